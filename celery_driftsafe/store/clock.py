"""Time: the authority whose clock decides due-ness, and the local clock that measures waits.

Three pieces:

* :class:`Clock` — what logic receives: ``now()`` (aware UTC, the *authority's* time),
  ``monotonic()`` and ``sleep()`` (local). Nothing else in the package reads a clock.
* :class:`Authority` — one round trip to the shared clock (the database's or Redis').
* :class:`AuthorityClock` — a :class:`Clock` that estimates the authority's ``now()`` from the
  last measurement plus the local monotonic time elapsed since, and re-measures periodically.
  The local *wall* clock is read only to report this node's offset; it never decides anything.

The offset estimate is NTP-style: ``offset = authority - midpoint(local before, local after)``
with error at most half the round trip; of several samples the one with the smallest round
trip wins.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, runtime_checkable

from celery_driftsafe.core.stored_names import TimeAuthority
from celery_driftsafe.exceptions import ClockError


@runtime_checkable
class Clock(Protocol):
    """The clock seam. ``now()`` is the authority's time as an aware UTC datetime;
    ``monotonic()`` and ``sleep()`` are the local process's, used only to measure waits."""

    def now(self) -> datetime: ...

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


def _local_wall() -> datetime:
    """This process's wall clock. Only for offset reports and the ``local`` authority."""
    return datetime.now(UTC)


class SystemClock:
    """The local machine's clocks. The authority is this machine's wall clock: fine for a
    single node and for tests, never for several machines."""

    def now(self) -> datetime:
        return _local_wall()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


@runtime_checkable
class Authority(Protocol):
    """A shared clock. ``read()`` makes one round trip and returns the authority's current
    time as an aware UTC datetime, or raises :class:`ClockError` when it cannot be reached."""

    name: str

    def read(self) -> datetime: ...


class LocalAuthority:
    """This process's own wall clock as authority (single-machine setups and tests)."""

    name = "local"

    def __init__(self, wall: Callable[[], datetime] = _local_wall) -> None:
        self._wall = wall

    def read(self) -> datetime:
        return self._wall()


_DATABASE_NOW_SQL = {
    # clock_timestamp(), not now(): now() is frozen at the start of the transaction.
    "postgresql": "SELECT clock_timestamp()",
    "mysql": "SELECT UTC_TIMESTAMP(6)",
    "sqlite": "SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')",
}


class DatabaseAuthority:
    """The database server's clock, read with one query on Django connection ``using``."""

    name = "database"

    def __init__(self, using: str = "default") -> None:
        self.using = using

    def read(self) -> datetime:
        from django.db import DatabaseError, connections

        connection = connections[self.using]
        try:
            sql = _DATABASE_NOW_SQL[connection.vendor]
        except KeyError:
            raise ClockError(f"no clock query for database vendor {connection.vendor!r}") from None
        try:
            with connection.cursor() as cursor:
                cursor.execute(sql)
                row = cursor.fetchone()
        except DatabaseError as exc:
            raise ClockError(f"database clock unreachable: {exc}") from exc
        return _as_utc(row[0])


class RedisAuthority:
    """Redis' clock (``TIME``), shared by every node that talks to the same server."""

    name = "redis"

    def __init__(self, client: Any) -> None:
        self.client = client

    def read(self) -> datetime:
        from redis.exceptions import RedisError

        try:
            seconds, micros = self.client.time()
        except RedisError as exc:
            raise ClockError(f"redis clock unreachable: {exc}") from exc
        return datetime.fromtimestamp(int(seconds), UTC) + timedelta(microseconds=int(micros))


def _as_utc(value: Any) -> datetime:
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if not isinstance(value, datetime):
        raise ClockError(f"authority answered {value!r}, not a time")
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


