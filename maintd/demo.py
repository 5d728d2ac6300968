"""``maintd demo``: an embedded PostgreSQL, the daemon with short intervals, and a live workload in
which every service has something to do. Prints a summary every few seconds."""

from __future__ import annotations

import random
import signal
import sys
import threading
import time
from datetime import datetime, timedelta, timezone

from sqlalchemy import Engine

from .config import Settings
from .db import make_engine
from .jobs import JobQueue
from .queries import JOB_STATES, jobs, sql

QUEUES = ("default", "mail")
def demo_settings(dsn: str, listen: str) -> Settings:
    return Settings(
        database_url=dsn, schema="maintd", instance_id="demo",
        http={"listen": listen}, log={"level": "warning"},
        leader={"lease": "10s", "renew_interval": "2s", "retry_interval": "1s"},
        cleaner={"interval": "5s", "completed_retention": "20s", "cancelled_retention": "20s",
                 "discarded_retention": "1m"},
        rescuer={"interval": "3s", "rescue_stuck_jobs_after": "8s"},
        scheduler={"interval": "1s"},
        periodic=[
            {"id": "demo-heartbeat", "schedule": "@every 5s", "kind": "demo.heartbeat", "backfill": "1m"},
            {"id": "demo-minutely", "schedule": "* * * * *", "kind": "demo.report", "run_on_start": True},
        ],
    )


class Workload:
    """Producers and workers using the public helpers, like an application would."""

    def __init__(self, engine: Engine, schema: str, stop: threading.Event, seed: int = 1):
        self.engine, self.q, self.stop = engine, JobQueue(schema), stop
        self.rng = random.Random(seed)
        self.counts = {"enqueued": 0, "completed": 0, "failed": 0, "crashed": 0}
        self.lock = threading.Lock()

    def bump(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1

    def producer(self) -> None:
        while not self.stop.wait(0.25):
            with self.engine.begin() as conn:
                for _ in range(3):
                    later = self.rng.random() < 0.25
                    self.q.enqueue(conn, "demo.email", {"n": self.rng.randint(1, 999)},
                                   queue=self.rng.choice(QUEUES),
                                   scheduled_at=datetime.now(timezone.utc) + timedelta(seconds=self.rng.uniform(2, 8))
                                   if later else None, max_attempts=3)
                    self.bump("enqueued")

    def worker(self, name: str) -> None:
        while not self.stop.is_set():
            claimed = []
            for queue in QUEUES:
                with self.engine.begin() as conn:
                    claimed += self.q.claim(conn, queue, name, limit=4)
            if not claimed:
                self.stop.wait(0.2)
                continue
            for job in claimed:
                roll = self.rng.random()
                self.stop.wait(self.rng.uniform(0.01, 0.05))
                if roll < 0.03:
                    self.bump("crashed")  # never finishes: the rescuer will give it back
                    continue
                with self.engine.begin() as conn:
                    if roll < 0.15:
                        self.q.fail(conn, job, "demo: simulated failure")
                        self.bump("failed")
                    else:
                        self.q.complete(conn, job)
                        self.bump("completed")


def _metric(daemon, name: str, labels: dict | None = None) -> float:
    labels = {"target": daemon.metrics.target, **(labels or {})}
    return daemon.metrics.registry.get_sample_value(name, labels) or 0.0


def _sum(daemon, name: str, label: str, values) -> float:
    return sum(_metric(daemon, name, {label: v}) for v in values)


def summary(daemon, engine: Engine, work: Workload, started: float) -> str:
    with engine.connect() as conn:
        counts = dict(conn.execute(sql(jobs.COUNT_BY_STATE, "maintd")).all())
    states = " ".join(f"{s}={counts.get(s, 0)}" for s in JOB_STATES)
    deleted = _sum(daemon, "maintd_jobs_deleted_total", "state", ("completed", "cancelled", "discarded"))
    rescued = _sum(daemon, "maintd_jobs_rescued_total", "outcome", ("retried", "discarded"))
    promoted = _sum(daemon, "maintd_jobs_promoted_total", "queue", QUEUES)
    periodic = _sum(daemon, "maintd_periodic_enqueued_total", "periodic_id", ("demo-heartbeat", "demo-minutely"))
    role = "leader" if daemon.is_leader else "follower"
    return (f"[{time.monotonic() - started:5.0f}s] {role} | jobs {states}\n"
            f"        cleaner deleted={deleted:.0f}  rescuer rescued={rescued:.0f}  "
            f"scheduler promoted={promoted:.0f}  periodic enqueued={periodic:.0f}  | workers "
            + " ".join(f"{k}={v}" for k, v in work.counts.items()))


def _seed(engine: Engine) -> None:
    """Old finished jobs (for the cleaner) and jobs of workers that died before the demo started
    (for the rescuer)."""
    with engine.begin() as conn:
        for state, age, n in (("completed", "1 hour", 400), ("cancelled", "2 hours", 50),
                              ("discarded", "8 days", 30), ("running", "1 hour", 5)):
            conn.execute(sql(jobs.DEMO_SEED_OLD, "maintd"), {"state": state, "age": age, "n": n})


def _start_daemon(dsn: str, listen: str):
    from .daemon import Daemon

    daemon = Daemon(demo_settings(dsn, listen))
    try:
        daemon.start()
    except OSError:  # the port is taken: any free one will do
        daemon = Daemon(demo_settings(dsn, "127.0.0.1:0"))
        daemon.start()
    return daemon


def _watch(daemon, engine: Engine, work: Workload, duration: float | None, stop: threading.Event) -> None:
    """Print a summary every 3 s until ``duration`` ends, Ctrl-C or SIGTERM."""
    started = time.monotonic()
    deadline = started + duration if duration else None
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    try:
        while not stop.wait(3.0):
            daemon.tick()
            print(summary(daemon, engine, work, started), flush=True)
            if deadline and time.monotonic() >= deadline:
                break
    except KeyboardInterrupt:
        pass
    stop.set()
    print(summary(daemon, engine, work, started))


def run_demo(duration: float | None = None, data_dir: str | None = None, listen: str = "127.0.0.1:9464") -> int:
    """``maintd demo``: a throwaway PostgreSQL, the daemon and a live workload."""
    from . import migrate
    from .embedded import EmbeddedPostgres, EmbeddedPostgresError
    from .logs import setup_logging

    try:
        pg = EmbeddedPostgres(data_dir=data_dir).start()
    except EmbeddedPostgresError as exc:
        print(f"maintd: error: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    daemon = None
    engine = make_engine(pg.dsn, application_name="maintd-demo-workload", pool_size=6)
    try:
        with engine.connect() as conn:
            migrate.upgrade(conn, "maintd")
        _seed(engine)
        setup_logging("warning", "text")
        daemon = _start_daemon(pg.dsn, listen)
        print(f"maintd demo: PostgreSQL {pg.dsn} (throwaway)" + (f", data in {data_dir}" if data_dir else ""))
        print(f"maintd demo: metrics on http://127.0.0.1:{daemon.http_port}/metrics, status on /status;"
              " Ctrl-C to stop")
        work = Workload(engine, "maintd", stop)
        threads = [threading.Thread(target=work.producer, daemon=True)]
        threads += [threading.Thread(target=work.worker, args=(f"worker-{i}",), daemon=True) for i in range(3)]
        for t in threads:
            t.start()
        _watch(daemon, engine, work, duration, stop)
        for t in threads:
            t.join(5)
        print("maintd demo: done")
        return 0
    finally:
        stop.set()
        if daemon is not None:
            daemon.stop()
        engine.dispose()
        pg.cleanup() if not data_dir else pg.stop()
