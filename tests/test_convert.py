"""``maintd migrate --convert partitioned`` (SPEC 8.1, issue 30): a live plain table converted
while workers enqueue, claim and complete throughout; interrupted and resumed; by the CLI."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta

import psycopg
import pytest
from sqlalchemy import text

from maintd import convert, grants, migrate
from maintd.db import make_engine
from maintd.jobs import JobQueue
from maintd.queries import convert as q_convert
from maintd.queries import sql

from .test_grants import apply, cli, login_role, role_dsn, write_config

LAYOUT = migrate.Layout("partitioned", timedelta(hours=1), 2)


def seed(engine, schema: str, final: int, live: int) -> None:
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, attempt, finalized_at) SELECT 'old', "
                         "CAST((ARRAY['completed', 'cancelled', 'discarded'])[1 + g % 3] AS {schema}.job_state), 1, "
                         "now() - g * interval '1 second' FROM generate_series(1, :n) g", schema), {"n": final})
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue) SELECT 'live', 'q' FROM generate_series(1, :n)",
                         schema), {"n": live})
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, unique_key) VALUES ('u', 'held')", schema))


def moved_is_none(call):
    """What the README tells workers: SQLSTATE 40001 (partitioned layout: a row moved to another
    partition meanwhile, e.g. claimed and completed by another worker) means nothing was done."""
    try:
        return call()
    except Exception as exc:
        if getattr(getattr(exc, "orig", None), "sqlstate", None) == "40001":
            return None
        raise


class Workload:
    """An enqueuer and workers claiming and completing (the README's statements, through
    JobQueue), each on its own connection, until stopped; what each did and its slowest call."""

    def __init__(self, engine, schema: str, workers: int = 3):
        self.engine, self.q = engine, JobQueue(schema)
        self.stop = threading.Event()
        self.enqueued: list[int] = []
        self.completed: list[int] = []
        self.errors: list[BaseException] = []
        self.slowest = 0.0
        self.threads = [threading.Thread(target=self._guard, args=(self._enqueue,))]
        self.threads += [threading.Thread(target=self._guard, args=(self._work,)) for _ in range(workers)]

    def __enter__(self) -> "Workload":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def _timed(self, fn):
        started = time.monotonic()
        with self.engine.begin() as conn:
            out = fn(conn)
        self.slowest = max(self.slowest, time.monotonic() - started)
        return out

    def _guard(self, loop) -> None:
        try:
            loop()
        except BaseException as exc:  # the test reports it
            self.errors.append(exc)

    def _enqueue(self) -> None:
        while not self.stop.is_set():
            self.enqueued.append(self._timed(lambda c: self.q.enqueue(c, "new", queue="q")))
            time.sleep(0.002)

    def _work(self) -> None:
        while not self.stop.is_set():
            jobs = moved_is_none(lambda: self._timed(lambda c: self.q.claim(c, "q", "w", limit=5))) or []
            for job in jobs:
                if moved_is_none(lambda: self._timed(lambda c: self.q.complete(c, job))):
                    self.completed.append(job.id)


def _convert_as_owner(pg_dsn: str, schema: str, say=lambda _: None) -> None:
    """A conversion run to the end on a session of the owner's own (a fresh engine)."""
    owner = make_engine(pg_dsn, application_name="convert", pooled=False)
    try:
        with owner.connect() as conn:
            assert convert.convert(conn, schema, LAYOUT, say=say) == "done"
    finally:
        owner.dispose()


def test_a_live_table_converts_under_load_losing_and_doubling_nothing(engine, pg_dsn, schema):
    seed(engine, schema, final=15000, live=4000)
    with engine.connect() as conn:
        before = set(conn.execute(sql("SELECT id FROM {schema}.jobs", schema)).scalars())
    lines: list[str] = []
    with Workload(engine, schema) as load:
        time.sleep(0.3)
        _convert_as_owner(pg_dsn, schema, say=lines.append)
        time.sleep(0.5)  # workers go on, on the partitioned table
    assert load.errors == []
    with engine.connect() as conn:
        kind = conn.execute(text("SELECT relkind FROM pg_class WHERE oid = to_regclass(:t)"),
                            {"t": f"{schema}.jobs"}).scalar()
        rows = conn.execute(sql("SELECT id, state::text FROM {schema}.jobs", schema)).all()
        leftovers = conn.execute(text("SELECT count(*) FROM pg_class WHERE relnamespace = to_regnamespace(:s) "
                                      "AND relname ~ '(_plain|_conv|jobs_convert)'"), {"s": schema}).scalar()
    ids = [r.id for r in rows]
    assert kind == "p" and leftovers == 0
    assert len(ids) == len(set(ids))  # no id twice
    assert set(ids) == before | set(load.enqueued)  # none lost, none made up
    states = dict(rows)
    assert load.completed and {states[i] for i in load.completed} == {"completed"}
    assert len(load.enqueued) > 100 and len(load.completed) > 100
    held = float(next(ln for ln in lines if "swapped" in ln).split("locked ")[1].split(" ms")[0])
    assert held < 1000 and load.slowest < 5.0, (held, load.slowest)
    order = [ln.split()[0] for ln in lines if re.match(r"(live|final) jobs: ", ln)]
    assert order == sorted(order, key=["live", "final"].index) and order[0] == "live"  # live jobs first
    print(f"swap held {held:.0f} ms; slowest worker call {1000 * load.slowest:.0f} ms; "
          f"{len(load.enqueued)} enqueued, {len(load.completed)} completed during the conversion")


def test_an_interrupted_conversion_resumes_where_it_stopped(engine, pg_dsn, schema):
    seed(engine, schema, final=12000, live=3000)
    q = JobQueue(schema)
    batches = []
    owner = make_engine(pg_dsn, application_name="convert", pooled=False)
    with owner.connect() as conn:
        stop_after = lambda: (batches.append(1), len(batches) > 2)[1]
        assert convert.convert(conn, schema, LAYOUT, say=lambda _: None, stop=stop_after) == "stopped"
    with engine.begin() as conn:  # meanwhile: the plain table is still the one, and the trigger follows
        job = q.claim(conn, "q", "w")[0]
        assert q.complete(conn, job)
        late = q.enqueue(conn, "late", queue="q")
        conn.execute(sql("DELETE FROM {schema}.jobs WHERE id = (SELECT min(id) FROM {schema}.jobs)", schema))
    with engine.connect() as conn:
        expected = dict(conn.execute(sql("SELECT id, state::text FROM {schema}.jobs", schema)).all())
        progress = conn.execute(sql("SELECT phase, cursor FROM {schema}.jobs_convert_progress", schema)).one()
    assert progress.phase in ("live", "final") and progress.cursor > 0
    with owner.connect() as conn:
        lines: list[str] = []
        assert convert.convert(conn, schema, LAYOUT, say=lines.append) == "done"
        assert convert.convert(conn, schema, LAYOUT, say=lines.append) == "already"
    owner.dispose()
    with engine.connect() as conn:
        after = dict(conn.execute(sql("SELECT id, state::text FROM {schema}.jobs", schema)).all())
    assert after == expected and expected[job.id] == "completed" and late in after


