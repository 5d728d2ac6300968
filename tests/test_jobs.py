"""Worker helpers: enqueue, claim, heartbeat, complete, fail, cancel, and their guards."""

from __future__ import annotations

import math
import threading
from datetime import datetime, timedelta, timezone

import pytest

from maintd.queries import jobs, sql
from maintd.jobs import ClaimedJob, JobQueue, backoff

from .conftest import run_concurrently
from .plans import explain

# Every test here runs on both jobs layouts (SPEC 8.1): tests/conftest.py.
pytestmark = pytest.mark.both_layouts


def _row(engine, schema, job_id):
    with engine.connect() as conn:
        return conn.execute(sql("SELECT * FROM {schema}.jobs WHERE id = :id", schema),
                            {"id": job_id}).mappings().one()


def _enqueue(engine, jq: JobQueue, **kw) -> int:
    with engine.begin() as conn:
        return jq.enqueue(conn, kw.pop("kind", "email"), kw.pop("args", {"to": "a@b.c"}), **kw)


def _claim(engine, queue: JobQueue, worker="w1", q="default", limit=1) -> list[ClaimedJob]:
    with engine.begin() as conn:
        return queue.claim(conn, q, worker, limit)


def test_backoff_is_exp_of_capped_attempt():
    assert backoff(1).total_seconds() == pytest.approx(math.e)
    assert backoff(10).total_seconds() == pytest.approx(math.exp(10))
    assert backoff(25) == backoff(10)  # capped at ~6 h
    assert backoff(0).total_seconds() == pytest.approx(1.0)


def test_enqueue_defaults_and_scheduled(engine, schema, queue):
    jid = _enqueue(engine, queue)
    row = _row(engine, schema, jid)
    assert (row["state"], row["queue"], row["priority"], row["attempt"], row["max_attempts"]) == (
        "available", "default", 0, 0, 25)
    assert row["args"] == {"to": "a@b.c"} and row["errors"] == [] and row["finalized_at"] is None

    future = datetime.now(timezone.utc) + timedelta(hours=1)
    jid2 = _enqueue(engine, queue, scheduled_at=future, queue="mail", priority=3, max_attempts=2,
                    metadata={"src": "t"})
    row2 = _row(engine, schema, jid2)
    assert row2["state"] == "scheduled" and row2["scheduled_at"] == future
    assert (row2["queue"], row2["priority"], row2["max_attempts"], row2["metadata"]) == (
        "mail", 3, 2, {"src": "t"})


def test_unique_key_allows_one_live_job(engine, schema, queue):
    first = _enqueue(engine, queue, unique_key="report:42")
    assert first is not None
    assert _enqueue(engine, queue, unique_key="report:42") is None
    [job] = _claim(engine, queue)
    with engine.begin() as conn:
        assert queue.complete(conn, job)
    # A finished job frees the key.
    assert _enqueue(engine, queue, unique_key="report:42") not in (None, first)


def test_check_constraints_reject_bad_rows(engine, schema, queue, layout):
    with pytest.raises(Exception, match="jobs_kind_length_check"):
        _enqueue(engine, queue, kind="")
    with pytest.raises(Exception, match="jobs_max_attempts_positive_check"):
        _enqueue(engine, queue, max_attempts=0)
    # Partitioned: a final row without finalized_at has no partition to go to (the check stays too).
    refused = "jobs_finalized_at_iff_final_check" if layout == "plain" else "no partition of relation"
    with engine.begin() as conn, pytest.raises(Exception, match=refused):
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state) VALUES ('k', 'completed')", schema))
    with engine.begin() as conn, pytest.raises(Exception, match="jobs_finalized_at_iff_final_check"):
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, finalized_at) VALUES ('k', 'available', now())",
                         schema))


