"""The settings: outbox and inbox enablement rules, refused configurations, tracing, limits."""

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from outbox_kit.application.tracing import NoTracing, OpenTelemetryTracing, SpanKind, otlp_processor
from outbox_kit.runtime.container import build_tracing
from outbox_kit.runtime.settings import ServiceSettings
from outbox_kit.transports.envelope import LIMITS
from outbox_kit.transports.settings import MessageBusSettings
from pydantic import ValidationError

pytestmark = pytest.mark.unit


def settings(**values: object) -> ServiceSettings:
    return ServiceSettings(_env_file=None, **values)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("transport", "outbox", "inbox", "expected"),
    [
        ("inprocess", None, None, (False, False)),
        ("rabbitmq", None, None, (True, True)),
        ("nats", None, False, (True, False)),
        ("inprocess", True, True, (True, True)),
        ("redis", True, None, (True, True)),
    ],
)
def test_outbox_and_inbox_are_tri_state(
    transport: str, outbox: bool | None, inbox: bool | None, expected: tuple[bool, bool]
) -> None:
    bus = {"transport": transport, "enable_outbox": outbox, "enable_inbox": inbox}
    resolved = settings(message_bus=bus).message_bus
    assert (resolved.outbox_enabled, resolved.inbox_enabled) == expected


def test_a_broker_with_the_outbox_explicitly_off_is_refused() -> None:
    with pytest.raises(ValidationError, match="ENABLE_OUTBOX=false is refused"):
        settings(message_bus={"transport": "kafka", "enable_outbox": False})


@pytest.mark.parametrize(
    ("outbox", "bus", "message"),
    [
        # The limit and its margin (a fifth of the lease) must fit inside the lease.
        ({"lease_seconds": 15, "delivery_timeout_seconds": 12.5}, {}, "OUTBOX__DELIVERY_TIMEOUT_SECONDS"),
        # Against the default lease (300 s): the lease is not derived from the limit.
        ({"delivery_timeout_seconds": 250}, {}, "OUTBOX__DELIVERY_TIMEOUT_SECONDS"),
        # A publish is one part of a delivery: its own limit cannot be longer.
        ({"delivery_timeout_seconds": 5}, {"publish_timeout_seconds": 10}, "PUBLISH_TIMEOUT_SECONDS"),
        ({"delivery_timeout_seconds": 5}, {"publish_timeout_seconds": 5}, "PUBLISH_TIMEOUT_SECONDS"),
        # In-process, every consumer's run is part of one delivery: a hung consumer must leave
        # the others time to run.
        ({"delivery_timeout_seconds": 20}, {"handler_timeout_seconds": 20}, "HANDLER_TIMEOUT_SECONDS"),
        ({"delivery_timeout_seconds": 60}, {"handler_timeout_seconds": 90}, "HANDLER_TIMEOUT_SECONDS"),
    ],
)
def test_time_limits_that_do_not_fit_inside_the_lease_are_refused(
    outbox: dict[str, float], bus: dict[str, float], message: str
) -> None:
    with pytest.raises(ValidationError, match=message) as refused:
        settings(outbox=outbox, message_bus=bus)
    (error,) = refused.value.errors()
    assert "\n" not in error["msg"]


def test_time_limits_inside_the_lease_are_accepted() -> None:
    fits = settings(
        outbox={"lease_seconds": 15, "delivery_timeout_seconds": 12},
        message_bus={"publish_timeout_seconds": 10, "handler_timeout_seconds": 11},
    )
    assert (fits.outbox.delivery_timeout_seconds, fits.message_bus.handler_timeout_seconds) == (12, 11)
    # Exactly 80% of the lease fits, whatever float arithmetic makes of it (3 * 0.8 + 3 * 0.2 > 3).
    exact = settings(
        outbox={"lease_seconds": 3, "delivery_timeout_seconds": 3 * 0.8},
        message_bus={"publish_timeout_seconds": 1, "handler_timeout_seconds": 1},
    )
    assert exact.outbox.delivery_timeout_seconds == 3 * 0.8
    # A broker's consumers are not part of a delivery: their limit is their own.
    broker = settings(
        outbox={"delivery_timeout_seconds": 20},
        message_bus={"transport": "nats", "handler_timeout_seconds": 90},
    )
    assert broker.message_bus.handler_timeout_seconds == 90
    assert settings().message_bus.handler_timeout_seconds < settings().outbox.delivery_timeout_seconds
    with pytest.raises(ValidationError):
        settings(message_bus={"handler_timeout_seconds": 0})


