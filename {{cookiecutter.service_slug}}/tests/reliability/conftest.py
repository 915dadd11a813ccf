"""The reliability tier's summary: one table of every scenario that ran, printed at the end of
the run and written to ``reliability-report.md`` (or ``RELIABILITY_REPORT``)."""

from outbox_kit.testing.reliability import pytest_terminal_summary

__all__ = ["pytest_terminal_summary"]
