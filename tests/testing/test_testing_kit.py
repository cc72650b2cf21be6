"""The testing kit for users (``celery_driftsafe.testing.pytest_plugin``), tested the way a user
meets it: pytest's ``pytester`` runs a small user-style test suite in a fresh pytest process,
which loads the plugin through its ``pytest11`` entry point (nothing names it there).

The inner runs use this suite's Django settings, so they run on the database of the pass
(``DRIFTSAFE_TEST_DB``), in a test database of their own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.docs import DOCS, samples

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]

INI = """
[pytest]
addopts = -p no:cacheprovider
filterwarnings =
    error
    ignore::DeprecationWarning:pytest_docker_tools.*
    ignore:unclosed <socket.socket:ResourceWarning
"""

ROUTES = """
app.conf.task_routes = {"reports.*": {"queue": "reports"}}
"""

#: Runs under the how-to's conftest overrides.
OVERRIDDEN = """
from datetime import UTC, datetime

import pytest


def test_the_overrides_apply(driftsafe):
    assert driftsafe.now() == datetime(2026, 3, 28, 12, 0, tzinfo=UTC)
    with pytest.raises(LookupError, match="the database has: none"):
        driftsafe.fired("nightly-report")  # not in the overriding app's schedule
"""

CONFTEST = """
import pytest


@pytest.fixture(autouse=True)
def _proj_app(settings):
    # The application names its Celery app in its settings, as a real project would.
    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "CELERY_APP": "proj_celery:app"}
"""

USER_TESTS = '''
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

BERLIN = ZoneInfo("Europe/Berlin")


def day(year, month, date):
    """One local day in Berlin, as (start, end)."""
    start = datetime(year, month, date, tzinfo=BERLIN)
    return start, datetime.combine(start.date() + timedelta(days=1), start.timetz())


def test_a_whole_week_around_the_change(driftsafe):
    driftsafe.clock.set(datetime(2026, 3, 26, 12, 0, tzinfo=UTC))
    start, _ = day(2026, 3, 27)
    _, end = day(2026, 3, 31)
    expected = [datetime(2026, 3, 27, 2, 30, tzinfo=BERLIN),
                datetime(2026, 3, 28, 2, 30, tzinfo=BERLIN),
                datetime(2026, 3, 29, 3, 0, tzinfo=BERLIN),
                datetime(2026, 3, 30, 2, 30, tzinfo=BERLIN),
                datetime(2026, 3, 31, 2, 30, tzinfo=BERLIN)]
    driftsafe.assert_fires("nightly-report", expected, between=(start, end))
    assert driftsafe.runs("nightly-report").count() == 5


def test_the_message_is_what_a_beat_sends(driftsafe):
    driftsafe.clock.set(datetime(2026, 3, 28, 12, 0, tzinfo=UTC))
    driftsafe.advance_to(datetime(2026, 3, 30, 0, 0, tzinfo=UTC))
    [message] = driftsafe.messages("nightly-report")
    assert message.task == "reports.nightly"
    assert message.kwargs == {"format": "pdf"}
    assert message.routing_key == "reports"  # the app's task_routes
    assert message.slot == datetime(2026, 3, 29, 1, 0, tzinfo=UTC)
    [run] = driftsafe.runs("nightly-report")
    assert (run.pk, run.status, run.celery_task_id) == (message.run_id, "dispatched",
                                                        message.task_id)


def test_with_transactional_db(transactional_db, driftsafe):
    driftsafe.clock.set(datetime(2026, 3, 28, 12, 0, tzinfo=UTC))
    driftsafe.advance_to(datetime(2026, 3, 30, 0, 0, tzinfo=UTC))
    assert driftsafe.fired("nightly-report") == [datetime(2026, 3, 29, 1, 0, tzinfo=UTC)]


def test_an_unknown_name_says_which_exist(driftsafe):
    with pytest.raises(LookupError, match="no periodic task named 'nightly'.*'nightly-report'"):
        driftsafe.fired("nightly")


def test_naive_instants_and_going_back_are_refused(driftsafe):
    with pytest.raises(ValueError, match="aware datetimes"):
        driftsafe.advance_to(datetime(2026, 3, 29, 2, 30))
    driftsafe.clock.set(datetime(2026, 3, 29, 12, 0, tzinfo=UTC))
    with pytest.raises(ValueError, match="does not go back"):
        driftsafe.advance_to(datetime(2026, 3, 29, 11, 0, tzinfo=UTC))


def test_no_fake_authority_outside_the_fixture():
    from celery_driftsafe.store.clock import authority_clock
    from celery_driftsafe.testing import FakeClock

    assert not isinstance(authority_clock(), FakeClock)


def test_wrong_expectation_fails_clearly(driftsafe):
    driftsafe.clock.set(datetime(2026, 3, 28, 12, 0, tzinfo=UTC))
    driftsafe.assert_fires(
        "nightly-report", [datetime(2026, 3, 29, 2, 30, tzinfo=BERLIN)],
        between=day(2026, 3, 29),
    )
'''


#: A task every second in the project's schedule, beside the how-to's nightly report.
EVERY_SECOND = """
app.conf.beat_schedule["heartbeat"] = {"task": "proj.heartbeat", "schedule": 1.0}
"""

#: Around every test of the project with a task every second: the beat steps the slots of the
#: tasks the test is about only, so it runs a few rounds, not one a second, and publishes the
#: task every second (which none of the how-to's tests is about) at most once a round.
FEW_ROUNDS = (
    CONFTEST
    + """

@pytest.fixture
def driftsafe(driftsafe):
    yield driftsafe
    heartbeats = [m for m in driftsafe.published if m.task == "proj.heartbeat"]
    assert 0 < driftsafe.rounds <= 12, f"{driftsafe.rounds} rounds"
    assert len(heartbeats) <= driftsafe.rounds, f"{len(heartbeats)} heartbeats"
