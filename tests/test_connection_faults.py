"""Routine faults of the database, classified by SQLSTATE (SPEC 8.5, issue 26): a full server, a
standby listed first in a multi-host URL, a primary set read-only, a copied instance id.

Each against a real PostgreSQL with the settings the fault needs (a private server per test), and
SQLSTATEs as PostgreSQL's "Appendix A. PostgreSQL Error Codes" lists them: 53300
too_many_connections, 57P01 admin_shutdown, 3D000 invalid_catalog_name, 28000
invalid_authorization_specification.
"""

from __future__ import annotations

import json
import os
import socket
import time

import psycopg
import psycopg.conninfo
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from maintd import migrate
from maintd.db import HostOrder, connect, make_engine
from maintd.faults import sqlstate, transient
from maintd.queries import daemons, psycopg_sql

from .procs import START, DaemonProc, lock_holders, wait_for
from .standby import StandbyPair
from .test_operator_truth import _cli as run_cli


def fill(dsn: str, n: int) -> list[psycopg.Connection]:
    """``n`` connections. A backend just refused (or closed) keeps its slot until its process has
    exited, so a free slot may read as taken for a moment ("too many clients"): wait for it."""
    held: list[psycopg.Connection] = []
    deadline = time.monotonic() + 10
    while len(held) < n:
        try:
            held.append(psycopg.connect(dsn, autocommit=True))
        except psycopg.OperationalError as exc:
            if sqlstate(exc) != "53300" or time.monotonic() > deadline:
                for conn in held:
                    conn.close()
                raise
            time.sleep(0.05)
    return held


def migrated(dsn: str, schema: str = "maintd") -> None:
    engine = make_engine(dsn, application_name="maintd-test-migrate", pooled=False)
    with engine.connect() as conn:
        migrate.upgrade(conn, schema)
    engine.dispose()


def connect_error(dsn: str) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as info:
        connect(dsn, application_name="maintd-test")
    return info.value


def test_connect_failures_are_classified_by_sqlstate(make_private_pg, pg_version):
    """A refused connect carries no SQLSTATE in libpq's message; maintd learns it anyway (the
    server's own code, whatever its lc_messages), and waits only for what waiting can fix."""
    pg = make_private_pg({"max_connections": "4", "superuser_reserved_connections": "1"})
    admin = psycopg.connect(pg.dsn, autocommit=True)  # kept: one of the 3 ordinary slots
    admin.execute("CREATE ROLE plain LOGIN")
    plain = pg.dsn.replace("postgres@", "plain@", 1)
    held = [admin, *fill(pg.dsn, 2)]  # the last slot is a superuser's
    try:
        reserved = connect_error(plain)  # "remaining connection slots are reserved ..."
        assert sqlstate(reserved) == "53300" and transient(reserved), reserved
        # The refused backend holds a slot until its process has exited: seen gone from here
        # (a CI run under load once found the last slot taken for all of fill's 10 s).
        backends = "SELECT pid, usename, state, backend_start FROM pg_stat_activity WHERE backend_type = 'client backend'"
        wait_for(lambda: len(admin.execute(backends).fetchall()) == 3, 30)
        try:
            held += fill(pg.dsn, 1)
        except psycopg.OperationalError as exc:
            raise AssertionError(f"the reserved slot is taken: {admin.execute(backends).fetchall()}") from exc
        full = connect_error(pg.dsn)  # "sorry, too many clients already"
        assert sqlstate(full) == "53300" and transient(full), full
    finally:
        for conn in held:
            conn.close()
    no_db = connect_error(pg.dsn.rsplit("/", 1)[0] + "/maintd_no_such_db")
    assert sqlstate(no_db) == "3D000" and not transient(no_db)
    no_role = connect_error(pg.dsn.replace("postgres@", "maintd_no_such_role@", 1))
    assert sqlstate(no_role) == "28000" and not transient(no_role)
    with socket.socket() as sock:  # nobody listens: no server said anything
        sock.bind(("127.0.0.1", 0))
        refused = connect_error(f"postgresql://postgres@127.0.0.1:{sock.getsockname()[1]}/postgres")
    assert sqlstate(refused) is None and transient(refused)
    with psycopg.connect(pg.dsn, autocommit=True) as victim, psycopg.connect(pg.dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (victim.info.backend_pid,))
        with pytest.raises(psycopg.Error) as info:
            victim.execute("SELECT 1")
    assert sqlstate(info.value) == "57P01" and transient(info.value)


