"""Rescuer: the stuck rule, retry/discard, races with completing workers, keyset pagination."""

from __future__ import annotations

import logging
import re
import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import event, text

from maintd.queries import sql
from maintd.jobs import BACKOFF_CAP, ClaimedJob, JobQueue, backoff
from maintd.metrics import Metrics
from maintd.services.base import PassContext, PassStopped
from maintd.queries.jobs import (RESCUER_BATCH, RESCUER_PROBE, RESCUER_COUNT_STUCK, RESCUER_EXHAUSTED_BATCH,
                                 RESCUER_NO_SIGN_BATCH, RESCUER_COUNT_ODD, RESCUER_FUTURE_SIGN_BATCH,
                                 RESCUER_COUNT_FUTURE)
from maintd.services.rescuer import NO_SIGN_START, Rescuer

from .conftest import T0, run_concurrently
from .plans import at_page_costs, entries_read_while_a_snapshot_is_held, explain
from .procs import jobs_locked

# Every test here runs on both jobs layouts (SPEC 8.1): tests/conftest.py.
pytestmark = pytest.mark.both_layouts


@pytest.fixture(autouse=True)
def _one_round(settings):
    """These tests look at one pass's batches: no precise-timing waits (tested below)."""
    settings.rescuer.precise_timing = False


def running(engine, schema, *, seen_ago, heartbeat_ago=None, attempt=1, max_attempts=25, n=1,
            worker="w1"):
    with engine.begin() as conn:
        return [r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, state, attempt, max_attempts, attempted_at, attempted_by, "
            "heartbeat_at) SELECT 'k', 'running', :attempt, :max, CAST(:t0 AS timestamptz) - CAST(:seen AS interval), "
            ":worker, CASE WHEN :hb THEN CAST(:t0 AS timestamptz) - CAST(:hb_ago AS interval) END "
            "FROM generate_series(1, :n) RETURNING id", schema),
            {"attempt": attempt, "max": max_attempts, "t0": T0, "seen": seen_ago, "worker": worker,
             "hb": heartbeat_ago is not None, "hb_ago": heartbeat_ago or timedelta(0), "n": n})]


def rows(engine, schema):
    with engine.connect() as conn:
        return {r.id: r for r in conn.execute(sql("SELECT * FROM {schema}.jobs", schema))}


def as_json(engine, t) -> str:
    """A timestamp as PostgreSQL writes it into JSON (in the session's time zone)."""
    with engine.connect() as conn:
        return conn.execute(text("SELECT to_jsonb(CAST(:t AS timestamptz)) #>> '{}'"), {"t": t}).scalar()


def run(settings, engine, clock, **kw):
    return Rescuer(settings.rescuer).run_once(PassContext.for_settings(settings, engine, clock, **kw))


def run_past_locks(settings, engine, clock, seconds: float = 10.0):
    """A pass while rows are held by another session: one that waits for them fails the test in
    ``seconds``, not at the suite's timeout (the pass runs in a thread)."""
    results: list = []
    passer = threading.Thread(target=lambda: results.append(run(settings, engine, clock)), daemon=True)
    passer.start()
    passer.join(seconds)
    assert not passer.is_alive(), "the pass waited for a locked row"
    return results[0]


def test_stuck_edges_and_retry_with_backoff(settings, engine, schema, clock, caplog):
    hour = timedelta(hours=1)
    stuck = running(engine, schema, seen_ago=hour + timedelta(seconds=1), attempt=3)
    fresh = running(engine, schema, seen_ago=hour - timedelta(seconds=1))
    exact = running(engine, schema, seen_ago=hour)  # not older than the limit: alive
    with caplog.at_level(logging.INFO, logger="maintd.rescuer"):
        result = run(settings, engine, clock)
    assert (result.retried, result.discarded) == (1, 0)
    r = rows(engine, schema)
    job = r[stuck[0]]
    assert job.state == "retryable" and job.finalized_at is None
    assert job.scheduled_at == T0 + backoff(3)
    seen = as_json(engine, T0 - hour - timedelta(seconds=1))
    assert job.errors == [{"at": as_json(engine, T0), "attempt": 3,
                           "error": f"stuck: no sign of life since {seen} (rescued by maintd test-1)"}]
    assert job.attempt == 3 and job.attempted_by == "w1"  # the claim's own fields stay as they were
    assert r[fresh[0]].state == "running" and r[exact[0]].state == "running"
    assert [(rec.getMessage(), rec.fields) for rec in caplog.records] == [
        ("released stale running jobs", {"count": 1, "retried": 1, "discarded": 0})]
    assert result.summary() == "rescued retried=1 discarded=0"


def test_counts_and_log_line_over_several_batches(settings, engine, schema, clock, caplog):
    """Counts add up over batches; a pass that only discarded logs its line too."""
    settings.rescuer.batch_size = 2
    running(engine, schema, seen_ago=timedelta(hours=2), attempt=25, max_attempts=25, n=5)
    with caplog.at_level(logging.INFO, logger="maintd.rescuer"):
        result = run(settings, engine, clock)
    assert (result.retried, result.discarded, result.batches) == (0, 5, 3)
    assert result.did_something() and result.summary() == "rescued retried=0 discarded=5"
    assert [(rec.getMessage(), rec.fields) for rec in caplog.records] == [
        ("released stale running jobs", {"count": 5, "retried": 0, "discarded": 5})]


def test_nothing_stuck_logs_nothing(settings, engine, schema, clock, caplog):
    running(engine, schema, seen_ago=timedelta(minutes=5))
    with caplog.at_level(logging.INFO, logger="maintd.rescuer"):
        result = run(settings, engine, clock)
    assert not result.did_something() and caplog.records == []


def test_heartbeat_keeps_long_jobs_alive(settings, engine, schema, clock):
    # Started 5 h ago but heartbeated 10 min ago: alive under the default rule.
    alive = running(engine, schema, seen_ago=timedelta(hours=5), heartbeat_ago=timedelta(minutes=10))
    dead = running(engine, schema, seen_ago=timedelta(hours=5), heartbeat_ago=timedelta(hours=1, seconds=1))
    run(settings, engine, clock)
    r = rows(engine, schema)
    assert r[alive[0]].state == "running"
    assert r[dead[0]].state == "retryable"


def test_heartbeat_timeout_rule(settings, engine, schema, clock):
    settings.rescuer.heartbeat_timeout = timedelta(minutes=2)
    silent = running(engine, schema, seen_ago=timedelta(minutes=30), heartbeat_ago=timedelta(minutes=2, seconds=1))
    beating = running(engine, schema, seen_ago=timedelta(minutes=30), heartbeat_ago=timedelta(minutes=1, seconds=59))
    never_beat = running(engine, schema, seen_ago=timedelta(minutes=30))  # only the 1 h rule applies
    # Exactly at each limit is not older than it: alive (with the heartbeat rule widening the scan).
    hb_exact = running(engine, schema, seen_ago=timedelta(minutes=30), heartbeat_ago=timedelta(minutes=2))
    never_beat_exact = running(engine, schema, seen_ago=timedelta(hours=1))
    never_beat_over = running(engine, schema, seen_ago=timedelta(hours=1, microseconds=1))
    run(settings, engine, clock)
    r = rows(engine, schema)
    assert r[silent[0]].state == "retryable"
    assert r[beating[0]].state == "running"
    assert r[never_beat[0]].state == "running"
    assert (r[hb_exact[0]].state, r[never_beat_exact[0]].state) == ("running", "running")
    assert r[never_beat_over[0]].state == "retryable"


