"""The beat's verdict on its clock offset: judged on every fresh measurement, whoever took it,
measured again at once when the wall clock steps, and logged once each time it crosses a
bound (a beat an hour off said so for some beats and not others: the clock's own measurement,
taken inside ``now()``, was never judged)."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

import pytest

from celery_driftsafe.beat.nodes import ClockWatch
from celery_driftsafe.conf import get_settings
from celery_driftsafe.store.clock import AuthorityClock
from tests.support import T0


class Machine:
    """A node's two clocks and a true time: the authority reads the true time, the wall clock
    is the true time plus ``skew`` (which a test steps), the monotonic clock never steps."""

    name = "database"

    def __init__(self) -> None:
        self.elapsed = 0.0
        self.skew = 0.0

    def read(self) -> datetime:  # the authority
        return T0 + timedelta(seconds=self.elapsed)

    def wall(self) -> datetime:
        return T0 + timedelta(seconds=self.elapsed + self.skew)

    def monotonic(self) -> float:
        return 1000.0 + self.elapsed


@pytest.fixture
def machine() -> Machine:
    return Machine()


@pytest.fixture
def watch(machine: Machine) -> ClockWatch:
    clock = AuthorityClock(
        machine, samples=1, resync_seconds=60, monotonic=machine.monotonic, wall=machine.wall
    )
    return ClockWatch(clock, "database", get_settings(), "node-a")


def _said(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.action, r.levelname) for r in caplog.records if hasattr(r, "action")]


def test_a_wall_clock_step_is_said_once_at_once_and_its_return_once(
    machine: Machine, watch: ClockWatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="celery_driftsafe.scheduler")
    assert watch.check() == ""
    assert _said(caplog) == []
    machine.elapsed += 2
    machine.skew = 3600.0  # stepped an hour ahead, 58 s before the next measurement is due
    assert watch.check() == ""  # past MAX_CLOCK_OFFSET_SECONDS, not past the hard bound
    assert _said(caplog) == [("clock-offset", "WARNING")]
    assert "wall clock is -3600.000 s off the database authority" in caplog.records[0].message
    for _ in range(5):  # measured again and again, still beyond: nothing more is said
        machine.elapsed += 61
        watch.check()
    assert _said(caplog) == [("clock-offset", "WARNING")]
    machine.elapsed += 2
    machine.skew = 0.0
    watch.check()
    assert _said(caplog) == [("clock-offset", "WARNING"), ("clock-offset-ok", "INFO")]
    machine.elapsed += 2
    machine.skew = -5.0  # crossing again is said again
    watch.check()
    assert _said(caplog)[-1] == ("clock-offset", "WARNING")


def test_a_measurement_the_clock_took_itself_is_judged(
    machine: Machine, watch: ClockWatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The clock measures inside ``now()`` when a measurement is due; the watch then finds
    none due and the wall clock where that measurement put it, and judged nothing: the beat
    never said its clock was off."""
    watch.check()
    machine.elapsed += 61
    machine.skew = 30.0
    watch.clock.now()  # the round's reading measures first
    assert not watch.clock.needs_sync()
    watch.check()
    assert _said(caplog) == [("clock-offset", "WARNING")]


def test_past_the_hard_bound_claiming_pauses_once_and_resumes_once(
    machine: Machine, watch: ClockWatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="celery_driftsafe.scheduler")
    hard = get_settings().hard_clock_offset_seconds
    watch.check()
    machine.elapsed += 1
    machine.skew = hard + 10
    reason = watch.check()
    assert "exceeds HARD_CLOCK_OFFSET_SECONDS" in reason and "claiming paused" in reason
    for _ in range(3):
        machine.elapsed += 61
        assert watch.check()
    machine.elapsed += 1
    machine.skew = 0.0
    assert watch.check() == ""
    assert _said(caplog) == [("pause", "ERROR"), ("resume", "WARNING")]
    machine.elapsed += 1
    machine.skew = hard + 10
    assert watch.check()
    machine.elapsed += 1
    machine.skew = 2.0  # back within the hard bound, still beyond the soft one
    assert watch.check() == ""
    assert _said(caplog)[2:] == [
        ("pause", "ERROR"),
        ("resume", "WARNING"),
        ("clock-offset", "WARNING"),
    ]
