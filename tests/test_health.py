"""Table health (SPEC 8.2, issue 27): each kind of holder of the xmin horizon named as PostgreSQL
shows it, the gauges, the once-per-holder warning, and the metric dropping back once the holder
ends.

The holders are made on a server of this module's own (``wal_level = logical`` for a logical slot,
``max_prepared_transactions`` > 0 for a prepared transaction), of the suite's major version: the
horizon is the whole database's, so the shared server's other tests would hold it too. The
standby's ``hot_standby_feedback`` runs on tests/standby.py's PostgreSQL 15 pair.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from contextlib import contextmanager, nullcontext
from datetime import datetime, timedelta, timezone
from typing import Any, Iterator

import psycopg
import pytest
from sqlalchemy import Engine

from maintd import migrate
from maintd.config import Settings
from maintd.daemon import Daemon
from maintd.db import make_engine
from maintd.health import HealthReader, HealthReport, HolderWarnings, Horizon, Holder, TableHealth, apply_metrics
from maintd.metrics import Metrics
from maintd.queries import health as q
from maintd.queries import psycopg_sql

from .conftest import private_server
from .procs import wait_for
from .scenarios import record

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def health_pg(pg_version: int) -> Iterator[str]:
    """A server of this module's own, migrated (schema maintd); its DSN."""
    with private_server(pg_version, {"wal_level": "logical", "max_prepared_transactions": "4",
                                     "max_replication_slots": "4", "autovacuum": "off"}) as pg:
        engine = make_engine(pg.dsn, application_name="maintd-test-migrate", pooled=False)
        with engine.connect() as conn:
            migrate.upgrade(conn, "maintd")
        engine.dispose()
        yield pg.dsn


@pytest.fixture
def health_engine(health_pg: str) -> Iterator[Engine]:
    engine = make_engine(health_pg, application_name="maintd-test-health", pooled=False)
    yield engine
    engine.dispose()


def read(engine: Engine, reader: HealthReader | None = None, schemas=("maintd",)):
    with engine.connect() as conn:
        return (reader or HealthReader()).read(conn.connection.dbapi_connection, list(schemas))