def test_claim_order_and_skip_locked(engine, schema, queue):
    low = _enqueue(engine, queue, priority=5)
    high = _enqueue(engine, queue, priority=1)
    later = _enqueue(engine, queue, priority=1)
    _enqueue(engine, queue, queue="other")
    _enqueue(engine, queue, scheduled_at=datetime.now(timezone.utc) + timedelta(hours=1))
    # A claimer holding a row lock does not block another claimer. The order is checked a job at a
    # time: RETURNING hands back the rows of a claim in the plan's order, not the ORDER BY's.
    with engine.connect() as c1:
        got1 = queue.claim(c1, "default", "w1", 1)
        assert [j.id for j in got1] == [high]
        assert [j.id for j in _claim(engine, queue, "w2", limit=1)] == [later]
        assert [j.id for j in _claim(engine, queue, "w2", limit=5)] == [low]
        c1.commit()
    job = got1[0]
    assert (job.attempt, job.attempted_by, job.kind) == (1, "w1", "email")
    row = _row(engine, schema, high)
    assert row["state"] == "running" and row["attempted_at"] is not None
    assert _claim(engine, queue, "w3") == []  # future and other-queue jobs are not claimed


def test_a_job_out_of_attempts_is_never_claimed(engine, schema, queue):
    """A waiting job with attempt >= max_attempts (an operator lowered max_attempts, an import) is
    the rescuer's to discard: a claim must not run it an attempt past its max_attempts."""
    spent = _enqueue(engine, queue, max_attempts=1)
    [job] = _claim(engine, queue, "w1")
    with engine.begin() as conn:
        assert queue.fail(conn, job, "boom") == "discarded"
        conn.execute(sql("UPDATE {schema}.jobs SET state = 'available', finalized_at = NULL "
                         "WHERE id = :id", schema), {"id": spent})  # attempt 1 of 1, waiting
    fresh = _enqueue(engine, queue, max_attempts=1)
    assert [j.id for j in _claim(engine, queue, "w2", limit=5)] == [fresh]
    row = _row(engine, schema, spent)
    assert (row["state"], row["attempt"]) == ("available", 1)


def test_concurrent_claims_never_share_a_job(engine, schema, queue):
    with engine.begin() as conn:
        for i in range(200):
            queue.enqueue(conn, "k", {"i": i})
    def worker() -> list[int]:
        mine: list[int] = []
        while jobs := _claim(engine, queue, f"w{threading.get_ident()}", limit=3):
            mine.extend(j.id for j in jobs)
        return mine

    claimed = [i for mine in run_concurrently(worker, 6) for i in mine]  # no worker raised
    assert len(claimed) == 200 and len(set(claimed)) == 200


def test_complete_and_heartbeat_guards(engine, schema, queue):
    jid = _enqueue(engine, queue)
    [job] = _claim(engine, queue, "w1")
    with engine.begin() as conn:
        assert queue.heartbeat(conn, job)
    assert _row(engine, schema, jid)["heartbeat_at"] is not None
    impostor = ClaimedJob(**{**job.__dict__, "attempted_by": "w2"})
    with engine.begin() as conn:
        assert not queue.complete(conn, impostor)
        assert not queue.heartbeat(conn, impostor)
    with engine.begin() as conn:
        assert queue.complete(conn, job)
    row = _row(engine, schema, jid)
    assert row["state"] == "completed" and row["finalized_at"] is not None
    with engine.begin() as conn:  # completing twice does nothing
        assert not queue.complete(conn, job)
        assert not queue.heartbeat(conn, job)


def test_complete_after_rescue_does_nothing(engine, schema, queue):
    """The rescuer moved the job on (retryable); the slow worker's late completion must not land."""
    jid = _enqueue(engine, queue)
    [job] = _claim(engine, queue, "w1")
    with engine.begin() as conn:  # what a rescue does to the row
        conn.execute(sql("UPDATE {schema}.jobs SET state = 'retryable', scheduled_at = now() "
                         "WHERE id = :id", schema), {"id": jid})
    with engine.begin() as conn:
        assert not queue.complete(conn, job)
        assert queue.fail(conn, job, "late failure") is None
    assert _row(engine, schema, jid)["state"] == "retryable"


