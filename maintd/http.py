"""HTTP endpoints: /metrics, /healthz, /readyz, /status and the dashboard, on the bounded
listener of :mod:`maintd.listener`.

Two kinds of handlers share one listener: ``routes`` take no argument (the probes and metrics),
``pages`` take a :class:`Request` (query string, path parameters such as ``/jobs/{id}``, headers).
With an auth token, every path except ``open_paths`` needs ``Authorization: Bearer TOKEN`` or
``?token=TOKEN``, compared in constant time.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Generic, Mapping, TypeVar
from urllib.parse import parse_qs, unquote

from .listener import INLINE, Limits, Listener
from .metrics import CONTENT_TYPE_LATEST

log = logging.getLogger("maintd.http")
T = TypeVar("T")

# (status, content type, body) and optionally extra headers.
Response = tuple[int, str, bytes] | tuple[int, str, bytes, dict[str, str]]
MAX_QUERY_FIELDS = 32
# The lane of each path that is not a page (see maintd.listener).
LANES = {"/healthz": INLINE, "/readyz": INLINE, "/metrics": "metrics"}
COMMON_HEADERS = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-store",
                  "Referrer-Policy": "no-referrer"}


class HttpError(Exception):
    """Raised by a page: answered with ``status`` and ``message`` (a line for a person)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Request:
    path: str
    query: dict[str, list[str]]
    headers: Mapping[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    raw_query: str = ""  # as sent, before percent-decoding

    def arg(self, name: str) -> str | None:
        """The single value of query parameter ``name`` (``None`` if absent)."""
        values = self.query.get(name)
        if not values:
            return None
        if len(values) > 1:
            raise HttpError(400, f"parameter {name!r} is given {len(values)} times; give it once")
        if "\0" in values[0]:  # PostgreSQL text cannot hold it: a 400, not a database error
            raise HttpError(400, f"parameter {name!r} holds a NUL byte (%00)")
        return values[0]

    def only(self, allowed: Collection[str]) -> None:
        """Reject parameters this page does not know (a typo would otherwise go unnoticed)."""
        unknown = sorted(set(self.query) - set(allowed) - {"token"})
        if unknown:
            raise HttpError(400, f"unknown parameter {unknown[0]!r} (this page takes: "
                                 f"{', '.join(sorted(allowed)) or 'none'})")


def parse_request(raw_path: str, headers: Mapping[str, str]) -> Request:
    path, _, qs = raw_path.partition("?")
    try:
        query = parse_qs(qs, keep_blank_values=True, max_num_fields=MAX_QUERY_FIELDS)
    except ValueError:
        raise HttpError(400, f"too many query parameters (at most {MAX_QUERY_FIELDS})") from None
    return Request(path=path, query=query, headers=headers, raw_query=qs)


def match_page(pages: Mapping[str, Callable[[Request], Response]], path: str
               ) -> tuple[Callable[[Request], Response], dict[str, str]] | None:
    """The page for ``path``: an exact key, or a pattern with ``{name}`` segments."""
    if path in pages:
        return pages[path], {}
    parts = path.split("/")
    for pattern, page in pages.items():
        pat = pattern.split("/")
        if "{" not in pattern or len(pat) != len(parts):
            continue
        params: dict[str, str] = {}
        for want, got in zip(pat, parts):
            if want.startswith("{") and want.endswith("}") and got:
                params[want[1:-1]] = unquote(got)
            elif want != got:
                break
        else:
            return page, params
    return None


def bearer_or_query_token(req: Request) -> list[str]:
    """The Bearer credential, else the first ``?token=``: percent-decoded, and as written (a
    token may hold '+' or '%', which a link pasted by hand does not encode)."""
    auth = req.headers.get("Authorization") or ""
    scheme, _, cred = auth.strip().partition(" ")
    if scheme.lower() == "bearer" and cred.strip():
        return [cred.strip()]
    values, raw = req.query.get("token"), _raw_token(req)
    return [*values[:1], *([raw] if raw is not None else [])] if values else []


def _raw_token(req: Request) -> str | None:
    """The first ``?token=`` as written."""
    return next((v for k, _, v in (f.partition("=") for f in req.raw_query.split("&")) if k == "token"), None)


def matching_token(req: Request, expected: str) -> str | None:
    """The given token that is ``expected`` (each compared in constant time), or None."""
    want = expected.encode()
    hits = [given for given in bearer_or_query_token(req) if hmac.compare_digest(given.encode(), want)]
    return hits[0] if hits else None


def authorized(req: Request, expected: str) -> bool:
    return matching_token(req, expected) is not None


def with_matched_token(req: Request, expected: str | None) -> dict[str, list[str]]:
    """The query, its ``token`` in the form that matched ``expected`` (as written or decoded), so
    that the links a page makes from it carry the token on."""
    raw = _raw_token(req)
    decoded = req.query.get("token", [raw])[0]
    if expected and raw is not None and decoded != raw and matching_token(req, expected) == raw:
        return {**req.query, "token": [raw]}
    return req.query


def _secret(value: Any) -> str | None:
    if value is not None and hasattr(value, "get_secret_value"):
        value = value.get_secret_value()
    return value or None


class HttpServer:
    """``routes``: path -> callable returning a :data:`Response`; ``pages``: path or pattern
    (``/jobs/{id}``) -> callable taking a :class:`Request`. ``auth_token`` is read on every
    request (a reload may change it); ``None`` leaves everything open. ``lanes``: the worker lane
    of a path (see :mod:`maintd.listener`): the probes are answered on the listener's loop,
    ``/metrics`` has threads of its own, everything else is a page (two at a time). ``ready``:
    path -> callable returning the answer when it needs no work, else None, made on the
    listener's loop (for the ``open_paths`` only: a token is checked on the lane)."""

    def __init__(self, host: str, port: int, routes: dict[str, Callable[[], Response]], *,
                 pages: dict[str, Callable[[Request], Response]] | None = None,
                 auth_token: Callable[[], Any] | None = None,
                 open_paths: Collection[str] = ("/metrics", "/healthz", "/readyz"),
                 lanes: Mapping[str, str] | None = None, limits: Limits = Limits(),
                 ready: Mapping[str, Callable[[], Response | None]] | None = None):
        self.routes, self.pages = routes, dict(pages or {})
        self.auth_token, self.open_paths = auth_token, frozenset(open_paths)
        self.lanes = dict(LANES if lanes is None else lanes)
        self.ready = dict(ready or {})
        self.listener = Listener(host, port, lambda method, target, headers: self.respond(target, headers),
                                 lambda path: self.lanes.get(path, "page"), limits,
                                 ready=lambda method, target, headers: self.respond_ready(target, headers))

    def respond_ready(self, raw_path: str, headers: Mapping[str, str] | None = None
                      ) -> tuple[int, str, bytes, dict[str, str]] | None:
        """On the listener's loop: a request without the token refused (so that a flood of them
        takes no page worker from an operator who has it), or the answer of an open path whose
        ``ready`` route has it without work; else None (the request goes to its lane, to
        :meth:`respond`)."""
        path = raw_path.partition("?")[0]
        if path not in self.open_paths and self.auth_token:
            try:
                req = parse_request(raw_path, headers or {})
            except HttpError as exc:  # a bad request: said here too, not by a page worker
                status, ctype, body = text(exc.status, exc.message + "\n")
                return status, ctype, body, dict(COMMON_HEADERS)
            if (refused := self._unauthorized(req)) is not None:
                return refused
        route = self.ready.get(path) if path in self.open_paths else None
        result = route() if route is not None else None
        if result is None:
            return None
        status, ctype, body, *extra = result
        return status, ctype, body, {**COMMON_HEADERS, **(extra[0] if extra else {})}

    def respond(self, raw_path: str, headers: Mapping[str, str]) -> tuple[int, str, bytes, dict[str, str]]:
        try:
            req = parse_request(raw_path, headers)
            if (refused := self._unauthorized(req)) is not None:
                return refused
            result = self._dispatch(req)
        except HttpError as exc:
            result = text(exc.status, exc.message + "\n")
        except Exception as exc:  # never leak internals
            log.warning("http handler failed", extra={"fields": {"path": raw_path.split("?", 1)[0],
                                                                  "error": type(exc).__name__}})
            result = text(500, "internal error\n")
        status, ctype, body, *extra = result
        return status, ctype, body, {**COMMON_HEADERS, **(extra[0] if extra else {})}

    def _unauthorized(self, req: Request) -> tuple[int, str, bytes, dict[str, str]] | None:
        """The 401 of a request without the token (None: an open path, no token set, or it has it)."""
        token = _secret(self.auth_token()) if self.auth_token else None
        if not token or req.path in self.open_paths or authorized(req, token):
            return None
        return (401, "text/plain; charset=utf-8",
                b"unauthorized: send the http.auth_token as 'Authorization: Bearer TOKEN' "
                b"or as ?token=TOKEN\n", {**COMMON_HEADERS, "WWW-Authenticate": 'Bearer realm="maintd"'})

    def _dispatch(self, req: Request) -> Response:
        route = self.routes.get(req.path)
        if route is not None:
            return route()
        found = match_page(self.pages, req.path)
        if found is None:
            return text(404, "not found\n")
        page, params = found
        query = with_matched_token(req, _secret(self.auth_token()) if self.auth_token else None)
        return page(Request(path=req.path, query=query, headers=req.headers, params=params,
                            raw_query=req.raw_query))

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.address

    @property
    def port(self) -> int:
        return self.listener.address[1]

    def start(self) -> None:
        self.listener.start()

    def stop(self) -> None:
        self.listener.stop()


def text(status: int, body: str) -> tuple[int, str, bytes]:
    return status, "text/plain; charset=utf-8", body.encode()


def as_json(status: int, data: Any) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(data, default=str, indent=2).encode()


def metrics_body(render: Callable[[], bytes]) -> tuple[int, str, bytes]:
    return 200, CONTENT_TYPE_LATEST, render()


class Recent(Generic[T]):
    """``render()``'s last result while it is at most ``max_age`` seconds old, rendered again by
    one caller at a time: however many clients scrape ``/metrics`` at once, it is rendered at
    most once per ``max_age``. A render holds the interpreter's lock, which the listener's loop
    needs to answer the probes: a flood of scrapers rendering for themselves slowed ``/healthz``
    past a second.

    While one caller renders, the others take the last result rather than wait for the next, and
    :meth:`ready` (on the listener's loop) hands it out without a thread: a flood of scrapers
    waiting behind the render filled the metrics lane, and Prometheus' own scrape got ``503``.
    ``/status`` is kept so too: each one read the database (14 statements), once per request."""

    def __init__(self, render: Callable[[], T], max_age: float = 0.5):
        self.render, self.max_age = render, max_age
        self._lock = threading.Lock()
        self._body: T | None = None
        self._at = self._asked = float("-inf")

    def __call__(self) -> T:
        if not self._lock.acquire(blocking=self._body is None):
            return self._body  # being rendered by another caller: the last one meanwhile
        try:
            if time.monotonic() - self._at > self.max_age:
                self._body, self._at = self.render(), time.monotonic()
            return self._body
        finally:
            self._lock.release()

    def ready(self) -> T | None:
        """The last result while it is fresh, or while the next one was asked for less than
        ``max_age`` ago; else None, and the caller is the one that asks (calls this object)."""
        now = time.monotonic()
        if self._body is not None and (now - self._at <= self.max_age or now - self._asked <= self.max_age):
            return self._body
        self._asked = now
        return None


def ready_metrics(scrape: Recent[bytes]) -> tuple[int, str, bytes] | None:
    """The ``/metrics`` answer when it needs no render (see :meth:`Recent.ready`)."""
    body = scrape.ready()
    return None if body is None else (200, CONTENT_TYPE_LATEST, body)
