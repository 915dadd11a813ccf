"""Start-up warnings: configurations that run, but silently lose or duplicate messages.

Each is a Warning in the log, once, when a process starts (``startup_diagnostics``, called by
the app's lifespan and by ``outbox worker``), never a refusal: a development machine runs some
of them on purpose (unsigned messages in-process, say). Contradictions that can never work are
refused earlier, by the settings themselves.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from outbox_kit.persistence.unit_of_work import SqlUnitOfWorkFactory
from outbox_kit.persistence.writer import RelayWriter
from outbox_kit.runtime.settings import ServiceSettings

if TYPE_CHECKING:
    from outbox_kit.runtime.container import OutboxContainer

log = logging.getLogger(__name__)


def startup_diagnostics(container: OutboxContainer) -> None:
    """Warn about configurations that silently lose or duplicate messages."""
    warn_about_unsafe_configuration(container.settings(), container.units_of_work())


def warn_about_unsafe_configuration(settings: ServiceSettings, units: SqlUnitOfWorkFactory) -> None:
    """Warn about configurations that silently lose or duplicate messages."""
    bus = settings.message_bus
    if units.outbox_enabled != bus.outbox_enabled or not isinstance(units.writer, RelayWriter):
        log.warning(
            "The outbox is %s by settings but the composition root wires a unit of work with "
            "the outbox %s: domain and integration events would bypass it. Restore the "
            "container's units_of_work provider.",
            "ON" if bus.outbox_enabled else "OFF",
            "ON" if units.outbox_enabled else "OFF",
        )
    if bus.is_broker and bus.enable_inbox is False:
        log.warning(
            "MESSAGE_BUS__ENABLE_INBOX=false with the %s transport: broker redeliveries will run "
            "handlers twice unless every handler is idempotent on its own.",
            bus.transport,
        )
    warn_when_replays_would_turn_stale(settings)
    if bus.is_broker and not bus.signing_keys:
        log.warning(
            "No MESSAGE_BUS__SIGNING_KEYS: context headers are unsigned, so any publisher on the "
            "broker can claim any tenant or user. Set signing keys before production."
        )
    elif bus.is_broker and bus.allow_unsigned:
        log.warning(
            "MESSAGE_BUS__ALLOW_UNSIGNED=true: messages are signed, but unsigned ones are accepted "
            "too, so any publisher on the broker can still claim any tenant or user. Turn it off "
            "once every producer signs."
        )


def warn_when_replays_would_turn_stale(settings: ServiceSettings) -> None:
    """Consumers refuse a message older than ``INBOX__RETENTION_DAYS`` (its duplicate could no
    longer be recognised); a dead letter replayed late in its window must not be one."""
    inbox_days = settings.inbox.retention_days
    dead_letter_days = settings.outbox.dead_letter_window_days
    if inbox_days and (dead_letter_days == 0 or inbox_days <= dead_letter_days):
        kept = "forever" if dead_letter_days == 0 else f"{dead_letter_days} days"
        log.warning(
            "INBOX__RETENTION_DAYS=%s does not exceed how long outbox dead letters are kept (%s): "
            "a dead letter replayed late reaches its consumers as stale and is dead-lettered "
            "there. Keep the inbox longer than OUTBOX__DEAD_LETTER_RETENTION_DAYS (0 = "
            "OUTBOX__RETENTION_DAYS) plus the time a replay takes.",
            inbox_days,
            kept,
        )
