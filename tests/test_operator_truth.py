"""What maintd tells operators is so (SPEC 8.4, issue 28). One test (or more) per row of the issue
that has no better home; row 1 is tests/test_readme_sql.py, row 3 tests/test_pass_summary.py."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
from datetime import datetime
import time
import urllib.error
import urllib.request
import uuid

import pytest
from sqlalchemy.exc import DBAPIError

from maintd.cli import main
from maintd.config import Settings
from maintd.dashboard import Dashboard
from maintd.http import Request
from maintd.db import describe_db_error
from maintd.queries import periodic_jobs, sql
from maintd.status import collect_status, format_status

from .procs import START, DaemonProc, wait_for
from .test_grants import login_role, role_dsn


def unique(prefix: str) -> str:
    """Instance ids are unique on the shared server (tests run at once)."""
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


# -- row 4: a SIGKILLed replica is gone at once ----------------------------------------------------


def _overview_html(settings: Settings) -> str:
    status, _, body, _ = Dashboard(lambda: settings).index(Request("/", {"refresh": ["0"]}))
    assert status == 200
    return body.decode()


@pytest.mark.slow
def test_a_killed_replica_is_shown_gone_as_soon_as_its_session_is(pg_dsn, schema, engine):
    """The issue saw it counted alive, as a follower, for up to a minute."""
    settings = Settings(database_url=pg_dsn, schema=schema, instance_id="reader")
    a, b = unique("a"), unique("b")
    leader = DaemonProc(pg_dsn, schema, a).start()
    follower = None
    try:
        leader.wait_log(r"became leader", timeout=START)
        follower = DaemonProc(pg_dsn, schema, b).start()
        wait_for(lambda: {d["instance_id"] for d in collect_status(engine, schema)["daemons"]} == {a, b},
                 START, what="both replicas alive")
        html = _overview_html(settings)
        assert re.search(r'id="replicas-alive">2<', html)
        follower.kill()  # SIGKILL: its lock session ends with it
        killed = time.monotonic()
        st = wait_for(lambda: (lambda s: s if [d["instance_id"] for d in s["gone"]] == [b] else None)(
            collect_status(engine, schema)), 10, interval=0.05, what="the killed replica shown gone")
        took = time.monotonic() - killed
        assert took < 3, took  # the session's end, not a minute
        assert [d["instance_id"] for d in st["daemons"]] == [a]
        assert re.search(rf"{b}\s.*gone \(no lock session; last seen ", format_status(st))
        html = _overview_html(settings)
        assert re.search(r'id="replicas-alive">1<', html)
        row = re.search(rf'<tr data-instance="{b}">(.*?)</tr>', html, re.S).group(1)
        assert "gone" in row and "follower" not in row
        # A replica that last connected over an hour ago (any that ran that long: the row is
        # written at connect) is shown gone too: the live one records when it saw it leave.
        # Before, it vanished from status at once, and its row was forgotten.
        follower.stop()
        follower = DaemonProc(pg_dsn, schema, c := unique("c")).start()
        wait_for(lambda: c in {d["instance_id"] for d in collect_status(engine, schema)["daemons"]}, START,
                 what="the third replica alive")
        time.sleep(4)  # the leader reads the live replicas every second: it has seen c by now, as it
        # has seen any replica that ran for an hour (CI once killed c before the leader's next read)
        with engine.begin() as conn:
            conn.execute(sql("UPDATE {schema}.daemons SET last_seen_at = now() - interval '2 hours' "
                             "WHERE instance_id = :c", schema), {"c": c})
        follower.kill()
        wait_for(lambda: c in [d["instance_id"] for d in collect_status(engine, schema)["gone"]], 10,
                 interval=0.1, what="the long-running replica shown gone")
    finally:
        if follower is not None:
            follower.stop()
        leader.stop()


def test_a_daemon_stopped_cleanly_after_an_hour_is_shown_gone(pg_dsn, schema, engine):
    """Its row is written when its lock session connects: one that ran for over an hour and then
    stopped, with no live replica left to see it leave, vanished from `maintd status` at once
    ("daemons: none alive", nothing gone). A daemon that stops records when it left."""
    from maintd.daemon import Daemon

    me = unique("clean")
    daemon = Daemon(Settings(database_url=pg_dsn, schema=schema, instance_id=me, http={"enabled": False},
                             leader={"lease": "3s", "renew_interval": "0.5s"}))
    daemon.start()
    try:
        wait_for(lambda: [d["instance_id"] for d in collect_status(engine, schema)["daemons"]] == [me], START,
                 what="the daemon registered")
        with engine.begin() as conn:  # it connected two hours ago
            conn.execute(sql("UPDATE {schema}.daemons SET last_seen_at = now() - interval '2 hours', "
                             "started_at = now() - interval '2 hours'", schema))
    finally:
        daemon.stop()
    st = collect_status(engine, schema)
    assert st["daemons"] == [] and [d["instance_id"] for d in st["gone"]] == [me], st
    # when it left: the gone entries dropped last_seen_at, so neither the text nor the JSON said
    left = datetime.fromisoformat(st["gone"][0]["last_seen_at"])
    assert abs((datetime.fromisoformat(st["time"]) - left).total_seconds()) < 30, st["gone"]
    assert f"gone (no lock session; last seen {left:%Y-%m-%d %H:%M:%S} UTC)" in format_status(st)


def _readyz(pg_dsn: str, schema: str, name: str, other: dict) -> tuple[int, str]:
    """/readyz (status, body) of a daemon of this process with two targets: ``schema`` ready, and
    ``other``, once the first has its lock session."""
    from maintd.daemon import Daemon

    daemon = Daemon(Settings(database_url=pg_dsn, instance_id=unique(name), http={"enabled": False},
                             leader={"lease": "3s", "renew_interval": "0.5s"},
                             targets=[{"name": "ok", "schema": schema}, other]))
    daemon.start()
    try:
        wait_for(lambda: daemon.targets[0].db_ok, START, what="the lock session")
        status, _, body = daemon._readyz()
        return status, body.decode()
    finally:
        daemon.stop()


def test_readyz_says_a_target_whose_schema_is_missing_needs_maintd_migrate(pg_dsn, schema):
    """A target whose schema was checked and found missing (or behind) was reported as one whose
    schema "could not be checked", as for an unreachable database or a missing grant."""
    missing = f"t_{uuid.uuid4().hex[:12]}"
    status, body = _readyz(pg_dsn, schema, "ready", {"name": "new", "schema": missing})
    assert status == 503 and body == \
        "not ready: 1 of 2 targets: new (not started: its schema is missing or behind: run `maintd migrate`)\n", body


def test_readyz_says_a_target_whose_database_is_down_at_start_is_unreachable(pg_dsn, schema):
    """The README's /readyz for a target whose database is down: ``billing (database unreachable
    (see /status or the log))``. A target whose database was already down when the daemon started
    read ``(not started: its schema could not be checked ...)``, sending the operator to look at
    a schema the daemon never reached."""
    from maintd.embedded import free_port

    down = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"  # nobody listens there
    status, body = _readyz(pg_dsn, schema, "down", {"name": "billing", "schema": "billing", "database_url": down})
    assert status == 503 and body == \
        "not ready: 1 of 2 targets: billing (database unreachable (see /status or the log))\n", body


def test_a_followers_status_says_where_the_table_health_is(pg_dsn, schema, settings):
    """SPEC 8.2: /status names the holder of the xmin horizon. A replica that does not lead reads
    no health: its /status had `"health": null` and nothing more, as if nothing were read (its
    job figures say that the leader counts them)."""
    from maintd.daemon import Daemon
    from maintd.leader import acquire_once

    elector, _ = acquire_once(settings)  # another instance leads
    daemon = Daemon(Settings(database_url=pg_dsn, schema=schema, instance_id=unique("fol"), http={"enabled": False},
                             leader={"lease": "3s", "renew_interval": "0.5s"}))
    daemon.start()
    try:
        wait_for(lambda: daemon.targets[0].db_ok, START, what="the lock session")
        code, _, body = daemon._status()
        st = json.loads(body)
        assert code == 200 and st["health"] is None and not st["this_instance"]["is_leader"], st
        assert "leader" in (st.get("health_note") or ""), st
    finally:
        daemon.stop()
        elector.stop()


@contextlib.contextmanager
def _led_primary_with_a_standby():
    """A primary (migrated, schema maintd) and its streaming standby, a daemon of this process
    leading on the primary; yields the pair and the daemon's instance id once the standby has
    replayed up to the lead."""
    from maintd import migrate
    from maintd.daemon import Daemon
    from maintd.db import make_engine

    from .standby import StandbyPair

    with StandbyPair() as pair:
        engine = make_engine(pair.primary.dsn, application_name="maintd-test-migrate", pooled=False)
        with engine.connect() as conn:
            migrate.upgrade(conn, "maintd")
        engine.dispose()
        me = unique("sb")
        daemon = Daemon(Settings(database_url=pair.primary.dsn, schema="maintd", instance_id=me,
                                 http={"enabled": False}, leader={"lease": "3s", "renew_interval": "0.5s"}))
        daemon.start()
        try:
            wait_for(lambda: daemon.is_leader, START, what="leading on the primary")
            pair.wait_replayed()
            yield pair, me
        finally:
            daemon.stop()


@pytest.mark.slow
def test_status_through_a_multi_host_url_with_the_standby_first_reads_the_primary():
    """pg_locks and pg_stat_activity are each server's own: read on a standby (the first host of
    a multi-host URL after a failover, which libpq takes without target_session_attrs), the
    leader read as none and every live daemon as gone. The readers ask for the primary (a
    read-only primary will do: status only reads)."""
    from maintd.cli import _status_one

    with _led_primary_with_a_standby() as (pair, me):
        url = (f"host=127.0.0.1,127.0.0.1 port={pair.standby.port},{pair.primary.port} user=postgres "
               f"dbname=postgres connect_timeout=3")
        st, error = _status_one(Settings(database_url=url, schema="maintd", instance_id="reader"))
        assert error is None, error
        assert (st["leader"] or {}).get("instance_id") == me, st["leader"]
        assert [d["instance_id"] for d in st["daemons"]] == [me] and st["gone"] == [], st


@pytest.mark.slow
def test_status_on_a_standby_says_so_instead_of_no_leader_and_every_daemon_gone():
    """A single-host URL to a standby (a read replica, the old primary's name after a failover):
    `maintd status` read pg_locks and pg_stat_activity there, which are the standby's own, and
    said "leader: none", "daemons: none alive", the live leader under gone and "database:
    read-only (maintenance paused)", exit 0, while the daemon led on the primary."""
    from maintd.cli import _status_one

    with _led_primary_with_a_standby() as (pair, _):
        st, error = _status_one(Settings(database_url=pair.standby.dsn, schema="maintd", instance_id="reader"))
        assert st is None and error is not None, st
        assert "standby" in error and "primary" in error, error


# -- row 11: periodic pause on an entry of the config or the crontab file ------------------------


def _cli(*argv: str) -> tuple[int, str, str]:
    """``maintd ...`` in this process, with its exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_periodic_pause_on_a_file_entry_says_to_edit_that_file(pg_dsn, schema, tmp_path):
    """The issue: "not found" although `periodic list` shows the entry."""
    (tmp_path / "maintd.crontab").write_text("# nightly\n0 4 * * * send_report ?id=nightly\n")
    cfg = tmp_path / "maintd.toml"
    cfg.write_text(f'database_url = "{pg_dsn}"\nschema = "{schema}"\ncrontab = "maintd.crontab"\n'
                   '[[periodic]]\nid = "hourly"\nschedule = "@hourly"\nkind = "tick"\n')
    rc, out, _ = _cli("--config", str(cfg), "periodic", "list")
    assert rc == 0 and "nightly" in out and "hourly" in out
    rc, out, err = _cli("--config", str(cfg), "periodic", "pause", "nightly")
    assert rc == 2 and out == "", err
    assert f"{tmp_path / 'maintd.crontab'}:2" in err and "comment the line out" in err and "SIGHUP" in err
    rc, _, err = _cli("--config", str(cfg), "periodic", "remove", "hourly")
    assert rc == 2 and str(cfg) in err and "delete the entry" in err, err
    rc, _, err = _cli("--config", str(cfg), "periodic", "pause", "hourly")
    assert rc == 2 and "enabled = false" in err, err
    rc, _, err = _cli("--config", str(cfg), "periodic", "add", "nightly", "--schedule", "@daily", "--kind", "k")
    assert rc == 2 and "not a row of periodic_jobs" in err, err
    # A row is still paused as before; an unknown id is still "not found".
    assert _cli("--config", str(cfg), "periodic", "add", "rowly", "--schedule", "@daily", "--kind", "k")[0] == 0
    assert _cli("--config", str(cfg), "periodic", "pause", "rowly")[:2] == (0, "periodic rowly: paused\n")
    rc, out, err = _cli("--config", str(cfg), "periodic", "pause", "nope")
    assert rc == 1 and out == "" and "periodic nope: not found" in err


# -- row 12 and the smaller items: exit codes, and errors that say what fixes them -----------------


def _config(tmp_path, dsn: str, schema: str) -> str:
    cfg = tmp_path / "maintd.toml"
    cfg.write_text(f'database_url = "{dsn}"\nschema = "{schema}"\ninstance_id = "{unique("truth")}"\n'
                   '[leader]\nlease = "3s"\nrenew_interval = "1s"\nretry_interval = "0.2s"\n')
    return str(cfg)


def test_a_malformed_database_url_is_a_config_error(monkeypatch):
    for url in ("not a url", "postgresql://u:hunter2@db:99999/app", "postgresql://u:hunter2@[::1/app"):
        monkeypatch.setenv("MAINTD_DATABASE_URL", url)
        for argv in (("check-config",), ("status",), ("jobs", "list")):
            rc, out, err = _cli(*argv)
            assert rc == 2 and "database_url" in err and "hunter2" not in err, (url, argv, err)


@pytest.mark.parametrize("url,hint", [
    # libpq's parse errors quote the text at fault: here, all or part of the password
    ("postgresql://u:Pa%zzssw0rdX@h/db", "%25"),
    ("postgresql://u:Pa%00ssw0rdX@h/db", "%00"),
    ("postgresql://u:Pass w0rdX@h/db", "%20"),
    ("host=h user=u password=Pass w0rdX dbname=d", "quote a value"),
    ("postgresql://u@h/db?password=Pa&ssw0rdX", "%26"),
    ("postgresql://u:Pa/ssw0rdX@h/db", "%2F"),  # 'Pa' read as the port
    ("postgresql://u:D4em@nPw_ssw0rdX@127.0.0.1:5432/db", "%40"),  # 'nPw_ssw0rdX@127.0.0.1' read as the host
])
def test_a_malformed_database_url_never_shows_any_part_of_its_password(monkeypatch, url, hint):
    """Malformed URLs whose password libpq's message (or ours) quoted, whole or in part; one with
    an '@' in its password was taken as a host name, shown in every retry's log line, in /status
    and on the dashboard, and retried forever as an outage."""
    monkeypatch.setenv("MAINTD_DATABASE_URL", url)
    for argv in (("check-config",), ("status",), ("run",)):
        rc, out, err = _cli(*argv)
        assert rc == 2 and "database_url" in err and hint in err, (argv, err)
        assert "w0rdX" not in out + err and "Pa" not in (out + err).replace("Path", ""), (argv, out, err)


def test_an_unmigrated_schema_says_run_migrate_first_everywhere(pg_dsn, tmp_path):
    cfg = _config(tmp_path, pg_dsn, f"t_{uuid.uuid4().hex[:12]}")  # no such schema
    for argv in (("jobs", "list"), ("jobs", "show", "1"), ("jobs", "retry", "1"), ("status",),
                 ("periodic", "list"), ("run-once", "cleaner", "--dry-run"), ("run-once", "scheduler")):
        rc, out, err = _cli("--config", cfg, *argv)
        assert rc == 1 and "run `maintd migrate` first" in out + err, (argv, rc, out, err)
        assert "Traceback" not in err


def test_a_schema_a_migration_behind_says_run_migrate_first(pg_dsn, tmp_path):
    """The maintd package upgraded before `maintd migrate` ran: `periodic list` on a schema at
    0018 failed with a bare 'column "resumed_at" does not exist' (a column 0019 adds), not the
    "run `maintd migrate` first" a missing table gets. Each column a later migration adds
    (daemons.lock_pid, periodic_slots.schedule, periodic_jobs.resumed_at) gets it now."""
    from maintd import migrate
    from maintd.db import make_engine

    schema = f"t_{uuid.uuid4().hex[:12]}"
    engine = make_engine(pg_dsn, application_name="maintd-test-migrate", pooled=False)
    try:
        with engine.connect() as conn:
            migrate.upgrade(conn, schema, "0018")
        cfg = _config(tmp_path, pg_dsn, schema)
        # `periodic list` reads no column 0019 adds (since the one listing of d176371): it lists
        with engine.begin() as conn:
            conn.exec_driver_sql(f"INSERT INTO \"{schema}\".periodic_jobs (id, schedule, kind) VALUES ('r1', '@every 1h', 'k')")
        rc, out, err = _cli("--config", cfg, "periodic", "list")
        assert rc == 0 and "r1" in out and "Traceback" not in err, (rc, out, err)
        # what reads one (the enqueuer's read of the rows) is told to run migrate, not a bare error
        with pytest.raises(DBAPIError) as raised, engine.connect() as conn:
            conn.execute(sql(periodic_jobs.ALL, schema), {"n": None})
        said = describe_db_error(raised.value)
        assert "resumed_at" in said and "run `maintd migrate` first" in said, said
        # run-once refuses it as `run` does (it ran the pass: a dry run said success)
        for argv in (("run-once", "cleaner", "--dry-run"), ("run-once", "periodic")):
            rc, out, err = _cli("--config", cfg, *argv)
            assert rc == 1 and "is at revision 0018, this maintd needs 0020: run `maintd migrate`" in err, \
                (argv, rc, out, err)
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        engine.dispose()


def test_an_unmigrated_schema_error_names_the_database_it_looked_in(pg_dsn, tmp_path):
    """"run `maintd migrate` first" is also what a command connected to the wrong database says
    (a shell without the unit's EnvironmentFile: config.example.toml's localhost/postgres); an
    operator who obeys it there makes the schema in that wrong database. The line names the
    database, host and role it read, never the password."""
    from urllib.parse import urlsplit

    url = urlsplit(pg_dsn)
    dbname = url.path.lstrip("/") or url.username
    cfg = _config(tmp_path, pg_dsn, f"t_{uuid.uuid4().hex[:12]}")  # no such schema
    for argv in (("status",), ("jobs", "list"), ("jobs", "retry", "1"), ("periodic", "list"),
                 ("run-once", "cleaner", "--dry-run")):
        rc, out, err = _cli("--config", cfg, *argv)
        assert rc == 1 and "run `maintd migrate` first" in out + err, (argv, out, err)
        assert f"database {dbname!r} on {url.hostname}:{url.port or 5432} as {url.username!r}" in out + err, \
            (argv, out + err)
        if url.password:
            assert url.password not in out + err


def test_status_on_a_schema_behind_this_maintd_says_run_migrate(pg_dsn, tmp_path):
    """A schema at an older revision (a rolling upgrade: the new binary first): `maintd status`
    failed with "column d.lock_pid does not exist", naming nothing that fixes it."""
    from maintd import migrate
    from maintd.db import make_engine

    name = f"t_{uuid.uuid4().hex[:12]}"
    engine = make_engine(pg_dsn, application_name="maintd-test-migrate", pooled=False)
    try:
        with engine.connect() as conn:
            migrate.upgrade(conn, name, revision="0009")
        with engine.begin() as conn:
            conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue) VALUES ('k', 'mail')", name))
        for argv in (("status",), ("status", "--json")):
            rc, out, err = _cli("--config", _config(tmp_path, pg_dsn, name), *argv)
            assert rc == 1 and "at revision 0009" in err and "run `maintd migrate`" in err, (argv, err)
        # An operator mid-upgrade still sees what can be read (it said the schema was behind, nothing
        # else), with the note; what 0009 cannot answer (daemons.lock_pid, 0010's) says why.
        rc, out, err = _cli("--config", _config(tmp_path, pg_dsn, name), "status")
        assert "schema behind: schema " in out and "at revision 0009" in out, out
        assert "leader: none" in out and "mail" in out and "available" in out, out
        assert "daemons: not read (" in out and "lock_pid" in out, out
        rc, out, err = _cli("--config", _config(tmp_path, pg_dsn, name), "status", "--json")
        st = json.loads(out)
        assert "at revision 0009" in st["schema_behind"] and st["leader"] is None, st
        assert {"queue": "mail", "state": "available", "count": 1} in st["jobs"], st
        assert "lock_pid" in st["not_read"]["daemons"], st
    finally:
        with engine.connect() as conn:
            conn.execute(sql("DROP SCHEMA {schema} CASCADE", name))
            conn.commit()
        engine.dispose()


def test_a_lost_connection_while_reading_a_schema_behind_is_said_as_such(pg_dsn):
    """On a schema behind this maintd each part is read in a savepoint, and a part that fails is
    left empty with why. A connection lost inside such a savepoint was taken for such a part: the
    next read failed with SQLAlchemy's "Can't reconnect until invalid transaction is rolled back",
    which is all `maintd status` and /status said; the server's own reason was lost. Here the
    status session is terminated while its read of the leader waits for a lock."""
    import threading

    import psycopg

    from maintd import migrate
    from maintd.db import make_engine
    from maintd.readers import reader_engine

    name = f"t_{uuid.uuid4().hex[:12]}"
    owner = make_engine(pg_dsn, application_name="maintd-test-migrate", pooled=False)
    reader = reader_engine(pg_dsn, f"lost-{name}", kept=1, most=1)
    out: dict = {}

    def read() -> None:
        try:
            out["status"] = collect_status(reader, name)
        except Exception as exc:
            out["error"] = exc

    try:
        with owner.connect() as conn:
            migrate.upgrade(conn, name, revision="0009")
        with psycopg.connect(pg_dsn) as holder, psycopg.connect(pg_dsn, autocommit=True) as killer:
            holder.execute(f"LOCK TABLE {name}.leader IN ACCESS EXCLUSIVE MODE")
            reading = threading.Thread(target=read, daemon=True)
            reading.start()
            pid, = wait_for(lambda: killer.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'",
                (f"maintd:lost-{name}:read",)).fetchone(), 30, what="the status read waiting for the leader's lock")
            killer.execute("SELECT pg_terminate_backend(%s)", (pid,))
            reading.join(30)
            assert not reading.is_alive(), "the status read did not end"
            holder.rollback()
        assert "error" in out, out  # nothing more can be read: the status fails, as on a current schema
        said = describe_db_error(out["error"])
        assert "terminating connection" in said and "rolled back" not in said, said
    finally:
        reader.dispose()
        with owner.connect() as conn:
            conn.execute(sql("DROP SCHEMA IF EXISTS {schema} CASCADE", name))
            conn.commit()
        owner.dispose()


def test_an_error_a_grant_fixes_names_maintd_grants(pg_dsn, schema, tmp_path):
    with login_role(pg_dsn, "no_grants") as role:
        cfg = _config(tmp_path, role_dsn(pg_dsn, role), schema)
        for argv in (("jobs", "list"), ("status",), ("periodic", "list"), ("jobs", "retry", "1"),
                     ("run-once", "cleaner", "--dry-run")):
            rc, out, err = _cli("--config", cfg, *argv)
            text = out + err
            assert rc == 1 and "permission denied" in text and f"maintd grants {role} --apply" in text, (argv, text)


# -- run-once prints duration_seconds --------------------------------------------------------------


def test_run_once_prints_the_duration_of_the_work(pg_dsn, schema, tmp_path, engine):
    """duration_seconds is the work, as maintd_service_run_seconds measures it: a scheduler pass
    does not wait for the next due job (1.2 s away), it says when it wants the next pass."""
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, scheduled_at) "
                         "VALUES ('k', 'scheduled', now() - interval '1 minute'),"
                         "       ('k', 'scheduled', now() + interval '1.2 seconds')", schema))
    cfg = _config(tmp_path, pg_dsn, schema)
    with open(cfg, "a") as f:
        f.write('[scheduler]\ninterval = "3s"\n')
    started = time.monotonic()
    rc, out, err = _cli("--config", cfg, "run-once", "scheduler")
    took = time.monotonic() - started
    assert rc == 0, err
    data = json.loads(out)
    assert data["counts"] == {"promoted": 1} and data["summary"].startswith("promoted 1 (default 1); next pass at")
    assert data["result"]["next_pass_at"] is not None
    assert 0 < data["duration_seconds"] < took, (data, took)
    rc, out, _ = _cli("--config", cfg, "run-once", "cleaner", "--dry-run")
    assert rc == 0 and json.loads(out)["duration_seconds"] > 0


def test_status_help_names_what_status_shows():
    """The README: `maintd status` shows the daemons alive and gone, `database: read-only
    (maintenance paused)`, the layout and its partitions, what holds the xmin horizon, every
    target (or --target's), and exits 1 when a target cannot be read. `status --help` said only
    "the current leader (instance, host, pid, since), the last run and outcome of each service,
    and job counts by queue and state"."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["status", "--help"])
    helptext = " ".join(out.getvalue().split()).lower()
    for said in ("gone", "read-only", "layout", "partitions", "xmin horizon", "every target",
                 "--target", "exit 1"):
        assert said in helptext, (said, helptext)


def test_demo_help_says_where_both_daemons_listen():
    """The README: the demo's metrics and dashboard are on :9464 and :9465 (the second daemon on
    the next port). `demo --help` said `--listen` was the "HTTP listen address for /metrics"."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["demo", "--help"])
    helptext = " ".join(out.getvalue().split())
    assert "127.0.0.1:9464" in helptext and "dashboard" in helptext and "next port" in helptext, helptext


def test_demo_help_says_what_the_demo_does():
    """The README: the demo starts two daemons, kills the leader with SIGKILL after 30 s (or
    halfway through --duration) so the other takes over, and has a report hold a snapshot open
    (the leader's warning names it). `demo --help` said it ran "the daemon"."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["demo", "--help"])
    helptext = " ".join(out.getvalue().split())
    for said in ("two daemons", "SIGKILL", "takes over", "snapshot"):
        assert said in helptext, (said, helptext)


def test_status_says_a_service_line_is_its_last_recorded_pass():
    """An idle pass that repeats the last record is not written (README "Idle costs nothing"), so
    a cleaner idle for hours read "cleaner success at <hours ago>" under a bare "services:", as
    if it had not run since; the dashboard heads the column "last recorded run"."""
    st = {"schema": "maintd", "leader": None, "daemons": [], "gone": [], "jobs": [],
          "services": [{"service": "cleaner", "outcome": "success", "instance_id": "a",
                        "started_at": "2026-03-01T09:00:00+00:00", "finished_at": "2026-03-01T09:00:01+00:00",
                        "result": {"deleted": {"completed": 0}}, "error": None}]}
    lines = format_status(st).splitlines()
    heading = lines[lines.index(next(ln for ln in lines if ln.startswith("services")))]
    assert "last recorded" in heading and "idle passes" in heading, heading


# -- an unreachable database: one behaviour, and --help says it -------------------------------------


@pytest.mark.slow
def test_an_unreachable_database_is_waited_for_by_the_daemon_and_fails_commands_fast(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: connections are refused
    cfg = _config(tmp_path, f"postgresql://postgres@127.0.0.1:{port}/app", "maintd")
    with open(cfg, "a") as f:
        f.write('[http]\nlisten = "127.0.0.1:0"\n')
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["--help"])
    helptext = " ".join(out.getvalue().split())
    assert "maintd run waits for it: retries with backoff" in helptext
    assert "other commands try once and exit 1" in helptext

    started = time.monotonic()
    rc, _, err = _cli("--config", cfg, "status")
    assert rc == 1 and "Connection refused" in err and time.monotonic() - started < 15

    env = {k: v for k, v in os.environ.items() if not k.startswith("MAINTD_")}
    log = tmp_path / "run.log"
    with open(log, "wb") as out_f:
        proc = subprocess.Popen([sys.executable, "-m", "maintd", "--config", cfg, "run"], stdout=out_f,
                                stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: log.read_text().count("database unreachable, retrying") >= 3, 30,
                 what="three retries")
        assert proc.poll() is None  # still waiting, not exited
        http = int(re.search(r"http listening address=\S+:(\d+)", log.read_text()).group(1))
        with pytest.raises(urllib.error.HTTPError) as ready:
            urllib.request.urlopen(f"http://127.0.0.1:{http}/readyz", timeout=5)
        assert ready.value.code == 503
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def test_the_walkthrough_was_made_with_the_schema_head_of_this_version():
    """docs/walkthrough.md is pasted output of docs/walkthrough.sh: after a new migration it shows
    an older head until it is made again (it once said 0008 with 0009 current)."""
    from pathlib import Path

    from maintd.migrate import head_revision

    walk = (Path(__file__).resolve().parent.parent / "docs" / "walkthrough.md").read_text()
    shown = set(re.findall(r"at revision (\w+) \(head\)", walk)) | set(re.findall(r"migrated from base to (\w+)", walk))
    assert shown == {head_revision()}, f"docs/walkthrough.md shows {shown}: run docs/walkthrough.sh again"


def test_status_and_periodic_list_escape_what_workers_wrote(pg_dsn, schema, tmp_path, engine):
    """Anyone who can enqueue a job chooses its queue; anyone with INSERT on periodic_jobs a
    schedule: with a newline, `maintd status` printed lines of the job's making ("leader: ...")
    among the true ones, and a terminal escape cleared the screen."""
    cfg = _config(tmp_path, pg_dsn, schema)
    forged = "x\nleader: mallory (host evil)\n  services: all fine"
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue) VALUES ('k', :forged), ('k', :esc)", schema),
                     {"forged": forged, "esc": "q\x1b[2Jclear"})
        conn.execute(sql("INSERT INTO {schema}.periodic_jobs (id, schedule, kind) VALUES "
                         "('p\x1b[31m', :schedule, 'k')", schema), {"schedule": "* * * * *\x1b[2J\nFAKE: ok"})
    rc, out, err = _cli("--config", cfg, "status")
    assert rc == 0, err
    assert "leader: mallory (host evil)" not in out.splitlines() and "  services: all fine" not in out.splitlines()
    assert "x\\nleader: mallory (host evil)\\n  services: all fine" in out and "q\\x1b[2Jclear" in out
    assert "\x1b" not in out
    rc, out, err = _cli("--config", cfg, "periodic", "list")
    assert rc == 0, err
    assert "\x1b" not in out and "FAKE: ok" not in [line.strip() for line in out.splitlines()]
    assert "p\\x1b[31m" in out and "* * * * *\\x1b[2J\\nFAKE: ok" in out, out


