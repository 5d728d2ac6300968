"""Failover time after SIGKILL and SIGSTOP of the leader (median of N): until a follower holds
the lock with a new term ("leads") and until its first pass is recorded ("pass"); and the idle
CPU/RSS of a leader and a follower. Not a test: a person runs it and reads the numbers.

    python bench/failover.py [--runs 5] [--idle-seconds 30]
"""

from __future__ import annotations

import argparse
import os
import signal
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from maintd import migrate  # noqa: E402
from maintd.db import make_engine  # noqa: E402
from maintd.embedded import EmbeddedPostgres  # noqa: E402
from tests.procs import DaemonProc, leader_row, wait_for, wait_new_leader  # noqa: E402


def proc_stats(pid: int) -> tuple[float, int]:
    """(cpu seconds, rss bytes) of a process from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return cpu, rss


def first_pass_by(dsn: str, instance: str, since: datetime) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT EXISTS (SELECT 1 FROM maintd.service_runs WHERE instance_id = %s "
                            "AND finished_at > %s)", (instance, since)).fetchone()[0]


def measure(dsn: str, mode: str, lease: str, runs: int, workdir: str) -> tuple[list[float], list[float]]:
    extra = {"leader": {"lease": lease, "renew_interval": "1s" if lease != "10s" else "2s",
                        "retry_interval": "1s"}}
    times, passes = [], []
    rng = random.Random(f"{mode} {lease}")  # reproducible moments per scenario
    for run in range(runs):
        procs = {f"{mode}{run}{i}": DaemonProc(dsn, "maintd", f"{mode}{run}{i}", extra, workdir=workdir).start()
                 for i in range(2)}
        try:
            wait_for(lambda: leader_row(dsn, "maintd")[1] in procs, 20, what="a leader")
            # At a random moment of the follower's retry cycle: a fixed delay would measure one
            # phase of it (always just before, or just after, the follower's next try).
            time.sleep(1.0 + rng.uniform(0, 1.0))
            epoch, inst = leader_row(dsn, "maintd")
            t0, killed_at = time.monotonic(), datetime.now(timezone.utc)
            procs[inst].signal(signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
            _, new = wait_new_leader(dsn, "maintd", epoch, 60)
            times.append(time.monotonic() - t0)
            wait_for(lambda: first_pass_by(dsn, new, killed_at), 30, interval=0.01, what="a pass")
            passes.append(time.monotonic() - t0)
        finally:
            for p in procs.values():
                p.stop()
    return times, passes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--idle-seconds", type=float, default=30)
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="maintd-failover-")
    with EmbeddedPostgres() as pg:
        engine = make_engine(pg.dsn, application_name="bench", pooled=False)
        with engine.connect() as conn:
            migrate.upgrade(conn, "maintd")
        engine.dispose()
        print(f"{'scenario (retry_interval 1s)':<34} {'leads: median':>13} {'min':>6} {'max':>6}"
              f" {'pass: median':>13} {'max':>6}   (seconds, {args.runs} runs)")
        for mode, lease in (("kill", "10s"), ("kill", "3s"), ("stop", "10s"), ("stop", "3s")):
            t, f = measure(pg.dsn, mode, lease, args.runs, workdir)
            label = f"SIGKILL leader (lease {lease})" if mode == "kill" else f"SIGSTOP leader (lease {lease})"
            print(f"{label:<34} {statistics.median(t):>13.2f} {min(t):>6.2f} {max(t):>6.2f}"
                  f" {statistics.median(f):>13.2f} {max(f):>6.2f}", flush=True)

        procs = [DaemonProc(pg.dsn, "maintd", f"idle{i}", {}, workdir=workdir).start() for i in range(2)]
        try:
            wait_for(lambda: leader_row(pg.dsn, "maintd")[1] is not None, 20, what="a leader")
            time.sleep(3)
            before = {p.instance_id: proc_stats(p.pid) for p in procs}
            time.sleep(args.idle_seconds)
            _, leader = leader_row(pg.dsn, "maintd")
            print(f"\nidle over {args.idle_seconds:.0f}s (empty queue, default intervals):")
            for p in procs:
                cpu0, _ = before[p.instance_id]
                cpu1, rss = proc_stats(p.pid)
                role = "leader" if p.instance_id == leader else "follower"
                print(f"  {role:<9} CPU {100 * (cpu1 - cpu0) / args.idle_seconds:5.2f} %   RSS {rss / 2**20:6.1f} MiB")
        finally:
            for p in procs:
                p.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
