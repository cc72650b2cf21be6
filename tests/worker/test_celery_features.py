"""Celery's own semantics under DriftSafeTask, with a real in-process worker
(``celery.contrib.testing.worker.start_worker``), a real Redis broker, real result backends and
the real database: retries, results, transactions, expiry, revoke, eager mode and canvas.

Every test checks three things: what the ledger recorded, what the body saw (``seen``), and
what the result backend holds.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, group
from celery.contrib.testing.worker import start_worker
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

from celery_driftsafe.models import Run, RunAttempt, RunStatus
from celery_driftsafe.task import DriftSafeTask, authority_clock
from tests import settings as test_settings
from tests.support import wait_until
from tests.support.factories import finished, new_run

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(120),
    # Celery's Redis result backend calls redis-py's deprecated setex(); not our code.
    pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning"),
    # The in-process worker's threads keep their own result-backend clients, unclosed.
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning"
    ),
]

BROKER_URL = f"{test_settings.REDIS_SERVER}/{test_settings.REDIS_DB + 1}"
#: Keys name the task id (uuid5): unique per test run, so no result of an earlier run is found.
KEY = f"{uuid.uuid4().hex[:8]}-"
SHORT_LEASE = {**test_settings.DRIFTSAFE_INTERNALS, "LEASE_SECONDS": 2.0}


@dataclass
class Env:
    app: Celery
    queue: str
    seen: list[tuple[str, Any, int]] = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)
    tasks: dict[str, Any] = field(default_factory=dict)

    def publish_run(self, run: Run, args: list[Any], **options: Any) -> None:
        """Publish a run by name, as the beat does (headers, deterministic id)."""
        headers = {
            "driftsafe_run_id": run.pk,
            "driftsafe_fencing_token": 0,
            "driftsafe_periodic_task_id": run.periodic_task_id,
            **options.pop("headers", {}),
        }
        self.app.send_task(
            run.task_name,
            args=args,
            task_id=run.celery_task_id,
            headers=headers,
            queue=self.queue,
            **options,
        )

    def bodies(self, name: str) -> list[tuple[Any, int]]:
        return [(value, retries) for task, value, retries in self.seen if task == name]


def _make_app(
    queue: str, backend: str | None, seen: list[Any], gate: threading.Event, tasks: dict[str, Any]
) -> Celery:
    app = Celery("driftsafe-semantics", broker=BROKER_URL, backend=backend, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        broker_connection_retry_on_startup=False,
        worker_hijack_root_logger=False,
        # the in-process worker stops within 0.1 s, not kombu's default second
        broker_transport_options={"polling_interval": 0.1},
        result_expires=600,
        task_store_eager_result=False,
    )

    @app.task(name="sem.flaky", base=DriftSafeTask, bind=True, shared=False, acks_late=True)
    def flaky(self: Any, marker: str, fail_times: int) -> str:
        seen.append(("sem.flaky", marker, self.request.retries))
        if self.request.retries < fail_times:
            raise self.retry(countdown=0.2, max_retries=5)
        return f"{marker}:{self.request.retries}"

    @app.task(
        name="sem.auto",
        base=DriftSafeTask,
        bind=True,
        shared=False,
        autoretry_for=(ValueError,),
        retry_backoff=True,
        retry_jitter=False,
        max_retries=2,
    )
    def auto(self: Any, marker: str) -> str:
        seen.append(("sem.auto", marker, self.request.retries))
        raise ValueError(f"{marker} attempt {self.request.retries} fails")

    @app.task(name="sem.double", base=DriftSafeTask, shared=False, acks_late=True)
    def double(x: int) -> int:
        assert gate.wait(20), "gate never opened"
        seen.append(("sem.double", x, 0))
        return x * 2

    @app.task(name="sem.add", shared=False)
    def add(values: Any, y: int = 0) -> int:
        return (sum(values) if isinstance(values, list) else values) + y

    # Plain tasks (no base class): the worker records their runs' outcomes all the same.
    @app.task(name="sem.quiet", shared=False, ignore_result=True)
    def quiet(marker: str) -> str:
        seen.append(("sem.quiet", marker, 0))
        return marker

    @app.task(name="sem.broken", bind=True, shared=False)
    def broken(self: Any, marker: str, retry_first: bool = False) -> None:
        seen.append(("sem.broken", marker, self.request.retries))
        if retry_first and self.request.retries == 0:
            raise self.retry(countdown=0.2, max_retries=3)
        raise ValueError(f"{marker} breaks at attempt {self.request.retries}")

    @app.task(name="sem.away", base=DriftSafeTask, bind=True, shared=False)
    def away(self: Any, marker: str, when: str) -> str:
        """Takes the attempts' table away (:func:`attempts_table`) as its first attempt hands
        over to its retry (``when="hand-over"``: what the hand-over wrote is read, and the
        table put back, before the error goes on), or as its second attempt's body ends
        (``"outcome"``: a thread reads the run and puts the table back a second later)."""
        seen.append(("sem.away", marker, self.request.retries))
        if when == "hand-over":
            attempts_table(away=True)
            try:
                self.retry(countdown=0.1, max_retries=1)
            except Exception:
                seen.append(("sem.away:run", run_now(self.request.id), 0))
                raise
            finally:
                attempts_table(away=False)
        if self.request.retries == 0:
            raise self.retry(countdown=0.1, max_retries=1)
        attempts_table(away=True)
        task_id = self.request.id  # the request is the worker thread's

        def back() -> None:
            try:
                seen.append(("sem.away:run", run_now(task_id), 1))
                attempts_table(away=False)
            finally:
                from django.db import connections

                connections.close_all()

        threading.Timer(1.0, back).start()
        return marker

    tasks.update(
        flaky=flaky, auto=auto, double=double, add=add, quiet=quiet, broken=broken, away=away
    )
    return app


@pytest.fixture
def make_env(redis_client: Any) -> Iterator[Callable[..., Env]]:
    """Build an app with its tasks (``backend``: a result backend URL or None) and optionally
    run an in-process worker on its own queue for the rest of the test."""
    from celery.signals import task_postrun, task_revoked
    from django.db import connections

    def close_connections(**kwargs: Any) -> None:
        if threading.current_thread() is not threading.main_thread():  # not eager calls
            connections.close_all()  # the worker's threads are not Django's: close theirs

    task_postrun.connect(close_connections, weak=False, dispatch_uid="sem-close-postrun")
    task_revoked.connect(close_connections, weak=False, dispatch_uid="sem-close-revoked")
    stack: list[Any] = []
    queues: list[str] = []
    apps: list[Celery] = []

    def make(
        backend: str | None = BROKER_URL,
        *,
        worker: bool = True,
        pool: str = "threads",
        eager: bool = False,
    ) -> Env:
        queue = f"sem-{uuid.uuid4().hex[:8]}"
        queues.append(queue)
        seen: list[Any] = []
        gate = threading.Event()
        gate.set()
        tasks: dict[str, Any] = {}
        env = Env(_make_app(queue, backend, seen, gate, tasks), queue, seen, gate, tasks)
        apps.append(env.app)
        if eager:
            env.app.conf.task_always_eager = True
        if worker:
            context = start_worker(
                env.app,
                pool=pool,
                concurrency=4,
                perform_ping_check=False,
                loglevel="WARNING",
                shutdown_timeout=30,
            )
            context.__enter__()
            stack.append(context)
        return env

    yield make
    for context in reversed(stack):
        context.__exit__(None, None, None)
    for app in apps:
        if app.conf.result_backend and "redis" in str(app.conf.result_backend):
            app.backend.result_consumer.stop()
            app.backend.client.close()
        app.close()
    task_postrun.disconnect(dispatch_uid="sem-close-postrun")
    task_revoked.disconnect(dispatch_uid="sem-close-revoked")
    client = redis.Redis.from_url(BROKER_URL)
    for queue in queues:
        client.delete(queue)
    client.close()


def start(env: Env, kind: str, task: str, args: list[Any]) -> Run:
    """Start a run of ``task`` the way ``kind`` of run is started."""
    if kind == "key":
        key = f"key-{uuid.uuid4().hex}"
        env.tasks[task.split(".")[1]].apply_async(args, idempotency_key=key)
        return Run.objects.get(idempotency_key=key)
    run = new_run(task, kind)
    env.publish_run(run, args)
    return run


# -- 1. retries ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["scheduled", "manual", "adhoc", "key"])
def test_self_retry_runs_every_attempt_of_the_same_run(make_env: Any, kind: str) -> None:
    env = make_env()
    run = start(env, kind, "sem.flaky", ["m", 2])
    assert env.app.AsyncResult(run.celery_task_id).get(timeout=30) == "m:2"
    run = finished(run)
    assert env.bodies("sem.flaky") == [("m", 0), ("m", 1), ("m", 2)]
    assert run.status == RunStatus.SUCCEEDED and run.attempt == 2
    attempts = list(RunAttempt.objects.filter(run=run).values_list("number", "outcome"))
    assert attempts == [(0, "retrying"), (1, "retrying"), (2, "succeeded")]
    assert run.duplicate_deliveries == 0
    # A redelivered copy of attempt 1 (or of the first message) is dropped: no body, no result.
    env.publish_run(run, ["m", 2], retries=1)
    env.publish_run(run, ["m", 2])
    wait_until(lambda: Run.objects.get(pk=run.pk).duplicate_deliveries == 2, what="2 duplicates")
    assert len(env.bodies("sem.flaky")) == 3
    assert env.app.AsyncResult(run.celery_task_id).get(timeout=5) == "m:2"
    assert Run.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED


def test_autoretry_with_backoff_ends_failed_after_max_retries(make_env: Any) -> None:
    env = make_env()
    run = start(env, "manual", "sem.auto", ["a"])
    result = env.app.AsyncResult(run.celery_task_id)
    with pytest.raises(ValueError, match="a attempt 2 fails"):
        result.get(timeout=30)
    run = finished(run)
    assert env.bodies("sem.auto") == [("a", 0), ("a", 1), ("a", 2)]
    assert run.status == RunStatus.FAILED and run.attempt == 2
    assert "ValueError: a attempt 2 fails" in run.error
    attempts = list(RunAttempt.objects.filter(run=run).values_list("number", "outcome", "error"))
    assert [(n, o) for n, o, _ in attempts] == [(0, "retrying"), (1, "retrying"), (2, "failed")]
    assert "a attempt 0 fails" in attempts[0][2]


def test_retry_in_eager_mode_records_each_attempt(make_env: Any) -> None:
    env = make_env(worker=False, eager=True)
    outcome = env.tasks["flaky"].apply_async(["e", 1], idempotency_key=KEY + "eager-retry")
    assert outcome.get() == "e:1"
    run = Run.objects.get(idempotency_key=KEY + "eager-retry")
    assert run.status == RunStatus.SUCCEEDED and run.attempt == 1
    assert env.bodies("sem.flaky") == [("e", 0), ("e", 1)]
    assert list(RunAttempt.objects.filter(run=run).values_list("number", "outcome")) == [
        (0, "retrying"),
        (1, "succeeded"),
    ]
    again = env.tasks["flaky"].apply_async(["e", 1], idempotency_key=KEY + "eager-retry")
    assert again.id == run.celery_task_id
    assert len(env.bodies("sem.flaky")) == 2, "the key ran once"


#: Where :func:`attempts_table` puts the run attempts' table.
ATTEMPTS_AWAY = f"{RunAttempt._meta.db_table}_away"


def attempts_table(*, away: bool) -> None:
    """Rename the run attempts' table away, so that the database refuses a write to it as it
    refuses one to a table that is not there, or back."""
    from django.db import connection

    names = (RunAttempt._meta.db_table, ATTEMPTS_AWAY)
    old, new = names if away else names[::-1]
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {quote(old)} RENAME TO {quote(new)}")


@pytest.fixture
def attempts_back() -> Iterator[None]:
    """The run attempts' table is back after the test, whatever happened in it."""
    from django.db import connection

    yield
    if ATTEMPTS_AWAY in connection.introspection.table_names():
        attempts_table(away=False)


