"""The relay's knobs with their defaults (polling 2 s, 10 s while idle and woken by NOTIFY,
processing delay 5 s, lease 300 s, a delivery time limit of 60 s, five retries, backoff base
10 s, batch 100 with 32 deliveries in flight, retention 7 days), and the inbox's retention.
A generated service's docs/performance.md says why; its docs/semantics.md ("Time limits") why the
limit fits the lease. Unset, the limit follows the lease; ``runtime.time_limits`` fits it (and
refuses one set too long)."""

from __future__ import annotations

from pydantic import BaseModel, Field

# The part of a lease no delivery may use: it covers the renewal statement before a delivery, the
# cancellation of one past its time limit, and clock differences between replicas. A delivery
# starts only with at least its time limit plus this margin of lease left (``renew_below``).
LEASE_MARGIN_FRACTION = 0.2
# Seconds compared after float arithmetic: 3 * 0.8 + 3 * 0.2 is a hair above 3.
FLOAT_SLACK = 1e-9


class OutboxSettings(BaseModel):
    """The delivery knobs of the outbox and the internal commands."""

    polling_interval_seconds: float = Field(default=2.0, gt=0)
    idle_polling_interval_seconds: float = Field(
        default=10.0,
        gt=0,
        description="Fallback poll while the table is empty and the PostgreSQL LISTEN connection is up",
    )
    processing_delay_seconds: float = Field(default=5.0, ge=0)
    lease_seconds: float = Field(default=300.0, gt=0)
    delivery_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        description="Time limit of one delivery (publish or local handlers); unset: follows the lease",
    )
    max_retries: int = Field(default=5, ge=1)
    retry_backoff_base_seconds: float = Field(default=10.0, gt=0)
    batch_size: int = Field(default=100, ge=1, le=10_000)
    # 100, the batch size: a batch's publishes all in flight together (32 left the broker's
    # confirm round trips idle between windows: 0.76x of a plain publish's rate against 0.99x).
    delivery_concurrency: int = Field(
        default=100, ge=1, le=256, description="Rows of one batch delivered at once (PostgreSQL; 1 on SQLite)"
    )
    claim_window: int = Field(default=0, ge=0, description="Keyed rows scanned per claim; 0 = auto")
    retention_days: int = Field(default=7, ge=0)
    dead_letter_retention_days: int = Field(default=0, ge=0)
    cleanup_interval_seconds: float = Field(default=3600.0, gt=0)
    cleanup_batch_size: int = Field(default=1000, ge=1)
    immediate_dispatch: bool = True
    max_cascade_depth: int = Field(default=8, ge=1)
    shutdown_timeout_seconds: float = Field(default=5.0, gt=0)
    metrics_interval_seconds: float = Field(default=15.0, gt=0)

    @property
    def lease_margin_seconds(self) -> float:
        return self.lease_seconds * LEASE_MARGIN_FRACTION

    @property
    def renew_below_seconds(self) -> float:
        """A delivery starting with less lease left than this renews first: its lease then outlasts
        the delivery's time limit whatever happens, so no replica can claim a row in flight."""
        return self.delivery_timeout_seconds + self.lease_margin_seconds

    @property
    def dead_letter_window_days(self) -> int:
        """How long dead letters are kept (and can be replayed); 0 = forever."""
        return self.dead_letter_retention_days or self.retention_days

    @property
    def effective_claim_window(self) -> int:
        return self.claim_window or 8 * self.batch_size


class InboxSettings(BaseModel):
    """Consumer-side deduplication records. Kept twice as long as outbox dead letters by
    default: a message older than the inbox remembers is refused as stale, and a dead letter
    replayed on the last day of its window must still be accepted."""

    retention_days: int = Field(default=14, ge=0)
