"""Prometheus metrics of the relay: the polled tables (outbox, internal commands) and the inbox.

All metrics live in a registry owned by the container (no process-global registry), exposed at
``/metrics``. What to alert on: a growing
``outbox_oldest_pending_age_seconds``, any ``outbox_dead_letters_total`` increase, and a
``outbox_processor_heartbeat_timestamp_seconds`` that stops moving. The metric names keep their
``outbox_`` prefix for both polled tables (``source`` tells them apart): dashboards and alerts
depend on the names.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
SOURCE, CONSUMER = ("source",), ("consumer",)
# attribute -> (type, name, help, labels, extra arguments)
DEFINITIONS: dict[str, tuple[type[Any], str, str, tuple[str, ...], dict[str, Any]]] = {
    "pending_depth": (
        Gauge,
        "outbox_pending_depth",
        "Rows neither processed nor dead-lettered (leased included)",
        SOURCE,
        {},
    ),
    "oldest_pending_age": (
        Gauge,
        "outbox_oldest_pending_age_seconds",
        "Age of the oldest claimable row at the last poll (0 when none)",
        SOURCE,
        {},
    ),
    "dispatch_lag": (
        Histogram,
        "outbox_dispatch_lag_seconds",
        "From occurred_on to delivered",
        SOURCE,
        {"buckets": LAG_BUCKETS},
    ),
    "dispatched": (Counter, "outbox_dispatched_total", "Rows delivered", ("source", "kind"), {}),
    "failures": (Counter, "outbox_failures_total", "Failed delivery attempts", SOURCE, {}),
    "dead_letters": (Counter, "outbox_dead_letters_total", "Rows dead-lettered", ("source", "reason"), {}),
    "unrouted": (
        Counter,
        "outbox_unrouted_total",
        "Rows published with no consumer bound (delivered to nobody, stamped processed)",
        ("source", "event_name"),
        {},
    ),
    "lost_leases": (Counter, "outbox_lost_leases_total", "Rows another processor took over", SOURCE, {}),
    "heartbeat": (
        Gauge,
        "outbox_processor_heartbeat_timestamp_seconds",
        "Unix time of the last finished cycle",
        SOURCE,
        {},
    ),
    "cleaned": (
        Counter,
        "outbox_cleanup_deleted_total",
        "Rows removed by retention",
        ("source", "state"),
        {},
    ),
    "inbox_consumed": (Counter, "inbox_consumed_total", "Messages handled and committed", CONSUMER, {}),
    "inbox_duplicates": (
        Counter,
        "inbox_duplicates_total",
        "Messages skipped as already consumed",
        CONSUMER,
        {},
    ),
    "inbox_failures": (
        Counter,
        "inbox_failures_total",
        "Handler failures (message redelivered)",
        CONSUMER,
        {},
    ),
    "inbox_outage_holds": (
        Counter,
        "inbox_database_outage_holds_total",
        "Consumed messages held and run again because the database was unreachable",
        CONSUMER,
        {},
    ),
    "inbox_dead_letters": (
        Counter,
        "inbox_dead_letters_total",
        "Consumed messages moved to the consumer's dead-letter destination",
        ("consumer", "reason"),
        {},
    ),
    "inbox_rejected": (
        Counter,
        "inbox_rejected_total",
        "Messages dead-lettered without processing (bad signature, malformed, unknown)",
        ("consumer", "reason"),
        {},
    ),
}


class RelayMetrics:
    """Every metric of the messaging machinery, labelled by ``source`` or ``consumer``."""

    pending_depth: Gauge
    oldest_pending_age: Gauge
    dispatch_lag: Histogram
    dispatched: Counter
    failures: Counter
    dead_letters: Counter
    unrouted: Counter
    lost_leases: Counter
    heartbeat: Gauge
    cleaned: Counter
    inbox_consumed: Counter
    inbox_duplicates: Counter
    inbox_failures: Counter
    inbox_outage_holds: Counter
    inbox_dead_letters: Counter
    inbox_rejected: Counter

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        for attribute, (kind, name, documentation, labels, extra) in DEFINITIONS.items():
            setattr(self, attribute, kind(name, documentation, labels, registry=self.registry, **extra))

    # -- RelayMetrics ----------------------------------------------------------------------

    def backlog_age(self, source: str, seconds: float) -> None:
        self.oldest_pending_age.labels(source).set(seconds)

    def delivered(self, source: str, kind: str, lag_seconds: float) -> None:
        self.dispatch_lag.labels(source).observe(lag_seconds)
        self.dispatched.labels(source, kind).inc()

    def failed(self, source: str) -> None:
        self.failures.labels(source).inc()

    def dead_lettered(self, source: str, reason: str, count: int = 1) -> None:
        self.dead_letters.labels(source, reason).inc(count)

    def unrouted_publish(self, source: str, event_name: str) -> None:
        self.unrouted.labels(source, event_name).inc()

    def lost_lease(self, source: str) -> None:
        self.lost_leases.labels(source).inc()

    def beat(self, source: str, now: datetime) -> None:
        self.heartbeat.labels(source).set(now.timestamp())
