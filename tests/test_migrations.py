"""Migrations: upgrade/downgrade round trip, concurrency, offline SQL, model == migrations."""

from __future__ import annotations

import threading
from datetime import timedelta

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from maintd import migrate
from maintd.db import make_engine, quote_ident
from maintd.models import metadata

from .conftest import new_schema_name, schema_at
from .procs import wait_for
from .test_layout import restart, server_now


def _tables(conn, schema):
    return set(inspect(conn).get_table_names(schema=schema))


def test_upgrade_downgrade_round_trip(pg_dsn):
    schema = new_schema_name()
    engine = make_engine(pg_dsn, application_name="t", pooled=False)
    try:
        with engine.connect() as conn:
            assert migrate.upgrade(conn, schema) == (None, migrate.head_revision())
            assert _tables(conn, schema) >= {"jobs", "leader", "daemons", "service_runs",
                                             "periodic_slots", "alembic_version"}
            # Idempotent.
            assert migrate.upgrade(conn, schema) == (migrate.head_revision(), migrate.head_revision())
            assert migrate.downgrade(conn, schema, "base")[1] is None
            assert _tables(conn, schema) == {"alembic_version"}
            assert conn.execute(text(
                "SELECT count(*) FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace "
                "WHERE n.nspname = :s AND t.typname = 'job_state'"), {"s": schema}).scalar() == 0
            migrate.upgrade(conn, schema)
            assert "jobs" in _tables(conn, schema)
            conn.execute(text(f"DROP SCHEMA {quote_ident(schema)} CASCADE"))
            conn.commit()
    finally:
        engine.dispose()


def test_concurrent_migrate_applies_once(pg_dsn):
    schema = new_schema_name()
    results, errors = [], []

    def run():
        engine = make_engine(pg_dsn, application_name="t", pooled=False)
        try:
            with engine.connect() as conn:
                results.append(migrate.upgrade(conn, schema))
        except Exception as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)
        finally:
            engine.dispose()

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    head = migrate.head_revision()
    assert sorted(results, key=str) == sorted([(None, head)] + [(head, head)] * 3, key=str)
    engine = make_engine(pg_dsn, application_name="t", pooled=False)
    with engine.connect() as conn:
        conn.execute(text(f"DROP SCHEMA {quote_ident(schema)} CASCADE"))
        conn.commit()
    engine.dispose()


def test_model_matches_migrations(pg_dsn, schema):
    engine = make_engine(pg_dsn, application_name="t", pooled=False)
    with engine.connect() as conn:
        conn.execute(text(f"SET search_path TO {quote_ident(schema)}"))
        ctx = MigrationContext.configure(conn, opts={
            "compare_type": True,
            "include_object": lambda obj, name, type_, reflected, compare_to: name != "alembic_version",
        })
        diff = compare_metadata(ctx, metadata)
    engine.dispose()
    assert diff == []


def test_offline_sql_is_schema_qualified():
    out = migrate.offline_sql("acme_jobs")
    assert 'CREATE SCHEMA IF NOT EXISTS "acme_jobs"' in out
    assert "CREATE TABLE acme_jobs.jobs" in out
    assert "CREATE UNIQUE INDEX jobs_unique_key_idx ON acme_jobs.jobs" in out
    assert out.strip().endswith("COMMIT;")


def test_migrate_sql_prints_what_is_left_to_do(pg_dsn, schema, tmp_path, capsys):
    """Issue 28: `migrate --sql` on a current schema printed the whole DDL from base."""
    from maintd.cli import main

    cfg = tmp_path / "maintd.toml"
    cfg.write_text(f'database_url = "{pg_dsn}"\nschema = "{schema}"\n')
    assert main(["--config", str(cfg), "migrate", "--sql"]) == 0
    out = capsys.readouterr().out
    assert out == f"-- schema {schema} is at revision {migrate.head_revision()} (head); nothing to do\n"
    engine = make_engine(pg_dsn, application_name="t", pooled=False)
    with engine.connect() as conn:
        migrate.downgrade(conn, schema, "0003")
    engine.dispose()
    assert main(["--config", str(cfg), "migrate", "--sql"]) == 0
    out = capsys.readouterr().out
    assert "Running upgrade 0003 -> 0004" in out and "Running upgrade  -> 0001" not in out  # from where it is
    assert f"CREATE TABLE {schema}.jobs" not in out  # (later revisions may create tables of their own)
    # --from base: the whole DDL without a connection (a new schema, a DBA's review)
    cfg.write_text(f'database_url = "postgresql://nobody@127.0.0.1:1/none"\nschema = "{schema}"\n')
    assert main(["--config", str(cfg), "migrate", "--sql", "--from", "base"]) == 0
    assert f"CREATE TABLE {schema}.jobs" in capsys.readouterr().out
    assert main(["--config", str(cfg), "migrate", "--sql"]) == 1  # it must read the revision
    assert "Connection refused" in capsys.readouterr().err


