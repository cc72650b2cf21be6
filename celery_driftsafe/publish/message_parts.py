"""What every Celery message of one task name and publish options shares, computed once with
Celery's own functions, step by step as ``Task.apply_async``, ``Celery.send_task``,
``AMQP.as_task_v2`` and ``send_task_message`` do (Celery 5, task protocol 2); used by
:mod:`celery_driftsafe.publish.fast_path`."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from celery import Task

from celery_driftsafe.publish.adhoc import publishes_on_commit
from celery_driftsafe.publish.originals import is_original

#: A placeholder task id, replaced in every message built from a skeleton.
_PLACEHOLDER_ID = "00000000-0000-0000-0000-000000000000"


@dataclass(frozen=True, slots=True, eq=False)
class Skeleton:
    """What the messages of every task with one name and publish options share, whatever
    their arguments (routing, the task's own options, headers but the argument reprs).
    Compared and hashed as an object (a cache keyed by a skeleton holds it: no other can
    take its place)."""

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
    #: Whether Celery publishes these messages through ``Task.apply_async`` (a registered
    #: task), which the fast path reproduces only while it is Celery's own.
    via_apply_async: bool
    #: The Redis envelopes' shapes (:mod:`celery_driftsafe.publish.envelope_text`), made by the
    #: Redis writer on first use and kept here by the fast path.
    envelopes: dict[tuple[Any, ...], Any] = field(default_factory=dict, compare=False, repr=False)

    def to_declare(self, producer: Any) -> list[Any] | None:
        """The entities kombu must declare before a message: none when the producer's
        connection has declared them all already (what kombu's ``maybe_declare`` finds out
        itself, after binding a copy of each entity to the channel: a third of a publish)."""
        if self.declare is None:
            return None
        if self.declare_idents is not None:
            declared = getattr(producer.connection, "declared_entities", None)
            if declared is not None and all(i in declared for i in self.declare_idents):
                return None
        return list(self.declare)


def build_skeleton(
    app: Any,
    origin: str,
    name: str,
    args: list[Any],
    kwargs: dict[str, Any],
    opts: dict[str, Any],
    expires: datetime | None,
) -> Skeleton | None:
    """The skeleton of the messages of task ``name`` with the publish options ``opts``
    (consumed), or None where the fast path cannot reproduce Celery's message. ``args`` and
    ``kwargs`` are one task's, for the router; ``origin`` is the ``origin`` header."""
    amqp = app.amqp
    task = app.tasks.get(name)
    if expires is not None:
        opts["expires"] = expires
    check_arguments = None
    if task is not None:
        # Task.apply_async (the dispatcher calls Task.apply_async for a DriftSafeTask)
        if not _celerys_apply_async(task):
            return None
        if getattr(task, "_dump_pydantic_arguments", None) is not None:
            return None
        if task.soft_time_limit and task.time_limit and task.soft_time_limit > task.time_limit:
            return None  # apply_async refuses it (ValueError): the slow path records why
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
        return None
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


def _declare_idents(declare: list[Any] | None) -> tuple[int, ...] | None:
    if not declare or not all(getattr(e, "can_cache_declaration", False) for e in declare):
        return None
    return tuple(hash(entity) for entity in declare)


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

    def matches(
        self,
        name: str,
        args: list[Any],
        kwargs: dict[str, Any],
        options: dict[str, Any],
        has_expiry: bool,
    ) -> bool:
        return (
            self.name == name
            and same_value(self.args, args)
            and same_value(self.kwargs, kwargs)
            and same_value(self.options, options)
            and self.has_expiry == has_expiry
        )

    def run_parts(
        self,
        task_id: str,
        reply_to: str,
        expires: str | None,
        expiration: float | None,
        headers: dict[str, Any],
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """A run's message headers and properties (new dicts), from this template:
        ``expires`` is the expiry (ISO 8601), ``expiration`` the seconds left until it,
        ``headers`` the run's custom headers."""
        skeleton = self.skeleton
        assert skeleton is not None
        message_headers = skeleton.headers.copy()
        message_headers["id"] = message_headers["root_id"] = task_id
        message_headers["argsrepr"] = self.argsrepr
        message_headers["kwargsrepr"] = self.kwargsrepr
        properties = skeleton.properties.copy()
        properties["correlation_id"] = task_id
        properties["reply_to"] = reply_to
        if expires is not None:
            message_headers["expires"] = expires
            properties["expiration"] = expiration
        message_headers.update(headers)
        if self.compression is not None:
            message_headers["compression"] = self.compression
        return message_headers, properties


def same_value(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` make the same message: equal, and of the same types throughout,
    their keys in the same order (``1``, ``True`` and ``1.0`` are equal, but Celery's JSON
    writes ``1``, ``true`` and ``1.0``; ``0.0`` and ``-0.0`` too; a dict's keys are written in
    their order, and its display form too). Equality is checked first, in C: then only the
    types and orders are left to compare."""
    if a is b:
        return True
    kind = type(a)
    return kind is type(b) and a == b and _same_equal(kind, a, b)


def _same_equal(kind: type, a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b``, equal and both of type ``kind``, are the same value."""
    if kind in _EXACT:
        return True
    if kind is list or kind is tuple:
        return all(map(_same_equal_item, a, b))  # equal lists: their items pairwise equal
    if kind is dict:
        # equal dicts, their keys in the same order: items pairwise equal
        return (
            all(map(operator.eq, a, b))
            and all(map(_same_equal_item, a, b))
            and all(map(_same_equal_item, a.values(), b.values()))
        )
    if kind is float:
        return a != 0.0 or math.copysign(1.0, a) == math.copysign(1.0, b)
    return True


def _same_equal_item(a: Any, b: Any) -> bool:
    kind = type(a)
    return kind is type(b) and (kind in _EXACT or _same_equal(kind, a, b))


#: Types whose equal values of the same type are the same value (the same JSON, the same repr).
_EXACT = frozenset({str, int, bool, type(None)})


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