def test_a_truncate_during_a_conversion_empties_the_copy_too(engine, pg_dsn, schema):
    """A TRUNCATE fires no row trigger (PostgreSQL's documentation, sql-createtrigger.html: TRUNCATE
    triggers are statement-level only), so the sync trigger never saw one: the rows already copied
    stayed in jobs_conv, and at the swap a queue emptied in an emergency came back and ran again."""
    seed(engine, schema, final=12000, live=3000)
    q = JobQueue(schema)
    batches = []
    owner = make_engine(pg_dsn, application_name="convert", pooled=False)
    try:
        with owner.connect() as conn:
            stop_after = lambda: (batches.append(1), len(batches) > 2)[1]
            assert convert.convert(conn, schema, LAYOUT, say=lambda _: None, stop=stop_after) == "stopped"
        with owner.begin() as conn:
            assert conn.execute(sql("SELECT count(*) FROM {schema}.jobs_conv", schema)).scalar() > 0
            conn.execute(sql("TRUNCATE {schema}.jobs", schema))
        with engine.begin() as conn:
            after_it = q.enqueue(conn, "after-the-truncate", queue="q")
        with owner.connect() as conn:
            assert convert.convert(conn, schema, LAYOUT, say=lambda _: None) == "done"
    finally:
        owner.dispose()
    assert list(_states(engine, schema)) == [after_it]


# The sync function as the release before the TRUNCATE trigger made it (row operations only).
EARLIER_SYNC_FUNCTION = """
CREATE OR REPLACE FUNCTION {schema}.jobs_convert_sync() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  IF TG_OP <> 'INSERT' THEN
    IF OLD.finalized_at IS NULL THEN
      DELETE FROM {schema}.jobs_conv AS c WHERE c.id = OLD.id AND c.state = OLD.state;
    ELSE
      DELETE FROM {schema}.jobs_conv AS c
       WHERE c.id = OLD.id AND c.state = OLD.state AND c.finalized_at = OLD.finalized_at;
    END IF;
  END IF;
  IF TG_OP <> 'DELETE' THEN
    INSERT INTO {schema}.jobs_conv SELECT NEW.*;
  END IF;
  INSERT INTO {schema}.jobs_convert_seen (id) VALUES (CASE WHEN TG_OP = 'DELETE' THEN OLD.id ELSE NEW.id END)
  ON CONFLICT DO NOTHING;
  RETURN NULL;
END
$fn$
"""


def _convert_until_stopped(owner, schema: str) -> None:
    """A conversion run that copies two batches and is stopped (resumable)."""
    batches = []
    with owner.connect() as conn:
        stop_after = lambda: (batches.append(1), len(batches) > 2)[1]
        assert convert.convert(conn, schema, LAYOUT, say=lambda _: None, stop=stop_after) == "stopped"


def test_a_conversion_begun_before_an_upgrade_follows_a_truncate_once_resumed(engine, pg_dsn, schema):
    """A conversion is resumable across runs (hours on a large table), so one begun by the release
    before the TRUNCATE trigger may be resumed by this one: its jobs_convert_sync() has row code
    only, and the resumed run made the statement-level TRUNCATE trigger on that old function. A
    TRUNCATE of jobs then ran the row code with OLD and NEW null (PostgreSQL's documentation,
    plpgsql-trigger.html: NEW and OLD are "null in statement-level triggers") and failed putting
    an all-null row into jobs_conv: the emergency TRUNCATE refused while the conversion lasted."""
    from maintd.queries import render

    seed(engine, schema, final=12000, live=3000)
    owner = make_engine(pg_dsn, application_name="convert", pooled=False)
    try:
        _convert_until_stopped(owner, schema)  # begun by the earlier release:
        with owner.begin() as conn:  # its function, and no TRUNCATE trigger
            conn.execute(sql("DROP TRIGGER jobs_convert_truncate ON {schema}.jobs", schema))
            conn.connection.dbapi_connection.execute(render(EARLIER_SYNC_FUNCTION, schema))
        _convert_until_stopped(owner, schema)  # resumed by this release
        with owner.begin() as conn:
            assert conn.execute(sql("SELECT count(*) FROM {schema}.jobs_conv", schema)).scalar() > 0
            conn.execute(sql("TRUNCATE {schema}.jobs", schema))
        with engine.begin() as conn:
            after_it = JobQueue(schema).enqueue(conn, "after-the-truncate", queue="q")
        with owner.connect() as conn:
            assert convert.convert(conn, schema, LAYOUT, say=lambda _: None) == "done"
    finally:
        owner.dispose()
    assert list(_states(engine, schema)) == [after_it]


def test_a_conversion_cut_off_after_its_swap_is_cleaned_up_by_the_next_run(engine, pg_dsn, schema, monkeypatch):
    """The swap commits, then the clean-up runs in a transaction of its own: a run killed between
    the two left jobs_plain (a whole copy of the table), the progress tables and the trigger
    function behind, and the next run said "already" and left them for good (SPEC 8.1: a
    conversion can be interrupted and resumed)."""
    seed(engine, schema, final=50, live=10)
    count = "SELECT count(*) FROM {schema}.jobs"
    with engine.connect() as conn:
        before = conn.execute(sql(count, schema)).scalar()
    owner = make_engine(pg_dsn, application_name="convert", pooled=False)

    def killed(conn, schema):
        raise KeyboardInterrupt

    try:
        with owner.connect() as conn:
            with monkeypatch.context() as m:
                m.setattr(convert, "_clean_up", killed)
                with pytest.raises(KeyboardInterrupt):
                    convert.convert(conn, schema, LAYOUT, say=lambda _: None)
        leftovers = "SELECT to_regclass(:t) IS NOT NULL"
        with engine.connect() as conn:
            assert conn.execute(text(leftovers), {"t": f'"{schema}".jobs_plain'}).scalar()
        with owner.connect() as conn:
            lines: list[str] = []
            assert convert.convert(conn, schema, LAYOUT, say=lines.append) == "already"
            assert "dropped what an interrupted conversion left" in lines[-2]
            assert "analyzed jobs and its partitions" in lines[-1]  # the interrupted run did not
            assert convert.convert(conn, schema, LAYOUT, say=lines.append) == "already"
            assert lines[-1].endswith("nothing to do")
        with engine.connect() as conn:
            for name in ("jobs_plain", "jobs_convert_seen", "jobs_convert_progress"):
                assert not conn.execute(text(leftovers), {"t": f'"{schema}".{name}'}).scalar(), name
            assert not conn.execute(text("SELECT to_regprocedure(:f) IS NOT NULL"),
                                    {"f": f'"{schema}".jobs_convert_sync()'}).scalar()
            assert conn.execute(sql(count, schema)).scalar() == before
    finally:
        owner.dispose()


