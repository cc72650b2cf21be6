"""compiled_sql: a round's statements compiled once per connection, run again with new values,
and kept only where the values are exactly the statement's parameters."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections

from celery_driftsafe.models import PeriodicTask
from celery_driftsafe.scheduler import DriftSafeScheduler
from celery_driftsafe.store.statement_cache import compiled, kept_statements, select_rows
from celery_driftsafe.testing import FakeClock
from tests.support import T0, drain
from tests.support.factories import interval_task

S = timedelta(seconds=1)


def _names_after(when: Any) -> Any:
    return PeriodicTask.objects.filter(name__gt=when).order_by("name").values_list("name")


@pytest.mark.django_db
def test_kept_sql_runs_with_new_values_and_build_is_not_called_again() -> None:
    for name in "abcd":
        interval_task(name, 60, anchor=T0, next_slot_at=T0)
    calls = []

    def build(when: str) -> Any:
        calls.append(when)
        return _names_after(when)

    first = select_rows("default", "names-after", ["a"], lambda: build("a"))
    again = select_rows("default", "names-after", ["c"], lambda: build("c"))
    assert [r[0] for r in first] == ["b", "c", "d"] and [r[0] for r in again] == ["d"]
    assert calls == ["a"]  # compiled once
    _, kept_sql, params = compiled("default", "names-after", ["b"], lambda: build("b"))
    fresh_sql, fresh_params = _names_after("b").query.get_compiler("default").as_sql()
    assert (kept_sql, list(params)) == (fresh_sql, list(fresh_params))


@pytest.mark.django_db
def test_a_statement_whose_parameters_are_not_the_values_is_compiled_every_time() -> None:
    interval_task("a", 60, anchor=T0, next_slot_at=T0)
    calls = []

    def build() -> Any:
        calls.append(1)
        return _names_after("")

    for _ in range(2):  # the caller says "x", Django compiled "": nothing is kept
        _, _, params = compiled("default", "mismatch", ["x"], build)
        assert list(params) == [""]
    assert len(calls) == 2
    assert not any(key[0] == "mismatch" for key in kept_statements("default"))
    # A key of None keeps nothing either, whatever the values.
    compiled("default", None, [""], build)
    compiled("default", None, [""], build)
    assert len(calls) == 4


@pytest.mark.django_db(transaction=True)
def test_each_thread_keeps_its_own_statements() -> None:
    interval_task("a", 60, anchor=T0, next_slot_at=T0)
    calls: list[str] = []

    def build() -> Any:
        calls.append(threading.current_thread().name)
        return _names_after("")

    def read() -> None:
        try:
            assert select_rows("default", "per-thread", [""], build) == [("a",)]
        finally:
            connections.close_all()

    select_rows("default", "per-thread", [""], build)
    worker = threading.Thread(target=read, name="other")
    worker.start()
    worker.join()
    select_rows("default", "per-thread", [""], build)
    assert calls == ["MainThread", "other"]


@pytest.mark.django_db(transaction=True)
def test_rounds_keep_their_statements_on_postgresql_and_stay_right(
    broker_app: Any, clock: FakeClock
) -> None:
    """Two rounds of a beat: the second runs the kept statements with new values (other
    tasks, other runs, another instant) and fires exactly the slots due. On PostgreSQL all
    five statements of a round are kept: a Django that compiles one differently shows here,
    not as a slower beat."""
    interval_task("early", 60, anchor=T0, next_slot_at=T0)
    interval_task("later", 60, anchor=T0 + 2 * S, next_slot_at=T0 + 2 * S)
    sched = DriftSafeScheduler(
        app=broker_app, clock=clock, authority=clock, install_signal_handlers=False
    )
    try:
        assert sched.run_round() == pytest.approx(1.0)  # the next in 2 s, capped at 1 s
        assert [m["task"] for m in drain()] == ["tests.add"]
        clock.advance(2 * S)
        sched.run_round()
        runs = {r.periodic_task.name: r.status for r in sched_runs()}
        assert runs == {"early": "dispatched", "later": "dispatched"}
        assert len(drain()) == 1
        assert sched.next_due() == T0 + 60 * S
        kept = {key[0] for key in kept_statements("default")}
        if connection.vendor == "postgresql":
            assert {
                ("due", True, sched.claimer.batch_size),
                ("next-due",),
                ("node-stopped",),
                "claim-holders",
                "mark-dispatched",
            } <= kept
    finally:
        sched.close()


def sched_runs() -> Any:
    from celery_driftsafe.models import Run

    return Run.objects.select_related("periodic_task")
