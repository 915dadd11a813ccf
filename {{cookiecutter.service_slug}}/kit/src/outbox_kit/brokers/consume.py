"""Consuming goes through one wrapper per message, whatever the transport, with a manual ack
policy (FastStream's defaults drop or loop messages differently per broker: RabbitMQ, NATS and
Redis reject a failed message, which JetStream never redelivers, and Kafka commits before the
handler runs):

* a message that cannot be trusted or read (bad/missing signature, malformed or oversized header,
  unknown event) is dead-lettered with the reason at once and never retried;
* a duplicate is acknowledged and skipped (the inbox said so);
* a handler failure (a run past ``MESSAGE_BUS__HANDLER_TIMEOUT_SECONDS`` is one, see ``holding``)
  is retried by the broker (the transport's retry step, with a delay) until
  ``MESSAGE_BUS__MAX_DELIVERY_ATTEMPTS``, then published to the consumer's dead-letter
  destination with ``x-error`` and ``x-attempts`` and acknowledged: never lost, never looping;
* a failure because the database is unreachable is not the message's fault: the message is held
  and run again, uncharged, for up to ``MESSAGE_BUS__DATABASE_OUTAGE_HOLD_SECONDS``;
* a message delivered more times than the limit without a recorded failure (the process died
  while handling it) is dead-lettered by a guard at the start;
* a message whose delivery counters cannot be read is rejected (``malformed_header``): without
  a count its retries could not be bounded;
* an error the wrapper itself did not expect (a bug, an ack or a retry step that failed) still
  ends the message, never leaving it unacknowledged: it is handled like a handler failure
  (redelivered while attempts remain, dead-lettered with the error at the limit, or at once when
  the attempt is unknown). A copy is bounded and sized against the transport's limit before it
  is published, and one refused all the same is sent again minimal (transports/copies.py): a
  message's size never reaches the connection. If the dead-letter copy is refused too (its
  destination is gone, the broker is down), the message goes back through
  the transport's retry step (counted, so the guard above dead-letters it once the destination
  takes copies again); if even that fails the connection is gone, and the broker redelivers on
  its own (a closed channel requeues, JetStream's ``ack_wait``, the Redis reclaimer).
"""

from __future__ import annotations

import logging
from typing import Any

from ..application.handler_types import Consumer
from ..inbox.pipeline import ConsumePipeline
from ..kernel.metrics import RelayMetrics
from ..messaging.rejections import RejectedMessageError
from ..messaging.settings import MessageBusSettings
from .holding import consume_through_database_outages, keep_alive
from .transports.ports import Delivery

log = logging.getLogger(__name__)
CRASH_GUARD_ERROR = "attempts exhausted without a recorded failure (crash or timeout)"
HANDLER_FAILED = "handler_failed"
INTERNAL = "internal_error"  # the reason tag of an error in this wrapper, not in the handler
UNKNOWN_ATTEMPT = 0  # x-attempts of a message whose counters could not be read


