"""The table-health read's server time (SPEC 8.2: "at most a few ms of server time" per interval
per database), measured with pg_stat_statements on a server of its own, with 1 and with 40
targets (schemas) on one database. Not a test: a person runs it and reads the table.

    python bench/health.py [--targets 1 40] [--reads 200] [--jobs 20000] [--pg-bin /usr/lib/postgresql/15/bin]

Each schema is migrated and holds ``--jobs`` jobs (a fifth waiting, the rest finished), with
statistics flushed, so the tables have sizes and counts; a few sessions hold snapshots and a
prepared transaction, so the holders' read has rows to name. Then ``--reads`` reads, and per
statement: calls, mean execution and planning time. One read per interval is the sum over its
statements, at the daemon's mix at the default 15 s: the jobs tables' rows every read, maintd's
own tables and the jobs tables' sizes once a minute, every size once in ten minutes. The history
step (at most once a minute per target) is measured the same way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from maintd import migrate  # noqa: E402
from maintd.clock import ServerClock  # noqa: E402
from maintd.config import Settings  # noqa: E402
from maintd.db import connect, make_engine  # noqa: E402
from maintd.embedded import EmbeddedPostgres  # noqa: E402
from maintd.health import HealthReader  # noqa: E402
from maintd.history import HistoryWriter  # noqa: E402
from maintd.services.base import PassContext  # noqa: E402

SETTINGS = {"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "all",
            "pg_stat_statements.track_planning": "on", "max_prepared_transactions": "4"}


class Server(EmbeddedPostgres):
    def __init__(self, bin_dir: str | None):
        super().__init__(settings=SETTINGS)
        if bin_dir:
            self.bin = Path(bin_dir)


def prepare(dsn: str, schemas: list[str], jobs: int) -> None:
    engine = make_engine(dsn, application_name="bench-migrate", pooled=False)
    with engine.connect() as conn:
        for s in schemas:
            migrate.upgrade(conn, s)
    engine.dispose()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        for s in schemas:
            conn.execute(f"""
                INSERT INTO {s}.jobs (kind, queue, state, finalized_at)
                SELECT 'bench', 'q' || (g % 7), CASE WHEN g % 5 = 0 THEN 'available' ELSE 'completed' END::{s}.job_state,
                       CASE WHEN g % 5 = 0 THEN NULL ELSE now() - g * interval '1 second' END
                  FROM generate_series(1, {jobs}) g""")
            conn.execute(f"DELETE FROM {s}.jobs WHERE id % 11 = 0")
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("ANALYZE")


def hold(dsn: str) -> list[psycopg.Connection]:
    """Three snapshots and a prepared transaction, so the holders' read has rows."""
    held = []
    for i in range(3):
        c = psycopg.connect(dsn, application_name=f"bench-holder-{i}")
        c.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        c.execute("SELECT 1")
        held.append(c)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("BEGIN")
        c.execute("SELECT txid_current()")
        c.execute("PREPARE TRANSACTION 'bench-2pc'")
    return held


def statements(dsn: str, like: list[str]) -> list[tuple]:
    with psycopg.connect(dsn, autocommit=True) as c:
        rows = c.execute("SELECT query, calls, mean_exec_time, total_plan_time / calls FROM pg_stat_statements "
                         "WHERE calls > 0 ORDER BY total_exec_time DESC").fetchall()
    return [r for r in rows if any(k in r[0] for k in like)]


