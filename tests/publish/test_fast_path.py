"""The fast publish path (``celery_driftsafe.publish.fast_path``) sends the message Celery's own
``apply_async``/``send_task`` sends for the same run: every run here is published both ways
through a real Redis broker and the two raw envelopes are compared field by field (headers,
properties, body bytes, delivery info, the Redis list it lands on). Where it cannot be exact
it falls back to ``apply_async``, and a real worker executes what it publishes."""

from __future__ import annotations

import base64
import copy
import functools
import json
import pickle
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from celery import Celery, signals
from celery.utils.saferepr import saferepr
from hypothesis import given
from hypothesis import settings as examples
from hypothesis import strategies as st
from kombu import Exchange, Queue

from celery_driftsafe.beat import nodes
from celery_driftsafe.claim.claimers import ClaimedRun, claimer_for
from celery_driftsafe.models import PeriodicTask, Run, RunStatus
from celery_driftsafe.publish.argsrepr import display_form
from celery_driftsafe.publish.dispatcher import Dispatcher
from celery_driftsafe.task import DriftSafeTask
from celery_driftsafe.testing import FakeClock
from tests import settings as test_settings
from tests.support import rabbitmq_url
from tests.support.factories import interval_task
from tests.support.fast_path import (
    BROKER_URL,
    T0,
    claim,
    comparable,
    raw_messages,
    same_expiry,
)

pytestmark = pytest.mark.django_db(transaction=True)


def both_ways(
    app: Celery, settings: Any, runs: list[ClaimedRun], queue: str, clock: FakeClock
) -> tuple[list[Any], list[Any], Dispatcher]:
    """Publish ``runs`` with Celery's ``apply_async``, then (their claims restored) with the
    fast path; the raw envelopes of each."""
    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "FAST_PUBLISH": False}
    # Both count a message's time to live from the authority's now: in step with this
    # process's wall clock, they count from the same instants.
    clock.set(datetime.now(UTC))
    slow = Dispatcher(app, clock)
    assert len(slow.dispatch(runs).published) == len(runs)
    assert slow.fast.declined == len(runs)
    celery_sent = raw_messages(queue)
    Run.objects.filter(pk__in=[r.run_id for r in runs]).update(
        status=RunStatus.CLAIMED, dispatched_at=None
    )
    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "FAST_PUBLISH": True}
    clock.set(datetime.now(UTC))
    fast = Dispatcher(app, clock)
    assert len(fast.dispatch(runs).published) == len(runs)
    fast_sent = raw_messages(queue)
    return celery_sent, fast_sent, fast


@pytest.mark.parametrize("fast", [True, False], ids=["fast path", "apply_async"])
def test_a_time_to_live_counts_from_the_authoritys_now(
    make_app: Any, settings: Any, fast: bool
) -> None:
    """A beat whose wall clock is at least 15 s ahead of the time authority publishes runs
    that expire 10 s after their slot, 25 s after the authority's now: their time to live is
    25 s, on the fast path and through Celery's ``apply_async`` alike. Counted from the wall
    clock, as Celery does, it was at most 10 s, and 0 once the wall clock ran 10 s ahead:
    RabbitMQ drops such a message unless a consumer takes it at once."""
    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "FAST_PUBLISH": fast}
    app = make_app()
    runs = claim(expires_seconds=10)
    assert runs[0].expires_at == T0 + timedelta(seconds=10)
    dispatcher = Dispatcher(app, FakeClock(T0 - timedelta(seconds=15)))
    assert len(dispatcher.dispatch(runs).published) == 2
    assert dispatcher.fast.published == (2 if fast else 0)
    ttls = [
        int(m["properties"]["expiration"]) for _, m in raw_messages(app.conf.task_default_queue)
    ]
    # less by the time from the batch's reading to each message
    assert len(ttls) == 2 and all(24_000 < ttl <= 25_000 for ttl in ttls), ttls


def route_by_first_argument(
    name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **kw: Any
) -> dict[str, Any] | None:
    """A router that looks at the arguments: each task's message is routed on its own."""
    if args and args[0] == 40:
        return {"priority": 4}
    return None


CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (app configuration, periodic task fields)
    "registered task": ({}, {"task": "fast.add"}),
    "DriftSafeTask": ({}, {"task": "fast.safe"}),
    "name only (send_task)": ({}, {"task": "elsewhere.task", "kwargs": {"a": [1, "é"]}}),
    "task's own options": ({}, {"task": "fast.limited"}),
    "queue, priority, headers": (
        {},
        {
            "task": "fast.add",
            "queue": "{queue}-other",
            "priority": 7,
            "headers": {"tenant": "a", "n": 1},
        },
    ),
    "task_routes": (
        {"task_routes": {"fast.add": {"queue": "{queue}-routed", "priority": 2}}},
        {"task": "fast.add"},
    ),
    "pickle": (
        {"task_serializer": "pickle", "accept_content": ["pickle", "json"]},
        {"task": "fast.add"},
    ),
    "pickle, no arguments": (
        {"task_serializer": "pickle", "accept_content": ["pickle"]},
        {"task": "elsewhere.task", "args": [], "kwargs": {}},
    ),
    "gzip": ({"task_compression": "gzip"}, {"task": "fast.add"}),
    "no expiry": ({}, {"task": "fast.add", "expires_seconds": None, "__no_expiry": True}),
}


