"""A beat's fast publish path: each task's Celery message is built once, each slot fills in
only what varies (see docs/reference/settings.md, "The fast publish path").

Celery's ``apply_async``/``send_task`` spends about 0.2 ms of CPU a message on work whose
result is the same for every slot of a task: the execution options, the routing, the
protocol-2 headers, the argument reprs and the serialised body. :class:`FastPublisher`
builds that part once per task (and again when the task's name, arguments or options
change), step by step as ``Task.apply_async``, ``Celery.send_task``, ``AMQP.as_task_v2`` and
``send_task_message`` do (Celery 5, task protocol 2) with Celery's own functions, and keeps
it as the task's :class:`~celery_driftsafe.publish.message_parts.MessageTemplate`. Per slot,
:meth:`FastPublisher.message` returns the run's
:class:`~celery_driftsafe.publish.message_parts.RunMessage` (the template and the run's task
id, expiry and headers), or why the run must take Celery's own path; the dispatcher hands
the message to the receivers, if any, and to its writer. The message a worker receives is
the one ``apply_async`` would have sent for the same run; ``tests/publish/test_fast_path.py``
compares the two field by field, and ``tests/publish/test_fast_path_equals_celery.py`` holds
both paths equal to what Celery's own beat sends over generated configurations, tasks, rows
and edits, on Redis and RabbitMQ.

Where that cannot be exact the fast path declines, says why, and the dispatcher uses
``apply_async`` (or ``send_task``, for a name the beat has not imported):

- Celery's task protocol 1 (``task_protocol = 1``), or task-sent events
  (``task_send_sent_event``), or ``task_always_eager``;
- receivers connected to the old ``task_sent`` signal (receivers of
  ``before_task_publish``/``after_task_publish``, which Celery sends from
  ``send_task_message`` with the message's parts, are sent by the fast path itself:
  :mod:`celery_driftsafe.publish.receivers`);
- a router function in ``task_routes``: Celery asks it with each message's options (the run's
  headers among them); plain maps and patterns read the task's name alone;
- any of Celery's publishing methods wrapped or replaced (``Celery.send_task``, the app's
  ``send_task_message`` or ``create_task_message``, its router; ``Task.apply_async`` for the
  tasks the beat has registered): a tracing integration's wrapper then runs for every
  message it concerns (:mod:`celery_driftsafe.publish.originals` tells, from the functions' code);
- a publish from inside a running worker task (Celery takes the parent's ids then);
- publish options other than ``queue``, ``exchange``, ``routing_key``, ``priority`` and
  ``headers`` (the dispatcher refuses those before either path:
  :data:`~celery_driftsafe.core.validation.PUBLISH_OPTIONS`), a task class that overrides
  ``apply_async`` or ``shadow_name``, a task whose soft time limit exceeds its time limit
  (``apply_async`` refuses it), a task with an ``expires`` of its own that is not an
  instant, a task whose arguments Celery turns into something else (pydantic), a task whose
  arguments do not fit its signature (Celery's error is recorded by the slow path).

A task's template is used while the run's task name, arguments and options are the ones it
was built from, types and key order included
(:func:`~celery_driftsafe.publish.message_parts.same_value`).
"""

from __future__ import annotations

import sys
from contextlib import suppress
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from celery import Task, signals
from celery.utils.nodenames import anon_nodename
from kombu import serialization
from kombu.compression import compress

from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.instants import iso_text
from celery_driftsafe.core.stored_names import Optimisation
from celery_driftsafe.core.validation import PUBLISH_OPTIONS
from celery_driftsafe.publish.adhoc import publishes_on_commit
from celery_driftsafe.publish.argsrepr import argument_reprs, repr_limits
from celery_driftsafe.publish.message_parts import (
    IMMUTABLE,
    MessageTemplate,
    RunMessage,
    Skeleton,
)
from celery_driftsafe.publish.originals import is_original

if TYPE_CHECKING:
    from collections.abc import Callable

    from celery_driftsafe.claim.outbox import ClaimedRun

