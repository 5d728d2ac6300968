"""The partitioned layout (SPEC 8.1, issue 30): what `migrate` builds, the README's worker SQL on
both layouts, unique keys, rows outside the made ranges (far past and future, 'infinity', a burst
while no leader made partitions), retention by dropping partitions, locks that are never waited
for, fencing.

The partitioner's passes run at the server's own time (a FrozenClock set to it): the partition
functions refuse to drop ranges that are not past by the server's clock. Tests that need
partitions in the past start a state's partitions there (:func:`restart`)."""

from __future__ import annotations

import json
import re
import threading
import time
import zlib
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Iterator

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from maintd import migrate
from maintd.clock import FrozenClock
from maintd.config import CleanerConfig, PartitionsConfig
from maintd.jobs import JobQueue
from maintd.metrics import Metrics
from maintd.queries import sql
from maintd.services.base import NotLeader, PassContext
from maintd.services.cleaner import Cleaner
from maintd.services.partitioner import Partitioner, PartitionerConfig

from .conftest import TEST_PARTITIONS, run_concurrently
from .procs import wait_for

HOUR, MINUTE = timedelta(hours=1), timedelta(minutes=1)
README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture
def layout(request: pytest.FixtureRequest) -> str:
    """This module's schemas are partitioned, but for tests marked ``both_layouts``."""
    return getattr(request, "param", "partitioned")


def server_now(engine) -> datetime:
    with engine.connect() as conn:
        return conn.execute(text("SELECT now()")).scalar()


def partitions(engine, schema: str, state: str = "completed") -> list[tuple]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(
            sql("SELECT * FROM {schema}.job_partitions(:state)", schema), {"state": state})]


def where(engine, schema: str) -> dict[int, str]:
    """Each job's partition."""
    with engine.connect() as conn:
        return dict(conn.execute(sql("SELECT id, tableoid::regclass::text FROM {schema}.jobs", schema)).all())


def restart(engine, schema: str, state: str, at: datetime, step: timedelta = HOUR) -> None:
    """As the schema's owner: the state's partitions dropped, its catch-alls meeting at ``at``."""
    with engine.begin() as conn:
        for name, *_ in conn.execute(sql("SELECT * FROM {schema}.job_partitions(:state)", schema),
                                     {"state": state}).all():
            conn.execute(sql(f"ALTER TABLE {{schema}}.jobs_{state} DETACH PARTITION {{schema}}.{name}", schema))
            conn.execute(sql(f"DROP TABLE {{schema}}.{name}", schema))
        conn.execute(sql("SELECT {schema}.start_partitions(:state, make_interval(secs => :step), :at)", schema),
                     {"state": state, "step": step.total_seconds(), "at": at})


def insert_final(engine, schema: str, state: str, finalized_at, n: int = 1, queue: str = "default") -> list[int]:
    with engine.begin() as conn:
        return [r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, queue, state, finalized_at) SELECT 'k', :queue, "
            "CAST(:state AS {schema}.job_state), CAST(:at AS timestamptz) FROM generate_series(1, :n) "
            "RETURNING id", schema), {"state": state, "at": finalized_at, "n": n, "queue": queue})]


def partitioner(*, premake: int = TEST_PARTITIONS["premake"], step: timedelta = HOUR, **cleaner) -> Partitioner:
    return Partitioner(PartitionerConfig("partitioned", PartitionsConfig(interval=step, premake=premake),
                                         CleanerConfig(**cleaner)))


def run(service, engine, schema, now: datetime | None = None, **kw):
    ctx = PassContext(engine=engine, schema=schema, clock=FrozenClock(now or server_now(engine)),
                      layout="partitioned", **kw)
    return service.run_once(ctx)


def running_job(engine, schema: str):
    """A job enqueued and claimed (running) as a worker does: (its queue, the job)."""
    q = JobQueue(schema)
    with engine.begin() as conn:
        q.enqueue(conn, "k")
    with engine.begin() as conn:
        return q, q.claim(conn, "default", "w1")[0]


def count(engine, schema: str) -> int:
    with engine.connect() as conn:
        return conn.execute(sql("SELECT count(*) FROM {schema}.jobs", schema)).scalar()


# -- what migrate builds --------------------------------------------------------------------------

def test_migrate_builds_jobs_partitioned_by_state(engine, schema):
    with engine.connect() as conn:
        kinds = dict(conn.execute(text(
            "SELECT c.relname, c.relkind FROM pg_class c WHERE c.relnamespace = to_regnamespace(:s) "
            "AND c.relname ~ '^jobs' AND c.relkind IN ('r', 'p')"), {"s": schema}).all())
        bound = conn.execute(text("SELECT pg_get_expr(relpartbound, oid) FROM pg_class "
                                  "WHERE oid = to_regclass(:t)"), {"t": f"{schema}.jobs_live"}).scalar()
        live_indexes = {r[0] for r in conn.execute(text(
            "SELECT indexname FROM pg_indexes WHERE schemaname = :s AND tablename = 'jobs_live'"), {"s": schema})}
        root_pkey = conn.execute(text("SELECT count(*) FROM pg_constraint WHERE conrelid = to_regclass(:t) "
                                      "AND contype = 'p'"), {"t": f"{schema}.jobs"}).scalar()
    assert kinds["jobs"] == "p" and kinds["jobs_live"] == "r"
    assert bound == "FOR VALUES IN ('available', 'scheduled', 'running', 'retryable')"
    for state in ("completed", "cancelled", "discarded"):
        assert kinds[f"jobs_{state}"] == "p"
        parts = partitions(engine, schema, state)
        assert parts[0][0] == f"jobs_{state}_min" and parts[0][1] is None
        assert parts[-1][0] == f"jobs_{state}_max" and parts[-1][2] is None
        assert len(parts) - 2 == TEST_PARTITIONS["premake"] + 1  # the current step and those ahead
        assert parts[-1][1] >= server_now(engine) + TEST_PARTITIONS["premake"] * HOUR
        assert all(a[2] == b[1] for a, b in zip(parts, parts[1:]))  # no gap, no overlap
        assert all(p[2] - p[1] == HOUR for p in parts[1:-1])
    assert {"jobs_live_pkey", "jobs_fetch_idx", "jobs_scheduled_idx", "jobs_running_idx", "jobs_exhausted_idx",
            "jobs_unique_key_idx"} <= live_indexes
    assert root_pkey == 0  # each partition has its own primary key on id


def test_migrate_sql_prints_the_partitioned_ddl():
    layout = migrate.Layout("partitioned", HOUR, 24)
    out = migrate.offline_sql("acme", layout=layout)
    assert "PARTITION BY LIST (state)" in out
    assert "CREATE TABLE \"acme\".jobs_live PARTITION OF \"acme\".jobs FOR VALUES IN" in out
    assert "SECURITY DEFINER" in out and "maintain_partitions('completed'" in out
    assert "CREATE INDEX CONCURRENTLY" not in out
    plain = migrate.offline_sql("acme")
    assert "PARTITION BY" not in plain and "CREATE INDEX CONCURRENTLY" in plain
    assert "SECURITY DEFINER" in plain  # the functions exist in every schema (for --convert)


def test_the_printed_sql_builds_the_partitioned_layout(pg_dsn, engine):
    """What `maintd migrate --sql` prints for a DBA, applied as it is (psql-style, one script)."""
    from .conftest import new_schema_name

    name = new_schema_name()
    script = migrate.offline_sql(name, layout=migrate.Layout("partitioned", HOUR, 2))
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(script)
    try:
        assert [p[0] for p in partitions(engine, name)][0] == "jobs_completed_min"
        assert len(partitions(engine, name)) == 2 + 3
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM " + f'"{name}"' + ".alembic_version")).scalar() == \
                migrate.head_revision()
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{name}" CASCADE')


# -- the README's worker statements, verbatim ------------------------------------------------------

def readme_worker_statements(schema: str) -> list[str]:
    """Every statement of the README's worker SQL block, in order, for ``schema``."""
    text_ = README.read_text()
    block = re.search(r"## The jobs table and the worker contract.*?```sql\n(.*?)```", text_, re.S).group(1)
    code = "\n".join(ln for ln in block.splitlines() if not ln.lstrip().startswith("--"))
    return [c.strip().replace("maintd.", f"{schema}.") for c in code.split(";") if c.strip()]


def psycopg_params(statement: str) -> str:
    return re.sub(r"(?<![:\w]):([a-z_]+)", r"%(\1)s", statement)


@pytest.mark.both_layouts
def test_readme_worker_statements_run_verbatim(pg_dsn, schema, layout):
    """SPEC 8.1 and 8.4: each statement as the README prints it, through psycopg 3 with
    server-side parameters, on both layouts."""
    s = readme_worker_statements(schema)
    assert len(s) == 6, s
    enqueue, claim, heartbeat, complete, fail, cancel = s
    assert enqueue.startswith("INSERT") and "SKIP LOCKED" in claim and "heartbeat_at = now()" in heartbeat
    assert "'completed'" in complete and ":backoff" in fail and "'cancelled'" in cancel
    job = {"kind": "k", "queue": "q", "args": "{}", "priority": 0, "max_attempts": 3, "scheduled_at": None,
           "metadata": "{}"}
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        run_ = lambda stmt, **p: conn.execute(psycopg_params(stmt), p).fetchall()
        first = run_(enqueue, **job, unique_key="only-one")
        assert len(first) == 1
        assert run_(enqueue, **job, unique_key="only-one") == []  # a live job holds the key
        second = run_(enqueue, **job, unique_key=None)[0][0]
        claimed = run_(claim, queue="q", worker="w1", limit=1)
        job_id, attempt = claimed[0][0], claimed[0][4]
        assert run_(heartbeat, id=job_id, worker="w1", attempt=attempt) == [(job_id,)]
        assert run_(complete, id=job_id, worker="w1", attempt=attempt) == [(job_id,)]
        assert run_(complete, id=job_id, worker="w1", attempt=attempt) == []  # not yours any more
        assert len(run_(enqueue, **job, unique_key="only-one")) == 1  # the key is free again
        other = run_(claim, queue="q", worker="w2", limit=5)
        failing = next(r for r in other if r[0] == second)
        assert run_(fail, id=second, worker="w2", attempt=failing[4], discard=False, backoff=1.5,
                    error="boom") == [("retryable",)]
        assert run_(cancel, id=second) == [(second,)]
    if layout == "partitioned":
        with psycopg.connect(pg_dsn) as conn:
            homes = dict(conn.execute(f"SELECT id, tableoid::regclass::text FROM {schema}.jobs").fetchall())
        assert homes[job_id].startswith(f"{schema}.jobs_completed_p")
        assert homes[second].startswith(f"{schema}.jobs_cancelled_")


def test_one_live_job_per_unique_key_under_concurrent_enqueues(engine, schema):
    q = JobQueue(schema)

    def enqueue() -> int | None:
        with engine.begin() as conn:
            return q.enqueue(conn, "k", unique_key="race")

    got = run_concurrently(enqueue, 8)  # none raises (a unique violation is an answer of None)
    assert got.count(None) == 7
    with engine.connect() as conn:
        assert conn.execute(sql("SELECT count(*) FROM {schema}.jobs WHERE unique_key = 'race'", schema)).scalar() == 1


