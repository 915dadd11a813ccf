"""Request context: validation, role flattening, capture and restore."""

import pytest
from outbox_kit.application.context import (
    MAX_ROLES_BYTES,
    MAX_TENANT_BYTES,
    MAX_USER_BYTES,
    InvalidContextError,
    RequestContext,
    capture_context,
    current_context,
    flatten_roles,
    restored,
    use_context,
    validate_correlation_id,
)
from outbox_kit.persistence.tables import COMMAND_TABLE, OUTBOX_TABLE, InboxMessage
from outbox_kit.transports.envelope import LIMITS, TENANT_ID, USER_ID, USER_ROLES

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("letter", ["r", "\u00fc"])
def test_roles_are_flattened_and_capped_at_512_bytes_on_role_boundaries(letter: str) -> None:
    roles = [f"{letter}ole-{i:04d}" for i in range(100)]
    flattened = flatten_roles(roles)
    assert flattened is not None
    assert 500 < len(flattened.encode()) <= MAX_ROLES_BYTES
    assert flattened.split(",") == roles[: len(flattened.split(","))]


@pytest.mark.parametrize("role", ["a,b", " ", "", "outbox-admin ", " outbox-admin", "outbox,-admin"])
def test_a_role_the_flattened_form_would_change_is_refused_not_cleaned(role: str) -> None:
    """Cleaned (``"outbox-admin "`` stored as ``outbox-admin``), a role refused by the API's exact
    check would be granted to every consumer that restores the context: it is refused instead,
    wherever a context is captured."""
    with pytest.raises(InvalidContextError, match="role"):
        flatten_roles(["clerk", role])
    refused = RequestContext(tenant_id="t", user_id="u", roles=("clerk", role))
    with use_context(refused), pytest.raises(InvalidContextError, match="role"):
        capture_context()
    with use_context(RequestContext(tenant_id="t", user_id="u", roles=("clerk", "outbox admin", "é"))):
        assert capture_context().user_roles == "clerk,outbox admin,é"


def test_one_byte_limit_per_identity_value_for_headers_and_columns() -> None:
    """The consumers bound the signed headers with the very limits the API bounds claims with,
    and every column that stores the value holds it: varchar(n) counts characters, and a value
    of n bytes never has more than n characters."""
    assert (LIMITS[TENANT_ID], LIMITS[USER_ID], LIMITS[USER_ROLES]) == (
        MAX_TENANT_BYTES,
        MAX_USER_BYTES,
        MAX_ROLES_BYTES,
    )
    inbox = InboxMessage.__table__  # type: ignore[attr-defined]
    columns = [
        *((table.c.tenant_id, MAX_TENANT_BYTES) for table in (OUTBOX_TABLE, COMMAND_TABLE, inbox)),
        *((table.c.user_id, MAX_USER_BYTES) for table in (OUTBOX_TABLE, COMMAND_TABLE)),
        *((table.c.user_roles, MAX_ROLES_BYTES) for table in (OUTBOX_TABLE, COMMAND_TABLE)),
    ]
    assert [(column, column.type.length >= limit) for column, limit in columns] == [
        (column, True) for column, _ in columns
    ]


def test_capture_refuses_an_identity_no_consumer_would_accept() -> None:
    """An identity set by other means than a token (a script's own context) is checked where it
    becomes a row: over its byte limit, nothing is written that every consumer would refuse."""
    for context in (
        RequestContext(tenant_id="\u00fc" * 33, user_id="u"),
        RequestContext(tenant_id="t", user_id="\u00fc" * 65),
    ):
        with use_context(context), pytest.raises(InvalidContextError, match="bytes in UTF-8"):
            capture_context()
    with use_context(RequestContext(tenant_id="\u00fc" * 32, user_id="\u00fc" * 64)):
        assert capture_context().tenant_id == "\u00fc" * 32


@pytest.mark.parametrize("value", ["x" * 65, "", "-starts-with-dash", "has space", "semi;colon", "é"])
def test_bad_correlation_ids_are_refused(value: str) -> None:
    with pytest.raises(InvalidContextError):
        validate_correlation_id(value)


def test_capture_and_restore_replace_rather_than_merge() -> None:
    with use_context(RequestContext(tenant_id="t1", user_id="u1", roles=("a", "b"), correlation_id="c1")):
        captured = capture_context()
    assert captured.user_roles == "a,b"
    with use_context(RequestContext(tenant_id="other", user_id="intruder")):
        with restored(captured, authentication_type="outbox") as context:
            assert (context.tenant_id, context.user_id, context.roles) == ("t1", "u1", ("a", "b"))
            assert context.authentication_type == "outbox"
            assert current_context() is context
        assert current_context().user_id == "intruder"