@pytest.mark.parametrize("case", CASES)
def test_the_fast_message_is_celerys_message(
    case: str, make_app: Callable[..., Celery], queue: str, settings: Any
) -> None:
    conf, fields = CASES[case]
    conf = json.loads(json.dumps(conf).replace("{queue}", queue))
    fields = json.loads(json.dumps(fields).replace("{queue}", queue))
    if fields.pop("__no_expiry", False):
        settings.DRIFTSAFE = {**settings.DRIFTSAFE, "RUN_EXPIRES_SECONDS": None}
    app = make_app(**conf)
    clock = FakeClock(T0)
    runs = claim(**fields)
    celery_sent, fast_sent, dispatcher = both_ways(app, settings, runs, queue, clock)
    assert dispatcher.fast.published == 2 and dispatcher.fast.declined == 0
    # every one of them written straight to the queue's Redis list (publish/redis_writer.py)
    assert dispatcher.fast.direct == 2
    assert len(celery_sent) == len(fast_sent) == 2
    for (key, celery_msg), (fast_key, fast_msg) in zip(celery_sent, fast_sent, strict=True):
        assert comparable(fast_key, fast_msg) == comparable(key, celery_msg)
        assert same_expiry(fast_msg, celery_msg)
    tags = [m["properties"]["delivery_tag"] for _, m in fast_sent]
    assert len(set(tags)) == 2 and {uuid.UUID(tag).version for tag in tags} == {4}
    headers = fast_sent[0][1]["headers"]
    assert headers["id"] == runs[0].celery_task_id
    assert headers["driftsafe_run_id"] == runs[0].run_id
    # where the beat takes run locks (the same in Celery's message: compared above)
    assert headers["driftsafe_locks"] == f"redis:{settings.DRIFTSAFE['KEY_PREFIX']}"
    if case == "no expiry":
        assert headers["expires"] is None
        assert "expiration" not in fast_sent[0][1]["properties"]
    else:
        assert headers["expires"] == runs[0].expires_at.isoformat()  # type: ignore[union-attr]
        assert int(fast_sent[0][1]["properties"]["expiration"]) > 80_000_000
    if case == "pickle":
        assert fast_sent[0][1]["content-type"] == "application/x-python-serialize"
        assert pickle.loads(base64.b64decode(fast_sent[0][1]["body"]))[0] == [1, 2]
    if case == "pickle, no arguments":
        assert pickle.loads(base64.b64decode(fast_sent[0][1]["body"]))[0] == ()
    if case == "gzip":
        assert headers["compression"] == "application/x-gzip"


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=6,
)


@pytest.mark.parametrize("conf", [{}, {"task_compression": "gzip"}], ids=["plain", "gzip"])
def test_a_spliced_envelope_is_the_text_put_writes_to_the_byte(
    make_app: Callable[..., Celery], queue: str, conf: dict[str, Any]
) -> None:
    """``RedisWriter.put_run`` (the envelope spliced into the shape of its skeleton's envelopes,
    made from the message's parts with markers) writes the very
    text of the envelope built with kombu's channel methods in kombu's JSON, to the same list,
    whatever the custom headers (any JSON values, any names, standard headers overridden), the
    display forms, the expiry and the reply address."""
    from celery_driftsafe.publish.fast_path import FastPublisher
    from celery_driftsafe.publish.message_parts import RunMessage
    from celery_driftsafe.publish.redis_writer import RedisWriter

    app = make_app(**conf)
    fast = FastPublisher(app)
    with app.producer_or_acquire() as producer:
        channel = producer.channel
        channel._next_delivery_tag = lambda: "the-delivery-tag"
        writer = RedisWriter(producer, channel, None)
        writer._next_tag = lambda: "the-delivery-tag"  # type: ignore[method-assign]

        @given(
            headers=st.dictionaries(
                st.sampled_from(["tenant", "n", "id", "task", "é", "driftsafe_run_id"])
                | st.text(max_size=6),
                _JSON_VALUES,
                max_size=4,
            ),
            reprs=st.tuples(st.text(max_size=10), st.text(max_size=10)),
            expiry=st.none() | st.floats(min_value=0, max_value=1e6),
            reply_to=st.text(max_size=8),
        )
        @examples(max_examples=150, deadline=None)
        def check(
            headers: dict[str, Any],
            reprs: tuple[str, str],
            expiry: float | None,
            reply_to: str,
        ) -> None:
            template = fast._template(
                repr((reprs, expiry is None)),  # a template of its own for these reprs
                "fast.add",
                [1, "é"],
                {},
                {},
                T0 if expiry is not None else None,
                lambda: reprs,
            )
            route = writer.route(template.skeleton)
            assert route is not None
            expires = T0.isoformat() if expiry is not None else None
            writer._lists = {}
            run = RunMessage(template, "the-id", reply_to, expires, expiry, dict(headers))
            key, message = writer.envelope(
                route, template.body, template.content_type, template.content_encoding, *run.parts()
            )
            writer.put_run(writer._shape(route, run), run)
            assert writer._lists == {key: [writer._dumps(message)]}

        try:
            check()
        finally:  # the channel goes back to the pool: as kombu made it
            del channel._next_delivery_tag


def test_delivery_tags_are_uuid4_texts_unique_across_writers(
    make_app: Callable[..., Celery],
) -> None:
    """The writer's delivery tags (counted, not drawn from os.urandom each) are canonical
    UUID4 texts as kombu's, none repeated within a writer or between two; a channel class
    with tags of its own gets kombu's path."""
    from kombu.transport import redis as kombu_redis

    from celery_driftsafe.publish.redis_writer import RedisWriter, _stock_redis_channel

    with make_app().producer_or_acquire() as producer:
        assert _stock_redis_channel(producer.channel)
        writers = [RedisWriter(producer, producer.channel, None) for _ in range(2)]
        tags = [writer._next_tag() for writer in writers for _ in range(5000)]
    assert len(set(tags)) == len(tags)
    assert {str(uuid.UUID(tag)) for tag in tags} == set(tags)
    assert {uuid.UUID(tag).version for tag in tags} == {4}

    class OwnTags(kombu_redis.Channel):
        def _next_delivery_tag(self) -> str:
            return "mine"

    assert not _stock_redis_channel(object.__new__(OwnTags))


def test_a_named_exchange_and_routing_key(
    make_app: Callable[..., Celery], queue: str, settings: Any
) -> None:
    """A task routed by exchange and routing key (no queue): the message goes through the
    exchange's binding, both ways."""
    app = make_app()
    bound = Queue(
        f"{queue}-bound", Exchange(f"{queue}-ex", type="direct"), routing_key=f"{queue}-rk"
    )
    with app.connection_for_write() as connection:
        bound(connection.default_channel).declare()
    runs = claim(task="fast.add", exchange=f"{queue}-ex", routing_key=f"{queue}-rk")
    celery_sent, fast_sent, dispatcher = both_ways(
        app, settings, runs, f"{queue}-bound", FakeClock(T0)
    )
    assert dispatcher.fast.published == 2
    assert dispatcher.fast.direct == 0  # a named exchange: kombu looks up its bindings
    assert [comparable(*m) for m in fast_sent] == [comparable(*m) for m in celery_sent]
    assert all(same_expiry(f[1], c[1]) for f, c in zip(fast_sent, celery_sent, strict=True))
    assert fast_sent[0][1]["properties"]["delivery_info"] == {
        "exchange": f"{queue}-ex",
        "routing_key": f"{queue}-rk",
    }