def test_max_attempts_discards(settings, engine, schema, clock):
    last = running(engine, schema, seen_ago=timedelta(hours=2), attempt=5, max_attempts=5)
    before = rows(engine, schema)[last[0]]
    result = run(settings, engine, clock)
    assert (result.retried, result.discarded) == (0, 1)
    job = rows(engine, schema)[last[0]]
    assert job.state == "discarded" and job.finalized_at == T0
    assert job.scheduled_at == before.scheduled_at  # no retry planned
    assert len(job.errors) == 1 and job.errors[0]["attempt"] == 5 and job.errors[0]["at"] == as_json(engine, T0)


def test_other_states_untouched(settings, engine, schema, clock):
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, attempted_at, finalized_at) VALUES "
                         "('k', 'available', now() - interval '9 hours', NULL), "
                         "('k', 'completed', now() - interval '9 hours', now() - interval '8 hours')", schema))
    before = {i: r.state for i, r in rows(engine, schema).items()}
    result = run(settings, engine, clock)
    assert result.retried + result.discarded == 0
    assert {i: r.state for i, r in rows(engine, schema).items()} == before


def test_dry_run(settings, engine, schema, clock):
    running(engine, schema, seen_ago=timedelta(hours=2), n=3)
    running(engine, schema, seen_ago=timedelta(hours=2), attempt=25, n=2)
    result = run(settings, engine, clock, dry_run=True)
    assert (result.retried, result.discarded) == (3, 2)
    assert result.dry_run is True and result.summary() == "would rescue retried=3 discarded=2"
    assert {r.state for r in rows(engine, schema).values()} == {"running"}


def test_dry_run_counts_what_every_batch_would_do(settings, engine, schema, clock):
    """The dry run counted only the stuck jobs in keyset order: running jobs with no usable sign
    of life and waiting jobs with no attempt left, which a real pass also handles, were left out
    ("would rescue 0", then a pass discarded jobs). Nor did it count a sign of life in the
    server's future that the pass then dated."""
    running(engine, schema, seen_ago=timedelta(hours=2))
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, attempt, max_attempts, attempted_at) VALUES "
                         "('k', 'running', 1, 25, NULL), ('k', 'running', 25, 25, 'infinity'), "
                         "('k', 'running', 1, 25, '-infinity'), "
                         "('k', 'available', 30, 25, NULL), ('k', 'running', 1, 25, now()), "
                         "('k', 'running', 1, 25, now() + interval '2 hours')", schema))

    def states():  # (SELECT * would load the 'infinity', which Python's datetime cannot hold)
        with engine.connect() as conn:
            return dict(conn.execute(sql("SELECT id, state FROM {schema}.jobs", schema)).all())

    before = states()
    # (the claim of 'infinity' is a sign from the future, dated like the one two hours ahead: see
    # test_an_infinite_heartbeat_or_claim_is_dated_not_rescued)
    planned = run(settings, engine, clock, dry_run=True)
    assert (planned.retried, planned.discarded, planned.exhausted, planned.dated) == (3, 0, 1, 2), planned
    assert states() == before
    done = run(settings, engine, clock)
    assert (done.retried, done.discarded, done.exhausted, done.dated) == (3, 0, 1, 2), done


def test_locked_rows_do_not_hide_later_stuck_jobs(settings, engine, schema, clock):
    """A batch's worth of candidates locked by workers must not stop the pass from reaching the rest."""
    settings.rescuer.batch_size = 5
    locked = running(engine, schema, seen_ago=timedelta(hours=5), n=5)
    later = running(engine, schema, seen_ago=timedelta(hours=2), n=7)
    with jobs_locked(engine, schema, locked):
        result = run_past_locks(settings, engine, clock)
    assert result.retried == 7
    r = rows(engine, schema)
    assert all(r[i].state == "retryable" for i in later)
    assert all(r[i].state == "running" for i in locked)


def test_locked_jobs_with_no_sign_of_life_are_passed_over_once(settings, engine, schema, clock):
    """RESCUER_NO_SIGN_BATCH picked its ids with no keyset and before SKIP LOCKED: every batch
    took the first ``batch_size`` entries of each part of jobs_running_idx (signs before year 1,
    none at all), whatever earlier batches had passed over. With those held by workers, the batch
    locked nothing, found fewer candidates than its size, and the pass ended: here it rescued 0 of
    the 7 it could. Now each batch starts where the last one ended, so the pass reads past the held
    rows once: 7 rescued in 4 batches (2, 2, 2 and 1), however many are held."""
    settings.rescuer.batch_size = 2

    def no_sign(attempted_at: str, n: int) -> list[int]:
        with engine.begin() as conn:
            return [r[0] for r in conn.execute(sql(
                "INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at, attempted_by) "
                f"SELECT 'k', 'running', 1, {attempted_at}, 'w1' FROM generate_series(1, :n) "
                "ORDER BY 1 RETURNING id", schema), {"n": n})]

    held = no_sign("'-infinity'", 6)
    free = no_sign("'0044-03-15 00:00:00+00 BC'", 3)
    held += no_sign("NULL", 6)
    free += no_sign("NULL", 4)
    statements: list[str] = []

    def count(conn, cursor, statement, *args):
        if "ARRAY(SELECT id FROM rescued) AS ids" in statement:  # RESCUER_NO_SIGN_BATCH
            statements.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        with jobs_locked(engine, schema, held):
            result = run_past_locks(settings, engine, clock)
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert result.retried == 7, result
    with engine.connect() as conn:  # not rows(): no Python datetime holds '-infinity'
        state = dict(conn.execute(sql("SELECT id, state::text FROM {schema}.jobs", schema)).all())
    assert all(state[i] == "retryable" for i in free) and all(state[i] == "running" for i in held)
    assert len(statements) == 4, len(statements)  # batches of 2, 2, 2 and 1


def test_batches_cover_everything(settings, engine, schema, clock):
    settings.rescuer.batch_size = 10
    running(engine, schema, seen_ago=timedelta(hours=2), n=35)
    result = run(settings, engine, clock)
    assert result.retried == 35 and result.batches == 4


