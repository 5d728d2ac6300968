"""``maintd grants ROLE [--worker]`` and ``maintd migrate`` by a least-privilege role (SPEC 7.5).

The grants are held to the code from both sides: a static check derives the privileges from every
SQL statement of the daemon (and of the worker helpers) and compares them with what
:mod:`maintd.grants` declares, so neither an unneeded nor a missing privilege goes unnoticed; and
real roles given exactly the printed SQL run every service, ``status`` and ``migrate`` on a real
server, while everything else stays denied.
"""

from __future__ import annotations

import ast
import json
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psycopg
import pytest

import maintd
from maintd import grants, migrate, partitions
from maintd.db import make_engine
from maintd.jobs import JobQueue

from .conftest import run_concurrently
from .procs import DaemonProc, wait_for

# -- the privileges the code's SQL needs ---------------------------------------------------------

# Not the daemon's SQL: worker helpers (the worker role's), the demo's workload, DDL (the owner's),
# the operator's commands (`maintd jobs`, `maintd periodic`: run with an operator's role).
NOT_DAEMON = {"maintd.jobs", "maintd.demo", "maintd.embedded", "maintd.migrate", "maintd.grants", "maintd.partitions",
              "maintd.__main__", "maintd.admin", "maintd.queries.admin", "maintd.periodic_table",
              # `maintd migrate --convert partitioned`: run by the schema's owner, like migrate
              "maintd.convert", "maintd.queries.convert"}


def operator_only() -> set[str]:
    """Statements of the statement modules that only operators' commands and the demo run."""
    from maintd.queries import jobs, periodic_jobs

    return {periodic_jobs.UPSERT, periodic_jobs.DELETE, periodic_jobs.SET_ENABLED,
            jobs.DEMO_SEED_OLD}


def worker_statements() -> list[str]:
    """What maintd.jobs.JobQueue (the README's worker SQL) runs."""
    from maintd.queries import jobs

    return [jobs.ENQUEUE, jobs.CLAIM, jobs.HEARTBEAT, jobs.COMPLETE, jobs.FAIL, jobs.CANCEL]
LOCKING = re.compile(r"\bFOR\s+(NO\s+KEY\s+UPDATE|UPDATE|KEY\s+SHARE|SHARE)\b", re.I)


def sql_texts(module) -> list[str]:
    """Every SQL template of a module: string constants holding ``{schema}`` (module attributes,
    so concatenated statements count whole, plus literals written inline in functions)."""
    texts = [v for v in vars(module).values() if isinstance(v, str) and "{schema}" in v]
    tree = ast.parse(inspect.getsource(module))
    texts += [n.value for n in ast.walk(tree)
              if isinstance(n, ast.Constant) and isinstance(n.value, str) and "{schema}" in n.value]
    return texts


FUNCTION_CALL = re.compile(r"(?<!INTO )\{schema\}\.(\w+)\s*\(", re.I)


def functions_of(statement: str) -> set[str]:
    """The schema's functions a statement calls (EXECUTE)."""
    return set(FUNCTION_CALL.findall(" ".join(statement.split())))


def privileges_of(statement: str) -> dict[str, set[str]]:
    """Table privileges a statement needs (PostgreSQL's rules: RETURNING, ON CONFLICT and WHERE
    read columns, so they need SELECT; row locks need UPDATE). Function calls are not tables."""
    s = FUNCTION_CALL.sub("f(", " ".join(statement.split()))
    need: dict[str, set[str]] = {}

    def add(table: str, *privs: str) -> None:
        need.setdefault(table, set()).update(privs)

    reads = bool(re.search(r"\b(WHERE|RETURNING|ON CONFLICT)\b", s, re.I))
    for m in re.finditer(r"\bINSERT\s+INTO\s+\{schema\}\.(\w+)", s, re.I):
        add(m.group(1), "INSERT", *(["SELECT"] if re.search(r"\b(RETURNING|ON CONFLICT)\b", s, re.I) else []))
        if re.search(r"\bDO\s+UPDATE\b", s, re.I):
            add(m.group(1), "UPDATE")
    for m in re.finditer(r"(?<!FOR )(?<!NO KEY )\bUPDATE\s+\{schema\}\.(\w+)", s, re.I):
        add(m.group(1), "UPDATE", *(["SELECT"] if reads else []))
    for m in re.finditer(r"\b(DELETE\s+)?(FROM|JOIN|USING)\s+\{schema\}\.(\w+)", s, re.I):
        if m.group(1):
            add(m.group(3), "DELETE", *(["SELECT"] if reads else []))
        else:
            add(m.group(3), "SELECT", *(["UPDATE"] if LOCKING.search(s) else []))
    return need


def expanded(text: str) -> str:
    """A statement with maintd's shared fragments filled in ({schema} kept)."""
    from maintd.queries import FRAGMENTS

    for name, fragment in FRAGMENTS.items():
        text = text.replace(name, fragment)
    return text


def derived(modules, texts=()) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    skip = operator_only()
    for text in [t for m in modules for t in sql_texts(m) if t not in skip] + list(texts):
        for table, privs in privileges_of(expanded(text)).items():
            out.setdefault(table, set()).update(privs)
    return out


def daemon_modules():
    for info in pkgutil.walk_packages(maintd.__path__, "maintd."):
        if info.name not in NOT_DAEMON and not info.name.startswith("maintd.migrations"):
            yield importlib.import_module(info.name)


def declared(table_grants) -> dict[str, set[str]]:
    return {g.table: set(g.privileges) for g in table_grants}


def on_tables(table_grants) -> dict[str, set[str]]:
    """The declared privileges held on the whole table (an UPDATE limited to columns is not)."""
    return {g.table: set(g.privileges) - ({"UPDATE"} if g.update_columns else set()) for g in table_grants}


def on_columns(table_grants) -> dict[str, set[str]]:
    """The columns each table's column-limited UPDATE is declared on."""
    return {g.table: set(g.update_columns) for g in table_grants if g.update_columns}


def column_updates(pg_dsn: str, schema: str, role: str) -> dict[str, set[str]]:
    """The columns the role was granted UPDATE on by a column grant, per table."""
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute("""
            SELECT c.relname, a.attname
              FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid, aclexplode(a.attacl) x
             WHERE c.relnamespace = to_regnamespace(%s) AND x.grantee = to_regrole(%s)
               AND x.privilege_type = 'UPDATE'""", (f'"{schema}"', role)).fetchall()
    out: dict[str, set[str]] = {}
    for table, column in rows:
        out.setdefault(table, set()).add(column)
    return out


SET_CLAUSE = re.compile(r"\bUPDATE\s+\{schema\}\.(\w+)(?:\s+AS\s+\w+)?\s+SET\s+(.*?)(?:\bWHERE\b|\bFROM\b|\bRETURNING\b|$)",
                        re.I | re.S)


def updated_columns(statement: str) -> dict[str, set[str]]:
    """The columns each ``UPDATE {schema}.t SET ...`` of a statement writes."""
    out: dict[str, set[str]] = {}
    for m in SET_CLAUSE.finditer(" ".join(statement.split())):
        depth, parts, part = 0, [], ""
        for ch in m.group(2):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if ch == "," and depth == 0:
                parts.append(part)
                part = ""
            else:
                part += ch
        parts.append(part)
        out.setdefault(m.group(1), set()).update(p.split("=")[0].strip().strip('"') for p in parts)
    return out


def test_privilege_rules_follow_postgresql():
    assert privileges_of("INSERT INTO {schema}.t (a) VALUES (1)") == {"t": {"INSERT"}}
    assert privileges_of("INSERT INTO {schema}.t (a) VALUES (1) ON CONFLICT (a) DO NOTHING") == \
        {"t": {"INSERT", "SELECT"}}
    assert privileges_of("INSERT INTO {schema}.t AS x VALUES (1) ON CONFLICT (a) DO UPDATE SET a = 2") == \
        {"t": {"INSERT", "SELECT", "UPDATE"}}
    assert privileges_of("SELECT 1 FROM {schema}.t WHERE a = 1 FOR KEY SHARE") == {"t": {"SELECT", "UPDATE"}}
    assert privileges_of("DELETE FROM {schema}.t") == {"t": {"DELETE"}}
    assert privileges_of("DELETE FROM {schema}.t WHERE a < 1") == {"t": {"DELETE", "SELECT"}}
    assert privileges_of("UPDATE {schema}.t SET a = 1 WHERE id = ANY(ARRAY(SELECT id FROM {schema}.u "
                         "FOR UPDATE SKIP LOCKED))") == {"t": {"UPDATE", "SELECT"}, "u": {"SELECT", "UPDATE"}}


