"""Handlers do not save: the kit's static call-graph rule, on every handler this service registers.

The rule (``outbox_kit.testing.SaveRule``) walks the calls below each registered handler and
fails with the whole chain, file and line for every hop, when a path saves on its own. Configure
it here: ``ALLOWLIST`` for accepted exceptions (with the reason), ``SINKS`` for more kinds of
save. The kit's own sinks (SQLAlchemy's and the unit of work's commits) and accepted writes
(a savepoint) come with it; the rule's limits are in its docstring, and its negative fixtures are
proven in the template's CI.
"""

from __future__ import annotations

import pytest
from outbox_kit.runtime.container import build_handlers
from outbox_kit.testing import SaveRule, SinkSpec, service_save_rule

from {{ cookiecutter.package_name }}.container import build_modules

pytestmark = pytest.mark.architecture

PACKAGE = build_modules.__module__.partition(".")[0]

# Accepted exceptions: dotted name (handler, function, class, module) -> why the write is fine.
# The walk stops at the name, and the report prints the reason.
ALLOWLIST: dict[str, str] = {}
# More kinds of save than SQLAlchemy's and the unit of work's commits: a dotted name, or a
# (type, method) pair matched on the receiver's type.
SINKS: tuple[SinkSpec, ...] = ()


def service_rule() -> SaveRule:
    return service_save_rule(PACKAGE, build_modules(), allowlist=ALLOWLIST, sinks=SINKS)


def test_registered_handlers_do_not_save() -> None:
    registered = build_handlers(build_modules()).all_handlers()
    report = service_rule().check(registered)

    assert not report.unresolved, report.describe()
    assert len(report.checked) == len({(kind, id(h)) for kind, hs in registered.items() for h in hs})
    assert not report.violations, report.describe()
    for hit in report.allowlisted:
        print(hit.describe())


def test_allowlist_entries_and_sinks_name_real_code() -> None:
    rule = service_rule()

    assert rule.unknown_allowlist_entries() == []
    assert rule.unknown_sinks() == []
    assert SaveRule(packages=(PACKAGE,), sinks=(("sqlalchemy.orm.Sesion", "commit"),)).unknown_sinks()