# -- rows outside the made ranges -----------------------------------------------------------------

def test_strays_land_in_the_catch_alls_and_are_counted(engine, schema):
    now = server_now(engine)
    ids = {"ancient": insert_final(engine, schema, "completed", "1990-01-01")[0],
           "minus_inf": insert_final(engine, schema, "completed", "-infinity")[0],
           "plus_inf": insert_final(engine, schema, "discarded", "infinity")[0],
           "future": insert_final(engine, schema, "cancelled", now + timedelta(days=400))[0],
           "now": insert_final(engine, schema, "completed", now)[0]}
    homes = where(engine, schema)
    assert homes[ids["ancient"]] == homes[ids["minus_inf"]] == f"{schema}.jobs_completed_min"
    assert homes[ids["plus_inf"]] == f"{schema}.jobs_discarded_max"
    assert homes[ids["future"]] == f"{schema}.jobs_cancelled_max"
    assert homes[ids["now"]].startswith(f"{schema}.jobs_completed_p")
    metrics = Metrics(target="t")
    service = partitioner(completed_retention=-1, cancelled_retention=-1, discarded_retention=-1)
    result = run(service, engine, schema, now=now)
    assert (result.stray_rows, result.partitions, result.made) == (4, 3 * (TEST_PARTITIONS["premake"] + 1), 0)
    service.observe(metrics, result)
    assert metrics.registry.get_sample_value("maintd_partition_stray_rows", {"target": "t"}) == 4


def test_a_demoted_replica_stops_exporting_its_term_s_stray_rows(configured, engine, schema):
    """maintd_partition_stray_rows is what the leader's last partitioner pass counted. A replica
    that stopped leading kept exporting its last count: after a new leader moved the rows, the
    ex-leader's series still said 1 (an alert on the max over replicas kept firing). A demotion
    puts it back where a replica that never led has it: the known series at 0 (SPEC 7.4)."""
    from maintd.runner import Runner
    from maintd.services.base import NoFence

    insert_final(engine, schema, "completed", "1990-01-01")  # in the low catch-all
    settings = configured(cleaner={"completed_retention": -1})
    metrics = Metrics(target="t")
    runner = Runner(settings, engine, metrics, build=lambda s: {"partitioner": Partitioner(PartitionerConfig.of(s))})
    runner.start()
    try:
        runner.activate(NoFence())
        wait_for(lambda: metrics.registry.get_sample_value("maintd_partition_stray_rows", {"target": "t"}) == 1,
                 30, what="the partitioner's count")
        runner.deactivate()
        assert metrics.registry.get_sample_value("maintd_partition_stray_rows", {"target": "t"}) == 0
    finally:
        runner.shutdown()


def test_a_burst_past_premake_closes_the_catch_all_and_moves_what_lies_beyond(engine, schema):
    """No leader made partitions for ten hours: every completion since then is in the high
    catch-all. The next pass makes it the partition of its range (no row moved), makes the
    partitions ahead, and moves the rows beyond (a clock a month ahead, 'infinity')."""
    now = server_now(engine)
    start = now - 10 * HOUR
    restart(engine, schema, "completed", start)
    burst = []
    for k in range(10):
        burst += insert_final(engine, schema, "completed", now - timedelta(hours=k, minutes=30), n=50)
    beyond = insert_final(engine, schema, "completed", "infinity") + \
        insert_final(engine, schema, "completed", now + timedelta(days=30))
    before = count(engine, schema)
    result = run(partitioner(completed_retention=-1), engine, schema, now=now)
    assert (result.closed, result.moved, result.busy) == (1, 2, [])
    parts = partitions(engine, schema)
    closed = parts[1]
    assert closed[1] == parts[0][2] and closed[1] <= start and closed[2] > now - HOUR
    assert all(a[2] == b[1] for a, b in zip(parts, parts[1:]))
    assert parts[-1][1] >= now + TEST_PARTITIONS["premake"] * HOUR
    homes = where(engine, schema)
    assert {homes[i] for i in burst} == {f"{schema}.{closed[0]}"}
    assert {homes[i] for i in beyond} == {f"{schema}.jobs_completed_max"}
    assert count(engine, schema) == before
    again = run(partitioner(completed_retention=-1), engine, schema, now=now)
    assert again.stray_rows == 2
    # The pass reports what it left, not what it found (it said 502 stray rows and fewer partitions).
    assert (result.stray_rows, result.partitions) == (again.stray_rows, again.partitions)
    # New completions go to the new partitions, not the catch-all.
    fresh = insert_final(engine, schema, "completed", now + HOUR)
    assert where(engine, schema)[fresh[0]].startswith(f"{schema}.jobs_completed_p")


def test_stray_rows_are_counted_exactly_up_to_100000_then_estimated(engine, schema):
    """A conversion leaves a retention's finished jobs in the low catch-all: an exact count read
    them all on every partitioner pass, `maintd status` and dashboard page (ten million: 0.4 s
    each). Up to 100,000 each catch-all is counted; past it, the planner's estimate once analyzed,
    and never less than the count."""
    def strays() -> tuple:
        with engine.connect() as conn:
            return conn.execute(sql("SELECT low_rows, high_rows FROM {schema}.catch_all_rows() "
                                    "WHERE state = 'completed'", schema)).one()

    insert_final(engine, schema, "completed", "2001-01-01", n=5)
    insert_final(engine, schema, "completed", "infinity", n=3)
    assert strays() == (5, 3)
    insert_final(engine, schema, "completed", "2001-01-01", n=150_000)
    assert strays() == (100_001, 3)  # the count stops there; not analyzed yet
    with engine.connect() as conn:
        conn.execute(sql("ANALYZE {schema}.jobs_completed_min", schema))
        conn.commit()
    low, high = strays()
    assert 140_000 <= low <= 160_000 and high == 3


def test_status_marks_a_stray_row_count_past_the_cap_as_an_estimate(engine, schema, settings):
    """Walking the README's conversion (380,000 finished jobs left in the low catch-all, no ANALYZE
    yet: autovacuum off, or not round yet), `maintd status` said "101,001 stray rows" as if
    counted: past 100,000 a catch-all's figure is the planner's estimate, here the floor
    100,001. Status, /status and the dashboard now mark it (`~`, `stray_rows_estimated`); a
    count within the cap stays unmarked."""
    from maintd.dashboard import Dashboard
    from maintd.http import Request
    from maintd.status import collect_status, format_status

    def shown() -> tuple[dict, str, str]:
        st = collect_status(engine, schema)
        _, _, body, _ = Dashboard(lambda: settings).pages()["/"](Request("/", {}))
        line = next(ln for ln in format_status(st).splitlines() if ln.startswith("layout:"))
        stray = re.search(r'id="stray-rows"[^>]*>([^<]*)<', body.decode()).group(1)
        return st["layout"], line, stray

    insert_final(engine, schema, "completed", "2001-01-01", n=5)
    layout, line, stray = shown()
    assert "stray_rows_estimated" not in layout and " 5 stray rows" in line and stray == "5 stray rows", (line, stray)
    insert_final(engine, schema, "completed", "2001-01-01", n=150_000)
    layout, line, stray = shown()
    assert layout["stray_rows"] == 100_001 and layout["stray_rows_estimated"] is True, layout
    assert "~100,001 stray rows" in line and "estimate" in line, line
    assert stray == "~100,001 stray rows", stray


def test_a_wider_step_does_not_keep_the_narrower_partitions_made_before_it(engine, schema):
    """The step raised from an hour to a day (a reload): whether the first partition is past the
    retention was judged as if it were a new step wide, so hour partitions past it were kept up to
    a day longer, their rows with them (the cleaner leaves them to the drops)."""
    now = server_now(engine)
    before = now - 2 * HOUR
    restart(engine, schema, "completed", before - 30 * HOUR)
    run(partitioner(), engine, schema, now=before)  # hour partitions from -32h on
    day = partitioner(step=24 * HOUR)  # completed: 24 h
    assert run(day, engine, schema, now=before).detached >= 6  # those past it then (and days made)
    expired = insert_final(engine, schema, "completed", now - timedelta(hours=25, minutes=30), n=10)
    kept = insert_final(engine, schema, "completed", now - timedelta(hours=20), n=10)
    result = run(day, engine, schema, now=now)  # two hours later: two more hours past it
    assert (result.made, result.emptied, result.deleted["completed"]) == (0, 1, 10)
    left = set(where(engine, schema))
    assert left.isdisjoint(expired) and set(kept) <= left


def test_after_an_outage_longer_than_premake_expired_rows_go_within_a_step(engine, schema):
    """No leader for two days: the high catch-all, closed into one partition of the outage's
    range, held its rows until all of them were past the retention, expired ones up to two days
    past it (README: rows live up to one step past their retention). The cleaner's DELETE takes
    the expired rows of a partition wider than a step, as it does the low catch-all's."""
    now = server_now(engine)
    restart(engine, schema, "completed", now - 48 * HOUR)
    rows = {k: insert_final(engine, schema, "completed", now - timedelta(hours=k, minutes=30), n=5)
            for k in range(47)}
    assert run(partitioner(), engine, schema, now=now).closed == 1
    wide = partitions(engine, schema)[1]
    assert wide[2] - wide[1] > 40 * HOUR  # the outage's range, in one partition
    result = run(Cleaner(CleanerConfig()), engine, schema, now=now)  # completed: 24 h
    left = set(where(engine, schema))
    assert result.deleted["completed"] == 5 * 23  # finalized 24h30m to 46h30m ago
    assert all(set(rows[k]) <= left for k in range(24)) and left.isdisjoint(rows[24] + rows[46])
    assert run(Cleaner(CleanerConfig()), engine, schema, now=now).deleted["completed"] == 0


# -- retention by dropping partitions --------------------------------------------------------------

def test_maintain_partitions_refuses_a_drop_horizon_in_the_future(engine, schema):
    """The daemon's role may call maintain_partitions (SECURITY DEFINER); its guard is that a
    drop horizon is past: one in the future (a caller's bug) would empty the partition jobs are
    being finalized into right now."""
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)
    run(partitioner(completed_retention=-1), engine, schema, now=now)
    recent = insert_final(engine, schema, "completed", now - timedelta(minutes=30), n=5)
    before = partitions(engine, schema)
    call = sql("SELECT * FROM {schema}.maintain_partitions('completed', interval '1 hour', "
               "now() + interval '3 hours', now() + interval '2 hours')", schema)
    with pytest.raises(DBAPIError) as failed, engine.begin() as conn:
        conn.execute(call).all()
    assert failed.value.orig.sqlstate == "22023"
    assert set(recent) <= set(where(engine, schema)) and partitions(engine, schema) == before


