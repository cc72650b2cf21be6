"""The Django signals celery_driftsafe sends: connect alerts to them (see docs/howto/deadlines.md
and docs/howto/pause-after-failures.md).

The deadline signals (the first two) are sent by the beat that flagged the run or the task,
from the thread of its deadline check (:mod:`celery_driftsafe.beat.deadlines`), once per late
run and once per time a task becomes stale, however many beats run: the flag is written by a
conditional ``UPDATE`` that only one beat wins. They are sent with ``send_robust``: a
receiver that raises is logged (action ``deadline-receiver-failed``) and neither stops the
other receivers nor the beat. A receiver runs in the beat's process: one that takes long
delays the next check, so hand slow work (an e-mail, an HTTP call) to a thread or a Celery
task.

``run_deadline_missed``
    ``sender``: :class:`~celery_driftsafe.models.PeriodicTask` (the class). Arguments:
    ``run`` (the :class:`~celery_driftsafe.models.Run`, as it was when flagged: its
    ``status`` says how far it got), ``task`` (its
    :class:`~celery_driftsafe.models.PeriodicTask`), ``deadline`` (the instant it had to
    succeed by: slot plus ``deadline_seconds``), ``late_at`` (when it was found late, on the
    time authority's clock).

``task_became_stale``
    ``sender``: :class:`~celery_driftsafe.models.PeriodicTask`. Arguments: ``task``, ``since``
    (its ``stale_since``), ``slots`` (how many of its last slots past their deadline had no
    success: ``STALE_AFTER_SLOTS`` or more).

``task_paused``
    ``sender``: :class:`~celery_driftsafe.models.PeriodicTask`. Arguments: ``task`` (as it is
    once paused: disabled, its ``disabled_reason`` saying why), ``reason`` (that reason),
    ``failures`` (its failed or missed runs in a row: its ``pause_after_failures`` or, when a
    claim recorded many missed slots at once, more). Sent once per pause, after the pause
    committed, by the process whose outcome paused the task: a worker (a run that failed) or a
    beat (missed slots, a lost worker's run, an outcome read from the result backend); see
    :mod:`celery_driftsafe.claim.pausing`. Sent with ``send_robust`` too (a receiver that raises
    is logged, action ``pause-receiver-failed``).
"""

from __future__ import annotations

from django.dispatch import Signal

#: A scheduled run had not succeeded by its slot plus its task's ``deadline_seconds``.
run_deadline_missed = Signal()
#: None of a task's last ``STALE_AFTER_SLOTS`` slots past their deadline succeeded.
task_became_stale = Signal()
#: A task was paused (disabled) after ``pause_after_failures`` failed or missed runs in a row.
task_paused = Signal()
