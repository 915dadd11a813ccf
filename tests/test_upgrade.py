"""Tier 2, upgrade: a generated service follows a template update with cruft, cleanly.

The template is copied into a git repository of its own (cruft reads templates from git), a
service is made from it the two documented ways (``cruft create``, or ``cookiecutter`` and then
``cruft link`` with the recorded answers), the template changes, and ``cruft update`` must apply
the change with no conflict and no ``.rej`` file, leaving ``cruft diff`` empty. A service its
team has extended (a context of its own, edits to the example) takes a new kit the same way."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from .support import BIN, TEMPLATE, check, run

pytestmark = pytest.mark.upgrade
CRUFT = str(BIN / "cruft")
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
}
NEW_SETTING = "# Added by a template update.\nAPPLICATION__EXAMPLE_ADDED=1\n"


def git(folder: Path, *args: str) -> str:
    return check(["git", *args], folder, env=GIT_IDENTITY).stdout


def commit_everything(folder: Path, message: str) -> None:
    git(folder, "add", "--all")
    git(folder, "commit", "--quiet", "--message", message)


@pytest.fixture
def template_repo(tmp_path: Path) -> Path:
    """The template as it is on disk, committed into a fresh git repository."""
    repo = tmp_path / "template"
    ignored = shutil.ignore_patterns(".git", ".venv", "build", "__pycache__", ".*_cache")
    shutil.copytree(TEMPLATE, repo, ignore=ignored)
    git(repo, "init", "--quiet", "--initial-branch=main")
    commit_everything(repo, "template v1")
    return repo


def update_the_template(repo: Path) -> None:
    """What a template release does: a new setting in .env.example, a changed dependency floor."""
    example = repo / "{{cookiecutter.service_slug}}" / ".env.example"
    example.write_text(example.read_text() + NEW_SETTING)
    pyproject = repo / "{{cookiecutter.service_slug}}" / "pyproject.toml"
    text = pyproject.read_text()
    assert '"pyjwt[crypto]>=2.10,<3",' in text
    pyproject.write_text(text.replace('"pyjwt[crypto]>=2.10,<3",', '"pyjwt[crypto]>=2.11,<3",'))
    commit_everything(repo, "template v2")


def service_repo(project: Path) -> None:
    git(project, "init", "--quiet", "--initial-branch=main")
    commit_everything(project, "generated")


def assert_clean_update(project: Path, template: Path) -> None:
    update_the_template(template)
    result = run([CRUFT, "check"], project)
    assert result.returncode != 0, "cruft check missed the new template commit"
    updated = check([CRUFT, "update", "--skip-apply-ask"], project)
    assert "conflict" not in (updated.stdout + updated.stderr).lower(), updated.stdout + updated.stderr
    assert sorted(p.name for p in project.rglob("*.rej")) == []
    assert (project / ".env.example").read_text().endswith(NEW_SETTING)
    assert '"pyjwt[crypto]>=2.11,<3",' in (project / "pyproject.toml").read_text()
    changed = sorted(line[3:] for line in git(project, "status", "--porcelain").splitlines())
    assert changed == [".cruft.json", ".env.example", "pyproject.toml"], changed
    check([CRUFT, "check"], project)
    check([CRUFT, "diff", "--exit-code"], project)


def test_a_service_made_with_cruft_create_takes_a_template_update(
    tmp_path: Path, template_repo: Path
) -> None:
    output = tmp_path / "services"
    create = [CRUFT, "create", "--no-input", "--output-dir", str(output)]
    check([*create, "--extra-context", '{"broker": "nats"}', str(template_repo)], tmp_path)
    project = output / "order-service"
    service_repo(project)
    check([CRUFT, "diff", "--exit-code"], project)  # nothing differs right after creation
    assert_clean_update(project, template_repo)
    answers = json.loads((project / ".cruft.json").read_text())["context"]["cookiecutter"]
    assert answers["broker"] == "nats"


def test_a_linked_service_keeps_its_answers_and_takes_a_template_update(
    tmp_path: Path, template_repo: Path
) -> None:
    """``cruft link`` without a terminal would record the template's defaults: given the recorded
    answers (the documented command), it records this service's own."""
    output = tmp_path / "services"
    generate = [sys.executable, "-m", "cookiecutter", "--no-input", "--output-dir", str(output)]
    check([*generate, str(template_repo), "broker=nats", "include_example=false"], tmp_path)
    project = output / "order-service"
    service_repo(project)
    recorded = json.loads((project / ".cookiecutter.json").read_text())["cookiecutter"]
    check(
        [CRUFT, "link", "--no-input", "--extra-context", json.dumps(recorded), str(template_repo)],
        project,
    )
    answers = json.loads((project / ".cruft.json").read_text())["context"]["cookiecutter"]
    assert (answers["broker"], answers["include_example"]) == ("nats", False)
    commit_everything(project, "track the template with cruft")
    check([CRUFT, "diff", "--exit-code"], project)  # no spurious change right after linking
    assert_clean_update(project, template_repo)