def test_with_a_global_key_prefix_the_messages_land_in_the_prefixed_lists(
    make_app: Callable[..., Celery], queue: str, settings: Any
) -> None:
    """kombu's ``global_keyprefix`` transport option: written straight to Redis, the message
    lands in the prefixed list, where Celery's lands."""
    prefix = f"{test_settings.RUN_PREFIX}-pfx-{uuid.uuid4().hex[:6]}-"
    app = make_app(broker_transport_options={"global_keyprefix": prefix})
    runs = claim(task="fast.add")
    celery_sent, fast_sent, dispatcher = both_ways(
        app, settings, runs, prefix + queue, FakeClock(T0)
    )
    assert dispatcher.fast.direct == 2
    assert [key for key, _ in fast_sent] == [prefix + queue] * 2
    assert [comparable(*m) for m in fast_sent] == [comparable(*m) for m in celery_sent]
    client = redis.Redis.from_url(BROKER_URL)
    client.delete(*client.keys(f"{prefix}*") or ["-"])
    client.close()


def test_a_queue_with_an_expiry_of_its_own_is_left_to_kombu(
    make_app: Callable[..., Celery], queue: str, settings: Any
) -> None:
    """A queue declared with ``x-expires``: kombu renews the expiry of its lists with every
    message, so its messages go through kombu."""
    app = make_app(task_queues=[Queue(queue, expires=600)])
    runs = claim(task="fast.add")
    celery_sent, fast_sent, dispatcher = both_ways(app, settings, runs, queue, FakeClock(T0))
    assert dispatcher.fast.published == 2 and dispatcher.fast.direct == 0
    assert [comparable(*m) for m in fast_sent] == [comparable(*m) for m in celery_sent]


def test_where_kombu_would_not_pipeline_it_publishes_through_kombu(
    make_app: Callable[..., Celery], queue: str, settings: Any
) -> None:
    """One message (kombu publishes it at once, with its retry), or a Redis client that
    retries writes (kombu then publishes one by one: a retried batch could land twice): not
    written straight to Redis, and still Celery's message."""
    app = make_app(broker_transport_options={"retry_on_timeout": True})
    runs = claim(task="fast.add")
    celery_sent, fast_sent, dispatcher = both_ways(app, settings, runs, queue, FakeClock(T0))
    assert dispatcher.fast.published == 2 and dispatcher.fast.direct == 0
    assert [comparable(*m) for m in fast_sent] == [comparable(*m) for m in celery_sent]
    Run.objects.update(status=RunStatus.CLAIMED, dispatched_at=None)
    single = Dispatcher(make_app(), FakeClock(T0))
    assert single.dispatch(runs[:1]).published == [runs[0].run_id]
    assert single.fast.published == 1 and single.fast.direct == 0
    assert [m["headers"]["id"] for _, m in raw_messages(queue)] == [runs[0].celery_task_id]


def test_a_write_redis_refuses_leaves_the_batch_claimed_for_the_outbox(
    make_app: Callable[..., Celery], queue: str
) -> None:
    """Redis refuses the batch's write (here a real ACL user without ``LPUSH``; the first
    message, which declares the queue, goes through kombu, and its write fails when the writer
    flushes it to keep the order): none of the batch counts as published, every run stays
    claimed under its task id, nothing is in the queue, and the next dispatch (Redis accepting
    again) publishes them once."""
    user = f"driftsafe-{uuid.uuid4().hex[:6]}"
    admin = redis.Redis.from_url(BROKER_URL)
    admin.execute_command("ACL", "SETUSER", user, "on", "nopass", "~*", "&*", "+@all", "-lpush")
    try:
        url = BROKER_URL.replace("redis://", f"redis://{user}:@", 1)
        refused_app = make_app(broker=url, broker_url=url)
        runs = claim(task="fast.add")
        dispatcher = Dispatcher(refused_app, FakeClock(T0))
        result = dispatcher.dispatch(runs)
        assert result.published == [] and sorted(result.deferred) == sorted(r.run_id for r in runs)
        assert set(Run.objects.values_list("status", flat=True)) == {RunStatus.CLAIMED}
        assert raw_messages(queue) == []
    finally:
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()
    accepted = Dispatcher(make_app(), FakeClock(T0))
    again = accepted.dispatch(runs)
    assert accepted.fast.direct >= 1  # the same batch, through the writer this time
    assert sorted(again.published) == sorted(r.run_id for r in runs)
    assert sorted(m["headers"]["id"] for _, m in raw_messages(queue)) == sorted(
        r.celery_task_id for r in runs
    )


def test_each_slot_gets_its_own_ids_and_an_edited_task_a_new_message(
    make_app: Callable[..., Celery], queue: str, settings: Any
) -> None:
    app = make_app()
    nodes.register("n1", T0)
    task = interval_task("t1", 60, anchor=T0, next_slot_at=T0, task="fast.add", args=[1, 2])
    dispatcher = Dispatcher(app, FakeClock(T0))
    dispatcher.dispatch(claimer_for().claim(T0, "n1").runs)
    task.args = [5, 5]
    task.save()
    dispatcher.dispatch(claimer_for().claim(T0 + timedelta(seconds=60), "n1").runs)
    sent = [m for _, m in raw_messages(queue)]
    assert dispatcher.fast.published == 2
    runs = list(Run.objects.order_by("slot"))
    assert [m["headers"]["id"] for m in sent] == [r.celery_task_id for r in runs]
    assert [m["properties"]["correlation_id"] for m in sent] == [r.celery_task_id for r in runs]
    assert [m["headers"]["root_id"] for m in sent] == [r.celery_task_id for r in runs]
    assert [m["headers"]["driftsafe_slot"] for m in sent] == [
        T0.isoformat(),
        (T0 + timedelta(seconds=60)).isoformat(),
    ]
    assert [json.loads(base64.b64decode(m["body"]))[0] for m in sent] == [[1, 2], [5, 5]]
    assert [m["headers"]["argsrepr"] for m in sent] == ["[1, 2]", "[5, 5]"]


