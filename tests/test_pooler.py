"""PgBouncer in front of maintd and its workers (issue 13, SPEC 7.2), with Debian's pgbouncer.

* Session pooling works: the lock and the fence name the server backend (``pg_backend_pid()``),
  not the pooler's client key; a leader does real work and fails over after a SIGKILL.
* Transaction pooling is refused before the lock is taken (exit 1, a message naming
  ``pool_mode``) and leaves no lock behind, even under worker traffic through the same pooler,
  where a healthy direct replica must still lead within a few seconds.
* Workers' claim/complete SQL (:class:`maintd.jobs.JobQueue`) stays correct through transaction
  pooling (psycopg's automatic server-side prepares must be off there: ``prepare_threshold=None``,
  as for any client of PgBouncer 1.18 in transaction mode).
"""

from __future__ import annotations

import socket
import statistics
import threading
import time

import psycopg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.pool import QueuePool

from maintd.db import advisory_key
from maintd.jobs import JobQueue

from .netproxy import NetProxy
from .pgbouncer import PgBouncer
from .procs import START, DaemonProc, leader_row, lock_holders, wait_for
from .scenarios import (FAST_SERVICES, audit_rows, foreign_writes, install_audit, q, record,
                        working_leader_after)

LEASE = 3.0
RENEW = 1.0  # FAST_LEADER's renew_interval


def schema_advisory_locks(dsn: str, schema: str) -> list[tuple[int, str]]:
    """(pid, application_name) of every server session holding the schema's leader lock, whoever
    it is (through a pooler the holder may be a pooled backend serving anyone)."""
    classid, objid = advisory_key(schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT l.pid, a.application_name FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.classid::bigint = %s AND l.objid::bigint = %s AND l.granted",
            (classid & 0xFFFFFFFF, objid & 0xFFFFFFFF)).fetchall()


def add_expired(dsn: str, schema: str, n: int = 5) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {q(schema)}.jobs (kind, state, finalized_at) "
                     "SELECT 'old', 'completed', now() - interval '2 days' FROM generate_series(1, %s)", (n,))