@pytest.mark.slow
def test_a_full_server_at_start_is_waited_for_then_led(make_private_pg, tmp_path):
    """53300 at start is an outage, not a configuration error: the daemon keeps retrying (under
    systemd an exit would soon hit StartLimitBurst) and leads once a slot is free."""
    pg = make_private_pg({"max_connections": "5", "superuser_reserved_connections": "0"})
    migrated(pg.dsn)
    held = fill(pg.dsn, 5)
    d = DaemonProc(pg.dsn, "maintd", "full-1", workdir=str(tmp_path)).start()
    try:
        d.wait_log(r"too many clients|database unreachable", START)
        time.sleep(3)
        assert d.proc.poll() is None, d.log()
        assert "53300" in d.log() or "too many clients" in d.log()
        for conn in held:
            conn.close()
        held = []
        # Seen from the daemon: on a server of 5 slots its own sessions may take every one again,
        # and a check from here would be the one refused ("too many clients").
        d.wait_log(r"became leader epoch=\d+ instance=full-1", 20)
    finally:
        for conn in held:
            conn.close()
        d.stop()


def test_a_multi_host_url_without_target_session_attrs_skips_a_standby():
    """libpq tries the hosts in order; with no target_session_attrs it stops at the first that
    answers, a standby included. maintd's writers ask for read-write themselves."""
    order = HostOrder("host=a,b port=1,2 user=u dbname=d")
    assert "target_session_attrs=read-write" in order.dsn()
    assert "target_session_attrs=any" in HostOrder("host=a,b port=1,2 target_session_attrs=any").dsn()
    assert "target_session_attrs" not in HostOrder("host=a port=1 user=u").dsn()


@pytest.mark.slow
def test_a_streaming_standby_listed_first_is_skipped_for_the_primary(tmp_path):
    with StandbyPair() as pair:
        migrated(pair.primary.dsn)
        pair.wait_replayed()
        url = (f"host=127.0.0.1,127.0.0.1 port={pair.standby.port},{pair.primary.port} user=postgres "
               f"dbname=postgres connect_timeout=3")
        d = DaemonProc(url, "maintd", "sb-1", workdir=str(tmp_path)).start()
        try:
            wait_for(lambda: lock_holders(pair.primary.dsn, "maintd") == ["maintd:sb-1"], START,
                     what="leading on the primary")
            assert d.http_get("/readyz")[0] == 200
            assert "cannot execute" not in d.log(), d.log()
        finally:
            d.stop()


