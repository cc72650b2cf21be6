"""Waking a waiting beat early: the :class:`Wakeup` event (safe to set from a signal handler)
and the thread that sets it on every schedule-change notification (Redis pub/sub)."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from celery_driftsafe.conf import DriftSafeSettings
from celery_driftsafe.monitoring import metrics
from celery_driftsafe.store.redis import channel, get_redis, mask_url

logger = logging.getLogger("celery_driftsafe.scheduler")


class Wakeup:
    """An event that a signal handler may set: a flag and a self-pipe, no lock.

    ``threading.Event.set()`` takes a lock that the interrupted main thread may be holding
    (inside its own ``Event.wait()``), so calling it from a signal handler can deadlock the
    process; raising out of a handler inside ``Event.wait()`` can leave that lock released
    twice. Here ``set()`` is a flag write and a one-byte ``os.write``, and ``wait()`` is a
    ``poll()`` (``select()`` where there is none) that returns as soon as anything was written.
    """

    def __init__(self) -> None:
        self._flag = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        # Closed when the object goes, never while a thread could still write to it.
        weakref.finalize(self, _close_fds, self._read, self._write)

    def set(self) -> None:
        self._flag = True
        with contextlib.suppress(BlockingIOError):  # a full pipe: a wake-up is pending anyway
            os.write(self._write, b"\0")

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float) -> bool:
        """Until set or ``timeout`` seconds passed; whether it is set."""
        if self._flag:
            return True
        if hasattr(select, "poll"):  # any descriptor number, unlike select()
            poller = select.poll()
            poller.register(self._read, select.POLLIN)
            poller.poll(max(timeout, 0.0) * 1000)
        else:
            select.select([self._read], [], [], max(timeout, 0.0))
        return self._flag

    def clear(self) -> None:
        self._flag = False
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read, 4096):
                pass


def _close_fds(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


#: How long the change listener waits for a message before it looks whether the beat stops.
LISTEN_POLL_SECONDS = 0.2
#: While Redis does not answer, the listener says so (ERROR) at least this often.
OUTAGE_REPEAT_SECONDS = 30.0


class RedisHealth:
    """Whether the beat's Redis answers, as its change listener last found it: written by the
    listener's thread, read by the beat's heartbeat (plain attributes, replaced whole)."""

    def __init__(self) -> None:
        #: Since when (monotonic) Redis has not answered, and its last error; None: it answers.
        self.failing: tuple[float, str] | None = None


def start_change_listener(
    settings: DriftSafeSettings,
    wake: Wakeup,
    shutdown: threading.Event,
    health: RedisHealth | None = None,
    loop_seconds: float | None = None,
) -> threading.Thread | None:
    """A daemon thread that sets ``wake`` on every schedule-change message until ``shutdown``
    is set, keeping ``health`` up to date; None when no Redis is configured (the beat then only
    polls, every ``loop_seconds``: its longest wait, which its log names)."""
    client = get_redis(settings)
    if client is None:
        return None
    listener = threading.Thread(
        target=_listen,
        args=(client, settings, wake, shutdown, health or RedisHealth()),
        kwargs={"loop_seconds": loop_seconds},
        name="driftsafe-wakeups",
        daemon=True,
    )
    listener.start()
    return listener


def _listen(
    client: Any,
    settings: DriftSafeSettings,
    wake: Wakeup,
    shutdown: threading.Event,
    health: RedisHealth,
    monotonic: Callable[[], float] = time.monotonic,
    loop_seconds: float | None = None,
) -> None:
    """Set the wake event on every schedule-change message; reconnect with backoff. While
    Redis does not answer it says so at ERROR, naming it and what that stops, at once and
    then at least every :data:`OUTAGE_REPEAT_SECONDS`; once Redis answers again, one line."""
    from redis.exceptions import RedisError

    name = channel(settings, "changes")
    where = mask_url(settings.redis_url or "")
    failing_since: float | None = None
    said_at = 0.0
    delay = 0.5
    while not shutdown.is_set():
        try:
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(name)
            if failing_since is not None:
                logger.warning(
                    "Redis at %s answers again after %.0f s: schedule-change notifications "
                    "restored",
                    where,
                    monotonic() - failing_since,
                    extra={"action": "redis-restored"},
                )
                failing_since, delay = None, 0.5
            health.failing = None
            metrics.dependency_up("redis", True)
            while not shutdown.is_set():
                # a short wait: a stopping beat joins this thread (a few polls a second)
                if pubsub.get_message(timeout=LISTEN_POLL_SECONDS) is not None:
                    wake.set()
        except (RedisError, OSError) as exc:
            now = monotonic()
            if failing_since is None or now - said_at >= OUTAGE_REPEAT_SECONDS:
                logger.error(
                    "Redis at %s does not answer (%s)%s: schedule-change notifications are "
                    "unavailable, so edits reach this beat at its next loop (every %.1f s); "
                    "slots are still claimed and published from the database",
                    where,
                    exc,
                    "" if failing_since is None else f" for {now - failing_since:.0f} s",
                    loop_seconds or settings.max_loop_interval_seconds,
                    extra={"action": "redis-unavailable"},
                )
                said_at = now
            if failing_since is None:
                failing_since = now
                metrics.dependency_up("redis", False)
            health.failing = (failing_since, str(exc))
            shutdown.wait(delay)
            delay = min(delay * 2, 10.0)