def schema_objects(pg_dsn: str, schema: str) -> tuple:
    """The schema's tables, indexes and functions, and how many jobs it holds."""
    with psycopg.connect(pg_dsn) as conn:
        relations = conn.execute("SELECT relname, relkind::text FROM pg_class WHERE relnamespace = to_regnamespace(%s)"
                                 " AND relkind IN ('r', 'p', 'i', 'I') ORDER BY 1", (schema,)).fetchall()
        functions = conn.execute("SELECT proname FROM pg_proc WHERE pronamespace = to_regnamespace(%s) ORDER BY 1",
                                 (schema,)).fetchall()
        jobs = conn.execute(f'SELECT count(*) FROM "{schema}".jobs').fetchone()[0]
    return relations, functions, jobs


def test_the_clean_up_of_a_cut_off_conversion_is_refused_to_a_non_owner_before_it_acts(pg_dsn, tmp_path, monkeypatch):
    """A conversion cut off after its swap leaves its copies for the next run to drop; that
    clean-up ran before the owner check, so a role that does not own the tables (with CREATE on
    the schema: only ownership is missing) got as far as its first DROP and said only "must be
    owner of table jobs_plain". It is refused first, naming the owner role, and nothing is
    changed; the owner's run then drops the leftovers."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with login_role(pg_dsn, "maintd_owner") as owner, login_role(pg_dsn) as other:
        apply(pg_dsn, f'CREATE SCHEMA "{schema}" AUTHORIZATION "{owner}"')
        owner_engine = make_engine(role_dsn(pg_dsn, owner), application_name="convert", pooled=False)

        def killed(conn, schema):
            raise KeyboardInterrupt

        try:
            with owner_engine.connect() as conn:
                migrate.upgrade(conn, schema)
            seed(owner_engine, schema, final=50, live=10)
            with owner_engine.connect() as conn, monkeypatch.context() as m:
                m.setattr(convert, "_clean_up", killed)
                with pytest.raises(KeyboardInterrupt):  # swapped, then cut off before its clean-up
                    convert.convert(conn, schema, LAYOUT, say=lambda _: None)
        finally:
            owner_engine.dispose()
        apply(pg_dsn, grants.render([schema], other) + f'\nGRANT CREATE ON SCHEMA "{schema}" TO "{other}";')
        before = schema_objects(pg_dsn, schema)
        assert ("jobs", "p") in before[0] and ("jobs_plain", "r") in before[0]  # cut off after the swap
        cfg = write_config(tmp_path, schema)
        convert_as = lambda role: cli("--config", cfg, "migrate", "--convert", "partitioned",
                                      env={"MAINTD_DATABASE_URL": role_dsn(pg_dsn, role)})
        res = convert_as(other)
        assert res.returncode == 1 and res.stdout == "", res.stdout
        [line] = res.stderr.strip().splitlines()
        assert f"role '{other}' does not own the tables of schema '{schema}'" in line, line
        assert f"owner role ('{owner}')" in line, line
        assert schema_objects(pg_dsn, schema) == before  # refused before it changed anything
        res = convert_as(owner)
        assert res.returncode == 0, res.stderr
        assert "dropped what an interrupted conversion left" in res.stdout, res.stdout
        relations, functions, jobs = schema_objects(pg_dsn, schema)
        assert not [r for r in relations if r[0].startswith(("jobs_plain", "jobs_convert"))], relations
        assert ("jobs_convert_sync",) not in functions and jobs == before[2] == 61


def test_a_conversion_run_by_the_runtime_role_names_the_command_to_run_as_the_owner(pg_dsn, tmp_path):
    """Walking the README, `maintd migrate --convert partitioned` run with the daemon's URL (the
    runtime role, given exactly what `maintd grants` prints) said "lacks CREATE on schema ...
    (needed to create maintd's tables): run `maintd migrate` as the owner role": run as told, a
    bare `maintd migrate` converts nothing ("nothing to do"). The error names the command that
    was run, with the privilege and the owner role, and nothing is made."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with login_role(pg_dsn, "maintd_owner") as owner, login_role(pg_dsn) as runtime:
        apply(pg_dsn, f'CREATE SCHEMA "{schema}" AUTHORIZATION "{owner}"')
        owner_engine = make_engine(role_dsn(pg_dsn, owner), application_name="convert", pooled=False)
        try:
            with owner_engine.connect() as conn:
                migrate.upgrade(conn, schema)
            seed(owner_engine, schema, final=20, live=5)
        finally:
            owner_engine.dispose()
        apply(pg_dsn, grants.render([schema], runtime))
        before = schema_objects(pg_dsn, schema)
        cfg = write_config(tmp_path, schema)
        for to in ("partitioned", "plain"):
            res = cli("--config", cfg, "migrate", "--convert", to, env={"MAINTD_DATABASE_URL": role_dsn(pg_dsn, runtime)})
            if to == "plain":  # nothing under way: nothing to give up, whoever asks
                assert res.returncode == 0 and "no conversion under way" in res.stdout, res.stdout + res.stderr
                continue
            assert res.returncode == 1, res.stdout + res.stderr
            [line] = res.stderr.strip().splitlines()
            assert f"role '{runtime}' lacks CREATE on schema '{schema}'" in line, line
            assert f"run `maintd migrate --convert partitioned` as the owner role ('{owner}')" in line, line
        assert schema_objects(pg_dsn, schema) == before


def test_the_cli_converts_and_the_admin_functions_follow(engine, pg_dsn, schema, tmp_path):
    seed(engine, schema, final=100, live=50)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'schema = "{schema}"\n[partitions]\npremake = 2\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAINTD_")}
    res = subprocess.run([sys.executable, "-m", "maintd", "--config", str(cfg), "migrate", "--convert", "partitioned"],
                         capture_output=True, text=True, timeout=120, env={**env, "MAINTD_DATABASE_URL": pg_dsn})
    assert res.returncode == 0, res.stderr
    assert "live jobs: 51 of about 51 read; 51 copied in all" in res.stdout and "swapped" in res.stdout
    with engine.begin() as conn:
        some = conn.execute(sql("SELECT id FROM {schema}.jobs WHERE state = 'available' LIMIT 1", schema)).scalar()
        changed = conn.execute(sql("SELECT id, state::text FROM {schema}.cancel_jobs(ARRAY[:id])", schema),
                               {"id": some}).all()
        home = conn.execute(sql("SELECT tableoid::regclass::text FROM {schema}.jobs WHERE id = :id", schema),
                            {"id": some}).scalar()
    assert changed == [(some, "cancelled")] and home.startswith(f"{schema}.jobs_cancelled_")
    again = subprocess.run([sys.executable, "-m", "maintd", "--config", str(cfg), "migrate", "--convert", "partitioned"],
                           capture_output=True, text=True, timeout=120, env={**env, "MAINTD_DATABASE_URL": pg_dsn})
    assert again.returncode == 0 and "partitioned already" in again.stdout


def test_migrate_under_a_partitioned_config_on_a_plain_table_says_to_convert_it(engine, pg_dsn, schema, tmp_path):
    """A newcomer sets `layout = "partitioned"` on a schema `maintd migrate` had made plain and runs
    `maintd migrate` again: it said only "nothing to do", and the table stayed plain with nothing
    to tell why (it builds that layout for a new schema only). It now names the conversion, and
    still exits 0 (the systemd unit runs it at every start); a plain config gets no such line."""
    env = {"MAINTD_DATABASE_URL": pg_dsn}
    for layout in ("plain", "partitioned"):
        res = cli("--config", write_config(tmp_path, schema, top=f'layout = "{layout}"\n'), "migrate", env=env)
        assert res.returncode == 0, res.stderr
        assert "nothing to do" in res.stdout, res.stdout
        said = "`maintd migrate --convert partitioned`" in res.stdout
        assert said == (layout == "partitioned"), res.stdout
    with engine.connect() as conn:
        assert not conn.execute(text("SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass(:t)"),
                                {"t": f'"{schema}".jobs'}).scalar()


def test_column_grants_and_row_level_security_are_refused_not_dropped(engine, pg_dsn, schema):
    """The swap copies the table's grants and nothing finer: a column-level grant (a reporting
    role's SELECT on some columns) was gone on the partitioned table, and row-level security
    enabled without a policy (every row hidden from roles that do not own the table) was turned
    off by the swap, showing every job to them. Both are named before anything is made; once
    the operator has removed them, the conversion goes through."""
    seed(engine, schema, final=20, live=10)
    with engine.begin() as conn:
        ids = conn.execute(sql("SELECT array_agg(id ORDER BY id) FROM {schema}.jobs", schema)).scalar()
        conn.execute(text(f"GRANT SELECT (kind, state) ON {schema}.jobs TO PUBLIC"))
        conn.execute(text(f"ALTER TABLE {schema}.jobs ENABLE ROW LEVEL SECURITY"))
    owner = make_engine(pg_dsn, application_name="convert", pooled=False)
    try:
        with owner.connect() as conn, pytest.raises(convert.ConvertError) as refused:
            convert.convert(conn, schema, LAYOUT, say=lambda _: None)
        for named in ("column grant on kind", "column grant on state", "row level security enabled"):
            assert named in str(refused.value), refused.value
        with engine.connect() as conn:
            assert conn.execute(text("SELECT to_regclass(:t)"), {"t": f"{schema}.jobs_conv"}).scalar() is None
        with engine.begin() as conn:
            conn.execute(text(f"REVOKE SELECT (kind, state) ON {schema}.jobs FROM PUBLIC"))
            conn.execute(text(f"ALTER TABLE {schema}.jobs DISABLE ROW LEVEL SECURITY"))
        with owner.connect() as conn:
            assert convert.convert(conn, schema, LAYOUT, say=lambda _: None) == "done"
        with engine.connect() as conn:
            assert conn.execute(sql("SELECT array_agg(id ORDER BY id) FROM {schema}.jobs", schema)).scalar() == ids
    finally:
        owner.dispose()


def test_what_the_swap_cannot_carry_is_refused_before_anything_is_made_and_at_the_swap(engine, pg_dsn, schema):
    """A view, a foreign key to jobs, an index or a trigger of the user's would stay on the plain
    table at the swap: the view went on reading the stale copy, the workers' inserts into a table
    with a foreign key to jobs failed, and the clean-up failed on every run after, leaving the copy
    behind. They are named before anything is made, and again under the swap's lock (one made
    while the rows were copied); the plain table stays in use, and the conversion resumes once
    they are gone. The live partition gets migrate's autovacuum settings."""
    seed(engine, schema, final=300, live=100)
    user_objects = [
        f"CREATE VIEW {schema}.job_report AS SELECT state, count(*) FROM {schema}.jobs GROUP BY state",
        f"CREATE TABLE {schema}.results (job_id bigint REFERENCES {schema}.jobs (id) ON DELETE CASCADE)",
        f"CREATE INDEX jobs_kind_idx ON {schema}.jobs (kind)",
        f"CREATE FUNCTION {schema}.audit() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RETURN NEW; END$$",
        f"CREATE TRIGGER audit AFTER UPDATE ON {schema}.jobs FOR EACH ROW EXECUTE FUNCTION {schema}.audit()",
    ]
    with engine.begin() as conn:
        for statement in user_objects:
            conn.execute(text(statement))
    owner = make_engine(pg_dsn, application_name="convert", pooled=False)
    try:
        with owner.connect() as conn, pytest.raises(convert.ConvertError) as refused:
            convert.convert(conn, schema, LAYOUT, say=lambda _: None)
        message = str(refused.value)
        for named in (f"view {schema}.job_report", f"foreign key results_job_id_fkey of {schema}.results",
                      "index jobs_kind_idx", "trigger audit"):
            assert named in message, message
        with engine.connect() as conn:
            assert conn.execute(text("SELECT to_regclass(:t)"), {"t": f"{schema}.jobs_conv"}).scalar() is None
        with engine.begin() as conn:
            for name in ("VIEW {schema}.job_report", "TABLE {schema}.results", "INDEX {schema}.jobs_kind_idx",
                         "TRIGGER audit ON {schema}.jobs"):
                conn.execute(text(f"DROP {name.format(schema=schema)}"))
        batches = []
        with owner.connect() as conn:  # a view made while the rows are copied: refused at the swap
            stop_after = lambda: (batches.append(1), len(batches) > 1)[1]
            assert convert.convert(conn, schema, LAYOUT, say=lambda _: None, stop=stop_after) == "stopped"
        with engine.begin() as conn:
            conn.execute(text(user_objects[0]))
        with owner.connect() as conn, pytest.raises(convert.ConvertError, match="view"):
            convert.convert(conn, schema, LAYOUT, say=lambda _: None)
        with engine.begin() as conn:
            assert conn.execute(sql("SELECT relkind FROM pg_class WHERE oid = '{schema}.jobs'::regclass",
                                    schema)).scalar() == "r"  # still the plain table, in use
            new = JobQueue(schema).enqueue(conn, "meanwhile", queue="q")
            conn.execute(text(f"DROP VIEW {schema}.job_report"))
        with owner.connect() as conn:
            assert convert.convert(conn, schema, LAYOUT, say=lambda _: None) == "done"
        with engine.connect() as conn:
            assert conn.execute(sql("SELECT count(*) FROM {schema}.jobs", schema)).scalar() == 402
            assert conn.execute(sql("SELECT kind FROM {schema}.jobs WHERE id = :id", schema), {"id": new}).scalar() \
                == "meanwhile"
            options = conn.execute(sql("SELECT reloptions FROM pg_class WHERE relnamespace = "
                                       "to_regnamespace(:s) AND relname = 'jobs_live'", schema), {"s": schema}).scalar()
        assert sorted(options) == sorted(f"{k}={v}" for k, v in migrate.JOBS_AUTOVACUUM.items())
    finally:
        owner.dispose()


def test_an_unfinished_conversion_can_be_abandoned_and_the_plain_table_is_untouched(engine, pg_dsn, schema, tmp_path):
    """Started and never finished, a conversion's trigger doubled every write of the workers into
    jobs_conv for good, and nothing removed it. `--convert plain` drops the trigger and the copy
    (jobs is untouched), and a conversion can start afresh afterwards; it does not convert a
    partitioned table back."""
    seed(engine, schema, final=3000, live=3000)
    owner = make_engine(pg_dsn, application_name="convert", pooled=False)
    try:
        batches = []
        with owner.connect() as conn:
            stop_after = lambda: (batches.append(1), len(batches) > 1)[1]
            assert convert.convert(conn, schema, LAYOUT, say=lambda _: None, stop=stop_after) == "stopped"
        with engine.connect() as conn:
            before = dict(conn.execute(sql("SELECT id, state::text FROM {schema}.jobs", schema)).all())
        cfg = tmp_path / "c.toml"
        cfg.write_text(f'schema = "{schema}"\n')
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("MAINTD_")}, "MAINTD_DATABASE_URL": pg_dsn}

        def cli(to: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "maintd", "--config", str(cfg), "migrate", "--convert", to],
                                  capture_output=True, text=True, timeout=120, env=env)

        res = cli("plain")
        assert res.returncode == 0 and "unfinished conversion is dropped" in res.stdout, res.stderr
        with engine.begin() as conn:
            left = conn.execute(sql("SELECT relname FROM pg_class WHERE relnamespace = to_regnamespace(:s) "
                                    "AND relname LIKE '%conv%'", schema), {"s": schema}).scalars().all()
            triggers = conn.execute(sql("SELECT count(*) FROM pg_trigger WHERE tgrelid = '{schema}.jobs'::regclass "
                                        "AND NOT tgisinternal", schema)).scalar()
            assert left == [] and triggers == 0
            assert dict(conn.execute(sql("SELECT id, state::text FROM {schema}.jobs", schema)).all()) == before
            JobQueue(schema).enqueue(conn, "after", queue="q")
        again = cli("plain")
        assert again.returncode == 0 and "nothing to do" in again.stdout
        assert cli("partitioned").returncode == 0  # afresh
        back = cli("plain")
        assert back.returncode == 1 and "not supported" in back.stderr
    finally:
        owner.dispose()


