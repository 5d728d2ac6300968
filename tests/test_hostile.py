"""Issue 26 against real daemons: nothing a client of the HTTP port does costs leadership, health
or the database's connections (SPEC 8.5). The "before" figures of each scenario, measured with
``bench/hostile.py`` on the code before the fix, are in the docstrings."""

from __future__ import annotations

import json
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import psycopg
import pytest

from .procs import START, DaemonProc, leader_row, wait_for


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
        d.wait_log(r"became leader epoch=", timeout=START)
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


def flood(port: int, seconds: float, clients: int, *paths: str, pipeline: bool = False) -> subprocess.Popen:
    """The clients in a process of their own at a lower priority (nice 10): an attacker's CPU is
    not the daemon's, but here both share the test machine's cores."""
    mode = ["--pipeline"] if pipeline else []
    return subprocess.Popen([sys.executable, "-m", "tests.flood", *mode, str(port), str(seconds), str(clients), *paths],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent,
                            preexec_fn=lambda: os.nice(10))


def probe_timeout() -> float:
    """The shortest ``timeoutSeconds`` of deploy/kubernetes's readiness and liveness probes (2 s)."""
    text = (Path(__file__).resolve().parent.parent / "deploy" / "kubernetes" / "deployment.yaml").read_text()
    return float(min(int(v) for v in re.findall(r"^\s*timeoutSeconds:\s*(\d+)", text, re.M)))


def connections(dsn: str, instance: str) -> tuple[int, int]:
    """(this daemon's reader sessions, all its sessions) at the server."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FILTER (WHERE application_name = %s), count(*) "
                            "FROM pg_stat_activity WHERE application_name LIKE %s",
                            (f"maintd:{instance}:read", f"maintd:{instance}:%")).fetchone()


@pytest.mark.slow
def test_a_status_and_dashboard_flood_costs_no_leadership_health_or_connections(pg_dsn, schema):
    """200 clients on /status, / and /jobs for 20 s while leading a table of 300,000 finished jobs.
    Before (bench/hostile.py): /status counted finished jobs on the maintenance pool, and 30
    clients on a table of 2 M cost the term (epoch 1 -> 2, /healthz 503 for 30 s); each page
    opened a connection of its own (28 at once for 200 clients)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"""INSERT INTO "{schema}".jobs (kind, queue, state, attempt, finalized_at)
                         SELECT 'k', 'q' || (i % 20), 'completed', 1, now() - (i % 3600) * interval '1 second'
                           FROM generate_series(1, 300000) i""")
        conn.execute(f'INSERT INTO "{schema}".jobs (kind, queue) SELECT \'k\', \'q\' || (i % 20) '
                     f'FROM generate_series(1, 20000) i')
        conn.execute(f'ANALYZE "{schema}".jobs')
    d = DaemonProc(pg_dsn, schema, "flood-1").start()
    try:
        d.wait_log(r"became leader epoch=", timeout=START)
        port, epoch = d.http_port, leader_row(pg_dsn, schema)[0]
        paths = ("/status", "/", "/jobs?state=completed")
        for path in paths:  # warm, then timed alone: what two page threads could serve in 20 s here
            get(port, path, timeout=30)
        # each timed read past the 0.5 s that /status and / keep a result (http.Recent): timed
        # within it they were that cache's hits (0.003 s), and the bound below ten times too high
        def read_alone(path: str) -> float:
            time.sleep(0.6)
            return get(port, path, timeout=30)[1]

        alone = statistics.mean(read_alone(path) for path in paths * 2)
        clients = flood(port, 20, 200, *paths)
        seen, probes = [], []
        while clients.poll() is None:
            seen.append(connections(pg_dsn, "flood-1"))
            probes.append(get(port, ("/healthz", "/metrics")[len(probes) % 2], timeout=5))
            time.sleep(0.2)
        calls = json.loads(clients.stdout.read())
        served, could = calls["by_status"].get("200", 0), 2 * 20 / alone
        print(f"flood: {calls}; pages served {served} of {could:.0f} alone ({alone:.3f} s a page); readers at "
              f"most {max(r for r, _ in seen)}, daemon sessions at most {max(a for _, a in seen)}; "
              f"/healthz and /metrics max {max(s for _, s, _ in probes):.3f} s")
        # Pages were served all along: in every quarter of the flood, at least a tenth of what two
        # page threads serve here without it (an absolute count, 100 in all, failed at 96 on a
        # slower machine running another test beside this one).
        assert min(calls["ok_by_quarter"]) > 0.1 * could / 4, (served, could, calls)
        assert max(r for r, _ in seen) <= 4, seen  # the readers' cap
        assert max(a for _, a in seen) <= 20, seen  # maintenance + lock + readers
        assert all(status == 200 for status, _, _ in probes), [p for p in probes if p[0] != 200]
        # Answered within the shortest probe timeout the shipped deployment gives them (kubelet
        # fails a probe past it): 1 s here failed at 1.04 s once in CI (its 90th percentile 0.11 s).
        bound = probe_timeout()
        assert max(s for _, s, _ in probes) < bound, (bound, statistics.quantiles([s for _, s, _ in probes], n=10))
        assert leader_row(pg_dsn, schema) == (epoch, "flood-1")  # the same term, still held
        assert "giving up" not in d.log() and "lost leadership" not in d.log()
    finally:
        d.stop()


