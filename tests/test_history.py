"""The dashboard's history (SPEC 8.2): a sample is written only when something changed (at most
one a minute) or every ten minutes when idle, fenced like every maintenance write, and pruned by
the writer. Reports are made by hand, at the times the test chooses (the writer uses the read's
server time, never the host's)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import event

from maintd.clock import ServerClock
from maintd.health import HealthReport, Holder, Horizon, TableHealth
from maintd.history import HistoryWriter, KEEP, PRUNE_EVERY, Sample, prune, series
from maintd.queries import sql
from maintd.services.base import NotLeader, PassContext

from .conftest import T0
from .plans import entries_read_while_a_snapshot_is_held


def report(at, *, bytes_: int = 8192, dead: int = 0, holder: Holder | None = None, schema: str = "",
           writes: int = 0) -> HealthReport:
    """A health read as the writer sees it; ``writes``: the jobs table's rows written so far."""
    horizon = Horizon(age_seconds=holder.age_seconds if holder else 0.0, age_xids=holder.age_xids if holder else 0,
                      holders=(holder,) if holder else ())
    return HealthReport(at=at, horizon=horizon,
                        tables={schema: (TableHealth("jobs", 10, dead, bytes_, None, writes),)})


def snapshot(pid: int, age: float) -> Holder:
    return Holder(kind="snapshot", scope="data", pid=pid, user="bi", application_name="metabase",
                  client_addr="10.1.2.3", state="idle in transaction", xmin="800", age_xids=120,
                  age_seconds=age, exact=True, since=T0)


def rows(engine, schema: str) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sql("SELECT * FROM {schema}.health_history ORDER BY at", schema)))


@pytest.fixture
def ctx(settings, engine):
    return PassContext.for_settings(settings, engine, ServerClock())


def test_written_on_change_at_most_once_a_minute_and_every_ten_minutes_when_idle(ctx, engine, schema):
    writer = HistoryWriter()
    at = T0
    assert writer.step(ctx, report(at, schema=schema)) is not None  # the first: nothing to compare with
    for seconds in (15, 30, 45):  # changed, but within the minute
        assert writer.step(ctx, report(at + timedelta(seconds=seconds), dead=seconds, schema=schema)) is None
    for minutes in range(1, 10):  # a minute on, nothing changed since the last row: nothing written
        assert writer.step(ctx, report(at + timedelta(minutes=minutes), schema=schema)) is None
    assert writer.step(ctx, report(at + timedelta(minutes=9, seconds=30), schema=schema, writes=2)) is None
    idle = writer.step(ctx, report(at + timedelta(minutes=10), schema=schema))
    assert idle is not None and idle.since == at
    changed = writer.step(ctx, report(at + timedelta(minutes=11), dead=500, schema=schema))
    assert changed is not None and changed.dead_tuples == 500
    assert [r.at for r in rows(engine, schema)] == [at, at + timedelta(minutes=10), at + timedelta(minutes=11)]


def test_a_sample_counts_the_jobs_finished_in_its_window_and_the_depth_by_state_and_queue(ctx, engine, schema):
    writer = HistoryWriter()
    writer.step(ctx, report(T0, schema=schema))
    with engine.begin() as conn:
        conn.execute(sql("""
            INSERT INTO {schema}.jobs (kind, queue, state, finalized_at)
            SELECT 'k', 'mail', CAST(s AS {schema}.job_state), CAST(:t0 AS timestamptz) + d
              FROM (SELECT 'completed' AS s, g * interval '1 second' AS d FROM generate_series(1, 30) g
                    UNION ALL SELECT 'discarded', interval '10 seconds'
                    UNION ALL SELECT 'completed', interval '5 minutes') AS rows""", schema),
            {"t0": T0})
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state) SELECT 'k', q, 'available' "
                         "FROM unnest(ARRAY['mail', 'mail', 'sms']) q", schema))
    sample = writer.step(ctx, report(T0 + timedelta(minutes=1), schema=schema, writes=35))
    assert (sample.completed, sample.discarded, sample.since) == (30, 1, T0)
    assert sample.depth == {"available": 3, "scheduled": 0, "running": 0, "retryable": 0}
    assert sample.queues == {"mail": 2, "sms": 1}
    assert writer.step(ctx, report(T0 + timedelta(minutes=2), schema=schema, writes=35)) is None  # nothing since
    later = writer.step(ctx, report(T0 + timedelta(minutes=6), schema=schema, writes=36))
    assert (later.completed, later.since) == (1, T0 + timedelta(minutes=1))


