"""Idempotency keys: a create command that a client retries runs once.

A client that did not get an answer (a timeout, a dropped connection) cannot know whether its
``POST`` created something; retrying blindly creates it twice. With an ``Idempotency-Key``
header the service records the key, a fingerprint of the request and the answer, in the SAME
transaction as what the command created (the unit of work), so a crash leaves neither a key
without its effect nor an effect without its key. Then, per tenant:

* the same key and the same request answer the first answer (same status, same bytes), without
  running the command again;
* the same key with another request raises :class:`IdempotencyKeyReusedError` (answered 422);
* two identical requests at once create one thing: the key row is inserted first, with
  ``INSERT ... ON CONFLICT DO NOTHING`` on its primary key ``(tenant, key)``. The second
  transaction's insert waits until the first one commits (PostgreSQL's unique index; SQLite's
  single writer), finds the row and answers what the first one recorded. If the first one
  fails, its row is rolled back with everything else and the waiting request runs the command.

A failed command records nothing (its transaction rolls back), so retrying it runs it again.
Keys are kept ``API__IDEMPOTENCY_KEY_RETENTION_HOURS`` (24 h by default) and then purged by the
retention cleanup; a key reused after that is a new request.

Use it from a route through :func:`run_once` (``runtime.http`` reads the header,
``runtime.errors`` answers its refusal)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar, cast

import sqlalchemy as sa

from outbox_kit.application.context import current_context
from outbox_kit.application.unit_of_work import (
    AdapterScope,
    TransactionalUnitOfWork,
    UnitOfWork,
    UnitOfWorkFactory,
)
from outbox_kit.domain import DomainError
from outbox_kit.persistence.tables import IDEMPOTENCY_KEYS_TABLE, upsert

KEYS = IDEMPOTENCY_KEYS_TABLE
NO_TENANT = ""
CLAIM_ATTEMPTS = 3
T = TypeVar("T")


class IdempotencyKeyReusedError(DomainError):
    """The key was used for another request of this tenant (answered 422)."""

    def __init__(self, key: str) -> None:
        super().__init__(
            f"Idempotency-Key {key!r} was already used for a different request; use a new key for"
            " a new request",
            code="idempotency_key_reused",
        )


@dataclass(frozen=True)
class IdempotencyKey:
    """A client's key and the operation it was sent to (``"POST /orders"``)."""

    key: str
    operation: str

    def fingerprint(self, request: object) -> str:
        """SHA-256 of the operation and the request (a JSON value, keys sorted): the same
        request sent again has the same fingerprint whatever its key order or spacing."""
        canonical = json.dumps([self.operation, request], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class Answer:
    """What a create command answered: its status, its JSON text, and whether it is a replay."""

    status_code: int
    body: str
    replayed: bool = False


def render(value: object) -> str:
    """JSON text as FastAPI's ``JSONResponse`` renders it (the first answer and the stored one)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


class SqlIdempotencyKeys:
    """The ``idempotency_keys`` rows of the current tenant, in the unit of work's transaction."""

    def __init__(self, scope: AdapterScope) -> None:
        self.scope = scope

    @staticmethod
    def _tenant() -> str:
        return current_context().tenant_id or NO_TENANT

    async def claim(self, key: IdempotencyKey, fingerprint: str) -> Answer | None:
        """Take ``key`` for this transaction (``None``), or the answer it already has."""
        session = self.scope.session
        tenant = self._tenant()
        for _ in range(CLAIM_ATTEMPTS):
            inserted = await session.exec(
                upsert(session, KEYS)
                .values(tenant_id=tenant, key=key.key, fingerprint=fingerprint, created_on=self.scope.now)
                .on_conflict_do_nothing(index_elements=[KEYS.c.tenant_id, KEYS.c.key])
                .returning(KEYS.c.key)
            )
            if inserted.first() is not None:
                return None
            found = (
                await session.exec(  # type: ignore[call-overload]
                    sa.select(KEYS.c.fingerprint, KEYS.c.status_code, KEYS.c.response_body).where(
                        KEYS.c.tenant_id == tenant, KEYS.c.key == key.key
                    )
                )
            ).first()
            if found is None:  # purged between the two statements: take it again
                continue
            if found.fingerprint != fingerprint:
                raise IdempotencyKeyReusedError(key.key)
            # Always true: the answer is recorded in the transaction that inserted the row, and
            # only committed rows are seen here.
            if found.status_code is not None and found.response_body is not None:
                return Answer(found.status_code, found.response_body, replayed=True)
        msg = f"Idempotency-Key {key.key!r} could not be claimed; retry the request"
        raise DomainError(msg, code="idempotency_key_busy")

    async def record(self, key: IdempotencyKey, answer: Answer) -> None:
        """Store the answer on the claimed key (same transaction as the command's writes)."""
        await self.scope.session.exec(
            sa.update(KEYS)
            .where(KEYS.c.tenant_id == self._tenant(), KEYS.c.key == key.key)
            .values(status_code=answer.status_code, response_body=answer.body)
        )


async def run_once(
    units: UnitOfWorkFactory,
    operation: Callable[[UnitOfWork], Awaitable[T]],
    *,
    present: Callable[[T], object],
    key: IdempotencyKey | None,
    request: object,
    status_code: int,
) -> Answer:
    """Run ``operation`` in a unit of work and commit; with a ``key``, at most once per tenant.

    ``present`` turns the operation's result into the JSON value of the answer (after the save:
    an aggregate carries its saved version); ``request`` is the JSON value of what was asked
    (the validated body), fingerprinted with ``key.operation``. Without a key the operation
    simply runs. Raises :class:`IdempotencyKeyReusedError` for a key already used with another
    request of the caller's tenant.
    """
    replayed: list[Answer] = []
    recorded: list[Answer] = []

    async def once(uow: TransactionalUnitOfWork) -> T | None:
        replayed.clear()  # a transient failure re-runs everything
        recorded.clear()
        if key is None:
            return await operation(uow)
        keys = uow.repository(SqlIdempotencyKeys)
        earlier = await keys.claim(key, key.fingerprint(request))
        if earlier is not None:
            replayed.append(earlier)
            return None
        result = await operation(uow)

        async def record() -> None:
            answer = Answer(status_code, render(present(result)))
            await keys.record(key, answer)
            recorded.append(answer)

        uow.before_commit(record)
        return result

    result = await units().run(once)
    if replayed:
        return replayed[0]  # the first answer, repeated
    if recorded:
        return recorded[0]  # the bytes stored with the key
    return Answer(status_code, render(present(cast("T", result))))
