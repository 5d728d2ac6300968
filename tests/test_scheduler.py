"""Scheduler: promotes exactly the due jobs, NOTIFYs each affected queue once, batches, lag."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

import psycopg
import pytest

from maintd.clock import ServerClock
from maintd.db import notify_channel
from maintd.queries import sql
from maintd.metrics import Metrics
from maintd.services.base import PassContext
from maintd.queries.jobs import SCHEDULER_COUNT_DUE, SCHEDULER_NEXT_DUE, SCHEDULER_PROBE, SCHEDULER_PROMOTE
from maintd.services.scheduler import MIN_WAKE, Scheduler, SchedulerResult

from .conftest import T0, run_concurrently
from .plans import explain

# Every test here runs on both jobs layouts (SPEC 8.1): tests/conftest.py.
pytestmark = pytest.mark.both_layouts


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
    return Scheduler(settings.scheduler).run_once(PassContext.for_settings(settings, engine, clock, **kw))


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
    add(engine, schema, state="retryable", due_in=timedelta(0), queue="b")  # due exactly now: counted
    add(engine, schema, state="scheduled", due_in=timedelta(microseconds=1), queue="c")  # not yet
    result = run(settings, engine, clock, dry_run=True)
    assert result.promoted == {"a": 2, "b": 1}
    assert result.dry_run is True and result.summary() == "would promote 3 jobs a=2 b=1"
    assert set(states(engine, schema).values()) == {"scheduled", "retryable"}  # nothing changed


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
        for stmt in (SCHEDULER_PROBE, SCHEDULER_PROMOTE, SCHEDULER_NEXT_DUE, SCHEDULER_COUNT_DUE):
            for generic in (False, True):
                plan = explain(conn, stmt, schema, {"now": T0, "limit": 100}, generic=generic)
                assert "jobs_scheduled_idx" in plan and "Seq Scan" not in plan, plan
                if stmt == SCHEDULER_PROBE:  # both probes of the idle tick
                    assert plan.count("jobs_scheduled_idx") == 2, plan
        conn.rollback()


def test_observe_counts_promotions_by_queue(settings, engine, schema, clock):
    add(engine, schema, state="scheduled", due_in=timedelta(seconds=-1), queue="a", n=3)
    add(engine, schema, state="retryable", due_in=timedelta(seconds=-1), queue="b", n=1)
    metrics = Metrics()
    Scheduler(settings.scheduler).observe(metrics, run(settings, engine, clock))
    value = lambda name, labels=None: metrics.registry.get_sample_value(name, {"target": "maintd", **(labels or {})})
    assert value("maintd_jobs_promoted_total", {"queue": "a"}) == 3
    assert value("maintd_jobs_promoted_total", {"queue": "b"}) == 1


# What a loaded 2-core machine adds to a wake-up on the wall clock: waking up, checking out a
# connection, the promote transaction and its commit (measured under a parallel load: typically
# 0.02-0.15 s, once 0.4 s with a load average of 10 on 2 cores, and 0.38 s in a full run of the
# suite on 2 workers, load about 3, failing the earlier 0.2 s). The design's own lag (at most one
# MIN_WAKE) is checked exactly, without this noise, on a simulated clock by
# test_precise_timing_lag_is_at_most_one_min_wake_on_a_simulated_clock; the wall-clock tests only
# check that the real thing is nowhere near the tick interval: lag at most MIN_WAKE + NOISE (0.5 s,
# half the 1 s interval the pass would otherwise wait, under which 300 jobs due every 3 ms over
# the interval would be up to a second late).
NOISE = 0.45


def test_precise_timing_promotes_between_ticks(settings, engine, schema):
    """A job due 0.4 s after the tick is promoted at its time (the pass sleeps until then: on the
    wall clock, within MIN_WAKE + NOISE), not at the next tick 2 s later."""
    settings.scheduler.interval = timedelta(seconds=2)
    states(engine, schema)  # a connection ready (and, partitioned, its partitions known) before the clock starts
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
    sched = Scheduler(settings.scheduler)
    result = sched.run_once(PassContext.for_settings(settings, engine, ServerClock()))
    watcher.join()
    assert result.total == 1 and result.wakeups >= 1
    lag = seen["at"] - (now + timedelta(milliseconds=400)).timestamp()
    assert lag <= MIN_WAKE + NOISE, f"promotion lag {lag:.3f}s"


def record_promotions(engine, schema):
    """An audit trigger: the server's clock at the moment each job became available."""
    with engine.begin() as conn:
        for stmt in [
            "CREATE TABLE {schema}.promotions (id bigint PRIMARY KEY, at timestamptz NOT NULL)",
            "CREATE FUNCTION {schema}.record_promotion() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "INSERT INTO {schema}.promotions VALUES (NEW.id, clock_timestamp()); RETURN NULL; END $$",
            "CREATE TRIGGER promoted AFTER UPDATE OF state ON {schema}.jobs FOR EACH ROW "
            "WHEN (NEW.state = 'available' AND OLD.state <> 'available') "
            "EXECUTE FUNCTION {schema}.record_promotion()",
        ]:
            conn.execute(sql(stmt, schema))


