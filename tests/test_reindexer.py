"""Reindexer: off by default, midnight schedule, leftover artifacts, cancelled builds, privileges."""

from __future__ import annotations

import threading
import uuid
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from urllib.parse import urlsplit

import psycopg
import pytest
from sqlalchemy import text

from maintd import migrate
from maintd.clock import ServerClock
from maintd.config import Settings
from maintd.db import make_engine
from maintd.queries import catalog
from maintd.services.base import PassContext
from maintd.services.reindexer import Reindexer

from .procs import wait_for

UTC = timezone.utc


@pytest.fixture(scope="module")
def pg_dsn(pg_dsn):
    """This module's tests run in a database of their own on the test server. REINDEX
    CONCURRENTLY waits for every older snapshot of its database, under the reindexer's 5 s
    lock_timeout: in the shared database, another xdist worker's long statement (test_hostile's
    300,000-row insert, a lock left waiting on purpose) would turn a "reindexed" into "timeout"."""
    with database_of_its_own(pg_dsn) as dsn:
        yield dsn


@pytest.fixture(scope="module")
def pg_version(pg_dsn):  # (the session's reads the module's pg_dsn above: one scope for both)
    with psycopg.connect(pg_dsn) as conn:
        return int(conn.execute("SHOW server_version_num").fetchone()[0]) // 10000


