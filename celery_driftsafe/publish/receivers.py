"""A fast-path message handed to receivers of Celery's ``before_task_publish`` and
``after_task_publish``, as Celery's ``send_task_message`` hands them its messages.

Celery sends ``before_task_publish`` with the message's parts (the body's arguments, the
headers, the properties, the entities to declare, the retry policy), publishes what the
receivers left in them, and then sends ``after_task_publish``. :func:`publish` does the same
with a run's :class:`~celery_driftsafe.publish.message_parts.RunMessage`: receivers get new
parts, which share nothing they could change in place with the task's template or with any
other message; and where they only added headers (OpenTelemetry's ``traceparent``), the
message is the template's with those headers more, written as without receivers (straight to
Redis where it can go there). Anything else they changed goes out as they left it, the body
serialised afresh, through kombu's producer
(:class:`~celery_driftsafe.publish.message_parts.ChangedParts`).

The cost is what receivers cannot do without: the parts a message is made of and two signals.
Whether receivers changed something is found by identity first, in C: each value handed to
them still in its place (the lists of them are kept, so that no address is reused meanwhile),
and each copy of a list or dict still holding the very items copied. Only where that fails is
a value compared with its original by value
(:func:`~celery_driftsafe.publish.message_parts.same_value`): an equal value of the same type
makes the same message. ``tests/publish/test_fast_path.py``
holds the parts receivers get to Celery's, argument by argument, and what they change to the
message that goes out.
"""

from __future__ import annotations

from operator import is_
from typing import Any

from celery import signals

from celery_driftsafe.publish.message_parts import (
    IMMUTABLE,
    ChangedParts,
    RunMessage,
    same_value,
)
from celery_driftsafe.publish.redis_writer import Writer


def connected() -> bool:
    """Whether receivers of ``before_task_publish`` or ``after_task_publish`` are connected
    (asked once a batch)."""
    return bool(signals.before_task_publish.receivers or signals.after_task_publish.receivers)


def publish(message: RunMessage, writer: Writer) -> bool:
    """Send ``before_task_publish`` with new parts of ``message``, have ``writer`` write what
    the receivers left, then send ``after_task_publish`` (as Celery's ``send_task_message``);
    whether the message was written straight to Redis."""
    template = message.template
    skeleton = message.skeleton
    custom = message.headers
    headers, properties = message.parts()
    if template.compression is not None:  # kombu's Producer adds it, as for Celery
        if "compression" in custom:
            headers["compression"] = custom["compression"]
        else:
            del headers["compression"]
    header_names = list(headers)
    property_names = list(properties)
    # copies of what a receiver could change in place (a stamp in ``stamps``): for this
    # message only, each kept beside its original to find a change made in it
    copies = [_copy_into(headers, name) for name in skeleton.mutable_headers if name not in custom]
    if not IMMUTABLE.issuperset(map(type, custom.values())):
        copies.extend(
            _copy_into(headers, name)
            for name, value in custom.items()
            if type(value) not in IMMUTABLE
        )
    copies.extend(_copy_into(properties, name) for name in skeleton.mutable_properties)
    handed_headers = list(headers.values())
    handed_properties = list(properties.values())
    # the run's own arguments, as Celery's: copies, the template's are shared
    args, kwargs, embed = template.args, template.kwargs, skeleton.embed
    body = (_fresh(args) if args else (), _fresh(kwargs) if kwargs else {}, _fresh(embed))
    publish_kwargs = skeleton.publish_kwargs.copy()
    policy = skeleton.publish_kwargs["retry_policy"]
    retry_policy = publish_kwargs["retry_policy"] = _fresh(policy)
    declare = list(skeleton.declare) if skeleton.declare is not None else None
    exchange, routing_key = publish_kwargs["exchange"], publish_kwargs["routing_key"]
    signals.before_task_publish.send(
        sender=template.name,
        body=body,
        exchange=exchange,
        routing_key=routing_key,
        declare=declare,
        headers=headers,
        properties=properties,
        retry_policy=retry_policy,
    )
    same_entities = _same_entities(declare, skeleton.declare)
    added = None
    if template.compression is None and same_entities:
        added = _added(headers, header_names, handed_headers)
    if (
        added is not None
        and _kept_parts(properties, property_names, handed_properties)
        and all(_kept(copy, original) for copy, original in copies)
        and _kept(retry_policy, policy)
        and _kept_argument(body[0], args)
        and _kept_argument(body[1], kwargs)
        and _kept(body[2], embed)
    ):
        if added:
            message = RunMessage(
                template,
                message.task_id,
                message.reply_to,
                message.expires,
                message.expiration,
                {**custom, **added},
            )
        direct = writer.write(message)
    else:
        direct = writer.write_parts(
            ChangedParts(
                skeleton, body, headers, properties, publish_kwargs, declare, same_entities
            )
        )
    signals.after_task_publish.send(
        sender=template.name,
        body=body,
        headers=headers,
        exchange=exchange,
        routing_key=routing_key,
    )
    return direct


