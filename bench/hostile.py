"""The hostile-client scenarios of issue 26, measured against a real daemon on a PostgreSQL of its
own (embedded PostgreSQL 18, ``max_connections = 100``). Not a test: a person runs it before and
after a change and reads the figures. Only outside behaviour is used (HTTP, the log, the
database's ``pg_stat_activity``, ``/proc``), so the same script measures any version.

    python bench/hostile.py                       # every scenario (about 5 minutes)
    python bench/hostile.py status-flood --rows 2000000 --seconds 40
    python bench/hostile.py idle-sockets dashboard-flood log-injection status-size backlog

Scenarios (issue 26's numbering):

1. ``status-flood``: 30 clients call ``/status`` for ``--seconds`` while the daemon leads a table
   of ``--rows`` finished jobs: the epoch before and after, ``/healthz`` latency, RSS.
   ``status-size``: ``/status`` with 100,000 queues: body bytes, and peak RSS under 16
   concurrent calls.
4. ``idle-sockets``: the daemon at ``nofile=1024:1024`` (prlimit), 2,000 idle TCP connections
   to its HTTP port: what ``/healthz`` answers meanwhile, and the daemon's CPU.
5. ``dashboard-flood``: 200 clients load ``/`` for ``--seconds``: the daemon's connections at the
   server (most at once), ``/healthz`` latency.
6. ``log-injection``: a queue named like a forged log line, one with ANSI escapes, and one
   promotion of 100,000 queues: forged lines found, escapes written raw, the longest line.
``backlog``: the listen backlog (``ss -ltn``). ``cleaner-timeout``: the cleaner at a 20 ms
statement timeout after a 1.5 M-row delete. ``raw-floods``: the raw-socket attacks of
``bench/attacker.py`` (held heads, pipelining without reading, idle churn, connect floods,
slowloris), each for ``--seconds``: ``/healthz`` latency, peak RSS, the term kept.

Measured on the 2-core test machine (shared, load 7-12), before and after issue 26's fix:

=================  ==========================================  =========================================
scenario           before                                      after
=================  ==========================================  =========================================
status-flood       epoch 1 -> 2 (gave up: maintenance hung),   epoch 1 -> 1; /healthz 81/81, max 169 ms;
(2 M rows, 40 s)   /healthz 503 61 of 112 samples              /status p50 0.05 s (the rest 503 at once)
status-size        11,781,516 bytes, 3.47 s; RSS 183 -> 1,174  15,720 bytes, 0.18 s; RSS 132 -> 148 MB
(100,000 queues)   MB under 16 clients
idle-sockets       0/6 /healthz, 88 % CPU, 1,024 fds, 5         30/30, max 122 ms, 1 % CPU, no traceback
(nofile 1024)      tracebacks
dashboard-flood    28 reader + 8 other sessions (38 at the      2 reader sessions (9 in all); /healthz
(200 clients)      server); /healthz max 4.5 s; 55 timeouts     max 0.7 s (this process's own clients
                                                                slow it: the test floods from another)
log-injection      1 forged line, 3 raw ESC, a 1,388,973-byte  0 forged, 0 ESC, longest line 243 bytes
                   line
backlog            5                                           1,024
cleaner-timeout    0 ok / 46 error passes, 0 deleted           17 ok / 0 error, 100,000 deleted
=================  ==========================================  =========================================
"""

from __future__ import annotations

import argparse
import contextlib
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
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg  # noqa: E402

from maintd import migrate  # noqa: E402
from maintd.db import make_engine  # noqa: E402
from maintd.embedded import EmbeddedPostgres  # noqa: E402
from tests.procs import DaemonProc, leader_row  # noqa: E402

PROD_LEADER = {"lease": "10s", "renew_interval": "2s", "retry_interval": "1s"}


# -- helpers ------------------------------------------------------------------------------------


