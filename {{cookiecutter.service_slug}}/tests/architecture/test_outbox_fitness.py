"""Fitness rules of the outbox and the inbox, checked over the service's source.

* Only the outbox processor publishes: no code outside the kit's ``processor/deliverers.py``,
  the buses it publishes through and the transports themselves (dead-letter copies included;
  ``MAY_PUBLISH`` lists each file with its reason) touches ``.publish``/``.publish_batch``, and
  only the transports import a broker client library, so every integration event leaves
  through the outbox.
* Every integration event has a stable, versioned, unique name, declared on the class itself
  (never inherited, never the Python qualname), and is registered so its rows can be read back.
  The names are pinned in ``message_names*.txt`` (a golden list): a new name is added there on
  purpose, and a listed name that is neither declared nor upcast any more (a rename, a deleted
  class) fails, because stored rows and other services' consumers still carry it.
* Every consumer goes through the inbox pipeline: only the transports subscribe to a broker, each
  subscription's handler is the consume wrapper's ``handler_for``, both buses reach
  ``ConsumePipeline.consume``, and only the pipeline calls a consumer's handler.
* Every event that declares an ordering key (``ordered=True``) is an aggregate's event. The
  ordering key is the ``aggregate_id``, so: a domain event with ``ordered=True`` is constructed
  only as the argument of ``<aggregate>._raise(...)`` inside an ``AggregateRoot`` subclass (and
  is raised somewhere); an integration event with ``ordered=True`` keeps the ``aggregate_id``
  field and every construction in the service passes ``aggregate_id=`` explicitly, because a
  missing one makes ``ordering_key()`` None and the event silently unordered.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard, cast

import pytest
from outbox_kit.application.messages import (
    IntegrationEvent,
    MessageRegistry,
)
from outbox_kit.consume.bus import (
    InProcessBus,
)
from outbox_kit.consume.inbox import (
    ConsumePipeline,
)
from outbox_kit.consume.subscribers import (
    ConsumeWrapper,
)
from outbox_kit.domain import (
    AggregateRoot,
    DomainEvent,
    validate_event_name,
)
from outbox_kit.runtime.container import build_registry
from outbox_kit.testing import (
    CallGraph,
    ClassRef,
    FunctionSource,
    Instance,
    Scope,
    own_nodes,
    source_index,
    type_name,
)

from {{ cookiecutter.package_name }}.container import Container, build_modules

pytestmark = pytest.mark.architecture

PACKAGE = Container.__module__.partition(".")[0]
KIT = InProcessBus.__module__.partition(".")[0]
PUBLISH = frozenset({"publish", "publish_batch"})
SUBSCRIBE = frozenset({"subscriber", "subscribe"})
# Where ``.publish`` may appear, each for a reason; anywhere else it bypasses the outbox.
MAY_PUBLISH = (
    "outbox_kit/processor/deliverers.py",  # the outbox processor's deliverer: the one publisher
    "outbox_kit/transports/bus.py",  # the MessageBus port; outbox off, in-process only (brokers refuse it)
    "outbox_kit/consume/bus.py",  # the buses the processor publishes through (FastStream, in-process)
    *(f"outbox_kit/transports/{broker}.py" for broker in ("base", "rabbit", "kafka", "nats", "redis")),
    "outbox_kit/testing/brokers.py",  # test tooling: publishes hostile messages raw, past the service
    # test tooling: the reliability tier publishes a duplicate on purpose, and the protocol model
    # records the publishes of the bus it wraps
    "outbox_kit/testing/reliability.py",
    "outbox_kit/testing/protocol_model.py",
)
# Broker client libraries: imported by the transports only, so no other module can reach a
# broker by another name (``basic_publish``, ``xadd``, ``send_and_wait``) either.
BROKER_CLIENTS = frozenset(
    {"faststream", "aio_pika", "aiormq", "pamqp", "nats", "redis", "aiokafka", "kafka", "pika"}
)
TRANSPORTS = tuple(
    f"outbox_kit/transports/{broker}.py" for broker in ("base", "rabbit", "kafka", "nats", "redis")
)
# The test tooling reads each broker raw (leftovers, dead-letter copies); it is no transport.
MAY_IMPORT_BROKER_CLIENTS = (*TRANSPORTS, "outbox_kit/testing/brokers.py")
MAY_SUBSCRIBE = ("outbox_kit/consume/", *TRANSPORTS)
CALLS_CONSUMER_HANDLERS = ("outbox_kit/consume/inbox.py",)


@dataclass(frozen=True)
class Site:
    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


@pytest.fixture(scope="module")
def graph() -> CallGraph:
    return CallGraph(source_index((PACKAGE, KIT)))


def relative(graph: CallGraph, path: Path) -> str:
    """``<package>/<path in it>`` for a file of one of the graph's packages."""
    for package in graph.index.packages:
        folder = graph.index.modules[package].path.parent
        if path.is_relative_to(folder):
            return f"{package}/{path.relative_to(folder).as_posix()}"
    return path.as_posix()


