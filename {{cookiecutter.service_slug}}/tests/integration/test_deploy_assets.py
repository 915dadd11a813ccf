"""The deploy assets (``deploy/``) agree with a running service: every metric and label the
alert rules and the dashboard use is one a running API or worker exports (scraped over HTTP),
the dashboard shows every metric a worker exports, and every probe and scrape target of the
Kubernetes manifests is served on the port the manifest starts the process with."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import yaml
from outbox_kit.testing.fixtures import (
    SERVICE_URLS,
    free_port,
    fresh_sqlite,
    get,
    make_settings,
    service_process,
    wait_for,
)

from {{ cookiecutter.package_name }}.container import (
    build_container,
)

pytestmark = [pytest.mark.integration, pytest.mark.rabbitmq]  # FastStream's metrics need a broker
PACKAGE = "{{ cookiecutter.package_name }}"
PROJECT = Path(__file__).resolve().parents[2]
DEPLOY = PROJECT / "deploy"
METRIC = re.compile(r"\b((?:outbox|inbox|faststream|http)_[a-z0-9_]+)")
GROUPING = re.compile(r"\b(?:by|without) \(([^)]*)\)")
SERIES_SUFFIXES = ("_bucket", "_count", "_sum", "_created")


def worker_process(
    database_url: str, *arguments: str, **env: str
) -> AbstractContextManager[subprocess.Popen[str]]:
    """This service's ``worker`` as a real process (see ``service_process``)."""
    return service_process(database_url, "worker", *arguments, package=PACKAGE, **env)


def alert_expressions() -> list[str]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def dashboard_expressions() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboard.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def manifests() -> Iterator[dict[str, Any]]:
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        yield from (document for document in yaml.safe_load_all(path.read_text()) if document)


def families(exposition: str) -> set[str]:
    """The metric families of an exposition, without the ``*_created`` gauges the Prometheus
    client adds beside an unlabelled counter or histogram (a creation time, not a metric)."""
    named = set(re.findall(r"^# HELP (\S+) ", exposition, re.MULTILINE))
    return {name for name in named if not name.endswith("_created")}


def family_of(series: str, known: set[str]) -> str | None:
    if series in known:
        return series
    for suffix in SERIES_SUFFIXES:
        if series.endswith(suffix) and series.removesuffix(suffix) in known:
            return series.removesuffix(suffix)
    return None


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory, sqlite_template: Path) -> dict[str, str]:
    """``/metrics`` of a running worker and a running API (separate processes, RabbitMQ)."""
    url = fresh_sqlite(tmp_path_factory.mktemp("deploy"), sqlite_template)
    broker = {
        "MESSAGE_BUS__TRANSPORT": "rabbitmq",
        "MESSAGE_BUS__URL": SERVICE_URLS["rabbitmq"],
        "APPLICATION__NAMESPACE": "deploy-assets-test",
    }
    worker_port, api_port = free_port(), free_port()
    with (
        worker_process(url, "--port", str(worker_port), **broker) as worker,
        api_process(url, api_port, **broker) as api,
    ):
        wait_for(f"http://127.0.0.1:{worker_port}/livez", worker)
        wait_for(f"http://127.0.0.1:{api_port}/livez", api)
        return {
            "worker": get(f"http://127.0.0.1:{worker_port}/metrics")[1],
            "api": get(f"http://127.0.0.1:{api_port}/metrics")[1],
        }


def api_process(database_url: str, port: int, **env: str) -> AbstractContextManager[subprocess.Popen[str]]:
    return service_process(database_url, "api", "--port", str(port), package=PACKAGE, **env)


def test_every_deploy_file_parses_and_kustomize_lists_every_manifest() -> None:
    assert alert_expressions()
    assert dashboard_expressions()
    kinds = [document["kind"] for document in manifests()]
    assert {"Deployment", "Service", "Job", "ConfigMap", "Secret", "PodDisruptionBudget"} <= set(kinds)
    kustomization = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in (DEPLOY / "kubernetes").glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


def test_every_metric_the_assets_use_is_exported_by_a_running_process(scraped: dict[str, str]) -> None:
    known = families(scraped["worker"]) | families(scraped["api"])
    used = {name for expr in alert_expressions() + dashboard_expressions() for name in METRIC.findall(expr)}
    assert used
    assert {name for name in used if family_of(name, known) is None} == set()


def test_the_dashboard_shows_every_metric_a_worker_or_the_api_exports(scraped: dict[str, str]) -> None:
    exported = families(scraped["worker"]) | families(scraped["api"])
    shown = {
        family
        for expr in dashboard_expressions()
        for name in METRIC.findall(expr)
        if (family := family_of(name, exported)) is not None
    }
    assert {name for name in exported if METRIC.fullmatch(name)} - shown == set()


def test_every_label_the_assets_group_by_belongs_to_their_metrics(scraped: dict[str, str]) -> None:
    """Label names come from the running registry's metrics (an exposition lists a label only
    once a sample has it): ``by (source, reason)`` on a metric without ``reason`` would be empty."""
    del scraped  # the names were checked against the scrape above; this needs the label sets
    bus = {"transport": "rabbitmq", "url": SERVICE_URLS["rabbitmq"]}
    container = build_container(make_settings("sqlite+aiosqlite:///unused.db", message_bus=bus))
    container.bus()  # FastStream's middleware registers its metrics with the bus
    container.http_metrics()  # and the HTTP instrumentation its own
    registry = container.metrics().registry
    labels = {
        name: set(getattr(collector, "_labelnames", ()))
        for collector, names in registry._collector_to_names.items()
        for name in names
    }
    wrong = []
    for expr in alert_expressions() + dashboard_expressions():
        metrics = set(METRIC.findall(expr))
        available = set().union(*(labels.get(name, set()) for name in metrics))
        if any(name.endswith("_bucket") for name in metrics):
            available.add("le")
        grouped = {label.strip() for group in GROUPING.findall(expr) for label in group.split(",")}
        if grouped - available:
            wrong.append((expr, sorted(grouped - available)))
    assert wrong == []


@pytest.mark.parametrize("component", ["api", "worker"])
def test_the_manifests_probe_and_scrape_what_the_process_serves(
    scraped: dict[str, str], sqlite_url: str, component: str
) -> None:
    del scraped  # started once already: the broker is there
    deployments = [d for d in manifests() if d["kind"] == "Deployment"]
    (deployment,) = [d for d in deployments if d["metadata"]["name"].endswith(f"-{component}")]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    command = container["command"]
    port = int(command[command.index("--port") + 1])
    probes = [container["livenessProbe"]["httpGet"], container["readinessProbe"]["httpGet"]]
    assert {probe["port"] for probe in probes} == {port}
    annotations = pod["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == port
    paths = [probe["path"] for probe in probes] + [annotations["prometheus.io/path"]]
    assert command[: command.index(component) + 1] == shlex.split(f"python -m {command[2]} {component}")
    local = free_port()  # the manifest's port may be taken here: the same process, another port
    broker = {"MESSAGE_BUS__TRANSPORT": "rabbitmq", "MESSAGE_BUS__URL": SERVICE_URLS["rabbitmq"]}
    starter = worker_process(sqlite_url, "--port", str(local), **broker) if component == "worker" else None
    with starter or api_process(sqlite_url, local, **broker) as process:
        wait_for(f"http://127.0.0.1:{local}/livez", process)
        statuses = {path: get(f"http://127.0.0.1:{local}{path}")[0] for path in paths}
    assert statuses == dict.fromkeys(paths, 200)