def count_kind(dsn: str, schema: str, kind: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(f"SELECT count(*) FROM {q(schema)}.jobs WHERE kind = %s", (kind,)).fetchone()[0]


def worker_engine(dsn: str, name: str):
    """A worker's engine for transaction pooling: no server-side prepared statements."""
    return create_engine("postgresql+psycopg://", poolclass=QueuePool, pool_size=1, max_overflow=0,
                         creator=lambda: psycopg.connect(dsn, application_name=name, prepare_threshold=None))


# -- session pooling ---------------------------------------------------------------------------

@pytest.mark.slow
def test_session_pooling_leader_does_real_work(pg_dsn, schema, tmp_path):
    install_audit(pg_dsn, schema)
    add_expired(pg_dsn, schema)
    with PgBouncer(pg_dsn, pool_mode="session") as bouncer:
        d = DaemonProc(bouncer.dsn, schema, "pooled", FAST_SERVICES, workdir=str(tmp_path))
        try:
            t0 = time.monotonic()
            d.start()
            wait_for(lambda: lock_holders(pg_dsn, schema) == ["maintd:pooled"], START, what="the lock")
            seconds = working_leader_after(pg_dsn, schema, t0, timeout=10)
            record("pgbouncer_session_first_leader", seconds)
            wait_for(lambda: count_kind(pg_dsn, schema, "old") == 0, 10, what="the cleaner")
            epoch = leader_row(pg_dsn, schema)[0]
            time.sleep(2 * LEASE)
            assert leader_row(pg_dsn, schema) == (epoch, "pooled"), "the term was dropped and retaken"
        finally:
            d.stop()
    assert "pass refused" not in d.log()
    rows = audit_rows(pg_dsn, schema)
    assert rows and not foreign_writes(rows), foreign_writes(rows)[:5]


@pytest.mark.slow
def test_session_pooling_failover_after_sigkill(pg_dsn, schema, tmp_path):
    install_audit(pg_dsn, schema)
    with PgBouncer(pg_dsn, pool_mode="session") as bouncer:
        daemons = {n: DaemonProc(bouncer.dsn, schema, n, FAST_SERVICES, workdir=str(tmp_path))
                   for n in ("pa", "pb")}
        times: list[float] = []
        try:
            daemons["pa"].start()
            working_leader_after(pg_dsn, schema, time.monotonic(), timeout=10)
            daemons["pb"].start().wait_log(r"maintd started", timeout=START)
            for _ in range(3):
                epoch, leader = leader_row(pg_dsn, schema)
                assert leader in daemons
                daemons[leader].kill()
                t0 = time.monotonic()
                times.append(working_leader_after(pg_dsn, schema, t0, timeout=4 * LEASE))
                assert leader_row(pg_dsn, schema)[0] > epoch
                daemons[leader] = DaemonProc(bouncer.dsn, schema, leader, FAST_SERVICES,
                                             workdir=str(tmp_path)).start()
                daemons[leader].wait_log(r"maintd started", timeout=START)
        finally:
            for d in daemons.values():
                d.stop()
    record("pgbouncer_session_failover", statistics.median(times), all=[round(t, 2) for t in times])
    assert statistics.median(times) < 2 * LEASE
    rows = audit_rows(pg_dsn, schema)
    assert not foreign_writes(rows), foreign_writes(rows)[:5]


# -- transaction pooling -----------------------------------------------------------------------

@pytest.mark.slow
def test_transaction_pooling_is_refused_before_the_lock(pg_dsn, schema, tmp_path):
    with PgBouncer(pg_dsn, pool_mode="transaction") as bouncer:
        d = DaemonProc(bouncer.dsn, schema, "txpooled", workdir=str(tmp_path))
        held: list = []
        try:
            d.start()
            # (a start-up takes about 1 s on an idle machine, 3-5 s with its cores busy; CI, 3 workers
            # on 2 cores, once saw no exit within 10 s: the point is the exit code and no lock held)
            deadline = time.monotonic() + 30
            while d.proc.poll() is None and time.monotonic() < deadline:
                held += schema_advisory_locks(pg_dsn, schema)
                time.sleep(0.05)
            rc = d.proc.poll()
            left_behind = schema_advisory_locks(pg_dsn, schema)  # the pooler still runs
        finally:
            d.stop()
    assert rc == 1, f"maintd kept running through transaction pooling; log:\n{d.log()[-1500:]}"
    assert "pool_mode" in d.log()
    assert "became leader" not in d.log()
    assert not held, f"the leader lock was taken: {held[:3]}"
    assert not left_behind
    assert leader_row(pg_dsn, schema)[0] == 0


@pytest.mark.slow
def test_transaction_pooling_found_after_an_unreachable_start_is_refused_too(pg_dsn, schema, tmp_path):
    """The pooler cannot be reached at start-up, so the first check is cut short and the loop
    retries; when the pooler comes, the loop's check refuses it, and that ends the daemon with
    exit 1 as at start-up, without a lock (a daemon that went on retrying stayed up, unhealthy,
    and CI's run of the test below found it so under worker traffic)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens there yet
    with PgBouncer(pg_dsn, pool_mode="transaction") as bouncer:
        info = psycopg.conninfo.conninfo_to_dict(bouncer.dsn)
        late = psycopg.conninfo.make_conninfo(**{**info, "port": str(port)})
        d = DaemonProc(late, schema, "txlate", workdir=str(tmp_path))
        held: list = []
        try:
            d.start().wait_log(r"database unreachable, retrying", timeout=20)
            with NetProxy(info["host"], int(info["port"]), listen_port=port):
                deadline = time.monotonic() + 20
                while d.proc.poll() is None and time.monotonic() < deadline:
                    held += schema_advisory_locks(pg_dsn, schema)
                    time.sleep(0.05)
        finally:
            d.stop()
    assert d.proc.returncode == 1, f"maintd kept running through transaction pooling; log:\n{d.log()[-1500:]}"
    assert "pool_mode" in d.log() and "became leader" not in d.log()
    assert not held, f"the leader lock was taken: {held[:3]}"
    assert leader_row(pg_dsn, schema)[0] == 0


@pytest.mark.slow
def test_a_pooler_switched_to_transaction_mode_under_a_leader_is_retried_not_fatal(pg_dsn, schema, tmp_path):
    """A daemon that has led through session pooling stays up when the pooler is switched to
    transaction mode under it (an operator's mistake, undone by switching back): its session is
    refused at each reconnect, no lock is held anywhere, /readyz fails; switched back, it leads."""
    with PgBouncer(pg_dsn, pool_mode="session") as bouncer:
        d = DaemonProc(bouncer.dsn, schema, "switched", FAST_SERVICES, workdir=str(tmp_path))
        try:
            d.start()
            wait_for(lambda: lock_holders(pg_dsn, schema) == ["maintd:switched"], START, what="the lock")
            bouncer.admin("SET pool_mode = 'transaction'")
            # The session ends (a reconnect): the server backend holding the lock, found by its lock,
            # not its name. In transaction mode PgBouncer hands that backend, lock and all, to its next
            # client once the lock session's statement ends (seen under CI load: it then showed the work
            # pool's name, the terminate by name found nothing and the lock stayed). Or none is found:
            # PgBouncer had already closed it, and its lock with it.
            classid, objid = advisory_key(schema)
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                ended = conn.execute(
                    "SELECT pid, pg_terminate_backend(pid, 10000) FROM pg_stat_activity "
                    "WHERE application_name = 'maintd:switched' OR pid IN (SELECT pid FROM pg_locks "
                    "WHERE locktype = 'advisory' AND classid::bigint = %s AND objid::bigint = %s AND granted)",
                    (classid & 0xFFFFFFFF, objid & 0xFFFFFFFF)).fetchall()
            # PostgreSQL's functions-admin docs: with a timeout, pg_terminate_backend "waits until the
            # process is actually terminated" (else true means only that the signal was sent).
            # Either way the daemon must reconnect and be refused, as the log line shows.
            assert all(done for _, done in ended), ended
            d.wait_log(r"unusable lock session", timeout=15)
            assert d.proc.poll() is None, d.log()[-1500:]
            wait_for(lambda: d.http_get("/readyz")[0] == 503, 10, what="/readyz to fail")
            held = [schema_advisory_locks(pg_dsn, schema) for _ in range(20) if not time.sleep(0.05)]
            assert not any(held), (ended, [h for h in held if h][:1], d.log()[-2000:])
            bouncer.admin("SET pool_mode = 'session'")
            wait_for(lambda: lock_holders(pg_dsn, schema) == ["maintd:switched"], 20, what="the lock again")
            wait_for(lambda: d.http_get("/readyz")[0] == 200, 10, what="/readyz again")
        finally:
            d.stop()


def test_a_lock_a_switched_pooler_keeps_on_a_pooled_backend_ends_with_that_backend_s_idleness(
        pg_dsn, schema, tmp_path):
    """Switched to transaction mode under a leader, PgBouncer links the client to another backend
    after the lock session's next transaction and hands the old one, lock and all, to its next
    client (here the daemon's own work pool); it runs no reset query in that mode. The lock session
    set ``idle_session_timeout = lease`` on that backend (PostgreSQL 14+), and a setting stays with
    the backend: once no client has used it for a lease, the server ends it and the lock with it,
    well before PgBouncer's ``server_idle_timeout`` (600 s) or ``server_lifetime`` (3600 s) would.
    No test terminate here: the daemon finds the switch itself at its next renewal."""
    with PgBouncer(pg_dsn, pool_mode="session") as bouncer:
        d = DaemonProc(bouncer.dsn, schema, "stranded", FAST_SERVICES, workdir=str(tmp_path))
        try:
            d.start()
            wait_for(lambda: lock_holders(pg_dsn, schema) == ["maintd:stranded"], START, what="the lock")
            [(backend, _)] = schema_advisory_locks(pg_dsn, schema)
            # More than five rounds (renew_interval 1 s) first: psycopg would have prepared the
            # round by then, and the switch would meet that, not the marker (test_lockconn's
            # test_the_lock_session_prepares_no_statement_a_pooler_could_hand_to_another_backend).
            time.sleep(8 * RENEW)
            bouncer.admin("SET pool_mode = 'transaction'")
            d.wait_log(r"lost leadership reason=\"the lock connection reached a session it did not set up", 15)
            wait_for(lambda: d.http_get("/readyz")[0] == 503, 10, what="/readyz to fail")
            # Freed within a lease of that backend's last use (the work pool's idle reads included).
            wait_for(lambda: not schema_advisory_locks(pg_dsn, schema), 4 * LEASE, interval=0.1,
                     what=f"the stranded lock freed: {schema_advisory_locks(pg_dsn, schema)}")
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                assert conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                                    (backend,)).fetchone()[0] == 0, "the backend that held it is gone"
            assert d.proc.poll() is None, d.log()[-1500:]
            bouncer.admin("SET pool_mode = 'session'")
            wait_for(lambda: lock_holders(pg_dsn, schema) == ["maintd:stranded"], 20, what="the lock again")
        finally:
            d.stop()


@pytest.mark.slow
def test_transaction_pooling_under_worker_traffic_a_direct_replica_leads(pg_dsn, schema, tmp_path):
    stop = threading.Event()
    errors: list[BaseException] = []
    queue = JobQueue(schema)

    def work(dsn: str, name: str) -> None:
        engine = worker_engine(dsn, name)
        try:
            while not stop.is_set():
                with engine.begin() as conn:  # not the canary's queue (working_leader_after)
                    queue.enqueue(conn, "traffic", queue="traffic")
                with engine.begin() as conn:
                    jobs = queue.claim(conn, "traffic", name, limit=2)
                for job in jobs:
                    with engine.begin() as conn:
                        queue.complete(conn, job)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            engine.dispose()

    with PgBouncer(pg_dsn, pool_mode="transaction", pool_size=3) as bouncer:
        threads = [threading.Thread(target=work, args=(bouncer.dsn, f"tw{i}")) for i in range(3)]
        for t in threads:
            t.start()
        pooled = DaemonProc(bouncer.dsn, schema, "txpooled", FAST_SERVICES, workdir=str(tmp_path))
        direct = DaemonProc(pg_dsn, schema, "direct", FAST_SERVICES, workdir=str(tmp_path))
        try:
            pooled.start()
            # Refused at start-up (exit 1), or (the bug) retrying, or leading through a pooled backend.
            try:
                wait_for(lambda: pooled.proc.poll() is not None or "became leader" in pooled.log(), START,
                         what="the pooled daemon to lead or exit")
            except AssertionError:
                pass
            t0 = time.monotonic()
            direct.start()  # its start-up counts here (recorded, not bounded): allow one
            seconds = working_leader_after(pg_dsn, schema, t0, timeout=START + 4 * LEASE)
            record("pgbouncer_transaction_direct_replica_leads", seconds)
            assert [app for _, app in schema_advisory_locks(pg_dsn, schema)] == ["maintd:direct"]
        finally:
            stop.set()
            for t in threads:
                t.join(10)
            pooled.stop()
            direct.stop()
    assert not errors, errors[:3]
    assert pooled.proc.returncode == 1 and "pool_mode" in pooled.log()


@pytest.mark.slow
def test_worker_claims_through_transaction_pooling_stay_correct(pg_dsn, schema):
    """4 workers over 2 server connections: every job claimed once, every completion applied."""
    n_jobs, n_workers = 300, 4
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {q(schema)}.jobs (kind, queue) "
                     "SELECT 'w', 'default' FROM generate_series(1, %s)", (n_jobs,))
    queue = JobQueue(schema)
    claims: list[tuple[str, int, int]] = []
    completed: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work(dsn: str, name: str) -> None:
        engine = worker_engine(dsn, name)
        try:
            while True:
                with engine.begin() as conn:
                    jobs = queue.claim(conn, "default", name, limit=5)
                if not jobs:
                    return
                with lock:
                    claims.extend((name, j.id, j.attempt) for j in jobs)
                for job in jobs:
                    with engine.begin() as conn:
                        assert queue.heartbeat(conn, job)
                    with engine.begin() as conn:
                        if queue.complete(conn, job):
                            with lock:
                                completed.append(job.id)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            engine.dispose()

    with PgBouncer(pg_dsn, pool_mode="transaction", pool_size=2) as bouncer:
        threads = [threading.Thread(target=work, args=(bouncer.dsn, f"w{i}")) for i in range(n_workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        servers = bouncer.show("SERVERS")
    assert not errors, errors[:3]
    assert len(servers) <= 2  # the 4 workers really shared 2 server connections
    ids = [c[1] for c in claims]
    assert len(ids) == len(set(ids)) == n_jobs, "a job was claimed twice (or never)"
    assert all(attempt == 1 for _, _, attempt in claims)
    assert sorted(completed) == sorted(ids)
    assert len({c[0] for c in claims}) > 1
    with psycopg.connect(pg_dsn) as conn:
        states = dict(conn.execute(f"SELECT state::text, count(*) FROM {q(schema)}.jobs GROUP BY 1").fetchall())
    assert states == {"completed": n_jobs}