def test_late_completion_of_an_earlier_attempt_does_nothing(engine, schema, queue):
    """Same worker id, re-claimed after a rescue: attempt 1's completion must not finish attempt 2."""
    jid = _enqueue(engine, queue)
    [first] = _claim(engine, queue, "w1")
    with engine.begin() as conn:
        conn.execute(sql("UPDATE {schema}.jobs SET state = 'available' WHERE id = :id", schema),
                     {"id": jid})
    [second] = _claim(engine, queue, "w1")
    assert second.attempt == 2
    with engine.begin() as conn:
        assert not queue.complete(conn, first)
        assert queue.complete(conn, second)


def test_fail_retries_with_backoff_then_discards(engine, schema, queue):
    jid = _enqueue(engine, queue, max_attempts=2)
    [job] = _claim(engine, queue)
    before = datetime.now(timezone.utc)
    with engine.begin() as conn:
        assert queue.fail(conn, job, "boom 1") == "retryable"
    row = _row(engine, schema, jid)
    delay = (row["scheduled_at"] - before).total_seconds()
    assert backoff(1).total_seconds() - 1 < delay < backoff(1).total_seconds() + 5
    assert row["finalized_at"] is None
    assert [(e["attempt"], e["error"]) for e in row["errors"]] == [(1, "boom 1")]

    with engine.begin() as conn:
        conn.execute(sql("UPDATE {schema}.jobs SET state = 'available', scheduled_at = now() "
                         "WHERE id = :id", schema), {"id": jid})
    [job2] = _claim(engine, queue)
    with engine.begin() as conn:
        assert queue.fail(conn, job2, "boom 2") == "discarded"
    row = _row(engine, schema, jid)
    assert row["state"] == "discarded" and row["finalized_at"] is not None
    assert [(e["attempt"], e["error"]) for e in row["errors"]] == [(1, "boom 1"), (2, "boom 2")]


def test_fail_with_discard_flag(engine, schema, queue):
    jid = _enqueue(engine, queue)
    [job] = _claim(engine, queue)
    with engine.begin() as conn:
        assert queue.fail(conn, job, "bad input", discard=True) == "discarded"
    assert _row(engine, schema, jid)["state"] == "discarded"


def test_cancel_live_jobs_only(engine, schema, queue):
    waiting = _enqueue(engine, queue)
    running = _enqueue(engine, queue, queue="q2")
    [job] = _claim(engine, queue, q="q2")
    with engine.begin() as conn:
        assert queue.cancel(conn, waiting)
        assert queue.cancel(conn, running)
        assert not queue.cancel(conn, waiting)  # already final
    assert _row(engine, schema, waiting)["state"] == "cancelled"
    with engine.begin() as conn:  # the worker of a cancelled job cannot complete it
        assert not queue.complete(conn, job)
    assert _row(engine, schema, running)["state"] == "cancelled"


def test_claim_uses_the_fetch_index(engine, schema, queue, layout):
    """The production CLAIM statement (not a copy of it), with a realistic table: many finished
    rows, a few waiting in other queues, statistics up to date. Both the plan with the values known
    and the generic plan psycopg switches to after five executions must read jobs_fetch_idx.
    (Partitioned, the finished rows are not in the live partition: running jobs make it big enough
    that a scan of it would not be the cheaper plan.)"""
    with engine.begin() as conn:
        if layout == "partitioned":
            conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state, attempt, attempted_at) "
                             "SELECT 'k', 'r' || (g % 7), 'running', 1, now() FROM generate_series(1, 20000) g",
                             schema))
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state, finalized_at) "
                         "SELECT 'k', 'q' || (g % 7), 'completed', now() FROM generate_series(1, 20000) g",
                         schema))
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue) "
                         "SELECT 'k', 'q' || (g % 7) FROM generate_series(1, 300) g", schema))
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    with engine.connect() as conn:
        params = {"queue": "q3", "worker": "w1", "limit": 5}
        plans = [explain(conn, jobs.CLAIM, schema, params, generic=g) for g in (False, True)]
        conn.rollback()
    for plan in plans:
        assert "jobs_fetch_idx" in plan and "Seq Scan" not in plan, plan


