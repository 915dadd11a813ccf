"""Bearer tokens: what a verified identity may hold, and what is refused before decoding."""

from datetime import UTC, datetime, timedelta
from typing import Any

import jwt
import pytest
from outbox_kit.runtime.identity_provider import InvalidTokenError
from outbox_kit.runtime.tokens import TokenService

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


# At the limits, in UTF-8 bytes: "\u00fc" is 2 bytes, so these are 32, 64 and 258 characters.
AT_LIMIT = {
    "tenant": "\u00fc" * 32,  # 64 bytes
    "sub": "\u00fc" * 64,  # 128 bytes
    "roles": ["\u00fc" * 127 + "a", "\u00fc" * 127 + "bc"],  # 255 + "," + 256 = 512 bytes
}
OVER_LIMIT = {
    "tenant": "\u00fc" * 40,  # 80 bytes in 40 characters: was accepted, every consumer refused it
    "sub": "\u00fc" * 65,  # 130 bytes in 65 characters
    "roles": ["\u00fc" * 127 + "a", "\u00fc" * 127 + "bcd"],  # 513 bytes in 259 characters
}


def test_identities_are_bounded_in_utf8_bytes_the_unit_consumers_bound_headers_in() -> None:
    """The consumers refuse a signed header over its byte limit (oversized_header): a value that
    fits in characters but not in bytes is refused at the token, never accepted and lost."""
    identity = service().verify(signed(**AT_LIMIT))
    assert (identity.tenant_id, identity.user_id, identity.roles) == (
        AT_LIMIT["tenant"],
        AT_LIMIT["sub"],
        tuple(AT_LIMIT["roles"]),
    )
    for claim, value in OVER_LIMIT.items():
        with pytest.raises(InvalidTokenError, match=f"'{claim}' .* bytes in UTF-8"):
            service().verify(signed(**{claim: value}))


@pytest.mark.parametrize("claim", ["exp", "nbf", "iat"])
@pytest.mark.parametrize(
    "value",
    [
        "9999999999",  # a string: PyJWT converts it with int() and accepted it
        1e308,  # a float: int(1e308) never expires
        9999999999.5,
        10**20,  # an integer no datetime holds
        True,
    ],
)
def test_times_that_are_not_plain_integers_are_refused(claim: str, value: object) -> None:
    """PyJWT reads a time with int(): a string, a float, 1e308 (a token that never expires) and
    True all passed. Each is refused (401 over HTTP), whichever check catches it first."""
    with pytest.raises(InvalidTokenError, match="invalid bearer token: "):
        service().verify(signed(**{claim: value}))
