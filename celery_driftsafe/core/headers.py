"""The message headers a published run carries (set by
:func:`celery_driftsafe.claim.outbox.message_headers`), and how a worker reads them back
(see docs/reference/headers.md).

A worker's request has every custom header as an attribute; an eager request
(``task_always_eager``, ``apply()``) has them only in ``request.headers``. Both are read here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celery_driftsafe.exceptions import BadRunHeaders

#: Id of the run's row in the ledger.
HEADER_RUN_ID = "driftsafe_run_id"
#: The slot, ISO 8601 in UTC (absent for manual and ad-hoc runs).
HEADER_SLOT = "driftsafe_slot"
#: The fencing token the run was claimed with.
HEADER_FENCING_TOKEN = "driftsafe_fencing_token"
#: Id of the periodic task (absent for ad-hoc runs).
HEADER_PERIODIC_TASK_ID = "driftsafe_periodic_task_id"
#: Where the publishing process takes run locks (:func:`celery_driftsafe.locks.lock_identity`).
HEADER_LOCKS = "driftsafe_locks"

#: Celery's beat sets it on every message it sends; a beat of this package does too.
HEADER_CELERY_BEAT = "celery_beat_task"

ALL = (HEADER_RUN_ID, HEADER_SLOT, HEADER_FENCING_TOKEN, HEADER_PERIODIC_TASK_ID, HEADER_LOCKS)


# -- The names no stored value may set -----------------------------------------------------------

#: Header names Celery, kombu or this package give a meaning, which a task's stored ``headers``
#: must not set (Celery lets a custom header override its own: ``id`` or ``task`` would make
#: the worker run another task under another id than the run that was claimed). Held equal to
#: Celery's and kombu's own lists by ``tests/usage/test_ordinary_use.py``.
RESERVED_HEADERS = frozenset(
    {
        # Celery's task protocol 2: the headers ``amqp.as_task_v2`` writes
        "lang",
        "task",
        "id",
        "shadow",
        "eta",
        "expires",
        "group",
        "group_index",
        "retries",
        "timelimit",
        "root_id",
        "parent_id",
        "argsrepr",
        "kwargsrepr",
        "origin",
        "ignore_result",
        "replaced_task_nesting",
        "stamped_headers",
        "stamps",
        # its message properties and the body's canvas, which a worker's request reads too
        "correlation_id",
        "reply_to",
        "callbacks",
        "errbacks",
        "chain",
        "chord",
        # the rest of a worker's request context (``celery.app.task.Context``), which takes
        # every header as an attribute: a header ``update`` would replace its method
        "args",
        "kwargs",
        "as_execution_options",
        "called_directly",
        "children",
        "clear",
        "delivery_info",
        "get",
        "headers",
        "hostname",
        "is_eager",
        "logfile",
        "loglevel",
        "properties",
        "soft_time_limit",
        "taskset",
        "time_limit",
        "update",
        "utc",
        # kombu: how the body is encoded (it decompresses by the ``compression`` header)
        "compression",
        "content_type",
        "content_encoding",
        "content-type",
        "content-encoding",
        # this package's
        *ALL,
    }
)
#: Prefixes of reserved names: this package's headers, and the private state of Celery's
#: request context (``_protected``, ``_children``, ...).
RESERVED_PREFIXES = ("driftsafe_", "_")


def reserved(name: str) -> bool:
    """Whether a stored header may not be called ``name``."""
    return name in RESERVED_HEADERS or name.startswith(RESERVED_PREFIXES)


# -- Reading them back in the worker -------------------------------------------------------------


@dataclass(frozen=True)
class RunHeaders:
    run_id: int
    fencing_token: int
    periodic_task_id: int | None
    slot: str | None
    #: Where the publisher takes run locks (None: a message from before that header).
    locks: str | None = None


def _int_header(name: str, value: Any, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise BadRunHeaders(f"header {name}={value!r} is not a whole number")
    try:
        number = int(value)
    except ValueError:
        raise BadRunHeaders(f"header {name}={value!r} is not a whole number") from None
    if number < 0:
        raise BadRunHeaders(f"header {name}={value!r} is negative")
    return number


def header_value(request: Any, name: str) -> Any:
    """One custom header of a Celery request (worker or eager), None when absent."""
    value = getattr(request, name, None)
    if value is None:
        custom = getattr(request, "headers", None)
        if isinstance(custom, dict):
            value = custom.get(name)
    return value


def read_headers(request: Any) -> RunHeaders | None:
    """The run headers of a request, None when it carries none; raises :class:`BadRunHeaders`."""
    raw = header_value(request, HEADER_RUN_ID)
    if raw is None:
        return None
    run_id = _int_header(HEADER_RUN_ID, raw)
    token = _int_header(HEADER_FENCING_TOKEN, header_value(request, HEADER_FENCING_TOKEN) or 0)
    periodic = _int_header(
        HEADER_PERIODIC_TASK_ID, header_value(request, HEADER_PERIODIC_TASK_ID), optional=True
    )
    slot = header_value(request, HEADER_SLOT)
    if slot is not None and not isinstance(slot, str):
        raise BadRunHeaders(f"header {HEADER_SLOT}={slot!r} is not an ISO 8601 instant")
    locks = header_value(request, HEADER_LOCKS)
    if locks is not None and not isinstance(locks, str):
        raise BadRunHeaders(f"header {HEADER_LOCKS}={locks!r} is not a text")
    assert run_id is not None and token is not None
    return RunHeaders(run_id, token, periodic, slot, locks)


def valid_headers(request: Any) -> RunHeaders | None:
    """:func:`read_headers`, None also when they are malformed: for code beside the body
    (the worker's records, a plain task's outcome), which leaves judging them to the body's
    side and records nothing for them."""
    try:
        return read_headers(request)
    except BadRunHeaders:
        return None