#: The publish options of a run that the fast path knows how to handle: every one the
#: publisher's gate lets through (a run's message carries no other).
FAST_OPTIONS = PUBLISH_OPTIONS
#: Tasks whose message parts a publisher keeps (about 0.5 kB each, with the arguments they
#: compare against); a beat with more tasks builds the others' parts each time.
TEMPLATE_CACHE_SIZE = 200_000
#: A placeholder task id, replaced in every message built from a skeleton.
_PLACEHOLDER_ID = "00000000-0000-0000-0000-000000000000"
#: Why a registered task's message takes Celery's path while ``Task.apply_async`` is wrapped.
_APPLY_ASYNC_WRAPPED = "Task.apply_async is wrapped or replaced"


class FastPublisher:
    """Each task's message built once and filled in per run (see the module's docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._templates: dict[int | str, MessageTemplate] = {}
        self._misses_when_full = 0
        #: Messages this path published, and messages left to ``apply_async`` (for figures).
        self.published = 0
        self.declined = 0
        #: Of the published, those written straight to Redis (publish/redis_writer.py).
        self.direct = 0
        self._skeletons: dict[tuple[Any, ...], Skeleton | str] = {}
        self._origin = anon_nodename()
        #: What the app's configuration says, read once a batch (:meth:`active`): the display
        #: forms' bounds.
        self._limits: tuple[int, int, int] | None = None
        #: Whether ``Task.apply_async`` is Celery's own, found once a batch (:meth:`active`):
        #: if not, the messages of registered tasks take it.
        self._apply_async_own = True
        #: How far this process's wall clock is ahead of the time authority (set by the
        #: dispatcher once a batch): a message's time to live counts from the authority's now.
        self.wall_ahead = timedelta(0)
        #: Whether templates hold their task names interned (``OPTIMISATIONS_OFF``
        #: "interned_names"; read once a batch, :meth:`active`).
        self._intern = True
        #: Why the last :meth:`active` found the fast path closed ("" while it is open).
        self.closed = ""

    def time_to_live(self, expires: datetime) -> float:
        """A message's time to live in the broker (its ``expiration``): as ``send_task``
        computes it, the seconds from now to ``expires``, but from the authority's now. A wall
        clock ahead would shorten it (to 0: RabbitMQ then drops a message no consumer takes
        at once), one behind would lengthen it."""
        return max((expires - (datetime.now(UTC) - self.wall_ahead)).total_seconds(), 0)

    def active(self) -> bool:
        """Whether this batch may take the fast path: ``FAST_PUBLISH`` is on and nothing
        about the app or process rules it out (:attr:`closed` says why not)."""
        settings = get_settings()
        if not settings.fast_publish:
            self.closed = "FAST_PUBLISH is off"
            return False
        self._intern = settings.optimised(Optimisation.INTERNED_NAMES)
        self._limits = None
        self._apply_async_own = celerys_apply_async()
        self.closed = self.declines() or ""
        return not self.closed

    def declines(self) -> str | None:
        """Why no message can take the fast path now (None: the fast path may be used).
        Asked once per batch: these conditions concern the app and process, not a run."""
        conf = self.app.conf
        if str(conf.task_protocol) != "2":
            return "task_protocol is not 2"
        if conf.task_send_sent_event:
            return "task_send_sent_event is on"
        if conf.task_always_eager:
            return "task_always_eager is on"
        if signals.task_sent.receivers:
            return "receivers are connected to task_sent"
        if self.app.current_worker_task is not None:
            return "publishing from inside a worker task"
        return celerys_send_path(self.app)

    def message(self, run: ClaimedRun, headers: dict[str, Any]) -> RunMessage | str:
        """``run``'s message (with these custom ``headers``), from its task's template; or,
        where it cannot be exact, why it must take Celery's own path."""
        args, kwargs = run.args, run.kwargs
        template = self._template(
            run.periodic_task_id if run.periodic_task_id is not None else run.task_name,
            run.task_name,
            args,
            kwargs,
            run.options,
            run.expires_at,
            lambda: argument_reprs(self.app, args, kwargs, self.limits()),
        )
        skeleton = template.skeleton
        if skeleton is None:
            return template.declined
        if skeleton.via_apply_async and not self._apply_async_own:
            return _APPLY_ASYNC_WRAPPED
        expires = run.expires_at
        if expires is None:
            return RunMessage(
                template, run.celery_task_id, self.app.thread_oid, None, None, headers
            )
        return RunMessage(
            template,
            run.celery_task_id,
            self.app.thread_oid,
            iso_text(expires),
            self.time_to_live(expires),
            headers,
        )

    def prebuild(
        self,
        cache_key: int | str,
        name: str,
        args: list[Any],
        kwargs: dict[str, Any],
        options: dict[str, Any],
        expires: datetime | None,
    ) -> bool:
        """Build (and keep) the template of a task's message ahead of its run
        (:mod:`celery_driftsafe.publish.prebuild`); whether one was built (False: it was there)."""
        cached = self._templates.get(cache_key)
        template = self._template(
            cache_key,
            name,
            args,
            kwargs,
            options,
            expires,
            lambda: argument_reprs(self.app, args, kwargs, self.limits()),
        )
        return template is not cached

    def has_template(self, cache_key: int | str) -> bool:
        """Whether a template is kept for ``cache_key`` (it may not match the task's current
        arguments: publishing checks that)."""
        return cache_key in self._templates

    def limits(self) -> tuple[int, int, int]:
        """The app's display form bounds (:func:`~celery_driftsafe.publish.argsrepr.repr_limits`),
        read once a batch."""
        if self._limits is None:
            self._limits = repr_limits(self.app)
        return self._limits

    def _template(
        self,
        cache_key: int | str,
        name: str,
        args: list[Any],
        kwargs: dict[str, Any],
        options: dict[str, Any],
        expires: datetime | None,
        reprs: Callable[[], tuple[str, str]],
    ) -> MessageTemplate:
        """The task's template, built on first use and again when its name, arguments or
        options change (one without a skeleton, also kept: the task's messages take the
        slow path). It refers to the run's own argument objects: no copies."""
        cached = self._templates.get(cache_key)
        if cached is not None and cached.matches(name, args, kwargs, options, expires is not None):
            return cached
        template = self._build(name, args, kwargs, options, expires, reprs)
        if cached is not None or len(self._templates) < TEMPLATE_CACHE_SIZE:
            self._templates[cache_key] = template
        else:
            # Full (more tasks than the bound): keep what is there, so that a beat that sees
            # its tasks in turn still finds that many; after a full cache's worth of misses
            # start afresh (the cache may hold tasks that were deleted).
            self._misses_when_full += 1
            if self._misses_when_full >= TEMPLATE_CACHE_SIZE:
                self._templates.clear()
                self._misses_when_full = 0
        return template

    def _build(
        self,
        name: str,
        args: list[Any],
        kwargs: dict[str, Any],
        options: dict[str, Any],
        expires: datetime | None,
        reprs: Callable[[], tuple[str, str]],
    ) -> MessageTemplate:
        """The parts of the message ``apply_async``/``send_task`` would build for this task,
        arguments and options that its :class:`Skeleton` does not hold; without a skeleton
        (and with the reason) when the fast path cannot reproduce the message."""
        skeleton = self._skeleton(name, args, kwargs, options, expires)
        if isinstance(skeleton, str):
            return MessageTemplate(
                name, args, kwargs, options, expires is not None, None, declined=skeleton
            )
        if skeleton.check_arguments is not None:
            try:
                skeleton.check_arguments(*args, **kwargs)
            except TypeError:  # the slow path records Celery's own error
                return MessageTemplate(
                    name,
                    args,
                    kwargs,
                    options,
                    expires is not None,
                    None,
                    declined="the arguments do not fit the task's signature",
                )
        argsrepr, kwargsrepr = reprs()
        # as AMQP.as_task_v2 has it: no arguments are an empty tuple
        body = (args or (), kwargs or {}, skeleton.embed)
        content_type, content_encoding, payload = serialization.dumps(
            body, serializer=skeleton.serializer
        )
        compressed: str | None = None
        if skeleton.compression:
            raw = payload.encode(content_encoding) if isinstance(payload, str) else payload
            payload, compressed = compress(raw, skeleton.compression)
        elif isinstance(payload, str):
            # What kombu's Producer does with a str body that has a content type.
            payload = payload.encode(content_encoding or "utf-8")
        return MessageTemplate(
            sys.intern(name) if self._intern else name,
            shared_value(args),
            shared_value(kwargs),
            shared_value(options),
            expires is not None,
            skeleton,
            payload,
            content_type,
            content_encoding,
            compressed,
            short_form(argsrepr),
            short_form(kwargsrepr),
        )

    def _skeleton(
        self,
        name: str,
        args: list[Any],
        kwargs: dict[str, Any],
        options: dict[str, Any],
        expires: datetime | None,
    ) -> Skeleton | str:
        """What the messages of every task of this name and options share, whatever their
        arguments (routes are plain maps: :meth:`declines`), shared by those tasks; or why
        the fast path cannot reproduce them."""
        if not FAST_OPTIONS.issuperset(options):
            return f"publish options other than {sorted(FAST_OPTIONS)}"
        opts: dict[str, Any] = {k: v for k, v in options.items() if k != "headers"}
        # with the values' types: a priority True is not a priority 1 to Celery's JSON
        key = (name, frozenset((k, type(v), v) for k, v in opts.items()), expires is not None)
        if key in self._skeletons:
            return self._skeletons[key]
        skeleton = build_skeleton(self.app, self._origin, name, args, kwargs, opts, expires)
        if len(self._skeletons) >= TEMPLATE_CACHE_SIZE:
            self._skeletons.clear()
        self._skeletons[key] = skeleton
        return skeleton


