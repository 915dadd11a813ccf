"""Where each bounded context keeps its data: the service's sources.

The default source is ``DATABASE__URL``: every context without a source of its own keeps its
tables, outbox, inbox and internal commands there. A context gets a source of its own from
``SOURCES__<CONTEXT>__DATABASE_URL`` / ``SOURCES__<CONTEXT>__SCHEMA`` or from its module's
declaration (``Module.source``); :func:`plan_sources` checks the plan once, at start-up (an
unknown context, a schema on SQLite, two contexts on one storage are refused, naming the
setting). :class:`DataSources` answers, at run time, which source a context or a consumer
writes to. The container builds each source's database and relay parts from the plan.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from outbox_kit.application.handlers import HandlerRegistry, Module
from outbox_kit.operations.retention import RetentionCleaner
from outbox_kit.persistence.database import Database, DatabaseSettings
from outbox_kit.persistence.tables import (
    DEFAULT_SOURCE,
    POLLED_TABLES,
)
from outbox_kit.persistence.unit_of_work import SqlUnitOfWorkFactory
from outbox_kit.processor.in_process import LocalDispatcher
from outbox_kit.runtime.settings import ServiceSettings

# What ``--source`` / ``source`` already means: a context of these names keeps the default source.
RESERVED_NAMES = frozenset({DEFAULT_SOURCE, "all", *POLLED_TABLES})


class SourcesError(ValueError):
    """The ``SOURCES__...`` settings (or a context's declared source) cannot be honoured."""


@dataclass(frozen=True)
class SourcePlan:
    """One source as the settings and the contexts declare it."""

    name: str
    database: DatabaseSettings
    schema: str | None
    contexts: tuple[str, ...]


def plan_sources(settings: ServiceSettings, modules: Sequence[Module]) -> list[SourcePlan]:
    """The default source (``DATABASE__URL``, every context without a source of its own) and one
    source per context that has one, by ``SOURCES__<CONTEXT>__...`` or its module's declaration."""
    names = [module.name for module in modules]
    unknown = sorted(set(settings.sources) - set(names))
    if unknown:
        msg = (
            f"SOURCES__{unknown[0].upper()}: no bounded context is named {unknown[0]!r} "
            f"(contexts: {', '.join(names)})"
        )
        raise SourcesError(msg)
    declared = {module.name: settings.sources.get(module.name) or module.source for module in modules}
    default = SourcePlan(
        DEFAULT_SOURCE, settings.database, None, tuple(name for name in names if declared[name] is None)
    )
    plans = [default]
    storage: dict[tuple[str, str | None], str] = {(settings.database.url, None): DEFAULT_SOURCE}
    for name in names:
        source = declared[name]
        if source is None:
            continue
        database = settings.database.model_copy(update={"url": source.database_url or settings.database.url})
        where = f"SOURCES__{name.upper()}"
        if name in RESERVED_NAMES:  # the operators' names for the default source and its tables
            msg = f"{where}: a context named {name!r} cannot have a source of its own"
            raise SourcesError(msg)
        if source.schema_name is not None and not database.is_postgresql:
            msg = (
                f"{where}__SCHEMA needs a PostgreSQL database; on SQLite give the context a file "
                f"of its own ({where}__DATABASE_URL)"
            )
            raise SourcesError(msg)
        key = (database.url, source.schema_name)
        if key in storage:
            msg = (
                f"{where}: the context would share the storage of source {storage[key]!r}; "
                "give it another database or schema"
            )
            raise SourcesError(msg)
        storage[key] = name
        plans.append(SourcePlan(name, database, source.schema_name, (name,)))
    return plans


@dataclass(frozen=True)
class DataSource:
    """One source's database and the relay parts bound to it: a unit of work of ``units``
    writes only here, and the outbox, inbox and internal-commands rows it writes are this
    source's."""

    name: str
    contexts: tuple[str, ...]
    database: Database
    units: SqlUnitOfWorkFactory
    dispatcher: LocalDispatcher
    cleaner: RetentionCleaner


class DataSources:
    """Every source of the service, the default first; which source a context and a consumer
    write to."""

    def __init__(self, sources: Sequence[DataSource], consumers: Mapping[str, str]) -> None:
        self._sources = {source.name: source for source in sources}
        self._of_context = {context: source for source in sources for context in source.contexts}
        self._consumers = consumers

    def __iter__(self) -> Iterator[DataSource]:
        return iter(self._sources.values())

    @property
    def default(self) -> DataSource:
        return self._sources[DEFAULT_SOURCE]

    # The default source's parts, as the container's providers of the same names give them.
    def default_database(self) -> Database:
        return self.default.database

    def default_units(self) -> SqlUnitOfWorkFactory:
        return self.default.units

    def default_dispatcher(self) -> LocalDispatcher:
        return self.default.dispatcher

    def default_cleaner(self) -> RetentionCleaner:
        return self.default.cleaner

    def cleaners(self) -> list[RetentionCleaner]:
        return [source.cleaner for source in self]

    def databases(self) -> dict[str, Database]:
        return {source.name: source.database for source in self}

    async def dispose(self) -> None:
        """Close every source's connections (a process's or a test's end)."""
        for source in self:
            await source.database.dispose()

    def named(self, name: str) -> DataSource:
        try:
            return self._sources[name]
        except KeyError:
            msg = f"unknown source {name!r}; this service has: {', '.join(self._sources)}"
            raise LookupError(msg) from None

    def of_context(self, context: str) -> DataSource:
        return self._of_context.get(context, self.default)

    def units_for_consumer(self, consumer: str) -> SqlUnitOfWorkFactory:
        """The unit-of-work factory of the source whose context registered ``consumer``: its
        inbox row and the handler's effects commit in that source."""
        return self.of_context(self._consumers.get(consumer, "")).units


def consumer_contexts(modules: Sequence[Module]) -> dict[str, str]:
    """Consumer name -> the context that registers it (each context's handlers, registered on
    a scratch registry: registering has no effect but the registry's)."""
    found: dict[str, str] = {}
    for module in modules:
        if module.register_handlers is not None:
            scratch = HandlerRegistry()
            module.register_handlers(scratch)
            found |= {consumer.name: module.name for consumer in scratch.consumers}
    return found
