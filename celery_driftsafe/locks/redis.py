"""The Redis lock backend: a lease timed by Redis, a fencing counter that expires a while after
its last use (``fence_ttl``; see ``docs/reference/locks.md`` for why that is safe)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from celery_driftsafe.exceptions import LockError
from celery_driftsafe.locks.contract import DEFAULT_TTL
from celery_driftsafe.locks.lease import _LeaseLock, _log_extra
from celery_driftsafe.store.clock import Clock, SystemClock

logger = logging.getLogger("celery_driftsafe.locks")

# KEYS[1] the lock, KEYS[2] its fencing counter; ARGV[1] the token, ARGV[2] the lease in ms,
# ARGV[3] the fencing floor (the token handed out is above it), ARGV[4] the counter's time to
# live in ms (0: none), ARGV[5] '' (a free lock) or the heir it must have been handed to,
# ARGV[6] '' or the start of the token it must be held under ('<holder>#', see take_from).
_ACQUIRE_SCRIPT = """
local taken
if ARGV[6] ~= '' then
    local held = redis.call('GET', KEYS[1])
    if held and string.sub(held, 1, string.len(ARGV[6])) == ARGV[6] then
        taken = redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    end
elseif ARGV[5] == '' then
    taken = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
elseif redis.call('GET', KEYS[1]) == ARGV[5] then
    taken = redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
if taken then
    local token = redis.call('INCR', KEYS[2])
    local floor = tonumber(ARGV[3])
    if token <= floor then
        token = floor + 1
        redis.call('SET', KEYS[2], token)
    end
    if tonumber(ARGV[4]) > 0 then
        redis.call('PEXPIRE', KEYS[2], ARGV[4])
    end
    return token
end
return 0
"""
# KEYS[1] the lock; ARGV[1] the token, ARGV[2] the lease in ms, ARGV[3] '1' when the holder's
# own lease has not run out: a key gone then (a flush, an eviction, a restart that kept nothing)
# is set again for the holder. Returns 1 extended, 2 set again, 0 held by another or over.
_EXTEND_SCRIPT = """
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if not held and ARGV[3] == '1' then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    return 2
end
return 0
"""
# KEYS[1] the lock; ARGV[1] the token, ARGV[2] the heir, ARGV[3] the heir's lease in ms.
_HAND_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
    return 1
end
return 0
"""
_RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisLockBackend:
    """Locks in Redis under ``<key_prefix>:lock:<name>``, fencing counters under
    ``<key_prefix>:fence:<name>``. ``clock`` only measures waits (Redis times the lease).

    One server or a Sentinel-managed master; not Redis Cluster (the two keys of a lock would
    need to share a hash slot). The client's socket timeouts and retries bound how long one
    call can hang; the watchdog declares a lease lost on time regardless.
    """

    def __init__(
        self,
        client: Any,
        key_prefix: str = "driftsafe",
        *,
        clock: Clock | None = None,
        fence_ttl: float | None = None,
    ) -> None:
        self.client = client
        self.key_prefix = key_prefix
        #: Seconds a fencing counter lives after its last acquisition (None: forever).
        self.fence_ttl = fence_ttl
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.acquire_script = client.register_script(_ACQUIRE_SCRIPT)
        self.extend_script = client.register_script(_EXTEND_SCRIPT)
        self.release_script = client.register_script(_RELEASE_SCRIPT)
        self.hand_script = client.register_script(_HAND_SCRIPT)

    def lock(
        self, name: str, ttl: float = DEFAULT_TTL, *, fencing_floor: int = 0, holder: str = ""
    ) -> RedisLock:
        return RedisLock(self, name, ttl, fencing_floor=fencing_floor, holder=holder)

    def lock_key(self, name: str) -> str:
        return f"{self.key_prefix}:lock:{name}"

    def fence_key(self, name: str) -> str:
        return f"{self.key_prefix}:fence:{name}"


def _ms(ttl: float) -> int:
    # Round up: Redis' lease never ends before the local view of it.
    return math.ceil(ttl * 1000)


class RedisLock(_LeaseLock):
    """A :class:`DistributedLock` in Redis; see :class:`RedisLockBackend`."""

    def __init__(
        self,
        backend: RedisLockBackend,
        name: str,
        ttl: float = DEFAULT_TTL,
        *,
        fencing_floor: int = 0,
        holder: str = "",
    ) -> None:
        super().__init__(name, ttl, backend.clock, fencing_floor, holder)
        self.backend = backend
        self.key = backend.lock_key(name)

    def _call(self, script: Any, keys: Sequence[str], args: Sequence[str | int]) -> int:
        from redis.exceptions import RedisError

        try:
            return int(script(keys=list(keys), args=list(args)))
        except RedisError as exc:
            raise LockError(f"lock {self.name!r}: Redis error: {exc}") from exc

    def _acquire_token(
        self, token: str, ttl: float, heir: str | None = None, holder: str | None = None
    ) -> int | None:
        keys = (self.key, self.backend.fence_key(self.name))
        fence_ttl = self.backend.fence_ttl
        fencing_token = self._call(
            self.backend.acquire_script,
            keys,
            (
                token,
                _ms(ttl),
                self.fencing_floor,
                _ms(fence_ttl) if fence_ttl else 0,
                heir or "",
                f"{holder}#" if holder else "",
            ),
        )
        return fencing_token or None

    def _hand_token(self, token: str, heir: str, ttl: float) -> bool:
        return self._call(self.backend.hand_script, (self.key,), (token, heir, _ms(ttl))) == 1

    def _extend_token(self, token: str, ttl: float) -> bool:
        """Restart the lease; or, while this holder's own lease lasts, set again a key Redis
        lost. Only an empty key is set: had another process taken the lock meanwhile, the key
        would hold its token (and its fencing token would be above this holder's)."""
        own_lease = "1" if self.lease_remaining() > 0 else "0"
        outcome = self._call(self.backend.extend_script, (self.key,), (token, _ms(ttl), own_lease))
        if outcome == 2:
            logger.warning(
                "lock %s (fencing token %s) was gone from Redis while held (a flush, an "
                "eviction or a restart that kept no data): set again for its holder; until "
                "then it was free, and another process may have taken it and done the work",
                self.name,
                self.fencing_token,
                extra=_log_extra("lock-retaken", self),
            )
        return outcome in (1, 2)

    def _release_token(self, token: str) -> bool:
        return self._call(self.backend.release_script, (self.key,), (token,)) == 1
