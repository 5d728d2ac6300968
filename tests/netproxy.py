r"""A TCP proxy on 127.0.0.1 for network-fault tests: forward, blackhole, delay, heal, close.

    with NetProxy("127.0.0.1", 5432) as proxy:
        dsn = proxy.dsn(pg_dsn)              # the same DSN through the proxy (sslmode=disable)
        proxy.blackhole()                    # every connection, and every new one, goes silent
        proxy.heal()                         # forwarding resumes; nothing buffered is lost
        proxy.blackhole(lambda link: link.app.endswith(":work"))  # only maintd's work pool
        proxy.delay(0.5)                     # each chunk is forwarded half a second late
        proxy.on_statement(r"pg_try_advisory_lock", lambda link: os.kill(pid, SIGSTOP))
        proxy.close_all()                    # close every connection (both sides)

A *blackholed* connection is not closed in either direction: its bytes stay in the sockets'
buffers, unread, as with a network partition whose packets are retransmitted until it heals. The
kernel still acknowledges them, so nothing on either side notices (no RST, no FIN, no
``tcp_user_timeout``): only a client-side timeout does. A connection accepted during a blackhole
is established (the kernel does that) but never answered, like a connect to a frozen server.

The proxy reads PostgreSQL's client protocol (unencrypted, hence ``sslmode=disable``) just enough
to know each connection's ``application_name`` (so a blackhole can cut one pool of a process and
not another) and the SQL each message runs (so a test can freeze a process at an exact statement).
One thread runs every connection with ``selectors``.
"""

from __future__ import annotations

import re
import selectors
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import psycopg.conninfo

SSL_REQUEST, GSSENC_REQUEST, CANCEL_REQUEST, PROTOCOL_3 = 80877103, 80877104, 80877102, 196608
MAX_BUFFERED = 1 << 20  # bytes waiting in one direction before the proxy stops reading that side
CHUNK = 65536

Match = Callable[["Link"], bool]


def _everything(link: "Link") -> bool:
    return True


@dataclass
class _Hook:
    pattern: re.Pattern[str]
    callback: Callable[["Link"], None]
    after: bool
    once: bool
    fired: int = 0


class ClientStream:
    """Incremental parser of the frontend side of the PostgreSQL protocol (v3, no TLS)."""

    def __init__(self) -> None:
        self.buf = b""
        self.startup = True
        self.opaque = False  # TLS or something we do not understand: stop parsing
        self.params: dict[str, str] = {}
        self.prepared: dict[str, str] = {}

    def feed(self, data: bytes) -> list[str]:
        """Parse what arrived; return the SQL text of every statement executed (Query / Bind)."""
        if self.opaque:
            return []
        self.buf += data
        out: list[str] = []
        while not self.opaque:
            if self.startup:
                if len(self.buf) < 8:
                    break
                length, code = struct.unpack("!ii", self.buf[:8])
                if length < 8 or length > 10000:
                    self.opaque = True
                    break
                if len(self.buf) < length:
                    break
                body, self.buf = self.buf[8:length], self.buf[length:]
                if code == PROTOCOL_3:
                    parts = body.split(b"\0")
                    self.params = {parts[i].decode(errors="replace"): parts[i + 1].decode(errors="replace")
                                   for i in range(0, len(parts) - 1, 2) if parts[i]}
                    self.startup = False
                elif code in (SSL_REQUEST, GSSENC_REQUEST, CANCEL_REQUEST):
                    continue  # with sslmode=disable the server answers 'N'; a cancel ends the stream
                else:
                    self.opaque = True
                continue
            if len(self.buf) < 5:
                break
            kind = self.buf[:1]
            length = struct.unpack("!i", self.buf[1:5])[0]
            if length < 4:
                self.opaque = True
                break
            if len(self.buf) < 1 + length:
                break
            body, self.buf = self.buf[5:1 + length], self.buf[1 + length:]
            text = self._statement(kind, body)
            if text is not None:
                out.append(text)
        return out

    def _statement(self, kind: bytes, body: bytes) -> str | None:
        if kind == b"Q":
            return body.split(b"\0", 1)[0].decode(errors="replace")
        if kind == b"P":
            name, query = body.split(b"\0")[:2]
            self.prepared[name.decode(errors="replace")] = query.decode(errors="replace")
        elif kind == b"B":
            statement = body.split(b"\0")[1].decode(errors="replace")
            return self.prepared.get(statement)
        return None


