"""The HTTP listener: connections, timeouts and bounded workers (SPEC 8.5).

One asyncio loop, on a thread of its own, owns every connection: it accepts, reads each request's
head, hands the request to a worker *lane* and writes the answer back, so a connection costs a
descriptor and a little memory, never a thread. What a client of the port can hold is bounded:

* a connection that sends nothing is closed after ``idle_timeout`` (a new one, or a kept-alive
  one between requests); a request head must be complete ``header_timeout`` after its first
  byte and at most ``max_head`` bytes; an answer the client does not read is dropped when a chunk
  of it (16 KB, all a connection buffers) waits ``write_timeout``, its socket closed at once;
* at most ``max_heads`` request heads are being received at once (each buffers up to twice
  ``max_head``): past that, the head begun the longest ago is dropped, so clients that trickle
  heads, or hold them unfinished, cost a bounded amount of memory however many they are (a
  whole head arrives in one packet: a client that is not an attacker is in this state for
  microseconds);
* at most ``max_connections`` connections are open, by default half the process's descriptor
  limit (the other half is for the database and the rest) and at most ``MAX_CONNECTIONS`` (an
  open connection costs about 8 KB of the process's memory, idle); at that cap a connection
  holding an unfinished head is closed to make room, else the one waiting for a request the
  longest (2,000 idle sockets against a limit of 1,024 do not keep a probe out);
* each lane runs at most ``threads`` requests at once with at most ``queue`` more waiting; past
  that the answer is ``503`` with ``Retry-After`` at once. Pages (the dashboard, ``/status``)
  render two at a time (the interpreter runs one thread at a time: more would only slow the
  probes); ``/metrics`` has its own two threads (and renders at most twice a second:
  :class:`maintd.http.Recent`); the probes (``/healthz``, ``/readyz``) read a few attributes and
  are answered on the loop itself, behind nothing but the loop's own turns;
* an answer that is ready without work (``ready``: the last ``/metrics`` body, while it is fresh
  or the next one is being rendered) is made on the loop too: only the request that finds it old
  goes to the lane, so a flood of scrapers neither queues behind a render nor fills the lane's
  queue (a scrape answered ``503``);
* a new connection costs no task until it needs one: its first read, if it is one whole request
  answered on the loop (a probe, or a refusal), is answered at once and the connection closed
  (:meth:`Listener._first_read`), so a flood of new connections does not fill the kernel's accept
  queue (where a probe's SYN would wait out the 1 s retransmit);
* the loop accepts at most ``ACCEPT_BATCH`` connections in a row before it serves the others, and
  at most ``turn`` requests of kept-alive connections begin per turn of the loop (:class:`_Turns`),
  so neither a flood of new connections nor clients that pipeline can keep it from a probe.

The listen backlog is ``backlog`` (the kernel caps it at ``net.core.somaxconn``). A client that
goes away mid-request is a debug line, never a traceback. Requests are HTTP/1.0 or 1.1 ``GET`` or
``HEAD`` without a body, their heads checked by :mod:`maintd.request_head`; an HTTP/1.1
connection is kept alive unless the client says otherwise.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import Callable, Mapping

from .logs import kv
from .request_head import BadRequest, Headers, keep_alive, parse_head

log = logging.getLogger("maintd.http")

INLINE = "inline"  # the lane of requests answered on the loop itself (cheap, never blocking)
# (status, content type, body, extra headers)
Answer = tuple[int, str, bytes, dict[str, str]]
# (method, request target, headers) -> answer; runs on a lane's thread (or the loop, INLINE)
Handle = Callable[[str, str, Headers], Answer]
# the same, on the loop: the answer when it is ready without work, else None
Ready = Callable[[str, str, Headers], "Answer | None"]
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
ACCEPT_BATCH = 64  # connections accepted in a row before the loop serves the others
MAX_CONNECTIONS = 2_000  # the default cap's ceiling: 2,000 idle connections cost about 16 MB
WRITE_CHUNK = 16 * 1024  # the most of an answer a connection buffers (see Listener._write)
FIRST_READ = 64 * 1024  # a new connection's first read: all of a too-long head is read before its 431


@dataclass(frozen=True)
class Lane:
    threads: int
    queue: int = 0


@dataclass(frozen=True)
class Limits:
    idle_timeout: float = 5.0
    header_timeout: float = 10.0
    write_timeout: float = 10.0
    max_head: int = 16 * 1024
    max_heads: int = 64  # heads being received at once
    max_headers: int = 64
    backlog: int = 1024
    max_connections: int = 0  # 0: half the descriptor limit (see connection_cap)
    turn: int = 16  # requests of kept-alive connections begun per turn of the loop (see _Turns)
    lanes: Mapping[str, Lane] = field(default_factory=lambda: {"page": Lane(2), "metrics": Lane(2, 30)})


def connection_cap(limits: Limits) -> int:
    """The most connections held open: ``max_connections``, or half the soft descriptor limit
    (at least 16, at most ``MAX_CONNECTIONS``)."""
    if limits.max_connections:
        return limits.max_connections
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, min(MAX_CONNECTIONS, (soft if soft != resource.RLIM_INFINITY else 20_000) // 2))


def raise_descriptor_limit(wanted: int = 65_536) -> tuple[int, int]:
    """Raise the soft limit on open files towards the hard one (as Go programs do at start): a
    container runtime or a login shell often leaves it at 1,024 under a far higher hard limit.
    Returns (before, after); a sandbox that forbids it (seccomp) leaves it as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            return soft, soft
        return soft, target
    return soft, soft