def attribute_sites(graph: CallGraph, names: frozenset[str], *, called: bool = False) -> Iterator[Site]:
    """Every ``x.<name>`` of the package (only as a call's target when ``called``)."""
    for module in graph.index.modules.values():
        for node in ast.walk(module.tree):
            target = (node.func if isinstance(node, ast.Call) else None) if called else node
            if isinstance(target, ast.Attribute) and target.attr in names:
                yield Site(relative(graph, module.path), target.lineno, ast.unparse(node)[:120])


def method_calls(graph: CallGraph, names: frozenset[str]) -> Iterator[tuple[Scope, ast.Call]]:
    """Every ``x.<name>(...)`` of the package, with the scope it is made in."""
    for module in graph.index.modules.values():
        for node in module_level_nodes(module.tree):
            if calls_method(node, names):
                yield Scope(module), node
    for fn in list(graph.index.functions.values()):
        for node in own_nodes(fn.node):
            if calls_method(node, names):
                yield graph.scope_of(fn), node


def calls_method(node: ast.AST, names: frozenset[str]) -> TypeGuard[ast.Call]:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names


def module_level_nodes(tree: ast.Module) -> Iterator[ast.AST]:
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            pending += ast.iter_child_nodes(node)


def on_a_broker(graph: CallGraph, scope: Scope, call: ast.Call) -> bool:
    """False only when the receiver is known to be one of the service's non-transport classes
    (``wake.subscribe()``); a library object or an unknown receiver may be a broker."""
    assert isinstance(call.func, ast.Attribute)
    receivers = graph.infer(call.func.value, scope)
    own = [
        graph.index.classes[value.type]
        for value in receivers
        if isinstance(value, Instance | ClassRef) and value.type in graph.index.classes
    ]
    transports = [cls for cls in own if relative(graph, cls.module.path).startswith(MAY_SUBSCRIBE)]
    return not receivers or len(own) < len(receivers) or bool(transports)


def subscriptions(
    graph: CallGraph, names: frozenset[str], *, skip: tuple[str, ...] = ()
) -> Iterator[tuple[Site, ast.Call]]:
    """Calls that may subscribe to a broker, except in the ``skip`` paths."""
    for scope, call in method_calls(graph, names):
        path = relative(graph, scope.module.path)
        if not path.startswith(skip) and on_a_broker(graph, scope, call):
            yield Site(path, call.lineno, ast.unparse(call)[:120]), call


def assert_none(found: list[str], rule: str) -> None:
    assert not found, f"{rule}:\n  " + "\n  ".join(found)


def outside(sites: Iterator[Site], allowed: tuple[str, ...]) -> list[str]:
    return [str(site) for site in sites if not site.path.startswith(allowed)]


# -- only the outbox processor publishes -----------------------------------------------------


def test_only_the_outbox_processor_and_the_transports_publish(graph: CallGraph) -> None:
    found = outside(attribute_sites(graph, PUBLISH), MAY_PUBLISH)

    assert_none(
        found,
        f"Only the outbox processor publishes (enqueue on the unit of work instead); allowed: {MAY_PUBLISH}",
    )