def test_partitions_past_retention_are_dropped_and_counted(engine, schema):
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)
    run(partitioner(completed_retention=-1), engine, schema, now=now)  # partitions from -10h on
    old = insert_final(engine, schema, "completed", now - timedelta(hours=9, minutes=30), n=500)
    older = insert_final(engine, schema, "completed", now - timedelta(days=3))  # a stray, expired
    middle = insert_final(engine, schema, "completed", now - timedelta(hours=5, minutes=30), n=300)
    kept = insert_final(engine, schema, "completed", now - timedelta(minutes=30), n=100)
    edge = insert_final(engine, schema, "completed", now - 3 * HOUR + MINUTE)  # its hour is not past yet
    metrics = Metrics(target="t")
    service = partitioner(completed_retention="3h")
    result = run(service, engine, schema, now=now)
    assert result.deleted["completed"] == 801 and not result.estimated  # never analyzed: counted
    assert result.dropped == result.detached >= 7
    service.observe(metrics, result)
    assert metrics.registry.get_sample_value("maintd_jobs_deleted_total", {"target": "t", "state": "completed"}) == 801
    left = set(where(engine, schema))
    assert left.isdisjoint(old + older + middle) and set(kept + edge) <= left
    parts = partitions(engine, schema)
    assert parts[0][0] == "jobs_completed_min" and parts[0][2] == parts[1][1] > now - 4 * HOUR
    assert all(a[2] == b[1] for a, b in zip(parts, parts[1:]))
    with engine.connect() as conn:  # nothing detached is left behind
        assert conn.execute(text("SELECT count(*) FROM pg_class WHERE relnamespace = to_regnamespace(:s) "
                                 "AND relname ~ '^jobs_completed' AND relkind = 'r' AND NOT relispartition"),
                            {"s": schema}).scalar() == 0


def test_a_pass_with_nothing_newly_expired_changes_nothing(engine, schema):
    """The low catch-all moves up with the partitions dropped, not on its own: a later pass with
    no partition newly past retention leaves it (the hardbyte harness run saw it detached and
    replaced, empty, on every pass)."""
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)
    run(partitioner(completed_retention=-1), engine, schema, now=now)
    assert run(partitioner(completed_retention="3h"), engine, schema, now=now).detached >= 7

    def low_oid():
        with engine.connect() as conn:
            return conn.execute(text("SELECT to_regclass(:t)::oid"), {"t": f"{schema}.jobs_completed_min"}).scalar()

    before, parts = low_oid(), partitions(engine, schema)
    again = run(partitioner(completed_retention="3h"), engine, schema, now=now)  # (a later step would make one)
    assert not again.did_something(), again
    assert low_oid() == before and partitions(engine, schema) == parts


def hour_of(at: datetime) -> datetime:
    """The start of ``at``'s hour (UTC): a partition boundary of an hour step."""
    return at.astimezone(timezone.utc).replace(minute=0, second=0, microsecond=0)


def test_a_partition_whose_range_ends_exactly_at_the_retention_horizon_is_dropped_and_counted(engine, schema):
    """SPEC 8.1: a partition goes once its whole range is past the retention. A range [start, end)
    whose end is the horizon itself (now - retention, at a step boundary) is wholly past it: its
    rows are dropped by that pass and counted, the dry run says so, and a row finalized at the
    horizon (the next range's first instant) is kept. The pass has nothing to make (partitions
    are premade a step further than it asks), so only its expiry check calls the function."""
    b = hour_of(server_now(engine))
    restart(engine, schema, "completed", b - 4 * HOUR)
    premake = TEST_PARTITIONS["premake"]
    run(partitioner(completed_retention=-1, premake=premake + 1), engine, schema, now=b)
    edge = insert_final(engine, schema, "completed", b - 3 * HOUR - timedelta(seconds=1), n=4)
    kept = insert_final(engine, schema, "completed", b - 3 * HOUR, n=2)
    service = partitioner(completed_retention="3h", cancelled_retention=-1, discarded_retention=-1, premake=premake)
    dry = run(service, engine, schema, now=b, dry_run=True)
    real = run(service, engine, schema, now=b)
    # emptied: the edge partition; detached: it and the low catch-all below it (moved up)
    assert (real.deleted["completed"], real.emptied, real.detached, real.dropped, real.made) == (4, 1, 2, 2, 0)
    assert (dry.deleted, dry.emptied, dry.detached) == (real.deleted, real.emptied, real.detached)
    left = set(where(engine, schema))
    assert left.isdisjoint(edge) and set(kept) <= left
    parts = partitions(engine, schema)
    assert (parts[0][0], parts[0][2], parts[1][1]) == ("jobs_completed_min", b - 3 * HOUR, b - 3 * HOUR)


def test_a_row_finalized_exactly_where_a_closed_catch_all_s_new_range_ends_moves_on(engine, schema):
    """No leader made partitions for ten hours: the high catch-all holds a burst, up to the last
    step of the range a pass premakes (a clock a little ahead), and rows exactly at that range's
    end (an import with round timestamps). The pass closes the catch-all into the partition of
    its range, up to the step after its latest row before that end: the end itself. The rows at
    the end are beyond it and move on into the new high catch-all, and the pass succeeds (left
    in the closed partition, they broke its re-attach: the pass failed, and every one after it)."""
    b = hour_of(server_now(engine))
    end = b + TEST_PARTITIONS["premake"] * HOUR  # where the pass's premade range ends
    restart(engine, schema, "completed", b - 10 * HOUR)
    burst = insert_final(engine, schema, "completed", b - 5 * HOUR - 30 * MINUTE, n=5) + \
        insert_final(engine, schema, "completed", end - 30 * MINUTE)
    at_end = insert_final(engine, schema, "completed", end, n=2)
    before = count(engine, schema)
    result = run(partitioner(completed_retention=-1), engine, schema, now=b)
    assert (result.closed, result.moved, result.made, result.busy) == (1, 2, 0, [])
    parts = partitions(engine, schema)
    assert [p[1:] for p in parts] == [(None, b - 10 * HOUR), (b - 10 * HOUR, end), (end, None)]
    homes = where(engine, schema)
    assert {homes[i] for i in burst} == {f"{schema}.{parts[1][0]}"}
    assert {homes[i] for i in at_end} == {f"{schema}.jobs_completed_max"}
    assert count(engine, schema) == before


def test_a_table_of_the_operator_s_named_like_a_partition_is_not_dropped_with_the_detached_ones(engine, schema):
    """The drop of detached partitions takes only the tables maintain_partitions marked: an
    operator's own table in the schema whose name starts as a partition's (an archive of old
    jobs, with a comment of its own) keeps its rows through a pass that detaches and drops expired partitions."""
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)
    run(partitioner(completed_retention=-1), engine, schema, now=now)
    with engine.begin() as conn:
        conn.execute(sql("CREATE TABLE {schema}.jobs_completed_archive (id bigint, finalized_at timestamptz)", schema))
        conn.execute(sql("INSERT INTO {schema}.jobs_completed_archive VALUES (1, now() - interval '2 days')", schema))
        conn.execute(sql("COMMENT ON TABLE {schema}.jobs_completed_archive IS 'jobs of 2025, kept'", schema))
    result = run(partitioner(completed_retention="3h"), engine, schema, now=now)
    assert result.detached >= 7 and result.dropped == result.detached
    with engine.connect() as conn:
        assert conn.execute(sql("SELECT count(*) FROM {schema}.jobs_completed_archive", schema)).scalar() == 1


def test_partitions_of_the_smallest_step_a_config_takes_are_made(engine, schema):
    """``partitions.interval`` takes 1m (SPEC 8.1: from 1m up): maintain_partitions, which refuses
    a step under a minute, takes one of exactly a minute and makes its partitions."""
    now = server_now(engine).replace(second=0, microsecond=0)  # a step boundary: five steps ahead, five made
    restart(engine, schema, "completed", now, step=MINUTE)
    result = run(partitioner(completed_retention=-1, step=MINUTE, premake=5), engine, schema, now=now)
    assert result.made == 5 and not result.busy
    proper = partitions(engine, schema)[1:-1]
    assert len(proper) == 5 and all(end - start == MINUTE for _, start, end in proper)


def test_the_longest_per_queue_retention_keeps_partitions_and_the_cleaner_deletes_shorter_ones(engine, schema):
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)
    run(partitioner(completed_retention=-1), engine, schema, now=now)
    short = insert_final(engine, schema, "completed", now - 2 * HOUR, n=5, queue="short")
    long_ = insert_final(engine, schema, "completed", now - 5 * HOUR, n=5, queue="long")
    default = insert_final(engine, schema, "completed", now - 5 * HOUR, n=5)
    retention = {"completed_retention": "4h",
                 "queues": {"short": {"completed_retention": "1h"}, "long": {"completed_retention": "6h"}}}
    result = run(partitioner(**retention), engine, schema, now=now)
    assert result.detached and result.deleted["completed"] == 0  # partitions older than 6h: empty
    cleaner = Cleaner(CleanerConfig(**retention))
    deleted = run(cleaner, engine, schema, now=now)
    # Queues whose retention is shorter than the longest (6h): the batched DELETE.
    assert deleted.deleted["completed"] == 10
    left = set(where(engine, schema))
    assert left.isdisjoint(short + default) and set(long_) <= left


def test_expired_strays_of_the_low_catch_all_go_with_the_cleaner(engine, schema):
    """Old jobs imported into a new partitioned table land in the low catch-all, whose own range
    is not past the retention yet: the cleaner deletes those that are expired (a DELETE in the
    catch-all only), the partitioner drops nothing, and proper partitions are left alone."""
    now = server_now(engine)
    imported = insert_final(engine, schema, "completed", now - timedelta(days=3), n=5)
    recent = insert_final(engine, schema, "completed", now, n=2)
    unexpired_stray = insert_final(engine, schema, "cancelled", now - 5 * HOUR)  # within 24h, kept
    assert run(partitioner(), engine, schema, now=now).detached == 0
    result = run(Cleaner(CleanerConfig()), engine, schema, now=now)
    assert result.deleted["completed"] == 5
    left = set(where(engine, schema))
    assert left.isdisjoint(imported) and set(recent + unexpired_stray) <= left


def test_the_cleaner_deletes_everything_on_a_partitioned_table_of_a_plain_config(engine, schema):
    """A table converted while the config still says plain: the cleaner's batched DELETE works
    on it and drops nothing."""
    now = server_now(engine)
    old = insert_final(engine, schema, "completed", now - 30 * HOUR, n=3)
    ctx = PassContext(engine=engine, schema=schema, clock=FrozenClock(now))  # layout "plain"
    assert Cleaner(CleanerConfig()).run_once(ctx).deleted["completed"] == 3
    assert set(where(engine, schema)).isdisjoint(old)