def test_a_conversion_interrupted_from_the_terminal_says_so_and_fails(engine, pg_dsn, schema, tmp_path):
    """Ctrl-C in the middle of `maintd migrate --convert partitioned` exited 0, printing nothing:
    a script (or an operator glancing at `$?`) took the table for converted while it was plain,
    the sync trigger doubling every write. Now it says where it stopped and exits 130, as any
    command cut off by Ctrl-C.

    The copy cannot finish before the signal: a final job in the middle is held FOR UPDATE (a
    worker on it) until the command has exited, so the conversion waits at it. (The signal was sent
    once the copy of 300,000 final jobs had said its first batch, and a machine loaded enough to
    starve the test for the rest of the copy saw it swapped.)"""
    seed(engine, schema, final=30_000, live=10)
    with engine.connect() as conn:
        middle = conn.execute(sql("SELECT id FROM {schema}.jobs WHERE kind = 'old' ORDER BY id OFFSET 15000 LIMIT 1",
                                  schema)).scalar()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'schema = "{schema}"\n[partitions]\npremake = 2\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAINTD_")}
    with psycopg.connect(pg_dsn) as worker:
        worker.execute(f'SELECT 1 FROM "{schema}".jobs WHERE id = %s FOR UPDATE', (middle,))
        proc = subprocess.Popen([sys.executable, "-m", "maintd", "--config", str(cfg), "migrate", "--convert",
                                 "partitioned"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**env, "MAINTD_DATABASE_URL": pg_dsn})
        try:
            while f"final jobs: waiting for job {middle}," not in (line := proc.stdout.readline()):
                assert line, proc.stderr.read()
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        worker.rollback()
    with engine.connect() as conn:
        assert not conn.execute(text("SELECT count(*) FROM pg_partitioned_table WHERE partrelid = to_regclass(:t)"),
                                {"t": f"{schema}.jobs"}).scalar()  # still plain: the swap never came
    assert proc.returncode == 130 and "run the same command again" in err, (proc.returncode, out, err)