def test_rescue_never_overwrites_a_concurrent_completion(settings, engine, schema, clock):
    """Many workers complete their (stuck-looking) jobs while rescuers run: zero overwritten."""
    settings.rescuer.batch_size = 3
    n = 400
    ids = running(engine, schema, seen_ago=timedelta(hours=2), n=n)
    queue = JobQueue(schema)
    completed: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(6)

    def worker(chunk):
        start.wait()
        for jid in chunk:
            job = ClaimedJob(id=jid, kind="k", queue="default", args={}, attempt=1, max_attempts=25,
                             attempted_by="w1")
            with engine.begin() as conn:
                if queue.complete(conn, job):
                    with lock:
                        completed.append(jid)

    def rescuer():
        start.wait()
        time.sleep(0.02)  # let the workers get going: both sides must win some races
        for _ in range(3):
            run(settings, engine, clock)

    threads = [threading.Thread(target=worker, args=(ids[i::4],)) for i in range(4)]
    threads += [threading.Thread(target=rescuer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r = rows(engine, schema)
    assert completed, "no worker won a race: the test exercised nothing"
    assert len(completed) < n, "the rescuer won no race: the test exercised nothing"
    for jid in completed:
        assert r[jid].state == "completed", f"completion of {jid} was overwritten"
        assert r[jid].errors == []
    for jid in set(ids) - set(completed):
        assert r[jid].state == "retryable"
        assert len(r[jid].errors) == 1  # rescued exactly once
    assert {r[j].state for j in ids} <= {"completed", "retryable"}


def test_two_rescuers_rescue_each_job_once(settings, engine, schema, clock):
    settings.rescuer.batch_size = 25
    ids = running(engine, schema, seen_ago=timedelta(hours=2), n=300)
    results = run_concurrently(lambda: run(settings, engine, clock))
    assert sum(r.retried for r in results) == 300
    assert all(len(rows(engine, schema)[i].errors) == 1 for i in ids)


def reads_only_the_locked_rows(plan: str) -> bool:
    """Whether every scan of the jobs table in ``plan`` (a batch's UPDATE) reads its candidates
    alone, by their ctids (``= ANY``) or each by its id (``id = c.id``), not a range or the whole of
    an index: its guards are checks of the rows, and the index they match holds the earlier
    batches' entries until a vacuum."""
    scans = re.findall(r"(?:Tid Scan|Index Scan using \w+|Bitmap Index Scan on \w+)[^\n]*\n\s*(?:Index|TID) Cond: ([^\n]*)",
                       plan)
    every = len(re.findall(r"Tid Scan on|Index Scan using|Bitmap Index Scan on|Seq Scan on", plan))
    return bool(scans) and len(scans) == every and all(
        ("= ANY" in cond or re.fullmatch(r"\(id = c\.id\)", cond)) and "COALESCE" not in cond for cond in scans)


def test_statements_are_index_backed(settings, engine, schema, clock, layout):
    """With 20,000 stuck jobs and batches of 100, a batch reads its candidates from
    jobs_running_idx and updates the row versions it locked through their ctids (never by walking every stuck
    row, which would make a pass quadratic), with values known or as a generic prepared plan;
    never a Seq Scan."""
    with engine.begin() as conn:
        # Partitioned (SPEC 8.1), finished jobs are not in the live partition the rescuer reads: the
        # other jobs there are waiting ones.
        filler = ("'completed', now()" if layout == "plain" else "'available', NULL")
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, finalized_at) "
                         f"SELECT 'k', {filler} FROM generate_series(1, 30000)", schema))
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at) "
                         "SELECT 'k', 'running', 1, CAST(:t0 AS timestamptz) - interval '2 hours' "
                         "- g * interval '1 second' FROM generate_series(1, 20000) g", schema), {"t0": T0})
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    params = {**Rescuer(settings.rescuer).horizons(T0), "after_seen": T0 - timedelta(days=999), "after_id": 0,
              "limit": 100, "now": T0, "instance": "i", "cap": BACKOFF_CAP, "events_channel": "e", "announce": True,
              "delays": [backoff(k).total_seconds() for k in range(BACKOFF_CAP + 1)]}
    with engine.connect() as conn:
        for generic in (False, True):
            plan = explain(conn, RESCUER_BATCH, schema, params, generic=generic)
            candidates, update = plan.split("CTE rescued")
            assert "Index Scan using jobs_running_idx" in candidates, plan
            # each batch starts in the index where the last one ended (a keyset in the Index Cond,
            # not a Filter): a pass reads each stuck row's entry once, not once per batch
            [cond] = [line for line in candidates.splitlines() if "Index Cond" in line]
            assert "ROW(COALESCE(heartbeat_at, attempted_at), id) >" in cond, plan
            assert "Tid Scan" in update and "jobs_running_idx" not in update, plan
            assert "Seq Scan" not in plan, plan
            plan = explain(conn, RESCUER_COUNT_STUCK, schema, params, generic=generic)
            assert "jobs_running_idx" in plan and "Seq Scan" not in plan, plan
            plan = explain(conn, RESCUER_NO_SIGN_BATCH, schema, {**params, **NO_SIGN_START}, generic=generic)
            assert "jobs_running_idx" in plan.split("CTE rescued")[0] and "Seq Scan" not in plan, plan
            # its two parts (before year 1, no sign at all) and the reads of where the next batch
            # starts, each from its keyset (in the Index Cond, not a Filter): a pass reads each
            # entry once, however many rows held by others it passes over
            conds = [line for line in plan.splitlines()
                     if "Index Cond" in line and "COALESCE(heartbeat_at, attempted_at)" in line]
            assert len(conds) == 4 and all(re.search(r"\bid\)? >", c) for c in conds), plan
            plan = explain(conn, RESCUER_FUTURE_SIGN_BATCH, schema,
                           {"ahead": 60, "limit": 100, "from_seen": "infinity", "from_id": 2 ** 63 - 1}, generic=generic)
            candidates, update = plan.split("CTE dated")
            assert "Index Scan Backward using jobs_running_idx" in candidates, plan
            # from its keyset (in the Index Cond), and the read of where the next batch starts too
            conds = [line for line in plan.splitlines()
                     if "Index Cond" in line and "COALESCE(heartbeat_at, attempted_at)" in line]
            assert len(conds) == 2 and all(re.search(r"\bid\)? <", c) for c in conds), plan
            assert reads_only_the_locked_rows(update) and "Seq Scan" not in plan, plan
            plan = explain(conn, RESCUER_COUNT_FUTURE, schema, {"ahead": 60}, generic=generic)
            assert "jobs_running_idx" in plan and "Seq Scan" not in plan, plan
            plan = explain(conn, RESCUER_COUNT_ODD, schema, params, generic=generic)
            assert "jobs_running_idx" in plan and "jobs_exhausted_idx" in plan and "Seq Scan" not in plan, plan
            # the daemon's probe, idle: each of its reads one index entry (an OR of three
            # conditions was a Seq Scan of the whole table, 45 ms at 450,000 rows); whatever the
            # server's page costs: the exhausted read as an EXISTS tied with a Seq Scan's first
            # row at the default costs, so CI's plan flipped between runs, and lost at 10
            for page_cost in at_page_costs(conn):
                plan = explain(conn, "SELECT " + ", ".join(RESCUER_PROBE), schema, params, generic=generic)
                assert "Seq Scan" not in plan and "Filter" not in plan, (page_cost, plan)
                assert "jobs_exhausted_idx" in plan, (page_cost, plan)
            plan = explain(conn, RESCUER_EXHAUSTED_BATCH, schema, {**params, "from_id": 0}, generic=generic)
            candidates, update = plan.split("CTE discarded")
            assert "jobs_exhausted_idx" in candidates, plan
            # each batch starts after the last one's candidates (a keyset in the Index Cond)
            [cond] = [line for line in candidates.splitlines() if "Index Cond" in line]
            assert re.search(r"\bid >=", cond), plan
            # and updates the rows it locked by their ctids or ids, never by a join that reads the
            # whole index (a Hash Join read 400 of 400 entries for a batch of 20: quadratic)
            assert reads_only_the_locked_rows(update), plan
            assert "Seq Scan" not in plan, plan
        conn.rollback()