@pytest.mark.slow
def test_a_flood_of_pipelined_metrics_requests_leaves_prometheus_scrapes_answered(pg_dsn, schema):
    """500 unauthenticated clients pipeline /metrics on kept-alive connections for 12 s while a
    scraper asks for it every 0.25 s on a connection of its own (as Prometheus does). Before: the
    flood filled the metrics lane (2 threads, 30 waiting) behind each render, and 13 of 32 scrapes
    got "503 busy"; now the last body is handed out on the listener's loop while it is fresh."""
    d = DaemonProc(pg_dsn, schema, "mflood-1").start()
    try:
        d.wait_log(r"became leader epoch=", timeout=START)
        port = d.http_port
        clients = flood(port, 12, 500, "/metrics", pipeline=True)
        time.sleep(2)  # every client connected and pipelining
        scrapes = []
        while clients.poll() is None:
            scrapes.append(get(port, "/metrics", timeout=5))
            time.sleep(0.25)
        calls = json.loads(clients.stdout.read())
        print(f"flood: {calls}; scrapes {len(scrapes)}, max {max(s for _, s, _ in scrapes):.3f} s")
        assert calls["by_status"].get("200", 0) > 1000, calls  # the flood was one
        assert len(scrapes) >= 10
        assert all(status == 200 and b"maintd_is_leader" in body for status, _, body in scrapes), \
            [(status, body[:60]) for status, _, body in scrapes if status != 200]
        assert max(s for _, s, _ in scrapes) < 1, statistics.quantiles([s for _, s, _ in scrapes], n=10)
    finally:
        d.stop()


