"""The Redis connection this package uses (``DRIFTSAFE['REDIS_URL']``), one pool per process.

``REDIS_URL`` takes every form :meth:`redis.Redis.from_url` understands, plus Sentinel:

* ``redis://[[user]:password@]host[:port][/db]`` — plain TCP, with optional AUTH
  (``redis://:secret@host`` for the default user, ``redis://alice:secret@host`` for an ACL user);
* ``rediss://…`` — the same over TLS (``?ssl_cert_reqs=required&ssl_ca_certs=/path/ca.pem``);
* ``unix:///path/to/redis.sock?db=0`` — a Unix socket;
* ``redis+sentinel://[[user]:password@]host1[:port],host2[:port]/service_name[/db]`` — ask the
  Sentinels (default port 26379) where the master of ``service_name`` is, and follow failovers.
  The credentials in the URL are the *master's*. Sentinels that require their own password
  take ``?sentinel_password=…`` (and ``&sentinel_username=…``).
  ``rediss+sentinel://…`` uses TLS to the Sentinels and to the master.

User names and passwords are percent-decoded (``%40`` for ``@``, ``%3A`` for ``:``).
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from celery_driftsafe.conf import DriftSafeSettings, get_settings
from celery_driftsafe.exceptions import ConfigurationError

_clients: dict[tuple[int, str], Any] = {}
_lock = threading.Lock()

#: URL schemes that name a Sentinel deployment (plain and TLS).
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_SENTINEL_PORT = 26379
_SENTINEL_QUERY_OPTIONS = ("sentinel_username", "sentinel_password")
_CLIENT_OPTIONS: dict[str, Any] = {
    "socket_timeout": 5,
    "socket_connect_timeout": 5,
    "health_check_interval": 30,
}


def get_redis(settings: DriftSafeSettings | None = None) -> Any | None:
    """A ``redis.Redis`` for ``REDIS_URL``, or None when no Redis is configured.

    Clients are cached per process id, so a forked worker child never shares its parent's
    sockets. A Sentinel URL gives a client bound to the current master.
    """
    settings = settings or get_settings()
    if not settings.redis_url:
        return None
    key = (os.getpid(), settings.redis_url)
    with _lock:
        client = _clients.get(key)
        if client is None:
            client = client_from_url(settings.redis_url)
            _clients[key] = client
        return client


def client_from_url(url: str, **options: Any) -> Any:
    """A new ``redis.Redis`` for ``url`` (any form in the module docstring), uncached.

    ``options`` override the defaults (5 s socket timeouts, health check every 30 s).
    """
    import redis

    options = {**_CLIENT_OPTIONS, **options}
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **options)
    from redis.sentinel import Sentinel

    parsed = parse_sentinel_url(url)
    sentinel_options = {k: v for k, v in options.items() if k.startswith("socket_")}
    if parsed.sentinel_username is not None:
        sentinel_options["username"] = parsed.sentinel_username
    if parsed.sentinel_password is not None:
        sentinel_options["password"] = parsed.sentinel_password
    if parsed.ssl:
        sentinel_options["ssl"] = True
    sentinel = Sentinel(list(parsed.sentinels), sentinel_kwargs=sentinel_options)
    return sentinel.master_for(
        parsed.service_name,
        db=parsed.db,
        username=parsed.username,
        password=parsed.password,
        ssl=parsed.ssl,
        **options,
    )


@dataclass(frozen=True)
class SentinelURL:
    """A parsed ``redis+sentinel://`` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` names a Sentinel deployment."""
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse ``redis+sentinel://[[user]:password@]host[:port],…/service_name[/db][?options]``.

    Raises :class:`ConfigurationError` (naming ``REDIS_URL``, password masked) for anything
    else: another scheme, no host, a bad port, no service name, a non-integer db, an unknown
    query option.
    """
    masked = mask_url(url)

    def fail(problem: str) -> ConfigurationError:
        hint = "use redis+sentinel://[:password@]host1:26379,host2:26379/service_name/db"
        return ConfigurationError("REDIS_URL", masked, problem, hint)

    try:
        split = urlsplit(url)
    except ValueError as exc:
        raise fail(f"not a URL: {exc}") from None
    if split.scheme.lower() not in SENTINEL_SCHEMES:
        raise fail(f"scheme must be one of {', '.join(SENTINEL_SCHEMES)}")
    userinfo, _, hostlist = split.netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, has_password, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if has_password else None
    sentinels = tuple(_parse_host(part, fail) for part in hostlist.split(","))
    path = [unquote(part) for part in split.path.split("/")[1:]]
    if path and path[-1] == "":
        path.pop()  # a trailing slash
    if not path or not path[0]:
        raise fail("no Sentinel service name in the path")
    if len(path) > 2:
        raise fail("the path is /service_name or /service_name/db, nothing more")
    db = 0
    if len(path) == 2:
        if not path[1].isdigit():
            raise fail(f"database {path[1]!r} is not a non-negative integer")
        db = int(path[1])
    query = parse_qs(split.query, keep_blank_values=True)
    unknown = sorted(set(query) - set(_SENTINEL_QUERY_OPTIONS))
    if unknown:
        raise fail(f"unknown option {unknown[0]!r}; known: {', '.join(_SENTINEL_QUERY_OPTIONS)}")
    options = {name: values[-1] for name, values in query.items()}
    return SentinelURL(
        sentinels=sentinels,
        service_name=path[0],
        db=db,
        username=username,
        password=password,
        sentinel_username=options.get("sentinel_username"),
        sentinel_password=options.get("sentinel_password"),
        ssl=split.scheme.lower() == "rediss+sentinel",
    )


def _parse_host(part: str, fail: Any) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port``."""
    if part.startswith("["):
        host, bracket, rest = part[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise fail(f"bad IPv6 Sentinel address {part!r}")
        port_text = rest[1:] if rest else ""
    else:
        host, _, port_text = part.partition(":")
    if not host:
        raise fail("a Sentinel host is empty")
    if not port_text:
        return host, DEFAULT_SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise fail(f"bad port {port_text!r} for Sentinel {host!r}")
    return host, int(port_text)


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for error messages and logs).

    Plain string surgery, so it also masks URLs too broken for :func:`urlsplit`."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = userinfo.split(":", 1)[0] + ":***@" + hosts
    tail = re.sub(r"(?<=[?&])((?:sentinel_)?password)=[^&]*", r"\1=***", tail)
    return f"{scheme}://{netloc}{tail}"