def test_observe_counts_rescues_by_outcome(settings, engine, schema, clock):
    running(engine, schema, seen_ago=timedelta(hours=2), n=3)
    running(engine, schema, seen_ago=timedelta(hours=2), attempt=25, n=2)
    metrics = Metrics()
    Rescuer(settings.rescuer).observe(metrics, run(settings, engine, clock))
    value = lambda name, labels=None: metrics.registry.get_sample_value(name, {"target": "maintd", **(labels or {})})
    assert value("maintd_jobs_rescued_total", {"outcome": "retried"}) == 3
    assert value("maintd_jobs_rescued_total", {"outcome": "discarded"}) == 2


@pytest.mark.parametrize("after,timeout", [("30m", "30m"), ("30m", "1h")])
def test_rescue_after_must_exceed_job_timeout(pg_dsn, after, timeout):
    from maintd.config import ConfigError, load_settings

    with pytest.raises(ConfigError, match="rescuer.rescue_stuck_jobs_after"):
        load_settings(None, rescuer={"rescue_stuck_jobs_after": after, "job_timeout": timeout})


def test_signs_of_life_at_the_keyset_start_are_rescued(settings, engine, schema, clock):
    """Where the no-sign batch (signs of life before year 1, January 2: FAR_PAST) hands over to the
    keyset, which starts just before (FAR_PAST, id 1): the job seen exactly at FAR_PAST with the
    smallest id there is, one a microsecond earlier and one a microsecond later are all rescued
    (a keyset starting at id 1 instead of 0 passed every other test)."""
    with engine.begin() as conn:
        for job_id, seen in [(1, "0001-01-02 00:00:00+00"), (2, "0001-01-01 23:59:59.999999+00"),
                             (3, "0001-01-02 00:00:00.000001+00")]:
            conn.execute(sql("INSERT INTO {schema}.jobs (id, kind, state, attempt, attempted_at) "
                             "OVERRIDING SYSTEM VALUE VALUES (:id, 'k', 'running', 1, CAST(:seen AS timestamptz))",
                             schema), {"id": job_id, "seen": seen})
    result = run(settings, engine, clock)
    assert (result.retried, result.discarded) == (3, 0)
    assert {i: r.state for i, r in rows(engine, schema).items()} == {1: "retryable", 2: "retryable", 3: "retryable"}


def test_a_job_with_an_id_of_zero_or_below_seen_exactly_at_the_keyset_start_is_rescued(settings, engine, schema,
                                                                                       clock):
    """The id column is an identity BY DEFAULT (an import may write any bigint, 0 and negative ones
    included), and the keyset started just after (FAR_PAST, 0): a job seen exactly at FAR_PAST
    with an id of 0 or below was neither the keyset's (not after that start) nor the no-sign
    batch's (not before FAR_PAST), so it stayed running for ever, while the dry run counted it
    and the probe asked for a pass every interval (SPEC 7.3: every other row is processed)."""
    with engine.begin() as conn:
        for job_id in (0, -7, -(2 ** 63)):
            conn.execute(sql("INSERT INTO {schema}.jobs (id, kind, state, attempt, attempted_at) "
                             "VALUES (:id, 'k', 'running', 1, '0001-01-02 00:00:00+00')", schema), {"id": job_id})
    assert run(settings, engine, clock, dry_run=True).retried == 3
    result = run(settings, engine, clock)
    assert (result.retried, result.discarded) == (3, 0)
    assert {i: r.state for i, r in rows(engine, schema).items()} == {0: "retryable", -7: "retryable",
                                                                      -(2 ** 63): "retryable"}


def test_jobs_without_a_sign_of_life_are_counted_over_several_batches(settings, engine, schema, clock, caplog):
    """Running jobs with no attempted_at nor heartbeat_at, more than a batch of them, some out of
    attempts: each is rescued once, counted once (retried or discarded) across the batches, and
    named in its batch's warning (one line per batch: a line per job made thousands a pass)."""
    settings.rescuer.batch_size = 2
    with engine.begin() as conn:
        ids = [r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, state, attempt, max_attempts) "
            "SELECT 'k', 'running', CASE WHEN g <= 5 THEN 3 ELSE 1 END, 3 "
            "FROM generate_series(1, 8) g RETURNING id", schema))]
    with caplog.at_level(logging.WARNING, logger="maintd.rescuer"):
        result = run(settings, engine, clock)
    lines = [r.fields for r in caplog.records
             if r.getMessage() == "rescued running jobs with no usable attempted_at or heartbeat_at"]
    assert sorted(int(i) for f in lines for i in f["job_ids"].split(",")) == sorted(ids)
    assert len(lines) == 4 and all(f["count"] == len(f["job_ids"].split(",")) == 2 for f in lines), lines
    assert (result.retried, result.discarded) == (3, 5), result
    assert sorted(r.state for r in rows(engine, schema).values()) == ["discarded"] * 5 + ["retryable"] * 3


def test_waiting_jobs_with_no_attempt_left_are_discarded_with_one_line_per_batch(settings, engine, schema, clock,
                                                                                caplog):
    """30 waiting jobs with attempt >= max_attempts in one batch: all discarded, one warning
    with the count and the first ids (a warning per job made a line per row, thousands a pass)."""
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, attempt, max_attempts) "
                         "SELECT 'k', 'available', 3, 3 FROM generate_series(1, 30)", schema))
    with caplog.at_level(logging.WARNING, logger="maintd.rescuer"):
        result = run(settings, engine, clock)
    lines = [r.fields for r in caplog.records
             if r.getMessage() == "discarded waiting jobs with no attempt left (attempt >= max_attempts)"]
    assert result.exhausted == 30 and len(lines) == 1, (result, lines)
    assert lines[0]["count"] == 30 and lines[0]["job_ids"].endswith(",... (+10 more)"), lines
    assert {r.state for r in rows(engine, schema).values()} == {"discarded"}


