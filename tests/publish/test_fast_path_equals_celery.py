"""Every message a beat sends is the one Celery's own beat would send for the same entry:
a differential, property-based test whose oracle is Celery itself.

Generated Celery configurations (serializer, compression, routers, missing queues, Redis
priority steps, queue order, key prefix, extended results) by task options (serializer,
compression, time limits, ignore_result, expiry, a shadow name) by row contents (arguments,
keyword arguments, queue, priority, headers) by edits of a row. For each, the beat's
publisher (``Dispatcher._publish_batch``: the fast path with its direct Redis writer where it
applies, Celery's ``apply_async`` where it steps aside) publishes a batch of runs, and
Celery's beat (``celery.beat.Scheduler.apply_async``, the very method ``celery beat`` calls
for an entry) publishes the same entries with the same task ids, expiries and headers.
The raw broker messages (Redis: the list entries, read with a Redis client; RabbitMQ: what
``basic_get`` returns) must be equal field by field, except what differs per message by
nature (docs/reference/settings.md, "The fast publish path"):

- the delivery tag (kombu draws one per message);
- the message's time to live (``expiration``): the beat counts it from the time authority's
  now, Celery from the wall clock, each at its moment of publishing (equal within the time
  between the two publishes, measured);
- this package's own headers (``driftsafe_*``, docs/reference/headers.md);
- an ``expires`` header Celery computes from the wall clock (a task's relative ``expires``):
  the same instant within that time too.

Nothing of this package's own message building is used as the oracle.
"""

from __future__ import annotations

import base64
import json
import math
import re
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from celery import Celery, Task
from celery.beat import ScheduleEntry, Scheduler
from celery.exceptions import CDeprecationWarning
from hypothesis import HealthCheck, given
from hypothesis import settings as examples
from hypothesis import strategies as st
from kombu import Connection, Queue

from celery_driftsafe.claim.outbox import ClaimedRun
from celery_driftsafe.publish.dispatcher import Dispatcher, DispatchResult
from celery_driftsafe.task import DriftSafeTask
from celery_driftsafe.testing import FakeClock
from tests import settings as test_settings
from tests.skip_guard import configuration
from tests.support import rabbitmq_url

pytestmark = pytest.mark.django_db(transaction=True)

#: The generated examples run on one pass (SQLite's, which always runs and is not the run's
#: longest): the messages are built from a claimed run's values, which both publishers are
#: handed alike, so the database under the claim changes neither side (the claim tests hold
#: the rows equal on every database). What the pass does change is the time authority (Redis
#: here, the database elsewhere), which sets only the time to live, compared within the time
#: between the two publishes. They took 110 s of a core on each of the three passes.
ONE_PASS = pytest.mark.skipif(
    test_settings.TEST_DB != "sqlite",
    reason=configuration("the generated examples run on the SQLite pass"),
)

REDIS_URL = f"{test_settings.REDIS_SERVER}/{test_settings.REDIS_DB + 2}"


SERIALIZERS = ["json", "pickle", "yaml", "msgpack"]  # yaml and msgpack: the test group
COMPRESSIONS = [None, "zlib", "bzip2"]


# -- Routers -------------------------------------------------------------------------------------


def _router(kind: str, prefix: str) -> Any:
    """A ``task_routes`` of ``kind`` routing to the queues of ``prefix``."""
    if kind == "dict":
        return {"diff.plain": {"queue": f"{prefix}-a"}, "diff.elsewhere": f"{prefix}-b"}
    if kind == "glob":
        return {"diff.*": {"queue": f"{prefix}-a", "priority": 3}}
    if kind == "regex":
        return [{re.compile(r"diff\.(plain|safe)"): {"queue": f"{prefix}-b"}}]

    def by_name(
        name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **kw: Any
    ) -> Any:
        return f"{prefix}-a" if name.endswith("safe") else None

    def by_args(
        name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **kw: Any
    ) -> Any:
        if args and args[0] == 1:
            return {"queue": f"{prefix}-b", "priority": 2}
        return None

    def by_kwargs(
        name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **kw: Any
    ) -> Any:
        return {"queue": f"{prefix}-a"} if "k" in (kwargs or {}) else None

    def by_options(
        name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **kw: Any
    ) -> Any:
        return {"queue": f"{prefix}-b"} if options.get("priority") == 5 else None

    def by_headers(
        name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **kw: Any
    ) -> Any:
        # what the beat's messages carry (Celery's marks them), or a tenant's
        headers = options.get("headers") or {}
        if headers.get("celery_beat_task") or headers.get("tenant") == "x":
            return {"queue": f"{prefix}-a", "priority": 8}
        return None

    functions = {
        "name": by_name,
        "args": by_args,
        "kwargs": by_kwargs,
        "options": by_options,
        "headers": by_headers,
    }
    return [functions[kind]]