def build_skeleton(
    app: Any,
    origin: str,
    name: str,
    args: list[Any],
    kwargs: dict[str, Any],
    opts: dict[str, Any],
    expires: datetime | None,
) -> Skeleton | str:
    """The skeleton of the messages of task ``name`` with the publish options ``opts``
    (consumed), or why the fast path cannot reproduce Celery's message. ``args`` and
    ``kwargs`` are one task's, for the router; ``origin`` is the ``origin`` header."""
    amqp = app.amqp
    task = app.tasks.get(name)
    if expires is not None:
        opts["expires"] = expires
    check_arguments = None
    if task is not None:
        # Task.apply_async (the dispatcher calls Task.apply_async for a DriftSafeTask)
        if not _celerys_apply_async(task):
            return "the task's apply_async or shadow_name is not Celery's own"
        if getattr(task, "_dump_pydantic_arguments", None) is not None:
            return "Celery turns the task's arguments into something else (pydantic)"
        if task.soft_time_limit and task.time_limit and task.soft_time_limit > task.time_limit:
            # apply_async refuses it (ValueError): the slow path records why
            return "the task's soft time limit exceeds its time limit"
        if task.typing:
            check_arguments = getattr(task, "__header__", None)
        opts = dict(task._get_exec_options(), **opts)
        opts.setdefault("ignore_result", task.ignore_result)
    # send_task
    time_limit = opts.pop("time_limit", None)
    soft_time_limit = opts.pop("soft_time_limit", None)
    task_expires = opts.pop("expires", None)
    if task_expires is not None and task_expires is not expires:
        return "the task has an expiry of its own, relative to the moment of publishing"
    ignore_result = opts.pop("ignore_result", None)
    opts = amqp.router.route(opts, name, args, kwargs, task)
    if not isinstance(opts, dict) or opts.get("eta") or opts.get("countdown"):
        return "the route sets an eta or a countdown"
    if expires is not None:
        opts["expiration"] = 0.0  # replaced per message
    opts["argsrepr"], opts["kwargsrepr"] = "", ""  # replaced per task
    headers, properties, body, _sent_event = amqp.as_task_v2(
        _PLACEHOLDER_ID,
        name,
        args,
        kwargs,
        None,
        None,
        None,
        None,
        expires,
        0,
        None,
        None,
        None,
        app.thread_oid,
        time_limit,
        soft_time_limit,
        False,
        None,
        None,
        None,
        None,
        ignore_result=ignore_result,
        replaced_task_nesting=0,
        origin=origin,
        **opts,
    )
    for stamp in opts.pop("stamped_headers", None) or ():
        opts.pop(stamp, None)
    # The placeholders' only place is the headers: Celery's beat passes no display forms to
    # apply_async, so its messages carry none among their properties.
    del opts["argsrepr"], opts["kwargsrepr"]
    publish = _publish_arguments(app, opts, properties)
    if publish is None:
        return "the route sets headers of its own"
    publish_kwargs, declare, serializer, compression = publish
    for per_message in ("correlation_id", "reply_to", "expiration"):
        properties.pop(per_message, None)
    return Skeleton(
        headers=headers,
        properties=properties,
        embed=body[2],
        serializer=serializer,
        compression=compression,
        publish_kwargs=publish_kwargs,
        declare=tuple(declare) if declare is not None else None,
        declare_idents=_declare_idents(declare),
        mutable_headers=_mutable(headers),
        mutable_properties=_mutable(properties),
        check_arguments=check_arguments,
        notify_backend=(
            not ignore_result
            and not is_original(
                app.backend.on_task_call, "celery.backends.base", "Backend.on_task_call"
            )
        ),
        via_apply_async=task is not None,
    )


