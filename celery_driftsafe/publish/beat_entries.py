"""Claimed runs handed to Celery beat's ``Scheduler.apply_entry``, where code wraps it.

Celery's beat publishes each due entry through ``apply_entry(entry, producer)``, and
integrations wrap that method on the class: Sentry's ``CeleryIntegration`` starts a new trace
for each entry there and, with ``monitor_beat_tasks=True``, puts its Crons headers (monitor
slug, schedule, check-in id) in the entry's options and sends the check-in that the worker
later completes. A driftsafe beat publishes claimed runs, not entries, so without this such a
wrapper would never run: every message of the beat would share one trace, and Sentry Crons
would see no scheduled task at all.

The scheduler hands itself down as an :class:`EntryScheduler` (this module's protocol, so the
import contracts see the one exit from the publishing that reaches the beat's own code).
Where its ``apply_entry`` is not Celery's own (wrapped on the class, or overridden
in a subclass), the beat's :class:`~celery_driftsafe.publish.dispatcher.Dispatcher` hands each
scheduled run to it as a :class:`RunEntry` (Celery's beat has no entry for a run an operator
started: those go out as without a wrapper): named as the periodic task, with its
schedule as a Celery schedule (:func:`celery_schedule`), the run's arguments and its publish
options with the run's headers. Celery's ``apply_entry`` calls the scheduler's
``apply_async(entry, ...)``, which publishes the run with the options the wrappers left in the
entry (Celery's own path, never the fast one: what a wrapper changed must reach the message).
The run's own headers (``driftsafe_*``) always go out as the run has them. Where the publish
fails, the error reaches the dispatcher as without a wrapper (Celery's ``apply_entry`` would
log it and go on, which would lose the run); a wrapper that did not publish leaves the run to
be tried again, with backoff, as one the broker refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import tzinfo
from typing import TYPE_CHECKING, Any, Protocol
from zoneinfo import ZoneInfo

from celery.beat import ScheduleEntry
from celery.schedules import BaseSchedule, crontab, schedule, solar

from celery_driftsafe.models import PeriodicTask, RunKind, ScheduleKind
from celery_driftsafe.publish.originals import is_original

if TYPE_CHECKING:
    from celery_driftsafe.claim.outbox import ClaimedRun

#: Publishes a run with the options (``headers`` among them) it is given; returns the result.
Send = Callable[[dict[str, Any]], Any]


class _ZonedCrontab(crontab):
    """Celery's crontab in the periodic task's own zone (Celery's takes the app's)."""

    def __init__(self, zone: tzinfo, **fields: Any) -> None:
        super().__init__(**fields)
        self._zone = zone

    @property
    def tz(self) -> tzinfo:
        return self._zone


class Unmapped(BaseSchedule):
    """A periodic task's schedule that Celery has no class for (a one-off instant, a crontab
    with seconds): the entry's ``schedule`` for what wraps ``apply_entry``, which then finds
    a schedule it does not know (Sentry Crons leaves the task unmonitored)."""

    def __init__(self, description: str) -> None:
        super().__init__()
        self.description = description

    def is_due(self, last_run_at: Any) -> tuple[bool, float]:
        return False, 3600.0  # the beat's claim decides; nothing asks this entry

    def __repr__(self) -> str:
        return f"<Unmapped: {self.description}>"


def celery_schedule(task: PeriodicTask) -> BaseSchedule:
    """``task``'s schedule as a Celery schedule object: an interval as ``schedule``, a crontab
    (whole minutes) as ``crontab`` in the task's zone, a solar event as ``solar``; anything
    else as :class:`Unmapped`."""
    kind = task.schedule_kind
    try:
        if kind == ScheduleKind.INTERVAL:
            return schedule(run_every=task.build_schedule().every)  # type: ignore[attr-defined]
        if kind == ScheduleKind.CRONTAB and (task.crontab_second or "0") == "0":
            return _ZonedCrontab(
                ZoneInfo(task.timezone or "UTC"),
                minute=task.crontab_minute or "*",
                hour=task.crontab_hour or "*",
                day_of_month=task.crontab_day_of_month or "*",
                month_of_year=task.crontab_month_of_year or "*",
                day_of_week=task.crontab_day_of_week or "*",
            )
        if kind == ScheduleKind.SOLAR:
            return solar(task.solar_event, task.solar_latitude, task.solar_longitude)
    except Exception as exc:  # a field Celery reads otherwise than this package (or refuses)
        return Unmapped(f"{kind}: {exc}")
    return Unmapped(f"{kind} with seconds" if kind == ScheduleKind.CRONTAB else str(kind))


class RunEntry(ScheduleEntry):
    """A claimed run as a Celery beat entry (see the module docstring)."""

    def __init__(
        self,
        run: ClaimedRun,
        task: PeriodicTask | None,
        options: dict[str, Any],
        send: Send,
        app: Any,
    ) -> None:
        super().__init__(
            name=task.name if task is not None else run.task_name,
            task=run.task_name,
            schedule=celery_schedule(task) if task is not None else Unmapped("deleted task"),
            args=run.args,
            kwargs=run.kwargs,
            options=options,
            app=app,
        )
        self.run = run
        #: The run's own headers, as they were before any wrapper saw the entry.
        self.run_headers = dict(options.get("headers") or {})
        self._send = send
        self.sent = False
        self.error: BaseException | None = None

    def send(self) -> Any:
        """Publish the run with the options the wrappers left (the run's headers as they are);
        the error, if any, is kept for :meth:`BeatEntries.apply` (Celery's ``apply_entry``
        logs it and goes on)."""
        options = dict(self.options)
        options["headers"] = {**(options.get("headers") or {}), **self.run_headers}
        try:
            result = self._send(options)
        except BaseException as exc:
            self.error = exc
            raise
        self.sent = True
        return result


class EntryScheduler(Protocol):
    """What a beat's scheduler hands down for its runs to go through ``apply_entry``
    (``DriftSafeScheduler``, a ``celery.beat.Scheduler``): its app, and ``apply_entry``
    itself, which publishes a :class:`RunEntry` by calling the scheduler's
    ``apply_async(entry, producer)``, and that, for a :class:`RunEntry`, calls
    :meth:`RunEntry.send`."""

    @property
    def app(self) -> Any: ...

    def apply_entry(self, entry: ScheduleEntry, producer: Any = None) -> None: ...


class BeatEntries:
    """A beat scheduler's ``apply_entry``, for the runs its dispatcher publishes."""

    def __init__(self, scheduler: EntryScheduler) -> None:
        self.scheduler = scheduler

    def wrapped(self) -> bool:
        """Whether runs go through ``apply_entry`` now: it is not Celery's own, wrapped on the
        class or overridden (read once a dispatch: an integration may wrap it after the beat
        started)."""
        apply_entry = type(self.scheduler).apply_entry
        return not is_original(apply_entry, "celery.beat", "Scheduler.apply_entry")

    def tasks(self, runs: Sequence[ClaimedRun], using: str) -> dict[int, PeriodicTask]:
        """The periodic tasks of the scheduled ones of ``runs``, by id (one read)."""
        ids = {
            run.periodic_task_id
            for run in runs
            if run.kind == RunKind.SCHEDULED and run.periodic_task_id is not None
        }
        return PeriodicTask.objects.using(using).in_bulk(ids) if ids else {}

    def apply(
        self,
        run: ClaimedRun,
        task: PeriodicTask | None,
        options: dict[str, Any],
        producer: Any,
        send: Send,
    ) -> None:
        """Hand ``run`` to ``apply_entry``; raises what its publish raised, or when no
        wrapper let it publish."""
        entry = RunEntry(run, task, options, send, self.scheduler.app)
        self.scheduler.apply_entry(entry, producer=producer)  # as Celery's beat calls it
        if entry.error is not None:
            raise entry.error
        if not entry.sent:
            raise RuntimeError(
                f"{type(self.scheduler).__name__}.apply_entry did not publish the run (a "
                "wrapper of it returned without calling it): tried again later"
            )