@dataclass
class _Pipe:
    """One direction of a link: bytes read from ``src`` wait in ``queue`` until written to ``dst``."""

    src: socket.socket
    dst: socket.socket
    queue: deque = field(default_factory=deque)  # [due, bytes, callbacks after writing]
    buffered: int = 0
    eof: bool = False  # src said EOF; shut dst's write side once the queue is empty
    shut: bool = False

    def due(self, now: float) -> bool:
        return bool(self.queue) and self.queue[0][0] <= now


class Link:
    """One proxied connection: the client's socket and ours to the server."""

    def __init__(self, number: int, client: socket.socket, server: socket.socket):
        self.number = number
        self.client, self.server = client, server
        self.up = _Pipe(client, server)
        self.down = _Pipe(server, client)
        self.stream = ClientStream()
        self.closed = False
        self.bytes_up = self.bytes_down = 0

    @property
    def params(self) -> dict[str, str]:
        return self.stream.params

    @property
    def app(self) -> str:
        return self.stream.params.get("application_name", "")

    def __repr__(self) -> str:
        return f"<Link {self.number} app={self.app!r} closed={self.closed}>"


class NetProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream``; see the module docstring."""

    def __init__(self, upstream_host: str, upstream_port: int, *, listen_port: int = 0):
        self.upstream = (upstream_host, upstream_port)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", listen_port))
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._lock = threading.Lock()
        self._links: list[Link] = []
        self._count = 0
        self._blackhole: Match | None = None
        self._delay = 0.0
        self._delay_match: Match = _everything
        self._hooks: list[_Hook] = []
        self._calls: list[Callable[[], object]] = []  # run by the proxy thread
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"netproxy:{self.port}", daemon=True)

    @classmethod
    def for_dsn(cls, dsn: str) -> "NetProxy":
        info = psycopg.conninfo.conninfo_to_dict(dsn)
        return cls(info.get("host") or "127.0.0.1", int(info.get("port") or 5432))

    # -- control (any thread) -----------------------------------------------------------------
    def start(self) -> "NetProxy":
        self._thread.start()
        return self

    def dsn(self, dsn: str) -> str:
        """``dsn`` with host and port replaced by the proxy's (and TLS off, so it can be read)."""
        info = psycopg.conninfo.conninfo_to_dict(dsn)
        info.update(host="127.0.0.1", port=str(self.port), sslmode="disable", gssencmode="disable")
        return psycopg.conninfo.make_conninfo(**info)

    def blackhole(self, match: Match | None = None) -> None:
        """Stop forwarding, in both directions, on every connection ``match`` selects (all by
        default), now and for connections made until :meth:`heal`. Nothing is closed."""
        self._set(_blackhole=match or _everything)

    def delay(self, seconds: float, match: Match | None = None) -> None:
        """Forward each chunk ``seconds`` after it arrived (0 = no delay)."""
        self._set(_delay=seconds, _delay_match=match or _everything)

    def heal(self) -> None:
        """Forward again, buffered bytes first (as TCP would after a partition), without delay."""
        self._set(_blackhole=None, _delay=0.0)

    def on_statement(self, pattern: str, callback: Callable[[Link], None], *, after: bool = False,
                     once: bool = True) -> _Hook:
        """Call ``callback(link)`` in the proxy thread when a client runs SQL matching ``pattern``:
        before the server sees it, or with ``after``, once it has been handed to the server and
        before the proxy forwards anything else (so the client cannot have read the answer)."""
        hook = _Hook(re.compile(pattern, re.S), callback, after, once)
        with self._lock:
            self._hooks.append(hook)
        return hook

    def close_all(self) -> None:
        """Close every connection, both sides (new ones are still accepted)."""
        done = threading.Event()
        with self._lock:
            self._calls.append(lambda: ([self._close(l) for l in self._links], done.set()))
        self._wake()
        done.wait(5)

    def links(self) -> list[Link]:
        with self._lock:
            return [l for l in self._links if not l.closed]

    def stop(self) -> None:
        self._stopping = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(5)
        for link in list(self._links):
            self._close(link)
        for s in (self.listener, self._wake_r, self._wake_w):
            s.close()

    def __enter__(self) -> "NetProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _set(self, **changes: object) -> None:
        with self._lock:
            for k, v in changes.items():
                setattr(self, k, v)
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    # -- the loop (proxy thread) --------------------------------------------------------------
    def _silent(self, link: Link) -> bool:
        match = self._blackhole
        return match is not None and bool(match(link))

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        try:
            while not self._stopping:
                timeout = self._register(sel)
                for key, events in sel.select(timeout):
                    key.data(events)
                with self._lock:
                    calls, self._calls = self._calls, []
                for call in calls:
                    call()
                now = time.monotonic()
                for link in list(self._links):
                    if not link.closed and not self._silent(link):
                        self._flush(link, now)
                with self._lock:
                    self._links = [l for l in self._links if not l.closed]
        finally:
            sel.close()

    def _register(self, sel: selectors.BaseSelector) -> float | None:
        """(Re)build the selector's interest set; return how long select may sleep."""
        for key in list(sel.get_map().values()):
            sel.unregister(key.fileobj)
        sel.register(self.listener, selectors.EVENT_READ, lambda ev: self._accept())
        sel.register(self._wake_r, selectors.EVENT_READ, lambda ev: self._drain_wake())
        now = time.monotonic()
        timeout: float | None = None
        for link in self._links:
            if link.closed or self._silent(link):
                continue
            wants: dict[socket.socket, int] = {}
            for pipe in (link.up, link.down):
                if not pipe.eof and pipe.buffered < MAX_BUFFERED:
                    wants[pipe.src] = wants.get(pipe.src, 0) | selectors.EVENT_READ
                if pipe.queue:
                    if pipe.due(now):
                        wants[pipe.dst] = wants.get(pipe.dst, 0) | selectors.EVENT_WRITE
                    else:
                        wait = pipe.queue[0][0] - now
                        timeout = wait if timeout is None else min(timeout, wait)
            for sock, events in wants.items():
                sel.register(sock, events, lambda ev, link=link, sock=sock: self._io(link, sock, ev))
        return timeout

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except BlockingIOError:
            return
        try:
            server = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            client.close()  # the server is down: the client sees the connection closed
            return
        for s in (client, server):
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._count += 1
            self._links.append(Link(self._count, client, server))

    def _io(self, link: Link, sock: socket.socket, events: int) -> None:
        if link.closed:
            return
        if events & selectors.EVENT_READ:
            self._read(link, link.up if sock is link.client else link.down)

    def _read(self, link: Link, pipe: _Pipe) -> None:
        try:
            data = pipe.src.recv(CHUNK)
        except BlockingIOError:
            return
        except OSError:
            self._close(link)
            return
        if not data:
            pipe.eof = True
            return
        after: list[Callable[[], None]] = []
        if pipe is link.up:
            link.bytes_up += len(data)
            for statement in link.stream.feed(data):
                after += self._fire_hooks(link, statement)
        else:
            link.bytes_down += len(data)
        delay = self._delay if self._delay and self._delay_match(link) else 0.0
        pipe.queue.append([time.monotonic() + delay, data, after])
        pipe.buffered += len(data)

    def _fire_hooks(self, link: Link, statement: str) -> list[Callable[[], None]]:
        """Run the 'before' hooks now; return the 'after' ones, to run once the chunk is sent."""
        later: list[Callable[[], None]] = []
        with self._lock:
            hooks = [h for h in self._hooks if h.pattern.search(statement) and not (h.once and h.fired)]
            for h in hooks:
                h.fired += 1
        for h in hooks:
            if h.after:
                later.append(lambda h=h: h.callback(link))
            else:
                h.callback(link)
        return later

    def _flush(self, link: Link, now: float) -> None:
        """Write whatever is due, in order, as far as the sockets take it."""
        for pipe in (link.up, link.down):
            while pipe.due(now) and not link.closed:
                entry = pipe.queue[0]
                try:
                    sent = pipe.dst.send(entry[1])
                except BlockingIOError:
                    break
                except OSError:
                    self._close(link)
                    return
                pipe.buffered -= sent
                if sent < len(entry[1]):
                    entry[1] = entry[1][sent:]
                    break
                pipe.queue.popleft()
                for callback in entry[2]:
                    callback()
            if pipe.eof and not pipe.queue and not pipe.shut and not link.closed:
                pipe.shut = True
                try:
                    pipe.dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
        if link.up.shut and link.down.shut:
            self._close(link)

    def _close(self, link: Link) -> None:
        if link.closed:
            return
        link.closed = True
        for s in (link.client, link.server):
            try:
                s.close()
            except OSError:
                pass
