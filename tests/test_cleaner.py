"""Cleaner: exact rows kept and deleted at every retention edge, batches, overrides, dry run."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from sqlalchemy import text

from maintd.db import sql
from maintd.services.base import PassContext
from maintd.services.cleaner import DELETE_RANGE, DELETE_TIED, PROBE, Cleaner

from .conftest import T0, run_concurrently


def insert(engine, schema, *, state, finalized_ago=None, queue="default", n=1, spread=False):
    """Insert n jobs in ``state`` finalized ``finalized_ago`` before T0 (``spread``: each 1 ms
    older than the previous); returns their ids."""
    final = state in ("completed", "cancelled", "discarded")
    with engine.begin() as conn:
        return [r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, queue, state, finalized_at, attempted_at) "
            "SELECT 'k', :queue, CAST(:state AS {schema}.job_state), "
            "CASE WHEN :final THEN CAST(:t0 AS timestamptz) - CAST(:ago AS interval) "
            "- CASE WHEN :spread THEN g * interval '1 millisecond' ELSE interval '0' END END, "
            "CAST(:t0 AS timestamptz) - interval '3 days' FROM generate_series(1, :n) g RETURNING id", schema),
            {"queue": queue, "state": state, "final": final, "t0": T0, "spread": spread,
             "ago": finalized_ago or timedelta(0), "n": n})]


def remaining(engine, schema) -> set[int]:
    with engine.connect() as conn:
        return {r[0] for r in conn.execute(sql("SELECT id FROM {schema}.jobs", schema))}


def run(settings, engine, clock, dry_run=False, cleaner=None):
    cleaner = cleaner or Cleaner(settings)
    return cleaner.run_once(PassContext(engine=engine, settings=settings, clock=clock, dry_run=dry_run))


@pytest.mark.parametrize("state,retention", [
    ("completed", timedelta(hours=24)), ("cancelled", timedelta(hours=24)), ("discarded", timedelta(days=7)),
])
def test_retention_edges_per_state(settings, engine, schema, clock, state, retention):
    old = insert(engine, schema, state=state, finalized_ago=retention + timedelta(seconds=1))
    young = insert(engine, schema, state=state, finalized_ago=retention - timedelta(seconds=1))
    exact = insert(engine, schema, state=state, finalized_ago=retention)  # not older: kept
    result = run(settings, engine, clock)
    assert result.deleted[state] == 1
    assert remaining(engine, schema) == set(young + exact)
    assert not set(old) & remaining(engine, schema)


def test_non_final_jobs_are_never_touched(settings, engine, schema, clock):
    live = []
    for state in ("available", "scheduled", "running", "retryable"):
        live += insert(engine, schema, state=state, n=3)
    with engine.begin() as conn:  # even if very old
        conn.execute(sql("UPDATE {schema}.jobs SET created_at = now() - interval '1 year', "
                         "scheduled_at = now() - interval '1 year'", schema))
    result = run(settings, engine, clock)
    assert result.total == 0
    assert remaining(engine, schema) == set(live)


def test_minus_one_keeps_forever(settings, engine, schema, clock):
    settings.cleaner.discarded_retention = None
    kept = insert(engine, schema, state="discarded", finalized_ago=timedelta(days=3650))
    gone = insert(engine, schema, state="completed", finalized_ago=timedelta(days=2))
    run(settings, engine, clock)
    assert remaining(engine, schema) == set(kept)
    assert gone


def test_per_queue_overrides(pg_dsn, schema, engine, clock):
    from maintd.config import Settings

    settings = Settings(database_url=pg_dsn, schema=schema, cleaner={
        "completed_retention": "1h",
        "queues": {"billing": {"completed_retention": "30d"},
                   "noisy": {"completed_retention": "1m", "discarded_retention": -1}},
    })
    billing_old = insert(engine, schema, state="completed", queue="billing",
                         finalized_ago=timedelta(days=30, seconds=1))
    billing_young = insert(engine, schema, state="completed", queue="billing",
                           finalized_ago=timedelta(days=29, hours=23, minutes=59, seconds=59))
    noisy_old = insert(engine, schema, state="completed", queue="noisy", finalized_ago=timedelta(seconds=61))
    noisy_young = insert(engine, schema, state="completed", queue="noisy", finalized_ago=timedelta(seconds=59))
    noisy_discarded = insert(engine, schema, state="discarded", queue="noisy", finalized_ago=timedelta(days=999))
    other_old = insert(engine, schema, state="completed", queue="other", finalized_ago=timedelta(minutes=61))
    other_young = insert(engine, schema, state="completed", queue="other", finalized_ago=timedelta(minutes=59))
    # Billing does not override 'discarded': the global 7 d applies.
    billing_discarded_old = insert(engine, schema, state="discarded", queue="billing",
                                   finalized_ago=timedelta(days=7, seconds=1))
    result = run(settings, engine, clock)
    assert remaining(engine, schema) == set(billing_young + noisy_young + noisy_discarded + other_young)
    assert result.deleted == {"completed": 3, "cancelled": 0, "discarded": 1}
    assert billing_old and noisy_old and other_old and billing_discarded_old


def test_batches_of_batch_size(settings, engine, schema, clock):
    settings.cleaner.batch_size = 100
    insert(engine, schema, state="completed", finalized_ago=timedelta(days=2), n=101, spread=True)
    keep = insert(engine, schema, state="completed", finalized_ago=timedelta(hours=1), n=5, spread=True)
    result = run(settings, engine, clock)
    assert result.deleted["completed"] == 101
    # 100 + 1 for completed, then one (empty) batch each for cancelled and discarded.
    assert result.batches == 4
    assert remaining(engine, schema) == set(keep)


def test_dry_run_counts_and_changes_nothing(settings, engine, schema, clock):
    insert(engine, schema, state="completed", finalized_ago=timedelta(days=2), n=7)
    insert(engine, schema, state="discarded", finalized_ago=timedelta(days=8), n=2)
    before = remaining(engine, schema)
    result = run(settings, engine, clock, dry_run=True)
    assert result.dry_run and result.deleted == {"completed": 7, "cancelled": 0, "discarded": 2}
    assert remaining(engine, schema) == before


def test_two_cleaners_at_once_delete_each_row_once(settings, engine, schema, clock):
    settings.cleaner.batch_size = 50
    insert(engine, schema, state="completed", finalized_ago=timedelta(days=2), n=2000)
    results = run_concurrently(lambda: run(settings, engine, clock))
    assert sum(r.deleted["completed"] for r in results) == 2000
    assert remaining(engine, schema) == set()


def test_adaptive_batch_shrinks_after_timeout_and_grows_back(settings, engine, schema, clock):
    settings.cleaner.batch_size = 1000
    cleaner = Cleaner(settings)
    insert(engine, schema, state="completed", finalized_ago=timedelta(days=2), n=10)
    # A DELETE batch blocked by a worker's lock on the row hits the tiny statement timeout.
    ids = sorted(remaining(engine, schema))
    blocker = engine.connect()
    blocker.execute(sql("SELECT 1 FROM {schema}.jobs WHERE id = :id FOR UPDATE", schema), {"id": ids[0]})
    try:
        settings.statement_timeout = timedelta(milliseconds=200)
        ctx = PassContext(engine=engine, settings=settings, clock=clock)
        # A locked row is skipped (after a short lock wait), not waited for: no timeout here...
        result = cleaner.run_once(ctx)
        assert result.deleted["completed"] == 9 and result.timeouts == 0
    finally:
        blocker.rollback()
        blocker.close()
    # ...so force one with a lock on the whole table.
    insert(engine, schema, state="completed", finalized_ago=timedelta(days=2), n=10)
    locker = engine.connect()
    locker.execute(sql("LOCK TABLE {schema}.jobs IN EXCLUSIVE MODE", schema))
    timer = threading.Timer(1.0, lambda: (locker.rollback(), locker.close()))
    timer.start()
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
        orig = ctx.transaction

        def short_timeout_transaction(**kw):
            kw.setdefault("statement_timeout_ms", 300)
            return orig(**kw)

        ctx.transaction = short_timeout_transaction  # type: ignore[method-assign]
        result = cleaner.run_once(ctx)
    finally:
        timer.join()
    assert result.timeouts >= 1
    assert cleaner._batch < 1000
    assert result.deleted["completed"] == 11  # the previously locked row too
    # Successes grow the batch back to batch_size.
    for _ in range(12):
        cleaner.run_once(PassContext(engine=engine, settings=settings, clock=clock))
    assert cleaner._batch == 1000


def test_delete_batch_is_index_backed(settings, engine, schema, clock, pg_version):
    """No batch may scan the whole table: the plan must use jobs_finalized_idx, not a Seq Scan."""
    with engine.begin() as conn:
        conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, queue, state, finalized_at, attempted_at) "
            "SELECT 'k', 'q' || (g % 5), CASE WHEN g % 10 = 0 THEN 'available' ELSE 'completed' END::{schema}.job_state, "
            "CASE WHEN g % 10 = 0 THEN NULL ELSE now() - (g || ' seconds')::interval END, now() "
            "FROM generate_series(1, 50000) g", schema))
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
        params = {"state": "completed", "horizon": T0, "lo": T0 - timedelta(days=9999),
                  "hi": T0 - timedelta(days=1), "queue": None, "excluded": ["q1"], "limit": 1000}
        plans = []
        for stmt in (PROBE, DELETE_RANGE, DELETE_TIED):
            plans.append("\n".join(r[0] for r in conn.execute(text("EXPLAIN " + sql(stmt, schema).text), params)))
        plan = "\n".join(plans)
    assert all("jobs_finalized_idx" in p for p in plans), plan
    assert "jobs_finalized_idx" in plan, plan
    assert "Seq Scan" not in plan, plan


def test_ties_larger_than_a_batch(settings, engine, schema, clock):
    """250 rows finalized at the same instant, batch_size 100: all deleted, nothing else."""
    settings.cleaner.batch_size = 100
    insert(engine, schema, state="completed", finalized_ago=timedelta(days=2), n=250)
    keep = insert(engine, schema, state="completed", finalized_ago=timedelta(hours=1), n=3)
    insert(engine, schema, state="completed", finalized_ago=timedelta(days=3), n=5)
    result = run(settings, engine, clock)
    assert result.deleted["completed"] == 255
    assert remaining(engine, schema) == set(keep)