def broker_client_imports(graph: CallGraph) -> Iterator[Site]:
    for module in graph.index.modules.values():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            if any(name.partition(".")[0] in BROKER_CLIENTS for name in names):
                yield Site(relative(graph, module.path), node.lineno, ast.unparse(node)[:120])


def test_only_the_transports_import_a_broker_client(graph: CallGraph) -> None:
    found = outside(broker_client_imports(graph), MAY_IMPORT_BROKER_CLIENTS)

    assert_none(
        found,
        "Only the transports import a broker client library (publish through the outbox, consume "
        f"through a registered consumer); allowed: {MAY_IMPORT_BROKER_CLIENTS}",
    )


def test_a_publish_or_a_broker_client_outside_the_allowed_files_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The publish rules are not vacuous: a probe service that publishes from its application
    layer, by the bus and by a raw client, is reported at each line."""
    package = f"publish_probe_{uuid.uuid4().hex[:8]}"
    kit = f"{package}_kit"
    files = {
        f"{kit}/__init__.py": "",
        f"{kit}/transports/__init__.py": "",
        f"{kit}/transports/rabbit.py": "import aio_pika\n",
        f"{package}/__init__.py": "",
        f"{package}/billing/__init__.py": "",
        f"{package}/billing/application.py": (
            "import redis.asyncio\n"
            "from faststream.rabbit import RabbitBroker\n\n\n"
            "async def bill(bus, client):\n"
            "    await bus.publish('billed')\n"
            "    await client.xadd('billing', {'x': 1})\n"
        ),
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = CallGraph(source_index((package, kit)))

    def allowed(paths: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(path.replace(f"{KIT}/", f"{kit}/", 1) for path in paths)

    publishing = outside(attribute_sites(probe, PUBLISH), allowed(MAY_PUBLISH))
    assert publishing == [f"{package}/billing/application.py:6: bus.publish"]
    assert outside(broker_client_imports(probe), allowed(MAY_IMPORT_BROKER_CLIENTS)) == [
        f"{package}/billing/application.py:1: import redis.asyncio",
        f"{package}/billing/application.py:2: from faststream.rabbit import RabbitBroker",
    ]


def test_the_processor_publishes_through_the_message_bus(graph: CallGraph) -> None:
    publishers = {site.path for site in attribute_sites(graph, PUBLISH, called=True)}

    assert "outbox_kit/processor/deliverers.py" in publishers


# -- integration events: stable, versioned, unique names --------------------------------------


def source_classes(graph: CallGraph, base: type[Any]) -> list[type[Any]]:
    """Every subclass of ``base`` defined in the package source (registered or not), but the
    kit's test harness (its messages are registered by the tests that use them)."""
    wanted = type_name(base)
    found: list[type[Any]] = []
    for key, cls in graph.index.classes.items():
        if key.startswith("outbox_kit.testing."):
            continue
        if key != wanted and wanted in graph.ancestors(key):
            module = importlib.import_module(cls.module.name)
            path = key.removeprefix(f"{module.__name__}.").split(".")
            found.append(cast("type[Any]", functools.reduce(getattr, path, module)))
    return found


def test_every_integration_event_has_a_stable_versioned_unique_name(graph: CallGraph) -> None:
    events = source_classes(graph, IntegrationEvent)
    registered = build_registry(build_modules()).names
    problems: list[str] = []
    for event in events:
        where = f"{event.__module__}.{event.__qualname__}"
        if not event.has_name():
            problems.append(f"{where} declares no name (class X(IntegrationEvent, name='ctx.x.v1'))")
            continue
        validate_event_name(event.message_name)
        if registered.get(event.message_name) is not event:
            problems.append(f"{where} ({event.message_name}) is not in any module's messages")
        version = re.search(r"V(\d+)$", event.__name__)
        if version and not event.message_name.endswith(f".v{version.group(1)}"):
            problems.append(f"{where} is version {version.group(1)} but named {event.message_name}")
    names = [event.message_name for event in events if event.has_name()]
    duplicates = sorted({name for name in names if names.count(name) > 1})

    assert_none(problems, "Integration events need a stable, versioned name, declared and registered")
    assert_none(duplicates, "Integration event names must be unique")