def test_the_partitioner_on_a_plain_table_advises_a_conversion_only_to_a_partitioned_config(engine, maintd_log):
    """`maintd run-once partitioner` is offered on either layout. On a plain config it has nothing
    to do and says so; before, it warned 'layout = "partitioned" but the jobs table is plain: run
    maintd migrate --convert partitioned' to an operator who had asked for no partitions."""
    from .conftest import new_schema_name

    name = new_schema_name()
    with engine.connect() as conn:
        migrate.upgrade(conn, name)  # plain
    try:
        for layout in ("plain", "partitioned"):
            maintd_log.clear()
            service = Partitioner(PartitionerConfig(layout, PartitionsConfig(), CleanerConfig()))
            ctx = PassContext(engine=engine, schema=name, clock=FrozenClock(server_now(engine)))
            assert service.run_once(ctx).layout == "plain"
            advice = [line for line in maintd_log if "--convert partitioned" in line]
            assert bool(advice) == (layout == "partitioned"), maintd_log
            assert layout == "partitioned" or any("nothing to do" in line for line in maintd_log)
    finally:
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{name}" CASCADE'))


# -- locks: never waited for ----------------------------------------------------------------------

def test_a_held_lock_leaves_the_work_to_the_next_pass_and_nobody_waits(engine, pg_dsn, schema):
    """A session reading a final state's partition holds a lock the change needs: the pass tries
    a few times without ever queueing (a worker completing meanwhile is not held up), reports the
    state busy, and a later pass does it."""
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)  # ten hours of partitions to make
    q, job = running_job(engine, schema)
    reader = psycopg.connect(pg_dsn)
    reader.execute(f"SELECT count(*) FROM {schema}.jobs_completed")  # holds AccessShare until rollback
    latencies: list[float] = []
    done = threading.Event()

    def complete():
        time.sleep(0.1)
        started = time.monotonic()
        with engine.begin() as conn:
            assert q.complete(conn, job)
        latencies.append(time.monotonic() - started)
        done.set()

    worker = threading.Thread(target=complete)
    worker.start()
    started = time.monotonic()
    result = run(partitioner(completed_retention=-1), engine, schema, now=now)
    elapsed = time.monotonic() - started
    worker.join()
    reader.rollback()
    assert result.busy == ["completed"] and result.made == 0
    assert elapsed < 5  # TRIES x RETRY_PAUSE, plus the work
    assert latencies[0] < 1.0  # the completion went through while the pass was retrying
    again = run(partitioner(completed_retention=-1), engine, schema, now=now)
    assert again.busy == [] and again.closed == 1
    reader.close()


def test_maintain_partitions_waits_in_the_lock_queue_at_most_a_second_whatever_it_is_asked(engine, pg_dsn, schema):
    """SPEC 8.1: a short lock_timeout. While it waits for jobs_<state>'s lock, every completion
    arriving queues behind it: maintain_partitions waits at most a second, however long its caller
    (the daemon's role may call it) asks, and says 'busy'."""
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)  # partitions to make: it waits for the lock
    with psycopg.connect(pg_dsn) as reader:
        reader.execute(f"SELECT count(*) FROM {schema}.jobs_completed")  # AccessShare until rollback
        started = time.monotonic()
        with engine.begin() as conn:
            actions = [r[0] for r in conn.execute(sql(
                "SELECT * FROM {schema}.maintain_partitions('completed', interval '1 hour', "
                "now() + interval '2 hours', NULL, 10000)", schema))]
        elapsed = time.monotonic() - started
        reader.rollback()
    assert actions == ["busy"] and 0.9 <= elapsed < 6, (actions, elapsed)  # (10.1 s without the cap)


def test_expired_rows_go_while_a_completion_holds_the_state_table_and_nobody_queues(engine, pg_dsn, schema):
    """Issue 30: the prune never queues workers behind an ACCESS EXCLUSIVE lock. A completion in
    flight (uncommitted: it holds jobs_completed until its commit) does not stop the expired rows
    from going: each expired partition is emptied under a lock on itself alone (TRUNCATE, no dead
    tuples), counted, and the detach of the empty tables waits for a pass that finds jobs_completed
    free, without ever waiting for it in the lock queue (nothing is to be made here)."""
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)
    run(partitioner(completed_retention=-1), engine, schema, now=now)
    old = insert_final(engine, schema, "completed", now - timedelta(hours=9, minutes=30), n=400)
    kept = insert_final(engine, schema, "completed", now - timedelta(minutes=30), n=10)
    with engine.begin() as conn:
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    q, job = running_job(engine, schema)
    home = where(engine, schema)[old[0]]
    worker = engine.connect()  # a completion in flight (the README's), holding jobs_completed
    try:
        assert q.complete(worker, job)
        before = partitions(engine, schema)
        started = time.monotonic()
        result = run(partitioner(completed_retention="3h"), engine, schema, now=now)
        elapsed = time.monotonic() - started
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            # Waits on this schema's relations only: the server is shared with the other xdist
            # worker, whose tests hold sessions waiting for locks on purpose.
            locked_out = conn.execute("SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                                      "WHERE NOT l.granted AND c.relnamespace = to_regnamespace(%s)",
                                      (schema,)).fetchone()[0]
            size = conn.execute("SELECT pg_relation_size(%s)", (home,)).fetchone()[0]
        assert result.busy == ["completed"] and result.emptied == 1 and result.detached == 0
        assert result.waited_seconds == 0  # nothing to make: one try a pass, no retries for empty tables
        assert result.deleted["completed"] == 400 and not result.estimated  # counted (under EXACT_UP_TO), analyzed or not
        assert set(where(engine, schema)).isdisjoint(old) and set(kept) <= set(where(engine, schema))
        assert partitions(engine, schema) == before  # still attached, empty
        assert locked_out == 0 and elapsed < 5 and size == 0  # gone from the disk: no dead tuples
        worker.commit()  # the completion went through; the next pass detaches and drops the empty tables
    finally:
        worker.close()
    again = run(partitioner(completed_retention="3h"), engine, schema, now=now)
    assert again.busy == [] and again.emptied == 0 and again.detached == again.dropped >= 7
    assert again.deleted["completed"] == 0  # counted once, when emptied
    assert job.id in set(where(engine, schema)) and set(kept) <= set(where(engine, schema))


def test_the_emptying_commits_without_a_lock_on_the_state_table(engine, schema):
    """Migration 0009: PostgreSQL unlinks a truncated table's old files (and drops its buffers) at
    commit, before it releases the transaction's locks, in time that grows with the files. So the
    call that empties expired partitions returns before it locks jobs_completed: while its
    transaction is open it holds locks on the emptied partitions alone, and the next call, in a
    transaction of its own, detaches them (the 0008 body did both in one, completions waiting)."""
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)
    run(partitioner(completed_retention=-1), engine, schema, now=now)
    old = insert_final(engine, schema, "completed", now - timedelta(hours=9, minutes=30), n=50)
    call = sql("SELECT action, partition_name FROM {schema}.maintain_partitions('completed', interval '1 hour', "
               "now() + interval '3 hours', now() - interval '3 hours')", schema)
    held = sql("SELECT c.relname, l.mode FROM pg_locks AS l JOIN pg_class AS c ON c.oid = l.relation "
               "WHERE l.pid = pg_backend_pid() AND c.relnamespace = to_regnamespace(:schema) "
               "AND l.mode = 'AccessExclusiveLock'", schema)
    home = where(engine, schema)[old[0]].split(".", 1)[1]
    with engine.begin() as conn:
        first = conn.execute(call).all()
        locked = {r.relname for r in conn.execute(held, {"schema": schema})}
    assert [r.action for r in first] == ["emptied"] and first[0].partition_name == home
    assert home in locked and "jobs_completed" not in locked and "jobs" not in locked
    assert set(where(engine, schema)).isdisjoint(old)
    with engine.begin() as conn:
        second = conn.execute(call).all()
    assert "emptied" not in {r.action for r in second}
    assert home in {r.partition_name for r in second if r.action == "detached"}


def test_an_expired_partition_being_read_is_neither_emptied_nor_detached(engine, pg_dsn, schema):
    """A session reading one expired partition (a report, a dashboard count) holds it: it is
    left, rows and all, to the next pass (detaching it unemptied would drop rows uncounted); the
    other expired partitions are emptied."""
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)
    run(partitioner(completed_retention=-1), engine, schema, now=now)
    read = insert_final(engine, schema, "completed", now - timedelta(hours=9, minutes=30), n=3)
    other = insert_final(engine, schema, "completed", now - timedelta(hours=7, minutes=30), n=4)
    home = where(engine, schema)[read[0]].split(".", 1)[1]
    reader = psycopg.connect(pg_dsn)
    try:
        reader.execute(f"SELECT count(*) FROM {schema}.{home}")  # holds AccessShare until rollback
        result = run(partitioner(completed_retention="3h"), engine, schema, now=now)
        assert result.deleted["completed"] == 4 and result.detached == 0
        assert set(read) <= set(where(engine, schema)) and set(where(engine, schema)).isdisjoint(other)
        reader.rollback()
    finally:
        reader.close()
    again = run(partitioner(completed_retention="3h"), engine, schema, now=now)
    assert again.deleted["completed"] == 3 and again.detached >= 7 and again.busy == []
    assert set(where(engine, schema)).isdisjoint(read)


def test_an_expired_partition_held_by_a_long_reader_is_reported_busy_when_nothing_else_is_due(engine, pg_dsn, schema):
    """A reader holding the only expired partition, with no partition to make: maintain_partitions
    returned no row, and the pass said nothing (no ``busy`` in its summary, log or status) while
    the partition stayed, pass after pass. It says busy, as when jobs_<state>'s lock is held."""
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)
    run(partitioner(completed_retention=-1), engine, schema, now=now)
    read = insert_final(engine, schema, "completed", now - timedelta(hours=9, minutes=30), n=3)
    home = where(engine, schema)[read[0]].split(".", 1)[1]
    reader = psycopg.connect(pg_dsn)
    try:
        reader.execute(f"SELECT count(*) FROM {schema}.{home}")  # holds AccessShare until rollback
        result = run(partitioner(completed_retention="3h"), engine, schema, now=now)
        assert (result.made, result.emptied, result.detached) == (0, 0, 0)
        assert result.busy == ["completed"] and "busy=completed" in result.summary(), result.summary()
        reader.rollback()
    finally:
        reader.close()
    again = run(partitioner(completed_retention="3h"), engine, schema, now=now)
    assert again.deleted["completed"] == 3 and again.busy == []


