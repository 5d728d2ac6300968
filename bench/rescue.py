"""The rescuer (issue 17): batch throughput before and after, and what precise timing costs.

    python bench/rescue.py                   # both parts, embedded PostgreSQL 18 (a few minutes)
    python bench/rescue.py --only batch --rows 300000 --repeat 3
    python bench/rescue.py --only load --running 10000 --seconds 60
    python bench/rescue.py --only odd --rows 200000 --exhausted 50000
    MAINTD_BENCH_DATABASE_URL=postgresql://... python bench/rescue.py

* batch: the data of ``bench/core.py`` (``--rows`` running/available jobs, a tenth of them stuck).
  The physical limit is one unbatched UPDATE of exactly the stuck rows; "before" is the batch
  statement of maintd before issue 17 (commit 727ec83, reproduced below) in the same keyset loop,
  at its default batch size (1,000) and at today's (5,000); "after" is a pass of today's Rescuer. Each is measured ``--repeat`` times on fresh data,
  interleaved, and the median run is reported.
* odd: ``--exhausted`` waiting jobs with no attempt left among ``--rows`` others, discarded by a
  pass, with and without a REPEATABLE READ snapshot held open by another session meanwhile (a
  report, a pg_dump: the discarded rows' index entries cannot be marked dead). The physical limit
  is one unbatched UPDATE of exactly those rows; "before" is the batch statement before 83a4ceb
  (no keyset, its UPDATE joined on id) in the same loop; "after" is a pass of today's Rescuer.
* load: what ``precise_timing`` adds to the database. The rescuer runs with ServerClock for
  ``--seconds`` with and without it, first with no running job (idle), then with ``--running``
  running jobs heartbeating every 10 s (``heartbeat_timeout = 30s``, a tenth of them beating each
  second from another connection). Reported: the rescuer's statements per second and the server
  time they took (the sum of ``EXPLAIN ANALYZE``-free client round trips over a local socket, an
  upper bound of server time), and the probe's own execution time from EXPLAIN ANALYZE.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import Engine, event, text  # noqa: E402

from bench.core import (SCHEMA, SEED_RESCUER, UNBATCHED_RESCUE, Run, Table, TimedContext,  # noqa: E402
                        bench_database, run_pass, seed, timed)
from maintd.clock import ServerClock  # noqa: E402
from maintd.config import Settings  # noqa: E402
from maintd.db import make_engine  # noqa: E402
from maintd.jobs import BACKOFF_CAP  # noqa: E402
from maintd.queries import jobs, sql  # noqa: E402
from maintd.services.rescuer import DELAYS, FAR_PAST, Rescuer  # noqa: E402

BEFORE_DEFAULT = 1_000  # rescuer.batch_size before issue 17
# RESCUER_BATCH of maintd before issue 17 (727ec83), fragments filled in.
BEFORE_BATCH = """
WITH candidates AS MATERIALIZED (
  SELECT id, attempt, coalesce(heartbeat_at, attempted_at) AS seen
    FROM {schema}.jobs
   WHERE state = 'running'
     AND coalesce(heartbeat_at, attempted_at) < :scan_until
     AND (coalesce(heartbeat_at, attempted_at), id) > (:after_seen, :after_id)
     AND (coalesce(heartbeat_at, attempted_at) < :stuck_before
          OR (heartbeat_at IS NOT NULL AND heartbeat_at < CAST(:hb_before AS timestamptz)))
   ORDER BY coalesce(heartbeat_at, attempted_at), id
   LIMIT :limit
     FOR NO KEY UPDATE SKIP LOCKED
), rescued AS (
  UPDATE {schema}.jobs AS j
     SET state = CASE WHEN j.attempt >= j.max_attempts
                      THEN 'discarded' ELSE 'retryable' END::{schema}.job_state,
         scheduled_at = CASE WHEN j.attempt >= j.max_attempts THEN j.scheduled_at
                             ELSE CAST(:now AS timestamptz) + make_interval(
                                    secs => (CAST(:delays AS float8[]))[least(greatest(j.attempt, 0), :cap) + 1])
                        END,
         finalized_at = CASE WHEN j.attempt >= j.max_attempts THEN CAST(:now AS timestamptz) END,
         errors = j.errors || jsonb_build_array(jsonb_build_object(
                    'at', CAST(:now AS timestamptz),
                    'attempt', j.attempt,
                    'error', 'stuck: no sign of life since '
                             || coalesce(to_jsonb(c.seen) #>> '{}', 'ever (attempted_at and heartbeat_at are NULL)')
                             || ' (rescued by maintd ' || CAST(:instance AS text) || ')'))
    FROM candidates AS c
   WHERE j.id = ANY(ARRAY(SELECT id FROM candidates))
     AND j.id = c.id
     AND j.state = 'running'
     AND j.attempt = c.attempt
     AND ((coalesce(heartbeat_at, attempted_at) < :stuck_before
          OR (heartbeat_at IS NOT NULL AND heartbeat_at < CAST(:hb_before AS timestamptz))) OR coalesce(heartbeat_at, attempted_at) IS NULL
          OR coalesce(heartbeat_at, attempted_at) < '0001-01-02 00:00:00+00')
  RETURNING j.id, j.state = 'discarded' AS discarded
)
SELECT (SELECT count(*) FROM candidates) AS candidates,
       last.seen AS last_seen, last.id AS last_id,
       (SELECT count(*) FROM rescued WHERE discarded) AS discarded,
       (SELECT count(*) FROM rescued WHERE NOT discarded) AS retried,
       ARRAY(SELECT id FROM rescued) AS ids
  FROM (SELECT 1) AS one
  LEFT JOIN LATERAL (SELECT seen, id FROM candidates ORDER BY seen DESC, id DESC LIMIT 1) AS last ON true
"""


def server_cpu(engine: Engine) -> float | None:
    """CPU seconds of the whole local server so far: the postmaster, its live children (backends,
    WAL writer, checkpointer...) and the children it has reaped. None when the server is remote."""
    try:
        with engine.connect() as conn:
            datadir = conn.execute(text("SHOW data_directory")).scalar()
        postmaster = int(Path(datadir, "postmaster.pid").read_text().split()[0])
        total = 0.0
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            pid, ppid = int(proc.name), int(fields[1])
            if pid == postmaster:
                total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
            elif ppid == postmaster:
                total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


def wal_lsn(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_current_wal_lsn() - '0/0'")).scalar())


def bench_batch(engine: Engine, url: str, table: Table, rows: int, repeat: int, more_sizes: list[int]) -> None:
    sizes = {"total": rows, "stuck": rows // 10}
    settings = Settings(database_url=url, schema=SCHEMA, rescuer={"precise_timing": False})
    limit = settings.rescuer.batch_size

    def unbatched(now) -> Run:
        t, n = timed(engine, UNBATCHED_RESCUE, {"now": now, "stuck_before": now - timedelta(hours=1)})
        return n, t, []

    def before(now, limit: int = BEFORE_DEFAULT) -> Run:
        stuck_before = now - settings.rescuer.rescue_stuck_jobs_after
        params = {"now": now, "stuck_before": stuck_before, "hb_before": None, "scan_until": stuck_before,
                  "instance": "bench", "delays": DELAYS, "cap": BACKOFF_CAP, "limit": limit}
        after_seen, after_id, done, batches = FAR_PAST, 0, 0, []
        t0 = time.perf_counter()
        with engine.connect() as conn:
            while True:
                b0 = time.perf_counter()
                batch = conn.execute(sql(BEFORE_BATCH, SCHEMA),
                                     {**params, "after_seen": after_seen, "after_id": after_id}).one()
                conn.commit()
                batches.append(time.perf_counter() - b0)
                done += batch.retried + batch.discarded
                if batch.candidates < limit:
                    break
                after_seen, after_id = batch.last_seen, batch.last_id
        return done, time.perf_counter() - t0, batches

    def after(now, sync: bool = False, size: int | None = None, events: bool = True) -> Run:
        config = settings.rescuer.model_copy(update={"batch_size": size or limit, "events": events})
        result, t, batches = run_pass(engine, settings, Rescuer(config), now,
                                      context=SyncContext if sync else None)
        return result.retried + result.discarded, t, batches

    methods = {"one unbatched UPDATE (physical limit)": unbatched,
               f"before (727ec83), batch_size {BEFORE_DEFAULT:,} (its default)": before,
               f"before's statement, batch_size {limit:,}": lambda now: before(now, limit),
               f"after, batch_size {limit:,}": after,
               "after, but synchronous_commit on": lambda now: after(now, sync=True),
               "after, rescuer.events = false": lambda now: after(now, events=False),
               **{f"after, batch_size {size:,}": (lambda now, size=size: after(now, size=size))
                  for size in more_sizes}}
    runs: dict[str, list[tuple[Run, float | None, int]]] = {name: [] for name in methods}
    for _ in range(repeat):  # interleaved, so that a slow spell of the machine hits every method
        for name, measure in methods.items():
            now = seed(engine, SEED_RESCUER, sizes)
            cpu0, wal0 = server_cpu(engine), wal_lsn(engine)
            run = measure(now)
            cpu1, wal1 = server_cpu(engine), wal_lsn(engine)
            runs[name].append((run, None if cpu0 is None else cpu1 - cpu0, wal1 - wal0))
    cpu_limit = None
    for i, (name, rs) in enumerate(runs.items()):
        rs_by_time = sorted(rs, key=lambda r: r[0][1])
        table.row("rescuer", name, *rs_by_time[len(rs) // 2][0], limit=i == 0)
        cpus = sorted(c for _, c, _ in rs if c is not None)
        wal = sorted(w for _, _, w in rs)[len(rs) // 2]
        if cpus:
            cpu = cpus[len(cpus) // 2]
            cpu_limit = cpu_limit or cpu
            table.note("", "  server CPU s (median) | vs limit | WAL MB",
                       f"{cpu:6.2f} | {cpu_limit / cpu:4.2f}x | {wal / 1e6:7.1f}")


# RESCUER_EXHAUSTED_BATCH before 83a4ceb: every batch from the index's start, the UPDATE joined on id.
BEFORE_EXHAUSTED = """
WITH candidates AS MATERIALIZED (
  SELECT id FROM {schema}.jobs
   WHERE state IN ('available', 'scheduled', 'retryable') AND attempt >= max_attempts
   ORDER BY id LIMIT :limit FOR NO KEY UPDATE SKIP LOCKED
), discarded AS (
  UPDATE {schema}.jobs AS j
     SET state = 'discarded', finalized_at = CAST(:now AS timestamptz),
         errors = j.errors || jsonb_build_array(jsonb_build_object(
                    'at', CAST(:now AS timestamptz), 'attempt', j.attempt,
                    'error', format('discarded by maintd (%s): no attempt left to claim, attempt %s >= max_attempts %s',
                                    CAST(:instance AS text), j.attempt, j.max_attempts)))
    FROM candidates AS c
   WHERE j.id = c.id AND j.state IN ('available', 'scheduled', 'retryable') AND j.attempt >= j.max_attempts
  RETURNING j.id
)
SELECT (SELECT count(*) FROM candidates) AS candidates, ARRAY(SELECT id FROM discarded) AS ids
"""
SEED_EXHAUSTED = """
INSERT INTO {schema}.jobs (kind, queue, state, attempt, max_attempts, scheduled_at)
SELECT 'bench', 'q' || (g % 8), 'available',
       CASE WHEN CAST(g AS bigint) * :exhausted / :total > (g - 1) * CAST(:exhausted AS bigint) / :total
            THEN 3 ELSE 0 END, 3, now()
  FROM generate_series(1, :total) g
"""
UNBATCHED_EXHAUSTED = """
UPDATE {schema}.jobs AS j
   SET state = 'discarded', finalized_at = CAST(:now AS timestamptz),
       errors = j.errors || jsonb_build_array(jsonb_build_object('at', CAST(:now AS timestamptz),
                'attempt', j.attempt, 'error', 'discarded'))
 WHERE state IN ('available', 'scheduled', 'retryable') AND attempt >= max_attempts
"""


@contextmanager
def snapshot_held(url: str, held: bool):
    """A REPEATABLE READ snapshot open in another session meanwhile (``held``), as a report's."""
    if not held:
        yield
        return
    other = make_engine(url, application_name="maintd-bench-report", pool_size=1)
    try:
        with other.connect() as conn:
            conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
            conn.execute(text("SELECT count(*) FROM pg_class")).scalar()
            yield
            conn.rollback()
    finally:
        other.dispose()


def bench_odd(engine: Engine, url: str, table: Table, rows: int, exhausted: int, repeat: int) -> None:
    settings = Settings(database_url=url, schema=SCHEMA, rescuer={"precise_timing": False})
    limit = settings.rescuer.batch_size
    sizes = {"total": rows + exhausted, "exhausted": exhausted}  # exactly that many, spread evenly

    def unbatched(now, held: bool) -> Run:
        with snapshot_held(url, held):
            t, n = timed(engine, UNBATCHED_EXHAUSTED, {"now": now})
        return n, t, []

    def before(now, held: bool) -> Run:
        done, batches, t0 = 0, [], time.perf_counter()
        with snapshot_held(url, held), engine.connect() as conn:
            while True:
                b0 = time.perf_counter()
                batch = conn.execute(sql(BEFORE_EXHAUSTED, SCHEMA), {"now": now, "instance": "bench", "limit": limit}).one()
                conn.commit()
                batches.append(time.perf_counter() - b0)
                done += len(batch.ids)
                if batch.candidates < limit:
                    return done, time.perf_counter() - t0, batches

    def after(now, held: bool) -> Run:
        with snapshot_held(url, held):
            result, t, batches = run_pass(engine, settings, Rescuer(settings.rescuer), now)
        return result.exhausted, t, batches

    methods = {f"{label}{', snapshot held' if held else ''}": (lambda now, m=m, held=held: m(now, held))
               for held in (False, True)
               for label, m in (("one unbatched UPDATE (physical limit)", unbatched),
                                (f"before (83a4ceb^), batch_size {limit:,}", before),
                                (f"after, batch_size {limit:,}", after))}
    runs: dict[str, list[Run]] = {name: [] for name in methods}
    for _ in range(repeat):
        for name, measure in methods.items():
            now = seed(engine, SEED_EXHAUSTED, sizes)
            runs[name].append(measure(now))
    for name, rs in runs.items():
        table.row("exhausted", name, *sorted(rs, key=lambda r: r[1])[len(rs) // 2], limit=name.startswith("one"))


class SyncContext(TimedContext):
    """Today's rescuer with every commit waiting for its WAL flush (to show what that costs)."""

    @contextmanager
    def transaction(self, **kw):
        kw.pop("settings", None)
        with super().transaction(**kw) as conn:
            yield conn


# --- load of precise timing ---------------------------------------------------------------------

SEED_RUNNING = """
INSERT INTO {schema}.jobs (kind, queue, state, attempt, attempted_at, attempted_by, heartbeat_at)
SELECT 'bench', 'q' || (g % 8), 'running', 1, now() - interval '1 minute', 'worker-' || (g % 50),
       now() - (g % 10) * interval '1 second'
  FROM generate_series(1, :n) g
"""

# Every second a tenth of the running jobs heartbeat (each every 10 s).
HEARTBEAT_TENTH = """
UPDATE {schema}.jobs SET heartbeat_at = now()
 WHERE state = 'running' AND id % 10 = :slot
"""


class Counter:
    """Statements run on an engine and their round-trip time (local socket)."""

    def __init__(self, engine: Engine):
        self.n, self.seconds, self._t0 = 0, 0.0, {}
        event.listen(engine, "before_cursor_execute", self.before)
        event.listen(engine, "after_cursor_execute", self.after)

    def before(self, conn, cursor, statement, params, context, executemany):
        self._t0[id(cursor)] = time.perf_counter()

    def after(self, conn, cursor, statement, params, context, executemany):
        self.n += 1
        self.seconds += time.perf_counter() - self._t0.pop(id(cursor), time.perf_counter())


def measure_load(url: str, seconds: float, precise: bool) -> tuple[float, float, int]:
    """Run rescuer passes every 30 s (the default interval) for ``seconds``: statements/s, ms of
    round trips per second, wake-ups."""
    settings = Settings(database_url=url, schema=SCHEMA,
                        rescuer={"precise_timing": precise, "heartbeat_timeout": "30s"})
    engine = make_engine(url, application_name="maintd-bench-rescuer", pool_size=2)
    counter = Counter(engine)
    rescuer = Rescuer(settings.rescuer)
    stop = threading.Event()
    clock = ServerClock()
    wakeups = 0
    t0 = time.monotonic()
    tick = t0
    while time.monotonic() - t0 < seconds:
        ctx = TimedContext.for_settings(settings, engine, clock, stop_event=stop)
        with ctx.session():
            wake = rescuer.run_once(ctx).wake_at()  # as the runner does: a pass then, or the next tick
        if wake is None or (wake - clock.now()).total_seconds() > tick + settings.rescuer.interval.total_seconds() - time.monotonic():
            tick += settings.rescuer.interval.total_seconds()
            rest = tick - time.monotonic()
        else:
            wakeups += 1
            rest = (wake - clock.now()).total_seconds()
        time.sleep(max(0.0, min(rest, seconds - (time.monotonic() - t0))))
    elapsed = time.monotonic() - t0
    engine.dispose()
    return counter.n / elapsed, counter.seconds * 1000 / elapsed, wakeups


def probe_ms(engine: Engine, settings: Settings) -> float:
    rescuer = Rescuer(settings.rescuer)
    with engine.connect() as conn:
        now = conn.execute(text("SELECT now()")).scalar()
        params = {**rescuer.graces(), "since": now, "until": now + timedelta(seconds=30)}
        times = []
        for _ in range(20):
            plan = conn.execute(text("EXPLAIN (ANALYZE, TIMING OFF) " + sql(jobs.RESCUER_NEXT_STUCK, SCHEMA).text),
                                params).all()
            times.append(float(plan[-1][0].split(":")[1].split()[0]))
        conn.rollback()
    return sorted(times)[len(times) // 2]


def bench_load(engine: Engine, url: str, running: int, seconds: float) -> None:
    settings = Settings(database_url=url, schema=SCHEMA, rescuer={"heartbeat_timeout": "30s"})
    for label, n in (("idle (no running job)", 0), (f"{running:,} running, heartbeating", running)):
        with engine.begin() as conn:
            conn.execute(sql("TRUNCATE {schema}.jobs", SCHEMA))
            if n:
                conn.execute(sql(SEED_RUNNING, SCHEMA), {"n": n})
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(sql("VACUUM ANALYZE {schema}.jobs", SCHEMA))
        stop = threading.Event()

        def heartbeats() -> None:
            slot = 0
            while not stop.wait(1.0):
                with engine.begin() as conn:
                    conn.execute(sql(HEARTBEAT_TENTH, SCHEMA), {"slot": slot % 10})
                slot += 1

        beater = threading.Thread(target=heartbeats, daemon=True)
        if n:
            beater.start()
        rows = {}
        for precise in (False, True):
            rows[precise] = measure_load(url, seconds, precise)
        stop.set()
        if n:
            beater.join()
        ms = probe_ms(engine, settings)
        for precise in (False, True):
            qps, mss, wakeups = rows[precise]
            print(f"load      {label:<34} precise_timing={str(precise).lower():<5} "
                  f"{qps:6.3f} statements/s  {mss:6.3f} ms/s round trips  {wakeups:3d} wake-ups", flush=True)
        added_q = rows[True][0] - rows[False][0]
        added_ms = rows[True][1] - rows[False][1]
        print(f"load      {label:<34} added by precise timing: {added_q:+.3f} statements/s, {added_ms:+.3f} ms/s; "
              f"probe execution (EXPLAIN ANALYZE, median) {ms:.3f} ms", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--running", type=int, default=10_000)
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--exhausted", type=int, default=50_000, help="odd: waiting jobs with no attempt left")
    ap.add_argument("--only", choices=["batch", "odd", "load"], action="append")
    ap.add_argument("--batch", type=int, action="append", help="also measure the rescuer with this batch_size")
    args = ap.parse_args()
    with bench_database(pool_size=4) as (url, engine):
        with engine.connect() as conn:
            version = conn.execute(text("SHOW server_version")).scalar()
        print(f"PostgreSQL {version}, {os.cpu_count()} CPUs\n")
        only = args.only or ["batch", "odd", "load"]
        if "batch" in only:
            bench_batch(engine, url, Table(), args.rows, args.repeat, args.batch or [])
        if "odd" in only:
            bench_odd(engine, url, Table(), args.rows, args.exhausted, args.repeat)
        if "load" in only:
            bench_load(engine, url, args.running, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
