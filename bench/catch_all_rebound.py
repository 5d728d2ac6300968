"""How long re-bounding a full high catch-all holds ``jobs_completed`` (SPEC 8.1). Not a test: a
person runs it and reads the figures. The server is private and durable (fsync, synchronous_commit
and full_page_writes on), or MAINTD_BENCH_DATABASE_URL.

    python bench/catch_all_rebound.py                     # 1,000,000 rows in jobs_completed_max
    python bench/catch_all_rebound.py --rows 3000000
    python bench/catch_all_rebound.py --cold --drop-os-cache   # the catch-all read from disk (root)

No leader made partitions for ``--hours`` hours: ``--rows`` completions of that time are in the
high catch-all, with two rows beyond (``'infinity'`` and a month ahead). One call of
``maintain_partitions`` (as the partitioner's last try makes it: ``p_lock_wait_ms`` 1000) makes
the catch-all the partition of its range and makes the partitions ahead. Meanwhile a worker
completes jobs one after another (each an UPDATE moving a row into ``jobs_completed``). Printed:
the call's time, how long it held ``jobs_completed``'s ACCESS EXCLUSIVE lock (from when a poller
every 2 ms first saw it granted to the call's commit), and the completions' waits (the longest,
and how many took over 100 ms).
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
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg  # noqa: E402

from maintd import migrate  # noqa: E402
from maintd.db import make_engine  # noqa: E402
from maintd.jobs import JobQueue  # noqa: E402
from sqlalchemy import text  # noqa: E402

SCHEMA = "bench_rebound"
WORKER_JOBS = 20_000  # claimed up front: the worker completes them during the call


@contextmanager
def bench_server() -> Iterator[tuple[str, object]]:
    """(its address, the embedded server or None)."""
    url = os.environ.get("MAINTD_BENCH_DATABASE_URL")
    if url:
        yield url, None
        return
    from maintd.embedded import EmbeddedPostgres

    pg = EmbeddedPostgres(settings={"shared_buffers": "512MB", "max_wal_size": "8GB", "fsync": "on",
                                    "synchronous_commit": "on", "full_page_writes": "on"}).start()
    try:
        yield pg.dsn, pg
    finally:
        pg.cleanup()


def prepare(url: str, rows: int, hours: int) -> None:
    """A fresh partitioned schema whose completed partitions stop ``hours`` hours ago, and the
    burst since then in the high catch-all."""
    engine = make_engine(url, application_name="bench")
    q = f'"{SCHEMA}"'
    with engine.connect() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {q} CASCADE"))
        conn.commit()
        migrate.upgrade(conn, SCHEMA, layout=migrate.Layout("partitioned", timedelta(hours=1), 24))
        conn.commit()
    with engine.begin() as conn:
        for (name,) in conn.execute(text(f"SELECT partition_name FROM {q}.job_partitions('completed')")).all():
            conn.execute(text(f"ALTER TABLE {q}.jobs_completed DETACH PARTITION {q}.{name}"))
            conn.execute(text(f"DROP TABLE {q}.{name}"))
        conn.execute(text(f"SELECT {q}.start_partitions('completed', interval '1 hour', "
                          f"date_trunc('hour', now()) - make_interval(hours => :h))"), {"h": hours})
        conn.execute(text(f"INSERT INTO {q}.jobs (kind, queue, state, attempt, attempted_at, finalized_at) "
                          "SELECT 'done', 'work', 'completed', 1, now() - interval '1 minute' * g / 1000, "
                          "date_trunc('hour', now()) - make_interval(hours => :h) "
                          "+ (g % (:h * 3600)) * interval '1 second' + interval '1 millisecond' "
                          "FROM generate_series(1, :n) AS g"), {"n": rows, "h": hours})
        conn.execute(text(f"INSERT INTO {q}.jobs (kind, queue, state, finalized_at) VALUES "
                          "('done', 'work', 'completed', 'infinity'), "
                          "('done', 'work', 'completed', now() + interval '30 days')"))
        conn.execute(text(f"INSERT INTO {q}.jobs (kind, queue) SELECT 'work', 'work' FROM generate_series(1, :n)"),
                     {"n": WORKER_JOBS})
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"VACUUM ANALYZE {q}.jobs")
        conn.execute("CHECKPOINT")
    engine.dispose()


def worker(url: str, stop: threading.Event, waits: list[tuple[float, float]]) -> None:
    """Claims and completes jobs one at a time until ``stop``: (start, seconds) of each completion."""
    engine = make_engine(url, application_name="bench")
    queue = JobQueue(SCHEMA)
    with engine.begin() as conn:
        jobs = queue.claim(conn, "work", "bench", WORKER_JOBS)
    for job in jobs:
        if stop.is_set():
            break
        started = time.monotonic()
        with engine.begin() as conn:
            assert queue.complete(conn, job)
        waits.append((started, time.monotonic() - started))
        time.sleep(0.002)
    engine.dispose()


def lock_poller(url: str, pid: int, stop: threading.Event, seen: list[float]) -> None:
    """The first moment the call's session is seen holding jobs_completed's ACCESS EXCLUSIVE lock."""
    with psycopg.connect(url, autocommit=True) as conn:
        while not stop.is_set():
            held = conn.execute("SELECT EXISTS (SELECT FROM pg_locks WHERE pid = %s AND granted "
                                "AND mode = 'AccessExclusiveLock' AND relation = to_regclass(%s))",
                                (pid, f'"{SCHEMA}".jobs_completed')).fetchone()[0]
            if held and not seen:
                seen.append(time.monotonic())
            time.sleep(0.002)


def measure(url: str) -> dict:
    q = f'"{SCHEMA}"'
    waits: list[tuple[float, float]] = []
    seen: list[float] = []
    stop = threading.Event()
    with psycopg.connect(url) as conn:
        pid = conn.info.backend_pid
        threads = [threading.Thread(target=worker, args=(url, stop, waits)),
                   threading.Thread(target=lock_poller, args=(url, pid, stop, seen))]
        for t in threads:
            t.start()
        time.sleep(1.0)  # the worker's rate before
        started = time.monotonic()
        rows = conn.execute(f"SELECT action, partition_name, row_count FROM {q}.maintain_partitions("
                            "'completed', interval '1 hour', now() + interval '24 hours', NULL, 1000)").fetchall()
        conn.commit()
        ended = time.monotonic()
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join()
    during = [w for s, w in waits if started <= s <= ended] + \
        [w for s, w in waits if s < started and s + w > started]
    return {"call": ended - started, "held": ended - seen[0] if seen else 0.0,
            "max_wait": max(w for _, w in waits), "slow": sum(1 for _, w in waits if w > 0.1),
            "completions_during": len(during),
            "actions": sorted({r[0] for r in rows}), "closed": [r[1] for r in rows if r[0] == "closed"],
            "moved": [r[2] for r in rows if r[0] == "moved"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--hours", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--cold", action="store_true",
                        help="restart the embedded server before the call (its shared buffers empty)")
    parser.add_argument("--drop-os-cache", action="store_true",
                        help="and empty the OS page cache (root: writes /proc/sys/vm/drop_caches)")
    args = parser.parse_args()
    with bench_server() as (url, pg):
        with psycopg.connect(url, autocommit=True) as conn:
            print("server", conn.execute("SHOW server_version").fetchone()[0])
        for k in range(args.repeat):
            prepare(url, args.rows, args.hours)
            with psycopg.connect(url, autocommit=True) as conn:
                size = conn.execute(f"SELECT pg_size_pretty(pg_total_relation_size('\"{SCHEMA}\".jobs_completed_max'))"
                                    ).fetchone()[0]
            if args.cold and pg is not None:
                pg.restart()
            if args.drop_os_cache:
                os.sync()
                Path("/proc/sys/vm/drop_caches").write_text("1\n")
            m = measure(url)
            print(f"{'cold' if args.cold or args.drop_os_cache else 'warm'} rows {args.rows:>10,}  catch-all {size:>8}  call {m['call']:6.2f} s  "
                  f"jobs_completed held {m['held']:6.2f} s  longest completion {m['max_wait']:6.2f} s  "
                  f"completions > 100 ms {m['slow']}  actions {m['actions']} moved {m['moved']}")


if __name__ == "__main__":
    main()
