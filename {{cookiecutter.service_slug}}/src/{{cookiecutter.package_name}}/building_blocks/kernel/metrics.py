"""Prometheus metrics of the outbox, the internal commands and the inbox.

All metrics live in a registry owned by the container (no process-global registry), exposed at
``/metrics``. What to alert on is in docs/operations.md: a growing
``outbox_oldest_pending_age_seconds``, any ``outbox_dead_letters_total`` increase, and a
``outbox_processor_heartbeat_timestamp_seconds`` that stops moving.
"""

from __future__ import annotations

from datetime import datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)


class RelayMetrics:
    """Every metric of the messaging machinery, labelled by ``source`` or ``consumer``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.pending_depth = Gauge(
            "outbox_pending_depth",
            "Rows neither processed nor dead-lettered (leased included)",
            ["source"],
            registry=r,
        )
        self.oldest_pending_age = Gauge(
            "outbox_oldest_pending_age_seconds",
            "Age of the oldest claimable row at the last poll (0 when none)",
            ["source"],
            registry=r,
        )
        self.dispatch_lag = Histogram(
            "outbox_dispatch_lag_seconds",
            "From occurred_on to delivered",
            ["source"],
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.dispatched = Counter("outbox_dispatched_total", "Rows delivered", ["source", "kind"], registry=r)
        self.failures = Counter("outbox_failures_total", "Failed delivery attempts", ["source"], registry=r)
        self.dead_letters = Counter(
            "outbox_dead_letters_total", "Rows dead-lettered", ["source", "reason"], registry=r
        )
        self.lost_leases = Counter(
            "outbox_lost_leases_total", "Rows another processor took over", ["source"], registry=r
        )
        self.heartbeat = Gauge(
            "outbox_processor_heartbeat_timestamp_seconds",
            "Unix time of the last finished cycle",
            ["source"],
            registry=r,
        )
        self.cleaned = Counter(
            "outbox_cleanup_deleted_total",
            "Rows removed by retention",
            ["source", "state"],
            registry=r,
        )
        self.inbox_consumed = Counter(
            "inbox_consumed_total", "Messages handled and committed", ["consumer"], registry=r
        )
        self.inbox_duplicates = Counter(
            "inbox_duplicates_total", "Messages skipped as already consumed", ["consumer"], registry=r
        )
        self.inbox_failures = Counter(
            "inbox_failures_total", "Handler failures (message redelivered)", ["consumer"], registry=r
        )
        self.inbox_outage_holds = Counter(
            "inbox_database_outage_holds_total",
            "Consumed messages held and run again because the database was unreachable",
            ["consumer"],
            registry=r,
        )
        self.inbox_dead_letters = Counter(
            "inbox_dead_letters_total",
            "Consumed messages moved to the consumer's dead-letter destination",
            ["consumer", "reason"],
            registry=r,
        )
        self.inbox_rejected = Counter(
            "inbox_rejected_total",
            "Messages dead-lettered without processing (bad signature, malformed, unknown)",
            ["consumer", "reason"],
            registry=r,
        )

    def beat(self, source: str, now: datetime) -> None:
        self.heartbeat.labels(source).set(now.timestamp())
