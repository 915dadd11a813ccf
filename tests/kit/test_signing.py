"""Context headers are signed; a consumer verifies before trusting anything."""

from datetime import UTC, datetime

import pytest
from outbox_kit.application.context import CapturedContext
from outbox_kit.transports.envelope import (
    SIGNATURE,
    TENANT_ID,
    Envelope,
    RejectedMessageError,
    Signer,
    read_envelope,
)

pytestmark = pytest.mark.unit
BODY = b'{"order_id": "o-1"}'


def envelope() -> Envelope:
    context = CapturedContext("acme", "alice", "clerk", "corr-1", "00-" + "a" * 32 + "-" + "b" * 16 + "-01")
    return Envelope("m-1", "orders.order-placed.v1", datetime(2026, 1, 1, tzinfo=UTC), BODY, context)


def signed_headers(signer: Signer) -> dict[str, str]:
    e = envelope()
    return signer.sign(e.headers(), e.body)


def test_a_signed_message_verifies_and_restores_the_context() -> None:
    signer = Signer({"k1": "secret"}, "k1", allow_unsigned=False)
    read = read_envelope(signed_headers(signer), BODY, signer)
    assert (read.message_id, read.context.tenant_id, read.context.user_id) == ("m-1", "acme", "alice")


def test_keys_rotate_old_key_still_verifies() -> None:
    old = Signer({"k1": "one"}, "k1", allow_unsigned=False)
    rotated = Signer({"k1": "one", "k2": "two"}, "k2", allow_unsigned=False)
    read_envelope(signed_headers(old), BODY, rotated)
    assert signed_headers(rotated)[SIGNATURE].startswith("k2:")


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda h, b: ({**h, TENANT_ID: "evil"}, b), "bad_signature"),
        (lambda h, b: (h, b + b" "), "bad_signature"),
        (lambda h, b: ({k: v for k, v in h.items() if k != SIGNATURE}, b), "unsigned"),
        (lambda h, b: ({**h, SIGNATURE: "nope:00"}, b), "bad_signature"),
        (lambda h, b: ({**h, "x-user-roles": "r" * 600}, b), "oversized_header"),
        (lambda h, b: ({**h, "x-correlation-id": 5}, b), "malformed_header"),
    ],
)
def test_tampered_unsigned_oversized_or_malformed_messages_are_rejected(tamper, reason: str) -> None:
    signer = Signer({"k1": "secret"}, "k1", allow_unsigned=False)
    headers, body = tamper(signed_headers(signer), BODY)
    with pytest.raises(RejectedMessageError) as rejected:
        read_envelope(headers, body, signer)
    assert rejected.value.reason == reason


def test_headers_over_the_total_limit_are_rejected() -> None:
    signer = Signer({"k1": "secret"}, "k1", allow_unsigned=False)
    headers = signed_headers(signer) | {"x-user-roles": "r" * 500}
    with pytest.raises(RejectedMessageError) as rejected:
        read_envelope(headers, BODY, signer, max_header_bytes=600)
    assert rejected.value.reason == "oversized_header"


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-tenant-id", "acme\r\nx-forged: 1"),
        ("x-user-id", "alice\x00"),
        ("x-user-roles", "clerk,\x1b[31madmin"),
        ("x-message-id", "m-1\n2026-01-01 ERROR forged"),
        ("x-event-name", "orders.order-placed.v1\x85"),
    ],
)
def test_an_identity_header_with_a_control_character_is_refused_even_when_signed(
    header: str, value: str
) -> None:
    """A producer holding a key (or a bug in one) cannot put a control character into the
    tenant, user, roles, message id or event name that a consumer stores and logs: the same rule
    the API applies to a token's claims."""
    signer = Signer({"k1": "secret"}, "k1", allow_unsigned=False)
    e = envelope()
    headers = e.headers() | {header: value}
    with pytest.raises(RejectedMessageError) as rejected:
        read_envelope(signer.sign(headers, e.body), e.body, signer)
    assert rejected.value.reason == "malformed_header"
    assert header in rejected.value.detail