@dataclass(frozen=True)
class OffsetSample:
    """One measurement of this node against the authority.

    ``offset`` is authority minus local wall clock (positive: this node is behind);
    ``rtt`` the round trip in seconds; the true offset lies within ``offset ± rtt/2``.
    ``authority_at`` is the authority's answer and ``monotonic_at`` the local monotonic
    time at the middle of the round trip, so ``authority_at + (monotonic() - monotonic_at)``
    estimates the authority's time later.
    """

    offset: float
    rtt: float
    authority_at: datetime
    monotonic_at: float

    @property
    def error_bound(self) -> float:
        return self.rtt / 2


def measure_offset(
    authority: Authority,
    samples: int = 5,
    *,
    wall: Callable[[], datetime] = _local_wall,
    monotonic: Callable[[], float] = time.monotonic,
) -> OffsetSample:
    """Measure this node's wall-clock offset from ``authority``; keep the lowest-RTT sample."""
    if samples < 1:
        raise ValueError("samples must be >= 1")
    best: OffsetSample | None = None
    for _ in range(samples):
        wall_before, mono_before = wall(), monotonic()
        answer = authority.read()
        wall_after, mono_after = wall(), monotonic()
        rtt = max(mono_after - mono_before, 0.0)
        local_mid = wall_before + (wall_after - wall_before) / 2
        sample = OffsetSample(
            offset=(answer - local_mid).total_seconds(),
            rtt=rtt,
            authority_at=answer,
            monotonic_at=mono_before + rtt / 2,
        )
        if best is None or sample.rtt < best.rtt:
            best = sample
    assert best is not None
    return best


class AuthorityClock:
    """A :class:`Clock` whose ``now()`` is the authority's time.

    It measures once on first use and again every ``resync_seconds``; between measurements it
    extrapolates on the local monotonic clock, so it costs no round trip per call. Its
    estimate can be off by the last sample's ``rtt/2`` plus the local oscillator's drift
    since; callers that must never act early re-check against the authority itself (the
    claim query does, on the database).
    """

    def __init__(
        self,
        authority: Authority,
        *,
        samples: int = 5,
        resync_seconds: float = 60.0,
        monotonic: Callable[[], float] = time.monotonic,
        sleeper: Callable[[float], None] = time.sleep,
        wall: Callable[[], datetime] = _local_wall,
    ) -> None:
        self.authority = authority
        self.samples = samples
        self.resync_seconds = resync_seconds
        self._monotonic = monotonic
        self._sleep = sleeper
        self._wall = wall
        self._lock = threading.Lock()
        self.last_sample: OffsetSample | None = None

    def sync(self) -> OffsetSample:
        """Measure now and keep the result."""
        sample = measure_offset(
            self.authority, self.samples, wall=self._wall, monotonic=self._monotonic
        )
        with self._lock:
            self.last_sample = sample
        return sample

    def needs_sync(self) -> bool:
        sample = self.last_sample
        return sample is None or self._monotonic() - sample.monotonic_at >= self.resync_seconds

    def wall_moved(self, tolerance: float) -> bool:
        """Whether this node's wall clock moved more than ``tolerance`` seconds against the
        authority since the last measurement (stepped by hand, by NTP or by a VM's resume):
        the estimate runs on the monotonic clock, which a step leaves alone, so comparing
        the two costs no round trip."""
        sample = self.last_sample
        if sample is None:
            return True
        estimate = sample.authority_at + timedelta(seconds=self._monotonic() - sample.monotonic_at)
        return abs((estimate - self._wall()).total_seconds() - sample.offset) > tolerance

    def now(self) -> datetime:
        sample = self.last_sample
        if sample is None or self.needs_sync():
            sample = self.sync()
        elapsed = self._monotonic() - sample.monotonic_at
        return sample.authority_at + timedelta(seconds=elapsed)

    def monotonic(self) -> float:
        return self._monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._sleep(seconds)


#: Databases whose server clock every beat shares: ``auto`` takes it there.
SHARED_CLOCK_VENDORS = ("postgresql", "mysql")


