"""``OPTIMISATIONS_OFF``: each performance mechanism can be switched off at run time, and off
it takes the plain way (shown by what it then uses or does not do) with the same outcome: the
same claimed runs and task states, the same published messages, the same misfire plans.
``benchmarks/switches.py`` names these and the mechanisms with settings of their own."""

from __future__ import annotations

import gc
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from functools import partial
from typing import Any

import pytest
from celery import Celery
from django.core.checks import Error
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from benchmarks.switches import OWN_SETTINGS, switched_off
from celery_driftsafe.beat import nodes
from celery_driftsafe.beat.gc_freeze import MIN_OBJECTS, HeapKeeper, widen_young_generation
from celery_driftsafe.checks import _check_raw
from celery_driftsafe.claim.claimers import claimer_for, run_expiry
from celery_driftsafe.claim.prefetch import Prefetcher
from celery_driftsafe.conf import build_settings, get_settings
from celery_driftsafe.core import instants
from celery_driftsafe.core.stored_names import MisfirePolicy, Optimisation
from celery_driftsafe.exceptions import ConfigurationError
from celery_driftsafe.models import PeriodicTask, Run, RunStatus
from celery_driftsafe.publish.dispatcher import Dispatcher
from celery_driftsafe.publish.prebuild import Prebuilder
from celery_driftsafe.scheduler import DriftSafeScheduler
from celery_driftsafe.store import loaders, statement_cache
from celery_driftsafe.testing import FakeClock
from tests.skip_guard import configuration
from tests.support import drain
from tests.support.factories import crontab_task, interval_task
from tests.support.fast_path import T0, claim, comparable, raw_messages, same_expiry
from tests.support.misfire import count_walks

pytestmark = pytest.mark.django_db(transaction=True)

S = timedelta(seconds=1)
H = timedelta(hours=1)


def switch_off(settings: Any, *names: str) -> None:
    settings.DRIFTSAFE_INTERNALS = {
        **settings.DRIFTSAFE_INTERNALS,
        "OPTIMISATIONS_OFF": list(names),
    }


def postgresql_only(what: str) -> None:
    if connection.vendor != "postgresql":
        pytest.skip(configuration(f"{what} is PostgreSQL's only"))


# -- the setting and its check ------------------------------------------------------------------


def test_the_setting_takes_known_names_and_the_check_refuses_others(settings: Any) -> None:
    switch_off(settings, "prebuild", "iso_texts")
    assert get_settings().optimisations_off == (Optimisation.PREBUILD, Optimisation.ISO_TEXTS)
    assert not get_settings().optimised(Optimisation.PREBUILD)
    assert get_settings().optimised(Optimisation.GC_FREEZE)
    internals = settings.DRIFTSAFE_INTERNALS
    assert [m for m in _check_raw(internals) if m.id == "celery_driftsafe.E033"] == []

    def refusals(value: Any) -> list[Error]:
        raw = {**internals, "OPTIMISATIONS_OFF": value}
        return [m for m in _check_raw(raw) if m.id == "celery_driftsafe.E033"]

    (unknown,) = refusals(["prebuild", "fast_publish"])
    assert "'fast_publish' is not an optimisation's name" in unknown.msg
    assert unknown.hint is not None and all(name in unknown.hint for name in Optimisation.values)
    (not_a_list,) = refusals("prebuild")
    assert "must be a list or tuple" in not_a_list.msg
    (not_a_name,) = refusals([3])
    assert "3 is not an optimisation's name" in not_a_name.msg
    with pytest.raises(ConfigurationError, match=r"OPTIMISATIONS_OFF.*known: redis_writer"):
        build_settings({}, internals={"OPTIMISATIONS_OFF": ["prebuilt"]}, database={})


def test_the_benchmark_names_every_mechanism_one_way() -> None:
    assert switched_off("") == ({}, {})
    assert switched_off("prebuild, fast_publish,gc_young") == (
        {"FAST_PUBLISH": False},
        {"OPTIMISATIONS_OFF": ["prebuild", "gc_young"]},
    )
    assert switched_off("claim_process,publish_batch,round_interval") == (
        {},
        {"CLAIM_PROCESS": False, "PUBLISH_BATCH_SIZE": 1, "MIN_ROUND_INTERVAL_SECONDS": 0},
    )
    assert not set(OWN_SETTINGS) & set(Optimisation.values)
    with pytest.raises(ValueError, match="unknown mechanism 'prebuilt'; known: fast_publish"):
        switched_off("prebuilt")


