"""Every runtime knob, read from the environment (nested with ``__``, no prefix) and ``.env``.

The sections and their checks are the kit's: ``Settings`` derives from
``outbox_kit.runtime.settings.ServiceSettings`` and names this service. A section of your own is
a field of ``Settings`` whose type is a pydantic model, read from ``<SECTION>__<FIELD>``. Import
the kit's section models from the kit where you need them (``outbox_kit.runtime.settings``,
``outbox_kit.transports.settings``, ``outbox_kit.processor.settings``,
``outbox_kit.persistence.database``).
"""

from __future__ import annotations

import importlib
import warnings
from typing import ClassVar

from outbox_kit.runtime.settings import ServiceSettings

from .about import DESCRIPTION, SERVICE_NAME, SERVICE_SLUG


class Settings(ServiceSettings):
    """The root of every setting; the container builds one per process."""

    service_slug: ClassVar[str] = SERVICE_SLUG
    service_name: ClassVar[str] = SERVICE_NAME
    description: ClassVar[str] = DESCRIPTION


# The kit's names this module re-exported until kit 0.12.0, and where each lives: an old import
# still works, with a DeprecationWarning naming the new one.
MOVED = {
    "DatabaseSettings": "outbox_kit.persistence.database",
    "InboxSettings": "outbox_kit.processor.settings",
    "OutboxSettings": "outbox_kit.processor.settings",
    **dict.fromkeys(
        [
            "DEV_JWT_SECRET",
            "MIN_JWT_SECRET_BYTES",
            "ApiSettings",
            "ApplicationSettings",
            "AuthSettings",
            "Environment",
            "LoggingSettings",
            "ServiceSettings",
            "TelemetrySettings",
            "TracingBackend",
            "WorkerSettings",
        ],
        "outbox_kit.runtime.settings",
    ),
    **dict.fromkeys(
        ["EXAMPLE_SIGNING_SECRET", "MIN_PRODUCTION_KEY_LENGTH", "MessageBusSettings", "Transport"],
        "outbox_kit.transports.settings",
    ),
}


def __getattr__(name: str) -> object:
    if name not in MOVED:
        msg = f"module {__name__!r} has no attribute {name!r}"
        raise AttributeError(msg)
    warnings.warn(
        f"import {name} from {MOVED[name]}, not from {__name__} (re-exported until kit 0.12.0)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(MOVED[name]), name)


__all__ = ["Settings"]
