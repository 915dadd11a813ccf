"""Messages of one consumer that are ready together are consumed together.

A broker that hands a consumer several messages at once runs each in a task of its own
(RabbitMQ delivers each message to a task; NATS runs a pulled batch in a task group). Each task
submits its message here and waits for its outcome. When no batch runs, the first task leads:
it yields once, so the messages ready at that moment join it, takes up to
``MESSAGE_BUS__CONSUME_BATCH_SIZE`` of them, oldest first, and runs them as one batch (one
transaction: ``consume.inbox``); the messages that arrive meanwhile wait for it and make the
next batch. A message that arrives alone is run alone, at once: nothing waits for a batch to
fill.

Up to ``MESSAGE_BUS__CONSUME_CONCURRENCY`` batches run at once, but another starts only when a
whole batch is waiting, or when a message has waited :data:`PATIENCE_SECONDS` (the running
batch is slow: a handler calling another service). So a slow handler holds up its own batch
only, as when each message had a task of its own, while quick handlers keep their batches full
(a second batch started for every message that found room ran batches of four on average, and
cost about 40% more CPU per message).

The work runs in the tasks of the messages themselves, never in a task of its own: a leader leads
until its own message has an outcome, then hands over to a message still waiting. A leader
cancelled mid-batch (the consumer stopping) puts the batch's unsettled messages back in front,
where the next leader takes them; each message's own task still acknowledges it, so one whose
task is gone is redelivered by the broker, and the inbox makes that a duplicate."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(eq=False)
class Submitted(Generic[T]):
    """One message waiting for its outcome."""

    headers: Mapping[str, object]
    body: bytes
    outcome: asyncio.Future[T] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    since: float = field(default_factory=lambda: asyncio.get_running_loop().time())
    queued: bool = False  # in the queue, waiting to be taken into a batch (read on every turn)

    @property
    def settled(self) -> bool:
        return self.outcome.done()

    def settle(self, outcome: T) -> None:
        if not self.outcome.done():
            self.outcome.set_result(outcome)

    def fail(self, error: BaseException) -> None:
        if not self.outcome.done():
            self.outcome.set_exception(error)


RunBatch = Callable[[Sequence[Submitted[T]]], Awaitable[None]]

# How long a message waits behind running batches before it may start one of its own.
PATIENCE_SECONDS = 0.05


def _retrieved(outcome: asyncio.Future[Any]) -> None:
    """An outcome nobody waits for any more (its task was cancelled) is read here, so asyncio
    does not report its exception as never retrieved."""
    if not outcome.cancelled():
        outcome.exception()


class Batches(Generic[T]):
    """The messages one consumer has waiting, run in batches of at most ``size`` by ``run``,
    which settles every message it is given (see the module)."""

    def __init__(self, run: RunBatch[T], size: int, concurrency: int = 1) -> None:
        self._run = run
        self._size = max(1, size)
        self._concurrency = max(1, concurrency)
        self._waiting: deque[Submitted[T]] = deque()
        self._leaders = 0
        self._handover: asyncio.Future[None] | None = None

    async def submit(self, headers: Mapping[str, object], body: bytes) -> T:
        """Wait for the outcome of this message (raises its failure)."""
        item: Submitted[T] = Submitted(headers, body)
        self._enqueue([item])
        try:
            while not item.settled:
                if self._may_lead(item):
                    await self._lead(item)
                    continue
                turn: set[asyncio.Future[Any]] = {item.outcome, self._next_turn()}
                await asyncio.wait(turn, timeout=PATIENCE_SECONDS, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            if item.queued:
                self._waiting.remove(item)
            item.outcome.add_done_callback(_retrieved)
            raise
        return item.outcome.result()

    def _may_lead(self, item: Submitted[T]) -> bool:
        """Whether ``item``'s task starts a batch now (see the module)."""
        if not item.queued:  # in a running batch
            return False
        if self._leaders == 0:
            return True
        if self._leaders >= self._concurrency:
            return False
        waited = asyncio.get_running_loop().time() - self._waiting[0].since
        return len(self._waiting) >= self._size or waited >= PATIENCE_SECONDS

    def _enqueue(self, items: list[Submitted[T]], *, in_front: bool = False) -> None:
        for item in items:
            item.queued = True
        if in_front:
            self._waiting.extendleft(reversed(items))
        else:
            self._waiting.extend(items)

    def _next_turn(self) -> asyncio.Future[None]:
        if self._handover is None:
            self._handover = asyncio.get_running_loop().create_future()
        return self._handover

    async def _lead(self, own: Submitted[T]) -> None:
        self._leaders += 1
        try:
            await asyncio.sleep(0)  # the messages ready at this moment join the first batch
            while not own.settled and self._waiting:
                batch = [self._waiting.popleft() for _ in range(min(self._size, len(self._waiting)))]
                for item in batch:
                    item.queued = False
                try:
                    await self._run(batch)
                finally:
                    # Cancelled mid-batch: what it did not settle goes back in front, in order.
                    self._enqueue([item for item in batch if not item.settled], in_front=True)
        finally:
            self._leaders -= 1
            handover, self._handover = self._handover, None
            if handover is not None:
                with contextlib.suppress(asyncio.InvalidStateError):
                    handover.set_result(None)