# -- publishing ---------------------------------------------------------------------------------


def publish_twice(
    app: Celery, settings: Any, name: str, off: str
) -> tuple[list[Any], list[Any], Dispatcher]:
    """Claim two runs and publish them to queue ``name`` with every mechanism on (written
    straight to Redis), then (their claims restored, a new dispatcher) with ``off`` off; the
    raw envelopes of each, and the second dispatcher."""
    runs = claim(task="fast.add")
    # once to declare the queue (a message that declares one goes through kombu), then on
    for _ in range(2):
        on = Dispatcher(app, FakeClock(datetime.now(T0.tzinfo)))
        assert len(on.dispatch(runs).published) == 2
        first = raw_messages(name)
        Run.objects.update(status=RunStatus.CLAIMED, dispatched_at=None)
    assert on.fast.direct == 2
    switch_off(settings, off)
    plain = Dispatcher(app, FakeClock(datetime.now(T0.tzinfo)))
    assert len(plain.dispatch(runs).published) == 2
    return first, raw_messages(name), plain


def assert_same_messages(first: list[Any], second: list[Any]) -> None:
    assert len(first) == len(second) == 2
    for (key, one), (other_key, other) in zip(first, second, strict=True):
        assert comparable(key, one) == comparable(other_key, other)
        assert same_expiry(one, other)


def test_without_the_redis_writer_kombu_publishes_the_same_messages(
    make_app: Callable[..., Celery],
    queue: str,
    settings: Any,
) -> None:
    first, second, plain = publish_twice(make_app(), settings, queue, "redis_writer")
    assert plain.fast.published == 2 and plain.fast.direct == 0  # on: 2 (test_fastpublish)
    assert_same_messages(first, second)


def test_without_counted_delivery_tags_each_message_draws_its_own(
    make_app: Callable[..., Celery],
    queue: str,
    settings: Any,
) -> None:
    first, second, plain = publish_twice(make_app(), settings, queue, "delivery_tags")
    assert plain.fast.direct == 2  # still written straight to Redis
    counted = [uuid.UUID(m["properties"]["delivery_tag"]) for _, m in first]
    drawn = [uuid.UUID(m["properties"]["delivery_tag"]) for _, m in second]
    assert counted[0].hex[:20] == counted[1].hex[:20]  # one UUID4, counted
    assert drawn[0].hex[:20] != drawn[1].hex[:20] and {t.version for t in drawn} == {4}
    assert_same_messages(first, second)


def test_without_interned_names_the_templates_hold_the_names_read(
    make_app: Callable[..., Celery],
    queue: str,
    settings: Any,
) -> None:
    app = make_app()
    name = "".join(["fast.", "add"])  # a new string, not the interned one

    def template_name(dispatcher: Dispatcher) -> str:
        assert dispatcher.fast.active()
        built = dispatcher.fast._template(1, name, [1, 2], {}, {}, None, lambda: ("", ""))
        return str(built.name)

    assert template_name(Dispatcher(app, FakeClock(T0))) is sys.intern(name)
    switch_off(settings, "interned_names")
    assert template_name(Dispatcher(app, FakeClock(T0))) is name
    first, second, _ = publish_twice(app, settings, queue, "interned_names")
    assert_same_messages(first, second)


def test_without_building_ahead_nothing_is_built_and_the_messages_are_the_same(
    make_app: Callable[..., Celery],
    queue: str,
    settings: Any,
) -> None:
    app = make_app()

    def prebuilder(dispatcher: Dispatcher) -> Prebuilder:
        expiry = partial(run_expiry, settings=get_settings())
        return Prebuilder(dispatcher.fast, expiry, monotonic=lambda: 0.0)

    interval_task("soon", 60, anchor=T0, next_slot_at=T0 + 30 * S, task="fast.add")
    on = Dispatcher(app, FakeClock(T0))
    assert prebuilder(on).run(T0, budget=1.0) == 1
    switch_off(settings, "prebuild")
    off = Dispatcher(app, FakeClock(T0))
    ahead = prebuilder(off)
    assert ahead.run(T0, budget=1.0) == 0 and ahead.built == ahead.read == 0
    assert off.fast._templates == {}
    PeriodicTask.objects.all().delete()
    settings.DRIFTSAFE_INTERNALS = {**settings.DRIFTSAFE_INTERNALS, "OPTIMISATIONS_OFF": []}
    first, second, _ = publish_twice(app, settings, queue, "prebuild")
    assert_same_messages(first, second)