def _stopped_then_abandon_cut_off(engine, owner, schema: str, monkeypatch, *, drops: int) -> None:
    """60 jobs, a conversion stopped after two batches of 10, then `--convert plain` cut off
    (Ctrl-C) once ``drops`` of its lock-bounded drops have run."""
    seed(engine, schema, final=30, live=30)
    monkeypatch.setattr(convert, "BATCH", 10)
    with owner.connect() as conn:
        batches = []
        stop_after = lambda: (batches.append(1), len(batches) > 2)[1]
        assert convert.convert(conn, schema, LAYOUT, say=lambda _: None, stop=stop_after) == "stopped"
    calls = []
    real = convert._with_lock_timeout

    def cut_off(conn, schema, what, *statements):
        calls.append(what)
        if len(calls) > drops:
            raise KeyboardInterrupt
        return real(conn, schema, what, *statements)

    with owner.connect() as conn, monkeypatch.context() as m:
        m.setattr(convert, "_with_lock_timeout", cut_off)
        with pytest.raises(KeyboardInterrupt):
            convert.abandon(conn, schema, say=lambda _: None)


def _states(engine, schema: str) -> dict[int, str]:
    with engine.connect() as conn:
        return dict(conn.execute(sql("SELECT id, state::text FROM {schema}.jobs", schema)).all())


