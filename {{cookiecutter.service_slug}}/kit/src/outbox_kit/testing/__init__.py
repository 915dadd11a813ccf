"""Test helpers for a service built on the kit (import them from tests only, never from
service code).

* Fakes for fast unit tests of use cases and handlers: :class:`InMemoryUnitOfWork`,
  :class:`InMemoryRepository` and the :class:`InMemoryStore` they share. They pass the same
  contract tests as the SQL unit of work.
* The "handlers do not save" rule: :class:`SaveRule` walks the call graph below every registered
  handler and reports, with the whole chain, any path that saves on its own; a service's
  architecture test builds it with :func:`service_save_rule` (its package, its modules and its
  allowlist).
* The kit's tables (``OUTBOX_TABLE``, ``COMMAND_TABLE``, ``INBOX_TABLE``,
  ``IDEMPOTENCY_KEYS_TABLE``), for a test that reads what a commit or a delivery wrote.
* The outbox's fitness rules: :class:`FitnessRules` (only the outbox publishes, every consumer
  goes through the inbox, integration events are named for good, ordered events are an
  aggregate's), built by :func:`service_fitness`; a golden list of message names is read by
  :func:`pinned_names` and checked by :func:`golden_list_problems`.
* The static call graph the rules walk (:class:`CallGraph` over a :func:`source_index`, a
  :class:`SourceIndex`), for architecture rules of your own (where a publish or a subscribe may
  appear, say). Its engine's parts stay in ``outbox_kit.testing.callgraph``: only what a test
  calls is exported here.

And modules imported by name, since they need pytest or start processes: ``fixtures`` (the
pytest plugin every suite loads with ``-p``), ``harness`` (the kit's test context), ``brokers``
(raw broker access), ``reliability``, ``processes`` and ``protocol_model`` (the reliability tier
a service runs on its own container), ``bench`` (the relay benchmark behind ``make bench``).
"""

from outbox_kit.persistence.tables import COMMAND_TABLE, IDEMPOTENCY_KEYS_TABLE, INBOX_TABLE, OUTBOX_TABLE
from outbox_kit.testing.callgraph import CallGraph, SourceIndex, source_index
from outbox_kit.testing.fakes import InMemoryRepository, InMemoryStore, InMemoryUnitOfWork
from outbox_kit.testing.rules import (
    DEFAULT_DEPTH,
    DEFAULT_SINKS,
    KIT_ALLOWLIST,
    KIT_SINKS,
    AllowlistHit,
    FitnessRules,
    Hop,
    Report,
    SaveRule,
    SinkSpec,
    Violation,
    golden_list_problems,
    pinned_names,
    service_fitness,
    service_save_rule,
)

__all__ = [
    "COMMAND_TABLE",
    "DEFAULT_DEPTH",
    "DEFAULT_SINKS",
    "IDEMPOTENCY_KEYS_TABLE",
    "INBOX_TABLE",
    "KIT_ALLOWLIST",
    "KIT_SINKS",
    "OUTBOX_TABLE",
    "AllowlistHit",
    "CallGraph",
    "FitnessRules",
    "Hop",
    "InMemoryRepository",
    "InMemoryStore",
    "InMemoryUnitOfWork",
    "Report",
    "SaveRule",
    "SinkSpec",
    "SourceIndex",
    "Violation",
    "golden_list_problems",
    "pinned_names",
    "service_fitness",
    "service_save_rule",
    "source_index",
]
