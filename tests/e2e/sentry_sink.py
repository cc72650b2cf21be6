"""A stand-in for Sentry's ingestion endpoint, in the test's process: it takes the envelopes
that ``sentry_sdk`` posts (``/api/<project>/envelope/``, gzip or plain) and keeps their items,
so an end-to-end test can read what the beat and the worker told Sentry (Crons check-ins).
"""

from __future__ import annotations

import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class SentrySink:
    """``with SentrySink() as sink:`` serves on a free loopback port; :attr:`dsn` points a
    ``sentry_sdk.init`` there, and :meth:`items` gives what arrived, of one type."""

    def __init__(self) -> None:
        self._items: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                sink._take(body)
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def dsn(self) -> str:
        return f"http://public@127.0.0.1:{self._server.server_address[1]}/1"

    def __enter__(self) -> SentrySink:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _take(self, envelope: bytes) -> None:
        """An envelope: a header line, then for each item its header line and its payload
        (``length`` bytes, or up to the next newline)."""
        rest = envelope.split(b"\n", 1)[1] if b"\n" in envelope else b""
        items = []
        while rest.strip():
            header_line, rest = rest.split(b"\n", 1)
            header = json.loads(header_line)
            if "length" in header:
                payload, rest = rest[: header["length"]], rest[header["length"] + 1 :]
            else:
                payload, _, rest = rest.partition(b"\n")
            try:
                items.append((header.get("type", ""), json.loads(payload)))
            except ValueError:
                items.append((header.get("type", ""), payload))
        with self._lock:
            self._items.extend(items)

    def items(self, kind: str) -> list[Any]:
        with self._lock:
            return [payload for item_kind, payload in self._items if item_kind == kind]