"""
)

STEPPING_TESTS = """
from datetime import UTC, datetime, timedelta

import pytest

START = datetime(2026, 1, 1, tzinfo=UTC)


def test_a_task_that_was_not_stepped_is_named_first(driftsafe):
    driftsafe.clock.set(datetime(2026, 3, 28, 12, 0, tzinfo=UTC))
    day = (datetime(2026, 3, 29, tzinfo=UTC), datetime(2026, 3, 30, tzinfo=UTC))
    driftsafe.assert_fires("nightly-report", [datetime(2026, 3, 29, 1, 0, tzinfo=UTC)], between=day)
    with pytest.raises(LookupError, match=r"driftsafe\\.watch\\('heartbeat'\\)"):
        driftsafe.fired("heartbeat")


def test_a_task_named_first_is_stepped(driftsafe):
    driftsafe.watch("heartbeat")
    driftsafe.advance(timedelta(seconds=5))
    assert driftsafe.fired("heartbeat") == [START + timedelta(seconds=s) for s in range(1, 6)]
"""


def _user_project(pytester: pytest.Pytester) -> None:
    """The how-to's samples as written (its Celery app, its two test modules, its conftest
    overrides in a folder of their own), plus :data:`USER_TESTS`."""
    app, dst_tests, task_tests, overrides = samples("howto/test-your-schedules.md")
    pytester.makeini(INI)
    # The app the how-to's tests expect, routing its reports to a queue of their own.
    pytester.makepyfile(proj_celery=app + ROUTES)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_howto_dst=dst_tests, test_howto_tasks=task_tests, test_user_schedules=USER_TESTS
    )
    folder = pytester.mkpydir("overrides")
    (folder / "conftest.py").write_text(overrides)
    (folder / "test_overrides.py").write_text(OVERRIDDEN)


def _environment(monkeypatch: pytest.MonkeyPatch, *, django: bool) -> None:
    # The suite's own modules (tests.settings) next to the inner project's.
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    if django:
        monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "tests.settings")
    else:
        monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)


# The inner run depends on the database of the pass: marked like the suite's database tests,
# so that both the SQLite and the PostgreSQL passes run it.
@pytest.mark.django_db
def test_user_tests_of_schedules_pass_and_a_wrong_expectation_fails_clearly(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _environment(monkeypatch, django=True)
    _user_project(pytester)
    result = pytester.runpytest_subprocess("-v", "-p", "no:xdist", "--no-migrations")
    result.assert_outcomes(passed=11, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_wrong_expectation_fails_clearly FAILED*",
            "E*AssertionError: periodic task 'nightly-report' fired 1 time(s) between "
            "2026-03-28 23:00:00 UTC (2026-03-29 00:00:00 CET Europe/Berlin) and "
            "2026-03-29 22:00:00 UTC (2026-03-30 00:00:00 CEST Europe/Berlin), expected 1:",
            "E*expected: 2026-03-29 01:30:00 UTC (2026-03-29 03:30:00 CEST Europe/Berlin)",
            "E*fired:    2026-03-29 01:00:00 UTC (2026-03-29 03:00:00 CEST Europe/Berlin)",
            "E*missing:  2026-03-29 01:30:00 UTC (2026-03-29 03:30:00 CEST Europe/Berlin)",
            "E*extra:    2026-03-29 01:00:00 UTC (2026-03-29 03:00:00 CEST Europe/Berlin)",
        ]
    )
    # The how-to shows this failure: word for word.
    howto = (DOCS / "howto/test-your-schedules.md").read_text()
    message = next(line for line in result.stdout.lines if "AssertionError: periodic" in line)
    assert message.split("AssertionError: ", 1)[1] in howto


def test_the_plugin_loads_without_django_configured(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _environment(monkeypatch, django=False)
    pytester.makeini(INI)
    pytester.makepyfile(
        test_clock="""
        from datetime import UTC, datetime, timedelta

        def test_fake_clock(driftsafe_clock):
            assert driftsafe_clock.now() == datetime(2026, 1, 1, tzinfo=UTC)
            driftsafe_clock.advance(timedelta(minutes=5))
            assert driftsafe_clock.now() == datetime(2026, 1, 1, 0, 5, tzinfo=UTC)
    """
    )
    result = pytester.runpytest_subprocess("-p", "no:xdist", "--fixtures")
    result.stdout.fnmatch_lines(["*fixtures defined from celery_driftsafe.testing.pytest_plugin*"])
    result = pytester.runpytest_subprocess("-p", "no:xdist")
    result.assert_outcomes(passed=1)


# The inner run depends on the database of the pass, as above.
@pytest.mark.django_db
def test_the_howto_samples_pass_beside_a_task_every_second_stepping_only_their_tasks(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The how-to's tests as written, in a project whose ``beat_schedule`` also has a task
    every second: each runs a few rounds (its conftest counts them; stepping every task took
    one round a second, 129,600 for the nightly report's day and a half, past ``MAX_ROUNDS``),
    and a task the beat did not step is named before it is asked about."""
    _environment(monkeypatch, django=True)
    app, dst_tests, task_tests, _ = samples("howto/test-your-schedules.md")
    pytester.makeini(INI)
    pytester.makepyfile(proj_celery=app + EVERY_SECOND)
    pytester.makeconftest(FEW_ROUNDS)
    pytester.makepyfile(
        test_howto_dst=dst_tests, test_howto_tasks=task_tests, test_stepping=STEPPING_TESTS
    )
    result = pytester.runpytest_subprocess("-v", "-p", "no:xdist", "--no-migrations")
    result.assert_outcomes(passed=6)
