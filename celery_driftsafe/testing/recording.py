"""Record every message published to a Redis broker list, stamped with the time it arrived,
and the one percentile the measurements use.

:class:`QueueRecorder` pops the list in a thread as messages arrive and stamps them with the
recording process's clock (default ``time.time``). On one machine that clock is the clock of
the PostgreSQL and Redis servers, the time authority, so a message stamped before its slot
was published early. The first message of a burst is stamped as ``BRPOP`` returns, the rest of
the list is taken in one transaction right after and shares one stamp: a stamp is late by at
most one drain (milliseconds). Parsing waits until :attr:`QueueRecorder.messages` is read, so
recording takes little CPU from the processes measured.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import redis

T = TypeVar("T")


def nearest_rank(count: int, q: float) -> int:
    """The 1-based rank of the ``q``-th percentile (0..100) among ``count`` sorted values."""
    return min(count, max(1, math.ceil(q / 100.0 * count)))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100; 50 is the median's lower value for an even
    count, 100 the maximum); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[nearest_rank(len(ordered), q) - 1]


class QueueRecorder(Generic[T]):
    """Drains one Redis list in a thread; ``parse(raw, stamp)`` turns each item into a ``T``
    (None: not counted)."""

    def __init__(
        self,
        url: str,
        queue: str,
        parse: Callable[[bytes, float], T | None],
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = redis.Redis.from_url(url)
        self.queue = queue
        self._parse = parse
        self._clock = clock
        self._raw: list[tuple[bytes, float]] = []
        self._parsed: list[T] = []
        self._seen = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recorder", daemon=True)

    def start(self) -> QueueRecorder[T]:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0, *, delete: bool = True) -> None:
        """Stop once the list is empty (or after ``timeout`` seconds); ``delete`` drops what
        is left and closes the connection."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if delete:
            with contextlib.suppress(redis.ConnectionError):
                self.client.delete(self.queue)
            self.client.close()

    @property
    def received(self) -> int:
        """Items popped so far (parsed or not)."""
        return len(self._raw)

    @property
    def messages(self) -> list[T]:
        """Every parsed message so far, in arrival order."""
        with self._lock:
            raw = self._raw
            while self._seen < len(raw):
                item, stamp = raw[self._seen]
                self._seen += 1
                parsed = self._parse(item, stamp)
                if parsed is not None:
                    self._parsed.append(parsed)
            return list(self._parsed)

    def _run(self) -> None:
        while not self._stop.is_set() or self._pending():
            try:
                self._drain()
            except redis.ConnectionError:  # keep recording once the server is back
                time.sleep(0.2)

    def _pending(self) -> int:
        try:
            return int(self.client.llen(self.queue))
        except redis.ConnectionError:
            return 0

    def _drain(self) -> None:
        item = self.client.brpop([self.queue], timeout=0.2)
        if item is None:
            return
        popped = item[1]
        if isinstance(popped, str):  # a client made with decode_responses=True
            popped = popped.encode()
        first = self._clock()
        with self.client.pipeline(transaction=True) as pipe:
            pipe.lrange(self.queue, 0, -1)
            pipe.delete(self.queue)
            rest = pipe.execute()[0]
        later = self._clock()
        # LPUSH puts the newest at the head: the rest in arrival order is the list reversed
        self._raw.append((popped, first))
        self._raw.extend((raw, later) for raw in reversed(rest))