@contextlib.contextmanager
def server(max_connections: int = 100) -> Iterator[str]:
    pg = EmbeddedPostgres(settings={"max_connections": str(max_connections), "shared_buffers": "256MB"})
    pg.start()
    try:
        yield pg.dsn
    finally:
        pg.cleanup()


def migrated(dsn: str, schema: str) -> None:
    engine = make_engine(dsn, application_name="bench-migrate", pooled=False)
    with engine.connect() as conn:
        migrate.upgrade(conn, schema)
    engine.dispose()


def execute(dsn: str, statement: str, params: Any = None) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(statement, params)


@contextlib.contextmanager
def daemon(dsn: str, schema: str, name: str, extra: dict | None = None,
           prefix: list[str] | None = None) -> Iterator[DaemonProc]:
    config = {"leader": dict(PROD_LEADER), **(extra or {})}
    d = DaemonProc(dsn, schema, name, config, prefix=prefix).start()
    try:
        d.wait_log(r"became leader epoch=", timeout=60)
        yield d
    finally:
        d.stop()


def get(port: int, path: str, timeout: float = 5) -> tuple[int, int, float]:
    """(status or -1 on a failure, body bytes, seconds)."""
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, len(r.read()), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, len(e.read()), time.monotonic() - t0
    except Exception:
        return -1, 0, time.monotonic() - t0


def rss_mb(pid: int, key: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Sampler(threading.Thread):
    """Calls ``fn`` every ``interval`` seconds until stopped; keeps what it returns."""

    def __init__(self, fn: Callable[[], Any], interval: float):
        super().__init__(daemon=True)
        self.fn, self.interval, self.values = fn, interval, []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            try:
                self.values.append(self.fn())
            except Exception as exc:  # noqa: BLE001
                self.values.append(exc)

    def stop(self) -> list:
        self.done.set()
        self.join()
        return self.values


def flood(port: int, paths: list[str], clients: int, seconds: float, timeout: float = 30) -> list[tuple]:
    out: list[tuple] = []
    end = time.monotonic() + seconds

    def client(i: int) -> None:
        while time.monotonic() < end:
            r = get(port, paths[i % len(paths)], timeout=timeout)
            out.append(r)
            if r[0] in (503, -1):
                time.sleep(0.05)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + timeout + 5)
    return out


def probe_summary(samples: list) -> str:
    ok = [s for s in samples if isinstance(s, tuple) and s[0] == 200]
    lat = sorted(s[2] for s in samples if isinstance(s, tuple))
    return (f"{len(ok)}/{len(samples)} ok, latency p50 {statistics.median(lat) * 1000:.0f} ms, "
            f"max {lat[-1] * 1000:.0f} ms" if lat else "no samples")


def report(name: str, **figures: Any) -> None:
    print(f"[{name}] " + "; ".join(f"{k}: {v}" for k, v in figures.items()), flush=True)


# -- scenarios ----------------------------------------------------------------------------------


def status_flood(args: argparse.Namespace) -> None:
    with server() as dsn:
        migrated(dsn, "s1")
        execute(dsn, """INSERT INTO s1.jobs (kind, queue, state, attempt, finalized_at)
                        SELECT 'k', 'q' || (i %% 10), 'completed', 1, now() - (i %% 3600) * interval '1 second'
                          FROM generate_series(1, %s) i""", (args.rows,))
        execute(dsn, "VACUUM ANALYZE s1.jobs")
        with daemon(dsn, "s1", "flood1") as d:
            port, epoch0 = d.http_port, leader_row(dsn, "s1")[0]
            single = get(d.http_port, "/status", timeout=30)
            health = Sampler(lambda: get(port, "/healthz", timeout=10), 0.5)
            rss = Sampler(lambda: rss_mb(d.pid), 0.5)
            health.start(), rss.start()
            calls = flood(port, ["/status"], 30, args.seconds)
            time.sleep(3)
            hs, rs = health.stop(), rss.stop()
            epoch1, holder = leader_row(dsn, "s1")
            lat = sorted(c[2] for c in calls if c[0] == 200)
            report("status-flood", rows=args.rows, one_status=f"{single[2]:.2f} s ({single[1]} bytes)",
                   calls=len(calls), ok=len(lat), status_503=sum(c[0] == 503 for c in calls),
                   failed=sum(c[0] == -1 for c in calls),
                   status_p50=f"{statistics.median(lat):.2f} s" if lat else "-",
                   epoch=f"{epoch0} -> {epoch1} (holder {holder})",
                   gave_up="giving up leadership" in d.log(), healthz=probe_summary(hs),
                   healthz_non200=sum(1 for s in hs if not (isinstance(s, tuple) and s[0] == 200)),
                   rss_max_mb=f"{max(rs):.0f}")


