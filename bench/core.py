"""Benchmarks of the cleaner, rescuer and scheduler against the physical limit, measured in the same
run on the same data. Not a test: a person runs it and reads the table.

    python bench/core.py                      # full size, embedded PostgreSQL 18 (about 4 minutes)
    python bench/core.py --rows 100000        # quick (a tenth of every row count)
    python bench/core.py --only cleaner --cleaner-batch 10000 --cleaner-batch 20000
    MAINTD_BENCH_DATABASE_URL=postgresql://... python bench/core.py   # an existing server (schema "bench")

Sizes at ``--rows 1000000`` (the default); everything scales with it:

* cleaner: 1,000,000 expired final rows (completed/cancelled > 24 h, discarded > 7 d) among
  1,150,000. The limit is one unbatched DELETE of exactly those rows; "naive" is the common
  ``DELETE ... WHERE id IN (SELECT id ... LIMIT n)`` loop.
* rescuer: 100,000 stuck running jobs among 1,000,000 running/available; limit: one UPDATE.
* scheduler: 100,000 due among 1,000,000 scheduled; limit: one UPDATE. Then the idle tick (nothing
  due, 900,000 future rows) and the promotion lag seen by a claimer woken by NOTIFY, with and
  without ``precise_timing``.
* workers: 4 threads claiming and completing with the maintd.jobs SQL; claim latency while maintd
  is idle and while the cleaner deletes the 1,000,000 rows underneath, at full speed and with
  each ``--cleaner-pause`` (``cleaner.batch_pause``), e.g. ``--only workers --cleaner-pause 0.02``.

The physical limit does the same work in one statement: the fastest PostgreSQL can do it, at the
price of one huge transaction that holds its locks and bloats until it ends, which is what maintd
must never do to a live queue. The server is durable (fsync and synchronous_commit on).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg  # noqa: E402
from sqlalchemy import Engine, text  # noqa: E402

from maintd import migrate  # noqa: E402
from maintd.clock import FrozenClock, ServerClock  # noqa: E402
from maintd.config import Settings  # noqa: E402
from maintd.db import make_engine, notify_channel
from maintd.queries import sql  # noqa: E402
from maintd.jobs import JobQueue  # noqa: E402
from maintd.services.base import PassContext  # noqa: E402
from maintd.services.cleaner import Cleaner  # noqa: E402
from maintd.services.rescuer import Rescuer  # noqa: E402
from maintd.services.scheduler import Scheduler  # noqa: E402

SCHEMA = "bench"
FULL = 1_000_000


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


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Table:
    """The result table: one row per method, ratios against the limit of the same service."""

    HEADER = (f"{'service':<10} {'method':<46} {'rows':>10} {'seconds':>8} {'rows/s':>11} "
              f"{'p50 ms':>7} {'p99 ms':>7} {'vs limit':>8}")

    def __init__(self):
        self.limit: dict[str, float] = {}
        print(self.HEADER)
        print("-" * len(self.HEADER), flush=True)

    def row(self, service: str, method: str, rows: int, seconds: float, batches: list[float] | None = None,
            *, limit: bool = False) -> None:
        rate = rows / seconds if seconds else 0.0
        if limit:
            self.limit[service] = rate
        ratio = f"{rate / self.limit[service]:.2f}x" if service in self.limit and rate else "-"
        p50 = f"{pct(batches, .5) * 1000:.1f}" if batches else "-"
        p99 = f"{pct(batches, .99) * 1000:.1f}" if batches else "-"
        print(f"{service:<10} {method:<46} {rows:>10,} {seconds:>8.2f} {rate:>11,.0f} {p50:>7} {p99:>7} "
              f"{ratio:>8}", flush=True)

    def note(self, service: str, what: str, value: str) -> None:
        print(f"{service:<10} {what:<46} {value}", flush=True)


def seed(engine: Engine, statement: str, params: dict, *more: str) -> datetime:
    """Empty the table, insert the same data again, VACUUM ANALYZE; returns the database's now."""
    with engine.begin() as conn:
        conn.execute(sql("TRUNCATE {schema}.jobs", SCHEMA))
        for stmt in (statement, *more):
            conn.execute(sql(stmt, SCHEMA), params)
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.execute(sql("VACUUM ANALYZE {schema}.jobs", SCHEMA))
        # Autovacuum would wake at a random moment of a timed section (of a batched pass, which
        # commits as it goes, far more often than of one long statement): keep it out of both.
        conn.execute(sql("ALTER TABLE {schema}.jobs SET (autovacuum_enabled = false)", SCHEMA))
        conn.execute(text("CHECKPOINT"))  # every method starts from the same clean buffers
        return conn.execute(text("SELECT now()")).scalar()


