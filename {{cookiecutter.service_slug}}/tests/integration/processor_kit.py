"""Helpers for driving a processor source by hand in tests."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from outbox_kit.application.observability import (
    SpanKind,
    TimeLimit,
)
from outbox_kit.persistence.tables import (
    COMMAND_TABLE,
    OUTBOX_TABLE,
)
from outbox_kit.processor.claim import ClaimedRow
from outbox_kit.processor.cycle import (
    TableSource,
)
from outbox_kit.processor.processor import SourceSettings
from outbox_kit.transports.bus import Delivered

from {{ cookiecutter.package_name }}.composition.relay import source_settings
from {{ cookiecutter.package_name }}.container import Container

from ..conftest import FakeClock


@dataclass
class ScriptedDeliverer:
    """Delivers by running ``script(row)``; records what it was asked to deliver."""

    script: Callable[[ClaimedRow], Awaitable[Delivered]] | None = None
    delivered: list[ClaimedRow] = field(default_factory=list)
    fresh_lease: bool = True  # like a handler; False like a publish (renewed only when short)

    def needs_fresh_lease(self, row: ClaimedRow) -> bool:
        del row
        return self.fresh_lease

    def span_kind(self, row: ClaimedRow) -> SpanKind:
        del row
        return SpanKind.INTERNAL

    async def deliver(self, row: ClaimedRow, token: uuid.UUID, limit: TimeLimit) -> Delivered:
        del token
        self.delivered.append(row)
        if self.script is not None:
            async with limit():  # the script stands for the handlers or the publish
                return await self.script(row)
        return Delivered.NEEDS_STAMP


def outbox_source(
    container: Container, deliverer: Any, clock: FakeClock | None = None, **overrides: Any
) -> TableSource:
    return polled_source(container, "outbox", deliverer, clock, **overrides)


def command_source(container: Container, clock: FakeClock | None = None, **overrides: Any) -> TableSource:
    """The internal-command processor's source with the service's deliverer, on ``clock``."""
    return polled_source(container, "internal_commands", container.command_deliverer(), clock, **overrides)


def polled_source(
    container: Container,
    name: str,
    deliverer: Any,
    clock: FakeClock | None = None,
    *,
    instance_id: str = "processor-a",
    **overrides: Any,
) -> TableSource:
    table, column = (OUTBOX_TABLE, "event_name") if name == "outbox" else (COMMAND_TABLE, "command_name")
    settings = source_settings(container.settings())
    values = {**settings.__dict__, **overrides}
    return TableSource(
        name=name,
        table=table,
        name_column=column,
        settings=SourceSettings(**values),
        database=container.database(),
        deliverer=deliverer,
        clock=clock or container.clock(),
        instance_id=instance_id,
        metrics=container.metrics(),
    )


async def insert_rows(
    container: Container, rows: list[dict[str, Any]], table: sa.Table = OUTBOX_TABLE
) -> list[uuid.UUID]:
    """Insert raw rows into a polled table, the outbox by default (seq assigned in list order)."""
    ids = []
    async with container.database().session() as session:
        for values in rows:
            row_id = values.pop("id", None) or uuid.uuid4()
            ids.append(row_id)
            statement = sa.insert(table).values(id=row_id, **values)
            if container.database().dialect != "postgresql":
                next_seq = sa.select(sa.func.coalesce(sa.func.max(table.c.seq), 0) + 1)
                statement = statement.values(seq=next_seq.scalar_subquery())
            await session.exec(statement)  # type: ignore[call-overload]
        await session.commit()
    return ids


def row(
    name: str, at: datetime, key: str | None = None, kind: str = "integration", **extra: Any
) -> dict[str, Any]:
    return {
        "event_name": name,
        "kind": kind,
        "payload": extra.pop("payload", {}),
        "occurred_on": at,
        "available_on": at,
        "ordering_key": key,
        "retry_count": 0,
        **extra,
    }


async def state(container: Container, row_id: uuid.UUID, table: sa.Table = OUTBOX_TABLE) -> Any:
    async with container.database().session() as session:
        return (await session.exec(sa.select(table).where(table.c.id == row_id))).one()  # type: ignore[call-overload]


async def all_rows(container: Container) -> list[Any]:
    async with container.database().session() as session:
        return list((await session.exec(sa.select(OUTBOX_TABLE).order_by(OUTBOX_TABLE.c.seq))).all())  # type: ignore[call-overload]
