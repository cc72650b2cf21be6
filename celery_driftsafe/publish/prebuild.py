"""Building messages ahead: while nothing is due, a beat builds the fast-path message templates
(:mod:`celery_driftsafe.publish.fast_path`) of the tasks that fall due soonest.

A beat builds a task's message once and then only fills in each run's ids; the first build
(argument reprs, serialised body, routing) costs about as much as publishing the message. A
beat that has just started (a deploy, a restart) would pay it for every task of its first
wave, while the wave is waiting: with 100,000 tasks due at midnight, seconds of lateness. So
between rounds, when the next slot is far enough off, the beat spends part of the wait
building the templates of the tasks due within :data:`HORIZON_SECONDS`, earliest first, in
chunks, never longer than the budget it is given, and while a pass is unfinished the beat
comes back after as long again (:attr:`Prebuilder.pending`; it then builds half the time it
waits), so that a restarted beat has built its first two minutes within seconds, not only by
the time they fall due: the wave then finds them built. It builds
nothing a slot is waiting for (it runs only when nothing is due before the wait ends) and
nothing that changes what is published: a template is used only while the run's task name,
arguments and options equal the ones it was built from.

A pass reads only the ids of the tasks due within the horizon, and reads in full (and builds)
only those this beat has no template for: a beat with 100,000 tasks a minute used to read and
decode every one of them again at each pass, twice a minute, for templates it already had
(about 3 s of a core a minute). A task edited since its template was built gets a new one
when its run is published (the template no longer matches), not ahead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections, transaction

from celery_driftsafe.claim.outbox import message_parts, run_message
from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.stored_names import Optimisation
from celery_driftsafe.models import PeriodicTask
from celery_driftsafe.store.connections import order_from_indexes
from celery_driftsafe.store.loaders import load_models, read_instants_in_c

if TYPE_CHECKING:
    from celery_driftsafe.publish.fast_path import FastPublisher

logger = logging.getLogger("celery_driftsafe.scheduler")

#: Tasks due within this many seconds of now are built ahead.
HORIZON_SECONDS = 120.0
#: Tasks looked at a query (their ids; those without a template are then read in full).
CHUNK = 500
#: After a pass over everything due within the horizon, the next starts this much later.
RESCAN_SECONDS = 30.0


class Prebuilder:
    """Builds ahead on database ``using`` through ``fast``; ``expires_at(task, slot)`` is the
    claim's own expiry of a run (whether a run's message will carry one)."""

    def __init__(
        self,
        fast: FastPublisher,
        expires_at: Callable[[PeriodicTask, datetime], datetime | None],
        *,
        using: str = "default",
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fast = fast
        self.expires_at = expires_at
        self.using = using
        self.monotonic = monotonic
        self.built = 0
        #: Tasks read in full (for tests and figures).
        self.read = 0
        self._after: tuple[datetime, int] | None = None
        self._rest_until = 0.0
        #: Off (``OPTIMISATIONS_OFF`` "prebuild"): nothing is built ahead.
        self.enabled = get_settings().optimised(Optimisation.PREBUILD)

    @property
    def pending(self) -> bool:
        """Whether a pass stopped for its budget with tasks left to build."""
        return self._after is not None

    def run(self, now: datetime, budget: float) -> int:
        """Build templates for at most ``budget`` seconds (a chunk at least); how many."""
        started = self.monotonic()
        if not self.enabled or started < self._rest_until or not self.fast.active():
            return 0
        built = 0
        while True:  # a chunk at least, then as many as the budget allows
            chunk = self._next_chunk(now)
            missing = [pk for pk, _ in chunk if not self.fast.has_template(pk)]
            if missing:
                for task in self._read(missing):
                    built += self._build(task)
            if len(chunk) < CHUNK:  # the pass is done
                self._after = None
                self._rest_until = self.monotonic() + RESCAN_SECONDS
                break
            pk, due_at = chunk[-1]
            self._after = (due_at, pk)
            if self.monotonic() - started >= budget:
                break
        self.built += built
        return built

    def _next_chunk(self, now: datetime) -> list[tuple[int, datetime]]:
        """The ids and due instants of the next :data:`CHUNK` tasks due within the horizon,
        in (due_at, id) order, after the last chunk's."""
        connection = connections[self.using]
        tasks: Any = PeriodicTask.objects.using(self.using).filter(
            enabled=True, due_at__lte=now + timedelta(seconds=HORIZON_SECONDS)
        )
        if self._after is not None:
            # After the last task read, as a row comparison: the (enabled, due_at, id) index
            # then starts there. Written as "due_at > x OR (due_at = x AND id > y)" it read
            # every earlier task of the same instant again, chunk after chunk (24 ms a chunk
            # 90,000 tasks into a burst, where this takes 0.8 ms).
            due_at, pk = self._after
            quote = connection.ops.quote_name
            tasks = tasks.extra(
                where=[f"({quote('due_at')}, {quote('id')}) > (%s, %s)"],
                params=[connection.ops.adapt_datetimefield_value(due_at), pk],
            )
        chunk = tasks.order_by("due_at", "id").values_list("id", "due_at")[:CHUNK]
        with transaction.atomic(using=self.using):
            order_from_indexes(self.using)
            if connection.vendor != "postgresql":
                return list(chunk)
            # the instants with psycopg's C loader where it gives the same values (pg_loaders)
            sql, params = chunk.query.get_compiler(using=self.using).as_sql()
            with connection.cursor() as cursor:
                read_instants_in_c(connection, cursor)
                cursor.execute(sql, params)
                return [(pk, due_at) for pk, due_at in cursor.fetchall()]

    def _read(self, pks: list[int]) -> list[PeriodicTask]:
        """The tasks ``pks`` in full (one query)."""
        connections[self.using].ensure_connection()  # for psycopg's C loader (pg_loaders)
        tasks = load_models(PeriodicTask.objects.using(self.using).filter(pk__in=pks))
        self.read += len(tasks)
        return tasks

    def _build(self, task: PeriodicTask) -> int:
        try:
            if task.publish_problems(schedule=False) or task.next_slot_at is None:
                return 0  # the claim disables it, with the reason
            parts: dict[str, Any] = message_parts(run_message(task))
            expires = self.expires_at(task, task.next_slot_at)
            return int(
                self.fast.prebuild(
                    task.pk, task.task, parts["args"], parts["kwargs"], parts["options"], expires
                )
            )
        except Exception:  # a bad row is the claim's to report; building ahead is optional
            logger.debug("not building the message of task %s ahead", task.pk, exc_info=True)
            return 0
