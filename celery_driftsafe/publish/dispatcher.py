"""Publishing claimed runs (the outbox's second half) and recording that they went out: the
``Dispatcher`` confirms each run's claim, publishes in pipelined batches over one producer
connection, and marks what went out ``dispatched`` (refused messages retried with backoff,
expired ones recorded). What a run is published with is :mod:`celery_driftsafe.claim.outbox`.

One run goes out one way, decided in one place (:meth:`Dispatcher.route`): its message from
its task's template (:mod:`~celery_driftsafe.publish.fast_path`), handed to the receivers of
the publish signals when there are any (:mod:`~celery_driftsafe.publish.receivers`) and
written by the batch's writer (:mod:`~celery_driftsafe.publish.redis_writer`: kombu's
producer, or the Redis lists); or, stepping aside with the reason, Celery's own
``apply_async`` (``send_task`` for a name the beat has not imported), or the beat's
``apply_entry`` where code wraps it (:mod:`~celery_driftsafe.publish.beat_entries`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from celery import Task
from celery.exceptions import QueueNotFound
from django.db import DatabaseError, transaction
from django.db.models import Case, F, Q, TextField, Value, When

from celery_driftsafe.celery_app import argument_problem
from celery_driftsafe.claim.disabling import disable_by_id
from celery_driftsafe.claim.outbox import message_headers, message_refusal
from celery_driftsafe.claim.sql import id_set
from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.stored_names import Optimisation
from celery_driftsafe.definitions import changes
from celery_driftsafe.exceptions import BrokerUnavailable
from celery_driftsafe.models import PeriodicTask, Run, RunKind, RunStatus
from celery_driftsafe.monitoring import metrics
from celery_driftsafe.publish import receivers
from celery_driftsafe.publish.adhoc import publishes_on_commit
from celery_driftsafe.publish.broker_errors import (
    connection_errors,
    describe_error,
    pipelined,
    refused,
)
from celery_driftsafe.publish.fast_path import FastPublisher
from celery_driftsafe.publish.message_parts import RunMessage
from celery_driftsafe.publish.redis_writer import BatchWriteError, KombuWriter, RedisWriter, Writer
from celery_driftsafe.store.clock import Clock
from celery_driftsafe.store.statement_cache import select_rows, update, update_query

if TYPE_CHECKING:
    from celery_driftsafe.claim.outbox import ClaimedRun
    from celery_driftsafe.publish.beat_entries import BeatEntries

logger = logging.getLogger("celery_driftsafe.publisher")
route_logger = logging.getLogger("celery_driftsafe.fastpublish")

#: The ways a run steps aside from the fast path (:class:`StepAside`).
CELERY = "Celery's apply_async"
ENTRY = "the beat's apply_entry"


#: A run whose publish the broker refused this many times is recorded ``failed``.
MAX_PUBLISH_ATTEMPTS = 8
#: Longest wait before another try of a refused publish.
MAX_PUBLISH_BACKOFF = timedelta(minutes=5)


@dataclass
class DispatchResult:
    published: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    #: Runs left ``claimed`` because the broker could not be reached: the outbox retries them
    #: after the lease.
    deferred: list[int] = field(default_factory=list)
    #: Runs whose message the broker refused (the others went out): retried with backoff.
    refused: dict[int, str] = field(default_factory=dict)
    #: Runs not published because this publisher no longer owns their claim (another node
    #: took them over while this one was paused, or this node was marked dead).
    lost: list[int] = field(default_factory=list)
    #: Runs not published because their message had expired already (a long outage).
    expired: list[int] = field(default_factory=list)
    #: Failed runs (among ``failed``) whose arguments Celery found unfit for the task's
    #: signature: their periodic tasks are disabled (:meth:`Dispatcher._disable_unfit`).
    unfit: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StepAside:
    """A run that leaves the fast path: it goes out through ``way`` (:data:`CELERY` or
    :data:`ENTRY`), for ``reason``."""

    way: str
    reason: str


class Dispatcher:
    """Publishes runs through a Celery app over one producer connection per batch."""

    def __init__(
        self, app: Any, clock: Clock, *, using: str = "default", batch_size: int | None = None
    ) -> None:
        self.app = app
        self.clock = clock
        self.using = using
        self.batch_size = batch_size or get_settings().publish_batch_size
        self.fast = FastPublisher(app)
        #: Whether this batch may write straight to Redis (read once a dispatch).
        self._direct = True
        #: Why the last publish found the broker out of reach; None while it answers.
        self.broker_down: str | None = None
        #: A beat's ``apply_entry`` (handed down by its scheduler): where code wraps it, each
        #: run of a periodic task is handed to it (:mod:`celery_driftsafe.publish.beat_entries`).
        self.entries: BeatEntries | None = None
        #: This dispatch's periodic tasks by id while runs go through ``apply_entry``.
        self._entry_tasks: dict[int, PeriodicTask] | None = None
        #: This batch's reason for Celery's own path ("": the fast path is open) and whether
        #: receivers of the publish signals are connected (read once a batch).
        self._closed = ""
        self._signalled = False

    def dispatch(self, runs: Sequence[ClaimedRun]) -> DispatchResult:
        """Publish ``runs``, then mark what went out ``dispatched``.

        First the claims are confirmed: only runs still ``claimed`` by the node that claimed
        them, while that node is not marked dead, are published. A run taken over meanwhile
        (this beat was paused past ``NODE_DEAD_AFTER_SECONDS``) is left to its new owner.

        Each message is published on its own: one the broker refuses is recorded with its
        error and tried again with backoff, and the rest of the batch goes out once. If the
        broker cannot be reached, every run not known to be out stays ``claimed`` for the
        outbox, under the same task id.
        """
        result = DispatchResult()
        if not runs:
            return result
        owned = self._still_owned(runs, result)
        now = self.clock.now()
        self.fast.wall_ahead = datetime.now(UTC) - now
        todo: list[ClaimedRun] = []
        gated: list[ClaimedRun] = []  # their captured message may not go out
        for run in runs:
            if run.run_id not in owned:
                continue
            if run.expires_at is not None and run.expires_at <= now:
                result.expired.append(run.run_id)
            elif refusal := message_refusal(run):
                result.failed[run.run_id] = refusal
                gated.append(run)
            else:
                todo.append(run)
        fast = self.fast if self.fast.active() else None
        if fast is None and todo:
            route_logger.debug(
                "publishing through Celery's apply_async: %s",
                self.fast.closed,
                extra={"action": "fast-publish-off"},
            )
        self._entry_tasks = None
        if self.entries is not None and self.entries.wrapped():
            self._entry_tasks = self.entries.tasks(todo, self.using)
        # the writer straight to Redis (OPTIMISATIONS_OFF "redis_writer": kombu's producer)
        self._direct = get_settings().optimised(Optimisation.REDIS_WRITER)
        # A write the broker holds back (RabbitMQ's flow control) may outlast the dead-after
        # and peers take the claims over: after a while, the ones left are confirmed again.
        recheck = timedelta(seconds=get_settings().node_dead_after_seconds / 4)
        confirmed_at = now
        try:
            with self.app.producer_or_acquire() as producer:
                for start in range(0, len(todo), self.batch_size):
                    batch = todo[start : start + self.batch_size]
                    if self.clock.now() - confirmed_at > recheck:
                        owned = self._still_owned(todo[start:], result)
                        confirmed_at = self.clock.now()
                    if result.lost:
                        batch = [run for run in batch if run.run_id in owned]
                    self._publish_batch(batch, producer, result, fast)
        except DatabaseError:
            raise  # the claims' second confirmation: as when they were first confirmed
        except Exception as exc:  # broker unreachable: nothing more is known to be out
            done = {*result.published, *result.refused, *result.failed, *result.lost}
            result.deferred = [r.run_id for r in todo if r.run_id not in done]
            self.broker_down = describe_error(exc)
            logger.error(
                "publishing failed after %d of %d runs; %d runs stay claimed for the outbox: %s",
                len(result.published),
                len(todo),
                len(result.deferred),
                exc,
                extra={"action": "publish-failed"},
            )
        self._record(result, {r.run_id: r for r in (*todo, *gated)})
        return result

    def check_broker(self) -> None:
        """After a publish found the broker out of reach: raise :class:`BrokerUnavailable`
        unless it answers a connection now (so a beat claims nothing more meanwhile)."""
        if self.broker_down is None:
            return
        try:
            with self.app.connection_for_write() as connection:
                connection.ensure_connection(
                    max_retries=1, interval_start=0, interval_step=0, interval_max=0
                )
                connection.default_channel  # noqa: B018  (Redis: the channel pings)
        except Exception as exc:
            raise BrokerUnavailable(describe_error(exc)) from exc
        self.broker_down = None

    def _publish_batch(
        self,
        runs: Sequence[ClaimedRun],
        producer: Any,
        result: DispatchResult,
        fast: FastPublisher | None = None,
    ) -> None:
        """Publish ``runs`` in one pipelined broker write where the transport can (kombu's
        publish batch); they count as published once the write returns. ``fast``: the fast
        path is open for this batch. A message refused on its own (a signature error, a
        negative confirm on a transport that publishes one by one) is recorded and the others
        go on; a failed write raises, leaving the batch's runs unknown, so they stay claimed
        for the outbox."""
        unreachable = connection_errors(producer)
        sent: list[int] = []
        self._closed = "" if fast is not None else self.fast.closed or "the fast path is off"
        self._signalled = fast is not None and receivers.connected()
        with pipelined(producer, len(runs)) as batch:
            # one message goes through kombu with its publish retry, as a batch kombu would
            # not pipeline does; the writer straight to Redis takes the batches kombu pipelines
            writer: Writer = KombuWriter(producer)
            if fast is not None and batch is not None and len(runs) > 1 and self._direct:
                writer = RedisWriter.open(producer, batch) or writer
            for run in runs:
                try:
                    self._publish(run, producer, writer)
                except BatchWriteError:
                    raise  # the batch's write, not this message: nothing of it is known out
                except QueueNotFound as exc:
                    # Routed to a queue missing from task_queues (task_create_missing_queues
                    # off): this message's, tried again with backoff. A KeyError, which
                    # kombu's Redis transport counts among its connection errors.
                    result.refused[run.run_id] = describe_error(exc)
                except unreachable as exc:
                    if not refused(exc):
                        raise
                    result.refused[run.run_id] = describe_error(exc)
                except TypeError as exc:
                    # Celery checks the arguments against the task's signature (a task this
                    # beat registered): no later try can fix the captured ones.
                    result.failed[run.run_id] = (
                        f"the arguments do not fit the task's signature: {exc}"
                    )
                    result.unfit.append(run.run_id)
                except ValueError as exc:
                    if not self._limits_refused(run):
                        result.refused[run.run_id] = describe_error(exc)
                        continue
                    # Celery's apply_async refuses the task's own time limits: so would
                    # every later try.
                    result.failed[run.run_id] = f"Celery refused the message: {exc}"
                except Exception as exc:
                    result.refused[run.run_id] = describe_error(exc)
                else:
                    sent.append(run.run_id)
            writer.flush()  # raises: none of the batch is known to be out
        result.published.extend(sent)

    def _limits_refused(self, run: ClaimedRun) -> bool:
        """Whether Celery's ``apply_async`` refuses ``run``'s task for its time limits (a soft
        time limit above the time limit: ``ValueError``)."""
        task = self.app.tasks.get(run.task_name)
        soft, hard = getattr(task, "soft_time_limit", None), getattr(task, "time_limit", None)
        return bool(soft and hard and soft > hard)

    def _still_owned(self, runs: Sequence[ClaimedRun], result: DispatchResult) -> set[int]:
        """The ids of ``runs`` whose claims their claimer still holds; the others are added
        to ``result.lost`` (with a warning)."""
        owned = self._confirm(runs)
        lost = [r.run_id for r in runs if r.run_id not in owned and r.run_id not in result.lost]
        if lost:
            result.lost.extend(lost)
            logger.warning(
                "%d claimed runs were taken over by another node before this one published "
                "them (it was paused or marked dead); not publishing them",
                len(lost),
                extra={"action": "claim-lost"},
            )
        return owned

    def _confirm(self, runs: Sequence[ClaimedRun]) -> set[int]:
        """The ids of ``runs`` whose claims their claimer still holds."""
        by_claimer: dict[str, list[int]] = {}
        for run in runs:
            by_claimer.setdefault(run.claimed_by, []).append(run.run_id)
        owned: set[int] = set()
        using = self.using
        for claimer, ids in by_claimer.items():
            if select_rows(using, ("node-stopped",), [claimer], partial(_stopped, using, claimer)):
                continue
            # Read by primary key only and compared here: with the status or the claimer in
            # the query, PostgreSQL chose their indexes (a new beat's node id is in no
            # statistics yet, so it looked rare) and read every run this node ever claimed,
            # or every claimed entry left in the outbox index, for each batch.
            where = id_set(ids, using)
            rows = select_rows(
                using, _key("claim-holders", where), _values(where), partial(_holders, using, where)
            )
            owned.update(
                pk for pk, status, by in rows if status == RunStatus.CLAIMED and by == claimer
            )
        return owned

    def route(self, run: ClaimedRun, headers: dict[str, Any]) -> RunMessage | StepAside:
        """How ``run`` goes out, decided once: its fast-path message (with its custom
        ``headers``), or the way it steps aside to Celery's own publishing and why. A
        scheduled run goes through the beat's ``apply_entry`` where code wraps it
        (:attr:`entries`); any run takes ``apply_async`` where the fast path cannot be exact
        for the batch (:meth:`FastPublisher.active`) or for the run's task
        (:meth:`FastPublisher.message`)."""
        if (
            self._entry_tasks is not None
            and run.kind == RunKind.SCHEDULED
            and run.periodic_task_id is not None
        ):
            return StepAside(ENTRY, "code wraps the beat's apply_entry")
        if self._closed:
            return StepAside(CELERY, self._closed)
        found = self.fast.message(run, headers)
        if type(found) is str:
            return StepAside(CELERY, found)
        return cast(RunMessage, found)

    def _publish(self, run: ClaimedRun, producer: Any, writer: Writer) -> None:
        """Publish ``run`` the way :meth:`route` decides. By name, as Celery beat does: a
        task this process has registered gets its own options (``apply_async``), any other
        goes out with ``send_task``; either way the app's routing (``task_routes``)
        applies, and the fast path's message is the one they would send."""
        headers = message_headers(run)
        route = self.route(run, headers)
        fast = self.fast
        if type(route) is RunMessage:
            if route.skeleton.notify_backend:
                self.app.backend.on_task_call(producer, run.celery_task_id)
            if self._signalled:
                fast.direct += receivers.publish(route, writer)
            else:
                fast.direct += writer.write(route)
            fast.published += 1
            return
        aside = cast(StepAside, route)
        fast.declined += 1
        if route_logger.isEnabledFor(logging.DEBUG):
            route_logger.debug(
                "run %s goes out through %s: %s",
                run.run_id,
                aside.way,
                aside.reason,
                extra={"action": "fast-publish-off", "run": run.run_id},
            )
        writer.before_kombu()
        options = {k: v for k, v in run.options.items() if k != "headers"}
        if run.expires_at is not None:
            options["expires"] = run.expires_at
        options["headers"] = headers
        send = partial(self._send, run, producer)
        if aside.way == ENTRY:
            assert self.entries is not None and self._entry_tasks is not None
            task = self._entry_tasks.get(cast(int, run.periodic_task_id))
            self.entries.apply(run, task, options, producer, send)
        else:
            send(options)

    def _send(self, run: ClaimedRun, producer: Any, options: dict[str, Any]) -> Any:
        """Publish ``run`` with ``options`` (its headers among them) through Celery."""
        task = self.app.tasks.get(run.task_name)
        if task is None:
            send = partial(self.app.send_task, run.task_name)
        elif publishes_on_commit(task):
            # Its apply_async would wait for a transaction's commit: a beat publishes now.
            send = partial(Task.apply_async, task)
        else:
            send = task.apply_async
        if run.expires_at is not None:
            producer = _TimeToLive(producer, self.fast.time_to_live(run.expires_at))
        return send(
            args=run.args,
            kwargs=run.kwargs,
            task_id=run.celery_task_id,
            producer=producer,
            **options,
        )

    def _record(self, result: DispatchResult, runs: dict[int, ClaimedRun]) -> None:
        now = self.clock.now()
        table = Run.objects.using(self.using)
        if result.published:
            # A fast worker may have started or even ended the run already (skipped, say):
            # keep its status and what it recorded, stamp the time.
            where = id_set(result.published, self.using)
            update(
                self.using,
                _key("mark-dispatched", where),
                [
                    now,
                    RunStatus.CLAIMED,
                    "",
                    RunStatus.CLAIMED,
                    RunStatus.DISPATCHED,
                    *_values(where),
                ],
                partial(_mark_dispatched, self.using, where, now),
            )
        for run_id, reason in result.refused.items():
            attempts = runs[run_id].dispatch_attempts
            if attempts >= MAX_PUBLISH_ATTEMPTS:
                result.failed[run_id] = f"publishing was refused {attempts} times; last: {reason}"
                continue
            delay = min(timedelta(seconds=2**attempts), MAX_PUBLISH_BACKOFF)
            logger.error(
                "could not publish run %s (attempt %d); trying again in %s: %s",
                run_id,
                attempts,
                delay,
                reason,
                extra={"action": "publish-refused", "run": run_id},
            )
            table.filter(pk=run_id, status=RunStatus.CLAIMED).update(
                retry_at=now + delay, error=f"publish attempt {attempts} refused: {reason}"
            )
        if result.expired:
            table.filter(pk__in=result.expired, status=RunStatus.CLAIMED).update(
                status=RunStatus.EXPIRED,
                finished_at=now,
                error="expired before it could be published",
            )
        for run_id, reason in result.failed.items():
            logger.error(
                "run %s failed before publishing: %s",
                run_id,
                reason,
                extra={"action": "dispatch-failed", "run": run_id},
            )
            table.filter(pk=run_id, status=RunStatus.CLAIMED).update(
                status=RunStatus.FAILED, finished_at=now, error=reason
            )
        if result.unfit:
            self._disable_unfit({runs[r].periodic_task_id for r in result.unfit} - {None})
        metrics.dispatched(result, runs, now)

    def _disable_unfit(self, task_ids: set[int | None]) -> None:
        """Disable each of these periodic tasks whose stored arguments its task, registered in
        this beat's app, cannot take (a row changed behind ``save()``, which checks them), with
        the reason, as the claim disables the other rows it cannot fire: the slot that met them
        failed, and the later ones are not claimed to fail one by one. The row is read again
        under a lock and checked as the admin checks it, so a row corrected meanwhile, or a
        ``TypeError`` of another origin, disables nothing."""
        disabled = False
        table = PeriodicTask.objects.using(self.using)
        for pk in sorted(cast(set[int], task_ids)):
            with transaction.atomic(using=self.using):
                row = (
                    table.select_for_update()
                    .filter(pk=pk, enabled=True)
                    .only("pk", "name", "task", "args", "kwargs")
                    .first()
                )
                if row is None:
                    continue
                problem = argument_problem(self.app, row.task, row.args, row.kwargs)
                if problem is None:
                    continue
                disable_by_id(self.using, pk, problem, name=row.name)
            disabled = True
        if disabled:
            changes.notify()  # the other beats drop what they hold of it


