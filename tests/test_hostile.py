"""Issue 26 against real daemons: nothing a client of the HTTP port does costs leadership, health
or the database's connections (SPEC 8.5). The "before" figures of each scenario, measured with
``bench/hostile.py`` on the code before the fix, are in the docstrings."""

from __future__ import annotations

import os
import resource
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request
from typing import Iterator

import psycopg
import pytest

from .procs import DaemonProc, leader_row, wait_for


def get(port: int, path: str, timeout: float = 10) -> tuple[int, float, bytes]:
    """(status, or -1 when the request failed; seconds; body)."""
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, time.monotonic() - started, r.read()
    except urllib.error.HTTPError as e:
        return e.code, time.monotonic() - started, e.read()
    except OSError:
        return -1, time.monotonic() - started, b""


@pytest.fixture
def more_descriptors() -> Iterator[None]:
    """This process needs a descriptor per client socket it holds open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def idle_connections(port: int, n: int, threads: int = 20) -> list[socket.socket]:
    """``n`` connections that never send a byte (each connect returns once the server's kernel
    took it), opened by ``threads`` threads."""
    socks: list[socket.socket] = []

    def opener(k: int) -> None:
        for _ in range(k):
            s = socket.socket()
            s.settimeout(3)
            try:
                s.connect(("127.0.0.1", port))
                socks.append(s)
            except OSError:
                s.close()

    workers = [threading.Thread(target=opener, args=(n // threads,)) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return socks


@pytest.mark.slow
def test_2000_idle_sockets_at_a_limit_of_1024_descriptors_do_not_stop_healthz(pg_dsn, schema,
                                                                               more_descriptors):
    """Before: the 2,000 connections took all 1,024 descriptors (a thread each, never timed
    out): 0 of 6 probes answered, at 88 % CPU, and 5 tracebacks in the log. The hard limit is
    1,024 too, so the daemon cannot raise its own."""
    d = DaemonProc(pg_dsn, schema, "nofile-1", prefix=["prlimit", "--nofile=1024:1024", "--"]).start()
    socks: list[socket.socket] = []
    try:
        d.wait_log(r"became leader epoch=", timeout=20)
        port = d.http_port
        assert d.wait_log(r"max_connections=(\d+)").group(1) == "512"  # half the limit
        socks = idle_connections(port, 2000)
        assert len(socks) >= 1900
        probes = []
        for _ in range(20):
            probes.append(get(port, "/healthz", timeout=5))
            time.sleep(0.25)
        assert all(status == 200 for status, _, _ in probes), probes
        assert max(seconds for _, seconds, _ in probes) < 1, probes
        assert len(os.listdir(f"/proc/{d.pid}/fd")) < 1024
        assert "Traceback" not in d.log()
    finally:
        for s in socks:
            s.close()
        d.stop()
