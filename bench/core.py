"""Benchmarks of the cleaner, rescuer and scheduler against the physical limit, on the same data in
the same run. Not a test: a person runs it and reads the table.

    python bench/core.py                 # full size (1.15 M rows), embedded PostgreSQL 18
    python bench/core.py --scale 0.1     # quick
    MAINTD_BENCH_DATABASE_URL=postgresql://... python bench/core.py   # an existing server

The "physical limit" is one unbatched statement doing the same work (one DELETE / UPDATE of all the
rows): the fastest PostgreSQL can do it, at the price of one huge transaction that holds its locks
and bloats until it ends, which is what maintd must never do to a live queue.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import text  # noqa: E402

from maintd import migrate  # noqa: E402
from maintd.clock import FrozenClock  # noqa: E402
from maintd.config import Settings  # noqa: E402
from maintd.db import make_engine, sql  # noqa: E402
from maintd.jobs import JobQueue  # noqa: E402
from maintd.services.base import PassContext  # noqa: E402
from maintd.services.cleaner import Cleaner  # noqa: E402
from maintd.services.rescuer import Rescuer  # noqa: E402
from maintd.services.scheduler import Scheduler  # noqa: E402

SCHEMA = "bench"
NOW = datetime.now(timezone.utc)


class TimedContext(PassContext):
    """Records the wall time of every transaction of a pass (one per batch)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.batch_seconds: list[float] = []

    @contextmanager
    def transaction(self, **kw):
        t0 = time.perf_counter()
        with super().transaction(**kw) as conn:
            yield conn
        self.batch_seconds.append(time.perf_counter() - t0)


def pct(values, q):
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def reset(engine, seed_sql: str, params: dict) -> datetime:
    """Reseed the same data; returns the database's "now" right after (the passes' clock)."""
    with engine.begin() as conn:
        conn.execute(sql("TRUNCATE {schema}.jobs", SCHEMA))
        conn.execute(sql(seed_sql, SCHEMA), params)
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.execute(sql("VACUUM ANALYZE {schema}.jobs", SCHEMA))
        return conn.execute(text("SELECT now()")).scalar()


def timed(engine, statement: str, params: dict) -> tuple[float, int]:
    t0 = time.perf_counter()
    with engine.begin() as conn:
        n = conn.execute(sql(statement, SCHEMA), params).rowcount
    return time.perf_counter() - t0, n


SEED_CLEANER = """
INSERT INTO {schema}.jobs (kind, queue, state, attempt, attempted_at, finalized_at, scheduled_at)
SELECT 'bench', 'q' || (g % 8),
       CASE WHEN g <= :expired THEN 'completed'
            WHEN g % 3 = 0 THEN 'available' WHEN g % 3 = 1 THEN 'running' ELSE 'completed' END::{schema}.job_state,
       1, now() - interval '3 days',
       CASE WHEN g <= :expired THEN now() - interval '2 days' - (g || ' ms')::interval
            WHEN g % 3 = 2 THEN now() - interval '1 hour' END,
       now() - interval '3 days'
  FROM generate_series(1, :total) g
"""


def bench_cleaner(engine, settings, scale) -> list[tuple]:
    total, expired = int(1_150_000 * scale), int(1_000_000 * scale)
    params = {"total": total, "expired": expired}
    rows = []
    reset(engine, SEED_CLEANER, params)
    t, n = timed(engine, "DELETE FROM {schema}.jobs WHERE state = 'completed' AND finalized_at < :h",
                 {"h": NOW - timedelta(hours=24)})
    rows.append(("cleaner", "one unbatched DELETE (limit)", n, t, n / t, "-", "-", t))
    limit_rate = n / t

    reset(engine, SEED_CLEANER, params)
    ctx = TimedContext(engine=engine, settings=settings, clock=FrozenClock(NOW))
    t0 = time.perf_counter()
    res = Cleaner(settings).run_once(ctx)
    t = time.perf_counter() - t0
    b = [x for x in ctx.batch_seconds]
    rows.append(("cleaner", f"maintd batches of {settings.cleaner.batch_size}", res.total, t, res.total / t,
                 f"{pct(b, .5) * 1000:.0f}", f"{pct(b, .99) * 1000:.0f}", t))

    reset(engine, SEED_CLEANER, params)
    naive = """
    DELETE FROM {schema}.jobs WHERE id IN (
      SELECT id FROM {schema}.jobs WHERE state = 'completed' AND finalized_at < :h LIMIT :n)"""
    batch_times, deleted = [], 0
    t0 = time.perf_counter()
    while True:
        bt, n = timed(engine, naive, {"h": NOW - timedelta(hours=24), "n": settings.cleaner.batch_size})
        batch_times.append(bt)
        deleted += n
        if n < settings.cleaner.batch_size:
            break
    t = time.perf_counter() - t0
    rows.append(("cleaner", "naive DELETE ... IN (SELECT ... LIMIT n)", deleted, t, deleted / t,
                 f"{pct(batch_times, .5) * 1000:.0f}", f"{pct(batch_times, .99) * 1000:.0f}", t))
    return rows, limit_rate


