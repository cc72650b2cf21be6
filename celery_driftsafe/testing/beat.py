"""A beat whose rounds a test runs by hand, on a fake clock: "which instants does my task fire
at?" answered without starting ``celery beat``.

:class:`SteppedBeat` drives the real :class:`~celery_driftsafe.scheduler.DriftSafeScheduler`
(its claim rounds, misfire policies, the outbox, the dispatch) against the test database, with
a :class:`~celery_driftsafe.testing.FakeClock` as its time authority. What it publishes goes to
an in-memory broker (``memory://``) through a Celery app of its own, by task name, as a beat
publishes, and is recorded as :class:`Published` messages; nothing executes the tasks.

``advance_to(instant)`` behaves like a beat that never sleeps past a slot of the tasks the test
is about: it jumps the clock to each slot of theirs that falls due on the way, in order, and
runs a round there, so each of their slots is claimed exactly on time (the claim's own rules,
DST included, decide which slots exist). The tasks the test is about are those it names
(:meth:`SteppedBeat.watch`, :meth:`~SteppedBeat.assert_fires`, :meth:`~SteppedBeat.fired`,
:meth:`~SteppedBeat.messages`, :meth:`~SteppedBeat.runs`) and those it creates while the beat
is there; with none, every task. The others are claimed in those rounds, as by a beat that
overslept, so a project's task every second costs a round's claim, not a round a second; asking
about one of them afterwards is an error that says to name it first.

The ``driftsafe`` fixture of the pytest plugin (:mod:`celery_driftsafe.testing.pytest_plugin`)
is one of these; see :doc:`/howto/test-your-schedules`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from celery import Celery
from celery.signals import after_task_publish
from django.db import DatabaseError
from django.db.models import Min
from django.db.models.signals import post_save

from celery_driftsafe.beat import nodes
from celery_driftsafe.core.headers import HEADER_PERIODIC_TASK_ID, HEADER_RUN_ID, HEADER_SLOT
from celery_driftsafe.definitions.beat_schedule import SyncReport, sync_beat_schedule
from celery_driftsafe.scheduler import ROLLED_BACK_ROUNDS, DriftSafeScheduler
from celery_driftsafe.store.connections import rolled_back
from celery_driftsafe.testing import FakeClock

#: Settings copied from the application's Celery app to the beat's own in-memory one: what
#: decides which entries exist, their time zone, and where their messages are routed.
COPIED_SETTINGS = (
    "beat_schedule",
    "timezone",
    "enable_utc",
    "task_routes",
    "task_queues",
    "task_default_queue",
    "task_default_exchange",
    "task_default_exchange_type",
    "task_default_routing_key",
    "task_default_priority",
    "task_create_missing_queues",
    "task_protocol",
    "task_serializer",
)
#: A test advancing further than this many rounds at once is stopped (a schedule firing every
#: second for a year is more likely a mistake than a test).
MAX_ROUNDS = 100_000
#: The ``dispatch_uid`` prefix of the receiver that notes the tasks a test creates.
_CREATED_UID = "driftsafe-stepped-beat-created"


@dataclass(frozen=True)
class Published:
    """One message the beat published: what a worker would receive."""

    task: str
    task_id: str
    args: list[Any]
    kwargs: dict[str, Any]
    run_id: int
    periodic_task_id: int | None
    slot: datetime | None
    #: When (on the fake clock) the round that published it ran.
    published_at: datetime
    routing_key: str
    exchange: str
    headers: dict[str, Any] = field(default_factory=dict)


class _SteppedScheduler(DriftSafeScheduler):
    """The real scheduler, minus what a test process must not do: no wake-up listener thread
    on Redis, no claim-ahead, pruning or reconciling thread (whose own database connection
    would not see the test's uncommitted rows, and, with committed ones, would judge them at an
    instant the test has since moved the clock away from), and no waiting out an unreachable
    database at start-up (the error goes to the test)."""

    def _start_up(self) -> SyncReport:
        nodes.register(self.node_id, self.clock.now(), using=self.using)
        return sync_beat_schedule(self.app, now=self.authority.read(), using=self.using)

    def setup_schedule(self) -> None:
        super().setup_schedule()
        # Nothing is claimed ahead yet: this publishes nothing and lets the thread go.
        self._prefetcher.finish(self.dispatcher.dispatch, self.node_id)
        self.pruner.close()  # and it never starts a pruning pass
        self.reconciler.close()  # nor a reconciling one

    def _start_listener(self) -> None:
        return None


def memory_app(source: Any) -> Celery:
    """A Celery app on an in-memory broker with ``source``'s schedule, time zone and routing
    (:data:`COPIED_SETTINGS`); never eager, so the beat publishes rather than runs."""
    app = Celery("driftsafe-testing", broker="memory://localhost/", set_as_current=False)
    if source is not None:
        app.conf.update(
            {
                name: source.conf.get(name)
                for name in COPIED_SETTINGS
                if source.conf.get(name) is not None
            }
        )
    app.conf.task_always_eager = False
    app.conf.broker_connection_retry_on_startup = False
    return app


class SteppedBeat:
    """One beat node, stepped by the test (see the module docstring).

    ``clock`` is its time authority (install it with
    :func:`~celery_driftsafe.testing.inject_authority_clock` so that tasks saved in the test take
    their first slot from it too); ``app`` the application's Celery app, whose
    ``beat_schedule``, time zone and routing are copied when the beat starts (its first round);
    ``publish_app``, if given, publishes instead of the in-memory app (for a test that runs a
    worker on it).
    """

    def __init__(
        self,
        clock: FakeClock,
        app: Any = None,
        *,
        publish_app: Any = None,
        using: str = "default",
    ) -> None:
        self.clock = clock
        self.source_app = app
        self.publish_app = publish_app
        self.using = using
        self.published: list[Published] = []
        #: Rounds run so far (each claims what is due at the clock's time then).
        self.rounds = 0
        self._scheduler: DriftSafeScheduler | None = None
        #: The tasks the test is about: named, or created while the beat is there (ids).
        self._named: set[str] = set()
        self._created: set[int] = set()
        #: Whether an advance stepped the slots of some tasks only (the others overslept).
        self._stepped_some = False
        self._starting = False
        from celery_driftsafe.models import PeriodicTask

        self._created_uid = f"{_CREATED_UID}-{id(self)}"
        post_save.connect(
            self._note_created, sender=PeriodicTask, weak=False, dispatch_uid=self._created_uid
        )

    # -- running ------------------------------------------------------------------------------

    def now(self) -> datetime:
        return self.clock.now()

    @property
    def scheduler(self) -> DriftSafeScheduler:
        """The scheduler, set up on first use: the node registers and ``beat_schedule`` is
        mirrored into the database at the clock's time then."""
        if self._scheduler is None:
            app = self.publish_app if self.publish_app is not None else memory_app(self.source_app)
            self._starting = True  # the beat_schedule entries it writes are not the test's
            try:
                self._scheduler = _SteppedScheduler(
                    app=app,
                    clock=self.clock,
                    authority=self.clock,
                    using=self.using,
                    install_signal_handlers=False,
                )
            except SystemExit as exc:  # the scheduler refuses a bad configuration this way
                raise RuntimeError(f"the driftsafe beat would not start: {exc}") from None
            finally:
                self._starting = False
        return self._scheduler

    def watch(self, *names: str) -> None:
        """Step the slots of the periodic tasks ``names`` too, from now on (the tasks a test
        names through the other methods, or creates, are stepped already)."""
        for name in names:
            self._task(name)  # an unknown name says which exist
            self._named.add(name)

    def run_round(self) -> list[Published]:
        """One round at the clock's current time; returns what it published."""
        scheduler = self.scheduler
        before = len(self.published)
        thread = threading.get_ident()
        at = self.clock.now()

        def record(
            sender: Any = None,
            body: Any = None,
            headers: Any = None,
            exchange: str = "",
            routing_key: str = "",
            **_: Any,
        ) -> None:
            if threading.get_ident() == thread:
                self._record(body, headers or {}, exchange, routing_key, at)

        after_task_publish.connect(record, weak=False)
        celery_log = logging.getLogger("celery.app.base")
        celery_log.addFilter(_past_expiry)
        try:
            for again in range(ROLLED_BACK_ROUNDS, -1, -1):
                try:
                    scheduler.run_round()
                    break
                except DatabaseError as exc:
                    # rolled back for a concurrent transaction (a deadlock with a worker
                    # recording an outcome, say): it changed nothing, and a beat runs the
                    # round again at once, a few times in a row; so does this one
                    if not (again and rolled_back(exc)):
                        raise
        finally:
            celery_log.removeFilter(_past_expiry)
            after_task_publish.disconnect(record)
        self.rounds += 1
        return self.published[before:]

    def advance_to(self, instant: datetime) -> list[Published]:
        """Move the clock to ``instant``, running a round at every slot that falls due on the
        way (in order) and one at ``instant``; returns what was published meanwhile."""
        _require_aware(instant, "advance_to")
        if instant < self.clock.now():
            raise ValueError(
                f"advance_to({instant.isoformat()}): the clock is already at "
                f"{self.clock.now().isoformat()} and does not go back"
            )
        before = len(self.published)
        self.scheduler  # noqa: B018  (started: beat_schedule entries exist from here on)
        stepped = self._stepped_ids()
        self._stepped_some |= stepped is not None
        for _ in range(MAX_ROUNDS):
            due = self._next_due(stepped)
            if due is None or due > instant:
                break
            if due > self.clock.now():
                self.clock.advance(due - self.clock.now())  # as a beat that slept until then
            if not self.run_round() and self._next_due(stepped) == due:
                # Nothing moved: the task is due but cannot be claimed here (a row another
                # connection holds, say). Do not spin.
                break
        else:
            raise RuntimeError(
                f"advance_to({instant.isoformat()}) stopped after {MAX_ROUNDS} rounds; "
                "advance in shorter steps, or name the tasks the test is about "
                "(driftsafe.watch(name)): only their slots are stepped then"
            )
        if instant > self.clock.now():
            self.clock.advance(instant - self.clock.now())
        self.run_round()
        return self.published[before:]

    def advance(self, seconds: float | timedelta) -> list[Published]:
        """:meth:`advance_to` the clock's time plus ``seconds``."""
        delta = seconds if isinstance(seconds, timedelta) else timedelta(seconds=seconds)
        return self.advance_to(self.clock.now() + delta)

    def close(self) -> None:
        """Let go of the in-memory app's connections (the fixture calls this). The node stays
        registered: the test database goes with the test."""
        post_save.disconnect(dispatch_uid=self._created_uid)
        if self._scheduler is not None and self.publish_app is None:
            self._scheduler.app.close()

    # -- what happened ------------------------------------------------------------------------

    def fired(self, name: str) -> list[datetime]:
        """The slots (aware UTC) published so far for the periodic task named ``name``, in
        the order they were published; a slot published twice appears twice."""
        task_id = self._asked(name)
        return [
            m.slot for m in self.published if m.periodic_task_id == task_id and m.slot is not None
        ]

    def messages(self, name: str) -> list[Published]:
        """The messages published so far for the periodic task named ``name``."""
        task_id = self._asked(name)
        return [m for m in self.published if m.periodic_task_id == task_id]

    def runs(self, name: str) -> Any:
        """The run ledger rows of the periodic task named ``name`` (a queryset, by slot):
        fired, missed, expired."""
        from celery_driftsafe.models import Run

        return (
            Run.objects.using(self.using)
            .filter(periodic_task_id=self._asked(name))
            .order_by("slot", "pk")
        )

    def assert_fires(
        self,
        name: str,
        expected: Iterable[datetime],
        *,
        between: tuple[datetime, datetime] | None = None,
    ) -> None:
        """Assert that the periodic task ``name`` fired exactly at ``expected`` (aware
        instants, in any zone; order does not matter, a duplicate firing does).

        With ``between=(start, end)``, the beat first runs up to ``end`` (if the clock is not
        there yet), and only the slots in ``[start, end)`` count."""
        wanted = sorted(_require_aware(t, "assert_fires") for t in expected)
        fired = self.fired(name)  # the task is about name from here on
        if between is not None:
            start, end = (_require_aware(t, "assert_fires(between=...)") for t in between)
            if end > self.clock.now():
                self.advance_to(end)
                fired = self.fired(name)
            fired = [slot for slot in fired if start <= slot < end]
        if sorted(fired) == wanted:
            return
        raise AssertionError(self._explain(name, wanted, sorted(fired), between))

    # -- internals ----------------------------------------------------------------------------

    def _note_created(self, sender: Any, instance: Any, created: bool, **_: Any) -> None:
        if created and not self._starting:
            self._created.add(int(instance.pk))

    def _stepped_ids(self) -> set[int] | None:
        """The ids of the tasks whose slots an advance steps: those the test named or created;
        None (every task) when it did neither."""
        if not self._named and not self._created:
            return None
        from celery_driftsafe.models import PeriodicTask

        named = PeriodicTask.objects.using(self.using).filter(name__in=self._named)
        return self._created | set(named.values_list("pk", flat=True))

    def _next_due(self, stepped: set[int] | None) -> datetime | None:
        """When the earliest unclaimed slot of the ``stepped`` tasks (None: of any) is due."""
        if stepped is None:
            return self.scheduler.next_due()
        from celery_driftsafe.models import PeriodicTask

        due: datetime | None = (
            PeriodicTask.objects.using(self.using)
            .filter(pk__in=stepped, enabled=True, due_at__isnull=False)
            .aggregate(first=Min("due_at"))["first"]
        )
        return due

    def _asked(self, name: str) -> int:
        """The id of the task ``name``, which the test is about from now on; an error if an
        advance already stepped other tasks' slots only (its record would miss slots)."""
        task = self._task(name)
        if self._stepped_some and name not in self._named and task.pk not in self._created:
            raise LookupError(
                f"periodic task {name!r} was not stepped: the beat advanced through the slots "
                "of the tasks this test named or created only, and claimed this one as a beat "
                f"that overslept. Name it before advancing: driftsafe.watch({name!r})"
            )
        self._named.add(name)
        return int(task.pk)

    def _record(
        self, body: Any, headers: dict[str, Any], exchange: str, routing_key: str, at: datetime
    ) -> None:
        if HEADER_RUN_ID not in headers:
            return
        args: Any = []
        kwargs: Any = {}
        if isinstance(body, list | tuple) and len(body) >= 2:
            args, kwargs = body[0], body[1]
        slot = headers.get(HEADER_SLOT)
        periodic = headers.get(HEADER_PERIODIC_TASK_ID)
        self.published.append(
            Published(
                task=str(headers.get("task", "")),
                task_id=str(headers.get("id", "")),
                args=list(args),
                kwargs=dict(kwargs),
                run_id=int(headers[HEADER_RUN_ID]),
                periodic_task_id=None if periodic is None else int(periodic),
                slot=None if slot is None else datetime.fromisoformat(slot).astimezone(UTC),
                published_at=at,
                routing_key=routing_key or "",
                exchange=exchange or "",
                headers=dict(headers),
            )
        )

    def _task(self, name: str) -> Any:
        from celery_driftsafe.models import PeriodicTask

        self.scheduler  # noqa: B018  (started: beat_schedule entries exist from here on)
        tasks = PeriodicTask.objects.using(self.using)
        task = tasks.filter(name=name).first()
        if task is None:
            known = sorted(tasks.values_list("name", flat=True))
            raise LookupError(
                f"no periodic task named {name!r}; the database has: "
                f"{', '.join(map(repr, known)) or 'none'}"
            )
        return task

    def _explain(
        self,
        name: str,
        wanted: Sequence[datetime],
        fired: Sequence[datetime],
        between: tuple[datetime, datetime] | None,
    ) -> str:
        zone = ZoneInfo(self._task(name).timezone or "UTC")
        span = (
            ""
            if between is None
            else (f" between {_show(between[0], zone)} and {_show(between[1], zone)}")
        )
        lines = [
            f"periodic task {name!r} fired {len(fired)} time(s){span}, expected {len(wanted)}:"
        ]
        lines.append("  expected: " + (", ".join(_show(t, zone) for t in wanted) or "nothing"))
        lines.append("  fired:    " + (", ".join(_show(t, zone) for t in fired) or "nothing"))
        missing = _minus(wanted, fired)
        extra = _minus(fired, wanted)
        if missing:
            lines.append("  missing:  " + ", ".join(_show(t, zone) for t in missing))
        if extra:
            lines.append("  extra:    " + ", ".join(_show(t, zone) for t in extra))
        lines.append(f"  (the clock is at {_show(self.clock.now(), zone)})")
        return "\n".join(lines)


