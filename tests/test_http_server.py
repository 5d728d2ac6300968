"""The HTTP listener against hostile and clumsy clients (issue 26, SPEC 8.5): idle and slow
connections are closed, pages render a few at a time and the rest get 503 at once, the probes
answer whatever the pages do, a connection cap makes room by closing the longest idle one, and a
client that hangs up is a debug line.

The timeouts follow what production servers do: Go's ``net/http`` ``Server.ReadHeaderTimeout``
and ``IdleTimeout``, nginx's ``client_header_timeout`` (408) and ``keepalive_timeout``."""

from __future__ import annotations

import asyncio
import http.client
import logging
import os
import re
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest

from maintd.http import HttpServer, Recent, Request, text
from maintd.listener import INLINE, MAX_CONNECTIONS, Lane, Limits, Listener, _Conn

from .procs import wait_for

FAST = Limits(idle_timeout=0.5, header_timeout=0.5, write_timeout=2,
              lanes={"page": Lane(4), "metrics": Lane(2, 30)})


class Gate:
    """A page that waits until opened: a render that takes as long as the test wants."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.entered = threading.Semaphore(0)

    def page(self, req: Request):
        self.entered.release()
        self.opened.wait(10)
        return text(200, "slow page\n")


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.opened.set()


def serve(gate: Gate, limits: Limits = FAST) -> HttpServer:
    server = HttpServer("127.0.0.1", 0, {"/healthz": lambda: text(200, "ok\n"),
                                         "/metrics": lambda: text(200, "# metrics\n")},
                        pages={"/slow": gate.page, "/": lambda req: text(200, "page\n")}, limits=limits)
    server.start()
    return server


@pytest.fixture
def server(gate: Gate) -> Iterator[HttpServer]:
    s = serve(gate)
    yield s
    gate.opened.set()
    s.stop()


def get(port: int, path: str, timeout: float = 5, method: str = "GET") -> tuple[int, bytes, dict, float]:
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path)
        r = conn.getresponse()
        return r.status, r.read(), dict(r.getheaders()), time.monotonic() - started
    finally:
        conn.close()


def closed_by_server(sock: socket.socket, within: float) -> float:
    """Seconds until the server closed ``sock`` (end of file), failing after ``within``."""
    started = time.monotonic()
    sock.settimeout(within)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return time.monotonic() - started
        data += chunk


def test_idle_connection_is_closed_after_the_idle_timeout(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        assert closed_by_server(s, 5) < 2.5


def test_a_kept_alive_connection_idle_between_requests_is_closed_after_the_idle_timeout(server):
    """The idle timeout holds between requests too (Go's IdleTimeout, nginx's keepalive_timeout):
    a client that keeps its connection and sends nothing more does not keep a descriptor."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(5)
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while not reply.endswith(b"page\n"):
            reply += s.recv(65536)
        assert b"Connection: keep-alive" in reply
        assert closed_by_server(s, 5) < 2.5

