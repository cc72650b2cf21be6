"""End-to-end: the real tracing integrations (Sentry's ``CeleryIntegration``, OpenTelemetry's
Celery instrumentation: :mod:`tests.e2e.tracing`) in a real driftsafe beat and in Celery's
own beat (``celery beat``, its default scheduler), same app, same task: the messages each
puts on the broker carry the same headers, each well formed. The fast publish path is used
where it can reproduce the integration (OpenTelemetry's publish-signal receivers: it sends
the signals itself) and steps aside where it must (Sentry wraps ``Task.apply_async`` and
``Celery.send_task`` on the class).
"""

from __future__ import annotations

import json
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from celery_driftsafe.testing.recording import QueueRecorder
from tests import settings as test_settings
from tests.e2e.harness import E2ERun, real_now
from tests.e2e.sentry_sink import SentrySink
from tests.skip_guard import configuration

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        test_settings.TEST_DB != "postgres", reason=configuration("runs on the PostgreSQL pass")
    ),
]

#: Messages read from each beat: a few seconds of a 1-second task.
MESSAGES = 3
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")
SENTRY_TRACE = re.compile(r"([0-9a-f]{32})-[0-9a-f]{16}(-[01])?")


def _headers(raw: bytes, stamp: float) -> dict[str, Any]:
    headers: dict[str, Any] = json.loads(raw)["headers"]
    return headers


def _ours(headers: dict[str, Any]) -> dict[str, Any]:
    """A message's headers without those only a driftsafe beat's messages carry."""
    return {k: v for k, v in headers.items() if not k.startswith("driftsafe_")}


def _beats(tmp_path: Path, tracing: str) -> dict[str, tuple[list[dict[str, Any]], list[str]]]:
    """Each beat's (``driftsafe``, ``celery``) messages' headers and the paths that sent
    them (:func:`tests.e2e.tracing._record_path`)."""
    run = E2ERun("postgresql", tmp_path, beat_schedule={"tick": 1.0})
    queues = {"driftsafe": run.queue, "celery": f"{run.queue}-celery"}
    recorders = {
        beat: QueueRecorder(run.broker_url, queue, _headers).start()
        for beat, queue in queues.items()
    }
    try:
        for beat, queue in queues.items():
            run.start_beat(
                0,
                scheduler="celery.beat:PersistentScheduler" if beat == "celery" else "driftsafe",
                env={
                    "DRIFTSAFE_E2E_TRACING": tracing,
                    "DRIFTSAFE_E2E_PATH_LOG": str(tmp_path / f"{beat}.paths"),
                    "DRIFTSAFE_E2E_QUEUE": queue,
                },
            )
        deadline = time.monotonic() + 60
        while any(len(r.messages) < MESSAGES for r in recorders.values()):
            assert time.monotonic() < deadline, f"too few messages\n{run.logs()}"
            assert all(b.process.poll() is None for b in run.beats), run.logs()
            time.sleep(0.2)
        run.stop()
        return {
            beat: (recorder.messages, (tmp_path / f"{beat}.paths").read_text().split())
            for beat, recorder in recorders.items()
        }
    finally:
        for recorder in recorders.values():
            recorder.stop(timeout=1)
        run.close()


def _same_keys(beats: dict[str, tuple[list[dict[str, Any]], list[str]]]) -> None:
    """Every message of either beat has the same header keys (a driftsafe beat's own aside),
    and so have the headers nested under ``headers``, where Sentry repeats its own."""
    keys = {
        beat: {(frozenset(_ours(m)), frozenset(_ours(m.get("headers") or {}))) for m in messages}
        for beat, (messages, _) in beats.items()
    }
    assert len(keys["celery"]) == 1, keys
    assert keys["driftsafe"] == keys["celery"]


def _sentry_traces(messages: list[dict[str, Any]]) -> set[str]:
    """The trace ids of the messages' ``sentry-trace`` headers, each well formed."""
    traces = [SENTRY_TRACE.fullmatch(m["sentry-trace"]) for m in messages]
    assert all(traces), messages
    return {t.group(1) for t in traces if t}


