"""Every runtime knob, read from the environment (nested with ``__``, no prefix) and ``.env``.

``Settings`` (``root``) is the one object a process builds; each section lives in a module of its
own, or in the framework's (the message bus and the database: the framework reads them). Every
name is re-exported here, so ``from <package>.settings import ...`` is the import.
"""

from outbox_kit.persistence.settings import DatabaseSettings
from outbox_kit.processor.settings import InboxSettings, OutboxSettings
from outbox_kit.runtime.settings import ApiSettings
from outbox_kit.transports.settings import (
    EXAMPLE_SIGNING_SECRET,
    MIN_PRODUCTION_KEY_LENGTH,
    MessageBusSettings,
    Transport,
)

from .auth import DEV_JWT_SECRET, MIN_JWT_SECRET_BYTES, AuthSettings
from .root import Settings
from .service import (
    ApplicationSettings,
    Environment,
    LoggingSettings,
    TelemetrySettings,
    TracingBackend,
    WorkerSettings,
)

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
    "Settings",
    "TelemetrySettings",
    "TracingBackend",
    "Transport",
    "WorkerSettings",
]