def test_daemon_grants_are_what_its_sql_needs():
    need = derived(daemon_modules())
    need.setdefault("alembic_version", set()).add("SELECT")  # read by Alembic, not by a template
    assert declared(grants.DAEMON) == need


def test_a_column_limited_update_is_on_exactly_the_columns_the_daemons_sql_writes():
    """The daemon's role had UPDATE on the whole of periodic_jobs, an application's table (its
    schedules), to write one column: the error note on a row it cannot use. It could rewrite
    any row's schedule, kind or args (a job of any kind, enqueued by the leader). UPDATE is
    granted on the columns the daemon's UPDATE statements write, and on `enabled` for `maintd
    periodic pause|resume` (which the README lets the daemon's role run); the table-level check
    (test_daemon_grants_are_what_its_sql_needs) still holds for the rest."""
    assert updated_columns("UPDATE {schema}.t AS x SET a = coalesce(b, 1), \"c\" = 2 WHERE id = 1") == \
        {"t": {"a", "c"}}
    skip = operator_only()
    written: dict[str, set[str]] = {}
    for text in [t for m in daemon_modules() for t in sql_texts(m) if t not in skip]:
        for table, columns in updated_columns(expanded(text)).items():
            written.setdefault(table, set()).update(columns)
    # and `maintd periodic pause|resume`, which the daemon's role may run with the daemon's config
    from maintd.queries import periodic_jobs
    for table, columns in updated_columns(expanded(periodic_jobs.SET_ENABLED)).items():
        written.setdefault(table, set()).update(columns)
    assert on_columns(grants.DAEMON) == {"periodic_jobs": {"error", "enabled"}}
    assert on_columns(grants.DAEMON) == {t: written[t] for t in on_columns(grants.DAEMON)}, written


def test_daemon_function_grants_are_what_its_sql_calls():
    """EXECUTE is granted on each function the daemon calls that migrate revoked from PUBLIC."""
    from maintd import partitions

    called = {f for m in daemon_modules() for t in sql_texts(m) for f in functions_of(expanded(t))}
    public = {"job_partitions", "catch_all_rows"}  # read-only, left to PUBLIC (maintd/partitions.py)
    granted = {signature.split("(")[0] for signature, _ in grants.DAEMON_FUNCTIONS}
    assert called == granted | public
    assert granted == {name.split("(")[0] for name in partitions.definer_functions()}


def test_worker_grants_are_what_the_worker_sql_needs():
    assert declared(grants.WORKER) == derived([], worker_statements())


# -- the command -----------------------------------------------------------------------------------

def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MAINTD_")}
    return subprocess.run([sys.executable, "-m", "maintd", *args], capture_output=True, text=True,
                          timeout=timeout, env={**base, **(env or {})})


def test_the_maintain_example_names_the_table_maintain_must_be_on_for_the_configured_layout(tmp_path):
    """`maintd grants` prints, for the reindexer on PostgreSQL 17+, a GRANT MAINTAIN to copy. On the
    partitioned layout it named `jobs`, whose MAINTAIN does not reach the partition `jobs_live`
    that holds the indexes (the README and the reindexer's own error say so): the copied grant
    left the reindexer `not_permitted`. It names `jobs_live` there, `jobs` on the plain layout."""
    for layout, table in (("plain", "jobs"), ("partitioned", "jobs_live")):
        cfg = tmp_path / f"{layout}.toml"
        cfg.write_text(f'schema = "acme_jobs"\nlayout = "{layout}"\n')
        res = cli("--config", str(cfg), "grants", "maintd_daemon")
        assert res.returncode == 0, res.stderr
        [example] = [line for line in res.stdout.splitlines() if "GRANT MAINTAIN" in line]
        assert example == f'--   GRANT MAINTAIN ON TABLE "acme_jobs"."{table}" TO "maintd_daemon";', example