def _normal(value: Any) -> Any:
    """What a receiver got, comparable between two publishes of one message (the time to
    live counts from the moment of publishing: set or not)."""
    if isinstance(value, dict):
        return {k: ("set" if k == "expiration" else _normal(v)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_normal(v) for v in value)
    return value


@pytest.mark.parametrize("conf", [{}, {"task_compression": "gzip"}], ids=["plain", "gzip"])
@pytest.mark.parametrize("task", ["fast.add", "fast.safe", "elsewhere.task"])
def test_receivers_of_the_publish_signals_get_celerys_parts_and_change_the_message(
    task: str,
    conf: dict[str, Any],
    make_app: Callable[..., Celery],
    queue: str,
    settings: Any,
) -> None:
    """Celery sends ``before_task_publish`` and ``after_task_publish`` from
    ``send_task_message`` with the message's parts, and a receiver may change the message
    (OpenTelemetry's stamps its headers): the fast path sends both signals with the parts
    Celery sends (compared, argument by argument, with what Celery's own path gives the same
    receivers), and what a receiver changes (a header, a property, the body's arguments)
    reaches the message, which equals Celery's. It used to step aside for any receiver."""
    app = make_app(**conf)
    got: list[tuple[str, dict[str, Any]]] = []

    def before(**kwargs: Any) -> None:
        kwargs.pop("signal")
        got.append(("before", _normal(copy.deepcopy(kwargs))))
        kwargs["headers"]["traced"] = kwargs["headers"]["id"][::-1]
        kwargs["headers"]["shadow"] = "shown-as"
        kwargs["properties"]["priority"] = 3
        kwargs["body"][1]["stamped"] = True

    def after(**kwargs: Any) -> None:
        kwargs.pop("signal")
        got.append(("after", _normal(copy.deepcopy(kwargs))))

    runs = claim(task=task, headers={"tenant": "a"})
    signals.before_task_publish.connect(before, weak=False)
    signals.after_task_publish.connect(after, weak=False)
    try:
        celery_sent, fast_sent, dispatcher = both_ways(app, settings, runs, queue, FakeClock(T0))
    finally:
        signals.before_task_publish.disconnect(before)
        signals.after_task_publish.disconnect(after)
    assert (dispatcher.fast.published, dispatcher.fast.declined) == (2, 0)
    for (key, celery_msg), (fast_key, fast_msg) in zip(celery_sent, fast_sent, strict=True):
        assert comparable(fast_key, fast_msg) == comparable(key, celery_msg)
        assert same_expiry(fast_msg, celery_msg)
    assert [m["headers"]["traced"] for _, m in fast_sent] == [r.celery_task_id[::-1] for r in runs]
    assert {m["headers"]["shadow"] for _, m in fast_sent} == {"shown-as"}
    assert {m["properties"]["priority"] for _, m in fast_sent} == {3}
    for _, message in fast_sent:
        raw = base64.b64decode(message["body"])
        assert json.loads(zlib.decompress(raw) if conf else raw)[1]["stamped"] is True
    assert [kind for kind, _ in got] == ["before", "after"] * 4
    assert got[4:] == got[:4]  # the fast path's receivers got what Celery's did


@pytest.mark.parametrize("task", ["fast.add", "fast.safe", "elsewhere.task"])
def test_a_message_whose_receivers_only_add_headers_is_written_straight_to_redis(
    task: str, make_app: Callable[..., Celery], queue: str, settings: Any
) -> None:
    """OpenTelemetry's receiver of ``before_task_publish`` adds a ``traceparent`` header and
    changes nothing else: the message is then the task's template with that header more,
    written straight to Redis as without receivers (it went through kombu, its body
    serialised again), and equals Celery's."""
    app = make_app()

    def before(headers: dict[str, Any], **kwargs: Any) -> None:
        headers["traceparent"] = f"00-{headers['id'].replace('-', '')}-00f067aa0ba902b7-01"

    runs = claim(task=task, headers={"tenant": "a"})
    signals.before_task_publish.connect(before, weak=False)
    try:
        celery_sent, fast_sent, dispatcher = both_ways(app, settings, runs, queue, FakeClock(T0))
    finally:
        signals.before_task_publish.disconnect(before)
    assert (dispatcher.fast.published, dispatcher.fast.direct) == (2, 2)
    for (key, celery_msg), (fast_key, fast_msg) in zip(celery_sent, fast_sent, strict=True):
        assert comparable(fast_key, fast_msg) == comparable(key, celery_msg)
        assert same_expiry(fast_msg, celery_msg)
    assert [m["headers"]["traceparent"][3:35] for _, m in fast_sent] == [
        r.celery_task_id.replace("-", "") for r in runs
    ]


@pytest.mark.parametrize(
    ("change", "direct"),
    [
        # an equal value of another type is another message: Celery's JSON writes ``false``
        (lambda headers, properties: headers.__setitem__("retries", False), 0),
        (lambda headers, properties: properties.__setitem__("reply_to", b"x".decode()), 0),
        # an equal value of the same type, another object: the same message, straight to Redis
        (lambda headers, properties: headers.__setitem__("lang", "".join(["p", "y"])), 2),
        (lambda headers, properties: headers.__setitem__("timelimit", [None, None]), 2),
        # a property renamed in its place: the values as they were, in their order
        (lambda headers, properties: _rename(properties, "reply_to", "x"), 0),
    ],
    ids=["bool-for-int", "other-reply-to", "equal-text", "equal-list", "renamed-property"],
)
def test_a_receiver_that_replaces_a_value_is_found_out_by_its_value(
    change: Callable[[dict[str, Any], dict[str, Any]], None],
    direct: int,
    make_app: Callable[..., Celery],
    queue: str,
    settings: Any,
) -> None:
    """Whether receivers changed the message is found first by identity (each value handed
    still there), then by value: a value replaced by another of the same type and value leaves
    the message as it was (written straight to Redis), any other replacement goes out as the
    receiver left it, as Celery's does."""
    app = make_app()

    def before(headers: dict[str, Any], properties: dict[str, Any], **kwargs: Any) -> None:
        change(headers, properties)

    runs = claim(task="fast.add")
    signals.before_task_publish.connect(before, weak=False)
    try:
        celery_sent, fast_sent, dispatcher = both_ways(app, settings, runs, queue, FakeClock(T0))
    finally:
        signals.before_task_publish.disconnect(before)
    assert (dispatcher.fast.published, dispatcher.fast.direct) == (2, direct)
    for (key, celery_msg), (fast_key, fast_msg) in zip(celery_sent, fast_sent, strict=True):
        assert comparable(fast_key, fast_msg) == comparable(key, celery_msg)
        assert same_expiry(fast_msg, celery_msg)


def _rename(parts: dict[str, Any], name: str, new_name: str) -> None:
    items = list(parts.items())
    parts.clear()
    parts.update((new_name if key == name else key, value) for key, value in items)


def test_a_receiver_that_changes_a_value_in_place_changes_its_message_only(
    make_app: Callable[..., Celery], queue: str, settings: Any
) -> None:
    """Celery builds each message's parts afresh, so a receiver of ``before_task_publish``
    may change a header's value in place (a stamp put in ``stamps``, a time limit in
    ``timelimit``) or the body's ``embed`` and only that message carries it: so with the fast
    path, whose tasks' messages share their parts' values. They leaked: the next message's
    receiver found the first one's stamp, and every later message carried it."""
    app = make_app()
    seen: list[Any] = []

    def before(headers: dict[str, Any], body: Any, **kwargs: Any) -> None:
        seen.append(copy.deepcopy((headers["stamps"], headers["timelimit"], body[2])))
        headers["stamps"]["seen"] = ["yes"]
        headers["timelimit"][0] = 60
        body[2]["callbacks"] = [{"task": "fast.add"}]

    runs = claim(task="fast.add")
    signals.before_task_publish.connect(before, weak=False)
    try:
        celery_sent, fast_sent, dispatcher = both_ways(app, settings, runs, queue, FakeClock(T0))
        fast_again = Dispatcher(app, FakeClock(datetime.now(UTC)))
        Run.objects.filter(pk__in=[r.run_id for r in runs]).update(
            status=RunStatus.CLAIMED, dispatched_at=None
        )
        assert len(fast_again.dispatch(runs).published) == 2
    finally:
        signals.before_task_publish.disconnect(before)
    assert dispatcher.fast.published == 2
    assert seen[:2] == [({}, [None, None], seen[0][2])] * 2
    assert seen[2:] == seen[:2] * 2
    for (key, celery_msg), (fast_key, fast_msg) in zip(celery_sent, fast_sent, strict=True):
        assert comparable(fast_key, fast_msg) == comparable(key, celery_msg)
    assert [m["headers"]["timelimit"] for _, m in raw_messages(queue)] == [[60, None]] * 2


def test_a_queue_a_receiver_adds_to_declare_is_declared(
    make_app: Callable[..., Celery], queue: str
) -> None:
    """With receivers, the fast path leaves out the queues the connection has declared, as
    without them; one a receiver adds to ``declare`` is declared (kombu binds it: Redis
    holds the binding), as from Celery's path."""
    app = make_app()
    extra = Queue(f"{queue}-extra", Exchange(f"{queue}-x"), routing_key="extra")

    def before(declare: list[Any], **kwargs: Any) -> None:
        if len(runs_seen) == 1:  # the second message: its queue already declared
            declare.append(extra)
        runs_seen.append(declare)

    runs_seen: list[Any] = []
    runs = claim(task="fast.add")
    signals.before_task_publish.connect(before, weak=False)
    try:
        dispatcher = Dispatcher(app, FakeClock(T0))
        assert len(dispatcher.dispatch(runs).published) == 2
    finally:
        signals.before_task_publish.disconnect(before)
    assert dispatcher.fast.published == 2
    client = redis.Redis.from_url(BROKER_URL)
    bound = client.smembers(f"_kombu.binding.{queue}-x")
    client.close()
    assert [b.decode().split("\x06\x16")[-1] for b in bound] == [f"{queue}-extra"]
    assert len(raw_messages(queue)) == 2


@pytest.mark.parametrize("what", ["setting off", "protocol 1"])
def test_where_the_fast_path_cannot_be_exact_it_falls_back(
    what: str, make_app: Callable[..., Celery], queue: str, settings: Any
) -> None:
    app = make_app(task_protocol=1) if what == "protocol 1" else make_app()
    if what == "setting off":
        settings.DRIFTSAFE = {**settings.DRIFTSAFE, "FAST_PUBLISH": False}
    runs = claim(task="fast.add")
    dispatcher = Dispatcher(app, FakeClock(T0))
    assert len(dispatcher.dispatch(runs).published) == 2
    assert (dispatcher.fast.published, dispatcher.fast.declined) == (0, 2)
    assert len(raw_messages(queue)) == 2


def test_an_option_outside_the_tasks_fields_is_refused_before_either_path(
    make_app: Callable[..., Celery], queue: str
) -> None:
    """The fast path takes every publish option the publisher's gate lets through (the task's
    own fields); one outside them (a captured message rewritten) is refused by the gate
    before either path, and the fast path on its own declines it too."""
    from celery_driftsafe.claim.outbox import message_headers
    from celery_driftsafe.core.validation import PUBLISH_OPTIONS
    from celery_driftsafe.publish.fast_path import FAST_OPTIONS, FastPublisher

    assert FAST_OPTIONS == PUBLISH_OPTIONS
    app = make_app()
    runs = claim(task="fast.add")
    runs[0].options["shadow"] = "shown-as"
    fast = FastPublisher(app)
    assert fast.active()
    assert "publish options other than" in str(fast.message(runs[0], message_headers(runs[0])))
    assert raw_messages(queue) == []
    dispatcher = Dispatcher(app, FakeClock(T0))
    result = dispatcher.dispatch(runs)
    assert list(result.failed) == [runs[0].run_id]
    assert "options: shadow" in result.failed[runs[0].run_id]
    assert (dispatcher.fast.published, dispatcher.fast.declined) == (1, 0)
    assert [m["headers"]["id"] for _, m in raw_messages(queue)] == [runs[1].celery_task_id]


def test_arguments_that_do_not_fit_the_task_fail_as_before(
    make_app: Callable[..., Celery], queue: str, settings: Any
) -> None:
    """Celery checks a registered task's arguments against its signature: the fast path
    leaves such a run to ``apply_async``, whose error is recorded."""
    app = make_app()
    runs = claim(task="fast.add", args=[1, 2, 3])
    result = Dispatcher(app, FakeClock(T0)).dispatch(runs)
    assert list(result.failed) == [runs[0].run_id] and result.published == [runs[1].run_id]
    assert "takes 2 positional arguments" in result.failed[runs[0].run_id]
    assert [m["headers"]["id"] for _, m in raw_messages(queue)] == [runs[1].celery_task_id]


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning"
)
def test_a_worker_executes_fast_path_messages(
    make_app: Callable[..., Celery], queue: str, settings: Any
) -> None:
    """A real (in-process) worker takes the fast path's messages: a plain task and a
    ``DriftSafeTask`` (which reads the run's headers and records the outcome)."""
    from celery.contrib.testing.worker import start_worker
    from django.db import connections

    app = make_app()
    done: list[tuple[str, int]] = []
    finished = threading.Event()

    @app.task(name="fast.record", shared=False)
    def record(x: int, y: int) -> None:
        done.append(("record", x + y))
        if len(done) >= 2:
            finished.set()

    @app.task(name="fast.record_safe", base=DriftSafeTask, shared=False)
    def record_safe(x: int, y: int) -> None:
        done.append(("safe", x + y))
        connections.close_all()  # the worker's thread is not Django's
        if len(done) >= 2:
            finished.set()

    nodes.register("n1", T0)
    interval_task("plain", 60, anchor=T0, next_slot_at=T0, task="fast.record", args=[1, 2])
    interval_task("safe", 60, anchor=T0, next_slot_at=T0, task="fast.record_safe", args=[20, 3])
    dispatcher = Dispatcher(app, FakeClock(T0))
    dispatcher.dispatch(claimer_for().claim(T0, "n1").runs)
    assert dispatcher.fast.published == 2
    with start_worker(
        app,
        pool="threads",
        concurrency=2,
        perform_ping_check=False,
        loglevel="WARNING",
        shutdown_timeout=30,
    ):
        assert finished.wait(60), done
        deadline = time.monotonic() + 30
        while (
            Run.objects.filter(task_name="fast.record_safe", status=RunStatus.SUCCEEDED).count()
            != 1
        ):
            assert time.monotonic() < deadline, list(Run.objects.values("task_name", "status"))
            time.sleep(0.05)
    assert sorted(done) == [("record", 3), ("safe", 23)]