ROUTERS = ["none", "dict", "glob", "regex", "name", "args", "kwargs", "options"]
ROUTERS.append("headers")
ROUTER_FUNCTIONS = {"name", "args", "kwargs", "options", "headers"}


# -- Configurations ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    broker: str
    serializer: str
    compression: str | None
    router: str
    create_missing_queues: bool
    result_extended: bool
    priority_steps: tuple[int, ...] | None
    queue_order_strategy: str | None
    global_keyprefix: str | None
    #: A wrapper on ``celery.Task.apply_async`` itself, as instrumentation puts there.
    wrapped_apply_async: bool = False


def configurations(broker: str) -> st.SearchStrategy[Config]:
    redis_only = broker == "redis"
    return st.builds(
        Config,
        broker=st.just(broker),
        serializer=st.sampled_from(SERIALIZERS),
        compression=st.sampled_from(COMPRESSIONS),
        router=st.sampled_from(ROUTERS),
        create_missing_queues=st.booleans(),
        result_extended=st.booleans(),
        priority_steps=(
            st.none() | st.sampled_from([(0, 3, 6, 9), tuple(range(10)), (0, 5)])
            if redis_only
            else st.none()
        ),
        queue_order_strategy=(
            st.none() | st.sampled_from(["priority", "round_robin", "sorted"])
            if redis_only
            else st.none()
        ),
        global_keyprefix=st.none() | st.just("gk:") if redis_only else st.none(),
        wrapped_apply_async=st.booleans(),
    )


@dataclass(frozen=True)
class TaskOptions:
    """A task as the project registers it (or none: ``send_task`` by name)."""

    kind: str  # plain, safe (DriftSafeTask), shadowed, elsewhere (not registered)
    serializer: str | None = None
    compression: str | None = None
    time_limit: int | None = None
    soft_time_limit: int | None = None
    ignore_result: bool | None = None
    #: "relative" (seconds from publishing) or "absolute" (an instant), or None.
    expires: str | None = None
    queue: str | None = None


def _limits() -> st.SearchStrategy[tuple[int | None, int | None]]:
    return st.tuples(st.none() | st.integers(1, 100), st.none() | st.integers(1, 100))


@st.composite
def task_options(draw: Any) -> TaskOptions:
    kind = draw(st.sampled_from(["plain", "safe", "shadowed", "elsewhere"]))
    if kind == "elsewhere":
        return TaskOptions(kind)
    time_limit, soft = draw(_limits())
    return TaskOptions(
        kind,
        serializer=draw(st.none() | st.sampled_from(SERIALIZERS)),
        compression=draw(st.sampled_from(COMPRESSIONS)),
        time_limit=time_limit,
        soft_time_limit=soft,
        ignore_result=draw(st.none() | st.booleans()),
        expires=draw(st.sampled_from([None, "relative", "absolute"])),
        queue=draw(st.sampled_from([None, "a", "c"])),
    )


# -- Rows and edits ------------------------------------------------------------------------------

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(["é", "日本語", "🙂", "'\"\\", ""])
)
JSON_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=5,
)
LARGE = st.sampled_from(["x" * 5000, "é" * 3000, list(range(300))])


@dataclass(frozen=True)
class Row:
    """A periodic task's message fields: what its runs are published with."""

    args: list[Any]
    kwargs: dict[str, Any]
    queue: str | None
    priority: int | None
    headers: dict[str, Any]


