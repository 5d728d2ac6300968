#!/usr/bin/env python3
"""maintd adapter for hardbyte/postgresql-job-queue-benchmarking (the long_horizon JSONL protocol).

One process: it migrates the schema (``layout`` from ``BENCH_MAINTD_LAYOUT``: plain|partitioned),
starts ``maintd run`` daemons as subprocesses (every service on, the cleaner with a short
retention so the table churns), a producer and ``WORKER_COUNT`` workers that use only the
README's worker SQL (read from README.md at start, run verbatim), and prints the protocol's JSONL
samples on stdout (logs on stderr). It also reports when maintd named the harness's idle-in-tx
holder: by its log warning ("vacuum is held back ...", pid = the holder) and by /status, in
seconds from the holder's ``xact_start`` (the harness opens it on entering the idle-in-tx phase).

Env (the harness's): DATABASE_URL, PRODUCER_RATE, PRODUCER_PACING (harness: ``ENQUEUE n`` lines on
stdin; adapter: own wall-clock pacing), WORKER_COUNT, SAMPLE_EVERY_S, JOB_PAYLOAD_BYTES,
JOB_WORK_MS, JOB_FAIL_FIRST_MOD. Own: BENCH_MAINTD_LAYOUT, BENCH_MAINTD_DAEMONS (2),
BENCH_MAINTD_POLL_MS (20), BENCH_MAINTD_CLAIM_LIMIT (1), BENCH_MAINTD_LOG_DIR, and any MAINTD_*
setting, which overrides the defaults in ``maintd_env``.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import psycopg
from psycopg.types.json import Jsonb

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PREFIX = "maintd"
APP_NAME = "hardbyte-maintd-adapter"
PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")
STOP = threading.Event()


def env_int(key: str, default: int) -> int:
    value = os.environ.get(key)
    return int(float(value)) if value not in (None, "") else default


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def log(msg: str) -> None:
    print(f"[maintd-adapter] {msg}", file=sys.stderr, flush=True)


# ─── the README's worker SQL, verbatim ────────────────────────────────────────────────────────


def readme_statements() -> dict[str, str]:
    """enqueue, claim, complete, fail: the README's statements, ``:name`` -> ``%(name)s``."""
    text = (ROOT / "README.md").read_text()
    start = text.index("Workers in other languages run")
    block = re.compile(r"```sql\n(.*?)```", re.S).search(text, start).group(1)
    body = "\n".join(re.sub(r"--.*", "", line) for line in block.splitlines())
    found: dict[str, str] = {}
    for stmt in (s.strip() for s in body.split(";") if s.strip()):
        if stmt.startswith("INSERT INTO maintd.jobs"):
            found["enqueue"] = stmt
        elif "SET state = 'running'" in stmt:
            found["claim"] = stmt
        elif "SET state = 'completed'" in stmt:
            found["complete"] = stmt
        elif "'discarded' ELSE 'retryable'" in stmt:
            found["fail"] = stmt
    missing = {"enqueue", "claim", "complete", "fail"} - set(found)
    if missing:
        raise SystemExit(f"README worker SQL not found: {sorted(missing)}")
    return {k: PARAM.sub(r"%(\1)s", v.replace("%", "%%")) for k, v in found.items()}


SQL = readme_statements()


# ─── bounded rolling percentiles ──────────────────────────────────────────────────────────────


class Rolling:
    """(monotonic time, value) ring, capped: percentiles over the last ``window_s``."""

    def __init__(self, maxlen: int = 32768):
        self.events: collections.deque[tuple[float, float]] = collections.deque(maxlen=maxlen)
        self.lock = threading.Lock()

    def add(self, value: float) -> None:
        with self.lock:
            self.events.append((time.monotonic(), value))

    def percentiles(self, window_s: float = 30.0) -> tuple[float, float, float]:
        cutoff = time.monotonic() - window_s
        with self.lock:
            values = sorted(v for t, v in self.events if t >= cutoff)
        if not values:
            return 0.0, 0.0, 0.0
        n = len(values)
        return tuple(values[min(n - 1, int(round(p * (n - 1))))] for p in (0.50, 0.95, 0.99))


