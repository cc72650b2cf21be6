"""The writers of fast-path messages, behind one contract (:class:`Writer`): kombu's producer
(:class:`KombuWriter`), or straight into the Redis lists kombu's Redis transport would push
them onto (:class:`RedisWriter`; see docs/reference/settings.md, "The fast publish path").
A writer is handed data (a :class:`~celery_driftsafe.publish.message_parts.RunMessage`, or
the :class:`~celery_driftsafe.publish.message_parts.ChangedParts` receivers left): it knows
no template builder and calls nothing back.

With a prebuilt message (:mod:`celery_driftsafe.publish.fast_path`), what is left of a publish is
kombu's: ``Producer.publish`` (its arguments, the retry wrapper, the declarations), the
virtual channel's envelope (``prepare_message``, the base64 body, a delivery tag) and one
``LPUSH`` command queued on a pipeline per message: about 65 µs of a beat's CPU a message,
where the envelope and its JSON are 20. :class:`RedisWriter` builds the same envelope with the
channel's own methods (``prepare_message``, ``_inplace_augment_message``, the priority list of
``_put``) and kombu's JSON, gathers a batch's envelopes per list, and writes each list's with
one ``LPUSH key m1 m2 …`` (the order ``LPUSH`` one by one gives; atomic, where a pipeline can
stop half-way).

It is used only where that is kombu's own path to the byte: for a batch kombu would write in
one pipeline (two messages or more, on a channel whose ``supports_batch_publish`` is true, so
not when the Redis client retries writes: kombu then publishes one by one, each with its
retry), on kombu's Redis channel (or the Sentinel one) with none of those methods overridden,
for a message to the default (nameless) exchange, that is to a queue by name (Celery's routing
by queue; a named exchange goes through kombu, which looks its bindings up), a queue without
an ``x-expires`` of its own, from a producer without compression or an exchange of its own to
declare, with nothing left to declare for the message. Any other message it hands to kombu's
producer, as :class:`KombuWriter` does. ``tests/publish/test_fast_path.py`` compares the
envelopes with Celery's.

A run's message is not built whole: its values are spliced
(:func:`~celery_driftsafe.publish.envelope_text.run_text`) into the shape of its skeleton's
envelopes (:meth:`RedisWriter.shape`, made once per route and set of custom header names from
the message's parts with markers), the text of :meth:`RedisWriter.envelope` in kombu's JSON, to
the byte.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol
from uuid import uuid4

from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.stored_names import Optimisation
from celery_driftsafe.publish import envelope_text
from celery_driftsafe.publish.envelope_text import (
    EnvelopeShape,
    make_shape,
    marker,
    run_text,
)
from celery_driftsafe.publish.message_parts import ChangedParts, RunMessage, Skeleton
from celery_driftsafe.publish.originals import is_original


class Writer(Protocol):
    """The contract of a batch's writer. Messages land in the order they were written,
    whichever way each goes; ``write`` and ``write_parts`` return whether the message was
    written straight to Redis (for figures)."""

    def write(self, message: RunMessage) -> bool:
        """Publish a run's message as its template makes it (the prebuilt body)."""

    def write_parts(self, parts: ChangedParts) -> bool:
        """Publish a message as receivers left its parts, through kombu's producer (the body
        serialised afresh, as Celery's ``send_task_message`` does)."""

    def before_kombu(self) -> None:
        """A message is about to go out through kombu outside this writer (Celery's own
        ``apply_async``): what the writer holds is written first."""

    def flush(self) -> None:
        """Write what is held (raises when the broker cannot be reached: none of what was
        held is known to be out)."""


class KombuWriter:
    """Writes each message through kombu's ``Producer.publish`` at once."""

    def __init__(self, producer: Any) -> None:
        self.producer = producer

    def write(self, message: RunMessage) -> bool:
        self._publish(message, message.skeleton.to_declare(self.producer))
        return False

    def _publish(self, message: RunMessage, declare: list[Any] | None) -> None:
        template = message.template
        headers, properties = message.parts()
        self.producer.publish(
            template.body,
            content_type=template.content_type,
            content_encoding=template.content_encoding,
            headers=headers,
            declare=declare,
            **message.skeleton.publish_kwargs,
            **properties,
        )

    def write_parts(self, parts: ChangedParts) -> bool:
        skeleton = parts.skeleton
        # the entities as the receivers left them: what kombu's maybe_declare would find of
        # the skeleton's own, without binding a copy of each entity
        declare = skeleton.to_declare(self.producer) if parts.declare_given else parts.declare
        self.producer.publish(
            parts.body,
            serializer=skeleton.serializer,
            compression=skeleton.compression,
            declare=declare,
            headers=parts.headers,
            **parts.publish_kwargs,
            **parts.properties,
        )
        return False

    def before_kombu(self) -> None:
        """Nothing held."""

    def flush(self) -> None:
        """Nothing held."""