def indexes(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        return {r[0]: r[1] for r in conn.execute(
            "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "JOIN pg_class t ON t.oid = i.indrelid JOIN pg_namespace n ON n.oid = t.relnamespace "
            "WHERE n.nspname = %s AND t.relname = 'jobs'", (schema,))}


def index_oids(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        return dict(conn.execute(
            "SELECT c.relname, c.oid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "JOIN pg_class t ON t.oid = i.indrelid JOIN pg_namespace n ON n.oid = t.relnamespace "
            "WHERE n.nspname = %s AND t.relname = 'jobs'", (schema,)).fetchall())


def leave_ccnew(pg_dsn, schema, name):
    """Index ``name`` on jobs, and PostgreSQL's own leftover of a REINDEX CONCURRENTLY of it: the
    build cut off by its lock_timeout while an older transaction holds the table."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE INDEX "{name}" ON "{schema}".jobs (created_at)')
    with psycopg.connect(pg_dsn) as blocker, psycopg.connect(pg_dsn, autocommit=True) as conn:
        blocker.execute(f'UPDATE "{schema}".jobs SET priority = 1 WHERE id = (SELECT min(id) FROM "{schema}".jobs)')
        conn.execute("SET lock_timeout = '300ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            conn.execute(f'REINDEX INDEX CONCURRENTLY "{schema}"."{name}"')
        blocker.rollback()


def make_invalid(pg_dsn, schema, name):
    """A real leftover: a concurrent unique build that fails on duplicates stays behind, invalid."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute(f'CREATE UNIQUE INDEX CONCURRENTLY "{name}" ON "{schema}".jobs (kind)')


def seed(pg_dsn, schema, n=2000):
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"INSERT INTO \"{schema}\".jobs (kind) SELECT 'k' FROM generate_series(1, {n})")


def run(settings, engine, **kw):
    return Reindexer(settings.reindexer).run_once(PassContext.for_settings(settings, engine, ServerClock(), **kw))


def test_disabled_by_default_and_fires_at_midnight_utc(settings):
    assert Settings().reindexer.enabled is False
    assert not Reindexer(Settings().reindexer).enabled()
    trigger = Reindexer(settings.reindexer).trigger()
    now = datetime(2026, 3, 1, 15, 30, tzinfo=UTC)
    assert trigger.get_next_fire_time(None, now) == datetime(2026, 3, 2, 0, 0, tzinfo=UTC)


def test_drops_invalid_artifacts_but_not_a_valid_lookalike(pg_dsn, schema, settings, engine):
    seed(pg_dsn, schema)
    make_invalid(pg_dsn, schema, "jobs_fetch_idx_ccnew")
    make_invalid(pg_dsn, schema, "jobs_fetch_idx_ccnew1")
    make_invalid(pg_dsn, schema, "jobs_fetch_idx_ccold")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE INDEX "jobs_fetch_idx_ccnew2" ON "{schema}".jobs (kind)')  # valid
    before = indexes(pg_dsn, schema)
    assert before["jobs_fetch_idx_ccnew"] is False and before["jobs_fetch_idx_ccnew2"] is True

    settings.reindexer.indexes = ["jobs_fetch_idx"]
    dry = run(settings, engine, dry_run=True)
    assert sorted(dry.indexes[0].artifacts_dropped) == [
        "jobs_fetch_idx_ccnew", "jobs_fetch_idx_ccnew1", "jobs_fetch_idx_ccold"]
    assert indexes(pg_dsn, schema) == before  # dry run changes nothing

    result = run(settings, engine)
    [report] = result.indexes
    assert report.outcome == "reindexed"
    assert sorted(report.artifacts_dropped) == ["jobs_fetch_idx_ccnew", "jobs_fetch_idx_ccnew1",
                                                "jobs_fetch_idx_ccold"]
    after = indexes(pg_dsn, schema)
    assert "jobs_fetch_idx_ccnew" not in after and "jobs_fetch_idx_ccold" not in after
    assert after["jobs_fetch_idx_ccnew2"] is True  # the valid one stays
    assert after["jobs_fetch_idx"] is True


def test_a_leftover_of_an_index_with_a_long_name_is_found_under_its_cut_name(pg_dsn, schema, settings, engine):
    """PostgreSQL cuts an index's name so that '<name>_ccnew' fits 63 bytes (ChooseRelationName):
    the leftover of a 60-character index is its first 57 characters and '_ccnew', which the
    pattern '<name>_ccnew' never matched: such a leftover was never dropped nor reported. The
    leftover here is PostgreSQL's own: a REINDEX CONCURRENTLY cut off by its lock_timeout while an
    old transaction holds the table."""
    from maintd.services.reindexer import is_artifact

    seed(pg_dsn, schema, 100)
    long_name = "jobs_created_at_idx_" + "x" * 40
    leave_ccnew(pg_dsn, schema, long_name)
    [leftover] = [name for name, valid in indexes(pg_dsn, schema).items() if name.endswith("_ccnew")]
    assert leftover == long_name[:57] + "_ccnew" and indexes(pg_dsn, schema)[leftover] is False
    assert is_artifact(leftover, long_name) and is_artifact(long_name[:56] + "_ccnew1", long_name)
    assert not is_artifact(leftover, "jobs_fetch_idx") and not is_artifact("jobs_fetch_idx_ccnew", long_name)
    settings.reindexer.indexes = [long_name]
    [report] = run(settings, engine).indexes
    assert report.outcome == "reindexed" and report.artifacts_dropped == [leftover]
    assert leftover not in indexes(pg_dsn, schema)


def test_default_reindexes_every_jobs_index(pg_dsn, schema, settings, engine):
    seed(pg_dsn, schema, 500)
    result = run(settings, engine)
    assert {r.index: r.outcome for r in result.indexes} == {
        "jobs_pkey": "reindexed", "jobs_fetch_idx": "reindexed", "jobs_scheduled_idx": "reindexed",
        "jobs_finalized_idx": "reindexed", "jobs_running_idx": "reindexed",
        "jobs_unique_key_idx": "reindexed", "jobs_exhausted_idx": "reindexed",
        "jobs_finalized_queue_idx": "reindexed"}
    assert all(v for v in indexes(pg_dsn, schema).values())


def test_timeout_during_the_build_leaves_no_artifact(pg_dsn, schema, settings, engine):
    seed(pg_dsn, schema)
    settings.reindexer.indexes = ["jobs_finalized_idx"]
    settings.reindexer.timeout = timedelta(seconds=1)
    settings.reindexer.lock_timeout = timedelta(seconds=20)
    # An open transaction that has read the table makes REINDEX CONCURRENTLY wait after it has
    # created jobs_finalized_idx_ccnew: the 1 s timeout cancels it there.
    blocker = psycopg.connect(pg_dsn)
    blocker.execute(f'SELECT count(*) FROM "{schema}".jobs')
    release = threading.Timer(4.0, blocker.rollback)  # well after the 1 s timeout, even on a slow start
    release.start()
    try:
        result = run(settings, engine)
    finally:
        release.join()
        blocker.close()
    [report] = result.indexes
    assert report.outcome == "timeout"
    # Depending on the phase it was cancelled in, the leftover is the new or the old copy.
    assert len(report.artifacts_dropped) == 1
    assert report.artifacts_dropped[0] in ("jobs_finalized_idx_ccnew", "jobs_finalized_idx_ccold")
    after = indexes(pg_dsn, schema)
    assert not [n for n in after if "_cc" in n], after
    assert after["jobs_finalized_idx"] is True


def test_a_rebuild_failed_by_an_older_transaction_says_so_and_what_to_raise(pg_dsn, schema, settings, engine):
    """A transaction that has read the jobs table and stays open (a report, pg_dump, a worker
    holding its transaction through a job) makes REINDEX CONCURRENTLY wait for it, and
    lock_timeout bounds those waits too: the rebuild failed with only "canceling statement due to
    lock timeout", which reads as a lock someone held against maintd. PostgreSQL's REINDEX page
    ("Rebuilding Indexes Concurrently"): each phase waits for the transactions that could use the
    index; those waits take no lock that blocks a worker. The error now says so, and what to raise."""
    seed(pg_dsn, schema, 200)
    settings.reindexer.indexes = ["jobs_finalized_idx"]
    settings.reindexer.lock_timeout = timedelta(milliseconds=500)
    reader = psycopg.connect(pg_dsn)
    reader.execute(f'SELECT count(*) FROM "{schema}".jobs')  # its transaction stays open
    try:
        [report] = run(settings, engine).indexes
    finally:
        reader.rollback()
        reader.close()
    assert report.outcome == "timeout"
    assert "canceling statement due to lock timeout" in report.error, report.error
    assert "a transaction older than the rebuild kept the jobs table for over reindexer.lock_timeout (0.5s)" \
        in report.error and "raise lock_timeout" in report.error, report.error
    run(settings, engine)  # the reader gone, the next pass drops the leftover the first could not
    assert not [n for n in indexes(pg_dsn, schema) if "_cc" in n]


def test_a_rebuild_by_someone_else_is_left_alone_and_the_error_names_its_copy(pg_dsn, schema, settings, engine,
                                                                              caplog):
    """Another session's REINDEX CONCURRENTLY in progress has an invalid ``_ccnew`` too: the pass
    cannot drop it (the other build holds the table) and gives up after lock_timeout, leaving the
    other build to finish. The error said only 'canceling statement due to lock timeout' under
    'reindex failed index=jobs_finalized_idx', as if the rebuild had timed out: it names the
    leftover it could not drop."""
    seed(pg_dsn, schema, 200)
    settings.reindexer.indexes = ["jobs_finalized_idx"]
    settings.reindexer.lock_timeout = timedelta(milliseconds=500)
    blocker = psycopg.connect(pg_dsn)  # keeps the other build waiting, its copy invalid
    blocker.execute(f'UPDATE "{schema}".jobs SET priority = 1 WHERE id = (SELECT min(id) FROM "{schema}".jobs)')
    failed = []

    def other_build():
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            try:
                conn.execute(f'REINDEX INDEX CONCURRENTLY "{schema}".jobs_finalized_idx')
            except psycopg.Error as exc:
                failed.append(exc)

    other = threading.Thread(target=other_build)
    other.start()
    try:
        wait_for(lambda: indexes(pg_dsn, schema).get("jobs_finalized_idx_ccnew") is False, 10,
                 what="the other session's build under way")
        [report] = run(settings, engine).indexes
    finally:
        blocker.rollback()
        blocker.close()
        other.join()
    assert report.outcome == "timeout" and report.artifacts_dropped == []
    assert "jobs_finalized_idx_ccnew" in report.error, report.error
    assert not failed and not [n for n in indexes(pg_dsn, schema) if "_cc" in n]  # the other build finished
    assert any("jobs_finalized_idx_ccnew" in str(getattr(r, "fields", "")) for r in caplog.records
               if "could not drop" in r.getMessage())


def test_a_rebuild_cancelled_by_a_stop_is_a_stopped_pass_not_a_success(pg_dsn, schema, settings, engine):
    """A rebuild cancelled by a demotion or a shutdown (the runner's stop: flag set, query
    cancelled) ended the pass normally, so it was recorded as a ``success`` (and set
    maintd_service_last_success_timestamp_seconds) although it rebuilt nothing: a reindexer that
    never gets to finish looked healthy. Its leftover is still dropped, and the index reported
    ``cancelled``."""
    from maintd.passes import Outcome, execute_pass
    from maintd.runner import _stop

    seed(pg_dsn, schema)
    settings.reindexer.indexes = ["jobs_finalized_idx", "jobs_pkey"]
    settings.reindexer.lock_timeout = timedelta(seconds=20)
    blocker = psycopg.connect(pg_dsn)  # the build waits for its snapshot, its copy made
    blocker.execute(f'SELECT count(*) FROM "{schema}".jobs')
    ctx = PassContext.for_settings(settings, engine, ServerClock())
    stop = threading.Timer(1.0, _stop, (ctx,))
    release = threading.Timer(2.5, blocker.rollback)
    stop.start(), release.start()
    try:
        record = execute_pass("reindexer", Reindexer(settings.reindexer), ctx)
    finally:
        stop.join(), release.join()
        blocker.close()
    assert [(r.index, r.outcome) for r in record.result.indexes] == [("jobs_finalized_idx", "cancelled")]
    assert record.outcome is Outcome.STOPPED, (record.outcome, record.error)
    assert not [n for n in indexes(pg_dsn, schema) if "_cc" in n]


def test_an_index_with_a_name_needing_quotes_is_reindexed_not_called_missing(pg_dsn, schema, settings, engine, caplog):
    """The default list is every index of the jobs table: one an operator made with a mixed-case
    or spaced name was reported ``missing`` ('configured index does not exist', counted in
    maintd_reindex_total{outcome="missing"}), though it exists and was never configured."""
    seed(pg_dsn, schema, 200)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE INDEX "Jobs_Kind" ON "{schema}".jobs (kind)')
        conn.execute(f'CREATE INDEX "jobs ""kind"" 2" ON "{schema}".jobs (kind)')
    before = index_oids(pg_dsn, schema)
    outcomes = {r.index: r.outcome for r in run(settings, engine).indexes}
    assert outcomes["Jobs_Kind"] == outcomes['jobs "kind" 2'] == "reindexed", outcomes
    after = index_oids(pg_dsn, schema)
    assert after["Jobs_Kind"] != before["Jobs_Kind"] and after['jobs "kind" 2'] != before['jobs "kind" 2']
    assert not any("does not exist" in r.getMessage() for r in caplog.records)


def test_missing_configured_index_is_a_warning(pg_dsn, schema, settings, engine, caplog):
    settings.reindexer.indexes = ["jobs_nope_idx", "jobs_pkey"]
    result = run(settings, engine)
    assert [(r.index, r.outcome) for r in result.indexes] == [("jobs_nope_idx", "missing"),
                                                              ("jobs_pkey", "reindexed")]
    assert any("does not exist" in r.getMessage() for r in caplog.records)


@contextmanager
def migrated_database(pg_dsn):
    """A database of its own with the schema maintd migrated: its DSN and an engine; the database
    dropped afterwards."""
    with database_of_its_own(pg_dsn) as dsn:
        engine = make_engine(dsn, application_name="maintd-test", pool_size=2)
        try:
            with engine.connect() as conn:
                migrate.upgrade(conn, "maintd")
            yield dsn, engine
        finally:
            engine.dispose()


@contextmanager
def database_of_its_own(pg_dsn):
    """A new, empty database on the test server: its DSN; dropped afterwards."""
    db = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db}"')
    try:
        yield urlsplit(pg_dsn)._replace(path=f"/{db}").geturl()
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