def consume_xids(dsn: str, n: int = 3) -> None:
    """Assign transaction ids after a holder's xmin (before that it holds nothing back)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(n):
            conn.execute("SELECT txid_current()")


def held_by(report, pid: int) -> Holder:
    [holder] = [h for h in report.horizon.holders if h.pid == pid]
    return holder


# -- each kind of holder, named -----------------------------------------------------------------

def test_a_repeatable_read_snapshot_is_named_without_its_query(health_pg, health_engine):
    with psycopg.connect(health_pg, application_name="nightly-report") as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM maintd.jobs WHERE kind = 'secret@example.com'")
        pid = holder.info.backend_pid
        consume_xids(health_pg)
        time.sleep(1.1)  # named once older than a second
        report = read(health_engine)
        h = held_by(report, pid)
        assert (h.kind, h.scope, h.user, h.application_name, h.client_addr, h.state) == \
            ("snapshot", "data", "postgres", "nightly-report", "127.0.0.1", "idle in transaction")
        assert h.exact and 1.0 <= h.age_seconds < 60 and h.age_xids >= 3
        assert report.horizon.holder == h and report.horizon.age_seconds >= h.age_seconds
        status = json.dumps(report.status("maintd"))
        assert "secret@example.com" not in status and '"query"' not in status
        shown = held_by(read(health_engine, HealthReader(show_query=True)), pid)
        assert "secret@example.com" in shown.query
        with psycopg.connect(health_pg, autocommit=True) as conn:  # not even read off the server
            texts = conn.execute(psycopg_sql(q.HOLDERS), {"show_query": False}).fetchall()
        assert texts and all(r[-1] is None for r in texts)


def test_a_read_late_in_a_transaction_ages_holders_from_the_read_not_from_its_start(health_pg, health_engine):
    """`maintd status` reads the health last in its transaction, after the job counts (up to 5 s):
    ages counted from now() (the transaction's start) were short by that much, and a holder that
    began meanwhile was aged 0 and not named at all."""
    from maintd.health import read_once

    with health_engine.connect() as conn:
        conn.exec_driver_sql("SELECT 1")  # its transaction, and now(), begin here
        with psycopg.connect(health_pg, application_name="late-report") as holder:
            time.sleep(0.5)
            holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT count(*) FROM maintd.jobs")
            consume_xids(health_pg)
            time.sleep(1.5)
            h = held_by(read_once(conn, "maintd"), holder.info.backend_pid)
            assert h.application_name == "late-report" and 1.4 <= h.age_seconds < 60, h


def test_a_read_in_an_older_snapshot_does_not_count_its_own_snapshot_as_holding_the_horizon(health_pg, health_engine):
    """HealthReader.read may run in a caller's transaction: one under REPEATABLE READ holds its
    snapshot from its first statement, older than the ids assigned since. That snapshot is the
    reader's own, not a holder to report: with nothing else holding, the horizon is 0 ids and
    0 s old and names no one (counted, it said 3 ids behind)."""
    from maintd.health import read_once

    with health_engine.connect() as conn:
        conn = conn.execution_options(isolation_level="REPEATABLE READ")
        conn.exec_driver_sql("SELECT 1")  # the snapshot, taken here
        consume_xids(health_pg)
        time.sleep(1.1)
        horizon = read_once(conn, "maintd").horizon
        assert (horizon.age_xids, horizon.age_seconds, horizon.holders) == (0, 0.0, ()), horizon


def test_an_idle_in_transaction_session_holding_a_transaction_id_is_named(health_pg, health_engine):
    with psycopg.connect(health_pg, application_name="forgetful-worker") as holder:
        holder.execute("INSERT INTO maintd.jobs (kind) VALUES ('held')")  # an xid, then idle
        pid = holder.info.backend_pid
        consume_xids(health_pg)
        time.sleep(1.1)
        h = held_by(read(health_engine), pid)
        assert (h.kind, h.state, h.application_name) == ("transaction", "idle in transaction", "forgetful-worker")
        assert h.exact and h.age_xids >= 3
        holder.rollback()


def test_a_prepared_transaction_is_named_by_its_gid(health_pg, health_engine):
    with psycopg.connect(health_pg, autocommit=True) as conn:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO maintd.jobs (kind) VALUES ('prepared')")
        conn.execute("PREPARE TRANSACTION 'maintd-test-2pc'")
        try:
            consume_xids(health_pg)
            time.sleep(1.1)
            [h] = [h for h in read(health_engine).horizon.holders if h.kind == "prepared_transaction"]
            assert (h.name, h.user, h.pid, h.exact) == ("maintd-test-2pc", "postgres", None, True)
            assert h.age_seconds >= 1.0 and h.age_xids >= 3
            assert "prepared transaction 'maintd-test-2pc'" in h.describe()
        finally:
            conn.execute("ROLLBACK PREPARED 'maintd-test-2pc'")


def test_a_transaction_in_another_database_is_named_with_its_database(health_pg, health_engine):
    """A transaction id running in another database is below the xmin of every snapshot taken in
    this one meanwhile (PostgreSQL's GetSnapshotData() reads the ids of every database), so the
    workers' snapshots keep VACUUM from the jobs table's dead rows for as long as it runs; so does
    a prepared transaction of another database. Both were left out (only this database's
    backends and prepared transactions were read), and a worker's snapshot was blamed instead.
    Another database's snapshot without a transaction id holds back only that database."""
    with psycopg.connect(health_pg, autocommit=True) as admin:
        admin.execute("DROP DATABASE IF EXISTS maintd_other")
        admin.execute("CREATE DATABASE maintd_other")
    from psycopg.conninfo import make_conninfo

    other_dsn = make_conninfo(health_pg, dbname="maintd_other")
    try:
        with psycopg.connect(other_dsn, application_name="elsewhere") as other, \
                psycopg.connect(other_dsn) as reader_there, psycopg.connect(health_pg) as worker:
            xid = other.execute("SELECT txid_current()").fetchone()[0]  # then idle in transaction
            reader_there.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            reader_there.execute("SELECT 1")  # a snapshot there, no transaction id
            consume_xids(health_pg)
            worker.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            worker.execute("SELECT 1")
            assert worker.execute("SELECT backend_xmin::text::bigint FROM pg_stat_activity "
                                  "WHERE pid = pg_backend_pid()").fetchone()[0] == xid % 2**32
            worker.rollback()
            with psycopg.connect(other_dsn, autocommit=True) as prep:
                prep.execute("BEGIN")
                prep.execute("SELECT txid_current()")
                prep.execute("PREPARE TRANSACTION 'maintd-test-other-2pc'")
            try:
                consume_xids(health_pg)
                time.sleep(1.1)
                report = read(health_engine)
                holders = report.horizon.holders
                h = held_by(report, other.info.backend_pid)
                assert (h.kind, h.detail, h.application_name, h.exact) == (
                    "transaction", "in database maintd_other", "elsewhere", True)
                assert h.xmin == str(xid % 2**32) and h.age_xids >= 6
                assert "in database maintd_other" in h.describe()
                assert all(x.pid != reader_there.info.backend_pid for x in holders)
                [p] = [x for x in holders if x.kind == "prepared_transaction"]
                assert (p.name, p.detail) == ("maintd-test-other-2pc", "in database maintd_other")
            finally:
                with psycopg.connect(other_dsn, autocommit=True) as prep:
                    prep.execute("ROLLBACK PREPARED 'maintd-test-other-2pc'")
            other.rollback()
            reader_there.rollback()
    finally:
        with psycopg.connect(health_pg, autocommit=True) as admin:
            admin.execute("DROP DATABASE IF EXISTS maintd_other")


@contextmanager
def in_background(dsn: str, statement: str, **params: Any) -> Iterator[psycopg.Connection]:
    """``statement`` running on a session of its own (``params``: libpq's) while the block runs;
    then cancelled, and the session closed."""
    session = psycopg.connect(dsn, autocommit=True, **params)
    done = threading.Event()

    def run() -> None:
        try:
            session.execute(statement)
        except psycopg.Error:
            pass  # cancelled below
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    try:
        yield session
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_cancel_backend(%s)", (session.info.backend_pid,))
        done.wait(10)
        session.close()


def test_a_lazy_vacuum_is_not_named_however_long_it_runs(health_pg, health_engine):
    """A lazy VACUUM's xmin is ignored by other vacuums (PROC_IN_VACUUM, in PostgreSQL's
    ComputeXidHorizons()). Only autovacuum workers were left out, by backend_type: a manual
    VACUUM (vacuumdb, a client backend) was named as a holder, and so was an autovacuum worker
    whenever backend_type is hidden (a role without pg_read_all_stats). Now every pid in
    pg_stat_progress_vacuum, which every role may read, is left out."""
    with psycopg.connect(health_pg, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS slow_vacuum")
        conn.execute("CREATE TABLE slow_vacuum AS SELECT g AS id, repeat('x', 200) AS pad "
                      "FROM generate_series(1, 100000) AS g")
        conn.execute("DELETE FROM slow_vacuum WHERE id % 2 = 0")
    try:
        with in_background(health_pg, "VACUUM slow_vacuum", options="-c vacuum_cost_delay=100 -c vacuum_cost_limit=1") as slow, \
                psycopg.connect(health_pg, autocommit=True) as conn:
            pid = slow.info.backend_pid
            wait_for(lambda: conn.execute("SELECT count(*) FROM pg_stat_progress_vacuum WHERE pid = %s",
                                          (pid,)).fetchone()[0], 10, what="the VACUUM under way")
            consume_xids(health_pg)
            time.sleep(1.1)
            xmin = conn.execute("SELECT backend_xmin FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0]
            assert xmin is not None, "this VACUUM holds no xmin: the test shows nothing"
            assert all(h.pid != pid for h in read(health_engine).horizon.holders)
    finally:
        with psycopg.connect(health_pg, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS slow_vacuum")


def test_a_parallel_vacuums_workers_are_not_named_either(health_pg, health_engine):
    """VACUUM (PARALLEL n) vacuums indexes in parallel workers, which share its snapshot and its
    PROC_IN_VACUUM (other vacuums ignore them too) but are not in pg_stat_progress_vacuum
    themselves (their leader is): they were named as snapshot holders while they ran."""
    with psycopg.connect(health_pg, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS par_vacuum")
        conn.execute("CREATE TABLE par_vacuum AS SELECT g AS id FROM generate_series(1, 30000) AS g")
        for i in range(3):
            conn.execute(f"CREATE INDEX par_vacuum_{i} ON par_vacuum ((md5(id::text) || md5((id + {i})::text)))")
        conn.execute("DELETE FROM par_vacuum WHERE id % 2 = 0")
    try:
        with in_background(health_pg, "VACUUM (PARALLEL 2) par_vacuum",
                           options="-c vacuum_cost_delay=20 -c vacuum_cost_limit=20 -c min_parallel_index_scan_size=0") as slow, \
                psycopg.connect(health_pg, autocommit=True) as conn:
            workers = wait_for(lambda: conn.execute(
                "SELECT array_agg(pid) FROM pg_stat_activity WHERE leader_pid = %s AND backend_xmin IS NOT NULL",
                (slow.info.backend_pid,)).fetchone()[0], 30, interval=0.05, what="the parallel workers")
            conn.execute("INSERT INTO maintd.jobs (kind) SELECT 'parallel' FROM generate_series(1, 200)")
            conn.execute("DELETE FROM maintd.jobs WHERE kind = 'parallel'")
            consume_xids(health_pg)
            conn.execute("SELECT pg_stat_force_next_flush()")  # before VACUUM's own count
            conn.execute("VACUUM maintd.jobs")  # the workers' snapshot does not hold it back
            assert conn.execute("SELECT pg_stat_get_dead_tuples('maintd.jobs'::regclass)").fetchone()[0] == 0
            time.sleep(1.1)
            named = [h for h in read(health_engine).horizon.holders if h.pid in workers]
            still = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (workers,)).fetchone()[0]
            assert still, "the workers are done already: the test shows nothing"
            assert named == [], named
    finally:
        with psycopg.connect(health_pg, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS par_vacuum")


def test_a_parallel_query_is_one_holder_not_one_per_worker(health_pg, health_engine, maintd_log):
    """A parallel query's workers hold the snapshot their leader holds: each was named, and
    warned about, as a holder of its own (a line per worker for every long report)."""
    with psycopg.connect(health_pg, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS par_query")
        conn.execute("CREATE TABLE par_query AS SELECT g AS id FROM generate_series(1, 20000) AS g")
        conn.execute("ANALYZE par_query")
    try:
        with in_background(health_pg, "SELECT count(*) FROM par_query WHERE pg_sleep(0.0005) IS NOT NULL",
                           application_name="bi-report",
                           options="-c max_parallel_workers_per_gather=2 -c parallel_setup_cost=0 "
                                   "-c parallel_tuple_cost=0 -c min_parallel_table_scan_size=0") as report, \
                psycopg.connect(health_pg, autocommit=True) as conn:
            workers = wait_for(lambda: conn.execute(
                "SELECT array_agg(pid) FROM pg_stat_activity WHERE leader_pid = %s",
                (report.info.backend_pid,)).fetchone()[0], 10, interval=0.05, what="the parallel workers")
            consume_xids(health_pg)
            time.sleep(1.2)
            reader, warnings = HealthReader(), HolderWarnings()
            hz = read(health_engine, reader).horizon
            warnings.check(hz, timedelta(seconds=1), ["q"])
            assert conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)",
                                (workers,)).fetchone()[0], "the workers are done already: the test shows nothing"
            assert [h.pid for h in hz.holders] == [report.info.backend_pid], hz.holders
        assert len([line for line in maintd_log if "vacuum is held back" in line]) == 1, maintd_log
    finally:
        with psycopg.connect(health_pg, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS par_query")


def assert_holds_the_catalogs_only(engine: Engine, slot: str) -> None:
    """Two reads 1.1 s apart (PostgreSQL 15 keeps no time for a slot: counted from the first) name
    the logical slot ``slot`` as holding back the catalogs, 3 or more transaction ids behind, and
    not the jobs table."""
    reader = HealthReader()
    read(engine, reader)
    time.sleep(1.1)
    report = read(engine, reader)
    [h] = [h for h in report.horizon.catalog_holders if h.name == slot]
    assert (h.kind, h.scope, h.detail) == ("replication_slot", "catalog", "logical")
    assert h.age_xids >= 3
    assert all(x.name != slot for x in report.horizon.holders)


def test_a_logical_slot_holds_back_the_catalogs_not_the_jobs_table(health_pg, health_engine):
    """A logical slot's catalog_xmin: PostgreSQL's ComputeXidHorizons() applies it to catalog
    relations only. Named as such, and VACUUM indeed removes the jobs table's dead rows meanwhile."""
    with psycopg.connect(health_pg, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot('maintd_test_slot', 'test_decoding')")
        try:
            conn.execute("INSERT INTO maintd.jobs (kind) SELECT 'slot' FROM generate_series(1, 200)")
            conn.execute("DELETE FROM maintd.jobs WHERE kind = 'slot'")
            conn.execute("SELECT pg_stat_force_next_flush()")  # before VACUUM's own count
            consume_xids(health_pg)
            assert_holds_the_catalogs_only(health_engine, "maintd_test_slot")
            assert conn.execute("SELECT pg_stat_get_dead_tuples('maintd.jobs'::regclass)").fetchone()[0] >= 200
            conn.execute("VACUUM maintd.jobs")
            dead = conn.execute("SELECT pg_stat_get_dead_tuples('maintd.jobs'::regclass)").fetchone()[0]
            assert dead == 0, "the logical slot held back the jobs table after all"
        finally:
            conn.execute("SELECT pg_drop_replication_slot('maintd_test_slot')")


def test_a_logical_slot_of_another_database_is_named_as_holding_back_the_catalogs(health_pg, health_engine):
    """A logical slot's catalog_xmin is the server's, not its database's: PostgreSQL keeps the
    oldest catalog_xmin of all slots (ReplicationSlotsComputeRequiredXmin() reads every slot,
    whatever its database) and ComputeXidHorizons() applies it to the catalogs of every database
    (PostgreSQL docs, Logical Decoding Concepts, Replication Slots: "a logical slot will ... prevent
    VACUUM from removing required rows from the system catalogs"; the view pg_replication_slots,
    catalog_xmin: "The oldest transaction affecting the system catalogs that this slot needs the
    database to retain"). Only the slots of this database (and physical ones) were read, so a slot
    left behind by a subscription in another database held back this database's pg_class and
    pg_attribute (every partition maintd makes and drops) while /status named nothing."""
    from psycopg.conninfo import make_conninfo

    with psycopg.connect(health_pg, autocommit=True) as admin:
        admin.execute("DROP DATABASE IF EXISTS maintd_other_slot")
        admin.execute("CREATE DATABASE maintd_other_slot")
    other_dsn = make_conninfo(health_pg, dbname="maintd_other_slot")
    try:
        with psycopg.connect(other_dsn, autocommit=True) as other:
            other.execute("SELECT pg_create_logical_replication_slot('maintd_elsewhere_slot', 'test_decoding')")
        with psycopg.connect(health_pg, autocommit=True) as conn:
            def dead_catalog_rows_kept() -> int:
                conn.execute("CREATE TABLE maintd_catalog_churn (a int)")
                conn.execute("DROP TABLE maintd_catalog_churn")
                conn.execute("SELECT pg_stat_force_next_flush()")  # before VACUUM's own count
                consume_xids(health_pg)
                conn.execute("VACUUM pg_class")
                return conn.execute("SELECT pg_stat_get_dead_tuples('pg_class'::regclass)").fetchone()[0]

            assert dead_catalog_rows_kept() > 0, "VACUUM removed them: the slot held nothing back here"
            assert_holds_the_catalogs_only(health_engine, "maintd_elsewhere_slot")
            with psycopg.connect(other_dsn, autocommit=True) as other:
                other.execute("SELECT pg_drop_replication_slot('maintd_elsewhere_slot')")
            assert dead_catalog_rows_kept() == 0, "something else held the catalogs back"
    finally:
        with psycopg.connect(health_pg, autocommit=True) as admin:
            admin.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                          "WHERE slot_name = 'maintd_elsewhere_slot'")
            admin.execute("DROP DATABASE IF EXISTS maintd_other_slot")

def test_a_slots_age_does_not_restart_when_a_consumer_comes_and_goes(health_pg, health_engine):
    """PostgreSQL 17+'s inactive_since is when the slot was last released, not when its xmin began
    to hold: every consumer that connected and left without confirming anything (a crash loop, a
    peek) set the slot's age back to 0 while its xmin stayed where it was, and the alert never
    fired. Now the age is the earliest of inactive_since and the first read that saw it hold."""
    with psycopg.connect(health_pg, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot('maintd_flap_slot', 'test_decoding')")
        try:
            consume_xids(health_pg)
            reader = HealthReader()
            read(health_engine, reader)
            time.sleep(2.5)
            conn.execute("SELECT count(*) FROM pg_logical_slot_peek_changes('maintd_flap_slot', NULL, NULL)")
            [h] = [h for h in read(health_engine, reader).horizon.catalog_holders if h.name == "maintd_flap_slot"]
            assert h.age_seconds >= 2.0, h
        finally:
            conn.execute("SELECT pg_drop_replication_slot('maintd_flap_slot')")


def test_an_invalidated_slot_is_not_named_since_it_holds_nothing_back(health_pg, health_engine):
    """A slot invalidated by max_slot_wal_keep_size (wal_status 'lost'; on PostgreSQL 16+ also by
    idle_replication_slot_timeout, or a standby's conflict) keeps showing its xmin and catalog_xmin
    in pg_replication_slots, but PostgreSQL no longer applies them (VACUUM's removable cutoff
    passes them): it was named as a holder, aged, warned about for ever, until someone dropped it."""
    with psycopg.connect(health_pg, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
        conn.execute("SELECT pg_reload_conf()")
        conn.execute("SELECT pg_create_logical_replication_slot('maintd_lost_slot', 'test_decoding')")
        try:
            consume_xids(health_pg)
            for _ in range(4):  # past max_slot_wal_keep_size: the checkpoint invalidates the slot
                conn.execute("SELECT txid_current()")
                conn.execute("SELECT pg_switch_wal()")
            conn.execute("CHECKPOINT")
            wal_status, catalog_xmin = conn.execute(
                "SELECT wal_status, catalog_xmin FROM pg_replication_slots "
                "WHERE slot_name = 'maintd_lost_slot'").fetchone()
            assert (wal_status, catalog_xmin is not None) == ("lost", True), "not invalidated: the test shows nothing"
            time.sleep(1.1)
            horizon = read(health_engine).horizon
            named = [h for h in horizon.holders + horizon.catalog_holders if h.name == "maintd_lost_slot"]
            assert named == [], named
        finally:
            conn.execute("SELECT pg_drop_replication_slot('maintd_lost_slot')")
            conn.execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
            conn.execute("SELECT pg_reload_conf()")


@contextmanager
def role_engine(dsn: str, role: str, *, read_all_stats: bool = False) -> Iterator[Engine]:
    """An engine that logs in as ``role``, a new role made here (granted pg_read_all_stats if
    ``read_all_stats``) and dropped afterwards."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"DROP ROLE IF EXISTS {role}")
        admin.execute(f"CREATE ROLE {role} LOGIN")
        if read_all_stats:
            admin.execute(f"GRANT pg_read_all_stats TO {role}")
    engine = make_engine(dsn.replace("postgres@", f"{role}@"), application_name="w", pooled=False)
    try:
        yield engine
    finally:
        engine.dispose()
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f"DROP ROLE {role}")


@contextmanager
def snapshot_held_past_warning(dsn: str, watcher: Engine, application_name: str):
    """A REPEATABLE READ session that has read maintd.jobs and held its snapshot past a 1 s
    warn-after, looked at by one HolderWarnings through ``watcher`` before and after the second;
    yields the session and ``look`` (one more such look)."""
    reader, warnings = HealthReader(), HolderWarnings()

    def look() -> None:
        warnings.check(read(watcher, reader, ()).horizon, timedelta(seconds=1), ["q"])

    with psycopg.connect(dsn, application_name=application_name) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM maintd.jobs")
        consume_xids(dsn)
        look()
        time.sleep(1.2)
        look()
        yield holder, look


def test_another_roles_session_without_pg_read_all_stats_is_named_with_what_it_may_see(health_pg):
    """Without pg_read_all_stats, PostgreSQL hides another role's state, client and start: the
    holder is still named (pid, user, application) and its age counts from the first read that
    saw a newer transaction id (a lower bound); with the grant (maintd grants prints it) all of it."""
    with role_engine(health_pg, "maintd_health_watcher") as watcher, \
            psycopg.connect(health_pg, application_name="other-team") as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1")
        pid, reader = holder.info.backend_pid, HealthReader()
        consume_xids(health_pg)
        first = [h for h in read(watcher, reader, ()).horizon.holders if h.pid == pid]
        assert first == []  # held for less than a second as far as it can tell
        time.sleep(1.2)
        h = held_by(read(watcher, reader, ()), pid)
        assert (h.kind, h.user, h.application_name) == ("snapshot", "postgres", "other-team")
        assert (h.state, h.client_addr, h.since, h.exact) == (None, None, None, False)
        assert 1.0 <= h.age_seconds < 30
        with psycopg.connect(health_pg, autocommit=True) as admin:
            admin.execute("GRANT pg_read_all_stats TO maintd_health_watcher")
        h = held_by(read(watcher, reader, ()), pid)
        assert (h.state, h.client_addr, h.exact) == ("idle in transaction", "127.0.0.1", True)


@pytest.mark.parametrize("hidden", [False, True], ids=["visible", "hidden"])
def test_a_snapshot_that_then_writes_is_warned_about_once_and_gone_once(health_pg, health_engine, maintd_log,
                                                                      hidden):
    """A REPEATABLE READ session reads, stays idle in its transaction, then writes: it holds a
    snapshot, then a transaction id too, but it is one holder. It was warned about twice (as
    ``snapshot pid N``, then ``transaction pid N``) with a false "holder gone" in between; as it is
    for a role that cannot see the session's start (its xmin names it then)."""
    watching = role_engine(health_pg, "maintd_health_flip") if hidden else nullcontext(health_engine)
    with watching as watcher, snapshot_held_past_warning(health_pg, watcher, "flipper") as (holder, look):
        pid = holder.info.backend_pid
        holder.execute("SELECT pg_current_xact_id()")  # now a transaction id too
        consume_xids(health_pg)
        look()
        time.sleep(1.2)  # past xmin_warn_after again
        look()
        holder.rollback()
        look()
    warned = [line for line in maintd_log if "vacuum is held back" in line and f"pid {pid} " in line]
    gone = [line for line in maintd_log if "holder gone" in line and f"pid={pid} " in line]
    assert len(warned) == 1 and "holder=snapshot pid" in warned[0], maintd_log
    assert len(gone) == 1, maintd_log


@pytest.mark.parametrize("change", ["GRANT", "REVOKE"])
def test_a_holder_whose_start_becomes_visible_or_hidden_mid_run_is_still_one_holder(health_pg, maintd_log, change):
    """GRANT pg_read_all_stats to the daemon's role while a session holds the horizon: its start
    becomes visible, and the holder was keyed by its xmin before and by its start after, so the
    same still-holding pid was warned about a second time and called "gone" a millisecond later
    (and the other way round after a REVOKE). One holder: one warning, one "gone" when it ends."""
    with role_engine(health_pg, "maintd_health_grantee", read_all_stats=change == "REVOKE") as watcher, \
            snapshot_held_past_warning(health_pg, watcher, "long-report") as (holder, look):
        pid = holder.info.backend_pid
        look()
        with psycopg.connect(health_pg, autocommit=True) as admin:
            admin.execute(f"{change} pg_read_all_stats {'TO' if change == 'GRANT' else 'FROM'} "
                          "maintd_health_grantee")
        look()
        time.sleep(0.2)
        look()
        held = [line for line in maintd_log if "vacuum is held back" in line and f"pid {pid} " in line]
        gone = [line for line in maintd_log if "holder gone" in line and f"pid={pid} " in line]
        assert (len(held), gone) == (1, []), maintd_log
        holder.rollback()
        look()
    assert sum("holder gone" in line and f"pid={pid} " in line for line in maintd_log) == 1, maintd_log


def test_maintd_status_names_the_holder_in_text_and_json(health_pg, tmp_path):
    import subprocess
    import sys

    config = tmp_path / "maintd.toml"
    config.write_text(f'database_url = "{health_pg}"\nschema = "maintd"\n')
    with psycopg.connect(health_pg, application_name="status-check") as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 'personal data' FROM maintd.jobs")
        pid = holder.info.backend_pid
        consume_xids(health_pg)
        time.sleep(1.1)

        def status(*extra: str) -> str:
            res = subprocess.run([sys.executable, "-m", "maintd", "--config", str(config), "status", *extra],
                                 capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, res.stderr
            return res.stdout

        text_out = status()
        assert f"held by: snapshot pid {pid} user postgres app status-check client 127.0.0.1 " \
               f"state idle in transaction, for " in text_out, text_out
        assert "xmin horizon:" in text_out and "    jobs " in text_out and "personal data" not in text_out
        data = json.loads(status("--json"))
        assert data["health"]["horizon"]["holder"]["pid"] == pid and "personal data" not in json.dumps(data)
        with_query = tmp_path / "query.toml"
        with_query.write_text(config.read_text() + "[health]\nshow_query = true\n")
        res = subprocess.run([sys.executable, "-m", "maintd", "--config", str(with_query), "status"],
                             capture_output=True, text=True, timeout=60)
        assert "query: SELECT 'personal data' FROM maintd.jobs" in res.stdout, res.stdout


# -- ages and the warning, without a database -------------------------------------------------

def row(**kw):
    base = {"kind": "standby_feedback", "scope": "data", "pid": 7, "usename": "replicator",
            "application_name": "standby-1", "client_addr": "10.0.0.9", "state": "streaming",
            "xmin": "1000", "age_xids": 0, "since": None, "name": None, "detail": "walsender", "query": None}
    return {**base, **kw}


def test_a_holder_without_a_start_time_ages_from_the_first_read_that_saw_it_hold():
    """A standby's feedback on an idle primary holds nothing back (no newer transaction id):
    age 0, however long; from the first read with a newer id its age counts up; a new xmin is a
    new holder."""
    reader = HealthReader()
    assert reader.horizon([row()], T0).age_seconds == 0
    assert reader.horizon([row()], T0 + timedelta(hours=1)).holders == ()
    reader.horizon([row(age_xids=5)], T0 + timedelta(hours=1))
    hz = reader.horizon([row(age_xids=9)], T0 + timedelta(hours=1, seconds=40))
    assert (hz.age_seconds, hz.age_xids, hz.holder.exact) == (40.0, 9, False)
    assert reader.horizon([row(xmin="1200", age_xids=3)], T0 + timedelta(hours=1, seconds=50)).age_seconds == 0
    assert reader.horizon([], T0 + timedelta(hours=2)) == Horizon()


def test_a_holder_whose_xmin_moves_but_stays_behind_is_aged_by_when_its_xmin_was_current():
    """A standby running overlapping 30-minute queries sends a feedback xmin that keeps moving
    but stays about 30 minutes behind. Aged from the first read that saw each xmin, it was always
    about 0 s old: the 5-minute warning and the seconds gauge never fired, only age_xids showed
    it. Each read now samples the next transaction id, and an xmin is at least as old as the
    first sample that had passed it (a lower bound: exact stays False)."""
    reader = HealthReader()
    reader.horizon([row()], T0, next_xid=1000)  # idle: holds nothing back
    reader.horizon([row(xmin="1500", age_xids=500)], T0 + timedelta(minutes=10), next_xid=2000)
    hz = reader.horizon([row(xmin="1600", age_xids=1400)], T0 + timedelta(minutes=20), next_xid=3000)
    assert (hz.age_seconds, hz.holder.exact) == (600.0, False), hz  # 1600 was passed by 10:10
    hz = reader.horizon([row(xmin="2500", age_xids=2500)], T0 + timedelta(minutes=40), next_xid=5000)
    assert hz.age_seconds == 1200.0 and hz.holder.age_xids == 2500, hz  # passed by 10:20: over the 5-minute warning
    # an xmin no sample had passed yet is aged, as before, from the first read that saw it
    assert reader.horizon([row(xmin="5005", age_xids=5)], T0 + timedelta(minutes=41),
                          next_xid=5010).age_seconds == 0.0


def test_a_one_shot_read_names_a_slot_holding_back_and_says_its_age_is_unknown():
    """`maintd status` reads once: a holder PostgreSQL keeps no time for has age 0 there, and was
    dropped as younger than a second, so a stale physical slot holding back 50 million ids read
    "held by: nothing older than a second". A slot or a standby's feedback is named as soon as it
    holds anything back, "for an unknown time"; a backend without a start time (another role's,
    most often a worker's short transaction) still needs a second read."""
    from maintd.status import format_health

    slot = row(kind="replication_slot", pid=None, name="stale", detail="physical", age_xids=50_000_000)
    backend = row(kind="snapshot", pid=8, detail=None, age_xids=40)
    hz = HealthReader().horizon([slot, backend], T0)
    assert [h.name for h in hz.holders] == ["stale"]
    report = {"at": "T0", "tables": [], "horizon": {
        "age_seconds": hz.age_seconds, "age_xids": hz.age_xids, "holder": hz.holder.as_dict(),
        "holders": [h.as_dict() for h in hz.holders], "catalog_holders": []}}
    text = "\n".join(format_health(report))
    assert "held by: replication slot 'stale' (physical)" in text and "for an unknown time (50,000,000 xids)" in text
    assert "nothing older than a second" not in text


def test_a_one_shot_read_does_not_say_nothing_holds_the_horizon_when_another_roles_session_does():
    """`maintd status` as the runtime role (README's install: `GRANT pg_read_all_stats` is
    optional): a worker role's forgotten transaction, its start hidden, holding back 301 ids read
    "xmin horizon: 0 s, 301 transaction ids / held by: nothing older than a second", however long
    it had been open. It is still not named on one read (most such sessions are workers' short
    transactions), but the line says that sessions of other roles hold it for a time this read
    cannot tell, and what shows it."""
    from maintd.status import format_health

    hidden = row(kind="transaction", pid=8, usename="app_worker", application_name="metabase",
                 client_addr=None, state=None, detail=None, age_xids=301)
    hz = HealthReader().horizon([hidden], T0)
    assert hz.holders == ()
    text = "\n".join(format_health({"at": "T0", "tables": [], "horizon": hz.as_dict()}))
    assert "nothing older than a second" not in text, text
    assert "1 session of another role" in text and "pg_read_all_stats" in text, text
    assert "xmin horizon: for a time this read cannot tell, 301 transaction ids" in text, text  # not "0 s"
    quiet = HealthReader().horizon([{**hidden, "age_xids": 0}], T0)  # holds nothing back yet
    assert "held by: nothing older than a second" in "\n".join(
        format_health({"at": "T0", "tables": [], "horizon": quiet.as_dict()}))


def test_several_hidden_sessions_read_sessions_of_other_roles_as_the_readme_quotes():
    """README ("When the queue bloats") quotes `2 sessions of other roles, for a time this read
    cannot tell`; the line read "2 sessions of another roles"."""
    from maintd.status import format_health

    hidden = [row(kind="transaction", pid=pid, usename="app_worker", application_name="w",
                  client_addr=None, state=None, detail=None, age_xids=301) for pid in (8, 9)]
    hz = HealthReader().horizon(hidden, T0)
    text = "\n".join(format_health({"at": "T0", "tables": [], "horizon": hz.as_dict()}))
    assert "held by: 2 sessions of other roles, for a time this read cannot tell" in text, text


def test_a_table_gone_loses_its_series_and_no_other_targets_series_goes():
    """With many targets in one process, a read applies each target's gauges given the tables it
    set last time (no scan of every target's series, which made a read of 200 targets quadratic);
    a table gone from a schema loses its series, those of the other targets stay."""
    a = Metrics(target="a")
    b = Metrics(target="b", shared=a)
    tables = {s: tuple(TableHealth(t, 1, 2, 3, None) for t in names)
              for s, names in {"sa": ("jobs", "leader"), "sb": ("jobs", "leader")}.items()}
    report = HealthReport(T0, Horizon(), tables)
    first = apply_metrics(a, report, "sa")  # a first read: nothing set before
    assert first == {"jobs", "leader"} and apply_metrics(b, report, "sb") == {"jobs", "leader"}
    report = HealthReport(T0, Horizon(), {**tables, "sa": tables["sa"][:1]})
    assert apply_metrics(a, report, "sa", first) == {"jobs"}

    def series(name: str) -> set:
        return {(s.labels["target"], s.labels["table"]) for m in a.registry.collect()
                for s in m.samples if s.name == name}

    for name in ("maintd_table_dead_tuples", "maintd_table_live_tuples", "maintd_table_last_vacuum_timestamp_seconds"):
        assert series(name) == {("a", "jobs"), ("b", "jobs"), ("b", "leader")}, name


def test_the_holder_named_is_the_oldest_xmin_and_young_ones_are_not_named():
    reader = HealthReader()
    started = T0 - timedelta(minutes=3)
    hz = reader.horizon([
        row(kind="transaction", pid=1, since=T0 - timedelta(minutes=10), age_xids=50, xmin="950"),
        row(kind="snapshot", pid=2, since=started, age_xids=80, xmin="920"),
        row(kind="transaction", pid=3, since=T0 - timedelta(milliseconds=20), age_xids=1, xmin="999"),
        row(kind="replication_slot", scope="catalog", name="cdc", since=started, age_xids=500, xmin="500")], T0)
    assert [h.pid for h in hz.holders] == [2, 1] and hz.holder.pid == 2
    assert hz.age_seconds == 600 and hz.age_xids == 80  # the oldest of each measure, data scope only
    assert [h.name for h in hz.catalog_holders] == ["cdc"]


def test_one_warning_per_holder_and_a_line_when_it_is_gone(maintd_log):
    reader, warnings = HealthReader(), HolderWarnings()
    held = row(kind="snapshot", pid=42, since=T0, age_xids=10, usename="alice", application_name="psql",
               state="idle in transaction")
    for minutes in (1, 6, 7, 30):
        warnings.check(reader.horizon([held], T0 + timedelta(minutes=minutes)), timedelta(minutes=5), ["q"])
    warned = [line for line in maintd_log if "vacuum is held back" in line]
    assert len(warned) == 1, maintd_log
    assert "holder=snapshot pid 42 (psql, user alice, 10.0.0.9)" in warned[0] and "age_seconds=360" in warned[0]
    assert "targets=q" in warned[0]
    warnings.check(reader.horizon([], T0 + timedelta(minutes=31)), timedelta(minutes=5), ["q"])
    assert sum("xmin horizon holder gone" in line for line in maintd_log) == 1
    later = {**held, "since": T0 + timedelta(minutes=40)}  # the same session's next transaction
    warnings.check(reader.horizon([later], T0 + timedelta(minutes=46)), timedelta(minutes=5), ["q"])
    assert sum("vacuum is held back" in line for line in maintd_log) == 2


def test_a_slot_whose_consumer_reconnects_is_one_holder(maintd_log):
    """A physical slot's xmin (a standby's hot_standby_feedback) stays where it is while its
    standby reconnects: the slot's active_pid changes (or is NULL in between), and the slot was
    keyed by it, so every reconnect logged "holder gone" and a new "vacuum is held back"."""
    reader, warnings = HealthReader(), HolderWarnings()
    slot = row(kind="replication_slot", name="standby_1", detail="physical", xmin="1000", age_xids=50)
    for minutes, pid in ((1, 7), (6, 7), (7, None), (8, 8), (9, None), (10, 9)):
        warnings.check(reader.horizon([{**slot, "pid": pid}], T0 + timedelta(minutes=minutes), next_xid=1050),
                       timedelta(minutes=4), ["q"])
    assert sum("vacuum is held back" in line for line in maintd_log) == 1, maintd_log
    assert sum("xmin horizon holder gone" in line for line in maintd_log) == 0, maintd_log


def test_a_standby_that_caught_up_and_falls_behind_again_is_warned_about_again(maintd_log):
    """A standby's feedback is one holder while its xmin moves (its walsender), so its warning
    is not repeated at every move; once it has caught up (younger than half xmin_warn_after) it is
    released with a "caught up" line (not "gone": it is still there), and falling behind
    again is a new warning."""
    reader, warnings = HealthReader(), HolderWarnings()
    reader.horizon([row()], T0, next_xid=1000)
    # held (passed at 1 min), moved but still 7 min behind, caught up, behind again (from 10 min)
    steps = ((1, "1000", 1100), (7, "1000", 2000), (8, "1050", 2600), (9, "2600", 2601), (10, "2601", 2700),
             (16, "2601", 3000))
    for minutes, xmin, next_xid in steps:
        warnings.check(reader.horizon([row(xmin=xmin, age_xids=next_xid - int(xmin))],
                                      T0 + timedelta(minutes=minutes), next_xid=next_xid),
                       timedelta(minutes=5), ["q"])
    assert sum("vacuum is held back" in line for line in maintd_log) == 2, maintd_log
    assert sum("xmin horizon holder caught up" in line for line in maintd_log) == 1, maintd_log
    assert not [line for line in maintd_log if "xmin horizon holder gone" in line], maintd_log


def test_a_standby_hovering_just_under_xmin_warn_after_is_not_warned_about_again(maintd_log):
    """A holder warned about is released ("caught up") only once younger than half
    xmin_warn_after: a replica's feedback that dips a little under the threshold and climbs back
    over it is still the one holder already warned about (a line each crossing otherwise: the
    flapping SPEC 8.2's once per holder rules out). Dropped under half, it is released, and the
    next crossing warns again. A read a minute (100 transaction ids a minute); the standby's
    xmin is the id current ``lag`` minutes before each read."""
    reader, warnings = HealthReader(), HolderWarnings()
    # the minute by which the standby's xmin was passed, at each read's minute
    passed = {m: m for m in range(4)} | {m: 4 for m in range(4, 11)} | {11: 7, 12: 7} \
        | {m: 12 for m in range(13, 19)}
    ages = []
    for minute, at in passed.items():
        hz = reader.horizon([row(xmin=str(1000 + 100 * at - 1), age_xids=100 * (minute - at) + 1)],
                            T0 + timedelta(minutes=minute), next_xid=1000 + 100 * minute)
        ages.append(hz.holder.age_seconds / 60)
        warnings.check(hz, timedelta(minutes=5), ["q"])
    assert ages[9:14] == [5, 6, 4, 5, 1]  # over, a little under, over, caught up
    assert sum("vacuum is held back" in line for line in maintd_log) == 2, maintd_log  # at 9 and 17
    assert sum("xmin horizon holder caught up" in line for line in maintd_log) == 1, maintd_log  # at 13


def test_a_snapshot_read_mid_statement_is_aged_from_the_earliest_start_seen_holding_it(maintd_log):
    """READ COMMITTED takes a snapshot per statement: a session with a transaction open for an
    hour that runs short statements holds each snapshot for the statement only. Aged from its
    transaction's start, it was warned about whenever a read caught it mid-statement, and "gone"
    at the next read that did not (a warning each time). Mid-statement a snapshot is aged from the
    statement's start (a lower bound: REPEATABLE READ keeps its first), and from the earliest
    start a read saw the same snapshot (pid, transaction, xmin) hold, an idle-in-transaction read
    proving the transaction's start."""
    reader, warnings = HealthReader(), HolderWarnings()
    xact = T0 - timedelta(hours=1)

    def snap(xmin: str, statement_start, state="active"):
        return row(kind="snapshot", pid=42, since=xact, xmin=xmin, age_xids=10, detail="client backend",
                   state=state, statement_start=statement_start)

    for i in range(4):  # READ COMMITTED: a new snapshot at every statement, each 2 s old when read
        at = T0 + timedelta(minutes=i)
        hz = reader.horizon([snap(str(1000 + i), at - timedelta(seconds=2))], at)
        warnings.check(hz, timedelta(seconds=30), ["q"])
        assert (hz.holder.age_seconds, hz.holder.exact) == (2.0, False)
        warnings.check(reader.horizon([], at + timedelta(seconds=30)), timedelta(seconds=30), ["q"])
    assert not [line for line in maintd_log if "vacuum is held back" in line or "holder gone" in line]
    # REPEATABLE READ: one snapshot across statements; a read between them proves its age
    assert reader.horizon([snap("900", T0)], T0 + timedelta(seconds=5)).holder.age_seconds == 5
    assert reader.horizon([snap("900", T0 + timedelta(seconds=20))], T0 + timedelta(seconds=25)).holder.age_seconds == 25
    assert reader.horizon([snap("900", None, "idle in transaction")], T0 + timedelta(seconds=30)).holder.exact
    later = reader.horizon([snap("900", T0 + timedelta(seconds=40))], T0 + timedelta(seconds=45)).holder
    assert (later.age_seconds, later.exact) == (3645.0, True)  # the transaction's start, proven
    fresh = HealthReader().horizon([snap("900", T0 + timedelta(seconds=40))], T0 + timedelta(seconds=45)).holder
    assert (fresh.age_seconds, fresh.exact) == (5.0, False)  # a first read: at least the statement


def test_a_read_committed_transaction_is_aged_by_its_running_statement(health_pg, health_engine):
    """On the server: a READ COMMITTED transaction open for seconds, caught in a statement that
    began a second ago, holds back the horizon for about a second, not since its BEGIN."""
    with psycopg.connect(health_pg, application_name="long-rc") as holder:
        holder.execute("SELECT 1")  # BEGIN (psycopg opens the transaction), then idle: no snapshot held
        pid = holder.info.backend_pid
        time.sleep(4)
        assert all(h.pid != pid for h in read(health_engine).horizon.holders)
        sleeper = threading.Thread(target=lambda: holder.execute("SELECT pg_sleep(4)"))
        sleeper.start()
        try:
            time.sleep(1.5)
            consume_xids(health_pg)
            h = held_by(read(health_engine), pid)
            assert (h.kind, h.state, h.exact) == ("snapshot", "active", False)
            assert 1.0 <= h.age_seconds < 3.5, h  # the statement's age; its transaction's is over 5 s
        finally:
            sleeper.join()
        holder.rollback()


# -- the tables ------------------------------------------------------------------------------------

def test_the_monitors_read_is_never_jit_compiled():
    """The monitor's connection plans the read generically (force_generic_plan): the tables'
    generic plan is estimated at about 290,000 (the per-leaf subplans times a guessed 17,000
    rows), over jit_above_cost (100,000 by default), so on a server built with JIT (Debian's,
    PostgreSQL 15; the embedded one has none, hence a server of 15's here) every read compiled
    some 50 functions: 70-85 ms of server time every health.interval for a statement that runs
    in under 1 ms. Each statement is explained as the monitor's connection runs it (prepared,
    its parameters as the reader sends them)."""
    import re
    from types import SimpleNamespace

    from maintd.db import HostOrder
    from maintd.guardian import TargetMember

    from .tools import unavailable

    with private_server(15, {"jit": "on", "jit_above_cost": "100000"}) as pg:
        with psycopg.connect(pg.dsn) as plain:  # (false where jit is off, as on the monitor's connection)
            if not plain.execute("SELECT pg_jit_available()").fetchone()[0]:
                unavailable("needs PostgreSQL 15 built with JIT (llvmjit, Debian's postgresql-15)")
        engine = make_engine(pg.dsn, application_name="maintd-test-migrate", pooled=False)
        with engine.connect() as c:
            migrate.upgrade(c, "maintd")
        engine.dispose()
        settings = Settings(database_url=pg.dsn, schema="maintd", instance_id="jit-1")
        with TargetMember(SimpleNamespace(settings=settings), HostOrder(pg.dsn)).connect() as conn:
            jitted = {}
            for name, sql_, args in (("NOW", q.NOW, {}), ("HOLDERS", q.HOLDERS, {"show_query": "false"}),
                                     ("TABLES", q.TABLES, {"schemas": "ARRAY['maintd']", "all_tables": "true",
                                                           "sizes": "'all'"}),
                                     ("TABLES", q.TABLES, {"schemas": "ARRAY['maintd']", "all_tables": "false",
                                                           "sizes": "'none'"})):
                names = list(dict.fromkeys(re.findall(r"(?<!:):([a-z_]+)", sql_)))
                text = re.sub(r"(?<!:):([a-z_]+)", lambda m: f"${names.index(m.group(1)) + 1}", sql_)
                conn.execute(f"PREPARE jit_probe AS {text}")
                call = f"EXECUTE jit_probe({', '.join(args[n] for n in names)})" if names else "EXECUTE jit_probe"
                [[plan]] = conn.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {call}").fetchall()
                conn.execute("DEALLOCATE jit_probe")
                if "JIT" in plan[0]:
                    jitted[name] = plan[0]["JIT"]["Functions"]
    assert jitted == {}, jitted


def test_tables_report_rows_size_and_vacuum_of_the_jobs_table_and_maintds_own(health_pg, health_engine):
    with psycopg.connect(health_pg, autocommit=True) as conn:
        conn.execute("INSERT INTO maintd.jobs (kind) SELECT 'k' FROM generate_series(1, 300)")
        conn.execute("DELETE FROM maintd.jobs WHERE kind = 'k' AND id % 3 = 0")
        conn.execute("SELECT pg_stat_force_next_flush()")
        report = read(health_engine)
        jobs = report.table("maintd")
        assert jobs.live >= 200 and jobs.dead >= 100 and jobs.bytes > 8192
        assert {"jobs", "leader", "daemons", "service_runs", "health_history"} <= \
            {t.table for t in report.tables["maintd"]}
        conn.execute("VACUUM maintd.jobs")
        conn.execute("SELECT pg_stat_force_next_flush()")
        vacuumed = read(health_engine).table("maintd")
        assert vacuumed.dead == 0 and abs(vacuumed.last_vacuum - time.time()) < 60
        conn.execute("DELETE FROM maintd.jobs WHERE kind = 'k'")


def test_sizes_and_maintds_own_tables_are_read_once_a_minute_the_jobs_rows_every_read(health_pg, health_engine):
    """Sizes are most of a read's cost (a stat() per file of every table and index): a reader
    reads the jobs table's rows every time, its size once every FULL_EVERY, and maintd's own
    tables (rows and sizes) once every SIZES_EVERY."""
    import maintd.health as health

    reader = HealthReader()
    first = read(health_engine, reader)
    with psycopg.connect(health_pg, autocommit=True) as conn:
        conn.execute("INSERT INTO maintd.jobs (kind) SELECT 'size' FROM generate_series(1, 2000)")
        conn.execute("DELETE FROM maintd.jobs WHERE kind = 'size'")
        conn.execute("SELECT pg_stat_force_next_flush()")
        again = read(health_engine, reader)
        assert again.table("maintd").dead >= first.table("maintd").dead + 2000  # read now
        assert again.table("maintd").bytes == first.table("maintd").bytes  # the last full read's
        assert [t.table for t in again.tables["maintd"]] == [t.table for t in first.tables["maintd"]]
        reader._full_at -= health.FULL_EVERY
        full = read(health_engine, reader)
        assert full.table("maintd").bytes > first.table("maintd").bytes
        assert full.table("maintd", "leader").bytes == first.table("maintd", "leader").bytes > 0
        assert [t.table for t in full.tables["maintd"]] == [t.table for t in first.tables["maintd"]]
        reader._sizes_at -= health.SIZES_EVERY
        assert read(health_engine, reader).table("maintd", "leader").bytes > 0
        conn.execute("DELETE FROM maintd.jobs WHERE kind = 'size'")


def test_a_partitioned_jobs_table_is_summed_over_its_leaves_and_gets_the_autovacuum_settings(health_pg,
                                                                                            health_engine):
    """The partitioned layout (SPEC 8.1): LIST (state) partitions, the final ones sub-partitioned
    by range. Rows and sizes are summed over the leaves; the last vacuum is the least recent of
    the leaves that owe one (dead rows past autovacuum's threshold for them: a finished state's
    leaf with a few dead rows, which autovacuum never visits, pinned it at "never" and fired
    MaintdVacuumNotSeen on a healthy table); migrate's autovacuum settings go on the live jobs' leaf."""
    ddl = """
    CREATE SCHEMA parted;
    CREATE TABLE parted.jobs (id bigint, state text, finalized_at timestamptz) PARTITION BY LIST (state);
    CREATE TABLE parted.jobs_live PARTITION OF parted.jobs FOR VALUES IN ('available', 'running');
    CREATE TABLE parted.jobs_done PARTITION OF parted.jobs FOR VALUES IN ('completed')
      PARTITION BY RANGE (finalized_at);
    CREATE TABLE parted.jobs_done_1 PARTITION OF parted.jobs_done FOR VALUES FROM (MINVALUE) TO ('2026-01-01');
    CREATE TABLE parted.jobs_done_2 PARTITION OF parted.jobs_done FOR VALUES FROM ('2026-01-01') TO (MAXVALUE);
    CREATE TABLE parted.leader (name text);
    INSERT INTO parted.jobs SELECT g, 'available', NULL FROM generate_series(1, 100) g;
    INSERT INTO parted.jobs SELECT g, 'completed', '2025-06-01' FROM generate_series(101, 150) g;
    INSERT INTO parted.jobs SELECT g, 'completed', '2026-06-01' FROM generate_series(151, 170) g;
    DELETE FROM parted.jobs WHERE id % 10 = 0;
    """
    with psycopg.connect(health_pg, autocommit=True) as conn:
        conn.execute(ddl)
        try:
            conn.execute("SELECT pg_stat_force_next_flush()")
            conn.execute(migrate.jobs_autovacuum_sql("parted"))
            [jobs] = [t for t in read(health_engine, schemas=["parted"]).tables["parted"] if t.table == "jobs"]
            assert (jobs.live, jobs.dead) == (153, 17)
            assert jobs.bytes == conn.execute("SELECT sum(pg_total_relation_size(relid)) FROM "
                                              "pg_partition_tree('parted.jobs')").fetchone()[0]
            options = dict(conn.execute("SELECT relname, reloptions FROM pg_class WHERE relnamespace = "
                                        "'parted'::regnamespace AND relname LIKE 'jobs%'").fetchall())
            expected = [f"{k}={v}" for k, v in migrate.JOBS_AUTOVACUUM.items()]
            assert options == {"jobs": None, "jobs_live": expected, "jobs_done": None, "jobs_done_1": None,
                               "jobs_done_2": None}
            conn.execute("VACUUM parted.jobs_live")
            conn.execute("SELECT pg_stat_force_next_flush()")
            vacuumed = conn.execute("SELECT extract(epoch FROM pg_stat_get_last_vacuum_time("
                                    "'parted.jobs_live'::regclass))::float8").fetchone()[0]

            def last_vacuum():
                [jobs] = [t for t in read(health_engine, schemas=["parted"]).tables["parted"] if t.table == "jobs"]
                return jobs.last_vacuum

            # 5 and 2 dead rows in the final leaves, below PostgreSQL's threshold (50 + 0.2 x rows)
            assert last_vacuum() == pytest.approx(vacuumed, abs=0.01)
            conn.execute("ALTER TABLE parted.jobs_done_1 SET (autovacuum_vacuum_threshold = 4, "
                         "autovacuum_vacuum_scale_factor = 0, autovacuum_enabled = false, fillfactor = 90)")
            assert last_vacuum() is None  # 5 dead rows past its own threshold of 4: it owes one
            conn.execute("ALTER TABLE parted.jobs_done_1 SET (autovacuum_vacuum_threshold = 5)")
            assert last_vacuum() == pytest.approx(vacuumed, abs=0.01)  # not past 5
        finally:
            conn.execute("DROP SCHEMA parted CASCADE")


def test_migrate_sets_the_autovacuum_settings_of_the_plain_jobs_table(health_pg):
    with psycopg.connect(health_pg) as conn:
        options = conn.execute("SELECT reloptions FROM pg_class WHERE oid = 'maintd.jobs'::regclass").fetchone()[0]
    assert sorted(options) == sorted(f"{k}={v}" for k, v in migrate.JOBS_AUTOVACUUM.items())


# -- the daemon: gauges, /status, the warning, and the drop back ------------------------------

def metric(daemon: Daemon, name: str, **labels: str) -> float | None:
    return daemon.metrics.registry.get_sample_value(name, {"target": "maintd", **labels})


def test_the_daemon_names_the_holder_warns_once_and_the_gauge_drops_back_within_an_interval(
        health_pg, maintd_log):
    interval = 1.0
    settings = Settings(database_url=health_pg, schema="maintd", instance_id="health-1",
                        http={"listen": "127.0.0.1:0"}, leader={"lease": "3s", "renew_interval": "0.5s"},
                        health={"interval": f"{interval}s", "xmin_warn_after": "2s"})
    daemon = Daemon(settings)
    daemon.start()
    try:
        wait_for(lambda: daemon.is_leader and metric(daemon, "maintd_xmin_horizon_age_seconds") is not None,
                 15, what="leadership and a first health read")
        with psycopg.connect(health_pg, application_name="dashboard-export") as holder:
            holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT count(*) FROM maintd.jobs WHERE kind = 'private-data'")
            pid = holder.info.backend_pid
            consume_xids(health_pg)
            wait_for(lambda: (metric(daemon, "maintd_xmin_horizon_age_seconds") or 0) >= 3.5, 15,
                     what="the horizon's age past 3.5 s")
            assert metric(daemon, "maintd_xmin_horizon_age_xids") >= 3
            assert metric(daemon, "maintd_table_bytes", table="jobs") > 0
            with urllib.request.urlopen(f"http://127.0.0.1:{daemon.http_port}/status", timeout=5) as r:
                body = r.read().decode()
            holder_seen = json.loads(body)["health"]["horizon"]["holder"]
            assert (holder_seen["pid"], holder_seen["kind"], holder_seen["application_name"]) == \
                (pid, "snapshot", "dashboard-export")
            assert "private-data" not in body
            holder.rollback()
            released = time.monotonic()
        wait_for(lambda: metric(daemon, "maintd_xmin_horizon_age_seconds") < 1.0, 10, interval=0.01,
                 what="the gauge back under a second")
        took = time.monotonic() - released
        record("health_gauge_drop_back", took, interval=interval)
        assert took <= interval + 1.0, f"the gauge dropped back {took:.2f} s after the holder ended"
        warned = [line for line in maintd_log if "vacuum is held back" in line and f"pid={pid}" in line]
        assert len(warned) == 1, maintd_log
        wait_for(lambda: any("xmin horizon holder gone" in line and f"pid={pid}" in line for line in maintd_log),
                 5, what="the holder gone line")
    finally:
        daemon.stop()
    assert metric(daemon, "maintd_xmin_horizon_age_seconds") is None  # a stopped leader exports none


class LeadingMember:
    """One target this replica leads, as :class:`maintd.guardian.HealthMonitor` sees it, whose
    health connection goes to ``dsn`` (a real server, or a port nothing listens on)."""

    def __init__(self, dsn: str, engine: Engine):
        self.name, self.schema, self.dsn, self.engine = "maintd", "maintd", dsn, engine
        self.settings = Settings(database_url=dsn, schema="maintd", instance_id="guard-1")
        self.metrics = Metrics(target="maintd")

    def leading(self) -> bool:
        return True

    def fence(self):
        from maintd.services.base import NotLeader

        raise NotLeader("no history in this test")

    def connect(self) -> psycopg.Connection:
        return psycopg.connect(self.dsn, autocommit=True, application_name="maintd:guard-1:health")

    def live_counts(self, at):
        return None


def overview_html(settings: Settings, monitor) -> str:
    from maintd.dashboard import Dashboard
    from maintd.http import Request

    status, _, body, _ = Dashboard(lambda: settings, health=monitor.status).index(Request("/", {"refresh": ["0"]}))
    assert status == 200, body
    return body.decode()


def test_a_leaders_failed_health_read_is_shown_not_hidden_or_taken_for_a_follower(health_pg, health_engine):
    """When the read failed, /status and the dashboard showed the last good read as if current
    (forever, while reads kept failing), or, with no good read yet in this term, nothing, which
    they take for "this replica does not lead the target". Now they carry the read's error."""
    from maintd.embedded import free_port
    from maintd.guardian import HealthMonitor
    from maintd.status import format_health

    member = LeadingMember(health_pg, health_engine)
    monitor = HealthMonitor([member], lambda: Settings().health)
    try:
        assert monitor.run_once() is not None
        good = monitor.status("maintd")
        assert good is not None and "error" not in good
        member.dsn = f"host=127.0.0.1 port={free_port()} user=postgres dbname=postgres connect_timeout=2"
        with psycopg.connect(health_pg, autocommit=True) as admin:  # the monitor's session ends
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE application_name = 'maintd:guard-1:health'")
        assert monitor.run_once() is None and monitor.run_once() is None  # and cannot reconnect
        failed = monitor.status("maintd")
        assert failed is not None and failed.get("error") and failed["at"] == good["at"], failed
        assert 'id="health-error"' in overview_html(member.settings, monitor)
    finally:
        monitor.stop()
    fresh = HealthMonitor([member], lambda: Settings().health)  # a new term whose first read fails
    try:
        assert fresh.run_once() is None
        status = fresh.status("maintd")
        assert status is not None and status.get("error"), status
        assert "not read" in "\n".join(format_health(status))
        html = overview_html(member.settings, fresh)
        assert 'id="health-error"' in html and "does not lead" not in html
    finally:
        fresh.stop()


def test_the_time_of_the_last_good_read_is_exported_and_stays_while_reads_fail(health_pg, health_engine):
    """While reads fail, the health gauges keep their last value (the README says so), and a
    frozen maintd_xmin_horizon_age_seconds never crosses MaintdXminHorizonHeld's threshold: the
    alert stayed quiet however long a holder then held the horizon, and no metric said the
    read had stopped. maintd_health_read_timestamp_seconds is the server's time of the last
    good read, which MaintdHealthReadFailing watches; it goes with the other gauges when this
    replica stops leading."""
    from maintd.embedded import free_port
    from maintd.guardian import HealthMonitor

    member = LeadingMember(health_pg, health_engine)
    gauge = lambda: member.metrics.registry.get_sample_value(  # noqa: E731
        "maintd_health_read_timestamp_seconds", {"target": "maintd"})
    monitor = HealthMonitor([member], lambda: Settings().health)
    try:
        report = monitor.run_once()
        assert report is not None and gauge() == report.at.timestamp()
        member.dsn = f"host=127.0.0.1 port={free_port()} user=postgres dbname=postgres connect_timeout=2"
        with psycopg.connect(health_pg, autocommit=True) as admin:  # the monitor's session ends
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE application_name = 'maintd:guard-1:health'")
        assert monitor.run_once() is None
        assert gauge() == report.at.timestamp()
        member.leading = lambda: False  # a term lost: the series goes with the other health gauges
        monitor.run_once()
        assert gauge() is None
    finally:
        monitor.stop()


def test_a_disabled_health_read_does_not_spin_its_thread(health_pg, health_engine):
    """health.enabled = false on a leader: its monitor thread ran run_once every poll (0.25 s),
    because the targets it led never counted as seen, clearing every target's gauges each time
    (200 targets: 800 clears a second). Now it runs once an interval, like an enabled one."""
    from maintd.guardian import HealthMonitor

    monitor = HealthMonitor([LeadingMember(health_pg, health_engine)], lambda: Settings(health={"enabled": False}).health)
    runs = []
    run_once = monitor.run_once
    monitor.run_once = lambda: runs.append(1) or run_once()  # counted, then run as it is
    monitor.start()
    try:
        time.sleep(2.0)
    finally:
        monitor.stop()
    assert len(runs) == 1, f"{len(runs)} runs in 2 s"
    assert monitor.status("maintd") is None


def test_stopping_cancels_a_health_read_waiting_on_a_lock_instead_of_waiting_it_out(health_pg, health_engine,
                                                                                   maintd_log):
    """A stop joined the monitor's thread for up to 5 s, and a read waiting on the jobs table's
    lock (pg_total_relation_size takes ACCESS SHARE; a migration's or an operator's ACCESS
    EXCLUSIVE) holds it up to its 5 s lock_timeout: the daemon's stop waited it out, with every
    other part of the stop done (CI, PostgreSQL 15, a stop of 4.4 s). Now the stop cancels the
    read, the thread ends at once, and the cancelled read is not logged as a failed one."""
    from maintd.guardian import HealthMonitor

    monitor = HealthMonitor([LeadingMember(health_pg, health_engine)], lambda: Settings().health)
    with psycopg.connect(health_pg) as locker, psycopg.connect(health_pg, autocommit=True) as watcher:
        locker.execute("LOCK TABLE maintd.jobs IN ACCESS EXCLUSIVE MODE")
        monitor.start()
        try:
            wait_for(lambda: watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'maintd:guard-1:health' "
                "AND wait_event_type = 'Lock'").fetchone()[0] == 1, 10,
                what="the health read waits on the lock")
        finally:
            started = time.monotonic()
            monitor.stop()
            took = time.monotonic() - started
        locker.rollback()
    assert took < 1.5, f"stopping the monitor took {took:.1f} s"
    assert not [line for line in maintd_log if "health read failed" in line], maintd_log


# -- a standby's hot_standby_feedback ------------------------------------------------------------

@pytest.mark.slow
def test_a_standbys_hot_standby_feedback_is_named_with_and_without_a_slot():
    """A query on a hot standby with hot_standby_feedback holds the primary's horizon: through
    its walsender (no slot: the walsender's xmin, pg_stat_replication names the standby), or
    through its physical slot (the slot's xmin). PostgreSQL keeps no time for either: the age
    counts from the first read that saw a newer transaction id."""
    from .standby import StandbyPair

    with StandbyPair() as pair:
        with psycopg.connect(pair.standby.dsn, autocommit=True) as standby:
            standby.execute("ALTER SYSTEM SET hot_standby_feedback = on")
            standby.execute("SELECT pg_reload_conf()")
        engine = make_engine(pair.primary.dsn, application_name="maintd-test-health", pooled=False)
        reader = HealthReader()
        try:
            with psycopg.connect(pair.standby.dsn, application_name="bi-on-standby") as query:
                query.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                query.execute("SELECT count(*) FROM pg_class")

                def feedback(kind: str):
                    consume_xids(pair.primary.dsn)
                    report = read(engine, reader, ())
                    return next((h for h in report.horizon.holders if h.kind == kind), None)

                wait_for(lambda: feedback("standby_feedback"), 20, interval=0.3, what="the standby's feedback named")
                time.sleep(1.2)
                h = feedback("standby_feedback")
                assert (h.client_addr, h.state, h.user, h.application_name, h.exact) == \
                    ("127.0.0.1", "streaming", "postgres", "walreceiver", False)
                assert h.pid is not None and h.age_seconds >= 1.0 and h.age_xids >= 3

                with psycopg.connect(pair.primary.dsn, autocommit=True) as primary:
                    primary.execute("SELECT pg_create_physical_replication_slot('standby_slot')")
                with psycopg.connect(pair.standby.dsn, autocommit=True) as standby:
                    standby.execute("ALTER SYSTEM SET primary_slot_name = 'standby_slot'")
                    standby.execute("SELECT pg_reload_conf()")
                slot = wait_for(lambda: feedback("replication_slot"), 30, interval=0.3, what="the slot's xmin named")
                assert (slot.name, slot.detail, slot.scope, slot.client_addr, slot.state) == \
                    ("standby_slot", "physical", "data", "127.0.0.1", "streaming")
                assert "replication slot 'standby_slot'" in slot.describe()
        finally:
            engine.dispose()


# -- PostgreSQL 15's vacuum_defer_cleanup_age -----------------------------------------------------

def test_vacuum_defer_cleanup_age_on_postgresql_15_is_named_as_what_holds_the_horizon():
    """PostgreSQL 15's vacuum_defer_cleanup_age (removed in 16) holds the horizon that many
    transaction ids behind the oldest holder, or behind the next id when nothing else holds it
    (ComputeXidHorizons() retreats the data horizon by it; PostgreSQL 15 docs, runtime-config-
    replication: "Specifies the number of transactions by which VACUUM and HOT updates will defer
    cleanup of dead row versions"). With nothing else holding, the read said the horizon was 0 s
    and 0 xids, "held by: nothing", while VACUUM removed none of the jobs table's dead rows. On a
    PostgreSQL 15 of its own whatever the suite's server: the setting exists on 15 only."""
    with private_server(15, {"vacuum_defer_cleanup_age": "100000", "autovacuum": "off"}) as pg:
        engine = make_engine(pg.dsn, application_name="maintd-test-health", pooled=False)
        try:
            with engine.connect() as conn:
                migrate.upgrade(conn, "maintd")
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                conn.execute("INSERT INTO maintd.jobs (kind) SELECT 'deferred' FROM generate_series(1, 200)")
                conn.execute("DELETE FROM maintd.jobs WHERE kind = 'deferred'")
                consume_xids(pg.dsn)
                conn.execute("VACUUM maintd.jobs")
                dead = conn.execute("SELECT pg_stat_get_dead_tuples('maintd.jobs'::regclass)").fetchone()[0]
                assert dead >= 200, "VACUUM removed the rows: the setting held nothing back, the test shows nothing"
            horizon = read(engine).horizon
            h = horizon.holder
            assert h is not None, horizon
            assert (h.kind, h.scope, h.name, h.exact) == ("setting", "data", "vacuum_defer_cleanup_age", False)
            assert h.age_xids >= 100_000 and horizon.age_xids >= 100_000
            assert "vacuum_defer_cleanup_age" in h.describe()
            from maintd.status import format_health

            text = "\n".join(format_health(read(engine).status("maintd")))
            assert "held by: setting 'vacuum_defer_cleanup_age' (100000 transactions behind the rest)" in text, text
            with psycopg.connect(pg.dsn, application_name="forgetful-worker") as holder:
                holder.execute("INSERT INTO maintd.jobs (kind) VALUES ('held')")  # an xid, then idle
                consume_xids(pg.dsn, 5)
                time.sleep(1.1)
                horizon = read(engine).horizon
                assert horizon.holder.name == "vacuum_defer_cleanup_age"  # behind the transaction
                [t] = [x for x in horizon.holders if x.pid == holder.info.backend_pid]
                assert horizon.holder.age_xids == t.age_xids + 100_000, horizon
                holder.rollback()
        finally:
            engine.dispose()


@pytest.mark.slow
def test_a_standby_that_stays_behind_while_its_xmin_moves_is_warned_about_once(maintd_log):
    """A standby whose queries overlap (one starts before the last ends: reports on a replica)
    sends a feedback xmin that moves on while staying minutes behind (PostgreSQL docs, Hot
    Standby: with hot_standby_feedback the standby's queries hold back the primary's cleanup).
    The standby is one holder, named by its walsender; it was keyed by its xmin as well, so each
    move logged "xmin horizon holder gone" and a new "vacuum is held back": a line pair per read
    (every 15 s) for as long as the replica's reports ran, against SPEC 8.2's once per holder."""
    from .standby import StandbyPair

    with StandbyPair() as pair:
        with psycopg.connect(pair.standby.dsn, autocommit=True) as standby:
            standby.execute("ALTER SYSTEM SET hot_standby_feedback = on")
            standby.execute("ALTER SYSTEM SET wal_receiver_status_interval = '1s'")  # feedback each second
            standby.execute("SELECT pg_reload_conf()")
        engine = make_engine(pair.primary.dsn, application_name="maintd-test-health", pooled=False)
        reader, warnings = HealthReader(), HolderWarnings()

        def feedback():
            consume_xids(pair.primary.dsn)
            horizon = read(engine, reader, ()).horizon
            warnings.check(horizon, timedelta(seconds=1), ["q"])
            return next((h for h in horizon.holders if h.kind == "standby_feedback"), None)

        try:
            with psycopg.connect(pair.standby.dsn, application_name="report-1") as first, \
                    psycopg.connect(pair.standby.dsn, application_name="report-2") as second:
                first.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                first.execute("SELECT count(*) FROM pg_class")
                held = wait_for(lambda: (h := feedback()) and h.age_seconds >= 1.0 and h, 30, interval=0.3,
                                what="the standby's feedback held past xmin_warn_after")
                pair.wait_replayed()  # the standby's next snapshot sees the ids consumed since
                second.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                second.execute("SELECT count(*) FROM pg_class")
                feedback()  # a read that sees ids assigned after the second report's xmin
                time.sleep(1.2)  # the second report too is held past xmin_warn_after: overlapping reports
                first.rollback()  # the feedback moves on to the second report's xmin, still behind
                wait_for(lambda: (h := feedback()) and h.xmin != held.xmin and h.age_seconds >= 1.0, 30,
                         interval=0.3, what="the standby's feedback moved, still held past xmin_warn_after")
                for _ in range(3):
                    feedback()
                second.rollback()
        finally:
            engine.dispose()
    warned = [line for line in maintd_log if "vacuum is held back" in line and "kind=standby_feedback" in line]
    gone = [line for line in maintd_log if "holder gone" in line and "kind=standby_feedback" in line]
    assert (len(warned), len(gone)) == (1, 0), maintd_log


@pytest.mark.slow
def test_vacuum_defer_cleanup_age_does_not_retreat_a_replication_slot_s_xmin():
    """PostgreSQL 15's ComputeXidHorizons() retreats by vacuum_defer_cleanup_age the horizon of the
    running transactions only (backends, prepared transactions, a walsender's feedback), and then
    takes the older of that and the replication slots' xmin (procarray.c, REL_15: "Check whether
    there are replication slots requiring an older xmin", after the retreat). A standby's slot held
    3,000 ids back with the setting at 1,000 holds the horizon at the slot's own age, as VACUUM
    VERBOSE's "removable cutoff" shows; the read retreated the slot too, and named the setting as
    holding the horizon 1,000 ids further back than it was."""
    import re

    from .standby import StandbyPair

    with StandbyPair() as pair:
        with psycopg.connect(pair.primary.dsn, autocommit=True) as primary:
            primary.execute("ALTER SYSTEM SET vacuum_defer_cleanup_age = 1000")
            primary.execute("SELECT pg_reload_conf()")
            primary.execute("SELECT pg_create_physical_replication_slot('standby_slot')")
        with psycopg.connect(pair.standby.dsn, autocommit=True) as standby:
            for setting, value in (("hot_standby_feedback", "on"), ("primary_slot_name", "standby_slot"),
                                   ("wal_receiver_status_interval", "1s")):
                standby.execute(f"ALTER SYSTEM SET {setting} = '{value}'")
            standby.execute("SELECT pg_reload_conf()")
        engine = make_engine(pair.primary.dsn, application_name="maintd-test-health", pooled=False)
        try:
            with psycopg.connect(pair.standby.dsn, application_name="bi-on-standby") as query:
                query.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                query.execute("SELECT count(*) FROM pg_class")

                def slot():
                    horizon = read(engine, None, ()).horizon
                    return next((h for h in horizon.holders if h.kind == "replication_slot"), None)

                wait_for(lambda: (consume_xids(pair.primary.dsn), slot())[1], 30, interval=0.3,
                         what="the slot's xmin named")
                consume_xids(pair.primary.dsn, 3000)
                with psycopg.connect(pair.primary.dsn, autocommit=True) as primary:
                    notices: list[str] = []
                    primary.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
                    primary.execute("CREATE TABLE IF NOT EXISTS defer_probe (n int)")
                    primary.execute("VACUUM (VERBOSE) defer_probe")
                cutoff = re.search(r"removable cutoff: \d+, which was (\d+) XIDs old", "\n".join(notices))
                assert cutoff, notices
                truth = int(cutoff.group(1))
                horizon = read(engine, None, ()).horizon
                held = slot()
                assert held is not None and truth >= 3000 and abs(held.age_xids - truth) <= 10, (held, truth)
                assert horizon.age_xids <= truth + 10, (horizon.holder, truth)
                assert horizon.holder.kind == "replication_slot", horizon.holder
        finally:
            engine.dispose()


def test_the_readme_says_what_to_do_for_every_kind_of_holder_the_read_names():
    """README "When the queue bloats" says what to do "by the holder's kind", one item per kind the
    warning's ``kind=`` and /status can name. PostgreSQL 15's vacuum_defer_cleanup_age became a
    kind (``setting``, the top holder whenever the setting is above 0, so warned about and alerted
    on once held past xmin_warn_after) with no item: the operator met a kind the README never named."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    start = readme.index("What to do, by the holder's kind:")
    listed = set(re.findall(r"^- \*\*`(\w+)`\*\*", readme[start:readme.index("\nAges: ", start)], re.M))
    named = set(re.findall(r"(?:SELECT|THEN|ELSE) '(\w+)'", q.HOLDERS)) - {"data", "catalog"}
    assert {"transaction", "snapshot", "prepared_transaction", "replication_slot", "standby_feedback",
            "setting"} <= named, named
    assert named <= listed, f"kinds the README does not list: {sorted(named - listed)}"
