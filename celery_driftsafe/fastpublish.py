"""A beat's fast publish path: each task's Celery message is built once, each slot fills in
only what varies (see docs/explanation/performance.md, "the fast publish path").

Celery's ``apply_async``/``send_task`` spends about 0.2 ms of CPU a message on work whose
result is the same for every slot of a task: the execution options, the routing, the
protocol-2 headers, the argument reprs and the serialised body. :class:`FastPublisher`
builds that part once per task (and again when the task's name, arguments or options
change), with Celery's own functions, and per slot copies it and sets the task id, the root
id, the expiry and the run's headers, then hands the serialised body to kombu's
``Producer.publish`` (which does not serialise a body that comes with its content type).
The message a worker receives is the one ``apply_async`` would have sent for the same run;
``tests/test_fastpublish.py`` compares the two field by field.

Where that cannot be exact the fast path declines and the dispatcher uses ``apply_async``:

- Celery's task protocol 1 (``task_protocol = 1``), or task-sent events
  (``task_send_sent_event``), or ``task_always_eager``;
- receivers connected to ``before_task_publish``/``after_task_publish`` (or the old
  ``task_sent``): Celery sends those signals from ``send_task``, with the message's parts, and
  a receiver may change the message; with receivers, every message takes Celery's path;
- a publish from inside a running worker task (Celery takes the parent's ids then);
- publish options other than ``queue``, ``exchange``, ``routing_key``, ``priority`` and
  ``headers`` (a run's captured options), a task class that overrides ``shadow_name``, a task
  with an ``expires`` of its own that is not an instant, a task whose arguments Celery turns
  into something else (pydantic), a task whose arguments do not fit its signature (Celery's
  error is recorded by the slow path).

Routers (``task_routes``) are asked once per task and arguments, when the message is built:
a router whose answer for the same task and arguments changes from call to call needs
``FAST_PUBLISH = False``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from celery import Task, signals
from celery.app.routes import MapRoute
from celery.backends.base import Backend
from celery.utils.nodenames import anon_nodename
from celery.utils.saferepr import saferepr
from celery.utils.time import subtract_datetimes
from kombu import serialization
from kombu.compression import compress

#: The publish options of a run that the fast path knows how to handle.
FAST_OPTIONS = frozenset({"queue", "exchange", "routing_key", "priority", "headers"})
#: Tasks whose message parts a publisher keeps (about 0.8 kB each with the argument objects
#: they refer to); a beat with more tasks builds the others' parts each time.
TEMPLATE_CACHE_SIZE = 200_000
#: A placeholder task id, replaced in every message built from a template.
_PLACEHOLDER_ID = "00000000-0000-0000-0000-000000000000"


@dataclass(frozen=True, slots=True)
class MessageTemplate:
    """One task's message parts (the rest is its :class:`Skeleton`'s), and what they were
    built from: kept per task, so small (a few hundred bytes)."""

    name: str
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    has_expiry: bool
    #: None: this task's messages cannot take the fast path.
    skeleton: Skeleton | None
    body: bytes = b""
    content_type: str = ""
    content_encoding: str = ""
    #: kombu's ``compression`` header value when the body is compressed, else None.
    compression: str | None = None
    argsrepr: str = ""
    kwargsrepr: str = ""

    def matches(self, name: str, args: list[Any], kwargs: dict[str, Any],
                options: dict[str, Any], has_expiry: bool) -> bool:
        return (self.name == name and self.args == args and self.kwargs == kwargs
                and self.options == options and self.has_expiry == has_expiry)


@dataclass(frozen=True, slots=True)
class Skeleton:
    """What the messages of every task with one name and publish options share, whatever
    their arguments (routing, the task's own options, headers but the argument reprs)."""

    headers: dict[str, Any]
    properties: dict[str, Any]
    #: The body's third part (callbacks, errbacks, chain, chord: none for a beat).
    embed: dict[str, Any]
    serializer: str
    compression: str | None
    publish_kwargs: dict[str, Any]
    declare: tuple[Any, ...] | None
    declare_idents: tuple[int, ...] | None
    #: The task's signature check (Celery's ``typing``), run on each task's arguments.
    check_arguments: Callable[..., Any] | None
    notify_backend: bool


class FastPublisher:
    """Publishes runs with per-task prebuilt Celery messages (see the module's docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._templates: dict[int | str, MessageTemplate] = {}
        self._misses_when_full = 0
        self._skeletons: dict[tuple[Any, ...], Skeleton | None] = {}
        self._origin = anon_nodename()

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
        if (signals.before_task_publish.receivers or signals.after_task_publish.receivers
                or signals.task_sent.receivers):
            return "receivers are connected to before/after_task_publish"
        if self.app.current_worker_task is not None:
            return "publishing from inside a worker task"
        return None

    def publish(
        self, producer: Any, *, cache_key: int | str, name: str, args: list[Any],
        kwargs: dict[str, Any], options: dict[str, Any], task_id: str,
        headers: dict[str, Any], expires: datetime | None,
        reprs: Callable[[], tuple[str, str]],
    ) -> bool:
        """Publish one run's message through ``producer``; False (nothing published) when
        this message cannot take the fast path. ``options`` are the run's publish options
        (their ``headers`` are ignored: ``headers`` are the custom headers the message
        carries)."""
        template = self._template(cache_key, name, args, kwargs, options, expires, reprs)
        skeleton = template.skeleton
        if skeleton is None:
            return False
        app = self.app
        message_headers = skeleton.headers.copy()
        message_headers["id"] = message_headers["root_id"] = task_id
        message_headers["argsrepr"] = template.argsrepr
        message_headers["kwargsrepr"] = template.kwargsrepr
        properties = skeleton.properties.copy()
        properties["correlation_id"] = task_id
        properties["reply_to"] = app.thread_oid
        properties["argsrepr"] = template.argsrepr
        properties["kwargsrepr"] = template.kwargsrepr
        if expires is not None:
            message_headers["expires"] = expires.isoformat()
            seconds = subtract_datetimes(expires, app.now()).total_seconds()
            properties["expiration"] = max(seconds, 0)
        message_headers.update(headers)
        if template.compression is not None:
            message_headers["compression"] = template.compression
        if skeleton.notify_backend:
            app.backend.on_task_call(producer, task_id)
        producer.publish(
            template.body, content_type=template.content_type,
            content_encoding=template.content_encoding, headers=message_headers,
            declare=_to_declare(producer, skeleton), **skeleton.publish_kwargs, **properties,
        )
        return True

    def _template(
        self, cache_key: int | str, name: str, args: list[Any], kwargs: dict[str, Any],
        options: dict[str, Any], expires: datetime | None,
        reprs: Callable[[], tuple[str, str]],
    ) -> MessageTemplate:
        """The task's template, built on first use and again when its name, arguments or
        options change (one without a skeleton, also kept: the task's messages take the
        slow path). It refers to the run's own argument objects: no copies."""
        cached = self._templates.get(cache_key)
        if cached is not None and cached.matches(name, args, kwargs, options,
                                                 expires is not None):
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
        self, name: str, args: list[Any], kwargs: dict[str, Any], options: dict[str, Any],
        expires: datetime | None, reprs: Callable[[], tuple[str, str]],
    ) -> MessageTemplate:
        """The parts of the message ``apply_async``/``send_task`` would build for this task,
        arguments and options that its :class:`Skeleton` does not hold; without a skeleton
        when the fast path cannot reproduce the message."""
        declined = MessageTemplate(name, args, kwargs, options, expires is not None, None)
        skeleton = self._skeleton(name, args, kwargs, options, expires)
        if skeleton is None:
            return declined
        if skeleton.check_arguments is not None:
            try:
                skeleton.check_arguments(*args, **kwargs)
            except TypeError:
                return declined  # the slow path records Celery's own error
        argsrepr, kwargsrepr = reprs()
        # as AMQP.as_task_v2 has it: no arguments are an empty tuple
        body = (args or (), kwargs or {}, skeleton.embed)
        content_type, content_encoding, payload = serialization.dumps(
            body, serializer=skeleton.serializer)
        compressed: str | None = None
        if skeleton.compression:
            raw = payload.encode(content_encoding) if isinstance(payload, str) else payload
            payload, compressed = compress(raw, skeleton.compression)
        elif isinstance(payload, str):
            # What kombu's Producer does with a str body that has a content type.
            payload = payload.encode(content_encoding or "utf-8")
        return MessageTemplate(
            name, args, kwargs, options, expires is not None, skeleton, payload, content_type,
            content_encoding, compressed, argsrepr, kwargsrepr,
        )

    def _skeleton(
        self, name: str, args: list[Any], kwargs: dict[str, Any], options: dict[str, Any],
        expires: datetime | None,
    ) -> Skeleton | None:
        """What the messages of every task of this name and options share, whatever their
        arguments; shared by those tasks when the routing does not depend on arguments
        (no router functions in ``task_routes``)."""
        if not FAST_OPTIONS.issuperset(options):
            return None
        opts: dict[str, Any] = {k: v for k, v in options.items() if k != "headers"}
        router = self.app.amqp.router
        shared = all(isinstance(route, MapRoute) for route in router.routes)
        key = (name, frozenset(opts.items()), expires is not None) if shared else None
        if key is not None and key in self._skeletons:
            return self._skeletons[key]
        skeleton = self._new_skeleton(name, args, kwargs, opts, expires)
        if key is not None:
            if len(self._skeletons) >= TEMPLATE_CACHE_SIZE:
                self._skeletons.clear()
            self._skeletons[key] = skeleton
        return skeleton

    def _new_skeleton(
        self, name: str, args: list[Any], kwargs: dict[str, Any], opts: dict[str, Any],
        expires: datetime | None,
    ) -> Skeleton | None:
        """Follows Celery 5's ``Task.apply_async``, ``send_task``, ``AMQP.as_task_v2`` and
        ``send_task_message`` step by step."""
        app = self.app
        amqp = app.amqp
        task = app.tasks.get(name)
        if expires is not None:
            opts["expires"] = expires
        check_arguments = None
        if task is not None:
            # Task.apply_async (the dispatcher calls Task.apply_async for a DriftSafeTask)
            if not _plain_apply_async(task) or type(task).shadow_name is not Task.shadow_name:
                return None
            if getattr(task, "_dump_pydantic_arguments", None) is not None:
                return None
            if task.typing:
                check_arguments = getattr(task, "__header__", None)
            opts = dict(task._get_exec_options(), **opts)
            opts.setdefault("ignore_result", task.ignore_result)
        # send_task
        time_limit = opts.pop("time_limit", None)
        soft_time_limit = opts.pop("soft_time_limit", None)
        task_expires = opts.pop("expires", None)
        if task_expires is not None and task_expires is not expires:
            return None  # an expiry relative to the moment of publishing: per message
        ignore_result = opts.pop("ignore_result", None)
        opts = amqp.router.route(opts, name, args, kwargs, task)
        if not isinstance(opts, dict) or opts.get("eta") or opts.get("countdown"):
            return None
        if expires is not None:
            opts["expiration"] = 0.0  # replaced per message
        opts["argsrepr"], opts["kwargsrepr"] = "", ""  # replaced per task
        headers, properties, body, _sent_event = amqp.as_task_v2(
            _PLACEHOLDER_ID, name, args, kwargs, None, None, None, None,
            expires, 0, None, None, None, app.thread_oid, time_limit, soft_time_limit,
            False, None, None, None, None, ignore_result=ignore_result,
            replaced_task_nesting=0, origin=self._origin, **opts,
        )
        for stamp in opts.pop("stamped_headers", None) or ():
            opts.pop(stamp, None)
        publish = self._publish_arguments(name, opts, properties)
        if publish is None:
            return None
        publish_kwargs, declare, serializer, compression = publish
        backend = app.backend
        for per_message in ("correlation_id", "reply_to", "expiration"):
            properties.pop(per_message, None)
        return Skeleton(
            headers=headers, properties=properties, embed=body[2], serializer=serializer,
            compression=compression, publish_kwargs=publish_kwargs,
            declare=tuple(declare) if declare is not None else None,
            declare_idents=_declare_idents(declare), check_arguments=check_arguments,
            notify_backend=(not ignore_result
                            and type(backend).on_task_call is not Backend.on_task_call),
        )

    def _publish_arguments(
        self, name: str, options: dict[str, Any], properties: dict[str, Any]
    ) -> tuple[dict[str, Any], list[Any] | None, str, str | None] | None:
        """``Producer.publish``'s arguments as Celery's ``send_task_message`` computes them
        from the routed options (``properties`` takes the options it does not know)."""
        from kombu.common import Broadcast

        amqp = self.app.amqp
        conf = self.app.conf
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
            "exchange": exchange, "routing_key": routing_key, "retry": retry,
            "retry_policy": policy, "delivery_mode": delivery_mode,
            "timeout": timeout, "confirm_timeout": confirm_timeout,
        }
        return (publish_kwargs, declare, serializer or conf.task_serializer,
                compression or conf.task_compression)


