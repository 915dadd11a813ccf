"""The polled tables by the name operators use for them (``outbox``, ``internal_commands``)."""

from __future__ import annotations

from .tables import POLLED_TABLES, PolledTable


class UnknownSourceError(LookupError):
    """The operator named a source this service does not have."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown source {name!r}; use one of: {', '.join(POLLED_TABLES)}")


def source_named(name: str) -> PolledTable:
    try:
        return POLLED_TABLES[name]
    except KeyError:
        raise UnknownSourceError(name) from None