GOLDEN_NAMES = sorted(Path(__file__).parent.glob("message_names*.txt"))


def pinned_names() -> dict[str, str]:
    """name -> the golden file that lists it."""
    pinned: dict[str, str] = {}
    for path in GOLDEN_NAMES:
        for line in path.read_text(encoding="utf-8").splitlines():
            name = line.strip()
            if name and not name.startswith("#"):
                pinned[name] = path.name
    return pinned


def golden_list_problems(registry: MessageRegistry, pinned: dict[str, str]) -> tuple[list[str], list[str]]:
    """(registered names not pinned, pinned names nothing reads any more)."""
    unpinned = sorted(set(registry.names) - set(pinned))
    stranded = sorted(f"{name} ({where})" for name, where in pinned.items() if not registry.is_known(name))
    return unpinned, stranded


def test_message_names_match_the_golden_list() -> None:
    unpinned, stranded = golden_list_problems(build_registry(build_modules()), pinned_names())

    assert GOLDEN_NAMES, "tests/architecture/message_names.txt is missing"
    assert_none(
        unpinned,
        "New message names: add each to tests/architecture/message_names.txt (a name is a "
        "durable contract once a row or a consumer carries it)",
    )
    assert_none(
        stranded,
        "Pinned names no class declares and no upcaster reads any more: stored rows and other "
        "services' consumers still carry them. Restore the class, or add the new version with "
        "an upcaster from the old name (Module.upcasters)",
    )


class ShipmentSentV2(IntegrationEvent, name="probe.shipment-sent.v2"):
    parcel: str


class ParcelWeighedV1(IntegrationEvent, name="probe.parcel-weighed.v1"):
    grams: int


def test_the_golden_list_catches_a_rename_and_a_new_name_but_not_an_upcast_version() -> None:
    registry = MessageRegistry()
    registry.register(ShipmentSentV2, ParcelWeighedV1)
    pinned = {
        "probe.shipment-sent.v1": "message_names.txt",
        "probe.shipment-sent.v2": "message_names.txt",
        "probe.parcel-weighed.v0": "message_names.txt",
    }

    unpinned, stranded = golden_list_problems(registry, pinned)
    assert unpinned == ["probe.parcel-weighed.v1"]
    assert stranded == [
        "probe.parcel-weighed.v0 (message_names.txt)",
        "probe.shipment-sent.v1 (message_names.txt)",
    ]

    registry.add_upcaster("probe.shipment-sent.v1", "probe.shipment-sent.v2", lambda payload: payload)
    assert golden_list_problems(registry, pinned)[1] == ["probe.parcel-weighed.v0 (message_names.txt)"]


# -- every consumer goes through the inbox pipeline --------------------------------------------


def reaches(graph: CallGraph, start: FunctionSource, target: str, depth: int = 4) -> bool:
    seen, queue = {start.key}, deque([(start, 0)])
    while queue:
        fn, level = queue.popleft()
        for edge in graph.edges(fn):
            if edge.callee.name == target:
                return True
            nxt = edge.callee.function
            if nxt is not None and nxt.key not in seen and level < depth:
                seen.add(nxt.key)
                queue.append((nxt, level + 1))
    return False


def method(graph: CallGraph, cls: type[Any], name: str) -> FunctionSource:
    return graph.index.functions[f"{type_name(cls)}.{name}"]


def test_only_the_transports_subscribe_to_a_broker(graph: CallGraph) -> None:
    sites = [str(site) for site, _ in subscriptions(graph, SUBSCRIBE, skip=MAY_SUBSCRIBE)]

    assert_none(
        sites, f"Only the transports subscribe to a broker ({MAY_SUBSCRIBE}); register a consumer instead"
    )