def test_a_sample_takes_the_leaders_recent_job_counts_instead_of_counting_again(ctx, engine, schema):
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue) VALUES ('k', 'sms')", schema))
    sample = HistoryWriter().step(ctx, report(T0, schema=schema), lambda: [("mail", "available", 7),
                                                                           ("mail", "running", 2)])
    assert sample.depth["available"] == 7 and sample.queues == {"mail": 9}  # the gauges', not a count
    counted = HistoryWriter().step(ctx, report(T0 + timedelta(minutes=11), schema=schema))
    assert counted.queues == {"sms": 1}


def test_a_holder_is_marked_once_held_a_minute_and_its_coming_and_going_are_changes(ctx, schema):
    writer = HistoryWriter()
    writer.step(ctx, report(T0, schema=schema, holder=snapshot(7, 20)))
    held = writer.step(ctx, report(T0 + timedelta(minutes=1), schema=schema, holder=snapshot(7, 80)))
    assert held.holder["pid"] == 7 and held.holder["describe"] == "snapshot pid 7 (metabase, user bi, 10.1.2.3)"
    assert writer.step(ctx, report(T0 + timedelta(minutes=2), schema=schema, holder=snapshot(7, 140))) is None
    gone = writer.step(ctx, report(T0 + timedelta(minutes=3), schema=schema))
    assert gone is not None and gone.holder is None


@pytest.mark.parametrize("kind", ["standby_feedback", "replication_slot"])
def test_a_standby_or_slot_whose_xmin_moves_while_it_stays_behind_is_no_change(ctx, engine, schema, kind):
    """A standby's hot_standby_feedback (or its slot) that keeps a replica's queries' horizon
    moves its xmin at every read while it stays minutes behind: the same holder (as the warning
    sees it), so on an otherwise idle jobs table a row every ten minutes, not one a minute (the
    holder's xmin was part of what made a change)."""
    def standby(minutes: int) -> Holder:
        return Holder(kind=kind, scope="data", pid=9, user="replicator", application_name="standby-1",
                      client_addr="10.0.0.9", state="streaming", xmin=str(800 + minutes), age_xids=300,
                      age_seconds=420.0, exact=False, name="standby_1" if kind == "replication_slot" else None,
                      detail="physical" if kind == "replication_slot" else "walsender")
    writer = HistoryWriter()
    assert writer.step(ctx, report(T0, schema=schema, holder=standby(0))) is not None
    written = [m for m in range(1, 10)
               if writer.step(ctx, report(T0 + timedelta(minutes=m), schema=schema, holder=standby(m))) is not None]
    assert written == [], written
    assert writer.step(ctx, report(T0 + timedelta(minutes=10), schema=schema, holder=standby(10))) is not None


def test_a_new_term_continues_from_the_last_row_in_the_table(ctx, engine, schema):
    HistoryWriter().step(ctx, report(T0, schema=schema))
    successor = HistoryWriter()  # another replica (or term): reads the last row first
    assert successor.step(ctx, report(T0 + timedelta(seconds=30), schema=schema)) is None
    assert successor.step(ctx, report(T0 + timedelta(minutes=5), schema=schema)) is None
    assert len(rows(engine, schema)) == 1


def test_a_sample_is_written_only_under_the_fence(settings, engine, schema):
    """A stale term's history write is refused inside its transaction (nothing written)."""
    asked = []

    class Refusing:
        epoch = 3

        def check(self, conn):
            asked.append(True)
            raise NotLeader("another instance leads")

    ctx = PassContext.for_settings(settings, engine, ServerClock(), fence=Refusing())
    with pytest.raises(NotLeader):
        HistoryWriter().step(ctx, report(T0, schema=schema))
    assert asked == [True] and rows(engine, schema) == []


def test_the_writer_prunes_history_older_than_two_days_hourly_with_the_cleaner_disabled(settings, engine,
                                                                                       schema, maintd_log):
    """The history was pruned by the cleaner's passes only: with ``[cleaner] enabled = false`` it
    grew for ever. The writer prunes what it writes, at most hourly (a read-only probe first), as
    fenced as its writes, whatever the cleaner's settings."""
    settings.cleaner.enabled = False
    ctx = PassContext.for_settings(settings, engine, ServerClock())
    with engine.begin() as conn:
        for at in (T0, T0 + timedelta(hours=1), T0 + timedelta(hours=2)):
            conn.execute(sql("INSERT INTO {schema}.health_history (at, since) VALUES (:at, :at)", schema), {"at": at})
    writer = HistoryWriter()
    now = T0 + KEEP + timedelta(minutes=90)
    assert writer.step(ctx, report(now, schema=schema)) is not None
    assert [r.at for r in rows(engine, schema)] == [T0 + timedelta(hours=2), now]
    assert [line for line in maintd_log if line.startswith("maintd.history: pruned the dashboard's history rows=2 ")]
    writer.step(ctx, report(now + PRUNE_EVERY - timedelta(minutes=1), dead=5, schema=schema))
    assert T0 + timedelta(hours=2) in [r.at for r in rows(engine, schema)]  # past two days, not yet due
    writer.step(ctx, report(now + PRUNE_EVERY + timedelta(minutes=1), dead=6, schema=schema))
    assert min(r.at for r in rows(engine, schema)) == now
    from maintd.dashboard import CHART_RANGES

    assert KEEP >= max(back for _, back, _ in CHART_RANGES) + timedelta(hours=1)  # the day chart stays whole



