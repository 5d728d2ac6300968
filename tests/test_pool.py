"""The work pool's checkout check (db._check_on_checkout), seen on the wire through the TCP proxy:
an idle pass sends one statement (no pre-ping round trip), a connection the server ended (a
FATAL message and end of file on its socket) or one the network closed is replaced before a pass
uses it, and a connection idle in the pool longer than PING_AFTER_IDLE is pinged first.

Outside references: SQLAlchemy's "Connection Pooling / Disconnect Handling - Pessimistic" (a
``checkout`` listener that raises DisconnectionError makes the pool discard that connection and
check out another, up to three times); PostgreSQL's "Server Signaling Functions"
(``pg_terminate_backend`` ends the session, whose client then reads the FATAL "terminating
connection due to administrator command"); pgx's pgxpool ``ShouldPing`` default (ping only a
connection idle over a second), which this goes past."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
import pytest

from maintd import db
from maintd.clock import ServerClock
from maintd.config import Settings
from maintd.passes import Outcome, execute_pass, maintenance_engine
from maintd.services.base import PassContext
from maintd.services.scheduler import Scheduler

from .netproxy import NetProxy
from .procs import wait_for


class Wire:
    """The statements maintd's work connections send through ``proxy``."""

    def __init__(self, proxy: NetProxy):
        self.seen: list[str] = []
        self._lock = threading.Lock()
        proxy.on_statement(r"^\s*;\s*$", lambda link: self._add(link, "ping"), once=False)
        proxy.on_statement(r"\S", lambda link: self._add(link, "statement"), once=False)

    def _add(self, link, what: str) -> None:
        if link.app.endswith(":work"):
            with self._lock:
                self.seen.append(what)

    def take(self) -> list[str]:
        time.sleep(0.05)  # the proxy thread has seen every byte sent (the answers came back)
        with self._lock:
            out, self.seen = self.seen, []
        return out


@pytest.fixture
def wired(settings, pg_dsn):
    """(settings through the proxy, the proxy, its Wire, the work engine, a scheduler pass)."""
    with NetProxy.for_dsn(pg_dsn) as proxy:
        # An instance id of its own: the test ends its work connections by application_name.
        via = Settings(database_url=proxy.dsn(pg_dsn), schema=settings.schema,
                       instance_id=f"pool-{uuid.uuid4().hex[:8]}", scheduler={"precise_timing": False})
        work = maintenance_engine(via)
        clock = ServerClock()
        service = Scheduler(via.scheduler)

        def run_pass():
            return execute_pass("scheduler", service, PassContext.for_settings(via, work, clock))

        try:
            yield via, proxy, Wire(proxy), work, run_pass
        finally:
            work.dispose()


def test_an_idle_pass_sends_one_statement_and_no_ping(wired):
    """SQLAlchemy's pool_pre_ping sent ';' before every pass: two round trips where one does
    (issue 17.2's idle tick)."""
    _, _, wire, _, run_pass = wired
    assert run_pass().outcome is Outcome.SUCCESS  # a new connection: its session setup
    wire.take()
    for _ in range(10):
        assert run_pass().outcome is Outcome.SUCCESS
    seen = wire.take()
    assert seen.count("ping") == 0 and seen.count("statement") == 10, seen


def test_a_connection_the_server_ended_is_replaced_before_the_pass(wired, pg_dsn):
    """pg_terminate_backend (as idle_session_timeout, a restart or an operator would end it): the
    server's FATAL message and end of file wait on the pooled socket; the checkout sees them,
    pings, and the pool opens another connection. No pass fails."""
    via, _, wire, _, run_pass = wired
    assert run_pass().outcome is Outcome.SUCCESS
    app = f"maintd:{via.instance_id}:work"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        pids = [r[0] for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND client_port IS NOT NULL "
            "AND pid <> pg_backend_pid()", (app,))]
        assert pids
        for pid in pids:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    wait_for(lambda: _backends(pg_dsn, app) == 0, 10, 0.05, "the work backends gone")
    for _ in range(3):
        record = run_pass()
        assert record.outcome is Outcome.SUCCESS, record.error


def test_a_connection_the_network_closed_is_replaced_before_the_pass(wired):
    via, proxy, _, work, run_pass = wired
    assert run_pass().outcome is Outcome.SUCCESS
    proxy.close_all()
    # The network's close has reached the pooled sockets (on a loaded machine the loopback's FIN
    # can be handled after the proxy's close() returns: CI once ran the pass before it arrived,
    # which is the case of a server that vanishes mid-pass, not this one).
    pooled = [rec.dbapi_connection for rec in list(work.pool._pool.queue)]
    assert pooled
    wait_for(lambda: all(db.readable(c.pgconn.socket) for c in pooled), 10, 0.01, "the close seen by the pool")
    record = run_pass()
    assert record.outcome is Outcome.SUCCESS, record.error


def test_a_connection_idle_longer_than_the_limit_is_pinged_first(wired, monkeypatch):
    _, _, wire, _, run_pass = wired
    assert run_pass().outcome is Outcome.SUCCESS
    monkeypatch.setattr(db, "PING_AFTER_IDLE", 0.2)
    time.sleep(0.3)
    wire.take()
    assert run_pass().outcome is Outcome.SUCCESS
    assert wire.take() == ["ping", "statement", "statement"]  # the ping matches both patterns


def _backends(dsn: str, app: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                            (app,)).fetchone()[0]