def test_an_expired_partition_left_pending_by_an_interrupted_concurrent_detach_is_finished_and_dropped(
        engine, pg_dsn, schema):
    """An operator's ``DETACH PARTITION ... CONCURRENTLY`` of an expired partition, cancelled
    while it waited for a reader (a statement timeout, a crash), leaves the partition pending
    detach (``pg_inherits.inhdetachpending``). PostgreSQL refuses a plain DETACH of it ("cannot
    detach partition ... already pending detach", SQLSTATE 55000) and completes it only with
    ``DETACH PARTITION ... FINALIZE`` (PostgreSQL docs, ALTER TABLE, DETACH PARTITION: "If FINALIZE
    is specified, a previous DETACH CONCURRENTLY invocation that was canceled or interrupted is
    completed"). Every pass failed on it: no expired partition of the state was dropped again, and
    no partition made ahead either (same call). The next pass finishes the detach and drops it."""
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)
    run(partitioner(completed_retention=-1), engine, schema, now=now)
    old = insert_final(engine, schema, "completed", now - timedelta(hours=9, minutes=30), n=5)
    other = insert_final(engine, schema, "completed", now - timedelta(hours=7, minutes=30), n=4)
    kept = insert_final(engine, schema, "completed", now - timedelta(minutes=30), n=2)
    home = where(engine, schema)[old[0]].split(".", 1)[1]
    reader = psycopg.connect(pg_dsn)
    try:
        reader.execute(f"SELECT count(*) FROM {schema}.jobs_completed")  # the detach waits for it
        with psycopg.connect(pg_dsn, autocommit=True) as detacher:
            detacher.execute("SET statement_timeout = '300ms'")
            with pytest.raises(psycopg.errors.QueryCanceled):
                detacher.execute(f"ALTER TABLE {schema}.jobs_completed DETACH PARTITION {schema}.{home} CONCURRENTLY")
    finally:
        reader.close()
    pending = text("SELECT count(*) FROM pg_inherits WHERE inhdetachpending AND inhrelid = to_regclass(:t)")
    with engine.connect() as conn:
        assert conn.execute(pending, {"t": f"{schema}.{home}"}).scalar() == 1
    result = run(partitioner(completed_retention="3h"), engine, schema, now=now)
    assert result.detached >= 7 and result.dropped == result.detached and result.busy == []
    assert result.deleted["completed"] == 5 + 4  # the pending one's rows too, counted when emptied
    with engine.connect() as conn:
        assert conn.execute(text("SELECT to_regclass(:t)"), {"t": f"{schema}.{home}"}).scalar() is None
    left = set(where(engine, schema))
    assert left.isdisjoint(old + other) and set(kept) <= left
    assert run(partitioner(completed_retention="3h"), engine, schema, now=now).busy == []


def test_a_partition_let_go_while_the_call_waits_for_the_state_table_is_not_detached_unemptied(engine, pg_dsn, schema):
    """The race the busy partition's guard in maintain_partitions is for: a reader holds an expired
    partition (so it is not emptied) and jobs_completed, and lets both go while the call waits for
    jobs_completed's lock (it does when partitions must be made, with a lock wait). The partition
    is free by then, but it must not be detached with its rows: they would be dropped uncounted
    (``row_count`` 0 in the detach). It is emptied, and counted, by the next pass."""
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)
    run(partitioner(completed_retention=-1), engine, schema, now=now)
    read = insert_final(engine, schema, "completed", now - timedelta(hours=9, minutes=30), n=3)
    home = where(engine, schema)[read[0]].split(".", 1)[1]
    call = sql("SELECT action, partition_name, row_count FROM {schema}.maintain_partitions('completed', "
               "interval '1 hour', now() + interval '20 hours', now() - interval '3 hours', 1000)", schema)
    reader = psycopg.connect(pg_dsn)
    got: list = []
    try:
        reader.execute(f"SELECT count(*) FROM {schema}.{home}")
        reader.execute(f"LOCK TABLE ONLY {schema}.jobs_completed IN ACCESS SHARE MODE")

        def maintain() -> None:
            with engine.begin() as conn:
                got.extend(conn.execute(call).all())
        caller = threading.Thread(target=maintain)
        caller.start()
        waiting = "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = to_regclass(%s)"
        deadline = time.monotonic() + 10
        while reader.execute(waiting, (f"{schema}.jobs_completed",)).fetchone()[0] == 0:
            assert time.monotonic() < deadline and caller.is_alive(), got
            time.sleep(0.01)
        reader.commit()  # both let go while the call waits for jobs_completed
        caller.join(10)
    finally:
        reader.close()
    assert "made" in {r.action for r in got}, got  # the call went on past the wait
    assert home not in {r.partition_name for r in got if r.action == "detached"}, got
    assert set(read) <= set(where(engine, schema))
    again = run(partitioner(completed_retention="3h"), engine, schema, now=now)
    assert again.deleted["completed"] == 3 and again.busy == []
    assert set(where(engine, schema)).isdisjoint(read)


def test_a_pass_of_an_instance_that_no_longer_leads_changes_nothing(engine, schema):
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)
    run(partitioner(completed_retention=-1), engine, schema, now=now)
    before = partitions(engine, schema)

    class Refused:
        epoch = 7

        def check(self, conn):
            raise NotLeader("epoch 7 is over")

    with pytest.raises(NotLeader):
        run(partitioner(completed_retention="1h"), engine, schema, now=now, fence=Refused())
    assert partitions(engine, schema) == before


def test_dry_run_says_what_a_pass_would_do(engine, schema):
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)
    run(partitioner(completed_retention=-1), engine, schema, now=now)
    before = partitions(engine, schema)
    result = run(partitioner(completed_retention="3h", premake=4), engine, schema, now=now, dry_run=True)
    assert result.detached >= 7 and result.made == 6  # 3 states x 2 more steps ahead
    assert partitions(engine, schema) == before



def test_dry_run_counts_the_rows_a_pass_then_drops(engine, schema):
    """SPEC 8.4: `run-once partitioner --dry-run` said "would delete 0 (estimated)" of partitions
    never analyzed (reltuples -1: fewer rows than autovacuum's threshold, or not reached yet),
    which the pass then emptied of 42 rows (counted exactly), and "emptied" every expired
    partition, empty ones and all, and "detached" the low catch-all, which a pass never does."""
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)
    run(partitioner(completed_retention=-1), engine, schema, now=now)
    insert_final(engine, schema, "completed", now - 8 * HOUR, n=30)
    insert_final(engine, schema, "completed", now - 5 * HOUR, n=12)
    insert_final(engine, schema, "completed", now - 20 * HOUR, n=3)  # the low catch-all's
    before = count(engine, schema)
    dry = run(partitioner(completed_retention="3h"), engine, schema, now=now, dry_run=True)
    real = run(partitioner(completed_retention="3h"), engine, schema, now=now)
    assert before - count(engine, schema) == 45
    assert dry.deleted == real.deleted == {"completed": 45, "cancelled": 0, "discarded": 0}
    assert (dry.emptied, dry.detached, dry.estimated) == (real.emptied, real.detached, real.estimated) \
        == (3, real.detached, False)
    # Analyzed partitions: counted the same way.
    insert_final(engine, schema, "completed", now - 2 * HOUR - 30 * MINUTE, n=7)
    with engine.begin() as conn:
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    dry = run(partitioner(completed_retention="1h"), engine, schema, now=now, dry_run=True)
    real = run(partitioner(completed_retention="1h"), engine, schema, now=now)
    assert dry.deleted == real.deleted and dry.deleted["completed"] == 7
    assert dry.estimated == real.estimated



def test_rows_the_cleaner_deleted_since_the_last_analyze_are_not_counted_again(engine, schema):
    """SPEC 8.4: an expired partition was counted by its planner estimate once analyzed. The
    cleaner deletes rows of such partitions (the low catch-all's strays, queues with a shorter
    retention) and counts them; the drop then counted them again, as the estimate still held them:
    1,000 deleted for 400 rows gone, maintd_jobs_deleted_total 600 over. Counted exactly now, up
    to a cap (beyond it, the live-row statistics, which follow deletes, over the estimate)."""
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)
    run(partitioner(completed_retention=-1), engine, schema, now=now)
    insert_final(engine, schema, "completed", now - 20 * HOUR, n=1000)  # the low catch-all's
    insert_final(engine, schema, "completed", now - 8 * HOUR, n=300, queue="short")
    insert_final(engine, schema, "completed", now - 8 * HOUR, n=50)
    with engine.begin() as conn:
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    cleaner = CleanerConfig(completed_retention="3h", queues={"short": {"completed_retention": "1h"}})
    with engine.begin() as conn:  # what the cleaner deleted (and counted) since
        gone = conn.execute(sql("DELETE FROM {schema}.jobs WHERE id IN (SELECT id FROM {schema}.jobs "
                                "WHERE finalized_at < :t ORDER BY id LIMIT 600)", schema), {"t": now - 19 * HOUR}).rowcount
        gone += conn.execute(sql("DELETE FROM {schema}.jobs WHERE queue = 'short'", schema)).rowcount
    assert gone == 900
    before = count(engine, schema)
    dry = run(Partitioner(PartitionerConfig("partitioned", PartitionsConfig(interval=HOUR, premake=2), cleaner)),
              engine, schema, now=now, dry_run=True)
    result = run(Partitioner(PartitionerConfig("partitioned", PartitionsConfig(interval=HOUR, premake=2), cleaner)),
                 engine, schema, now=now)
    assert before - count(engine, schema) == 450
    assert result.deleted["completed"] == dry.deleted["completed"] == 450
    assert not result.estimated and not dry.estimated


# -- rows moved to another partition meanwhile (SQLSTATE 40001) -----------------------------------

def waiting_on_a_lock(pg_dsn: str, schema: str) -> bool:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                            "AND query ILIKE %s", (f"%DELETE FROM \"{schema}\".jobs%",)).fetchone()[0] > 0


def test_a_row_revived_while_the_cleaner_deletes_it_is_skipped_not_an_error(pg_dsn, engine, schema):
    """The cleaner's DELETE waits for a row an operator's retry_jobs is moving back to the live
    partition; when that commits, PostgreSQL fails the DELETE with 40001 (the plain layout would
    re-check the row and pass it over). The batch is redone: the revived job lives, the rest goes."""
    now = server_now(engine)
    ids = insert_final(engine, schema, "completed", now - 30 * HOUR, n=20)
    reviver = psycopg.connect(pg_dsn)
    reviver.execute(f"SELECT * FROM {schema}.retry_jobs(ARRAY[{ids[7]}])")  # moved, not committed
    ctx = PassContext(engine=engine, schema=schema, clock=FrozenClock(now))
    outcome: list = []
    cleaner = threading.Thread(target=lambda: outcome.append(Cleaner(CleanerConfig()).run_once(ctx)))
    cleaner.start()
    deadline = time.monotonic() + 10
    while not waiting_on_a_lock(pg_dsn, schema) and time.monotonic() < deadline:
        time.sleep(0.01)
    reviver.commit()
    cleaner.join()
    reviver.close()
    assert outcome and outcome[0].deleted["completed"] == 19
    assert ctx.moved == 1
    assert set(where(engine, schema)) == {ids[7]}


