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
