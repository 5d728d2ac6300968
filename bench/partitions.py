"""Retention on the partitioned layout (SPEC 8.1, issue 30) against the plain one. Not a test: a
person runs it and reads the table. The server is private and durable (fsync, synchronous_commit
and full_page_writes on), or MAINTD_BENCH_DATABASE_URL.

    python bench/partitions.py                      # prune 1,000,000 expired rows among 150,000 live
    python bench/partitions.py --rows 10000000      # the 10 M case
    python bench/partitions.py --soak --minutes 20  # size and dead tuples over time, both layouts

Prune. The same data on both layouts: ``--rows`` completed jobs finalized in the ``--hours``
whole hours that ended 24 hours before this hour began (past the 24 h retention) and 150,000
available ones. Plain: one ``DELETE`` of the expired rows (the fastest a DELETE can do it).
Partitioned, in the steady state (the partitions start with the rows' first hour): one
partitioner pass (empty, detach and drop the ``--hours`` expired partitions). Each is measured
twice on fresh data: alone (time, WAL written, dead tuples left), then with 4 workers claiming
and completing (their claims/s during the prune over their rate in the 5 s before, summed over
``--repeat`` prunes of fresh data). The physical floor, in the same run: a ``DROP TABLE`` of a
copy of the expired partitions (the same files to free), alone and with the workers running; no
retention that gives the space back can beat it. Goals (issue 30): at 1 M at least 10x the
DELETE's speed, at 10 M at least 100x, WAL at most 1 % of the DELETE's, workers at least 0.95x
their idle rate (0.57x during a DELETE).

Soak. Both layouts side by side in one database for ``--minutes``: an enqueuer per layout at
``--rate`` jobs/s, 2 workers each, retention ``--retention`` (partitions of ``--step``), the
cleaner and the partitioner every 10 s; printed every 30 s: tables plus indexes (bytes), dead
tuples (all, and in final-state partitions), live rows. Run once without and once with a
transaction holding the xmin horizon for ``--hold`` seconds from the second minute.
"""

from __future__ import annotations

import argparse
import multiprocessing
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
from maintd.clock import FrozenClock  # noqa: E402
from maintd.config import CleanerConfig, PartitionsConfig  # noqa: E402
from maintd.db import make_engine  # noqa: E402
from maintd.jobs import JobQueue  # noqa: E402
from maintd.services.base import PassContext  # noqa: E402
from maintd.services.cleaner import Cleaner  # noqa: E402
from maintd.services.partitioner import Partitioner, PartitionerConfig  # noqa: E402
from tests.test_convert import moved_is_none  # noqa: E402  (the README's 40001 rule, as the tests read it)

LIVE = 150_000
PRUNES: list = []  # the partitioner's results, printed with the table
HOUR = timedelta(hours=1)
EXPIRED = "finalized_at < now() - interval '24 hours'"  # past the retention (the seeded rows)


# --- the server and the schemas ------------------------------------------------------------------

@contextmanager
def bench_server() -> Iterator[str]:
    url = os.environ.get("MAINTD_BENCH_DATABASE_URL")
    if url:
        yield url
        return
    from maintd.embedded import EmbeddedPostgres

    pg = EmbeddedPostgres(settings={"shared_buffers": "512MB", "max_wal_size": "8GB", "fsync": "on",
                                    "synchronous_commit": "on", "full_page_writes": "on"}).start()
    try:
        yield pg.dsn
    finally:
        pg.cleanup()


def fresh_schema(engine: Engine, schema: str, layout: str, step: timedelta = HOUR) -> None:
    with engine.connect() as conn:
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        conn.commit()
        migrate.upgrade(conn, schema, layout=migrate.Layout(layout, step, 24))
        conn.commit()


