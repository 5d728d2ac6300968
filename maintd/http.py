"""HTTP endpoints: /metrics, /healthz, /readyz, /status (stdlib server in a thread)."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from .metrics import CONTENT_TYPE_LATEST

log = logging.getLogger("maintd.http")


class HttpServer:
    """``routes``: path -> callable returning (status, content_type, body bytes)."""

    def __init__(self, host: str, port: int, routes: dict[str, Callable[[], tuple[int, str, bytes]]]):
        self.routes = routes
        server_self = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                route = server_self.routes.get(self.path.split("?", 1)[0])
                if route is None:
                    status, ctype, body = 404, "text/plain", b"not found\n"
                else:
                    try:
                        status, ctype, body = route()
                    except Exception as exc:  # never leak internals
                        log.warning("http handler failed", extra={"fields": {"path": self.path,
                                                                              "error": type(exc).__name__}})
                        status, ctype, body = 500, "text/plain", b"internal error\n"
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="maintd-http", daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def text(status: int, body: str) -> tuple[int, str, bytes]:
    return status, "text/plain; charset=utf-8", body.encode()


def as_json(status: int, data: Any) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(data, default=str, indent=2).encode()


def metrics_body(render: Callable[[], bytes]) -> tuple[int, str, bytes]:
    return 200, CONTENT_TYPE_LATEST, render()