def status_size(args: argparse.Namespace) -> None:
    with server() as dsn:
        migrated(dsn, "s2")
        execute(dsn, """INSERT INTO s2.jobs (kind, queue) SELECT 'k', 'queue-' || i
                          FROM generate_series(1, 100000) i""")
        execute(dsn, "VACUUM ANALYZE s2.jobs")
        with daemon(dsn, "s2", "size1", {"scheduler": {"enabled": False}}) as d:
            time.sleep(20)  # the leader's job gauges have counted once
            one = get(d.http_port, "/status", timeout=60)
            base = rss_mb(d.pid)
            calls = flood(d.http_port, ["/status"], 16, args.seconds, timeout=60)
            report("status-size", body_bytes=one[1], status=one[0], one_seconds=f"{one[2]:.2f}",
                   calls=len(calls), ok=sum(c[0] == 200 for c in calls),
                   rss_before_mb=f"{base:.0f}", rss_peak_mb=f"{rss_mb(d.pid, 'VmHWM'):.0f}")


def idle_connections(port: int, n: int, threads: int = 20) -> tuple[list[socket.socket], int]:
    """``n`` TCP connections that never send a byte, opened by ``threads`` threads that each
    connect one after the other (a connect returns once the server's kernel accepted it)."""
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
    return socks, len(socks)


def idle_sockets(args: argparse.Namespace) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    with server() as dsn:
        migrated(dsn, "s4")
        with daemon(dsn, "s4", "idle1", prefix=["prlimit", "--nofile=1024:1024", "--"]) as d:
            port = d.http_port
            before = get(port, "/healthz")
            socks, opened = idle_connections(port, 2000)
            cpu0, t0 = cpu_seconds(d.pid), time.monotonic()
            samples = []
            while time.monotonic() - t0 < args.seconds:
                samples.append(get(port, "/healthz", timeout=2))
                time.sleep(0.5)
            cpu = (cpu_seconds(d.pid) - cpu0) / (time.monotonic() - t0)
            fds = len(os.listdir(f"/proc/{d.pid}/fd"))
            for s in socks:
                s.close()
            time.sleep(1)
            after = get(port, "/healthz", timeout=5)
            report("idle-sockets", opened=opened, healthz_before=before[0], during=probe_summary(samples),
                   daemon_cpu=f"{cpu:.0%}", daemon_fds=fds, after_close=after[0],
                   tracebacks=d.log().count("Traceback"))