# -- the arguments' display forms --------------------------------------------------------------

_scalars = (
    st.integers() | st.floats(allow_nan=False) | st.booleans() | st.none() | st.text(max_size=40)
)


def _nested(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return (
        _scalars
        | st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=4)
    )


_values = _nested(_nested(_scalars))  # containers two deep inside the arguments' own


@given(
    value=st.lists(_values, max_size=4) | st.dictionaries(st.text(max_size=8), _values, max_size=4),
    maxsize=st.sampled_from([1024, 60, 8]),
    maxlevels=st.sampled_from([3, 2, 5]),
)
@examples(max_examples=400, deadline=None)
def test_display_forms_are_celerys(value: Any, maxsize: int, maxlevels: int) -> None:
    """``argsrepr``/``kwargsrepr`` as Celery's ``saferepr`` writes them, for any arguments
    (the shortcut through ``repr`` applies to plain ones only)."""
    assert display_form(value, maxsize, maxlevels) == saferepr(value, maxsize, maxlevels=maxlevels)


def test_display_forms_of_plain_and_other_arguments() -> None:
    plain = {"n": 1, "name": "report é", "when": [1.5, None, True], "deep": {"a": [1, 2]}}
    assert display_form(plain, 1024, 3) == repr(plain) == saferepr(plain, 1024, maxlevels=3)
    quoted = ["it's", "tab\there", b"bytes"]
    assert display_form(quoted, 1024, 3) == saferepr(quoted, 1024, maxlevels=3) != repr(quoted)


