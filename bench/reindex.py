"""Worker claim latency while the reindexer rebuilds the jobs indexes of a 1M-row table, versus
without it. Not a test: a person runs it and reads the numbers.

    python bench/reindex.py [--rows 1000000]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from maintd import migrate  # noqa: E402
from maintd.clock import ServerClock  # noqa: E402
from maintd.config import Settings  # noqa: E402
from maintd.db import make_engine
from maintd.queries import sql  # noqa: E402
from maintd.embedded import EmbeddedPostgres  # noqa: E402
from maintd.jobs import JobQueue  # noqa: E402
from maintd.services.base import PassContext  # noqa: E402
from maintd.services.reindexer import Reindexer  # noqa: E402


def claims(engine, stop: threading.Event, lat: list[float]) -> None:
    q = JobQueue("maintd")
    while not stop.is_set():
        t0 = time.perf_counter()
        with engine.begin() as conn:
            jobs = q.claim(conn, "default", "bench", 1)
            for job in jobs:
                q.complete(conn, job)
            q.enqueue(conn, "bench", {})
        lat.append(time.perf_counter() - t0)


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))] * 1000 if v else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    args = ap.parse_args()
    with EmbeddedPostgres(settings={"shared_buffers": "512MB", "max_wal_size": "4GB"}) as pg:
        engine = make_engine(pg.dsn, application_name="bench", pool_size=6)
        with engine.connect() as conn:
            migrate.upgrade(conn, "maintd")
        with engine.begin() as conn:
            conn.execute(sql(
                "INSERT INTO {schema}.jobs (kind, queue, state, finalized_at, attempted_at) "
                "SELECT 'b', 'q' || (g % 8), CASE WHEN g % 4 = 0 THEN 'available' ELSE 'completed' END::{schema}.job_state, "
                "CASE WHEN g % 4 = 0 THEN NULL ELSE now() - (g || ' s')::interval END, now() "
                "FROM generate_series(1, :n) g", "maintd"), {"n": args.rows})
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(sql("VACUUM ANALYZE {schema}.jobs", "maintd"))
        settings = Settings(database_url=pg.dsn, schema="maintd", reindexer={"enabled": True, "timeout": "10m"})
        rows = []
        for label, reindex in (("no reindex", False), ("during REINDEX CONCURRENTLY", True)):
            stop, lat = threading.Event(), []
            t = threading.Thread(target=claims, args=(engine, stop, lat))
            t.start()
            started = time.perf_counter()
            if reindex:
                result = Reindexer(settings.reindexer).run_once(PassContext.for_settings(settings, engine, ServerClock()))
            else:
                time.sleep(10)
            took = time.perf_counter() - started
            stop.set()
            t.join()
            rows.append((label, len(lat) / took, pct(lat, .5), pct(lat, .99), max(lat) * 1000, took))
        print(f"{args.rows:,} rows; claim+complete+enqueue transactions of one worker thread")
        for label, rate, p50, p99, mx, took in rows:
            print(f"  {label:<30} {rate:7.0f} tx/s  p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  max {mx:7.2f} ms  ({took:.1f} s)")
        for r in result.indexes:
            print(f"  {r.index:<22} {r.outcome:<10} {r.seconds:6.2f} s  {r.bytes_before / 2**20:6.1f} -> "
                  f"{(r.bytes_after or 0) / 2**20:6.1f} MiB  bloat est. {r.bloat_percent}%")
        engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