SEED_RESCUER = """
INSERT INTO {schema}.jobs (kind, queue, state, attempt, attempted_at, attempted_by, scheduled_at)
SELECT 'bench', 'q' || (g % 8),
       CASE WHEN g % 2 = 0 THEN 'available' ELSE 'running' END::{schema}.job_state, 1,
       CASE WHEN g <= :stuck * 2 THEN now() - interval '2 hours' ELSE now() - interval '5 minutes' END,
       'w', now()
  FROM generate_series(1, :total) g
"""


def bench_rescuer(engine, settings, scale):
    params = {"total": int(1_000_000 * scale), "stuck": int(100_000 * scale)}
    rows = []
    reset(engine, SEED_RESCUER, params)
    t, n = timed(engine, """
      UPDATE {schema}.jobs SET state = 'retryable', scheduled_at = now() + interval '3 seconds',
             errors = errors || '[{"error": "stuck"}]'::jsonb
       WHERE state = 'running' AND coalesce(heartbeat_at, attempted_at) < :h""", {"h": NOW - timedelta(hours=1)})
    rows.append(("rescuer", "one unbatched UPDATE (limit)", n, t, n / t, "-", "-", t))
    reset(engine, SEED_RESCUER, params)
    ctx = TimedContext(engine=engine, settings=settings, clock=FrozenClock(NOW))
    t0 = time.perf_counter()
    res = Rescuer(settings).run_once(ctx)
    t = time.perf_counter() - t0
    b = ctx.batch_seconds
    rows.append(("rescuer", f"maintd batches of {settings.rescuer.batch_size}", res.retried + res.discarded, t,
                 (res.retried + res.discarded) / t, f"{pct(b, .5) * 1000:.0f}", f"{pct(b, .99) * 1000:.0f}", t))
    return rows, n / rows[0][3]


SEED_SCHEDULER = """
INSERT INTO {schema}.jobs (kind, queue, state, scheduled_at)
SELECT 'bench', 'q' || (g % 8), 'scheduled',
       CASE WHEN g <= :due THEN now() - (g || ' ms')::interval ELSE now() + interval '1 day' + (g || ' ms')::interval END
  FROM generate_series(1, :total) g
"""


def bench_scheduler(engine, settings, scale):
    params = {"total": int(1_000_000 * scale), "due": int(100_000 * scale)}
    rows = []
    now = reset(engine, SEED_SCHEDULER, params)
    t, n = timed(engine, "UPDATE {schema}.jobs SET state = 'available' "
                 "WHERE state IN ('scheduled', 'retryable') AND scheduled_at <= :now", {"now": now})
    rows.append(("scheduler", "one unbatched UPDATE (limit)", n, t, n / t, "-", "-", t))
    now = reset(engine, SEED_SCHEDULER, params)
    settings.scheduler.precise_timing = False
    ctx = TimedContext(engine=engine, settings=settings, clock=FrozenClock(now))
    t0 = time.perf_counter()
    res = Scheduler(settings).run_once(ctx)
    t = time.perf_counter() - t0
    b = ctx.batch_seconds
    rows.append(("scheduler", f"maintd batches of {settings.scheduler.batch_size} + NOTIFY", res.total, t,
                 res.total / t, f"{pct(b, .5) * 1000:.0f}", f"{pct(b, .99) * 1000:.0f}", t))
    idle = []
    for _ in range(50):
        t0 = time.perf_counter()
        Scheduler(settings).run_once(PassContext(engine=engine, settings=settings, clock=FrozenClock(now)))
        idle.append(time.perf_counter() - t0)
    rows.append(("scheduler", f"idle tick ({params['total'] - params['due']:,} future rows)", 0, pct(idle, .5),
                 0, f"{pct(idle, .5) * 1000:.1f}", f"{pct(idle, .99) * 1000:.1f}", pct(idle, .5)))
    return rows, n / rows[0][3]