#: ``Producer.publish``'s own parameters that a message property of the same name would be
#: taken for and that change a Redis message: such a property declines. (``priority`` and
#: ``expiration`` are handled; ``mandatory``, ``immediate`` and the timeouts reach kombu's
#: Redis channel and change nothing there: they are dropped, as kombu drops them.)
_PUBLISH_PARAMETERS = frozenset(
    {
        "routing_key",
        "delivery_mode",
        "content_type",
        "content_encoding",
        "serializer",
        "headers",
        "compression",
        "exchange",
        "retry",
        "retry_policy",
        "declare",
    }
)
_IGNORED_BY_REDIS = ("mandatory", "immediate", "timeout", "confirm_timeout")
#: The ``Producer.publish`` arguments a skeleton may carry (skeleton._publish_arguments).
_KNOWN_PUBLISH_KWARGS = frozenset(
    {
        "exchange",
        "routing_key",
        "retry",
        "retry_policy",
        "delivery_mode",
        "timeout",
        "confirm_timeout",
    }
)


def _stock_redis_channel(channel: Any) -> bool:
    """Whether ``channel`` is kombu's Redis channel with its publishing methods as kombu has
    them (a subclass that changes them, or a wrapper installed over them, gets kombu's path)."""
    try:
        from kombu.transport import redis as kombu_redis
    except ImportError:  # redis-py missing: no Redis transport
        return False
    virtual = "kombu.transport.virtual.base"
    return (
        isinstance(channel, kombu_redis.Channel)
        and is_original(channel.basic_publish, virtual, "Channel.basic_publish")
        and is_original(channel.prepare_message, virtual, "Channel.prepare_message")
        and is_original(
            channel._inplace_augment_message, virtual, "Channel._inplace_augment_message"
        )
        and is_original(channel._next_delivery_tag, virtual, "Channel._next_delivery_tag")
        and is_original(channel._put, "kombu.transport.redis", "Channel._put")
    )


class BatchWriteError(Exception):
    """Writing the batch's earlier messages failed (its own or kombu's, flushed in turn to
    keep their order): none of the batch is known to be out."""