def test_a_head_sent_slowly_gets_408_after_the_header_timeout(server):
    """Slowloris: a request head trickling in byte by byte is cut off, whatever the trickle."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        reply = b""
        s.settimeout(5)
        while chunk := s.recv(4096):
            reply += chunk
            if time.monotonic() - started < 0.3:
                s.sendall(b"X")
        assert reply.startswith(b"HTTP/1.1 408 ") and time.monotonic() - started < 3


@pytest.mark.parametrize("raw,status", [
    (b"GET / HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 20_000 + b"\r\n\r\n", 431),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405),
    (b"GET / HTTP/2.0\r\n\r\n", 505),
    (b"GET evil/ HTTP/1.1\r\nHost: x\r\n\r\n", 400),  # test_http_parse: the forms a target may take
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nNo colon here\r\n\r\n", 400),
])
def test_malformed_requests_get_a_4xx_and_the_connection_closed(server, raw, status):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(raw)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply.startswith(f"HTTP/1.1 {status} ".encode()), reply[:80]
    assert b"Connection: close" in reply


def test_keep_alive_head_and_the_common_headers(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        for _ in range(3):  # three requests on one connection
            conn.request("GET", "/")
            r = conn.getresponse()
            assert (r.status, r.read()) == (200, b"page\n")
            assert r.getheader("Connection") == "keep-alive" and r.getheader("X-Content-Type-Options") == "nosniff"
        conn.request("HEAD", "/healthz")
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Content-Length") == "3" and r.read() == b""
    finally:
        conn.close()
    assert get(server.port, "/nope")[0] == 404


def test_pages_beyond_the_cap_get_503_at_once_and_the_probes_still_answer(server, gate):
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(get(server.port, "/slow", 15)[0]))
               for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(4):
        assert gate.entered.acquire(timeout=5)  # four renders under way
    status, body, headers, seconds = get(server.port, "/")
    assert status == 503 and headers["Retry-After"] == "1" and seconds < 0.5, (status, seconds)
    assert b"busy" in body
    for path in ("/healthz", "/metrics"):
        status, _, _, seconds = get(server.port, path)
        assert status == 200 and seconds < 1, (path, status, seconds)
    gate.opened.set()
    for t in threads:
        t.join(10)
    assert results == [200] * 4
    assert get(server.port, "/")[0] == 200  # the slots are free again


def established(port: int) -> int:
    out = subprocess.run(["ss", "-tnH", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True, check=True).stdout
    return len(out.splitlines())


def test_at_the_connection_cap_the_longest_idle_connection_makes_room(gate):
    server = serve(gate, Limits(idle_timeout=30, header_timeout=30, max_connections=20))
    idle = []
    try:
        for _ in range(100):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        for _ in range(10):
            status, _, _, seconds = get(server.port, "/healthz")
            assert status == 200 and seconds < 1, seconds
        wait_for(lambda: established(server.port) <= 20, 5, what="at most 20 connections held")
    finally:
        for s in idle:
            s.close()
        server.stop()


def shut_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (EOF or reset waiting to be read)."""
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_unfinished_heads_are_bounded_and_dropped_oldest_first(gate):
    """Each connection holding a head it never finishes buffers up to twice max_head: before, 10,000
    of them (16,000 bytes each) took a daemon from 79 to 377 MB, past the 256Mi its Deployment
    allows. Past ``max_heads`` the oldest unfinished head is dropped; the probes still answer."""
    server = serve(gate, Limits(idle_timeout=30, header_timeout=30, max_heads=4))
    heads = []
    try:
        for _ in range(10):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall(b"GET / HTTP/1.1\r\nX: " + b"a" * 8000)  # no end of the head
            heads.append(s)
            time.sleep(0.05)
        wait_for(lambda: [shut_by_server(s) for s in heads] == [True] * 6 + [False] * 4, 5,
                 what="the 6 oldest unfinished heads dropped, the 4 newest kept")
        assert get(server.port, "/healthz")[0] == 200
    finally:
        for s in heads:
            s.close()
        server.stop()


def test_at_the_cap_unfinished_heads_make_room_before_idle_connections(gate):
    """A connection that trickles or holds a head goes before one waiting for a request, however
    old the waiting one is."""
    server = serve(gate, Limits(idle_timeout=30, header_timeout=30, max_connections=8))
    idle, heads, late = [], [], []
    try:
        for _ in range(4):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        time.sleep(0.2)
        for _ in range(4):
            heads.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
            heads[-1].sendall(b"GET / HTTP/1.1\r\nX: y")
            time.sleep(0.05)
        for _ in range(3):  # newer than every idle one; at the cap each closes a head, the oldest first
            late.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
            time.sleep(0.05)
        wait_for(lambda: [shut_by_server(s) for s in heads] == [True] * 3 + [False], 5,
                 what="the 3 oldest heads closed for room")
        assert get(server.port, "/healthz")[0] == 200  # the last head makes room for it
        assert shut_by_server(heads[3]) and not any(shut_by_server(s) for s in idle + late)
    finally:
        for s in idle + heads + late:
            s.close()
        server.stop()


