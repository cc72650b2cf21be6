"""The testing kit for users (``celery_driftsafe.testing.pytest_plugin``), tested the way a user
meets it: pytest's ``pytester`` runs a small user-style test suite in a fresh pytest process,
which loads the plugin through its ``pytest11`` entry point (nothing names it there).

The inner runs use this suite's Django settings, so they run on the database of the pass
(``DRIFTSAFE_TEST_DB``), in a test database of their own.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parent.parent

INI = """
[pytest]
addopts = -p no:cacheprovider
filterwarnings =
    error
    ignore::DeprecationWarning:pytest_docker_tools.*
    ignore:unclosed <socket.socket:ResourceWarning
"""

#: The user's Celery app, with the schedule the inner tests check.
PROJ_CELERY = """
from celery import Celery
from celery.schedules import crontab

app = Celery("proj", set_as_current=False)
app.conf.timezone = "Europe/Berlin"
app.conf.task_routes = {"reports.*": {"queue": "reports"}}
app.conf.beat_schedule = {
    "nightly-report": {
        "task": "reports.nightly",
        "schedule": crontab(minute=30, hour=2),
        "kwargs": {"format": "pdf"},
    },
}
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

from celery_driftsafe.models import PeriodicTask, Run

BERLIN = ZoneInfo("Europe/Berlin")


def day(year, month, date):
    """One local day in Berlin, as (start, end)."""
    start = datetime(year, month, date, tzinfo=BERLIN)
    return start, datetime.combine(start.date() + timedelta(days=1), start.timetz())


def test_nightly_report_fires_once_on_spring_forward(driftsafe):
    driftsafe.clock.set(datetime(2026, 3, 28, 12, 0, tzinfo=UTC))
    # 02:30 does not exist in Berlin on 2026-03-29: it fires once, at the end of the gap.
    driftsafe.assert_fires(
        "nightly-report", [datetime(2026, 3, 29, 3, 0, tzinfo=BERLIN)],
        between=day(2026, 3, 29),
    )
    [message] = driftsafe.messages("nightly-report")
    assert message.task == "reports.nightly"
    assert message.kwargs == {"format": "pdf"}
    assert message.routing_key == "reports"
    assert message.slot == datetime(2026, 3, 29, 1, 0, tzinfo=UTC)


def test_nightly_report_fires_once_on_fall_back(driftsafe):
    driftsafe.clock.set(datetime(2026, 10, 24, 12, 0, tzinfo=UTC))
    # 02:30 happens twice in Berlin on 2026-10-25: it fires once, at the first (fold=0, CEST).
    driftsafe.assert_fires(
        "nightly-report", [datetime(2026, 10, 25, 2, 30, tzinfo=BERLIN)],
        between=day(2026, 10, 25),
    )
    assert driftsafe.fired("nightly-report") == [datetime(2026, 10, 25, 0, 30, tzinfo=UTC)]


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


def test_a_task_created_in_the_test_fires_every_quarter_through_the_repeated_hour(driftsafe):
    driftsafe.clock.set(datetime(2026, 10, 25, 0, 0, tzinfo=UTC))  # 02:00 CEST
    PeriodicTask.objects.create(
        name="poll feeds", task="feeds.poll", schedule_kind="crontab",
        crontab_minute="*/15", crontab_hour="*", timezone="Europe/Berlin",
    )
    driftsafe.advance_to(datetime(2026, 10, 25, 2, 0, tzinfo=UTC))  # 03:00 CET
    # 02:00-03:00 happens twice: a quarter-hourly task fires every 15 real minutes.
    start = datetime(2026, 10, 25, 0, 15, tzinfo=UTC)
    assert driftsafe.fired("poll feeds") == [start + timedelta(minutes=15 * k) for k in range(8)]
    assert driftsafe.now() == datetime(2026, 10, 25, 2, 0, tzinfo=UTC)