def test_a_conversion_resumed_after_its_trigger_was_gone_copies_again_what_changed_meanwhile(engine, pg_dsn, schema,
                                                                                             monkeypatch):
    """`--convert plain` drops the sync trigger first, then the copy: cut off between the two (Ctrl-C,
    a lock never free), it left jobs_conv and the seen ids, no longer followed. A conversion run
    again resumed from them: the jobs completed, deleted or changed meanwhile were carried over as
    they had been copied (a deleted job came back, a completed one ran again)."""
    q = JobQueue(schema)
    owner = make_engine(pg_dsn, application_name="convert", pooled=False)
    try:
        _stopped_then_abandon_cut_off(engine, owner, schema, monkeypatch, drops=1)  # the trigger dropped
        with engine.begin() as conn:  # no trigger follows these
            job = q.claim(conn, "q", "w")[0]
            assert q.complete(conn, job)
            gone = conn.execute(sql("DELETE FROM {schema}.jobs WHERE id = (SELECT min(id) FROM {schema}.jobs "
                                    "WHERE state = 'available') RETURNING id", schema)).scalar()
        expected = _states(engine, schema)
        with owner.connect() as conn:
            assert convert.convert(conn, schema, LAYOUT, say=lambda _: None) == "done"
        after = _states(engine, schema)
        assert gone not in after and after[job.id] == "completed"
        assert after == expected
    finally:
        owner.dispose()


def test_a_conversion_after_an_abandon_cut_off_past_the_copy_starts_afresh(engine, pg_dsn, schema, monkeypatch):
    """`--convert plain` cut off after dropping jobs_conv left the seen ids, the progress row and the
    trigger function: the next `--convert partitioned` failed on them ("relation jobs_convert_seen
    already exists") until the abandon was run again."""
    owner = make_engine(pg_dsn, application_name="convert", pooled=False)
    try:
        _stopped_then_abandon_cut_off(engine, owner, schema, monkeypatch, drops=2)  # the trigger and jobs_conv
        expected = _states(engine, schema)
        with owner.connect() as conn:
            assert convert.convert(conn, schema, LAYOUT, say=lambda _: None) == "done"
        assert _states(engine, schema) == expected
    finally:
        owner.dispose()