def test_every_subscription_is_wrapped_by_the_consume_pipeline(graph: CallGraph) -> None:
    consume = f"{type_name(ConsumePipeline)}.consume"
    subscribed = list(subscriptions(graph, frozenset({"subscribe"})))
    unwrapped = [
        str(site)
        for site, call in subscribed
        if not any(
            isinstance(a, ast.Call) and ast.unparse(a.func).endswith(".handler_for") for a in call.args
        )
    ]

    assert subscribed
    assert_none(unwrapped, "Every broker subscription must run through ConsumeWrapper.handler_for")
    assert reaches(graph, method(graph, ConsumeWrapper, "handler_for"), consume)
    assert reaches(graph, method(graph, InProcessBus, "publish"), consume)


def test_only_the_pipeline_calls_a_consumer_handler(graph: CallGraph) -> None:
    sites = attribute_sites(graph, frozenset({"handler"}), called=True)

    assert_none(
        outside(sites, CALLS_CONSUMER_HANDLERS), "Only the consume pipeline runs a consumer's handler"
    )


def test_the_in_process_bus_delivers_through_the_container_pipeline(service_container: Container) -> None:
    bus = service_container.bus()

    assert isinstance(bus, InProcessBus)
    assert bus._pipeline is service_container.pipeline()


# -- ordered events are an aggregate's events --------------------------------------------------


def constructions(graph: CallGraph, classes: set[str]) -> Iterator[tuple[FunctionSource, ast.Call, str]]:
    """Every ``Cls(...)`` of the package where ``Cls`` resolves to one of ``classes``."""
    for fn in list(graph.index.functions.values()):
        scope = graph.scope_of(fn)
        for node in own_nodes(fn.node):
            if isinstance(node, ast.Call):
                for value in graph.infer(node.func, scope):
                    if isinstance(value, ClassRef) and value.type in classes:
                        yield fn, node, value.type


def raised_by_aggregates(graph: CallGraph) -> set[int]:
    """The argument nodes of ``x._raise(...)`` calls made inside AggregateRoot subclasses."""
    aggregate = type_name(AggregateRoot)
    raised: set[int] = set()
    for fn in graph.index.functions.values():
        owner = graph.scope_of(fn).owner
        if owner is None or aggregate not in graph.ancestors(owner.key):
            continue
        for node in own_nodes(fn.node):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "_raise"
            ):
                raised |= {id(arg) for arg in node.args}
    return raised


def ordered(graph: CallGraph, base: type[Any]) -> set[str]:
    return {type_name(cls) for cls in source_classes(graph, base) if cls.ordered}


def where(graph: CallGraph, fn: FunctionSource, node: ast.AST) -> str:
    return f"{relative(graph, fn.module.path)}:{getattr(node, 'lineno', fn.line)} in {fn.key}"


def test_ordered_domain_events_are_raised_only_by_aggregates(graph: CallGraph) -> None:
    events = ordered(graph, DomainEvent)
    raised = raised_by_aggregates(graph)
    found = list(constructions(graph, events))
    outside_aggregates = [
        f"{event} built at {where(graph, fn, call)}" for fn, call, event in found if id(call) not in raised
    ]
    never_raised = sorted(events - {event for _, call, event in found if id(call) in raised})

    assert_none(outside_aggregates, "An ordered domain event is built only in <aggregate>._raise(...)")
    assert_none(never_raised, "An ordered domain event must be raised by an aggregate")


def test_ordered_integration_events_carry_their_aggregate_id(graph: CallGraph) -> None:
    events = ordered(graph, IntegrationEvent)
    classes = {type_name(cls): cls for cls in source_classes(graph, IntegrationEvent)}
    without_field = sorted(e for e in events if "aggregate_id" not in classes[e].model_fields)
    without_key = [
        f"{event} built without aggregate_id= at {where(graph, fn, call)}"
        for fn, call, event in constructions(graph, events)
        if not any(k.arg in {"aggregate_id", None} for k in call.keywords)
    ]

    assert_none(without_field, "An ordered integration event keeps its aggregate_id field")
    assert_none(without_key, "An ordered integration event is built with aggregate_id= (its ordering key)")