@st.composite
def rows(draw: Any) -> Row:
    args = draw(st.lists(JSON_VALUES, max_size=3) | st.lists(LARGE, min_size=1, max_size=1))
    if draw(st.booleans()):
        args = [1, *args]  # what the router of arguments routes elsewhere
    kwargs = draw(st.dictionaries(st.sampled_from(["k", "a", "é", "long_name"]), JSON_VALUES))
    headers = draw(
        st.dictionaries(
            st.sampled_from(["tenant", "x-trace", "ü"]),
            st.sampled_from(["x", "y"]) | JSON_VALUES,  # "x": the router of headers' tenant
            max_size=2,
        )
    )
    return Row(
        args=args,
        kwargs=kwargs,
        queue=draw(st.sampled_from([None, "a", "b", "c"])),
        priority=draw(st.none() | st.integers(0, 9)),
        headers=headers,
    )


def _to_true(value: Any) -> Any:
    """``value`` with its 1s and 0s turned into booleans (equal in Python, not in a message)."""
    if type(value) is int and value in (0, 1):
        return bool(value)
    if isinstance(value, list):
        return [_to_true(item) for item in value]
    if isinstance(value, dict):
        return {key: _to_true(item) for key, item in value.items()}
    return value


EDITS = ["none", "key_order", "args", "priority", "headers", "type_only"]


def edited(row: Row, edit: str, new: Row) -> Row:
    """``row`` after ``edit`` (``new`` gives the new values)."""
    if edit == "key_order":
        return Row(
            row.args, dict(reversed(row.kwargs.items())), row.queue, row.priority, row.headers
        )
    if edit == "type_only":  # ``row`` starts with 1, 0 (see :func:`_check`)
        return Row(_to_true(row.args), _to_true(row.kwargs), row.queue, row.priority, row.headers)
    if edit == "args":
        return Row(new.args, new.kwargs, row.queue, row.priority, row.headers)
    if edit == "priority":
        return Row(row.args, row.kwargs, row.queue, new.priority, row.headers)
    if edit == "headers":
        return Row(row.args, row.kwargs, row.queue, row.priority, new.headers)
    return row


# -- Apps, one per configuration -----------------------------------------------------------------


class Apps:
    """A Celery app per configuration, with its queues' prefix; closed at the end."""

    def __init__(self) -> None:
        self.apps: dict[Config, tuple[Celery, str, Dispatcher]] = {}

    def get(self, config: Config) -> tuple[Celery, str, Dispatcher]:
        if config not in self.apps:
            prefix = f"{test_settings.RUN_PREFIX}-dq-{uuid.uuid4().hex[:10]}"
            broker = REDIS_URL if config.broker == "redis" else rabbitmq_url()
            app = Celery("driftsafe-differential", broker=broker, set_as_current=False)
            transport: dict[str, Any] = {}
            if config.priority_steps is not None:
                transport["priority_steps"] = list(config.priority_steps)
            if config.queue_order_strategy is not None:
                transport["queue_order_strategy"] = config.queue_order_strategy
            if config.global_keyprefix is not None:
                transport["global_keyprefix"] = config.global_keyprefix
            if config.broker == "rabbitmq":
                # a publish returns once the broker has the message: read at once from another
                # connection, an unconfirmed one may not be in its queue yet (seen in CI: the
                # fast path's four messages read as none)
                transport["confirm_publish"] = True
            app.conf.update(
                task_default_queue=f"{prefix}-default",
                task_queues=[Queue(f"{prefix}-default"), Queue(f"{prefix}-a")],
                task_create_missing_queues=config.create_missing_queues,
                task_serializer=config.serializer,
                accept_content=SERIALIZERS,
                task_compression=config.compression,
                result_extended=config.result_extended,
                task_routes=None if config.router == "none" else _router(config.router, prefix),
                broker_transport_options=transport,
                broker_connection_retry_on_startup=False,
                broker_connection_max_retries=1,
            )
            self.apps[config] = (app, prefix, Dispatcher(app, FakeClock(datetime.now(UTC))))
        return self.apps[config]

    def close(self) -> None:
        for config, (app, prefix, _) in self.apps.items():
            if config.broker == "rabbitmq":
                with app.connection_for_write() as connection:
                    channel = connection.default_channel
                    for queue in _queue_names(prefix):
                        channel.queue_delete(queue)
            app.close()


def _queue_names(prefix: str) -> list[str]:
    return [f"{prefix}-{suffix}" for suffix in ("default", "a", "b", "c")]


class Shadowed(Task):
    def shadow_name(self, args: Any, kwargs: Any, options: Any) -> str:
        return f"shadow-of-{self.name}"


