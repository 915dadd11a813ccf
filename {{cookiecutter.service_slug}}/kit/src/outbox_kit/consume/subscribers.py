"""The wrapper around every subscriber: attempts, failures, and holding on through a database
outage.

**Keeping a message** while its handler works, and through a database outage. While a handler
runs, ``keep_alive`` touches the message so the broker does not hand it to
another consumer (NATS ``in_progress``, Redis ``XCLAIM JUSTID``). A database outage says nothing
about the message: charging it an attempt would dead-letter every message in flight during a
failover, so it is held and run again, uncharged, with a capped backoff for up to
``MESSAGE_BUS__DATABASE_OUTAGE_HOLD_SECONDS``; a longer outage falls through to the normal,
charged redelivery. Each run rolls back in full, so running again is exactly a redelivery.

Consuming goes through one wrapper per message, whatever the transport, with a manual ack
policy (FastStream's defaults drop or loop messages differently per broker: RabbitMQ, NATS and
Redis reject a failed message, which JetStream never redelivers, and Kafka commits before the
handler runs):

* a message that cannot be trusted or read (bad/missing signature, malformed or oversized header,
  unknown event) is dead-lettered with the reason at once and never retried;
* a duplicate is acknowledged and skipped (the inbox said so);
* a handler failure (a handler past ``MESSAGE_BUS__HANDLER_TIMEOUT_SECONDS`` is one: the limit
  covers the handler, never the commit, see ``consume.inbox``) is retried by the broker (the
  transport's retry step, with a delay) until ``MESSAGE_BUS__MAX_DELIVERY_ATTEMPTS``, then
  published to the consumer's dead-letter destination with ``x-error`` and ``x-attempts`` and
  acknowledged: never lost, never looping;
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
  takes copies again, with the failure this process recorded: :class:`RefusedCopies`; past the
  limit no redelivery runs the handler again, and none is ever the last: no transport caps
  redeliveries below the wrapper); if even that fails the connection is gone, and the broker
  redelivers on its own (a closed channel requeues, JetStream's ``ack_wait``, the Redis
  reclaimer).

Every line logged about a message, from its ``received`` to its ``processed``, carries the
correlation id and tenant its headers claim (read, not yet verified: for the logs only), so a
worker's lines can be followed from the API's; FastStream's own per-message lines, logged
outside it with the worker's context, are kept out (``transports.base``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from outbox_kit.application.handlers import Consumer
from outbox_kit.application.metrics import RelayMetrics
from outbox_kit.consume.inbox import ConsumePipeline
from outbox_kit.persistence.database import is_database_outage
from outbox_kit.transports.base import FastStreamTransport
from outbox_kit.transports.envelope import RejectedMessageError, claimed_context
from outbox_kit.transports.received import BrokerDelivery, DeliveryHandler
from outbox_kit.transports.settings import MessageBusSettings

log = logging.getLogger(__name__)
OUTAGE_FIRST_PAUSE_SECONDS = 0.2
OUTAGE_MAX_PAUSE_SECONDS = 5.0


@asynccontextmanager
async def keep_alive(delivery: BrokerDelivery) -> AsyncIterator[None]:
    """While the block runs, ``touch`` the message so the broker does not hand it to another
    consumer (NATS ``in_progress``, Redis ``XCLAIM JUSTID``); a no-op where not needed.

    The heartbeat is stopped by an event, not by cancelling it: a broker client may swallow a
    cancellation that lands inside its command (redis-py was seen to), and a heartbeat awaited
    after such a cancel beat on for ever while the handler, done, waited for it: the consumer
    stalled with its messages pending. A touch that hangs is abandoned after one interval.
    """
    interval = delivery.heartbeat_seconds
    if interval is None:
        yield
        return
    stopped = asyncio.Event()

    async def beat() -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopped.wait(), timeout=interval)
                return
            try:
                await delivery.touch()
            except Exception:
                log.warning("could not extend message %s", delivery.message_id, exc_info=True)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        stopped.set()
        _, hanging = await asyncio.wait({task}, timeout=max(interval, 1.0))
        for touch in hanging:
            touch.cancel()  # not awaited: it must not hold the message's outcome


async def consume_through_database_outages(
    pipeline: ConsumePipeline,
    metrics: RelayMetrics,
    hold_seconds: float,
    consumer: Consumer[Any],
    delivery: BrokerDelivery,
) -> None:
    """Run the pipeline; while the database is unreachable, hold the message and run it again.

    A database outage says nothing about the message: charging it an attempt would
    dead-letter every message in flight during a failover. The message is held (kept alive
    at the broker) with a capped backoff for up to ``DATABASE_OUTAGE_HOLD_SECONDS``; a longer
    outage falls through to the normal, charged redelivery. Each run rolls back in full, so
    running again is exactly a redelivery.

    Each run's handler is limited to ``MESSAGE_BUS__HANDLER_TIMEOUT_SECONDS`` (the pipeline's, see
    ``consume.inbox``): one that hangs fails its run like any other failure (redelivered, then
    dead-lettered), so it cannot stop its consumer (or, on Kafka, its partition)."""
    deadline = time.monotonic() + hold_seconds
    pause = OUTAGE_FIRST_PAUSE_SECONDS
    while True:
        try:
            await pipeline.consume(consumer, delivery.headers, delivery.body)
        except Exception as error:
            if not is_database_outage(error) or time.monotonic() + pause > deadline:
                raise
            metrics.inbox_outage_holds.labels(consumer.name).inc()
            log.warning(
                "%s: database unreachable while handling %s; holding it %.1fs (not charged): %s",
                consumer.name,
                delivery.message_id,
                pause,
                error,
            )
            await asyncio.sleep(pause)
            pause = min(pause * 2, OUTAGE_MAX_PAUSE_SECONDS)
        else:
            return


CRASH_GUARD_ERROR = "attempts exhausted without a recorded failure (crash or timeout)"
HANDLER_FAILED = "handler_failed"
INTERNAL = "internal_error"  # the reason tag of an error in this wrapper, not in the handler
UNKNOWN_ATTEMPT = 0  # x-attempts of a message whose counters could not be read


@dataclass(frozen=True)
class Failure:
    """Why a message is dead-lettered: its ``x-error`` and the reason tag its metric counts."""

    error: str
    reason: str


REMEMBERED_REFUSALS = 1024


class RefusedCopies:
    """The failures whose dead-letter copy was refused, by consumer and message id (the latest
    :data:`REMEMBERED_REFUSALS`), so that the redelivery which dead-letters the message past its
    limit (the crash guard) carries the failure, not "no recorded failure". This process's memory
    only: a redelivery another process takes is dead-lettered with the crash guard's reason."""

    def __init__(self, size: int = REMEMBERED_REFUSALS) -> None:
        self._size = size
        self._failures: OrderedDict[tuple[str, str], Failure] = OrderedDict()

    def remember(self, key: tuple[str, str], failure: Failure) -> None:
        """Keep the first failure recorded for ``key`` (a later one is the refusal itself)."""
        if key in self._failures:
            return
        self._failures[key] = failure
        while len(self._failures) > self._size:
            self._failures.popitem(last=False)

    def recall(self, key: tuple[str, str]) -> Failure | None:
        return self._failures.get(key)

    def forget(self, key: tuple[str, str]) -> None:
        self._failures.pop(key, None)