def test_metrics_render_at_most_once_per_max_age_however_many_scrape():
    """A flood of scrapers rendering for themselves held the interpreter's lock the listener's loop
    needs: /healthz took 1.5-2.2 s while 2,000 connections pipelined /metrics (0.1-0.3 s with
    renders shared)."""
    renders = []

    def render() -> bytes:
        renders.append(time.monotonic())
        time.sleep(0.05)
        return b"# %d\n" % len(renders)

    recent = Recent(render, max_age=0.5)
    with ThreadPoolExecutor(16) as pool:
        bodies = list(pool.map(lambda _: recent(), range(64)))
    assert len(renders) == 1 and set(bodies) == {b"# 1\n"}
    time.sleep(0.6)
    assert recent() == b"# 2\n"


def test_metrics_is_fresh_for_a_scraper_that_connects_anew_each_time():
    """Prometheus scrapes every 15 s and the port closes idle connections after 5 s: each scrape
    is a new connection. The last render, served on the loop (Recent.ready), was asked twice for
    such a request, and the second ask found the first: the body of the first scrape was served
    for good (maintd_is_leader 1 on a deposed leader, in an independent review)."""
    from maintd.http import metrics_body, ready_metrics

    scrape = Recent(lambda: f"rendered at {time.monotonic():.3f}".encode(), max_age=0.2)
    srv = HttpServer("127.0.0.1", 0, {"/metrics": lambda: metrics_body(scrape)},
                     ready={"/metrics": lambda: ready_metrics(scrape)})
    srv.start()
    try:
        bodies = []
        for _ in range(3):
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
            conn.request("GET", "/metrics")
            bodies.append(conn.getresponse().read())
            conn.close()
            time.sleep(0.5)
        assert len(set(bodies)) == 3, bodies
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)  # kept alive, as before
        for _ in range(2):
            conn.request("GET", "/metrics")
            bodies.append(conn.getresponse().read())
            time.sleep(0.5)
        conn.close()
        assert len(set(bodies)) == 5, bodies
    finally:
        srv.stop()


def test_the_listen_backlog_is_at_least_128(server):
    out = subprocess.run(["ss", "-ltnH", f"( sport = :{server.port} )"], capture_output=True, text=True,
                         check=True).stdout
    backlog = int(re.search(r"LISTEN\s+\d+\s+(\d+)", out).group(1))
    assert backlog >= 128, out  # Send-Q of a listening socket: its backlog (it was 5)


@pytest.fixture
def http_log() -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("maintd")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_a_client_that_hangs_up_is_a_debug_line_not_a_traceback(server, gate, http_log, capfd):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        assert gate.entered.acquire(timeout=5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
    gate.opened.set()
    wait_for(lambda: any(r.getMessage() == "http: client went away" for r in http_log), 5,
             what="the debug line")
    assert all(r.levelno == logging.DEBUG for r in http_log if r.name == "maintd.http"), \
        [(r.levelname, r.getMessage()) for r in http_log]
    assert get(server.port, "/healthz")[0] == 200
    assert "Traceback" not in capfd.readouterr().err


HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]


@pytest.mark.parametrize("limit,after", [("1024:4096", 4096), ("1024:1024", 1024),
                                         (f"2048:{HARD}", min(HARD, 65536))])
