"""Several targets per daemon (SPEC 7.9): T targets on R replicas against one PostgreSQL, versus
separate single-target processes. Not a test: a person runs it and reads the table.

    python bench/targets.py [--targets 200] [--replicas 3] [--separate 20] [--window 20]
    python bench/targets.py --one-database [--counts 1,40,200] [--window 60]

``--one-database`` (SPEC 8.3): one replica on one database, with 1, 40 and 200 targets side by
side in one run: its threads, idle CPU (and the ratio to one target's), the backends holding its
advisory locks, and its client connections. Goals: one backend holds every lock, at most 10
threads more than one target, idle CPU at most 5x one target's.

Measures, with the default leader settings (lease 10 s, renew 2 s, retry 1 s) and default
service intervals:
  * time from the start of the replicas to a stable spread (every target led, none above
    ceil(T/R) + 1, for 5 s) and the leaderships per replica;
  * CPU (% of one core) and RSS per replica idle, and while jobs come due in every target and old
    finished jobs wait for the cleaner;
  * connections per replica (lock sessions, maintenance pool), from pg_stat_activity;
  * failover: the time until every target of a SIGKILLed replica is led again, then (after a
    replacement replica joined and the spread settled) of a SIGSTOPped one;
  * ``--separate`` single-target processes (one replica each, each leading its own target), CPU,
    RSS and connections each, extrapolated to T targets x R replicas (the deployment the issue
    describes: one maintd deployment per schema).
The "floor" column is the physical minimum: one process per replica, and one session per replica
(a session can hold the advisory locks of every target on its database).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from maintd import migrate  # noqa: E402
from maintd.db import make_engine  # noqa: E402
from maintd.embedded import EmbeddedPostgres  # noqa: E402
from tests.procs import DaemonProc, spread_ok  # noqa: E402
from tests.procs import target_leaders as leaders  # noqa: E402

from bench.failover import proc_stats  # noqa: E402

STABLE = 5.0
# The defaults, written out: DaemonProc's config starts from the tests' fast leader settings
# (lease 3 s), which an empty section would keep.
DEFAULT_LEADER = {"lease": "10s", "renew_interval": "2s", "retry_interval": "1s"}


def schema_names(n: int) -> list[str]:
    return [f"tenant_{i:03d}" for i in range(n)]


def migrate_all(dsn: str, schemas: list[str]) -> float:
    t0 = time.monotonic()
    engine = make_engine(dsn, application_name="bench-migrate", pooled=False)
    with engine.connect() as conn:
        for s in schemas:
            migrate.upgrade(conn, s)
    engine.dispose()
    return time.monotonic() - t0


def connections(dsn: str) -> Counter:
    """Sessions per application_name."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return Counter({app: n for app, n in conn.execute(
            "SELECT application_name, count(*) FROM pg_stat_activity WHERE application_name LIKE 'maintd:%' "
            "GROUP BY 1")})


def per_replica_connections(dsn: str, names: list[str]) -> dict[str, tuple[int, int]]:
    c = connections(dsn)
    return {n: (c.get(f"maintd:{n}", 0), c.get(f"maintd:{n}:work", 0)) for n in names}


def spread_line(dsn: str, schemas: list[str]) -> str:
    led = leaders(dsn, schemas)
    return f"led {len(led)}/{len(schemas)}: " + ", ".join(f"{n} {c}" for n, c in sorted(Counter(led.values()).items()))


def wait_stable(check, timeout: float, progress=None) -> tuple[float, object]:
    """(seconds until ``check()`` first held for good, its value), good = held for STABLE s;
    ``progress()`` returns a line printed (to stderr) every 5 s meanwhile."""
    t0 = time.monotonic()
    since, value, shown = None, None, t0
    while time.monotonic() - t0 < timeout:
        value = check()
        now = time.monotonic()
        if progress is not None and now - shown >= 5:
            shown = now
            print(f"  {now - t0:5.0f}s {progress()}", file=sys.stderr, flush=True)
        since = (since or now) if value else None
        if since is not None and now - since >= STABLE:
            return since - t0, value
        time.sleep(0.2)
    raise SystemExit(f"no stable spread after {timeout}s")


