"""A beat whose Redis does not answer, seen from everywhere an operator looks: its node row,
``driftsafe_status`` (exit 3, naming the beat and what that stops, even when Redis answers the
command itself), the admin's dashboard, the beat's metric; and all of it cleared once Redis
answers the beat again. A real beat (its change listener thread against a port where nothing
listens, then a real Redis started there) on the test database."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.urls import reverse

from celery_driftsafe.models import BeatNode
from celery_driftsafe.monitoring import metrics_server
from celery_driftsafe.scheduler import DriftSafeScheduler
from celery_driftsafe.testing.processes import NoRedis, free_port, start_redis
from tests.support import wait_until
from tests.support.metrics import scrape, value

DASHBOARD = reverse("admin:celery_driftsafe_dashboard")


def _status() -> tuple[int, str]:
    out = io.StringIO()
    try:
        call_command("driftsafe_status", stdout=out, no_color=True)
    except CommandError as exc:
        return exc.returncode, f"{out.getvalue()}\n{exc}"
    return 0, out.getvalue()


@pytest.mark.django_db(transaction=True)
def test_a_beat_cut_off_from_redis_is_seen_everywhere_and_cleared_when_it_answers(
    broker_app: Any, settings: Any, admin_client: Any, tmp_path: Path
) -> None:
    port = free_port()
    beat_redis = f"redis://127.0.0.1:{port}/0"
    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "TIME_AUTHORITY": "database", "METRICS_PORT": 0}
    # the command and the admin reach the tests' Redis; the beat is given one that is away
    reachable = settings.DRIFTSAFE
    settings.DRIFTSAFE = {**reachable, "REDIS_URL": beat_redis}
    beat = DriftSafeScheduler(app=broker_app, install_signal_handlers=False)
    server = None
    try:
        wait_until(lambda: beat._redis.failing is not None, "the listener to find Redis away")
        beat._heartbeat()
        node = BeatNode.objects.get(node_id=beat.node_id)
        assert node.redis_unreachable_since is not None
        assert "Connection refused" in node.redis_error
        settings.DRIFTSAFE = reachable
        code, said = _status()
        assert code == 3, said
        assert f"REDIS UNREACHABLE since {node.redis_unreachable_since.isoformat()}" in said
        assert f"beats that do not reach Redis: {beat.node_id}" in said
        assert "DriftSafeTask bodies do not run" in said and "slots keep being claimed" in said
        page = admin_client.get(DASHBOARD).content.decode()
        assert 'id="ds-degraded"' in page and f"Beat {beat.node_id}: Redis unreachable" in page
        assert "not reached by every beat" in page
        served = metrics_server.node_server(beat.node_id)
        assert served is not None
        figures = scrape(served.port)
        assert value(figures, "driftsafe_beat_dependency_up", dependency="redis") == 0
        assert value(figures, "driftsafe_beat_dependency_up", dependency="database") == 1
        settings.DRIFTSAFE = {**reachable, "REDIS_URL": beat_redis}
        try:
            server = start_redis(tmp_path / "redis", port=port)
        except NoRedis as exc:
            pytest.fail(f"{exc} (apt-get install redis-server)")
        wait_until(lambda: beat._redis.failing is None, "the listener to find Redis back")
        beat._heartbeat()
        node.refresh_from_db()
        assert (node.redis_unreachable_since, node.redis_error) == (None, "")
        settings.DRIFTSAFE = reachable
        code, said = _status()
        assert code == 0 and "REDIS UNREACHABLE" not in said, said
        assert 'id="ds-degraded"' not in admin_client.get(DASHBOARD).content.decode()
        figures = scrape(served.port)
        assert value(figures, "driftsafe_beat_dependency_up", dependency="redis") == 1
    finally:
        beat.close()
        if server is not None:
            server.stop()
