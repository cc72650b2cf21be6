"""The claim process's own side (:mod:`celery_driftsafe.claim.helper_process` is the beat's): set
Django up as the beat has it, then claim each batch the beat asks for, as the beat's node,
sending back the result with the log records of its claim, until the beat asks it to end or
is gone. Nothing here imports Django at import time: a spawned helper imports this module
before Django is set up."""

from __future__ import annotations

import logging
import pickle
import signal
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class Request:
    """One batch asked of the helper: claimed at ``now`` (an authority reading)."""

    now: datetime
    busy_since: datetime | None


class _Records(logging.Handler):
    """Keeps the helper's log records of one claim, made safe to send back."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        record.msg = record.getMessage()
        record.args = None
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        self.records.append(record)


def serve(conn: Any, config: bytes) -> None:
    """The helper's life: set Django up as the beat has it, then claim what is asked for
    until asked to end or the beat is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    using, node_id, database, driftsafe, internals, configured, level = pickle.loads(config)
    try:
        claimer = _set_up(using, database, (driftsafe, internals), configured)
    except Exception as exc:
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    from django.db import connections

    records = _Records()
    root = logging.getLogger()
    root.addHandler(records)
    root.setLevel(level)
    conn.send("ready")
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            break  # the beat is gone
        if request is None:
            break
        records.records = []
        answer: tuple[str, Any]
        try:
            answer = ("result", claimer.claim(request.now, node_id, request.busy_since))
        except Exception as exc:
            connections.close_all()
            answer = ("error", _sendable(exc))
        try:
            conn.send((*answer, records.records))
        except (OSError, ValueError):
            break
    connections.close_all()


def configured_settings(settings: Any) -> dict[str, Any]:
    """What a helper needs of a beat whose Django was set up with ``settings.configure()``
    (no settings module the helper could import), besides its database and ``DRIFTSAFE``."""
    return {
        "INSTALLED_APPS": list(settings.INSTALLED_APPS),
        "USE_TZ": settings.USE_TZ,
        "TIME_ZONE": settings.TIME_ZONE,
        "DEFAULT_AUTO_FIELD": settings.DEFAULT_AUTO_FIELD,
    }


def _set_up(
    using: str,
    database: dict[str, Any],
    driftsafe: tuple[Any, Any],
    configured: dict[str, Any] | None,
) -> Any:
    """Django with the beat's database ``using``, ``DRIFTSAFE`` and ``DRIFTSAFE_INTERNALS``
    (``driftsafe``, as they are in the beat, which may have changed them since its settings
    module was read), and a claimer. With ``configured`` (the beat has no settings module),
    Django is configured from it."""
    import django
    from django.conf import settings

    project, internals = driftsafe
    if configured is not None:
        databases = {"default": {}, using: database}
        settings.configure(
            **configured, DATABASES=databases, DRIFTSAFE=project, DRIFTSAFE_INTERNALS=internals
        )
    else:
        settings.DATABASES[using] = database
        settings.DRIFTSAFE = project
        settings.DRIFTSAFE_INTERNALS = internals
    django.setup()
    from celery_driftsafe.claim.claimers import claimer_for
    from celery_driftsafe.conf import get_settings
    from celery_driftsafe.store.connections import read_committed_connections

    read_committed_connections()
    return claimer_for(using, get_settings())


def _sendable(exc: Exception) -> Exception:
    """``exc``, or a plain exception with its text when it cannot be pickled."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