@pytest.fixture(params=[False, True], ids=["catalog-estimate", "pgstattuple"])
def own_database(request, pg_dsn):
    """A database of this test's own (pgstattuple is a per-database extension, and whether it is
    installed changes how the reindexer measures bloat), with the schema migrated."""
    with migrated_database(pg_dsn) as (dsn, engine):
        if request.param:
            with engine.connect() as conn:
                conn.execute(text("CREATE EXTENSION pgstattuple"))
                conn.commit()
        yield dsn, engine, request.param


def test_bloat_threshold_skips_healthy_indexes(own_database):
    """A really bloated primary key (9 rows in 10 deleted and vacuumed away: its leaf pages stay
    mostly empty) is rebuilt above the threshold; right after, the same index is fresh and skipped."""
    dsn, engine, with_pgstattuple = own_database
    settings = Settings(database_url=dsn, schema="maintd",
                        reindexer={"indexes": ["jobs_pkey"], "bloat_threshold": 50})
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO maintd.jobs (kind) SELECT 'k' FROM generate_series(1, 20000)")
        conn.execute("DELETE FROM maintd.jobs WHERE id % 10 <> 0")
        conn.execute("VACUUM ANALYZE maintd.jobs")
        if with_pgstattuple:  # the figure pgstatindex gives, which the catalog estimate does not
            density = conn.execute("SELECT avg_leaf_density FROM pgstatindex('maintd.jobs_pkey')").fetchone()[0]
            with engine.connect() as sa:
                estimate = sa.execute(text(catalog.ESTIMATED_BLOAT), {"schema": "maintd", "index": "jobs_pkey"}).scalar()
            assert abs(estimate - (90 - density)) > 1, (estimate, density)  # the case tells the two apart
    [bloated] = run(settings, engine).indexes
    assert bloated.outcome == "reindexed", bloated
    assert bloated.bloat_percent is not None and bloated.bloat_percent > 70, bloated
    if with_pgstattuple:
        assert bloated.bloat_percent == round(max(0.0, 90 - density), 1), (bloated, density)
    assert bloated.bytes_after < bloated.bytes_before / 4, bloated
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ANALYZE maintd.jobs")
    [fresh] = run(settings, engine).indexes
    assert fresh.outcome == "skipped", fresh
    assert fresh.bloat_percent is not None and fresh.bloat_percent < 50, fresh
    assert fresh.bytes_before == bloated.bytes_after