#: A task's own absolute expiry (a day ahead: RabbitMQ refuses a time to live beyond 2**32 ms).
EXPIRES_AT = datetime.now(UTC).replace(microsecond=0) + timedelta(days=1)


def task_name(app: Celery, prefix: str, options: TaskOptions) -> str:
    """Register the task of ``options`` on ``app`` (once); its name."""
    base_names = {"plain": "diff.plain", "safe": "diff.safe", "shadowed": "diff.shadowed"}
    if options.kind == "elsewhere":
        return "diff.elsewhere"
    name = f"{base_names[options.kind]}-{abs(hash(options)) % 10**8}"
    if name in app.tasks:
        return name
    decorator_options: dict[str, Any] = {}
    for field in ("serializer", "compression", "time_limit", "soft_time_limit", "ignore_result"):
        value = getattr(options, field)
        if value is not None:
            decorator_options[field] = value
    if options.expires == "relative":
        decorator_options["expires"] = 3600
    elif options.expires == "absolute":
        decorator_options["expires"] = EXPIRES_AT
    if options.queue is not None:
        decorator_options["queue"] = f"{prefix}-{options.queue}"
    base = {"plain": Task, "safe": DriftSafeTask, "shadowed": Shadowed}[options.kind]

    def body(*args: Any, **kwargs: Any) -> None:
        return None

    with warnings.catch_warnings():
        # a task's own queue is deprecated in Celery 5 (for task_routes), not gone
        warnings.simplefilter("ignore", CDeprecationWarning)
        app.task(name=name, base=base, shared=False, **decorator_options)(body)
    return name


# -- Publishing both ways and reading what the broker got ---------------------------------------


def runs_of(
    name: str,
    row: Row,
    prefix: str,
    row_id: int,
    expires_at: datetime | None,
    count: int,
    version: int = 0,
) -> list[ClaimedRun]:
    """``count`` runs of ``row`` (``version`` of it: run ids differ from the other version's,
    as in a beat's batch, where no two runs share one)."""
    options: dict[str, Any] = {}
    if row.queue is not None:
        options["queue"] = f"{prefix}-{row.queue}"
    if row.priority is not None:
        options["priority"] = row.priority
    if row.headers:
        options["headers"] = dict(row.headers)
    slot = datetime(2026, 1, 1, tzinfo=UTC)
    return [
        ClaimedRun(
            run_id=row_id * 100 + version * 10 + i,
            periodic_task_id=row_id,
            task_name=name,
            slot=slot + timedelta(minutes=i),
            celery_task_id=str(uuid.uuid4()),
            fencing_token=0,
            args=list(row.args),
            kwargs=dict(row.kwargs),
            options=options,
            claimed_by="n1",
            expires_at=expires_at,
        )
        for i in range(count)
    ]


def beat_publish(app: Celery, runs: list[ClaimedRun]) -> list[bool | str]:
    """Celery's beat publishing each run as the entry it would be: ``Scheduler.apply_async``
    (which calls the task's ``apply_async`` or ``send_task`` itself); whether each went out."""
    scheduler = Scheduler(app, lazy=True)
    sent: list[bool | str] = []
    with app.producer_or_acquire() as producer:
        for run in runs:
            options = dict(run.options)
            options["headers"] = dict(options.get("headers") or {})
            options["task_id"] = run.celery_task_id
            if run.expires_at is not None:
                options["expires"] = run.expires_at
            entry = ScheduleEntry(
                name=f"entry-{run.periodic_task_id}",
                task=run.task_name,
                args=run.args,
                kwargs=run.kwargs,
                options=options,
                app=app,
            )
            try:
                scheduler.apply_async(entry, producer=producer, advance=False)
            except Exception as exc:
                sent.append(f"{exc.__cause__ or exc!r}")
            else:
                sent.append(True)
    return sent


def driftsafe_publish(dispatcher: Dispatcher, runs: list[ClaimedRun]) -> list[bool]:
    """The beat's publisher (fast path and all) publishing ``runs`` as one batch."""
    dispatcher.clock.set(datetime.now(UTC))  # type: ignore[attr-defined]
    result = DispatchResult()
    fast = dispatcher.fast if dispatcher.fast.active() else None
    with dispatcher.app.producer_or_acquire() as producer:
        dispatcher._publish_batch(runs, producer, result, fast)
    return [run.run_id in result.published for run in runs]


