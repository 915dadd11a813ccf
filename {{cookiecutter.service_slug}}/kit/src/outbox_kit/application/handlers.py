"""Handlers, the registry that routes messages to them, and the modules that register them.

**A handler** is a callable of the message and the unit of work it must not commit; and a
consumer: an integration-event handler with the durable name its inbox rows and queues use,
and handler_name, the readable dotted name of any handler for logs and errors.

**The registry** is where handlers are registered: the single source the dispatcher, the
processors, the consumers and the architecture tests all read.

A handler receives the message and the unit of work that owns the current transaction. It may
load and mutate aggregates, raise events, enqueue integration events and schedule internal
commands; it never commits. The unit of work persists its effects together with the delivery
record (processed stamp or inbox row), which is what makes a redelivery safe. See
``tests/architecture`` for the rule that proves it statically.

The contract between a bounded context and the composition root.

Each bounded context exposes ``contexts/<name>/module.py`` with a ``module()`` function
returning a :class:`Module`. The container discovers them (any folder of ``contexts/`` with a
``module.py``), so adding a context needs no edit elsewhere, and removing the example is
deleting its folders.

Finding the bounded contexts: every folder of contexts/ with a module.py defining module() ->
Module, imported in name order, with its table modules."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from outbox_kit.application.messages import IntegrationEvent, InternalCommand, Upcaster
from outbox_kit.application.unit_of_work import Adapter, UnitOfWork
from outbox_kit.domain import DomainEvent, Message

if TYPE_CHECKING:
    from fastapi import APIRouter  # an external type only: no import cycle to break
import importlib
import pkgutil
from types import ModuleType

M_contra = TypeVar("M_contra", bound=Message, contravariant=True)
M = TypeVar("M", bound=Message)


class Handler(Protocol[M_contra]):
    """Reacts to one message inside a unit of work it must not commit."""

    def __call__(self, message: M_contra, uow: UnitOfWork, /) -> Awaitable[None]: ...


def handler_name(handler: object) -> str:
    """A readable dotted name for logs and error messages."""
    target = handler
    if not hasattr(target, "__qualname__"):
        target = type(handler)
    module = getattr(target, "__module__", "?")
    return f"{module}.{getattr(target, '__qualname__', repr(target))}"


@dataclass(frozen=True)
class Consumer(Generic[M]):
    """An integration-event handler with the durable name its inbox rows and queues use."""

    name: str
    event_type: type[M]
    handler: Handler[M]


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
        self._record_only: set[type[DomainEvent]] = set()
        self._consumers: dict[str, Consumer[Any]] = {}
        self._commands: dict[type[InternalCommand], Handler[Any]] = {}

    def on_domain_event(self, event_type: type[M], handler: Handler[M]) -> None:
        event = _checked(event_type, DomainEvent)
        if event in self._record_only:
            msg = f"{event.__qualname__} is declared record-only and cannot have a handler"
            raise HandlerRegistryError(msg)
        self._domain[event].append(handler)

    def record_only(self, *event_types: type[DomainEvent]) -> None:
        """Domain events kept in the outbox as a record, with no handler by design: the processor
        stamps them processed quietly (an undeclared event without a handler gets a Warning, since
        its handler usually lives on a host that should run the processor instead)."""
        for event_type in event_types:
            event = _checked(event_type, DomainEvent)
            if self._domain.get(event):
                msg = f"{event.__qualname__} has a handler and cannot be declared record-only"
                raise HandlerRegistryError(msg)
            self._record_only.add(event)

    def is_record_only(self, event_type: type[Message]) -> bool:
        return event_type in self._record_only

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


@dataclass(frozen=True)
class UpcasterSpec:
    """Read payloads stored under ``source`` as ``target`` (one version step)."""

    source: str
    target: str
    upcast: Upcaster


# A PostgreSQL schema name as the kit accepts it: lower case, unquoted, at most 63 characters.
SCHEMA_PATTERN = r"^[a-z_][a-z0-9_]{0,62}$"


class ContextSource(BaseModel):
    """A bounded context's own storage: another database (``database_url``), a schema of the
    default PostgreSQL database (``schema``), or a schema of another database (both). Set by
    ``SOURCES__<CONTEXT>__DATABASE_URL`` / ``SOURCES__<CONTEXT>__SCHEMA``, or declared as the
    context's default in its ``module.py``."""

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    database_url: str | None = None
    schema_name: str | None = Field(default=None, alias="schema", pattern=SCHEMA_PATTERN)

    @model_validator(mode="after")
    def _says_where(self) -> Self:
        if self.database_url is None and self.schema_name is None:
            msg = "a context's source needs a database_url, a schema, or both"
            raise ValueError(msg)
        return self


@dataclass(frozen=True)
class Module:
    """What a bounded context contributes: messages, handlers, HTTP routes, table modules."""

    name: str
    messages: Sequence[type[Message]] = ()
    upcasters: Sequence[UpcasterSpec] = ()
    register_handlers: Callable[[HandlerRegistry], None] | None = None
    routers: Sequence[APIRouter] = ()
    table_modules: Sequence[str] = field(default_factory=tuple)
    adapters: Mapping[type[Any], Adapter] = field(default_factory=dict)
    """Port (a Protocol the use cases ask ``uow.repository`` for) -> adapter class."""
    source: ContextSource | None = None
    """Where the context keeps its data when the settings say nothing (``SOURCES__<NAME>__...``
    win): a source of its own, with its own outbox, inbox and internal-commands tables."""
    examples: Sequence[str] = ()
    """Calls a developer can try first, shown by the development banner: ``{base}`` is replaced
    by the server's address, ``{auth}`` by the ``Authorization`` header of a development token
    (nothing else is: a JSON body's braces stay as they are)."""


def collect_adapters(modules: Sequence[Module]) -> dict[type[Any], Adapter]:
    """Every context's port -> adapter map; one port claimed twice is refused."""
    adapters: dict[type[Any], Adapter] = {}
    for module in modules:
        for port, adapter in module.adapters.items():
            if port in adapters:
                msg = f"port {port.__qualname__} has two adapters (module {module.name})"
                raise TypeError(msg)
            adapters[port] = adapter
    return adapters


def discover_modules(contexts: ModuleType) -> list[Module]:
    """Import ``<contexts>.<name>.module`` for every context folder, in name order (a folder
    without ``module.py`` is not a context and is skipped)."""
    found: list[Module] = []
    for info in sorted(pkgutil.iter_modules(contexts.__path__), key=lambda i: i.name):
        if not info.ispkg:
            continue
        try:
            contributed = importlib.import_module(f"{contexts.__name__}.{info.name}.module")
        except ModuleNotFoundError as error:
            if error.name == f"{contexts.__name__}.{info.name}.module":
                continue
            raise
        factory = getattr(contributed, "module", None)
        if not callable(factory):
            msg = f"{contributed.__name__} must define module() -> Module"
            raise TypeError(msg)
        found.append(factory())
    return found


def import_table_modules(modules: Sequence[Module]) -> None:
    """Import every context's table definitions so SQLModel's metadata knows them."""
    for module in modules:
        for name in module.table_modules:
            importlib.import_module(name)
