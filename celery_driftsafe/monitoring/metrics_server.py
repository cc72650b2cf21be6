"""Serving the Prometheus metrics over HTTP: a beat node's server on ``METRICS_PORT`` (from the
node's registration to its stop) and a worker main process's on ``WORKER_METRICS_PORT``, over
the multiprocess collector when ``PROMETHEUS_MULTIPROC_DIR`` is set (a prefork pool's bodies
count in child processes). The metrics themselves and their hooks are in
:mod:`celery_driftsafe.monitoring.metrics`.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from celery_driftsafe.conf import DriftSafeSettings, get_settings
from celery_driftsafe.exceptions import ConfigurationError
from celery_driftsafe.monitoring import metrics
from celery_driftsafe.monitoring.metrics import import_prometheus

logger = logging.getLogger("celery_driftsafe.metrics_server")


@dataclass
class Server:
    """A running metrics HTTP server (prometheus-client's, in a daemon thread)."""

    httpd: Any
    thread: threading.Thread
    port: int

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def _serve(setting: str, port: int, address: str, registry: Any) -> Server:
    pc = import_prometheus()
    try:
        httpd, thread = pc.start_http_server(port, addr=address, registry=registry)
    except OSError as exc:
        raise ConfigurationError(
            setting,
            port,
            f"cannot serve metrics on {address}:{port}: {exc}",
            "pick a free port (each beat or worker on one host needs its own)",
        ) from exc
    server = Server(httpd, thread, int(httpd.server_port))
    logger.info(
        "serving Prometheus metrics on %s:%d (%s)",
        address,
        server.port,
        setting,
        extra={"action": "metrics-serve"},
    )
    return server


def serve_beat(settings: DriftSafeSettings) -> Server | None:
    """Serve the beat's metrics on ``METRICS_PORT`` (None when it is not set)."""
    if settings.metrics_port is None:
        return None
    # Defined before the first scrape, so every series is there from the start.
    metrics.beat_metrics()
    pc = import_prometheus()
    return _serve("METRICS_PORT", settings.metrics_port, settings.metrics_address, pc.REGISTRY)


_node_servers: dict[str, Server] = {}
_servers_lock = threading.Lock()


def serve_node(node_id: str) -> Server | None:
    """A beat node registered: serve its metrics on ``METRICS_PORT``, once per node (a node
    registered again after being marked dead keeps its server)."""
    with _servers_lock:
        server = _node_servers.get(node_id)
        if server is None and (server := serve_beat(get_settings())) is not None:
            _node_servers[node_id] = server
        return server


def node_server(node_id: str) -> Server | None:
    """The metrics server of a beat node, if it serves one."""
    return _node_servers.get(node_id)


def stop_node(node_id: str) -> None:
    """A beat node stopped: stop serving its metrics."""
    with _servers_lock:
        server = _node_servers.pop(node_id, None)
    if server is not None:
        server.stop()


_worker_server: Server | None = None


def worker_registry() -> Any:
    """The registry a worker's main process serves: the multiprocess collector over
    ``PROMETHEUS_MULTIPROC_DIR`` when set, else the process's own."""
    pc = import_prometheus()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = pc.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry
    return pc.REGISTRY


def on_worker_init(sender: Any = None, **kwargs: Any) -> None:
    """``worker_init`` receiver (the worker's main process, before its pool starts): serve
    on ``WORKER_METRICS_PORT``."""
    global _worker_server
    settings = get_settings()
    if settings.worker_metrics_port is None or _worker_server is not None:
        return
    pool = str(getattr(sender, "pool_cls", "") or "")
    if "prefork" in pool and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        logger.warning(
            "WORKER_METRICS_PORT is set on a prefork worker without PROMETHEUS_MULTIPROC_DIR: "
            "the bodies run in child processes whose counters this process cannot see; set "
            "PROMETHEUS_MULTIPROC_DIR to an empty directory (see the monitoring how-to)",
            extra={"action": "metrics-serve"},
        )
    metrics.worker_metrics()
    _worker_server = _serve(
        "WORKER_METRICS_PORT",
        settings.worker_metrics_port,
        settings.metrics_address,
        worker_registry(),
    )


def on_worker_shutdown(sender: Any = None, **kwargs: Any) -> None:
    """``worker_shutdown`` receiver: stop serving."""
    global _worker_server
    server, _worker_server = _worker_server, None
    if server is not None:
        server.stop()