@pytest.mark.parametrize("error", ["bad byte \x00 in a message", "undecodable \udcff name",
                                   ValueError("an exception, not its text")])
def test_fail_records_any_error_text(engine, schema, queue, error):
    """A failure's text comes from anywhere (a subprocess's output, a file name read with
    surrogateescape, the exception itself): PostgreSQL's text holds no NUL byte and no lone
    surrogate. fail() must still retry the job and keep the message, not raise and leave it
    running until the rescuer's hour is up."""
    jid = _enqueue(engine, queue)
    [job] = _claim(engine, queue)
    with engine.begin() as conn:
        assert queue.fail(conn, job, error) == "retryable", "fail() refused the error text"
    row = _row(engine, schema, jid)
    assert row["state"] == "retryable"
    [entry] = row["errors"]
    assert str(error).split(" ")[0] in entry["error"] and "\x00" not in entry["error"]


@pytest.mark.parametrize("worker, limit", [("w1", None), (None, 1), ("w1", -1), ("w1", True)])
def test_claim_refuses_a_missing_worker_or_limit(engine, schema, queue, worker, limit):
    """``limit=None`` reached the SQL as ``LIMIT NULL`` (no limit: the whole queue claimed by one
    worker); ``worker=None`` claimed jobs no guarded update can finish (stuck until rescued)."""
    _enqueue(engine, queue)
    _enqueue(engine, queue)
    with engine.begin() as conn, pytest.raises(ValueError):
        queue.claim(conn, "default", worker, limit)
    with engine.connect() as conn:
        waiting = conn.execute(sql("SELECT count(*) FROM {schema}.jobs WHERE state = 'available'",
                                   schema)).scalar()
    assert waiting == 2


def test_enqueue_reads_a_naive_scheduled_at_as_utc(engine, schema, queue):
    """``datetime.utcnow() + delay`` is naive: PostgreSQL read it in the caller's session TimeZone
    (here New York), so the job ran five hours late (or, east of UTC, at once). UTC, as
    ``maintd jobs reschedule --at`` reads a naive time."""
    naive = datetime.now(timezone.utc).replace(tzinfo=None, microsecond=0) + timedelta(minutes=10)
    with engine.begin() as conn:
        conn.exec_driver_sql("SET LOCAL TimeZone = 'America/New_York'")
        jid = queue.enqueue(conn, "k", {}, scheduled_at=naive)
    row = _row(engine, schema, jid)
    assert row["scheduled_at"] == naive.replace(tzinfo=timezone.utc), "naive time not read as UTC"
    assert row["state"] == "scheduled"


@pytest.mark.parametrize("field, value", [("args", 0), ("args", False), ("args", [1, 2]),
                                          ("args", "to=a@b.c"), ("metadata", ["x"])])
def test_enqueue_refuses_args_or_metadata_that_are_not_an_object(engine, schema, queue, field, value):
    """args and metadata are JSON objects (SPEC 1: default '{}'; the claim hands args out as a
    dict, the periodic enqueuer merges ``_cron`` into them). A falsy value was silently stored as
    ``{}`` (the job ran without its argument), a list or a string as such (the worker's
    ``job.args["to"]`` failing on every attempt until discarded)."""
    kw = {"args": {"to": "a@b.c"}, field: value}
    with engine.begin() as conn, pytest.raises(TypeError, match=field):
        queue.enqueue(conn, "k", kw.pop("args"), **kw)
    with engine.connect() as conn:
        assert conn.execute(sql("SELECT count(*) FROM {schema}.jobs", schema)).scalar() == 0