# -- the beat's heap ----------------------------------------------------------------------------


@pytest.fixture
def threshold() -> Iterator[tuple[int, ...]]:
    kept = gc.get_threshold()
    gc.unfreeze()  # what another test froze
    gc.set_threshold(700, *kept[1:])
    yield gc.get_threshold()
    gc.set_threshold(*kept)
    gc.unfreeze()


def test_without_gc_freeze_nothing_is_frozen(settings: Any, threshold: tuple[int, ...]) -> None:
    cache = [{"template": [i]} for i in range(MIN_OBJECTS)]
    gc.collect()
    switch_off(settings, "gc_freeze")
    keeper = HeapKeeper(lambda: 0.0)
    assert not keeper.maybe_freeze(check_now=True)
    assert keeper.freezes == 0 and gc.get_freeze_count() == 0
    settings.DRIFTSAFE_INTERNALS = {**settings.DRIFTSAFE_INTERNALS, "OPTIMISATIONS_OFF": []}
    assert HeapKeeper(lambda: 0.0).maybe_freeze(check_now=True)  # on, the same heap freezes
    assert len(cache) == MIN_OBJECTS


def test_without_gc_young_the_threshold_stays(settings: Any, threshold: tuple[int, ...]) -> None:
    switch_off(settings, "gc_young")
    assert not widen_young_generation()
    assert gc.get_threshold() == threshold
    settings.DRIFTSAFE_INTERNALS = {**settings.DRIFTSAFE_INTERNALS, "OPTIMISATIONS_OFF": []}
    assert widen_young_generation() and gc.get_threshold() != threshold


# -- the core's switch and the misfire planner's choice -----------------------------------------


@pytest.fixture
def core_switches() -> Iterator[None]:
    yield
    instants.remember_iso_texts(True)


def test_the_settings_switch_the_cores_mechanisms(settings: Any, core_switches: None) -> None:
    when = T0 + timedelta(microseconds=7)
    switch_off(settings, "iso_texts")  # set as the settings change
    assert instants.iso_text(when) == when.isoformat()
    assert instants.iso_text(when) is not instants.iso_text(when)  # made again each time
    assert instants._iso_texts == {}
    settings.DRIFTSAFE_INTERNALS = {**settings.DRIFTSAFE_INTERNALS, "OPTIMISATIONS_OFF": []}
    assert instants.iso_text(when) is instants.iso_text(when)