def _past_expiry(record: logging.LogRecord) -> bool:
    """Drop Celery's warning that a message's expiry lies in the past: it compares with the
    real clock, and on the fake one the expiry is ahead."""
    return "has an expiration date in the past" not in record.getMessage()


def _minus(these: Sequence[datetime], those: Sequence[datetime]) -> list[datetime]:
    """``these`` without one occurrence of each of ``those`` (a multiset difference)."""
    rest = list(those)
    out = []
    for item in these:
        if item in rest:
            rest.remove(item)
        else:
            out.append(item)
    return out


def _show(instant: datetime, zone: ZoneInfo) -> str:
    """``2026-03-29 01:00:00 UTC (03:00:00 CEST Europe/Berlin)``."""
    utc = instant.astimezone(UTC)
    text = f"{utc:%Y-%m-%d %H:%M:%S} UTC"
    if zone.key != "UTC":
        local = instant.astimezone(zone)
        text += f" ({local:%Y-%m-%d %H:%M:%S %Z} {zone.key})"
    return text


def _require_aware(instant: datetime, where: str) -> datetime:
    """``instant`` in UTC. (Aware datetimes in different zones compare by instant, except
    that one in a repeated hour never equals anything: PEP 495. In UTC they all do.)"""
    if not isinstance(instant, datetime) or instant.tzinfo is None:
        raise ValueError(
            f"{where} needs aware datetimes (e.g. tzinfo=UTC or "
            f"ZoneInfo('Europe/Berlin')), not {instant!r}"
        )
    return instant.astimezone(UTC)