def received(app: Celery, config: Config, prefix: str) -> list[tuple[str, dict[str, Any]]]:
    """Every message of the configuration's queues, oldest first per queue, as comparable
    records with the queue (Redis: the list) they were in."""
    if config.broker == "redis":
        return _redis_messages(prefix)
    out = []
    with Connection(rabbitmq_url()) as connection:
        channel = connection.default_channel
        for queue in _queue_names(prefix):
            channel.queue_declare(queue, durable=True, auto_delete=False)
            while (message := channel.basic_get(queue, no_ack=True)) is not None:
                properties = dict(message.properties)
                # the headers again (compared as the headers)
                assert properties.pop("application_headers") == message.headers
                out.append(
                    (
                        queue,
                        {
                            "headers": dict(message.headers),
                            "properties": properties,
                            "body": message.body,
                            "content_type": message.content_type,
                            "content_encoding": message.content_encoding,
                            "delivery_info": {
                                key: message.delivery_info.get(key)
                                for key in ("exchange", "routing_key")
                            },
                        },
                    )
                )
    return out


def _redis_messages(prefix: str) -> list[tuple[str, dict[str, Any]]]:
    client = redis.Redis.from_url(REDIS_URL)
    out = []
    try:
        for key in sorted(k.decode() for k in client.keys(f"*{prefix}*")):
            if client.type(key) != b"list":
                continue
            while (raw := client.rpop(key)) is not None:
                envelope = json.loads(raw)
                envelope["body"] = base64.b64decode(envelope["body"])
                out.append((key, envelope))
    finally:
        client.close()
    return out


def _drop_driftsafe_headers(headers: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in headers.items() if not k.startswith("driftsafe_")}


def assert_same(
    fast: list[tuple[str, dict[str, Any]]],
    celery: list[tuple[str, dict[str, Any]]],
    apart_ms: int = 0,
) -> None:
    """Field by field, but what differs per message by nature (the module's docstring).
    ``apart_ms``: how far apart the two publishes were, at most (a time to live, counted from
    each publish, differs by that)."""
    assert [queue for queue, _ in fast] == [queue for queue, _ in celery]
    for (queue, ours), (_, theirs) in zip(fast, celery, strict=True):
        ours, theirs = (
            json.loads(json.dumps(ours, default=repr)),
            json.loads(json.dumps(theirs, default=repr)),
        )
        for message in (ours, theirs):
            message["headers"] = _drop_driftsafe_headers(message["headers"])
            message["properties"].pop("delivery_tag", None)
        ttls = [m["properties"].pop("expiration", None) for m in (ours, theirs)]
        assert (ttls[0] is None) == (ttls[1] is None), (queue, ttls)
        if ttls[0] is not None:
            # both count down to one expiry from their own publish; rounding to the ms
            assert abs(int(ttls[0]) - int(ttls[1])) <= apart_ms + 1, (queue, ttls, apart_ms)
        expires = [m["headers"].pop("expires", None) for m in (ours, theirs)]
        assert (expires[0] is None) == (expires[1] is None), (queue, expires)
        if expires[0] is not None:
            instants = [datetime.fromisoformat(text) for text in expires]
            apart = timedelta(milliseconds=apart_ms + 1)
            assert abs(instants[0] - instants[1]) <= apart, (queue, expires, apart_ms)
        assert ours["headers"] == theirs["headers"], queue
        assert ours["properties"] == theirs["properties"], queue
        assert ours == theirs, queue


# -- The property --------------------------------------------------------------------------------


@contextmanager
def wrapped_apply_async(on: bool) -> Iterator[None]:
    """``celery.Task.apply_async`` wrapped, as tracing instrumentation does (a header more),
    while ``on``."""
    if not on:
        yield
        return
    original = Task.apply_async

    def traced(self: Task, args: Any = None, kwargs: Any = None, *rest: Any, **options: Any) -> Any:
        options["headers"] = {**(options.get("headers") or {}), "x-traced": self.name}
        return original(self, args, kwargs, *rest, **options)

    Task.apply_async = traced  # type: ignore[method-assign]
    try:
        yield
    finally:
        Task.apply_async = original  # type: ignore[method-assign]