def key_prefix(settings: DriftSafeSettings) -> str:
    """The prefix of every Redis key and channel of this package: ``KEY_PREFIX``, by default
    derived from the default database (:func:`celery_driftsafe.conf.default_key_prefix`).
    Everything that names a Redis key or channel goes through here or :func:`channel`."""
    return settings.key_prefix


def channel(settings: DriftSafeSettings, name: str) -> str:
    """A namespaced key or channel name: ``<key_prefix>:<name>``."""
    return f"{key_prefix(settings)}:{name}"


def eviction_risk(settings: DriftSafeSettings | None = None) -> str | None:
    """Why the Redis of ``REDIS_URL`` may evict run locks, for a warning: it has a
    ``maxmemory`` and a policy other than ``noeviction`` (``volatile-*`` policies evict keys
    with a time to live first, and a lock is such a key). An evicted lock is free, so a
    redelivered copy of a run still running can take it over and run the body again. None
    when it evicts nothing, or does not say (``INFO`` refused or out of reach)."""
    import redis

    client = get_redis(settings)
    if client is None:
        return None
    try:
        memory = client.info("memory")
    except redis.RedisError:
        return None
    limit = int(memory.get("maxmemory") or 0)
    policy = str(memory.get("maxmemory_policy", "noeviction"))
    if not limit or policy == "noeviction":
        return None
    return (
        f"the Redis of REDIS_URL evicts keys at its maxmemory ({limit} bytes, "
        f"maxmemory-policy {policy}): an evicted run lock is free, and a redelivered copy of "
        "a run still running would take it over and run the body again; set "
        "maxmemory-policy noeviction, or give celery_driftsafe a Redis of its own"
    )
