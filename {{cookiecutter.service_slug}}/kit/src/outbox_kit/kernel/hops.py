"""The asynchronous hops (an outbox row, an internal command, a broker message) capture the ambient
context when written and restore it when delivered, through this one pair of helpers, so the
hops cannot drift apart. A restore always replaces the whole context (never merges), so one
row's identity can never answer for the next row of the same batch."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .context_values import check_identity, new_correlation_id
from .request_context import CapturedContext, RequestContext, current_context, use_context
from .roles import flatten_roles, split_roles


def capture() -> CapturedContext:
    """Snapshot the ambient context for persistence (roles flattened and capped); an identity
    over its byte limit is refused (``InvalidContextError``) before any row carries it."""
    context = current_context()
    check_identity(context.tenant_id, context.user_id)
    return CapturedContext(
        tenant_id=context.tenant_id,
        user_id=context.user_id,
        user_roles=flatten_roles(context.roles),
        correlation_id=context.correlation_id,
        traceparent=context.traceparent,
    )


def rebuild(captured: CapturedContext, *, authentication_type: str) -> RequestContext:
    """Turn a captured context back into a live one, naming the hop it came back from."""
    return RequestContext(
        tenant_id=captured.tenant_id,
        user_id=captured.user_id,
        roles=split_roles(captured.user_roles),
        correlation_id=captured.correlation_id or new_correlation_id(),
        traceparent=captured.traceparent,
        authentication_type=authentication_type if captured.user_id else None,
    )


@contextmanager
def restored(captured: CapturedContext, *, authentication_type: str) -> Iterator[RequestContext]:
    """Restore a captured context for one delivery (outbox row, command or message)."""
    with use_context(rebuild(captured, authentication_type=authentication_type)) as context:
        yield context