def test_the_daemon_raises_its_soft_descriptor_limit_towards_the_hard_one(limit, after):
    """What a pod gets from the container runtime (soft 1,024 under a high hard limit) is raised
    at start, as Go programs do (Go 1.19 release notes, "os": RLIMIT_NOFILE); where the hard limit
    is the soft one, the listener's connection cap keeps to half of it."""
    code = ("from maintd.listener import raise_descriptor_limit, connection_cap, Limits; "
            "print(raise_descriptor_limit()[1], connection_cap(Limits()))")
    out = subprocess.run(["prlimit", f"--nofile={limit}", "--", sys.executable, "-c", code],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(after), str(min(after // 2, MAX_CONNECTIONS))]  # half, memory allowing


def test_at_most_a_turns_worth_of_kept_alive_requests_begin_per_turn_of_the_loop():
    """``_Turns`` with 2 a round: 7 requests waiting at once begin 2, 2, 2, 1 in four turns of the
    loop, in the order they came (a pipelining flood cannot fill one turn of the loop, where a
    probe's connection waits)."""
    from maintd.listener import _Turns

    async def main() -> list[tuple[int, int]]:
        loop, turns, began, tick = asyncio.get_running_loop(), None, [], [0]

        def ticker() -> None:  # counts the loop's turns
            tick[0] += 1
            loop.call_soon(ticker)

        turns = _Turns(loop, 2)
        for _ in range(2):  # this turn's two are taken already
            await turns.take()
        loop.call_soon(ticker)

        async def request(i: int) -> None:
            await turns.take()
            began.append((i, tick[0]))

        await asyncio.gather(*(request(i) for i in range(7)))
        return began

    began = asyncio.run(main())
    assert [i for i, _ in began] == list(range(7))
    per_turn = [sum(1 for _, t in began if t == turn) for turn in sorted({t for _, t in began})]
    assert per_turn == [2, 2, 2, 1], began


def test_at_the_cap_a_connection_waiting_its_turn_makes_room_for_a_probe(gate):
    """Three connections pipeline 20,000 requests each and read the answers as they come, one
    request a turn between them, so each is always either answered or waiting in line: at a cap
    of three, the probe's connection closes one of those waiting. (Not counting them as waiting,
    the listener refused the probe: the flood of bench/attacker.py pipelined reset it.)"""
    server = serve(gate, Limits(idle_timeout=30, header_timeout=30, max_connections=3, turn=1))
    flood = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(3)]
    ended: list[int] = []

    def pipeline(i: int) -> None:
        threading.Thread(target=lambda: flood[i].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 20_000),
                         daemon=True).start()
        try:
            while flood[i].recv(65536):
                pass
        except OSError:
            pass
        ended.append(i)

    readers = [threading.Thread(target=pipeline, args=(i,), daemon=True) for i in range(3)]
    try:
        for t in readers:
            t.start()
        time.sleep(0.3)
        assert not ended, "the flood is over before the probe"
        status, body, _, _ = get(server.port, "/healthz")
        assert (status, body) == (200, b"ok\n")
        wait_for(lambda: len(ended) == 1, 5, what="one pipelining connection closed for room")
        time.sleep(0.3)
        assert len(ended) == 1
    finally:
        for s in flood:
            s.close()
        server.stop()


def test_at_the_cap_a_connection_whose_client_does_not_read_makes_room_for_a_probe(gate):
    """Three connections with a small receive buffer pipeline thousands of requests and never
    read: each ends up blocked writing an answer (for write_timeout, 30 s here), neither waiting
    for a request nor sending a head, and at a cap of three the listener refused every other
    connection, a probe's too. Such a connection is now closed to make room."""
    big = "# metrics\n" * 200_000  # 2 MB: a few answers fill every buffer on the way
    server = HttpServer("127.0.0.1", 0, {"/healthz": lambda: text(200, "ok\n"), "/metrics": lambda: text(200, big)},
                        limits=Limits(idle_timeout=30, header_timeout=30, write_timeout=30, max_connections=3, turn=1))
    server.start()
    flood = []
    try:
        for _ in range(3):
            flood.append(_unread_client(server.port, requests=20))
        time.sleep(2.0)  # every buffer full: the three are blocked writing
        status, body, _, took = get(server.port, "/healthz")
        assert (status, body) == (200, b"ok\n") and took < 2.0, took
    finally:
        for s in flood:
            s.close()
        server.stop()


def test_a_connection_dropped_while_its_answer_is_unsent_gives_its_socket_back():
    """Ten clients pipeline three 2 MB answers and never read; at a cap of five, five of them
    are closed to make room and the other five after write_timeout. Before: each kept its socket
    (asyncio's close() waits for the client to take what is unsent), out of the cap's count: 20
    descriptors open for the ten clients' 10, for as long as the clients stayed."""
    big = "# metrics\n" * 200_000
    server = HttpServer("127.0.0.1", 0, {"/healthz": lambda: text(200, "ok\n"), "/metrics": lambda: text(200, big)},
                        limits=Limits(idle_timeout=30, header_timeout=30, write_timeout=1, max_connections=5))
    server.start()
    flood = []
    try:
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(10):
            flood.append(_unread_client(server.port, requests=3))
            time.sleep(0.1)
        wait_for(lambda: len(os.listdir("/proc/self/fd")) - before <= 10, 10,
                 what="only the clients' own sockets open")
        assert get(server.port, "/healthz")[:2] == (200, b"ok\n")
    finally:
        for s in flood:
            s.close()
        server.stop()


def test_a_large_answer_written_a_chunk_at_a_time_arrives_whole():
    """An answer is handed to the kernel a chunk at a time (a client that does not read holds at
    most a chunk of buffer): a 2 MB one arrives byte for byte on a kept-alive connection, its
    HEAD with the same Content-Length and no body, and the connection carries the next request."""
    big = "".join(f"line {i}\n" for i in range(200_000))
    server = HttpServer("127.0.0.1", 0, {"/healthz": lambda: text(200, "ok\n"), "/big": lambda: text(200, big)},
                        lanes={"/healthz": INLINE, "/big": "metrics"})
    server.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        for method in ("GET", "HEAD", "GET"):
            conn.request(method, "/big")
            r = conn.getresponse()
            body = r.read()
            assert r.status == 200 and r.getheader("Content-Length") == str(len(big.encode()))
            assert body == (big.encode() if method == "GET" else b"")
        conn.request("GET", "/healthz")
        assert conn.getresponse().read() == b"ok\n"
        conn.close()
    finally:
        server.stop()


def _unread_client(port: int, requests: int) -> socket.socket:
    """A client that pipelines ``requests`` /metrics requests and never reads, with as small a
    receive buffer as the kernel allows."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect(("127.0.0.1", port))
    _send_quietly(s, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * requests)
    return s


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass


@pytest.mark.parametrize("pieces", [1, 2])
def test_a_handler_that_raises_is_a_500_and_a_warning_however_the_request_came(pieces, http_log):
    """The listener's handler answers its own errors (HttpServer.respond does); one that raises
    anyway, on the loop (a probe) or on a lane's thread, gets 500 and a warning, whether its
    request came in the first read or in pieces."""
    def handle(method, target, headers):
        raise RuntimeError("boom")

    listener = Listener("127.0.0.1", 0, handle, lambda path: INLINE if path == "/healthz" else "page", FAST)
    listener.start()
    try:
        for path in (b"/healthz", b"/page"):
            raw = b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            with socket.create_connection(listener.address, timeout=5) as s:
                for part in (raw[:5], raw[5:]) if pieces == 2 else (raw,):
                    s.sendall(part)
                    time.sleep(0.05)
                reply = b""
                while chunk := s.recv(65536):
                    reply += chunk
            assert reply.startswith(b"HTTP/1.1 500 ") and reply.endswith(b"internal error\n"), (path, reply[:80])
    finally:
        listener.stop()
    assert [r.getMessage() for r in http_log].count("http: handler failed") == 2, http_log


def test_pipelined_requests_are_answered_in_the_order_they_came():
    """RFC 9112 9.3.2: a server that reads pipelined requests "MUST send the corresponding
    responses in the same order that the requests were received". Here the probes are answered
    on the loop and /metrics on its lane's threads, each request after its turn (turn=1), and
    the first request comes in the connection's first read."""
    server = HttpServer("127.0.0.1", 0, {"/healthz": lambda: text(200, "ok\n"),
                                         "/metrics": lambda: (time.sleep(0.05), text(200, "# metrics\n"))[1]},
                        limits=Limits(idle_timeout=5, header_timeout=5, turn=1))
    server.start()
    try:
        paths = ["/metrics", "/healthz", "/metrics", "/healthz", "/healthz", "/metrics"]
        raw = b"".join(f"GET {p} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for p in paths[:-1])
        raw += f"GET {paths[-1]} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(raw)
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
    finally:
        server.stop()
    bodies = re.findall(rb"\r\n\r\n(ok\n|# metrics\n)", reply)
    assert bodies == [b"# metrics\n" if p == "/metrics" else b"ok\n" for p in paths], reply


def test_requests_without_the_token_are_refused_on_the_loop_and_take_no_page_slot(gate):
    """With ``http.auth_token`` set, a request without it was refused by a page worker: a flood
    of them took the two page slots of the daemon, and the operator who had the token got "503
    busy". The token is now checked on the listener's loop, so such a request never takes a slot:
    with every slot rendering, it still gets its 401 at once, and an operator's pages are answered
    while a flood without the token goes on."""
    server = HttpServer("127.0.0.1", 0, {"/healthz": lambda: text(200, "ok\n")},
                        pages={"/slow": gate.page, "/": lambda req: text(200, "page\n")}, limits=FAST,
                        auth_token=lambda: "s3cret", ready={})
    server.start()
    try:
        threads = [threading.Thread(target=get, args=(server.port, "/slow?token=s3cret", 15)) for _ in range(4)]
        for t in threads:
            t.start()
        for _ in range(4):
            assert gate.entered.acquire(timeout=5)  # every page slot rendering
        status, body, _, seconds = get(server.port, "/")
        assert status == 401 and seconds < 1, f"a request without the token got {status} {body!r}"
        gate.opened.set()
        for t in threads:
            t.join(10)
        stop = threading.Event()

        def flood() -> None:
            while not stop.is_set():
                get(server.port, "/")

        flooders = [threading.Thread(target=flood) for _ in range(8)]
        for t in flooders:
            t.start()
        try:
            answers = [get(server.port, "/?token=s3cret")[0] for _ in range(50)]
        finally:
            stop.set()
            for t in flooders:
                t.join(10)
        assert answers == [200] * 50
    finally:
        server.stop()


def test_a_token_with_plus_or_percent_is_taken_in_a_link_as_written_or_percent_encoded():
    """http.auth_token takes any printable ASCII (``openssl rand -base64 32`` gives '+', '/' and
    '='), but ``?token=TOKEN`` was read as a form field only: a '+' became a space and '%41' an
    'A', so the README's ``?token=TOKEN`` link was a 401 with the right token. It is now taken
    as written too (and still percent-encoded, as the dashboard's own links carry it)."""
    from urllib.parse import quote

    token = "Ab+9/x%41z=="
    server = HttpServer("127.0.0.1", 0, {}, pages={"/": lambda req: text(200, req.query["token"][0])},
                        limits=FAST, auth_token=lambda: token, ready={})
    server.start()
    try:  # the page gets the token as it matched (its links carry it on)
        assert get(server.port, "/?token=" + token)[:2] == (200, token.encode())
        assert get(server.port, "/?token=" + quote(token, safe=""))[:2] == (200, token.encode())
        assert get(server.port, "/?refresh=0&token=" + token)[0] == 200
        assert get(server.port, "/?token=" + token.replace("+", " ").replace(" ", "%20"))[0] == 401
        assert get(server.port, "/?token=" + token[:-1])[0] == 401
    finally:
        server.stop()


def test_a_closing_connection_whose_client_does_not_read_is_given_up_after_the_write_timeout():
    """After the last answer the listener closes the connection and waits (_linger) until the
    client has taken what is unsent, at most ``write_timeout``: asyncio's close() keeps the socket
    for as long as anything is unsent, for ever if the client never reads. Every answer is
    drained a chunk at a time within ``write_timeout`` before that (_write), so nothing is left
    unsent when the wait begins, and its own timeout could be deleted unnoticed (a mutation
    review). Here the wait is driven directly, on real sockets: a client that does not read, an
    answer of 8 MB written past both sockets' small buffers and not drained; the wait gives up
    after write_timeout (1 s; 20 s allowed), and the connection no longer counts as writing."""
    listener = Listener("127.0.0.1", 0, lambda *request: (200, "text/plain", b"", {}), lambda target: INLINE,
                        limits=Limits(write_timeout=1))
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)

    async def linger() -> None:
        client.connect(listener.address)
        listener.sock.setblocking(True)
        sock, _ = listener.sock.accept()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.setblocking(False)
        conn = _Conn(sock)
        _, conn.writer = await asyncio.open_connection(sock=sock)
        listener._conns[conn] = None
        conn.writer.write(b"x" * 8_000_000)
        await asyncio.sleep(0.2)
        assert conn.writer.transport.get_write_buffer_size() > 0, "everything was sent: the test tests nothing"
        waiting = asyncio.ensure_future(listener._linger(conn))
        try:
            done, _ = await asyncio.wait({waiting}, timeout=20)
            assert waiting in done, "the connection waited for a client that never reads"
            assert isinstance(waiting.exception(), TimeoutError) and conn not in listener._writing
        finally:
            waiting.cancel()
            listener._close(conn)

    try:
        asyncio.run(linger())
    finally:
        client.close()
        listener.stop()