def test_a_job_row_held_long_by_a_worker_stops_neither_the_workers_nor_a_row_of_the_copy(engine, pg_dsn, schema):
    """A worker that keeps its job's row locked while the job runs: the copy's batch waited for it
    with no bound, holding FOR SHARE on the batch's earlier rows, and the workers completing those
    jobs waited with it (SPEC 8.1: any lock on jobs held at most about 1 s). The batch waits a
    short while, gives its rows back, copies those before the held row and waits for that one
    alone, saying so; no row is skipped."""
    seed(engine, schema, final=300, live=300)
    with engine.connect() as conn:
        live = conn.execute(sql("SELECT id FROM {schema}.jobs WHERE state = 'available' ORDER BY id",
                                schema)).scalars().all()
    early, held = live[10], live[len(live) // 2]
    holder = psycopg.connect(pg_dsn)
    owner = make_engine(pg_dsn, application_name="convert", pooled=False)
    lines: list[str] = []
    out: list = []
    try:
        holder.execute(f'SELECT id FROM "{schema}".jobs WHERE id = %s FOR UPDATE', (held,))

        def run() -> None:
            try:
                with owner.connect() as conn:
                    out.append(convert.convert(conn, schema, LAYOUT, say=lines.append))
            except BaseException as exc:  # the test reports it
                out.append(exc)
        converting = threading.Thread(target=run)
        converting.start()
        # the copy has reached the held row and given the batch's other rows back (a fixed 1.5 s
        # was too short for the preparation on a loaded CI machine); the defect never says so
        deadline = time.monotonic() + 60
        while not any(f"waiting for job {held}" in ln for ln in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        with psycopg.connect(pg_dsn, autocommit=True) as worker:
            worker.execute("SET lock_timeout = '6s'")
            started = time.monotonic()
            try:
                worker.execute(f"UPDATE \"{schema}\".jobs SET state = 'completed', finalized_at = now() "
                               "WHERE id = %s", (early,))
            except psycopg.errors.LockNotAvailable:
                pass
            waited = time.monotonic() - started
        assert waited < 3.0, (waited, lines)
        assert converting.is_alive()  # still waiting for the held row
        assert any(f"waiting for job {held}" in ln for ln in lines), lines
        holder.execute(f"UPDATE \"{schema}\".jobs SET state = 'running' WHERE id = %s", (held,))
        holder.commit()
        converting.join(60)
        assert out == ["done"], (out, lines)
    finally:
        holder.close()
        owner.dispose()
    with engine.connect() as conn:
        rows = dict(conn.execute(sql("SELECT id, state::text FROM {schema}.jobs", schema)).all())
        kind = conn.execute(text("SELECT relkind FROM pg_class WHERE oid = to_regclass(:t)"),
                            {"t": f"{schema}.jobs"}).scalar()
    assert kind == "p" and len(rows) == 601
    assert rows[early] == "completed" and rows[held] == "running"


def test_converting_back_after_a_swap_cut_off_before_its_clean_up_says_what_finishes_it(engine, pg_dsn, schema,
                                                                                         tmp_path, monkeypatch):
    """Swapped, then cut off before the clean-up: jobs_plain (a whole copy of the table) is left.
    `--convert plain` said only that converting back is not supported, and nothing told the
    operator that `--convert partitioned` drops what is left."""
    seed(engine, schema, final=50, live=10)
    owner = make_engine(pg_dsn, application_name="convert", pooled=False)

    def killed(conn, schema):
        raise KeyboardInterrupt

    try:
        with owner.connect() as conn, monkeypatch.context() as m:
            m.setattr(convert, "_clean_up", killed)
            with pytest.raises(KeyboardInterrupt):
                convert.convert(conn, schema, LAYOUT, say=lambda _: None)
    finally:
        owner.dispose()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'schema = "{schema}"\n')
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MAINTD_")}, "MAINTD_DATABASE_URL": pg_dsn}
    back = subprocess.run([sys.executable, "-m", "maintd", "--config", str(cfg), "migrate", "--convert", "plain"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert back.returncode == 1 and "not supported" in back.stderr, back.stderr
    assert "--convert partitioned" in back.stderr and "jobs_plain" in back.stderr, back.stderr


def test_jobs_with_an_id_of_zero_or_below_are_carried_over(engine, pg_dsn, schema):
    """jobs.id is an identity BY DEFAULT: an import may give its own ids, 0 and negative ones
    among them. The copy's cursor started at 0 and read ``id > cursor``, so a job with such an id
    that no worker touched during the conversion was never copied, and the swap dropped it with
    the plain table."""
    seed(engine, schema, final=30, live=10)
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (id, kind, queue) VALUES (0, 'imported', 'q'), "
                         "(-7, 'imported', 'q'), (-9223372036854775808, 'imported', 'q')", schema))
        conn.execute(sql("INSERT INTO {schema}.jobs (id, kind, state, finalized_at) "
                         "VALUES (-3, 'imported', 'completed', now()), "
                         "(9223372036854775807, 'imported', 'completed', now())", schema))
    expected = _states(engine, schema)
    _convert_as_owner(pg_dsn, schema)
    assert _states(engine, schema) == expected


def test_a_conversion_that_never_gets_its_lock_names_the_sessions_holding_jobs(engine, pg_dsn, schema,
                                                                               monkeypatch):
    """A worker left idle in a transaction that touched jobs keeps the conversion from ever locking
    it (for the sync triggers, or the swap). It gave up with "could not lock jobs for the sync
    triggers in 100 tries; run the command again", naming no one: run again, it failed the same
    way, and the operator had to go through pg_locks to find the session to end."""
    seed(engine, schema, final=10, live=10)
    monkeypatch.setattr(convert, "SWAP_TRIES", 3)
    with psycopg.connect(pg_dsn, application_name="stuck-worker-7") as worker:
        worker.execute(f'UPDATE "{schema}".jobs SET priority = 1 WHERE id = (SELECT min(id) FROM "{schema}".jobs)')
        pid = worker.info.backend_pid  # idle in transaction from here on, holding its lock on jobs
        owner = make_engine(pg_dsn, application_name="convert", pooled=False)
        try:
            with owner.connect() as conn, pytest.raises(convert.ConvertError) as failed:
                convert.convert(conn, schema, LAYOUT, say=lambda _: None)
        finally:
            owner.dispose()
        worker.rollback()
    message = str(failed.value)
    assert "could not lock jobs" in message and f"pid {pid}" in message and "stuck-worker-7" in message, message
    assert "idle in transaction" in message, message


def _storage(conn, schema: str, table: str) -> tuple:
    """A table's storage parameters, its TOAST table's, and its comment."""
    return conn.execute(sql("SELECT c.reloptions, t.reloptions, obj_description(c.oid, 'pg_class') FROM pg_class AS c "
                            "LEFT JOIN pg_class AS t ON t.oid = c.reltoastrelid "
                            "WHERE c.oid = to_regclass(:t)", schema), {"t": f'"{schema}".{table}'}).one()


def test_the_plain_tables_storage_parameters_and_comment_are_carried_over(engine, pg_dsn, schema):
    """A queue's table is the one whose autovacuum an operator tunes (the README says how). The
    swap carried its grants, not its storage parameters: the live partition got migrate's
    defaults, so a tuned fillfactor, vacuum cost or scale factor went back to them without a
    word, and the table's comment was dropped with the plain table. PostgreSQL's ALTER TABLE
    documentation: a partitioned table takes no storage parameters, so they go on the partition
    of the live jobs, the one that churns; the comment goes on the new jobs."""
    seed(engine, schema, final=30, live=10)
    with engine.begin() as conn:
        conn.execute(sql("ALTER TABLE {schema}.jobs SET (fillfactor = 70, autovacuum_vacuum_cost_delay = 0, "
                         "autovacuum_vacuum_scale_factor = 0.002, toast.autovacuum_enabled = false)", schema))
        conn.execute(sql("ALTER TABLE {schema}.jobs RESET (autovacuum_analyze_threshold)", schema))
        conn.execute(sql("COMMENT ON TABLE {schema}.jobs IS 'billing''s queue'", schema))
        options, toast, comment = _storage(conn, schema, "jobs")
    _convert_as_owner(pg_dsn, schema)
    with engine.connect() as conn:
        live_options, live_toast, _ = _storage(conn, schema, "jobs_live")
        assert sorted(live_options) == sorted(options)
        assert "autovacuum_vacuum_scale_factor=0.002" in live_options
        assert not any(o.startswith("autovacuum_analyze_threshold=") for o in live_options)
        assert live_toast == toast == ["autovacuum_enabled=false"]
        assert _storage(conn, schema, "jobs")[2] == comment == "billing's queue"


def test_status_says_a_conversion_is_under_way_or_was_interrupted(engine, pg_dsn, schema):
    """While `migrate --convert partitioned` copies (or after it was interrupted, its trigger
    still doubling every write of the workers), `maintd status`, /status and the dashboard said
    only "layout: plain". They now say a conversion is under way, and how to finish it or give it
    up. Read from the catalog alone: the runtime role may not read the progress table."""
    from maintd.status import collect_status, format_status

    seed(engine, schema, final=20, live=5)
    assert "converting" not in collect_status(engine, schema)["layout"]
    owner = make_engine(pg_dsn, application_name="convert", pooled=False)
    try:
        with owner.connect() as conn:
            assert convert.convert(conn, schema, LAYOUT, say=lambda _: None, stop=lambda: True) == "stopped"
        st = collect_status(engine, schema)
        assert st["layout"] == {"layout": "plain", "converting": True}, st["layout"]
        text_ = format_status(st)
        assert "a conversion to partitioned is under way (or was interrupted)" in text_, text_
        assert "--convert partitioned" in text_ and "--convert plain" in text_
        from maintd.config import Settings
        from maintd.dashboard import Dashboard
        from maintd.http import Request

        settings = Settings(database_url=pg_dsn, schema=schema, instance_id="t")
        _, _, body, _ = Dashboard(lambda: settings).index(Request("/", {"refresh": ["0"]}))
        assert 'id="converting"' in body.decode()
        with owner.connect() as conn:
            convert.abandon(conn, schema, say=lambda _: None)
        assert "converting" not in collect_status(engine, schema)["layout"]
    finally:
        owner.dispose()


def test_a_conversion_analyzes_the_new_table_so_status_counts_the_catch_alls(engine, pg_dsn, schema):
    """A conversion left the new table and its partitions never analyzed; autovacuum never
    analyzes a partitioned table itself (PostgreSQL's "Routine Vacuuming": "partitioned tables
    are not processed by autovacuum"), and its partitions' turn came later. Meanwhile the planner
    knew nothing of the copied rows, and `maintd status` showed a retention's finished jobs
    (120,000 here, in the low catch-all) as "~100,001 stray rows", the floor of an estimate. The
    conversion now ends with ANALYZE, which (its documentation) gathers the partitioned table's
    statistics as a whole and each partition's."""
    from maintd.status import collect_status

    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, attempt, finalized_at) SELECT 'old', 'completed', 1, "
                         "timestamptz '2001-01-01' + g * interval '1 second' FROM generate_series(1, 120000) g",
                         schema))
    lines: list[str] = []
    _convert_as_owner(pg_dsn, schema, say=lines.append)
    assert any(re.fullmatch(rf"schema {schema}: analyzed jobs and its partitions in \d+\.\d s", ln) for ln in lines), lines
    with engine.connect() as conn:
        leaves = "FROM pg_partition_tree(to_regclass(:t)) p JOIN pg_class c ON c.oid = p.relid WHERE p.isleaf"
        tree = {"t": f'"{schema}".jobs'}
        assert conn.execute(text(f"SELECT count(*) {leaves}"), tree).scalar() >= 8  # live, 3 states × 2+
        never = conn.execute(text(f"SELECT c.relname {leaves} AND c.reltuples < 0 ORDER BY 1"), tree).scalars().all()
        assert never == [], never  # reltuples -1: never analyzed (nor vacuumed)
        assert conn.execute(text("SELECT count(*) FROM pg_stats WHERE schemaname = :s AND tablename = 'jobs' "
                                 "AND inherited"), {"s": schema}).scalar() > 0  # the table as a whole
    layout = collect_status(engine, schema)["layout"]
    assert layout["stray_rows_estimated"] is True and 110_000 <= layout["stray_rows"] <= 130_000, layout