def run_now(task_id: str) -> tuple[str, int]:
    """The status and attempt of the run of ``task_id``, read now."""
    run = Run.objects.get(celery_task_id=task_id)
    return run.status, run.attempt


def test_an_outcome_and_its_attempts_row_are_written_together(
    make_env: Any, attempts_back: None
) -> None:
    """The second attempt's outcome cannot be written without its attempt's row: while the
    attempts' table is away the run stays started (the worker keeps trying, as while the
    database is away), and once it is back both are written, and the result is the body's."""
    env = make_env()
    run = start(env, "manual", "sem.away", ["o", "outcome"])
    assert env.app.AsyncResult(run.celery_task_id).get(timeout=30) == "o"
    run = finished(run)
    assert env.bodies("sem.away") == [("o", 0), ("o", 1)]
    assert env.bodies("sem.away:run") == [((RunStatus.STARTED, 1), 1)], "written without its row"
    assert run.status == RunStatus.SUCCEEDED and run.attempt == 1
    attempts = list(RunAttempt.objects.filter(run=run).values_list("number", "outcome"))
    assert attempts == [(0, "retrying"), (1, "succeeded")]


def test_a_hand_over_and_its_attempts_row_are_written_together(
    make_env: Any, attempts_back: None
) -> None:
    """A hand-over to the retry that cannot write its attempt's row writes nothing: the run is
    still at its first attempt, started, when the error reaches the body (and the retry is
    not sent: Celery's ``retry()`` rejects the message, and the run is recorded failed)."""
    env = make_env()
    run = start(env, "manual", "sem.away", ["h", "hand-over"])
    run = finished(run)
    assert env.bodies("sem.away:run") == [((RunStatus.STARTED, 0), 0)], (
        "handed over without its row"
    )
    assert "LedgerUnavailable" in run.error and RunAttempt._meta.db_table in run.error
    assert env.bodies("sem.away") == [("h", 0)]
    assert run.status == RunStatus.FAILED and run.attempt == 0
    assert not RunAttempt.objects.filter(run=run).exists()


