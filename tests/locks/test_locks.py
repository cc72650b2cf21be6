"""Locks, against real Redis and the real database: one conformance suite run on both backends,
then what is particular to each (Redis keys, URLs, TLS, AUTH, Sentinel; the database lease's
exact expiry boundary).

Races are real (threads with their own connections); the database's expiry boundary is shown
with the fake clock, Redis' with short leases and real waits. Throw-away ``redis-server`` and
``redis-sentinel`` processes on free ports stand in for outages, TLS, AUTH and Sentinel.
"""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from django.db import connections, transaction
from django.test import override_settings

from celery_driftsafe.conf import DriftSafeSettings
from celery_driftsafe.exceptions import ConfigurationError, LockError, LockLost
from celery_driftsafe.locks import (
    POLL_MIN_SECONDS,
    DatabaseLockBackend,
    HeldLock,
    LockBackend,
    RedisLockBackend,
    lock_backend,
)
from celery_driftsafe.models import Lock as LockRow
from celery_driftsafe.store import redis as redis_client
from celery_driftsafe.store.clock import AuthorityClock, SystemClock
from celery_driftsafe.store.redis import (
    SentinelURL,
    client_from_url,
    get_redis,
    is_sentinel_url,
    mask_url,
    parse_sentinel_url,
)
from celery_driftsafe.testing import FakeClock
from celery_driftsafe.testing.processes import free_port
from tests import settings as test_settings
from tests.support import T0, empty_redis, wait_until

PREFIX = test_settings.DRIFTSAFE["KEY_PREFIX"]
# A Redis database of its own (the locks database of tests/settings.py, ``REDIS_DB + 3``):
# ``redis_client`` flushes ``REDIS_DB`` while other tests run.
LOCK_REDIS_URL = f"{test_settings.REDIS_SERVER}/{test_settings.REDIS_DB + 3}"

BACKENDS = [
    pytest.param("redis", id="redis"),
    pytest.param("database", id="database", marks=pytest.mark.django_db(transaction=True)),
]


class Harness:
    """Makes backends of one kind, each with its own connection, and tampers with storage."""

    def __init__(self, kind: str, admin: Any) -> None:
        self.kind = kind
        self.admin = admin  # a Redis client on the test db, for tampering (None: database)
        self._clients: list[Any] = []

    def backend(self, clock: Any = None) -> LockBackend:
        if self.kind == "redis":
            client = redis.Redis.from_url(LOCK_REDIS_URL)
            self._clients.append(client)
            return RedisLockBackend(client, PREFIX, clock=clock)
        return DatabaseLockBackend(clock=clock or SystemClock())

    def expiring_backend(self, ttl: float) -> tuple[LockBackend, Callable[[], None]]:
        """A backend and a function that makes a lease of ``ttl`` taken now run out."""
        if self.kind == "redis":
            return self.backend(), lambda: time.sleep(ttl + 0.1)
        clock = FakeClock(T0)
        return self.backend(clock), lambda: clock.advance(ttl)  # exactly to expires_at

    def mark_unrenewed(self, name: str) -> None:
        """Make a renewal of ``name``'s 30 s lease visible: Redis' expiry is cut to 20 s (a
        renewal puts it back to 30); the database row is compared with the fake clock."""
        if self.kind == "redis":
            self.admin.pexpire(f"{PREFIX}:lock:{name}", 20_000)

    def renewed(self, name: str, clock: FakeClock, ttl: float) -> bool:
        if self.kind == "redis":
            left: int = self.admin.pttl(f"{PREFIX}:lock:{name}")
            return left > (ttl - 5) * 1000
        expires: datetime = LockRow.objects.get(name=name).expires_at
        return expires == clock.now() + timedelta(seconds=ttl)

    def overwrite(self, name: str) -> None:
        if self.kind == "redis":
            self.admin.set(f"{PREFIX}:lock:{name}", "intruder", px=60_000)
        else:
            LockRow.objects.filter(name=name).update(token="intruder")

    def delete(self, name: str) -> None:
        if self.kind == "redis":
            self.admin.delete(f"{PREFIX}:lock:{name}")
        else:
            LockRow.objects.filter(name=name).delete()

    def close(self) -> None:
        for client in self._clients:
            client.close()


@pytest.fixture
def lock_redis() -> Iterator[Any]:
    """A client on the locks database (``REDIS_DB + 3``), emptied before and after."""
    client = redis.Redis.from_url(LOCK_REDIS_URL)
    empty_redis(client)
    yield client
    empty_redis(client)
    client.close()


@pytest.fixture
def harness(kind: str, request: pytest.FixtureRequest) -> Iterator[Harness]:
    admin = request.getfixturevalue("lock_redis") if kind == "redis" else None
    h = Harness(kind, admin)
    yield h
    h.close()