def test_opentelemetry_headers_match_celerys_beat(tmp_path: Path) -> None:
    """Each message carries a ``traceparent`` of its own publish span (a new trace: a beat
    publishes outside any span), as from Celery's beat; the driftsafe beat publishes them on
    the fast path, sending the publish signals itself."""
    beats = _beats(tmp_path, "opentelemetry")
    _same_keys(beats)
    for beat, (messages, paths) in beats.items():
        assert paths == ["fast" if beat == "driftsafe" else "celery"] * len(paths), beat
        assert len(paths) >= len(messages)
        traces = [TRACEPARENT.fullmatch(m["traceparent"]) for m in messages]
        assert all(traces), (beat, messages)
        assert len({t.group(1) for t in traces if t}) == len(messages), beat


def test_sentry_headers_match_celerys_beat(tmp_path: Path) -> None:
    """Each message carries Sentry's ``sentry-trace``, its ``baggage`` naming the same trace
    and its enqueue time, at the top and nested under ``headers``, as from Celery's beat; the
    driftsafe beat steps aside from the fast path (Sentry wraps ``Celery.send_task``), so
    Sentry's wrappers run for every message. Each message starts a trace of its own, as from
    Celery's beat: Sentry wraps ``Scheduler.apply_entry`` for that, and a driftsafe beat hands
    each run to it (:mod:`celery_driftsafe.publish.beat_entries`)."""
    beats = _beats(tmp_path, "sentry")
    _same_keys(beats)
    for beat, (messages, paths) in beats.items():
        assert paths == ["celery"] * len(paths), beat
        assert len(paths) >= len(messages)
        assert len(_sentry_traces(messages)) == len(messages), (beat, messages)
        for message in messages:
            trace = SENTRY_TRACE.fullmatch(message["sentry-trace"])
            assert trace, (beat, message)
            assert f"sentry-trace_id={trace.group(1)}" in message["baggage"].split(","), message
            assert isinstance(message["sentry-task-enqueued-time"], float), message
            nested = message["headers"]
            for key in ("sentry-trace", "baggage", "sentry-task-enqueued-time"):
                assert nested[key] == message[key], (beat, key, message)


def test_sentry_crons_gets_a_check_in_for_each_scheduled_run(tmp_path: Path) -> None:
    """With ``monitor_beat_tasks=True`` Sentry's wrapper of ``apply_entry`` starts a Crons
    check-in for each message of a task it can monitor (an interval of whole minutes) and puts
    its id in the message, and the worker completes it: from driftsafe beats too, one check-in
    for each run, whichever of the two beats claimed it. A task it cannot monitor (every
    second) gets none. Sentry's endpoint is a sink in this process
    (:class:`tests.e2e.sentry_sink.SentrySink`)."""
    minutely = {"schedule_kind": "interval", "interval_every": 60, "interval_unit": "seconds"}
    with SentrySink() as sink:
        run = E2ERun("postgresql", tmp_path)
        try:
            env = {"DRIFTSAFE_E2E_TRACING": "sentry-crons", "DRIFTSAFE_E2E_SENTRY_DSN": sink.dsn}
            run.seed(
                [
                    {"name": "minutely-a", **minutely},
                    {"name": "minutely-b", **minutely},
                    {"name": "each-second", **minutely, "interval_every": 1},
                ],
                real_now() + timedelta(seconds=3),
            )
            run.start_worker("crons", env=env)
            run.start_beat(0, env=env)
            run.start_beat(0, env=env)
            deadline = time.monotonic() + 60
            while len([c for c in sink.items("check_in") if c["status"] == "ok"]) < 2:
                assert time.monotonic() < deadline, f"too few check-ins\n{run.logs()}"
                time.sleep(0.2)
            time.sleep(1)  # a second check-in of a slot, were there one, arrives meanwhile
            run.stop()
        finally:
            run.close()
    check_ins = sink.items("check_in")
    started = {c["check_in_id"]: c for c in check_ins if c["status"] == "in_progress"}
    done = [c for c in check_ins if c["status"] == "ok"]
    assert sorted(c["monitor_slug"] for c in started.values()) == ["minutely-a", "minutely-b"]
    for check_in in started.values():
        assert check_in["monitor_config"]["schedule"] == {
            "type": "interval",
            "value": 1,
            "unit": "minute",
        }, check_in
    assert sorted(c["check_in_id"] for c in done) == sorted(started), check_ins
    assert {c["monitor_slug"] for c in done} == {"minutely-a", "minutely-b"}
