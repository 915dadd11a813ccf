"""The service's AsyncAPI document, as ``make asyncapi`` writes it: a channel for every
integration event its contexts register (the kit's tests cover the document's form)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from outbox_kit.public import IntegrationEvent
from outbox_kit.testing.fixtures import make_settings

from {{ cookiecutter.package_name }}.container import build_container

pytestmark = pytest.mark.integration
PROJECT = Path(__file__).resolve().parents[2]


def test_the_asyncapi_command_and_make_target_write_the_document(tmp_path: Path) -> None:
    """``make asyncapi`` runs ``asyncapi --output asyncapi.json``; the command writes a document
    with a channel for every integration event the service registers."""
    make = shutil.which("make")
    assert make is not None, "make is needed to run the project's targets"
    dry_run = subprocess.run(
        [make, "-n", "asyncapi"], cwd=PROJECT, capture_output=True, text=True, timeout=60, check=False
    )
    assert dry_run.returncode == 0, dry_run.stderr
    assert "asyncapi --output asyncapi.json" in dry_run.stdout
    target = tmp_path / "asyncapi.json"
    env = {k: v for k, v in os.environ.items() if "__" not in k}
    written = subprocess.run(
        [
            sys.executable,
            "-m",
            "{{ cookiecutter.package_name }}",
            "asyncapi",
            "--output",
            str(target),
        ],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert written.returncode == 0, written.stderr
    document = json.loads(target.read_text(encoding="utf-8"))
    assert document["asyncapi"] == "3.0.0"
    channels = {name: channel["address"] for name, channel in document["channels"].items()}
    registry = build_container(make_settings("sqlite+aiosqlite:///unused.db")).registry()
    for event in registry.classes(IntegrationEvent):
        key = event.message_name.replace(".", "_").replace("-", "_")
        assert channels[key].endswith(event.message_name), f"{event.message_name} has no channel"