def in_thread(target: Callable[[], Any]) -> threading.Thread:
    """Run ``target`` in a thread that closes its own database connection when done."""

    def run() -> None:
        try:
            target()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


class CountingClock(SystemClock):
    """The system clock, recording every sleep it is asked for."""

    def __init__(self) -> None:
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        super().sleep(seconds)


# -- the contract, on both backends -------------------------------------------------------------


@pytest.mark.parametrize("kind", BACKENDS)
class TestLockContract:
    def test_acquire_excludes_others_and_release_frees(self, harness: Harness) -> None:
        locks = harness.backend()
        first, second = locks.lock("job", ttl=10), locks.lock("job", ttl=10)
        assert first.acquire(blocking=False)
        assert isinstance(first.token, str) and len(first.token) == 32
        assert first.fencing_token == 1
        assert not second.acquire(blocking=False)
        assert second.token is None and second.fencing_token is None
        assert first.release()
        assert first.token is None and first.fencing_token is None
        assert second.acquire(blocking=False)
        assert second.fencing_token == 2
        assert locks.lock("other", ttl=10).acquire(blocking=False), "names are independent"

    def test_a_strangers_token_can_neither_release_nor_extend(
        self, harness: Harness, caplog: pytest.LogCaptureFixture
    ) -> None:
        locks = harness.backend()
        holder, stranger = locks.lock("job", ttl=10), locks.lock("job", ttl=10)
        assert holder.acquire()
        stranger.token = "0" * 32  # someone else's idea of the token
        with caplog.at_level(logging.WARNING, logger="celery_driftsafe.locks"):
            assert not stranger.extend(60)
            assert not stranger.release()
        actions = [getattr(r, "action", None) for r in caplog.records]
        assert actions == ["lock-extend-lost", "lock-release-lost"]
        assert not locks.lock("job", ttl=10).acquire(blocking=False), "still held"
        assert holder.extend() and holder.release()
        assert not holder.release(), "a second release is refused"

    def test_expired_lease_is_taken_over_and_the_old_holder_cannot_touch_it(
        self, harness: Harness
    ) -> None:
        locks, expire = harness.expiring_backend(ttl=0.2)
        old, new = locks.lock("job", ttl=0.2), locks.lock("job", ttl=10)
        assert old.acquire(blocking=False)
        assert not new.acquire(blocking=False)
        expire()
        assert new.acquire(blocking=False)
        assert new.fencing_token == 2, "the fencing counter survives expiry"
        assert not old.extend(10)
        assert not old.release(), "releasing someone else's lock is refused"
        assert not locks.lock("job", ttl=10).acquire(blocking=False), "new holder kept it"
        assert new.release()

    def test_a_lock_handed_over_is_taken_by_its_heir_alone(self, harness: Harness) -> None:
        locks = harness.backend()
        holder, other, heir = (locks.lock("job", ttl=10) for _ in range(3))
        assert holder.acquire(blocking=False) and holder.fencing_token == 1
        assert holder.hand_over("heir:run:7")
        assert holder.token is None and holder.fencing_token is None
        assert not holder.release(), "no longer its to release"
        assert not other.acquire(blocking=False), "held for its heir"
        assert not other.take_handed("heir:run:8"), "nor for another heir"
        assert heir.take_handed("heir:run:7")
        assert isinstance(heir.token, str) and heir.fencing_token == 2
        assert not locks.lock("job", ttl=10).take_handed("heir:run:7"), "taken once"
        assert heir.release()
        assert not other.take_handed("heir:run:7"), "a free lock is not a handed one"
        assert other.acquire(blocking=False) and other.fencing_token == 3

    def test_a_lock_is_taken_from_a_named_holder_alone_and_only_while_its_lease_lasts(
        self, harness: Harness
    ) -> None:
        """``take_from(holder)``: the lock held under a token made for ``holder`` is taken over
        (a fresh token, the fencing counter on), once; not a free lock, not one held by
        another holder or handed to a heir, and not a lapsed one (free for anyone then)."""
        locks, expire = harness.expiring_backend(ttl=0.2)
        killed = locks.lock("job", ttl=0.2, holder="run:7")
        assert killed.acquire(blocking=False) and killed.fencing_token == 1
        assert isinstance(killed.token, str) and killed.token.startswith("run:7#")
        assert not locks.lock("job", ttl=0.2).take_from("run:8"), "another holder's name"
        assert not locks.lock("job", ttl=0.2).take_from("run"), "a name is matched whole"
        taker = locks.lock("job", ttl=0.2)
        assert taker.take_from("run:7") and taker.fencing_token == 2
        assert not killed.extend(), "the killed holder no longer holds it"
        assert not locks.lock("job", ttl=0.2).take_from("run:7"), "taken once"
        assert not locks.lock("job", ttl=0.2).acquire(blocking=False), "the taker holds it"
        assert taker.hand_over("heir:run:9")
        assert not locks.lock("job", ttl=0.2).take_from("heir"), "a heir's name is no holder's"
        heir = locks.lock("job", ttl=0.2)
        assert heir.take_handed("heir:run:9") and heir.release()
        assert not locks.lock("job", ttl=0.2).take_from("run:7"), "a free lock"
        lapsed = locks.lock("job", ttl=0.2, holder="run:10")
        assert lapsed.acquire(blocking=False)
        expire()
        assert not locks.lock("job", ttl=0.2).take_from("run:10"), "its lease ran out"

    def test_a_handed_lock_nobody_takes_is_free_once_its_lease_runs_out(
        self, harness: Harness
    ) -> None:
        locks, expire = harness.expiring_backend(ttl=0.2)
        holder = locks.lock("job", ttl=0.2)
        assert holder.acquire(blocking=False) and holder.hand_over("heir:run:7")
        assert not locks.lock("job", ttl=10).acquire(blocking=False)
        expire()
        assert not locks.lock("job", ttl=10).take_handed("heir:run:7"), "the lease is over"
        taker = locks.lock("job", ttl=10)
        assert taker.acquire(blocking=False) and taker.fencing_token == 2

    def test_only_the_holder_hands_over_and_watch_hands_to_a_heir_set_meanwhile(
        self, harness: Harness, caplog: pytest.LogCaptureFixture
    ) -> None:
        locks, expire = harness.expiring_backend(ttl=0.2)
        lapsed = locks.lock("job", ttl=0.2)
        assert lapsed.acquire(blocking=False)
        expire()
        taker = locks.lock("job", ttl=10)
        assert taker.acquire(blocking=False)
        with caplog.at_level(logging.WARNING, logger="celery_driftsafe.locks"):
            assert not lapsed.hand_over("heir:run:7")
        assert [getattr(r, "action", None) for r in caplog.records] == ["lock-release-lost"]
        assert not locks.lock("job", ttl=10).take_handed("heir:run:7"), "the taker's still"
        assert taker.release()
        with locks.lock("job", ttl=10).hold() as held:
            held.heir = "heir:run:9"
        assert not held.lost.is_set(), "handed, not lost"
        assert not locks.lock("job", ttl=10).acquire(blocking=False)
        assert locks.lock("job", ttl=10).take_handed("heir:run:9")

    def test_blocking_acquire_waits_for_release(self, harness: Harness) -> None:
        holder = harness.backend().lock("job", ttl=10)
        waiter_backend = harness.backend()
        assert holder.acquire()
        result: dict[str, Any] = {}

        def wait() -> None:
            lock = waiter_backend.lock("job", ttl=10)
            started = time.monotonic()
            result["acquired"] = lock.acquire(timeout=10)
            result["waited"] = time.monotonic() - started
            result["fencing_token"] = lock.fencing_token
            lock.release()

        thread = in_thread(wait)
        time.sleep(0.3)
        assert thread.is_alive(), "the waiter is still waiting"
        assert holder.release()
        thread.join(10)
        assert result["acquired"] and result["fencing_token"] == 2
        assert 0.25 <= result["waited"] < 10

    def test_blocking_acquire_times_out_without_busy_looping(self, harness: Harness) -> None:
        assert harness.backend().lock("job", ttl=10).acquire()
        clock = CountingClock()
        waiter = harness.backend(clock).lock("job", ttl=10)
        assert not waiter.acquire(blocking=False)
        assert clock.sleeps == [], "non-blocking never sleeps"
        started = time.monotonic()
        assert not waiter.acquire(timeout=0.3)
        assert time.monotonic() - started >= 0.29
        # It waited by sleeping, with pauses of at least half the smallest poll interval (the
        # last one may be cut short by the timeout), and never polled in a tight loop.
        assert len(clock.sleeps) >= 3
        assert all(s >= POLL_MIN_SECONDS / 2 for s in clock.sleeps[:-1]) and clock.sleeps[-1] > 0
        assert len(clock.sleeps) < 40, f"polled {len(clock.sleeps)} times in 0.3 s"
        assert not waiter.acquire(timeout=0), "timeout 0 tries once"

    def test_the_watchdog_renews_on_the_lock_clock(self, harness: Harness) -> None:
        """No real sleep: the watchdog waits on the lock's clock, and the test moves it."""
        clock = FakeClock(T0)
        locks = harness.backend(clock)
        with locks.lock("job", ttl=30).hold(watchdog=True) as held:
            for _ in range(6):  # two leases' worth, a renewal every ttl/3
                wait_until(lambda: clock.waiters == 2, "the renewer and the timekeeper waiting")
                harness.mark_unrenewed("job")
                clock.advance(10)
                wait_until(lambda: harness.renewed("job", clock, 30), "renewed at the fake now")
            assert not held.lost.is_set()
            held.check()
            assert not locks.lock("job", ttl=10).acquire(blocking=False)
        assert not held.lost.is_set(), "released cleanly"
        assert locks.lock("job", ttl=10).acquire(blocking=False)

    def test_without_watchdog_a_short_lease_is_lost(self, harness: Harness) -> None:
        locks, run_out = harness.expiring_backend(0.3)
        with locks.lock("job", ttl=0.3).hold() as held:
            run_out()
            with pytest.raises(LockLost):
                held.check()
            other = locks.lock("job", ttl=10)
            assert other.acquire(blocking=False)
            assert other.fencing_token == held.fencing_token + 1
        assert held.lost.is_set() and held.lost_reason == "no longer held at release"
        assert not locks.lock("job", ttl=10).acquire(blocking=False), "other kept it"

    @pytest.mark.parametrize("tamper", ["overwrite", "delete"])
    def test_watchdog_signals_a_lock_taken_behind_its_back(
        self, harness: Harness, tamper: str
    ) -> None:
        if tamper == "delete" and harness.kind == "redis":
            return self._a_key_redis_lost_is_set_again_for_its_holder(harness)
        clock = FakeClock(T0)
        calls: list[HeldLock] = []
        locks = harness.backend(clock)
        with locks.lock("job", ttl=30).hold(watchdog=True, on_lost=calls.append) as held:
            wait_until(lambda: clock.waiters == 2, "the renewer and the timekeeper waiting")
            getattr(harness, tamper)("job")
            assert not held.lost.is_set()
            clock.advance(10)  # the next renewal is refused
            wait_until(held.lost.is_set, "the lock declared lost at its next renewal")
            assert held.lost_reason is not None and "renewal refused" in held.lost_reason
            assert calls == [held]
            with pytest.raises(LockLost, match="renewal refused"):
                held.check()
        if tamper == "overwrite" and harness.kind == "redis":
            assert harness.admin.get(f"{PREFIX}:lock:job") == b"intruder", "not deleted"
        if tamper == "overwrite" and harness.kind == "database":
            assert LockRow.objects.get(name="job").token == "intruder", "not released"
        assert calls == [held], "called once"

    def _a_key_redis_lost_is_set_again_for_its_holder(self, harness: Harness) -> None:
        """A Redis key gone while its holder's lease lasts (a flush, an eviction, a restart
        that kept nothing) is set again at the next renewal, not declared lost: no other
        process holds it, and a copy that took it in between would have left its own token.
        Once set again, nobody else can take it."""
        clock = FakeClock(T0)
        calls: list[HeldLock] = []
        locks = harness.backend(clock)
        with locks.lock("job", ttl=30).hold(watchdog=True, on_lost=calls.append) as held:
            wait_until(lambda: clock.waiters == 2, "the renewer and the timekeeper waiting")
            harness.delete("job")
            clock.advance(10)  # the next renewal
            key = f"{PREFIX}:lock:job"
            wait_until(lambda: harness.admin.get(key) is not None, "the key set again")
            assert harness.admin.pttl(key) > 25_000, "with a whole lease"
            assert not harness.backend(clock).lock("job", ttl=10).acquire(blocking=False)
            assert not held.lost.is_set() and calls == []
            held.check()
        assert harness.admin.get(key) is None, "released at the end"
        # A holder whose own lease is over does not set the key again.
        late = locks.lock("job", ttl=30)
        assert late.acquire(blocking=False)
        harness.delete("job")
        clock.advance(30)
        assert not late.extend() and harness.admin.get(key) is None

    def test_hold_raises_when_the_lock_is_taken(self, harness: Harness) -> None:
        locks = harness.backend()
        assert locks.lock("job", ttl=10).acquire()
        with (
            pytest.raises(LockError, match="held by someone else"),
            locks.lock("job").hold(blocking=False),
        ):
            pass

    def test_fencing_tokens_strictly_increase_under_contention(self, harness: Harness) -> None:
        threads, rounds = 8, 25
        guard = threading.Lock()
        inside = [0, 0]  # holders now, most holders at once
        acquired: list[tuple[int, int]] = []  # (fencing token, thread) in acquisition order
        errors: list[BaseException] = []
        backends = [harness.backend() for _ in range(threads)]

        def work(me: int) -> None:
            try:
                for _ in range(rounds):
                    lock = backends[me].lock("contended", ttl=10)
                    assert lock.acquire(timeout=60)
                    with guard:
                        inside[0] += 1
                        inside[1] = max(inside)
                        assert lock.fencing_token is not None
                        acquired.append((lock.fencing_token, me))
                    time.sleep(0.001)
                    with guard:
                        inside[0] -= 1
                    assert lock.release()
            except BaseException as exc:
                errors.append(exc)

        workers = [in_thread(lambda me=me: work(me)) for me in range(threads)]
        for worker in workers:
            worker.join(120)
        assert not errors, errors
        assert inside[1] == 1, "never two holders at once"
        tokens = [token for token, _ in acquired]
        assert len(tokens) == threads * rounds
        assert tokens == list(range(1, threads * rounds + 1)), "distinct, increasing, no gaps"
        for me in range(threads):
            mine = [token for token, who in acquired if who == me]
            assert mine == sorted(mine) and len(mine) == rounds

    def test_fencing_floor_continues_one_sequence(self, harness: Harness) -> None:
        """A lock made with a floor hands out a token above it even when its counter is behind
        (another backend or a lost counter handed out higher ones); without one it counts on."""
        locks = harness.backend()
        first = locks.lock("floored", ttl=10)
        assert first.acquire(blocking=False) and first.fencing_token == 1
        assert first.release()
        jumped = locks.lock("floored", ttl=10, fencing_floor=41)
        assert jumped.acquire(blocking=False) and jumped.fencing_token == 42
        assert jumped.release()
        below = locks.lock("floored", ttl=10, fencing_floor=5)
        assert below.acquire(blocking=False) and below.fencing_token == 43
        assert below.release()
        fresh = locks.lock("never-taken", ttl=10, fencing_floor=7)
        assert fresh.acquire(blocking=False) and fresh.fencing_token == 8
        assert fresh.release()