def _plain_apply_async(task: Any) -> bool:
    """Whether publishing ``task`` goes through Celery's own ``Task.apply_async`` (a task
    class of the project's may override it to do more)."""
    from celery_driftsafe.task import DriftSafeTask

    return isinstance(task, DriftSafeTask) or type(task).apply_async is Task.apply_async


def display_form(value: Any, maxsize: int, maxlevels: int) -> str:
    """Celery's display form of task arguments (``saferepr``, for ``argsrepr`` and
    ``kwargsrepr``), with a shortcut: for plain values (numbers, booleans, None, strings of
    printable characters without quotes or backslashes, in lists and string-keyed dicts at
    most two deep) whose ``repr`` fits, the two are the same string, and ``repr`` costs a
    tenth."""
    if maxlevels >= 3 and _plain(value, 0):
        text = repr(value)
        if len(text) < maxsize:
            return text
    return str(saferepr(value, maxsize, maxlevels=maxlevels))


_PLAIN_SCALARS = (int, float, bool, type(None))


def _plain(value: Any, depth: int) -> bool:
    kind = type(value)
    if kind is str:
        return (value.isprintable() and "'" not in value and '"' not in value
                and "\\" not in value)
    if kind in _PLAIN_SCALARS:
        return True
    if depth >= 2:
        return False
    if kind is list:
        return all(_plain(item, depth + 1) for item in value)
    if kind is dict:
        return all(type(key) is str and _plain(key, depth + 1) and _plain(item, depth + 1)
                   for key, item in value.items())
    return False


def _declare_idents(declare: list[Any] | None) -> tuple[int, ...] | None:
    if not declare or not all(getattr(e, "can_cache_declaration", False) for e in declare):
        return None
    return tuple(hash(entity) for entity in declare)


def _to_declare(producer: Any, template: Skeleton) -> list[Any] | None:
    """The entities kombu must declare before this message: none when the connection has
    declared them all already (what kombu's ``maybe_declare`` finds out itself, after
    binding a copy of each entity to the channel: a third of a publish's time)."""
    if template.declare is None:
        return None
    if template.declare_idents is not None:
        declared = getattr(producer.connection, "declared_entities", None)
        if declared is not None and all(i in declared for i in template.declare_idents):
            return None
    return list(template.declare)