def wait_all_led(dsn: str, schemas: list[str], by: list[str], timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        led = leaders(dsn, schemas)
        if len(led) == len(schemas) and set(led.values()) <= set(by):
            return time.monotonic() - t0
        time.sleep(0.05)
    return float("nan")


def cpu_rss(procs: list[DaemonProc], seconds: float) -> list[tuple[float, float]]:
    """(CPU % of one core, RSS MiB) per process over ``seconds``."""
    before = [proc_stats(p.pid)[0] for p in procs]
    time.sleep(seconds)
    after = [proc_stats(p.pid) for p in procs]
    return [(100 * (a[0] - b) / seconds, a[1] / 2**20) for a, b in zip(after, before)]


def add_work(dsn: str, schemas: list[str], seconds: float, due: int, old: int) -> None:
    """In every target: ``due`` jobs coming due over ``seconds``, ``old`` finished 2 days ago."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for s in schemas:
            conn.execute(f'INSERT INTO "{s}".jobs (kind, state, scheduled_at) SELECT \'k\', \'scheduled\', '
                         f"now() + random() * interval '{seconds} seconds' FROM generate_series(1, {due})")
            conn.execute(f'INSERT INTO "{s}".jobs (kind, state, finalized_at) SELECT \'k\', \'completed\', '
                         f"now() - interval '2 days' FROM generate_series(1, {old})")


def start_replicas(dsn: str, schemas: list[str], names: list[str], workdir: str) -> list[DaemonProc]:
    config = {"targets": [{"schema": s} for s in schemas], "leader": DEFAULT_LEADER,
              "log": {"level": "warning"}}
    return [DaemonProc(dsn, "unused", n, config, workdir=workdir).start() for n in names]


def run_multi(dsn: str, schemas: list[str], args: argparse.Namespace, workdir: str) -> dict:
    out: dict = {}
    names = [f"r{i}" for i in range(args.replicas)]
    procs = start_replicas(dsn, schemas, names, workdir)
    try:
        out["spread_s"], per = wait_stable(lambda: spread_ok(dsn, schemas, names), 300,
                                           lambda: spread_line(dsn, schemas))
        out["per_replica"] = [per.get(n, 0) for n in names]
        out["idle"] = cpu_rss(procs, args.window)
        out["conns_idle"] = per_replica_connections(dsn, names)
        add_work(dsn, schemas, args.window, args.due, args.old)
        peak: dict[str, tuple[int, int]] = {}
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.5):
                for n, (lock, work) in per_replica_connections(dsn, names).items():
                    peak[n] = (max(lock, peak.get(n, (0, 0))[0]), max(work, peak.get(n, (0, 0))[1]))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        out["work"] = cpu_rss(procs, args.window)
        stop.set()
        sampler.join()
        out["conns_work"] = peak
        with psycopg.connect(dsn, autocommit=True) as conn:
            out["left_due"] = sum(conn.execute(
                f"SELECT count(*) FROM \"{s}\".jobs WHERE state = 'scheduled' AND scheduled_at < now() - interval '5 seconds'"
            ).fetchone()[0] for s in schemas)
            out["left_old"] = sum(conn.execute(
                f"SELECT count(*) FROM \"{s}\".jobs WHERE state = 'completed'").fetchone()[0] for s in schemas)
        # SIGKILL the replica leading the most; time until its targets are led by the others.
        victim = procs[max(range(len(names)), key=lambda i: per.get(names[i], 0))]
        victim.kill()
        alive = [n for n in names if n != victim.instance_id]
        out["kill_s"] = wait_all_led(dsn, schemas, alive, 120)
        # A replacement joins; once the spread is stable again, SIGSTOP the busiest replica.
        procs += start_replicas(dsn, schemas, [f"r{args.replicas}"], workdir)
        names = alive + [f"r{args.replicas}"]
        out["rejoin_s"], per = wait_stable(lambda: spread_ok(dsn, schemas, names), 300,
                                           lambda: spread_line(dsn, schemas))
        frozen = next(p for p in procs if p.instance_id == max(names, key=lambda n: per.get(n, 0)))
        frozen.kill(signal.SIGSTOP)
        out["stop_s"] = wait_all_led(dsn, schemas, [n for n in names if n != frozen.instance_id], 120)
        frozen.signal(signal.SIGCONT)
    finally:
        for p in procs:
            p.stop()
    return out


def run_separate(dsn: str, schemas: list[str], args: argparse.Namespace, workdir: str) -> dict:
    """``--separate`` single-target processes, each leading its own target."""
    procs = [DaemonProc(dsn, s, f"s{i}", {"leader": DEFAULT_LEADER, "log": {"level": "warning"}}, workdir=workdir).start()
             for i, s in enumerate(schemas[:args.separate])]
    try:
        deadline = time.monotonic() + 120
        while len(leaders(dsn, schemas[:args.separate])) < args.separate and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)
        idle = cpu_rss(procs, args.window)
        c = connections(dsn)
        conns = [c.get(f"maintd:s{i}", 0) + c.get(f"maintd:s{i}:work", 0) for i in range(args.separate)]
    finally:
        for p in procs:
            p.stop()
    return {"idle": idle, "conns": conns}


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def lock_backends(dsn: str, instance: str) -> int:
    """Backends of this replica holding advisory locks."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT count(DISTINCT l.pid) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                            "WHERE l.locktype = 'advisory' AND a.application_name = %s",
                            (f"maintd:{instance}",)).fetchone()[0]