def _publish_arguments(
    app: Any, options: dict[str, Any], properties: dict[str, Any]
) -> tuple[dict[str, Any], list[Any] | None, str, str | None] | None:
    """``Producer.publish``'s arguments as Celery's ``send_task_message`` computes them
    from the routed options (``properties`` takes the options it does not know)."""
    from kombu.common import Broadcast

    amqp = app.amqp
    conf = app.conf
    opts = dict(options)
    exchange = opts.pop("exchange", None)
    routing_key = opts.pop("routing_key", None)
    queue = opts.pop("queue", None)
    opts.pop("event_dispatcher", None)
    retry = opts.pop("retry", None)
    retry_policy = opts.pop("retry_policy", None)
    serializer = opts.pop("serializer", None)
    delivery_mode = opts.pop("delivery_mode", None)
    compression = opts.pop("compression", None)
    declare = opts.pop("declare", None)
    if opts.pop("headers", None):
        return None  # the run's headers are added per message
    exchange_type = opts.pop("exchange_type", None)
    timeout = opts.pop("timeout", None)
    confirm_timeout = opts.pop("confirm_timeout", None)
    properties.update(opts)

    qname = queue
    if queue is None and exchange is None:
        queue = amqp.default_queue
    if queue is not None:
        if isinstance(queue, str):
            qname, queue = queue, amqp.queues[queue]
        else:
            qname = queue.name
    if delivery_mode is None:
        with suppress(AttributeError):
            delivery_mode = queue.exchange.delivery_mode
        delivery_mode = delivery_mode or conf.task_default_delivery_mode
    if exchange_type is None:
        try:
            exchange_type = queue.exchange.type
        except AttributeError:
            exchange_type = "direct"
    if (not exchange or not routing_key) and exchange_type == "direct":
        exchange, routing_key = "", qname
    elif exchange is None:
        exchange = queue.exchange.name or amqp.default_exchange
        routing_key = routing_key or queue.routing_key or conf.task_default_routing_key
    if declare is None and queue and not isinstance(queue, Broadcast):
        declare = [queue]
    default_policy = conf.task_publish_retry_policy
    retry = conf.task_publish_retry if retry is None else retry
    policy = dict(default_policy, **retry_policy) if retry_policy else dict(default_policy)
    publish_kwargs = {
        "exchange": exchange,
        "routing_key": routing_key,
        "retry": retry,
        "retry_policy": policy,
        "delivery_mode": delivery_mode,
        "timeout": timeout,
        "confirm_timeout": confirm_timeout,
    }
    return (
        publish_kwargs,
        declare,
        serializer or conf.task_serializer,
        compression or conf.task_compression,
    )


