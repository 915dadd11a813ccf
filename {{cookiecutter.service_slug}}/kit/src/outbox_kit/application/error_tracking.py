"""Error tracking (``SENTRY__DSN``, extra ``[sentry]``): unhandled errors and ERROR log records
sent to Sentry as events, each with the caller's tenant, user and correlation id, and nothing
secret (every event and breadcrumb goes through :class:`~outbox_kit.application.scrubbing.Scrubber`
first). The SDK is imported only when a DSN is set.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from outbox_kit.application.context import RequestContext, current_context
from outbox_kit.application.scrubbing import Scrubber

if TYPE_CHECKING:
    from sentry_sdk.integrations import Integration


def configure_error_tracking(
    *, dsn: str, environment: str, release: str | None, sample_rate: float, secrets: Iterable[str] = ()
) -> bool:
    """Start sending errors to Sentry when ``dsn`` is set (once per process); ``False`` when off.
    Every event and breadcrumb is scrubbed first: ``secrets`` (the process's own, by value), any
    credential by its shape, any value under a key that names a secret (:class:`Scrubber`)."""
    if not dsn:
        return False
    try:
        import sentry_sdk  # noqa: PLC0415 (optional dependency)
    except ImportError as missing:
        msg = "SENTRY__DSN needs the Sentry SDK: pip install '.[sentry]'"
        raise RuntimeError(msg) from missing
    scrubber = Scrubber(secrets)
    # The scrubbing is the kit's own, in the two hooks Sentry 2 and 3 both have (Sentry 3 has no
    # sentry_sdk.scrubber). Sentry's Event and Breadcrumb are TypedDicts of their own: cast.
    sentry_sdk.init(
        dsn=dsn,
        environment=environment,
        release=release or None,
        sample_rate=sample_rate,
        traces_sample_rate=None,  # traces are OpenTelemetry's (TELEMETRY__TRACING)
        before_send=cast("Any", partial(_reported, scrubber)),
        before_breadcrumb=cast("Any", scrubber.event),
        before_send_log=cast("Any", scrubber.event),  # none are sent (below); scrubbed if ever
        integrations=[_log_records_as_events()],
    )
    return True


def _log_records_as_events() -> Integration:
    """ERROR records become events and INFO ones their breadcrumbs, on Sentry 2 and 3: Sentry 3
    no longer enables this by default, and its ``level`` sends every record as a Sentry Log (past
    ``before_send``) where Sentry 2's meant breadcrumbs."""
    from sentry_sdk.integrations.logging import LoggingIntegration  # noqa: PLC0415

    if "breadcrumb_level" in inspect.signature(LoggingIntegration).parameters:  # Sentry 3
        return LoggingIntegration(level=None, event_level=logging.ERROR)
    return LoggingIntegration(level=logging.INFO, event_level=logging.ERROR)


def _reported(scrubber: Scrubber, event: dict[str, Any], hint: dict[str, Any]) -> dict[str, Any]:
    """What is sent of ``event``: with the caller's context, then scrubbed (the tags too)."""
    return scrubber.event(with_request_context(event, hint))


def with_request_context(event: dict[str, Any], hint: dict[str, Any]) -> dict[str, Any]:
    """The caller's tenant, user and correlation id on the event (the context of the request or
    of the message being handled when it happened)."""
    del hint
    context = current_context()
    tags = event.setdefault("tags", {})  # a request's own, set by tag_error_reports, come first
    tags.setdefault("correlation_id", context.correlation_id)
    if context.tenant_id:
        tags.setdefault("tenant_id", context.tenant_id)
    if context.user_id and not event.get("user"):
        event["user"] = {"id": context.user_id}
    return event


def tag_error_reports(context: RequestContext) -> None:
    """Put the caller on the error-tracking scope of the current request: Sentry's ASGI
    integration reports an unhandled error after the request context has ended."""
    sentry_sdk = sys.modules.get("sentry_sdk")
    if sentry_sdk is None or not sentry_sdk.get_client().is_active():
        return
    scope = sentry_sdk.get_isolation_scope()
    scope.set_tag("correlation_id", context.correlation_id)
    if context.tenant_id:
        scope.set_tag("tenant_id", context.tenant_id)
    if context.user_id:
        scope.set_user({"id": context.user_id})
