"""Raw-socket clients that attack a daemon's HTTP port, in a process of their own (``bench/hostile.py
raw-floods`` runs them at nice 10, beside its probes):

    python bench/attacker.py MODE PORT SECONDS N

Modes (N: connections held, or threads for ``connect-flood``), each reconnecting what the server
closes until SECONDS have passed; prints one line of counts:

* ``held-heads``: each connection sends a 16,000-byte request head it never finishes;
* ``pipelined``: each connection sends 50 requests for /metrics and the probes every 50 ms and
  never reads an answer;
* ``idle-churn``: connections that never send a byte;
* ``connect-flood``: threads that connect, send a request half the time and reset the connection;
* ``slowloris``: each connection sends one byte of a request head a second.
"""

from __future__ import annotations

import random
import resource
import socket
import struct
import sys
import threading
import time
from typing import Callable

HEAD = b"GET / HTTP/1.1\r\nX: " + b"a" * 16_000
PATHS = (b"/metrics", b"/healthz", b"/readyz")
counts = {"connected": 0, "closed_by_server": 0, "refused": 0}


def connect(port: int) -> socket.socket | None:
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError:
        counts["refused"] += 1
        return None
    counts["connected"] += 1
    return s


def open_now(s: socket.socket) -> bool:
    """False (and closed) once the server has closed ``s``."""
    try:
        s.setblocking(False)
        if s.recv(65536):  # an answer we do not want (pipelined): read, then dropped
            return True
    except BlockingIOError:
        return True
    except OSError:
        pass
    counts["closed_by_server"] += 1
    s.close()
    return False


def held(port: int, end: float, n: int, first: bytes, every: float,
         then: bytes | Callable[[], bytes] = b"") -> None:
    """``n`` connections: ``first`` sent at connect, ``then`` (or what it returns) every ``every``
    seconds."""
    socks: list[socket.socket] = []
    while time.monotonic() < end:
        for _ in range(min(500, n - len(socks))):  # at most 500 a round: what the server closed is seen
            if time.monotonic() >= end:
                break
            s = connect(port)
            if s is None:
                time.sleep(0.01)
                break
            try:
                s.sendall(first)
            except OSError:
                s.close()
                continue
            socks.append(s)
        for s in socks if then else []:
            try:
                s.send(then() if callable(then) else then)
            except BlockingIOError:
                pass
            except OSError:
                s.close()
        socks = [s for s in socks if s.fileno() >= 0 and open_now(s)]
        time.sleep(every)


def pipeline() -> bytes:
    return b"".join(b"GET " + random.choice(PATHS) + b" HTTP/1.1\r\nHost: x\r\n\r\n" for _ in range(50))


def connect_flood(port: int, end: float, n: int) -> None:
    def one() -> None:
        while time.monotonic() < end:
            s = connect(port)
            if s is None:
                continue
            try:
                if random.random() < 0.5:
                    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset
            except OSError:
                pass
            s.close()

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main(mode: str, port: int, seconds: float, n: int) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 1024), hard))
    end = time.monotonic() + seconds
    if mode == "held-heads":
        held(port, end, n, HEAD, 0.2)
    elif mode == "pipelined":
        held(port, end, n, b"", 0.05, pipeline)
    elif mode == "idle-churn":
        held(port, end, n, b"", 0.2)
    elif mode == "slowloris":
        held(port, end, n, b"G", 1.0, b"X")
    elif mode == "connect-flood":
        connect_flood(port, end, n)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(mode, counts, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