class Stats:
    def __init__(self) -> None:
        self.pickup = Rolling()       # protocol's claim_*: insert -> worker start
        self.claim_stmt = Rolling()   # the claim UPDATE's round trip (every claim, empty too)
        self.lock = threading.Lock()
        self.counts = collections.Counter()
        self.depth = 0
        self.table: dict[str, float] = {}
        self.holder: dict[str, float] = {}

    def bump(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n


STATS = Stats()


def connect(url: str, autocommit: bool = True) -> psycopg.Connection:
    return psycopg.connect(url, autocommit=autocommit, application_name=APP_NAME)


# ─── producer ─────────────────────────────────────────────────────────────────────────────────


def enqueue(conn: psycopg.Connection, n: int, payload: str) -> None:
    rows = [{"kind": "bench", "queue": "bench", "args": Jsonb({"t": time.time(), "pad": payload}),
             "priority": 0, "max_attempts": 3, "scheduled_at": None, "unique_key": None,
             "metadata": Jsonb({})} for _ in range(n)]
    with conn.transaction():
        with conn.cursor() as cur:
            cur.executemany(SQL["enqueue"], rows)
    STATS.bump("enqueued", n)


def producer_harness(url: str, payload: str) -> None:
    """``ENQUEUE n`` lines from the harness's pacer on stdin."""
    with connect(url) as conn:
        for line in sys.stdin:
            if STOP.is_set():
                return
            parts = line.split()
            if len(parts) == 2 and parts[0] == "ENQUEUE":
                try:
                    enqueue(conn, int(parts[1]), payload)
                except psycopg.Error as exc:
                    log(f"enqueue failed: {type(exc).__name__}")


def producer_local(url: str, payload: str, rate: int, batch_ms: int = 25) -> None:
    """Own pacing, credited on real elapsed time (the protocol's normative shape)."""
    credit, last = 0.0, time.monotonic()
    with connect(url) as conn:
        while not STOP.is_set():
            STOP.wait(max(0.0, batch_ms / 1000 - (time.monotonic() - last)))
            now = time.monotonic()
            credit += rate * (now - last)
            last = now
            whole = int(credit)
            if whole >= 1:
                credit -= whole
                try:
                    enqueue(conn, whole, payload)
                except psycopg.Error as exc:
                    log(f"enqueue failed: {type(exc).__name__}")


# ─── workers ──────────────────────────────────────────────────────────────────────────────────


def claim(conn: psycopg.Connection, worker: str, limit: int) -> list[tuple]:
    t0 = time.perf_counter()
    try:
        rows = conn.execute(SQL["claim"], {"queue": "bench", "worker": worker, "limit": limit}).fetchall()
    except psycopg.errors.SerializationFailure:  # README: partitioned layout, claim again
        STATS.bump("claim_40001")
        return []
    STATS.claim_stmt.add((time.perf_counter() - t0) * 1000)
    return rows


def finish(conn: psycopg.Connection, worker: str, job: tuple, fail_mod: int) -> None:
    job_id, _kind, _queue, args, attempt = job[:5]
    params = {"id": job_id, "worker": worker, "attempt": attempt}
    try:
        if fail_mod and attempt == 1 and job_id % fail_mod == 0:
            conn.execute(SQL["fail"], {**params, "discard": False, "backoff": 1.0, "error": "bench"})
            STATS.bump("failed")
        elif conn.execute(SQL["complete"], params).fetchone():
            STATS.bump("completed")
        else:
            STATS.bump("not_ours")
    except psycopg.errors.SerializationFailure:  # README: the job is no longer ours
        STATS.bump("finish_40001")


def worker_loop(url: str, index: int, work_ms: int, poll_ms: int, limit: int, fail_mod: int) -> None:
    worker = f"bench-{os.getpid()}-{index}"
    with connect(url) as conn:
        while not STOP.is_set():
            try:
                jobs = claim(conn, worker, limit)
            except psycopg.Error as exc:
                log(f"claim failed: {type(exc).__name__}: {exc}")
                STOP.wait(0.5)
                continue
            if not jobs:
                STOP.wait(poll_ms / 1000)
                continue
            for job in jobs:
                STATS.pickup.add(max(0.0, (time.time() - float(job[3]["t"])) * 1000))
                if work_ms:
                    time.sleep(work_ms / 1000)
                finish(conn, worker, job, fail_mod)


# ─── maintd daemons ───────────────────────────────────────────────────────────────────────────


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def maintd_env(url: str, layout: str) -> dict[str, str]:
    """Every service on; the cleaner keeps completed jobs 1 min (partitions of 1 min), so the
    table churns; health read every 5 s, the holder warning after 30 s (defaults: 15 s, 5 min)."""
    base = {
        "MAINTD_LAYOUT": layout,
        "MAINTD_CLEANER__INTERVAL": "5s",
        "MAINTD_CLEANER__COMPLETED_RETENTION": "1m",
        "MAINTD_CLEANER__CANCELLED_RETENTION": "1m",
        "MAINTD_CLEANER__DISCARDED_RETENTION": "1m",
        "MAINTD_PARTITIONS__INTERVAL": "1m",
        "MAINTD_HEALTH__INTERVAL": "5s",
        "MAINTD_HEALTH__XMIN_WARN_AFTER": "30s",
        "MAINTD_REINDEXER__ENABLED": "false",
        "MAINTD_LOG__FORMAT": "json",
    }
    own = {k: v for k, v in os.environ.items() if k.startswith("MAINTD_")}
    return {**os.environ, **base, **own, "MAINTD_DATABASE_URL": url}


def migrate(env: dict[str, str]) -> None:
    res = subprocess.run([sys.executable, "-m", "maintd", "migrate"], env=env, cwd=ROOT,
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"maintd migrate failed (exit {res.returncode}): {res.stderr.strip()[-2000:]}")


class Daemon:
    """One ``maintd run``; its JSON log is scanned for the holder warning and kept in a file."""

    def __init__(self, env: dict[str, str], name: str, log_dir: Path | None):
        self.port = free_port()
        env = {**env, "MAINTD_INSTANCE_ID": name, "MAINTD_HTTP__LISTEN": f"127.0.0.1:{self.port}"}
        self.proc = subprocess.Popen([sys.executable, "-m", "maintd", "run"], env=env, cwd=ROOT,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        self.log_file = open(log_dir / f"{name}.log", "a") if log_dir else None
        threading.Thread(target=self._read_log, name=f"log-{name}", daemon=True).start()

    def _read_log(self) -> None:
        for line in self.proc.stderr:
            if self.log_file:
                self.log_file.write(line)
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("level") in ("warning", "error", "critical"):
                log(f"maintd: {line.strip()[:400]}")
            if str(rec.get("msg", "")).startswith("vacuum is held back"):
                HOLDER.named_by_log(rec.get("pid"))

    def status(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/status", timeout=2) as r:
                return json.loads(r.read())
        except Exception:
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self.log_file:
            self.log_file.close()


# ─── the horizon holder: found in pg_stat_activity, named by maintd ───────────────────────────

HOLDER_SQL = """
SELECT pid, extract(epoch FROM xact_start)::float8
  FROM pg_stat_activity
 WHERE datname = current_database() AND state = 'idle in transaction' AND backend_xid IS NOT NULL
   AND pid <> pg_backend_pid() AND application_name NOT LIKE 'maintd%%'
   AND application_name <> %s AND xact_start < now() - interval '1 second'
 ORDER BY xact_start LIMIT 1
"""


class HolderWatch:
    """The idle-in-tx holder (the harness's: BEGIN; SELECT txid_current(); idle) and when maintd
    named it, in seconds from its xact_start."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid: int | None = None
        self.start = 0.0
        self.by_log: float | None = None
        self.by_status: float | None = None

    def seen(self, pid: int | None, start: float) -> None:
        with self.lock:
            if pid != self.pid:
                if pid is not None:
                    log(f"idle-in-tx holder pid {pid} since {start:.3f}")
                self.pid, self.start, self.by_log, self.by_status = pid, start, None, None

    def named_by_log(self, pid: object) -> None:
        with self.lock:
            if self.pid is not None and pid == self.pid and self.by_log is None:
                self.by_log = time.time() - self.start
                log(f"maintd's log named holder pid {pid} after {self.by_log:.1f} s")

    def named_by_status(self, pids: set[int]) -> None:
        with self.lock:
            if self.pid is not None and self.pid in pids and self.by_status is None:
                self.by_status = time.time() - self.start
                log(f"maintd's /status named holder pid {self.pid} after {self.by_status:.1f} s")

    def metrics(self) -> list[tuple[str, float]]:
        with self.lock:
            if self.pid is None:
                return []
            out = [("horizon_holder_age_s", time.time() - self.start)]
            if self.by_log is not None:
                out.append(("maintd_log_named_holder_s", self.by_log))
            if self.by_status is not None:
                out.append(("maintd_status_named_holder_s", self.by_status))
            return out


HOLDER = HolderWatch()


def holder_pids(status: dict | None) -> set[int]:
    """Every pid under a ``holders`` list anywhere in a /status document."""
    found: set[int] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "holders" and isinstance(value, list):
                    found.update(h["pid"] for h in value if isinstance(h, dict) and h.get("pid"))
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(status)
    return found


def watch_holder(url: str, daemons: list[Daemon]) -> None:
    with connect(url) as conn:
        while not STOP.wait(0.5):
            try:
                row = conn.execute(HOLDER_SQL, (APP_NAME,)).fetchone()
            except psycopg.Error:
                continue
            HOLDER.seen(*(row or (None, 0.0)))
            if HOLDER.pid is not None and HOLDER.by_status is None:
                for d in daemons:
                    HOLDER.named_by_status(holder_pids(d.status()))


# ─── observers and the sampler ────────────────────────────────────────────────────────────────

TABLE_SQL = """
WITH leaves AS (
  SELECT relid FROM pg_partition_tree('maintd.jobs') WHERE isleaf
  UNION  -- a plain table is no partition tree: itself
  SELECT oid FROM pg_class WHERE oid = 'maintd.jobs'::regclass AND relkind = 'r'
)
SELECT coalesce(sum(s.n_dead_tup), 0)::float8, coalesce(sum(s.n_live_tup), 0)::float8,
       coalesce(sum(pg_total_relation_size(l.relid)), 0)::float8 / (1024 * 1024),
       count(*)::float8
  FROM leaves l
  LEFT JOIN pg_stat_user_tables s ON s.relid = l.relid
"""
DEPTH_SQL = "SELECT count(*) FROM maintd.jobs WHERE state = 'available' AND queue = 'bench'"


def observe(url: str) -> None:
    """Queue depth every second; the jobs table (partitions summed) every 5 s."""
    tick = 0
    with connect(url) as conn:
        while not STOP.wait(1.0):
            try:
                STATS.depth = conn.execute(DEPTH_SQL).fetchone()[0]
                if tick % 5 == 0:
                    dead, live, mb, leaves = conn.execute(TABLE_SQL).fetchone()
                    STATS.table = {"jobs_dead_tuples": dead, "jobs_live_tuples": live,
                                   "jobs_total_mb": mb, "jobs_leaf_tables": leaves}
            except psycopg.Error as exc:
                log(f"observer query failed: {type(exc).__name__}")
            tick += 1


def emit(record: dict) -> None:
    record.setdefault("instance_id", env_int("BENCH_INSTANCE_ID", 0))
    print(json.dumps(record), flush=True)


def sample_records(system: str, every: int, dt: float, last: dict) -> list[tuple[str, float, float]]:
    with STATS.lock:
        counts = dict(STATS.counts)
    enq = (counts.get("enqueued", 0) - last.get("enqueued", 0)) / dt
    done = (counts.get("completed", 0) - last.get("completed", 0)) / dt
    last.update(counts)
    p50, p95, p99 = STATS.pickup.percentiles()
    s50, s95, s99 = STATS.claim_stmt.percentiles()
    out = [("claim_p50_ms", p50, 30.0), ("claim_p95_ms", p95, 30.0), ("claim_p99_ms", p99, 30.0),
           ("enqueue_rate", enq, float(every)), ("completion_rate", done, float(every)),
           ("queue_depth", float(STATS.depth), 0.0),
           ("claim_stmt_p50_ms", s50, 30.0), ("claim_stmt_p95_ms", s95, 30.0),
           ("claim_stmt_p99_ms", s99, 30.0)]
    out += [(k, v, 0.0) for k, v in STATS.table.items()]
    out += [(k, v, 0.0) for k, v in HOLDER.metrics()]
    out += [(f"count_{k}", float(v), 0.0) for k, v in counts.items() if "40001" in k or k == "not_ours"]
    return out


def sampler(system: str, every: int) -> None:
    STOP.wait(every - (time.time() % every))  # clock-aligned first tick
    with STATS.lock:
        last: dict = dict(STATS.counts)
    last_tick = time.monotonic()
    while not STOP.wait(every - (time.time() % every)):
        dt = max(0.001, time.monotonic() - last_tick)
        last_tick = time.monotonic()
        ts = now_iso()
        for metric, value, window in sample_records(system, every, dt, last):
            emit({"t": ts, "system": system, "kind": "adapter", "subject_kind": "adapter",
                  "subject": "", "metric": metric, "value": value, "window_s": window})


# ─── main ─────────────────────────────────────────────────────────────────────────────────────


def descriptor(system: str, url: str, layout: str) -> dict:
    """The harness polls these: the table itself, and on the partitioned layout the live
    partition (claims and completions happen there; the dated final partitions come and go, so
    the adapter's jobs_* metrics sum every leaf instead)."""
    with connect(url) as conn:
        server = conn.execute("SHOW server_version").fetchone()[0]
    from maintd import __version__
    tables = ["maintd.jobs"] + (["maintd.jobs_live"] if layout == "partitioned" else [])
    return {"kind": "descriptor", "system": system, "event_tables": tables,
            "extensions": [], "version": __version__, "schema_version": f"layout={layout}",
            "db_name": url.rsplit("/", 1)[-1].split("?")[0], "started_at": now_iso(),
            "postgres": server}


def start_threads(url: str, system: str, daemons: list[Daemon]) -> None:
    payload = "x" * env_int("JOB_PAYLOAD_BYTES", 256)
    if os.environ.get("PRODUCER_PACING", "adapter") == "harness":
        target, args = producer_harness, (url, payload)
    else:
        target, args = producer_local, (url, payload, env_int("PRODUCER_RATE", 200))
    jobs = [(target, args), (observe, (url,)), (watch_holder, (url, daemons)),
            (sampler, (system, env_int("SAMPLE_EVERY_S", 5)))]
    for i in range(env_int("WORKER_COUNT", 4)):
        jobs.append((worker_loop, (url, i, env_int("JOB_WORK_MS", 1), env_int("BENCH_MAINTD_POLL_MS", 20),
                                   env_int("BENCH_MAINTD_CLAIM_LIMIT", 1), env_int("JOB_FAIL_FIRST_MOD", 0))))
    for fn, fn_args in jobs:
        threading.Thread(target=fn, args=fn_args, name=fn.__name__, daemon=True).start()


def main() -> int:
    url = os.environ["DATABASE_URL"]
    layout = os.environ.get("BENCH_MAINTD_LAYOUT", "plain")
    system = os.environ.get("BENCH_MAINTD_SYSTEM", f"{SYSTEM_PREFIX}-{layout}")
    log_dir = Path(os.environ["BENCH_MAINTD_LOG_DIR"]) if os.environ.get("BENCH_MAINTD_LOG_DIR") else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    env = maintd_env(url, layout)
    migrate(env)
    daemons = [Daemon(env, f"bench-{chr(97 + i)}", log_dir) for i in range(env_int("BENCH_MAINTD_DAEMONS", 2))]
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: STOP.set())
    emit(descriptor(system, url, layout))
    start_threads(url, system, daemons)
    while not STOP.wait(1.0):
        dead = [d for d in daemons if d.proc.poll() is not None]
        if dead:
            log(f"a maintd daemon exited (rc={dead[0].proc.returncode}); stopping")
            STOP.set()
    for d in daemons:
        d.stop()
    log("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
