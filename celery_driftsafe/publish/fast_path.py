"""A beat's fast publish path: each task's Celery message is built once, each slot fills in
only what varies (see docs/reference/settings.md, "The fast publish path").

Celery's ``apply_async``/``send_task`` spends about 0.2 ms of CPU a message on work whose
result is the same for every slot of a task: the execution options, the routing, the
protocol-2 headers, the argument reprs and the serialised body. :class:`FastPublisher`
builds that part once per task (and again when the task's name, arguments or options
change), with Celery's own functions, and per slot copies it and sets the task id, the root
id, the expiry and the run's headers, then hands the serialised body to kombu's
``Producer.publish`` (which does not serialise a body that comes with its content type).
The message a worker receives is the one ``apply_async`` would have sent for the same run;
``tests/publish/test_fast_path.py`` compares the two field by field, and
``tests/publish/test_fast_path_equals_celery.py`` holds both paths equal to what Celery's own beat
sends over generated configurations, tasks, rows and edits, on Redis and RabbitMQ.

Where that cannot be exact the fast path declines and the dispatcher uses ``apply_async``
(or ``send_task``, for a name the beat has not imported):

- Celery's task protocol 1 (``task_protocol = 1``), or task-sent events
  (``task_send_sent_event``), or ``task_always_eager``;
- receivers connected to the old ``task_sent`` signal (with receivers of
  ``before_task_publish``/``after_task_publish``, which Celery sends from
  ``send_task_message`` with the message's parts, the fast path sends them itself with new
  parts for each message and publishes what a receiver changed:
  ``FastPublisher._publish_signalled``);
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

import copy
import logging
import sys
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from celery import signals
from celery.utils.nodenames import anon_nodename
from kombu import serialization
from kombu.compression import compress

from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.instants import iso_text
from celery_driftsafe.core.stored_names import Optimisation
from celery_driftsafe.core.validation import PUBLISH_OPTIONS
from celery_driftsafe.publish import envelope_text
from celery_driftsafe.publish.argsrepr import argument_reprs, repr_limits
from celery_driftsafe.publish.envelope_text import marker
from celery_driftsafe.publish.message_parts import (
    MessageTemplate,
    Skeleton,
    build_skeleton,
    celerys_apply_async,
    celerys_send_path,
    same_value,
    shared_value,
    short_form,
)
from celery_driftsafe.publish.redis_writer import RedisWriter

if TYPE_CHECKING:
    from celery_driftsafe.claim.outbox import ClaimedRun

logger = logging.getLogger("celery_driftsafe.fastpublish")

#: The publish options of a run that the fast path knows how to handle: every one the
#: publisher's gate lets through (a run's message carries no other).
FAST_OPTIONS = PUBLISH_OPTIONS
#: Tasks whose message parts a publisher keeps (about 0.5 kB each, with the arguments they
#: compare against); a beat with more tasks builds the others' parts each time.
TEMPLATE_CACHE_SIZE = 200_000


class FastPublisher:
    """Publishes runs with per-task prebuilt Celery messages (see the module's docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._templates: dict[int | str, MessageTemplate] = {}
        self._misses_when_full = 0
        #: Messages this path published, and messages left to ``apply_async`` (for figures).
        self.published = 0
        self.declined = 0
        #: Of the published, those written straight to Redis (publish/redis_writer.py).
        self.direct = 0
        self._skeletons: dict[tuple[Any, ...], Skeleton | None] = {}
        self._origin = anon_nodename()
        #: What the app's configuration says, read once a batch (:meth:`active`): the display
        #: forms' bounds.
        self._limits: tuple[int, int, int] | None = None
        #: Whether ``Task.apply_async`` is Celery's own, found once a batch (:meth:`active`):
        #: if not, the messages of registered tasks take it.
        self._apply_async_own = True
        #: Whether receivers of ``before_task_publish``/``after_task_publish`` are connected
        #: (found once a batch): each message is then sent as :meth:`_publish_signalled` does.
        self._signalled = False
        #: How far this process's wall clock is ahead of the time authority (set by the
        #: dispatcher once a batch): a message's time to live counts from the authority's now.
        self.wall_ahead = timedelta(0)
        #: Whether templates hold their task names interned (``OPTIMISATIONS_OFF``
        #: "interned_names"; read once a batch, :meth:`active`).
        self._intern = True

    def time_to_live(self, expires: datetime) -> float:
        """A message's time to live in the broker (its ``expiration``): as ``send_task``
        computes it, the seconds from now to ``expires``, but from the authority's now. A wall
        clock ahead would shorten it (to 0: RabbitMQ then drops a message no consumer takes
        at once), one behind would lengthen it."""
        return max((expires - (datetime.now(UTC) - self.wall_ahead)).total_seconds(), 0)

    def active(self) -> bool:
        """Whether this batch may take the fast path: ``FAST_PUBLISH`` is on and nothing
        about the app or process rules it out (see :meth:`declines`)."""
        settings = get_settings()
        if not settings.fast_publish:
            return False
        self._intern = settings.optimised(Optimisation.INTERNED_NAMES)
        self._limits = None
        self._apply_async_own = celerys_apply_async()
        self._signalled = bool(
            signals.before_task_publish.receivers or signals.after_task_publish.receivers
        )
        reason = self.declines()
        if reason is not None:
            logger.debug(
                "publishing through Celery's apply_async: %s",
                reason,
                extra={"action": "fast-publish-off"},
            )
        return reason is None

    def publish_run(
        self,
        run: ClaimedRun,
        producer: Any,
        headers: dict[str, Any],
        writer: RedisWriter | None = None,
    ) -> bool:
        """Publish a claimed run's message (with these custom ``headers``; on ``writer``
        where it can go there); False, nothing published, when it cannot take the fast
        path."""
        key = run.periodic_task_id if run.periodic_task_id is not None else run.task_name
        done = self.publish(
            producer,
            cache_key=key,
            name=run.task_name,
            args=run.args,
            kwargs=run.kwargs,
            options=run.options,
            task_id=run.celery_task_id,
            headers=headers,
            expires=run.expires_at,
            reprs=lambda: argument_reprs(self.app, run.args, run.kwargs, self.limits()),
            writer=writer,
        )
        self.published += done
        return done

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
        read
        once a batch."""
        if self._limits is None:
            self._limits = repr_limits(self.app)
        return self._limits

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

    def publish(
        self,
        producer: Any,
        *,
        cache_key: int | str,
        name: str,
        args: list[Any],
        kwargs: dict[str, Any],
        options: dict[str, Any],
        task_id: str,
        headers: dict[str, Any],
        expires: datetime | None,
        reprs: Callable[[], tuple[str, str]],
        writer: RedisWriter | None = None,
    ) -> bool:
        """Publish one run's message through ``producer`` (or queue it on ``writer``, which
        the caller flushes); False (nothing published) when this message cannot take the
        fast path. ``options`` are the run's publish options (their ``headers`` are ignored:
        ``headers`` are the custom headers the message carries)."""
        template = self._template(cache_key, name, args, kwargs, options, expires, reprs)
        skeleton = template.skeleton
        if skeleton is None or (skeleton.via_apply_async and not self._apply_async_own):
            return False
        app = self.app
        expires_text = expiration = None
        if expires is not None:
            expires_text = iso_text(expires)
            expiration = self.time_to_live(expires)
        if skeleton.notify_backend:
            app.backend.on_task_call(producer, task_id)
        if self._signalled:
            self._publish_signalled(
                producer,
                template,
                args,
                kwargs,
                task_id,
                expires_text,
                expiration,
                headers,
                writer,
            )
            return True
        declare = skeleton.to_declare(producer)
        if writer is not None and declare is None and (route := writer.route(skeleton)):
            self._put_on_writer(
                writer, route, template, task_id, app.thread_oid, expires_text, expiration, headers
            )
            return True
        if writer is not None:
            writer.via_kombu()
        message_headers, properties = template.run_parts(
            task_id, app.thread_oid, expires_text, expiration, headers
        )
        producer.publish(
            template.body,
            content_type=template.content_type,
            content_encoding=template.content_encoding,
            headers=message_headers,
            declare=declare,
            **skeleton.publish_kwargs,
            **properties,
        )
        return True

    def _publish_signalled(
        self,
        producer: Any,
        template: MessageTemplate,
        args: list[Any],
        kwargs: dict[str, Any],
        task_id: str,
        expires: str | None,
        expiration: float | None,
        headers: dict[str, Any],
        writer: RedisWriter | None = None,
    ) -> None:
        """Publish a run's message as Celery's ``send_task_message`` does when receivers of
        its signals are connected: ``before_task_publish`` gets the message's parts (new
        ones: the body's arguments, headers, properties, declarations and retry policy),
        what a receiver changes in them is published (the body serialised afresh, as Celery
        does), and ``after_task_publish`` follows. Where the receivers only added headers
        (OpenTelemetry's ``traceparent``), the message is the template's with those headers
        more, written as without receivers (on ``writer`` where it can go there)."""
        skeleton = template.skeleton
        assert skeleton is not None
        base_headers, base_properties = template.run_parts(
            task_id, self.app.thread_oid, expires, expiration, headers
        )
        # new values too (the template's are shared by the task's messages): a receiver may
        # change one in place (a stamp in ``stamps``), for this message only
        message_headers = {key: _fresh(value) for key, value in base_headers.items()}
        properties = {key: _fresh(value) for key, value in base_properties.items()}
        if template.compression is not None:  # kombu's Producer adds it, as for Celery
            if "compression" in headers:
                message_headers["compression"] = headers["compression"]
            else:
                del message_headers["compression"]
        # the run's own arguments, as Celery's; copies where the template holds them
        if args is template.args:
            args = copy.deepcopy(args)
        if kwargs is template.kwargs:
            kwargs = copy.deepcopy(kwargs)
        body = (args or (), kwargs or {}, _fresh(skeleton.embed))
        publish = dict(skeleton.publish_kwargs)
        publish["retry_policy"] = dict(publish["retry_policy"])
        declare = list(skeleton.declare) if skeleton.declare is not None else None
        exchange, routing_key = publish["exchange"], publish["routing_key"]
        signals.before_task_publish.send(
            sender=template.name,
            body=body,
            exchange=exchange,
            routing_key=routing_key,
            declare=declare,
            headers=message_headers,
            properties=properties,
            retry_policy=publish["retry_policy"],
        )
        if declare is not None and _same_entities(declare, skeleton.declare):
            # what kombu's maybe_declare would find, without binding a copy of each entity
            declare = skeleton.to_declare(producer)
        added = None
        if writer is not None and declare is None and template.compression is None:
            added = _added_headers(message_headers, base_headers)
        if (
            added is not None
            and writer is not None
            and (route := writer.route(skeleton))
            and same_value(properties, base_properties)
            and same_value(publish["retry_policy"], skeleton.publish_kwargs["retry_policy"])
            and same_value(body[0], template.args or ())
            and same_value(body[1], template.kwargs or {})
            and same_value(body[2], skeleton.embed)
        ):
            self._put_on_writer(
                writer,
                route,
                template,
                task_id,
                self.app.thread_oid,
                expires,
                expiration,
                {**headers, **added},
            )
        else:
            if writer is not None:
                writer.via_kombu()
            producer.publish(
                body,
                serializer=skeleton.serializer,
                compression=skeleton.compression,
                declare=declare,
                headers=message_headers,
                **publish,
                **properties,
            )
        signals.after_task_publish.send(
            sender=template.name,
            body=body,
            headers=message_headers,
            exchange=exchange,
            routing_key=routing_key,
        )

    def _put_on_writer(
        self,
        writer: RedisWriter,
        route: tuple[str, str, Any],
        template: MessageTemplate,
        task_id: str,
        reply_to: str,
        expires: str | None,
        expiration: float | None,
        headers: dict[str, Any],
    ) -> None:
        """Queue a run's message on ``writer``: its values spliced into the shape of its
        skeleton's envelopes for this route and these custom header names, made on first use
        from the message's parts with markers in place of the values
        (:mod:`celery_driftsafe.publish.envelope_text`)."""
        skeleton = template.skeleton
        assert skeleton is not None
        has_expiry = expires is not None
        shape_key = (
            route,
            tuple(headers),
            has_expiry,
            template.content_type,
            template.content_encoding,
            template.compression,
            writer.body_encoding,
        )
        shape = skeleton.envelopes.get(shape_key)
        if shape is None:
            names = list(headers)
            stand_in = replace(
                template,
                argsrepr=marker(envelope_text.ARGSREPR),
                kwargsrepr=marker(envelope_text.KWARGSREPR),
            )
            marked_headers, marked_properties = stand_in.run_parts(
                marker(envelope_text.TASK_ID),
                marker(envelope_text.REPLY_TO),
                marker(envelope_text.EXPIRES) if has_expiry else None,
                0.0 if has_expiry else None,
                {name: marker(envelope_text.FIXED + i) for i, name in enumerate(names)},
            )
            shape = skeleton.envelopes[shape_key] = writer.shape(
                route,
                template.content_type,
                template.content_encoding,
                marked_headers,
                marked_properties,
                has_expiry,
                len(names),
            )
        writer.put_run(
            shape,
            template.body,
            task_id,
            reply_to,
            template.argsrepr,
            template.kwargsrepr,
            expires,
            expiration,
            headers,
        )
        self.direct += 1

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
    ) -> Skeleton | None:
        """What the messages of every task of this name and options share, whatever their
        arguments (routes are plain maps: :meth:`declines`), shared by those tasks."""
        if not FAST_OPTIONS.issuperset(options):
            return None
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


def _fresh(value: Any) -> Any:
    """``value`` or, where it may be changed in place, a copy that shares nothing with it."""
    if value is None or type(value) in _IMMUTABLE:
        return value
    if type(value) is list:
        return [_fresh(item) for item in value]
    if type(value) is dict:
        return {key: _fresh(item) for key, item in value.items()}
    return copy.deepcopy(value)


_IMMUTABLE = frozenset({str, int, float, bool, bytes})


def _added_headers(headers: dict[str, Any], base: dict[str, Any]) -> dict[str, Any] | None:
    """The headers receivers added after ``base``'s (which they left as they were, in their
    order), or None when they changed, removed or moved one of ``base``'s."""
    if len(headers) < len(base):
        return None
    items = iter(headers.items())
    # base first: zip stops at its end before taking an item more of the others
    for (base_key, base_value), (key, value) in zip(base.items(), items, strict=False):
        if key != base_key or not same_value(value, base_value):
            return None
    return dict(items)


def _same_entities(declare: list[Any], entities: tuple[Any, ...] | None) -> bool:
    """Whether a receiver left the list of entities to declare as it was given."""
    return (
        entities is not None
        and len(declare) == len(entities)
        and all(a is b for a, b in zip(declare, entities, strict=True))
    )