def _check(
    apps: Apps,
    settings: Any,
    config: Config,
    tasks: list[tuple[TaskOptions, Row, str, Row, bool]],
) -> None:
    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "FAST_PUBLISH": True}
    app, prefix, dispatcher = apps.get(config)
    received(app, config, prefix)  # nothing left from an earlier, failed example
    versions: list[list[ClaimedRun]] = [[], []]
    for row_id, (options, row, edit, new, expiring) in enumerate(tasks, start=1):
        name = task_name(app, prefix, options)
        expires_at = datetime.now(UTC) + timedelta(hours=1) if expiring else None
        if edit == "type_only":
            row = Row([1, 0, *row.args], row.kwargs, row.queue, row.priority, row.headers)
        versions[0].extend(runs_of(name, row, prefix, row_id, expires_at, 2))
        versions[1].extend(
            runs_of(name, edited(row, edit, new), prefix, row_id, expires_at, 2, version=1)
        )
    # each version alone, then each task's two versions in turn in one batch (on Redis, one
    # writer for them all)
    batches = [*versions, [run for pair in zip(*versions, strict=True) for run in pair]]
    with wrapped_apply_async(config.wrapped_apply_async):
        for batch in batches:
            began = time.monotonic()
            went = driftsafe_publish(dispatcher, batch)
            ours = received(app, config, prefix)
            expected = beat_publish(app, batch)
            apart_ms = math.ceil((time.monotonic() - began) * 1000)
            theirs = received(app, config, prefix)
            assert went == [value is True for value in expected], expected
            assert_same(ours, theirs, apart_ms)


TASKS = st.lists(
    st.tuples(task_options(), rows(), st.sampled_from(EDITS), rows(), st.booleans()),
    min_size=1,
    max_size=3,
)


def _property(settings: Any, broker: str, count: int) -> Apps:
    """The property on ``broker`` over ``count`` examples; the apps it used (closed)."""
    apps = Apps()

    @given(config=configurations(broker), tasks=TASKS)
    @examples(max_examples=count, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    def check(config: Config, tasks: Any) -> None:
        _check(apps, settings, config, tasks)

    try:
        check()
    finally:
        apps.close()
    return apps


def _paths_taken(apps: Apps) -> tuple[int, int, int]:
    """Messages the examples' publishers sent by the fast path, of them straight to Redis,
    and through Celery's ``apply_async`` (the fast path stepping aside)."""
    fast = [dispatcher.fast for _, _, dispatcher in apps.apps.values()]
    return (
        sum(f.published for f in fast),
        sum(f.direct for f in fast),
        sum(f.declined for f in fast),
    )


@ONE_PASS
def test_on_redis_the_beat_sends_what_celerys_beat_sends(settings: Any) -> None:
    published, direct, declined = _paths_taken(_property(settings, "redis", 150))
    # both paths were held to Celery's, the fast one mostly written straight to Redis
    assert published >= direct > 0 and declined > 0


@ONE_PASS
def test_on_rabbitmq_the_beat_sends_what_celerys_beat_sends(settings: Any) -> None:
    published, direct, declined = _paths_taken(_property(settings, "rabbitmq", 60))
    assert published > 0 and declined > 0 and direct == 0


# -- The differences this test found, each as a plain example ------------------------------------


@pytest.fixture
def redis_app() -> Iterator[tuple[Celery, str, Dispatcher]]:
    apps = Apps()
    config = Config("redis", "json", None, "none", True, False, None, None, None)
    try:
        yield apps.get(config)
    finally:
        _redis_messages(apps.get(config)[1])
        apps.close()


def _one_task(app: Celery, prefix: str, row: Row, count: int = 2) -> list[ClaimedRun]:
    return runs_of(task_name(app, prefix, TaskOptions("plain")), row, prefix, 1, None, count)


@pytest.mark.parametrize("fast", [True, False], ids=["fast path", "apply_async"])
def test_a_scheduled_runs_message_is_marked_as_celerys_beat_marks_it(
    redis_app: tuple[Celery, str, Dispatcher], settings: Any, fast: bool
) -> None:
    """Celery's beat adds the header ``celery_beat_task: True`` to every message it sends
    (``Scheduler.apply_async``); a run of a schedule carries it too, on either path (a manual
    run, without a slot, is not the beat's and does not)."""
    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "FAST_PUBLISH": fast}
    app, prefix, dispatcher = redis_app
    runs = _one_task(app, prefix, Row([1], {}, None, None, {"celery_beat_task": False}))
    manual = replace(runs[1], slot=None)
    assert driftsafe_publish(dispatcher, [runs[0], manual]) == [True, True]
    sent = [message["headers"] for _, message in _redis_messages(prefix)]
    assert sent[0]["celery_beat_task"] is True
    assert sent[1]["celery_beat_task"] is False  # the task's own header, as stored
    assert dispatcher.fast.published == (2 if fast else 0)


