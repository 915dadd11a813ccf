"""Where the service runs: its mode, identity, HTTP listener, logging and tracing (the database's
settings are the kit's own: ``outbox_kit.persistence.settings``)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field, field_validator

from ..about import SERVICE_SLUG


class Environment(StrEnum):
    """Development allows conveniences (dev tokens, default secrets); production refuses them."""

    DEVELOPMENT = "development"
    PRODUCTION = "production"


class ApplicationSettings(BaseModel):
    """Identity of the running service."""

    namespace: str = Field(default="", description="Prefix for broker names; the slug when empty")
    instance_id: str = Field(default="", description="Processor id in leases; host:pid when empty")

    @property
    def resolved_namespace(self) -> str:
        return self.namespace or SERVICE_SLUG


class ApiSettings(BaseModel):
    """Where `run` and `api` listen, the largest request body they read, the time limits of their
    HTTP server (the worker's probe server takes the same) and how long an ``Idempotency-Key``
    is remembered."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    max_body_bytes: int = Field(default=1_048_576, ge=1)
    idempotency_key_retention_hours: float = Field(
        default=24.0,
        ge=0,
        le=24 * 366,
        description="How long an Idempotency-Key answers its first answer; 0 keeps keys for ever",
    )
    # A request head (request line and headers) not complete this long after its first byte, or
    # after the connection opened, closes the connection (408 when a head was begun).
    header_read_timeout_seconds: float = Field(default=10.0, gt=0, le=3600)
    # A request body not fully received this long after the application starts reading it: 408,
    # connection closed (a client sending a byte now and then held a request for ever).
    body_read_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    # An idle kept-alive connection is closed after this long (uvicorn's timeout_keep_alive).
    keep_alive_timeout_seconds: int = Field(default=5, ge=1, le=3600)
    shutdown_timeout_seconds: float = Field(
        default=10.0, gt=0, description="After SIGTERM, requests still running this long are cancelled"
    )
    readiness_timeout_seconds: float = Field(
        default=2.0, gt=0, description="A /readyz check (database, bus) not answering this long fails"
    )


class WorkerSettings(BaseModel):
    """Where ``worker`` serves ``/livez``, ``/readyz`` and ``/metrics``, and when it is stalled.

    Without a port the worker serves nothing, so several workers can share a host; give each its
    own port (``WORKER__PORT`` or ``--port``) to scrape and probe it.
    """

    host: str = "127.0.0.1"
    port: int | None = Field(default=None, ge=0, le=65535)
    liveness_timeout_seconds: float | None = Field(
        default=None,
        gt=0,
        description="A processor loop silent this long fails /livez; unset = lease + 3 idle intervals",
    )

    @field_validator("port", "liveness_timeout_seconds", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        """``WORKER__PORT=`` (as ``.env.example`` has it) means no port, not an error."""
        return None if value == "" else value


class LoggingSettings(BaseModel):
    """Plain text for people, JSON lines for machines."""

    level: str = "INFO"
    json_format: bool = False


class TracingBackend(StrEnum):
    """``none``: no spans (nothing imported); ``otel``: OpenTelemetry, exported over OTLP."""

    NONE = "none"
    OTEL = "otel"


class TelemetrySettings(BaseModel):
    """Tracing (metrics are always on, at ``/metrics``). The OTLP endpoint, service name and
    sampling come from OpenTelemetry's own ``OTEL_*`` variables."""

    tracing: TracingBackend = TracingBackend.NONE