# -- database specifics -------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
class TestDatabaseLock:
    """The lease is over *at* ``expires_at``: at that instant it may be taken over, and its
    holder can neither extend nor release it; one microsecond before, it is still held."""

    def test_one_microsecond_before_expiry_the_lease_holds(self) -> None:
        clock = FakeClock(T0)
        locks = DatabaseLockBackend(clock=clock)
        holder = locks.lock("job", ttl=30)
        assert holder.acquire()
        assert LockRow.objects.get(name="job").expires_at == T0 + timedelta(seconds=30)
        clock.advance(timedelta(seconds=30) - timedelta(microseconds=1))
        assert not locks.lock("job").acquire(blocking=False)
        assert holder.extend(30)
        assert LockRow.objects.get(name="job").expires_at == clock.now() + timedelta(seconds=30)

    def test_at_expires_at_the_lease_is_over(self) -> None:
        clock = FakeClock(T0)
        locks = DatabaseLockBackend(clock=clock)
        holder = locks.lock("job", ttl=30)
        assert holder.acquire()
        clock.advance(30)
        assert not holder.extend(30)
        assert not holder.release()
        row = LockRow.objects.get(name="job")
        assert row.token != "" and row.fencing_token == 1, "a late release changes nothing"
        taker = locks.lock("job", ttl=30)
        assert taker.acquire(blocking=False)
        assert taker.fencing_token == 2

    def test_release_keeps_the_row_so_fencing_keeps_counting(self) -> None:
        locks = DatabaseLockBackend(clock=FakeClock(T0))
        for expected in (1, 2, 3):
            lock = locks.lock("job")
            assert lock.acquire() and lock.fencing_token == expected
            assert lock.release()
        row = LockRow.objects.get(name="job")
        assert (row.token, row.fencing_token) == ("", 3)

    def test_blocking_acquire_gets_an_expiring_lease_on_the_fake_clock(self) -> None:
        clock = FakeClock(T0)
        locks = DatabaseLockBackend(clock=clock)
        assert locks.lock("job", ttl=2).acquire()
        waiter = locks.lock("job", ttl=2)
        assert waiter.acquire(timeout=10)
        assert clock.now() >= T0 + timedelta(seconds=2)
        assert waiter.fencing_token == 2
        assert all(0 < s <= 0.05 for s in clock.sleeps)

    def test_refuses_to_run_inside_a_transaction(self) -> None:
        lock = DatabaseLockBackend(clock=FakeClock(T0)).lock("job")
        with transaction.atomic(), pytest.raises(LockError, match="outside a transaction"):
            lock.acquire()

    def test_factory_without_redis_gives_the_database_on_its_clock(self) -> None:
        no_redis = {**test_settings.DRIFTSAFE, "REDIS_URL": None}
        with override_settings(DRIFTSAFE=no_redis):
            locks = lock_backend()
            assert isinstance(locks, DatabaseLockBackend)
            assert isinstance(locks.clock, AuthorityClock)
            with locks.lock("job", ttl=5).hold(watchdog=True) as held:
                assert held.fencing_token == 1
        assert LockRow.objects.get(name="job").token == ""