def _copy_into(parts: dict[str, Any], name: str) -> tuple[Any, Any]:
    """Put a copy of ``parts[name]`` that shares nothing changeable with it in its place;
    the copy and the original."""
    original = parts[name]
    copy = parts[name] = _fresh(original)
    return copy, original


def _fresh(value: Any) -> Any:
    """``value`` or, where it may be changed in place, a copy that shares nothing with it."""
    kind = type(value)
    if kind in IMMUTABLE:
        return value
    if kind is dict:
        copied = value.copy()
        if IMMUTABLE.issuperset(map(type, copied.values())):
            return copied
        for key, item in value.items():
            if type(item) not in IMMUTABLE:
                copied[key] = _fresh(item)
        return copied
    if kind is list:
        if IMMUTABLE.issuperset(map(type, value)):
            return value.copy()
        return [_fresh(item) for item in value]
    if kind is tuple:
        return tuple(_fresh(item) for item in value)
    import copy

    return copy.deepcopy(value)


def _kept(value: Any, original: Any) -> bool:
    """Whether ``value``, a copy of ``original`` handed to receivers, is still the same value:
    each item the very one copied, in the same order (found in C), or else
    :func:`same_value`. A receiver can only replace an item by another object, so identity
    shows it unchanged; a nested container was copied (:func:`_fresh`), so a change made in it
    falls to the comparison by value."""
    kind = type(value)
    if kind is not type(original) or len(value) != len(original):
        return False
    if kind is dict:
        if all(map(is_, value, original)) and all(map(is_, value.values(), original.values())):
            return True
    elif (kind is list or kind is tuple) and all(map(is_, value, original)):
        return True
    return same_value(value, original)


def _kept_argument(value: Any, original: list[Any] | dict[str, Any]) -> bool:
    """Whether the body's arguments ``value``, handed to receivers for the template's
    ``original`` (a copy; ``()`` or ``{}`` in the place of empty ones, as Celery's), are
    still the same value."""
    if original:
        return _kept(value, original)
    return not value and type(value) is (tuple if type(original) is list else dict)


def _kept_parts(parts: dict[str, Any], names: list[str], handed: list[Any]) -> bool:
    """Whether receivers left ``parts`` (the properties) the same: the ``names`` they were
    handed, in their order, with the values ``handed`` (:func:`_same_values`)."""
    return len(parts) == len(names) and list(parts) == names and _same_values(parts, handed)


def _same_values(parts: dict[str, Any], handed: list[Any]) -> bool:
    """Whether the first values of ``parts`` are the same as those ``handed``: the very ones
    (found in C), or else each the same value. (A copy handed for a value that can change in
    place is compared with its original by the caller, :func:`_kept`.)"""
    values = list(parts.values())[: len(handed)] if len(parts) > len(handed) else parts.values()
    return all(map(is_, values, handed)) or all(map(same_value, values, handed))


def _added(headers: dict[str, Any], names: list[str], handed: list[Any]) -> dict[str, Any] | None:
    """The headers receivers added after the ``names`` they were handed, whose values they
    left the same and in their order (:func:`_same_values`); None when they changed, removed
    or moved one of them."""
    count = len(names)
    if len(headers) == count:
        return {} if list(headers) == names and _same_values(headers, handed) else None
    if len(headers) < count or list(headers)[:count] != names:
        return None
    return dict(list(headers.items())[count:]) if _same_values(headers, handed) else None


def _same_entities(declare: list[Any] | None, entities: tuple[Any, ...] | None) -> bool:
    """Whether receivers left the list of entities to declare as it was given."""
    if declare is None or entities is None:
        return declare is None and entities is None
    return len(declare) == len(entities) and all(map(is_, declare, entities))
