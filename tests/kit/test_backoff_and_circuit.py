"""Retry backoff band and cap; the circuit breaker opens, half-opens and closes."""

import random
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import pytest
from outbox_kit.processor.retries import backoff_seconds
from outbox_kit.transports.bus import BrokerUnavailableError, CircuitBreaker, CircuitOpenError, PublishResult

pytestmark = pytest.mark.unit


def test_backoff_stays_in_the_jitter_band_and_never_exceeds_the_cap() -> None:
    rng = random.Random(7)
    for attempt in range(1, 6):
        samples = [backoff_seconds(attempt, base=10, cap=300, rng=rng) for _ in range(2000)]
        nominal = 10 * 2 ** (attempt - 1)
        assert min(samples) >= nominal * 0.8
        assert max(samples) <= nominal * 1.2
        assert max(samples) - min(samples) > nominal * 0.3  # really jittered, not constant
    assert {backoff_seconds(9, base=10, cap=300, rng=rng) for _ in range(50)} == {300}


class FakeClock:
    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def outage() -> BrokerUnavailableError:
    return BrokerUnavailableError("connection refused")


def attempt(*results: PublishResult) -> Callable[[], Awaitable[list[PublishResult]]]:
    """One publish attempt of a batch whose messages end in ``results``."""

    async def publish() -> list[PublishResult]:
        return list(results)

    return publish


def paused(results: list[PublishResult]) -> list[CircuitOpenError]:
    assert all(isinstance(result, CircuitOpenError) for result in results), results
    return [result for result in results if isinstance(result, CircuitOpenError)]


async def test_outages_are_never_charged_and_open_the_circuit_at_the_threshold() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, reset_seconds=30, clock=clock)
    # Below the threshold: released briefly, not charged; each message's outage counts.
    (first, _) = paused(await breaker.call(attempt(outage(), outage())))
    assert first.retry_at <= clock.now + timedelta(seconds=2)  # a step back per outage so far
    assert isinstance(first.__cause__, BrokerUnavailableError)
    assert breaker.state == "closed"
    (second,) = paused(await breaker.call(attempt(outage())))
    assert breaker.state == "open"
    assert second.retry_at == clock.now + timedelta(seconds=30)
    with pytest.raises(CircuitOpenError):
        await breaker.call(attempt(None))  # open: not even attempted
    clock.now += timedelta(seconds=31)
    assert breaker.state == "half-open"
    paused(await breaker.call(attempt(outage())))  # the trial fails: open again, still not charged
    assert breaker.state == "open"
    clock.now += timedelta(seconds=31)
    assert await breaker.call(attempt(None, None)) == [None, None]
    assert breaker.state == "closed"


async def test_an_outage_in_part_of_a_batch_pauses_only_the_messages_it_took() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, reset_seconds=30, clock=clock)
    refused = ValueError("NO_ROUTE")
    confirmed, failed, cut = await breaker.call(attempt(None, refused, outage()))
    assert confirmed is None
    assert failed is refused  # the message's own failure: charged by the processor
    assert isinstance(cut, CircuitOpenError)
    assert breaker.state == "open"


async def test_a_message_level_failure_is_charged_and_proves_the_broker_answers() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, reset_seconds=30, clock=clock)
    unroutable = ValueError("NO_ROUTE")
    assert await breaker.call(attempt(unroutable)) == [unroutable]  # the processor charges it
    assert breaker.state == "closed"
    paused(await breaker.call(attempt(outage())))
    clock.now += timedelta(seconds=31)
    assert await breaker.call(attempt(unroutable)) == [unroutable]  # the half-open trial reached the broker
    assert breaker.state == "closed"
