"""What a failed savepoint gives back to the unit of work.

The database rolls back to the savepoint on its own; the unit of work must do the same with what
it holds in memory: aggregates tracked before the savepoint get back their state and pending
events (deep copies taken on entry, the pending event objects shared, since the commit removes
them by identity), aggregates first tracked inside it are forgotten, and integration events,
internal commands, stamps and inbox rows collected inside it are dropped.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from ..domain.aggregate import AggregateRoot


@dataclass(frozen=True)
class Snapshot:
    """The unit of work as it was when a savepoint opened."""

    tracked: list[tuple[AggregateRoot, Any]]
    states: list[dict[str, Any]]
    lengths: dict[str, int]  # how many items each collected list held


def aggregate_state(aggregate: AggregateRoot) -> dict[str, Any]:
    """A deep copy of the aggregate's attributes, sharing the pending event objects themselves."""
    state = {key: value for key, value in vars(aggregate).items() if key != "_pending_events"}
    copied = copy.deepcopy(state)
    copied["_pending_events"] = list(aggregate.pending_events)
    return copied


def take(tracked: list[tuple[AggregateRoot, Any]], collected: dict[str, list[Any]]) -> Snapshot:
    return Snapshot(
        tracked=list(tracked),
        states=[aggregate_state(aggregate) for aggregate, _ in tracked],
        lengths={name: len(items) for name, items in collected.items()},
    )


def restore(snapshot: Snapshot, collected: dict[str, list[Any]]) -> list[tuple[AggregateRoot, Any]]:
    """Put the aggregates and the collected lists back; returns the tracked list to keep."""
    for (aggregate, _), state in zip(snapshot.tracked, snapshot.states, strict=True):
        vars(aggregate).clear()
        vars(aggregate).update(state)
    for name, items in collected.items():
        del items[snapshot.lengths[name] :]
    return list(snapshot.tracked)