@contextmanager
def role_engine(pg_dsn, schema, privileges="SELECT, INSERT, UPDATE, DELETE"):
    """An engine of a new role with USAGE on the schema and ``privileges`` on its tables (not
    their owner); the role dropped afterwards."""
    role = f"maintd_noown_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO {role}')
        conn.execute(f'GRANT {privileges} ON ALL TABLES IN SCHEMA "{schema}" TO {role}')
    engine = make_engine(pg_dsn.replace("postgres@", f"{role}@", 1), application_name="t")
    try:
        yield engine
    finally:
        engine.dispose()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'REVOKE ALL ON ALL TABLES IN SCHEMA "{schema}" FROM {role}')
            conn.execute(f'REVOKE ALL ON SCHEMA "{schema}" FROM {role}')
            conn.execute(f"DROP ROLE {role}")


def test_role_without_ownership_gets_a_clear_error(pg_dsn, pg_version, schema, settings):
    with role_engine(pg_dsn, schema) as engine:
        settings.reindexer.indexes = ["jobs_pkey"]
        result = run(settings, engine)
        [report] = result.indexes
        assert (report.index, report.outcome) == ("jobs_pkey", "not_permitted") and result.failed()
        assert "needs ownership of the jobs table" in report.error
        # MAINTAIN is named where the server has it: before 17 the advice was a privilege that
        # does not exist there (GRANT MAINTAIN fails: 'unrecognized privilege type').
        if pg_version >= 17:
            assert "needs ownership of the jobs table (or MAINTAIN on it): run" in report.error, report.error
        else:
            assert "MAINTAIN" not in report.error and "the jobs table: run" in report.error, report.error
        # A runtime role that is not the owner should not run the reindexer at all: the error
        # says so, and what the owner runs instead (a newcomer's walk found only "run as owner").
        assert "keep it off (the default) and have the owner run REINDEX INDEX CONCURRENTLY" in report.error
        # Issue 28: `run-once reindexer --dry-run` as the runtime role planned indexes it could
        # not reindex. It now says so for each (and the dry run itself does not fail).
        settings.reindexer.indexes = []
        dry = run(settings, engine, dry_run=True)
        assert dry.indexes and {r.outcome for r in dry.indexes} == {"not_permitted"} and not dry.failed()
        assert all("run the reindexer as the owner role" in r.error for r in dry.indexes)


