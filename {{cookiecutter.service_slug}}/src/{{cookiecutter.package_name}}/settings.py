"""Every runtime knob, read from the environment (nested with ``__``, no prefix) and ``.env``.

The sections and their checks are the kit's (``outbox_kit.runtime.settings``): this service's
``Settings`` names it, and is where a section of its own goes (a field whose type is a pydantic
model, read from ``<SECTION>__<FIELD>``). Every name is re-exported here, so
``from <package>.settings import ...`` is the import.
"""

from __future__ import annotations

from typing import ClassVar

from outbox_kit.persistence.database import DatabaseSettings
from outbox_kit.processor.settings import InboxSettings, OutboxSettings
from outbox_kit.runtime.settings import (
    DEV_JWT_SECRET,
    MIN_JWT_SECRET_BYTES,
    ApiSettings,
    ApplicationSettings,
    AuthSettings,
    Environment,
    LoggingSettings,
    ServiceSettings,
    TelemetrySettings,
    TracingBackend,
    WorkerSettings,
)
from outbox_kit.transports.settings import (
    EXAMPLE_SIGNING_SECRET,
    MIN_PRODUCTION_KEY_LENGTH,
    MessageBusSettings,
    Transport,
)

from .about import DESCRIPTION, SERVICE_NAME, SERVICE_SLUG


class Settings(ServiceSettings):
    """The root of every setting; the container builds one per process."""

    service_slug: ClassVar[str] = SERVICE_SLUG
    service_name: ClassVar[str] = SERVICE_NAME
    description: ClassVar[str] = DESCRIPTION


__all__ = [
    "DEV_JWT_SECRET",
    "EXAMPLE_SIGNING_SECRET",
    "MIN_JWT_SECRET_BYTES",
    "MIN_PRODUCTION_KEY_LENGTH",
    "ApiSettings",
    "ApplicationSettings",
    "AuthSettings",
    "DatabaseSettings",
    "Environment",
    "InboxSettings",
    "LoggingSettings",
    "MessageBusSettings",
    "OutboxSettings",
    "ServiceSettings",
    "Settings",
    "TelemetrySettings",
    "TracingBackend",
    "Transport",
    "WorkerSettings",
]