def test_waiting_jobs_with_no_attempt_left_are_discarded_in_batches_of_batch_size(settings, engine, schema, clock,
                                                                                 caplog):
    """More exhausted waiting jobs than a batch: each batch (one transaction, its rows locked until
    it commits) discards at most ``batch_size`` of them, in id order, and names them in a line of
    its own. A batch of ``batch_size + 1`` (``LIMIT :limit + 1``) passed every other test: 7 jobs
    in batches of 3 went as 4 and 3."""
    settings.rescuer.batch_size = 3
    with engine.begin() as conn:
        ids = conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, attempt, max_attempts) "
                               "SELECT 'k', 'available', 3, 3 FROM generate_series(1, 7) RETURNING id",
                               schema)).scalars().all()
    with caplog.at_level(logging.WARNING, logger="maintd.rescuer"):
        result = run(settings, engine, clock)
    lines = [r.fields for r in caplog.records
             if r.getMessage() == "discarded waiting jobs with no attempt left (attempt >= max_attempts)"]
    assert [(f["count"], f["job_ids"]) for f in lines] == [
        (3, ",".join(map(str, ids[0:3]))), (3, ",".join(map(str, ids[3:6]))), (1, str(ids[6]))], lines
    assert result.exhausted == 7 and {r.state for r in rows(engine, schema).values()} == {"discarded"}


def test_waiting_jobs_with_attempts_left_are_no_candidates_of_the_exhausted_batch(settings, engine, schema, clock):
    """RESCUER_EXHAUSTED_BATCH's candidates are the exhausted waiting jobs alone (its UPDATE checks
    again). Were every waiting job a candidate, a batch of live ones (each locked FOR NO KEY UPDATE,
    so claims passed them over) discarded none and was full, and the next batch took the same rows:
    with a batch's worth of claimable jobs the pass never ended, and the exhausted job behind them
    was never discarded."""
    settings.rescuer.batch_size = 5
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, attempt, max_attempts) "
                         "SELECT 'k', 'available', 0, 3 FROM generate_series(1, 10)", schema))
        exhausted = conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, attempt, max_attempts) "
                                     "VALUES ('k', 'available', 3, 3) RETURNING id", schema)).scalar()
    stop, results = threading.Event(), []

    def one_pass():
        try:
            results.append(Rescuer(settings.rescuer).run_once(
                PassContext.for_settings(settings, engine, clock, stop_event=stop)))
        except PassStopped:
            results.append(None)

    passer = threading.Thread(target=one_pass, daemon=True)
    passer.start()
    passer.join(10)
    stop.set()  # a pass that never ends is stopped (PassStopped), not left running
    passer.join(10)
    assert results != [None], "the pass did not end within 10 s (stopped)"
    assert results[0].exhausted == 1, results
    states = {i: r.state for i, r in rows(engine, schema).items()}
    assert states.pop(exhausted) == "discarded" and set(states.values()) == {"available"}


def test_a_waiting_job_with_no_attempt_left_held_by_another_session_does_not_stall_the_pass(settings, engine,
                                                                                            schema, clock):
    """A session holding one exhausted waiting job's row (an operator's transaction, an
    application's SELECT ... FOR UPDATE) must not stall the rescuer's pass (and every stuck job
    behind it) until that session ends: the row is passed over, the others discarded."""
    with engine.begin() as conn:
        held, *others = conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, attempt, max_attempts) "
                                         "SELECT 'k', 'available', 3, 3 FROM generate_series(1, 4) "
                                         "RETURNING id", schema)).scalars().all()
    with jobs_locked(engine, schema, held):
        result = run_past_locks(settings, engine, clock)
    assert result.exhausted == 3
    r = rows(engine, schema)
    assert [r[i].state for i in others] == ["discarded"] * 3 and r[held].state == "available"


def test_a_server_clock_stepped_back_since_the_daemon_read_it_rescues_no_live_job(settings, engine, schema):
    """The daemon reads the server's clock and carries it forward on the host's monotonic clock
    for up to 30 s (maintd.clock.ServerClock). If the server's clock steps back meanwhile (an NTP
    step), the carried reading runs ahead of the clock the workers' heartbeats are written with:
    with a 60 s step and heartbeat_timeout 30 s, a job that heartbeated 10 s ago was rescued
    while alive. The horizons now move back by how far the reading is ahead of
    statement_timestamp()."""
    from maintd.clock import FrozenClock

    settings.rescuer.heartbeat_timeout = timedelta(seconds=30)
    with engine.begin() as conn:
        server_now = conn.execute(text("SELECT now()")).scalar()
        alive, dead = [r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at, heartbeat_at) "
            "SELECT 'k', 'running', 1, now() - interval '1 minute', now() - CAST(s AS interval) "
            "FROM unnest(ARRAY['10 seconds', '40 seconds']) WITH ORDINALITY AS u(s, n) ORDER BY n RETURNING id",
            schema))]
    read_before_the_step = FrozenClock(server_now + timedelta(seconds=60))
    result = run(settings, engine, read_before_the_step)
    assert (result.retried, result.discarded) == (1, 0)
    assert rows(engine, schema)[alive].state == "running" and rows(engine, schema)[dead].state == "retryable"


def test_a_sign_of_life_from_the_future_is_dated_now_and_the_job_rescued_after_its_grace(settings, engine,
                                                                                          schema, caplog):
    """A worker that writes its own clock's time, set ten years ahead, or an import: the job's
    sign of life lay in the future, so the keyset reached it only then and its dead worker's job
    stayed running for ten years. Such a sign was given no later than now: it is dated now
    (logged, counted), and the job is rescued once its grace has passed with no newer sign. A sign
    less than a minute ahead (clocks a little apart) is left alone. Why now is never too early:
    PostgreSQL docs, "Current Date/Time" (functions-datetime.html): statement_timestamp() is the
    start of the current statement, and "Read Committed Isolation Level" (transaction-iso.html): a
    statement sees only what was committed before it began, so every sign a worker wrote with the
    server's now() and we can see is at or before it."""
    from maintd.clock import FrozenClock
    from maintd.queries import render

    settings.rescuer.heartbeat_timeout = timedelta(seconds=2)
    with engine.begin() as conn:
        ahead_10y, ahead_2h, ahead_30s = [r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at, heartbeat_at) "
            "VALUES ('k', 'running', 1, now(), now() + interval '10 years'), "
            "       ('k', 'running', 1, now() + interval '2 hours', NULL), "
            "       ('k', 'running', 1, now(), now() + interval '30 seconds') RETURNING id", schema))]

    def server_now():
        with engine.connect() as conn:
            return conn.execute(text("SELECT now()")).scalar()

    rescuer, columns = Rescuer(settings.rescuer), ", ".join(render(c, schema) for c in RESCUER_PROBE)
    with engine.connect() as conn:
        values = tuple(conn.execute(text(f"SELECT {columns}")).one())
    assert rescuer.after_probe(values, server_now()) is True  # the probe asks for the pass
    before = server_now()
    with caplog.at_level(logging.WARNING, logger="maintd.rescuer"):
        result = rescuer.run_once(PassContext.for_settings(settings, engine, FrozenClock(before)))
    assert (result.retried, result.discarded, result.skipped_rows()) == (0, 0, {"future_sign": 2, "stale_heartbeat": 0})
    r = rows(engine, schema)
    assert before <= r[ahead_10y].heartbeat_at <= server_now() and before <= r[ahead_2h].attempted_at <= server_now()
    assert r[ahead_2h].heartbeat_at is None  # never heartbeated: its claim time is dated, not a heartbeat made up
    assert r[ahead_30s].heartbeat_at > server_now() + timedelta(seconds=20)
    assert [rec.fields["job_ids"] for rec in caplog.records
            if rec.getMessage().startswith("dated now the sign of life")] == [f"{min(ahead_10y, ahead_2h)},{max(ahead_10y, ahead_2h)}"]
    time.sleep(2.5)  # the grace passes with no newer sign
    result = rescuer.run_once(PassContext.for_settings(settings, engine, FrozenClock(server_now())))
    r = rows(engine, schema)
    assert {i: r[i].state for i in (ahead_10y, ahead_2h, ahead_30s)} == {  # ahead_2h: 1 h grace, no heartbeat
        ahead_10y: "retryable", ahead_2h: "running", ahead_30s: "running"}
    assert result.skipped_rows() == {"future_sign": 0, "stale_heartbeat": 0}


