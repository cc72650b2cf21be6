"""Building messages ahead (``celery_driftsafe.publish.prebuild``): while nothing is due, a beat
builds
the fast-path templates of the tasks due soonest; their runs then publish without building,
and what is published is exactly what would have been built then (an edit after the build
gets a new message)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

import pytest
from celery import Celery

from celery_driftsafe.beat import nodes
from celery_driftsafe.claim.claimers import claimer_for, run_expiry
from celery_driftsafe.conf import get_settings
from celery_driftsafe.publish.dispatcher import Dispatcher
from celery_driftsafe.publish.fast_path import FastPublisher
from celery_driftsafe.publish.prebuild import CHUNK, HORIZON_SECONDS, RESCAN_SECONDS, Prebuilder
from celery_driftsafe.testing import FakeClock
from tests.support.factories import interval_task
from tests.support.fast_path import T0, raw_messages

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[int | str]:
    """The cache keys of every template built, in order."""
    seen: list[int | str] = []
    original = FastPublisher._template

    def counting(self: FastPublisher, cache_key: int | str, *args: Any) -> Any:
        if cache_key not in self._templates:
            seen.append(cache_key)
        return original(self, cache_key, *args)

    monkeypatch.setattr(FastPublisher, "_template", counting)
    return seen


def prebuilder(dispatcher: Dispatcher, clock: Callable[[], float] | None = None) -> Prebuilder:
    return Prebuilder(
        dispatcher.fast,
        partial(run_expiry, settings=get_settings()),
        monotonic=clock or (lambda: 0.0),
    )


def test_runs_of_prebuilt_tasks_publish_without_building(
    make_app: Callable[..., Celery],
    queue: str,
    builds: list[int | str],
) -> None:
    app = make_app()
    nodes.register("n1", T0)
    soon = [
        interval_task(
            f"t{i}",
            60,
            anchor=T0,
            next_slot_at=T0,
            task="fast.add",
            args=[i, 1],
        )
        for i in range(5)
    ]
    later = interval_task(
        "later", 3600, anchor=T0, next_slot_at=T0 + timedelta(hours=1), task="fast.add", args=[9, 9]
    )
    dispatcher = Dispatcher(app, FakeClock(T0))
    ahead = prebuilder(dispatcher)
    before = T0 - timedelta(seconds=30)
    assert ahead.run(before, budget=1.0) == 5
    assert sorted(builds) == sorted(t.pk for t in soon)  # not "later": beyond the horizon
    assert later.pk not in dispatcher.fast._templates
    assert ahead.run(before, budget=1.0) == 0  # resting after a full pass

    builds.clear()
    runs = claimer_for().claim(T0, "n1").runs
    assert len(runs) == 5
    assert len(dispatcher.dispatch(runs).published) == 5
    assert builds == []  # every message from a template built ahead
    sent = [m for _, m in raw_messages(queue)]
    assert sorted(json.loads(base64.b64decode(m["body"]))[0] for m in sent) == [
        [i, 1] for i in range(5)
    ]
    assert {m["headers"]["id"] for m in sent} == {r.celery_task_id for r in runs}


def test_an_edit_after_the_build_publishes_the_new_arguments(
    make_app: Callable[..., Celery],
    queue: str,
    builds: list[int | str],
) -> None:
    app = make_app()
    nodes.register("n1", T0)
    task = interval_task("t", 60, anchor=T0, next_slot_at=T0, task="fast.add", args=[1, 2])
    dispatcher = Dispatcher(app, FakeClock(T0))
    assert prebuilder(dispatcher).run(T0 - timedelta(seconds=10), budget=1.0) == 1
    task.args = [7, 7]
    task.save()
    runs = claimer_for().claim(T0, "n1").runs
    dispatcher.dispatch(runs)
    (message,) = [m for _, m in raw_messages(queue)]
    assert json.loads(base64.b64decode(message["body"]))[0] == [7, 7]
    assert message["headers"]["argsrepr"] == "[7, 7]"
    assert builds == [task.pk]  # built ahead; the edited arguments replaced that template
    assert dispatcher.fast._templates[task.pk].args == [7, 7]


@pytest.mark.parametrize("spread", [60, 1], ids=["over a minute", "one instant"])
def test_building_ahead_keeps_to_its_budget_and_goes_on_where_it_stopped(
    make_app: Callable[..., Celery],
    builds: list[int | str],
    spread: int,
) -> None:
    """A pass stops for its budget and the next goes on after the last task built, whether
    the tasks are spread over a minute or all due at one instant (a burst: the chunks are
    read after the last (due_at, id) read)."""
    app = make_app()
    count = CHUNK + 30
    for i in range(count):
        interval_task(
            f"t{i:04d}",
            60,
            anchor=T0,
            next_slot_at=T0 + timedelta(seconds=i % spread),
            task="fast.add",
            args=[i, 0],
        )
    interval_task(
        "beyond",
        60,
        anchor=T0,
        next_slot_at=T0 + timedelta(seconds=HORIZON_SECONDS + 1),
        task="fast.add",
    )
    ticks = iter(range(10_000))
    ahead = prebuilder(Dispatcher(app, FakeClock(T0)), clock=lambda: float(next(ticks)))
    # a budget of 0.5 s on a clock that moves 1 s a reading: one chunk, then it stops
    assert not ahead.pending
    assert ahead.run(T0, budget=0.5) == CHUNK
    assert ahead.pending  # the scheduler comes back soon for the rest
    assert ahead.run(T0, budget=0.5) == 30  # the rest, from where it stopped
    assert not ahead.pending  # a full pass: nothing more until the next
    assert len(builds) == count == len(set(builds))


def test_a_later_pass_reads_in_full_only_the_tasks_without_a_template(
    make_app: Callable[..., Celery],
    builds: list[int | str],
) -> None:
    """The next pass looks at every task due within the horizon again, but reads (and
    builds) only the one added since: the others' templates are there. An edited task keeps
    its template until its run is published (then rebuilt: the test above)."""
    app = make_app()
    tasks = [
        interval_task(f"t{i:04d}", 60, anchor=T0, next_slot_at=T0, task="fast.add", args=[i])
        for i in range(CHUNK + 30)
    ]
    now = [0.0]
    ahead = prebuilder(Dispatcher(app, FakeClock(T0)), clock=lambda: now[0])
    assert ahead.run(T0, budget=1.0) == CHUNK + 30
    assert ahead.read == CHUNK + 30
    now[0] += RESCAN_SECONDS
    tasks[5].args = [-1]
    tasks[5].save()
    added = interval_task("added", 60, anchor=T0, next_slot_at=T0, task="fast.add", args=[9])
    builds.clear()
    assert ahead.run(T0, budget=1.0) == 1
    assert ahead.read == CHUNK + 31  # the added task only
    assert builds == [added.pk]
    assert not ahead.pending


def test_nothing_is_built_ahead_without_the_fast_path(
    make_app: Callable[..., Celery],
    settings: Any,
    builds: list[int | str],
) -> None:
    app = make_app()
    interval_task("t", 60, anchor=T0, next_slot_at=T0 + timedelta(seconds=5), task="fast.add")
    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "FAST_PUBLISH": False}
    assert prebuilder(Dispatcher(app, FakeClock(T0))).run(T0, budget=1.0) == 0
    assert builds == []


def test_a_beat_comes_back_soon_while_building_ahead_is_unfinished(
    scheduler: Any, builds: list[int | str]
) -> None:
    """The round's wait is cut while a pass stopped for its budget (so a restarted beat builds
    its first two minutes within seconds), and is the plain wait again once the pass is done."""
    from tests.support import T0 as START

    for i in range(CHUNK + 10):
        interval_task(f"t{i:04d}", 60, anchor=START, next_slot_at=START + timedelta(seconds=30))
    ticks = iter(range(10_000))
    scheduler._prebuilder.monotonic = lambda: 0.25 * next(ticks)  # a chunk spends the budget
    assert scheduler.run_round() == pytest.approx(0.05)  # back soon: more to build
    assert len(builds) == CHUNK
    assert scheduler.run_round() == pytest.approx(1.0)  # done: MAX_LOOP_INTERVAL_SECONDS
    assert len(builds) == CHUNK + 10


def test_a_beat_freezes_the_templates_it_built_ahead_before_the_wave(scheduler: Any) -> None:
    """Right after a pass that built templates (while the beat waits), the heap is checked
    at once (beat/gc_freeze.py), so that the collection that freezes them does not fall in the
    wave; a
    pass that built nothing does not check."""
    from tests.support import T0 as START

    for i in range(20):
        interval_task(f"h{i:02d}", 60, anchor=START, next_slot_at=START + timedelta(seconds=30))
    checks: list[bool] = []
    original = scheduler._heap.maybe_freeze

    def recording(*, check_now: bool = False) -> bool:
        checks.append(check_now)
        return bool(original(check_now=check_now))

    scheduler._heap.maybe_freeze = recording
    scheduler.run_round()  # builds the 20 templates while nothing is due
    assert checks == [False, True]
    scheduler.run_round()  # nothing left to build
    assert checks == [False, True, False]
