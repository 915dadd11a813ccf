"""Retry backoff band and cap; the circuit breaker opens, half-opens and closes."""

import random
from datetime import UTC, datetime, timedelta

import pytest
from outbox_kit.persistence.tables import backoff_seconds
from outbox_kit.transports.bus import BrokerUnavailableError, CircuitBreaker, CircuitOpenError

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


async def outage() -> None:
    msg = "connection refused"
    raise BrokerUnavailableError(msg)


async def succeed() -> str:
    return "ok"


async def test_outages_are_never_charged_and_open_the_circuit_at_the_threshold() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=2, reset_seconds=30, clock=clock)
    with pytest.raises(CircuitOpenError) as first:
        await breaker.call(outage)  # below the threshold: released briefly, not charged
    assert first.value.retry_at <= clock.now + timedelta(seconds=1)
    assert breaker.state == "closed"
    with pytest.raises(CircuitOpenError) as second:
        await breaker.call(outage)
    assert breaker.state == "open"
    assert second.value.retry_at == clock.now + timedelta(seconds=30)
    with pytest.raises(CircuitOpenError):
        await breaker.call(succeed)  # open: not even attempted
    clock.now += timedelta(seconds=31)
    assert breaker.state == "half-open"
    with pytest.raises(CircuitOpenError):
        await breaker.call(outage)  # the trial fails: open again, still not charged
    assert breaker.state == "open"
    clock.now += timedelta(seconds=31)
    assert await breaker.call(succeed) == "ok"
    assert breaker.state == "closed"


async def test_a_message_level_failure_is_charged_and_proves_the_broker_answers() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, reset_seconds=30, clock=clock)

    async def unroutable() -> None:
        msg = "NO_ROUTE"
        raise ValueError(msg)

    with pytest.raises(ValueError, match="NO_ROUTE"):  # propagates: the processor charges it
        await breaker.call(unroutable)
    assert breaker.state == "closed"
    with pytest.raises(CircuitOpenError):
        await breaker.call(outage)
    clock.now += timedelta(seconds=31)
    with pytest.raises(ValueError, match="NO_ROUTE"):
        await breaker.call(unroutable)  # the half-open trial reached the broker
    assert breaker.state == "closed"