def test_a_future_claim_time_is_dated_without_inventing_a_heartbeat(settings, engine, schema, caplog):
    """A job claimed with a time in the server's future (a worker writing its own clock) that never
    heartbeated: dating it now must keep it a job that never heartbeated, judged by
    rescue_stuck_jobs_after (1 h), not by heartbeat_timeout (SPEC 2: that rule holds only for a
    job that "has heartbeated"). Dating wrote heartbeat_at, so a live worker that does not
    heartbeat lost its job heartbeat_timeout after the dating."""
    from maintd.clock import FrozenClock

    settings.rescuer.heartbeat_timeout = timedelta(minutes=2)
    with engine.begin() as conn:
        job = conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at, attempted_by) "
            "VALUES ('k', 'running', 1, now() + interval '2 hours', 'w1') RETURNING id", schema)).scalar_one()
        before = conn.execute(text("SELECT now()")).scalar()
    rescuer = Rescuer(settings.rescuer)
    result = rescuer.run_once(PassContext.for_settings(settings, engine, FrozenClock(before)))
    assert result.skipped_rows() == {"future_sign": 1, "stale_heartbeat": 0}
    dated = rows(engine, schema)[job]
    assert dated.heartbeat_at is None, f"dating invented a heartbeat: heartbeat_at={dated.heartbeat_at}"
    assert dated.attempted_at <= before + timedelta(minutes=1)
    with engine.begin() as conn:  # ten minutes pass with no heartbeat (the worker does not send any)
        conn.execute(sql("UPDATE {schema}.jobs SET attempted_at = attempted_at - interval '10 minutes', "
                         "heartbeat_at = heartbeat_at - interval '10 minutes' WHERE id = :id", schema), {"id": job})
        now = conn.execute(text("SELECT now()")).scalar()
    result = Rescuer(settings.rescuer).run_once(PassContext.for_settings(settings, engine, FrozenClock(now)))
    assert (result.retried, result.discarded) == (0, 0)
    assert rows(engine, schema)[job].state == "running"


# The {rescue} fragment against candidates read before the row changed: the batch statements read
# and lock their candidates in the same statement, so their attempt is the row's own (a row
# re-attempted after the statement's snapshot is locked in its new version, and the update's TID
# scan does not see that version), and no pass can show the fragment a stale one. This one can.
RESCUE_AFTER_A_SCAN = """
WITH candidates AS MATERIALIZED (
  SELECT id, ctid, CAST(:scanned_attempt AS smallint) AS attempt, coalesce(heartbeat_at, attempted_at) AS seen
    FROM {schema}.jobs WHERE id = :id FOR NO KEY UPDATE
), {rescue}, {clear_stale}
SELECT ARRAY(SELECT id FROM rescued) AS rescued
"""


def test_a_candidate_re_attempted_since_its_scan_is_not_rescued(settings, engine, schema):
    """The rescue re-checks each candidate as it is now, its attempt included: a job scanned
    stuck in attempt 1 and, meanwhile, failed, retried and claimed again (attempt 2) is not the
    job the scan judged; its rescue is for a later batch, which judges attempt 2 by its own sign
    of life. Here attempt 2 is stuck too, so only ``j.attempt = c.attempt`` tells the two apart
    (the batches' own locking keeps their candidates from ever being stale: nothing else covers
    this line, and a mutation review found it could be deleted unnoticed)."""
    [job] = running(engine, schema, seen_ago=timedelta(hours=2), attempt=2)
    params = {**Rescuer(settings.rescuer).horizons(T0), "now": T0, "instance": "i", "cap": BACKOFF_CAP,
              "delays": [backoff(k).total_seconds() for k in range(BACKOFF_CAP + 1)], "id": job}
    with engine.begin() as conn:
        stale = conn.execute(sql(RESCUE_AFTER_A_SCAN, schema), {**params, "scanned_attempt": 1}).scalar()
    r = rows(engine, schema)[job]
    assert stale == [] and (r.state, r.attempt, r.errors) == ("running", 2, []), "a stale candidate was rescued"
    with engine.begin() as conn:  # the same candidate as the row is now: rescued (the statement works)
        current = conn.execute(sql(RESCUE_AFTER_A_SCAN, schema), {**params, "scanned_attempt": 2}).scalar()
    assert current == [job] and rows(engine, schema)[job].state == "retryable"


def test_a_heartbeat_left_from_an_earlier_attempt_does_not_rescue_the_new_one(settings, engine, schema, clock):
    """SPEC 2's claim sets attempted_at and leaves heartbeat_at as it was. A job that heartbeated
    two hours ago in its first attempt, failed (or was rescued), and was claimed again five minutes
    ago by such a worker is alive: its only sign of life in this attempt is the claim. The rescuer
    judged it by the old heartbeat and gave it back at once, under the default rule and under
    heartbeat_timeout alike, so two workers ran it. A heartbeat older than the attempt's start is
    the earlier attempt's: it is cleared (counted, as a sign of life the rule cannot judge), and
    the job is judged by its claim. One whose claim is itself past the grace is rescued."""
    settings.rescuer.heartbeat_timeout = timedelta(minutes=2)
    again = running(engine, schema, seen_ago=timedelta(minutes=5), heartbeat_ago=timedelta(hours=2), attempt=2)
    dead = running(engine, schema, seen_ago=timedelta(hours=1, seconds=1), heartbeat_ago=timedelta(hours=2), attempt=2)
    planned = run(settings, engine, clock, dry_run=True)
    assert (planned.retried, planned.discarded) == (1, 0), planned
    result = run(settings, engine, clock)
    r = rows(engine, schema)
    assert (r[again[0]].state, r[dead[0]].state) == ("running", "retryable"), "the new attempt was rescued"
    assert r[again[0]].heartbeat_at is None and r[again[0]].attempted_at == T0 - timedelta(minutes=5)
    assert (result.retried, result.skipped_rows()) == (1, {"future_sign": 0, "stale_heartbeat": 1})
    assert r[dead[0]].heartbeat_at is None, "a rescued job keeps its last attempt's heartbeat for the next one"
    assert run(settings, engine, clock).did_something() is False  # cleared once; nothing left to do