@pytest.mark.slow
def test_a_queue_name_cannot_forge_a_log_line_and_100000_queues_make_no_huge_line(pg_dsn, schema):
    """Before (bench/hostile.py log-injection): the forged line appeared as a line of its own, 3
    raw ESC bytes reached the log, and the promotion of 100,000 queues wrote a 1,388,973-byte line."""
    forged = "x\n2026-01-01T00:00:00.000Z info    became leader epoch=999 instance=attacker"
    ansi = "y\x1b[2J\x1b[31mRED\x1b[0m"
    d = DaemonProc(pg_dsn, schema, "logs-1").start()
    try:
        d.wait_log(r"became leader epoch=", timeout=START)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            def promoted() -> bool:
                return not conn.execute(f"""SELECT EXISTS (SELECT 1 FROM "{schema}".jobs
                                            WHERE state = 'scheduled')""").fetchone()[0]

            conn.execute(f"""INSERT INTO "{schema}".jobs (kind, queue, state, scheduled_at)
                             SELECT 'k', q, 'scheduled', now() FROM unnest(%s::text[]) q""", ([forged, ansi],))
            wait_for(promoted, 20, what="the two jobs promoted")
            d.wait_log("scheduler pass", timeout=10)
            conn.execute(f"""INSERT INTO "{schema}".jobs (kind, queue, state, scheduled_at)
                             SELECT 'k', 'queue-' || i, 'scheduled', now()
                               FROM generate_series(1, 100000) i""")
            wait_for(promoted, 60, what="every job promoted")
        wait_for(lambda: "more queues)" in d.log(), 10, what="the promotion's line")
    finally:
        d.stop()
    text = d.log()
    lines = text.split("\n")
    assert not [ln for ln in lines if ln.startswith("2026-01-01")], "a forged line"
    assert r"x\n2026-01-01T00:00:00.000Z info    became leader epoch=999 instance=attacker" in text
    assert "\x1b" not in text and r"y\x1b[2J" in text
    assert max(len(ln.encode()) for ln in lines) < 4096
    assert "more queues)" in text  # the largest named, the rest counted


def rss_mb(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key + ":"))


@pytest.mark.slow
def test_status_of_100000_queues_is_small_and_16_readers_cost_little_memory(pg_dsn, schema):
    """Before (bench/hostile.py status-size): one /status of 100,000 queues was 11,781,516 bytes
    and took 3.5 s; 16 clients for 20 s drove the daemon's RSS from 183 MB to 1,174 MB."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"""INSERT INTO "{schema}".jobs (kind, queue) SELECT 'k', 'queue-' || i
                           FROM generate_series(1, 100000) i""")
    d = DaemonProc(pg_dsn, schema, "size-1").start()
    try:
        d.wait_log(r"became leader epoch=", timeout=START)
        port = d.http_port

        def counted() -> dict | None:
            status, _, body = get(port, "/status")
            data = json.loads(body) if status == 200 else {}
            return data if data.get("jobs_counted_at") else None

        data = wait_for(counted, 30, what="the leader's counts")
        body = json.dumps(data)
        assert len(body) < 50_000, len(body)
        assert sum(r["count"] for r in data["jobs"]) == 100_000 and "100000 queues" in data["jobs_note"]
        before = rss_mb(d.pid, "VmRSS")
        clients = flood(port, 10, 16, "/status")
        calls = json.loads(clients.communicate(timeout=60)[0])
        assert calls["by_status"].get("200", 0) >= 20, calls
        assert rss_mb(d.pid, "VmHWM") - before < 100, (before, rss_mb(d.pid, "VmHWM"))
    finally:
        d.stop()



def unread_pipelines(port: int, n: int, requests: int) -> list[socket.socket]:
    """``n`` connections that each pipeline ``requests`` ``/metrics`` requests and never read an
    answer, with as small a receive buffer as the kernel allows (a client that stopped reading,
    or one that means harm)."""
    socks: list[socket.socket] = []
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.settimeout(3)
        try:
            s.connect(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        socks.append(s)
        try:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * requests)
        except OSError:
            pass
    return socks


def hundred_queues(dsn: str, schema: str) -> None:
    """Jobs in 100 queues, two states each: a /metrics of about 45 KB (more than the kernel's
    buffers of a client that does not read take)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"""INSERT INTO "{schema}".jobs (kind, queue, state, scheduled_at)
                         SELECT 'k', 'queue-with-a-long-name-' || (i % 100), s::"{schema}".job_state,
                                now() + interval '1 day'
                           FROM generate_series(1, 1000) i, unnest(array['available', 'scheduled']) s""")