def timed(engine: Engine, statement: str, params: dict) -> tuple[float, int]:
    t0 = time.perf_counter()
    with engine.begin() as conn:
        n = conn.execute(sql(statement, SCHEMA), params).rowcount
    return time.perf_counter() - t0, n


def run_pass(engine: Engine, settings: Settings, service, now: datetime, context=None):
    ctx = (context or TimedContext).for_settings(settings, engine, FrozenClock(now))
    t0 = time.perf_counter()
    with ctx.session():  # as the daemon runs a pass: one pooled connection for its transactions
        result = service.run_once(ctx)
    return result, time.perf_counter() - t0, ctx.batch_seconds


Run = tuple[int, float, list]  # rows, seconds, batch times


def median(repeat: int, measure) -> Run:
    """``measure()`` (which seeds its own data) ``repeat`` times; the run with the median time."""
    return medians(repeat, {"": measure})[""]


def medians(repeat: int, measures: dict) -> dict[str, Run]:
    """Each ``measure()`` ``repeat`` times, interleaved (a, b, a, b, ...) so that a slow spell of
    the machine or the server (a checkpoint, new WAL segments) hits every method alike; per
    method, the run with the median time."""
    runs: dict[str, list[Run]] = {name: [] for name in measures}
    for _ in range(repeat):
        for name, measure in measures.items():
            runs[name].append(measure())
    return {name: sorted(r, key=lambda run: run[1])[len(r) // 2] for name, r in runs.items()}


# --- cleaner ----------------------------------------------------------------------------------

# Oldest rows first in the heap, as in a real table: :expired final rows past their retention
# (90 % completed, 5 % cancelled older than 24 h, 5 % discarded older than 7 d), then live rows
# and recently finished ones.
SEED_CLEANER = """
INSERT INTO {schema}.jobs (kind, queue, state, attempt, attempted_at, finalized_at, scheduled_at, created_at)
SELECT 'bench', 'q' || (g % 8), s.state::{schema}.job_state, 1, t.at - interval '1 minute',
       CASE WHEN s.state IN ('completed', 'cancelled', 'discarded') THEN t.at END,
       t.at - interval '2 minutes', t.at - interval '2 minutes'
  FROM generate_series(1, :total) g,
       LATERAL (SELECT CASE WHEN g > :expired THEN (ARRAY['available', 'running', 'completed'])[g % 3 + 1]
                            WHEN g % 20 = 0 THEN 'cancelled' WHEN g % 20 = 1 THEN 'discarded'
                            ELSE 'completed' END AS state) s,
       LATERAL (SELECT CASE WHEN g > :expired THEN now() - interval '1 hour' + (g - :expired) * interval '1 ms'
                            WHEN s.state = 'discarded' THEN now() - interval '8 days' + g * interval '1 ms'
                            ELSE now() - interval '2 days' + g * interval '1 ms' END AS at) t
"""

UNBATCHED_DELETE = """
DELETE FROM {schema}.jobs
 WHERE (state IN ('completed', 'cancelled') AND finalized_at < :day_ago)
    OR (state = 'discarded' AND finalized_at < :week_ago)
"""

NAIVE_DELETE = """
DELETE FROM {schema}.jobs WHERE id IN (
  SELECT id FROM {schema}.jobs
   WHERE (state IN ('completed', 'cancelled') AND finalized_at < :day_ago)
      OR (state = 'discarded' AND finalized_at < :week_ago)
   LIMIT :n)
"""


def cleaner_sizes(rows: int) -> dict:
    return {"total": int(rows * 1.15), "expired": rows}


def bench_cleaner(engine: Engine, url: str, table: Table, rows: int, batch_sizes: list[int], repeat: int) -> None:
    sizes = cleaner_sizes(rows)

    def horizons(now: datetime) -> dict:
        return {"day_ago": now - timedelta(days=1), "week_ago": now - timedelta(days=7)}

    def unbatched() -> Run:
        now = seed(engine, SEED_CLEANER, sizes)
        t, n = timed(engine, UNBATCHED_DELETE, horizons(now))
        return n, t, []

    def maintd(size: int) -> Run:
        settings = Settings(database_url=url, schema=SCHEMA, cleaner={"batch_size": size})
        result, t, batches = run_pass(engine, settings, Cleaner(settings.cleaner), seed(engine, SEED_CLEANER, sizes))
        return result.total, t, batches

    def naive(size: int) -> Run:
        params = {**horizons(seed(engine, SEED_CLEANER, sizes)), "n": size}
        batches, deleted = [], 0
        t0 = time.perf_counter()
        while True:
            bt, n = timed(engine, NAIVE_DELETE, params)
            batches.append(bt)
            deleted += n
            if n < size:
                return deleted, time.perf_counter() - t0, batches

    limit = "one unbatched DELETE (physical limit)"
    methods = {limit: unbatched}
    for size in batch_sizes:
        methods[f"maintd, batch_size {size:,}"] = lambda size=size: maintd(size)
    results = medians(repeat, methods)
    table.row("cleaner", limit, *results.pop(limit), limit=True)
    for method, run in results.items():
        table.row("cleaner", method, *run)
    # Far slower, and only there to show the shape maintd avoids: measured once.
    size = batch_sizes[0]
    table.row("cleaner", f"naive DELETE ... IN (SELECT .. LIMIT {size:,})", *naive(size))


# --- rescuer ----------------------------------------------------------------------------------

SEED_RESCUER = """
INSERT INTO {schema}.jobs (kind, queue, state, attempt, max_attempts, attempted_at, attempted_by, scheduled_at)
SELECT 'bench', 'q' || (g % 8), CASE WHEN g % 2 = 0 THEN 'available' ELSE 'running' END::{schema}.job_state,
       1 + g % 5, CASE WHEN g % 100 = 1 THEN 1 ELSE 25 END,
       CASE WHEN g <= :stuck * 2 THEN now() - interval '3 hours' + g * interval '1 ms'
            ELSE now() - interval '5 minutes' + g * interval '1 microsecond' END,
       'worker-' || (g % 50), now()
  FROM generate_series(1, :total) g
"""

UNBATCHED_RESCUE = """
UPDATE {schema}.jobs
   SET state = CASE WHEN attempt >= max_attempts THEN 'discarded' ELSE 'retryable' END::{schema}.job_state,
       scheduled_at = CASE WHEN attempt >= max_attempts THEN scheduled_at
                           ELSE :now + make_interval(secs => exp(least(attempt, 10))) END,
       finalized_at = CASE WHEN attempt >= max_attempts THEN CAST(:now AS timestamptz) END,
       errors = errors || jsonb_build_array(jsonb_build_object('at', CAST(:now AS timestamptz),
                'attempt', attempt, 'error', 'stuck'))
 WHERE state = 'running' AND coalesce(heartbeat_at, attempted_at) < :stuck_before
"""


def bench_rescuer(engine: Engine, url: str, table: Table, rows: int, repeat: int) -> None:
    sizes = {"total": rows, "stuck": rows // 10}
    settings = Settings(database_url=url, schema=SCHEMA, rescuer={"precise_timing": False})

    def unbatched() -> Run:
        now = seed(engine, SEED_RESCUER, sizes)
        t, n = timed(engine, UNBATCHED_RESCUE, {"now": now, "stuck_before": now - timedelta(hours=1)})
        return n, t, []

    def maintd() -> Run:
        result, t, batches = run_pass(engine, settings, Rescuer(settings.rescuer), seed(engine, SEED_RESCUER, sizes))
        return result.retried + result.discarded, t, batches

    table.row("rescuer", "one unbatched UPDATE (physical limit)", *median(repeat, unbatched), limit=True)
    table.row("rescuer", f"maintd, batch_size {settings.rescuer.batch_size:,}", *median(repeat, maintd))


# --- scheduler --------------------------------------------------------------------------------

SEED_SCHEDULER = """
INSERT INTO {schema}.jobs (kind, queue, state, scheduled_at)
SELECT 'bench', 'q' || (g % 8), CASE WHEN g % 4 = 0 THEN 'retryable' ELSE 'scheduled' END::{schema}.job_state,
       CASE WHEN g <= :due THEN now() - g * interval '1 ms'
            ELSE now() + interval '1 day' + g * interval '1 ms' END
  FROM generate_series(1, :total) g
"""

UNBATCHED_PROMOTE = """
UPDATE {schema}.jobs SET state = 'available'
 WHERE state IN ('scheduled', 'retryable') AND scheduled_at <= :now
"""


def bench_scheduler(engine: Engine, url: str, table: Table, rows: int, repeat: int) -> None:
    sizes = {"total": rows, "due": rows // 10}
    settings = Settings(database_url=url, schema=SCHEMA, scheduler={"precise_timing": False})

    def unbatched() -> Run:
        now = seed(engine, SEED_SCHEDULER, sizes)
        t, n = timed(engine, UNBATCHED_PROMOTE, {"now": now})
        return n, t, []

    def maintd() -> Run:
        result, t, batches = run_pass(engine, settings, Scheduler(settings.scheduler), seed(engine, SEED_SCHEDULER, sizes))
        return result.total, t, batches

    table.row("scheduler", "one unbatched UPDATE (physical limit)", *median(repeat, unbatched), limit=True)
    table.row("scheduler", f"maintd, batch_size {settings.scheduler.batch_size:,} + NOTIFY",
              *median(repeat, maintd))
    future = rows - sizes["due"]
    # Right after the promotion, the partial index still holds the promoted jobs' entries (dead
    # until a vacuum) just where the probe looks; then as autovacuum leaves it.
    idle_tick(engine, url, table, f"idle tick ({future:,} future rows, {sizes['due']:,} just promoted)")
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(text(f"VACUUM {SCHEMA}.jobs"))
    idle_tick(engine, url, table, f"idle tick ({future:,} future rows, after VACUUM)")


def idle_tick(engine: Engine, url: str, table: Table, label: str, n: int = 400) -> None:
    """Idle scheduler ticks as the daemon runs them (one pass: pooled connection, the leader's
    fence, the server clock, precise_timing on), interleaved with the physical floor: one
    ``SELECT 1`` round trip on an open connection. An idle tick is one read-only statement."""
    from maintd.leader import acquire_once
    from maintd.passes import execute_pass, maintenance_engine

    settings = Settings(database_url=url, schema=SCHEMA, instance_id="bench-idle")
    work, clock, service = maintenance_engine(settings), ServerClock(), Scheduler(settings.scheduler)
    held = acquire_once(settings, wait=10)
    assert held is not None, "another instance leads the bench schema"
    elector, fence = held
    ticks, floor = [], []
    try:
        with psycopg.connect(url, autocommit=True) as raw:
            for i in range(n + 50):
                t0 = time.perf_counter()
                record = execute_pass("scheduler", service, PassContext.for_settings(settings, work, clock, fence=fence))
                t1 = time.perf_counter()
                raw.execute("SELECT 1")
                t2 = time.perf_counter()
                assert record.outcome == "success" and not record.result.did_something()
                if i >= 50:  # warm-up: connections, prepared plans, the clock
                    ticks.append(t1 - t0)
                    floor.append(t2 - t1)
    finally:
        elector.stop()
        work.dispose()
    p50, base = pct(ticks, .5), pct(floor, .5)
    table.note("scheduler", label,
               f"p50 {p50 * 1000:.3f} ms  p99 {pct(ticks, .99) * 1000:.2f} ms  ({n} ticks); SELECT 1 round "
               f"trip p50 {base * 1000:.3f} ms: {p50 / base:.1f}x the floor")


def bench_lag(engine: Engine, url: str, table: Table, rows: int) -> None:
    """Jobs due at random moments over a window; the scheduler ticks every 5 s as the daemon runs
    it; a claimer LISTENs and claims as soon as it is woken. Lag = attempted_at - scheduled_at."""
    window = 20.0 if rows >= FULL else 6.0
    n_jobs = 1000
    queue = JobQueue(SCHEMA)
    for precise in (True, False):
        with engine.begin() as conn:
            conn.execute(sql("DELETE FROM {schema}.jobs WHERE queue = 'lag'", SCHEMA))
            start = conn.execute(text("SELECT now()")).scalar() + timedelta(seconds=0.5)
            conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state, scheduled_at) "
                             "SELECT 'lag', 'lag', 'scheduled', CAST(:start AS timestamptz) "
                             "+ random() * CAST(:window AS float8) * interval '1 second' "
                             "FROM generate_series(1, :n)", SCHEMA),
                         {"start": start, "window": window, "n": n_jobs})
        settings = Settings(database_url=url, schema=SCHEMA, scheduler={"precise_timing": precise})
        stop = threading.Event()
        listener = psycopg.connect(url, autocommit=True)
        listener.execute(f'LISTEN "{notify_channel(SCHEMA)}"')

        def claimer():
            while not stop.is_set():
                woken = any(n.payload == "lag" for n in listener.notifies(timeout=0.5))
                while woken:
                    with engine.begin() as conn:
                        woken = len(queue.claim(conn, "lag", "bench-claimer", 100)) == 100

        def ticker():  # what the runner does: one pass every interval
            scheduler = Scheduler(settings.scheduler)
            interval = settings.scheduler.interval.total_seconds()
            next_tick = time.monotonic()
            while not stop.is_set():
                scheduler.run_once(PassContext.for_settings(settings, engine, ServerClock(),
                                               stop_event=stop))
                next_tick += interval
                stop.wait(max(0.0, next_tick - time.monotonic()))

        threads = [threading.Thread(target=claimer), threading.Thread(target=ticker)]
        for t in threads:
            t.start()
        time.sleep(window + 0.5 + settings.scheduler.interval.total_seconds() + 0.5)
        stop.set()
        for t in threads:
            t.join()
        listener.close()
        with engine.connect() as conn:
            r = conn.execute(sql("""
                SELECT count(*) FILTER (WHERE attempted_at IS NOT NULL) AS claimed,
                       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM attempted_at - scheduled_at)) AS p50,
                       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM attempted_at - scheduled_at)) AS p99,
                       max(extract(epoch FROM attempted_at - scheduled_at)) AS worst
                  FROM {schema}.jobs WHERE queue = 'lag'""", SCHEMA)).one()
        label = "precise_timing on (default)" if precise else "precise_timing off"
        table.note("scheduler", f"promotion lag, {label}",
                   f"p50 {r.p50 * 1000:.0f} ms  p99 {r.p99 * 1000:.0f} ms  max {r.worst * 1000:.0f} ms  "
                   f"({r.claimed}/{n_jobs} claimed, interval 5s)")


# --- worker load ------------------------------------------------------------------------------

def bench_workers(engine: Engine, url: str, table: Table, rows: int, pauses: list[float]) -> None:
    """Claim latency of 4 workers before, during and after a cleaner pass deleting ``rows`` rows,
    once per ``cleaner.batch_pause`` in ``pauses`` (the same data seeded again each time)."""
    for pause in pauses:
        settings = Settings(database_url=url, schema=SCHEMA, cleaner={"batch_pause": pause})
        mode = f"batch_pause {pause * 1000:g} ms" if pause else "full speed"
        workers_under_cleaner(engine, settings, table, rows, mode)


def workers_under_cleaner(engine: Engine, settings: Settings, table: Table, rows: int, mode: str,
                          idle_seconds: float = 5.0) -> None:
    queue = JobQueue(SCHEMA)
    now = seed(engine, SEED_CLEANER, cleaner_sizes(rows),
               "INSERT INTO {schema}.jobs (kind, queue) SELECT 'work', 'work' FROM generate_series(1, 300000)")
    stop = threading.Event()
    phase = ["before"]
    latencies: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    lock = threading.Lock()

    def worker(i: int) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            with engine.begin() as conn:
                jobs = queue.claim(conn, "work", f"w{i}", 1)
            dt = time.perf_counter() - t0
            with lock:
                latencies[phase[0]].append(dt)
            if jobs:
                with engine.begin() as conn:
                    queue.complete(conn, jobs[0])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(idle_seconds)
    phase[0] = "during"
    result, during, batches = run_pass(engine, settings, Cleaner(settings.cleaner), now)
    phase[0] = "after"
    time.sleep(idle_seconds)
    stop.set()
    for t in threads:
        t.join()
    spans = {"before": idle_seconds, "during": during, "after": idle_seconds}
    for name, label in (("before", "maintd idle (before)"), ("during", f"cleaner deleting, {mode}"),
                        ("after", "maintd idle (after)")):
        lat = latencies[name]
        table.note("workers", f"claims, {label}",
                   f"{len(lat) / spans[name]:7,.0f} claims/s  p50 {pct(lat, .5) * 1000:5.2f} ms  "
                   f"p99 {pct(lat, .99) * 1000:6.2f} ms  max {max(lat, default=0) * 1000:6.1f} ms")
    table.row("workers", f"cleaner under that load, {mode}", result.total, during, batches)


# --- main -------------------------------------------------------------------------------------

BENCHES = ["cleaner", "rescuer", "scheduler", "lag", "workers"]


@contextmanager
def bench_database(pool_size: int) -> Iterator[tuple[str, Engine]]:
    """(URL, engine) of the benches' server with the schema migrated: MAINTD_BENCH_DATABASE_URL,
    else an embedded PostgreSQL with durable settings, as in production (the limit and maintd both
    pay for WAL and fsync), removed afterwards."""
    url = os.environ.get("MAINTD_BENCH_DATABASE_URL")
    pg = None
    if not url:
        from maintd.embedded import EmbeddedPostgres

        pg = EmbeddedPostgres(settings={"shared_buffers": "512MB", "max_wal_size": "4GB", "fsync": "on",
                                        "synchronous_commit": "on", "full_page_writes": "on"}).start()
        url = pg.dsn
    try:
        engine = make_engine(url, application_name="maintd-bench", pool_size=pool_size)
        with engine.connect() as conn:
            migrate.upgrade(conn, SCHEMA)
            conn.commit()
        yield url, engine
        engine.dispose()
    finally:
        if pg is not None:
            pg.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=FULL,
                    help="expired rows for the cleaner; every other size scales with it (default 1000000)")
    ap.add_argument("--only", choices=BENCHES, action="append", help="run only these (repeatable)")
    ap.add_argument("--cleaner-batch", type=int, action="append",
                    help="cleaner batch sizes to measure (repeatable; default: the configured default)")
    ap.add_argument("--cleaner-pause", type=float, action="append", metavar="SECONDS",
                    help="with the workers bench: also run the cleaner with this batch_pause (repeatable)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure each method this many times on fresh data and report the median run")
    args = ap.parse_args()
    with bench_database(pool_size=8) as (url, engine):
        with engine.connect() as conn:
            version = conn.execute(text("SHOW server_version")).scalar()
            durable = {k: conn.execute(text(f"SHOW {k}")).scalar()
                       for k in ("fsync", "synchronous_commit", "shared_buffers")}
        defaults = Settings(database_url=url, schema=SCHEMA)
        batch_sizes = args.cleaner_batch or [defaults.cleaner.batch_size]
        print(f"PostgreSQL {version} ({', '.join(f'{k}={v}' for k, v in durable.items())}), "
              f"--rows {args.rows:,}, --repeat {args.repeat}, {os.cpu_count()} CPUs\n")
        table = Table()
        only = args.only or BENCHES
        if "cleaner" in only:
            bench_cleaner(engine, url, table, args.rows, batch_sizes, args.repeat)
        if "rescuer" in only:
            bench_rescuer(engine, url, table, args.rows, args.repeat)
        if "scheduler" in only:
            bench_scheduler(engine, url, table, args.rows, args.repeat)
        if "lag" in only:
            if "scheduler" not in only:
                seed(engine, SEED_SCHEDULER, {"total": args.rows, "due": 0})
            bench_lag(engine, url, table, args.rows)
        if "workers" in only:
            bench_workers(engine, url, table, args.rows, [0.0, *(args.cleaner_pause or [])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