def test_status_says_when_the_database_takes_no_writes(make_private_pg):
    """A read-only primary (``ALTER SYSTEM SET default_transaction_read_only``) pauses maintenance
    (SPEC 8.5). ``/status`` said so for its daemon; ``maintd status``, whose own sessions are
    read-only by design, showed the leader and its last runs as if all were well. Its session's
    ``reset_val`` is the server's value (the reader's own SET does not change it)."""
    import psycopg

    from maintd.readers import reader_engine

    from .test_connection_faults import migrated

    pg = make_private_pg()
    migrated(pg.dsn)
    engine = reader_engine(pg.dsn, "truth", kept=1, most=1)
    try:
        st = collect_status(engine, "maintd")
        assert st["database_writable"] is True and "read-only" not in format_status(st)
        with psycopg.connect(pg.dsn, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM SET default_transaction_read_only = on")
            admin.execute("SELECT pg_reload_conf()")
        wait_for(lambda: collect_status(engine, "maintd")["database_writable"] is False, 10,
                 what="the reload seen by a kept session")
        assert "database: read-only (maintenance paused)" in format_status(collect_status(engine, "maintd"))
        # The dashboard said nothing of it either: the leader and its runs, as if all were well.
        dashboard = Dashboard(lambda: Settings(database_url=pg.dsn, schema="maintd"))
        status, _, body, _ = dashboard.pages()["/"](Request("/", {}))
        assert status == 200 and 'id="read-only"' in body.decode(), body.decode()[:2000]
        with psycopg.connect(pg.dsn, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM RESET default_transaction_read_only")
            admin.execute("SELECT pg_reload_conf()")
        wait_for(lambda: 'id="read-only"' not in dashboard.pages()["/"](Request("/", {}))[2].decode(), 10,
                 what="the notice gone once the server takes writes")
    finally:
        engine.dispose()


# -- README "Day to day", as an operator types it on an installed host ------------------------------


def test_the_day_to_day_commands_run_as_written_on_an_installed_host(pg_dsn, schema, tmp_path, engine):
    """The README's "Day to day" block, run as written in a shell on a host installed as
    "Production install" says: config.example.toml in /etc/maintd/maintd.toml, the runtime role's
    DSN in /etc/maintd/maintd.env, which the unit reads (EnvironmentFile=) and an operator's shell
    does not. The block gave no DSN: each command used the example's
    postgresql://localhost/postgres and failed (refused, or "run `maintd migrate` first" there)."""
    from pathlib import Path

    from sqlalchemy import text

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    start = readme.index("Day to day")
    block = re.compile(r"```sh\n(.*?)```", re.S).search(readme, start).group(1)
    etc = tmp_path / "etc" / "maintd"
    etc.mkdir(parents=True)
    example = (root / "config.example.toml").read_text()
    assert '\nschema = "maintd"\n' in example
    (etc / "maintd.toml").write_text(example.replace('\nschema = "maintd"\n', f'\nschema = "{schema}"\n'))
    (etc / "maintd.env").write_text(f"MAINTD_DATABASE_URL={pg_dsn}\n")
    with engine.begin() as conn:
        conn.execute(text(f'INSERT INTO "{schema}".jobs (kind, state, finalized_at) '
                          "VALUES ('day.to.day', 'discarded', now())"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAINTD_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    res = subprocess.run(["bash", "-e", "-c", block.replace("/etc/maintd/", f"{etc}/")], env=env,
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0 and "day.to.day" in res.stdout, res.stdout + res.stderr


def test_the_session_names_the_readme_gives_are_the_ones_maintd_uses():
    """An operator looks for maintd's sessions in pg_stat_activity by the names the README gives.
    "Configuration" said the lock session was `maintd:<instance>:lock`; it is `maintd:<instance>`
    (as "Leadership" says), and nothing is named `...:lock`."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    said = set(re.findall(r"`maintd:<(?:instance|instance_id|id)>((?::\w+)?)`", readme))
    used = set()
    for path in (root / "maintd").rglob("*.py"):
        used |= set(re.findall(r'application_name=f"maintd:\{[^}]+\}((?::\w+)?)"', path.read_text()))
    assert "" in used and said and said <= used, (said - used, used)


def test_the_readme_upgrade_steps_give_the_runtime_role_the_tables_a_release_adds(pg_dsn, tmp_path):
    """"Upgrades" said: run `maintd migrate` with the new version, then restart the replicas. A
    migration grants nothing (its DDL runs as the owner), so a table the release adds (here 0007's
    health_history) was out of the runtime role's reach and the new daemon met "permission denied"
    on it; the systemd unit and the Kubernetes init containers run `maintd grants ROLE --apply`
    after the migration, the README's own steps did not. The steps run as the README writes them."""
    from pathlib import Path

    from sqlalchemy import text

    from maintd import migrate
    from maintd.db import make_engine

    from .conftest import new_schema_name

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("### Upgrades"):]
    section = section[:section.index("\n## ")]
    steps = [s for s in re.findall(r"`(maintd [^`]+)`", section) if not s.startswith("maintd migrate --")]
    schema = new_schema_name()
    engine = make_engine(pg_dsn, application_name="maintd-test-upgrade", pooled=False)
    with engine.connect() as conn:
        migrate.upgrade(conn, schema, revision="0006")
    try:
        with login_role(pg_dsn) as role:
            with engine.begin() as conn:  # what the runtime role had before the upgrade (and more)
                conn.execute(text(f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"; GRANT SELECT, INSERT, UPDATE, '
                                  f'DELETE ON ALL TABLES IN SCHEMA "{schema}" TO "{role}"'))
            cfg = tmp_path / "maintd.toml"
            cfg.write_text(f'schema = "{schema}"\n')
            env = {k: v for k, v in os.environ.items() if not k.startswith("MAINTD_")}
            env["MAINTD_DATABASE_URL"] = pg_dsn  # the owner's connection (here a superuser's)
            for step in steps:
                argv = step.replace("ROLE", role).split()
                res = subprocess.run([sys.executable, "-m", "maintd", "--config", str(cfg), *argv[1:]],
                                     capture_output=True, text=True, timeout=120, env=env)
                assert res.returncode == 0, (step, res.stdout, res.stderr)
            with engine.connect() as conn:
                assert conn.execute(text(f'SELECT version_num FROM "{schema}".alembic_version')).scalar() \
                    == migrate.head_revision(), steps
                held = conn.execute(text("SELECT has_table_privilege(:role, :table, 'INSERT')"),
                                    {"role": role, "table": f'"{schema}".health_history'}).scalar()
            assert held, f"the README's upgrade steps {steps} leave the runtime role without the new table"
    finally:
        with engine.connect() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
            conn.commit()
        engine.dispose()


def test_the_start_warning_for_a_urls_application_name_names_the_sessions_maintd_uses():
    """A URL's own application_name is replaced, with a warning at start saying what maintd uses
    instead: "maintd's session names (maintd:<instance>:lock, :work, ...)". The lock session is
    `maintd:<instance>` (README "Configuration" and "Leadership"; the test above fixed the README's
    `:lock`), and no session is named `...:lock`: an operator looking for it found nothing."""
    from pathlib import Path

    from maintd.db import replaced_params

    root = Path(__file__).resolve().parent.parent
    used = set()
    for path in (root / "maintd").rglob("*.py"):
        used |= set(re.findall(r'application_name=f"maintd:\{[^}]+\}(?::(\w+))?"', path.read_text()))
    said = replaced_params("postgresql://db.internal/app?application_name=billing")["application_name"]
    assert "maintd:<instance>" in said, said
    suffixes = set(re.findall(r":(\w+)", said.split("maintd:<instance>", 1)[1]))
    assert suffixes and suffixes <= used, (said, used)


def test_a_database_that_never_answers_is_named_by_the_commands_error(tmp_path):
    """A silent server (a firewall dropping packets, a frozen host) costs a command its connect
    timeout, then exit 1. A refused connect names the server (psycopg's 'connection to server at
    "127.0.0.1", port N failed'), but a timed-out one said only 'connection timeout expired':
    with several databases (or a DSN from the environment) the operator could not tell which
    address, nor which timeout, was at fault."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # connects are accepted by the kernel, never answered
        port = silent.getsockname()[1]
        cfg = _config(tmp_path, f"postgresql://maintd:hunter2secret@127.0.0.1:{port}/app?connect_timeout=2", "maintd")
        for argv in (("status",), ("jobs", "list"), ("periodic", "list"), ("migrate",)):
            started = time.monotonic()
            rc, _, err = _cli("--config", cfg, *argv)
            assert rc == 1 and time.monotonic() - started < 15, (argv, rc, err)
            assert "connection timeout expired" in err and f"127.0.0.1:{port}" in err, (argv, err)
            assert re.search(r"within connect_timeout \d+ s", err) and "hunter2" not in err, (argv, err)


def test_jobs_actions_and_periodic_changes_end_when_the_server_stops_answering(pg_dsn, schema, tmp_path):
    """A server frozen (SIGSTOP, a paused VM) or cut off after the connect keeps acknowledging at
    the TCP level, so keepalives never fire and its statement_timeout never runs: only a
    client-side bound ends the wait. `status`, `jobs list|show`, `periodic list` and `run-once`
    had one; `jobs retry|delete|...` and `periodic add|remove|pause|resume` waited for ever (still
    running after 120 s here), against "other commands try once and exit 1"."""
    for argv in (["jobs", "retry", "--state", "retryable"], ["jobs", "delete", "1"], ["periodic", "pause", "x"]):
        _ends_when_the_server_stops_answering(pg_dsn, schema, tmp_path, argv, re.escape(schema))


def test_migrate_sql_and_grants_apply_end_when_the_server_stops_answering(pg_dsn, schema, tmp_path):
    """As for jobs actions: `migrate --sql` (one read of the schema's revision) and `grants --apply`
    (GRANTs) waited for ever on a server that stopped answering after the connect (still running
    after 120 s here)."""
    for argv, pattern in ((["migrate", "--sql"], "alembic_version|pg_namespace|pg_class"),
                          (["grants", "postgres", "--apply"], "(?i)grant")):
        _ends_when_the_server_stops_answering(pg_dsn, schema, tmp_path, argv, pattern)


def _ends_when_the_server_stops_answering(pg_dsn, schema, tmp_path, argv, pattern):
    """``maintd argv`` through a proxy that goes silent at the first statement matching ``pattern``
    (the connect answered) exits 1 within 45 s, saying the server gave no answer."""
    from .netproxy import NetProxy

    env = {k: v for k, v in os.environ.items() if not k.startswith("MAINTD_")}
    with NetProxy.for_dsn(pg_dsn) as proxy:
        proxy.on_statement(pattern, lambda link: proxy.blackhole())
        cfg = tmp_path / "frozen.toml"
        cfg.write_text(f'database_url = "{proxy.dsn(pg_dsn)}"\nschema = "{schema}"\nstatement_timeout = "2s"\n')
        started = time.monotonic()
        try:
            done = subprocess.run([sys.executable, "-m", "maintd", "--config", str(cfg), *argv], env=env,
                                  capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{argv}: still waiting after 60 s on a server that stopped answering") from None
        assert done.returncode == 1 and "no answer from the server" in done.stderr, (argv, done.stderr)
        assert time.monotonic() - started < 45, argv


def test_run_once_names_the_lock_holder_without_counting_jobs(pg_dsn, schema, settings, monkeypatch):
    """run-once with the lock held names the holder; to read it, it collected the whole status,
    counting every job by queue and state (the heap of finished jobs, up to the 5 s timeout on a
    large table) for one line about the leader."""
    import maintd.status
    from maintd.leader import acquire_once

    def counted(*_a, **_k):
        raise AssertionError("counted jobs to name the leader")

    monkeypatch.setattr(maintd.status, "_count", counted)
    monkeypatch.setenv("MAINTD_DATABASE_URL", pg_dsn)
    monkeypatch.setenv("MAINTD_SCHEMA", schema)
    monkeypatch.setenv("MAINTD_INSTANCE_ID", unique("once"))
    elector, _ = acquire_once(settings)
    try:
        rc, _, err = _cli("run-once", "cleaner")
    finally:
        elector.stop()
    assert rc == 1 and f"another instance holds the leader lock (instance={settings.instance_id} " in err, err


def test_the_production_install_puts_maintd_on_the_operators_path():
    """"Production install" puts maintd in the virtualenv /opt/maintd, whose bin/ is on no shell's
    PATH, and "Day to day" then types `maintd --config ...`: on a host installed as written, each
    command was "maintd: command not found" (the Day-to-day test above puts the venv's bin/ on PATH
    itself). The install steps link the command where a root shell finds it."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    start = readme.index("### Production install")
    install = re.compile(r"```sh\n(.*?)```", re.S).search(readme, start).group(1)
    day = re.compile(r"```sh\n(.*?)```", re.S).search(readme, readme.index("Day to day")).group(1)
    assert re.search(r"^maintd ", day, re.M), day  # typed bare, as an operator does
    assert re.search(r"^ln -s(f)? /opt/maintd/bin/maintd /usr/local/bin/maintd\b", install, re.M), install


def test_the_readme_says_how_much_of_an_error_jobs_list_shows(pg_dsn, schema, tmp_path, engine):
    """The README said `jobs list` "shows the first 4,096 characters" of a job's last error; its
    table cut each cell at 48. It now says both limits, and both are what the command does."""
    from pathlib import Path

    from maintd.admin import CELL_WIDTH, LIST_ERROR_CHARS

    readme = " ".join((Path(__file__).resolve().parent.parent / "README.md").read_text().split())
    assert f"first {LIST_ERROR_CHARS:,} characters of each job's last error" in readme
    assert f"cuts every cell at {CELL_WIDTH} characters" in readme
    error = "E" * 5000
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, finalized_at, errors) VALUES "
                         "('cut', 'discarded', now(), jsonb_build_array(jsonb_build_object('error', CAST(:e AS text))))",
                         schema), {"e": error})
    cfg = _config(tmp_path, pg_dsn, schema)
    rc, out, err = _cli("--config", cfg, "jobs", "list", "--state", "discarded")
    assert rc == 0, err
    cells = [c.strip() for line in out.splitlines() for c in line.split("  ") if "EEE" in c]
    assert cells == ["E" * (CELL_WIDTH - 3) + "..."], out
    rc, out, err = _cli("--config", cfg, "jobs", "list", "--state", "discarded", "--json")
    assert rc == 0, err
    listed = json.loads(out)
    job = (listed["jobs"] if isinstance(listed, dict) else listed)[0]
    assert job["last_error"] == "E" * LIST_ERROR_CHARS and job["last_error_chars"] == 5000, job


def test_the_stated_failover_of_a_frozen_leader_is_lease_plus_a_retry():
    """The README said a frozen leader is replaced "within the lease (10 s)". Its session ends a
    lease after its last statement (idle_session_timeout), and a follower takes the lock at its
    next try: up to lease + retry_interval (measured 10.0 s on PostgreSQL 15 with the defaults).
    The README and config.example.toml say that bound, with its value for the defaults."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    readme = " ".join((root / "README.md").read_text().split())
    example = " ".join((root / "config.example.toml").read_text().replace("#", " ").split())
    from maintd.config import LeaderConfig

    defaults = LeaderConfig()
    bound = round((defaults.lease + defaults.retry_interval).total_seconds())
    assert "within the lease (10 s) if it freezes" not in readme
    assert "takes over within the lease without a human" not in readme
    assert f"within the lease plus a retry (about {bound} s) if it freezes" in readme
    assert f"within `lease + retry_interval` of the freeze (about {bound} s with the defaults" in readme
    assert f"replaced within lease + retry_interval (about {bound} s with these values)" in example