def test_without_misfire_arithmetic_the_claim_plans_walk(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim hands the misfire planner its choice (the core holds no switch): off, each
    plan walks its slots, and the claim's outcome is the same."""
    walks = count_walks(monkeypatch)
    nodes.register("n1", T0)

    def claimed(prefix: str) -> list[tuple[str, Any]]:
        interval_task(f"{prefix}-on-time", 60, anchor=T0 - timedelta(hours=2), next_slot_at=T0)
        interval_task(
            f"{prefix}-behind", 60, anchor=T0 - timedelta(hours=2), next_slot_at=T0 - 2 * H
        )
        runs = claimer_for().claim(T0 + S, "n1").runs
        return sorted((run.task_name.removeprefix(prefix), run.slot) for run in runs)

    assert claimer_for().arithmetic  # type: ignore[attr-defined]
    planned = claimed("a")
    assert walks == []  # the shortcut, then the count on the grid
    switch_off(settings, "misfire_arithmetic")
    assert not claimer_for().arithmetic  # type: ignore[attr-defined]
    assert claimed("b") == planned and len(walks) == 2


# -- reading the due tasks ----------------------------------------------------------------------


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """What each read of due tasks used: the cursor's loader, the JSON reader's calls and the
    plain build's checks."""
    seen: dict[str, list[Any]] = {"loader": [], "json": [], "plain": []}
    read, json_, plain = loaders._read, loaders._json, loaders._plain_instances

    def reading(connection: Any, how: Any, *args: Any) -> Any:
        seen["loader"].append(how.loader)
        return read(connection, how, *args)

    def json_reading(value: Any) -> Any:
        seen["json"].append(value)
        return json_(value)

    def plain_check(*args: Any) -> bool:
        seen["plain"].append(plain(*args))
        return seen["plain"][-1]  # type: ignore[no-any-return]

    monkeypatch.setattr(loaders, "_read", reading)
    monkeypatch.setattr(loaders, "_json", json_reading)
    monkeypatch.setattr(loaders, "_plain_instances", plain_check)
    return seen


@pytest.mark.parametrize("off", ["c_timestamps", "json_columns", "plain_instances"])
def test_each_short_way_of_reading_tasks_steps_aside_alone_and_reads_the_same(
    off: str, settings: Any, reads: dict[str, list[Any]]
) -> None:
    postgresql_only("reading the due tasks their own way")
    interval_task("a", 60, anchor=T0, args=[1, "é"], kwargs={"k": [None, 1.5]})
    interval_task("b", 60, anchor=T0, headers={"h": "v"})
    due = PeriodicTask.objects.order_by("id").select_for_update()
    switch_off(settings, off)
    with transaction.atomic():
        ours = loaders.load_models(due)
        djangos = list(due)
        with connection.cursor() as cursor:
            loaders.read_instants_in_c(connection, cursor)
            instant_loader = cursor.cursor.adapters.get_loader(1184, 0)
    (loader,) = reads["loader"]
    if off == "c_timestamps":
        assert loader is None and instant_loader.__module__.startswith("django")
    else:
        assert "psycopg" in loader.__module__ and "psycopg" in instant_loader.__module__
    assert (reads["json"] == []) == (off == "json_columns")
    assert reads["plain"] == ([] if off == "plain_instances" else [True])
    fields = [f.attname for f in PeriodicTask._meta.concrete_fields]
    for mine, theirs in zip(ours, djangos, strict=True):
        assert vars(mine).keys() == vars(theirs).keys()
        for name in fields:
            a, b = getattr(mine, name), getattr(theirs, name)
            assert a == b and type(a) is type(b), name
            if isinstance(a, datetime):
                assert a.tzinfo is b.tzinfo, name


def test_without_the_statement_cache_each_statement_is_compiled_again(settings: Any) -> None:
    builds: list[int] = []

    def build() -> Any:
        builds.append(1)
        return PeriodicTask.objects.filter(name="x").values_list("id")

    for _ in range(2):
        statement_cache.compiled("default", "probe", ["x"], build)
    assert builds == [1]  # kept on this connection
    statement_cache.kept_statements("default").clear()
    switch_off(settings, "statement_cache")
    for _ in range(2):
        statement_cache.compiled("default", "probe", ["x"], build)
    assert builds == [1, 1, 1] and statement_cache.kept_statements("default") == {}


# -- claiming -----------------------------------------------------------------------------------

#: The optimisations of claiming, each with a round claimed once with it off.
CLAIM_SIDE = [
    "statement_cache",
    "c_timestamps",
    "plain_instances",
    "json_columns",
    "iso_texts",
    "misfire_arithmetic",
    "plain_insert",
    "expiry_shortcut",
]


def claim_a_mix(settings: Any, off: list[str]) -> tuple[list[Any], list[Any]]:
    """Tasks on time, behind the grace, after an outage under each policy, jittered, on a
    crontab, and one whose slot already has a run, claimed in two rounds with ``off`` off;
    the runs and the tasks' claim state, by task name (ids differ between calls)."""
    Run.objects.all().delete()
    PeriodicTask.objects.all().delete()
    settings.DRIFTSAFE_INTERNALS = {**settings.DRIFTSAFE_INTERNALS, "OPTIMISATIONS_OFF": off}
    interval_task("on-time", 60, anchor=T0, next_slot_at=T0, args=[1, "é"], kwargs={"k": [2]})
    interval_task("several", 10, anchor=T0, next_slot_at=T0 - 25 * S)
    for policy in MisfirePolicy:
        interval_task(
            f"outage-{policy}",
            60,
            anchor=T0,
            next_slot_at=T0 - timedelta(hours=2),
            misfire_policy=policy,
        )
    interval_task("jittered", 60, anchor=T0, next_slot_at=T0 - 120 * S, jitter_seconds=20)
    crontab_task("crontab", "* * * * *", next_slot_at=T0 - 180 * S)
    interval_task("expiring", 60, anchor=T0, next_slot_at=T0, expires_seconds=30)
    interval_task("bounded", 20, anchor=T0, next_slot_at=T0, valid_until=T0 + 30 * S)
    taken = interval_task("taken", 30, anchor=T0, next_slot_at=T0)
    Run.objects.create(periodic_task=taken, task_name="tests.add", slot=T0 + 30 * S)
    nodes.register("n1", T0)
    claimer = claimer_for()
    for now in (T0 + S, T0 + 40 * S):
        claimer.claim(now, "n1", busy_since=T0 - 3 * S)
    runs = sorted(
        Run.objects.values_list(
            "periodic_task__name",
            "slot",
            "status",
            "missed_count",
            "missed_until",
            "expires_at",
            "message",
            "error",
        ),
        key=repr,
    )
    tasks = sorted(
        PeriodicTask.objects.values_list(
            "name", "next_slot_at", "due_at", "last_slot_at", "run_count", "enabled"
        )
    )
    return runs, tasks


def test_without_the_expiry_shortcut_every_expiry_is_the_limits(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery_driftsafe.claim import claimers

    limits: list[datetime] = []
    original = claimers.message_expiry

    def counting(slot: datetime, *args: Any) -> datetime | None:
        limits.append(slot)
        return original(slot, *args)

    monkeypatch.setattr(claimers, "message_expiry", counting)
    task = interval_task("plain", 60, anchor=T0, next_slot_at=T0, expires_seconds=30)
    on = run_expiry(task, T0, get_settings())
    assert limits == []  # the slot plus the seconds
    switch_off(settings, "expiry_shortcut")
    assert run_expiry(task, T0, get_settings()) == on == T0 + 30 * S
    assert limits == [T0]


@pytest.mark.parametrize("off", [*CLAIM_SIDE, "all"])
def test_rounds_claim_the_same_runs_with_an_optimisation_off(
    off: str, settings: Any, core_switches: None
) -> None:
    names = CLAIM_SIDE if off == "all" else [off]
    runs, tasks = claim_a_mix(settings, [])
    assert len(runs) > 12 and any(r[2] == RunStatus.MISSED for r in runs)
    assert claim_a_mix(settings, names) == (runs, tasks)


def test_without_the_plain_insert_taken_slots_are_skipped_from_the_first_statement(
    settings: Any,
) -> None:
    switch_off(settings, "plain_insert")
    interval_task("free", 10, anchor=T0, next_slot_at=T0)
    taken = interval_task("taken", 10, anchor=T0, next_slot_at=T0)
    Run.objects.create(periodic_task=taken, task_name="tests.add", slot=T0)
    table = connection.ops.quote_name(Run._meta.db_table)
    with CaptureQueriesContext(connection) as queries:
        result = claimer_for().claim(T0, "node-a")
    sqls = [q["sql"] for q in queries.captured_queries]
    assert not any(sql.startswith("ROLLBACK TO SAVEPOINT") for sql in sqls)  # none refused
    inserts = [i for i, sql in enumerate(sqls) if sql.startswith(f"INSERT INTO {table}")]
    if connection.vendor == "postgresql":
        assert len(inserts) == 1 and "ON CONFLICT DO NOTHING" in sqls[inserts[0]]
    else:  # the taken slots looked up before the insert
        assert any(f"FROM {table}" in sql for sql in sqls[: inserts[0]])
    assert [r.periodic_task_id for r in result.runs] != [taken.pk]
    assert len(result.runs) == 1


def test_without_claiming_ahead_a_wave_goes_out_a_batch_a_round(
    settings: Any, broker_app: Any, clock: FakeClock
) -> None:
    postgresql_only("claiming ahead (SKIP LOCKED)")
    settings.DRIFTSAFE_INTERNALS = {
        **settings.DRIFTSAFE_INTERNALS,
        "CLAIM_BATCH_SIZE": 10,
        "CLAIM_PROCESS": False,
        "OPTIMISATIONS_OFF": ["claim_ahead"],
    }
    assert not Prefetcher("default").available
    wave = clock.now()
    tasks = [interval_task(f"a{i:02d}", 60, anchor=wave, next_slot_at=wave) for i in range(25)]
    beat = DriftSafeScheduler(
        app=broker_app, clock=clock, authority=clock, install_signal_handlers=False
    )
    try:
        assert beat.run_round() == 0.0  # a full batch, published; none claimed ahead
        assert len(drain()) == 10 and not Run.objects.filter(status=RunStatus.CLAIMED).exists()
        while beat.run_round() == 0.0:
            pass
    finally:
        beat.close()
    sent = drain()
    assert len(sent) == 15  # with claim_ahead: 10, 10, 5 (tests/beat/test_burst.py)
    assert Run.objects.filter(status=RunStatus.DISPATCHED, slot=wave).count() == len(tasks)