def test_more_tasks_than_the_template_bound_still_get_their_own_messages(
    make_app: Callable[..., Celery],
    queue: str,
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from celery_driftsafe.publish import fast_path as fastpublish

    monkeypatch.setattr(fastpublish, "TEMPLATE_CACHE_SIZE", 2)
    app = make_app()
    nodes.register("n1", T0)
    for i in range(5):
        interval_task(f"t{i}", 60, anchor=T0, next_slot_at=T0, task="fast.add", args=[i, i])
    dispatcher = Dispatcher(app, FakeClock(T0))
    for wave in range(3):
        dispatcher.dispatch(claimer_for().claim(T0 + timedelta(seconds=60 * wave), "n1").runs)
    sent = [m for _, m in raw_messages(queue)]
    assert dispatcher.fast.published == 15 and len(dispatcher.fast._templates) <= 2
    assert sorted(json.loads(base64.b64decode(m["body"]))[0][0] for m in sent) == sorted(
        list(range(5)) * 3
    )
    assert all(
        m["headers"]["argsrepr"] == repr(json.loads(base64.b64decode(m["body"]))[0]) for m in sent
    )


def test_on_rabbitmq_with_publisher_confirms_the_message_is_celerys_too(
    settings: Any,
) -> None:
    """The same comparison on RabbitMQ (publisher confirms on): what a consumer gets, fields
    and body, both ways."""
    app = Celery("driftsafe-fast-amqp", broker=rabbitmq_url(), set_as_current=False)
    name = f"fast-amqp-{uuid.uuid4().hex[:8]}"
    app.conf.update(
        broker_transport_options={"confirm_publish": True},
        broker_connection_retry_on_startup=False,
        task_default_queue=name,
        task_queues=[Queue(name, queue_arguments={"x-max-priority": 9})],
    )
    runs = claim(task="elsewhere.task", priority=5, headers={"tenant": "b"})

    def received() -> list[dict[str, Any]]:
        out = []
        with app.connection_for_write() as connection:
            queue = Queue(name, queue_arguments={"x-max-priority": 9})(connection.default_channel)
            while (message := queue.get(no_ack=True)) is not None:
                properties = dict(message.properties)
                ttl = properties.pop("expiration", None)
                out.append(
                    {
                        "headers": message.headers,
                        "properties": properties,
                        "body": message.body,
                        "content_type": message.content_type,
                        "delivery_info": {
                            k: message.delivery_info.get(k) for k in ("exchange", "routing_key")
                        },
                        "ttl_ms": int(ttl) if ttl else None,
                    }
                )
        return out

    try:
        settings.DRIFTSAFE = {**settings.DRIFTSAFE, "FAST_PUBLISH": False}
        # both ways, the authority in step with this process's wall clock
        assert len(Dispatcher(app, FakeClock(datetime.now(UTC))).dispatch(runs).published) == 2
        celery_sent = received()
        Run.objects.update(status=RunStatus.CLAIMED, dispatched_at=None)
        settings.DRIFTSAFE = {**settings.DRIFTSAFE, "FAST_PUBLISH": True}
        dispatcher = Dispatcher(app, FakeClock(datetime.now(UTC)))
        assert len(dispatcher.dispatch(runs).published) == 2
        fast_sent = received()
    finally:
        with app.connection_for_write() as connection:
            connection.default_channel.queue_delete(name)
        app.close()
    assert dispatcher.fast.published == 2 and len(fast_sent) == 2
    for fast, celery in zip(fast_sent, celery_sent, strict=True):
        fast_ttl, celery_ttl = fast.pop("ttl_ms"), celery.pop("ttl_ms")
        assert fast == celery
        assert fast_ttl > 80_000_000 and abs(fast_ttl - celery_ttl) < 2000
    assert fast_sent[0]["properties"]["priority"] == 5
    assert fast_sent[0]["headers"]["tenant"] == "b"


# -- Celery is the oracle: what the fast path may not take for granted -------------------------


def _adding_a_header(function: Callable[..., Any], at: str) -> Callable[..., Any]:
    """A wrapper of Celery's or kombu's publishing as tracing integrations install them (on
    the class, with ``functools.wraps``): it adds the header ``traced`` to every message."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if at == "message":  # send_task_message(producer, name, message, ...)
            args[2][0]["traced"] = "yes"
        else:
            kwargs["headers"] = {**(kwargs.get("headers") or {}), "traced": "yes"}
        return function(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize(
    "wrapped", ["Task.apply_async", "Celery.send_task", "send_task_message", "Producer.publish"]
)
@pytest.mark.parametrize("task", ["fast.add", "fast.safe", "elsewhere.task"])
def test_a_wrapper_installed_over_celerys_publishing_runs_for_the_beats_messages(
    wrapped: str,
    task: str,
    make_app: Callable[..., Celery],
    queue: str,
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sentry's (Elastic APM's, OpenTracing's) integration replaces ``Task.apply_async`` or
    ``Celery.send_task`` on the class with a wrapper that adds its tracing headers: the beat's
    message carries them as Celery's does. The fast path steps aside for the tasks the wrapper
    concerns (a name only, published with ``send_task``, does not go through
    ``Task.apply_async``) and keeps the others. It compared ``type(task).apply_async is
    Task.apply_async``, true after such a patch: no message carried the header."""
    from celery.app.task import Task
    from kombu.messaging import Producer

    app = make_app()
    if wrapped == "send_task_message":
        amqp = app.amqp
        monkeypatch.setattr(
            amqp, "send_task_message", _adding_a_header(amqp.send_task_message, "message")
        )
    else:
        owner = {"Task": Task, "Celery": Celery, "Producer": Producer}[wrapped.split(".")[0]]
        name = wrapped.split(".")[1]
        monkeypatch.setattr(owner, name, _adding_a_header(getattr(owner, name), "kwargs"))
    runs = claim(task=task)
    celery_sent, fast_sent, dispatcher = both_ways(app, settings, runs, queue, FakeClock(T0))
    for (key, celery_msg), (fast_key, fast_msg) in zip(celery_sent, fast_sent, strict=True):
        assert comparable(fast_key, fast_msg) == comparable(key, celery_msg)
    concerned = wrapped != "Task.apply_async" or task != "elsewhere.task"
    assert [m["headers"].get("traced") for _, m in fast_sent] == ["yes" if concerned else None] * 2
    if wrapped == "Producer.publish":  # the fast path calls Producer.publish: kept
        assert dispatcher.fast.published == 2 and dispatcher.fast.direct == 0
    else:
        assert dispatcher.fast.published == (0 if concerned else 2)


def route_by_tenant(
    name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **kw: Any
) -> dict[str, Any] | None:
    """A router that reads the message's headers, as Celery passes them to routers."""
    tenant = (options.get("headers") or {}).get("tenant")
    return {"queue": tenant} if tenant else None


@pytest.mark.parametrize("router", ["route_by_tenant", "route_by_first_argument"])
def test_router_functions_get_celerys_options(
    router: str, make_app: Callable[..., Celery], queue: str, settings: Any
) -> None:
    """Celery asks the routers of ``task_routes`` with the publish options, the message's
    headers among them: a router on a header sends the message where Celery's ``send_task``
    does. The fast path asked routers once per task without the headers (the message went to
    the default queue); it now leaves tasks to Celery wherever a router is a function (plain
    maps and patterns keep the fast path: they read only the task's name)."""
    app = make_app(task_routes=[f"tests.publish.test_fast_path.{router}"])
    runs = claim(task="fast.add", headers={"tenant": f"{queue}-acme"})
    celery_sent, fast_sent, dispatcher = both_ways(app, settings, runs, queue, FakeClock(T0))
    for (key, celery_msg), (fast_key, fast_msg) in zip(celery_sent, fast_sent, strict=True):
        assert comparable(fast_key, fast_msg) == comparable(key, celery_msg)
    if router == "route_by_tenant":
        assert [key for key, _ in fast_sent] == [f"{queue}-acme"] * 2
    else:
        assert [m["properties"]["priority"] for _, m in fast_sent] == [0, 4]
    assert (dispatcher.fast.published, dispatcher.fast.declined) == (0, 2)


EDITS = {
    "a number to a boolean": ({"args": [1]}, {"args": [True]}),
    "a boolean to a number": ({"kwargs": {"flag": False}}, {"kwargs": {"flag": 0}}),
    "a whole number to a float": ({"args": [1, {"x": 2}]}, {"args": [1, {"x": 2.0}]}),
    "zero to minus zero": ({"args": [0.0]}, {"args": [-0.0]}),
    "the keys' order": ({"kwargs": {"a": 1, "b": 2}}, {"kwargs": {"b": 2, "a": 1}}),
}


@pytest.mark.parametrize("fast", [True, False], ids=["fast path", "apply_async"])
@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edit_that_changes_only_a_type_or_an_order_is_sent(
    edit: str, fast: bool, make_app: Callable[..., Celery], queue: str, settings: Any
) -> None:
    """``1 == True == 1.0`` and ``{"a": 1, "b": 2} == {"b": 2, "a": 1}``, but Celery's message
    is not the same (``[true]``, ``'[True]'``): after such an edit the next message is the
    one Celery sends for the new arguments (its body, and display forms written from them).
    Templates and display forms were reused while the arguments compared equal: the old
    body went out until the beat restarted."""
    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "FAST_PUBLISH": fast}
    before, after = EDITS[edit]
    app = make_app()
    nodes.register("n1", T0)
    task = interval_task("t1", 60, anchor=T0, next_slot_at=T0, task="elsewhere.task", **before)
    dispatcher = Dispatcher(app, FakeClock(T0))
    dispatcher.dispatch(claimer_for().claim(T0, "n1").runs)
    for field_name, value in after.items():
        setattr(task, field_name, value)
    task.save()
    runs = claimer_for().claim(T0 + timedelta(seconds=60), "n1").runs
    dispatcher.dispatch(runs)
    assert dispatcher.fast.published == (2 if fast else 0)
    first, second = (m for _, m in raw_messages(queue))
    # the oracle: Celery's own send_task with the run's arguments (as the database gave them)
    app.send_task("elsewhere.task", args=runs[0].args, kwargs=runs[0].kwargs, queue=queue)
    ((_, celery_msg),) = raw_messages(queue)
    assert base64.b64decode(second["body"]) == base64.b64decode(celery_msg["body"])
    # PostgreSQL's jsonb keeps neither a dict's key order nor a minus zero: no edit there
    if test_settings.TEST_DB != "postgres" or edit not in ("the keys' order", "zero to minus zero"):
        assert base64.b64decode(second["body"]) != base64.b64decode(first["body"])
    for name in ("argsrepr", "kwargsrepr"):
        assert second["headers"][name] == celery_msg["headers"][name]