class ConsumeWrapper:
    """Runs each received message through the consume pipeline and ends it, whatever happens."""

    def __init__(
        self, *, settings: MessageBusSettings, pipeline: ConsumePipeline, metrics: RelayMetrics
    ) -> None:
        self._settings = settings
        self._pipeline = pipeline
        self._metrics = metrics

    def handler_for(self, consumer: Consumer[Any]) -> Any:  # noqa: ANN401 (what a transport subscribes)
        async def handle(delivery: Delivery) -> None:
            attempt: int | None = None
            try:
                attempt = await delivery.attempt()
                await self._handle(consumer, delivery, attempt)
            except RejectedMessageError as rejected:  # the counters were unreadable
                self._metrics.inbox_rejected.labels(consumer.name, rejected.reason).inc()
                await self._end(consumer, delivery, rejected, attempt)
            except Exception as error:  # noqa: BLE001 (the last resort: see the module)
                await self._end(consumer, delivery, error, attempt)

        return handle

    async def _handle(self, consumer: Consumer[Any], delivery: Delivery, attempt: int) -> None:
        if attempt > self._settings.max_delivery_attempts:
            await delivery.dead_letter(CRASH_GUARD_ERROR, attempt)
            self._metrics.inbox_rejected.labels(consumer.name, "attempts_exhausted").inc()
            self._metrics.inbox_dead_letters.labels(consumer.name, "crash_guard").inc()
            log.error(
                "%s: message %s dead-lettered: %s", consumer.name, delivery.message_id, CRASH_GUARD_ERROR
            )
            return
        try:
            async with keep_alive(delivery):
                await consume_through_database_outages(
                    self._pipeline,
                    self._metrics,
                    self._settings.database_outage_hold_seconds,
                    consumer,
                    delivery,
                    handler_timeout_seconds=self._settings.handler_timeout_seconds,
                )
        except RejectedMessageError as rejected:
            await self._dead_letter_rejected(consumer, delivery, rejected, attempt)
            return
        except Exception as error:  # noqa: BLE001 (the handler's failure, retried or dead-lettered)
            await self._fail(consumer, delivery, error, attempt, reason=HANDLER_FAILED)
            return
        await delivery.ack()

    async def _dead_letter_rejected(
        self, consumer: Consumer[Any], delivery: Delivery, rejected: RejectedMessageError, attempt: int
    ) -> None:
        await delivery.dead_letter(f"rejected: {rejected}", attempt)
        self._metrics.inbox_dead_letters.labels(consumer.name, rejected.reason).inc()
        log.error(
            "%s: message %s rejected and dead-lettered: %s", consumer.name, delivery.message_id, rejected
        )

    async def _fail(
        self, consumer: Consumer[Any], delivery: Delivery, error: Exception, attempt: int, *, reason: str
    ) -> None:
        """Redeliver while attempts remain; at the limit, dead-letter with the error."""
        limit = self._settings.max_delivery_attempts
        if attempt >= limit:
            await self._dead_letter_failure(consumer, delivery, error, attempt, reason=reason)
            return
        log.warning(
            "%s: message %s failed attempt %s/%s, redelivering: %s: %s",
            consumer.name,
            delivery.message_id,
            attempt,
            limit,
            type(error).__name__,
            error,
        )
        await delivery.retry(attempt)

    async def _dead_letter_failure(
        self, consumer: Consumer[Any], delivery: Delivery, error: Exception, attempt: int, *, reason: str
    ) -> None:
        described = f"{type(error).__name__}: {error}"
        await delivery.dead_letter(
            described if reason == HANDLER_FAILED else f"{reason}: {described}", attempt
        )
        self._metrics.inbox_dead_letters.labels(consumer.name, reason).inc()
        log.error(
            "%s: message %s dead-lettered after %s attempts: %s",
            consumer.name,
            delivery.message_id,
            attempt or "unknown",
            described,
            exc_info=error,
        )

    async def _end(
        self, consumer: Consumer[Any], delivery: Delivery, error: Exception, attempt: int | None
    ) -> None:
        """End a message the normal path could not: a rejection before the attempt was known, or
        an error the wrapper did not expect (see the module). Never raises. An unknown attempt
        is written as ``x-attempts: 0``."""
        try:
            if isinstance(error, RejectedMessageError):
                await self._dead_letter_rejected(consumer, delivery, error, attempt or UNKNOWN_ATTEMPT)
            elif attempt is None:  # no count, so no bounded retry: dead-letter at once
                await self._dead_letter_failure(consumer, delivery, error, UNKNOWN_ATTEMPT, reason=INTERNAL)
            else:
                await self._fail(consumer, delivery, error, attempt, reason=INTERNAL)
        except Exception:  # the dead-letter copy itself failed (logged with its traceback)
            log.exception(
                "%s: message %s could not be dead-lettered after %s: %s; handing it back to the broker",
                consumer.name,
                delivery.message_id,
                type(error).__name__,
                error,
            )
            await self._hand_back(consumer, delivery, attempt)

    async def _hand_back(self, consumer: Consumer[Any], delivery: Delivery, attempt: int | None) -> None:
        """The transport's retry step, so the message is not left unacknowledged (on RabbitMQ that
        would also hold one of the consumer's prefetch slots for good): it comes back counted,
        and the crash guard dead-letters it once the destination takes copies again. If even this
        fails the connection is gone, and the broker redelivers on its own."""
        try:
            await delivery.retry(attempt or 1)
        except Exception:
            log.exception(
                "%s: message %s left to the broker's redelivery", consumer.name, delivery.message_id
            )