def celerys_send_path(app: Any) -> str | None:
    """What of Celery's ``send_task`` path of ``app`` the fast path cannot reproduce, or None:
    a method wrapped or replaced (``Celery.send_task``, the protocol's message builder, the
    app's ``send_task_message``, the router's ``route``), or a router function in
    ``task_routes`` (Celery passes it each message's options, its headers among them: only
    plain maps and patterns, which read the task's name alone, give one answer a task)."""
    from celery.app.routes import MapRoute

    amqp = app.amqp
    if not is_original(app.send_task, "celery.app.base", "Celery.send_task"):
        return "Celery.send_task is wrapped or replaced"
    if not is_original(amqp.create_task_message, "celery.app.amqp", "AMQP.as_task_v2"):
        return "the app's create_task_message is not Celery's as_task_v2"
    if not is_original(amqp.send_task_message, "celery.app.amqp", _SEND_TASK_MESSAGE):
        return "the app's send_task_message is wrapped or replaced"
    router = amqp.router
    if not is_original(router.route, "celery.app.routes", "Router.route"):
        return "the app's router is not Celery's"
    if not all(type(route) is MapRoute for route in router.routes):
        return "task_routes has a router function"
    return None


#: The function ``AMQP.send_task_message`` is (made by ``_create_task_sender``).
_SEND_TASK_MESSAGE = "AMQP._create_task_sender.<locals>.send_task_message"