def encode(answer: Answer, *, keep: bool, head_only: bool) -> bytes:
    return response_head(answer, keep=keep) + (b"" if head_only else answer[2])


def response_head(answer: Answer, *, keep: bool) -> bytes:
    status, ctype, body, headers = answer
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    lines = [f"HTTP/1.1 {status} {reason}", f"Date: {formatdate(usegmt=True)}", "Server: maintd",
             f"Content-Type: {ctype}", f"Content-Length: {len(body)}",
             *(f"{k}: {v}" for k, v in headers.items()), f"Connection: {'keep-alive' if keep else 'close'}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def plain(status: int, message: str, **headers: str) -> Answer:
    return status, "text/plain; charset=utf-8", (message + "\n").encode(), dict(headers)


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    writer: asyncio.StreamWriter | None = None
    task: asyncio.Task | None = None
    timer: asyncio.TimerHandle | None = None  # the idle timeout of its first read (no task yet)
    watched: bool = False  # its socket is in the loop's selector for that read


class _Pool:
    """A lane's threads and how many of its requests are in flight (touched on the loop only)."""

    def __init__(self, name: str, lane: Lane):
        self.executor = ThreadPoolExecutor(lane.threads, thread_name_prefix=f"maintd-http-{name}")
        self.cap, self.busy, self.threads = lane.threads + lane.queue, 0, lane.threads


class _Turns:
    """At most ``per_round`` requests of kept-alive connections begin per turn of the loop, the
    rest wait in line: however many connections pipeline requests, a turn stays short, and a new
    connection (a probe) is read and answered within a few turns."""

    def __init__(self, loop: asyncio.AbstractEventLoop, per_round: int):
        self.loop, self.per_round, self.granted = loop, per_round, 0
        self.line: deque[asyncio.Future] = deque()
        self.scheduled = False

    async def take(self) -> None:
        if self.granted < self.per_round and not self.line:
            self.granted += 1
        else:
            self.line.append(self.loop.create_future())
            await self.line[-1]
        self._schedule()

    def _schedule(self) -> None:
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self._next_round)

    def _next_round(self) -> None:
        self.scheduled, self.granted = False, 0
        while self.line and self.granted < self.per_round:
            waiter = self.line.popleft()
            if not waiter.done():  # else cancelled: its connection was closed meanwhile
                waiter.set_result(None)
                self.granted += 1
        if self.line:
            self._schedule()