def test_a_conversion_leaves_the_live_row_counts_the_health_read_shows_true(engine, pg_dsn, schema):
    """Walking the README's conversion on PostgreSQL 15 (2,000 jobs, 500 live), `maintd status`
    then showed `jobs live 4,000`: every copied row counted twice in pg_stat_user_tables'
    n_live_tup, which the health read sums. The conversion's session copies and then analyzes.
    PostgreSQL's "The Cumulative Statistics System" (Viewing Statistics): "Each individual server
    process flushes out accumulated statistics to shared memory just before going idle, but not
    more frequently than once per PGSTAT_MIN_INTERVAL milliseconds"; and ANALYZE subtracts only
    its own transaction's inserts from the count it reports (pgstat_report_analyze in
    src/backend/utils/activity/pgstat_relation.c). So the copy's counts, flushed after ANALYZE
    had set the true count, were added to it. The conversion now asks for the flush first
    (pg_stat_force_next_flush(), PostgreSQL 15+)."""
    seed(engine, schema, final=1500, live=500)
    owner = make_engine(pg_dsn, application_name="convert", pooled=False)
    try:
        with owner.connect() as conn:
            assert convert.convert(conn, schema, LAYOUT) == "done"
            # What the session still holds goes now, before the read (else it went at the
            # session's exit, maybe after the read: 2,001 seen even where ANALYZE was undone).
            conn.execute(text(q_convert.FLUSH_STATS))
            conn.commit()
    finally:
        owner.dispose()
    with engine.connect() as conn:
        live = dict(conn.execute(text(
            "SELECT relname, n_live_tup FROM pg_stat_user_tables WHERE schemaname = :s AND n_live_tup > 0 "
            "AND relname LIKE 'jobs%'"), {"s": schema}).all())
    assert sum(live.values()) == 2001 and live.get("jobs_live") == 501, live  # (seed's unique one: live)


def test_a_daemon_running_under_a_plain_config_says_once_that_a_swap_partitioned_its_table(
        engine, pg_dsn, schema, monkeypatch, maintd_log):
    """The README's last step of a conversion is `layout = "partitioned"` and a reload. The daemon
    checked the layout when it started only: a leader running through the swap said nothing,
    and, the step forgotten, kept no partitions (after `premake` steps every finished job in the
    catch-all) while its log stayed quiet. The leader reads the layout with its job counts
    (every 15 s, in the same statement) and warns once; a reload that leaves `plain` is warned
    of again, and one to `partitioned` ends it."""
    from maintd.config import Settings
    from maintd.metrics import Metrics
    from maintd.probes import CountProbe

    from .test_runner import leading_count_probe

    monkeypatch.setattr(CountProbe, "INTERVAL", 0.0)  # a count at each run, not every 15 s
    seed(engine, schema, final=30, live=10)
    settings = Settings(database_url=pg_dsn, schema=schema, instance_id="t", layout="plain")

    def warned() -> int:
        return sum("keeps no partitions" in line for line in maintd_log)

    with leading_count_probe(settings, engine, Metrics()) as (runner, probe):
        probe.run()
        assert warned() == 0 and runner.gauges.counts is not None  # plain: nothing to say
        _convert_as_owner(pg_dsn, schema)
        probe.run()
        assert warned() == 1, maintd_log
        probe.run()
        assert warned() == 1, "said at every count"
        runner.reload(settings)  # reloaded, still plain
        probe.run()
        assert warned() == 2, maintd_log
        runner.reload(settings.model_copy(update={"layout": "partitioned"}))
        probe.run()
        probe.run()
        assert warned() == 2, maintd_log
