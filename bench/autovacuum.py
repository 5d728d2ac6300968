"""Soak: the jobs table's dead rows, size and claim latency over time with PostgreSQL's default
autovacuum settings against those ``maintd migrate`` sets (``maintd.migrate.JOBS_AUTOVACUUM``),
side by side on one server (two schemas, the same workload in each, at the same time, so both
see the same machine). Not a test: a person runs it and reads the table.

    python bench/autovacuum.py [--minutes 10] [--rate 60] [--retained 1000000] [--hold 0]

Each schema holds ``--retained`` finished jobs inside their retention (completed jobs are kept
24 h by default: a day of a queue's work), vacuumed and analyzed before the soak; then producers
enqueue ``--rate`` jobs a second into each, two workers per schema claim (the README's claim, 10
at a time) and complete them, and a maintd daemon (cleaner, rescuer, scheduler) leads both
schemas. Every 30 s: dead rows, live rows, table size with indexes, autovacuum runs, and the
workers' claim p50/p99 over the interval. ``--hold N`` opens a REPEATABLE READ snapshot for N
minutes from the soak's first third (vacuum can then remove nothing, in either schema).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from maintd import migrate  # noqa: E402
from maintd.config import Settings  # noqa: E402
from maintd.daemon import Daemon  # noqa: E402
from maintd.db import make_engine  # noqa: E402
from maintd.embedded import EmbeddedPostgres  # noqa: E402
from maintd.jobs import JobQueue  # noqa: E402

SCHEMAS = {"defaults": "PostgreSQL's defaults (scale factor 0.2, threshold 50)",
           "chosen": "maintd migrate's: " + ", ".join(f"{k.removeprefix('autovacuum_')}={v}"
                                                      for k, v in migrate.JOBS_AUTOVACUUM.items())}
SAMPLE = 30.0


def prepare(dsn: str, retained: int) -> None:
    engine = make_engine(dsn, application_name="bench-migrate", pooled=False)
    with engine.connect() as conn:
        for s in SCHEMAS:
            migrate.upgrade(conn, s)
    engine.dispose()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(migrate.jobs_autovacuum_sql("defaults", reset=True))
        for s in SCHEMAS:
            conn.execute(f"""
                INSERT INTO {s}.jobs (kind, queue, state, attempt, attempted_at, attempted_by, finalized_at,
                                      created_at, scheduled_at)
                SELECT 'soak', 'default', 'completed', 1, t, 'seed', t, t, t
                  FROM (SELECT now() - (g % 86400) * interval '1 second' AS t
                          FROM generate_series(1, {retained}) g) x""")
            conn.execute(f"VACUUM (ANALYZE) {s}.jobs")


def producer(dsn: str, schema: str, rate: float, seconds: float) -> None:
    engine = make_engine(dsn, application_name=f"soak-producer-{schema}", pool_size=1)
    q, deadline, sent = JobQueue(schema), time.monotonic() + seconds, 0
    start = time.monotonic()
    while time.monotonic() < deadline:
        due = int((time.monotonic() - start) * rate) - sent
        if due > 0:
            with engine.begin() as conn:
                for _ in range(due):
                    q.enqueue(conn, "soak", {"n": sent})
                    sent += 1
        time.sleep(0.05)
    engine.dispose()


def worker(dsn: str, schema: str, seconds: float, out: "mp.Queue") -> None:
    engine = make_engine(dsn, application_name=f"soak-worker-{schema}", pool_size=1)
    q, deadline, name = JobQueue(schema), time.monotonic() + seconds, f"w{mp.current_process().pid}"
    lat: list[tuple[float, float]] = []  # (monotonic end, claim seconds)
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        with engine.begin() as conn:
            jobs = q.claim(conn, "default", name, 10)
        lat.append((time.monotonic(), time.perf_counter() - t0))
        with engine.begin() as conn:
            for job in jobs:
                q.complete(conn, job)
        if not jobs:
            time.sleep(0.02)
    engine.dispose()
    out.put((schema, lat))


def sample(dsn: str) -> dict[str, tuple[int, int, int, int]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("""
            SELECT n.nspname, pg_stat_get_dead_tuples(c.oid), pg_stat_get_live_tuples(c.oid),
                   pg_total_relation_size(c.oid), pg_stat_get_autovacuum_count(c.oid)
              FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE c.relname = 'jobs' AND n.nspname = ANY(%s)""", (list(SCHEMAS),)).fetchall()
    return {r[0]: tuple(r[1:]) for r in rows}


def hold_snapshot(dsn: str, after: float, minutes: float, stop: threading.Event) -> None:
    if stop.wait(after):
        return
    with psycopg.connect(dsn, application_name="soak-report") as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT 1")
        print(f"  (a snapshot is held for {minutes:g} min from now)", flush=True)
        stop.wait(minutes * 60)
        conn.rollback()
    print("  (the snapshot ended)", flush=True)


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))] * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--rate", type=float, default=60, help="jobs a second into each schema")
    ap.add_argument("--retained", type=int, default=1_000_000, help="finished jobs kept, per schema")
    ap.add_argument("--hold", type=float, default=0, help="minutes a snapshot is held open")
    args = ap.parse_args()
    seconds = args.minutes * 60
    pg = EmbeddedPostgres(settings={"shared_buffers": "256MB", "max_wal_size": "4GB"})
    pg.start()
    try:
        t0 = time.monotonic()
        prepare(pg.dsn, args.retained)
        print(f"seeded {args.retained:,} finished jobs per schema in {time.monotonic() - t0:.0f} s")
        for s, what in SCHEMAS.items():
            print(f"  {s}: {what}")
        settings = Settings(database_url=pg.dsn, instance_id="soak", http={"enabled": False},
                            targets=[{"schema": s} for s in SCHEMAS], health={"enabled": False})
        daemon = Daemon(settings)
        daemon.start()
        out: mp.Queue = mp.Queue()
        procs = [mp.Process(target=producer, args=(pg.dsn, s, args.rate, seconds)) for s in SCHEMAS]
        procs += [mp.Process(target=worker, args=(pg.dsn, s, seconds, out)) for s in SCHEMAS for _ in range(2)]
        stop = threading.Event()
        if args.hold:
            threading.Thread(target=hold_snapshot, args=(pg.dsn, seconds / 3, args.hold, stop), daemon=True).start()
        start = time.monotonic()
        for p in procs:
            p.start()
        samples = [(0.0, sample(pg.dsn))]
        while time.monotonic() - start < seconds:
            time.sleep(min(SAMPLE, seconds - (time.monotonic() - start)))
            samples.append((time.monotonic() - start, sample(pg.dsn)))
        lat: dict[str, list[tuple[float, float]]] = {s: [] for s in SCHEMAS}
        for _ in range(2 * len(SCHEMAS)):
            schema, got = out.get(timeout=120)
            lat[schema] += got
        for p in procs:
            p.join(30)
        stop.set()
        daemon.stop()
        report(samples, lat, start)
    finally:
        pg.cleanup()
    return 0


def report(samples: list, lat: dict[str, list[tuple[float, float]]], start: float) -> None:
    names = list(SCHEMAS)
    head = "".join(f" | {s + ': dead':>14} {'live':>9} {'MB':>7} {'av':>3} {'p50ms':>6} {'p99ms':>7}" for s in names)
    print(f"\n{'t (s)':>6}{head}")
    prev = 0.0
    for t, row in samples:
        line = f"{t:>6.0f}"
        for s in names:
            dead, live, size, runs = row[s]
            window = [x for end, x in lat[s] if prev < end - start <= t]
            line += (f" | {dead:>14,} {live:>9,} {size / 2**20:>7.1f} {runs:>3}"
                     f" {percentile(window, 0.5):>6.2f} {percentile(window, 0.99):>7.2f}")
        print(line)
        prev = t
    for s in names:
        deads = [row[s][0] for _, row in samples[1:]]
        sizes = [row[s][2] / 2**20 for _, row in samples]
        claims = [x for _, x in lat[s]]
        print(f"{s}: dead rows max {max(deads):,} mean {statistics.mean(deads):,.0f}; size {sizes[0]:.1f} -> "
              f"{sizes[-1]:.1f} MB; autovacuums {samples[-1][1][s][3] - samples[0][1][s][3]}; claim p50 "
              f"{percentile(claims, 0.5):.2f} ms p99 {percentile(claims, 0.99):.2f} ms over {len(claims):,} claims")


if __name__ == "__main__":
    raise SystemExit(main())
