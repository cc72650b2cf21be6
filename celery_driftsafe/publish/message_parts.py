"""A fast-path message as data: what every message of one task name and publish options
shares (:class:`Skeleton`), what every message of one task shares (:class:`MessageTemplate`),
and one run's message (:class:`RunMessage`), whose headers and properties are the template's
with the run's values set (:meth:`RunMessage.parts`). Built by
:mod:`celery_driftsafe.publish.fast_path`, handed to the publish-signal receivers
(:mod:`celery_driftsafe.publish.receivers`) and written by a writer
(:mod:`celery_driftsafe.publish.redis_writer`); this module calls nothing of theirs.

Also what "the same message" means for the values that make one (:func:`same_value`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


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
    declare_idents: frozenset[int] | None
    #: The task's signature check (Celery's ``typing``), run on each task's arguments.
    check_arguments: Callable[..., Any] | None
    notify_backend: bool
    #: Whether Celery publishes these messages through ``Task.apply_async`` (a registered
    #: task), which the fast path reproduces only while it is Celery's own.
    via_apply_async: bool
    #: The names of the headers and properties whose values a receiver could change in place
    #: (a list, a dict): each message hands receivers copies of these, the others as they are.
    mutable_headers: tuple[str, ...] = ()
    mutable_properties: tuple[str, ...] = ()
    #: The Redis envelopes' shapes (:mod:`celery_driftsafe.publish.envelope_text`), made by the
    #: Redis writer on first use and kept here for the skeleton's messages.
    envelopes: dict[tuple[Any, ...], Any] = field(default_factory=dict, compare=False, repr=False)

    def to_declare(self, producer: Any) -> list[Any] | None:
        """The entities kombu must declare before a message: none when the producer's
        connection has declared them all already (what kombu's ``maybe_declare`` finds out
        itself, after binding a copy of each entity to the channel: a third of a publish)."""
        if self.declare is None:
            return None
        if self.declare_idents is not None:
            declared = getattr(producer.connection, "declared_entities", None)
            if declared is not None and self.declare_idents.issubset(declared):
                return None
        return list(self.declare)


@dataclass(frozen=True, slots=True)
class MessageTemplate:
    """One task's message parts (the rest is its :class:`Skeleton`'s), and what they were
    built from: kept per task, so small (a few hundred bytes)."""

    name: str
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    has_expiry: bool
    #: None: this task's messages cannot take the fast path (:attr:`declined` says why).
    skeleton: Skeleton | None
    body: bytes = b""
    content_type: str = ""
    content_encoding: str = ""
    #: kombu's ``compression`` header value when the body is compressed, else None.
    compression: str | None = None
    argsrepr: str = ""
    kwargsrepr: str = ""
    declined: str = ""

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


@dataclass(frozen=True, slots=True)
class RunMessage:
    """One run's message: its task's template with the run's values (``expires`` the expiry
    as ISO 8601 text, ``expiration`` the seconds left until it, ``headers`` the run's custom
    headers)."""

    template: MessageTemplate
    task_id: str
    reply_to: str
    expires: str | None
    expiration: float | None
    headers: dict[str, Any]

    @property
    def skeleton(self) -> Skeleton:
        skeleton = self.template.skeleton
        assert skeleton is not None
        return skeleton

    def parts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The message's headers and properties (new dicts; their values the template's)."""
        template = self.template
        skeleton = self.skeleton
        task_id = self.task_id
        headers = skeleton.headers.copy()
        headers["id"] = headers["root_id"] = task_id
        headers["argsrepr"] = template.argsrepr
        headers["kwargsrepr"] = template.kwargsrepr
        properties = skeleton.properties.copy()
        properties["correlation_id"] = task_id
        properties["reply_to"] = self.reply_to
        if self.expires is not None:
            headers["expires"] = self.expires
            properties["expiration"] = self.expiration
        headers.update(self.headers)
        if template.compression is not None:
            headers["compression"] = template.compression
        return headers, properties


@dataclass(frozen=True, slots=True)
class ChangedParts:
    """A run's message as receivers of ``before_task_publish`` left it, for kombu's producer
    to publish as Celery's ``send_task_message`` does: the body serialised afresh, and the
    entities to declare as the receivers left them (:attr:`declare_given`: the skeleton's
    own, which a writer may find declared already)."""

    skeleton: Skeleton
    body: tuple[Any, Any, Any]
    headers: dict[str, Any]
    properties: dict[str, Any]
    publish_kwargs: dict[str, Any]
    declare: list[Any] | None
    declare_given: bool


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
#: Types whose values cannot be changed in place (a receiver can only replace them).
IMMUTABLE = frozenset({str, int, float, bool, bytes, type(None)})
