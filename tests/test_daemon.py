"""Leadership with real processes: one leader, SIGKILL/SIGSTOP failover with fencing, killed lock
session, Postgres restart, graceful hand-over, SIGHUP reloads, CLI exit codes."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone

import psycopg
import pytest

from .procs import (START, DaemonProc, audited_writes, install_write_audit, leader_row, lock_holders, wait_for,
                    wait_new_leader)

pytestmark = pytest.mark.slow

QUIET = {"cleaner": {"interval": "1s"}, "rescuer": {"interval": "1s"}, "scheduler": {"interval": "1s"}}


def service_runs(dsn, schema):
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {r[0]: (r[1], r[2]) for r in conn.execute(
            f'SELECT service, instance_id, finished_at FROM "{schema}".service_runs')}


def last_passes(d) -> dict:
    """This daemon's last pass of each service, idle ones included (its /status; service_runs
    holds only the passes that said something new)."""
    runs = json.loads(d.http_get("/status")[1])["this_instance"]["last_runs"]
    return {name: (d.instance_id, datetime.fromisoformat(r["finished_at"])) for name, r in runs.items()}


def registered(dsn, schema) -> set[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {r[0] for r in conn.execute(f'SELECT instance_id FROM "{schema}".daemons')}


def ran_pass_since(dsn, schema, instance, since):
    return any(inst == instance and fin > since for inst, fin in service_runs(dsn, schema).values())


@pytest.fixture
def daemons(pg_dsn, schema, tmp_path):
    started: list[DaemonProc] = []

    def start(n, extra=None, prefix="d", gated_log=False):
        new = [DaemonProc(pg_dsn, schema, f"{prefix}{len(started) + i}", extra or QUIET,
                          workdir=str(tmp_path)).start(gated_log) for i in range(n)]
        started.extend(new)
        return new

    yield start
    for d in started:
        d.stop()


def current_leader(pg_dsn, schema, procs):
    _, inst = wait_for(lambda: (lambda r: r if r[1] else None)(leader_row(pg_dsn, schema)), START,
                       what="a leader")
    return next(p for p in procs if p.instance_id == inst)


def test_three_daemons_one_leader_then_sigkill_failover(pg_dsn, schema, daemons):
    procs = daemons(3)
    leader = current_leader(pg_dsn, schema, procs)
    # Exactly one lock holder, observed repeatedly.
    for _ in range(20):
        assert len(lock_holders(pg_dsn, schema)) == 1
        time.sleep(0.05)
    assert lock_holders(pg_dsn, schema) == [f"maintd:{leader.instance_id}"]
    epoch, _ = leader_row(pg_dsn, schema)
    wait_for(lambda: ran_pass_since(pg_dsn, schema, leader.instance_id, datetime(2000, 1, 1, tzinfo=timezone.utc)),
             10, what="a first pass")

    killed_at = datetime.now(timezone.utc)
    t0 = time.monotonic()
    leader.kill()
    new_epoch, new_inst = wait_new_leader(pg_dsn, schema, epoch, timeout=5)
    wait_for(lambda: ran_pass_since(pg_dsn, schema, new_inst, killed_at), 5, what="a pass by the new leader")
    failover = time.monotonic() - t0
    assert new_inst != leader.instance_id
    assert failover < 2.0, f"failover took {failover:.2f}s"
    assert len(lock_holders(pg_dsn, schema)) == 1


def test_sigstop_leader_is_replaced_within_lease_and_fenced_after_sigcont(pg_dsn, schema, daemons):
    """A frozen leader is replaced within the lease; when it resumes, the fence stops every write
    it tries. Every committed write statement on jobs and service_runs is recorded by a trigger,
    with the leader row as committed at that moment.

    The resumed ex-leader would stop its passes within milliseconds by two other routes, racing
    them: its main loop sees the lease expired (and stops the passes), its elector sees the term
    lost. To test the fence and not that race, both are stalled first: its log is stalled (a full
    pipe) and a SIGHUP makes the main loop block in its reload, at a log line (checked in
    /proc: it no longer wakes); the elector will block at its "lost leadership" line. The cleaner's pass goes on (a
    long backlog in small batches with pauses; it logs nothing per batch), and the freeze is
    taken between two of its transactions (every maintenance connection idle, checked after the
    SIGSTOP; else resume and try again), so after SIGCONT its next step is a new transaction, in
    the new term. Without the fence it writes (every run); with it, nothing."""
    install_write_audit(pg_dsn, schema)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'INSERT INTO "{schema}".jobs (kind, state, scheduled_at) SELECT \'k\', \'scheduled\', '
                     f"now() + g * interval '20 milliseconds' FROM generate_series(1, 3000) g")
        conn.execute(f'INSERT INTO "{schema}".jobs (kind, state, finalized_at) SELECT \'k\', \'completed\', '
                     f"now() - interval '2 days' - g * interval '1 millisecond' FROM generate_series(1, 100000) g")
    busy = {"scheduler": {"interval": "1s"}, "rescuer": {"interval": "0.2s"},
            "cleaner": {"interval": "0.2s", "batch_size": 100, "batch_pause": "0.2s"}}
    # Instance ids unique on the server: pg_stat_activity is read by application name.
    procs = daemons(2, busy, prefix=f"{schema}-d", gated_log=True)
    leader = current_leader(pg_dsn, schema, procs)
    follower = next(p for p in procs if p is not leader)
    for _ in range(10):  # two daemons, exactly one leader
        assert [p.is_leader_from_db() for p in (leader, follower)] == [True, False]
        time.sleep(0.05)
    epoch, _ = leader_row(pg_dsn, schema)
    leader.http_port  # (read from its log while it can still write one)
    work = f"maintd:{leader.instance_id}:work"

    def cleaner_writes():  # the rows its cleaner deleted (the scheduler's writes are updates)
        return sum(w["app"] == work and w["op"] == "DELETE" for w in audited_writes(pg_dsn, schema))

    # Before the log stalls: the leader has seen the follower (its election loop logs the change
    # of live replicas: had it not, that line would stop its renewals, and the fence would end the
    # cleaner's pass before SIGSTOP), and the cleaner's long pass is under way (once stalled, a
    # pass about to start may block at a log line on its way; one already running logs nothing
    # per batch).
    leader.wait_log(r"live replicas changed replicas=2", timeout=10)
    wait_for(cleaner_writes, 10, what="the cleaner's pass under way")
    offset = len(leader.log())
    leader.block_log()
    leader.signal(signal.SIGHUP)
    wait_for(leader.main_thread_stalled, 5, what="the main loop blocked at a log line")
    before = cleaner_writes()
    wait_for(lambda: cleaner_writes() > before + 2, 5, what="the cleaner writing on with the log stalled")
    for _ in range(100):  # freeze between two transactions
        wait_for(lambda: set(leader.work_backends()) <= {"idle"}, 5, interval=0.005, what="idle connections")
        leader.kill(signal.SIGSTOP)
        t0 = time.monotonic()
        time.sleep(0.1)  # a statement already sent but not yet read by the server starts now
        if set(leader.work_backends()) <= {"idle"}:
            break
        leader.signal(signal.SIGCONT)
        time.sleep(0.05)
    else:
        pytest.fail("never froze the leader between two transactions")
    try:
        new_epoch, new_inst = wait_new_leader(pg_dsn, schema, epoch, timeout=3 + 3)  # lease 3 s + margin
        took = time.monotonic() - t0
        assert new_inst == follower.instance_id
    finally:
        leader.signal(signal.SIGCONT)
    assert took <= 3 + 2.5, f"takeover took {took:.2f}s with a 3 s lease"
    time.sleep(1.5)  # the ex-leader runs, its main loop and elector stuck in log lines
    writes = audited_writes(pg_dsn, schema)
    leader.unblock_log()
    mine = [w for w in writes if w["app"].startswith(f"maintd:{leader.instance_id}")]
    assert mine, "the leader never wrote"
    stale = [w for w in mine if (w["leader_epoch"], w["leader_instance"]) != (epoch, leader.instance_id)
             or (w["committed_epoch"], w["committed_instance"]) != (epoch, leader.instance_id)]
    assert not stale, f"the ex-leader wrote in the new term: {stale[:3]}"
    assert any(w["app"] == f"maintd:{follower.instance_id}:work" and w["leader_epoch"] == new_epoch
               for w in writes), "the new leader never wrote"
    # Once its log flows again, the ex-leader notices, says so, and still writes nothing.
    # Both lines were waiting behind the stalled log, in no set order: wait for each.
    leader.wait_log(r"lost leadership reason=", timeout=5, after=offset)
    leader.wait_log(r"pass refused: not the leader", timeout=5, after=offset)  # the fence was tried
    time.sleep(0.5)
    assert [w for w in audited_writes(pg_dsn, schema) if w["app"].startswith(f"maintd:{leader.instance_id}")] == mine
    assert leader_row(pg_dsn, schema) == (new_epoch, follower.instance_id)
    assert lock_holders(pg_dsn, schema) == [f"maintd:{follower.instance_id}"]
    assert leader.proc.poll() is None  # it stays up as a follower
    status, metrics = leader.http_get("/metrics")
    assert status == 200 and re.search(r"^maintd_is_leader\{target=\"[^\"]+\"\} 0\.0$", metrics, re.M)


def test_terminated_lock_session_demotes_at_once(pg_dsn, schema, daemons):
    procs = daemons(2)
    leader = current_leader(pg_dsn, schema, procs)
    epoch, _ = leader_row(pg_dsn, schema)
    offset = len(leader.log())
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        # The lock session of this schema's leader (by its pid: instance names such as "d0" are
        # not unique across tests running at once on a shared server).
        n = conn.execute(f'SELECT count(pg_terminate_backend(backend_pid)) FROM "{schema}".leader '
                         "WHERE instance_id = %s", (leader.instance_id,)).fetchone()[0]
    assert n == 1
    t0 = time.monotonic()
    leader.wait_log(r"lost leadership", timeout=3, after=offset)
    assert time.monotonic() - t0 < 2.5  # at the next renewal (renew_interval 1 s)
    wait_new_leader(pg_dsn, schema, epoch, timeout=5)


def test_graceful_stop_hands_over_at_once(pg_dsn, schema, daemons):
    slow_retry = {**QUIET, "leader": {"retry_interval": "5s", "lease": "20s", "renew_interval": "2s"}}
    procs = daemons(2, slow_retry)
    leader = current_leader(pg_dsn, schema, procs)
    epoch, _ = leader_row(pg_dsn, schema)
    t0 = time.monotonic()
    leader.signal(signal.SIGTERM)
    _, new_leader = wait_new_leader(pg_dsn, schema, epoch, timeout=4)
    # Far below the 5 s retry interval: the follower woke on the hand-over NOTIFY.
    assert time.monotonic() - t0 < 2.0
    assert leader.stop() == 0
    assert "released leadership" in leader.log()
    assert new_leader != leader.instance_id
    procs = daemons(1, slow_retry, prefix="late")  # a new follower, stopped while it waits
    procs[0].wait_log(r"connected to database")
    time.sleep(0.3)
    t0 = time.monotonic()
    assert procs[0].stop() == 0
    # Includes the interpreter's exit; a stop that waited out the retry interval would take > 5 s.
    assert time.monotonic() - t0 < 3.0


def test_sigterm_exits_in_time_while_maintenance_connections_hang(pg_dsn, schema, tmp_path):
    """The work pool's server falls silent (a partition, its lock session still fine) and the
    operator stops the daemon: the process exits well within systemd's TimeoutStopSec (20 s in
    deploy/systemd/maintd.service). The pass threads still waiting on the silent server (the
    probe of the next due time, a pass's record) held the interpreter's exit until their wait
    for an answer ran out (statement_timeout + lease: 33 s here), and systemd then killed it."""
    from .netproxy import NetProxy
    from .scenarios import working_leader_after

    with NetProxy.for_dsn(pg_dsn) as proxy:
        d = DaemonProc(proxy.dsn(pg_dsn), schema, "cut", {**QUIET, "scheduler": {"interval": "0.5s"},
                                                          "statement_timeout": "30s"}, workdir=str(tmp_path))
        try:
            d.start()
            working_leader_after(pg_dsn, schema, time.monotonic(), timeout=START)
            proxy.blackhole(lambda link: link.app.endswith(":work"))
            time.sleep(1.5)  # the next due-time probe (every second) waits on the silent server
            t0 = time.monotonic()
            d.signal(signal.SIGTERM)
            try:
                code = d.proc.wait(25)
            except subprocess.TimeoutExpired:
                code = None
            took = time.monotonic() - t0
        finally:
            proxy.heal()
            d.stop()
    assert code == 0 and took < 12.0, f"exit {code} {took:.1f} s after SIGTERM\n{d.log()[-2000:]}"
    assert "maintd stopped" in d.log()


class NotifyListener:
    """A systemd notify socket read by a thread for the whole test, as systemd does (a socket
    nobody reads fills up and the daemon then drops its messages)."""

    def __init__(self, path: str):
        self.path = path
        self.messages: list[bytes] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(path)
        self._sock.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self.messages.append(self._sock.recv(200))
            except socket.timeout:
                continue

    def count(self, message: bytes) -> int:
        return self.messages.count(message)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()


@pytest.fixture
def notify_socket(tmp_path):
    listener = NotifyListener(str(tmp_path / "notify.sock"))
    yield listener
    listener.close()


def test_sighup_toggles_a_service_and_rejects_a_bad_file(pg_dsn, schema, tmp_path, notify_socket):
    d = DaemonProc(pg_dsn, schema, "hup", QUIET, workdir=str(tmp_path),
                   env={"NOTIFY_SOCKET": notify_socket.path, "WATCHDOG_USEC": "1000000"}).start()
    try:
        _sighup_checks(pg_dsn, schema, d, notify_socket)
    finally:
        assert d.stop() == 0
    wait_for(lambda: notify_socket.count(b"STOPPING=1") == 1, 2, what="STOPPING=1")


def _job(dsn, schema, state) -> int:
    """A job with work for a service: ``completed`` three days ago (past retention: the cleaner's),
    or ``running`` since two hours ago with no heartbeat (stuck: the rescuer's)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(f'INSERT INTO "{schema}".jobs (kind, state, attempt, attempted_at, finalized_at) '
                            "VALUES ('k', %s, 1, now() - interval '3 days', "
                            "CASE WHEN %s = 'completed' THEN now() - interval '3 days' END) RETURNING id",
                            (state, state)).fetchone()[0]


def _exists(dsn, schema, job_id) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(f'SELECT count(*) FROM "{schema}".jobs WHERE id = %s', (job_id,)).fetchone()[0] == 1


def _sighup_checks(pg_dsn, schema, d, notify):
    # systemd Type=notify: READY=1 once the daemon is up (STATUS=... lines may come first).
    wait_for(lambda: notify.count(b"READY=1") == 1, START, what="READY=1")
    d.wait_log(r"became leader epoch=\d+")
    pings = notify.count(b"WATCHDOG=1")
    wait_for(lambda: notify.count(b"WATCHDOG=1") > pings, 2, what="WATCHDOG=1")  # every WATCHDOG_USEC / 2
    config = dict(d.config)
    config["cleaner"] = {**config.get("cleaner", {}), "enabled": False}
    d.write_config(config)
    offset = len(d.log())
    d.signal(signal.SIGHUP)
    m = d.wait_log(r"config reloaded services=(\S+)", after=offset)
    assert "cleaner" not in m.group(1).split(",") and "rescuer" in m.group(1)
    # Passes of the disabled service stop; the others go on. Both services have work (a service
    # with nothing to do runs no pass): an expired completed job for the cleaner, a stuck running
    # job for the rescuer. (A cleaner pass already running at the reload may still finish: compare
    # with the record after the first rescuer pass that began after the reload.)
    reloaded = datetime.now(timezone.utc)
    expired = _job(pg_dsn, schema, "completed")
    _job(pg_dsn, schema, "running")
    wait_for(lambda: last_passes(d)["rescuer"][1] > reloaded, 5, what="a rescuer pass")
    cleaner_before = last_passes(d).get("cleaner")
    rescued_at = last_passes(d)["rescuer"][1]
    _job(pg_dsn, schema, "running")
    wait_for(lambda: last_passes(d)["rescuer"][1] > rescued_at, 5, what="the next rescuer pass")
    assert last_passes(d).get("cleaner") == cleaner_before and _exists(pg_dsn, schema, expired)

    config["cleaner"]["enabled"] = True
    d.write_config(config)
    offset = len(d.log())
    d.signal(signal.SIGHUP)
    m = d.wait_log(r"config reloaded services=(\S+)", after=offset)
    assert "cleaner" in m.group(1).split(",")
    since = datetime.now(timezone.utc)
    wait_for(lambda: last_passes(d).get("cleaner", (None, since))[1] > since, 5,
             what="a cleaner pass after re-enabling")
    wait_for(lambda: not _exists(pg_dsn, schema, expired), 5, what="the expired job deleted")

    d.config_path.write_text("[cleaner]\nbatch_size = 0\n")
    offset = len(d.log())
    d.signal(signal.SIGHUP)
    m = d.wait_log(r"config reload rejected.*", after=offset)
    assert "cleaner.batch_size" in m.group(0)
    since = datetime.now(timezone.utc)
    expired = _job(pg_dsn, schema, "completed")
    wait_for(lambda: last_passes(d).get("cleaner", (None, since))[1] > since, 5,
             what="passes continuing with the old config")
    wait_for(lambda: not _exists(pg_dsn, schema, expired), 5, what="the expired job deleted")
    assert d.proc.poll() is None


def test_postgres_restart_leadership_recovers(private_pg, tmp_path):
    from maintd import migrate
    from maintd.db import make_engine

    engine = make_engine(private_pg.dsn, application_name="t", pooled=False)
    with engine.connect() as conn:
        migrate.upgrade(conn, "maintd")
    engine.dispose()
    procs = [DaemonProc(private_pg.dsn, "maintd", f"r{i}", QUIET, workdir=str(tmp_path)).start() for i in range(2)]
    try:
        current_leader(private_pg.dsn, "maintd", procs)
        epoch, _ = leader_row(private_pg.dsn, "maintd")
        # Both have connected once (the follower may still be connecting when the leader wins),
        # so what follows is a reconnection for each.
        wait_for(lambda: [p.http_get("/readyz")[0] for p in procs] == [200, 200], 10, what="both ready")
        assert [p.http_get("/healthz")[0] for p in procs] == [200, 200]
        private_pg.stop()  # fast shutdown, then about 2 s of outage
        # /readyz reflects the outage (the election loop's connection is gone); /healthz, the
        # liveness probe, does not: an outage must not make Kubernetes restart the pods ...
        wait_for(lambda: [p.http_get("/readyz")[0] for p in procs] == [503, 503], 5, what="503s")
        assert [p.http_get("/healthz")[0] for p in procs] == [200, 200]
        time.sleep(1)
        private_pg.start()
        restarted = datetime.now(timezone.utc)
        new_epoch, inst = wait_new_leader(private_pg.dsn, "maintd", epoch, timeout=15)
        wait_for(lambda: ran_pass_since(private_pg.dsn, "maintd", inst, restarted), 10,
                 what="passes after the restart")
        for p in procs:
            assert p.proc.poll() is None, p.log()
            assert "database unreachable, retrying" in p.log()
            p.wait_log(r"reconnected to database", timeout=10)  # backoff is capped at 5 s
        # ... and recovers with it.
        wait_for(lambda: [p.http_get("/healthz")[0] for p in procs] == [200, 200], 5, what="200s")
        assert len(lock_holders(private_pg.dsn, "maintd")) == 1
    finally:
        for p in procs:
            p.stop()


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "maintd", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_run_without_schema_exits_1_with_one_line(pg_dsn, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'database_url = "{pg_dsn}"\nschema = "never_migrated"\n[http]\nlisten = "127.0.0.1:0"\n')
    res = _cli("--config", str(cfg), "run")
    assert res.returncode == 1
    assert "run `maintd migrate`" in res.stderr and "Traceback" not in res.stderr


def test_run_once_cli(pg_dsn, schema, daemons, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'database_url = "{pg_dsn}"\nschema = "{schema}"\n')
    res = _cli("--config", str(cfg), "run-once", "cleaner")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["service"] == "cleaner" and out["outcome"] == "success" and not out["dry_run"]
    procs = daemons(1)
    current_leader(pg_dsn, schema, procs)
    res = _cli("--config", str(cfg), "run-once", "rescuer")
    assert res.returncode == 1
    assert f"instance={procs[0].instance_id}" in res.stderr
    res = _cli("--config", str(cfg), "run-once", "rescuer", "--dry-run")
    assert res.returncode == 0 and json.loads(res.stdout)["dry_run"] is True
    assert _cli("--config", str(cfg), "run-once", "vacuum").returncode == 2  # usage


def test_status_cli(pg_dsn, schema, daemons, tmp_path):
    procs = daemons(2)
    leader = current_leader(pg_dsn, schema, procs)
    wait_for(lambda: registered(pg_dsn, schema) >= {p.instance_id for p in procs}, 10, what="both registered")
    wait_for(lambda: ran_pass_since(pg_dsn, schema, leader.instance_id, datetime(2000, 1, 1, tzinfo=timezone.utc)),
             10, what="a pass")
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'database_url = "{pg_dsn}"\nschema = "{schema}"\n')
    res = _cli("--config", str(cfg), "status")
    assert res.returncode == 0
    assert f"leader: {leader.instance_id}" in res.stdout
    res = _cli("--config", str(cfg), "status", "--json")
    data = json.loads(res.stdout)
    assert data["leader"]["instance_id"] == leader.instance_id
    assert {d["instance_id"] for d in data["daemons"]} >= {p.instance_id for p in procs}
    assert {s["service"] for s in data["services"]} >= {"cleaner", "rescuer", "scheduler"}
