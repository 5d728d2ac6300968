"""``maintd demo``: an embedded PostgreSQL, two daemons (real ``maintd run`` processes) with short
intervals, and a live workload in which every service has something to do. Midway the leader is
killed with SIGKILL and the other daemon takes over; around it a "report" holds a snapshot open
for 20 s, and the daemons' guardian names it (their warning line is printed). Prints a summary
every few seconds.

No process outlives the demo, whatever fails: the daemons and the server get a parent-death
signal (``PR_SET_PDEATHSIG``: SIGKILL for the daemons, PostgreSQL's immediate shutdown for the
server), each daemon runs in a process group of its own that the demo kills as a whole, and every
exit path (a daemon that cannot start, Ctrl-C, SIGTERM, SIGHUP, an error) stops what was started.
The daemons run in the demo's own temporary directory, so a ``maintd/`` folder in the directory the
demo is started from cannot shadow the installed package (``python -m`` puts the working
directory first on ``sys.path``)."""

from __future__ import annotations

import ctypes
import functools
import os
import random
import secrets
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path

from sqlalchemy import Engine

from .db import make_engine
from .jobs import JobQueue
from .queries import JOB_STATES, jobs, sql

PR_SET_PDEATHSIG = 1
QUEUES = ("default", "mail")
NAMES = ("demo-a", "demo-b")
FIRST_KILL = 30.0  # seconds: when the leader is killed if the demo runs until Ctrl-C
HOLD_AT = 45.0  # seconds: when the report's snapshot is taken if the demo runs until Ctrl-C
HOLD_FOR = 20.0  # seconds the report holds its snapshot (the horizon) open
GUARDIAN = re.compile(r"vacuum is held back.*$", re.M)
CONFIG = """\
database_url = "{dsn}"
schema = "maintd"

[http]
listen = "{listen}"

[log]
level = "info"

[leader]
lease = "10s"
renew_interval = "2s"
retry_interval = "1s"

[cleaner]
interval = "5s"
completed_retention = "20s"
cancelled_retention = "20s"
discarded_retention = "1m"

[rescuer]
interval = "3s"
rescue_stuck_jobs_after = "8s"

[scheduler]
interval = "1s"

[health]
interval = "2s"
xmin_warn_after = "8s"

[[periodic]]
id = "demo-heartbeat"
schedule = "@every 5s"
kind = "demo.heartbeat"
backfill = "1m"

[[periodic]]
id = "demo-minutely"
schedule = "* * * * *"
kind = "demo.report"
run_on_start = true
"""
COUNTERS = {  # the summary's name -> the metric families summed over all their series
    "cleaner deleted": "maintd_jobs_deleted", "rescuer rescued": "maintd_jobs_rescued",
    "scheduler promoted": "maintd_jobs_promoted", "periodic enqueued": "maintd_periodic_enqueued"}


class Workload:
    """Producers and workers using the public helpers, like an application would: most jobs
    complete, some fail and are retried, ``demo.poison`` jobs always fail (discarded once out of
    attempts), some scheduled jobs are cancelled, and a few workers die holding their job."""

    def __init__(self, engine: Engine, schema: str, stop: threading.Event, seed: int = 1):
        self.engine, self.q, self.stop = engine, JobQueue(schema), stop
        self.rng = random.Random(seed)
        self.counts = {"enqueued": 0, "completed": 0, "failed": 0, "discarded": 0, "cancelled": 0, "crashed": 0}
        self.lock = threading.Lock()

    def bump(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1

    def producer(self) -> None:
        while not self.stop.wait(0.25):
            with self.engine.begin() as conn:
                for _ in range(3):
                    later = self.rng.random() < 0.25
                    kind = "demo.poison" if self.rng.random() < 0.05 else "demo.email"
                    job_id = self.q.enqueue(conn, kind, {"n": self.rng.randint(1, 999)},
                                            queue=self.rng.choice(QUEUES), max_attempts=2 if kind == "demo.poison" else 3,
                                            scheduled_at=datetime.now(timezone.utc) + timedelta(
                                                seconds=self.rng.uniform(2, 8)) if later else None)
                    self.bump("enqueued")
                    if later and self.rng.random() < 0.2 and self.q.cancel(conn, job_id):
                        self.bump("cancelled")  # the user changed their mind

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
                self.stop.wait(self.rng.uniform(0.01, 0.05))
                self.finish(job, self.rng.random())

    def finish(self, job, roll: float) -> None:
        if roll < 0.03:
            self.bump("crashed")  # never finishes: the rescuer will give it back
            return
        with self.engine.begin() as conn:
            if job.kind == "demo.poison" or roll < 0.15:
                outcome = self.q.fail(conn, job, "demo: simulated failure")
                self.bump("discarded" if outcome == "discarded" else "failed")
            else:
                self.q.complete(conn, job)
                self.bump("completed")


class DemoDaemon:
    """One ``maintd run`` process of the demo, its log file and its last /metrics reading."""

    def __init__(self, name: str, workdir: Path):
        self.name, self.log_path = name, workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.last: dict[str, float] = {}  # a killed daemon's counts stay in the totals
        self.leading = False

    def start(self, config: Path) -> None:
        env = {**os.environ, "MAINTD_INSTANCE_ID": self.name}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "maintd", "--config", str(config), "run"],
                                         stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=self.log_path.parent,
                                         preexec_fn=functools.partial(_bound_to_parent, os.getpid()))

    def error(self) -> str:
        """Why the daemon did not start: its ``maintd: error`` line, else its log's last lines."""
        text = self.log_path.read_text(errors="replace")
        found = re.findall(r"^maintd: (?:config )?error: .*$", text, re.M)
        return found[-1] if found else "its log:\n" + "\n".join(text.splitlines()[-20:])

    def wait_http(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"http listening address=\S+:(\d+)", self.log_path.read_text(errors="replace"))
            if m:
                self.port = int(m.group(1))
                return self.port
            if self.proc and self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"daemon {self.name} did not start: {self.error()}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def scrape(self) -> None:
        """Refresh ``last`` and ``leading`` from /metrics (kept as they were if it does not answer)."""
        if not self.alive or self.port is None:
            self.leading = False
            return
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return
        self.leading = bool(re.search(r"^maintd_is_leader\{[^}]*\} 1(\.0)?$", text, re.M))
        self.last = {label: sum(float(v) for v in re.findall(rf"^{family}_total\{{[^}}]*\}} (\S+)$", text, re.M))
                     for label, family in COUNTERS.items()}

    def kill(self) -> None:
        """SIGKILL to the daemon's whole process group (it leads one of its own)."""
        if self.proc is not None and self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.leading = False

    def stop(self) -> None:
        if self.alive:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def _bound_to_parent(demo_pid: int) -> None:
    """In a daemon, before exec: a process group of its own, and SIGKILL when the demo dies."""
    os.setpgid(0, 0)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != demo_pid:  # the demo died before prctl: nobody would send the signal
        os._exit(1)