def bench_worker_load(engine, settings, scale, seconds=8.0):
    """Claim latency of 4 workers with and without the cleaner deleting underneath."""
    q = JobQueue(SCHEMA)
    out = []
    for with_cleaner in (False, True):
        reset(engine, SEED_CLEANER, {"total": int(1_150_000 * scale), "expired": int(1_000_000 * scale)})
        with engine.begin() as conn:
            conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue) SELECT 'w', 'work' "
                             "FROM generate_series(1, 200000)", SCHEMA))
        stop = threading.Event()
        lat: list[float] = []
        lock = threading.Lock()

        def worker(i):
            while not stop.is_set():
                t0 = time.perf_counter()
                with engine.begin() as conn:
                    jobs = q.claim(conn, "work", f"w{i}", 1)
                dt = time.perf_counter() - t0
                with lock:
                    lat.append(dt)
                if jobs:
                    with engine.begin() as conn:
                        q.complete(conn, jobs[0])

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        if with_cleaner:
            ctx = PassContext(engine=engine, settings=settings, clock=FrozenClock(NOW))
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                Cleaner(settings).run_once(ctx)
                time.sleep(0.05)
        else:
            time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        out.append((with_cleaner, len(lat) / seconds, pct(lat, .5) * 1000, pct(lat, .99) * 1000))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the full row counts (default 1.0)")
    ap.add_argument("--only", choices=["cleaner", "rescuer", "scheduler", "workers"], action="append")
    args = ap.parse_args()
    url = os.environ.get("MAINTD_BENCH_DATABASE_URL")
    pg = None
    if not url:
        from maintd.embedded import EmbeddedPostgres

        # Durable settings, as in production: the limit and maintd both pay for WAL and fsync.
        pg = EmbeddedPostgres(settings={"shared_buffers": "512MB", "max_wal_size": "4GB", "fsync": "on",
                                        "synchronous_commit": "on", "full_page_writes": "on"}).start()
        url = pg.dsn
    try:
        engine = make_engine(url, application_name="maintd-bench", pool_size=8)
        with engine.connect() as conn:
            migrate.upgrade(conn, SCHEMA)
            version = conn.execute(text("SHOW server_version")).scalar()
        settings = Settings(database_url=url, schema=SCHEMA)
        print(f"PostgreSQL {version}, scale {args.scale}, cleaner batch_size {settings.cleaner.batch_size}\n")
        header = f"{'service':<10} {'method':<44} {'rows':>10} {'seconds':>8} {'rows/s':>10} {'p50 ms':>7} {'p99 ms':>7} {'vs limit':>8}"
        print(header)
        print("-" * len(header))
        only = set(args.only or ["cleaner", "rescuer", "scheduler", "workers"])
        for name, fn in (("cleaner", bench_cleaner), ("rescuer", bench_rescuer), ("scheduler", bench_scheduler)):
            if name not in only:
                continue
            rows, limit = fn(engine, settings, args.scale)
            for svc, method, n, t, rate, p50, p99, _ in rows:
                ratio = f"{rate / limit:.2f}x" if rate else "-"
                print(f"{svc:<10} {method:<44} {n:>10,} {t:>8.2f} {rate:>10,.0f} {p50:>7} {p99:>7} {ratio:>8}",
                      flush=True)
        if "workers" in only:
            print("\nworker claims (4 threads) on the same table")
            for with_cleaner, rate, p50, p99 in bench_worker_load(engine, settings, args.scale):
                label = "with the cleaner deleting" if with_cleaner else "maintd idle"
                print(f"  {label:<28} claims/s {rate:>8,.0f}   p50 {p50:6.2f} ms   p99 {p99:6.2f} ms", flush=True)
        engine.dispose()
    finally:
        if pg is not None:
            pg.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
