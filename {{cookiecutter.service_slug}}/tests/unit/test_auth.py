"""Bearer tokens: what a verified identity may hold, and what is refused before decoding."""

from datetime import UTC, datetime, timedelta
from typing import Any

import jwt
import pytest

from {{ cookiecutter.package_name }}.building_blocks.web.auth import (
    InvalidTokenError,
    TokenService,
)

pytestmark = pytest.mark.unit
SECRET = "unit-test-secret-of-at-least-32-bytes!"


def service() -> TokenService:
    return TokenService(secret=SECRET, clock=lambda: datetime.now(UTC))


def signed(**claims: Any) -> str:
    now = datetime.now(UTC)
    base = {
        "sub": "alice",
        "tenant": "acme",
        "roles": ["clerk"],
        "iat": now,
        "exp": now + timedelta(minutes=5),
    }
    return jwt.encode(base | claims, SECRET, algorithm="HS256")


@pytest.mark.parametrize(
    ("claim", "value"),
    [
        ("tenant", "acme\r\nX-Tenant: globex"),
        ("tenant", "ac\x00me"),
        ("tenant", "acme\x7f"),
        ("tenant", "\ud800acme"),
        ("sub", "alice\r\n"),
        ("sub", "al\x00ice"),
        ("sub", "alice\x85"),
        ("roles", ["clerk", "outbox-admin\r\nforged"]),
        ("roles", ["ad\x00min"]),
        ("roles", "clerk,ad\tmin"),
    ],
)
def test_an_identity_with_a_control_character_is_refused(claim: str, value: object) -> None:
    """Tenant, user and roles are written into every table, header and log line: a CRLF or a
    NUL in them is refused (401 over HTTP), never stored."""
    with pytest.raises(InvalidTokenError, match=f"'{claim}' must not contain control characters"):
        service().verify(signed(**{claim: value}))


def test_ordinary_identities_pass() -> None:
    identity = service().verify(signed(sub="ann.o'brien@example.com", tenant="Acme GmbH", roles=["a b", "é"]))
    assert (identity.user_id, identity.tenant_id, identity.roles) == (
        "ann.o'brien@example.com",
        "Acme GmbH",
        ("a b", "é"),
    )


def test_an_80_kb_token_is_refused_without_being_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    token = signed(pad="p" * 80_000)

    def must_not_decode(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("an over-long token was decoded")

    monkeypatch.setattr(jwt, "decode", must_not_decode)
    with pytest.raises(InvalidTokenError, match="longer than 8192 characters"):
        service().verify(token)


def test_a_configured_issuer_and_audience_are_required_in_every_token() -> None:
    strict = TokenService(
        secret=SECRET, issuer="https://id.example", audience="orders", clock=lambda: datetime.now(UTC)
    )
    good = signed(iss="https://id.example", aud="orders")
    assert strict.verify(good).user_id == "alice"
    for claims in ({}, {"iss": "https://id.example"}, {"aud": "orders"}, {"iss": "other", "aud": "orders"}):
        with pytest.raises(InvalidTokenError):
            strict.verify(signed(**claims))
