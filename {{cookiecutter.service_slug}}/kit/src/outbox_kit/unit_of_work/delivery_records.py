"""What a unit of work that delivers a message writes besides the handler's effects.

The processed stamp of the row it delivers (guarded by the lease token: if another processor
took the row, the stamp matches nothing and ``LeaseLostError`` rolls the whole transaction back,
so a redelivery cannot double an effect), or the inbox row of the message it consumes. Both are
written in the same transaction as the handler's effects, just before the commit.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime

from sqlmodel.ext.asyncio.session import AsyncSession

from ..persistence.audit_tables import InboxMessage
from ..polling.leases import LeaseLostError, LeaseStore


@dataclass(frozen=True)
class Stamp:
    store: LeaseStore
    row_id: uuid.UUID
    token: uuid.UUID


@dataclass
class DeliveryRecords:
    """The stamps and inbox rows one unit of work writes at commit."""

    stamps: list[Stamp] = field(default_factory=list)
    inbox: list[InboxMessage] = field(default_factory=list)

    def stamp(self, store: LeaseStore, row_id: uuid.UUID, token: uuid.UUID) -> None:
        self.stamps.append(Stamp(store, row_id, token))

    async def apply(self, session: AsyncSession, now: datetime) -> None:
        for stamp in self.stamps:
            connection = await session.connection()
            if not await stamp.store.stamp_processed(connection, [stamp.row_id], stamp.token, now):
                msg = f"lease on {stamp.store.table.name} row {stamp.row_id} was lost"
                raise LeaseLostError(msg)
        for row in self.inbox:
            session.add(row)