def test_a_shortened_lease_alone_starts_with_time_limits_that_follow_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``OUTBOX__LEASE_SECONDS=5`` alone was refused (the default delivery limit, 60 s, did not
    fit), then, once that was set, refused again for the publish limit: one setting is enough."""
    monkeypatch.setenv("OUTBOX__LEASE_SECONDS", "5")
    shortened = ServiceSettings(_env_file=None)  # type: ignore[call-arg]
    delivery = shortened.outbox.delivery_timeout_seconds
    assert delivery + shortened.outbox.lease_margin_seconds <= shortened.outbox.lease_seconds
    assert shortened.message_bus.publish_timeout_seconds < delivery
    assert shortened.message_bus.handler_timeout_seconds < delivery  # in-process: inside a delivery
    # What was derived stays unset: only OUTBOX__LEASE_SECONDS was given.
    assert shortened.outbox.model_fields_set == {"lease_seconds"}
    assert shortened.message_bus.model_fields_set == set()
    # A broker's consumers are not part of a delivery: their limit keeps its default.
    monkeypatch.setenv("MESSAGE_BUS__TRANSPORT", "nats")
    broker = ServiceSettings(_env_file=None)  # type: ignore[call-arg]
    assert broker.message_bus.handler_timeout_seconds == settings().message_bus.handler_timeout_seconds
    assert broker.message_bus.publish_timeout_seconds < broker.outbox.delivery_timeout_seconds


def test_at_the_default_lease_the_time_limits_are_their_documented_defaults() -> None:
    defaults = settings()
    limits = (
        defaults.outbox.delivery_timeout_seconds,
        defaults.message_bus.publish_timeout_seconds,
        defaults.message_bus.handler_timeout_seconds,
    )
    assert limits == (60, 10, 30)


def test_an_empty_time_limit_is_unset_and_follows_the_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    """``.env.example`` leaves the limits empty (``OUTBOX__DELIVERY_TIMEOUT_SECONDS=``), so a
    ``.env`` copied from it does not pin them against a lease shortened later."""
    for name in ("OUTBOX__DELIVERY_TIMEOUT_SECONDS", "MESSAGE_BUS__PUBLISH_TIMEOUT_SECONDS"):
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("MESSAGE_BUS__HANDLER_TIMEOUT_SECONDS", "")
    monkeypatch.setenv("OUTBOX__LEASE_SECONDS", "5")
    empty = ServiceSettings(_env_file=None)  # type: ignore[call-arg]
    shortened = settings(outbox={"lease_seconds": 5})
    assert empty.outbox == shortened.outbox
    assert empty.message_bus == shortened.message_bus


def test_an_explicit_time_limit_that_fits_wins_over_the_derived_one() -> None:
    chosen = settings(outbox={"lease_seconds": 5, "delivery_timeout_seconds": 4})
    assert chosen.outbox.delivery_timeout_seconds == 4
    assert chosen.message_bus.publish_timeout_seconds < 4  # follows the explicit delivery limit
    derived = settings(outbox={"lease_seconds": 5}).message_bus.publish_timeout_seconds
    assert chosen.message_bus.publish_timeout_seconds > derived
    publish = settings(outbox={"lease_seconds": 5}, message_bus={"publish_timeout_seconds": 0.3})
    assert publish.message_bus.publish_timeout_seconds == 0.3
    handler = settings(outbox={"lease_seconds": 5}, message_bus={"handler_timeout_seconds": 0.2})
    assert handler.message_bus.handler_timeout_seconds == 0.2


def test_every_explicit_contradiction_is_refused_in_one_message() -> None:
    with pytest.raises(ValidationError) as refused:
        settings(
            outbox={"lease_seconds": 5, "delivery_timeout_seconds": 10},
            message_bus={"publish_timeout_seconds": 20, "handler_timeout_seconds": 20},
        )
    (error,) = refused.value.errors()
    assert "\n" not in error["msg"]
    for name in (
        "OUTBOX__DELIVERY_TIMEOUT_SECONDS (10) must be at most 4 s",
        "MESSAGE_BUS__PUBLISH_TIMEOUT_SECONDS (20) must be below",
        "MESSAGE_BUS__HANDLER_TIMEOUT_SECONDS (20) must be below",
    ):
        assert name in error["msg"]


def test_an_explicit_limit_contradicting_the_lease_says_what_was_derived() -> None:
    """The publish limit set, the delivery's not: the delivery's follows the lease, and the
    message says so (the publish limit contradicts the lease through it)."""
    with pytest.raises(ValidationError) as refused:
        settings(outbox={"lease_seconds": 5}, message_bus={"publish_timeout_seconds": 10})
    (error,) = refused.value.errors()
    assert error["msg"].startswith("Value error, MESSAGE_BUS__PUBLISH_TIMEOUT_SECONDS (10) must be below")
    assert "OUTBOX__DELIVERY_TIMEOUT_SECONDS (2.5, unset: from OUTBOX__LEASE_SECONDS (5))" in error["msg"]


# What production needs from AUTH__ (RFC 7518 3.2: an HS256 key of at least 256 bits).
PRODUCTION_AUTH = {
    "jwt_secret": "s" * 40,
    "jwt_issuer": "https://id.example",
    "jwt_audience": "order-service",
}


def test_production_refuses_the_dev_secret_and_unsigned_brokers() -> None:
    with pytest.raises(ValidationError, match="JWT_SECRET must be set"):
        settings(environment="production")
    with pytest.raises(ValidationError, match="SIGNING_KEYS must be set"):
        settings(environment="production", auth=PRODUCTION_AUTH, message_bus={"transport": "nats"})
    allowed = settings(
        environment="production",
        auth=PRODUCTION_AUTH,
        message_bus={"transport": "nats", "allow_unsigned": True},
    )
    assert allowed.message_bus.allow_unsigned


@pytest.mark.parametrize(
    ("auth", "message"),
    [
        ({"jwt_secret": "x"}, "at least 32 bytes for HS256, got 1"),
        ({"jwt_secret": "s" * 31}, "at least 32 bytes for HS256, got 31"),
        ({"jwt_algorithm": "HS512"}, "at least 64 bytes for HS512, got 40"),
    ],
)
def test_production_refuses_a_jwt_secret_shorter_than_its_hash(auth: dict[str, str], message: str) -> None:
    with pytest.raises(ValidationError, match=f"AUTH__JWT_SECRET must be {message}"):
        settings(environment="production", auth=PRODUCTION_AUTH | auth)
    multibyte = settings(environment="production", auth=PRODUCTION_AUTH | {"jwt_secret": "\u00e9" * 16})
    assert len(multibyte.auth.jwt_secret.get_secret_value().encode()) == 32  # counted in bytes


@pytest.mark.parametrize("missing", ["jwt_issuer", "jwt_audience"])
def test_production_requires_an_issuer_and_an_audience(missing: str) -> None:
    """Tokens are checked against both when set; production must set them, so a token minted
    for another service or by another issuer with the same secret is refused."""
    with pytest.raises(ValidationError, match=f"AUTH__{missing.upper()} must be set in production"):
        settings(environment="production", auth=PRODUCTION_AUTH | {missing: ""})


@pytest.mark.parametrize("secret", ["change-me-local-signing-key", "short-secret"])
def test_production_refuses_the_example_or_a_short_signing_key(secret: str) -> None:
    with pytest.raises(ValidationError, match=r"SIGNING_KEYS old: the example key or shorter than 16"):
        settings(
            environment="production",
            auth=PRODUCTION_AUTH,
            message_bus={"transport": "nats", "signing_keys": f"new:{'n' * 32},old:{secret}"},
        )
    strong = settings(
        environment="production",
        auth=PRODUCTION_AUTH,
        message_bus={"transport": "nats", "signing_keys": f"new:{'n' * 32}"},
    )
    assert list(strong.message_bus.signing_keys) == ["new"]


def test_signing_keys_parse_from_the_environment_form() -> None:
    parsed = settings(message_bus={"signing_keys": "k1:one,k2:two", "signing_key_id": "k2"}).message_bus
    assert {k: v.get_secret_value() for k, v in parsed.signing_keys.items()} == {"k1": "one", "k2": "two"}
    with pytest.raises(ValidationError, match="must look like"):
        settings(message_bus={"signing_keys": "nokey"})


def test_tracing_is_off_by_default_and_otel_builds_an_otlp_tracer() -> None:
    """``none`` passes the caller's traceparent on untouched; ``otel`` builds the SDK tracer with
    the OTLP exporter (configured by OpenTelemetry's own variables). No span is opened on it:
    shutting down would try to send it, and the spans themselves are test_tracing.py's."""
    plain = build_tracing(settings())
    assert isinstance(plain, NoTracing)
    assert (plain.tracer_provider, plain.active_traceparent()) == (None, None)
    traceparent = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    with plain.span("x", kind=SpanKind.INTERNAL, traceparent=traceparent) as span:
        assert span.traceparent == traceparent

    otel = build_tracing(settings(telemetry={"tracing": "otel"}))
    try:
        assert isinstance(otel, OpenTelemetryTracing)
        assert isinstance(otel.tracer_provider, TracerProvider)
        assert otel.active_traceparent() is None  # no span is open here
    finally:
        otel.shutdown()
    exporting = otlp_processor()  # what OpenTelemetryTracing reports to unless told otherwise
    try:
        assert isinstance(exporting, BatchSpanProcessor)
    finally:
        exporting.shutdown()


def test_the_header_total_can_never_refuse_headers_each_within_its_limit() -> None:
    """Every signed header at its own limit (an identity the API accepts at its byte limit) fits
    in the smallest MESSAGE_BUS__MAX_HEADER_BYTES accepted."""
    at_limits = sum(len(name) + limit for name, limit in LIMITS.items())
    field = MessageBusSettings.model_fields["max_header_bytes"]
    minimum = next(rule.ge for rule in field.metadata if hasattr(rule, "ge"))
    assert at_limits <= minimum
    assert settings(message_bus={"max_header_bytes": minimum}).message_bus.max_header_bytes == minimum
    with pytest.raises(ValidationError, match="max_header_bytes"):
        settings(message_bus={"max_header_bytes": at_limits - 1})


@pytest.mark.parametrize(
    ("outbox", "database"),
    [({}, {}), ({"batch_size": 500, "delivery_timeout_seconds": 200}, {"pool_size": 5})],
    ids=["defaults", "large-batch-small-pool"],
)
def test_the_default_liveness_outlasts_a_batch_whose_every_handler_hangs(
    outbox: dict[str, object], database: dict[str, object]
) -> None:
    """Handlers run a pool's worth at a time, each up to its time limit: a worker busy with a
    batch of hung handlers turns its loop only after all those rounds, and must not be
    restarted by /livez meanwhile (the default was the lease plus three idle intervals)."""
    chosen = settings(outbox=outbox, database=database)
    room = min(chosen.outbox.delivery_concurrency, chosen.database.pool_size)
    rounds = -(-chosen.outbox.batch_size // room)
    assert chosen.liveness_timeout_seconds > rounds * chosen.outbox.delivery_timeout_seconds
    assert chosen.liveness_timeout_seconds > chosen.outbox.lease_seconds
