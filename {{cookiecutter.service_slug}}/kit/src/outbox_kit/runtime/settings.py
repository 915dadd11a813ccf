"""The HTTP entry points' settings (``API__*``): a module of their own, so reading the settings
never imports the HTTP server."""

from __future__ import annotations

from pydantic import BaseModel, Field


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