def test_runner_does_not_schedule_it_when_disabled(pg_dsn, schema, settings, engine):
    from maintd.metrics import Metrics
    from maintd.runner import Runner
    from maintd.services.base import NoFence

    before = index_oids(pg_dsn, schema)
    runner = Runner(settings, engine, Metrics())
    runner.start()
    try:
        runner.activate(NoFence())
        wait_for(lambda: runner.timetable.get_jobs(), 5, what="the term's services scheduled")
        assert "reindexer" not in {j.id for j in runner.timetable.get_jobs()}
        wait_for(lambda: runner.clock.skew() is not None, 10, what="the server's time read by a pass")
        settings.reindexer.enabled = True
        runner.reload(settings)
        job = runner.timetable.get_job("reindexer")
        # At the server's midnight (host and server share a clock here, up to the reading's error).
        midnight = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0) + timedelta(days=1)
        assert job is not None and abs(job.next_run_time - midnight) < timedelta(seconds=1), job.next_run_time
    finally:
        runner.shutdown()
    assert index_oids(pg_dsn, schema) == before  # nothing was rebuilt (REINDEX CONCURRENTLY makes new oids)


class LateFastClock(ServerClock):
    """The server's time runs 5 minutes ahead of the host's clock, and is unknown until ``known``
    is set (a daemon whose first pass has not read it yet)."""

    def __init__(self) -> None:
        super().__init__()
        self.known = threading.Event()

    def now(self) -> datetime:
        return datetime.now(timezone.utc) + timedelta(minutes=5)

    def skew(self) -> timedelta | None:
        return timedelta(minutes=5) if self.known.is_set() else None