def test_indexes_exist_per_access_path(pg_dsn, schema):
    engine = make_engine(pg_dsn, application_name="t", pooled=False)
    with engine.connect() as conn:
        names = {r[0] for r in conn.execute(text(
            "SELECT indexname FROM pg_indexes WHERE schemaname = :s AND tablename = 'jobs'"),
            {"s": schema})}
    engine.dispose()
    assert names == {"jobs_pkey", "jobs_fetch_idx", "jobs_scheduled_idx", "jobs_finalized_idx",
                     "jobs_running_idx", "jobs_unique_key_idx", "jobs_exhausted_idx",
                     "jobs_finalized_queue_idx"}  # main's 0004


def test_0009_replaces_the_three_argument_drop_helper(pg_dsn):
    """A schema migrated to 0008 by an earlier release has drop_expired_partitions(text,
    timestamptz, jsonb); 0009 drops it, creates the two-argument one (not executable by PUBLIC)
    and maintain_partitions calls that (a prune of an expired partition works afterwards). The
    replaced job_partitions stays executable by everyone (the daemon's role reads it)."""
    schema = new_schema_name()
    engine = make_engine(pg_dsn, application_name="t", pooled=False)
    q = quote_ident(schema)
    signatures = text("SELECT p.oid::regprocedure::text, has_function_privilege('public', p.oid, 'EXECUTE') "
                      "FROM pg_proc AS p WHERE p.pronamespace = to_regnamespace(:s) "
                      "AND p.proname = 'drop_expired_partitions'")
    try:
        with engine.connect() as conn:
            layout = migrate.Layout("partitioned", timedelta(hours=1), 3)
            migrate.upgrade(conn, schema, "0008", layout=layout)
            conn.execute(text(f"DROP FUNCTION {q}.drop_expired_partitions(text, timestamptz)"))
            conn.execute(text(f"CREATE FUNCTION {q}.drop_expired_partitions(p_state text, p_before timestamptz, "
                              "p_counts jsonb) RETURNS void LANGUAGE sql AS 'SELECT'"))  # as 0006 made it
            conn.commit()
            migrate.upgrade(conn, schema)
            assert conn.execute(signatures, {"s": schema}).all() == [
                (f"{schema}.drop_expired_partitions(text,timestamp with time zone)", False)]
            assert conn.execute(text("SELECT has_function_privilege('public', CAST(:f AS regprocedure), 'EXECUTE')"),
                                {"f": f"{q}.job_partitions(text)"}).scalar()  # replaced, still everyone's
            conn.commit()
            restart(engine, schema, "completed", server_now(engine) - timedelta(hours=5))
            conn.execute(text(f"SELECT count(*) FROM {q}.maintain_partitions('completed', interval '1 hour', now())"))
            conn.execute(text(f"INSERT INTO {q}.jobs (kind, state, finalized_at) "
                              "VALUES ('k', 'completed', now() - interval '4 hours 30 minutes')"))
            rows = conn.execute(text(f"SELECT action FROM {q}.maintain_partitions('completed', interval '1 hour', "
                                     "now(), now() - interval '2 hours')")).scalars().all()
            assert rows == ["emptied"]
            conn.commit()
            rows = conn.execute(text(f"SELECT action FROM {q}.maintain_partitions('completed', interval '1 hour', "
                                     "now(), now() - interval '2 hours')")).scalars().all()
            assert "detached" in rows
            assert conn.execute(text(f"SELECT count(*) FROM {q}.jobs")).scalar() == 0
            conn.execute(text(f"DROP SCHEMA {q} CASCADE"))
            conn.commit()
    finally:
        engine.dispose()