KIT_MODULE = "kit/src/outbox_kit/persistence/tables.py"
KIT_CHANGE = ('RETRIES_EXHAUSTED = "retries_exhausted"\n', 'RETRIES_EXHAUSTED = "retries_exhausted"  # v2\n')
OWN_CONTEXT = {
    "__init__.py": "",
    "domain.py": '"""Invoices: the team\'s own context."""\n\nINVOICE_PREFIX = "INV-"\n',
    "module.py": (
        "from outbox_kit.public import Module\n\n\n"
        "def module() -> Module:\n"
        '    return Module(name="invoices")\n'
    ),
}


def release_a_new_kit(repo: Path) -> None:
    """A template release that changes the kit: one of its modules and its changelog."""
    kit = repo / "{{cookiecutter.service_slug}}"
    module = kit / KIT_MODULE
    text = module.read_text()
    assert text.count(KIT_CHANGE[0]) == 1
    module.write_text(text.replace(*KIT_CHANGE))
    changelog = kit / "kit" / "CHANGELOG.md"
    changelog.write_text(changelog.read_text() + "\n## next\n\n- A change of the kit.\n")
    commit_everything(repo, "template v2: a new kit")


def test_an_extended_service_takes_a_new_kit_without_a_conflict(tmp_path: Path, template_repo: Path) -> None:
    output = tmp_path / "services"
    check([CRUFT, "create", "--no-input", "--output-dir", str(output), str(template_repo)], tmp_path)
    project = output / "order-service"
    service_repo(project)
    contexts = project / "src" / "order_service" / "contexts"
    for name, text in OWN_CONTEXT.items():
        (contexts / "invoices").mkdir(exist_ok=True)
        (contexts / "invoices" / name).write_text(text)
    example = contexts / "orders" / "domain.py"
    edited = example.read_text() + "\n\n# The team's own rule, added after generation.\nMAX_LINES = 50\n"
    example.write_text(edited)
    commit_everything(project, "our own context, and a rule in the example")

    release_a_new_kit(template_repo)
    updated = check([CRUFT, "update", "--skip-apply-ask"], project)
    assert "conflict" not in (updated.stdout + updated.stderr).lower(), updated.stdout + updated.stderr
    assert sorted(p.name for p in project.rglob("*.rej")) == []
    assert KIT_CHANGE[1] in (project / KIT_MODULE).read_text()
    assert (project / "kit" / "CHANGELOG.md").read_text().endswith("- A change of the kit.\n")
    assert example.read_text() == edited  # the team's edits and context are left as they were
    assert (contexts / "invoices" / "module.py").read_text() == OWN_CONTEXT["module.py"]
    changed = sorted(line[3:] for line in git(project, "status", "--porcelain").splitlines())
    assert changed == [".cruft.json", "kit/CHANGELOG.md", KIT_MODULE], changed