def test_its_cron_slots_are_the_server_s_time_not_the_host_s(pg_dsn, schema, settings, engine):
    """The reindexer's "0 0 * * *" is the server's midnight: with the host's clock 5 minutes slow,
    APScheduler (on the host's clock) fires at the host's 23:55. Until the server's time is known,
    the job waits and is scheduled again a second later (it would have fired at the host's
    midnight, 5 minutes late)."""
    from apscheduler.triggers.date import DateTrigger

    from maintd.metrics import Metrics
    from maintd.runner import Runner
    from maintd.schedules import ScheduleTrigger
    from maintd.services.base import NoFence

    settings.reindexer.enabled = True
    clock = LateFastClock()
    runner = Runner(settings, engine, Metrics(), clock=clock)
    runner.start()
    try:
        runner.activate(NoFence())
        job = wait_for(lambda: runner.timetable.get_job("reindexer"), 5, what="the term's services scheduled")
        assert isinstance(job.trigger, DateTrigger)
        clock.known.set()
        # (the one-off job is gone from the timetable once it fired, until it scheduled the real one)
        wait_for(lambda: isinstance(getattr(runner.timetable.get_job("reindexer"), "trigger", None), ScheduleTrigger),
                 5, what="the reindexer scheduled on the server's time")
        job = runner.timetable.get_job("reindexer")
        server_midnight = (clock.now() + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
        assert job.next_run_time == server_midnight - timedelta(minutes=5), job.next_run_time
    finally:
        runner.shutdown()


def test_a_fenced_pass_counts_no_attempt_it_never_made(pg_dsn, schema, engine):
    """SPEC 8.4: a pass whose leadership was refused before an index's rebuild reported that index
    as ``planned`` (a dry run's word) and counted it in maintd_reindex_total{outcome="planned"},
    an attempt that never happened. Indexes done before the refusal stay as they were."""
    from maintd.metrics import Metrics
    from maintd.passes import Outcome, execute_pass
    from maintd.services.base import NotLeader

    class RefusedAfter:
        epoch = 4

        def __init__(self, n):
            self.n = n

        def check(self, conn):
            self.n -= 1
            if self.n < 0:
                raise NotLeader("epoch 4 is over")

    settings = Settings(database_url=pg_dsn, schema=schema,
                        reindexer={"enabled": True, "indexes": ["jobs_fetch_idx", "jobs_scheduled_idx"]})
    metrics = Metrics(target=schema)
    before = index_oids(pg_dsn, schema)
    ctx = PassContext.for_settings(settings, engine, ServerClock(), fence=RefusedAfter(1))
    record = execute_pass("reindexer", Reindexer(settings.reindexer), ctx, metrics)
    assert record.outcome is Outcome.FENCED
    after = index_oids(pg_dsn, schema)
    assert after["jobs_fetch_idx"] != before["jobs_fetch_idx"]  # rebuilt before the refusal
    assert after["jobs_scheduled_idx"] == before["jobs_scheduled_idx"]  # never tried
    outcomes = {r["index"]: r["outcome"] for r in record.as_dict()["result"]["indexes"]}
    assert outcomes == {"jobs_fetch_idx": "reindexed"}
    text_ = metrics.render().decode()
    assert 'outcome="planned"' not in text_, text_
    summary = record.as_dict()["summary"]
    assert summary.startswith("jobs_fetch_idx reindexed") and "jobs_scheduled_idx" not in summary, summary


def test_a_configured_index_of_another_table_is_named_as_such(pg_dsn, schema, settings, engine, caplog):
    """An index of another table of the schema (the periodic_jobs table's key, say) was reported
    'configured index does not exist': it exists, and the reindexer rebuilds only the jobs
    table's. The line and the report now say which table it belongs to."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        [(name,)] = conn.execute("SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                                 "WHERE i.indrelid = to_regclass(%s) AND i.indisprimary", (f'"{schema}".periodic_jobs',)).fetchall()
    settings.reindexer.indexes = [name]
    [report] = run(settings, engine).indexes
    assert (report.index, report.outcome) == (name, "missing")
    said = [r.getMessage() for r in caplog.records if r.name == "maintd.reindexer"]
    assert not any("does not exist" in m for m in said), said
    assert "periodic_jobs" in (report.error or ""), report


def test_a_size_that_cannot_be_read_after_a_rebuild_leaves_it_reindexed(pg_dsn, schema, settings, engine):
    """The rebuild is done when REINDEX returns; reading the new size is a report's detail. An
    index dropped by someone else right then failed that read, and the rebuild was reported
    ``error`` (counted in maintd_reindex_total{outcome="error"}), though it had succeeded."""
    settings.reindexer.indexes = ["jobs_kind_dropped_idx"]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE INDEX jobs_kind_dropped_idx ON "{schema}".jobs (kind)')

    class DroppedRightAfter(Reindexer):
        def _size(self, ctx, index):
            with psycopg.connect(pg_dsn, autocommit=True) as conn:  # another session, right then
                conn.execute(f'DROP INDEX "{schema}".jobs_kind_dropped_idx')
            return super()._size(ctx, index)

    [report] = DroppedRightAfter(settings.reindexer).run_once(
        PassContext.for_settings(settings, engine, ServerClock())).indexes
    assert (report.outcome, report.bytes_after, report.error) == ("reindexed", None, None), report


def test_a_stop_before_a_rebuild_starts_reports_no_attempt(pg_dsn, schema, settings, engine):
    """A demotion or shutdown that lands after an index is looked at but before its REINDEX is
    sent cancelled nothing: that index was reported ``cancelled`` (and counted in
    maintd_reindex_total{outcome="cancelled"}) though no rebuild was ever started."""
    from maintd.passes import Outcome, execute_pass

    settings.reindexer.indexes = ["jobs_pkey", "jobs_finalized_idx"]
    before = index_oids(pg_dsn, schema)
    ctx = PassContext.for_settings(settings, engine, ServerClock())

    class StoppedWhileMeasuring(Reindexer):
        def _bloat(self, ctx, index, has_pgstattuple):
            if index == "jobs_finalized_idx":
                ctx.stop_event.set()  # the demotion arrives now
            return super()._bloat(ctx, index, has_pgstattuple)

    record = execute_pass("reindexer", StoppedWhileMeasuring(settings.reindexer), ctx)
    assert record.outcome is Outcome.STOPPED
    assert [(r.index, r.outcome) for r in record.result.indexes] == [("jobs_pkey", "reindexed")], record.result
    assert index_oids(pg_dsn, schema)["jobs_finalized_idx"] == before["jobs_finalized_idx"]


def test_a_maintain_holder_rebuilds_and_names_the_leftover_only_the_owner_may_drop(pg_dsn, pg_version, schema,
                                                                                  settings, caplog):
    """PostgreSQL 17+: MAINTAIN on the jobs table allows REINDEX, not DROP INDEX (owner only). Such
    a role tried to drop an earlier build's leftover first, got 'must be owner of index ..._ccnew',
    and failed the index with '(REINDEX CONCURRENTLY needs ownership ...)': the index was never
    rebuilt again, on any pass, and the log promised 'the next pass will' drop it. The rebuild now
    runs; the leftover is kept, named, with what the owner must do, and the pass fails. Before 17
    there is no MAINTAIN: the same role without ownership may do neither, and is told so."""
    maintain = pg_version >= 17
    seed(pg_dsn, schema, 200)
    make_invalid(pg_dsn, schema, "jobs_fetch_idx_ccnew")
    before = index_oids(pg_dsn, schema)
    with role_engine(pg_dsn, schema, "SELECT, INSERT, UPDATE, DELETE" + (", MAINTAIN" if maintain else "")) as engine:
        settings.reindexer.indexes = ["jobs_fetch_idx"]
        dry = run(settings, engine, dry_run=True)
        assert dry.indexes[0].artifacts_dropped == [], dry.indexes[0]  # it would not drop it
        result = run(settings, engine)
    [report] = result.indexes
    if not maintain:  # PostgreSQL 15, 16: nothing tried, and said why
        assert report.outcome == "not_permitted" and result.failed(), report
        assert index_oids(pg_dsn, schema) == before  # neither rebuilt nor the leftover dropped
        return
    assert report.outcome == "reindexed", (report.outcome, report.error)
    assert index_oids(pg_dsn, schema)["jobs_fetch_idx"] != before["jobs_fetch_idx"]
    assert report.leftovers_kept == ["jobs_fetch_idx_ccnew"] and result.failed(), report
    assert "DROP INDEX" in report.error and "owner" in report.error and "REINDEX CONCURRENTLY needs" not in report.error
    assert not any("the next pass will" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("layout", ["partitioned"], indirect=True)
def test_a_configured_partitioned_index_of_jobs_is_named_as_such(pg_dsn, schema, settings, engine, caplog):
    """SPEC 8.1: on the partitioned layout jobs_finalized_idx (a name of the plain layout's
    defaults, valid in a config written for it) is a partitioned index of jobs itself. It was
    reported 'an index of the jobs table, not of jobs' and logged 'configured index is not the jobs
    table's' with table=jobs: a contradiction that tells the operator nothing. It now says what
    the index is and what the reindexer rebuilds instead."""
    settings.reindexer.indexes = ["jobs_finalized_idx"]
    [report] = run(settings, engine).indexes
    assert (report.index, report.outcome) == ("jobs_finalized_idx", "missing")
    assert "not of jobs" not in (report.error or "") and "partitioned index" in (report.error or ""), report
    assert "jobs_live_state_finalized_at_id_idx" in report.error, report.error
    said = [r.getMessage() for r in caplog.records if r.name == "maintd.reindexer"]
    assert not any("not the jobs table's" in m for m in said), said


@pytest.mark.both_layouts
def test_the_catalog_bloat_estimate_of_a_fresh_index_is_low_on_both_layouts(pg_dsn, schema, settings, engine, layout):
    """The catalog estimate read the columns' widths from pg_stats of the table named 'jobs'. On
    the partitioned layout the rebuilt indexes are the live partition's (jobs_live), whose
    statistics are under jobs_live (autovacuum never analyzes a partitioned parent): every width
    defaulted to 8 bytes, a fresh four-column jobs_fetch_idx read as about half bloat, and with
    bloat_threshold set it was rebuilt on every pass though healthy."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"INSERT INTO \"{schema}\".jobs (kind, queue) "
                     f"SELECT 'k', 'queue_' || (i % 7) FROM generate_series(1, 20000) i")
    settings.reindexer.indexes = ["jobs_fetch_idx"]
    [first] = run(settings, engine).indexes  # no threshold: rebuilt, fresh
    assert first.outcome == "reindexed", first
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # what autovacuum analyzes
        conn.execute(f'ANALYZE "{schema}".{"jobs_live" if layout == "partitioned" else "jobs"}')
    settings.reindexer.bloat_threshold = 30
    [fresh] = run(settings, engine).indexes
    assert fresh.outcome == "skipped" and fresh.bloat_percent < 30, fresh