# -- Redis specifics ----------------------------------------------------------------------------


class TestRedisLock:
    def test_keys_are_namespaced_and_the_fence_never_expires(self, lock_redis: Any) -> None:
        lock = RedisLockBackend(lock_redis, PREFIX).lock("job", ttl=5)
        assert lock.acquire()
        assert lock_redis.get(f"{PREFIX}:lock:job") == lock.token.encode()  # type: ignore[union-attr]
        assert 0 < lock_redis.pttl(f"{PREFIX}:lock:job") <= 5000
        assert lock.release()
        assert lock_redis.exists(f"{PREFIX}:lock:job") == 0
        assert lock_redis.get(f"{PREFIX}:fence:job") == b"1"
        assert lock_redis.ttl(f"{PREFIX}:fence:job") == -1

    def test_factory_with_redis_gives_redis(self) -> None:
        locks = lock_backend()
        assert isinstance(locks, RedisLockBackend)
        assert locks.key_prefix == PREFIX and locks.client is get_redis()

    def test_watchdog_declares_the_lock_lost_when_redis_dies(self, tmp_path: Path) -> None:
        """Redis killed: the renewals fail, and the lock is declared lost when its lease runs
        out, not before. The lease runs on a fake clock; the test moves it."""
        with redis_server(tmp_path) as (port, process):
            client = redis.Redis(port=port, socket_timeout=5, socket_connect_timeout=5, retry=None)
            clock = FakeClock(T0)
            calls: list[HeldLock] = []
            try:
                lock = RedisLockBackend(client, PREFIX, clock=clock).lock("job", ttl=30)
                with lock.hold(watchdog=True, on_lost=calls.append) as held:
                    wait_until(lambda: clock.waiters == 2, "the renewer and the timekeeper waiting")
                    process.kill()
                    process.wait()
                    clock.advance(10)  # a renewal fails; the lease has 20 s left
                    wait_until(lambda: clock.waiters == 2, "the renewer waiting to retry")
                    assert not held.lost.is_set(), held.lost_reason
                    clock.advance(21)  # past the lease's end
                    wait_until(held.lost.is_set, "the lock declared lost at the lease's end")
                    assert "lease ran out" in (held.lost_reason or "")
                    assert calls == [held]
            finally:
                client.close()

    def test_lost_is_signalled_on_time_while_a_renewal_is_stuck(self, tmp_path: Path) -> None:
        """A frozen Redis (SIGSTOP) leaves the renewal call hanging for its socket timeout
        (120 s here, far past the test's waits); the lease end on the lock's clock, not the
        call, decides when ``lost`` is set."""
        with redis_server(tmp_path) as (port, process):
            client = redis.Redis(port=port, socket_timeout=120)
            clock = FakeClock(T0)
            try:
                lock = RedisLockBackend(client, PREFIX, clock=clock).lock("job", ttl=30)
                with lock.hold(watchdog=True) as held:
                    wait_until(lambda: clock.waiters == 2, "the renewer and the timekeeper waiting")
                    process.send_signal(signal.SIGSTOP)
                    try:
                        clock.advance(10)  # the renewal call hangs on the frozen Redis
                        wait_until(lambda: clock.waiters == 1, "only the timekeeper waiting")
                        clock.advance(21)  # past the lease's end, the call still hanging
                        wait_until(held.lost.is_set, "lost at the lease's end, the call stuck")
                        assert held.lost_reason == "the lease ran out before it could be renewed"
                    finally:
                        process.send_signal(signal.SIGCONT)
            finally:
                client.close()

    def test_unreachable_redis_raises_lock_error(self) -> None:
        client = redis.Redis(port=free_port(), socket_connect_timeout=0.2, retry=None)
        try:
            with pytest.raises(LockError, match="Redis error"):
                RedisLockBackend(client, PREFIX).lock("job").acquire()
        finally:
            client.close()


