"""Everything a bounded context may use from the kit, besides ``outbox_kit.domain``.

A context's domain layer imports only ``outbox_kit.domain`` (aggregates, events, errors:
the standard library only). Everything else a context needs is here, and nowhere else: the
architecture tests refuse an import of any other kit module from ``contexts/``, so
the rest (polling, leases, capture, transports, the concrete unit of work) can change without
breaking your code.

* messages: :class:`IntegrationEvent` (published to other services), :class:`InternalCommand`
  (deferred work of this service);
* the unit of work, as use cases and handlers see it (:class:`UnitOfWork`), as entry points drive
  it (:class:`UnitOfWorkFactory`), and as adapters are built from it (:class:`AdapterScope`,
  :class:`Repository` for aggregates);
* registration: :class:`Module` (what ``contexts/<name>/module.py`` returns; its ``source``, a
  :class:`ContextSource`, gives the context a database or schema of its own),
  :class:`HandlerRegistry`, :class:`UpcasterSpec`;
* the caller: :class:`RequestContext`, :func:`current_context`, and inside an integration-event
  handler :func:`current_delivery`;
* HTTP: the FastAPI dependencies :func:`authenticated`, :func:`require_role` and
  :func:`units_of_work`; for a create command, :func:`idempotency_key` (the ``Idempotency-Key``
  header), :func:`run_once` and :func:`idempotent_response` (a retried request runs once);
* tables: ``JSON_TYPE`` (JSON on SQLite, JSONB on PostgreSQL), :func:`upsert` (an atomic
  ``INSERT ... ON CONFLICT`` on either database: counters and create-unless-present)."""

from __future__ import annotations

from outbox_kit.application.context import RequestContext, current_context
from outbox_kit.application.handlers import ContextSource, Handler, HandlerRegistry, Module, UpcasterSpec
from outbox_kit.application.messages import IntegrationEvent, InternalCommand
from outbox_kit.application.unit_of_work import (
    Adapter,
    AdapterScope,
    TransactionalUnitOfWork,
    UnitOfWork,
    UnitOfWorkFactory,
)
from outbox_kit.consume.inbox import Delivery, current_delivery
from outbox_kit.persistence.idempotency import IdempotencyKey, IdempotencyKeyReusedError, run_once
from outbox_kit.persistence.repository import Repository
from outbox_kit.persistence.tables import JSON_TYPE, upsert
from outbox_kit.persistence.unit_of_work import CrossSourceError
from outbox_kit.runtime.errors import STORABLE_TEXT, ErrorOut, error_responses
from outbox_kit.runtime.http import (
    authenticated,
    idempotency_key,
    idempotent_response,
    require_role,
    units_of_work,
)

__all__ = [
    "JSON_TYPE",
    "STORABLE_TEXT",
    "Adapter",
    "AdapterScope",
    "ContextSource",
    "CrossSourceError",
    "Delivery",
    "ErrorOut",
    "Handler",
    "HandlerRegistry",
    "IdempotencyKey",
    "IdempotencyKeyReusedError",
    "IntegrationEvent",
    "InternalCommand",
    "Module",
    "Repository",
    "RequestContext",
    "TransactionalUnitOfWork",
    "UnitOfWork",
    "UnitOfWorkFactory",
    "UpcasterSpec",
    "authenticated",
    "current_context",
    "current_delivery",
    "error_responses",
    "idempotency_key",
    "idempotent_response",
    "require_role",
    "run_once",
    "units_of_work",
    "upsert",
]