def dashboard_flood(args: argparse.Namespace) -> None:
    with server(max_connections=100) as dsn:
        migrated(dsn, "s5")
        execute(dsn, """INSERT INTO s5.jobs (kind, queue, state, attempt, finalized_at)
                        SELECT 'k', 'q' || (i % 20), 'completed', 1, now() - (i % 3600) * interval '1 second'
                          FROM generate_series(1, 200000) i""")
        execute(dsn, "INSERT INTO s5.jobs (kind, queue) SELECT 'k', 'q' || (i % 20) FROM generate_series(1, 50000) i")
        execute(dsn, "VACUUM ANALYZE s5.jobs")
        with daemon(dsn, "s5", "dash1") as d:
            port, epoch0 = d.http_port, leader_row(dsn, "s5")[0]

            def count() -> tuple[int, int, int]:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    row = conn.execute(
                        "SELECT count(*) FILTER (WHERE application_name LIKE %s),"
                        " count(*) FILTER (WHERE application_name IN (%s, %s)),"
                        " count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'",
                        ("maintd:dash1:%", "maintd:dash1:dashboard", "maintd:dash1:read")).fetchone()
                return row

            conns = Sampler(count, 0.2)
            health = Sampler(lambda: get(port, "/healthz", timeout=10), 0.5)
            conns.start(), health.start()
            calls = flood(port, ["/", "/jobs?state=completed", "/status"], 200, args.seconds)
            cs, hs = conns.stop(), health.stop()
            cs = [c for c in cs if isinstance(c, tuple)]
            refused = 0
            try:
                psycopg.connect(dsn).close()
            except psycopg.OperationalError:
                refused = 1
            report("dashboard-flood", calls=len(calls), ok=sum(c[0] == 200 for c in calls),
                   status_503=sum(c[0] == 503 for c in calls), failed=sum(c[0] == -1 for c in calls),
                   daemon_conns_max=max(c[0] for c in cs), reader_conns_max=max(c[1] for c in cs),
                   server_conns_max=max(c[2] for c in cs), epoch=f"{epoch0} -> {leader_row(dsn, 's5')[0]}",
                   healthz=probe_summary(hs), refused_after=refused)


def log_injection(args: argparse.Namespace) -> None:
    forged = "x\n2026-01-01T00:00:00.000Z info    became leader epoch=999 instance=attacker"
    ansi = "y\x1b[2J\x1b[31mRED\x1b[0m"
    with server() as dsn:
        migrated(dsn, "s6")
        with daemon(dsn, "s6", "log1") as d:
            execute(dsn, """INSERT INTO s6.jobs (kind, queue, state, scheduled_at)
                            SELECT 'k', q, 'scheduled', now() + interval '3 seconds'
                              FROM unnest(%s::text[]) q""", ([forged, ansi],))
            execute(dsn, """INSERT INTO s6.jobs (kind, queue, state, scheduled_at)
                            SELECT 'k', 'queue-' || i, 'scheduled', now() + interval '6 seconds'
                              FROM generate_series(1, 100000) i""")
            time.sleep(15)
            text = d.log()
        lines = text.split("\n")
        report("log-injection", forged_lines=sum(1 for ln in lines if "instance=attacker" in ln
                                                 and ln.startswith("2026-01-01")),
               raw_escapes=text.count("\x1b"), longest_line_bytes=max(len(ln.encode()) for ln in lines),
               lines=len(lines))


def backlog(args: argparse.Namespace) -> None:
    with server() as dsn:
        migrated(dsn, "s7")
        with daemon(dsn, "s7", "bl1") as d:
            port = d.http_port
            out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
            m = re.search(r"LISTEN\s+\d+\s+(\d+)", out)
            report("backlog", listen_backlog=m.group(1) if m else out.strip())


def metric(text: str, name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in want))


