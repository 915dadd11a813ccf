"""The time limits of a delivery, fitted to the lease in one place.

Three limits nest inside ``OUTBOX__LEASE_SECONDS``: a delivery
(``OUTBOX__DELIVERY_TIMEOUT_SECONDS``) must end inside its lease with a margin (a fifth of it), a
publish (``MESSAGE_BUS__PUBLISH_TIMEOUT_SECONDS``) before the delivery it is part of, and, on the
in-process transport, a consumer's handler run (``MESSAGE_BUS__HANDLER_TIMEOUT_SECONDS``) before
the delivery it runs inside. A limit not set (or set empty) follows the lease: its default, or
half of what encloses it when that is shorter (the delivery's, half the lease). So a shortened
lease alone is enough, and only limits set explicitly can contradict one another: every such
contradiction is refused at once, in one message.
"""

from __future__ import annotations

from typing import Any, TypeVar

from outbox_kit.processor.settings import FLOAT_SLACK, LEASE_MARGIN_FRACTION, OutboxSettings
from outbox_kit.transports.settings import MessageBusSettings

SettingsT = TypeVar("SettingsT", OutboxSettings, MessageBusSettings)

# (section, field) of every limit that follows the lease when unset.
FOLLOWING = (
    ("outbox", "delivery_timeout_seconds"),
    ("message_bus", "publish_timeout_seconds"),
    ("message_bus", "handler_timeout_seconds"),
)
# A derived limit is this share of what encloses it: half the lease leaves a batch room before
# its rows need renewing; half the delivery's, a publish or hung consumer room to end first.
SHARE = 0.5


def without_empty_limits(data: Any) -> Any:  # noqa: ANN401 (a settings source's raw input)
    """``OUTBOX__DELIVERY_TIMEOUT_SECONDS=`` (as ``.env.example`` has it) means unset, so that it
    follows the lease, rather than a number that does not parse."""
    if not isinstance(data, dict):
        return data
    cleaned = dict(data)
    for section, name in FOLLOWING:
        values = cleaned.get(section)
        if isinstance(values, dict) and values.get(name) == "":
            cleaned[section] = {key: value for key, value in values.items() if key != name}
    return cleaned


def fit_to_the_lease(
    outbox: OutboxSettings, bus: MessageBusSettings
) -> tuple[OutboxSettings, MessageBusSettings]:
    """The settings with every unset limit derived from the lease (still unset in
    ``model_fields_set``); a :class:`ValueError` naming every contradiction among those set."""
    delivery = _set_or(
        outbox,
        "delivery_timeout_seconds",
        min(_default(outbox, "delivery_timeout_seconds"), outbox.lease_seconds * SHARE),
    )
    publish = _set_or(
        bus, "publish_timeout_seconds", min(_default(bus, "publish_timeout_seconds"), delivery * SHARE)
    )
    handler = _default(bus, "handler_timeout_seconds")
    if not bus.is_broker:  # in-process, a consumer runs inside a delivery
        handler = min(handler, delivery * SHARE)
    handler = _set_or(bus, "handler_timeout_seconds", handler)
    fitted = (
        _with(outbox, delivery_timeout_seconds=delivery),
        _with(bus, publish_timeout_seconds=publish, handler_timeout_seconds=handler),
    )
    contradictions = _contradictions(*fitted)
    if contradictions:
        raise ValueError("; ".join(contradictions))
    return fitted


def _contradictions(outbox: OutboxSettings, bus: MessageBusSettings) -> list[str]:
    """What is wrong with the limits, one sentence each. A derived limit fits by construction,
    so each sentence names at least one limit that was set explicitly."""
    found = []
    lease, delivery = outbox.lease_seconds, outbox.delivery_timeout_seconds
    most = lease * (1 - LEASE_MARGIN_FRACTION)
    if delivery - most > FLOAT_SLACK:  # 2.4 of a 3 s lease fits exactly
        found.append(
            f"OUTBOX__DELIVERY_TIMEOUT_SECONDS ({delivery:g}) must be at most {most:g} s, 80% of "
            f"OUTBOX__LEASE_SECONDS ({_origin(outbox, 'lease_seconds')}): a delivery must end inside "
            "its lease with a margin; lower the time limit or lengthen the lease"
        )
    enclosing = f"OUTBOX__DELIVERY_TIMEOUT_SECONDS ({_delivery_origin(outbox)})"
    # An equal limit races the two timers, and an outage (the publish's time-out, not charged)
    # would be charged to the row (the delivery's).
    if bus.publish_timeout_seconds >= delivery:
        found.append(
            f"MESSAGE_BUS__PUBLISH_TIMEOUT_SECONDS ({bus.publish_timeout_seconds:g}) must be below "
            f"{enclosing}: a publish is part of a delivery, and a publish timing out in a broker "
            "outage must not be charged to the row"
        )
    # In-process, one hung consumer must leave the consumers after it time to run.
    if not bus.is_broker and bus.handler_timeout_seconds >= delivery:
        found.append(
            f"MESSAGE_BUS__HANDLER_TIMEOUT_SECONDS ({bus.handler_timeout_seconds:g}) must be below "
            f"{enclosing} with the in-process transport: its consumers run inside a delivery"
        )
    return found


def _set_or(settings: OutboxSettings | MessageBusSettings, name: str, derived: float) -> float:
    """The limit as set explicitly, else ``derived``."""
    return float(getattr(settings, name)) if name in settings.model_fields_set else derived


def _default(settings: OutboxSettings | MessageBusSettings, name: str) -> float:
    return float(type(settings).model_fields[name].default)


def _with(settings: SettingsT, **limits: float) -> SettingsT:
    """``settings`` with ``limits``, keeping what was set explicitly (``model_copy`` would count
    the derived limits as set)."""
    return type(settings).model_construct(
        _fields_set=set(settings.model_fields_set), **(dict(settings) | limits)
    )


def _origin(settings: OutboxSettings, name: str) -> str:
    value = f"{getattr(settings, name):g}"
    return value if name in settings.model_fields_set else f"{value}, the default"


def _delivery_origin(outbox: OutboxSettings) -> str:
    value = f"{outbox.delivery_timeout_seconds:g}"
    if "delivery_timeout_seconds" in outbox.model_fields_set:
        return value
    return f"{value}, unset: from OUTBOX__LEASE_SECONDS ({_origin(outbox, 'lease_seconds')})"