class ConsumeWrapper:
    """Runs each received message through the consume pipeline and ends it, whatever happens."""

    def __init__(
        self, *, settings: MessageBusSettings, pipeline: ConsumePipeline, metrics: RelayMetrics
    ) -> None:
        self._settings = settings
        self._pipeline = pipeline
        self._metrics = metrics
        self._refused = RefusedCopies()

    def subscribe_all(self, transport: FastStreamTransport, consumers: Sequence[Consumer[Any]]) -> None:
        """The way in: every consumer's messages reach its handler through this wrapper."""
        for consumer in consumers:
            transport.subscribe(consumer, self.handler_for(consumer))

    def handler_for(self, consumer: Consumer[Any]) -> DeliveryHandler:
        async def handle(delivery: BrokerDelivery) -> None:
            # Every line about the message carries its correlation id and tenant (see the module).
            with claimed_context(delivery.headers):
                log.info("%s: received message %s", consumer.name, delivery.message_id)
                if await self._handle_to_the_end(consumer, delivery):
                    log.info("%s: processed message %s", consumer.name, delivery.message_id)
                else:  # the line before this one says what became of it
                    log.info("%s: done with message %s after a failure", consumer.name, delivery.message_id)

        return handle

    async def _handle_to_the_end(self, consumer: Consumer[Any], delivery: BrokerDelivery) -> bool:
        """True when the pipeline took the message (processed, or a duplicate skipped); False
        when it failed and was ended otherwise (retried, handed back or dead-lettered)."""
        attempt: int | None = None
        try:
            attempt = await delivery.attempt()
            return await self._handle(consumer, delivery, attempt)
        except RejectedMessageError as rejected:  # the counters were unreadable
            self._metrics.inbox_rejected.labels(consumer.name, rejected.reason).inc()
            await self._end(consumer, delivery, rejected, attempt)
            return False
        except Exception as error:  # noqa: BLE001 (the last resort: see the module)
            await self._end(consumer, delivery, error, attempt)
            return False

    async def _handle(self, consumer: Consumer[Any], delivery: BrokerDelivery, attempt: int) -> bool:
        """True when the pipeline took the message and it was acknowledged; False when it was
        retried, handed back or dead-lettered here."""
        if attempt > self._settings.max_delivery_attempts:
            recorded = self._refused.recall((consumer.name, delivery.message_id))
            if recorded is not None:  # handed back earlier: its copy was refused, not the handler run
                await self._copy(consumer, delivery, recorded, attempt)
                self._metrics.inbox_dead_letters.labels(consumer.name, recorded.reason).inc()
                log.error(
                    "%s: message %s dead-lettered after %s attempts: %s",
                    consumer.name,
                    delivery.message_id,
                    attempt,
                    recorded.error,
                )
                return False
            await delivery.dead_letter(CRASH_GUARD_ERROR, attempt)
            self._metrics.inbox_rejected.labels(consumer.name, "attempts_exhausted").inc()
            self._metrics.inbox_dead_letters.labels(consumer.name, "crash_guard").inc()
            log.error(
                "%s: message %s dead-lettered: %s", consumer.name, delivery.message_id, CRASH_GUARD_ERROR
            )
            return False
        try:
            async with keep_alive(delivery):
                await consume_through_database_outages(
                    self._pipeline,
                    self._metrics,
                    self._settings.database_outage_hold_seconds,
                    consumer,
                    delivery,
                )
        except RejectedMessageError as rejected:
            await self._dead_letter_rejected(consumer, delivery, rejected, attempt)
            return False
        except Exception as error:  # noqa: BLE001 (the handler's failure, retried or dead-lettered)
            await self._fail(consumer, delivery, error, attempt, reason=HANDLER_FAILED)
            return False
        await delivery.ack()
        return True

    async def _dead_letter_rejected(
        self, consumer: Consumer[Any], delivery: BrokerDelivery, rejected: RejectedMessageError, attempt: int
    ) -> None:
        await self._copy(consumer, delivery, Failure(f"rejected: {rejected}", rejected.reason), attempt)
        self._metrics.inbox_dead_letters.labels(consumer.name, rejected.reason).inc()
        log.error(
            "%s: message %s rejected and dead-lettered: %s", consumer.name, delivery.message_id, rejected
        )

    async def _fail(
        self,
        consumer: Consumer[Any],
        delivery: BrokerDelivery,
        error: Exception,
        attempt: int,
        *,
        reason: str,
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
        self,
        consumer: Consumer[Any],
        delivery: BrokerDelivery,
        error: Exception,
        attempt: int,
        *,
        reason: str,
    ) -> None:
        described = f"{type(error).__name__}: {error}"
        failure = Failure(described if reason == HANDLER_FAILED else f"{reason}: {described}", reason)
        await self._copy(consumer, delivery, failure, attempt)
        self._metrics.inbox_dead_letters.labels(consumer.name, reason).inc()
        log.error(
            "%s: message %s dead-lettered after %s attempts: %s",
            consumer.name,
            delivery.message_id,
            attempt or "unknown",
            described,
            exc_info=error,
        )

    async def _copy(
        self, consumer: Consumer[Any], delivery: BrokerDelivery, failure: Failure, attempt: int
    ) -> None:
        """The transport's dead-letter step; a refused copy's failure is remembered for the
        redelivery that tries again (see :class:`RefusedCopies`)."""
        key = (consumer.name, delivery.message_id)
        try:
            await delivery.dead_letter(failure.error, attempt)
        except Exception:
            self._refused.remember(key, failure)
            raise
        self._refused.forget(key)

    async def _end(
        self, consumer: Consumer[Any], delivery: BrokerDelivery, error: Exception, attempt: int | None
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

    async def _hand_back(
        self, consumer: Consumer[Any], delivery: BrokerDelivery, attempt: int | None
    ) -> None:
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