def test_a_stopped_beat_catches_up_once(driftsafe):
    driftsafe.clock.set(datetime(2026, 5, 4, 8, 0, tzinfo=UTC))
    PeriodicTask.objects.create(name="sync", task="crm.sync", schedule_kind="interval",
                                interval_every=10, interval_unit="minutes")
    driftsafe.advance(timedelta(minutes=30))
    assert len(driftsafe.fired("sync")) == 3
    driftsafe.clock.advance(timedelta(hours=2))  # no rounds: the beats were down
    driftsafe.run_round()
    assert len(driftsafe.fired("sync")) == 4  # one catch-up firing, not twelve
    assert Run.objects.filter(status="missed").exists()


def test_with_transactional_db(transactional_db, driftsafe):
    driftsafe.clock.set(datetime(2026, 3, 28, 12, 0, tzinfo=UTC))
    driftsafe.advance_to(datetime(2026, 3, 30, 0, 0, tzinfo=UTC))
    assert driftsafe.fired("nightly-report") == [datetime(2026, 3, 29, 1, 0, tzinfo=UTC)]


def test_an_unknown_name_says_which_exist(driftsafe):
    with pytest.raises(LookupError, match="no periodic task named 'nightly'.*'nightly-report'"):
        driftsafe.fired("nightly")


def test_naive_instants_are_refused(driftsafe):
    with pytest.raises(ValueError, match="aware datetimes"):
        driftsafe.advance_to(datetime(2026, 3, 29, 2, 30))


def test_wrong_expectation_fails_clearly(driftsafe):
    driftsafe.clock.set(datetime(2026, 3, 28, 12, 0, tzinfo=UTC))
    driftsafe.assert_fires(
        "nightly-report", [datetime(2026, 3, 29, 2, 30, tzinfo=BERLIN)],
        between=day(2026, 3, 29),
    )
'''


def _user_project(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI)
    pytester.makepyfile(proj_celery=PROJ_CELERY)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_user_schedules=USER_TESTS)


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
    result.assert_outcomes(passed=8, failed=1)
    result.stdout.fnmatch_lines([
        "*test_wrong_expectation_fails_clearly FAILED*",
        "E*AssertionError: periodic task 'nightly-report' fired 1 time(s) between "
        "2026-03-28 23:00:00 UTC (2026-03-29 00:00:00 CET Europe/Berlin) and "
        "2026-03-29 22:00:00 UTC (2026-03-30 00:00:00 CEST Europe/Berlin), expected 1:",
        "E*expected: 2026-03-29 01:30:00 UTC (2026-03-29 03:30:00 CEST Europe/Berlin)",
        "E*fired:    2026-03-29 01:00:00 UTC (2026-03-29 03:00:00 CEST Europe/Berlin)",
        "E*missing:  2026-03-29 01:30:00 UTC (2026-03-29 03:30:00 CEST Europe/Berlin)",
        "E*extra:    2026-03-29 01:00:00 UTC (2026-03-29 03:00:00 CEST Europe/Berlin)",
    ])


def test_the_plugin_loads_without_django_configured(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _environment(monkeypatch, django=False)
    pytester.makeini(INI)
    pytester.makepyfile(test_clock="""
        from datetime import UTC, datetime, timedelta

        def test_fake_clock(driftsafe_clock):
            assert driftsafe_clock.now() == datetime(2026, 1, 1, tzinfo=UTC)
            driftsafe_clock.advance(timedelta(minutes=5))
            assert driftsafe_clock.now() == datetime(2026, 1, 1, 0, 5, tzinfo=UTC)
    """)
    result = pytester.runpytest_subprocess("-p", "no:xdist", "--fixtures")
    result.stdout.fnmatch_lines(["*fixtures defined from celery_driftsafe.testing.pytest_plugin*"])
    result = pytester.runpytest_subprocess("-p", "no:xdist")
    result.assert_outcomes(passed=1)
    assert "DJANGO_SETTINGS_MODULE" not in os.environ
