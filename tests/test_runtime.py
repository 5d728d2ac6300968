"""In-process runtime: fencing, the runner's error handling and stop, HTTP endpoints, sd_notify."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from dataclasses import dataclass

import pytest
from sqlalchemy import text

from maintd.daemon import Daemon
from maintd.db import sql
from maintd.leader import LeaderFence, LeaderToken, acquire_once
from maintd.metrics import Metrics
from maintd.runner import Runner, execute_pass, maintenance_engine
from maintd.sdnotify import SystemdNotifier
from maintd.services.base import NoFence, NotLeader, PassContext, PassResult, Service

from .procs import wait_for


@dataclass
class CountResult(PassResult):
    n: int = 0

    def did_something(self) -> bool:
        return True


class Flaky(Service):
    """Fails every other pass; records overlap."""

    name = "cleaner"

    def __init__(self, settings, state):
        super().__init__(settings)
        self.state = state

    def run_once(self, ctx):
        with self.state["lock"]:
            self.state["running"] += 1
            self.state["max_running"] = max(self.state["max_running"], self.state["running"])
            self.state["calls"] += 1
            n = self.state["calls"]
        try:
            time.sleep(0.05)
            if n % 2 == 0:
                raise RuntimeError("boom")
            return CountResult(n)
        finally:
            with self.state["lock"]:
                self.state["running"] -= 1


class Slow(Service):
    name = "rescuer"

    def run_once(self, ctx):
        with ctx.transaction() as conn:
            conn.execute(text("SELECT pg_sleep(30)"))
        return CountResult(1)


def test_fence_refuses_a_stale_epoch_and_writes_nothing(settings, engine, schema):
    held = acquire_once(settings)
    assert held is not None
    elector, fence = held
    try:
        ctx = PassContext(engine=engine, settings=settings, clock=None, fence=fence)  # type: ignore[arg-type]
        with ctx.transaction() as conn:  # the real term passes the fence
            conn.execute(sql("INSERT INTO {schema}.jobs (kind) VALUES ('ok')", schema))
        stale = LeaderFence(schema, LeaderToken(fence.token.epoch - 1, fence.token.lock_pid,
                                                settings.instance_id, fence.token.classid, fence.token.objid))
        ctx_stale = PassContext(engine=engine, settings=settings, clock=None, fence=stale)  # type: ignore[arg-type]
        with pytest.raises(NotLeader):
            with ctx_stale.transaction() as conn:
                conn.execute(sql("INSERT INTO {schema}.jobs (kind) VALUES ('stale')", schema))
        wrong_pid = LeaderFence(schema, LeaderToken(fence.token.epoch, 1, settings.instance_id,
                                                    fence.token.classid, fence.token.objid))
        with pytest.raises(NotLeader), engine.connect() as conn:
            wrong_pid.check(conn)
    finally:
        elector.stop()
    # After release, the old term's fence refuses too.
    with pytest.raises(NotLeader):
        with engine.connect() as conn:
            fence.check(conn)
    with engine.connect() as conn:
        kinds = [r[0] for r in conn.execute(sql("SELECT kind FROM {schema}.jobs ORDER BY id", schema))]
    assert kinds == ["ok"]


def test_second_acquire_fails_while_held(settings):
    held = acquire_once(settings)
    try:
        assert acquire_once(settings, wait=0.3) is None
    finally:
        held[0].stop()
    again = acquire_once(settings)
    assert again is not None
    again[0].stop()


def test_failing_pass_is_counted_and_never_overlaps(settings, engine):
    state = {"lock": threading.Lock(), "running": 0, "max_running": 0, "calls": 0}
    metrics = Metrics()
    settings.cleaner.interval = __import__("datetime").timedelta(milliseconds=20)
    runner = Runner(settings, engine, metrics)
    runner.services = {"cleaner": Flaky(settings, state)}
    runner.start()
    try:
        runner.activate(NoFence())
        wait_for(lambda: state["calls"] >= 6, 10, what="six passes")
    finally:
        runner.shutdown()
    assert state["max_running"] == 1
    assert metrics.service_runs.labels("cleaner", "error")._value.get() >= 2
    assert metrics.service_runs.labels("cleaner", "success")._value.get() >= 2


def test_losing_leadership_stops_passes_within_a_second(settings, engine):
    metrics = Metrics()
    runner = Runner(settings, engine, metrics)
    runner.services = {"rescuer": Slow(settings)}
    runner.start()
    try:
        runner.activate(NoFence())
        wait_for(lambda: runner._active, 5, what="the slow pass to start")
        time.sleep(0.2)
        t0 = time.monotonic()
        runner.deactivate("test")
        took = time.monotonic() - t0
        assert not runner._active and took < 1.0
        assert runner.scheduler.get_jobs() == []
    finally:
        runner.shutdown()
    assert metrics.service_runs.labels("rescuer", "error")._value.get() + \
        metrics.service_runs.labels("rescuer", "stopped")._value.get() == 1


def test_execute_pass_reports_fenced(settings, engine):
    class Fenced:
        def check(self, conn):
            raise NotLeader("stale")

    from maintd.services.cleaner import Cleaner

    ctx = PassContext(engine=engine, settings=settings, clock=__import__("maintd.clock").clock.SystemClock(),
                      fence=Fenced())
    outcome, result, error = execute_pass(Cleaner(settings), ctx)
    assert outcome == "fenced" and result is None and "stale" in error


def _get(port, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_http_endpoints_and_metrics(settings, schema):
    daemon = Daemon(settings)
    daemon.start()
    try:
        port = daemon.http_port
        wait_for(lambda: daemon.is_leader, 10, what="leadership")
        wait_for(lambda: "cleaner" in daemon.runner.last_runs, 10, what="a cleaner pass")
        assert _get(port, "/healthz")[0] == 200
        assert _get(port, "/readyz")[0] == 200
        status, body = _get(port, "/metrics")
        assert status == 200
        for name in ("maintd_is_leader 1.0", "maintd_leadership_changes_total 1.0",
                     'maintd_service_runs_total{outcome="success",service="cleaner"}',
                     'maintd_service_run_seconds_bucket{le="0.005",service="cleaner"}',
                     'maintd_service_last_success_timestamp_seconds{service="cleaner"}'):
            assert name in body, name
        status, body = _get(port, "/status")
        data = json.loads(body)
        assert status == 200 and data["leader"]["instance_id"] == settings.instance_id
        assert data["this_instance"]["is_leader"] is True
        assert _get(port, "/nope")[0] == 404
        # Bound to loopback only.
        assert daemon.http.server.server_address[0] == "127.0.0.1"
    finally:
        daemon.stop()
    assert not daemon.is_leader


def test_default_http_listen_is_loopback():
    from maintd.config import Settings

    assert Settings().http.host == "127.0.0.1"


def test_sd_notify_sends_ready_and_watchdog(tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2)
    try:
        n = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000"})
        assert n.enabled and n.watchdog_interval == 2.0
        assert n.ready() and n.watchdog()
        assert sock.recv(100) == b"READY=1"
        assert sock.recv(100) == b"WATCHDOG=1"
    finally:
        sock.close()
    assert not SystemdNotifier({}).ready()


def test_maintenance_sessions_are_bounded(settings):
    engine = maintenance_engine(settings)
    try:
        with engine.connect() as conn:
            st = conn.execute(text("SHOW statement_timeout")).scalar()
            idle = conn.execute(text("SHOW idle_in_transaction_session_timeout")).scalar()
            app = conn.execute(text("SHOW application_name")).scalar()
    finally:
        engine.dispose()
    assert st == "30s" and idle == "10s" and app == f"maintd:{settings.instance_id}:work"


def test_job_gauges_refresh_live_often_and_final_counts_when_asked(settings, engine, schema, queue):
    from maintd.status import refresh_job_gauges

    metrics = Metrics()
    with engine.begin() as conn:
        for _ in range(3):
            queue.enqueue(conn, "k", queue="mail")
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state, finalized_at) "
                         "VALUES ('k', 'mail', 'completed', now())", schema))
    refresh_job_gauges(engine, settings, metrics, final=True)
    get = metrics.registry.get_sample_value
    assert get("maintd_jobs", {"queue": "mail", "state": "available"}) == 3
    assert get("maintd_jobs", {"queue": "mail", "state": "completed"}) == 1
    assert get("maintd_oldest_available_job_age_seconds", {"queue": "mail"}) >= 0
    with engine.begin() as conn:
        [job] = queue.claim(conn, "mail", "w")
        queue.complete(conn, job)
    refresh_job_gauges(engine, settings, metrics, final=False)
    assert get("maintd_jobs", {"queue": "mail", "state": "available"}) == 2
    assert get("maintd_jobs", {"queue": "mail", "state": "completed"}) == 1  # not recounted yet
    refresh_job_gauges(engine, settings, metrics, final=True)
    assert get("maintd_jobs", {"queue": "mail", "state": "completed"}) == 2