class Listener:
    """Binds at once (an ``OSError`` names what is wrong); serves from :meth:`start` on."""

    def __init__(self, host: str, port: int, handle: Handle, lane_of: Callable[[str], str],
                 limits: Limits = Limits(), ready: Ready | None = None):
        """``ready``: on the loop, the answer to a request of a lane when it needs no work, else
        None (the request goes to its lane's thread)."""
        self.handle, self.lane_of, self.limits, self.ready = handle, lane_of, limits, ready
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        self.sock = socket.create_server((host, port), family=family, backlog=limits.backlog)
        self.sock.setblocking(False)
        self.max_connections = connection_cap(limits)
        self._pools = {name: _Pool(name, lane) for name, lane in limits.lanes.items()}
        self._conns: dict[_Conn, None] = {}
        # The connections that may be closed for room, in the order they began what they do:
        self._heads: dict[_Conn, None] = {}  # receiving a request head
        self._waiting: dict[_Conn, None] = {}  # waiting for a request (no byte of it yet)
        self._writing: dict[_Conn, None] = {}  # an answer the client has not taken yet (in drain)
        self._loop = asyncio.new_event_loop()
        self._turns = _Turns(self._loop, limits.turn)
        self._accepting: asyncio.Task | None = None
        self._warned_at = float("-inf")
        self.thread = threading.Thread(target=self._run, name="maintd-http", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()[:2]

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        if self.thread.is_alive():
            self._loop.call_soon_threadsafe(self._shutdown)
            self.thread.join(timeout)
        elif not self._loop.is_closed():
            self._loop.close()
        self.sock.close()
        for pool in self._pools.values():
            pool.executor.shutdown(wait=False, cancel_futures=True)

    # -- the loop -----------------------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.set_exception_handler(self._loop_error)
        self._accepting = self._loop.create_task(self._accept())
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    @staticmethod
    def _loop_error(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        log.warning("http: unexpected error", extra=kv(error=repr(exc) if exc else context.get("message")))

    def _shutdown(self) -> None:
        async def close_all() -> None:
            tasks = [t for t in (self._accepting, *(c.task for c in self._conns)) if t is not None]
            for conn in list(self._conns):
                self._close(conn, cancel=True)
            if self._accepting is not None:
                self._accepting.cancel()
            await asyncio.wait(tasks, timeout=1.0) if tasks else None
            self._loop.stop()

        self._loop.create_task(close_all())

    async def _accept(self) -> None:
        accepted = 0
        while True:
            try:
                sock, _ = await self._loop.sock_accept(self.sock)
            except OSError as exc:
                if exc.errno in OUT_OF_DESCRIPTORS:
                    self._out_of_descriptors(exc)
                    if not self._make_room():
                        await asyncio.sleep(0.05)
                continue
            if len(self._conns) >= self.max_connections and not self._make_room():
                sock.close()  # every connection is busy: this one is refused, not queued
                continue
            conn = _Conn(sock, watched=True)
            self._conns[conn] = None
            self._waiting[conn] = None
            self._loop.add_reader(sock.fileno(), self._first_read, conn)
            conn.timer = self._loop.call_later(self.limits.idle_timeout, self._close, conn)
            accepted += 1
            if accepted % ACCEPT_BATCH == 0:  # let the connections accepted so far be served
                await asyncio.sleep(0)

    def _out_of_descriptors(self, exc: OSError) -> None:
        now = self._loop.time()
        if now - self._warned_at >= 60:
            self._warned_at = now
            log.warning("http: out of file descriptors, closing idle connections (raise the "
                        "limit: LimitNOFILE)", extra=kv(connections=len(self._conns), error=exc.strerror))

    def _make_room(self) -> bool:
        """Close the connection whose unfinished head was begun the longest ago, else the one
        whose client has not taken its answer the longest, else the one waiting for a request
        the longest (accepted or answered the longest ago); False if none is. Connections that
        trickle, hold heads or do not read go first, whatever their age: a probe's connection,
        just accepted, goes after every older one."""
        victim = next(iter(self._heads), None) or next(iter(self._writing), None) or next(iter(self._waiting), None)
        if victim is None:
            return False
        log.debug("http: connection closed to make room", extra=kv(connections=len(self._conns)))
        self._close(victim, cancel=True)
        return True

    def _close(self, conn: _Conn, cancel: bool = False) -> None:
        for conns in (self._conns, self._heads, self._waiting, self._writing):
            conns.pop(conn, None)
        self._unwatch(conn)
        if conn.writer is not None:  # not close(): it keeps the socket until the client takes what
            conn.writer.transport.abort()  # is unsent, for ever if it never reads (see _linger)
        else:
            conn.sock.close()
        if cancel and conn.task is not None and conn.task is not asyncio.current_task():
            conn.task.cancel()

    def _unwatch(self, conn: _Conn) -> None:
        if conn.timer is not None:
            conn.timer.cancel()
        if conn.watched:
            conn.watched = False
            self._loop.remove_reader(conn.sock.fileno())

    def _first_read(self, conn: _Conn) -> None:
        """A new connection's first bytes. A whole head in one read whose answer is made on the
        loop (the probes, and every refusal) is answered here and the connection closed, with no
        task or stream: under a flood of new connections the loop keeps up and the kernel's accept
        queue does not fill (a probe whose SYN finds it full waits the 1 s SYN retransmit). Any
        other request goes on as a task, with the bytes read."""
        self._unwatch(conn)
        try:
            data = conn.sock.recv(FIRST_READ)
        except (BlockingIOError, InterruptedError):
            data = None
        except OSError as exc:
            log.debug("http: client went away", extra=kv(error=type(exc).__name__))
            self._close(conn)
            return
        if data == b"":
            self._close(conn)
            return
        quick = self._quick(data) if data else None
        if quick is None:
            self._go_on(conn, data or b"")
            return
        payload, keep = quick
        try:
            sent = conn.sock.send(payload)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            sent = len(payload)  # gone: nothing more to say
            keep = False
        if sent == len(payload) and not keep:
            self._close(conn)
        else:  # the rest of the answer, and the requests after it, go on as a task
            self._go_on(conn, unsent=payload[sent:], keep=keep)

    def _go_on(self, conn: _Conn, read: bytes = b"", *, unsent: bytes = b"", keep: bool = True) -> None:
        """Serve the rest of the connection as a task (:meth:`_serve`)."""
        self._waiting.pop(conn, None)
        conn.task = self._loop.create_task(self._serve(conn, read, unsent=unsent, keep=keep))

    def _quick(self, data: bytes) -> tuple[bytes, bool] | None:
        """(the answer, keep the connection) when ``data`` is exactly one head with CRLF line ends
        whose answer is made on the loop; else None (read as any request is)."""
        if (len(data) > self.limits.max_head or data.find(b"\r\n\r\n") != len(data) - 4
                or data.startswith(b"\r\n") or data.count(b"\n") != data.count(b"\r\n")):
            return None
        try:
            method, target, version, headers = parse_head(data[:-4], self.limits.max_headers)
        except BadRequest as exc:
            return encode(plain(exc.status, exc.message), keep=False, head_only=False), False
        # Not ``ready``: a request it declines is then served as any (:meth:`_answer`), which would
        # ask it again, and the second ask finds the first (an old /metrics body served for good).
        answer = self._inline(method, target, headers, self._lane(target), ready=False)
        if answer is None:
            return None
        keep = keep_alive(version, headers) and answer[0] not in (405, 503)
        return encode(answer, keep=keep, head_only=method == "HEAD"), keep

    async def _serve(self, conn: _Conn, read: bytes = b"", *, unsent: bytes = b"", keep: bool = True) -> None:
        """``read``: bytes already read from the connection; ``unsent``: the part of an answer
        made by :meth:`_first_read` that the socket did not take at once."""
        try:
            reader, conn.writer = await asyncio.open_connection(sock=conn.sock, limit=self.limits.max_head)
            conn.writer.transport.set_write_buffer_limits(high=0)  # drain(): all of it is sent (_write)
            if unsent:
                await self._write(conn, unsent)
            reader.feed_data(read)
            del read  # the reader holds a copy: not twice per connection
            while keep:
                self._waiting[conn] = None  # while it waits its turn, room can be made by closing it
                await self._turns.take()  # a pipelining client waits its turn
                keep = await self._exchange(conn, reader)
            await self._linger(conn)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, OSError) as exc:
            log.debug("http: client went away", extra=kv(error=type(exc).__name__))
        finally:
            self._close(conn)

    async def _linger(self, conn: _Conn) -> None:
        """Close once the client has taken the rest of the last answer, within ``write_timeout``
        (:meth:`_close` then drops it). Meanwhile the connection counts towards the cap and room
        can be made by closing it: a socket that outlived its connection, its answer unsent to a
        client that never reads, held a descriptor out of the cap's count, and enough of them
        took every descriptor the process had (no probe answered, no database session opened)."""
        assert conn.writer is not None
        conn.writer.close()
        self._writing[conn] = None
        try:
            async with asyncio.timeout(self.limits.write_timeout):
                await conn.writer.wait_closed()
        finally:
            self._writing.pop(conn, None)

    async def _exchange(self, conn: _Conn, reader: asyncio.StreamReader) -> bool:
        """One request and its answer; whether the connection carries another."""
        try:
            head = await self._read_head(conn, reader)
            if head is None:
                return False
            method, target, version, headers = parse_head(head, self.limits.max_headers)
        except BadRequest as exc:
            await self._send(conn, plain(exc.status, exc.message), keep=False, head_only=False)
            return False
        keep = keep_alive(version, headers)
        answer = await self._answer(method, target, headers)
        keep = keep and answer[0] not in (405, 503)  # a body may follow an odd method; busy: go
        await self._send(conn, answer, keep=keep, head_only=method == "HEAD")
        return keep

    async def _read_head(self, conn: _Conn, reader: asyncio.StreamReader) -> bytes | None:
        """A request's head, or None when the client closed or stayed silent."""
        self._waiting.pop(conn, None)
        self._waiting[conn] = None  # to the end of the line: the longest waiting stays first
        try:
            async with asyncio.timeout(self.limits.idle_timeout):  # no task of its own (wait_for's)
                first = await reader.read(1)
        except TimeoutError:
            return None
        finally:
            self._waiting.pop(conn, None)
        if not first:
            return None
        self._head_begun(conn)
        try:
            async with asyncio.timeout(self.limits.header_timeout):  # a head already here: no wait
                return await self._head_lines(first, reader)
        except TimeoutError:
            raise BadRequest(408, f"the request head took over {self.limits.header_timeout:g}s") from None
        except asyncio.LimitOverrunError:
            raise BadRequest(431, f"the request head is over {self.limits.max_head} bytes") from None
        finally:
            self._heads.pop(conn, None)

    async def _head_lines(self, first: bytes, reader: asyncio.StreamReader) -> bytes:
        """The head's lines up to the empty one, joined by CRLF. A line may end in CRLF or a bare
        LF, and empty lines before the request line are skipped (RFC 9112 2.2, as Go and h11 do)."""
        lines: list[bytes] = []
        size, line = 0, first if first == b"\n" else first + await reader.readuntil(b"\n")
        while True:
            size += len(line)
            if size > self.limits.max_head:
                raise asyncio.LimitOverrunError("head", size)
            line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
            if line:
                lines.append(line)
            elif lines:
                return b"\r\n".join(lines)
            line = await reader.readuntil(b"\n")

    def _head_begun(self, conn: _Conn) -> None:
        """Past ``max_heads`` heads being received, drop the one begun the longest ago."""
        self._heads[conn] = None
        while len(self._heads) > self.limits.max_heads:
            oldest = next(iter(self._heads))
            log.debug("http: unfinished request head dropped", extra=kv(heads=len(self._heads)))
            self._close(oldest, cancel=True)

    def _lane(self, target: str) -> str:
        return self.lane_of(target.partition("?")[0])

    def _inline(self, method: str, target: str, headers: Headers, lane: str, ready: bool = True) -> Answer | None:
        """The answer when it is made on the loop (a refused method, a probe, an answer that is
        ``ready``, asked once per request); else None."""
        if method not in ("GET", "HEAD"):
            return plain(405, f"method {method} not allowed", Allow="GET, HEAD")
        make = self.handle if lane == INLINE else (self.ready if ready else None)
        if make is None:
            return None
        try:
            return make(method, target, headers)
        except Exception as exc:
            return self._failed(exc)

    @staticmethod
    def _failed(exc: Exception) -> Answer:
        """A handler raised: it answers its own errors, so this is a bug."""
        log.warning("http: handler failed", extra=kv(error=repr(exc)))
        return plain(500, "internal error")

    async def _answer(self, method: str, target: str, headers: Headers) -> Answer:
        lane = self._lane(target)
        answer = self._inline(method, target, headers, lane)
        if answer is not None:
            return answer
        pool = self._pools[lane]
        if pool.busy >= pool.cap:
            return plain(503, f"busy: {pool.threads} requests of this kind are being answered; "
                              f"retry in a second", **{"Retry-After": "1"})
        pool.busy += 1
        try:
            return await self._loop.run_in_executor(pool.executor, self.handle, method, target, headers)
        except Exception as exc:
            return self._failed(exc)
        finally:
            pool.busy -= 1

    async def _send(self, conn: _Conn, answer: Answer, *, keep: bool, head_only: bool) -> None:
        head, body = response_head(answer, keep=keep), b"" if head_only else answer[2]
        if len(body) <= WRITE_CHUNK:
            await self._write(conn, head + body)  # one segment
        else:  # not joined: a copy of the body per connection
            await self._write(conn, head)
            await self._write(conn, body)

    async def _write(self, conn: _Conn, payload: bytes) -> None:
        """Hand ``payload`` to the kernel :data:`WRITE_CHUNK` bytes at a time, each taken within
        ``write_timeout`` (as nginx's send_timeout). A connection whose client does not read then
        holds at most a chunk of its own (the body is the handler's, shared by every connection
        a ``ready`` answer goes to): 2,000 of them each held a copy of the 45 KB /metrics in
        full and asyncio's 64 KB of buffer on top, 370 MB, past a 256 MiB memory limit."""
        assert conn.writer is not None
        view = memoryview(payload)
        self._writing[conn] = None  # until the client takes it, room can be made by closing it
        try:
            for at in range(0, len(view), WRITE_CHUNK):
                conn.writer.write(view[at:at + WRITE_CHUNK])
                async with asyncio.timeout(self.limits.write_timeout):
                    await conn.writer.drain()
        finally:
            self._writing.pop(conn, None)