def test_a_leftover_of_a_long_non_ascii_name_is_found_under_its_cut_name(pg_dsn, schema, settings, engine):
    """PostgreSQL cuts a name to fit 63 *bytes*, at a character's boundary: the leftover of a long
    name with two-byte characters is 62 bytes, fewer than 63 characters, and was taken for
    another index: never dropped, never reported."""
    seed(pg_dsn, schema, 100)
    long_name = "jobs" + "é" * 29  # 62 bytes
    leave_ccnew(pg_dsn, schema, long_name)
    [leftover] = [name for name in indexes(pg_dsn, schema) if name.endswith("_ccnew")]
    assert leftover == "jobs" + "é" * 26 + "_ccnew", leftover
    reports = {r.index: r for r in run(settings, engine).indexes}  # the default list: every index of jobs
    assert leftover not in reports, reports
    report = reports[long_name]
    assert report.outcome == "reindexed" and report.artifacts_dropped == [leftover], report
    assert leftover not in indexes(pg_dsn, schema)


def test_a_stop_while_the_rebuild_s_connection_is_prepared_starts_no_rebuild(pg_dsn, schema, settings, engine,
                                                                              monkeypatch):
    """The runner's stop (a demotion, a shutdown) sets the flag, then cancels the statement its
    pass tracks. One landing after the last look at the flag, while the DDL's own connection was
    checked out and given its timeouts (before it was tracked), found nothing to cancel: the
    REINDEX was sent anyway and ran to its end (up to ``timeout``) on an instance that no longer
    led, and the index was reported ``reindexed``. Now the flag is looked at again once the
    connection is tracked, right before the statement is sent."""
    from maintd.passes import Outcome, execute_pass
    from maintd.runner import _stop
    from maintd.services import base

    settings.reindexer.indexes = ["jobs_finalized_idx"]
    before = index_oids(pg_dsn, schema)
    ctx = PassContext.for_settings(settings, engine, ServerClock())
    set_session = base._set_session

    def stopped_meanwhile(conn, **values):
        if not ctx.stop_event.is_set():
            _stop(ctx)  # the demotion arrives while the DDL's connection gets its timeouts
        set_session(conn, **values)

    monkeypatch.setattr(base, "_set_session", stopped_meanwhile)
    record = execute_pass("reindexer", Reindexer(settings.reindexer), ctx)
    assert record.outcome is Outcome.STOPPED, (record.outcome, record.error)
    assert index_oids(pg_dsn, schema)["jobs_finalized_idx"] == before["jobs_finalized_idx"]  # not rebuilt
    assert record.result.indexes == [], record.result


@pytest.mark.parametrize("layout", ["partitioned"], indirect=True)
def test_on_the_partitioned_layout_a_refusal_names_the_live_partition_whose_privilege_is_missing(
        pg_dsn, pg_version, schema, settings):
    """SPEC 8.1: the rebuilt indexes are the live partition's (jobs_live), and PostgreSQL checks
    ownership or MAINTAIN (17+) on that table itself: MAINTAIN granted on jobs, as the refusal
    said ('needs ownership of the jobs table (or MAINTAIN on it ...)'), does not reach its
    partition, and the same refusal came back however often it was followed. It now names
    jobs_live, and granting what it names lets the role rebuild."""
    seed(pg_dsn, schema, 200)
    maintain = pg_version >= 17
    settings.reindexer.indexes = ["jobs_fetch_idx"]
    with role_engine(pg_dsn, schema, "SELECT, INSERT, UPDATE, DELETE") as engine:
        with engine.connect() as conn:
            role = conn.execute(text("SELECT current_user")).scalar()
        if maintain:  # what the refusal said to grant
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute(f'GRANT MAINTAIN ON "{schema}".jobs TO {role}')
        [report] = run(settings, engine).indexes
        assert report.outcome == "not_permitted", report
        assert "ownership of the jobs_live table" in report.error, report.error
        assert ("MAINTAIN" in report.error) is maintain, report.error  # named where it exists (17+)
        if maintain:
            assert "MAINTAIN on the partitioned jobs table does not reach" in report.error, report.error
            with psycopg.connect(pg_dsn, autocommit=True) as conn:  # what it says now
                conn.execute(f'GRANT MAINTAIN ON "{schema}".jobs_live TO {role}')
            [report] = run(settings, engine).indexes
            assert report.outcome == "reindexed", report
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'REVOKE ALL ON "{schema}".jobs, "{schema}".jobs_live FROM {role}')