def summary(daemons: list[DemoDaemon], engine: Engine, work: Workload, started: float) -> str:
    with engine.connect() as conn:
        counts = dict(conn.execute(sql(jobs.COUNT_BY_STATE, "maintd")).all())
    for d in daemons:
        d.scrape()
    states = " ".join(f"{s}={counts.get(s, 0)}" for s in JOB_STATES)
    leader = ",".join(d.name for d in daemons if d.leading) or "none"
    totals = "  ".join(f"{label}={sum(d.last.get(label, 0) for d in daemons):.0f}" for label in COUNTERS)
    return (f"[{time.monotonic() - started:5.0f}s] leader={leader} | jobs now: {states}\n"
            f"        {totals}  | workers " + " ".join(f"{k}={v}" for k, v in work.counts.items()))


def _seed(engine: Engine) -> None:
    """Old finished jobs (for the cleaner) and jobs of workers that died before the demo started
    (for the rescuer)."""
    with engine.begin() as conn:
        for state, age, n in (("completed", "1 hour", 400), ("cancelled", "2 hours", 50),
                              ("discarded", "8 days", 30), ("running", "1 hour", 5)):
            conn.execute(sql(jobs.DEMO_SEED_OLD, "maintd"), {"state": state, "age": age, "n": n})


class Report:
    """An analytics query that keeps a REPEATABLE READ snapshot open for ``HOLD_FOR`` seconds:
    while it does, vacuum cannot remove the jobs the workload finishes."""

    def __init__(self, dsn: str, stop: threading.Event):
        self.dsn, self.stop = dsn, stop
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._hold, name="demo-report", daemon=True)
        self.thread.start()

    def _hold(self) -> None:
        import psycopg

        with psycopg.connect(self.dsn, application_name="demo-report") as conn:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            conn.execute("SELECT count(*) FROM maintd.jobs")
            print(f"maintd demo: a report (pid {conn.info.backend_pid}, application demo-report) holds a "
                  f"snapshot open for {HOLD_FOR:.0f} s: vacuum cannot remove finished jobs meanwhile", flush=True)
            self.stop.wait(HOLD_FOR)
            conn.rollback()
        print("maintd demo: the report ended its snapshot", flush=True)


def _guardian_lines(daemons: list[DemoDaemon], seen: set[str]) -> list[str]:
    """The daemons' warning lines about a holder of the horizon not printed yet."""
    out = []
    for d in daemons:
        try:
            text = d.log_path.read_text(errors="replace")
        except OSError:
            continue
        for m in GUARDIAN.finditer(text):
            if m.group(0) not in seen:
                seen.add(m.group(0))
                out.append(f"maintd demo: guardian of {d.name}: {m.group(0)}")
    return out


def _kill_leader(daemons: list[DemoDaemon]) -> None:
    leader = next((d for d in daemons if d.leading and d.alive), None)
    if leader is None:
        return
    pid = leader.proc.pid
    leader.kill()
    others = ", ".join(d.name for d in daemons if d.alive)
    print(f"maintd demo: killed the leader {leader.name} (pid {pid}) with SIGKILL; {others} takes over",
          flush=True)


