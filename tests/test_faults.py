"""Fault injection over real processes and a real PostgreSQL, then invariants from the database.

3 daemons and 2 worker processes run for about a minute while we SIGKILL the leader, freeze it
(SIGSTOP/SIGCONT), kill maintd sessions with pg_terminate_backend, lock the jobs table (statement
timeouts), and restart PostgreSQL. Afterwards: nothing lost, no completion overwritten, every
periodic slot exactly once with no gap, and no two instances' maintenance transactions overlapping.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest

from maintd import migrate
from maintd.db import make_engine

from .procs import START, DaemonProc, leader_row, lock_holders, wait_for, wait_new_leader

pytestmark = pytest.mark.slow

AUDIT = """
CREATE TABLE maintd.fault_enqueued (id bigint PRIMARY KEY);
CREATE TABLE maintd.fault_completed (id bigint PRIMARY KEY);
CREATE TABLE maintd.fault_audit (app text, txid bigint, at timestamptz, op text);
CREATE FUNCTION maintd.fault_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF current_setting('application_name') LIKE 'maintd:%' THEN
    INSERT INTO maintd.fault_audit VALUES (current_setting('application_name'), txid_current(),
                                           clock_timestamp(), TG_OP);
  END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER fault_audit AFTER INSERT OR UPDATE OR DELETE ON maintd.jobs
  FOR EACH STATEMENT EXECUTE FUNCTION maintd.fault_audit();
INSERT INTO maintd.jobs (kind, state, finalized_at)
  SELECT 'old', 'completed', now() - interval '2 days' FROM generate_series(1, 3000);
