"""Waking a waiting beat early: the :class:`Wakeup` event (safe to set from a signal handler)
and the thread that sets it on every schedule-change notification (Redis pub/sub)."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import weakref
from typing import Any

from celery_driftsafe.conf import DriftSafeSettings
from celery_driftsafe.store.redis import channel, get_redis

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


def start_change_listener(
    settings: DriftSafeSettings, wake: Wakeup, shutdown: threading.Event
) -> threading.Thread | None:
    """A daemon thread that sets ``wake`` on every schedule-change message until ``shutdown``
    is set; None when no Redis is configured (the beat then only polls)."""
    client = get_redis(settings)
    if client is None:
        return None
    listener = threading.Thread(
        target=_listen,
        args=(client, settings, wake, shutdown),
        name="driftsafe-wakeups",
        daemon=True,
    )
    listener.start()
    return listener


def _listen(
    client: Any, settings: DriftSafeSettings, wake: Wakeup, shutdown: threading.Event
) -> None:
    """Set the wake event on every schedule-change message; reconnect with backoff."""
    from redis.exceptions import RedisError

    name = channel(settings, "changes")
    failing = False
    delay = 0.5
    while not shutdown.is_set():
        try:
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(name)
            if failing:
                logger.warning("schedule-change notifications restored")
                failing, delay = False, 0.5
            while not shutdown.is_set():
                # a short wait: a stopping beat joins this thread (a few polls a second)
                if pubsub.get_message(timeout=LISTEN_POLL_SECONDS) is not None:
                    wake.set()
        except (RedisError, OSError) as exc:
            if not failing:
                logger.warning(
                    "schedule-change notifications unavailable (%s); polling every %.1f s",
                    exc,
                    settings.max_loop_interval_seconds,
                )
            failing = True
            shutdown.wait(delay)
            delay = min(delay * 2, 10.0)