class Reviver:
    """Before the first attempt at a cleaner DELETE of a range (by its start), ``times`` ranges in
    all, an operator's retry_jobs moves a row of that range back to the live partition and commits
    once the DELETE waits for it: PostgreSQL fails the DELETE with 40001, every time."""

    def __init__(self, pg_dsn: str, schema: str, times: int):
        self.schema, self.times = schema, times
        self.conn = psycopg.connect(pg_dsn)
        self.watch = psycopg.connect(pg_dsn, autocommit=True)
        self.attempts: dict = {}
        self.revived: list[int] = []
        self.threads: list[threading.Thread] = []

    def __call__(self, conn, cursor, statement, parameters, context, executemany):
        if not statement.lstrip().startswith("DELETE FROM") or "lo" not in (parameters or {}):
            return
        key = (parameters["state"], parameters["lo"])
        self.attempts[key] = self.attempts.get(key, 0) + 1
        if self.attempts[key] > 1 or len(self.revived) >= self.times:
            return
        row = self.conn.execute(f"SELECT id FROM {self.schema}.jobs WHERE state = 'completed' AND finalized_at >= %s "
                                "AND finalized_at < %s ORDER BY finalized_at LIMIT 1",
                                (parameters["lo"], parameters["hi"])).fetchone()
        if row is None:
            return
        self.conn.execute(f"SELECT * FROM {self.schema}.retry_jobs(ARRAY[%s::bigint])", row)  # not committed
        self.revived.append(row[0])
        self.threads.append(threading.Thread(target=self._commit_when_waited_for,
                                             args=(cursor.connection.info.backend_pid,)))
        self.threads[-1].start()

    def _commit_when_waited_for(self, pid: int) -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not self.watch.execute(
                "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0]:
            time.sleep(0.002)
        self.conn.commit()

    def close(self) -> None:
        """After the commits: one whose batch never waited for its row (its 5 s wait ending after
        the pass) would otherwise commit on a closed connection, an error in the next test."""
        for thread in self.threads:
            thread.join(10)
        self.conn.close()
        self.watch.close()


def test_a_busy_table_moving_rows_under_every_batch_still_gets_a_successful_pass(pg_dsn, engine, schema):
    """Operators revive expired jobs (retry_jobs) all over the range the cleaner walks: each of its
    first 120 batches meets a moved row (SQLSTATE 40001). The pass used to
    fail once 100 batches had been redone ("tuple to be locked was already moved to another
    partition"); now each batch is redone, smaller, and the pass succeeds, the moves counted."""
    from sqlalchemy import event

    from maintd.passes import Outcome, execute_pass

    now = server_now(engine)
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, finalized_at) SELECT 'k', 'completed', "
                         "CAST(:at AS timestamptz) + g * interval '1 millisecond' FROM generate_series(1, :n) g",
                         schema), {"at": now - 30 * HOUR, "n": 10_000})
    reviver = Reviver(pg_dsn, schema, times=120)
    event.listen(engine, "before_cursor_execute", reviver)
    metrics = Metrics(target="t")
    ctx = PassContext(engine=engine, schema=schema, clock=FrozenClock(now), layout="partitioned")
    try:
        record = execute_pass("cleaner", Cleaner(CleanerConfig(batch_size=100)), ctx, metrics)
    finally:
        event.remove(engine, "before_cursor_execute", reviver)
        reviver.close()
    assert record.outcome is Outcome.SUCCESS, record.error
    assert ctx.moved == len(reviver.revived) == 120
    assert metrics.registry.get_sample_value("maintd_rows_skipped_total",
                                             {"target": "t", "service": "cleaner", "reason": "moved"}) == ctx.moved
    with engine.connect() as conn:
        left = dict(conn.execute(sql("SELECT id, state::text FROM {schema}.jobs", schema)).all())
    assert sorted(left) == sorted(reviver.revived) and set(left.values()) == {"available"}
    assert record.result.deleted["completed"] == 10_000 - len(reviver.revived)


def test_a_worker_completing_while_an_operator_cancels(pg_dsn, engine, schema):
    """The README's cancel and complete on one running job: the completion waits for the
    cancel's row lock; once the cancel commits, the completion fails with 40001 on the
    partitioned layout, which the README tells workers to read as 'not yours any more'. The job
    is cancelled once, and nothing else happens to it."""
    q, job = running_job(engine, schema)
    operator = psycopg.connect(pg_dsn)
    operator.execute(f"UPDATE {schema}.jobs SET state = 'cancelled', finalized_at = now() "
                     f"WHERE id = %s AND state NOT IN ('completed', 'cancelled', 'discarded') RETURNING id", (job.id,))
    errors: list[str] = []

    def complete():
        try:
            with engine.begin() as conn:
                errors.append("completed" if q.complete(conn, job) else "not yours")
        except Exception as exc:
            errors.append(getattr(getattr(exc, "orig", None), "sqlstate", repr(exc)))

    worker = threading.Thread(target=complete)
    worker.start()
    time.sleep(0.3)
    operator.commit()
    worker.join()
    operator.close()
    assert errors == ["40001"]
    with engine.connect() as conn:
        assert conn.execute(sql("SELECT state::text FROM {schema}.jobs WHERE id = :id", schema),
                            {"id": job.id}).scalar() == "cancelled"


def test_the_rescuer_against_completions_loses_nothing(pg_dsn, engine, schema):
    """Workers complete jobs that look stuck while the rescuer rescues them: each job ends either
    completed (the worker's update returned it) or rescued (retryable), never both, never lost,
    and no pass fails, though rows move to the completed partition under the rescuer's feet."""
    from maintd.config import RescuerConfig
    from maintd.services.rescuer import Rescuer

    now = server_now(engine)
    n = 3000
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at, attempted_by) "
                         "SELECT 'k', 'running', 1, CAST(:at AS timestamptz), 'w' FROM generate_series(1, :n)",
                         schema), {"at": now - 2 * HOUR, "n": n})
        ids = [r[0] for r in conn.execute(sql("SELECT id FROM {schema}.jobs ORDER BY id", schema))]
    completed: list[int] = []
    errors: list[BaseException] = []  # a worker that died would leave its jobs to the rescuer
    stop = threading.Event()

    def worker(part: list[int]):
        try:
            work(part)
        except BaseException as exc:
            errors.append(exc)

    def work(part: list[int]):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for job_id in part:
                if stop.is_set():
                    return
                try:
                    row = conn.execute(f"UPDATE {schema}.jobs SET state = 'completed', finalized_at = now() "
                                       "WHERE id = %s AND state = 'running' AND attempted_by = 'w' AND attempt = 1 "
                                       "RETURNING id", (job_id,)).fetchone()
                except psycopg.errors.SerializationFailure:
                    row = None  # rescued meanwhile: not ours any more
                if row:
                    completed.append(job_id)

    threads = [threading.Thread(target=worker, args=(ids[k::4],)) for k in range(4)]
    for t in threads:
        t.start()
    service = Rescuer(RescuerConfig(batch_size=50, precise_timing=False))
    moved, rescued = 0, 0
    while any(t.is_alive() for t in threads):
        ctx = PassContext(engine=engine, schema=schema, clock=FrozenClock(now))
        rescued += service.run_once(ctx).retried  # raises on an error pass
        moved += ctx.moved
    stop.set()
    for t in threads:
        t.join()
    assert errors == []
    with engine.connect() as conn:
        states = dict(conn.execute(sql("SELECT id, state::text FROM {schema}.jobs", schema)).all())
    assert len(states) == n  # nothing lost, nothing doubled
    assert {states[i] for i in completed} == {"completed"}
    assert sum(1 for s in states.values() if s == "retryable") == rescued
    assert len(completed) + rescued == n
    print(f"rescued={rescued} completed={len(completed)} batches redone (40001)={moved}")


# -- an operator's batch meeting a moved row (SQLSTATE 40001) -------------------------------------

@contextmanager
def operator_role(pg_dsn: str, schema: str) -> Iterator[str]:
    """A login role that may run ``maintd jobs`` on the schema (not a superuser, so row security
    applies to it), dropped afterwards."""
    from .test_grants import login_role

    with login_role(pg_dsn, "maintd_op") as role:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"; '
                         f'GRANT SELECT, UPDATE ON "{schema}".jobs TO "{role}"; '
                         f'GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA "{schema}" TO "{role}"')
        yield role