# -- connecting: URLs, TLS, AUTH, Sentinel -----------------------------------------------------


class TestParseSentinelUrl:
    def test_full_form(self) -> None:
        url = "redis+sentinel://:s3cret@s1:26380,s2/mymaster/3?sentinel_password=sp"
        assert parse_sentinel_url(url) == SentinelURL(
            sentinels=(("s1", 26380), ("s2", 26379)),
            service_name="mymaster",
            db=3,
            password="s3cret",
            sentinel_password="sp",
        )

    def test_defaults_user_tls_ipv6_and_percent_encoding(self) -> None:
        parsed = parse_sentinel_url("rediss+sentinel://al%40ice:p%3Aw%40d@[::1]:26390,h/svc/")
        assert parsed.sentinels == (("::1", 26390), ("h", 26379))
        assert (parsed.username, parsed.password) == ("al@ice", "p:w@d")
        assert parsed.ssl and parsed.db == 0 and parsed.service_name == "svc"
        assert parse_sentinel_url("redis+sentinel://h/svc").password is None
        assert parse_sentinel_url("redis+sentinel://u@h/svc").username == "u"

    @pytest.mark.parametrize(
        ("url", "problem"),
        [
            ("redis://h/svc", "scheme must be"),
            ("redis+sentinel:///svc", "host is empty"),
            ("redis+sentinel://h1,/svc", "host is empty"),
            ("redis+sentinel://h:99999/svc", "bad port"),
            ("redis+sentinel://h:x/svc", "bad port"),
            ("redis+sentinel://[::1/svc", "not a URL"),
            ("redis+sentinel://[::1]x/svc", "bad IPv6"),
            ("redis+sentinel://h", "no Sentinel service name"),
            ("redis+sentinel://h/", "no Sentinel service name"),
            ("redis+sentinel://h/svc/db1", "not a non-negative integer"),
            ("redis+sentinel://h/svc/1/2", "nothing more"),
            ("redis+sentinel://h/svc?ssl=true", "unknown option 'ssl'"),
        ],
    )
    def test_errors_name_the_setting_and_the_problem(self, url: str, problem: str) -> None:
        with pytest.raises(ConfigurationError, match="REDIS_URL") as caught:
            parse_sentinel_url(url)
        assert problem in caught.value.problem

    def test_errors_never_show_passwords(self) -> None:
        with pytest.raises(ConfigurationError) as caught:
            parse_sentinel_url("redis+sentinel://:hunter2@h/svc/x?sentinel_password=pw2")
        assert "hunter2" not in str(caught.value) and "pw2" not in str(caught.value)
        assert mask_url("redis://u:pw@h:1/0") == "redis://u:***@h:1/0"
        assert mask_url("redis+sentinel://:p@w@[::1/s?a=1&sentinel_password=x") == (
            "redis+sentinel://:***@[::1/s?a=1&sentinel_password=***"
        )

    def test_is_sentinel_url(self) -> None:
        assert is_sentinel_url("redis+sentinel://h/s") and is_sentinel_url("rediss+sentinel://h/s")
        assert not is_sentinel_url("redis://h/0") and not is_sentinel_url("unix:///r.sock")


