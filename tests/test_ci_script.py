"""Tier 0, ci: ``.ci/run`` stops only what it started and never deletes a service's data.

CI runs on machines whose services (PostgreSQL, RabbitMQ, Redis, NATS) belong to the machine, not
to the run: a run may restart a broker that does not answer, with the broker's own command and
the pid the broker itself recorded, but never kill processes by name nor wipe a data folder.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from .support import TEMPLATE

pytestmark = pytest.mark.ci

SCRIPT = TEMPLATE / ".ci" / "run"


def commands() -> list[str]:
    """The script's lines without comments."""
    lines = (line.split("#", 1)[0].strip() for line in SCRIPT.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line]


def test_no_kill_by_name_and_no_deletion() -> None:
    forbidden = re.compile(r"\b(pkill|killall|rm)\b")
    assert [line for line in commands() if forbidden.search(line)] == []
    kills = [line for line in commands() if re.search(r"\bkill\s+-(TERM|KILL|9)\b|\bkill\s+\"", line)]
    assert kills, "the script signals the pids it knows"
    assert all(re.search(r'"\$(pid|tansu_pid)"', line) for line in kills), kills


def function(name: str) -> str:
    source = SCRIPT.read_text(encoding="utf-8")
    found = re.search(rf"^{name}\(\) \{{\n.*?^\}}\n", source, re.MULTILINE | re.DOTALL)
    assert found is not None, f".ci/run defines no {name}()"
    return found.group(0)


def test_a_stale_pid_file_never_signals_another_process(tmp_path: Path) -> None:
    """The node cannot be reached (``rabbitmqctl`` fails) and its pid file names a process that is
    not an Erlang VM (the pid was reused): that process lives on."""
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        conf = tmp_path / "rabbitmq-env.conf"
        (tmp_path / "rabbit@ci.pid").write_text(str(bystander.pid))
        stub = tmp_path / "bin"
        stub.mkdir()
        (stub / "rabbitmqctl").write_text("#!/bin/sh\nexit 69\n")
        (stub / "rabbitmqctl").chmod(0o755)
        script = "\n".join(
            [
                function("rabbit_pid").replace("/etc/rabbitmq/rabbitmq-env.conf", str(conf)),
                function("stop_rabbit"),
            ]
        )
        conf.write_text("NODENAME=rabbit@ci\n")
        environment = {
            **os.environ,
            "PATH": f"{stub}{os.pathsep}{os.environ['PATH']}",
            "RABBITMQ_MNESIA_BASE": str(tmp_path),
        }
        ran = subprocess.run(
            ["bash", "-c", f"{script}\nstop_rabbit; echo stopped"],
            env=environment,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert "stopped" in ran.stdout
        assert bystander.poll() is None, "a process that is not the broker was signalled"
        assert "TERM" not in ran.stdout
    finally:
        bystander.kill()
        bystander.wait()


def test_the_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