def _watch(daemons: list[DemoDaemon], engine: Engine, work: Workload, duration: float | None,
           stop: threading.Event, report: Report | None = None) -> None:
    """Print a summary every 3 s until ``duration`` ends, Ctrl-C or SIGTERM; kill the leader midway,
    and start the report's snapshot a fifth of the way (printing the guardian's lines)."""
    started = time.monotonic()
    deadline = started + duration if duration else None
    kill_at = started + (duration / 2 if duration else FIRST_KILL)
    hold_at = started + (duration / 5 if duration else HOLD_AT) if report is not None else None
    line, warned = None, set()
    try:
        while not stop.wait(3.0):
            if hold_at is not None and time.monotonic() >= hold_at:
                report.start()
                hold_at = None
            for warning in _guardian_lines(daemons, warned):
                print(warning, flush=True)
            if kill_at is not None and time.monotonic() >= kill_at:
                _kill_leader(daemons)
                kill_at = None
            line = summary(daemons, engine, work, started)
            print(line, flush=True)
            if deadline and time.monotonic() >= deadline:
                return
    except KeyboardInterrupt:
        pass
    if line is None:  # stopped before the first summary: print one (and only one) at the end
        print(summary(daemons, engine, work, started), flush=True)


def _start_daemons(dsn: str, listen: str, workdir: Path, daemons: list[DemoDaemon]) -> None:
    """Two daemons on one config, added to ``daemons`` as each starts (so that a failure stops the
    ones already running); the second listens on the next port (any free one with port 0)."""
    host, _, port = listen.rpartition(":")
    for i, name in enumerate(NAMES):
        config = workdir / f"{name}.toml"
        config.write_text(CONFIG.format(dsn=dsn, listen=f"{host}:{int(port) + i if int(port) else 0}"))
        daemon = DemoDaemon(name, workdir)
        daemons.append(daemon)
        daemon.start(config)
    for daemon in daemons:
        daemon.wait_http()


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM and SIGHUP end the demo as Ctrl-C does: through every ``finally``."""
    raise KeyboardInterrupt


def _stop_all(daemons: list[DemoDaemon]) -> None:
    """SIGTERM to every daemon at once (a graceful stop each), SIGKILL to the group of any that
    has not stopped 15 s later."""
    for d in daemons:
        if d.alive:
            d.proc.terminate()
    deadline = time.monotonic() + 15
    for d in daemons:
        if d.proc is None:
            continue
        try:
            d.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        d.kill()  # the whole group, even when the daemon itself has exited


def run_demo(duration: float | None = None, data_dir: str | None = None, listen: str = "127.0.0.1:9464") -> int:
    """``maintd demo``: a throwaway PostgreSQL, two daemons, a live workload and a failover."""
    from .embedded import EmbeddedPostgres, EmbeddedPostgresError

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    daemons: list[DemoDaemon] = []
    workdir = Path(tempfile.mkdtemp(prefix="maintd-demo-"))
    pg = None
    try:
        pg = EmbeddedPostgres(data_dir=data_dir, password=_password(data_dir))
        pg.start()
        return _run(pg, data_dir, listen, duration, workdir, daemons)
    except (EmbeddedPostgresError, RuntimeError) as exc:
        print(f"maintd: error: {exc}", file=sys.stderr)
        return 1
    finally:
        for s in previous:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(s, signal.SIG_IGN)
        _stop_all(daemons)
        if pg is not None:
            pg.cleanup() if not data_dir else pg.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _password(data_dir: str | None) -> str:
    """The demo server's superuser password: without one, any local user could connect over TCP
    as its superuser while it runs (and run programs as its user). Kept beside a --data-dir
    database (0600), which a later run reuses."""
    if data_dir is None:
        return secrets.token_urlsafe(18)
    kept = Path(data_dir) / "demo-password"
    if not kept.exists():
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        fd = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(18))
    return kept.read_text().strip()


def _run(pg, data_dir: str | None, listen: str, duration: float | None, workdir: Path,
         daemons: list[DemoDaemon]) -> int:
    from . import migrate

    stop = threading.Event()
    engine = make_engine(pg.dsn, application_name="maintd-demo-workload", pool_size=6)
    threads: list[threading.Thread] = []
    try:
        with engine.connect() as conn:
            migrate.upgrade(conn, "maintd")
        _seed(engine)
        _start_daemons(pg.dsn, listen, workdir, daemons)
        print(f"maintd demo: PostgreSQL {pg.dsn} (throwaway)" + (f", data in {data_dir}" if data_dir else ""))
        print("maintd demo: daemons " + ", ".join(f"{d.name} on http://127.0.0.1:{d.port}/metrics" for d in daemons)
              + " (/status, / for the dashboard); Ctrl-C to stop")
        work = Workload(engine, "maintd", stop)
        threads = [threading.Thread(target=work.producer, daemon=True)]
        threads += [threading.Thread(target=work.worker, args=(f"worker-{i}",), daemon=True) for i in range(3)]
        for t in threads:
            t.start()
        _watch(daemons, engine, work, duration, stop, Report(pg.dsn, stop))
        print("maintd demo: done")
        return 0
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        engine.dispose()