def test_a_relative_revision_that_leads_nowhere_exits_2_naming_the_option(pg_dsn, schema, tmp_path, capsys):
    """SPEC 8.4: exit 2 for bad usage. `--revision head+1` exited 1 with "maintd: error:
    AssertionError" (Alembic's bare assert), `--downgrade +1` and `--sql --from head+5` exited 1
    with Alembic's words; the schema is left as it was."""
    from maintd.cli import main

    cfg = tmp_path / "maintd.toml"
    cfg.write_text(f'database_url = "{pg_dsn}"\nschema = "{schema}"\n')
    for argv, option in [(["migrate", "--revision", "head+1"], "--revision head+1"),
                         (["migrate", "--revision", "0012+50"], "--revision 0012+50"),
                         (["migrate", "--downgrade", "+1"], "--downgrade +1"),
                         (["migrate", "--revision", "-1"], "--revision -1"),
                         (["migrate", "--sql", "--from", "base", "--revision", "head+1"], "--revision head+1"),
                         (["migrate", "--sql", "--from", "head+5"], "--from head+5")]:
        assert main(["--config", str(cfg), *argv]) == 2, argv
        err = capsys.readouterr().err
        assert f"maintd: config error: {option}: " in err and "Traceback" not in err, (argv, err)
    engine = make_engine(pg_dsn, application_name="t", pooled=False)
    with engine.connect() as conn:
        assert migrate.current_revision(conn, schema) == migrate.head_revision()
    engine.dispose()


def test_a_relative_downgrade_counts_from_the_schemas_revision_not_from_head(pg_dsn, tmp_path, capsys):
    """`maintd migrate --downgrade -1` on a schema one revision behind head said "is at revision
    ...; nothing to do" and exit 0: Alembic's get_revisions reads "-1" from head, so the schema
    seemed there already. Alembic's downgrade counts from the schema's revision, as the README's
    "-1" means: it now goes one down, and "-2" two. Source: Alembic's tutorial, "Relative Migration
    Identifiers" (docs/build/tutorial.rst): "To move two versions from the current, a decimal value
    '+N' can be supplied ... Negative values are accepted for downgrades: alembic downgrade -1"."""
    from maintd.cli import main

    ids = migrate.revisions()
    schema, engine = schema_at(pg_dsn, ids[-2])
    try:
        cfg = tmp_path / "maintd.toml"
        cfg.write_text(f'database_url = "{pg_dsn}"\nschema = "{schema}"\n')
        for argv, then in ((["--downgrade", "-1"], ids[-3]), (["--downgrade", "-2"], ids[-5]),
                           (["--revision", "+1"], ids[-4])):
            assert main(["--config", str(cfg), "migrate", *argv]) == 0, argv
            assert "nothing to do" not in capsys.readouterr().out, argv
            with engine.connect() as conn:
                assert migrate.current_revision(conn, schema) == then, argv
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {quote_ident(schema)} CASCADE"))
        engine.dispose()