class RedisWriter(KombuWriter):
    """A batch's fast-path envelopes for one producer's Redis channel, written on
    :meth:`flush`; the messages it cannot write itself go through kombu, in turn."""

    def __init__(self, producer: Any, channel: Any, batch: Any) -> None:
        super().__init__(producer)
        self.channel = channel
        #: kombu's publish batch of the same messages, and whether it holds some written
        #: after this writer's (the two are flushed in turn, so the lists keep their order).
        self._batch = batch
        self._kombu_queued = False
        #: Redis list -> envelopes (JSON), in publishing order.
        self._lists: dict[str, list[str]] = {}
        #: skeleton -> (exchange name, routing key, delivery mode), or None: kombu's path
        #: (keyed by the skeleton itself, held while the writer is: never by ``id()``, which
        #: a skeleton freed meanwhile would leave to another).
        self._routes: dict[Skeleton, tuple[str, str, Any] | None] = {}
        from kombu.utils.json import JSONEncoder, dumps

        self._dumps = dumps
        #: kombu's encoder as its ``dumps`` makes it, for the values spliced into a shape.
        self._encoder = JSONEncoder()
        #: Delivery tags: this writer's own random UUID4 with its last 48 bits a count.
        self._tag_prefix = str(uuid4())[:24]
        self._tags = 0
        #: Off (``OPTIMISATIONS_OFF`` "delivery_tags"): a new ``uuid4()`` a message, as kombu.
        self._counted_tags = get_settings().optimised(Optimisation.DELIVERY_TAGS)

    @classmethod
    def open(cls, producer: Any, batch: Any) -> RedisWriter | None:
        """A writer for ``producer`` beside kombu's publish ``batch`` (``Producer.batch()``),
        or None where its messages must go through kombu."""
        messaging = "kombu.messaging"
        if (
            not is_original(producer.publish, messaging, "Producer.publish")
            or not is_original(producer._publish, messaging, "Producer._publish")
            or not is_original(producer._prepare, messaging, "Producer._prepare")
            or producer.compression
            or (producer.auto_declare and producer.exchange.name)
        ):
            return None
        channel = producer.channel
        if not _stock_redis_channel(channel):
            return None
        if not getattr(channel, "supports_batch_publish", False):
            # kombu publishes one by one here (the Redis client retries on timeouts or
            # errors, and a retried batch could land twice): so does the beat
            return None
        return cls(producer, channel, batch)

    def write(self, message: RunMessage) -> bool:
        skeleton = message.skeleton
        declare = skeleton.to_declare(self.producer)
        route = self.route(skeleton) if declare is None else None
        if route is None:
            self.before_kombu()
            self._publish(message, declare)
            return False
        self.put_run(self._shape(route, message), message)
        return True

    def write_parts(self, parts: ChangedParts) -> bool:
        self.before_kombu()
        return super().write_parts(parts)

    def _shape(self, route: tuple[str, str, Any], message: RunMessage) -> EnvelopeShape:
        """The shape of the envelopes of ``message``'s skeleton for this route, custom header
        names and content, made on first use from the message's parts with markers in place
        of the values (:mod:`celery_driftsafe.publish.envelope_text`)."""
        template = message.template
        headers = message.headers
        has_expiry = message.expires is not None
        key = (
            route,
            tuple(headers),
            has_expiry,
            template.content_type,
            template.content_encoding,
            template.compression,
            self.channel.body_encoding,
        )
        envelopes = message.skeleton.envelopes
        shape: EnvelopeShape | None = envelopes.get(key)
        if shape is None:
            names = list(headers)
            stand_in = RunMessage(
                replace(
                    template,
                    argsrepr=marker(envelope_text.ARGSREPR),
                    kwargsrepr=marker(envelope_text.KWARGSREPR),
                ),
                marker(envelope_text.TASK_ID),
                marker(envelope_text.REPLY_TO),
                marker(envelope_text.EXPIRES) if has_expiry else None,
                0.0 if has_expiry else None,
                {name: marker(envelope_text.FIXED + i) for i, name in enumerate(names)},
            )
            marked_headers, marked_properties = stand_in.parts()
            shape = envelopes[key] = self.shape(
                route,
                template.content_type,
                template.content_encoding,
                marked_headers,
                marked_properties,
                has_expiry,
                len(names),
            )
        return shape

    def route(self, skeleton: Skeleton) -> tuple[str, str, Any] | None:
        """Where messages of ``skeleton`` go (exchange name, queue, delivery mode), or None
        when they must take kombu's path. Asked once per skeleton and batch."""
        if skeleton not in self._routes:
            self._routes[skeleton] = self._route(skeleton)
        return self._routes[skeleton]

    def _route(self, skeleton: Skeleton) -> tuple[str, str, Any] | None:
        publish = skeleton.publish_kwargs
        if not _KNOWN_PUBLISH_KWARGS.issuperset(publish):
            return None
        if not _PUBLISH_PARAMETERS.isdisjoint(skeleton.properties):
            return None
        producer = self.producer
        # as Producer.publish: the exchange's name and the delivery mode
        exchange, delivery_mode = producer._delivery_details(
            publish.get("exchange") or producer.exchange, publish.get("delivery_mode")
        )
        routing_key = publish.get("routing_key")
        if routing_key is None:
            routing_key = producer.routing_key
        if exchange or not isinstance(routing_key, str) or not routing_key:
            return None  # a named exchange: its bindings decide (kombu's path)
        expires = self.channel._expires
        if expires and routing_key in expires:
            return None
        return "", routing_key, delivery_mode

    @property
    def body_encoding(self) -> str:
        """How the channel encodes a message's body in its envelope (``base64``): a shape is
        made for one."""
        return str(self.channel.body_encoding)

    def put_run(self, shape: EnvelopeShape, message: RunMessage) -> None:
        """Queue one run's message: the envelope ``Producer.publish`` and the channel's
        ``basic_publish`` would build (:meth:`envelope`), its values spliced into ``shape``
        (made by :meth:`shape` for the message's route, content and custom header names)."""
        channel = self.channel
        template = message.template
        encoded, _encoding = channel.encode_body(template.body, channel.body_encoding)
        text = run_text(
            shape,
            self._encoder.encode,
            encoded,
            message.task_id,
            message.reply_to,
            template.argsrepr,
            template.kwargsrepr,
            message.expires,
            message.expiration,
            self._next_tag(),
            message.headers,
        )
        self._queue(shape.key, text)

    def _next_tag(self) -> str:
        """A delivery tag, in the form of kombu's channel's (``str(uuid4())``: one read of
        ``os.urandom`` a message, 2.4 to 3.2 µs here) and as unique: the consumer's channel
        keys its unacknowledged messages by it. The writer's random UUID4 (74 random bits),
        its last 12 hex digits the count of the writer's messages; 0.3 to 0.4 µs."""
        if not self._counted_tags:
            return str(uuid4())
        self._tags += 1
        return f"{self._tag_prefix}{self._tags:012x}"

    def shape(
        self,
        route: tuple[str, str, Any],
        content_type: str,
        content_encoding: str,
        headers: dict[str, Any],
        properties: dict[str, Any],
        has_expiry: bool,
        custom_headers: int,
    ) -> EnvelopeShape:
        """The shape of the envelopes :meth:`envelope` builds for messages with these
        ``headers`` and ``properties`` (taken over), in which a
        :func:`~celery_driftsafe.publish.envelope_text.marker` stands for each value that
        varies (the run's, and the values of its ``custom_headers`` custom headers)."""
        key, message = self.envelope(
            route, b"", content_type, content_encoding, headers, properties
        )
        message["body"] = marker(envelope_text.BODY)
        message["properties"]["delivery_tag"] = marker(envelope_text.DELIVERY_TAG)
        if has_expiry:
            message["properties"]["expiration"] = marker(envelope_text.EXPIRATION)
        return make_shape(message, key, envelope_text.FIXED + custom_headers, self._dumps)

    def envelope(
        self,
        route: tuple[str, str, Any],
        body: bytes,
        content_type: str,
        content_encoding: str,
        headers: dict[str, Any],
        properties: dict[str, Any],
    ) -> tuple[str, dict[str, Any]]:
        """The Redis list and the envelope of one message (``properties`` is the message's
        own dict, taken over), as the channel builds them: what a spliced envelope's text
        must equal once encoded with kombu's JSON."""
        exchange, routing_key, delivery_mode = route
        channel = self.channel
        for name in _IGNORED_BY_REDIS:
            properties.pop(name, None)
        priority = properties.pop("priority", 0)
        expiration = properties.pop("expiration", None)
        properties["delivery_mode"] = delivery_mode
        if expiration is not None:
            properties["expiration"] = str(int(expiration * 1000))
        message = channel.prepare_message(
            body, priority, content_type, content_encoding or "binary", headers, properties
        )
        channel._inplace_augment_message(message, exchange, routing_key)
        key = channel._q_for_pri(routing_key, channel._get_message_priority(message, reverse=False))
        return key, message

    def _queue(self, key: str, envelope_text: str) -> None:
        if self._kombu_queued:  # kombu holds earlier messages: they go first
            self._kombu_queued = False
            try:
                self._batch.flush()
            except Exception as exc:
                raise BatchWriteError(f"{type(exc).__name__}: {exc}") from exc
        envelopes = self._lists.get(key)
        if envelopes is None:
            envelopes = self._lists[key] = []
        envelopes.append(envelope_text)

    def before_kombu(self) -> None:
        """A message of the batch is about to go through kombu: what this writer holds is
        written first, so that the messages land in the order they were published."""
        try:
            self.flush()
        except Exception as exc:
            raise BatchWriteError(f"{type(exc).__name__}: {exc}") from exc
        self._kombu_queued = True

    def flush(self) -> None:
        """Write what is queued: one ``LPUSH`` a list (raises if Redis cannot be reached;
        then none of the batch is known to be out)."""
        if not self._lists:
            return
        lists, self._lists = self._lists, {}
        with self.channel.conn_or_acquire() as client:
            if len(lists) == 1:
                ((key, envelopes),) = lists.items()
                client.lpush(key, *envelopes)
            else:
                with client.pipeline(transaction=False) as pipe:
                    for key, envelopes in lists.items():
                        pipe.lpush(key, *envelopes)
                    pipe.execute()