def run_one_database(dsn: str, schemas: list[str], counts: list[int], window: float, workdir: str) -> None:
    """One replica per count, one after the other on the same server; each measured once all its
    targets are led and it has settled."""
    rows = []
    for n in counts:
        name = f"one{n}"
        config = {"targets": [{"schema": s} for s in schemas[:n]], "leader": DEFAULT_LEADER,
                  "log": {"level": "warning"}}
        proc = DaemonProc(dsn, "unused", name, config, workdir=workdir).start()
        try:
            wait_all_led(dsn, schemas[:n], [name], 120)
            time.sleep(10)  # the first passes of every term, and the pools' first connections
            (cpu, rss), = cpu_rss([proc], window)
            conns = sum(v for k, v in connections(dsn).items() if k == f"maintd:{name}" or k.startswith(f"maintd:{name}:"))
            rows.append((n, threads(proc.pid), cpu, rss, lock_backends(dsn, name), conns))
        finally:
            proc.stop()
    base = rows[0]
    print(f"\none replica, one database, idle ({window:.0f} s windows, default settings)")
    print(f"{'targets':>8}{'threads':>9}{'+threads':>10}{'CPU %':>8}{'x one':>7}{'RSS MiB':>9}{'lock backends':>15}{'connections':>13}")
    for n, th, cpu, rss, backends, conns in rows:
        print(f"{n:>8}{th:>9}{th - base[1]:>10}{cpu:>8.2f}{cpu / max(base[2], 1e-9):>7.1f}{rss:>9.0f}"
              f"{backends:>15}{conns:>13}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", type=int, default=200)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--separate", type=int, default=20, help="single-target processes to run (extrapolated)")
    ap.add_argument("--window", type=float, default=20.0, help="seconds of each CPU measurement")
    ap.add_argument("--due", type=int, default=50, help="jobs coming due per target in the work window")
    ap.add_argument("--old", type=int, default=200, help="old finished jobs per target for the cleaner")
    ap.add_argument("--max-connections", type=int, default=1000)
    ap.add_argument("--one-database", action="store_true", help="one replica with 1, 40, 200 targets (SPEC 8.3)")
    ap.add_argument("--counts", default="1,40,200", help="target counts of --one-database")
    args = ap.parse_args()
    if args.one_database:
        args.targets = max(int(c) for c in args.counts.split(","))
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))  # stop the replicas on the way out
    schemas = schema_names(args.targets)
    workdir = tempfile.mkdtemp(prefix="bench-targets-")
    with EmbeddedPostgres(settings={"max_connections": str(args.max_connections)}) as pg:
        with psycopg.connect(pg.dsn) as conn:
            version = conn.execute("SHOW server_version").fetchone()[0]
        took = migrate_all(pg.dsn, schemas)
        print(f"PostgreSQL {version}, max_connections={args.max_connections}; {args.targets} targets migrated "
              f"in {took:.1f}s; {os.cpu_count()} cores", flush=True)
        if args.one_database:
            run_one_database(pg.dsn, schemas, [int(c) for c in args.counts.split(",")], args.window, workdir)
            return 0
        multi = run_multi(pg.dsn, schemas, args, workdir)
        sep = run_separate(pg.dsn, schemas, args, workdir)
    report(args, multi, sep)
    return 0