def test_the_prune_deletes_in_batches(settings, engine, schema):
    """Rows past KEEP go in batches of ``batch`` rows, each its own short transaction (after an
    outage of the writer the backlog is days of rows: one DELETE of it all holds its locks and
    its statement timeout for the whole)."""
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.health_history (at, since) SELECT t, t FROM generate_series("
                         "CAST(:t0 AS timestamptz), CAST(:t0 AS timestamptz) + interval '24 minutes', "
                         "interval '1 minute') t",
                         schema), {"t0": T0})
    deleted: list[int] = []

    def count(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().startswith("DELETE FROM") and "health_history" in statement:
            deleted.append(cursor.rowcount)

    event.listen(engine, "after_cursor_execute", count)
    try:
        ctx = PassContext.for_settings(settings, engine, ServerClock())
        assert prune(ctx, T0 + KEEP + timedelta(hours=1), batch=10) == 25
    finally:
        event.remove(engine, "after_cursor_execute", count)
    assert deleted == [10, 10, 5]
    assert rows(engine, schema) == []

def test_the_charts_series_has_one_point_per_bucket_with_the_finished_jobs_summed(ctx, engine, schema):
    with engine.begin() as conn:
        for i in range(12):  # one sample a minute for 12 minutes, 6 completed in each
            conn.execute(sql("INSERT INTO {schema}.health_history (at, since, completed, depth, queues, dead_tuples) "
                             "VALUES (:at, :since, 6, CAST(:depth AS jsonb), '{}', :dead)", schema),
                         {"at": T0 + timedelta(minutes=i + 1), "since": T0 + timedelta(minutes=i),
                          "depth": f'{{"available": {i}}}', "dead": i * 10})
        points = series(conn, schema, T0, timedelta(minutes=10))
    assert [(p.at, p.since, p.completed, p.depth["available"], p.dead_tuples) for p in points] == [
        (T0 + timedelta(minutes=9), T0, 54, 8, 80),
        (T0 + timedelta(minutes=12), T0 + timedelta(minutes=9), 18, 11, 110)]
    assert isinstance(points[0], Sample)


def test_the_depth_by_queue_keeps_a_queue_named_other_apart_from_the_overflow():
    """The largest queues by name and the rest summed as ``_other``: a queue named ``_other``
    among the largest was summed with the rest. Beside the overflow it is ``\\_other``."""
    from maintd.history import depth_of
    from maintd.metrics import OTHER
    rows = [("_other", "available", 30), ("big", "running", 20)] + [(f"q{i}", "available", 1) for i in range(4)]
    states, queues = depth_of(rows, top=2)
    assert queues == {"\\_other": 30, "big": 20, OTHER: 4}, queues
    assert states["available"] == 34 and states["running"] == 20


def test_the_prune_reads_each_entry_once_while_a_snapshot_keeps_them(settings, engine, schema, pg_dsn):
    """Each batch of the prune read health_history_pkey from its start. A deleted row's entry
    stays there until a vacuum, and while any transaction older than the delete is open (a
    report, a pg_dump) the scan cannot mark it dead, so every batch read again the entries of
    every earlier one: 400 rows in batches of 20 read 4,233 entries, 1,600 read 64,833
    (quadratic). Each batch now starts at the last one's last row."""
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.health_history (at, since) SELECT t, t FROM generate_series("
                         "CAST(:t0 AS timestamptz) - interval '399 minutes', CAST(:t0 AS timestamptz), "
                         "interval '1 minute') t", schema), {"t0": T0})
        conn.execute(sql("INSERT INTO {schema}.health_history (at, since) VALUES ('-infinity', '-infinity')", schema))
        conn.execute(sql("ANALYZE {schema}.health_history", schema))
    n, read = entries_read_while_a_snapshot_is_held(
        engine, pg_dsn, schema, "health_history",
        lambda e: prune(PassContext.for_settings(settings, e, ServerClock()), T0 + KEEP + timedelta(hours=1), batch=20))
    assert n == 401 and rows(engine, schema) == []
    # one read to delete each row, one more per batch (where it starts), the probe's (about 440 here)
    assert read <= 1000, f"{read} entries of health_history_pkey read to prune 401 rows"