def celerys_apply_async() -> bool:
    """Whether ``Task.apply_async`` is Celery's own (a tracing integration may have wrapped
    it on the class)."""
    return is_original(Task.apply_async, "celery.app.task", "Task.apply_async")


def _celerys_apply_async(task: Any) -> bool:
    """Whether publishing ``task`` goes through Celery's own ``Task.apply_async`` and
    ``shadow_name`` (a task class of the project's may override them to do more)."""
    apply_async = Task.apply_async if publishes_on_commit(task) else task.apply_async
    return is_original(apply_async, "celery.app.task", "Task.apply_async") and is_original(
        task.shadow_name, "celery.app.task", "Task.shadow_name"
    )


def _declare_idents(declare: list[Any] | None) -> frozenset[int] | None:
    if not declare or not all(getattr(e, "can_cache_declaration", False) for e in declare):
        return None
    return frozenset(hash(entity) for entity in declare)


def _mutable(parts: dict[str, Any]) -> tuple[str, ...]:
    """The names of ``parts`` whose values could be changed in place (a list, a dict, a
    tuple holding one)."""
    return tuple(name for name, value in parts.items() if not _immutable(value))


def _immutable(value: Any) -> bool:
    if type(value) in IMMUTABLE:
        return True
    return type(value) is tuple and all(map(_immutable, value))


#: Stand-ins for empty arguments and options: a template compares against them, never
#: changes them, and a hundred thousand tasks then share one.
_EMPTY_LIST: list[Any] = []
_EMPTY_DICT: dict[str, Any] = {}


def shared_value(value: Any) -> Any:
    """``value``, or the one shared empty list or dict it equals (memory per task)."""
    if not value:
        if type(value) is list:
            return _EMPTY_LIST
        if type(value) is dict:
            return _EMPTY_DICT
    return value


def short_form(text: str) -> str:
    """The display forms of no arguments (``[]``, ``{}``): one shared string each."""
    return _EMPTY_FORMS.get(text, text)


_EMPTY_FORMS = {"[]": "[]", "{}": "{}", "()": "()"}
