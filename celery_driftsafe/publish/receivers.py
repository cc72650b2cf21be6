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
Whether receivers changed something is found mostly by identity: every value handed to them
that cannot be changed in place is compared by ``is`` (the value lists are kept, so that no
address is reused meanwhile), and only the few that can be (a list, a dict) are compared by
value with the template's. ``tests/publish/test_fast_path.py`` holds the parts receivers get
to Celery's, argument by argument, and what they change to the message that goes out.
"""

from __future__ import annotations

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
    # copies of what a receiver could change in place (a stamp in ``stamps``): for this
    # message only
    for name in skeleton.mutable_headers:
        if name not in custom:
            headers[name] = _fresh(headers[name])
    changeable = [name for name, value in custom.items() if type(value) not in IMMUTABLE]
    for name in changeable:
        headers[name] = _fresh(headers[name])
    mutable_properties = skeleton.mutable_properties
    for name in mutable_properties:
        properties[name] = _fresh(properties[name])
    given_headers = _given(headers)
    given_properties = _given(properties)
    # the run's own arguments, as Celery's: copies, the template's are shared
    args, kwargs = template.args, template.kwargs
    body = (_fresh(args) if args else (), _fresh(kwargs) if kwargs else {}, _fresh(skeleton.embed))
    publish_kwargs = skeleton.publish_kwargs.copy()
    policy = skeleton.publish_kwargs["retry_policy"]
    retry_policy = publish_kwargs["retry_policy"] = _fresh(policy)
    given_policy = _given(retry_policy)
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
        added = _added(headers, given_headers, skeleton.mutable_headers, changeable, message)
    if (
        added is not None
        and _unchanged(properties, given_properties)
        and all(same_value(properties[n], skeleton.properties[n]) for n in mutable_properties)
        and _unchanged(retry_policy, given_policy)
        and (IMMUTABLE.issuperset(map(type, given_policy[1])) or same_value(retry_policy, policy))
        and _same(body[0], args)
        and _same(body[1], kwargs)
        and _same(body[2], skeleton.embed)
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


def _same(value: Any, original: Any) -> bool:
    """Whether ``value``, a copy of ``original`` (or the empty value in its place) that
    receivers were handed, is still the same value."""
    if not original:  # empty arguments: () and {} in the body, which a receiver may fill
        return not value and type(value) is (tuple if type(original) is list else type(original))
    return same_value(value, original)


def _unchanged(parts: dict[str, Any], given: tuple[list[str], list[Any]]) -> bool:
    """Whether receivers left ``parts`` as ``given`` (:func:`_given`): the same names in the
    same order, each with the very value it had."""
    return len(parts) == len(given[0]) and _same_prefix(parts, given)


def _given(parts: dict[str, Any]) -> tuple[list[str], list[Any]]:
    """The names and values of ``parts`` as handed to receivers (the values kept: no other
    object can take one's address meanwhile, so an identity compares as the value)."""
    return list(parts), list(parts.values())


def _same_prefix(parts: dict[str, Any], given: tuple[list[str], list[Any]]) -> bool:
    """Whether ``parts`` begins with ``given``'s names, each with its very value."""
    names, values = given
    count = len(names)
    if len(parts) == count:
        return list(parts) == names and list(map(id, parts.values())) == list(map(id, values))
    return list(parts)[:count] == names and list(map(id, list(parts.values())[:count])) == list(
        map(id, values)
    )


def _added(
    headers: dict[str, Any],
    given: tuple[list[str], list[Any]],
    mutable: tuple[str, ...],
    changeable: list[str],
    message: RunMessage,
) -> dict[str, Any] | None:
    """The headers receivers added after the ``given`` ones, which they left as they were,
    in their order; None when they changed, removed or moved one of them."""
    count = len(given[0])
    if len(headers) < count or not _same_prefix(headers, given):
        return None
    # replaced values were found by identity; changes in place are found by value
    custom = message.headers
    skeleton_headers = message.skeleton.headers
    for name in mutable:
        if name not in custom and not same_value(headers[name], skeleton_headers[name]):
            return None
    for name in changeable:
        if not same_value(headers[name], custom[name]):
            return None
    if len(headers) == count:
        return {}
    return dict(list(headers.items())[count:])


def _same_entities(declare: list[Any] | None, entities: tuple[Any, ...] | None) -> bool:
    """Whether receivers left the list of entities to declare as it was given."""
    if declare is None or entities is None:
        return declare is None and entities is None
    return len(declare) == len(entities) and all(
        a is b for a, b in zip(declare, entities, strict=True)
    )