def report(args: argparse.Namespace, m: dict, s: dict) -> None:
    T, R = args.targets, args.replicas
    cap = math.ceil(T / R) + 1
    print(f"\n{T} targets on {R} replicas (cap ceil(T/R)+1 = {cap}), default leader settings")
    print(f"  stable spread after {m['spread_s']:.1f}s; leaderships per replica {m['per_replica']}")
    print(f"  after SIGKILL of a replica: its targets led again in {m['kill_s']:.2f}s "
          f"(retry_interval 1s); a replacement joined and the spread was stable in {m['rejoin_s']:.1f}s")
    print(f"  after SIGSTOP of a replica: its targets led again in {m['stop_s']:.2f}s (lease 10s)")
    print(f"  work window: {args.due} due + {args.old} old jobs per target; left after it: "
          f"{m['left_due']} overdue, {m['left_old']} old (cleaner interval 30s)")
    idle_cpu = [c for c, _ in m["idle"]]
    work_cpu = [c for c, _ in m["work"]]
    rss = [r for _, r in m["work"]]
    locks = [m["conns_idle"][n][0] for n in m["conns_idle"]]
    work_conns = [v[1] for v in m["conns_work"].values()] or [0]
    print(f"\n{'per replica':<34}{'min':>9}{'median':>9}{'max':>9}")
    for label, vals in (("CPU idle (% of a core)", idle_cpu), ("CPU with work (% of a core)", work_cpu),
                        ("RSS (MiB)", rss), ("lock sessions", locks), ("work connections (peak)", work_conns)):
        print(f"{label:<34}{min(vals):>9.1f}{statistics.median(vals):>9.1f}{max(vals):>9.1f}")
    sep_cpu = statistics.median(c for c, _ in s["idle"])
    sep_rss = statistics.median(r for _, r in s["idle"])
    sep_conn = statistics.median(s["conns"])
    total_multi = {"cpu": sum(idle_cpu), "rss": sum(r for _, r in m["idle"]),
                   "conns": sum(locks) + sum(v[1] for v in m["conns_idle"].values())}
    total_sep = {"cpu": sep_cpu * T * R, "rss": sep_rss * T * R, "conns": sep_conn * T * R}
    floor_conns = R
    print(f"\nidle, all replicas of all {T} targets{'':<8}{'multi':>12}{'separate':>12}{'saved':>8}{'floor':>10}")
    print(f"{'processes':<43}{R:>12}{T * R:>12}{T * R / R:>7.0f}x{R:>10}")
    print(f"{'CPU (% of a core)':<43}{total_multi['cpu']:>12.1f}{total_sep['cpu']:>12.1f}"
          f"{total_sep['cpu'] / max(total_multi['cpu'], 1e-9):>7.1f}x{'':>10}")
    print(f"{'RSS (MiB)':<43}{total_multi['rss']:>12.0f}{total_sep['rss']:>12.0f}"
          f"{total_sep['rss'] / total_multi['rss']:>7.1f}x{'':>10}")
    print(f"{'connections':<43}{total_multi['conns']:>12.0f}{total_sep['conns']:>12.0f}"
          f"{total_sep['conns'] / total_multi['conns']:>7.1f}x{floor_conns:>10}")
    print(f"(separate: {args.separate} single-target processes measured, one replica each: CPU "
          f"{sep_cpu:.2f} %, RSS {sep_rss:.1f} MiB, {sep_conn:.0f} connections each; times {T * R})")
    print(f"connections / floor (one session per replica): multi "
          f"{total_multi['conns'] / floor_conns:.2f}x, separate {total_sep['conns'] / floor_conns:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
