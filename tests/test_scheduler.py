"""Scheduler: promotes exactly the due jobs, NOTIFYs each affected queue once, batches, lag."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

import psycopg

from maintd.clock import SystemClock
from maintd.db import notify_channel, sql
from maintd.metrics import Metrics
from maintd.services.base import PassContext
from maintd.services.scheduler import COUNT_DUE, MIN_WAKE, NEXT_DUE, PROMOTE_BATCH, Scheduler

from .conftest import T0, run_concurrently
from .plans import explain


def add(engine, schema, *, state, due_in, queue="default", n=1):
    with engine.begin() as conn:
        return [r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, queue, state, scheduled_at, finalized_at) "
            "SELECT 'k', :queue, CAST(:state AS {schema}.job_state), CAST(:t AS timestamptz), "
            "CASE WHEN :state IN ('completed', 'cancelled', 'discarded') THEN now() END "
            "FROM generate_series(1, :n) RETURNING id", schema),
            {"queue": queue, "state": state, "t": T0 + due_in, "n": n})]


def states(engine, schema):
    with engine.connect() as conn:
        return {r.id: r.state for r in conn.execute(sql("SELECT id, state FROM {schema}.jobs", schema))}


def run(settings, engine, clock, **kw):
    settings.scheduler.precise_timing = False
    return Scheduler(settings).run_once(PassContext(engine=engine, settings=settings, clock=clock, **kw))


def listen(pg_dsn, schema):
    conn = psycopg.connect(pg_dsn, autocommit=True)
    conn.execute(f'LISTEN "{notify_channel(schema)}"')
    return conn


def drain(conn, timeout=0.5):
    return [n.payload for n in conn.notifies(timeout=timeout)]


def test_promotes_exactly_the_due_jobs_and_notifies_each_queue_once(pg_dsn, settings, engine, schema, clock):
    due_a = add(engine, schema, state="scheduled", due_in=timedelta(seconds=-1), queue="a", n=3)
    due_b = add(engine, schema, state="retryable", due_in=timedelta(0), queue="b")  # exactly now: due
    future = add(engine, schema, state="scheduled", due_in=timedelta(seconds=1), queue="c")
    final = add(engine, schema, state="completed", due_in=timedelta(hours=-1), queue="d")
    running = add(engine, schema, state="running", due_in=timedelta(hours=-1), queue="e")
    listener = listen(pg_dsn, schema)
    try:
        result = run(settings, engine, clock)
        payloads = drain(listener)
    finally:
        listener.close()
    assert result.promoted == {"a": 3, "b": 1}
    s = states(engine, schema)
    assert all(s[i] == "available" for i in due_a + due_b)
    assert s[future[0]] == "scheduled" and s[final[0]] == "completed" and s[running[0]] == "running"
    assert sorted(payloads) == ["a", "b"]


def test_channel_name_follows_schema():
    assert notify_channel("maintd") == "maintd_jobs"
    assert notify_channel("billing") == "billing_maintd_jobs"


def test_batches_and_one_notify_per_queue_per_transaction(pg_dsn, settings, engine, schema, clock):
    settings.scheduler.batch_size = 10
    add(engine, schema, state="scheduled", due_in=timedelta(seconds=-5), queue="q", n=21)
    listener = listen(pg_dsn, schema)
    try:
        result = run(settings, engine, clock)
        payloads = drain(listener)
    finally:
        listener.close()
    assert result.promoted == {"q": 21} and result.batches == 3
    assert payloads == ["q", "q", "q"]  # one per committed batch


def test_idle_tick_sends_nothing(pg_dsn, settings, engine, schema, clock):
    add(engine, schema, state="scheduled", due_in=timedelta(hours=1), n=5)
    listener = listen(pg_dsn, schema)
    try:
        result = run(settings, engine, clock)
        assert drain(listener, 0.2) == []
    finally:
        listener.close()
    assert result.total == 0 and not result.did_something()


def test_dry_run(settings, engine, schema, clock):
    add(engine, schema, state="scheduled", due_in=timedelta(seconds=-1), queue="a", n=2)
    result = run(settings, engine, clock, dry_run=True)
    assert result.promoted == {"a": 2}
    assert set(states(engine, schema).values()) == {"scheduled"}


def test_two_schedulers_promote_each_job_once(pg_dsn, settings, engine, schema, clock):
    settings.scheduler.batch_size = 7
    add(engine, schema, state="scheduled", due_in=timedelta(seconds=-1), queue="q", n=500)
    results = run_concurrently(lambda: run(settings, engine, clock))
    assert sum(r.total for r in results) == 500
    assert set(states(engine, schema).values()) == {"available"}


def test_statements_are_index_backed(settings, engine, schema):
    """Promotion, the idle probe and the dry-run count read jobs_scheduled_idx, with values known or
    as a generic prepared plan; never a Seq Scan."""
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, finalized_at) "
                         "SELECT 'k', 'completed', now() FROM generate_series(1, 30000)", schema))
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, scheduled_at) "
                         "SELECT 'k', 'scheduled', now() + g * interval '1 second' FROM generate_series(1, 3000) g",
                         schema))
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    with engine.connect() as conn:
        for stmt in (PROMOTE_BATCH, NEXT_DUE, COUNT_DUE):
            for generic in (False, True):
                plan = explain(conn, stmt, schema, {"now": T0, "limit": 100}, generic=generic)
                assert "jobs_scheduled_idx" in plan and "Seq Scan" not in plan, plan
        conn.rollback()


def test_observe_counts_promotions_by_queue(settings, engine, schema, clock):
    add(engine, schema, state="scheduled", due_in=timedelta(seconds=-1), queue="a", n=3)
    add(engine, schema, state="retryable", due_in=timedelta(seconds=-1), queue="b", n=1)
    metrics = Metrics()
    Scheduler(settings).observe(metrics, run(settings, engine, clock))
    value = metrics.registry.get_sample_value
    assert value("maintd_jobs_promoted_total", {"queue": "a"}) == 3
    assert value("maintd_jobs_promoted_total", {"queue": "b"}) == 1


def test_precise_timing_promotes_between_ticks(settings, engine, schema):
    """A job due 0.4 s after the tick is promoted within a few ms of its time, not at the next tick."""
    settings.scheduler.interval = timedelta(seconds=2)
    now = datetime.now(timezone.utc)
    with engine.begin() as conn:
        [jid] = [r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, state, scheduled_at) VALUES ('k', 'scheduled', :t) RETURNING id",
            schema), {"t": now + timedelta(milliseconds=400)})]
    seen: dict[str, float] = {}

    def watch():
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            if states(engine, schema)[jid] == "available":
                seen["at"] = time.time()
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    sched = Scheduler(settings)
    result = sched.run_once(PassContext(engine=engine, settings=settings, clock=SystemClock()))
    watcher.join()
    assert result.total == 1 and result.wakeups >= 1
    lag = seen["at"] - (now + timedelta(milliseconds=400)).timestamp()
    assert lag < 0.25, f"promotion lag {lag:.3f}s"


def test_precise_timing_wakes_at_most_every_min_wake(settings, engine, schema):
    """A dense stream of due times (one every 3 ms) does not turn the pass into a busy loop."""
    settings.scheduler.interval = timedelta(seconds=1)
    start = datetime.now(timezone.utc)
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, scheduled_at) "
                         "SELECT 'k', 'scheduled', CAST(:t AS timestamptz) + g * interval '3 milliseconds' "
                         "FROM generate_series(1, 300) g", schema), {"t": start})
    result = Scheduler(settings).run_once(PassContext(engine=engine, settings=settings, clock=SystemClock()))
    assert 5 <= result.wakeups <= 1 / MIN_WAKE + 2, result
    with engine.connect() as conn:
        pending = conn.execute(sql("SELECT min(scheduled_at) FROM {schema}.jobs WHERE state = 'scheduled'",
                                   schema)).scalar()
    # Everything due well before the pass ended was promoted (at most one MIN_WAKE late).
    assert pending is None or pending > start + timedelta(seconds=0.5)
