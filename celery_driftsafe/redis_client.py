"""The Redis connection this package uses (``DRIFTSAFE['REDIS_URL']``), one pool per process."""

from __future__ import annotations

import os
import threading
from typing import Any

from celery_driftsafe.conf import DriftSafeSettings, get_settings

_clients: dict[tuple[int, str], Any] = {}
_lock = threading.Lock()


def get_redis(settings: DriftSafeSettings | None = None) -> Any | None:
    """A ``redis.Redis`` for ``REDIS_URL``, or None when no Redis is configured.

    Clients are cached per process id, so a forked worker child never shares its parent's
    sockets.
    """
    settings = settings or get_settings()
    if not settings.redis_url:
        return None
    key = (os.getpid(), settings.redis_url)
    with _lock:
        client = _clients.get(key)
        if client is None:
            import redis

            client = redis.Redis.from_url(
                settings.redis_url, socket_timeout=5, socket_connect_timeout=5,
                health_check_interval=30,
            )
            _clients[key] = client
        return client


def channel(settings: DriftSafeSettings, name: str) -> str:
    """A namespaced key or channel name."""
    return f"{settings.key_prefix}:{name}"