def test_precise_timing_wakes_at_most_every_min_wake(settings, engine, schema):
    """A dense stream of due times (one every 3 ms) does not turn the pass into a busy loop, and
    each job due during the pass is promoted at most one MIN_WAKE (plus NOISE) late, never early."""
    settings.scheduler.interval = timedelta(seconds=1)
    record_promotions(engine, schema)
    start = datetime.now(timezone.utc)
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, scheduled_at) "
                         "SELECT 'k', 'scheduled', CAST(:t AS timestamptz) + g * interval '3 milliseconds' "
                         "FROM generate_series(1, 300) g", schema), {"t": start})
    result = Scheduler(settings.scheduler).run_once(PassContext.for_settings(settings, engine, ServerClock()))
    ended = datetime.now(timezone.utc)
    assert 5 <= result.wakeups <= 1 / MIN_WAKE + 2, result
    with engine.connect() as conn:
        rows = conn.execute(sql("SELECT j.id, j.state::text AS state, j.scheduled_at, p.at FROM {schema}.jobs j "
                                "LEFT JOIN {schema}.promotions p USING (id) ORDER BY j.scheduled_at", schema)).all()
    promoted = [r for r in rows if r.state == "available"]
    assert len(promoted) == result.total >= 100, result
    assert all(r.at is not None for r in promoted)
    lags = [(r.at - r.scheduled_at).total_seconds() for r in promoted]
    assert min(lags) >= 0, "promoted before it was due"
    assert max(lags) <= MIN_WAKE + NOISE, f"promotion lag up to {max(lags):.3f}s"
    # The pass ends (about TICK_MARGIN before the next tick) right after a promotion: what is
    # still scheduled fell due after that last promotion, or is at most noise earlier.
    last = max(r.at for r in promoted)
    pending = [r.scheduled_at for r in rows if r.state == "scheduled"]
    assert not pending or min(pending) > last - timedelta(seconds=NOISE)
    assert last <= ended


class AheadClock(ServerClock):
    """A ServerClock whose carried reading runs ``ahead`` seconds fast: what the monotonic carry's
    drift (and the round trip's asymmetry) does to a real one, a fraction of a ms at a time."""

    def __init__(self, ahead: float):
        super().__init__()
        self.ahead = timedelta(seconds=ahead)

    def now(self) -> datetime:
        return super().now() + self.ahead