def test_a_job_claimed_exactly_its_grace_ago_over_an_earlier_attempt_s_heartbeat_stays_running(settings, engine,
                                                                                              schema, clock):
    """The edge of the test above: a claim exactly as old as the rule's limit is not older than it,
    so the job is alive by its claim and its earlier attempt's heartbeat is cleared, not taken for
    this attempt's (``{stale_heartbeat}``'s ``attempted_at >=``). With ``>`` the job was rescued
    by the old heartbeat, and the dry run counted it; a microsecond older, it is rescued."""
    hour = timedelta(hours=1)
    exact = running(engine, schema, seen_ago=hour, heartbeat_ago=2 * hour, attempt=2)
    older = running(engine, schema, seen_ago=hour + timedelta(microseconds=1), heartbeat_ago=2 * hour, attempt=2)
    planned = run(settings, engine, clock, dry_run=True)
    result = run(settings, engine, clock)
    r = rows(engine, schema)
    assert (r[exact[0]].state, r[older[0]].state) == ("running", "retryable")
    assert r[exact[0]].heartbeat_at is None and r[exact[0]].attempted_at == T0 - hour
    assert (planned.retried, result.retried, result.skipped_rows()["stale_heartbeat"]) == (1, 1, 1)


def test_a_rescued_job_claimed_again_by_the_spec_claim_stays_running(settings, engine, schema, clock):
    """The same through the rescue itself: a job rescued after its heartbeats stopped, claimed
    again by SPEC 2's claim (which does not clear heartbeat_at), is not rescued by the next pass."""
    settings.rescuer.heartbeat_timeout = timedelta(minutes=2)
    [job] = running(engine, schema, seen_ago=timedelta(minutes=30), heartbeat_ago=timedelta(minutes=3))
    assert run(settings, engine, clock).retried == 1
    with engine.begin() as conn:  # SPEC 2's claim, a minute before the clock's now
        conn.execute(sql("UPDATE {schema}.jobs SET state = 'running', attempt = attempt + 1, "
                         "attempted_at = CAST(:t AS timestamptz), attempted_by = 'w2' WHERE id = :id", schema),
                     {"t": T0 - timedelta(minutes=1), "id": job})
    result = run(settings, engine, clock)
    assert (result.retried, result.discarded) == (0, 0)
    assert rows(engine, schema)[job].state == "running"


def test_a_claim_over_a_go_zero_heartbeat_neither_spins_the_pass_nor_is_rescued_live(settings, engine, schema,
                                                                                      clock):
    """A worker that writes Go's zero time.Time (year 1, before the keyset's start) as heartbeat_at
    and claims by SPEC 2 (attempted_at = now, heartbeat_at left) runs a live job whose only sign
    of life in this attempt is its claim. The batch for running jobs with no usable sign took it
    as a candidate and, by the stale-heartbeat rule, did not rescue it, nor clear it: the batch
    found as many candidates as its limit again and again, and the pass never ended. Such a
    heartbeat is now cleared like any other earlier attempt's, and the job judged by its claim;
    the dry run says the same."""
    settings.rescuer.batch_size = 1
    with engine.begin() as conn:
        [live] = [r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at, heartbeat_at) "
            "VALUES ('k', 'running', 2, CAST(:t AS timestamptz) - interval '5 minutes', "
            "'0001-01-01 00:00:00+00') RETURNING id", schema), {"t": T0})]
    planned = run(settings, engine, clock, dry_run=True)
    assert (planned.retried, planned.discarded, planned.cleared) == (0, 0, 1), planned
    ctx = PassContext.for_settings(settings, engine, clock)
    done: list = []

    def pass_():
        try:
            done.append(Rescuer(settings.rescuer).run_once(ctx))
        except Exception as exc:  # PassStopped: the stop below ended a pass that never ended
            done.append(exc)

    worker = threading.Thread(target=pass_, daemon=True)
    worker.start()
    worker.join(20)
    ctx.stop_event.set()  # a pass still looping ends at its next batch
    worker.join(20)
    assert done and not isinstance(done[0], Exception), (
        "the pass never ended: the batch of jobs without a usable sign found the same candidate again", done)
    assert (done[0].retried, done[0].discarded, done[0].skipped_rows()) == (
        0, 0, {"future_sign": 0, "stale_heartbeat": 1}), done[0]
    job = rows(engine, schema)[live]
    assert (job.state, job.heartbeat_at) == ("running", None)
    assert run(settings, engine, clock).did_something() is False


def test_an_infinite_heartbeat_or_claim_is_dated_not_rescued(settings, engine, schema):
    """A heartbeat_at of 'infinity' (or from 9999-12-31 on) is a sign of life from the future like
    one ten years ahead, which is dated now: given no later than now. The batch for jobs with no
    usable sign took it as none, and rescued at once a job claimed a minute ago whose worker may
    well be alive (SPEC 2's rule never finds it stuck): two workers ran it. Such a heartbeat is
    now dated now, and the job rescued once its grace passes with no newer sign. So is a claim
    time of 'infinity' with no heartbeat: its worker may be alive too (before: rescued at once)."""
    from maintd.clock import FrozenClock

    settings.rescuer.precise_timing = False
    with engine.begin() as conn:
        live, last_day, claim_only = [r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at, attempted_by, heartbeat_at) "
            "VALUES ('k', 'running', 1, now() - interval '1 minute', 'w1', 'infinity'), "
            "       ('k', 'running', 1, now() - interval '1 minute', 'w1', '9999-12-31 12:00:00+00'), "
            "       ('k', 'running', 1, 'infinity', 'w1', NULL) RETURNING id", schema))]
        now = conn.execute(text("SELECT now()")).scalar()
    planned = run(settings, engine, FrozenClock(now), dry_run=True)
    assert (planned.retried, planned.discarded, planned.dated) == (0, 0, 3), planned
    result = Rescuer(settings.rescuer).run_once(PassContext.for_settings(settings, engine, FrozenClock(now)))
    with engine.connect() as conn:
        got = {r.id: r for r in conn.execute(sql(
            "SELECT id, state::text AS state, coalesce(heartbeat_at, attempted_at) < '9999-01-01' AS dated, "
            "heartbeat_at IS NULL AS no_heartbeat FROM {schema}.jobs", schema))}
    assert {i: got[i].state for i in (live, last_day, claim_only)} == {
        live: "running", last_day: "running", claim_only: "running"}, "a job with a fresh claim was rescued"
    assert got[live].dated and got[last_day].dated and got[claim_only].dated
    assert got[claim_only].no_heartbeat, "the claim is dated, not a heartbeat written for a job that never sent one"
    assert (result.retried, result.skipped_rows()) == (0, {"future_sign": 3, "stale_heartbeat": 0}), result