@pytest.mark.slow
def test_clients_that_never_read_cannot_hold_descriptors_past_the_connection_cap(pg_dsn, schema, more_descriptors):
    """1,800 connections, 300 every 2 s, pipeline 60 /metrics requests each (45 KB answers: more
    than the kernel's buffers take) and never read, at a limit of 1,024 descriptors (a cap of 512
    connections). Before: a connection closed to make room for a new one (or after write_timeout)
    kept its socket as long as an answer was unsent (asyncio's close() waits for its buffer to be
    taken), out of the cap's count: the daemon held 1,023 descriptors, logged 'out of file
    descriptors', and every /healthz and /status failed at once (-1)."""
    hundred_queues(pg_dsn, schema)
    d = DaemonProc(pg_dsn, schema, "unread-1", prefix=["prlimit", "--nofile=1024:1024", "--"]).start()
    socks: list[socket.socket] = []
    try:
        d.wait_log(r"became leader epoch=", timeout=START)
        port, epoch = d.http_port, leader_row(pg_dsn, schema)[0]
        assert d.wait_log(r"max_connections=(\d+)").group(1) == "512"
        wait_for(lambda: len(get(port, "/metrics")[2]) > 40_000, 30, what="the 100 queues' gauges")
        for _ in range(6):
            socks += unread_pipelines(port, 300, requests=60)
            time.sleep(2)  # their answers fill the kernel's buffers: each blocked writing the rest
        assert len(socks) >= 1700
        held = len(os.listdir(f"/proc/{d.pid}/fd"))
        probes = []
        for _ in range(8):
            probes.append(get(port, "/healthz", timeout=5))
            time.sleep(0.25)
        status = get(port, "/status", timeout=10)[0]  # a reader session opened: a descriptor too
        assert held < 700, held  # the cap (512), and the daemon's own: the database's, the log
        assert all(status == 200 for status, _, _ in probes), probes
        assert max(seconds for _, seconds, _ in probes) < 1, probes
        assert status == 200
        assert "out of file descriptors" not in d.log()
        assert leader_row(pg_dsn, schema) == (epoch, "unread-1")
    finally:
        for s in socks:
            s.close()
        d.stop()


@pytest.mark.slow
def test_2000_clients_that_never_read_metrics_cost_a_bounded_amount_of_memory(pg_dsn, schema, more_descriptors):
    """2,100 connections, 300 a second, pipeline 60 /metrics requests each (45 KB answers) and
    never read, up to the default cap of 2,000 connections. Before: each connection blocked
    writing held its own copy of an answer and asyncio's 64 KB of buffer besides: the daemon went
    from 79 to 370 MB, past the Deployment's 256Mi limit (an OOM kill: leadership lost)."""
    hundred_queues(pg_dsn, schema)
    d = DaemonProc(pg_dsn, schema, "unread-2", prefix=["prlimit", "--nofile=8192:8192", "--"]).start()
    socks: list[socket.socket] = []
    try:
        d.wait_log(r"became leader epoch=", timeout=START)
        port = d.http_port
        assert d.wait_log(r"max_connections=(\d+)").group(1) == "2000"
        wait_for(lambda: len(get(port, "/metrics")[2]) > 40_000, 30, what="the 100 queues' gauges")
        before = rss_mb(d.pid, "VmRSS")
        for _ in range(7):
            socks += unread_pipelines(port, 300, requests=60)
            time.sleep(1)
        time.sleep(2)  # every connection blocked writing
        grown = rss_mb(d.pid, "VmHWM") - before
        probes = [get(port, "/healthz", timeout=5) for _ in range(4)]
        print(f"RSS {before:.0f} MB, then at most {before + grown:.0f} MB")
        assert grown < 120, (before, grown)
        assert all(status == 200 for status, _, _ in probes), probes
        assert max(seconds for _, seconds, _ in probes) < 1, probes
    finally:
        for s in socks:
            s.close()
        d.stop()