def test_a_pass_failed_by_a_kept_leftover_names_it_in_its_error_and_summary(pg_dsn, pg_version, schema, settings):
    """PostgreSQL 17+: a MAINTAIN holder rebuilds the index but may not drop an earlier build's
    leftover, and the pass fails for it. The pass's error ('part of the pass failed:
    jobs_fetch_idx=reindexed') and its summary ('jobs_fetch_idx reindexed'), what `maintd status`,
    /status and the dashboard show, named nothing that failed: the leftover and what to do
    were only in the result's details and a log line. Before 17 (no MAINTAIN) the index is
    not_permitted, which both name."""
    from maintd.passes import Outcome, execute_pass

    maintain = pg_version >= 17
    seed(pg_dsn, schema, 200)
    make_invalid(pg_dsn, schema, "jobs_fetch_idx_ccnew")
    settings.reindexer.indexes = ["jobs_fetch_idx"]
    with role_engine(pg_dsn, schema, "SELECT, INSERT, UPDATE, DELETE" + (", MAINTAIN" if maintain else "")) as engine:
        ctx = PassContext.for_settings(settings, engine, ServerClock())
        record = execute_pass("reindexer", Reindexer(settings.reindexer), ctx)
    assert record.outcome is Outcome.ERROR, (record.outcome, record.error)
    said = record.as_dict()
    if not maintain:
        assert "not_permitted" in record.error and "not_permitted" in said["summary"], said
        return
    assert "jobs_fetch_idx_ccnew" in record.error, record.error
    assert "jobs_fetch_idx_ccnew" in said["summary"], said["summary"]


def test_pgstatindex_is_called_in_the_extension_s_schema_not_whatever_the_search_path_finds(pg_dsn):
    """The bloat estimate called ``pgstatindex(...)`` unqualified whenever pgstattuple was installed
    anywhere in the database: with the extension in a schema of its own (``extensions``, as
    hosted services do) and a ``pgstatindex(regclass)`` planted in ``public`` by a role that may
    create there, every pass ran the planted function as the reindexer's role (the owner, or a
    superuser): PostgreSQL's CVE-2018-1058 pattern. It now calls the extension's own function."""
    with migrated_database(pg_dsn) as (dsn, engine):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE SCHEMA extensions")
            conn.execute("CREATE EXTENSION pgstattuple SCHEMA extensions")
            conn.execute("""CREATE FUNCTION public.pgstatindex(regclass) RETURNS TABLE (avg_leaf_density float8)
                            LANGUAGE sql AS $$ SELECT float8 '-1000' $$""")  # its figure: 1090 % bloat
            conn.execute("INSERT INTO maintd.jobs (kind) SELECT 'k' FROM generate_series(1, 2000)")
            density = conn.execute("SELECT avg_leaf_density FROM extensions.pgstatindex('maintd.jobs_pkey')").fetchone()[0]
        settings = Settings(database_url=dsn, schema="maintd", reindexer={"indexes": ["jobs_pkey"]})
        [report] = run(settings, engine, dry_run=True).indexes
        assert report.bloat_percent == round(max(0.0, 90 - density), 1), (report, density)


def test_a_conversions_copy_under_way_is_not_rebuilt(pg_dsn, schema, settings, engine):
    """While `migrate --convert partitioned` copies a plain table, the copy's live partition is
    named jobs_live already (its indexes suffixed _conv, renamed at the swap). The default "every
    jobs index" took them in: a rebuild of the copy, and a cancelled one's <x>_conv_ccnew outlived
    the swap under a name no leftover check matches, maintained on every write for good. The
    reindexer leaves the copy alone; the swap gives it the real names."""
    from maintd import convert

    seed(pg_dsn, schema, 200)
    owner = make_engine(pg_dsn, application_name="convert", pooled=False)
    try:
        with owner.connect() as conn:  # prepared, the copy begun, then stopped: resumable
            assert convert.convert(conn, schema, migrate.Layout("partitioned", timedelta(hours=1), 2),
                                   say=lambda _: None, stop=lambda: True) == "stopped"
        with psycopg.connect(pg_dsn) as conn:  # the test shows something: the copy's indexes are there
            assert conn.execute("SELECT count(*) FROM pg_indexes WHERE schemaname = %s AND tablename = 'jobs_live' "
                                "AND indexname LIKE '%%\\_conv'", (schema,)).fetchone()[0] > 0
        result = run(settings, engine)
        assert {r.index for r in result.indexes} == {
            "jobs_pkey", "jobs_fetch_idx", "jobs_scheduled_idx", "jobs_finalized_idx", "jobs_running_idx",
            "jobs_unique_key_idx", "jobs_exhausted_idx", "jobs_finalized_queue_idx"}
    finally:
        with owner.connect() as conn:
            convert.abandon(conn, schema, say=lambda _: None)
        owner.dispose()
