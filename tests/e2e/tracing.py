"""The real tracing integrations, installed in an e2e process as a project installs them: at
the import of its Celery app (:mod:`tests.e2e.celery_app` calls :func:`install` when
``DRIFTSAFE_E2E_TRACING`` names one). ``tests/e2e/test_tracing.py`` compares the headers they
add to a driftsafe beat's messages with those they add to Celery's own beat's.

- ``sentry``: ``sentry_sdk.init`` with its ``CeleryIntegration`` (which wraps
  ``Task.apply_async``, ``Celery.send_task`` and kombu's ``Producer.publish`` on the class,
  and Celery beat's ``Scheduler.apply_entry``) and a DSN whose port nothing listens on;
  ``sentry-crons``: the same with ``monitor_beat_tasks=True`` (Sentry Crons' headers and
  check-ins for each scheduled message); ``DRIFTSAFE_E2E_SENTRY_DSN`` sends either to a
  :class:`tests.e2e.sentry_sink.SentrySink` instead;
- ``opentelemetry``: the SDK's ``TracerProvider`` with a batch span processor whose exporter
  drops the spans, and ``CeleryInstrumentor().instrument()`` (receivers of
  ``before_task_publish`` and ``after_task_publish``).

With ``DRIFTSAFE_E2E_PATH_LOG`` set, a receiver of ``before_task_publish`` also appends, for
each message, the path that sent it to that file: ``fast`` (the fast publish path,
``publish/receivers.py``) or ``celery`` (Celery's ``send_task_message``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

#: Where Sentry would send events: a local port nothing listens on (the discard port).
SENTRY_DSN = "http://public@127.0.0.1:9/1"


def install(kind: str) -> None:
    """Install the integration named ``kind`` in this process."""
    if kind in ("sentry", "sentry-crons"):
        import sentry_sdk
        from sentry_sdk.integrations.celery import CeleryIntegration

        crons = kind == "sentry-crons"
        sentry_sdk.init(
            dsn=os.environ.get("DRIFTSAFE_E2E_SENTRY_DSN", SENTRY_DSN),
            integrations=[CeleryIntegration(monitor_beat_tasks=crons)],
        )
    elif kind == "opentelemetry":
        install_opentelemetry()
    else:
        raise ValueError(
            f"DRIFTSAFE_E2E_TRACING={kind!r}: 'sentry', 'sentry-crons' or 'opentelemetry'"
        )
    if os.environ.get("DRIFTSAFE_E2E_PATH_LOG"):
        from celery import signals

        signals.before_task_publish.connect(_record_path, weak=False)


def install_opentelemetry() -> None:
    """OpenTelemetry's SDK and Celery instrumentation, spans dropped where an exporter would
    send them (also used by ``benchmarks/bench_burst.py``)."""
    from opentelemetry import trace
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class Dropped(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    trace.set_tracer_provider(provider)
    CeleryInstrumentor().instrument()


def connect_noop_receivers() -> Callable[[], None]:
    """Receivers of ``before_task_publish`` and ``after_task_publish`` that do nothing: what
    any receiver costs the beat's publishing (the fast path's signals and the message parts it
    makes afresh for them), apart from the receiver's own work (used by ``benchmarks/``).
    Returns what disconnects them."""
    from celery import signals

    def nothing(**kwargs: Any) -> None:
        pass

    publish_signals = (signals.before_task_publish, signals.after_task_publish)
    for signal in publish_signals:
        signal.connect(nothing, weak=False)

    def disconnect() -> None:
        for signal in publish_signals:
            signal.disconnect(nothing)

    return disconnect


def _record_path(sender: Any = None, **kwargs: Any) -> None:
    frame = sys._getframe(1)
    path = "celery"
    while frame is not None:
        if frame.f_code.co_filename.endswith("celery_driftsafe/publish/receivers.py"):
            path = "fast"
            break
        frame = frame.f_back
    with open(os.environ["DRIFTSAFE_E2E_PATH_LOG"], "a") as log:
        log.write(path + "\n")
