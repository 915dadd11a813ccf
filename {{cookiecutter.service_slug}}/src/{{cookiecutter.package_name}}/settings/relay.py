"""The relay's knobs with their defaults (polling 2 s, 10 s while idle and woken by NOTIFY,
processing delay 5 s, lease 300 s, five retries, backoff base 10 s, batch 100 with 32 deliveries
in flight, retention 7 days), and the inbox's retention. docs/performance.md says why."""

from __future__ import annotations

from pydantic import BaseModel, Field


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
    max_retries: int = Field(default=5, ge=1)
    retry_backoff_base_seconds: float = Field(default=10.0, gt=0)
    batch_size: int = Field(default=100, ge=1, le=10_000)
    delivery_concurrency: int = Field(
        default=32, ge=1, le=256, description="Rows of one batch delivered at once (PostgreSQL; 1 on SQLite)"
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
