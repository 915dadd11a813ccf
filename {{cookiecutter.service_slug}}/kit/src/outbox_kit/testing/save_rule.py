"""The "handlers do not save" rule, and its report.

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

import inspect
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outbox_kit.application.handlers import Module, collect_adapters
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork
from outbox_kit.testing.callgraph import (
    Callee,
    CallGraph,
    ClassRef,
    Edge,
    External,
    FunctionRef,
    FunctionSource,
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