def _stopped(using: str, node_id: str) -> Any:
    from celery_driftsafe.models import BeatNode

    return (
        BeatNode.objects.using(using)
        .filter(node_id=node_id, stopped_at__isnull=False)
        .order_by()
        .values_list("pk")[:1]
    )


def _holders(using: str, ids: Any) -> Any:
    return (
        Run.objects.using(using)
        .filter(pk__in=ids)
        .order_by()
        .values_list("pk", "status", "claimed_by")
    )


def _mark_dispatched(using: str, ids: Any, now: datetime) -> Any:
    # A fast worker may have started or even ended the run already (skipped, say): keep its
    # status and what it recorded, stamp the time.
    claimed = Q(status=RunStatus.CLAIMED)
    return update_query(
        Run.objects.using(using).filter(pk__in=ids, dispatched_at__isnull=True).order_by(),
        dispatched_at=now,
        retry_at=None,
        error=Case(When(claimed, then=Value("")), default=F("error"), output_field=TextField()),
        status=Case(When(claimed, then=Value(RunStatus.DISPATCHED)), default=F("status")),
    )


def _key(name: str, ids: Any) -> str | None:
    """A statement's key (store/statement_cache.py) when :func:`id_set` gave one array: a
    list of ids (other databases) changes the SQL with its length."""
    return None if isinstance(ids, list) else name


def _values(ids: Any) -> list[Any]:
    """The parameters :func:`id_set`'s value compiles to (its one array on PostgreSQL)."""
    return list(getattr(ids, "params", ids))


class _TimeToLive:
    """A producer whose messages live ``seconds`` in the broker (Celery's ``send_task`` counts
    them from ``app.now()``, the wall clock); everything else is the wrapped producer's."""

    def __init__(self, producer: Any, seconds: float) -> None:
        self._producer = producer
        self._seconds = seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def publish(self, body: Any, **kwargs: Any) -> Any:
        if kwargs.get("expiration") is not None:
            kwargs["expiration"] = self._seconds
        return self._producer.publish(body, **kwargs)