def start_partitions_at(engine: Engine, schema: str, at: datetime, step: timedelta = HOUR) -> None:
    """The completed state's partitions start at ``at`` (as if made since then), up to 24 steps ahead."""
    with engine.begin() as conn:
        q = f'"{schema}"'
        for (name,) in conn.execute(text(f"SELECT partition_name FROM {q}.job_partitions('completed')")).all():
            conn.execute(text(f"ALTER TABLE {q}.jobs_completed DETACH PARTITION {q}.{name}"))
            conn.execute(text(f"DROP TABLE {q}.{name}"))
        conn.execute(text(f"SELECT {q}.start_partitions('completed', make_interval(secs => :s), :at)"),
                     {"s": step.total_seconds(), "at": at})
        while conn.execute(text(f"SELECT count(*) FROM {q}.maintain_partitions('completed', "
                                "make_interval(secs => :s), now() + 24 * make_interval(secs => :s))"),
                           {"s": step.total_seconds()}).scalar():
            pass  # at most 50 partitions a call


def seed(engine: Engine, schema: str, rows: int, hours: int) -> None:
    """``rows`` completed jobs finalized within the ``hours`` whole hours that ended 24 hours before
    this hour began (all past the 24 h retention), and LIVE available ones."""
    q = f'"{schema}"'
    with engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {q}.jobs (kind, queue, state, attempt, attempted_at, finalized_at) "
                          f"SELECT 'done', 'work', 'completed', 1, now() - interval '80 hours', "
                          f"date_trunc('hour', now()) - interval '24 hours' "
                          f"- (g % (:hours * 3600)) * interval '1 second' - interval '1 millisecond' "
                          f"FROM generate_series(1, :n) g"), {"n": rows, "hours": hours})
        conn.execute(text(f"INSERT INTO {q}.jobs (kind, queue) SELECT 'work', 'work' FROM generate_series(1, :n)"),
                     {"n": LIVE})
    autocommit(engine, f"VACUUM ANALYZE {q}.jobs")


def prepare(engine: Engine, schema: str, layout: str, rows: int, hours: int) -> None:
    """The steady state: the completed state's partitions start with the seeded rows' first hour,
    as if the partitioner had dropped the ones before as they expired; the ``hours`` partitions
    that hold the rows are the expired ones."""
    fresh_schema(engine, schema, layout)
    if layout == "partitioned":
        with engine.connect() as conn:
            hour = conn.execute(text("SELECT date_trunc('hour', now())")).scalar()
        start_partitions_at(engine, schema, hour - (hours + 24) * HOUR)
    seed(engine, schema, rows, hours)


# --- measurements --------------------------------------------------------------------------------

def claim(engine: Engine, queue: JobQueue, worker: str, limit: int = 1):
    with engine.begin() as conn:
        return queue.claim(conn, "work", worker, limit)


def complete(engine: Engine, queue: JobQueue, job) -> bool:
    with engine.begin() as conn:
        return queue.complete(conn, job)