def resolve_time_authority(setting: str, *, vendor: str, redis_url: str | None) -> TimeAuthority:
    """The authority ``TIME_AUTHORITY = setting`` means on a database of Django vendor
    ``vendor`` with ``REDIS_URL = redis_url``: ``auto`` becomes the database's clock where the
    database has one of its own (PostgreSQL, MySQL), else Redis' when ``REDIS_URL`` is set,
    else the local clock (SQLite without Redis: beats on one machine only, which is all such
    a setup can serve). Any other value is itself."""
    if setting != TimeAuthority.AUTO:
        return TimeAuthority(setting)
    if vendor in SHARED_CLOCK_VENDORS:
        return TimeAuthority.DATABASE
    if redis_url:
        return TimeAuthority.REDIS
    return TimeAuthority.LOCAL


def configured_time_authority(settings: Any = None, *, using: str = "default") -> TimeAuthority:
    """:func:`resolve_time_authority` for the current settings and Django database ``using``."""
    from django.db import connections

    from celery_driftsafe.conf import get_settings

    settings = settings or get_settings()
    return resolve_time_authority(
        settings.time_authority, vendor=connections[using].vendor, redis_url=settings.redis_url
    )


def authority_from_settings(settings: Any = None, *, using: str = "default") -> Authority:
    """The authority ``DRIFTSAFE['TIME_AUTHORITY']`` names (``auto`` resolved, see
    :func:`resolve_time_authority`)."""
    from celery_driftsafe.conf import get_settings
    from celery_driftsafe.exceptions import ConfigurationError
    from celery_driftsafe.store.redis import get_redis

    settings = settings or get_settings()
    try:
        chosen = configured_time_authority(settings, using=using)
    except ValueError:
        raise ConfigurationError(
            "TIME_AUTHORITY",
            settings.time_authority,
            "unknown time authority",
            "use 'auto', 'database', 'redis' or 'local'",
        ) from None
    if chosen == TimeAuthority.DATABASE:
        return DatabaseAuthority(using)
    if chosen == TimeAuthority.REDIS:
        client = get_redis(settings)
        if client is None:
            raise ConfigurationError(
                "TIME_AUTHORITY", "redis", "needs DRIFTSAFE['REDIS_URL']", "set REDIS_URL"
            )
        return RedisAuthority(client)
    return LocalAuthority()


# -- The authority outside a beat --------------------------------------------------------------

_cache_lock = threading.Lock()
#: (pid, settings object, database) -> the clock; a settings change makes a new settings
#: object, so the next reading follows it.
_cached: dict[tuple[int, int, str], tuple[Any, AuthorityClock]] = {}
_injected: Clock | None = None


def authority_clock(using: str = "default") -> Clock:
    """The authority's clock for code outside a beat (the task, run now, the admin, schedule
    edits): one per process and database, measured once and then read on the local monotonic
    clock, re-measured every ``CLOCK_SYNC_INTERVAL_SECONDS``. A beat keeps its own.

    Tests (and users' tests) put a clock in its place with :func:`inject_authority_clock`."""
    if _injected is not None:
        return _injected
    from celery_driftsafe.conf import get_settings

    settings = get_settings()
    key = (os.getpid(), id(settings), using)
    with _cache_lock:
        held = _cached.get(key)
        if held is None or held[0] is not settings:
            clock = AuthorityClock(
                authority_from_settings(settings, using=using),
                samples=1,
                resync_seconds=settings.clock_sync_interval_seconds,
            )
            _cached[key] = held = (settings, clock)
        return held[1]


@contextmanager
def inject_authority_clock(clock: Clock) -> Iterator[Clock]:
    """Within the block, :func:`authority_clock` is ``clock`` (for example a
    :class:`~celery_driftsafe.testing.FakeClock`)."""
    global _injected
    previous, _injected = _injected, clock
    try:
        yield clock
    finally:
        _injected = previous


@dataclass(frozen=True)
class Reading:
    """An authority reading and the local monotonic time it was taken at."""

    at: datetime
    monotonic: float

    def now(self, monotonic: float) -> datetime:
        return self.at + timedelta(seconds=monotonic - self.monotonic)
