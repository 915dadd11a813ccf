"""The architecture rules a service runs over its own code and the kit's: handlers do not save
(:class:`SaveRule`), and the outbox's fitness rules (:class:`FitnessRules`: only the outbox
publishes, every consumer goes through the inbox, integration events are named for good, an
ordered event is an aggregate's). A service's architecture tests are a few lines around them,
with its allowlist and its golden list of message names.

The "handlers do not save" rule, and its report.

What the handlers-do-not-save rule reports: each violation with the chain of calls from the
handler to the save (file and line of every hop), each allowlisted save with its reason, and how
to fix a violation.

The "handlers do not save" rule: a static, transitive call-graph check over the source.

A handler (domain-event handler, integration-event consumer, internal-command handler) runs
inside a unit of work that commits its effects together with the delivery record: the processed
stamp or the inbox row. A handler that saves on its own writes without that record (a retry
repeats the write) or before the owning transaction decides (a rollback cannot undo it). The
unit of work refuses a commit while it dispatches (``HandlerMustNotSaveError``); this rule proves
the same statically, before the code runs, for paths no test exercises.

How it works. The walk starts from every handler *registered* in a ``HandlerRegistry`` (the one
the service builds: ``all_handlers()``), never from a naming convention. It goes breadth-first,
to ``depth`` calls below the handler (default 6), through (see ``callgraph``):

* direct calls to functions and classes, names resolved through each module's imports;
* methods on ``self`` and on attributes, parameters and locals whose type is known from an
  annotation, from constructor injection (``def __init__(self, x: T)``; ``self.x = x``) or from
  an assignment (``x = T(...)``, ``with T() as x``, a return annotation);
* virtual calls: a method call on a class reaches every override in the scanned subclasses (an
  ABC's implementations, nominally), and a call through a ``Protocol`` reaches the called method
  of every scanned class that defines it (structurally: no base class needed);
* ``uow.repository(Port)``, resolved through the modules' ``adapters`` map (how the service does
  dependency injection; the adapter's constructor is reachable too);
* dependency-injector providers declared on a container class in the scanned packages
  (``x = providers.Factory(Cls, ...)``, ``Singleton``, ``Callable``, ``Resource``...): calling
  ``container.x()`` reaches the class's constructor or the function, and gives its instance or
  the function's return type;
* nested and async functions, lambdas, functions passed as values (callbacks,
  ``functools.partial``), property getters, and ``__aenter__``/``__aexit__`` of ``async with``.

A *sink* is a save: ``commit``/``flush``/``begin``/``begin_nested`` on a SQLAlchemy or SQLModel
``Session``/``AsyncSession``, ``commit``/``begin``/``begin_nested`` on a ``Connection``/
``AsyncConnection``, ``begin`` on an ``Engine``/``AsyncEngine`` and on a session factory
(``sessionmaker``/``async_sessionmaker``: the session it opens commits at the end of the
block), any sink the caller adds (a dotted name, or a ``(type, method)`` pair matched on the
receiver's type and its subclasses) and, conservatively, ``commit``/``flush`` on a receiver
whose type the analysis cannot tell (annotate the receiver, or allowlist the call). A sink
reached ends that path; the failure prints the whole chain handler -> ... -> sink with file:line
for every hop.

The allowlist maps a dotted name (a handler, a function, a class: every method of it, a module)
to the *reason* the write is accepted; the walk stops there and the report lists the hit with
its reason, so an accepted exception is visible and never silent.

Limits (what this rule cannot see; the runtime guard still catches commits of the unit of work):

* **Depth.** Only ``depth`` calls below the handler are followed; a save deeper than that is not
  reported. The negative fixtures include one such handler and assert that it passes.
* **Dynamic dispatch.** ``getattr``, callables looked up in dicts or lists, ``**kwargs``
  forwarding, callables stored on objects whose type is not annotated, monkeypatching,
  ``exec``/``eval``, dynamically created classes: the callee is unknown, so the path ends (a
  ``commit``/``flush`` on an unknown receiver is still reported).
* **Run-time DI beyond what is declared.** A provider overridden at run time
  (``container.x.override(...)``), a ``providers.Dependency``/``Selector``, a service locator or
  any object resolved at run time is seen only through its annotated type (and that type's
  implementations in the scanned packages).
* **Code outside the scanned packages.** Libraries are not walked: a library function that
  commits internally is a save only if it is declared a sink.
* **Flow-insensitive types.** A name holds every value assigned to it anywhere in its scope, and
  generic containers lose their element types; this errs towards reporting more, not less."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard, cast

from outbox_kit.application.handlers import Module, collect_adapters
from outbox_kit.application.messages import IntegrationEvent, MessageRegistry
from outbox_kit.domain import AggregateRoot, DomainEvent, validate_event_name
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork
from outbox_kit.testing.callgraph import (
    Callee,
    CallGraph,
    ClassRef,
    Edge,
    External,
    FunctionRef,
    FunctionSource,
    Instance,
    Scope,
    own_nodes,
    source_index,
    type_name,
)

HOW_TO_FIX = (
    "Handlers must not save: the unit of work that dispatches them commits their effects with "
    "the delivery record. Mutate state, raise events, enqueue integration events or schedule an "
    "internal command (uow.schedule) instead; or allowlist the name with the reason it is safe."
)


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


@dataclass(frozen=True)
class Hop:
    """One step of a chain: what was reached, how, and the file:line where it happens."""

    name: str
    path: Path
    line: int
    how: str

    @property
    def location(self) -> str:
        return f"{_shown(self.path)}:{self.line}"

    def describe(self) -> str:
        return f"{self.name}  [{self.how} at {self.location}]"


def _chain_text(chain: tuple[Hop, ...], last: str) -> str:
    lines = [f"      {chain[0].describe()}"]
    lines += [f"   -> {hop.describe()}" for hop in chain[1:]]
    return "\n".join([*lines[:-1], f"{lines[-1]}  <- {last}"]) if len(lines) > 1 else lines[0]


@dataclass(frozen=True)
class Violation:
    handler: str
    kind: str
    chain: tuple[Hop, ...]

    @property
    def sink(self) -> str:
        return self.chain[-1].name

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(hop.name for hop in self.chain)

    def describe(self) -> str:
        return (
            f"  {self.kind} handler {self.handler} saves ({len(self.chain) - 1} call(s) deep):\n"
            f"{_chain_text(self.chain, 'saves')}"
        )


@dataclass(frozen=True)
class AllowlistHit:
    """The first (shortest) path from a handler to one allowlist entry."""

    handler: str
    kind: str
    entry: str
    name: str
    reason: str
    chain: tuple[Hop, ...]

    def describe(self) -> str:
        return (
            f"  {self.kind} handler {self.handler} reaches {self.name} (allowlisted as {self.entry})\n"
            f"      reason: {self.reason}\n{_chain_text(self.chain, 'allowlisted, not walked')}"
        )


@dataclass
class Report:
    checked: list[str] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    allowlisted: list[AllowlistHit] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)

    def violations_of(self, handler: str) -> list[Violation]:
        return [v for v in self.violations if v.handler == handler]

    def allowlisted_for(self, handler: str) -> list[AllowlistHit]:
        return [hit for hit in self.allowlisted if hit.handler == handler]

    def describe(self) -> str:
        parts = [f"{len(self.checked)} handler(s) checked, {len(self.violations)} save(s) found."]
        if self.violations:
            parts += [HOW_TO_FIX, *(v.describe() for v in self.violations)]
        if self.unresolved:
            parts.append("No source found (not checked): " + ", ".join(self.unresolved))
        if self.allowlisted:
            parts += ["Allowlisted:", *(hit.describe() for hit in self.allowlisted)]
        return "\n".join(parts)


DEFAULT_DEPTH = 6
SESSION_METHODS = ("commit", "flush", "begin", "begin_nested")
CONNECTION_METHODS = ("commit", "begin", "begin_nested")
SinkSpec = str | tuple[str | type[Any], str]
"""A dotted name (``"pkg.audit.write_now"``, ``"pkg.db.Gateway.save"``) or ``(type, method)``."""

DEFAULT_SINKS: tuple[SinkSpec, ...] = (
    *(("sqlalchemy.orm.Session", method) for method in SESSION_METHODS),
    *(("sqlalchemy.ext.asyncio.AsyncSession", method) for method in SESSION_METHODS),
    *(("sqlalchemy.engine.Connection", method) for method in CONNECTION_METHODS),
    *(("sqlalchemy.ext.asyncio.AsyncConnection", method) for method in CONNECTION_METHODS),
    ("sqlalchemy.engine.Engine", "begin"),
    ("sqlalchemy.ext.asyncio.AsyncEngine", "begin"),
    # ``async with sessions.begin() as session:`` commits on leaving the block.
    ("sqlalchemy.orm.sessionmaker", "begin"),
    ("sqlalchemy.ext.asyncio.async_sessionmaker", "begin"),
)
UNTYPED_SINK_METHODS = frozenset({"commit", "flush"})


# -- the report --------------------------------------------------------------------------------


# -- sinks -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Sinks:
    methods: Mapping[str, frozenset[str]]
    names: frozenset[str]
    untyped: frozenset[str]

    @classmethod
    def compile(cls, specs: Iterable[SinkSpec], untyped: frozenset[str], graph: CallGraph) -> _Sinks:
        methods: dict[str, set[str]] = {}
        names: set[str] = set()
        for spec in specs:
            if isinstance(spec, tuple):
                owner, method = _canonical_type(spec[0], graph), spec[1]
            else:
                owner, _, method = spec.rpartition(".")
                if not _canonical_type(owner, graph, strict=True):
                    names.add(_canonical_function(spec, graph))
                    continue
                owner = _canonical_type(owner, graph)
            methods.setdefault(method, set()).add(owner)
            names |= {f"{owner}.{method}", graph.library_method(owner, method)}
        return cls({m: frozenset(t) for m, t in methods.items()}, frozenset(names), untyped)

    def matches(self, callee: Callee, graph: CallGraph) -> bool:
        if callee.name in self.names:
            return True
        if callee.untyped:
            return callee.method in self.untyped
        owners = self.methods.get(callee.method or "")
        return bool(owners and callee.receiver and graph.ancestors(callee.receiver) & owners)


def _canonical_type(spec: str | type[Any], graph: CallGraph, *, strict: bool = False) -> str:
    if inspect.isclass(spec):
        return type_name(spec)
    classes = [v.type for v in graph.resolve(str(spec)) if isinstance(v, ClassRef)] if spec else []
    return classes[0] if classes else ("" if strict else str(spec))


def _canonical_function(spec: str, graph: CallGraph) -> str:
    """A scanned function's key, or a library function's canonical name."""
    for value in graph.resolve(spec):
        if isinstance(value, FunctionRef):
            return value.key
        if isinstance(value, External):
            return value.name
    return spec


# -- the walk ----------------------------------------------------------------------------------


class _HandlerWalk:
    """Breadth-first from one handler; the first (shortest) chain to each function is kept."""

    def __init__(
        self, rule: SaveRule, graph: CallGraph, sinks: _Sinks, handler: FunctionSource, kind: str
    ) -> None:
        self.rule, self.graph, self.sinks, self.handler, self.kind = rule, graph, sinks, handler, kind
        start = Hop(handler.key, handler.module.path, handler.line, "handler")
        self.chains: dict[str, tuple[Hop, ...]] = {handler.key: (start,)}
        self.violations: dict[tuple[str, Path, int], Violation] = {}
        self.allowed: dict[str, AllowlistHit] = {}

    def run(self) -> None:
        entry = self.rule.allowlist_entry(self.handler.key)
        if entry is not None:
            self._allow(entry, self.handler.key, self.chains[self.handler.key])
            return
        queue = deque([(self.handler, 0)])
        while queue:
            fn, level = queue.popleft()
            for edge in self.graph.edges(fn):
                reached = self._visit(fn, edge, level)
                if reached is not None:
                    queue.append((reached, level + 1))

    def _visit(self, fn: FunctionSource, edge: Edge, level: int) -> FunctionSource | None:
        callee = edge.callee
        chain = (*self.chains[fn.key], Hop(callee.name, fn.module.path, edge.line, edge.how))
        entry = self.rule.allowlist_entry(callee.name)
        if entry is not None:
            self._allow(entry, callee.name, chain)
            return None
        if self.sinks.matches(callee, self.graph):
            self.violations.setdefault((callee.name, fn.module.path, edge.line), self._violation(chain))
            return None
        target = callee.function
        if target is None or target.key in self.chains or level + 1 > self.rule.depth:
            return None
        self.chains[target.key] = chain
        return target

    def _violation(self, chain: tuple[Hop, ...]) -> Violation:
        return Violation(self.handler.key, self.kind, chain)

    def _allow(self, entry: str, name: str, chain: tuple[Hop, ...]) -> None:
        reason = self.rule.allowlist[entry]
        self.allowed.setdefault(entry, AllowlistHit(self.handler.key, self.kind, entry, name, reason, chain))


# -- the rule ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveRule:
    """Configure once per service; ``check(registry.all_handlers())`` returns a :class:`Report`.

    ``packages``: what is parsed and walked (the service's package; fixtures add theirs).
    ``adapters``: port -> adapter, as the composition root maps them (``collect_adapters``).
    ``allowlist``: dotted name -> the reason the write is accepted.
    ``sinks``: what counts as a save (``DEFAULT_SINKS`` plus the unit of work's ``commit``).
    """

    packages: tuple[str, ...]
    adapters: Mapping[type[Any], Callable[..., Any]] = field(default_factory=dict)
    allowlist: Mapping[str, str] = field(default_factory=dict)
    sinks: tuple[SinkSpec, ...] = DEFAULT_SINKS
    depth: int = DEFAULT_DEPTH
    untyped_sink_methods: frozenset[str] = UNTYPED_SINK_METHODS
    resolver_methods: frozenset[str] = frozenset({"repository"})

    def graph(self) -> CallGraph:
        return CallGraph(
            source_index(self.packages), adapters=self.adapters, resolver_methods=self.resolver_methods
        )

    def allowlist_entry(self, name: str) -> str | None:
        """The allowlist entry covering ``name`` (itself, or a class/module/function it is in)."""
        for entry in self.allowlist:
            if name == entry or name.startswith(f"{entry}."):
                return entry
        return None

    def unknown_allowlist_entries(self) -> list[str]:
        """Entries that name nothing (a typo, or code that was removed)."""
        graph = self.graph()
        return [entry for entry in self.allowlist if not graph.exists(entry)]

    def unknown_sinks(self) -> list[str]:
        """Sinks whose type (or function) names nothing: they would never match."""
        graph = self.graph()
        unknown: list[str] = []
        for spec in self.sinks:
            owner, method = (
                spec if isinstance(spec, tuple) else (spec.rpartition(".")[0], spec.rpartition(".")[2])
            )
            found = _canonical_type(owner, graph, strict=True) or graph.exists(str(spec))
            if not found or not method:
                unknown.append(repr(spec))
        return unknown

    def check(self, handlers: Mapping[str, Iterable[Callable[..., Any]]]) -> Report:
        graph = self.graph()
        sinks = _Sinks.compile(self.sinks, self.untyped_sink_methods, graph)
        report = Report()
        seen: set[tuple[str, str]] = set()
        for kind, registered in handlers.items():
            for handler in registered:
                fn = graph.function_for(handler)
                if fn is None:
                    report.unresolved.append(f"{kind}: {handler!r}")
                elif (kind, fn.key) not in seen:
                    seen.add((kind, fn.key))
                    self._walk(graph, sinks, fn, kind, report)
        return report

    def _walk(self, graph: CallGraph, sinks: _Sinks, fn: FunctionSource, kind: str, report: Report) -> None:
        walk = _HandlerWalk(self, graph, sinks, fn, kind)
        walk.run()
        report.checked.append(fn.key)
        report.violations += walk.violations.values()
        report.allowlisted += walk.allowed.values()


KIT_PACKAGE = __name__.partition(".")[0]
KIT_ALLOWLIST: Mapping[str, str] = {
    f"{SqlUnitOfWork.__module__}.SqlUnitOfWork.savepoint": (
        "a savepoint (SAVEPOINT ... RELEASE) commits nothing: the dispatching unit of work still "
        "decides, with the delivery record"
    ),
}
"""The kit's accepted writes: every service's rule starts from these."""
KIT_SINKS: tuple[SinkSpec, ...] = (*DEFAULT_SINKS, (SqlUnitOfWork, "commit"))
"""What counts as a save in a service on the kit: SQLAlchemy's and the unit of work's commits."""


def service_save_rule(
    package: str,
    modules: Sequence[Module],
    *,
    allowlist: Mapping[str, str] | None = None,
    sinks: Iterable[SinkSpec] = (),
    depth: int = DEFAULT_DEPTH,
) -> SaveRule:
    """The rule as a service runs it: the service's package and the kit walked, the contexts'
    adapters map, the kit's sinks and accepted writes beside the service's own ``allowlist``
    (dotted name -> why the write is accepted) and ``sinks``."""
    return SaveRule(
        packages=(package, KIT_PACKAGE),
        adapters=collect_adapters(modules),
        allowlist={**KIT_ALLOWLIST, **(allowlist or {})},
        sinks=(*KIT_SINKS, *sinks),
        depth=depth,
    )


# -- the outbox's fitness rules ------------------------------------------------------------------
#
# * Only the outbox processor publishes: no code outside the kit's ``processor/deliverers.py``,
#   the buses it publishes through and the transports themselves (dead-letter copies included;
#   ``MAY_PUBLISH`` lists each file with its reason) touches ``.publish``/``.publish_batch``, and
#   only the transports import a broker client library, so every integration event leaves
#   through the outbox.
# * Every integration event has a stable, versioned, unique name, declared on the class itself
#   (never inherited, never the Python qualname), and is registered so its rows can be read back.
#   The names are pinned in a golden list: a new name is added there on purpose, and a listed
#   name that is neither declared nor upcast any more (a rename, a deleted class) is reported,
#   because stored rows and other services' consumers still carry it.
# * Every consumer goes through the inbox pipeline: only the transports subscribe to a broker,
#   each subscription's handler is the consume wrapper's ``handler_for``, both buses reach
#   ``ConsumePipeline.consume``, and only the pipeline calls a consumer's handler.
# * Every event that declares an ordering key (``ordered=True``) is an aggregate's event. The
#   ordering key is the ``aggregate_id``, so: a domain event with ``ordered=True`` is constructed
#   only as the argument of ``<aggregate>._raise(...)`` inside an ``AggregateRoot`` subclass (and
#   is raised somewhere); an integration event with ``ordered=True`` keeps the ``aggregate_id``
#   field and every construction passes ``aggregate_id=`` explicitly, because a missing one makes
#   ``ordering_key()`` None and the event silently unordered.

PUBLISH = frozenset({"publish", "publish_batch"})
SUBSCRIBE = frozenset({"subscriber", "subscribe"})
_BROKERS = ("base", "rabbit", "kafka", "nats", "redis")
TRANSPORTS = tuple(f"{KIT_PACKAGE}/transports/{broker}.py" for broker in _BROKERS)
# Where ``.publish`` may appear, each for a reason; anywhere else it bypasses the outbox.
MAY_PUBLISH = (
    f"{KIT_PACKAGE}/processor/deliverers.py",  # the outbox processor's deliverer: the one publisher
    f"{KIT_PACKAGE}/transports/bus.py",  # the MessageBus port; outbox off, in-process only
    f"{KIT_PACKAGE}/transports/in_process.py",  # the in-process bus the processor publishes through
    *TRANSPORTS,
    # test tooling: hostile messages published raw, a duplicate on purpose, a recording bus
    f"{KIT_PACKAGE}/testing/",
)
# Broker client libraries: imported by the transports only, so no other module can reach a
# broker by another name (``basic_publish``, ``xadd``, ``send_and_wait``) either.
BROKER_CLIENTS = frozenset(
    {"faststream", "aio_pika", "aiormq", "pamqp", "nats", "redis", "aiokafka", "kafka", "pika"}
)
# The test tooling reads each broker raw (leftovers, dead-letter copies); it is no transport.
MAY_IMPORT_BROKER_CLIENTS = (*TRANSPORTS, f"{KIT_PACKAGE}/testing/brokers.py")
MAY_SUBSCRIBE = (f"{KIT_PACKAGE}/consume/", *TRANSPORTS)
CALLS_CONSUMER_HANDLERS = (f"{KIT_PACKAGE}/consume/inbox.py",)


@dataclass(frozen=True)
class Site:
    """A place in the source: ``<package>/<path>:<line>: <code>``."""

    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


def pinned_names(paths: Iterable[Path]) -> dict[str, str]:
    """A golden list of message names (one per line, ``#`` comments): name -> the file that lists
    it."""
    pinned: dict[str, str] = {}
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            name = line.strip()
            if name and not name.startswith("#"):
                pinned[name] = path.name
    return pinned


def golden_list_problems(registry: MessageRegistry, pinned: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(registered names not pinned, pinned names nothing reads any more: no class declares them
    and no upcaster reads them)."""
    unpinned = sorted(set(registry.names) - set(pinned))
    stranded = sorted(f"{name} ({where})" for name, where in pinned.items() if not registry.is_known(name))
    return unpinned, stranded


class FitnessRules:
    """The outbox's fitness rules over ``graph`` (a service's package and the kit, or any pair
    of packages laid out like them: ``kit`` names the kit's package in the allowed paths). Each
    rule returns what breaks it, one readable line each: an empty list is a pass."""

    def __init__(self, graph: CallGraph, *, kit: str = KIT_PACKAGE) -> None:
        self.graph = graph
        self.kit = kit

    def _allowed(self, paths: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(path.replace(f"{KIT_PACKAGE}/", f"{self.kit}/", 1) for path in paths)

    def relative(self, path: Path) -> str:
        """``<package>/<path in it>`` for a file of one of the graph's packages."""
        for package in self.graph.index.packages:
            folder = self.graph.index.modules[package].path.parent
            if path.is_relative_to(folder):
                return f"{package}/{path.relative_to(folder).as_posix()}"
        return path.as_posix()

    # -- only the outbox processor publishes

    def attribute_sites(self, names: frozenset[str], *, called: bool = False) -> Iterator[Site]:
        """Every ``x.<name>`` of the packages (only as a call's target when ``called``)."""
        for module in self.graph.index.modules.values():
            for node in ast.walk(module.tree):
                target = (node.func if isinstance(node, ast.Call) else None) if called else node
                if isinstance(target, ast.Attribute) and target.attr in names:
                    yield Site(self.relative(module.path), target.lineno, ast.unparse(node)[:120])

    def publishes_outside_the_outbox(self) -> list[str]:
        return _outside(self.attribute_sites(PUBLISH), self._allowed(MAY_PUBLISH))

    def broker_client_imports(self) -> Iterator[Site]:
        for module in self.graph.index.modules.values():
            for node in ast.walk(module.tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                if any(name.partition(".")[0] in BROKER_CLIENTS for name in names):
                    yield Site(self.relative(module.path), node.lineno, ast.unparse(node)[:120])

    def broker_clients_outside_the_transports(self) -> list[str]:
        return _outside(self.broker_client_imports(), self._allowed(MAY_IMPORT_BROKER_CLIENTS))

    def publishers(self) -> set[str]:
        """The files that call ``.publish``: the processor's deliverer must be one."""
        return {site.path for site in self.attribute_sites(PUBLISH, called=True)}

    # -- every consumer goes through the inbox pipeline

    def method_calls(self, names: frozenset[str]) -> Iterator[tuple[Scope, ast.Call]]:
        """Every ``x.<name>(...)`` of the packages, with the scope it is made in."""
        for module in self.graph.index.modules.values():
            for node in _module_level_nodes(module.tree):
                if _calls_method(node, names):
                    yield Scope(module), node
        for fn in list(self.graph.index.functions.values()):
            for node in own_nodes(fn.node):
                if _calls_method(node, names):
                    yield self.graph.scope_of(fn), node

    def _on_a_broker(self, scope: Scope, call: ast.Call) -> bool:
        """False only when the receiver is known to be one of the packages' non-transport
        classes (``wake.subscribe()``); a library object or an unknown receiver may be a broker."""
        assert isinstance(call.func, ast.Attribute)  # noqa: S101 (a method call, by _calls_method)
        receivers = self.graph.infer(call.func.value, scope)
        own = [
            self.graph.index.classes[value.type]
            for value in receivers
            if isinstance(value, Instance | ClassRef) and value.type in self.graph.index.classes
        ]
        allowed = self._allowed(MAY_SUBSCRIBE)
        transports = [cls for cls in own if self.relative(cls.module.path).startswith(allowed)]
        return not receivers or len(own) < len(receivers) or bool(transports)

    def subscriptions(
        self, names: frozenset[str], *, skip: tuple[str, ...] = ()
    ) -> Iterator[tuple[Site, ast.Call]]:
        """Calls that may subscribe to a broker, except in the ``skip`` paths."""
        for scope, call in self.method_calls(names):
            path = self.relative(scope.module.path)
            if not path.startswith(skip) and self._on_a_broker(scope, call):
                yield Site(path, call.lineno, ast.unparse(call)[:120]), call

    def subscriptions_outside_the_transports(self) -> list[str]:
        return [str(site) for site, _ in self.subscriptions(SUBSCRIBE, skip=self._allowed(MAY_SUBSCRIBE))]

    def subscriptions_not_wrapped(self) -> tuple[int, list[str]]:
        """(how many broker subscriptions there are, those whose handler is not the consume
        wrapper's ``handler_for``)."""
        subscribed = list(self.subscriptions(frozenset({"subscribe"})))
        unwrapped = [
            str(site)
            for site, call in subscribed
            if not any(
                isinstance(a, ast.Call) and ast.unparse(a.func).endswith(".handler_for") for a in call.args
            )
        ]
        return len(subscribed), unwrapped

    def reaches(self, start: str, target: str, depth: int = 4) -> bool:
        """Whether the function named ``start`` (dotted) calls a function named ``target``
        within ``depth`` calls."""
        first = self.graph.index.functions[start]
        seen, queue = {first.key}, deque([(first, 0)])
        while queue:
            fn, level = queue.popleft()
            for edge in self.graph.edges(fn):
                if edge.callee.name == target:
                    return True
                nxt = edge.callee.function
                if nxt is not None and nxt.key not in seen and level < depth:
                    seen.add(nxt.key)
                    queue.append((nxt, level + 1))
        return False

    def consumer_handlers_called_outside_the_pipeline(self) -> list[str]:
        sites = self.attribute_sites(frozenset({"handler"}), called=True)
        return _outside(sites, self._allowed(CALLS_CONSUMER_HANDLERS))

    # -- integration events: stable, versioned, unique names

    def source_classes(self, base: type[Any]) -> list[type[Any]]:
        """Every subclass of ``base`` defined in the packages' source (registered or not), but
        the kit's test tooling (its messages are registered by the tests that use them)."""
        wanted = type_name(base)
        found: list[type[Any]] = []
        for key, cls in self.graph.index.classes.items():
            if key.startswith(f"{self.kit}.testing."):
                continue
            if key != wanted and wanted in self.graph.ancestors(key):
                module = importlib.import_module(cls.module.name)
                path = key.removeprefix(f"{module.__name__}.").split(".")
                found.append(cast("type[Any]", functools.reduce(getattr, path, module)))
        return found

    def event_name_problems(self, registry: MessageRegistry) -> tuple[list[str], list[str]]:
        """(integration events without a declared, versioned, registered name; names used
        twice)."""
        events = self.source_classes(IntegrationEvent)
        problems: list[str] = []
        for event in events:
            where = f"{event.__module__}.{event.__qualname__}"
            if not event.has_name():
                problems.append(f"{where} declares no name (class X(IntegrationEvent, name='ctx.x.v1'))")
                continue
            validate_event_name(event.message_name)
            if registry.names.get(event.message_name) is not event:
                problems.append(f"{where} ({event.message_name}) is not in any module's messages")
            version = re.search(r"V(\d+)$", event.__name__)
            if version and not event.message_name.endswith(f".v{version.group(1)}"):
                problems.append(f"{where} is version {version.group(1)} but named {event.message_name}")
        names = [event.message_name for event in events if event.has_name()]
        return problems, sorted({name for name in names if names.count(name) > 1})

    # -- ordered events are an aggregate's events

    def _constructions(self, classes: set[str]) -> Iterator[tuple[FunctionSource, ast.Call, str]]:
        """Every ``Cls(...)`` of the packages where ``Cls`` resolves to one of ``classes``."""
        for fn in list(self.graph.index.functions.values()):
            scope = self.graph.scope_of(fn)
            for node in own_nodes(fn.node):
                if isinstance(node, ast.Call):
                    for value in self.graph.infer(node.func, scope):
                        if isinstance(value, ClassRef) and value.type in classes:
                            yield fn, node, value.type

    def _raised_by_aggregates(self) -> set[int]:
        """The argument nodes of ``x._raise(...)`` calls made inside AggregateRoot subclasses."""
        aggregate = type_name(AggregateRoot)
        raised: set[int] = set()
        for fn in self.graph.index.functions.values():
            owner = self.graph.scope_of(fn).owner
            if owner is None or aggregate not in self.graph.ancestors(owner.key):
                continue
            for node in own_nodes(fn.node):
                if _calls_method(node, frozenset({"_raise"})):
                    raised |= {id(arg) for arg in node.args}
        return raised

    def _ordered(self, base: type[Any]) -> set[str]:
        return {type_name(cls) for cls in self.source_classes(base) if cls.ordered}

    def _where(self, fn: FunctionSource, node: ast.AST) -> str:
        return f"{self.relative(fn.module.path)}:{getattr(node, 'lineno', fn.line)} in {fn.key}"

    def ordered_domain_event_problems(self) -> tuple[list[str], list[str]]:
        """(ordered domain events built outside an aggregate's ``_raise``, ordered domain events
        no aggregate raises)."""
        events = self._ordered(DomainEvent)
        raised = self._raised_by_aggregates()
        found = list(self._constructions(events))
        outside_aggregates = [
            f"{event} built at {self._where(fn, call)}" for fn, call, event in found if id(call) not in raised
        ]
        never_raised = sorted(events - {event for _, call, event in found if id(call) in raised})
        return outside_aggregates, never_raised

    def ordered_integration_event_problems(self) -> tuple[list[str], list[str]]:
        """(ordered integration events without an ``aggregate_id`` field, constructions that do
        not pass ``aggregate_id=``)."""
        events = self._ordered(IntegrationEvent)
        classes = {type_name(cls): cls for cls in self.source_classes(IntegrationEvent)}
        without_field = sorted(e for e in events if "aggregate_id" not in classes[e].model_fields)
        without_key = [
            f"{event} built without aggregate_id= at {self._where(fn, call)}"
            for fn, call, event in self._constructions(events)
            if not any(k.arg in {"aggregate_id", None} for k in call.keywords)
        ]
        return without_field, without_key


def service_fitness(package: str) -> FitnessRules:
    """The fitness rules as a service runs them: over its package and the kit."""
    return FitnessRules(CallGraph(source_index((package, KIT_PACKAGE))))


def _outside(sites: Iterator[Site], allowed: tuple[str, ...]) -> list[str]:
    return [str(site) for site in sites if not site.path.startswith(allowed)]


def _calls_method(node: ast.AST, names: frozenset[str]) -> TypeGuard[ast.Call]:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names


def _module_level_nodes(tree: ast.Module) -> Iterator[ast.AST]:
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            pending += ast.iter_child_nodes(node)