@pytest.mark.parametrize("fast", [True, False], ids=["fast path", "apply_async"])
def test_the_display_forms_are_headers_only_as_in_celerys_message(
    redis_app: tuple[Celery, str, Dispatcher], settings: Any, fast: bool
) -> None:
    """``argsrepr``/``kwargsrepr`` are message headers; Celery's beat (which passes no display
    forms to ``apply_async``) does not repeat them among the message's properties. Both paths
    did (the publisher passed its own forms as options, which Celery copies into the
    properties): every Redis message carried its arguments' display forms twice."""
    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "FAST_PUBLISH": fast}
    app, prefix, dispatcher = redis_app
    runs = _one_task(app, prefix, Row(["é" * 50], {"k": 1}, None, None, {}))
    assert driftsafe_publish(dispatcher, runs) == [True, True]
    for _, message in _redis_messages(prefix):
        assert message["headers"]["argsrepr"] == repr(["é" * 50])
        assert message["headers"]["kwargsrepr"] == "{'k': 1}"
        assert "argsrepr" not in message["properties"]
        assert "kwargsrepr" not in message["properties"]


def test_an_edit_that_reorders_keys_changes_the_message(
    redis_app: tuple[Celery, str, Dispatcher], settings: Any
) -> None:
    """Keyword arguments edited into another order (equal dictionaries, another body and
    ``kwargsrepr``) get a new message, in their new order, as Celery's would be: the kept
    message was reused because the dictionaries compared equal."""
    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "FAST_PUBLISH": True}
    app, prefix, dispatcher = redis_app
    before = Row([], {"a": 1, "b": {"x": 1, "y": 2}}, None, None, {})
    after = Row([], {"b": {"y": 2, "x": 1}, "a": 1}, None, None, {})
    assert driftsafe_publish(dispatcher, _one_task(app, prefix, before)) == [True, True]
    assert driftsafe_publish(dispatcher, _one_task(app, prefix, after)) == [True, True]
    sent = [message for _, message in _redis_messages(prefix)]
    assert [m["headers"]["kwargsrepr"] for m in sent] == ["{'a': 1, 'b': {'x': 1, 'y': 2}}"] * 2 + [
        "{'b': {'y': 2, 'x': 1}, 'a': 1}"
    ] * 2
    assert [m["body"][: len(b'[[], {"b"')] for m in sent[2:]] == [b'[[], {"b"'] * 2
    assert dispatcher.fast.published == 4


def test_a_run_routed_to_a_missing_queue_on_redis_is_refused_alone(
    settings: Any,
) -> None:
    """A run routed to a queue missing from ``task_queues`` (``task_create_missing_queues``
    off) is refused on its own, as Celery's beat fails that entry alone, and the batch's other
    runs go out. Celery's ``QueueNotFound`` is a ``KeyError``, which kombu's Redis transport
    counts among its connection errors: the dispatcher took it for the broker out of reach and
    left the whole batch claimed."""
    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "FAST_PUBLISH": True}
    apps = Apps()
    config = Config("redis", "json", None, "none", False, False, None, None, None)
    app, prefix, dispatcher = apps.get(config)
    try:
        good = _one_task(app, prefix, Row([1], {}, "a", None, {}), count=1)
        missing = runs_of("diff.elsewhere", Row([2], {}, "b", None, {}), prefix, 2, None, 1)
        assert beat_publish(app, missing)[0] is not True  # Celery's beat: that entry fails
        assert driftsafe_publish(dispatcher, [*good, *missing]) == [True, False]
        assert [queue for queue, _ in _redis_messages(prefix)] == [f"{prefix}-a"]
    finally:
        apps.close()
