"""Every runtime knob, read from the environment (nested with ``__``, no prefix) and ``.env``.

Defaults (polling 2 s, processing delay 5 s, lease 300 s, five retries,
backoff base 10 s, batch 100, retention 7 days). The embedded default is a SQLite file and the
in-process transport, so a fresh checkout runs with no server at all.

``MESSAGE_BUS__ENABLE_OUTBOX`` and ``MESSAGE_BUS__ENABLE_INBOX`` are tri-state: unset resolves ON
for a broker transport and OFF for the in-process one. The resolved values are exposed
as ``outbox_enabled`` / ``inbox_enabled``; code never reads the raw fields.
"""

from __future__ import annotations

import math
from typing import Self

from outbox_kit.persistence.settings import DatabaseSettings
from outbox_kit.processor.settings import InboxSettings, OutboxSettings
from outbox_kit.runtime.settings import ApiSettings
from outbox_kit.transports.settings import (
    EXAMPLE_SIGNING_SECRET,
    MIN_PRODUCTION_KEY_LENGTH,
    MessageBusSettings,
)
from pydantic import model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .auth import AuthSettings
from .service import (
    ApplicationSettings,
    Environment,
    LoggingSettings,
    TelemetrySettings,
    WorkerSettings,
)


class Settings(BaseSettings):
    """The root of every setting; build one per process in the container."""

    model_config = SettingsConfigDict(
        env_file=".env",
        env_file_encoding="utf-8",
        env_nested_delimiter="__",
        extra="ignore",
    )

    environment: Environment = Environment.DEVELOPMENT
    application: ApplicationSettings = ApplicationSettings()
    database: DatabaseSettings = DatabaseSettings()
    message_bus: MessageBusSettings = MessageBusSettings()
    outbox: OutboxSettings = OutboxSettings()
    inbox: InboxSettings = InboxSettings()
    auth: AuthSettings = AuthSettings()
    api: ApiSettings = ApiSettings()
    worker: WorkerSettings = WorkerSettings()
    logging: LoggingSettings = LoggingSettings()
    telemetry: TelemetrySettings = TelemetrySettings()

    @property
    def is_production(self) -> bool:
        return self.environment is Environment.PRODUCTION

    @property
    def liveness_timeout_seconds(self) -> float:
        """How long a processor loop may go without a turn before ``/livez`` fails. The longest
        cycle is the lease, or a batch whose every delivery runs handlers and hangs to its time
        limit: those run a pool's worth at a time (``source.py``), so ``ceil(batch / room)``
        rounds of ``OUTBOX__DELIVERY_TIMEOUT_SECONDS`` (600 s at the defaults: a worker merely
        busy with hung handlers must not be restarted for it). Between cycles a loop sleeps at
        most its idle interval; three of those leave room for a slow database."""
        outbox = self.outbox
        idle = max(outbox.polling_interval_seconds, outbox.idle_polling_interval_seconds)
        room = min(outbox.delivery_concurrency, self.database.pool_size)
        longest_cycle = max(
            outbox.lease_seconds, math.ceil(outbox.batch_size / room) * outbox.delivery_timeout_seconds
        )
        return self.worker.liveness_timeout_seconds or longest_cycle + 3 * idle

    @model_validator(mode="after")
    def _refuse_a_liveness_shorter_than_a_sleep(self) -> Self:
        """An idle loop sleeps up to its idle interval: a shorter liveness timeout would fail
        ``/livez`` on every idle worker and have the orchestrator restart it for nothing."""
        timeout, outbox = self.worker.liveness_timeout_seconds, self.outbox
        longest_sleep = max(outbox.polling_interval_seconds, outbox.idle_polling_interval_seconds)
        if timeout is not None and timeout <= longest_sleep:
            msg = (
                f"WORKER__LIVENESS_TIMEOUT_SECONDS ({timeout:g}) must be longer than the longest sleep "
                f"of a processor loop ({longest_sleep:g} s: OUTBOX__IDLE_POLLING_INTERVAL_SECONDS and "
                "OUTBOX__POLLING_INTERVAL_SECONDS)"
            )
            raise ValueError(msg)
        return self

    @model_validator(mode="after")
    def _refuse_a_publish_limit_longer_than_a_delivery(self) -> Self:
        """A publish is one part of a delivery, and its own limit must end it first: a publish
        timing out during a broker outage is an outage (the circuit breaker pauses delivery,
        nothing is charged), while the delivery's limit cutting it is charged to the row. An
        equal limit races the two timers and charged outages to rows."""
        publish, delivery = self.message_bus.publish_timeout_seconds, self.outbox.delivery_timeout_seconds
        if publish >= delivery:
            msg = (
                f"MESSAGE_BUS__PUBLISH_TIMEOUT_SECONDS ({publish:g}) must be below "
                f"OUTBOX__DELIVERY_TIMEOUT_SECONDS ({delivery:g}): a publish is part of a delivery, "
                "and a publish timing out in a broker outage must not be charged to the row"
            )
            raise ValueError(msg)
        return self

    @model_validator(mode="after")
    def _refuse_an_in_process_handler_limit_as_long_as_a_delivery(self) -> Self:
        """In-process, every consumer of an event runs inside the delivery that publishes it: a
        handler limit as long as the delivery's would let one hung consumer use the whole
        delivery, and the consumers after it would never run."""
        handler, delivery = self.message_bus.handler_timeout_seconds, self.outbox.delivery_timeout_seconds
        if not self.message_bus.is_broker and handler >= delivery:
            msg = (
                f"MESSAGE_BUS__HANDLER_TIMEOUT_SECONDS ({handler:g}) must be below "
                f"OUTBOX__DELIVERY_TIMEOUT_SECONDS ({delivery:g}) with the in-process transport: "
                "its consumers run inside a delivery"
            )
            raise ValueError(msg)
        return self

    @model_validator(mode="after")
    def _refuse_unsafe_combinations(self) -> Self:
        bus = self.message_bus
        if bus.is_broker and bus.enable_outbox is False:
            msg = (
                f"MESSAGE_BUS__ENABLE_OUTBOX=false is refused with the {bus.transport} transport: "
                "integration events would bypass the outbox and be lost on a crash"
            )
            raise ValueError(msg)
        if bus.signing_key_id and bus.signing_key_id not in bus.signing_keys:
            msg = f"MESSAGE_BUS__SIGNING_KEY_ID {bus.signing_key_id!r} is not in SIGNING_KEYS"
            raise ValueError(msg)
        if self.is_production:
            self.auth.refuse_in_production()
            if bus.is_broker and not bus.signing_keys and not bus.allow_unsigned:
                msg = (
                    "MESSAGE_BUS__SIGNING_KEYS must be set for a broker transport in production "
                    "(or set MESSAGE_BUS__ALLOW_UNSIGNED=true to accept unsigned context headers)"
                )
                raise ValueError(msg)
            weak = sorted(
                kid
                for kid, secret in bus.signing_keys.items()
                if secret.get_secret_value() == EXAMPLE_SIGNING_SECRET
                or len(secret.get_secret_value()) < MIN_PRODUCTION_KEY_LENGTH
            )
            if weak:
                msg = (
                    f"MESSAGE_BUS__SIGNING_KEYS {', '.join(weak)}: the example key or shorter than "
                    f"{MIN_PRODUCTION_KEY_LENGTH} characters is refused in production"
                )
                raise ValueError(msg)
        return self
