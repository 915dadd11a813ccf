"""Who is acting, for which tenant, under which correlation: the ambient request context.

The API sets it from the bearer token and the ``X-Correlation-Id`` header; every asynchronous hop
(outbox row, internal command, broker message) captures it when written and restores it when
delivered, through the one pair of helpers below, so the hops cannot drift apart. A restore
always *replaces* the whole context (never merges), so one row's identity can never answer for
the next row of the same batch.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RequestContext:
    """The identity and correlation a piece of work runs under."""

    tenant_id: str | None = None
    user_id: str | None = None
    roles: tuple[str, ...] = ()
    correlation_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    traceparent: str | None = None
    authentication_type: str | None = None

    @property
    def is_authenticated(self) -> bool:
        return self.user_id is not None

    def has_role(self, role: str) -> bool:
        return role in self.roles


@dataclass(frozen=True, slots=True)
class CapturedContext:
    """The persisted form of a context: what an outbox row, a command or a header carries."""

    tenant_id: str | None
    user_id: str | None
    user_roles: str | None
    correlation_id: str | None
    traceparent: str | None


_current: ContextVar[RequestContext | None] = ContextVar("request_context", default=None)


def current_context() -> RequestContext:
    """The ambient context; an anonymous one (with a fresh correlation id) when none is set."""
    context = _current.get()
    if context is None:
        context = RequestContext()
        _current.set(context)
    return context


@contextmanager
def use_context(context: RequestContext) -> Iterator[RequestContext]:
    """Run a block under ``context``, replacing (not merging) whatever was ambient."""
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)
