"""Messages and their registry: what a service sends, and how a stored or received name and
payload become a message again.

**Messages that leave the aggregate**, integration events and internal commands, are pydantic
models because they cross a process boundary (a broker, or a row read back later), so their
payload is validated on the way in and documented in AsyncAPI. Domain events
stay plain dataclasses in ``outbox_kit.domain`` so the domain layer imports nothing but the
standard library.

**The registry** resolves stored message names back to classes, with upcasters for old payload
shapes. It is filled once at start-up by the composition root from every module's messages.
It refuses, at start-up rather than at delivery: two classes with one name, an upcaster whose
source is registered twice or is still declared by a class, an upcaster chain that loops, and a
chain that ends at a name no class declares. At delivery a name that still does not resolve
raises ``UnknownMessageError``, which the processor treats as ``type_unresolvable``."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from outbox_kit.domain import Message, check_ordering_key, utc_now


class _ModelMessage(Message, BaseModel):
    """What both pydantic message kinds share: frozen, tolerant of new fields, a checked key."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    def model_post_init(self, _context: Any, /) -> None:  # noqa: ANN401 (pydantic's signature)
        check_ordering_key(self.message_name, self.ordering_key())


class IntegrationEvent(_ModelMessage):
    """A fact published to other services. Delivered only by the outbox processor."""

    event_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    occurred_on: datetime = Field(default_factory=utc_now)
    aggregate_id: str | None = Field(
        default=None, description="The aggregate this event is about; its ordering key if ordered"
    )

    def ordering_key(self) -> str | None:
        return self.aggregate_id if self.ordered else None


class InternalCommand(_ModelMessage):
    """A deferred instruction to this service itself, run by its own processor."""

    command_id: uuid.UUID = Field(default_factory=uuid.uuid4)


Payload = dict[str, Any]
Upcaster = Callable[[Payload], Payload]
M = TypeVar("M", bound=Message)


class RegistryError(Exception):
    """The registered messages or upcasters are inconsistent (raised at start-up)."""


class UnknownMessageError(LookupError):
    """A stored message name (after upcasting) matches no registered class."""


class MalformedPayloadError(ValueError):
    """A stored payload no longer validates against its class."""


class MessageRegistry:
    """Stable name <-> class, JSON payloads, and the upcaster chains between versions."""

    def __init__(self) -> None:
        self._classes: dict[str, type[Message]] = {}
        self._upcasters: dict[str, tuple[str, Upcaster]] = {}
        self._adapters: dict[type[Message], TypeAdapter[Any]] = {}

    def register(self, *classes: type[Message]) -> None:
        for cls in classes:
            if not cls.has_name():
                msg = f"{cls.__qualname__} declares no name (class X(Base, name='ctx.x.v1'))"
                raise RegistryError(msg)
            existing = self._classes.get(cls.message_name)
            if existing is not None and existing is not cls:
                msg = (
                    f"message name {cls.message_name!r} is declared by both "
                    f"{existing.__module__}.{existing.__qualname__} and "
                    f"{cls.__module__}.{cls.__qualname__}"
                )
                raise RegistryError(msg)
            self._classes[cls.message_name] = cls

    def add_upcaster(self, source: str, target: str, upcast: Upcaster) -> None:
        """Teach the registry to read ``source`` payloads as ``target`` (one version step)."""
        if source in self._upcasters:
            msg = f"upcaster for {source!r} is registered twice"
            raise RegistryError(msg)
        if source == target:
            msg = f"upcaster {source!r} -> {target!r} points at itself"
            raise RegistryError(msg)
        self._upcasters[source] = (target, upcast)

    def validate(self) -> None:
        """Refuse loops, dead ends and shadowed classes in the upcaster chains (call once after
        registration)."""
        for start in self._upcasters:
            if start in self._classes:
                cls = self._classes[start]
                msg = (
                    f"{start!r} has an upcaster and is also declared by {cls.__module__}.{cls.__qualname__}: "
                    "stored rows of that name would be upcast and never read as that class"
                )
                raise RegistryError(msg)
            seen = [start]
            name = start
            while name in self._upcasters:
                name = self._upcasters[name][0]
                if name in seen:
                    chain = " -> ".join([*seen, name])
                    msg = f"upcaster chain loops: {chain}"
                    raise RegistryError(msg)
                seen.append(name)
            if name not in self._classes:
                chain = " -> ".join(seen)
                msg = f"upcaster chain {chain} ends at {name!r}, which no class declares"
                raise RegistryError(msg)

    @property
    def names(self) -> Mapping[str, type[Message]]:
        return dict(self._classes)

    def classes(self, base: type[M]) -> list[type[M]]:
        return [cls for cls in self._classes.values() if issubclass(cls, base)]

    def is_known(self, name: str) -> bool:
        return self._final_name(name) in self._classes

    def _final_name(self, name: str) -> str:
        while name in self._upcasters:
            name = self._upcasters[name][0]
        return name

    def _adapter(self, cls: type[Message]) -> TypeAdapter[Any]:
        adapter = self._adapters.get(cls)
        if adapter is None:
            adapter = TypeAdapter(cls)
            self._adapters[cls] = adapter
        return adapter

    def dump(self, message: Message) -> Payload:
        """The JSON-safe payload of ``message`` (what an outbox row or a broker body holds)."""
        if isinstance(message, BaseModel):
            return message.model_dump(mode="json")
        # Domain events are dataclasses (the domain layer imports no pydantic).
        return cast("Payload", self._adapter(type(message)).dump_python(message, mode="json"))

    def upcast(self, name: str, payload: Payload) -> tuple[str, Payload]:
        """The current name and payload shape of a stored message, through the upcaster chain
        (no upcaster for ``name``: ``name`` and ``payload`` themselves, not a copy)."""
        current, payload, _steps = self._upcast(name, payload)
        return current, payload

    def _upcast(self, name: str, payload: Payload) -> tuple[str, Payload, int]:
        steps = 0
        while name in self._upcasters:
            name, step = self._upcasters[name]
            payload = step(dict(payload))
            steps += 1
        return name, payload, steps

    def load(self, name: str, payload: Payload) -> Message:
        """Rebuild a message from its stored name and payload, upcasting old versions."""
        current, payload, steps = self._upcast(name, payload)
        cls = self._classes.get(current)
        if cls is None:
            hint = f" (upcast from {name!r} in {steps} steps)" if steps else ""
            msg = f"no registered message is named {current!r}{hint}"
            raise UnknownMessageError(msg)
        try:
            return cast("Message", self._adapter(cls).validate_python(payload))
        except ValidationError as exc:
            # Field paths and reasons only: the values may be personal data, and this message
            # ends up in last_error, which operators read (dead-letter lists, explain).
            problems = "; ".join(
                f"{'.'.join(str(part) for part in error['loc']) or '<payload>'}: {error['msg']}"
                for error in exc.errors(include_url=False, include_input=False, include_context=False)
            )
            msg = f"payload of {current!r} does not validate: {exc.error_count()} error(s): {problems}"
            raise MalformedPayloadError(msg) from exc

    def register_all(self, classes: Iterable[type[Message]]) -> None:
        self.register(*classes)