def test_migrate_sql_with_downgrade_prints_the_downgrade(tmp_path, capsys):
    """`migrate --sql --downgrade REV` printed the upgrade SQL (or 'nothing to do' on a current
    schema) with exit 0: a DBA reviewing a downgrade saw none of the DROPs it would run.
    `--sql --convert` likewise printed upgrade SQL; the conversion has no offline SQL."""
    from maintd.cli import main

    cfg = tmp_path / "maintd.toml"
    cfg.write_text('database_url = "postgresql://nobody@127.0.0.1:1/none"\nschema = "acme_jobs"\n')
    assert main(["--config", str(cfg), "migrate", "--sql", "--from", "head", "--downgrade", "0006"]) == 0
    out = capsys.readouterr().out
    assert "Running downgrade 0007 -> 0006" in out and "DROP TABLE acme_jobs.health_history" in out, out
    assert "nothing to do" not in out and "Running upgrade" not in out
    assert main(["--config", str(cfg), "migrate", "--sql", "--from", "0002", "--downgrade", "base"]) == 0
    out = capsys.readouterr().out
    assert "DROP TABLE acme_jobs.jobs" in out and "Running downgrade 0003" not in out, out
    assert main(["--config", str(cfg), "migrate", "--sql", "--from", "0006", "--downgrade", "0006"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert main(["--config", str(cfg), "migrate", "--sql", "--from", "base", "--convert", "partitioned"]) == 2
    assert "--convert: does not go with --sql" in capsys.readouterr().err
    # --revision beside --downgrade was ignored without a word: which one did the operator mean?
    assert main(["--config", str(cfg), "migrate", "--sql", "--from", "head", "--downgrade", "0006",
                 "--revision", "0005"]) == 2
    assert "--revision: does not go with --downgrade" in capsys.readouterr().err


def test_migrate_interrupted_by_ctrl_c_does_not_exit_0(pg_dsn, tmp_path):
    """Ctrl-C (SIGINT) ended every command with exit 0: `maintd migrate && deploy` went on to
    deploy on a schema that was never migrated. It exits 130, as a shell does for SIGINT."""
    import os
    import signal
    import subprocess
    import sys
    import time

    schema = new_schema_name()
    cfg = tmp_path / "maintd.toml"
    cfg.write_text(f'database_url = "{pg_dsn}"\nschema = "{schema}"\ninstance_id = "{schema}"\n')
    engine = make_engine(pg_dsn, application_name="t", pooled=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAINTD_")}
    try:
        with engine.connect() as holder:  # the migrate lock, held: the command waits for it
            holder.execute(text("SELECT pg_advisory_lock(:k)"), {"k": migrate.lock_key(schema)})
            proc = subprocess.Popen([sys.executable, "-m", "maintd", "--config", str(cfg), "migrate"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            # This command's own session (other workers' tests run `maintd migrate` on this server
            # too; a match on any migrate session once sent the signal while this one was importing).
            mine = text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :a")

            def waiting() -> bool:
                found = holder.execute(mine, {"a": f"maintd:{schema}:migrate"}).scalar()
                holder.commit()  # pg_stat_activity is read once per transaction
                return bool(found)

            wait_for(waiting, 60, interval=0.1, what="maintd migrate waiting on the held migrate lock")
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
            holder.execute(text("SELECT pg_advisory_unlock_all()"))
        assert proc.returncode == 130, (proc.returncode, out, err)
        assert "migrated" not in out and err == "maintd: interrupted\n", err
    finally:
        engine.dispose()


def test_the_printed_ddl_runs_as_the_readme_owner_role(pg_dsn):
    """README "Production install": a superuser makes the schema (CREATE SCHEMA maintd
    AUTHORIZATION maintd_owner) and the owner, with no CREATE on the database, runs the
    migrations. `maintd migrate` does; the script `maintd migrate --sql` prints for a DBA began
    with CREATE SCHEMA IF NOT EXISTS, which PostgreSQL refuses such a role even when the schema
    exists ("permission denied for database"), so every printed script failed as the owner: the
    whole DDL and each upgrade's."""
    import subprocess

    import psycopg

    from .test_grants import login_role, role_dsn
    from .test_readme_sql import psql_with_bind

    name = new_schema_name()
    with login_role(pg_dsn, "owner") as owner:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{name}" AUTHORIZATION "{owner}"')
        try:
            dsn = role_dsn(pg_dsn, owner)
            with psycopg.connect(dsn, autocommit=True) as conn:
                assert conn.execute("SELECT has_database_privilege(current_database(), 'CREATE')").fetchone() == (False,)
            # as a DBA applies it: `maintd migrate --sql | psql -v ON_ERROR_STOP=1 "$OWNER_URL"`
            for script in (migrate.offline_sql(name, "0016"), migrate.offline_sql(name, start="0016")):
                res = subprocess.run([psql_with_bind(), "-X", "-q", "-v", "ON_ERROR_STOP=1", dsn], input=script,
                                     capture_output=True, text=True, timeout=120)
                assert res.returncode == 0, res.stderr
            with psycopg.connect(dsn) as conn:
                assert conn.execute(f'SELECT version_num FROM "{name}".alembic_version').fetchone() == \
                    (migrate.head_revision(),)
        finally:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def upgrade_in_background(engine, schema: str, result: dict) -> threading.Thread:
    """``migrate.upgrade`` to head in a started thread: its revisions (or its error) in ``result``."""
    def run():
        try:
            with engine.connect() as conn:
                result["revisions"] = migrate.upgrade(conn, schema)
        except Exception as exc:  # pragma: no cover - the assertion below reports it
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def drop(engine, schema: str) -> None:
    """Drop the test's schema, and the engine's connections."""
    with engine.connect() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {quote_ident(schema)} CASCADE"))
        conn.commit()
    engine.dispose()


def test_a_migration_never_queues_behind_a_long_transaction_while_blocking_others(pg_dsn):
    """A migration's DDL waited without a lock_timeout: upgrading 0009 to head while a long
    transaction (a report, pg_dump) held ACCESS SHARE on daemons queued ALTER TABLE daemons behind
    it, and every other session reading or writing daemons (each replica's registration) queued
    behind the ALTER for as long as the report ran. A migration's lock is now waited for a bounded
    time per try and tried again, so the others pass meanwhile; it finishes once the holder ends."""
    import time

    import psycopg

    schema, engine = schema_at(pg_dsn, "0009")
    result: dict = {}
    holder = psycopg.connect(pg_dsn)
    try:
        holder.execute(f"SELECT count(*) FROM {quote_ident(schema)}.daemons")  # a long report: held

        thread = upgrade_in_background(engine, schema, result)
        time.sleep(2)  # the migration meets the held lock
        with psycopg.connect(pg_dsn, autocommit=True) as other:
            other.execute("SET lock_timeout = '5s'")
            for _ in range(3):  # the daemons' registration goes on, though the migration waits
                other.execute(f"SELECT count(*) FROM {quote_ident(schema)}.daemons").fetchone()
                time.sleep(0.5)
        assert thread.is_alive() and not result, result
        holder.rollback()
        thread.join(60)
        assert result == {"revisions": ("0009", migrate.head_revision())}, result
    finally:
        holder.close()
        drop(engine, schema)


def test_an_index_built_by_a_migration_waits_for_a_long_worker_transaction(pg_dsn):
    """CREATE INDEX CONCURRENTLY blocks no worker (SHARE UPDATE EXCLUSIVE), but waits for the
    transactions that write jobs: the migration's bounded lock wait must not make it give up."""
    import time

    import psycopg

    schema, engine = schema_at(pg_dsn, "0003")
    result: dict = {}
    worker = psycopg.connect(pg_dsn)
    try:
        worker.execute(f"INSERT INTO {quote_ident(schema)}.jobs (kind) VALUES ('k')")  # open

        thread = upgrade_in_background(engine, schema, result)
        # One build, waiting all along (for 3 s once seen): with the migration's 1 s lock_timeout
        # kept for it, the build gave up after a second and left an invalid index, and each retry's
        # DROP of that index (ACCESS EXCLUSIVE on jobs) queued behind the worker, every other
        # worker's write behind it; the retry loop hid this, and the upgrade still ended well.
        building = ("SELECT pid, query_start FROM pg_stat_activity WHERE query LIKE %s AND state = 'active'",
                    (f"%CREATE INDEX CONCURRENTLY%{quote_ident(schema)}.jobs%",))
        builds, now_building, deadline = set(), [], time.monotonic() + 30
        with psycopg.connect(pg_dsn, autocommit=True) as watcher:
            while time.monotonic() < deadline:
                now_building = watcher.execute(*building).fetchall()
                if now_building and not builds:
                    deadline = time.monotonic() + 3
                builds.update(now_building)
                time.sleep(0.05)
        assert thread.is_alive() and not result, result
        assert len(builds) == 1 and now_building == list(builds), \
            f"the index build was not one build waiting all along: begun {builds}, at the end {now_building}"
        worker.commit()
        thread.join(60)
        assert result == {"revisions": ("0003", migrate.head_revision())}, result
    finally:
        worker.close()
        drop(engine, schema)


def test_migrate_on_a_current_schema_does_not_wait_for_a_conversion(pg_dsn, schema):
    """`maintd migrate` took the schema's migrate lock before it read the revision, so on a current
    schema it waited for whoever held it: `maintd migrate --convert partitioned`, which holds it
    for the whole copy (hours on a large table). Every daemon start (maintd-migrate.service, the
    pods' init container) hung meanwhile, silently, until systemd's 15 minutes ran out. A current
    schema needs no lock: it says nothing to do at once."""
    engine = make_engine(pg_dsn, application_name="t", pooled=False)
    try:
        result, waited = while_a_conversion_holds_the_lock(engine, schema, lambda conn: migrate.upgrade(conn, schema))
        head = migrate.head_revision()
        assert result == (head, head) and waited < 10, (result, waited)
    finally:
        engine.dispose()


def while_a_conversion_holds_the_lock(engine, schema: str, work) -> tuple[object, float]:
    """``work(conn)`` in a thread while another session holds the schema's migrate lock (as a
    conversion under way does), given 10 s; the lock is then let go. Returns what ``work``
    returned (None if it had not) and the seconds it was waited for (10 at most: it had not)."""
    import time

    result: dict = {}
    with engine.connect() as holder:
        holder.execute(text("SELECT pg_advisory_lock(:k)"), {"k": migrate.lock_key(schema)})
        holder.commit()

        def run():
            with engine.connect() as conn:
                result["value"] = work(conn)

        thread = threading.Thread(target=run, daemon=True)
        started = time.monotonic()
        thread.start()
        thread.join(10)
        waited = time.monotonic() - started
        holder.execute(text("SELECT pg_advisory_unlock_all()"))
        holder.commit()
        thread.join(30)
    return result.get("value"), waited


def test_a_migrate_waiting_for_another_says_once_who_holds_the_lock(pg_dsn):
    """A `maintd migrate` with work to do waits for the schema's migrate lock while another run
    (or a `--convert`, for hours) holds it. It waited silently, with no end: an operator saw a
    command hang. After a couple of seconds it now says once that it waits, and for whom: the
    holder's pid and application_name (pg_locks, pg_stat_activity)."""
    import psycopg

    schema = new_schema_name()
    said: list[str] = []
    results: list = []
    with psycopg.connect(pg_dsn, autocommit=True, application_name="other-migrate") as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (migrate.lock_key(schema),))
        engine = make_engine(pg_dsn, application_name="t", pooled=False)

        def run():
            with engine.connect() as conn:
                results.append(migrate.upgrade(conn, schema, waiting=said.append))

        t = threading.Thread(target=run)
        t.start()
        try:
            deadline = threading.Event()
            for _ in range(100):
                if said or deadline.wait(0.1):
                    break
            assert len(said) == 1 and f"pid {holder.info.backend_pid}" in said[0] and "other-migrate" in said[0], said
            assert f"schema {schema}" in said[0] and not results
        finally:
            holder.execute("SELECT pg_advisory_unlock(%s)", (migrate.lock_key(schema),))
            t.join(120)
    assert results == [(None, migrate.head_revision())] and len(said) == 1
    with engine.connect() as conn:
        conn.execute(text(f"DROP SCHEMA {quote_ident(schema)} CASCADE"))
        conn.commit()
    engine.dispose()


def test_the_migrate_command_says_on_stderr_that_it_waits(pg_dsn, tmp_path, capsys):
    """The same, from `maintd migrate`: one line on stderr, then the migration once the lock is free."""
    import psycopg

    from maintd.cli import main

    schema = new_schema_name()
    cfg = tmp_path / "maintd.toml"
    cfg.write_text(f'database_url = "{pg_dsn}"\nschema = "{schema}"\n')
    with psycopg.connect(pg_dsn, autocommit=True, application_name="other-migrate") as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (migrate.lock_key(schema),))
        pid = holder.info.backend_pid
        threading.Timer(4.0, lambda: holder.execute("SELECT pg_advisory_unlock(%s)",
                                                    (migrate.lock_key(schema),))).start()
        assert main(["--config", str(cfg), "migrate"]) == 0
    out, err = capsys.readouterr()
    assert err.count("waiting for the migrate lock") == 1 and f"pid {pid}" in err, err
    assert f"schema {schema} migrated from base to {migrate.head_revision()}" in out
    engine = make_engine(pg_dsn, application_name="t", pooled=False)
    with engine.connect() as conn:
        conn.execute(text(f"DROP SCHEMA {quote_ident(schema)} CASCADE"))
        conn.commit()
    engine.dispose()


@pytest.mark.parametrize("layout", ["partitioned"], indirect=True)
@pytest.mark.parametrize("how", ["migrate", "printed-sql"])
def test_a_partitioned_schema_downgraded_below_0006_migrates_up_again(pg_dsn, schema, layout, how):
    """``migrate --downgrade 0005`` (or lower, not base) of a partitioned schema drops the partition
    functions but keeps the partitions (they hold the finished jobs); 0006's upgrade then made each
    final state's catch-alls again: `maintd migrate` (and the script `--sql` prints) failed with
    'relation "jobs_completed_min" already exists', and the schema could never reach head again.
    A state whose partitions are there keeps them; the jobs in them stay."""
    from .conftest import migrate_layout

    engine = make_engine(pg_dsn, application_name="t", pooled=False)
    try:
        with engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {quote_ident(schema)}.jobs (kind, state, finalized_at) "
                              "VALUES ('k', 'completed', now() - interval '1 minute')"))
        with engine.connect() as conn:
            assert migrate.downgrade(conn, schema, "0005")[1] == "0005"
            if how == "migrate":
                assert migrate.upgrade(conn, schema, layout=migrate_layout(layout)) == ("0005", migrate.head_revision())
            else:  # as a DBA applies `maintd migrate --sql`
                script = migrate.offline_sql(schema, start="0005", layout=migrate_layout(layout))
                conn.connection.driver_connection.execute(script)
                conn.connection.driver_connection.commit()
            assert migrate.current_revision(conn, schema) == migrate.head_revision()
            assert conn.execute(text(f"SELECT count(*) FROM {quote_ident(schema)}.jobs_completed")).scalar() == 1
            parts = conn.execute(text(f"SELECT count(*) FROM {quote_ident(schema)}.job_partitions('completed')")).scalar()
            assert parts >= 2 + 2  # the two catch-alls and the steps made ahead
    finally:
        engine.dispose()


@pytest.mark.parametrize("layout", ["plain", "partitioned"], indirect=True)
def test_migrate_sql_prints_what_migrate_does_on_the_table_as_it_is(pg_dsn, schema, layout, tmp_path, capsys):
    """`migrate --sql` read the schema's revision from the database but took the layout from the
    config, while `migrate` asks the catalog (a config's layout only shapes a new jobs table): a
    plain table at 0003 with `layout = "partitioned"` set ahead of a conversion got a script
    without 0004's and 0005's index builds and with partitions for a table that has none (psql:
    'relation "S.jobs_completed" does not exist'); a partitioned one configured plain (the
    default) got index builds PostgreSQL refuses on it. The script is now the table's, and runs."""
    import subprocess

    from maintd.cli import main

    from .test_readme_sql import psql_with_bind

    engine = make_engine(pg_dsn, application_name="t", pooled=False)
    with engine.connect() as conn:
        migrate.downgrade(conn, schema, "0003")
    engine.dispose()
    other = "plain" if layout == "partitioned" else "partitioned"
    cfg = tmp_path / "maintd.toml"
    cfg.write_text(f'database_url = "{pg_dsn}"\nschema = "{schema}"\nlayout = "{other}"\n')
    assert main(["--config", str(cfg), "migrate", "--sql"]) == 0
    script = capsys.readouterr().out
    assert ("CREATE INDEX CONCURRENTLY" in script) == (layout == "plain"), script
    res = subprocess.run([psql_with_bind(), "-X", "-q", "-v", "ON_ERROR_STOP=1", pg_dsn], input=script,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute(f'SELECT version_num FROM "{schema}".alembic_version').fetchone() == (migrate.head_revision(),)
        kinds = {r[0] for r in conn.execute(
            "SELECT c.relkind FROM pg_class c WHERE c.relnamespace = to_regnamespace(%s) "
            "AND c.relname LIKE 'jobs\\_%%\\_min'", (schema,))}
        assert kinds == ({"r"} if layout == "partitioned" else set())
        indexes = {r[0] for r in conn.execute(
            "SELECT indexname FROM pg_indexes WHERE schemaname = %s", (schema,))}
        assert {"jobs_finalized_queue_idx", "jobs_exhausted_idx"} <= indexes