"""

DAEMON = {
    "statement_timeout": "1s",
    "leader": {"lease": "3s", "renew_interval": "1s", "retry_interval": "0.2s"},
    "cleaner": {"interval": "1s", "batch_size": 200},
    "rescuer": {"interval": "1s", "rescue_stuck_jobs_after": "3s"},
    "scheduler": {"interval": "1s"},
    "periodic": [{"id": "beat", "schedule": "@every 1s", "kind": "beat", "queue": "periodic", "backfill": "2m"}],
}


def test_faults_keep_every_invariant(private_pg, tmp_path):
    dsn = private_pg.dsn
    engine = make_engine(dsn, application_name="t", pooled=False)
    with engine.connect() as conn:
        migrate.upgrade(conn, "maintd")
    engine.dispose()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(AUDIT)

    daemons = {f"f{i}": DaemonProc(dsn, "maintd", f"f{i}", DAEMON, workdir=str(tmp_path)).start() for i in range(3)}
    workers = [subprocess.Popen([sys.executable, str(Path(__file__).with_name("fault_worker.py")), dsn, "maintd",
                                 f"w{i}", "45"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                cwd=str(Path(__file__).resolve().parent.parent)) for i in range(2)]
    holders_seen: list[int] = []
    stop_sampling = threading.Event()

    def sample():
        while not stop_sampling.wait(0.1):
            try:
                holders_seen.append(len(lock_holders(dsn, "maintd")))
            except psycopg.Error:
                pass

    sampler = threading.Thread(target=sample)
    sampler.start()
    faults: list[str] = []
    rng = random.Random(3)

    def leader():
        epoch, inst = wait_for(lambda: (lambda r: r if r[1] else None)(leader_row(dsn, "maintd")), START,
                               what="a leader")
        return epoch, daemons[inst]

    try:
        time.sleep(4)
        first_epoch, _ = leader()
        # 1. SIGKILL the leader, bring it back.
        epoch, d = leader()
        d.kill()
        wait_new_leader(dsn, "maintd", epoch, 10)
        daemons[d.instance_id] = DaemonProc(dsn, "maintd", d.instance_id, DAEMON, workdir=str(tmp_path)).start()
        faults.append("sigkill leader")
        time.sleep(3)
        # 2. Freeze the leader past its lease, then let it resume (it must be fenced).
        epoch, d = leader()
        d.signal(signal.SIGSTOP)
        wait_new_leader(dsn, "maintd", epoch, 10)
        time.sleep(1)
        d.signal(signal.SIGCONT)
        faults.append("sigstop/sigcont leader")
        time.sleep(3)
        # 3. Kill random maintd sessions (lock session and pool connections).
        with psycopg.connect(dsn, autocommit=True) as conn:
            pids = [r[0] for r in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'maintd:%'")]
            for pid in rng.sample(pids, min(4, len(pids))):
                conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        faults.append("pg_terminate_backend x4")
        time.sleep(3)
        # 4. Lock contention long enough for statement timeouts.
        with psycopg.connect(dsn) as conn:
            conn.execute("LOCK TABLE maintd.jobs IN EXCLUSIVE MODE")
            time.sleep(2.5)
        faults.append("table lock / statement timeouts")
        time.sleep(3)
        # 5. PostgreSQL fast restart.
        private_pg.restart()
        faults.append("postgres restart")
        time.sleep(5)
        # 6. SIGKILL the leader once more.
        epoch, d = leader()
        d.kill()
        wait_new_leader(dsn, "maintd", epoch, 10)
        faults.append("sigkill leader")
        for w in workers:
            w.wait(60)

        def settled() -> bool:  # rescues, promotions and the cleaner caught up
            with psycopg.connect(dsn, autocommit=True) as conn:
                running, old = conn.execute(
                    "SELECT count(*) FILTER (WHERE kind = 'fault' AND state = 'running'), "
                    "count(*) FILTER (WHERE kind = 'old') FROM maintd.jobs").fetchone()
            return running <= 6 and old == 0

        time.sleep(2)
        wait_for(settled, 30, interval=0.5, what="rescues and the cleaner to settle")
    finally:
        stop_sampling.set()
        sampler.join()
        for w in workers:
            if w.poll() is None:
                w.kill()
        for d in daemons.values():
            d.stop()

    assert len(faults) == 6
    assert holders_seen and max(holders_seen) <= 1, "two sessions held the leader lock at once"
    with psycopg.connect(dsn) as conn:
        enqueued = {r[0] for r in conn.execute("SELECT id FROM maintd.fault_enqueued")}
        completed = {r[0] for r in conn.execute("SELECT id FROM maintd.fault_completed")}
        states = dict(conn.execute("SELECT id, state::text FROM maintd.jobs WHERE kind = 'fault'").fetchall())
        old_left = conn.execute("SELECT count(*) FROM maintd.jobs WHERE kind = 'old'").fetchone()[0]
        slots = [r[0] for r in conn.execute(
            "SELECT (metadata->>'slot')::timestamptz FROM maintd.jobs WHERE kind = 'beat' ORDER BY 1")]
        audit = conn.execute("SELECT app, txid, min(at), max(at) FROM maintd.fault_audit "
                             "GROUP BY app, txid ORDER BY 3").fetchall()
    assert len(enqueued) > 200
    # Nothing lost: every enqueued job is still there, in a valid state.
    assert enqueued <= set(states), f"lost jobs: {sorted(enqueued - set(states))[:10]}"
    # No acknowledged completion was overwritten by a rescue.
    overwritten = [i for i in completed if states[i] != "completed"]
    assert not overwritten, f"completions overwritten: {overwritten[:10]}"
    # The crashed workers' jobs were rescued: none is left running for long.
    assert sum(1 for i in enqueued if states[i] == "running") <= 6
    assert old_left == 0  # the cleaner finished its work through all of it
    # Periodic: each slot once, no gap from the first to the last.
    assert len(slots) == len(set(slots)) and len(slots) > 30
    gaps = [(a, b) for a, b in zip(slots, slots[1:]) if (b - a).total_seconds() != 1]
    assert not gaps, gaps
    # No two instances' maintenance transactions overlapped in time.
    instance = lambda app: app.split(":")[1]  # noqa: E731
    overlaps, latest_end = [], {}
    for app, _, start, end in audit:  # ordered by start
        me = instance(app)
        for other, other_end in latest_end.items():
            if other != me and other_end > start:
                overlaps.append((other, me, start, other_end))
        latest_end[me] = max(end, latest_end.get(me, end))
    assert not overlaps, overlaps[:5]
    # Leadership really moved: a new term after each of the 3 leader faults (which instance wins
    # each election is up to the race), and maintenance was done by more than one instance.
    last_epoch, _ = leader_row(dsn, "maintd")
    assert last_epoch - first_epoch >= 3
    assert len({instance(a[0]) for a in audit}) >= 2