def jobs_cli(dsn: str, schema: str, tmp_path: Path, capsys, *argv: str) -> tuple[int, str, str]:
    """``maintd jobs ARGV`` as an operator runs it, on ``dsn``: exit code, stdout, stderr."""
    from maintd.cli import main

    path = tmp_path / "maintd.toml"
    path.write_text(f'database_url = "{dsn}"\nschema = "{schema}"\ninstance_id = "admin-test"\n')
    rc = main(["--config", str(path), "jobs", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


MOVED = "tuple to be locked was already moved to another partition due to concurrent update"


def cancel_while_a_worker_completes(pg_dsn: str, engine, schema: str, tmp_path: Path, capsys):
    """`maintd jobs cancel DONE OTHER --json`, two available jobs of queue 'race', by an operator
    role, while a worker claims and completes DONE. The worker's completion commits after
    cancel_jobs's statement took its snapshot (DONE available in it) and before it locks DONE:
    a row-security policy on jobs (nothing in the admin SQL is changed) makes the function's
    ``FOR UPDATE`` scan wait for an advisory lock the test holds; the test sees that wait in
    pg_locks, commits the worker, then releases the lock. Returns ((rc, out, err), DONE, OTHER)."""
    key = zlib.crc32(schema.encode())
    q = JobQueue(schema)
    with engine.begin() as conn:
        done, other = q.enqueue(conn, "k", queue="race"), q.enqueue(conn, "k", queue="race")
    outcome: list = []
    with operator_role(pg_dsn, schema) as role, psycopg.connect(pg_dsn, autocommit=True) as gate:
        # FOR UPDATE reads and updates by the operator pass the gate (lock_timeout 0 there: the
        # CLI's 5 s LOCK_TIMEOUT must not end the wait on a slow machine)
        with engine.begin() as conn:
            conn.execute(sql("CREATE FUNCTION {schema}.gate() RETURNS boolean LANGUAGE sql VOLATILE "
                             "SET lock_timeout = 0 AS $$ SELECT true FROM pg_advisory_xact_lock_shared(%d) $$"
                             % key, schema))
            conn.execute(sql("ALTER TABLE {schema}.jobs ENABLE ROW LEVEL SECURITY", schema))
            conn.execute(sql(f'CREATE POLICY reads ON {{schema}}.jobs FOR SELECT TO "{role}" USING (true)', schema))
            conn.execute(sql(f'CREATE POLICY updates ON {{schema}}.jobs FOR UPDATE TO "{role}" '
                             "USING ({schema}.gate())", schema))
        gate.execute("SELECT pg_advisory_lock(%s)", (key,))

        def operate():
            try:
                outcome.append(jobs_cli(pg_dsn.replace("postgres@", f"{role}@", 1), schema, tmp_path, capsys,
                                        "cancel", str(done), str(other), "--json"))
            except BaseException as exc:  # reported by the test, not lost in the thread
                outcome.append(exc)

        with engine.connect() as worker:  # claims and completes DONE in one transaction, committed below
            [job] = q.claim(worker, "race", "w9")
            assert job.id == done and q.complete(worker, job)
            operator = threading.Thread(target=operate)
            operator.start()
            try:
                wait_for(lambda: gate.execute(
                    "SELECT count(*) FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid) "
                    "WHERE a.usename = %s AND l.locktype = 'advisory' AND NOT l.granted "
                    "AND a.query LIKE '%%cancel_jobs%%'", (role,)).fetchone()[0] == 1,
                    timeout=30, what="the operator's cancel_jobs to wait at the gate")
                worker.commit()  # DONE moves from jobs_live to a completed partition
            finally:
                gate.execute("SELECT pg_advisory_unlock(%s)", (key,))
                operator.join(60)
        assert not operator.is_alive(), "the operator's command did not end"
    [result] = outcome
    assert not isinstance(result, BaseException), result
    return result, done, other


def final_rows(engine, schema: str) -> dict[int, tuple]:
    """Each job's (state, attempt, attempted_by, finalized, partition)."""
    with engine.connect() as conn:
        return {r[0]: tuple(r[1:]) for r in conn.execute(sql(
            "SELECT id, state::text, attempt, attempted_by, finalized_at IS NOT NULL, "
            "tableoid::regclass::text FROM {schema}.jobs ORDER BY id", schema))}


def test_an_operator_s_cancel_meeting_a_job_a_worker_completed_meanwhile_is_redone(pg_dsn, engine, schema,
                                                                                  tmp_path, capsys):
    """An admin function reads its jobs with its statement's snapshot, then locks them (``FOR
    UPDATE SKIP LOCKED``: a row another transaction holds is skipped, never waited for). A
    worker's completion committed in between has moved the row from jobs_live to a completed
    partition. In Read Committed a row found updated by a transaction committed since the
    snapshot is followed to its newest version and re-checked (PostgreSQL docs, 13.2.1 Read
    Committed Isolation Level); a row moved to another partition cannot be followed, and
    PostgreSQL fails the statement with a serialization failure, SQLSTATE 40001 (docs, UPDATE
    reference page, Notes: a concurrent UPDATE or DELETE of a row an UPDATE moved to another
    partition "will get a serialization failure error (which always returns with an SQLSTATE
    code '40001'). Applications may wish to retry the transaction"; a row lock of it fails alike,
    "tuple to be locked was already moved to another partition due to concurrent update").
    ``admin.in_batch`` redoes the batch (up to MOVED_TRIES): the operator sees the other job
    cancelled and this one as it is now, completed by its worker, and the command succeeds. (The
    next test shows that the same race fails the batch when it is not redone.)"""
    (rc, out, err), done, other = cancel_while_a_worker_completes(pg_dsn, engine, schema, tmp_path, capsys)
    assert (rc, err) == (0, ""), (rc, out, err)
    data = json.loads(out)
    assert "error" not in data
    assert (data["changed"], data["skipped"], data["not_found"], data["batches"]) == (1, 1, 0, 1), data
    assert data["jobs"] == [{"id": other, "queue": "race", "kind": "k", "from": "available", "to": "cancelled"}]
    assert data["skipped_jobs"] == [{"id": done, "queue": "race", "kind": "k", "state": "completed",
                                     "reason": "nothing to do: the job is completed"}]
    assert data["by_queue"] == [{"queue": "race", "from": "available", "to": "cancelled", "count": 1}]
    rows = final_rows(engine, schema)
    assert sorted(rows) == [done, other]
    assert rows[done][:4] == ("completed", 1, "w9", True) and rows[done][4].startswith(f"{schema}.jobs_completed_")
    assert rows[other][:4] == ("cancelled", 0, None, True) and rows[other][4].startswith(f"{schema}.jobs_cancelled_")


def test_the_same_race_fails_the_batch_with_40001_when_it_is_not_redone(pg_dsn, engine, schema, tmp_path,
                                                                       capsys, monkeypatch):
    """The test above really meets the moved row: with a single try (MOVED_TRIES = 1, as before
    the retry), the very same race fails the command with PostgreSQL's 40001, nothing changed."""
    from maintd import admin

    monkeypatch.setattr(admin, "MOVED_TRIES", 1)
    (rc, out, err), done, other = cancel_while_a_worker_completes(pg_dsn, engine, schema, tmp_path, capsys)
    assert rc == 1 and MOVED in err, (rc, out, err)
    data = json.loads(out)
    assert MOVED in data["error"] and (data["changed"], data["batches"]) == (0, 0), data
    rows = final_rows(engine, schema)
    assert rows[done][:4] == ("completed", 1, "w9", True)
    assert rows[other][:4] == ("available", 0, None, False)


@pytest.mark.parametrize("sqlstate, tries", [("40P01", 1), ("40001", "MOVED_TRIES")])
def test_an_operator_s_batch_is_redone_only_for_40001_and_at_most_moved_tries_times(
        pg_dsn, engine, schema, tmp_path, capsys, sqlstate, tries):
    """Only SQLSTATE 40001 has the batch redone: any other error (here 40P01, deadlock_detected,
    of the same class) fails the command at once, and a 40001 that keeps coming is given up after
    MOVED_TRIES attempts. Either way the command exits 1 with the error and the job is unchanged.
    A row trigger raises the error and counts the attempts in a sequence (not rolled back)."""
    from maintd import admin

    tries = admin.MOVED_TRIES if tries == "MOVED_TRIES" else tries
    with engine.begin() as conn:
        job = JobQueue(schema).enqueue(conn, "k")
        conn.execute(sql("CREATE SEQUENCE {schema}.attempts", schema))
        conn.execute(sql("CREATE FUNCTION {schema}.refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                         "PERFORM nextval('{schema}.attempts'); "
                         f"RAISE EXCEPTION 'refused job %', OLD.id USING ERRCODE = '{sqlstate}'; END $$", schema))
        conn.execute(sql("CREATE TRIGGER refuse BEFORE UPDATE ON {schema}.jobs FOR EACH ROW "
                         "EXECUTE FUNCTION {schema}.refuse()", schema))
    rc, out, err = jobs_cli(pg_dsn, schema, tmp_path, capsys, "cancel", str(job), "--json")
    assert rc == 1 and f"refused job {job}" in err, (rc, out, err)
    data = json.loads(out)
    assert (data["changed"], data["batches"]) == (0, 0) and f"refused job {job}" in data["error"], data
    with engine.connect() as conn:
        assert conn.execute(sql("SELECT last_value FROM {schema}.attempts", schema)).scalar() == tries
        assert conn.execute(sql("SELECT state::text FROM {schema}.jobs", schema)).all() == [("available",)]


# -- visibility -----------------------------------------------------------------------------------

@pytest.mark.both_layouts
def test_status_and_the_dashboard_show_the_layout_and_its_partitions(engine, pg_dsn, schema, layout, settings):
    from maintd.dashboard import Dashboard
    from maintd.http import Request
    from maintd.status import collect_status, format_status

    now = server_now(engine)
    insert_final(engine, schema, "completed", "infinity")
    insert_final(engine, schema, "discarded", now)
    st = collect_status(engine, schema)
    status, _, body, _ = Dashboard(lambda: settings).pages()["/"](Request("/", {}))
    html = body.decode()
    assert status == 200
    if layout == "plain":
        assert st["layout"] == {"layout": "plain"} and "layout: plain" in format_status(st)
        assert 'data-layout="plain"' in html
        return
    per_state = TEST_PARTITIONS["premake"] + 1
    assert st["layout"]["layout"] == "partitioned"
    assert (st["layout"]["partitions"], st["layout"]["stray_rows"]) == (3 * per_state, 1)
    assert datetime.fromisoformat(st["layout"]["newest"]) >= now + TEST_PARTITIONS["premake"] * HOUR
    assert datetime.fromisoformat(st["layout"]["oldest"]) <= now
    line = next(ln for ln in format_status(st).splitlines() if ln.startswith("layout:"))
    assert f"partitioned, {3 * per_state} partitions" in line and "1 stray rows" in line
    assert 'data-layout="partitioned"' in html
    assert re.search(rf'id="partition-count">{3 * per_state}<', html) and ">1 stray rows<" in html


# PostgreSQL's documentation, "Date/Time Output" (datatype-datetime.html, table "Date/Time Output
# Styles"): the four DateStyle output styles, each with its field order where it has one.
DATE_STYLES = ["ISO, MDY", "SQL, DMY", "SQL, MDY", "Postgres, DMY", "Postgres, MDY", "German, DMY"]


@pytest.mark.parametrize("zone", ["UTC", "America/New_York", "Asia/Kathmandu", "Pacific/Chatham", "Asia/Kolkata"])
def test_partition_bounds_read_back_in_every_date_style_and_time_zone(pg_dsn, schema, zone):
    """job_partitions prints each bound (pg_get_expr) and reads it back (the cut by position of
    migration 0009): in every output style the documentation lists, and in zones with odd
    offsets (+05:45, +13:45) or an ambiguous abbreviation (Asia/Kolkata prints IST, which
    PostgreSQL 15 reads back as Israel's: 3.5 hours off before job_partitions pinned its own
    settings), the bounds are the same instants as in ISO and UTC. Compared as epoch seconds,
    computed in the same session."""
    query = (f"SELECT partition_name, extract(epoch FROM range_start), extract(epoch FROM range_end) "
             f"FROM {schema}.job_partitions('completed')")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SET TimeZone = 'UTC'")
        conn.execute("SET DateStyle = 'ISO, MDY'")
        expected = conn.execute(query).fetchall()
        assert len(expected) >= 3 and expected[0][1] is None and expected[-1][2] is None
        conn.execute("SELECT set_config('TimeZone', %s, false)", (zone,))
        for style in DATE_STYLES:
            conn.execute("SELECT set_config('DateStyle', %s, false)", (style,))
            assert conn.execute(query).fetchall() == expected, style


@pytest.mark.parametrize("zone", ["Asia/Kolkata", "Pacific/Chatham"])
def test_migrate_in_a_session_of_another_date_style_and_zone_starts_the_partitions_at_the_step(pg_dsn, zone):
    """The bounds written by migrate (and by --convert: both call start_partitions in the owner's
    session) are the step of time, whatever that session's DateStyle and TimeZone. They were
    printed into the ATTACH in the session's style: on PostgreSQL 15 a session in Asia/Kolkata with
    DateStyle SQL wrote '... IST', read back as Israel's time, so the catch-alls met 3.5 hours in
    the future (every completion until then a stray in the low catch-all, every partition after
    it half an hour off the step)."""
    from .conftest import new_schema_name

    name = new_schema_name()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{name}"')
    dsn = pg_dsn + ("&" if "?" in pg_dsn else "?") + f"options=-c%20DateStyle%3DSQL%2CDMY%20-c%20TimeZone%3D{zone}"
    migrate_engine = None
    try:
        from sqlalchemy import create_engine
        from sqlalchemy.pool import NullPool

        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SET TimeZone = 'UTC'")
            before = conn.execute("SELECT date_trunc('hour', now())").fetchone()[0]
        # Not maintd's own engine, which pins the ISO DateStyle in its sessions (maintd.db.PINNED):
        # the owner's session as it is (migrate's SQL run by hand, say), which the function must not trust.
        migrate_engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn), poolclass=NullPool)
        with migrate_engine.connect() as conn:
            assert conn.execute(text("SHOW DateStyle")).scalar() == "SQL, DMY"
            migrate.upgrade(conn, name, layout=migrate.Layout("partitioned", HOUR, 2))
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SET TimeZone = 'UTC'")
            after = conn.execute("SELECT date_trunc('hour', now())").fetchone()[0]
            for state in ("completed", "cancelled", "discarded"):
                parts = conn.execute(f'SELECT * FROM "{name}".job_partitions(%s)', (state,)).fetchall()
                assert parts[0][2] in (before, after), (state, parts[0])  # the low catch-all ends at this hour
                assert all(p[1].minute == p[1].second == 0 for p in parts[1:]), parts
    finally:
        if migrate_engine is not None:
            migrate_engine.dispose()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def test_dry_run_does_not_count_an_empty_low_catch_all_that_a_pass_leaves_where_it_is(engine, schema):
    """The low catch-all's range is past the retention (the usual case: it ends where the first
    partition starts) but no proper partition is, and it holds no row: a pass leaves it where it is
    (nothing emptied, nothing detached). The dry run said it would empty and detach it, each time
    partitions were to be made (once a step), with its stale row estimate as jobs deleted."""
    now = server_now(engine)
    restart(engine, schema, "completed", now - 3 * HOUR - MINUTE)  # ends at the hour before
    service = partitioner(completed_retention="3h")
    planned = run(service, engine, schema, now=now, dry_run=True)
    done = run(service, engine, schema, now=now)
    assert done.made >= 3 and (done.emptied, done.detached, done.deleted["completed"]) == (0, 0, 0)
    assert (planned.emptied, planned.detached, planned.deleted["completed"]) == (0, 0, 0), planned