def cleaner_timeout(args: argparse.Namespace) -> None:
    """1.5 M expired rows deleted in one statement (dead index entries; autovacuum off on the
    table, as before it gets there), then 100,000 newer expired rows, and the daemon at
    ``statement_timeout = "20ms"``: cleaner passes by outcome, and the rows left, after
    ``--seconds``."""
    with server() as dsn:
        migrated(dsn, "s8")
        execute(dsn, "ALTER TABLE s8.jobs SET (autovacuum_enabled = off)")
        execute(dsn, """INSERT INTO s8.jobs (kind, queue, state, attempt, finalized_at)
                        SELECT 'k', 'q' || (i % 10), 'completed', 1,
                               now() - interval '3 days' - i * interval '10 ms'
                          FROM generate_series(1, 1500000) i""")
        execute(dsn, "ANALYZE s8.jobs")
        execute(dsn, "DELETE FROM s8.jobs")
        execute(dsn, """INSERT INTO s8.jobs (kind, queue, state, attempt, finalized_at)
                        SELECT 'k', 'q' || (i % 10), 'completed', 1,
                               now() - interval '25 hours' - i * interval '10 ms'
                          FROM generate_series(1, 100000) i""")
        with daemon(dsn, "s8", "clean1", {"statement_timeout": "20ms",
                                          "cleaner": {"interval": "1s"}}) as d:
            t0 = time.monotonic()
            time.sleep(args.seconds)
            body = get_body(d.http_port, "/metrics")
            with psycopg.connect(dsn) as conn:
                left = conn.execute("SELECT count(*) FROM s8.jobs").fetchone()[0]
            report("cleaner-timeout", seconds=round(time.monotonic() - t0),
                   passes_ok=metric(body, "maintd_service_runs_total", service="cleaner", outcome="success"),
                   passes_error=metric(body, "maintd_service_runs_total", service="cleaner", outcome="error"),
                   deleted=metric(body, "maintd_jobs_deleted_total"), rows_left=left,
                   timeout_lines=d.log().count("statement timeout"),
                   pass_seconds_mean=round(metric(body, "maintd_service_run_seconds_sum", service="cleaner")
                                           / max(1, metric(body, "maintd_service_run_seconds_count",
                                                           service="cleaner")), 3),
                   first_pass=re.findall(r"cleaner pass result=.*", d.log())[:1])


# bench/attacker.py's modes and how many connections (threads for connect-flood) each holds
RAW_ATTACKS = {"held-heads": 10_000, "pipelined": 2_000, "idle-churn": 10_000, "connect-flood": 64,
               "slowloris": 5_000}


def raw_floods(args: argparse.Namespace) -> None:
    """Each raw-socket attack of bench/attacker.py for ``--seconds`` against a leader, the attacker at
    nice 10 on the same machine: ``/healthz`` twice a second on fresh connections (p50, p90, the
    worst, how many over a second), the daemon's peak RSS, and its term before and after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65_536), hard))
    with server() as dsn:
        migrated(dsn, "s7")
        with daemon(dsn, "s7", "raw1") as d:
            for mode, n in RAW_ATTACKS.items():
                epoch, peak, samples = leader_row(dsn, "s7")[0], rss_mb(d.pid), []
                attacker = subprocess.Popen(
                    [sys.executable, str(Path(__file__).with_name("attacker.py")), mode, str(d.http_port),
                     str(args.seconds), str(n)], stdout=subprocess.PIPE, text=True, preexec_fn=lambda: os.nice(10))
                while attacker.poll() is None:
                    samples.append(get(d.http_port, "/healthz", timeout=10))
                    peak = max(peak, rss_mb(d.pid))
                    time.sleep(max(0.0, 0.5 - samples[-1][2]))
                lat = sorted(s[2] for s in samples)
                report(mode, connections=n, healthz=probe_summary(samples),
                       p90=f"{lat[int(len(lat) * 0.9)] * 1000:.0f} ms", over_1s=sum(x > 1 for x in lat),
                       rss_peak_mb=round(peak), epoch=f"{epoch} -> {leader_row(dsn, 's7')[0]}",
                       attacker=attacker.stdout.read().strip())
                time.sleep(3)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def get_body(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.read().decode()


SCENARIOS = {"status-flood": status_flood, "status-size": status_size, "idle-sockets": idle_sockets,
             "dashboard-flood": dashboard_flood, "log-injection": log_injection, "backlog": backlog,
             "cleaner-timeout": cleaner_timeout, "raw-floods": raw_floods}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenarios", nargs="*", help=f"of: {', '.join(SCENARIOS)} (default: all)")
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--seconds", type=float, default=30)
    args = p.parse_args()
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario {unknown[0]!r}")
    for name in args.scenarios or SCENARIOS:
        SCENARIOS[name](args)


if __name__ == "__main__":
    main()