def test_a_job_is_never_promoted_before_the_servers_clock_reaches_it(settings, engine, schema):
    """Whatever the daemon's reading of the server's clock says, promotion waits for the server's
    own clock: 200 jobs spread over 2 s, promoted by precise-timing passes whose clock runs 30 ms
    fast, are each promoted at or after scheduled_at by clock_timestamp() in the promoting
    transaction (a trigger records it), and still within MIN_WAKE + NOISE."""
    settings.scheduler.interval = timedelta(seconds=1)
    record_promotions(engine, schema)
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, scheduled_at) "
                         "SELECT 'k', 'scheduled', clock_timestamp() + interval '0.2 seconds' "
                         "+ g * interval '10.0371 milliseconds' FROM generate_series(1, 200) g", schema))
    clock, total = AheadClock(0.030), 0
    deadline = time.monotonic() + 3.5
    while time.monotonic() < deadline and total < 200:
        total += Scheduler(settings.scheduler).run_once(PassContext.for_settings(settings, engine, clock)).total
    with engine.connect() as conn:
        rows = conn.execute(sql("SELECT j.id, j.scheduled_at, p.at FROM {schema}.jobs j "
                                "JOIN {schema}.promotions p USING (id)", schema)).all()
    assert total == len(rows) == 200
    early = [(r.id, (r.scheduled_at - r.at).total_seconds()) for r in rows if r.at < r.scheduled_at]
    assert not early, f"{len(early)} promoted before the server's clock reached them, e.g. {early[:3]}"
    lags = [(r.at - r.scheduled_at).total_seconds() for r in rows]
    assert max(lags) <= MIN_WAKE + NOISE, f"promotion lag up to {max(lags):.3f}s"


class SimulatedSleep(threading.Event):
    """A pass's stop flag whose waits take no time: each moves a FrozenClock on by its timeout
    instead, and records the time it wakes at."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock
        self.wakes: list[datetime] = []

    def wait(self, timeout=None):
        if self.is_set():
            return True
        self.wakes.append(self.clock.advance(timeout))
        return False


def test_precise_timing_lag_is_at_most_one_min_wake_on_a_simulated_clock(settings, engine, schema, clock):
    """The module's promise, without the machine's noise: every job is promoted at the first
    wake-up at or after its due time, and that wake-up comes at most MIN_WAKE after it, for a
    dense stream (every 3 ms) and for sparse due times (the pass sleeps until each exactly, at
    most MAX_SLEEP at a time); wake-ups are at least MIN_WAKE apart."""
    settings.scheduler.interval = timedelta(seconds=60)  # the pass's real-time deadline is never near
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, scheduled_at) "
                         "SELECT 'k', 'scheduled', CAST(:t AS timestamptz) + g * interval '3 milliseconds' "
                         "FROM generate_series(1, 300) g", schema), {"t": T0})
    sparse = [timedelta(seconds=s) for s in (1.2, 1.45, 2.0, 3.7)]
    for due in sparse:
        add(engine, schema, state="retryable", due_in=due)
    stop = SimulatedSleep(clock)
    result = Scheduler(settings.scheduler).run_once(
        PassContext.for_settings(settings, engine, clock, stop_event=stop))
    assert result.total == 304 and set(states(engine, schema).values()) == {"available"}, result
    wakes = [T0] + stop.wakes
    assert all(b - a >= timedelta(seconds=MIN_WAKE) for a, b in zip(wakes, wakes[1:])), wakes
    with engine.connect() as conn:
        due_times = [r[0] for r in conn.execute(sql("SELECT scheduled_at FROM {schema}.jobs", schema))]
    for due in due_times:
        woke = min(w for w in wakes if w >= due)
        assert woke - due <= timedelta(seconds=MIN_WAKE), (due, woke)
    for due in sparse:  # nothing else due near them: the pass wakes exactly at their time
        assert T0 + due in wakes, (due, wakes)


def test_run_seconds_measure_work_not_the_precise_timing_sleeps(settings, engine, schema):
    """SPEC 7.4: a pass that sleeps until a job falls due reports its work, not its wait."""
    from maintd.metrics import Metrics
    from maintd.passes import execute_pass

    settings.scheduler.interval = timedelta(seconds=3)
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, scheduled_at) "
                         "VALUES ('k', 'scheduled', clock_timestamp() + interval '1.5 seconds')", schema))
    metrics = Metrics()
    t0 = time.monotonic()
    record = execute_pass("scheduler", Scheduler(settings.scheduler),
                          PassContext.for_settings(settings, engine, ServerClock()), metrics)
    took = time.monotonic() - t0
    assert record.result.total == 1 and record.result.slept >= 1.0 and took >= 1.4
    assert record.seconds < took - 1.0  # the wait is left out
    assert metrics.registry.get_sample_value(
        "maintd_service_run_seconds_sum", {"target": "maintd", "service": "scheduler"}) == record.seconds


def test_result_summary_and_whether_a_pass_did_something():
    assert not SchedulerResult().did_something() and SchedulerResult().summary() == "promoted 0 jobs"
    assert SchedulerResult(promoted={"a": 1}).did_something()
    assert SchedulerResult(promoted={"b": 2, "a": 1}).summary() == "promoted 3 jobs a=1 b=2"


def test_precise_pass_ends_before_the_next_tick(settings, engine, schema):
    """interval 1 s: the pass ends TICK_MARGIN (0.1 s here) before the next tick; a job due at
    0.85 s is promoted by this pass, one due at 0.97 s is left to the next tick's pass."""
    settings.scheduler.interval = timedelta(seconds=1)
    with engine.begin() as conn:
        ids = [r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, state, scheduled_at) SELECT 'k', 'scheduled', now() + interval '1 day' "
            "FROM generate_series(1, 2) RETURNING id", schema))]
    with engine.begin() as conn:  # due times set right before the pass starts
        conn.execute(sql("UPDATE {schema}.jobs SET scheduled_at = clock_timestamp() + CASE WHEN id = :a "
                         "THEN interval '850 milliseconds' ELSE interval '970 milliseconds' END", schema),
                     {"a": ids[0]})
    result = Scheduler(settings.scheduler).run_once(PassContext.for_settings(settings, engine, ServerClock()))
    assert result.total == 1 and states(engine, schema) == {ids[0]: "available", ids[1]: "scheduled"}