def wal_lsn(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        return int(conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'").fetchone()[0])


def dead_tuples(url: str, schema: str) -> int:
    """Dead tuples of the jobs table (all its partitions), as the statistics say once flushed."""
    time.sleep(11)  # an idle backend flushes its statistics within 10 s
    with psycopg.connect(url, autocommit=True) as conn:
        return int(conn.execute("SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables "
                                "WHERE schemaname = %s AND relname ~ '^jobs'", (schema,)).fetchone()[0])


class TimedContext(PassContext):
    """Notes when each transaction of a pass ends (the partitioner's last one drops the files)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.ends: list[float] = []

    @contextmanager
    def transaction(self, **kw):
        with super().transaction(**kw) as conn:
            yield conn
        self.ends.append(time.perf_counter())


def prune(engine: Engine, schema: str, layout: str) -> tuple[int, float | None]:
    """The layout's retention, once: one DELETE, or one partitioner pass. Returns the rows removed
    and, for the pass, when its rows were gone from jobs (the transaction that emptied the expired
    partitions committed; the detach and the drop come after)."""
    if layout == "plain":
        with engine.begin() as conn:
            return conn.execute(text(f'DELETE FROM "{schema}".jobs WHERE state = \'completed\' '
                                     f"AND {EXPIRED}")).rowcount, None
    with engine.connect() as conn:
        now = conn.execute(text("SELECT now()")).scalar()
        conn.rollback()
    service = Partitioner(PartitionerConfig("partitioned", PartitionsConfig(interval="1h", premake=24),
                                            CleanerConfig()))
    ctx = TimedContext(engine=engine, schema=schema, clock=FrozenClock(now), layout="partitioned")
    result = service.run_once(ctx)
    # The first transaction emptied the expired partitions (their rows gone at its commit); the
    # detach and the drop follow in this pass, or (workers holding jobs_completed) a later one.
    assert result.emptied and result.deleted["completed"], result
    PRUNES.append(result)
    return result.deleted["completed"], ctx.ends[0]


def floor_copy(engine: Engine, schema: str) -> None:
    """A copy of the expired partitions (the same rows and indexes, so files of the same size):
    dropping it is the physical floor of freeing the rows' space (:func:`floor_drop`). The file
    system frees files in time that grows with their size."""
    q = f'"{schema}"'
    with engine.begin() as conn:
        (first,) = conn.execute(text(f"SELECT partition_name FROM {q}.job_partitions('completed') "
                                     "WHERE range_start IS NOT NULL ORDER BY range_start LIMIT 1")).one()
        conn.execute(text(f"CREATE TABLE {q}.floor_copy (LIKE {q}.{first} INCLUDING ALL)"))
        conn.execute(text(f"INSERT INTO {q}.floor_copy SELECT * FROM {q}.jobs_completed "
                          f"WHERE {EXPIRED}"))


def floor_drop(engine: Engine, schema: str) -> float:
    """Seconds to drop the copy and commit."""
    started = time.perf_counter()
    with engine.begin() as conn:
        conn.execute(text(f'DROP TABLE "{schema}".floor_copy'))
    return time.perf_counter() - started


def autocommit(engine: Engine, statement: str) -> None:
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(text(statement))


def prepared(engine: Engine, schema: str, layout: str, rows: int, hours: int) -> None:
    """:func:`prepare`, the floor's copy on the partitioned layout, then a checkpoint (as 24-hour-old
    rows have had one since they were written; the DELETE then writes full-page images)."""
    prepare(engine, schema, layout, rows, hours)
    if layout == "partitioned":
        floor_copy(engine, schema)
    autocommit(engine, "CHECKPOINT")


def measure_alone(engine: Engine, url: str, schema: str, layout: str, rows: int, hours: int) -> dict:
    prepared(engine, schema, layout, rows, hours)
    floor = None
    if layout == "partitioned":
        floor = floor_drop(engine, schema)
        autocommit(engine, "CHECKPOINT")  # the prune right after one, as the DELETE (its WAL compared)
    before = wal_lsn(url)
    started = time.perf_counter()
    removed, gone = prune(engine, schema, layout)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "gone": (gone or started + seconds) - started, "wal": wal_lsn(url) - before,
            "removed": removed, "dead": dead_tuples(url, schema), "floor": floor}


def measure_with_workers(engine: Engine, url: str, schema: str, layout: str, rows: int, hours: int, repeat: int = 1) -> dict:
    """Claims/s of 4 workers idle and during the prune, over ``repeat`` prunes of fresh data (a
    prune of a few tens of milliseconds holds few claims: one alone is noisy), and the slowest
    claim plus completion of each phase."""
    runs = [measure_workers_once(engine, url, schema, layout, rows, hours) for _ in range(repeat)]
    idle, during, floor = (sum(r[f"{k}_n"] for r in runs) / max(1e-9, sum(r[f"{k}_s"] for r in runs))
                           for k in ("idle", "during", "floor"))
    return {"idle": idle, "during": during, "ratio": during / idle, "floor_ratio": floor / idle,
            "seconds": sum(r["during_s"] for r in runs) / repeat,
            "slowest_idle": max(r["slowest_idle"] for r in runs),
            "slowest_during": max(r["slowest_during"] for r in runs)}


def measure_workers_once(engine: Engine, url: str, schema: str, layout: str, rows: int, hours: int, idle: float = 5.0) -> dict:
    """One prune with the workers of :func:`workers_process` running, in a process of their own
    (as workers are: in the bench's process they would share its GIL with the pass)."""
    prepared(engine, schema, layout, rows, hours)
    mp = multiprocessing.get_context("fork")
    phase, counts, slowest = mp.Value("i", 0), mp.Array("i", len(PHASES)), mp.Array("d", 2)
    floor = 0.0
    workers = mp.Process(target=workers_process, args=(url, schema, phase, counts, slowest))
    workers.start()
    try:
        time.sleep(2.0)  # connected and warm
        phase.value = IDLE
        time.sleep(idle)
        if layout == "partitioned":  # the workers during the floor: the same files freed, nothing else
            phase.value = FLOOR
            floor = floor_drop(engine, schema)
            phase.value = WARMUP
            time.sleep(1.0)
        phase.value = DURING
        started = time.perf_counter()
        prune(engine, schema, layout)
        during = time.perf_counter() - started
    finally:
        phase.value = AFTER
        workers.join()
    return {"idle_n": counts[IDLE], "idle_s": idle, "during_n": counts[DURING], "during_s": during,
            "floor_n": counts[FLOOR], "floor_s": floor, "slowest_idle": slowest[0], "slowest_during": slowest[1]}


PHASES = ("warmup", "idle", "during", "floor", "after")  # what the workers count a completion in
WARMUP, IDLE, DURING, FLOOR, AFTER = range(len(PHASES))


def workers_process(url: str, schema: str, phase, counts, slowest, n: int = 4) -> None:  # noqa: ANN001
    """4 workers (threads) claiming and completing one job at a time until the phase is "after":
    each completion counted in the phase it ended in, the slowest claim plus completion of the
    idle and the during phases (begun and ended in it)."""
    engine = make_engine(url, application_name="bench-workers", pool_size=n)
    queue, lock = JobQueue(schema), threading.Lock()

    def worker(i: int) -> None:
        while phase.value < AFTER:
            started, begun = time.perf_counter(), phase.value
            jobs = moved_is_none(lambda: claim(engine, queue, f"w{i}")) or []
            if jobs:
                moved_is_none(lambda: complete(engine, queue, jobs[0]))
                with lock:
                    ended = phase.value
                    counts[ended] += 1
                    if ended == begun and ended in (IDLE, DURING):  # slowest[0]: idle, [1]: during
                        slowest[ended - IDLE] = max(slowest[ended - IDLE], time.perf_counter() - started)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.dispose()


def bench_prune(engine: Engine, url: str, rows: int, hours: int, repeat: int) -> None:
    print(f"prune: {rows:,} expired completed jobs finalized over {hours} h ({hours} partitions of 1 h "
          f"past the retention), {LIVE:,} live; workers measured over {repeat} prune(s)", flush=True)
    results = {}
    for layout in ("plain", "partitioned"):
        schema = f"bench_{layout}"
        alone = measure_alone(engine, url, schema, layout, rows, hours)
        loaded = measure_with_workers(engine, url, schema, layout, rows, hours, repeat)
        with engine.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
            conn.commit()
        results[layout] = {**alone, **{f"workers_{k}": v for k, v in loaded.items()}}
        r = results[layout]
        print(f"{layout:<12} removed {r['removed']:>10,} in {r['seconds']:8.3f} s (gone from jobs after "
              f"{r['gone']:.3f} s)  WAL {r['wal'] / 1e6:9.2f} MB  "
              f"dead tuples left {r['dead']:>10,}  workers {r['workers_idle']:7.0f}/s idle, "
              f"{r['workers_during']:7.0f}/s during the prune ({r['workers_seconds']:.3f} s) = "
              f"{r['workers_ratio']:.2f}x; slowest claim+complete {1000 * r['workers_slowest_idle']:.0f} ms idle, "
              f"{1000 * r['workers_slowest_during']:.0f} ms during", flush=True)
    for result in PRUNES:
        print(f"  partitioner pass: {result.summary()}")
    p, d = results["plain"], results["partitioned"]
    print(f"\npartitioned pass {d['seconds']:.3f} s = {d['floor']:.3f} s for the file system to free the rows' files "
          f"(the floor: DROP TABLE of a same-size copy, {d['seconds'] / d['floor']:.2f}x of it) + "
          f"{d['seconds'] - d['floor']:.3f} s of maintd's catalog work and round trips")
    print(f"partitioned vs one DELETE at {rows:,} rows among {LIVE:,} live: "
          f"{p['seconds'] / d['seconds']:,.1f}x faster ({p['seconds'] / d['gone']:,.1f}x until the rows are gone, "
          f"at the commit that frees their files; the floor allows at most {p['seconds'] / d['floor']:,.1f}x), "
          f"WAL {100 * d['wal'] / p['wal']:.3f} % of the DELETE's, "
          f"dead tuples {d['dead']:,} vs {p['dead']:,}, workers during the prune "
          f"{d['workers_ratio']:.2f}x idle (DELETE: {p['workers_ratio']:.2f}x; during the floor's "
          f"DROP TABLE of the same files: {d['workers_floor_ratio']:.2f}x)")


# --- soak -----------------------------------------------------------------------------------------

class Soak:
    """One layout's workload: an enqueuer at ``rate`` jobs/s, 2 workers, maintenance every 10 s."""

    def __init__(self, engine: Engine, schema: str, layout: str, rate: float, retention: str, step: timedelta):
        self.engine, self.schema, self.layout, self.rate = engine, schema, layout, rate
        self.queue = JobQueue(schema)
        self.cleaner = Cleaner(CleanerConfig(completed_retention=retention, cancelled_retention=retention,
                                             discarded_retention=retention))
        self.partitioner = Partitioner(PartitionerConfig(
            layout, PartitionsConfig(interval=step, premake=24), self.cleaner.config))
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=f) for f in (self._enqueue, self._work, self._work, self._maintain)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def _enqueue(self) -> None:
        started, n = time.monotonic(), 0
        while not self.stop.is_set():
            with self.engine.begin() as conn:
                for _ in range(10):
                    self.queue.enqueue(conn, "soak", queue="soak")
            n += 10
            ahead = n / self.rate - (time.monotonic() - started)
            if ahead > 0:
                self.stop.wait(ahead)

    def _work(self) -> None:
        while not self.stop.is_set():
            jobs = moved_is_none(lambda: self._claim_and_complete())
            if not jobs:
                self.stop.wait(0.05)

    def _claim_and_complete(self) -> list:
        with self.engine.begin() as conn:
            jobs = self.queue.claim(conn, "soak", "w", 10)
            for job in jobs:
                self.queue.complete(conn, job)
        return jobs

    def _maintain(self) -> None:
        while not self.stop.wait(10):
            with self.engine.connect() as conn:
                now = conn.execute(text("SELECT now()")).scalar()
                conn.rollback()
            ctx = lambda: PassContext(engine=self.engine, schema=self.schema, clock=FrozenClock(now),
                                      layout=self.layout)
            self.cleaner.run_once(ctx())
            if self.layout == "partitioned":
                self.partitioner.run_once(ctx())


def table_health(url: str, schema: str) -> tuple[int, int, int, int]:
    """(bytes of tables plus indexes, dead tuples, dead tuples in final-state partitions, live rows)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("""
            SELECT coalesce(sum(pg_total_relation_size(relid)), 0), coalesce(sum(n_dead_tup), 0),
                   coalesce(sum(n_dead_tup) FILTER (WHERE relname ~ '^jobs_(completed|cancelled|discarded)_'), 0),
                   coalesce(sum(n_live_tup), 0)
              FROM pg_stat_user_tables WHERE schemaname = %s AND relname ~ '^jobs'""", (schema,)).fetchone()
    return tuple(int(v) for v in row)  # type: ignore[return-value]


def hold_horizon(url: str, start: float, seconds: float, stop: threading.Event) -> threading.Thread:
    def hold() -> None:
        if stop.wait(start):
            return
        with psycopg.connect(url) as conn:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            conn.execute("SELECT count(*) FROM pg_class")  # takes the snapshot
            print(f"  (horizon held from now for {seconds:.0f} s)", flush=True)
            stop.wait(seconds)
            conn.rollback()
            print("  (horizon released)", flush=True)

    t = threading.Thread(target=hold)
    t.start()
    return t


def bench_soak(engine: Engine, url: str, minutes: float, rate: float, retention: str, step: timedelta,
               hold: float | None) -> None:
    print(f"\nsoak: {minutes:g} min at {rate:g} jobs/s per layout, retention {retention}, step {step}, "
          + (f"horizon held {hold:g} s from minute 1" if hold else "no horizon held"), flush=True)
    soaks = []
    for layout in ("plain", "partitioned"):
        fresh_schema(engine, f"soak_{layout}", layout, step)
        soaks.append(Soak(engine, f"soak_{layout}", layout, rate, retention, step))
    stop = threading.Event()
    holder = hold_horizon(url, 60, hold, stop) if hold else None
    for s in soaks:
        s.start()
    print(f"{'min':>5} | {'plain MB':>9} {'dead':>9} {'live':>8} | {'part. MB':>9} {'dead':>9} "
          f"{'final dead':>10} {'live':>8}", flush=True)
    started = time.monotonic()
    try:
        while time.monotonic() - started < minutes * 60:
            time.sleep(30)
            p, d = table_health(url, "soak_plain"), table_health(url, "soak_partitioned")
            print(f"{(time.monotonic() - started) / 60:5.1f} | {p[0] / 1e6:9.1f} {p[1]:9,} {p[3]:8,} | "
                  f"{d[0] / 1e6:9.1f} {d[1]:9,} {d[2]:10,} {d[3]:8,}", flush=True)
    finally:
        stop.set()
        for s in soaks:
            s.join()
        if holder:
            holder.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="expired rows to prune (default 1000000)")
    ap.add_argument("--hours", type=int, default=1,
                    help="hours (1 h partitions) the expired rows spread over (default 1: what a pass drops "
                         "in the steady state; 24: a day's backlog)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="prunes (each of fresh data) the workers' rate is measured over (default 3)")
    ap.add_argument("--soak", action="store_true", help="the soak instead of the prune")
    ap.add_argument("--minutes", type=float, default=20, help="soak: minutes per run (default 20)")
    ap.add_argument("--rate", type=float, default=300, help="soak: jobs/s per layout (default 300)")
    ap.add_argument("--retention", default="2m", help="soak: retention of every final state (default 2m)")
    ap.add_argument("--step", default="1m", help="soak: partition step (default 1m)")
    ap.add_argument("--hold", type=float, default=180, help="soak: seconds the horizon is held (default 180)")
    ap.add_argument("--runs", choices=("both", "no-hold", "hold"), default="both",
                    help="soak: without a held horizon, with one, or both, one after the other (default)")
    args = ap.parse_args()
    with bench_server() as url:
        engine = make_engine(url, application_name="maintd-bench", pool_size=12)
        with engine.connect() as conn:
            version = conn.execute(text("SHOW server_version")).scalar()
            durable = {k: conn.execute(text(f"SHOW {k}")).scalar()
                       for k in ("fsync", "synchronous_commit", "full_page_writes", "shared_buffers")}
        print(f"PostgreSQL {version} ({', '.join(f'{k}={v}' for k, v in durable.items())}), "
              f"{os.cpu_count()} CPUs", flush=True)
        if args.soak:
            step = PartitionsConfig(interval=args.step).interval
            for hold in {"both": (None, args.hold), "no-hold": (None,), "hold": (args.hold,)}[args.runs]:
                bench_soak(engine, url, args.minutes, args.rate, args.retention, step, hold)
        else:
            bench_prune(engine, url, args.rows, args.hours, args.repeat)
        engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
