"""Where handlers are registered: the single source the dispatcher, the processors, the
consumers and the architecture tests all read.

A handler receives the message and the unit of work that owns the current transaction. It may
load and mutate aggregates, raise events, enqueue integration events and schedule internal
commands; it never commits. The unit of work persists its effects together with the delivery
record (processed stamp or inbox row), which is what makes a redelivery safe. See
``tests/architecture`` for the rule that proves it statically.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from ..domain.events import DomainEvent, Message
from .handler_types import Consumer, Handler, M
from .messages import IntegrationEvent, InternalCommand

K = TypeVar("K", bound=Message)


class HandlerRegistryError(Exception):
    """Handlers are registered inconsistently (raised at start-up)."""


def _checked(message_type: type[Message], kind: type[K]) -> type[K]:
    """message_type as a kind, or a registration error naming both."""
    if not issubclass(message_type, kind):
        article = "an" if kind.__name__[0] in "AEIOU" else "a"
        msg = f"{message_type.__qualname__} is not {article} {kind.__name__}"
        raise HandlerRegistryError(msg)
    return message_type


class HandlerRegistry:
    """Domain-event handlers, integration-event consumers and internal-command handlers."""

    def __init__(self) -> None:
        self._domain: dict[type[DomainEvent], list[Handler[Any]]] = defaultdict(list)
        self._consumers: dict[str, Consumer[Any]] = {}
        self._commands: dict[type[InternalCommand], Handler[Any]] = {}

    def on_domain_event(self, event_type: type[M], handler: Handler[M]) -> None:
        self._domain[_checked(event_type, DomainEvent)].append(handler)

    def consume(self, name: str, event_type: type[M], handler: Handler[M]) -> None:
        _checked(event_type, IntegrationEvent)
        if name in self._consumers:
            msg = f"consumer name {name!r} is registered twice"
            raise HandlerRegistryError(msg)
        self._consumers[name] = Consumer(name, event_type, handler)

    def on_command(self, command_type: type[M], handler: Handler[M]) -> None:
        command = _checked(command_type, InternalCommand)
        if command in self._commands:
            msg = f"{command.__qualname__} already has a handler"
            raise HandlerRegistryError(msg)
        self._commands[command] = handler

    def domain_handlers(self, event_type: type[Message]) -> Sequence[Handler[Any]]:
        return tuple(self._domain.get(event_type, ()))  # type: ignore[arg-type]

    def has_domain_handlers(self, event_type: type[Message]) -> bool:
        return bool(self._domain.get(event_type))  # type: ignore[arg-type]

    def command_handler(self, command_type: type[Message]) -> Handler[Any] | None:
        return self._commands.get(command_type)  # type: ignore[arg-type]

    @property
    def consumers(self) -> Sequence[Consumer[Any]]:
        return tuple(self._consumers.values())

    def consumers_of(self, event_type: type[Message]) -> Sequence[Consumer[Any]]:
        return tuple(c for c in self._consumers.values() if c.event_type is event_type)

    def all_handlers(self) -> Mapping[str, Sequence[Callable[..., Awaitable[None]]]]:
        """Every registered handler by kind (what the architecture rule starts from)."""
        return {
            "domain-event": [h for hs in self._domain.values() for h in hs],
            "integration-event": [c.handler for c in self._consumers.values()],
            "internal-command": list(self._commands.values()),
        }
