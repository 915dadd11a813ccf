"""Retry backoff band and cap; the circuit breaker opens, half-opens and closes."""

import random
from datetime import UTC, datetime, timedelta

import pytest

from {{ cookiecutter.package_name }}.building_blocks.messaging.circuit import CircuitBreaker
from {{ cookiecutter.package_name }}.building_blocks.polling.leases import backoff_seconds
from {{ cookiecutter.package_name }}.building_blocks.polling.source import CircuitOpenError

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


async def test_breaker_opens_after_threshold_then_half_opens_then_closes() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=2, reset_seconds=30, clock=clock)

    async def fail() -> None:
        raise ConnectionError("down")

    async def succeed() -> str:
        return "ok"

    for _ in range(2):
        with pytest.raises(ConnectionError):
            await breaker.call(fail)
    assert breaker.state == "open"
    with pytest.raises(CircuitOpenError) as opened:
        await breaker.call(succeed)
    assert opened.value.retry_at >= clock.now + timedelta(seconds=29)
    clock.now += timedelta(seconds=31)
    assert breaker.state == "half-open"
    with pytest.raises(ConnectionError):
        await breaker.call(fail)  # the trial fails: open again
    assert breaker.state == "open"
    clock.now += timedelta(seconds=31)
    assert await breaker.call(succeed) == "ok"
    assert breaker.state == "closed"