def test_grants_prints_quoted_statements_for_the_configured_schema(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('schema = "acme_jobs"\n')
    res = cli("--config", str(cfg), "grants", "maintd_daemon")
    assert res.returncode == 0, res.stderr
    statements = [line for line in res.stdout.splitlines() if line.startswith("GRANT")]
    assert statements[0] == 'GRANT USAGE ON SCHEMA "acme_jobs" TO "maintd_daemon";'
    assert 'GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE "acme_jobs"."jobs" TO "maintd_daemon";' in statements
    assert 'GRANT SELECT, UPDATE ("error", "enabled") ON TABLE "acme_jobs"."periodic_jobs" TO "maintd_daemon";' in statements
    assert any(line.startswith("DO $$") and line.endswith(
        'REVOKE UPDATE ON TABLE "acme_jobs"."periodic_jobs" FROM "maintd_daemon"; END IF; END$$;')
        for line in res.stdout.splitlines())
    assert all('"acme_jobs".' in s and s.endswith('TO "maintd_daemon";') for s in statements[1:])
    assert "ownership" in res.stdout and "reindex" in res.stdout  # said, not granted
    assert not any(re.search(r"\b(CREATE|OWNER|ALL|TRUNCATE|MAINTAIN)\b", s) for s in statements)
    worker = cli("--config", str(cfg), "grants", "app_worker", "--worker")
    assert [line for line in worker.stdout.splitlines() if line.startswith("GRANT")] == [
        'GRANT USAGE ON SCHEMA "acme_jobs" TO "app_worker";',
        'GRANT SELECT, INSERT, UPDATE ON TABLE "acme_jobs"."jobs" TO "app_worker";']


def test_grants_for_targets_in_two_databases_print_a_script_per_database(tmp_path):
    """Targets in two databases got one script (one BEGIN ... COMMIT naming both schemas, no
    database named): piped into psql on either database, as its header says, it failed on the
    other's schema and granted nothing; two same-named schemas in two databases got one block
    and the second database nothing. Now one script per database, headed by its (redacted) URL."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('database_url = "postgresql://owner:pw1@db1/app"\n'
                   '[[targets]]\nschema = "aaa"\n[[targets]]\nschema = "bbb"\n'
                   '[[targets]]\nname = "other_aaa"\nschema = "aaa"\ndatabase_url = "postgresql://owner:pw2@db2/app"\n')
    res = cli("--config", str(cfg), "grants", "maintd_daemon")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("BEGIN;") == 2, res.stdout
    first, second = res.stdout.split("BEGIN;")[1:]
    assert "-- database postgresql://owner:***@db2/app" in first.split("COMMIT;")[1]  # the second's header
    assert '"aaa"."jobs"' in first and '"bbb"."jobs"' in first.split("COMMIT;")[0]
    assert '"aaa"."jobs"' in second and '"bbb"' not in second
    assert "pw1" not in res.stdout and "pw2" not in res.stdout
    one = cli("--config", str(cfg), "--target", "aaa", "grants", "maintd_daemon")
    assert one.stdout.count("BEGIN;") == 1 and "-- database" not in one.stdout  # one database: as before


@pytest.mark.parametrize("role", ['Maintd', 'a"b', "x; DROP ROLE postgres", "pg_monitor", "public",
                                  "1abc", "", "a" * 64])
def test_a_bad_role_name_is_refused(role):
    with pytest.raises(ValueError, match="invalid role name"):
        grants.render(["maintd"], role)


def test_grants_with_a_bad_role_name_exits_2_with_one_line():
    res = cli("grants", "x; DROP ROLE postgres")
    assert res.returncode == 2 and res.stdout == ""
    assert "invalid role name" in res.stderr and len(res.stderr.strip().splitlines()) == 1


# -- on a real server --------------------------------------------------------------------------------

def role_dsn(pg_dsn: str, role: str) -> str:
    assert "postgres@" in pg_dsn, pg_dsn
    return pg_dsn.replace("postgres@", f"{role}@", 1)


@contextmanager
def login_role(pg_dsn: str, prefix: str = "maintd_t") -> Iterator[str]:
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{name}" LOGIN')
    try:
        yield name
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,))
            conn.execute(f'DROP OWNED BY "{name}" CASCADE')
            conn.execute(f'DROP ROLE "{name}"')


def apply(pg_dsn: str, script: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(script)


def table_privileges(pg_dsn: str, schema: str, role: str) -> dict[str, set[str]]:
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute("""
            SELECT c.relname, a.privilege_type
              FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace,
                   aclexplode(c.relacl) a
             WHERE n.nspname = %s AND a.grantee = to_regrole(%s)""", (schema, role)).fetchall()
    out: dict[str, set[str]] = {}
    for table, priv in rows:
        out.setdefault(table, set()).add(priv)
    return out


@pytest.mark.both_layouts
def test_grants_cover_every_table_migrate_creates(pg_dsn, schema):
    """Partitions are read and written through jobs: only its privileges are checked."""
    with psycopg.connect(pg_dsn) as conn:
        tables = {r[0] for r in conn.execute(
            "SELECT c.relname FROM pg_class c WHERE c.relnamespace = to_regnamespace(%s) "
            "AND c.relkind IN ('r', 'p') AND NOT c.relispartition", (schema,))}
        sequences = conn.execute("""
            SELECT c.relname, d.deptype FROM pg_class c
              JOIN pg_namespace n ON n.oid = c.relnamespace
              LEFT JOIN pg_depend d ON d.objid = c.oid AND d.classid = 'pg_class'::regclass
                                   AND d.refclassid = 'pg_class'::regclass
             WHERE n.nspname = %s AND c.relkind = 'S'""", (schema,)).fetchall()
    assert tables == {g.table for g in grants.DAEMON}
    # The only sequences are identity sequences (deptype 'i'), which INSERT uses without a grant.
    assert sequences and {deptype for _, deptype in sequences} == {"i"}


@pytest.mark.both_layouts
@pytest.mark.parametrize("worker", [False, True], ids=["daemon", "worker"])
def test_printed_sql_grants_exactly_the_declared_privileges(pg_dsn, schema, worker):
    with login_role(pg_dsn) as role:
        apply(pg_dsn, grants.render([schema], role, worker=worker))
        assert table_privileges(pg_dsn, schema, role) == on_tables(grants.WORKER if worker else grants.DAEMON)
        assert column_updates(pg_dsn, schema, role) == on_columns(grants.WORKER if worker else grants.DAEMON)
        with psycopg.connect(role_dsn(pg_dsn, role)) as conn:
            usage, create, db_create = conn.execute(
                "SELECT has_schema_privilege(%s, 'USAGE'), has_schema_privilege(%s, 'CREATE'), "
                "has_database_privilege(current_database(), 'CREATE')", (schema, schema)).fetchone()
            executable = {name: conn.execute("SELECT has_function_privilege(%s, 'EXECUTE')",
                                             (f'"{schema}".{name}',)).fetchone()[0]
                          for name, _ in grants.DAEMON_FUNCTIONS}
        assert (usage, create, db_create) == (True, False, False)
        assert set(executable.values()) == {not worker}  # revoked from PUBLIC, granted to the daemon


@pytest.mark.parametrize("layout", ["partitioned"], indirect=True)
def test_the_daemon_role_can_reach_the_partition_ddl_only_through_its_guarded_functions(pg_dsn, schema):
    """SPEC 8.1: the partition functions run as the schema's owner. Every SECURITY DEFINER one
    pins search_path to pg_catalog, pg_temp; the daemon's role may call exactly those `maintd
    grants` names, none of the helpers that take a table name (new_partition_table,
    rename_partition, attach_partition, ...); and maintain_partitions refuses a state that is
    not a final one (the live partition, a quoted name) before touching anything."""
    granted = {sig for sig, _ in grants.DAEMON_FUNCTIONS}
    helpers = [partitions._name_args(sig) for sig, *_ in partitions.HELPERS
               if not sig.startswith(partitions.PUBLIC_HELPERS) and partitions._name_args(sig) not in granted]
    assert "new_partition_table(text, text)" in helpers and "rename_partition(text, text)" in helpers
    with login_role(pg_dsn) as role:
        apply(pg_dsn, grants.render([schema], role))
        with psycopg.connect(pg_dsn) as conn:
            definers = dict(conn.execute(
                "SELECT p.proname, p.proconfig FROM pg_proc AS p WHERE p.pronamespace = to_regnamespace(%s)"
                " AND p.prosecdef", (f'"{schema}"',)).fetchall())
            relations = conn.execute("SELECT count(*) FROM pg_class WHERE relnamespace = to_regnamespace(%s)",
                                     (f'"{schema}"',)).fetchone()[0]
        assert definers and all("search_path=pg_catalog, pg_temp" in (config or []) for config in definers.values())
        with psycopg.connect(role_dsn(pg_dsn, role)) as conn:
            callable_definers = {name for name in definers if conn.execute(
                "SELECT bool_or(has_function_privilege(p.oid, 'EXECUTE')) FROM pg_proc AS p"
                " WHERE p.pronamespace = to_regnamespace(%s) AND p.proname = %s",
                (f'"{schema}"', name)).fetchone()[0]}
            assert callable_definers == {sig.split("(")[0] for sig, _ in grants.DAEMON_FUNCTIONS}
            for name_args in helpers:
                assert not conn.execute("SELECT has_function_privilege(%s, 'EXECUTE')",
                                        (f'"{schema}".{name_args}',)).fetchone()[0], name_args
            for state in ("live", "jobs_live", 'completed"; DROP TABLE jobs; --', "Completed"):
                with pytest.raises(psycopg.errors.InvalidParameterValue):
                    conn.execute(f'SELECT * FROM "{schema}".maintain_partitions(%s, interval \'1 hour\', now())',
                                 (state,))
                conn.rollback()
        with psycopg.connect(pg_dsn) as conn:
            assert conn.execute("SELECT count(*) FROM pg_class WHERE relnamespace = to_regnamespace(%s)",
                                (f'"{schema}"',)).fetchone()[0] == relations


@pytest.mark.parametrize("layout", ["partitioned"], indirect=True)
def test_maintain_partitions_refuses_a_null_argument_or_a_step_in_months_as_the_daemon_role(pg_dsn, schema):
    """Its guards were comparisons, which a NULL passes (NULL is not true): a NULL state failed
    deep in a helper ('null values cannot be formatted as an SQL identifier'), a NULL step went on
    to detach the catch-alls, a NULL make-until skipped the '1000 steps ahead' guard; and a step
    of '1 month' (not under a minute) made partitions of calendar months (31 days, then 31, 28...),
    not the fixed steps from the epoch the layout is made of. Migration 0020: each is refused,
    naming the argument, before anything is touched; a call as the daemon makes it (a step in
    seconds) still makes partitions."""
    calls = {
        "p_state": "maintain_partitions(NULL, interval '1 hour', now())",
        "p_step": "maintain_partitions('completed', NULL, now())",
        "p_make_until": "maintain_partitions('completed', interval '1 hour', NULL, now() - interval '1 day')",
        "p_step in months": "maintain_partitions('completed', interval '1 month', now())",
        "p_step in years": "maintain_partitions('completed', interval '1 year 1 hour', now())",
    }
    with login_role(pg_dsn) as role:
        apply(pg_dsn, grants.render([schema], role))
        with psycopg.connect(pg_dsn) as conn:
            before = conn.execute("SELECT count(*) FROM pg_class WHERE relnamespace = to_regnamespace(%s)",
                                  (f'"{schema}"',)).fetchone()[0]
        with psycopg.connect(role_dsn(pg_dsn, role)) as conn:
            for said, call in calls.items():
                with pytest.raises(psycopg.errors.InvalidParameterValue, match=said.split()[0]) as raised:
                    conn.execute(f'SELECT * FROM "{schema}".{call}')
                conn.rollback()
                assert "maintain_partitions" in str(raised.value), (said, str(raised.value))
                if said.startswith("p_step in"):
                    assert "month" in str(raised.value), str(raised.value)
            with psycopg.connect(pg_dsn) as owner:
                assert owner.execute("SELECT count(*) FROM pg_class WHERE relnamespace = to_regnamespace(%s)",
                                     (f'"{schema}"',)).fetchone()[0] == before
            made = conn.execute(f'SELECT action FROM "{schema}".maintain_partitions(\'completed\', '
                                'make_interval(secs => 3600), now() + interval \'3 hours\')').fetchall()
            conn.commit()
        assert ("made",) in made, made


def test_apply_from_several_replicas_at_once(pg_dsn, schema):
    with login_role(pg_dsn) as role:
        engines = [make_engine(pg_dsn, application_name=f"grants-{i}", pooled=False) for i in range(4)]
        unused = list(engines)

        def go():
            with unused.pop().connect() as conn:  # list.pop is atomic
                return grants.apply(conn, [schema], role)

        try:  # unserialized, concurrent GRANTs on one table fail with "tuple concurrently updated"
            assert run_concurrently(go, 4) == [len(grants.grant_statements(schema, role))] * 4
        finally:
            for engine in engines:
                engine.dispose()
        assert table_privileges(pg_dsn, schema, role) == on_tables(grants.DAEMON)
        assert column_updates(pg_dsn, schema, role) == on_columns(grants.DAEMON)


def test_a_quoted_reserved_word_is_a_usable_role_name(pg_dsn, schema):
    name = "select"  # valid per the identifier rules, works only because it is quoted
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute('DROP ROLE IF EXISTS "select"')
        conn.execute('CREATE ROLE "select"')
    try:
        apply(pg_dsn, grants.render([schema], name))
        assert table_privileges(pg_dsn, schema, name)["jobs"] == {"SELECT", "INSERT", "UPDATE", "DELETE"}
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute('DROP OWNED BY "select"')
            conn.execute('DROP ROLE "select"')


def write_config(tmp_path, schema: str, extra: str = "", top: str = "") -> str:
    cfg = tmp_path / "maintd.toml"
    cfg.write_text(f'schema = "{schema}"\ninstance_id = "grants-test"\n{top}'
                   '[http]\nlisten = "127.0.0.1:0"\n' + extra)
    return str(cfg)


def seed(pg_dsn: str, schema: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"""INSERT INTO "{schema}".jobs (kind, state, finalized_at, attempted_at, attempt, scheduled_at)
            VALUES ('old', 'completed', now() - interval '2 days', now() - interval '2 days', 1, now()),
                   ('stuck', 'running', NULL, now() - interval '2 hours', 1, now()),
                   ('due', 'scheduled', NULL, NULL, 0, now() - interval '1 second')""")


def job_states(pg_dsn: str, schema: str) -> dict[str, str]:
    with psycopg.connect(pg_dsn) as conn:
        return dict(conn.execute(f'SELECT kind, state::text FROM "{schema}".jobs').fetchall())


@pytest.mark.both_layouts
def test_daemon_role_runs_every_service_status_and_migrate(pg_dsn, schema, layout, tmp_path):
    """On the partitioned layout (SPEC 8.1) the role also makes and drops partitions, through the
    partition functions only: the completed state's partitions start three days back (no leader
    made them since), so the old job is in the high catch-all; the first pass closes it into a
    partition of its range, the second drops that partition (past 24h)."""
    periodic = '[[periodic]]\nid = "g"\nschedule = "@hourly"\nkind = "g.tick"\nrun_on_start = true\n'
    cfg = write_config(tmp_path, schema, periodic, top=f'layout = "{layout}"\n')
    services = ["cleaner", "rescuer", "scheduler", "periodic"]
    if layout == "partitioned":
        from datetime import timedelta

        from .test_layout import restart, server_now

        engine = make_engine(pg_dsn, application_name="grants-restart", pooled=False)
        restart(engine, schema, "completed", server_now(engine) - timedelta(days=3))
        engine.dispose()
        services += ["partitioner", "partitioner"]
    seed(pg_dsn, schema)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # a row the periodic enqueuer refuses, noting why
        conn.execute(f"""INSERT INTO "{schema}".periodic_jobs (id, schedule, kind) VALUES ('bad', 'not a schedule', 'b')""")
    with login_role(pg_dsn) as role:
        apply(pg_dsn, grants.render([schema], role))
        env = {"MAINTD_DATABASE_URL": role_dsn(pg_dsn, role)}
        for service in services:
            res = cli("--config", cfg, "run-once", service, env=env)
            assert res.returncode == 0 and '"outcome": "success"' in res.stdout, (service, res.stdout + res.stderr)
        states = job_states(pg_dsn, schema)
        assert "old" not in states and states["stuck"] in ("retryable", "available")  # backoff 2.7 s
        assert states["due"] == "available" and states["g.tick"] == "available"
        res = cli("--config", cfg, "status", "--json", env=env)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["schema"] == schema  # leader, daemons, runs, job counts read
        res = cli("--config", cfg, "migrate", env=env)
        assert res.returncode == 0 and "nothing to do" in res.stdout, res.stderr
        assert_updates_only_the_error_note(pg_dsn, schema, role)


def assert_updates_only_the_error_note(pg_dsn: str, schema: str, role: str) -> None:
    """The daemon's role wrote the bad row's error note (the periodic pass), may write it and
    enabled (`maintd periodic pause|resume`), and may not write any other column of periodic_jobs
    (an application's schedules)."""
    with psycopg.connect(pg_dsn) as conn:
        assert "schedule" in conn.execute(f'SELECT error FROM "{schema}".periodic_jobs WHERE id = %s',
                                          ("bad",)).fetchone()[0]
    with psycopg.connect(role_dsn(pg_dsn, role), autocommit=True) as conn:
        assert conn.execute(f'UPDATE "{schema}".periodic_jobs SET error = NULL WHERE id = %s RETURNING id',
                            ("bad",)).fetchall() == [("bad",)]
        assert conn.execute(f'UPDATE "{schema}".periodic_jobs SET enabled = true WHERE id = %s RETURNING id',
                            ("bad",)).fetchall() == [("bad",)]
        for column, value in (("schedule", "'@hourly'"), ("kind", "'other'"), ("queue", "'q'"),
                              ("args", "'{}'"), ("updated_at", "now()")):
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="periodic_jobs"):
                conn.execute(f'UPDATE "{schema}".periodic_jobs SET {column} = {value} WHERE id = %s', ("bad",))
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute(f'SELECT schedule, enabled, kind FROM "{schema}".periodic_jobs WHERE id = %s',
                            ("bad",)).fetchone() == ("not a schedule", True, "b")


def test_apply_takes_back_an_earlier_update_on_the_whole_periodic_jobs_table(pg_dsn, schema, tmp_path):
    """An upgrade: a role given an earlier maintd's grants (UPDATE on all of periodic_jobs, as
    the deploy files' `grants --apply` did) and then this maintd's `grants --apply` is left with
    UPDATE on the error and enabled columns only; a GRANT of a column adds to the table's, it takes nothing
    away. The printed script does the same."""
    def earlier(who: str) -> str:  # this maintd's script as it was before the column grant
        return "\n".join(line.replace('UPDATE ("error", "enabled")', "UPDATE") for line in grants.render([schema], who).splitlines()
                         if "REVOKE UPDATE" not in line)

    with login_role(pg_dsn) as role, login_role(pg_dsn) as printed:
        for who in (role, printed):
            apply(pg_dsn, earlier(who))
            assert "UPDATE" in table_privileges(pg_dsn, schema, who)["periodic_jobs"]
        apply_by_cli(pg_dsn, tmp_path, schema, role, worker=False)
        apply(pg_dsn, grants.render([schema], printed))
        for who in (role, printed):
            assert effective_privileges(pg_dsn, schema, who) == on_tables(grants.DAEMON), who
            assert column_updates(pg_dsn, schema, who) == {"periodic_jobs": {"error", "enabled"}}, who
            with psycopg.connect(role_dsn(pg_dsn, who), autocommit=True) as conn:
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(f'UPDATE "{schema}".periodic_jobs SET schedule = schedule')
                conn.execute(f'UPDATE "{schema}".periodic_jobs SET error = error')


@pytest.mark.parametrize("how", ["apply", "printed"])
def test_grants_for_the_schemas_owner_take_nothing_from_it(pg_dsn, tmp_path, how):
    """The script revokes UPDATE on the whole periodic_jobs table before its column grant, and an
    owner may revoke its own privileges: `maintd grants OWNER --apply` (one role for everything, or
    the owner's name given by mistake) left the owner unable to change a schedule (`periodic add
    --replace`: permission denied for table periodic_jobs) until it granted itself UPDATE again.
    The REVOKE is not run for the table's owner."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with login_role(pg_dsn, "maintd_owner") as owner:
        apply(pg_dsn, f'CREATE SCHEMA "{schema}" AUTHORIZATION "{owner}"')
        cfg = write_config(tmp_path, schema)
        env = {"MAINTD_DATABASE_URL": role_dsn(pg_dsn, owner)}
        assert cli("--config", cfg, "migrate", env=env).returncode == 0
        for _ in range(2):  # and again, as an upgrade does
            if how == "apply":
                res = cli("--config", cfg, "grants", owner, "--apply", env=env)
                assert res.returncode == 0, res.stdout + res.stderr
            else:
                apply(role_dsn(pg_dsn, owner), grants.render([schema], owner))
        with psycopg.connect(role_dsn(pg_dsn, owner), autocommit=True) as conn:
            conn.execute(f"INSERT INTO \"{schema}\".periodic_jobs (id, schedule, kind) VALUES ('p', '@hourly', 'k')")
            conn.execute(f"UPDATE \"{schema}\".periodic_jobs SET schedule = '@daily'")  # permission denied before
        assert "UPDATE" in effective_privileges(pg_dsn, schema, owner)["periodic_jobs"]


def test_daemon_role_runs_a_daemon_with_two_targets(pg_dsn, schema, tmp_path):
    """``maintd run`` with two [[targets]] (one shared lock session, LISTEN, the daemons registry,
    the spread's reads) under a role given exactly what ``maintd grants ROLE`` prints for both."""
    from sqlalchemy import text

    from .conftest import new_schema_name
    from .procs import wait_for

    other = new_schema_name()
    engine = make_engine(pg_dsn, application_name="maintd-test-migrate", pooled=False)
    with engine.connect() as conn:
        migrate.upgrade(conn, other)
    cfg = tmp_path / "multi.toml"
    cfg.write_text('instance_id = "grants-multi"\n[http]\nlisten = "127.0.0.1:0"\n'
                   '[scheduler]\ninterval = "1s"\n'
                   f'[[targets]]\nschema = "{schema}"\n[[targets]]\nschema = "{other}"\n')
    try:
        for s in (schema, other):
            seed(pg_dsn, s)
        with login_role(pg_dsn) as role:
            apply(pg_dsn, grants.render([schema, other], role))
            base = {k: v for k, v in os.environ.items() if not k.startswith("MAINTD_")}
            proc = subprocess.Popen([sys.executable, "-m", "maintd", "--config", str(cfg), "run"],
                                    env={**base, "MAINTD_DATABASE_URL": role_dsn(pg_dsn, role)},
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                wait_for(lambda: all(job_states(pg_dsn, s).get("due") == "available" for s in (schema, other)),
                         30, 0.1, what="due jobs promoted in both targets by the restricted role")
                with psycopg.connect(pg_dsn) as conn:
                    for s in (schema, other):
                        row = conn.execute(f'SELECT instance_id FROM "{s}".leader').fetchone()
                        assert row == ("grants-multi",), (s, row)
                        assert conn.execute(f'SELECT count(*) FROM "{s}".daemons').fetchone()[0] == 1
            finally:
                proc.terminate()
                out, _ = proc.communicate(timeout=30)
            assert proc.returncode == 0, out
            assert "permission denied" not in out and "missing privilege" not in out, out
    finally:
        with engine.connect() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{other}" CASCADE'))
            conn.commit()
        engine.dispose()


@pytest.mark.both_layouts
def test_worker_role_runs_the_worker_sql_and_nothing_else(pg_dsn, schema):
    with login_role(pg_dsn, "app_worker") as role:
        apply(pg_dsn, grants.render([schema], role, worker=True))
        q = JobQueue(schema)
        engine = make_engine(role_dsn(pg_dsn, role), application_name="grants-worker", pooled=False)
        try:
            with engine.begin() as conn:
                assert q.enqueue(conn, "w", queue="w", unique_key="k") is not None
                assert q.enqueue(conn, "w", queue="w", unique_key="k") is None
                q.enqueue(conn, "w", queue="w")
                q.enqueue(conn, "w", queue="w")
            with engine.begin() as conn:
                a, b, c = q.claim(conn, "w", "worker-1", limit=3)
                assert q.heartbeat(conn, a) and q.complete(conn, a)
                assert q.fail(conn, b, "boom") == "retryable" and q.cancel(conn, c.id)
            for forbidden in (f'DELETE FROM "{schema}".jobs', f'SELECT * FROM "{schema}".leader',
                              f'TRUNCATE "{schema}".jobs', f'CREATE TABLE "{schema}".x ()'):
                with pytest.raises(Exception, match="permission denied"), engine.begin() as conn:
                    conn.exec_driver_sql(forbidden)
        finally:
            engine.dispose()


# -- migrate as a role that may not do the work -------------------------------------------------

def test_migrate_by_a_role_without_create_on_the_database_names_it(pg_dsn, tmp_path):
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with login_role(pg_dsn) as role:
        res = cli("--config", write_config(tmp_path, schema), "migrate",
                  env={"MAINTD_DATABASE_URL": role_dsn(pg_dsn, role)})
        assert res.returncode == 1 and "Traceback" not in res.stderr
        [line] = res.stderr.strip().splitlines()
        assert "lacks CREATE on database" in line and f"schema '{schema}'" in line
        assert "as the owner role" in line and f"CREATE SCHEMA \"{schema}\" AUTHORIZATION" in line


def test_migrate_into_an_empty_schema_without_create_names_it(pg_dsn, tmp_path):
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with login_role(pg_dsn, "maintd_owner") as owner, login_role(pg_dsn) as role:
        apply(pg_dsn, f'CREATE SCHEMA "{schema}" AUTHORIZATION "{owner}"; '
                      f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"')
        res = cli("--config", write_config(tmp_path, schema), "migrate",
                  env={"MAINTD_DATABASE_URL": role_dsn(pg_dsn, role)})
        assert res.returncode == 1
        [line] = res.stderr.strip().splitlines()
        assert f"lacks CREATE on schema '{schema}'" in line and f"owner role ('{owner}')" in line
        # The owner can, without CREATE on the database: the schema is there already.
        res = cli("--config", write_config(tmp_path, schema), "migrate",
                  env={"MAINTD_DATABASE_URL": role_dsn(pg_dsn, owner)})
        assert res.returncode == 0 and "migrated from base" in res.stdout, res.stderr


def test_a_downgrade_by_the_runtime_role_says_it_does_not_own_the_tables(pg_dsn, tmp_path):
    """`maintd migrate --downgrade -1` as the runtime role (exactly `maintd grants`) said it
    'lacks CREATE on schema ... (needed to create maintd's tables)': a newcomer walking the
    README read that as a grant to add before a downgrade, which creates no table. What it
    lacks is ownership of the tables it drops; an upgrade still names CREATE first."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with login_role(pg_dsn, "maintd_owner") as owner, login_role(pg_dsn) as role:
        apply(pg_dsn, f'CREATE SCHEMA "{schema}" AUTHORIZATION "{owner}"')
        cfg = write_config(tmp_path, schema)
        assert cli("--config", cfg, "migrate", "--revision", "head-1",
                   env={"MAINTD_DATABASE_URL": role_dsn(pg_dsn, owner)}).returncode == 0
        apply(pg_dsn, grants.render([schema], role))
        env = {"MAINTD_DATABASE_URL": role_dsn(pg_dsn, role)}
        # The command to run as the owner is the one run: a bare `maintd migrate` would upgrade.
        for argv, said in ((("--downgrade", "-1"), f"does not own the tables of schema '{schema}' (needed to drop or alter"),
                           (("--downgrade", "base"), f"does not own the tables of schema '{schema}' (needed to drop or alter"),
                           ((), f"lacks CREATE on schema '{schema}' (needed to create maintd's tables)"),
                           (("--revision", "head"), f"lacks CREATE on schema '{schema}' (needed to create maintd's tables)")):
            res = cli("--config", cfg, "migrate", *argv, env=env)
            assert res.returncode == 1, (argv, res.stdout, res.stderr)
            [line] = res.stderr.strip().splitlines()
            command = " ".join(("maintd migrate", *argv)).replace(" --revision head", "")
            assert said in line and f"run `{command}` as the owner role ('{owner}')" in line, (argv, line)
        with psycopg.connect(pg_dsn) as conn:  # nothing was touched
            assert conn.execute(f'SELECT count(*) FROM "{schema}".alembic_version').fetchone()[0] == 1


def test_migrate_work_on_tables_of_another_owner_names_the_owner(pg_dsn, tmp_path):
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with login_role(pg_dsn, "maintd_owner") as owner, login_role(pg_dsn) as role:
        apply(pg_dsn, f'CREATE SCHEMA "{schema}" AUTHORIZATION "{owner}"')
        cfg = write_config(tmp_path, schema)
        assert cli("--config", cfg, "migrate", env={"MAINTD_DATABASE_URL": role_dsn(pg_dsn, owner)}).returncode == 0
        apply(pg_dsn, grants.render([schema], role) + f'GRANT CREATE ON SCHEMA "{schema}" TO "{role}";')
        res = cli("--config", cfg, "migrate", "--downgrade", "base",
                  env={"MAINTD_DATABASE_URL": role_dsn(pg_dsn, role)})
        assert res.returncode == 1
        [line] = res.stderr.strip().splitlines()
        assert f"does not own the tables of schema '{schema}'" in line and f"('{owner}')" in line
        with psycopg.connect(pg_dsn) as conn:  # nothing was touched
            assert conn.execute(f'SELECT version_num FROM "{schema}".alembic_version').fetchone()[0] == migrate.head_revision()


def test_migrate_by_a_role_that_cannot_see_the_schema_never_says_nothing_to_do(pg_dsn, schema, tmp_path):
    """A role without USAGE on a migrated schema reads no revision: `migrate --downgrade base`
    said "schema S is at revision base; nothing to do" (exit 0) while the schema stayed at head,
    and the operator believed the tables were gone. It names the missing USAGE, as `migrate` does."""
    with login_role(pg_dsn) as role:
        res = cli("--config", write_config(tmp_path, schema), "migrate", "--downgrade", "base",
                  env={"MAINTD_DATABASE_URL": role_dsn(pg_dsn, role)})
        assert res.returncode == 1 and "nothing to do" not in res.stdout, (res.stdout, res.stderr)
        [line] = res.stderr.strip().splitlines()
        assert f"role '{role}' lacks USAGE on schema '{schema}'" in line, line
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute(f'SELECT version_num FROM "{schema}".alembic_version').fetchone()[0] == migrate.head_revision()


def test_migrate_sql_by_a_role_that_cannot_see_the_schema_names_the_owner_role_not_a_grant(pg_dsn, schema, tmp_path):
    """`maintd migrate --sql` reads the schema's revision to print what is left to do. A role
    without USAGE on the schema got "permission denied for schema S (a grant is missing: as the
    schema's owner, run `maintd grants ROLE --apply`)": no grant `maintd grants` gives is for
    migrating, and its SQL is the owner's to run. It names the USAGE and the owner role, as
    `maintd migrate` does, and --from, which needs no read."""
    with login_role(pg_dsn) as role:
        env = {"MAINTD_DATABASE_URL": role_dsn(pg_dsn, role)}
        res = cli("--config", write_config(tmp_path, schema), "migrate", "--sql", env=env)
        assert res.returncode == 1 and not res.stdout, (res.stdout, res.stderr)
        [line] = res.stderr.strip().splitlines()
        assert f"role '{role}' lacks USAGE on schema '{schema}'" in line and "owner role" in line, line
        assert "--from" in line and "maintd grants" not in line, line
        res = cli("--config", write_config(tmp_path, schema), "migrate", "--sql", "--from", "0017", env=env)
        assert res.returncode == 0 and "0018" in res.stdout, res.stderr


def test_the_daemon_role_gets_the_owner_named_for_what_no_grant_of_its_own_gives(pg_dsn, tmp_path):
    """`maintd grants` deliberately leaves the conversion (DDL) and writing schedule rows out of
    the daemon's role: the error must say which role can, not advise the grants it already has.
    Found by running the README as a newcomer: both said "a grant is missing: run `maintd grants
    ROLE --apply`", and the conversion got as far as "preparing jobs_conv" first."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with login_role(pg_dsn, "maintd_owner") as owner, login_role(pg_dsn) as role:
        apply(pg_dsn, f'CREATE SCHEMA "{schema}" AUTHORIZATION "{owner}"')
        cfg = write_config(tmp_path, schema)
        assert cli("--config", cfg, "migrate", env={"MAINTD_DATABASE_URL": role_dsn(pg_dsn, owner)}).returncode == 0
        apply(pg_dsn, grants.render([schema], role))
        env = {"MAINTD_DATABASE_URL": role_dsn(pg_dsn, role)}
        res = cli("--config", cfg, "migrate", "--convert", "partitioned", env=env)
        assert res.returncode == 1 and res.stdout == "", res.stdout  # refused before it made anything
        [line] = res.stderr.strip().splitlines()
        assert f"lacks CREATE on schema '{schema}'" in line and f"owner role ('{owner}')" in line
        assert "maintd grants" not in line
        res = cli("--config", cfg, "periodic", "add", "r1", "--schedule", "@hourly", "--kind", "report", env=env)
        assert res.returncode == 1
        [line] = res.stderr.strip().splitlines()
        assert "permission denied for table periodic_jobs" in line and "maintd grants ROLE --apply" not in line
        assert "schema's owner" in line and f'GRANT SELECT, INSERT, UPDATE, DELETE ON "{schema}".periodic_jobs' in line
        owner_env = {"MAINTD_DATABASE_URL": role_dsn(pg_dsn, owner)}
        res = cli("--config", cfg, "periodic", "add", "r1", "--schedule", "@hourly", "--kind", "report", env=owner_env)
        assert res.returncode == 0, res.stderr
        for action in ("pause", "resume"):  # what the daemon's role may do (UPDATE of enabled)
            res = cli("--config", cfg, "periodic", action, "r1", env=env)
            assert res.returncode == 0, res.stderr
        res = cli("--config", cfg, "periodic", "remove", "r1", env=env)
        [line] = res.stderr.strip().splitlines()
        assert res.returncode == 1 and "schema's owner" in line and "maintd grants ROLE --apply" not in line, line
        with psycopg.connect(pg_dsn) as conn:  # nothing was converted
            assert conn.execute(f"SELECT relkind FROM pg_class WHERE oid = '\"{schema}\".jobs'::regclass").fetchone()[0] == "r"
            assert conn.execute(f'SELECT count(*) FROM "{schema}".periodic_jobs').fetchone()[0] == 1


REPO = Path(__file__).resolve().parent.parent
PERIODIC_PRIVILEGES = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE)\b")


def test_a_role_given_what_the_readme_or_the_hint_names_adds_pauses_and_removes_schedules(pg_dsn, schema, tmp_path):
    """`maintd periodic add` is an ``INSERT ... ON CONFLICT DO UPDATE ... RETURNING`` and `remove` a
    ``DELETE ... WHERE ... RETURNING``: PostgreSQL asks UPDATE of the first and SELECT of both
    (https://www.postgresql.org/docs/current/sql-insert.html: "INSERT with an ON CONFLICT DO UPDATE
    clause requires UPDATE privilege", and SELECT for columns read by RETURNING or the conflict's
    target; https://www.postgresql.org/docs/current/sql-delete.html: SELECT for the WHERE and
    RETURNING). The README said they "need INSERT and DELETE on `periodic_jobs`" and the error's
    hint "GRANT INSERT, UPDATE, DELETE": a role given either could not add a schedule (walking the
    README as a newcomer: "permission denied for table periodic_jobs" again)."""
    readme = (REPO / "README.md").read_text()
    said = re.search(r"`add` and `remove` need (.+?) on\s+`periodic_jobs`", readme, re.S)
    assert said, "the README no longer says what `periodic add` and `remove` need"
    readme_privileges = ", ".join(PERIODIC_PRIVILEGES.findall(said.group(1)))
    with login_role(pg_dsn) as role:
        apply(pg_dsn, f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"')
        cfg, env = write_config(tmp_path, schema), {"MAINTD_DATABASE_URL": role_dsn(pg_dsn, role)}
        add = ("periodic", "add", "r1", "--schedule", "@hourly", "--kind", "report")
        res = cli("--config", cfg, *add, env=env)
        assert res.returncode == 1, res.stdout
        hint = re.search(r"GRANT ([A-Z, ]+) ON \S+\.periodic_jobs TO the role", res.stderr)
        assert hint, res.stderr
        for source, privileges in (("README", readme_privileges), ("hint", hint.group(1))):
            apply(pg_dsn, f'REVOKE ALL ON "{schema}".periodic_jobs FROM "{role}"; '
                          f'GRANT {privileges} ON "{schema}".periodic_jobs TO "{role}"')
            for action in (add, ("periodic", "pause", "r1"), ("periodic", "remove", "r1")):
                res = cli("--config", cfg, *action, env=env)
                assert res.returncode == 0, f"{source}'s GRANT {privileges}: {' '.join(action)}: {res.stderr}"


@pytest.mark.parametrize("wait", ["0", "3"], ids=["at-once", "wait"])
def test_run_once_by_a_role_that_cannot_start_a_term_says_why(pg_dsn, schema, tmp_path, wait):
    """A role that may read but not write the leader row wins the lock and cannot start a term:
    run-once said 'another instance holds the leader lock (unknown)', which nobody did; the
    cause, a grant, was only in an earlier log line (SPEC 8.4: an error a grant would fix names
    `maintd grants`). With --wait it said so again (a review's fix cleared the cause before every
    round, and most rounds of a wait try nothing: the cause was gone by its end)."""
    with login_role(pg_dsn) as role:
        apply(pg_dsn, f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"; '
                      f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO "{role}"')
        res = cli("--config", write_config(tmp_path, schema), "run-once", "cleaner", "--wait", wait,
                  env={"MAINTD_DATABASE_URL": role_dsn(pg_dsn, role)})
        assert res.returncode == 1
        last = res.stderr.strip().splitlines()[-1]
        assert last.startswith("maintd: error: could not start a term: permission denied for table leader"), last
        assert f"maintd grants {role} --apply" in last and "another instance" not in res.stderr


def test_run_once_wait_says_what_its_last_try_met_not_an_earlier_one(pg_dsn, schema, tmp_path):
    """run-once --wait by a role that cannot start a term: its first try wins the lock and fails
    on the missing grant; then a daemon takes the lock and holds it until the wait is over. The
    last tries found the lock held: that is what is said, not the first try's grant error (said
    before a review: 'could not start a term: permission denied', though the grant was not why
    run-once ended without the lock)."""
    instance = f"holder-{uuid.uuid4().hex[:8]}"
    with login_role(pg_dsn) as role:
        apply(pg_dsn, f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"; '
                      f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO "{role}"')
        err = tmp_path / "run-once.err"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MAINTD_")}
        with open(err, "w") as out:
            run_once = subprocess.Popen([sys.executable, "-m", "maintd", "--config", write_config(tmp_path, schema),
                                         "run-once", "cleaner", "--wait", "25"], stdout=subprocess.DEVNULL, stderr=out,
                                        text=True, env={**env, "MAINTD_DATABASE_URL": role_dsn(pg_dsn, role)})
        daemon = DaemonProc(pg_dsn, schema, instance, workdir=str(tmp_path))
        try:
            wait_for(lambda: "could not start a term" in err.read_text(), 20, what="run-once's first try")
            # the daemon's start-up, up to 10 s seen on a loaded machine (procs.START), within the wait
            daemon.start().wait_log(r"became leader", timeout=20)
            assert run_once.poll() is None, "run-once ended before the daemon took the lock: " + err.read_text()
            assert run_once.wait(45) == 1
        finally:
            if run_once.poll() is None:
                run_once.kill()
                run_once.wait()
            daemon.stop()
    last = err.read_text().strip().splitlines()[-1]
    assert last.startswith(f"maintd: error: another instance holds the leader lock (instance={instance} "), last


# -- `maintd grants ROLE [--worker] --apply` against real roles ------------------------------------

TABLE_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")


def effective_privileges(pg_dsn: str, schema: str, role: str) -> dict[str, set[str]]:
    """Every privilege the role has on every table of the schema, however it got it."""
    with psycopg.connect(pg_dsn) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT c.oid::regclass::text FROM pg_class c WHERE c.relnamespace = to_regnamespace(%s)"
            " AND c.relkind IN ('r', 'p', 'v', 'm')", (f'"{schema}"',))]
        out = {}
        for table in tables:
            held = {p for p in TABLE_PRIVILEGES
                    if conn.execute("SELECT has_table_privilege(%s, %s, %s)", (role, table, p)).fetchone()[0]}
            if held:
                out[table.rsplit(".", 1)[-1].strip('"')] = held
    return out


def apply_by_cli(pg_dsn: str, tmp_path, schema: str, role: str, worker: bool) -> None:
    res = cli("--config", write_config(tmp_path, schema), "grants", role, *(["--worker"] if worker else []),
              "--apply", env={"MAINTD_DATABASE_URL": pg_dsn})
    who = "a worker" if worker else "the daemon"
    assert res.returncode == 0 and f"granted role {role} what {who} needs on schema {schema}" in res.stdout, \
        res.stdout + res.stderr


@pytest.mark.parametrize("worker", [False, True], ids=["daemon", "worker"])
def test_grants_apply_gives_a_role_exactly_the_declared_privileges(pg_dsn, schema, tmp_path, worker):
    with login_role(pg_dsn) as role:
        apply_by_cli(pg_dsn, tmp_path, schema, role, worker)
        assert effective_privileges(pg_dsn, schema, role) == on_tables(grants.WORKER if worker else grants.DAEMON)
        assert column_updates(pg_dsn, schema, role) == on_columns(grants.WORKER if worker else grants.DAEMON)


@pytest.mark.parametrize("grantor", ["daemon", "stranger"])
def test_grants_apply_by_a_role_that_may_not_grant_fails_naming_the_owner_and_grants_nothing(
        pg_dsn, schema, tmp_path, grantor):
    """The daemon's own role applying a worker's grants: PostgreSQL's GRANT by a role that holds
    the privileges without their grant option is only a warning ("no privileges were granted",
    SQLSTATE 01007; PostgreSQL's GRANT page, Notes), and maintd printed "granted role ... (2
    statements)" with exit 0 while the worker got nothing. A role with no privileges at all gets
    an error, whose hint told it to run the very command it ran. Both now fail with exit 1, naming
    the schema's owner, and nothing is granted."""
    with login_role(pg_dsn, "maintd_g") as runner, login_role(pg_dsn, "maintd_w") as worker:
        if grantor == "daemon":
            apply_by_cli(pg_dsn, tmp_path, schema, runner, worker=False)
        res = cli("--config", write_config(tmp_path, schema), "grants", worker, "--worker", "--apply",
                  env={"MAINTD_DATABASE_URL": role_dsn(pg_dsn, runner)})
        assert res.returncode == 1 and res.stdout == "", res.stdout + res.stderr
        line = res.stderr.strip()
        assert len(line.splitlines()) == 1, line
        assert f"role {runner} may not grant on schema {schema}" in line, line
        assert f"run `maintd grants {worker} --worker --apply` as the schema's owner, postgres" in line, line
        assert "granted role" not in line, line
        assert ("no privileges were granted" if grantor == "daemon" else "permission denied") in line, line
        assert effective_privileges(pg_dsn, schema, worker) == {}


def readme_worker_sql(schema: str) -> list[str]:
    """The worker statements of the README, verbatim, in psycopg's parameter style, for ``schema``."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = re.search(r"Workers in other languages run\s+the same statements.*?```sql\n(.*?)```", readme, re.S)
    assert block, "no worker SQL in the README"
    text = re.sub(r"--[^\n]*", "", block.group(1)).replace("maintd.", f'"{schema}".')
    text = re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", text)
    return [s.strip() for s in text.split(";") if s.strip()]


def test_a_worker_role_applied_by_the_cli_runs_the_worker_sql_and_admin_functions_and_nothing_else(
        pg_dsn, schema, tmp_path):
    """`maintd grants ROLE --worker --apply`: the role runs the README's worker SQL as written and
    the admin functions that change jobs, and nothing else: no DELETE (the cleaner's job, so
    delete_jobs and remove_job are refused too), no maintenance writes (the leader row, service
    runs, periodic slots and rows, the replicas' registry), no DDL, no maintd function that runs
    with its owner's rights."""
    with login_role(pg_dsn, "app_worker") as role:
        apply_by_cli(pg_dsn, tmp_path, schema, role, worker=True)
        enqueue, claim, heartbeat, complete, fail, cancel = readme_worker_sql(schema)
        job = {"kind": "w", "queue": "w", "args": "{}", "priority": 0, "max_attempts": 3, "scheduled_at": None,
               "metadata": "{}"}
        with psycopg.connect(role_dsn(pg_dsn, role), autocommit=True) as conn:
            ids = [conn.execute(enqueue, {**job, "unique_key": k}).fetchone()[0] for k in ("a", "b", "c")]
            assert conn.execute(enqueue, {**job, "unique_key": "a"}).fetchone() is None  # a live job holds it
            claimed = conn.execute(claim, {"worker": "w1", "queue": "w", "limit": 3}).fetchall()
            assert sorted(r[0] for r in claimed) == ids
            mine = {"worker": "w1", "attempt": 1}
            assert conn.execute(heartbeat, {"id": ids[0], **mine}).fetchone() == (ids[0],)
            assert conn.execute(complete, {"id": ids[0], **mine}).fetchone() == (ids[0],)
            assert conn.execute(fail, {"id": ids[1], **mine, "discard": False, "backoff": 1.5,
                                       "error": "boom"}).fetchone() == ("retryable",)
            assert conn.execute(cancel, {"id": ids[2]}).fetchone() == (ids[2],)
            for call in ("retry_jobs(%(ids)s)", "reschedule_jobs(%(ids)s, run_at => now())",
                         "permanently_fail_jobs(%(ids)s, 'r')", "retry_jobs(%(ids)s)", "cancel_jobs(%(ids)s)",
                         "retry_jobs(%(ids)s)", "complete_jobs(%(ids)s)"):
                assert conn.execute(f'SELECT id FROM "{schema}".{call}', {"ids": [ids[1]]}).fetchall() == [(ids[1],)], call
            refused = [
                f'DELETE FROM "{schema}".jobs',
                f'SELECT * FROM "{schema}".delete_jobs(ARRAY[{ids[0]}]::bigint[])',
                f'SELECT * FROM "{schema}".remove_job(\'a\')',
                f'TRUNCATE "{schema}".jobs',
                f'SELECT * FROM "{schema}".leader',
                f'UPDATE "{schema}".leader SET epoch = epoch + 1',
                f'INSERT INTO "{schema}".service_runs (service, instance_id, started_at, finished_at, outcome)'
                " VALUES ('cleaner', 'x', now(), now(), 'success')",
                f'INSERT INTO "{schema}".periodic_slots (periodic_id, slot) VALUES (\'p\', now())',
                f'DELETE FROM "{schema}".periodic_slots',
                f'UPDATE "{schema}".periodic_jobs SET error = \'x\'',
                f'INSERT INTO "{schema}".daemons (instance_id, host, pid, version, started_at, last_seen_at)'
                " VALUES ('x', 'h', 1, 'v', now(), now())",
                f'CREATE TABLE "{schema}".x ()',
                f'CREATE INDEX ON "{schema}".jobs (kind)',
            ]
            for statement in refused:
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(statement)
            # Functions that run with their owner's rights (the partition functions of SPEC 8.1)
            # must not be executable by a worker; PostgreSQL grants EXECUTE to PUBLIC by default.
            definer = conn.execute(
                "SELECT p.oid::regprocedure::text FROM pg_proc p WHERE p.pronamespace = to_regnamespace(%s)"
                " AND p.prosecdef AND has_function_privilege(p.oid, 'EXECUTE')", (f'"{schema}"',)).fetchall()
            assert definer == []
        assert effective_privileges(pg_dsn, schema, role) == declared(grants.WORKER)


def test_each_function_grant_says_what_that_function_does():
    """`maintd grants` printed one comment, naming every partition function's use, above each
    of the three EXECUTE grants."""
    reasons = dict(grants.DAEMON_FUNCTIONS)
    assert len(set(reasons.values())) == len(reasons) == 3, reasons
    assert "drop" in reasons["drop_detached_partitions()"] and "count" in reasons["catch_all_rows()"]
    assert all(r.startswith("partitioned layout: ") and r.endswith("(runs as the schema's owner)")
               for r in reasons.values())


def test_the_history_grant_names_who_deletes_its_rows():
    """`maintd grants` said the DELETE on health_history is for "the cleaner", which prunes nothing
    there since the health read's history writer took the pruning over (hourly, whether the
    cleaner is enabled or not: README "Dashboard", tests/test_history.py): an operator with the
    cleaner off would revoke a DELETE the leader still needs."""
    from maintd import history

    [reason] = [g.why for g in grants.DAEMON if g.table == "health_history"]
    assert "PRUNE" in inspect.getsource(history) and "cleaner" not in reason, reason
    assert "DELETE" in reason and "two days" in reason, reason


def test_run_once_that_waited_for_the_lock_in_vain_does_not_advise_waiting(pg_dsn, schema, tmp_path):
    """`run-once --wait 2` while a daemon leads ended with "another instance holds the leader lock
    (...); stop it, use --wait, or run with --dry-run": it had waited (found walking the README's
    "Day to day" as a newcomer). After a wait, it says how long it waited instead."""
    instance = f"holder-{uuid.uuid4().hex[:8]}"
    daemon = DaemonProc(pg_dsn, schema, instance, workdir=str(tmp_path))
    try:
        daemon.start().wait_log(r"became leader", timeout=20)
        cfg = write_config(tmp_path, schema)
        env = {"MAINTD_DATABASE_URL": pg_dsn}
        res = cli("--config", cfg, "run-once", "scheduler", env=env)
        assert res.returncode == 1 and res.stderr.strip().splitlines()[-1].endswith(
            "stop it, use --wait, or run with --dry-run"), res.stderr
        res = cli("--config", cfg, "run-once", "scheduler", "--wait", "2", env=env)
        last = res.stderr.strip().splitlines()[-1]
    finally:
        daemon.stop()
    assert res.returncode == 1 and last.startswith(
        f"maintd: error: another instance holds the leader lock (instance={instance} "), last
    assert "use --wait" not in last and "still held after waiting 2 s" in last, last


def test_apply_does_not_wait_for_a_conversion(pg_dsn, schema):
    """`grants --apply` took the schema's migrate lock, which `migrate --convert partitioned` holds
    for the whole copy (hours on a large table): the second command of maintd-migrate.service (and
    so every daemon start) hung until systemd's 15 minutes ran out. Grants now have a lock of their
    own, which the conversion takes only for its swap."""
    from .test_migrations import while_a_conversion_holds_the_lock

    with login_role(pg_dsn) as role:
        engine = make_engine(pg_dsn, application_name="t", pooled=False)
        try:
            count, waited = while_a_conversion_holds_the_lock(engine, schema,
                                                              lambda conn: grants.apply(conn, [schema], role))
            assert count == len(grants.grant_statements(schema, role)) and waited < 10, (count, waited)
        finally:
            engine.dispose()


def test_apply_waiting_for_a_migration_does_not_deadlock_its_index_builds(pg_dsn):
    """A migration holds the grants lock for its run, and its CREATE INDEX CONCURRENTLY (0004,
    0005) waits for every transaction whose snapshot is older than the build's. `grants --apply`
    waited for the grants lock inside pg_advisory_xact_lock, a statement, so with a snapshot: the
    index build waited for the grants, the grants for the migration, and PostgreSQL's deadlock
    detector cancelled one of them (the migration, after its index build: `deadlock detected`).
    Waiting for the lock as `migrate` does, by tries between statements, holds no snapshot."""
    import threading
    import time

    from sqlalchemy import text

    from .conftest import schema_at

    schema, engine = schema_at(pg_dsn, "0003")
    result: dict = {}
    worker = psycopg.connect(pg_dsn)
    try:
        with login_role(pg_dsn) as role:
            worker.execute(f'INSERT INTO "{schema}".jobs (kind) VALUES (\'k\')')  # the index build waits for it

            def run(name, step):
                try:
                    with engine.connect() as conn:
                        result[name] = step(conn)
                except Exception as exc:  # the assertion below reports it
                    result[name] = exc

            migration = threading.Thread(target=run, args=("migrate", lambda c: migrate.upgrade(c, schema)), daemon=True)
            migration.start()
            wait_for(lambda: _holds(pg_dsn, migrate.grants_lock_key(schema)), 30, what="the migration's grants lock")
            applying = threading.Thread(target=run, args=("grants", lambda c: grants.apply(c, [schema], role)),
                                        daemon=True)
            applying.start()
            time.sleep(3)  # the grants wait (past deadlock_timeout), the index build waits for the worker
            worker.commit()  # the build goes on, and then waits for the older snapshots
            migration.join(120)
            applying.join(60)
            assert result.get("migrate") == ("0003", migrate.head_revision()), result
            assert isinstance(result.get("grants"), int), result
    finally:
        worker.close()
        with engine.connect() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
            conn.commit()
        engine.dispose()


def _holds(dsn: str, key: int) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT NOT pg_try_advisory_lock(%s) OR NOT pg_advisory_unlock(%s)", (key, key)).fetchone()[0]


def test_grants_apply_on_a_schema_behind_this_maintd_says_to_migrate_first(pg_dsn, schema, tmp_path):
    """`maintd grants ROLE --apply` before `maintd migrate` (a new release's grants on the old
    schema: its revision 0006 has no health_history yet) failed with 'relation
    "S.health_history" does not exist' and no word of `maintd migrate`. It names the schema's
    revision and the command, and grants nothing."""
    engine = make_engine(pg_dsn, application_name="t", pooled=False)
    try:
        with engine.connect() as conn:
            migrate.downgrade(conn, schema, "0006")
    finally:
        engine.dispose()
    with login_role(pg_dsn) as role:
        res = cli("--config", write_config(tmp_path, schema), "grants", role, "--apply",
                  env={"MAINTD_DATABASE_URL": pg_dsn})
        assert res.returncode == 1 and res.stdout == "", res.stdout + res.stderr
        [line] = res.stderr.strip().splitlines()
        assert f"schema '{schema}' is at revision 0006" in line and "run `maintd migrate`" in line, line
        assert effective_privileges(pg_dsn, schema, role) == {}


def test_the_daemon_script_says_how_the_reindexer_can_run_without_ownership():
    """The script said "let the owner role reindex on a schedule instead", which maintd cannot do
    while the daemons run (`run-once reindexer` as the owner needs the leader lock they hold). It
    now names the way that works: MAINTAIN on the jobs table (PostgreSQL 17+), granted by the
    owner, or the reindexer left off."""
    text = grants.render(["maintd"], "maintd_daemon")
    assert "on a schedule instead" not in text
    assert '--   GRANT MAINTAIN ON TABLE "maintd"."jobs" TO "maintd_daemon";' in text
    assert "reindexer.enabled = false" in text