# -- 2. results ---------------------------------------------------------------------------------


def test_a_run_from_a_process_locking_elsewhere_is_reported_once_and_runs(
    make_env: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A beat without ``REDIS_URL`` (its messages say ``driftsafe_locks: database``) and a
    worker with it: neither sees the other's run locks. The worker says so, once, and runs
    them, on the database's conditional start alone (the run says "(no lock)")."""
    from celery_driftsafe.locks import lock_identity
    from celery_driftsafe.worker import execution

    execution._LOCKS_REPORTED.clear()
    env = make_env()
    mine = lock_identity()
    assert mine.startswith("redis:")
    runs = [new_run("sem.double", "manual") for _ in range(3)]
    with caplog.at_level("ERROR", logger="celery_driftsafe"):
        for run, locks in zip(runs, ["database", "database", mine], strict=True):
            env.publish_run(run, [3], headers={"driftsafe_locks": locks})
        for run in runs:
            assert finished(run).status == RunStatus.SUCCEEDED
    assert env.bodies("sem.double") == [(3, 0)] * 3
    reports = [r.getMessage() for r in caplog.records if "takes run locks" in r.getMessage()]
    assert reports == [
        f"run {runs[0].pk} was published by a process that takes run locks in database, and "
        f"this worker takes them in {mine}: neither sees the other's locks, so this worker "
        "starts such runs on the database's check alone and never takes over one already "
        "started (a lost worker's run is then recorded failed, not run again); give every beat "
        "and worker the same DRIFTSAFE REDIS_URL and KEY_PREFIX"
    ]
    workers = [Run.objects.get(pk=run.pk).worker for run in runs]
    assert [w.endswith("(no lock)") for w in workers] == [True, True, False], workers
    stores = [Run.objects.get(pk=run.pk).lock_store for run in runs]
    assert stores == [None, None, mine]  # only a lock holder says where it locks


@pytest.mark.parametrize("header", ["database", "own"])
def test_a_worker_locking_elsewhere_never_takes_over_a_started_run(
    make_env: Any, header: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A live holder that locks in the database has started the run (its lock held, its token
    on the row), and a copy of the run's message reaches this worker, which locks in Redis and
    cannot see that lock. It must not take the run over.

    ``database``: the copy says it was published where runs lock in the database, so this
    worker starts it on the database's conditional start alone, which refuses a started run.
    ``own``: the copy says this worker's own store (an outbox re-publish by a beat locking in
    Redis), so the worker takes its Redis lock, free, with a token above the holder's; the
    start is refused all the same, because the run was started by a worker locking in the
    database (``lock_store``). (Before, in either case the worker took the run over and ran
    the body a second time.)"""
    from celery_driftsafe.conf import get_settings
    from celery_driftsafe.ledger.run_ledger import Ledger, Start
    from celery_driftsafe.locks import DatabaseLockBackend, lock_backend, lock_identity
    from celery_driftsafe.worker import execution

    execution._LOCKS_REPORTED.clear()
    env = make_env()
    run = new_run("sem.double", "manual")
    ttl = get_settings().lease_seconds
    earlier = lock_backend().lock(f"run:{run.pk}", ttl=ttl, fencing_floor=10)
    assert earlier.acquire(blocking=False)  # earlier attempts left Redis's counter at 11
    earlier.release()
    holder = DatabaseLockBackend().lock(f"run:{run.pk}", ttl=60)
    assert holder.acquire(blocking=False)
    locks = "database" if header == "database" else lock_identity()
    try:
        token = holder.fencing_token
        assert token < 11
        assert Ledger().start(Start(run.pk, token, timezone.now(), "other-worker", 0, "database"))
        with caplog.at_level("INFO", logger="celery_driftsafe"):
            env.publish_run(run, [5], headers={"driftsafe_locks": locks})
            wait_until(
                lambda: Run.objects.get(pk=run.pk).duplicate_deliveries == 1,
                what="the copy dropped as a duplicate",
            )
        fresh = Run.objects.get(pk=run.pk)
        assert (fresh.status, fresh.worker, fresh.fencing_token, fresh.lock_store) == (
            RunStatus.STARTED,
            "other-worker",
            token,
            "database",
        )
        assert env.bodies("sem.double") == []
        if header == "own":
            assert "started by a worker that locks in database" in caplog.text
            assert "neither sees the other" not in caplog.text  # not the mismatch path
    finally:
        holder.release()


@pytest.mark.parametrize("backend", ["redis", "django-db", None])
def test_duplicates_never_write_the_result(
    make_env: Any, backend: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """Three copies arrive while the body runs (re-sent for after the lease), two after it
    finished: the result is the body's, never an early or late None."""
    url = {"redis": BROKER_URL, "django-db": "django-db", None: None}[backend]
    with override_settings(DRIFTSAFE_INTERNALS=SHORT_LEASE):
        env = make_env(url)
        env.gate.clear()
        run = new_run("sem.double", "manual")
        env.publish_run(run, [21])
        wait_until(
            lambda: Run.objects.get(pk=run.pk).status == RunStatus.STARTED, "the run started"
        )
        for _ in range(3):
            env.publish_run(run, [21])
        wait_until(lambda: caplog.text.count("re-sent for") >= 3, what="3 copies re-sent")
        if url is not None:
            assert env.app.AsyncResult(run.celery_task_id).state == "PENDING"
        env.gate.set()
        run = finished(run)
        for _ in range(2):
            env.publish_run(run, [21])
        wait_until(
            lambda: Run.objects.get(pk=run.pk).duplicate_deliveries == 5,
            timeout=30,
            what="5 duplicates",
        )
    assert run.status == RunStatus.SUCCEEDED
    assert env.bodies("sem.double") == [(21, 0)]
    if url is not None:
        result = env.app.AsyncResult(run.celery_task_id)
        assert result.get(timeout=5) == 42 and result.state == "SUCCESS"
    if backend == "django-db":
        from django_celery_results.models import TaskResult

        stored = TaskResult.objects.get(task_id=run.celery_task_id)
        assert stored.status == "SUCCESS" and stored.result == "42"
        assert Run.objects.get(pk=run.pk).task_result == stored


@pytest.mark.parametrize("backend", ["django-db", "redis"])
def test_with_track_started_a_duplicate_leaves_the_stored_outcome(
    make_env: Any, backend: str
) -> None:
    """``task_track_started``: Celery stores ``STARTED`` before the body, so a duplicate of a
    finished run would put a succeeded (or failed) run's stored state back to ``STARTED`` on a
    backend that overwrites (django-celery-results does; Redis keeps a ``SUCCESS``). The base
    class holds that write back for a delivery it will drop, and lets it through for the run's
    own start."""
    url = {"redis": BROKER_URL, "django-db": "django-db"}[backend]
    env = make_env(url)
    env.tasks["double"].track_started = True
    env.tasks["flaky"].track_started = True
    run = new_run("sem.double", "manual")
    env.publish_run(run, [4])
    run = finished(run)
    assert env.app.AsyncResult(run.celery_task_id).get(timeout=5) == 8
    for _ in range(2):
        env.publish_run(run, [4])
    wait_until(lambda: Run.objects.get(pk=run.pk).duplicate_deliveries == 2, what="2 duplicates")
    # A retried run: a copy of its first attempt, delivered after the run succeeded.
    retried = new_run("sem.flaky", "manual")
    env.publish_run(retried, ["r", 1])
    retried = finished(retried)
    env.publish_run(retried, ["r", 1])
    wait_until(
        lambda: Run.objects.get(pk=retried.pk).duplicate_deliveries == 1,
        what="the stale copy dropped",
    )
    assert env.bodies("sem.double") == [(4, 0)]
    result = env.app.AsyncResult(run.celery_task_id)
    assert (result.state, result.result) == ("SUCCESS", 8)
    again = env.app.AsyncResult(retried.celery_task_id)
    assert (again.state, again.result) == ("SUCCESS", "r:1")
    assert retried.status == RunStatus.SUCCEEDED
    if backend == "django-db":
        from django_celery_results.models import TaskResult

        stored = TaskResult.objects.get(task_id=run.celery_task_id)
        assert stored.status == "SUCCESS" and stored.result == "8"
        assert stored.date_started is not None  # the run's own start was stored


# -- 3. transactions ----------------------------------------------------------------------------


def test_publish_inside_a_transaction_waits_for_the_commit(make_env: Any) -> None:
    env = make_env()
    with transaction.atomic():
        keyed = env.tasks["double"].apply_async([5], idempotency_key=KEY + "on-commit")
        plain = env.tasks["double"].apply_async([6])
        time.sleep(1.0)  # a worker would have run a message published now
        assert env.seen == []
        client = redis.Redis.from_url(BROKER_URL)
        assert client.llen(env.queue) == 0
        client.close()
    assert keyed.get(timeout=20) == 10 and plain.get(timeout=20) == 12
    run = finished(Run.objects.get(idempotency_key=KEY + "on-commit"))
    assert run.status == RunStatus.SUCCEEDED and run.celery_task_id == keyed.id
    assert sorted(env.bodies("sem.double")) == [(5, 0), (6, 0)]


def test_rollback_publishes_nothing_and_keeps_the_key_unused(make_env: Any) -> None:
    env = make_env()

    class Rollback(Exception):
        pass

    def publish_then_roll_back() -> None:
        with transaction.atomic():
            env.tasks["double"].apply_async([7], idempotency_key=KEY + "rolled-back")
            env.tasks["double"].apply_async([8])
            raise Rollback

    with pytest.raises(Rollback):
        publish_then_roll_back()
    time.sleep(1.0)
    assert env.seen == []
    assert not Run.objects.filter(idempotency_key=KEY + "rolled-back").exists()
    again = env.tasks["double"].apply_async([7], idempotency_key=KEY + "rolled-back")
    assert again.get(timeout=20) == 14
    assert env.bodies("sem.double") == [(7, 0)]


# -- 4. expiry on the authority's clock ---------------------------------------------------------


def test_run_past_its_expiry_is_recorded_expired_not_run(make_env: Any) -> None:
    env = make_env()
    run = new_run("sem.double", "scheduled")
    now = authority_clock().now()
    Run.objects.filter(pk=run.pk).update(expires_at=now - timedelta(seconds=1))
    env.publish_run(run, [1])
    run = finished(run)
    assert run.status == RunStatus.EXPIRED and "expired" in run.error
    assert env.seen == []
    # the ledger is written first (it decides), the result backend right after
    wait_until(
        lambda: env.app.AsyncResult(run.celery_task_id).state == "REVOKED",
        "the run revoked",
        timeout=5,
    )


def test_expiry_is_the_authoritys_not_the_workers_clock(make_env: Any) -> None:
    """The message's own ``expires`` says "expired" by this machine's clock, but the run's
    ``expires_at`` on the authority's clock is still ahead: the run runs."""
    env = make_env()
    run = new_run("sem.double", "manual")
    Run.objects.filter(pk=run.pk).update(expires_at=authority_clock().now() + timedelta(minutes=5))
    env.publish_run(run, [2], expires=datetime.now(UTC) - timedelta(minutes=1))
    assert env.app.AsyncResult(run.celery_task_id).get(timeout=20) == 4
    assert finished(run).status == RunStatus.SUCCEEDED


def test_message_expires_is_judged_by_the_authority_without_expires_at(make_env: Any) -> None:
    env = make_env()
    past, future = new_run("sem.double", "manual"), new_run("sem.double", "manual")
    now = authority_clock().now()
    env.publish_run(past, [5], expires=now - timedelta(seconds=1))
    env.publish_run(future, [6], expires=now + timedelta(minutes=5))
    assert env.app.AsyncResult(future.celery_task_id).get(timeout=20) == 12
    assert finished(past).status == RunStatus.EXPIRED
    assert finished(future).status == RunStatus.SUCCEEDED
    assert env.bodies("sem.double") == [(6, 0)]


def test_explicit_expires_of_a_keyed_call_is_judged_by_the_authority(make_env: Any) -> None:
    env = make_env(worker=False)
    env.tasks["double"].apply_async([3], idempotency_key=KEY + "expiring", expires=0.5)
    run = Run.objects.get(idempotency_key=KEY + "expiring")
    assert run.expires_at is not None
    assert timedelta(0) < run.expires_at - run.claimed_at <= timedelta(seconds=0.5)
    time.sleep(0.7)
    with start_worker(
        env.app, pool="threads", concurrency=2, perform_ping_check=False, loglevel="WARNING"
    ):
        run = finished(run)
    assert run.status == RunStatus.EXPIRED
    assert env.seen == []


def test_revoked_message_is_recorded_revoked(make_env: Any) -> None:
    env = make_env()
    run = new_run("sem.double", "manual")
    # The worker starts without a ping check, so its broadcast queue may not listen yet: a
    # revoke sent before then is lost. Send it until the worker says it has it (sending twice
    # is harmless), then publish.
    deadline = time.monotonic() + 30
    while not env.app.control.revoke(run.celery_task_id, reply=True, limit=1, timeout=1):
        assert time.monotonic() < deadline, "the worker never acknowledged the revoke"
    env.publish_run(run, [4])
    run = finished(run)
    assert run.status == RunStatus.REVOKED
    assert env.seen == []
    assert env.app.AsyncResult(run.celery_task_id).state == "REVOKED"


# -- 5. plain tasks -----------------------------------------------------------------------------


def test_plain_tasks_runs_get_their_outcome_from_the_worker(make_env: Any) -> None:
    """Plain tasks (no base class) on a worker with this app: each run ends with its body's
    outcome at once, an ``ignore_result`` task's too (it used to end ``expired`` a day later);
    a retry waits for its last attempt; a run that is not waiting, or not the task's, is left
    as it is."""
    env = make_env(backend=None)
    quiet, broken, retried = (
        new_run("sem.quiet", "scheduled"),
        new_run("sem.broken", "manual"),
        new_run("sem.broken", "adhoc"),
    )
    before = authority_clock().now()
    env.publish_run(quiet, ["q"])
    env.publish_run(broken, ["b"])
    env.publish_run(retried, ["r", True])
    quiet, broken, retried = finished(quiet), finished(broken), finished(retried)
    after = authority_clock().now()

    assert quiet.status == RunStatus.SUCCEEDED and quiet.error == ""
    assert quiet.worker and quiet.attempt == 0
    assert quiet.started_at is not None and quiet.finished_at is not None
    assert before <= quiet.started_at <= quiet.finished_at <= after
    assert broken.status == RunStatus.FAILED
    assert "Traceback" in broken.error and "ValueError: b breaks at attempt 0" in broken.error
    assert retried.status == RunStatus.FAILED and retried.attempt == 1
    assert "ValueError: r breaks at attempt 1" in retried.error
    # The worker runs messages side by side, so the two first attempts come in either order.
    assert sorted(env.bodies("sem.broken")) == [("b", 0), ("r", 0), ("r", 1)]

    # A second delivery runs the body again (a plain task), but the first outcome stays; a
    # message naming another task's run changes nothing.
    env.publish_run(quiet, ["again"])
    foreign = new_run("sem.double", "manual")
    env.app.send_task(
        "sem.quiet",
        args=["foreign"],
        headers={"driftsafe_run_id": foreign.pk, "driftsafe_fencing_token": 0},
        queue=env.queue,
    )
    wait_until(lambda: len(env.bodies("sem.quiet")) == 3, what="both deliveries")
    assert Run.objects.get(pk=quiet.pk).finished_at == quiet.finished_at
    assert Run.objects.get(pk=foreign.pk).status == RunStatus.DISPATCHED


def test_plain_task_in_eager_mode_is_recorded_inside_the_callers_transaction(
    make_env: Any,
) -> None:
    env = make_env(worker=False, eager=True)
    run = new_run("sem.quiet", "manual")
    with transaction.atomic():
        env.tasks["quiet"].apply(
            ["eager"], headers={"driftsafe_run_id": run.pk}, task_id=run.celery_task_id
        )
        assert Run.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED
    assert Run.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED  # committed, not broken


@pytest.fixture
def handled() -> Iterator[list[str]]:
    """The task ids of the messages the worker has handled (after the package's own
    ``task_postrun`` and ``task_revoked`` receivers, which were connected first)."""
    from celery.signals import task_postrun, task_revoked

    ids: list[str] = []

    def ran(task_id: str | None = None, **kwargs: Any) -> None:
        ids.append(str(task_id))

    def revoked(request: Any = None, **kwargs: Any) -> None:
        ids.append(str(request.id))

    task_postrun.connect(ran, weak=False, dispatch_uid="sem-handled-postrun")
    task_revoked.connect(revoked, weak=False, dispatch_uid="sem-handled-revoked")
    yield ids
    task_postrun.disconnect(dispatch_uid="sem-handled-postrun")
    task_revoked.disconnect(dispatch_uid="sem-handled-revoked")


def test_a_plain_tasks_outcome_is_taken_only_from_its_runs_own_message(
    make_env: Any, handled: list[str]
) -> None:
    """A message that names a run in its headers but carries another Celery task id than the
    run's is not the run's: its body's outcome is not recorded against the run."""
    env = make_env(backend=None)
    run = new_run("sem.quiet", "manual")
    forged = str(uuid.uuid4())
    env.app.send_task(
        "sem.quiet",
        args=["forged"],
        task_id=forged,
        headers={"driftsafe_run_id": run.pk, "driftsafe_fencing_token": 0},
        queue=env.queue,
    )
    wait_until(lambda: forged in handled, what="the forged message's outcome")
    assert env.bodies("sem.quiet") == [("forged", 0)]
    assert Run.objects.get(pk=run.pk).status == RunStatus.DISPATCHED
    env.publish_run(run, ["own"])
    assert finished(run).status == RunStatus.SUCCEEDED


def test_an_eager_plain_call_with_another_task_id_is_not_recorded(make_env: Any) -> None:
    env = make_env(worker=False, eager=True)
    run = new_run("sem.quiet", "manual")
    env.tasks["quiet"].apply(["other"], headers={"driftsafe_run_id": run.pk})
    assert Run.objects.get(pk=run.pk).status == RunStatus.DISPATCHED
    env.tasks["quiet"].apply(
        ["own"], headers={"driftsafe_run_id": run.pk}, task_id=run.celery_task_id
    )
    assert Run.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED


def test_a_revoked_message_with_another_task_id_leaves_the_run_alone(
    make_env: Any, handled: list[str]
) -> None:
    """The worker's own records (a revoke here; time limits and lost processes go through
    the same function) take a run's outcome only from the run's own message."""
    env = make_env()
    run = new_run("sem.double", "manual")
    forged = str(uuid.uuid4())
    deadline = time.monotonic() + 30
    while not env.app.control.revoke(forged, reply=True, limit=1, timeout=1):
        assert time.monotonic() < deadline, "the worker never acknowledged the revoke"
    env.app.send_task(
        "sem.double",
        args=[4],
        task_id=forged,
        headers={"driftsafe_run_id": run.pk, "driftsafe_fencing_token": 0},
        queue=env.queue,
    )
    wait_until(lambda: forged in handled, what="the forged message's revoke")
    assert Run.objects.get(pk=run.pk).status == RunStatus.DISPATCHED
    assert env.seen == []


# -- 6. Celery features -------------------------------------------------------------------------


def test_eager_mode_runs_keyed_calls_once_and_records_them(make_env: Any) -> None:
    env = make_env(worker=False, eager=True)
    with transaction.atomic():  # as in a user's TestCase: eager calls do not wait for commit
        first = env.tasks["double"].apply_async([9], idempotency_key=KEY + "eager")
        second = env.tasks["double"].apply_async([9], idempotency_key=KEY + "eager")
        assert first.get() == 18
        assert env.bodies("sem.double") == [(9, 0)]
        assert second.id == first.id
        run = Run.objects.get(idempotency_key=KEY + "eager")
        assert run.status == RunStatus.SUCCEEDED and run.worker.endswith("(no lock)")
    assert env.tasks["double"].delay(1).get() == 2


def test_chain_group_and_chord_with_driftsafe_tasks(make_env: Any) -> None:
    env = make_env()
    double, add = env.tasks["double"], env.tasks["add"]
    assert chain(double.s(1), add.s(100)).apply_async().get(timeout=20) == 102
    assert group(double.s(i) for i in range(3)).apply_async().get(timeout=20) == [0, 2, 4]
    assert chord((double.s(i) for i in range(3)), add.s(1)).apply_async().get(timeout=20) == 7
    keyed = chain(double.s(5).set(idempotency_key=KEY + "in-a-chain"), add.s(1)).apply_async()
    assert keyed.get(timeout=20) == 11
    run = finished(Run.objects.get(idempotency_key=KEY + "in-a-chain"))
    assert run.status == RunStatus.SUCCEEDED
    assert sorted(env.bodies("sem.double")) == sorted(
        [(1, 0), (0, 0), (1, 0), (2, 0), (0, 0), (1, 0), (2, 0), (5, 0)]
    )