def test_more_signs_of_life_from_the_future_than_a_batch_are_all_dated_in_one_pass_newest_first(
        settings, engine, schema, caplog):
    """Five running jobs from the future (a worker writing its own clock, an import), batches of
    two. A pass dates them all, newest first, a batch at a time, each batch starting below the
    last one's candidates. Taken nearest first, a batch dated the two signs a day or two ahead,
    found nothing below them to go on with, and the pass ended: the signs of 'infinity' and ten
    years ahead stayed, and their dead workers' jobs were not rescued, until a later look (once
    an interval) came to them, a batch per look. Exact jobs per logged batch."""
    from maintd.clock import FrozenClock

    settings.rescuer.batch_size = 2
    with engine.begin() as conn:
        day_1, day_2, day_3, years_10, never_ends = [r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at, attempted_by, heartbeat_at) "
            "VALUES ('k', 'running', 1, now() + interval '1 day', 'w1', NULL), "
            "       ('k', 'running', 1, now() + interval '2 days', 'w1', NULL), "
            "       ('k', 'running', 1, now(), 'w1', now() + interval '3 days'), "
            "       ('k', 'running', 1, now(), 'w1', now() + interval '10 years'), "
            "       ('k', 'running', 1, now() - interval '1 minute', 'w1', 'infinity') RETURNING id", schema))]
        now = conn.execute(text("SELECT now()")).scalar()
    with caplog.at_level(logging.WARNING, logger="maintd.rescuer"):
        result = run(settings, engine, FrozenClock(now))
    assert [rec.fields["job_ids"] for rec in caplog.records if rec.getMessage().startswith("dated now the sign")] == [
        f"{years_10},{never_ends}", f"{day_2},{day_3}", f"{day_1}"]
    assert (result.dated, result.retried, result.discarded) == (5, 0, 0), result
    with engine.connect() as conn:
        ahead = conn.execute(sql("SELECT id FROM {schema}.jobs "
                                 "WHERE coalesce(heartbeat_at, attempted_at) > now() + interval '1 minute'",
                                 schema)).scalars().all()
    assert ahead == [], f"signs of life still in the future after the pass: {ahead}"


def test_a_pass_reads_each_exhausted_jobs_index_entry_once_while_a_snapshot_keeps_them(settings, engine, schema,
                                                                                     clock, pg_dsn):
    """RESCUER_EXHAUSTED_BATCH's batches each started at the beginning of jobs_exhausted_idx. A
    discarded job's entry stays there until a vacuum, and while any transaction older than the
    discard is open (a report, a pg_dump) the scan cannot mark it dead, so every batch read again
    the entries of every earlier one; and its UPDATE found its candidates by a hash join over the
    whole index. 400 exhausted jobs in batches of 20 read 99,600 entries, quadratic in the jobs.
    Now each batch starts after the last one's candidates and updates them by ctid or id: two
    reads per job."""
    settings.rescuer.batch_size = 20
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, attempt, max_attempts) "
                         "SELECT 'k', 'available', 3, 3 FROM generate_series(1, 400)", schema))
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    result, read = entries_read_while_a_snapshot_is_held(engine, pg_dsn, schema, "exhausted",
                                                         lambda e: run(settings, e, clock))
    assert result.exhausted == 400, result
    assert {r.state for r in rows(engine, schema).values()} == {"discarded"}
    # one read to lock each job and one to discard it (800 here); a batch that read the index
    # from its start, or an update that joined the whole index, read 4,600 to 99,600
    assert read <= 1000, f"{read} index entries read for 400 exhausted jobs"


def test_a_pass_reads_each_future_sign_of_lifes_index_entry_once_while_a_snapshot_keeps_them(settings, engine,
                                                                                           schema, clock, pg_dsn):
    """RESCUER_FUTURE_SIGN_BATCH read jobs_running_idx backwards from its end in every batch. A
    dated job's old entry stays there until a vacuum, and while a transaction older than the
    dating is open the scan cannot mark it dead, so each batch read again the entries of every
    earlier one (400 jobs from the future in batches of 20: quadratic), and its UPDATE could
    read the whole range of future signs again to find its candidates (PostgreSQL 15 did). Now
    each batch starts at the entry after the last one's candidates, and the UPDATE finds them by
    ctid or id."""
    settings.rescuer.batch_size = 20
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at, attempted_by) "
                         "SELECT 'k', 'running', 1, CASE WHEN g % 2 = 0 THEN 'infinity' "
                         "ELSE now() + g * interval '1 day' END, 'w' FROM generate_series(1, 400) g", schema))
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    result, read = entries_read_while_a_snapshot_is_held(engine, pg_dsn, schema, "running",
                                                         lambda e: run(settings, e, clock))
    assert result.dated == 400, result
    with engine.connect() as conn:
        assert conn.execute(sql("SELECT count(*) FROM {schema}.jobs WHERE attempted_at > now() + interval '1 minute'",
                                schema)).scalar() == 0
    # one read to lock each job and the next batch's start (419 here; the pass's other batches read
    # an entry or so each); batches that read from the index's end, or an update that read the
    # whole range of future signs, read 5,800 and more
    assert read <= 1000, f"{read} index entries read for 400 jobs from the future"


def test_a_pass_reads_each_index_entry_of_jobs_stuck_at_one_instant_once_while_a_snapshot_keeps_them(
        settings, engine, schema, clock, pg_dsn):
    """Stuck jobs last seen at the very same instant are common (one worker's claim of a batch,
    one statement's now(): a crashed worker leaves them all). RESCUER_BATCH's keyset position is
    its last candidate, (seen, id) with the largest id of the tie: taken with the smallest id
    (``id`` for ``id DESC`` there), each batch read again the entries of the last batch's rescued
    jobs (they stay in jobs_running_idx until a vacuum, and a transaction older than the rescue
    keeps them from being marked dead): 400 jobs in batches of 20 read 780 entries, not 400."""
    settings.rescuer.batch_size = 20
    stuck = running(engine, schema, seen_ago=timedelta(hours=2), n=400)
    with engine.begin() as conn:
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    result, read = entries_read_while_a_snapshot_is_held(engine, pg_dsn, schema, "running",
                                                         lambda e: run(settings, e, clock))
    assert (result.retried, result.batches) == (400, 20), result
    assert {i: r.state for i, r in rows(engine, schema).items()} == {i: "retryable" for i in stuck}
    assert read <= 600, f"{read} entries of jobs_running_idx read for 400 jobs stuck at one instant"