@pytest.mark.parametrize("fast", [True, False], ids=["fast path", "apply_async"])
def test_every_message_goes_to_its_own_tasks_queue_whatever_the_cache_keeps(
    fast: bool,
    make_app: Callable[..., Celery],
    queue: str,
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With more tasks than the template cache holds (here one), the skeletons of the tasks
    it does not keep are freed after their message is built and CPython reuses their memory:
    the Redis writer's routes, kept by ``id(skeleton)``, sent later tasks to an earlier
    task's queue. Each message lands on its own task's queue."""
    from celery_driftsafe.publish import fast_path as fastpublish

    monkeypatch.setattr(fastpublish, "TEMPLATE_CACHE_SIZE", 1)
    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "FAST_PUBLISH": fast}
    app = make_app()
    nodes.register("n1", T0)
    for i in range(40):
        interval_task(
            f"t{i}",
            60,
            anchor=T0,
            next_slot_at=T0,
            task="fast.add",
            args=[i, i],
            queue=f"{queue}-{i}",
        )
    dispatcher = Dispatcher(app, FakeClock(T0))
    # the first wave declares the queues (through kombu), the next ones are written to Redis
    for wave in range(3):
        runs = claimer_for().claim(T0 + timedelta(seconds=60 * wave), "n1").runs
        assert len(dispatcher.dispatch(runs).published) == 40
    sent = raw_messages(queue)
    assert len(sent) == 120 and dispatcher.fast.published == (120 if fast else 0)
    assert dispatcher.fast.direct == (80 if fast else 0)
    for key, message in sent:
        (i, _) = json.loads(base64.b64decode(message["body"]))[0]
        assert key == f"{queue}-{i}", (key, i)


def test_time_limits_celery_refuses_fail_the_run_on_both_paths(
    make_app: Callable[..., Celery], queue: str, settings: Any
) -> None:
    """Celery's ``apply_async`` refuses a task whose soft time limit exceeds its time limit
    (``ValueError``): its runs are recorded failed with Celery's reason on either path, and
    the round goes on. The fast path published them; the slow path retried them for minutes
    as if the broker had refused them."""
    app = make_app()

    @app.task(name="fast.bad_limits", shared=False, time_limit=10, soft_time_limit=20)
    def bad_limits() -> None:
        """Never runs."""

    with pytest.raises(ValueError, match="soft_time_limit") as celerys:
        bad_limits.apply_async()
    for fast in (True, False):
        settings.DRIFTSAFE = {**settings.DRIFTSAFE, "FAST_PUBLISH": fast}
        Run.objects.all().delete()
        PeriodicTask.objects.all().delete()
        nodes.register("n1", T0)
        interval_task("bad", 60, anchor=T0, next_slot_at=T0, task="fast.bad_limits")
        interval_task("good", 60, anchor=T0, next_slot_at=T0, task="fast.add", args=[1, 2])
        runs = {r.task_name: r for r in claimer_for().claim(T0, "n1").runs}
        result = Dispatcher(app, FakeClock(T0)).dispatch(list(runs.values()))
        assert result.published == [runs["fast.add"].run_id] and not result.refused
        assert str(celerys.value) in result.failed[runs["fast.bad_limits"].run_id]
        failed = Run.objects.get(pk=runs["fast.bad_limits"].run_id)
        assert failed.status == RunStatus.FAILED and str(celerys.value) in failed.error
        assert [m["headers"]["task"] for _, m in raw_messages(queue)] == ["fast.add"]


@pytest.mark.parametrize("fast", [True, False], ids=["fast path", "apply_async"])
@pytest.mark.parametrize("task", ["fast.add", "elsewhere.task"])
def test_a_task_without_arguments_shows_them_as_celerys_beat_does(
    task: str, fast: bool, make_app: Callable[..., Celery], queue: str, settings: Any
) -> None:
    """Celery's beat publishes an entry without arguments with ``args=[]``, which Celery's
    message shows as ``argsrepr '()'`` (``as_task_v2`` takes no arguments as ``()``): so do
    both paths, which showed ``'[]'``."""
    from celery.beat import ScheduleEntry, Scheduler

    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "FAST_PUBLISH": fast}
    app = make_app()
    if task == "fast.add":
        app.tasks["fast.add"].typing = False  # no arguments for a task of two
    nodes.register("n1", T0)
    interval_task("t1", 60, anchor=T0, next_slot_at=T0, task=task, args=[], kwargs={})
    dispatcher = Dispatcher(app, FakeClock(T0))
    assert len(dispatcher.dispatch(claimer_for().claim(T0, "n1").runs).published) == 1
    ((_, message),) = raw_messages(queue)
    # the oracle: Celery's own beat, for a beat_schedule entry without arguments
    beat = Scheduler(app, lazy=True)
    beat.apply_async(ScheduleEntry(name="t1", task=task, app=app), advance=False)
    ((_, celery_msg),) = raw_messages(queue)
    assert celery_msg["headers"]["argsrepr"] == "()"
    assert (message["headers"]["argsrepr"], message["headers"]["kwargsrepr"]) == (
        celery_msg["headers"]["argsrepr"],
        celery_msg["headers"]["kwargsrepr"],
    )
    assert base64.b64decode(message["body"]) == base64.b64decode(celery_msg["body"])
    assert dispatcher.fast.published == int(fast)
