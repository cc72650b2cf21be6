"""Prometheus metrics: the figures move when slots fire.

Beats: real claim rounds (in-process scheduler, fake clock as the authority, real database and
Redis broker) scraped over the beat's own metrics port. Workers: a real in-process Celery
worker executing runs, scraped over ``WORKER_METRICS_PORT``. The database-derived figures:
the Django view over seeded nodes, tasks and runs. Plus the settings checks and the clear
error when metrics are switched on without prometheus-client.

The metrics live in prometheus-client's process-wide registry, so every assertion is on the
change a test causes (before and after), never on an absolute count.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db.models import F, Sum
from django.test import override_settings

from celery_driftsafe import checks
from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.headers import read_headers
from celery_driftsafe.definitions import changes
from celery_driftsafe.exceptions import ConfigurationError
from celery_driftsafe.models import BeatNode, PeriodicTask, Run, RunKind, RunStatus
from celery_driftsafe.monitoring import metrics, metrics_server
from celery_driftsafe.scheduler import DriftSafeScheduler
from celery_driftsafe.task import DriftSafeTask
from celery_driftsafe.testing import FakeClock
from tests import settings as test_settings
from tests.support import drain, wait_until
from tests.support.factories import interval_task
from tests.support.metrics import parse, scrape, value

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
S = timedelta(seconds=1)


def metrics_on(**extra: Any) -> Any:
    return override_settings(DRIFTSAFE={**settings.DRIFTSAFE, **extra})


# -- beats -------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_claim_rounds_move_the_beat_figures_served_on_the_metrics_port(
    broker_app: Any, clock: FakeClock
) -> None:
    with metrics_on(METRICS_PORT=0):  # heartbeats every 5 s (a sixth of the dead-after)
        sched = DriftSafeScheduler(
            app=broker_app, clock=clock, authority=clock, install_signal_handlers=False
        )
        try:
            server = metrics_server.node_server(sched.node_id)  # serving since it registered
            assert server is not None and server.port > 0
            before = scrape(server.port)
            # one task due now, one a quarter of an hour behind with a 5 s grace: it fires
            # its latest slot (now as well) and records the slots it missed (fire_once)
            interval_task("m-now", 10, anchor=T0, next_slot_at=T0)
            interval_task(
                "m-behind",
                60,
                anchor=T0 - 15 * 60 * S,
                next_slot_at=T0 - 15 * 60 * S,
                misfire_grace_seconds=5.0,
            )
            clock.advance(0.25)
            sched.run_round()  # the heartbeat comes first: both tasks due, one node alive
            first = scrape(server.port)
            fired = list(Run.objects.filter(status=RunStatus.DISPATCHED))
            missed = Run.objects.filter(status=RunStatus.MISSED).aggregate(n=Sum("missed_count"))[
                "n"
            ]
            assert len(fired) == 2 and missed and missed > 0
            assert len(drain()) == 2

            def delta(name: str, **labels: str) -> float:
                return value(first, name, **labels) - value(before, name, **labels)

            assert delta("driftsafe_beat_slots_claimed_total") == 2
            assert delta("driftsafe_beat_slots_published_total") == 2
            assert delta("driftsafe_beat_slots_missed_total") == missed
            assert delta("driftsafe_beat_slots_failed_total") == 0
            assert delta("driftsafe_beat_round_duration_seconds_count") == 1
            assert delta("driftsafe_beat_dispatch_lateness_seconds_count") == 2
            lateness = sorted(
                (r.dispatched_at - r.slot).total_seconds()
                for r in fired
                if r.dispatched_at and r.slot
            )
            assert lateness == pytest.approx([0.25, 0.25])
            assert delta("driftsafe_beat_dispatch_lateness_seconds_sum") == pytest.approx(0.5)
            # both fired 0.25 s late: in the 0.25 bucket (le is inclusive), not the 0.1 one
            assert delta("driftsafe_beat_dispatch_lateness_seconds_bucket", le="0.1") == 0
            assert delta("driftsafe_beat_dispatch_lateness_seconds_bucket", le="0.25") == 2
            assert value(first, "driftsafe_beat_backlog_slots") == 2
            assert value(first, "driftsafe_beat_nodes_alive") == 1
            assert value(first, "driftsafe_beat_claiming_paused") == 0
            assert value(first, "driftsafe_beat_last_round_timestamp_seconds") == (
                (T0 + S / 4).timestamp()
            )

            # five seconds on: nothing is due, the heartbeat sees no backlog, nothing fires
            clock.advance(5)
            sched.run_round()
            second = scrape(server.port)
            assert value(second, "driftsafe_beat_backlog_slots") == 0
            assert value(second, "driftsafe_beat_slots_claimed_total") == value(
                first, "driftsafe_beat_slots_claimed_total"
            )
            assert (
                value(second, "driftsafe_beat_round_duration_seconds_count")
                - value(first, "driftsafe_beat_round_duration_seconds_count")
                == 1
            )
            # five more: m-now's next slot fires
            clock.advance(5)
            sched.run_round()
            third = scrape(server.port)
            assert (
                value(third, "driftsafe_beat_slots_claimed_total")
                - value(second, "driftsafe_beat_slots_claimed_total")
                == 1
            )
            assert len(drain()) == 1
            port = server.port
        finally:
            sched.close()
        assert metrics_server.node_server(sched.node_id) is None
        with pytest.raises(OSError, match="refused"):  # a stopped node stops serving
            scrape(port)


@pytest.mark.django_db(transaction=True)
def test_with_metrics_off_the_hooks_record_nothing(scheduler: DriftSafeScheduler) -> None:
    from prometheus_client import REGISTRY

    assert not metrics.enabled()
    assert metrics.beat_metrics() is None and metrics.worker_metrics() is None
    assert metrics_server.node_server(scheduler.node_id) is None
    before = REGISTRY.get_sample_value("driftsafe_beat_slots_claimed_total")
    interval_task("quiet", 10, anchor=T0, next_slot_at=T0)
    scheduler.run_round()
    assert Run.objects.filter(status=RunStatus.DISPATCHED).count() == 1
    drain()
    assert REGISTRY.get_sample_value("driftsafe_beat_slots_claimed_total") == before


def test_with_metrics_off_prometheus_client_is_never_imported() -> None:
    import subprocess

    script = (
        "import sys, django; django.setup()\n"
        "from datetime import datetime, UTC\n"
        "from celery_driftsafe.monitoring import metrics\n"
        "from celery_driftsafe.claim.claimers import ClaimResult\n"
        "from celery_driftsafe.publish.dispatcher import DispatchResult\n"
        "now = datetime.now(UTC)\n"
        "metrics.round_done(ClaimResult(), now, 0.0, 0.1)\n"
        "metrics.dispatched(DispatchResult(published=[1]), {}, now)\n"
        "metrics.heartbeat(None, now, paused=False)\n"
        "for hook in (metrics.duplicate, metrics.fenced_out, metrics.lock_error):\n"
        "    hook('t')\n"
        "metrics.execution('t', 'succeeded')\n"
        "print('prometheus_client' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=test_settings.BASE_DIR.parent,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_serving_on_a_port_in_use_names_the_setting() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with metrics_on(METRICS_PORT=port), pytest.raises(ConfigurationError) as info:
            metrics_server.serve_beat(get_settings())
    assert "METRICS_PORT" in str(info.value) and str(port) in str(info.value)


def test_a_prefork_worker_without_multiprocess_dir_is_warned(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from types import SimpleNamespace

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with metrics_on(WORKER_METRICS_PORT=0):
        metrics_server.on_worker_init(sender=SimpleNamespace(pool_cls="prefork"))
        try:
            server = metrics_server._worker_server
            assert server is not None
            assert (
                "driftsafe_worker_executions"
                in urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10)
                .read()
                .decode()
            )
        finally:
            metrics_server.on_worker_shutdown()
    assert metrics_server._worker_server is None
    assert any("PROMETHEUS_MULTIPROC_DIR" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with metrics_on(WORKER_METRICS_PORT=0):
        metrics_server.on_worker_init(sender=SimpleNamespace(pool_cls="threads"))
        metrics_server.on_worker_shutdown()
    assert not any("PROMETHEUS_MULTIPROC_DIR" in r.getMessage() for r in caplog.records)


def _bound_address(server: metrics_server.Server) -> str:
    address: str = server.httpd.socket.getsockname()[0]
    return address


def test_metrics_servers_listen_on_this_host_only_unless_configured() -> None:
    from types import SimpleNamespace

    assert "METRICS_ADDRESS" not in settings.DRIFTSAFE
    with metrics_on(METRICS_PORT=0, WORKER_METRICS_PORT=0):
        beat = metrics_server.serve_beat(get_settings())
        assert beat is not None
        try:
            assert _bound_address(beat) == "127.0.0.1"
        finally:
            beat.stop()
        metrics_server.on_worker_init(sender=SimpleNamespace(pool_cls="threads"))
        try:
            worker = metrics_server._worker_server
            assert worker is not None and _bound_address(worker) == "127.0.0.1"
        finally:
            metrics_server.on_worker_shutdown()
    with metrics_on(METRICS_PORT=0, METRICS_ADDRESS="0.0.0.0"):  # configured: every interface
        wide = metrics_server.serve_beat(get_settings())
        assert wide is not None
        try:
            assert _bound_address(wide) == "0.0.0.0"
        finally:
            wide.stop()


# -- settings and the missing extra ------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "bad", "check_id"),
    [
        ("METRICS_PORT", "9808", "celery_driftsafe.E020"),
        ("METRICS_PORT", 70000, "celery_driftsafe.E020"),
        ("WORKER_METRICS_PORT", True, "celery_driftsafe.E020"),
        ("METRICS_ADDRESS", "", "celery_driftsafe.E022"),
        ("METRICS_ADDRESS", "0.0.0.0:9808", "celery_driftsafe.E022"),
        ("METRICS_ADDRESS", "http://metrics.internal", "celery_driftsafe.E022"),
        ("METRICS_ADDRESS", ["127.0.0.1"], "celery_driftsafe.E022"),
        ("METRICS_TOKEN", 12345, "celery_driftsafe.E028"),
        ("METRICS_TOKEN", "two words-" * 4, "celery_driftsafe.E028"),
        ("METRICS_TOKEN", "", "celery_driftsafe.E028"),
        ("METRICS_TOKEN", "short-token", "celery_driftsafe.W020"),
    ],
)
def test_bad_metrics_settings_get_stable_ids(key: str, bad: Any, check_id: str) -> None:
    with override_settings(DRIFTSAFE={key: bad}):
        found = [m for m in checks.check_settings() if m.id == check_id]
    assert found and key in found[0].msg
    if key == "METRICS_TOKEN" and isinstance(bad, str) and bad:
        assert bad not in found[0].msg  # a token is never printed


@pytest.mark.parametrize(
    ("key", "good"),
    [
        ("METRICS_ADDRESS", "127.0.0.1"),
        ("METRICS_ADDRESS", "0.0.0.0"),
        ("METRICS_ADDRESS", "::"),
        ("METRICS_ADDRESS", "::1"),
        ("METRICS_ADDRESS", "localhost"),
        ("METRICS_ADDRESS", "metrics-1.internal"),
        ("METRICS_TOKEN", None),
        ("METRICS_TOKEN", "x" * 32),
    ],
)
def test_good_metrics_settings_pass_the_checks(key: str, good: Any) -> None:
    with override_settings(DRIFTSAFE={key: good}):
        assert [m for m in checks.check_settings() if key in m.msg] == []


def test_metrics_switched_on_without_prometheus_client_name_the_extra(
    monkeypatch: pytest.MonkeyPatch, rf: Any
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    assert metrics.prometheus_missing() is not None
    with override_settings(DRIFTSAFE={"WORKER_METRICS_PORT": 9808}):
        (error,) = [m for m in checks.startup_errors() if m.id == "celery_driftsafe.E021"]
        assert "WORKER_METRICS_PORT" in error.msg
        assert "celery-driftsafe[metrics]" in error.hint
    with override_settings(DRIFTSAFE={}):
        assert [m for m in checks.check_settings() if m.id == "celery_driftsafe.E021"] == []
    from celery_driftsafe.monitoring import views

    with pytest.raises(ImproperlyConfigured, match=r"celery-driftsafe\[metrics\]"):
        views.metrics(rf.get("/driftsafe/metrics"))


# -- the metrics view --------------------------------------------------------------------------


@pytest.mark.django_db
def test_metrics_view_serves_backlog_nodes_last_slots_and_runs_by_status(
    admin_client: Any,
) -> None:
    now = changes.authority_now()
    for host, age, offset in (
        ("beat-a", 1.0, 0.004),
        ("beat-b", 2.0, -0.71),
        ("beat-c", 600.0, 0.002),
    ):
        BeatNode.objects.create(
            node_id=f"{host}:1:x",
            hostname=host,
            pid=1,
            started_at=now - timedelta(hours=1),
            last_heartbeat_at=now - timedelta(seconds=age),
            clock_offset_seconds=offset,
        )
    BeatNode.objects.create(
        node_id="old:1:x",
        hostname="old",
        pid=1,
        started_at=now - timedelta(days=2),
        last_heartbeat_at=now - timedelta(days=1),
        stopped_at=now - timedelta(days=1),
    )
    due = interval_task(
        "due", 60, anchor=now - timedelta(hours=1), next_slot_at=now - timedelta(seconds=90)
    )
    interval_task("later", 60, anchor=now, next_slot_at=now + timedelta(minutes=5))
    fired = now - timedelta(minutes=2)
    PeriodicTask.objects.filter(pk=due.pk).update(last_slot_at=fired)
    for status, minutes in (
        (RunStatus.SUCCEEDED, 2),
        (RunStatus.SUCCEEDED, 3),
        (RunStatus.FAILED, 4),
        (RunStatus.DISPATCHED, 1),
        (RunStatus.SUCCEEDED, 30),
    ):  # the last: older than 5 minutes
        slot = now - timedelta(minutes=minutes)
        Run.objects.create(
            periodic_task=due,
            task_name=due.task,
            kind=RunKind.SCHEDULED,
            slot=slot,
            status=status,
            claimed_by="beat-a:1:x",
            claimed_at=slot,
            celery_task_id=str(uuid.uuid4()),
        )

    response = admin_client.get(METRICS)
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    got = parse(response.content.decode())
    assert value(got, "driftsafe_backlog_slots") == 1
    assert value(got, "driftsafe_oldest_due_age_seconds") == pytest.approx(90, abs=30)
    assert value(got, "driftsafe_nodes_alive") == 2
    assert value(got, "driftsafe_node_up", node="beat-a:1:x", hostname="beat-a") == 1
    assert value(got, "driftsafe_node_up", node="beat-c:1:x", hostname="beat-c") == 0
    assert ("driftsafe_node_up", (("hostname", "old"), ("node", "old:1:x"))) not in got
    assert value(
        got, "driftsafe_node_clock_offset_seconds", node="beat-b:1:x", hostname="beat-b"
    ) == pytest.approx(-0.71)
    assert value(
        got, "driftsafe_node_heartbeat_age_seconds", node="beat-c:1:x", hostname="beat-c"
    ) == pytest.approx(600, abs=30)
    assert value(got, "driftsafe_task_last_slot_timestamp_seconds", task="due") == (
        fired.timestamp()
    )
    assert value(got, "driftsafe_runs_recent", status="succeeded") == 2
    assert value(got, "driftsafe_runs_recent", status="failed") == 1
    assert value(got, "driftsafe_runs_recent", status="missed") == 0
    assert value(got, "driftsafe_runs_open", status="dispatched") == 1


METRICS = "/driftsafe/metrics"
TOKEN = "scrape-token-0123456789abcdefghijklmnop"


def _with_token(**extra: Any) -> Any:
    return metrics_on(METRICS_TOKEN=TOKEN, **extra)


@pytest.mark.django_db
def test_metrics_view_refuses_an_anonymous_scrape(client: Any) -> None:
    task = interval_task("secret-report", 60, anchor=T0)
    PeriodicTask.objects.filter(pk=task.pk).update(last_slot_at=T0)  # a series of its own
    response = client.get(METRICS)
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer ")
    assert b"secret-report" not in response.content and b"driftsafe_" not in response.content
    with _with_token():  # a token being set changes nothing for a request without one
        assert client.get(METRICS).status_code == 401


@pytest.mark.django_db
def test_metrics_view_needs_the_view_permissions_of_tasks_runs_and_nodes(client: Any) -> None:
    from django.contrib.auth.models import Permission, User

    user = User.objects.create_user("grafana", password="pw", is_staff=True)
    client.force_login(user)
    assert client.get(METRICS).status_code == 403
    for codename in ("view_periodictask", "view_run"):
        user.user_permissions.add(Permission.objects.get(codename=codename))
        user = User.objects.get(pk=user.pk)  # no cached permissions
        client.force_login(user)
        assert client.get(METRICS).status_code == 403, f"up to {codename}"
    user.user_permissions.add(Permission.objects.get(codename="view_beatnode"))
    response = client.get(METRICS)
    assert response.status_code == 200
    assert "driftsafe_nodes_alive" in response.content.decode()
    user.is_active = False  # a deactivated account is refused, whatever its permissions
    user.save()
    assert client.get(METRICS).status_code == 401


@pytest.mark.django_db
def test_metrics_view_takes_the_bearer_token_of_the_settings(
    client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    def scrape_with(token: str) -> Any:
        return client.get(METRICS, HTTP_AUTHORIZATION=f"Bearer {token}")

    with _with_token():
        right = scrape_with(TOKEN)
        assert right.status_code == 200 and "driftsafe_backlog_slots" in right.content.decode()
        assert client.get(METRICS, HTTP_AUTHORIZATION=f"bearer  {TOKEN}").status_code == 200
        for wrong in (TOKEN[:-1], TOKEN + "x", "", TOKEN.upper()):
            refused = scrape_with(wrong)
            assert refused.status_code == 401, wrong
            assert 'error="invalid_token"' in refused["WWW-Authenticate"]
        assert client.get(METRICS, HTTP_AUTHORIZATION=f"Basic {TOKEN}").status_code == 401
    # no token configured: none is accepted
    assert scrape_with(TOKEN).status_code == 401
    denied = [r for r in caplog.records if getattr(r, "action", "") == "metrics-denied"]
    assert denied and not any(TOKEN[:-1] in r.getMessage() for r in denied)


@pytest.mark.django_db
def test_metrics_view_answers_an_unreachable_authority_without_the_errors_text(
    client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The time authority is a Redis on a closed port, reached with a user and password: the
    scraper learns that it is unreachable, the log learns where and why."""
    from celery_driftsafe.testing.processes import free_port

    port = free_port()  # nothing listens there
    url = f"redis://scraper-user:s3cret-pw@127.0.0.1:{port}/0"
    with _with_token(TIME_AUTHORITY="redis", REDIS_URL=url):
        response = client.get(METRICS, HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 503
    body = response.content.decode()
    assert "time authority" in body
    for secret in ("s3cret", "scraper-user", "127.0.0.1", str(port), "refused", "Error"):
        assert secret not in body, secret
    (logged,) = [r for r in caplog.records if getattr(r, "action", "") == "metrics-error"]
    assert str(port) in logged.getMessage()


@pytest.mark.django_db(transaction=True)  # MySQL: the rename commits, and is undone by hand
def test_metrics_view_answers_a_database_error_without_its_text(
    client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A table the figures read is missing (an upgrade not migrated yet): 503, the database's
    message only in the log."""
    from django.db import connection, transaction

    class RollBack(Exception):
        pass

    table = BeatNode._meta.db_table
    try:
        with _with_token(), contextlib.suppress(RollBack), transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(f"ALTER TABLE {table} RENAME TO renamed_for_the_test")
            response = client.get(METRICS, HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
            raise RollBack  # and the rename with it
    finally:
        if not connection.features.can_rollback_ddl:  # MySQL commits DDL at once
            with connection.cursor() as cursor:
                cursor.execute(f"ALTER TABLE renamed_for_the_test RENAME TO {table}")
    assert BeatNode.objects.count() == 0  # the table is back
    assert response.status_code == 503
    body = response.content.decode()
    assert "database" in body and table not in body and "SELECT" not in body
    (logged,) = [r for r in caplog.records if getattr(r, "action", "") == "metrics-error"]
    assert table in logged.getMessage()


# -- workers -----------------------------------------------------------------------------------


BROKER_URL = f"{test_settings.REDIS_SERVER}/{test_settings.REDIS_DB + 1}"


@pytest.fixture
def worker_env(redis_client: Any) -> Iterator[tuple[Celery, str]]:
    """An in-process worker (threads pool) on a queue of its own, serving its metrics on a
    free port; its threads' database connections are closed after each task."""
    from celery.signals import task_postrun, worker_shutdown
    from django.db import connections

    def close_connections(**kwargs: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            connections.close_all()

    task_postrun.connect(close_connections, weak=False, dispatch_uid="metrics-close")
    queue = f"metrics-{uuid.uuid4().hex[:8]}"
    app = Celery("driftsafe-metrics", broker=BROKER_URL, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        broker_connection_retry_on_startup=False,
        worker_hijack_root_logger=False,
        # the in-process worker stops within 0.1 s, not kombu's default second
        broker_transport_options={"polling_interval": 0.1},
        task_ignore_result=True,
    )

    @app.task(name="metrics.ok", base=DriftSafeTask, shared=False)
    def ok(x: int) -> int:
        return x

    @app.task(name="metrics.boom", base=DriftSafeTask, shared=False)
    def boom() -> None:
        raise ValueError("boom")

    @app.task(name="metrics.taken_over", base=DriftSafeTask, bind=True, shared=False)
    def taken_over(self: Any) -> None:
        # a newer holder takes the run over while the body runs: its outcome is fenced out
        headers = read_headers(self.request)
        assert headers is not None
        Run.objects.filter(pk=headers.run_id).update(fencing_token=F("fencing_token") + 1000)

    with (
        metrics_on(WORKER_METRICS_PORT=0),
        start_worker(
            app,
            pool="threads",
            concurrency=2,
            perform_ping_check=False,
            loglevel="WARNING",
            shutdown_timeout=30,
        ),
    ):
        yield app, queue
    # The test worker's thread ends without WorkController.stop(), which sends worker_shutdown
    # in a real worker: send it here.
    worker_shutdown.send(sender=None)
    assert metrics_server._worker_server is None
    task_postrun.disconnect(dispatch_uid="metrics-close")
    app.close()
    client = redis.Redis.from_url(BROKER_URL)
    client.delete(queue)
    client.close()


def _publish(app: Celery, queue: str, run: Run, args: list[Any]) -> None:
    headers = {
        "driftsafe_run_id": run.pk,
        "driftsafe_fencing_token": 0,
        "driftsafe_periodic_task_id": run.periodic_task_id,
    }
    app.send_task(
        run.task_name, args=args, task_id=run.celery_task_id, headers=headers, queue=queue
    )


def _new_run(name: str) -> Run:
    return Run.objects.create(
        task_name=name,
        kind=RunKind.MANUAL,
        status=RunStatus.DISPATCHED,
        claimed_by="admin:tester",
        celery_task_id=str(uuid.uuid4()),
    )


def _ended(run: Run) -> Run:
    return wait_until(
        lambda: Run.objects.filter(
            pk=run.pk, status__in=[RunStatus.SUCCEEDED, RunStatus.FAILED]
        ).first(),
        f"run {run.pk}",
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
@pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning"
)
def test_worker_figures_move_as_runs_execute(worker_env: tuple[Celery, str]) -> None:
    app, queue = worker_env
    server = metrics_server._worker_server
    assert server is not None
    before = scrape(server.port)

    def moved(name: str, **labels: str) -> float:
        return value(scrape(server.port), name, **labels) - value(before, name, **labels)

    good, bad = _new_run("metrics.ok"), _new_run("metrics.boom")
    _publish(app, queue, good, [1])
    _publish(app, queue, bad, [])
    assert _ended(good).status == RunStatus.SUCCEEDED
    assert _ended(bad).status == RunStatus.FAILED
    executions = "driftsafe_worker_executions_total"
    wait_until(lambda: moved(executions, task="metrics.boom", outcome="failed") == 1, "failed")
    assert moved(executions, task="metrics.ok", outcome="succeeded") == 1

    # the same message again: a duplicate of a finished run, dropped and counted
    _publish(app, queue, good, [1])
    wait_until(
        lambda: moved("driftsafe_worker_duplicates_suppressed_total", task="metrics.ok") == 1,
        "the duplicate",
    )
    assert moved(executions, task="metrics.ok", outcome="succeeded") == 1

    # taken over mid-body: the outcome is refused by the fencing token, and counted
    fenced = _new_run("metrics.taken_over")
    _publish(app, queue, fenced, [])
    wait_until(
        lambda: moved("driftsafe_worker_fenced_out_total", task="metrics.taken_over") == 1,
        "the fenced-out outcome",
    )
    assert Run.objects.get(pk=fenced.pk).status == RunStatus.STARTED  # not overwritten
    assert moved("driftsafe_worker_lock_errors_total", task="metrics.ok") == 0

    # the lock backend unreachable (fail_open: the database alone decides): a lock error
    # (the database as the time authority: the Redis one is unreachable too)
    unreachable = {
        **settings.DRIFTSAFE,
        "METRICS_ADDRESS": "127.0.0.1",
        "WORKER_METRICS_PORT": 0,
        "REDIS_URL": "redis://127.0.0.1:1/0",
        "REDIS_UNAVAILABLE": "fail_open",
        "TIME_AUTHORITY": "database",
    }
    with override_settings(DRIFTSAFE=unreachable):
        lonely = _new_run("metrics.ok")
        _publish(app, queue, lonely, [2])
        assert _ended(lonely).status == RunStatus.SUCCEEDED
        wait_until(
            lambda: moved("driftsafe_worker_lock_errors_total", task="metrics.ok") == 1,
            "the lock error",
        )
        assert moved(executions, task="metrics.ok", outcome="succeeded") == 2


# -- the docs' alert rules and Grafana dashboard ----------------------------------------------


DOCS = test_settings.BASE_DIR.parent / "docs"


def _exported_names() -> set[str]:
    """Every sample name the beats, workers and the view can export."""
    from prometheus_client import REGISTRY

    from celery_driftsafe.monitoring.views import DatabaseCollector

    with metrics_on(WORKER_METRICS_PORT=9808):  # defines the metrics; serves nothing here
        assert metrics.beat_metrics() is not None and metrics.worker_metrics() is not None
    names: set[str] = set()
    families = [*REGISTRY.collect(), *DatabaseCollector(changes.authority_now()).collect()]
    for family in families:
        if not family.name.startswith("driftsafe_"):
            continue
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names.update(f"{family.name}{suffix}" for suffix in ("_bucket", "_count", "_sum"))
        else:
            names.add(family.name)
    return names


@pytest.mark.django_db
def test_alert_rules_and_grafana_dashboard_use_only_exported_metrics() -> None:
    import json
    import re

    import yaml

    known = _exported_names()
    page = (DOCS / "howto" / "monitoring.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", page, re.S) if "groups:" in b]
    rules = yaml.safe_load(block)["groups"][0]["rules"]
    alerts = {rule["alert"] for rule in rules}
    assert {
        "DriftsafeNoLiveBeat",
        "DriftsafeDispatchLate",
        "DriftsafeClockOffset",
        "DriftsafeBacklog",
    } <= alerts
    expressions = [rule["expr"] for rule in rules]
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning")
        assert rule["annotations"]["summary"]
    dashboard = json.loads((DOCS / "_static" / "grafana-dashboard.json").read_text())
    targets = [t for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(targets) >= 20
    expressions += [target["expr"] for target in targets]
    used = {name for expr in expressions for name in re.findall(r"driftsafe_[a-z_]+", expr)}
    assert used - known == set(), f"not exported: {used - known}"
    # and the dashboard shows every beat and worker counter
    counters = {n for n in known if n.startswith(("driftsafe_beat_slots", "driftsafe_worker"))}
    assert counters <= used, f"not on the dashboard: {counters - used}"


@pytest.mark.django_db(transaction=True)
def test_a_beats_reconciliation_counts_the_outcomes_it_gave(
    broker_app: Any, clock: FakeClock
) -> None:
    """Runs of plain tasks get their outcome from the reconciliation, not from a worker: the
    beat counts them by outcome (an expired run here; the result backend's others)."""
    with metrics_on(METRICS_PORT=0):
        sched = DriftSafeScheduler(
            app=broker_app, clock=clock, authority=clock, install_signal_handlers=False
        )
        try:
            server = metrics_server.node_server(sched.node_id)
            assert server is not None
            before = scrape(server.port)
            old = T0 - timedelta(days=2)
            Run.objects.create(
                task_name="tests.add",
                slot=old,
                status=RunStatus.DISPATCHED,
                claimed_at=old,
                expires_at=old + timedelta(days=1),
            )
            sched.run_round()  # the first round starts a pass
            sched.reconciler.join(10)
            after = scrape(server.port)
            name = "driftsafe_beat_runs_reconciled_total"
            assert (
                value(after, name, outcome="expired") - value(before, name, outcome="expired") == 1
            )
            assert value(after, name, outcome="worker_lost") == value(
                before, name, outcome="worker_lost"
            )
        finally:
            sched.close()


@pytest.mark.django_db(transaction=True)
def test_a_beats_deadline_check_counts_the_late_runs_and_stale_tasks_it_flagged(
    broker_app: Any, clock: FakeClock
) -> None:
    """The beat's round starts the deadline check (celery_driftsafe.beat.deadlines) at the
    authority's now; the runs and the task it flags are counted, labelled with the task."""
    from tests.support.factories import interval_task

    with metrics_on(METRICS_PORT=0):
        sched = DriftSafeScheduler(
            app=broker_app, clock=clock, authority=clock, install_signal_handlers=False
        )
        try:
            server = metrics_server.node_server(sched.node_id)
            assert server is not None
            before = scrape(server.port)
            now = clock.now()
            task = interval_task("due-by", 600, anchor=now, deadline_seconds=60)
            PeriodicTask.objects.filter(pk=task.pk).update(enabled=False)  # nothing claimed
            for minutes in (30, 20, 10):
                Run.objects.create(
                    periodic_task=task,
                    task_name="tests.add",
                    slot=now - timedelta(minutes=minutes),
                    status=RunStatus.FAILED,
                )
            sched.run_round()  # the first round starts a check
            sched.deadlines.join(10)
            after = scrape(server.port)
            missed = "driftsafe_beat_deadlines_missed_total"
            stale = "driftsafe_beat_tasks_became_stale_total"
            assert value(after, missed, task="due-by") - value(before, missed, task="due-by") == 3
            assert value(after, stale, task="due-by") - value(before, stale, task="due-by") == 1
        finally:
            sched.close()