def test_without_precise_timing_a_pass_does_not_wait(settings, engine, schema):
    settings.scheduler.interval = timedelta(seconds=2)
    settings.scheduler.precise_timing = False
    now = datetime.now(timezone.utc)
    add_at = now + timedelta(seconds=1.5)  # before the next tick; far enough that setup under load is not late
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, scheduled_at) VALUES ('k', 'scheduled', :t)",
                         schema), {"t": add_at})
    t0 = time.monotonic()
    result = Scheduler(settings.scheduler).run_once(PassContext.for_settings(settings, engine, ServerClock()))
    assert result.total == 0 and result.wakeups == 0 and time.monotonic() - t0 < 1.0  # a wait would be ~1.5 s


def test_a_sleeping_precise_pass_holds_no_pooled_connection(settings, engine, schema):
    """The passes of many targets share one pool (SPEC 7.9): while a pass sleeps until the next
    due job (1.2 s away) it has given its connection back, and it still promotes the job in time,
    within its own session (execute_pass opens one, as the runner does)."""
    from maintd.passes import execute_pass

    settings.scheduler.interval = timedelta(seconds=3)
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, scheduled_at) "
                         "VALUES ('k', 'scheduled', now() + interval '1.2 seconds')", schema))
    out: dict = {}
    ctx = PassContext.for_settings(settings, engine, ServerClock())
    runner = threading.Thread(target=lambda: out.update(record=execute_pass("scheduler", Scheduler(settings.scheduler), ctx)))
    runner.start()
    time.sleep(0.6)  # the pass probed, found the job 0.6 s away, and sleeps
    assert engine.pool.checkedout() == 0
    runner.join(5)
    assert out["record"].result.total == 1 and out["record"].result.wakeups >= 1
    assert engine.pool.checkedout() == 0