class TestGetRedis:
    def test_no_url_no_client_and_one_client_per_url(self) -> None:
        assert get_redis(DriftSafeSettings(redis_url=None)) is None
        settings = DriftSafeSettings(redis_url=test_settings.REDIS_URL)
        assert get_redis(settings) is get_redis(settings)
        assert get_redis(settings).ping()

    def test_auth_urls_default_user_and_acl_user(self, tmp_path: Path) -> None:
        conf = "requirepass secret\nuser alice on >w@nder ~* &* +@all\n"
        with redis_server(tmp_path, conf) as (port, _):
            for url in (
                f"redis://:secret@127.0.0.1:{port}/2",
                f"redis://alice:w%40nder@127.0.0.1:{port}/2",
            ):
                with connected(url) as client:
                    lock = RedisLockBackend(client, PREFIX).lock("job", ttl=5)
                    assert lock.acquire() and lock.release()
            wrong = f"redis://:wrong@127.0.0.1:{port}/2"
            with connected(wrong, retry=None) as client, pytest.raises(LockError):
                RedisLockBackend(client, PREFIX).lock("job").acquire()

    def test_rediss_tls(self, tmp_path: Path) -> None:
        if shutil.which("openssl") is None:
            pytest.skip("openssl is not installed: cannot make a test certificate")
        cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1"],
            check=True, capture_output=True,
        )  # fmt: skip
        conf = (
            f"tls-cert-file {cert}\ntls-key-file {key}\ntls-ca-cert-file {cert}\n"
            "tls-auth-clients no\n"
        )
        with redis_server(tmp_path, conf, tls=True) as (port, _):
            url = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={cert}"
            with connected(url) as client:
                assert client.connection_pool.connection_class is redis.SSLConnection
                lock = RedisLockBackend(client, PREFIX).lock("job", ttl=5)
                assert lock.acquire() and lock.fencing_token == 1 and lock.release()

    def test_sentinel_url_finds_the_master(self, tmp_path: Path) -> None:
        sentinel_binary = shutil.which("redis-sentinel")
        if sentinel_binary is None:
            pytest.skip("redis-sentinel is not installed (apt-get install redis-sentinel)")
        with redis_server(tmp_path, "requirepass masterpw\n") as (master_port, _):
            conf = (
                f"sentinel monitor drifttest 127.0.0.1 {master_port} 1\n"
                "sentinel auth-pass drifttest masterpw\n"
                "sentinel down-after-milliseconds drifttest 60000\n"
                "requirepass sentinelpw\n"
            )
            with redis_server(tmp_path, conf, binary=sentinel_binary) as (sentinel_port, _):
                url = (
                    f"redis+sentinel://:masterpw@127.0.0.1:{sentinel_port}/drifttest/4"
                    "?sentinel_password=sentinelpw"
                )
                settings = DriftSafeSettings(redis_url=url, key_prefix=PREFIX)
                client = get_redis(settings)
                try:
                    assert client.connection_pool.get_master_address() == (
                        "127.0.0.1",
                        master_port,
                    )
                    locks = lock_backend(settings)
                    assert isinstance(locks, RedisLockBackend) and locks.client is client
                    lock = locks.lock("job", ttl=5)
                    assert lock.acquire()
                    direct = redis.Redis(port=master_port, password="masterpw", db=4)
                    try:
                        assert direct.get(f"{PREFIX}:lock:job") == lock.token.encode()  # type: ignore[union-attr]
                    finally:
                        direct.close()
                    assert lock.release()
                finally:
                    redis_client._clients.pop(next(k for k in redis_client._clients if k[1] == url))
                    client.close()


