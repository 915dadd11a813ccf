"""The "handlers do not save" rule (``outbox_kit.testing.SaveRule``) is not vacuous: on negative
fixtures (``save_fixtures``) each saving handler is reported with its whole chain, the one beyond
the depth limit is (honestly) not, and the allowlisted one passes with its reason reported."""

from __future__ import annotations

from pathlib import Path

import pytest
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork
from outbox_kit.testing import DEFAULT_DEPTH, DEFAULT_SINKS, Report, SaveRule, SinkSpec, Violation
from outbox_kit.testing.rules import KIT_PACKAGE
from save_fixtures import registry as fixtures

pytestmark = pytest.mark.unit

# What counts as a save in a service: SQLAlchemy/SQLModel commit, flush and begin, and the unit
# of work's commit; the fixtures add one sink of their own.
SINKS: tuple[SinkSpec, ...] = (*DEFAULT_SINKS, (SqlUnitOfWork, "commit"))

# -- the negative fixtures -------------------------------------------------------------------

FIXTURES = fixtures.__name__.rpartition(".")[0]
HANDLERS = f"{FIXTURES}.handlers"
ALL_FIXTURE_HANDLERS = 20

# handler -> the hops after it, each a fragment of the hop's name, ending with the save.
SAVES: dict[str, tuple[str, ...]] = {
    "commits_the_unit_of_work": ("SqlUnitOfWork.commit",),
    "commits_the_session": ("AsyncSession.commit",),
    "flushes_through_a_helper": ("helpers.flush_everything", "AsyncSession.flush"),
    "RecordsAudit.__call__": ("SqlAuditRepository.append", "AsyncSession.flush"),
    "charges_through_a_protocol": (
        "helpers.charge",
        "SqlPaymentGateway.capture",
        "SqlPaymentGateway._record",
        "AsyncSession.commit",
    ),
    "posts_through_the_adapters_map": ("infrastructure.SqlLedger.post", "SqlUnitOfWork.commit"),
    "commits_in_a_lambda": ("commits_in_a_lambda.<locals>.<lambda>", "SqlUnitOfWork.commit"),
    "commits_in_a_nested_function": ("commits_in_a_nested_function.<locals>.persist", "SqlUnitOfWork.commit"),
    "flushes_through_a_partial": ("helpers.flush_everything", "AsyncSession.flush"),
    "commits_an_untyped_receiver": ("?.commit",),
    "OpensItsOwnUnitOfWork.__call__": ("SqlUnitOfWork.commit",),
    "writes_in_its_own_session_transaction": ("AsyncSession.begin",),
    "WritesThroughTheEngine.__call__": ("AsyncEngine.begin",),
    "CommitsAConnection.__call__": ("AsyncConnection.commit",),
    "WritesThroughASessionFactory.__call__": ("async_sessionmaker.begin",),
    "calls_a_declared_sink": ("helpers.post_to_the_ledger_api",),
    "ChargesThroughAProvider.__call__": (
        "SqlPaymentGateway.capture",
        "SqlPaymentGateway._record",
        "AsyncSession.commit",
    ),
}
PASSES = ("saves_beyond_the_depth_limit", "writes_an_accepted_audit", "only_mutates_state")


FIXTURE_SINKS: tuple[SinkSpec, ...] = (*SINKS, fixtures.DECLARED_SINK)


def fixture_rule(depth: int = DEFAULT_DEPTH) -> SaveRule:
    return SaveRule(
        packages=(FIXTURES, KIT_PACKAGE),
        adapters=fixtures.ADAPTERS,
        allowlist=fixtures.ALLOWLIST,
        sinks=FIXTURE_SINKS,
        depth=depth,
    )


@pytest.fixture(scope="module")
def fixture_report() -> Report:
    return fixture_rule().check(fixtures.build_registry().all_handlers())


def the_violation(report: Report, handler: str) -> Violation:
    found = report.violations_of(f"{HANDLERS}.{handler}")
    assert len(found) == 1, report.describe()
    return found[0]


def test_every_fixture_handler_is_walked(fixture_report: Report) -> None:
    assert not fixture_report.unresolved
    assert len(fixture_report.checked) == ALL_FIXTURE_HANDLERS
    assert {v.handler for v in fixture_report.violations} == {f"{HANDLERS}.{name}" for name in SAVES}


@pytest.mark.parametrize("handler", list(SAVES))
def test_a_handler_that_saves_is_reported_with_its_chain(fixture_report: Report, handler: str) -> None:
    violation = the_violation(fixture_report, handler)
    reached = violation.names[1:]

    assert violation.names[0] == f"{HANDLERS}.{handler}"
    assert len(reached) == len(SAVES[handler]), violation.describe()
    for name, expected in zip(reached, SAVES[handler], strict=True):
        assert expected in name, violation.describe()
    described = fixture_report.describe()
    assert violation.describe() in described
    for hop in violation.chain:
        assert f"{hop.name}  [{hop.how} at {hop.location}]" in described


@pytest.mark.parametrize("handler", list(SAVES))
def test_the_chain_points_at_the_saving_line(fixture_report: Report, handler: str) -> None:
    sink = the_violation(fixture_report, handler).chain[-1]
    line = Path(sink.path).read_text(encoding="utf-8").splitlines()[sink.line - 1]

    assert sink.name.rpartition(".")[2] in line


@pytest.mark.parametrize("handler", PASSES)
def test_a_handler_without_a_reported_save_passes(fixture_report: Report, handler: str) -> None:
    assert fixture_report.violations_of(f"{HANDLERS}.{handler}") == []


def test_a_save_beyond_the_depth_limit_is_not_found_the_honest_limit() -> None:
    handler = f"{HANDLERS}.saves_beyond_the_depth_limit"
    registered = fixtures.build_registry().all_handlers()

    assert fixture_rule(DEFAULT_DEPTH).check(registered).violations_of(handler) == []
    deeper = fixture_rule(DEFAULT_DEPTH + 1).check(registered).violations_of(handler)
    assert [v.names[-2:] for v in deeper] == [
        (f"{FIXTURES}.helpers.hop_7", "sqlalchemy.ext.asyncio.session.AsyncSession.commit")
    ]


def test_an_allowlisted_save_passes_and_its_reason_is_reported(fixture_report: Report) -> None:
    handler = f"{HANDLERS}.writes_an_accepted_audit"
    (hit,) = fixture_report.allowlisted_for(handler)

    assert fixture_report.violations_of(handler) == []
    assert hit.entry == f"{FIXTURES}.infrastructure.IndependentAudit"
    assert hit.name.startswith(f"{hit.entry}.")
    assert hit.reason == fixtures.ACCEPTED_AUDIT_REASON
    assert fixtures.ACCEPTED_AUDIT_REASON in fixture_report.describe()


def test_without_the_allowlist_the_accepted_save_is_reported() -> None:
    rule = SaveRule(packages=(FIXTURES, KIT_PACKAGE), adapters=fixtures.ADAPTERS, sinks=FIXTURE_SINKS)
    report = rule.check(fixtures.build_registry().all_handlers())

    (violation,) = report.violations_of(f"{HANDLERS}.writes_an_accepted_audit")
    assert violation.names[-2:] == (
        f"{FIXTURES}.infrastructure.IndependentAudit.write",
        "sqlalchemy.ext.asyncio.session.AsyncSession.commit",
    )
