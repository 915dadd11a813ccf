"""The inbox: decode, verify, deduplicate and handle a received message in one transaction.

**What a consumer refuses** before its handler runs: a message older than the inbox remembers
(``stale``), a body that is not a readable JSON object, an event no class answers to, or an event
the consumer does not take. Each refusal is a ``RejectedMessageError`` with its reason tag: the
transport dead-letters the message at once and never retries it.

**The one consume pipeline** every integration-event handler runs through (the handler reads
its message id, event name and consumer with ``current_delivery()``):

verify -> restore context -> open a unit of work -> insert the inbox row ``(message_id,
consumer)`` in it -> run the handler -> commit handler writes, inbox row and any new outbox rows
together -> acknowledge.

* A message whose signature, headers or payload cannot be trusted raises
  :class:`RejectedMessageError` before anything is restored: the transport dead-letters it with
  the reason and never retries it.
* Freshness: the inbox forgets a message ``INBOX__RETENTION_DAYS`` after it was received, so a
  copy arriving later than that could no longer be recognised as a duplicate (a captured message
  replayed after the purge ran its handler again). With the inbox on, a message whose signed
  ``x-occurred-on`` is older than the retention is rejected as ``stale``: an inbox row is
  received no earlier than its message occurred, so every message younger than the retention
  still finds its row. This holds only if inbox retention exceeds how late a message can
  legitimately arrive (outbox dead-letter retention plus the time to replay; a start-up
  Warning names a configuration that breaks it). ``0`` keeps inbox rows for ever: no limit.
* The inbox row is written by one ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` in the
  handler's transaction. On PostgreSQL it comes first (one round trip; a lookup and an ORM insert
  at commit were two): a copy consumed at the same moment waits on the row's key, and when the
  first commits the copy's insert does nothing (a duplicate, its handler never runs); when it
  rolls back, the copy inserts and runs. On SQLite a lookup comes first and the insert last,
  after the handler: any write there takes the database's one write lock, which a slow handler
  would otherwise hold; a copy that committed meanwhile makes the insert do nothing, and this
  run rolls back as a duplicate.
* A duplicate (already in the inbox, or a racing consumer whose inbox row committed first) is
  reported as ``DUPLICATE``: acknowledge and skip. Dedup is on
  the message id, but the inbox row also keeps the SHA-256 of the signed body: a message under a
  processed id whose body differs is not a copy (a producer reusing ids, or a bug upstream), and
  skipping it would lose it silently. It raises :class:`RejectedMessageError`
  (``conflicting_duplicate``) and is dead-lettered with that reason, for a person to look at.
* A handler failure rolls everything back, including the staged inbox row, so the redelivery is
  not mistaken for a duplicate; the exception propagates and the transport redelivers (bounded)
  then dead-letters.

The handler runs under the runtime guard: it must not commit; the pipeline does.

The handler's time limit (``MESSAGE_BUS__HANDLER_TIMEOUT_SECONDS``) covers the handler, never the
commit: past it the handler is cancelled, its unit of work rolls back and the run fails with
``TimeLimitExceededError`` (redelivered, then dead-lettered). The commit, and the in-process
dispatch of the domain events it wrote (under the delivery's own limits), run unlimited by it: a
message whose inbox row committed is never failed, so never dead-lettered, by a limit.

Batches (PostgreSQL). Messages of one consumer that are ready at the same moment
(``consume.batch``) share one transaction, at most ``MESSAGE_BUS__CONSUME_BATCH_SIZE`` of them
(and at most ``MESSAGE_BUS__CONSUME_CONCURRENCY`` such transactions of a consumer at once):

* one statement writes their inbox rows, in message id order (two batches that share messages
  lock them in the same order, so they never deadlock); the messages already there are settled
  as duplicates (or ``conflicting_duplicate``) as above;
* each other message's handler runs in a unit of work of its own on that transaction, with its
  own context restored and its own time limit, and what it decided is written there (its outbox
  rows carry its context); then one COMMIT, and each message is acknowledged by its own task;
* a handler that fails rolls the transaction back: that message alone fails (redelivered or
  dead-lettered, as above) and the others run again without it, so one poison message never
  costs its neighbours an attempt; an unreachable database fails them all, uncharged (the
  consume wrapper holds them); a failure of none in particular (the receipts, the commit: a
  deadlock with another writer, say) runs each alone, in a transaction of its own;
* a second copy of a message in the same batch waits for the next round, where it is a duplicate;
* each message's consume span covers its handler; the commit is the batch's.

A message that arrives alone runs at once, alone. On SQLite every message has a transaction of
its own (its single writer gains nothing from a batch)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from typing import Any, cast

import sqlalchemy as sa
from sqlmodel.ext.asyncio.session import AsyncSession

from outbox_kit.application.clock import Clock, time_limit
from outbox_kit.application.context import current_context, restored
from outbox_kit.application.handlers import Consumer, handler_name
from outbox_kit.application.messages import MalformedPayloadError, MessageRegistry, UnknownMessageError
from outbox_kit.application.metrics import RelayMetrics
from outbox_kit.application.tracing import NoTracing, Span, SpanKind, Tracing
from outbox_kit.consume.batch import Batches, Submitted
from outbox_kit.domain import Message
from outbox_kit.persistence.database import is_database_outage
from outbox_kit.persistence.save_guard import handler_scope
from outbox_kit.persistence.tables import INBOX_TABLE, upsert
from outbox_kit.persistence.unit_of_work import SharedTransaction, SqlUnitOfWork, SqlUnitOfWorkFactory, Staged
from outbox_kit.transports.envelope import (
    MESSAGE_AUTHENTICATION,
    Envelope,
    RejectedMessageError,
    Rejection,
    Signer,
    read_envelope,
)


@dataclass(frozen=True)
class Delivery:
    """The message a consumer handler is running for."""

    message_id: str
    event_name: str
    consumer: str


_delivery: ContextVar[Delivery | None] = ContextVar("delivery", default=None)


def current_delivery() -> Delivery:
    """The delivery being consumed (raises outside a consumer handler)."""
    delivery = _delivery.get()
    if delivery is None:
        msg = "current_delivery() is only available inside an integration-event handler"
        raise LookupError(msg)
    return delivery


@contextmanager
def delivering(delivery: Delivery) -> Iterator[None]:
    token = _delivery.set(delivery)
    try:
        yield
    finally:
        _delivery.reset(token)


def refuse_stale(envelope: Envelope, now: datetime, max_age: timedelta | None) -> None:
    """Reject a message older than the inbox remembers (see the module docstring)."""
    if max_age is None:
        return
    age = now - envelope.occurred_on
    if age > max_age:
        detail = (
            f"x-occurred-on {envelope.occurred_on.isoformat()} is {age.days} days old, older than "
            f"INBOX__RETENTION_DAYS ({max_age.days}): a duplicate could no longer be recognised"
        )
        raise RejectedMessageError(Rejection.STALE, detail)


def decode(registry: MessageRegistry, consumer: Consumer[Any], event_name: str, body: bytes) -> Message:
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, an int past
        # Python's digit limit (ValueError), or nesting deeper than the recursion limit
        detail = f"the body is not readable JSON: {type(error).__name__}: {error}"
        raise RejectedMessageError(Rejection.MALFORMED_BODY, detail) from error
    if not isinstance(payload, dict):
        raise RejectedMessageError(Rejection.MALFORMED_BODY, "the body is not a JSON object")
    try:
        message = registry.load(event_name, payload)
    except UnknownMessageError as error:
        raise RejectedMessageError(Rejection.UNKNOWN_EVENT, str(error)) from error
    except MalformedPayloadError as error:
        raise RejectedMessageError(Rejection.MALFORMED_BODY, str(error)) from error
    if not isinstance(message, consumer.event_type):
        detail = f"{event_name} is not consumed by {consumer.name}"
        raise RejectedMessageError(Rejection.UNEXPECTED_EVENT, detail)
    return cast("Message", message)


log = logging.getLogger(__name__)
INBOX = INBOX_TABLE
RECEIPT_ATTEMPTS = 2

# A batch's inbox rows, one statement whatever the batch's size (PostgreSQL only: batches run
# there), inserted in message id order so two batches that share messages lock them in the same
# order and never deadlock on each other's receipts.
BATCH_RECEIPT = sa.text(
    f"INSERT INTO {INBOX.name}"  # noqa: S608 (a constant table name, every value bound)
    " (message_id, consumer, event_name, tenant_id, correlation_id, received_on, body_digest)"
    " SELECT m, :consumer, e, t, c, :received_on, d FROM unnest("
    "CAST(:message_ids AS VARCHAR[]), CAST(:event_names AS VARCHAR[]), CAST(:tenant_ids AS VARCHAR[]),"
    " CAST(:correlation_ids AS VARCHAR[]), CAST(:digests AS VARCHAR[])) AS received(m, e, t, c, d)"
    " ORDER BY m ON CONFLICT (message_id, consumer) DO NOTHING RETURNING message_id"
).bindparams(sa.bindparam("received_on", type_=sa.DateTime(timezone=True)))


class ConsumeOutcome(Enum):
    CONSUMED = "consumed"
    DUPLICATE = "duplicate"


@dataclass(frozen=True)
class Read:
    """A submitted message, verified and decoded, with the digest its inbox row keeps."""

    item: Submitted[ConsumeOutcome]
    envelope: Envelope
    message: Message
    digest: str


class ConsumePipeline:
    """Runs consumers with verification, context restore and inbox deduplication."""

    def __init__(
        self,
        *,
        units: Callable[[str], SqlUnitOfWorkFactory],
        registry: MessageRegistry,
        signer: Signer,
        inbox_enabled: bool,
        metrics: RelayMetrics,
        clock: Clock,
        handler_timeout_seconds: float,
        inbox_retention_days: int = 0,
        max_header_bytes: int = 4096,
        tracing: Tracing | None = None,
        batch_size: int = 1,
        batch_concurrency: int = 1,
    ) -> None:
        self._max_age = (
            timedelta(days=inbox_retention_days) if inbox_enabled and inbox_retention_days else None
        )
        self._max_header_bytes = max_header_bytes
        self._handler_timeout = handler_timeout_seconds
        self._tracing: Tracing = tracing or NoTracing()
        self._units = units
        self._registry = registry
        self._signer = signer
        self._inbox = inbox_enabled
        self._metrics = metrics
        self._clock = clock
        self._receipts: dict[str, sa.Executable] = {}  # per dialect, built on first use
        self._batch_size = batch_size
        self._batch_concurrency = batch_concurrency
        self._batches: dict[str, Batches[ConsumeOutcome]] = {}  # per consumer

    async def consume(
        self, consumer: Consumer[Any], headers: Mapping[str, object], body: bytes
    ) -> ConsumeOutcome:
        """Process one message for one consumer (see the module docstring). On PostgreSQL, with
        other messages of the consumer ready at the same moment, in one transaction with them
        (see "Batches" in the module docstring)."""
        if self._batch_size == 1 or not self._units(consumer.name).database.is_postgresql:
            return await self.consume_one(consumer, headers, body)
        batches = self._batches.get(consumer.name)
        if batches is None:
            run = functools.partial(self._consume_batch, consumer)
            batches = self._batches[consumer.name] = Batches(run, self._batch_size, self._batch_concurrency)
        return await batches.submit(headers, body)

    async def consume_one(
        self, consumer: Consumer[Any], headers: Mapping[str, object], body: bytes
    ) -> ConsumeOutcome:
        """Process one message in a transaction of its own."""
        envelope, message = self._read(consumer, headers, body)
        with self._consuming(consumer, envelope) as span:
            try:
                outcome = await self._run(consumer, message, envelope)
            except Exception as error:
                self._count_failure(consumer, error)
                raise
            span.set_attribute("inbox.outcome", outcome.value)
        self._count(consumer, envelope, outcome)
        return outcome

    def _read(
        self, consumer: Consumer[Any], headers: Mapping[str, object], body: bytes
    ) -> tuple[Envelope, Message]:
        """Verify and decode: what cannot be trusted or read raises :class:`RejectedMessageError`."""
        try:
            envelope = read_envelope(headers, body, self._signer, max_header_bytes=self._max_header_bytes)
            refuse_stale(envelope, self._clock(), self._max_age)
            return envelope, decode(self._registry, consumer, envelope.event_name, body)
        except RejectedMessageError as rejected:
            self._metrics.inbox_rejected.labels(consumer.name, rejected.reason).inc()
            raise

    @contextmanager
    def _consuming(self, consumer: Consumer[Any], envelope: Envelope) -> Iterator[Span]:
        """The message's consume span, and its context restored (what its handler enqueues
        carries the span: the trace goes on to the next hop)."""
        delivery = Delivery(envelope.message_id, envelope.event_name, consumer.name)
        attributes = {"messaging.message.id": envelope.message_id, "messaging.consumer.name": consumer.name}
        with self._tracing.span(
            f"consume {envelope.event_name}",
            kind=SpanKind.CONSUMER,
            traceparent=envelope.context.traceparent,
            attributes=attributes,
        ) as span:
            context = envelope.context
            if span.traceparent != context.traceparent:
                context = dataclasses.replace(context, traceparent=span.traceparent)
            with restored(context, authentication_type=MESSAGE_AUTHENTICATION), delivering(delivery):
                yield span

    def _count_failure(self, consumer: Consumer[Any], error: BaseException) -> None:
        if isinstance(error, RejectedMessageError):  # a conflicting duplicate
            self._metrics.inbox_rejected.labels(consumer.name, error.reason).inc()
        else:
            self._metrics.inbox_failures.labels(consumer.name).inc()

    def _count(self, consumer: Consumer[Any], envelope: Envelope, outcome: ConsumeOutcome) -> None:
        if outcome is ConsumeOutcome.DUPLICATE:
            self._metrics.inbox_duplicates.labels(consumer.name).inc()
            log.info("%s skipped duplicate message %s", consumer.name, envelope.message_id)
        else:
            self._metrics.inbox_consumed.labels(consumer.name).inc()

    async def _run(self, consumer: Consumer[Any], message: Message, envelope: Envelope) -> ConsumeOutcome:
        digest = self._digest(envelope)
        units = self._units(consumer.name)  # the consumer's context's source: its inbox, its tables
        async with units() as uow:
            session = uow.session
            # PostgreSQL: the receipt first, a lock on its key only. SQLite: a lookup first and the
            # receipt last, since any write takes the database's one write lock and a slow handler
            # would hold it (every other writer of the service waiting behind it).
            receipt_first, dialect = units.database.is_postgresql, units.database.dialect
            if self._inbox:
                known = (
                    not await self._first_receipt(
                        session, units.database.dialect, consumer.name, envelope, digest
                    )
                    if receipt_first
                    else await self._already_consumed(session, envelope.message_id, consumer.name, digest)
                )
                if known:
                    return ConsumeOutcome.DUPLICATE
            await self._handle(consumer, message, uow)
            late_receipt = self._inbox and not receipt_first
            if late_receipt and not await self._first_receipt(
                session, dialect, consumer.name, envelope, digest
            ):
                await uow.rollback()  # a copy committed while this one ran: its effects stand
                return ConsumeOutcome.DUPLICATE
            await uow.commit()
        return ConsumeOutcome.CONSUMED

    def _digest(self, envelope: Envelope) -> str:
        return hashlib.sha256(envelope.body).hexdigest() if self._inbox else ""  # only the inbox keeps it

    async def _handle(self, consumer: Consumer[Any], message: Message, uow: SqlUnitOfWork) -> None:
        async with time_limit(self._handler_timeout, "handler"):  # the handler, not the commit
            with handler_scope(handler_name(consumer.handler)):
                await consumer.handler(message, uow)

    # -- a batch: one transaction for the messages ready together ------------------------------

    async def _consume_batch(
        self, consumer: Consumer[Any], items: Sequence[Submitted[ConsumeOutcome]]
    ) -> None:
        """Settle every item (see "Batches" in the module docstring)."""
        if len(items) == 1:
            await self._consume_alone(consumer, items[0])
            return
        ready: list[Read] = []
        for item in items:
            try:
                envelope, message = self._read(consumer, item.headers, item.body)
            except RejectedMessageError as rejected:
                item.fail(rejected)
                continue
            ready.append(Read(item, envelope, message, self._digest(envelope)))
        while ready:  # a copy of a message already in this round waits for the next one
            seen: set[str] = set()
            this_round: list[Read] = []
            later: list[Read] = []
            for read in ready:
                (later if read.envelope.message_id in seen else this_round).append(read)
                seen.add(read.envelope.message_id)
            while this_round:
                this_round = await self._attempt(consumer, this_round)
            ready = later

    async def _attempt(self, consumer: Consumer[Any], reads: list[Read]) -> list[Read]:
        """Run ``reads`` in one transaction and settle them. When one message's handler fails,
        only that message is settled (with its failure); the others are returned, to be run
        again without it."""
        units = self._units(consumer.name)
        shared = SharedTransaction(units.database.sessions(), units.writer.new_lease(units.clock()))
        staged: list[tuple[Read, SqlUnitOfWork, Staged]] = []
        running: Read | None = None
        failure: Exception | None = None
        try:
            for read in await self._receive(shared.session, consumer, units.database.dialect, reads):
                running = read
                staged.append(await self._stage(consumer, read, units(shared=shared)))
            running = None
            await self._commit(units, shared, [done for _, _, done in staged])
        except Exception as error:  # noqa: BLE001 (settled below, message by message)
            failure = error
        finally:
            await shared.session.close()
        if failure is not None:
            return await self._after_failure(consumer, reads, running, failure)
        for read, uow, done in staged:
            with restored(read.envelope.context, authentication_type=MESSAGE_AUTHENTICATION):
                await uow.committed_as(done)
                self._count(consumer, read.envelope, ConsumeOutcome.CONSUMED)
            read.item.settle(ConsumeOutcome.CONSUMED)
        return []

    async def _receive(
        self, session: AsyncSession, consumer: Consumer[Any], dialect: str, reads: list[Read]
    ) -> list[Read]:
        """Write the batch's inbox rows in one statement; settle the messages already consumed
        (duplicates) and return the others, to be handled."""
        if not self._inbox:
            return reads
        inserted = await self._receipts_of(session, consumer.name, reads)
        fresh: list[Read] = []
        for read in reads:
            if read.envelope.message_id in inserted:
                fresh.append(read)
                continue
            envelope = read.envelope
            with restored(envelope.context, authentication_type=MESSAGE_AUTHENTICATION):
                try:
                    known = await self._already_consumed(
                        session, envelope.message_id, consumer.name, read.digest
                    )
                    # Not known: purged between the two statements (past its retention); insert it alone.
                    if not known and await self._first_receipt(
                        session, dialect, consumer.name, envelope, read.digest
                    ):
                        fresh.append(read)
                        continue
                except RejectedMessageError as rejected:  # a conflicting duplicate
                    self._count_failure(consumer, rejected)
                    read.item.fail(rejected)
                    continue
                self._count(consumer, envelope, ConsumeOutcome.DUPLICATE)
            read.item.settle(ConsumeOutcome.DUPLICATE)
        return fresh

    async def _receipts_of(self, session: AsyncSession, consumer: str, reads: list[Read]) -> set[str]:
        """The message ids whose inbox row this statement wrote (the others have one already)."""
        contexts = [read.envelope.context for read in reads]
        params = {
            "consumer": consumer,
            "received_on": self._clock(),
            "message_ids": [read.envelope.message_id for read in reads],
            "event_names": [read.envelope.event_name for read in reads],
            "tenant_ids": [context.tenant_id for context in contexts],
            "correlation_ids": [context.correlation_id for context in contexts],
            "digests": [read.digest for read in reads],
        }
        result = await session.exec(BATCH_RECEIPT, params=params)  # type: ignore[call-overload]
        return {row[0] for row in result}

    async def _stage(
        self, consumer: Consumer[Any], read: Read, uow: SqlUnitOfWork
    ) -> tuple[Read, SqlUnitOfWork, Staged]:
        """Run the message's handler in its own unit of work on the batch's transaction, and
        write what it decided (its outbox rows carry this message's context)."""
        with self._consuming(consumer, read.envelope) as span:
            async with uow:
                await self._handle(consumer, read.message, uow)
                staged = await uow.stage()
            span.set_attribute("inbox.outcome", ConsumeOutcome.CONSUMED.value)
        return read, uow, staged

    @staticmethod
    async def _commit(units: SqlUnitOfWorkFactory, shared: SharedTransaction, staged: list[Staged]) -> None:
        """One COMMIT for the batch; when its units of work leased rows to this process, under
        their shared lease, given back if a cancellation interrupts the commit."""
        commit = shared.session.commit()
        if all(done.outbox.lease_until is None for done in staged):
            await commit
            return
        await units.after_commit.commit_leased(commit, shared.lease.token, shared.lease.until)

    async def _after_failure(
        self, consumer: Consumer[Any], reads: list[Read], running: Read | None, error: Exception
    ) -> list[Read]:
        """Settle a failed attempt: the message whose handler failed fails alone and the others
        go again; an unreachable database fails them all (each is held, uncharged, by the
        consume wrapper); a failure of none in particular (the receipts, the commit) runs each
        alone."""
        unsettled = [read for read in reads if not read.item.settled]
        outage = is_database_outage(error)
        if running is not None and not outage:
            self._count_failure(consumer, error)
            running.item.fail(error)
            return [read for read in unsettled if read is not running]
        if outage:
            for read in unsettled:
                self._count_failure(consumer, error)
                read.item.fail(error)
            return []
        log.warning(
            "%s: a batch of %s messages failed as a whole (%s: %s); each runs alone",
            consumer.name,
            len(unsettled),
            type(error).__name__,
            error,
        )
        for read in unsettled:
            await self._consume_alone(consumer, read.item)
        return []

    async def _consume_alone(self, consumer: Consumer[Any], item: Submitted[ConsumeOutcome]) -> None:
        try:
            item.settle(await self.consume_one(consumer, item.headers, item.body))
        except Exception as error:  # noqa: BLE001 (the message's own outcome, raised in its task)
            item.fail(error)

    async def _first_receipt(
        self, session: AsyncSession, dialect: str, consumer: str, envelope: Envelope, digest: str
    ) -> bool:
        """Insert the inbox row in the handler's transaction; False when ``consumer`` already has
        this message (after the digest check of :meth:`_already_consumed`)."""
        context = current_context()
        row = {
            "message_id": envelope.message_id,
            "consumer": consumer,
            "event_name": envelope.event_name,
            "tenant_id": context.tenant_id,
            "correlation_id": context.correlation_id,
            "received_on": self._clock(),
            "body_digest": digest,
        }
        statement = self._receipt_statement(session, dialect)
        for _ in range(RECEIPT_ATTEMPTS):
            inserted = await session.exec(statement, params=row)  # type: ignore[call-overload]
            if inserted.first() is not None:
                return True
            if await self._already_consumed(session, envelope.message_id, consumer, digest):
                return False
            # Purged between the two statements (past its retention): insert it again.
        msg = f"the inbox row of {envelope.message_id} for {consumer} could not be written"
        raise RuntimeError(msg)

    def _receipt_statement(self, session: AsyncSession, dialect: str) -> sa.Executable:
        """``INSERT ... ON CONFLICT DO NOTHING RETURNING`` into the inbox, built once per dialect
        (the sources' databases) and bound to each message's values (building it per message cost
        more than running it)."""
        receipt = self._receipts.get(dialect)
        if receipt is None:
            values = {column.name: sa.bindparam(column.name, type_=column.type) for column in INBOX.columns}
            receipt = self._receipts[dialect] = (
                upsert(session, INBOX)
                .values(values)
                .on_conflict_do_nothing(index_elements=[INBOX.c.message_id, INBOX.c.consumer])
                .returning(INBOX.c.message_id)
            )
        return receipt

    @staticmethod
    async def _already_consumed(session: AsyncSession, message_id: str, consumer: str, digest: str) -> bool:
        """Whether ``consumer`` has processed ``message_id``; a processed id whose recorded body
        digest differs from ``digest`` raises ``conflicting_duplicate``."""
        result = await session.exec(  # type: ignore[call-overload]
            sa.select(INBOX.c.body_digest).where(
                INBOX.c.message_id == message_id, INBOX.c.consumer == consumer
            )
        )
        row = result.first()
        if row is None:
            return False
        recorded = row[0]
        if recorded is not None and recorded != digest:
            raise RejectedMessageError(
                Rejection.CONFLICTING_DUPLICATE,
                f"message {message_id} was processed with another body (sha256 {recorded[:12]}...,"
                f" this one {digest[:12]}...)",
            )
        return True
