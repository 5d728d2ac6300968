"""Load and soak: jobs flowing through worker processes with maintd off, then on (all services,
short intervals); claim throughput and p99 in both; maintd's CPU and RSS sampled over the soak.

    python bench/soak.py                 # 1,000,000 jobs, 10-minute soak
    python bench/soak.py --short         # ~1 minute (used by tests/test_soak_short.py)

Prints one JSON line at the end (for the test) after the human-readable table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.failover import proc_stats  # noqa: E402
from maintd import migrate  # noqa: E402
from maintd.db import make_engine
from maintd.queries import sql  # noqa: E402
from maintd.embedded import EmbeddedPostgres  # noqa: E402
from maintd.jobs import JobQueue  # noqa: E402
from tests.procs import DaemonProc, leader_row, wait_for  # noqa: E402


def worker(dsn: str, seconds: float, batch: int, out: "mp.Queue", refill: bool = False) -> None:
    """Claim and complete as fast as possible; with ``refill`` enqueue one new job per completed
    one, so the flow never runs dry during a long soak."""
    engine = make_engine(dsn, application_name="soak-worker", pool_size=1)
    q = JobQueue("maintd")
    lat, done = [], 0
    deadline = time.monotonic() + seconds
    name = f"w{mp.current_process().pid}"
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        with engine.begin() as conn:
            jobs = q.claim(conn, "default", name, batch)
            lat.append(time.perf_counter() - t0)
            for job in jobs:
                q.complete(conn, job)
                if refill:
                    q.enqueue(conn, "soak", {})
        done += len(jobs)
        if not jobs:
            time.sleep(0.01)
    engine.dispose()
    out.put((done, lat))


def run_workers(dsn: str, n: int, seconds: float, batch: int) -> tuple[float, float]:
    out: mp.Queue = mp.Queue()
    procs = [mp.Process(target=worker, args=(dsn, seconds, batch, out)) for _ in range(n)]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    done = sum(r[0] for r in results)
    lat = sorted(x for r in results for x in r[1])
    p99 = lat[int(0.99 * (len(lat) - 1))] if lat else 0.0
    return done / seconds, p99 * 1000


def seed(dsn: str, n: int) -> None:
    """The same starting point for each phase: n available jobs and nothing else."""
    engine = make_engine(dsn, application_name="soak-seed", pooled=False)
    with engine.begin() as conn:
        conn.execute(sql("TRUNCATE {schema}.jobs", "maintd"))
        conn.execute(sql("INSERT INTO {schema}.jobs (kind) SELECT 'soak' FROM generate_series(1, :n)", "maintd"),
                     {"n": n})
        conn.execute(sql("ANALYZE {schema}.jobs", "maintd"))
    engine.dispose()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    jobs, phase, soak, batch = (60_000, 8.0, 30.0, 10) if args.short else (1_000_000, 60.0, 600.0, 10)
    workdir = tempfile.mkdtemp(prefix="maintd-soak-")
    with EmbeddedPostgres() as pg:
        engine = make_engine(pg.dsn, application_name="soak", pooled=False)
        with engine.connect() as conn:
            migrate.upgrade(conn, "maintd")
        engine.dispose()
        seed(pg.dsn, jobs)
        off_rate, off_p99 = run_workers(pg.dsn, args.workers, phase, batch)
        extra = {"cleaner": {"interval": "2s", "completed_retention": "5s"}, "rescuer": {"interval": "2s"},
                 "scheduler": {"interval": "1s"},
                 "periodic": [{"id": "soak", "schedule": "@every 1s", "kind": "soak"}]}
        d = DaemonProc(pg.dsn, "maintd", "soak", extra, workdir=workdir).start()
        try:
            wait_for(lambda: leader_row(pg.dsn, "maintd")[1] == "soak", 20, what="leadership")
            seed(pg.dsn, jobs)
            on_rate, on_p99 = run_workers(pg.dsn, args.workers, phase, batch)
            # Soak: the workload keeps flowing while we sample maintd.
            samples = []
            out: mp.Queue = mp.Queue()
            flows = [mp.Process(target=worker, args=(pg.dsn, soak, batch, out, True))
                     for _ in range(args.workers)]
            for flow in flows:
                flow.start()
            t_end = time.monotonic() + soak
            while time.monotonic() < t_end:
                samples.append((time.monotonic(), *proc_stats(d.pid)))
                time.sleep(min(5.0, soak / 10))
            soak_jobs = sum(out.get()[0] for _ in flows)
            for flow in flows:
                flow.join()
        finally:
            d.stop()
    loss = 1 - on_rate / off_rate if off_rate else 0.0
    rss = [s[2] / 2**20 for s in samples]
    cpu = (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0]) * 100
    half = len(rss) // 2
    print(f"jobs seeded per phase {jobs:,}, {args.workers} worker processes, claim batch {batch}")
    print(f"maintd off: {off_rate:8,.0f} jobs/s   claim p99 {off_p99:6.2f} ms")
    print(f"maintd on:  {on_rate:8,.0f} jobs/s   claim p99 {on_p99:6.2f} ms   throughput loss {100 * loss:.1f} %")
    print(f"soak {soak:.0f}s: {soak_jobs:,} jobs through the workers; maintd CPU {cpu:.1f} %, RSS first {rss[0]:.1f} MiB, max {max(rss):.1f} MiB, "
          f"last {rss[-1]:.1f} MiB (first-half mean {statistics.mean(rss[:half] or rss):.1f}, "
          f"second-half mean {statistics.mean(rss[half:]):.1f})")
    print(json.dumps({"off_rate": off_rate, "on_rate": on_rate, "loss": loss, "off_p99_ms": off_p99,
                      "on_p99_ms": on_p99, "soak_jobs": soak_jobs, "rss_mib": rss, "cpu_percent": cpu}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