# -- helpers: throw-away Redis servers ----------------------------------------------------------


@contextmanager
def redis_server(
    tmp_path: Path, conf: str = "", *, tls: bool = False, binary: str | None = None
) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """A ``redis-server`` (or ``redis-sentinel``) on a free port, stopped on exit."""
    binary = binary or shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    listen = f"port 0\ntls-port {port}\n" if tls else f"port {port}\n"
    path = tmp_path / f"redis-{port}.conf"  # Sentinel rewrites its file: it must be writable
    path.write_text(f'{listen}bind 127.0.0.1\nsave ""\nappendonly no\ndir {tmp_path}\n{conf}')
    process = subprocess.Popen(
        [binary, str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{binary} did not start on port {port} (config {path})")
            time.sleep(0.02)
        yield port, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.terminate()
        process.wait(10)


@contextmanager
def connected(url: str, **options: Any) -> Iterator[Any]:
    client = client_from_url(url, **options)
    try:
        yield client
    finally:
        client.close()


def test_lock_identity_names_the_store_and_fits_the_run_column() -> None:
    """``database`` without ``REDIS_URL``; ``redis:<KEY_PREFIX>`` with it; a prefix too long
    for the run's ``lock_store`` column by its digest, still one name per prefix."""
    from celery_driftsafe.conf import DriftSafeSettings
    from celery_driftsafe.locks import MAX_LOCK_IDENTITY, lock_identity
    from celery_driftsafe.models import Run

    assert Run._meta.get_field("lock_store").max_length == MAX_LOCK_IDENTITY
    redis = "redis://127.0.0.1:6379/0"
    assert lock_identity(DriftSafeSettings(key_prefix="p")) == "database"
    assert lock_identity(DriftSafeSettings(redis_url=redis, key_prefix="p")) == "redis:p"
    fits = "x" * (MAX_LOCK_IDENTITY - len("redis:"))
    assert lock_identity(DriftSafeSettings(redis_url=redis, key_prefix=fits)) == "redis:" + fits
    long_ones = {
        lock_identity(DriftSafeSettings(redis_url=redis, key_prefix=fits + tail))
        for tail in ("a", "b")
    }
    assert len(long_ones) == 2
    assert all(name.startswith("redis-sha256:") for name in long_ones)
    assert all(len(name) <= MAX_LOCK_IDENTITY for name in long_ones)


def test_a_redis_that_may_evict_run_locks_is_named(tmp_path: Path) -> None:
    """A beat warns at start when its Redis would evict keys (a ``maxmemory`` and a policy
    other than ``noeviction``): an evicted run lock is free while its run still runs. A
    private server, so the shared one's settings are left alone."""
    from celery_driftsafe.conf import DriftSafeSettings
    from celery_driftsafe.store.redis import eviction_risk
    from celery_driftsafe.testing.processes import NoRedis, start_redis

    try:
        server = start_redis(tmp_path / "redis", options=["--maxmemory-policy", "noeviction"])
    except NoRedis as exc:
        pytest.fail(f"{exc} (apt-get install redis-server)")
    url = f"{server.url}/0"
    client = redis.Redis.from_url(url)
    try:
        settings = DriftSafeSettings(redis_url=url, key_prefix="evict")
        assert eviction_risk(DriftSafeSettings()) is None  # no Redis at all
        client.config_set("maxmemory", 0)
        client.config_set("maxmemory-policy", "allkeys-lru")
        assert eviction_risk(settings) is None  # no limit: nothing is evicted
        client.config_set("maxmemory", 64 * 1024 * 1024)
        client.config_set("maxmemory-policy", "noeviction")
        assert eviction_risk(settings) is None
        for policy in ("volatile-lru", "allkeys-lfu", "volatile-ttl"):
            client.config_set("maxmemory-policy", policy)
            risk = eviction_risk(settings)
            assert risk is not None and f"maxmemory-policy {policy}" in risk, risk
            assert "noeviction" in risk and "67108864 bytes" in risk
    finally:
        client.close()
        server.stop()
