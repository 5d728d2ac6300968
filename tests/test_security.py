"""Security and bad input: secrets never shown, hostile config rejected, least privilege works,
clear one-line errors with the SPEC's exit codes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
import uuid
from datetime import datetime, timezone

import psycopg
import pytest

from .procs import DaemonProc, wait_for

SECRET = "S3cr3t-Pa55w0rd"

# The documented least-privilege grants (README: "Database role and grants").
GRANTS = """
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role};
"""


def with_password(dsn: str, user: str = "postgres") -> str:
    out = dsn.replace("postgres@", f"{user}:{SECRET}@", 1)
    assert SECRET in out, "the test DSN has no 'postgres@' to put the password in: the checks would see none"
    return out


def cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "maintd", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def role(pg_dsn, schema):
    name = f"maintd_app_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {name} LOGIN PASSWORD '{SECRET}'")
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{name}'")
        conn.execute(f'REVOKE ALL ON ALL TABLES IN SCHEMA "{schema}" FROM {name}')
        conn.execute(f'REVOKE ALL ON SCHEMA "{schema}" FROM {name}')
        conn.execute(f"DROP ROLE {name}")


@pytest.mark.parametrize("body", [
    'schema = "maintd; DROP TABLE jobs; --"',
    'schema = "\\"x\\""',
    'schema = "Robert\'); DROP TABLE students;--"',
    'schema = "' + "a" * 64 + '"',
    '[reindexer]\nindexes = ["jobs_pkey\\"; DROP TABLE maintd.jobs; --"]',
    '[reindexer]\nindexes = ["../../etc/passwd"]',
    '[cleaner]\nbatch_size = 1e30',
    '[cleaner]\nbatch_size = 9223372036854775808',
    '[cleaner]\ncompleted_retention = "-1s"',
    '[cleaner]\ninterval = "-5m"',
    '[rescuer]\nrescue_stuck_jobs_after = "99999999w"',
    '[[periodic]]\nid = "x\'; DROP TABLE jobs; --"\nschedule = "@hourly"\nkind = "k"',
    '[[periodic]]\nid = "ok"\nschedule = "$(rm -rf /)"\nkind = "k"',
    'instance_id = "a b; rm"',
])
def test_hostile_config_is_rejected_with_exit_2(tmp_path, body):
    p = tmp_path / "c.toml"
    p.write_text(body + "\n")
    res = cli("--config", str(p), "check-config")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "config error" in res.stderr and "Traceback" not in res.stderr


def test_password_never_shown(pg_dsn, schema, tmp_path):
    dsn = with_password(pg_dsn)  # trust auth accepts it; it must still never be printed
    d = DaemonProc(dsn, schema, "sec1", {"log": {"level": "debug"}}, workdir=str(tmp_path)).start()
    try:
        d.wait_log(r"became leader")
        port = int(d.wait_log(r"http listening address=127\.0\.0\.1:(\d+)").group(1))
        def status_has_runs():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as r:
                return json.loads(r.read())["services"]

        wait_for(status_has_runs, 10, what="a pass")
        for path in ("/status", "/metrics", "/healthz"):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                assert SECRET not in r.read().decode()
    finally:
        d.stop()
    assert SECRET not in d.log()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'database_url = "{dsn}"\nschema = "{schema}"\n')
    for args in (("check-config",), ("status",), ("status", "--json"), ("run-once", "cleaner", "--dry-run")):
        res = cli("--config", str(cfg), *args)
        assert res.returncode == 0, res.stderr
        assert SECRET not in res.stdout + res.stderr
    # Errors too: an unreachable server.
    bad = tmp_path / "bad.toml"
    bad.write_text(f'database_url = "postgresql://maintd:{SECRET}@127.0.0.1:1/app"\n')
    for args in (("status",), ("migrate",), ("run-once", "cleaner")):
        res = cli("--config", str(bad), *args)
        assert res.returncode == 1
        assert SECRET not in res.stdout + res.stderr
        assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_unknown_role_is_one_line_exit_1(pg_dsn, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'database_url = "{with_password(pg_dsn, "nobody_here")}"\n'
                   '[http]\nlisten = "127.0.0.1:0"\n')
    for args in (("run",), ("status",), ("migrate",)):
        res = cli("--config", str(cfg), *args)
        assert res.returncode == 1, (args, res.stderr)
        assert 'role "nobody_here" does not exist' in res.stderr
        assert "Traceback" not in res.stderr and SECRET not in res.stderr
        # A start that ends (exit 1) must not have said it retries: it said "database unreachable,
        # retrying" and "target not started, retrying in the background" before exiting.
        assert "retrying" not in res.stderr, res.stderr


def test_role_without_privileges_is_one_line_exit_1(pg_dsn, schema, role, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'database_url = "{with_password(pg_dsn, role)}"\nschema = "{schema}"\n'
                   '[http]\nlisten = "127.0.0.1:0"\n')
    res = cli("--config", str(cfg), "run")
    assert res.returncode == 1
    assert "permission denied" in res.stderr and "Traceback" not in res.stderr
    # One line says what is wrong; the rest is the daemon's log (the HTTP listener starts first,
    # so the probes answer during start-up).
    not_log = [line for line in res.stderr.strip().splitlines()
               if not re.match(r"^\d{4}-\d\d-\d\dT\S+ (debug|info|warning|error) ", line)]
    assert len(not_log) == 1 and not_log[0].startswith("maintd: error: permission denied"), res.stderr
    assert "retrying" not in res.stderr, res.stderr  # it exits: nothing is retried


@pytest.mark.slow
def test_least_privilege_role_runs_every_service(pg_dsn, schema, role, tmp_path):
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for stmt in GRANTS.format(schema=f'"{schema}"', role=role).strip().splitlines():
            conn.execute(stmt)
        conn.execute(f"""INSERT INTO "{schema}".jobs (kind, state, finalized_at, attempted_at, attempt, scheduled_at)
            VALUES ('old', 'completed', now() - interval '2 days', now() - interval '2 days', 1, now()),
                   ('stuck', 'running', NULL, now() - interval '2 hours', 1, now()),
                   ('due', 'scheduled', NULL, NULL, 0, now() - interval '1 second')""")
    extra = {"cleaner": {"interval": "1s"}, "rescuer": {"interval": "1s"}, "scheduler": {"interval": "1s"},
             "reindexer": {"enabled": False},
             "periodic": [{"id": "lp", "schedule": "@every 1s", "kind": "lp", "run_on_start": True}]}
    d = DaemonProc(with_password(pg_dsn, role), schema, "lp1", extra, workdir=str(tmp_path)).start()
    since = datetime.now(timezone.utc)
    try:
        def all_succeeded():
            with psycopg.connect(pg_dsn) as conn:
                rows = dict(conn.execute(f'SELECT service, outcome FROM "{schema}".service_runs '
                                         "WHERE finished_at > %s", (since,)).fetchall())
            return rows if {"cleaner", "rescuer", "scheduler", "periodic"} <= set(rows) and \
                set(rows.values()) == {"success"} else None

        wait_for(all_succeeded, 15, what="every service to succeed as the least-privilege role")
        with psycopg.connect(pg_dsn) as conn:
            states = dict(conn.execute(f'SELECT kind, state::text FROM "{schema}".jobs '
                                       "WHERE kind IN ('old', 'stuck', 'due')").fetchall())
            periodic = conn.execute(f'SELECT count(*) FROM "{schema}".jobs WHERE kind = %s', ("lp",)).fetchone()[0]
        assert "old" not in states and states["stuck"] in ("retryable", "available")
        assert states["due"] == "available" and periodic >= 1
        # The reindexer, run once as this role, reports a clear error instead of crashing.
        cfg = tmp_path / "lp.toml"
        cfg.write_text(f'database_url = "{with_password(pg_dsn, role)}"\nschema = "{schema}"\n'
                       '[reindexer]\nindexes = ["jobs_pkey"]\n')
    finally:
        d.stop()
    res = cli("--config", str(cfg), "run-once", "reindexer")
    out = json.loads(res.stdout)
    [report] = out["result"]["indexes"]
    assert report["outcome"] == "not_permitted" and "needs ownership" in report["error"]
    assert res.returncode == 1  # a pass in which anything failed
    assert SECRET not in d.log() + res.stdout + res.stderr


def test_http_binds_loopback_by_default():
    from maintd.config import Settings

    assert Settings().http.listen.startswith("127.0.0.1:")


def test_identifiers_are_quoted_in_sql():
    from maintd.identifiers import quote_ident
    from maintd.queries import render as render_sql

    assert render_sql("SELECT 1 FROM {schema}.jobs", "maintd") == 'SELECT 1 FROM "maintd".jobs'
    # A statement's own placeholders are filled in the same single pass: a value (a quoted name
    # from the catalog, a comment) is never read as a placeholder, and other braces stay.
    assert render_sql("COMMENT ON FUNCTION {signature} IS {comment}", "maintd", signature='"maintd".f()',
                      comment="'{schema} {comment}'") == \
        """COMMENT ON FUNCTION "maintd".f() IS '{schema} {comment}'"""
    assert render_sql("SELECT '{}'::int[], '{a}' FROM {schema}.jobs", "m") == """SELECT '{}'::int[], '{a}' FROM "m".jobs"""
    for bad in ('a"b', "x; drop", "UPPER", "", "1abc"):
        with pytest.raises(ValueError):
            quote_ident(bad)


def test_a_function_planted_on_the_roles_search_path_never_runs_as_maintd(pg_dsn, schema, tmp_path):
    """CVE-2018-1058: a role that may create in a schema on maintd's search_path (``public`` before
    PostgreSQL 15) plants ``format(text, text, smallint, smallint)``. PostgreSQL prefers it over the
    built-in variadic ``format`` even with pg_catalog searched first, so the rescuer's discard of a
    job with no attempt left (which formats attempt and max_attempts, both smallint) would run it
    as maintd's role. maintd's sessions resolve names in pg_catalog only (maintd.db.PINNED), whatever
    the URL's, role's or database's search_path: here the URL's ``options``."""
    planted = f"planted_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {planted}")
        conn.execute(f"CREATE TABLE {planted}.calls (args text)")
        conn.execute(f"CREATE FUNCTION {planted}.format(text, text, smallint, smallint) RETURNS text"
                     f" LANGUAGE sql AS $$ INSERT INTO {planted}.calls VALUES ($2) RETURNING 'planted' $$")
        # and one the session settings' own statement would meet (maintd.queries.catalog.SET_SESSIONS)
        conn.execute(f"CREATE FUNCTION {planted}.unnest(text[]) RETURNS SETOF text LANGUAGE sql AS"
                     f" $$ INSERT INTO {planted}.calls VALUES ('unnest'); SELECT pg_catalog.unnest($1) $$")
        # the probe: on this server, with this search_path, the planted function does win
        conn.execute(f"SET search_path = {planted}")
        assert conn.execute("SELECT format('%s %s %s', 'x'::text, 1::smallint, 2::smallint)").fetchone()[0] == "planted"
        conn.execute("RESET search_path")
        conn.execute(f"TRUNCATE {planted}.calls")
        job = conn.execute(f'INSERT INTO "{schema}".jobs (kind, state, attempt, max_attempts)'
                           " VALUES ('k', 'available', 3, 3) RETURNING id").fetchone()[0]
    try:
        url = f"{pg_dsn}{'&' if '?' in pg_dsn else '?'}options=-csearch_path%3D{planted}"
        cfg = tmp_path / "m.toml"
        cfg.write_text(f'database_url = "{url}"\nschema = "{schema}"\ninstance_id = "{planted}"\n')
        res = cli("--config", str(cfg), "run-once", "rescuer")
        assert res.returncode == 0, res.stdout + res.stderr
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            calls = conn.execute(f"SELECT args FROM {planted}.calls").fetchall()
            state, errors = conn.execute(f'SELECT state::text, errors FROM "{schema}".jobs WHERE id = %s', (job,)).fetchone()
        assert calls == [], f"the planted format() ran as maintd's role: {calls}"
        assert state == "discarded" and "no attempt left to claim, attempt 3 >= max_attempts 3" in errors[-1]["error"]
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {planted} CASCADE")