def test_dry_run_makes_what_a_pass_makes_after_a_burst_and_past_the_cap(engine, schema):
    """A pass makes at most 50 partitions a state (make_partitions' cap), and after a burst in the
    high catch-all closes it into the partition of its range and makes only the steps after it.
    The dry run counted every step from the catch-all's start to premake ahead: "would made=13
    closed=0 moved=0" for a pass that closed one, moved two rows and made two."""
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)
    for k in range(10):
        insert_final(engine, schema, "completed", now - timedelta(hours=k, minutes=30), n=5)
    insert_final(engine, schema, "completed", "infinity")
    insert_final(engine, schema, "completed", now + timedelta(days=30))
    service = partitioner(completed_retention=-1)
    dry = run(service, engine, schema, now=now, dry_run=True)
    real = run(service, engine, schema, now=now)
    assert (real.closed, real.moved) == (1, 2)
    assert (dry.made, dry.closed, dry.moved) == (real.made, real.closed, real.moved), (dry.summary(), real.summary())
    many = partitioner(completed_retention=-1, premake=120)
    dry = run(many, engine, schema, now=now, dry_run=True)
    real = run(many, engine, schema, now=now)
    assert real.made == 3 * 50
    assert dry.made == real.made, (dry.summary(), real.summary())


def test_dry_run_drops_what_a_pass_drops(engine, schema):
    """A pass drops the tables it detaches (and those an earlier one left detached): the dry run
    said "would ... detached=8 dropped=0" of a pass that then said "detached=8 dropped=8"."""
    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)
    run(partitioner(completed_retention=-1), engine, schema, now=now)
    insert_final(engine, schema, "completed", now - timedelta(hours=9, minutes=30), n=3)
    service = partitioner(completed_retention="3h")
    dry = run(service, engine, schema, now=now, dry_run=True)
    real = run(service, engine, schema, now=now)
    assert real.dropped == real.detached >= 7
    assert (dry.detached, dry.dropped) == (real.detached, real.dropped), (dry.summary(), real.summary())


def test_the_emptied_line_marks_a_row_count_that_is_an_estimate(engine, schema, caplog):
    """Past EXACT_UP_TO rows an emptied partition's count is the statistics' estimate; the pass
    summary said so ("(estimated)") while the log line gave the number as if counted."""
    import logging

    now = server_now(engine)
    restart(engine, schema, "completed", now - 10 * HOUR)
    run(partitioner(completed_retention=-1), engine, schema, now=now)
    insert_final(engine, schema, "completed", now - timedelta(hours=9, minutes=30), n=100_001)
    with engine.begin() as conn:
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    with caplog.at_level(logging.INFO, logger="maintd.partitioner"):
        result = run(partitioner(completed_retention="3h"), engine, schema, now=now)
    assert result.estimated
    [rows] = [r.fields["rows"] for r in caplog.records if r.getMessage() == "partition emptied"]
    assert str(rows).startswith("~"), f"an estimate logged as a count: rows={rows}"


def test_a_partitioned_table_under_a_plain_config_is_said_by_status_and_the_daemon(engine, schema, pg_dsn, maintd_log):
    """The README's last step of a conversion is `layout = "partitioned"`; forgotten, the leader
    keeps no partitions (none made ahead: after `premake` steps every finished job lands in the
    catch-all; none dropped), and nothing said so: the partitioner warned only the other way
    round (a partitioned config on a plain table). Now the daemon warns when it checks the schema,
    and `maintd status` (and /status) carry the note under the layout."""
    from maintd.config import Settings
    from maintd.daemon import Daemon
    from maintd.status import collect_status, format_status

    for configured in ("plain", "partitioned"):
        st = collect_status(engine, schema, configured_layout=configured)
        note = st["layout"].get("note")
        assert (note is not None and 'layout = "partitioned"' in note) == (configured == "plain"), st["layout"]
        assert ("warning: " in format_status(st)) == (configured == "plain")
    for configured in ("plain", "partitioned"):
        maintd_log.clear()
        daemon = Daemon(Settings(database_url=pg_dsn, schema=schema, instance_id="t", layout=configured))
        try:
            daemon.targets[0].check_schema()
        finally:
            daemon.readers.dispose()
        warned = [line for line in maintd_log if "keeps no partitions" in line]
        assert len(warned) == (configured == "plain"), maintd_log
        # The line names its target, the only one too (the other start lines of a target do):
        # moved to the runner, whose context names a target only when there are several, it lost it.
        assert all(line.endswith(f" target={schema}") for line in warned), warned


@pytest.mark.both_layouts
def test_status_warns_whenever_the_config_s_layout_is_not_the_table_s(engine, schema, layout):
    """Walking the README on a schema `maintd migrate` had made plain, `layout = "partitioned"`
    set and `maintd migrate` run again ("nothing to do": it builds the partitioned layout for a
    new schema only): `maintd status` and /status said `layout: plain` and nothing more, while
    the leader kept no partitions. Either mismatch is now a warning under the layout, naming what
    to do; a config that agrees with the table gets none."""
    from maintd.status import collect_status, format_status

    for configured in ("plain", "partitioned"):
        st = collect_status(engine, schema, configured_layout=configured)
        text_ = format_status(st)
        note = st["layout"].get("note")
        assert st["layout"]["layout"] == layout
        assert (note is not None) == (configured != layout), st["layout"]
        assert ("warning: " in text_) == (configured != layout), text_
        if configured == "partitioned" and layout == "plain":
            assert "maintd migrate --convert partitioned" in note, note


def test_the_layout_line_writes_stray_rows_with_thousands_separators_as_every_other_count():
    """`maintd status` and the dashboard wrote "7200 stray rows" beside the partitioner's
    "stray rows 7,200" and the jobs' "4,000" (seen walking the README's conversion)."""
    from pathlib import Path

    from maintd.layout_status import format_layout

    line = format_layout({"layout": "partitioned", "partitions": 1500, "oldest": "a", "newest": "b",
                          "stray_rows": 7200})
    assert "1,500 partitions" in line and "7,200 stray rows" in line, line
    template = (Path(__file__).resolve().parent.parent / "maintd" / "templates" / "index.html").read_text()
    assert "{{ t.layout.stray_rows|num }} stray rows" in template


# A pause of a session that sets gate.paused, at the start of each CREATE TABLE, for as long as
# another session holds advisory lock GATE_KEY (polled: no lock wait, which lock_timeout would end).
GATE_KEY = 727_001
GATE = f"""
CREATE FUNCTION public.gate() RETURNS event_trigger LANGUAGE plpgsql AS $$
BEGIN
  IF current_setting('gate.paused', true) = 'on' THEN
    WHILE NOT pg_try_advisory_lock({GATE_KEY}) LOOP PERFORM pg_sleep(0.01); END LOOP;
    PERFORM pg_advisory_unlock({GATE_KEY});
  END IF;
END $$;
CREATE EVENT TRIGGER gate ON ddl_command_start WHEN TAG IN ('CREATE TABLE') EXECUTE FUNCTION public.gate();
"""


def test_a_state_table_taken_between_the_probe_and_the_lock_is_not_waited_for(private_pg):
    """maintain_partitions probes jobs_<state> (NOWAIT, undone), makes the new tables, then
    locks it for the change, NOWAIT again: a completion that took the table meanwhile must not
    find the change ahead of it in the lock queue (every completion after it would wait behind
    it, up to the function's 1 s lock_timeout). The probe catches every lock held before the
    call, so the second NOWAIT could be deleted unnoticed (a mutation review). Here the call is
    paused after the probe, at its first CREATE TABLE (an event trigger, on a server of the test's
    own), a completion takes jobs_completed, and the call goes on: it reports the state busy and
    never waits; once the completion is over, the next call makes the partitions."""
    from maintd.db import make_engine

    from .conftest import migrate_layout, new_schema_name

    dsn, schema = private_pg.dsn, new_schema_name()
    engine = make_engine(dsn, application_name="maintd-test", pooled=False)
    with engine.connect() as conn:
        migrate.upgrade(conn, schema, layout=migrate_layout("partitioned"))
    engine.dispose()
    call = (f"SELECT action FROM {schema}.maintain_partitions('completed', interval '1 hour', "
            "now() + interval '10 hours')")
    with psycopg.connect(dsn, autocommit=True) as watcher, psycopg.connect(dsn, autocommit=True) as holder, \
            psycopg.connect(dsn) as completion, psycopg.connect(dsn, autocommit=True) as maintainer:
        watcher.execute(GATE)
        holder.execute("SELECT pg_advisory_lock(%s)", (GATE_KEY,))
        maintainer.execute("SET gate.paused = 'on'")
        pid = maintainer.info.backend_pid
        answers: list = []
        call_thread = threading.Thread(target=lambda: answers.append(maintainer.execute(call).fetchall()), daemon=True)
        call_thread.start()
        wait_for(lambda: watcher.execute("SELECT wait_event FROM pg_stat_activity WHERE pid = %s",
                                         (pid,)).fetchone() == ("PgSleep",), 30, what="the call paused after its probe")
        completion.execute(f"LOCK TABLE {schema}.jobs_completed IN ROW EXCLUSIVE MODE")  # a completion in flight
        holder.execute("SELECT pg_advisory_unlock(%s)", (GATE_KEY,))
        waited = False
        while call_thread.is_alive():
            waited = waited or bool(watcher.execute("SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted",
                                                    (pid,)).fetchall())
            call_thread.join(0.005)
        assert not waited, "the change waited in the lock queue of jobs_completed"
        assert answers == [[("busy",)]]
        completion.rollback()
        made = {a for (a,) in maintainer.execute(call).fetchall()}
        assert "made" in made and "busy" not in made, made