def reset(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("SELECT pg_stat_statements_reset()")


def table(title: str, rows: list[tuple], per: int) -> float:
    """Print per statement calls and ms; returns the server ms of one round (``per`` calls)."""
    print(f"\n{title}")
    print(f"  {'statement':<60} {'calls':>6} {'exec ms':>8} {'plan ms':>8}  (means per call)")
    total = 0.0
    for query, calls, exec_ms, plan_ms in rows:
        text = " ".join(query.split())[:58]
        print(f"  {text:<60} {calls:>6} {exec_ms:>8.3f} {plan_ms or 0:>8.3f}")
        total += (exec_ms + (plan_ms or 0)) * calls / per
    return total


def measure(dsn: str, n: int, reads: int) -> dict[str, float]:
    schemas = [f"tenant_{i:03d}" for i in range(n)]
    engine = make_engine(dsn, application_name="bench-health", pool_size=2)
    reader = HealthReader()
    conn = connect(dsn, application_name="bench-health",  # as the monitor's own connection
                   settings={"statement_timeout": 5000, "plan_cache_mode": "force_generic_plan"})
    reader.read(conn, schemas)  # warm: catalog caches, the prepared statements
    like = ["pg_stat_activity", "pg_partition_tree", "SELECT now() AS now"]
    reset(dsn)
    wall, full_wall = [], []
    for i in range(reads):  # the daemon's mix at 15 s: every table and jobs' size once a minute,
        if i % 40 == 0:     # every size once in 10 minutes
            reader._sizes_at = None
        elif i % 4 == 0:
            reader._full_at = None
        t0 = time.perf_counter()
        report = reader.read(conn, schemas)
        (full_wall if i % 4 == 0 else wall).append((time.perf_counter() - t0) * 1000)
    read_ms = table(f"{n} target(s): {reads} health reads at the daemon's mix", statements(dsn, like), reads)
    print(f"  holders named: {len(report.horizon.holders)}; tables read: {sum(len(t) for t in report.tables.values())}")
    reset(dsn)
    for _ in range(20):
        reader._sizes_at = None
        reader.read(conn, schemas)
    full_ms = table(f"{n} target(s): the full read alone (every table, every size)", statements(dsn, like), 20)
    reset(dsn)
    settings = Settings(database_url=dsn)
    steps = 0
    for s in schemas:
        ctx = PassContext.for_settings(settings.model_copy(update={"schema": s}), engine, ServerClock())
        writer = HistoryWriter(idle_every=timedelta(0))
        writer.step(ctx, report, lambda: [("q0", "available", 1000)])  # the job gauges' counts, as in the daemon
        steps += 1
    history_ms = table(f"{n} target(s): the history step of each target (once a minute at most)",
                       statements(dsn, ["health_history", "count(*) FILTER", "GROUP BY queue, state"]), steps)
    engine.dispose()
    conn.close()
    return {"targets": n, "read_server_ms": read_ms, "full_server_ms": full_ms,
            "read_wall_ms_p50": statistics.median(wall), "full_wall_ms_p50": statistics.median(full_wall),
            "history_server_ms_per_target": history_ms}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", type=int, nargs="+", default=[1, 40])
    ap.add_argument("--reads", type=int, default=200)
    ap.add_argument("--jobs", type=int, default=20_000, help="jobs per schema")
    ap.add_argument("--pg-bin", help="PostgreSQL binaries (default: the embedded PostgreSQL)")
    args = ap.parse_args()
    results = []
    for n in args.targets:
        pg = Server(args.pg_bin)
        pg.start()
        held: list[psycopg.Connection] = []
        try:
            with psycopg.connect(pg.dsn) as c:
                version = c.execute("SHOW server_version").fetchone()[0]
            prepare(pg.dsn, [f"tenant_{i:03d}" for i in range(n)], args.jobs)
            held = hold(pg.dsn)
            results.append(measure(pg.dsn, n, args.reads))
        finally:
            for c in held:
                c.close()
            pg.cleanup()
    print(f"\nPostgreSQL {version}: server ms (execution + planning, pg_stat_statements) per health read,")
    print("averaged over reads at the daemon's mix (every 15 s; see above), and the full read alone")
    print(f"  {'targets':>7} {'avg read':>9} {'full read':>10} {'wall p50':>9} {'full wall p50':>14} "
          f"{'history/target':>15}")
    for r in results:
        print(f"  {r['targets']:>7} {r['read_server_ms']:>9.2f} {r['full_server_ms']:>10.2f} "
              f"{r['read_wall_ms_p50']:>9.2f} {r['full_wall_ms_p50']:>14.2f} {r['history_server_ms_per_target']:>15.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