def metric(body: str, name: str, **labels: str) -> float | None:
    """The value of the one sample of ``name`` with (at least) these labels; None if none.
    (It took labels inside ``name`` and then never matched: a check of it could not fail.)"""
    found = [s.value for family in text_string_to_metric_families(body) for s in family.samples
             if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


@pytest.mark.slow
def test_a_read_only_primary_is_reported_and_maintenance_pauses(make_private_pg, tmp_path):
    """default_transaction_read_only = on: /readyz 503 naming it, maintd_database_writable 0,
    the leader's passes stop instead of failing one by one; back to normal when it is lifted."""
    pg = make_private_pg()
    migrated(pg.dsn)
    d = DaemonProc(pg.dsn, "maintd", "ro-1", workdir=str(tmp_path)).start()
    try:
        wait_for(lambda: d.http_get("/readyz")[0] == 200, START, what="ready")
        with psycopg.connect(pg.dsn, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM SET default_transaction_read_only = on")
            admin.execute("SELECT pg_reload_conf()")
        wait_for(lambda: d.http_get("/readyz")[0] == 503, 10, what="not ready")
        assert "database is read-only" in d.http_get("/readyz")[1]
        body = d.http_get("/metrics")[1]
        assert metric(body, "maintd_database_writable") == 0.0
        errors = metric(body, "maintd_service_runs_total", service="cleaner", outcome="error")
        assert errors is not None  # (every outcome's series is there from the start)
        time.sleep(3)  # cleaner interval 1 s (DaemonProc's fast settings): no error passes meanwhile
        after = d.http_get("/metrics")[1]
        assert metric(after, "maintd_service_runs_total", service="cleaner", outcome="error") == errors
        assert alive_daemons(pg.dsn) == {"ro-1"}
        with psycopg.connect(pg.dsn, autocommit=True) as admin:  # its lock session cut: it reconnects,
            # and cannot write its row (the new session's pid) while the server is read-only
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'maintd:ro-1'")
        d.wait_log(r"reconnected to database", 15)
        wait_for(lambda: alive_daemons(pg.dsn) == set(), 5, what="shown gone while its row cannot be written")
        with psycopg.connect(pg.dsn, autocommit=True) as admin:
            admin.execute("SET default_transaction_read_only = off")
            admin.execute("ALTER SYSTEM RESET default_transaction_read_only")
            admin.execute("SELECT pg_reload_conf()")
        wait_for(lambda: d.http_get("/readyz")[0] == 200, 10, what="ready again")
        assert metric(d.http_get("/metrics")[1], "maintd_database_writable") == 1.0
        assert "database is read-only: maintenance paused" in d.log()
        wait_for(lambda: alive_daemons(pg.dsn) == {"ro-1"}, 5, what="alive again without another reconnect")
        assert d.log().count("reconnected to database") == 1, d.log()
    finally:
        d.stop()


def test_a_daemon_started_on_a_read_only_primary_reports_it_once_not_an_error_per_try(make_private_pg, tmp_path):
    """SPEC 8.5: a read-only primary is a reported state. A daemon that starts (or follows) on one
    wins the lock but cannot start a term: that is the paused state already reported, not an
    error line per retry_interval; once lifted, it leads."""
    pg = make_private_pg()
    migrated(pg.dsn)
    with psycopg.connect(pg.dsn, autocommit=True) as admin:
        admin.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        admin.execute("SELECT pg_reload_conf()")
    d = DaemonProc(pg.dsn, "maintd", "ro-2", workdir=str(tmp_path)).start()
    try:
        wait_for(lambda: d.http_get("/readyz")[0] == 503 and "database is read-only" in d.http_get("/readyz")[1],
                 START, what="not ready: read-only")  # includes the start-up
        time.sleep(3)  # retry_interval 0.2 s (DaemonProc's fast settings): a dozen tries meanwhile
        assert metric(d.http_get("/metrics")[1], "maintd_database_writable") == 0.0
        log_text = d.log()
        assert "database is read-only: maintenance paused" in log_text
        assert "could not start a term" not in log_text, log_text
        with psycopg.connect(pg.dsn, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM RESET default_transaction_read_only")
            admin.execute("SELECT pg_reload_conf()")
        wait_for(lambda: metric(d.http_get("/metrics")[1], "maintd_is_leader") == 1.0, 15, what="leads once writable")
        wait_for(lambda: d.http_get("/readyz")[0] == 200, 10, what=f"ready: {d.http_get('/readyz')} {d.log()}")
        # Its row could not be written at connect: it is written once the server takes writes,
        # so `maintd status` and the other replicas' spread see it alive without a reconnect.
        wait_for(lambda: alive_daemons(pg.dsn) == {"ro-2"}, 5, what=f"registered alive: {registered_rows(pg.dsn)}")
    finally:
        d.stop()


def registered_rows(dsn: str, schema: str = "maintd") -> list[tuple]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(psycopg_sql(daemons.REGISTERED, schema)).fetchall()


def alive_daemons(dsn: str) -> set[str]:
    return {row[0] for row in registered_rows(dsn) if row[5]}


@pytest.mark.slow
def test_a_second_daemon_with_a_live_instance_id_is_refused(pg_dsn, schema, tmp_path):
    """SPEC 8.4: exit 2, naming the other's host and pid; the first keeps its row and its lead."""
    first = DaemonProc(pg_dsn, schema, f"dup-{os.getpid()}", workdir=str(tmp_path)).start()
    try:
        wait_for(lambda: lock_holders(pg_dsn, schema) == [f"maintd:{first.instance_id}"], START, what="the first leads")
        (tmp_path / "b").mkdir()
        second = DaemonProc(pg_dsn, schema, first.instance_id, workdir=str(tmp_path / "b")).start()
        try:
            assert second.proc.wait(30) == 2, second.log()
        finally:
            second.stop()
        assert f"pid {first.pid}" in second.log() and socket.gethostname() in second.log(), second.log()
        assert lock_holders(pg_dsn, schema) == [f"maintd:{first.instance_id}"]
    finally:
        first.stop()


def test_a_schema_dropped_while_running_is_named_not_unreachable(pg_dsn, tmp_path):
    """Issue 26: a dropped schema is reported as "run `maintd migrate`", never "database
    unreachable"; the other target keeps working (its renewals read only pg_locks)."""
    from maintd.config import Settings
    from maintd.daemon import Daemon

    from .conftest import new_schema_name

    names = [new_schema_name() for _ in range(2)]
    engine = make_engine(pg_dsn, application_name="maintd-test-migrate", pooled=False)
    with engine.connect() as conn:
        for name in names:
            migrate.upgrade(conn, name)
    daemon = Daemon(Settings(database_url=pg_dsn, instance_id=f"drop-{os.getpid()}", http={"listen": "127.0.0.1:0"},
                             leader={"lease": "3s", "renew_interval": "1s", "retry_interval": "0.2s"},
                             targets=[{"schema": n} for n in names], rescuer={"interval": "1s"}))
    daemon.start()
    try:
        wait_for(lambda: all(t.is_leader for t in daemon.targets), 15, what="both led")
        for attempt in range(5):  # an operator's DROP meeting the leader's locks may be the deadlock's victim
            try:
                with psycopg.connect(pg_dsn, autocommit=True) as conn:
                    conn.execute(f'DROP SCHEMA "{names[0]}" CASCADE')
                break
            except psycopg.errors.DeadlockDetected:
                if attempt == 4:
                    raise
                time.sleep(0.2)

        def reason():
            daemon.tick()
            return daemon.targets[0].not_ready_reason()

        why = wait_for(reason, 15, what="the dropped schema named")
        assert "run `maintd migrate`" in why and "unreachable" not in why, why
        assert daemon.targets[1].is_leader and daemon.targets[1].not_ready_reason() is None
    finally:
        daemon.stop()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for name in names:
                conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def test_a_database_with_other_date_and_interval_styles_is_maintained_and_shown(pg_dsn, tmp_path):
    """A database (or role) may default to another DateStyle or IntervalStyle (PostgreSQL's
    "Client Connection Defaults": ``ALTER DATABASE ... SET DateStyle = 'SQL, DMY'``). psycopg 3
    loads timestamps only in the ISO DateStyle (else "can't parse timestamptz with DateStyle
    'SQL, DMY'", every pass and `maintd status` failed) and intervals only in the postgres style:
    maintd pins both in each session it opens."""
    name = f"maintd_styles_{os.getpid()}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name}")
        admin.execute(f"CREATE DATABASE {name}")
        admin.execute(f"ALTER DATABASE {name} SET DateStyle = 'SQL, DMY'")
        admin.execute(f"ALTER DATABASE {name} SET IntervalStyle = 'iso_8601'")
    dsn = psycopg.conninfo.make_conninfo(pg_dsn, dbname=name)
    try:
        migrated(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT now()::text").fetchone()[0][2] == "/"  # the database's style, as a client sees it
            conn.execute("INSERT INTO maintd.jobs (kind, state, finalized_at) VALUES ('old', 'completed', now() - interval '30 days')")
            conn.execute("INSERT INTO maintd.jobs (kind, state, scheduled_at) VALUES ('due', 'scheduled', now() - interval '1 minute')")
        cfg = tmp_path / "styles.toml"
        cfg.write_text(f'database_url = "{dsn}"\ninstance_id = "styles"\n')
        for service in ("cleaner", "scheduler", "rescuer", "periodic", "partitioner"):
            rc, out, err = run_cli("--config", str(cfg), "run-once", service)
            assert rc == 0 and json.loads(out)["outcome"] == "success", (service, out, err)
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT kind, state FROM maintd.jobs").fetchall() == [("due", "available")]
        rc, out, err = run_cli("--config", str(cfg), "status", "--json")
        assert rc == 0 and json.loads(out)["time"][4] == "-", (out, err)  # the server's time, ISO
        rc, out, err = run_cli("--config", str(cfg), "jobs", "list")
        assert rc == 0 and "due" in out, (out, err)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_a_url_s_own_libpq_parameters_win_over_defaults_and_those_maintd_replaces_are_said(pg_dsn, configured,
                                                                                         maintd_log):
    """``?keepalives_idle=...&connect_timeout=...`` in database_url were silently replaced by
    maintd's defaults. Now the URL's keepalives and connect timeout win (for the work pool;
    the lock session and the dashboard's readers keep their own connect timeouts), and what
    maintd must set itself (its session names, the lease's bounds) is said once at start."""
    url = pg_dsn + ("&" if "?" in pg_dsn else "?") + \
        "keepalives_idle=77&connect_timeout=9&application_name=mine&tcp_user_timeout=1234"
    conn = connect(url, application_name="maintd-test")
    try:
        given = conn.info.get_parameters()
        assert given["keepalives_idle"] == "77" and given["connect_timeout"] == "9", given
        assert given["keepalives_interval"] == "2" and given["application_name"] == "maintd-test", given
    finally:
        conn.close()
    from maintd.daemon import Daemon

    settings = configured(instance_id="url-params", http={"enabled": False})
    daemon = Daemon(settings.model_copy(update={"database_url": SecretStr(url)}))
    daemon.start()
    try:
        wait_for(lambda: daemon.is_leader, 10, what="leadership")
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            names = [r[0] for r in admin.execute(
                "SELECT application_name FROM pg_stat_activity WHERE application_name LIKE %s "
                "OR application_name = 'mine'", ["maintd:url-params:%"])]
        assert names and "mine" not in names, names
    finally:
        daemon.stop()
    said = [line for line in maintd_log if "database_url: parameters replaced" in line]
    assert len(said) == 1, said
    assert "application_name=mine (maintd uses" in said[0] and "tcp_user_timeout=1234 (maintd uses leader.lease for the lock session and the passes)" in said[0]
    assert "connect_timeout=9 (maintd uses leader.lease for the lock session" in said[0]
    assert "keepalives" not in said[0], said


def test_a_silent_database_at_start_costs_one_connect_timeout_not_one_per_target(pg_dsn):
    """Under systemd (Type=notify, the default TimeoutStartSec of 90 s) the start must end in
    bounded time. With the database silent (a partition: connects time out), start() tried
    each target's schema in turn, a 5 s connect timeout each, after the lock session's own:
    5 + 5 x N seconds before READY=1, so about 17 targets never started (the unit killed and
    restarted them over and over), whatever the other databases' targets. Now a database whose
    first connect timed out has its targets retried in the background at once; once it
    answers they start."""
    from sqlalchemy import text

    from maintd.config import Settings
    from maintd.daemon import Daemon

    from .netproxy import NetProxy

    schemas = [f"t_silent_{os.getpid()}_{i}" for i in range(6)]
    engine = make_engine(pg_dsn, application_name="maintd-test-migrate", pooled=False)
    with engine.connect() as conn:
        for name in schemas:
            migrate.upgrade(conn, name)
    try:
        with NetProxy.for_dsn(pg_dsn) as proxy:
            proxy.blackhole()
            daemon = Daemon(Settings(database_url=proxy.dsn(pg_dsn), schema=schemas[0], instance_id="silent-1",
                                     http={"enabled": False}, targets=[{"schema": s} for s in schemas]))
            started = time.monotonic()
            try:
                daemon.start()
                took = time.monotonic() - started
                assert took < 15, f"start() took {took:.0f} s with {len(schemas)} targets on a silent database"
                proxy.heal()
                wait_for(lambda: all(t.started for t in daemon.targets), 30, what="every target started once healed")
            finally:
                daemon.stop()
    finally:
        with engine.connect() as conn:
            for name in schemas:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
            conn.commit()
        engine.dispose()


def test_a_pass_on_a_silent_server_waits_for_one_connect_timeout_not_three(pg_dsn, tmp_path):
    """A pass reads the server's time when it starts, runs, and reads it again when it ends. On a
    server that never answers each of the three waited for its own connect timeout: `maintd
    run-once cleaner --dry-run` took 16 s to say "no answer within connect_timeout 5 s", and every
    failing pass of a daemon held its thread three times as long. A pass whose start cannot be
    read now fails at once with that error: one connection tried, one timeout waited."""
    from .netproxy import NetProxy

    with NetProxy.for_dsn(pg_dsn) as proxy:
        proxy.blackhole()
        cfg = tmp_path / "silent.toml"
        cfg.write_text(f'database_url = "{proxy.dsn(pg_dsn)}"\ninstance_id = "silent-pass"\n')
        started = time.monotonic()
        rc, out, err = run_cli("--config", str(cfg), "run-once", "cleaner", "--dry-run")
        took = time.monotonic() - started
        assert rc == 1 and json.loads(out)["outcome"] == "error", (out, err)
        assert f"127.0.0.1:{proxy.port}" in json.loads(out)["error"], out
        assert proxy._count == 1, f"{proxy._count} connections tried in {took:.1f} s"
