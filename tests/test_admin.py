"""SQL admin functions (revision 0002) and ``maintd jobs`` (SPEC 7.5), on real PostgreSQL.

Function semantics follow graphile-worker's admin functions and their tests
(graphile/worker __tests__/workerUtils.completeJobs.test.ts, workerUtils.permanentlyFailJobs.test.ts,
workerUtils.rescheduleJobs.test.ts: "leaves locked jobs unaffected") and River's JobRetry
(riverqueue/river riverdriver/riverpgxv5/internal/dbsqlc/river_job.sql), adapted to maintd's states.
"""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from sqlalchemy import text

from maintd import admin, migrate
from maintd.cli import main
from maintd.db import make_engine, notify_channel, quote_ident
from maintd.queries import sql
from maintd.jobs import ClaimedJob, JobQueue
from maintd.queries import FINAL_STATES, JOB_STATES
from maintd.queries import admin as admin_queries

from .plans import explain, index_names, seq_scans

# Every test here runs on both jobs layouts (SPEC 8.1): tests/conftest.py.
pytestmark = pytest.mark.both_layouts

ALL = JOB_STATES  # one job per state, in this order, in most tests
IDLE = ("available", "scheduled", "retryable")
ADMIN_FUNCTIONS = {"complete_jobs", "permanently_fail_jobs", "retry_jobs", "cancel_jobs",
                   "reschedule_jobs", "remove_job", "delete_jobs"}


# ---------------------------------------------------------------- helpers

def add(engine, schema, state="available", *, queue="default", kind="k", n=1, attempt=0,
        max_attempts=25, due_in=timedelta(0), unique_key=None):
    """Insert ``n`` jobs in ``state`` (consistent: finalized_at for final states, attempted_at for
    running); returns their ids."""
    with engine.begin() as conn:
        return [r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, queue, state, attempt, max_attempts, scheduled_at,"
            " finalized_at, attempted_at, attempted_by, unique_key)"
            " SELECT :kind, :queue, CAST(:state AS {schema}.job_state), :attempt, :max_attempts,"
            " now() + make_interval(secs => :due), CASE WHEN :state IN ('completed', 'cancelled',"
            " 'discarded') THEN now() END, CASE WHEN :state = 'running' THEN now() END,"
            " CASE WHEN :state = 'running' THEN 'w1' END, :unique_key"
            " FROM generate_series(1, :n) ORDER BY 1 RETURNING id", schema),
            {"kind": kind, "queue": queue, "state": state, "attempt": attempt, "n": n,
             "max_attempts": max_attempts, "due": due_in.total_seconds(), "unique_key": unique_key})]


def one_of_each(engine, schema, **kw) -> dict[str, int]:
    return {s: add(engine, schema, s, **kw)[0] for s in ALL}


def rows(engine, schema, ids=None) -> dict[int, dict]:
    with engine.connect() as conn:
        return {r["id"]: dict(r) for r in conn.execute(sql(
            "SELECT *, state::text AS state FROM {schema}.jobs"
            " WHERE CAST(:ids AS bigint[]) IS NULL OR id = ANY(CAST(:ids AS bigint[]))", schema),
            {"ids": ids}).mappings()}


def call(engine, schema, fn, *args):
    """``SELECT * FROM schema.fn(args)`` in its own transaction; the changed rows by id."""
    marks = ", ".join(f":a{i}" for i in range(len(args)))
    with engine.begin() as conn:
        out = conn.execute(text(f"SELECT *, state::text AS state FROM {quote_ident(schema)}.{fn}({marks})"),
                           {f"a{i}": a for i, a in enumerate(args)}).mappings()
        return {r["id"]: dict(r) for r in out}


def table_digest(engine, schema) -> str:
    with engine.connect() as conn:
        return conn.execute(sql("SELECT md5(coalesce(string_agg(j::text, '|' ORDER BY id), ''))"
                                " FROM {schema}.jobs AS j", schema)).scalar()


def listen(pg_dsn, schema):
    conn = psycopg.connect(pg_dsn, autocommit=True)
    conn.execute(f'LISTEN "{notify_channel(schema)}"')
    return conn


def drain(conn, timeout=0.5):
    return sorted(n.payload for n in conn.notifies(timeout=timeout))


@pytest.fixture
def cfg(tmp_path, pg_dsn, schema):
    path = tmp_path / "maintd.toml"
    path.write_text(f'database_url = "{pg_dsn}"\nschema = "{schema}"\ninstance_id = "admin-test"\n')
    return str(path)


@pytest.fixture
def cli(cfg, capsys):
    def run(*argv):
        rc = main(["--config", cfg, "jobs", *argv])
        out = capsys.readouterr()
        return rc, out.out, out.err
    return run


def cli_json(cli, *argv):
    rc, out, err = cli(*argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def assert_invariant(engine, schema):
    with engine.connect() as conn:
        bad = conn.execute(sql("SELECT count(*) FROM {schema}.jobs WHERE (finalized_at IS NOT NULL)"
                               " <> (state IN ('completed', 'cancelled', 'discarded'))", schema)).scalar()
    assert bad == 0


# ---------------------------------------------------------------- SQL functions

def test_complete_jobs_completes_all_but_running_and_completed(engine, schema):
    ids = one_of_each(engine, schema)
    before = rows(engine, schema)
    changed = call(engine, schema, "complete_jobs", list(ids.values()))
    assert set(changed) == {ids[s] for s in ALL if s not in ("running", "completed")}
    after = rows(engine, schema)
    assert {after[i]["state"] for i in changed} == {"completed"}
    assert after[ids["running"]] == before[ids["running"]]  # untouched, byte for byte
    assert after[ids["completed"]] == before[ids["completed"]]
    assert all(after[i]["finalized_at"] is not None for i in changed)
    assert_invariant(engine, schema)


def test_permanently_fail_jobs_discards_waiting_jobs_and_appends_the_reason(engine, schema):
    ids = one_of_each(engine, schema, attempt=2)
    changed = call(engine, schema, "permanently_fail_jobs", list(ids.values()), "bad payload")
    assert set(changed) == {ids[s] for s in IDLE}
    for job in changed.values():
        assert job["state"] == "discarded" and job["finalized_at"] is not None
        [entry] = job["errors"]
        assert entry["error"] == "bad payload" and entry["attempt"] == 2
        assert datetime.fromisoformat(entry["at"]) == job["finalized_at"]  # the server's now()
    after = rows(engine, schema)
    assert after[ids["running"]]["state"] == "running" and after[ids["running"]]["errors"] == []
    # No reason: still an entry, with a default text (the dashboard shows the last error).
    [job_id] = add(engine, schema, "retryable")
    [entry] = call(engine, schema, "permanently_fail_jobs", [job_id], None)[job_id]["errors"]
    assert entry["error"] == "permanently failed by an operator"


def test_cancel_jobs_cancels_only_waiting_jobs(engine, schema):
    ids = one_of_each(engine, schema)
    changed = call(engine, schema, "cancel_jobs", list(ids.values()) + [10**12])
    assert set(changed) == {ids[s] for s in IDLE}
    assert {j["state"] for j in changed.values()} == {"cancelled"}
    assert all(j["finalized_at"] is not None for j in changed.values())
    after = rows(engine, schema)
    assert {after[ids[s]]["state"] for s in ("running", "completed", "discarded")} == {
        "running", "completed", "discarded"}
    assert_invariant(engine, schema)


def test_retry_jobs_revives_final_jobs_with_one_more_attempt_and_notifies(pg_dsn, engine, schema):
    exhausted = add(engine, schema, "discarded", queue="mail", attempt=25, max_attempts=25)[0]
    cancelled = add(engine, schema, "cancelled", queue="mail", attempt=1)[0]
    later = add(engine, schema, "scheduled", queue="pdf", due_in=timedelta(hours=1))[0]
    due_now = add(engine, schema, "available", queue="pdf")[0]  # already available: no change
    running = add(engine, schema, "running", queue="pdf")[0]
    listener = listen(pg_dsn, schema)
    try:
        changed = call(engine, schema, "retry_jobs", [exhausted, cancelled, later, due_now, running])
        assert drain(listener) == ["mail", "pdf"]  # once per queue
    finally:
        listener.close()
    assert set(changed) == {exhausted, cancelled, later}
    for job in changed.values():
        assert job["state"] == "available" and job["finalized_at"] is None
        assert job["scheduled_at"] <= datetime.now(timezone.utc) + timedelta(seconds=5)
    assert changed[exhausted]["attempt"] == 25 and changed[exhausted]["max_attempts"] == 26
    assert changed[cancelled]["max_attempts"] == 25  # attempts left: unchanged
    assert rows(engine, schema, [running])[running]["state"] == "running"
    assert_invariant(engine, schema)


def test_retry_jobs_keeps_a_final_job_whose_unique_key_is_taken(engine, schema):
    live = add(engine, schema, "scheduled", unique_key="report:1", due_in=timedelta(hours=1))[0]
    old = add(engine, schema, "discarded", unique_key="report:1")[0]
    twins = add(engine, schema, "discarded", unique_key="report:2", n=2)
    changed = call(engine, schema, "retry_jobs", [live, old, *twins])
    # The live one is retried; the old one cannot be (one live job per key); of two final twins
    # the newest is revived. No unique violation aborts the call.
    assert set(changed) == {live, max(twins)}


def test_retry_jobs_gives_an_available_job_out_of_attempts_one_more(engine, schema, cli):
    """What reschedule_jobs(..., max_attempts := n) below a job's attempt leaves (README, "The
    attempt counter"): an available job out of attempts. retry_jobs left it alone as available
    and due, the CLI said "nothing to do", and the rescuer discarded it."""
    [exhausted] = add(engine, schema, "available", attempt=3, max_attempts=2)
    [fresh] = add(engine, schema, "available", attempt=1, max_attempts=5)  # due, attempts left: nothing to do
    rc, out, err = cli("retry", str(exhausted), str(fresh), "--dry-run")
    assert rc == 0 and "1 job would be retried" in out, out + err
    changed = call(engine, schema, "retry_jobs", [exhausted, fresh])
    assert set(changed) == {exhausted} and changed[exhausted]["max_attempts"] == 4
    assert changed[exhausted]["attempt"] == 3 and changed[exhausted]["state"] == "available"


def test_cli_retry_by_state_available_ends_on_a_job_at_the_attempt_limit(engine, schema, cli):
    """An available job at attempt 32767 (README, "The attempt counter": an import's odd row)
    cannot get one more attempt, yet retry_jobs "changed" it: scheduled_at = now() moved it
    ahead of the keyset of `retry --state available`, so every batch retried it again and the
    command never ended. It is left alone now (nothing to do), like a due job with attempts left."""
    [stuck] = add(engine, schema, "available", attempt=32767, max_attempts=32767)
    [exhausted] = add(engine, schema, "available", attempt=3, max_attempts=2)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(out=cli(
        "retry", "--state", "available", "--batch-size", "1", "--json")), daemon=True)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive(), "`maintd jobs retry --state available` did not end"
    rc, out, err = result["out"]
    data = json.loads(out)
    assert rc == 0 and data["changed"] == 1 and [j["id"] for j in data["jobs"]] == [exhausted], out + err
    assert call(engine, schema, "retry_jobs", [stuck]) == {}


def test_retry_jobs_skips_a_final_job_whose_key_a_live_job_took_meanwhile(pg_dsn, engine, schema):
    """A worker's enqueue of the same unique_key, not committed yet when retry_jobs read: the
    revival waited for it, then failed the whole call with 23505, the jobs it had changed rolled
    back. The job is skipped now, the others changed."""
    import threading

    import psycopg

    [keyed] = add(engine, schema, "cancelled", unique_key="K")
    [other] = add(engine, schema, "cancelled")
    with psycopg.connect(pg_dsn) as worker:
        worker.execute(f'INSERT INTO "{schema}".jobs (kind, unique_key) VALUES (%s, %s)', ["k", "K"])
        threading.Timer(1.0, worker.commit).start()  # while retry_jobs waits on the key
        changed = call(engine, schema, "retry_jobs", [keyed, other])
    assert set(changed) == {other}
    assert rows(engine, schema, [keyed])[keyed]["state"] == "cancelled"
    assert_invariant(engine, schema)


def test_retry_jobs_on_many_final_jobs_with_keys_takes_linear_time(engine, schema):
    """The newest final job of each unique_key was found by a subquery over the call's other
    candidates, once per keyed job: quadratic (8,000 jobs 3 s, 16,000 about 13 s, the CLI's
    --batch-size 1,000,000 hours). One grouped pass now."""
    n = 16_000
    with engine.begin() as conn:
        ids = [r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, state, finalized_at, unique_key)"
            " SELECT 'k', 'discarded', now(), 'key:' || g FROM generate_series(1, :n) AS g"
            " ORDER BY g RETURNING id", schema), {"n": n})]
    started = time.monotonic()
    with engine.begin() as conn:
        changed = conn.execute(sql("SELECT count(*) FROM {schema}.retry_jobs(:ids)", schema),
                               {"ids": ids}).scalar()
    elapsed = time.monotonic() - started
    assert changed == n
    assert elapsed < 4, f"retry_jobs of {n} keyed final jobs took {elapsed:.1f} s"


def test_retry_jobs_revives_keyed_final_jobs_in_one_subtransaction_not_one_each(engine, schema):
    """Each final job with a unique_key was revived in a BEGIN ... EXCEPTION block of its own: a
    subtransaction with a transaction id of its own, 1,000 in a CLI batch. Past 64 in one
    transaction the backend's subtransaction cache overflows, and every other session's snapshot
    then has to look them up in pg_subtrans while the transaction lasts (PostgreSQL's docs,
    "Subtransactions": "more than 64 ... can cause performance degradation").

    Counted by the rows themselves: a row version's xmin is the id of the (sub)transaction that
    wrote it, so 200 jobs revived one block each carry 200 distinct xmins, and one block 1. (This
    read the server's next transaction id before and after instead, which other tests on a shared
    server advance meanwhile: CI on PostgreSQL 15 counted [9, 7, 10].)"""
    with engine.begin() as conn:
        ids = [r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, state, finalized_at, unique_key)"
            " SELECT 'k', 'discarded', now(), 'sub:' || g FROM generate_series(1, 200) AS g RETURNING id",
            schema))]
    with engine.begin() as conn:
        changed = conn.execute(sql("SELECT count(*) FROM {schema}.retry_jobs(:ids)", schema), {"ids": ids}).scalar()
        writers = conn.execute(sql(
            "SELECT count(DISTINCT xmin::text) FROM {schema}.jobs WHERE id = ANY(:ids)", schema), {"ids": ids}).scalar()
    assert changed == 200
    assert writers == 1, f"retry_jobs revived 200 keyed jobs in {writers} (sub)transactions"


def test_retry_dry_run_predicts_one_revival_per_unique_key(engine, schema, cli):
    """Of final jobs sharing a unique_key, retry_jobs revives the newest: --dry-run counted them
    all ("2 jobs would be retried", then 1 was)."""
    twins = add(engine, schema, "cancelled", unique_key="K", n=2)
    rc, out, err = cli("retry", *map(str, twins), "--dry-run")
    assert rc == 0 and "1 job would be retried" in out, out + err
    rc, out, err = cli("retry", *map(str, twins))
    assert rc == 0 and "1 job retried" in out and "a newer job with its unique_key was retried" in out, out + err


def test_reschedule_jobs_null_keeps_fields_and_state_follows_run_at(pg_dsn, engine, schema):
    ids = one_of_each(engine, schema, attempt=3)
    before = rows(engine, schema)
    later = datetime.now(timezone.utc) + timedelta(hours=2)
    changed = call(engine, schema, "reschedule_jobs", list(ids.values()), later, None, None, None)
    assert set(changed) == {ids[s] for s in IDLE}  # final jobs are not revived here
    assert changed[ids["available"]]["state"] == "scheduled"
    assert changed[ids["scheduled"]]["state"] == "scheduled"
    assert changed[ids["retryable"]]["state"] == "retryable"
    for job_id, job in changed.items():
        assert job["scheduled_at"] == later
        assert (job["priority"], job["attempt"], job["max_attempts"]) == (0, 3, 25)
    after = rows(engine, schema)
    for s in ("running", *FINAL_STATES):
        assert after[ids[s]] == before[ids[s]]
    listener = listen(pg_dsn, schema)
    try:
        past = datetime.now(timezone.utc) - timedelta(minutes=1)
        changed = call(engine, schema, "reschedule_jobs", [ids["scheduled"]], past, 7, 0, 3)
        assert drain(listener) == ["default"]
    finally:
        listener.close()
    job = changed[ids["scheduled"]]
    assert (job["state"], job["priority"], job["attempt"], job["max_attempts"]) == ("available", 7, 0, 3)


def test_remove_job_deletes_the_pending_job_of_a_key_but_not_a_running_one(engine, schema):
    pending = add(engine, schema, "scheduled", unique_key="a", due_in=timedelta(hours=1))[0]
    history = add(engine, schema, "completed", unique_key="a")[0]
    running = add(engine, schema, "running", unique_key="b")[0]
    assert set(call(engine, schema, "remove_job", "a")) == {pending}
    assert call(engine, schema, "remove_job", "a") == {}
    assert call(engine, schema, "remove_job", "b") == {}
    left = rows(engine, schema)
    assert set(left) == {history, running} and left[running]["state"] == "running"
    # The key is free again: a new job with it can be enqueued.
    with engine.begin() as conn:
        assert JobQueue(schema).enqueue(conn, "k", unique_key="a") is not None


def test_delete_jobs_deletes_any_state_but_running(engine, schema):
    ids = one_of_each(engine, schema)
    deleted = call(engine, schema, "delete_jobs", list(ids.values()))
    assert set(deleted) == {ids[s] for s in ALL if s != "running"}
    assert set(rows(engine, schema)) == {ids["running"]}


FUNCTION_CALLS = {
    "complete_jobs": ("complete_jobs(:ids)", "available"),
    "permanently_fail_jobs": ("permanently_fail_jobs(:ids, 'x')", "available"),
    "cancel_jobs": ("cancel_jobs(:ids)", "available"),
    "delete_jobs": ("delete_jobs(:ids)", "available"),
    "retry_jobs": ("retry_jobs(:ids)", "retryable"),
    "reschedule_jobs": ("reschedule_jobs(:ids, now() + interval '1 hour')", "available"),
    "remove_job": ("remove_job(:key)", "available"),  # the job holds the key 'locked:1'
}


@pytest.mark.parametrize("fn", sorted(FUNCTION_CALLS))
def test_functions_skip_a_row_a_worker_holds_locked_without_waiting(pg_dsn, engine, schema, fn):
    """A worker claims the job (row locked, not yet committed): the admin call returns at once
    without it, and after the worker commits the job is the worker's."""
    expr, state = FUNCTION_CALLS[fn]
    job_id = add(engine, schema, state, queue="q", due_in=timedelta(seconds=-1), unique_key="locked:1")[0]
    worker = psycopg.connect(pg_dsn)
    try:
        worker.execute(f"UPDATE {quote_ident(schema)}.jobs SET state = 'running', attempt = attempt + 1,"
                       " attempted_at = now(), attempted_by = 'w1' WHERE id = %s", (job_id,))
        admin_engine = make_engine(pg_dsn, application_name="t", pooled=False,
                                   session={"statement_timeout": 10000})
        started = time.monotonic()
        with admin_engine.begin() as conn:
            out = conn.execute(text(f"SELECT id FROM {quote_ident(schema)}.{expr}"),
                               {"ids": [job_id], "key": "locked:1"}).all()
        elapsed = time.monotonic() - started
        admin_engine.dispose()
        assert out == [] and elapsed < 5
        worker.commit()
    finally:
        worker.close()
    job = rows(engine, schema, [job_id])[job_id]
    assert (job["state"], job["attempted_by"], job["attempt"]) == ("running", "w1", 1)


def test_permanently_fail_jobs_keeps_the_earlier_errors(engine, schema):
    """The reason is appended: the errors the worker recorded before stay, in order."""
    [job_id] = add(engine, schema, "retryable", attempt=2)
    earlier = [{"at": "2026-01-01T00:00:00+00:00", "attempt": 1, "error": "timeout"},
               {"at": "2026-01-01T00:01:00+00:00", "attempt": 2, "error": "refused"}]
    with engine.begin() as conn:
        conn.execute(sql("UPDATE {schema}.jobs SET errors = CAST(:e AS jsonb) WHERE id = :id", schema),
                     {"e": json.dumps(earlier), "id": job_id})
    errors = call(engine, schema, "permanently_fail_jobs", [job_id], "bad payload")[job_id]["errors"]
    assert errors[:2] == earlier
    assert [(e["attempt"], e["error"]) for e in errors[2:]] == [(2, "bad payload")]


@pytest.mark.parametrize("fn", sorted(FUNCTION_CALLS))
def test_functions_never_lock_a_running_job(pg_dsn, engine, schema, fn):
    """A running job is skipped and not locked either: its worker's heartbeat (completion,
    failure) must not wait for the operator's transaction. Dropping the inner ``state <>
    'running'`` of a function's FOR UPDATE left the result alike but held the running row."""
    [job_id] = add(engine, schema, "running", unique_key="run:1")
    expr = FUNCTION_CALLS[fn][0]
    worker = make_engine(pg_dsn, application_name="t", pooled=False, session={"lock_timeout": 3000})
    try:
        with engine.connect() as conn, conn.begin():
            out = conn.execute(text(f"SELECT id FROM {quote_ident(schema)}.{expr}"),
                               {"ids": [job_id], "key": "run:1"}).all()
            assert out == []
            with worker.begin() as w:  # the admin transaction still open: a lock would time out here
                job = JobQueue(schema).heartbeat(w, ClaimedJob(job_id, "k", "default", {}, 0, 25, "w1"))
            assert job is True
    finally:
        worker.dispose()


def test_reschedule_at_now_makes_the_job_available(engine, schema, cli):
    """`reschedule --at now` is run_at = now() exactly: due, so available (and NOTIFYd) at once,
    not scheduled for the scheduler's next pass."""
    [job_id] = add(engine, schema, "scheduled", due_in=timedelta(hours=1))
    rc, out, err = cli("reschedule", str(job_id), "--at", "now")
    assert rc == 0 and "scheduled -> available" in out, out + err
    assert rows(engine, schema, [job_id])[job_id]["state"] == "available"
    [other] = add(engine, schema, "retryable", due_in=timedelta(hours=1))
    with engine.begin() as conn:
        [(state,)] = conn.execute(sql("SELECT state::text FROM {schema}.reschedule_jobs(ARRAY[CAST(:id AS bigint)], now())",
                                      schema), {"id": other}).all()
    assert state == "available"


def test_reschedule_jobs_null_priority_keeps_a_nonzero_priority(engine, schema):
    [job_id] = add(engine, schema, "scheduled", due_in=timedelta(hours=1))
    with engine.begin() as conn:
        conn.execute(sql("UPDATE {schema}.jobs SET priority = 9 WHERE id = :id", schema), {"id": job_id})
    later = datetime.now(timezone.utc) + timedelta(hours=2)
    job = call(engine, schema, "reschedule_jobs", [job_id], later, None, None, None)[job_id]
    assert (job["priority"], job["scheduled_at"], job["state"]) == (9, later, "scheduled")


def test_reschedule_jobs_to_later_notifies_nobody(pg_dsn, engine, schema):
    """Only a job made available wakes the scheduler's listeners: a job moved later does not."""
    [job_id] = add(engine, schema, "available", queue="later-q")
    listener = listen(pg_dsn, schema)
    try:
        later = datetime.now(timezone.utc) + timedelta(hours=2)
        assert set(call(engine, schema, "reschedule_jobs", [job_id], later, None, None, None)) == {job_id}
        assert drain(listener) == []
    finally:
        listener.close()


def test_retry_jobs_gives_an_available_job_at_exactly_its_attempt_limit_one_more(engine, schema):
    """attempt = max_attempts is out of attempts (the claim needs attempt < max_attempts): one more."""
    [at_limit] = add(engine, schema, "available", attempt=5, max_attempts=5)
    [below] = add(engine, schema, "available", attempt=4, max_attempts=5)
    changed = call(engine, schema, "retry_jobs", [at_limit, below])
    assert set(changed) == {at_limit}
    assert (changed[at_limit]["attempt"], changed[at_limit]["max_attempts"]) == (5, 6)


def test_retry_dry_run_predicts_nothing_for_an_available_job_at_attempt_32767(engine, schema, cli):
    """--dry-run evaluates retry_jobs' own guard: a job at attempt 32767 cannot get one more."""
    [stuck] = add(engine, schema, "available", attempt=32767, max_attempts=32767)
    [exhausted] = add(engine, schema, "available", attempt=32766, max_attempts=32766)
    data = cli_json(cli, "retry", str(stuck), str(exhausted), "--dry-run")
    assert [j["id"] for j in data["jobs"]] == [exhausted]
    assert [(j["id"], j["reason"]) for j in data["skipped_jobs"]] == [(stuck, "nothing to do: the job is available")]


def test_retry_jobs_revives_a_final_job_at_attempt_32767_without_overflow(engine, schema):
    """max_attempts is a smallint: attempt + 1 is capped at 32767, not an out-of-range error."""
    [top] = add(engine, schema, "discarded", attempt=32767, max_attempts=32767)
    [fine] = add(engine, schema, "cancelled", attempt=3, max_attempts=3)
    changed = call(engine, schema, "retry_jobs", [top, fine])
    assert {i: (j["state"], j["attempt"], j["max_attempts"]) for i, j in changed.items()} == {
        top: ("available", 32767, 32767), fine: ("available", 3, 4)}


def test_retry_jobs_notifies_the_queue_of_a_revived_keyed_final_job(pg_dsn, engine, schema):
    [keyed] = add(engine, schema, "completed", queue="keyed-q", unique_key="N")
    [plain] = add(engine, schema, "completed", queue="plain-q")
    listener = listen(pg_dsn, schema)
    try:
        assert set(call(engine, schema, "retry_jobs", [keyed, plain])) == {keyed, plain}
        assert drain(listener) == ["keyed-q", "plain-q"]
    finally:
        listener.close()


def test_retry_jobs_with_one_key_taken_still_revives_the_others_in_one_subtransaction(engine, schema):
    """A final job whose key a live job holds is left out before the UPDATE: the others go in one
    statement, not one subtransaction each (the per-job fallback is for a key taken meanwhile)."""
    with engine.begin() as conn:
        ids = [r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, state, finalized_at, unique_key)"
            " SELECT 'k', 'discarded', now(), 'one:' || g FROM generate_series(1, 100) AS g RETURNING id",
            schema))]
    add(engine, schema, "scheduled", unique_key="one:1", due_in=timedelta(hours=1))
    with engine.begin() as conn:
        changed = conn.execute(sql("SELECT count(*) FROM {schema}.retry_jobs(:ids)", schema), {"ids": ids}).scalar()
        writers = conn.execute(sql("SELECT count(DISTINCT xmin::text) FROM {schema}.jobs"
                                   " WHERE id = ANY(:ids) AND state = 'available'", schema), {"ids": ids}).scalar()
    assert changed == 99
    assert writers == 1, f"retry_jobs revived 99 keyed jobs in {writers} (sub)transactions"


def test_retry_jobs_under_a_lock_timeout_skips_a_final_job_whose_key_is_being_taken(pg_dsn, engine, schema):
    """With a lock_timeout (an operator's session, a pooler's default), the wait for an
    uncommitted enqueue of the same key ends in 55P03: that job stays final, the others change."""
    [keyed] = add(engine, schema, "cancelled", unique_key="LT")
    [other] = add(engine, schema, "cancelled")
    [other_keyed] = add(engine, schema, "cancelled", unique_key="LT2")
    admin_engine = make_engine(pg_dsn, application_name="t", pooled=False, session={"lock_timeout": 300})
    try:
        with psycopg.connect(pg_dsn) as worker:
            worker.execute(f'INSERT INTO "{schema}".jobs (kind, unique_key) VALUES (%s, %s)', ["k", "LT"])
            with admin_engine.begin() as conn:
                changed = {r[0] for r in conn.execute(sql("SELECT id FROM {schema}.retry_jobs(:ids)", schema),
                                                      {"ids": [keyed, other, other_keyed]})}
            worker.commit()
    finally:
        admin_engine.dispose()
    assert changed == {other, other_keyed}
    assert rows(engine, schema, [keyed])[keyed]["state"] == "cancelled"
    assert_invariant(engine, schema)


# What each function does to one job in each state, as the README says (None: deleted; a state
# not listed is left alone, byte for byte).
WAITING = ("available", "scheduled", "retryable")
EFFECTS: dict[str, dict[str, str | None]] = {
    "complete_jobs": {s: "completed" for s in ALL if s not in ("running", "completed")},  # any but running/completed
    "permanently_fail_jobs": {s: "discarded" for s in WAITING},  # waiting -> discarded
    "cancel_jobs": {s: "cancelled" for s in WAITING},  # waiting -> cancelled
    # anything but running -> available now (an available job already due is left as it is)
    "retry_jobs": {s: "available" for s in ALL if s not in ("running", "available")},
    "reschedule_jobs": {s: "available" for s in WAITING},  # waiting only; run_at now: available
    "delete_jobs": {s: None for s in ALL if s != "running"},  # any state but running
}


def test_every_function_keeps_the_finalized_at_invariant_from_every_state(engine, schema):
    """From each state: exactly the jobs the README says change, to the state it says, with
    finalized_at set exactly for final states; every other job (the running one first) untouched,
    byte for byte. Each function on fresh jobs of its own, so each is checked on its own."""
    for fn, effects in EFFECTS.items():
        args = {"permanently_fail_jobs": ("r",), "reschedule_jobs": (datetime.now(timezone.utc),)}.get(fn, ())
        ids = one_of_each(engine, schema)
        before = rows(engine, schema, list(ids.values()))
        changed = call(engine, schema, fn, list(ids.values()), *args)  # the CHECK constraint aborts a violation
        after = rows(engine, schema, list(ids.values()))
        assert set(changed) == {ids[s] for s in effects}, fn
        assert {s: (after[i]["state"] if i in after else None) for s, i in ids.items() if s in effects} == effects, fn
        for state, job in ids.items():
            if state not in effects:
                assert after[job] == before[job], f"{fn} touched the {state} job"
            elif job in after:
                assert (after[job]["finalized_at"] is not None) == (after[job]["state"] in FINAL_STATES), fn
        assert after[ids["running"]] == before[ids["running"]], fn
        assert_invariant(engine, schema)


def test_functions_are_schema_qualified_and_channel_follows_the_schema():
    out = migrate.offline_sql("maintd")
    assert "CREATE FUNCTION \"maintd\".retry_jobs(ids bigint[]) RETURNS SETOF \"maintd\".jobs" in out
    assert "pg_notify('maintd_jobs'" in out
    other = migrate.offline_sql("acme")
    assert "pg_notify('acme_maintd_jobs'" in other and "maintd_jobs'" not in other.replace("acme_maintd_jobs'", "")
    assert "SET search_path = pg_catalog, pg_temp" in out


def test_downgrade_drops_the_functions_and_upgrade_restores_them(pg_dsn, engine, schema):
    def present():
        with engine.connect() as conn:
            return {r[0] for r in conn.execute(text(
                "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
                " WHERE n.nspname = :s"), {"s": schema})} & ADMIN_FUNCTIONS

    assert present() == ADMIN_FUNCTIONS
    mig = make_engine(pg_dsn, application_name="t", pooled=False)
    try:
        with mig.connect() as conn:
            assert migrate.downgrade(conn, schema, "0001") == (migrate.head_revision(), "0001")
            assert present() == set()
            assert migrate.downgrade(conn, schema, "base")[1] is None  # jobs drops: nothing depends on it
            assert migrate.upgrade(conn, schema) == (None, migrate.head_revision())
    finally:
        mig.dispose()
    assert present() == ADMIN_FUNCTIONS
    job_id = add(engine, schema, "discarded")[0]
    assert set(call(engine, schema, "retry_jobs", [job_id])) == {job_id}


# ---------------------------------------------------------------- maintd jobs: list, show

def test_cli_list_filters_and_prints_a_table_or_json(engine, schema, cli):
    add(engine, schema, "available", queue="mail", kind="send", n=3)
    failed = add(engine, schema, "retryable", queue="mail", kind="send")[0]
    add(engine, schema, "completed", queue="pdf", kind="render", n=2)
    with engine.begin() as conn:
        conn.execute(sql("UPDATE {schema}.jobs SET errors = CAST(:e AS jsonb) WHERE id = :id", schema),
                     {"id": failed, "e": json.dumps([{"error": "old"}, {"error": "smtp\x1b[31m down"}])})
    rc, out, _ = cli("list", "--queue", "mail", "--limit", "3")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "STATE", "QUEUE", "KIND", "ATTEMPT", "PRIO", "SCHEDULED_AT", "LAST_ERROR"]
    assert len(lines) == 4 and lines[1].split()[:2] == [str(failed), "retryable"]  # newest first
    assert "smtp?[31m down" in lines[1] and "\x1b" not in out  # terminal escapes neutralised
    data = cli_json(cli, "list", "--state", "completed")
    assert [j["state"] for j in data] == ["completed", "completed"] and data[0]["queue"] == "pdf"
    assert cli("list", "--state", "nope")[0] == 2


def test_cli_list_ships_at_most_a_bounded_start_of_each_last_error(engine, schema, cli):
    """SPEC: `jobs list` holds O(page) in memory. A worker's error is text of any length (a stack
    trace with a payload), and the list shipped each row's last error whole, in --json too: a page
    of 1,000 jobs failed with 1 MB errors held 1 GB. The statement now ships at most
    LIST_ERROR_CHARS characters of it with its whole length (``last_error_chars``); `jobs show`
    prints it whole."""
    failed = add(engine, schema, "retryable", queue="mail", kind="send")[0]
    long_error = "Traceback " + "x" * 300_000
    with engine.begin() as conn:
        conn.execute(sql("UPDATE {schema}.jobs SET errors = CAST(:e AS jsonb) WHERE id = :id", schema),
                     {"id": failed, "e": json.dumps([{"error": long_error}])})
    with engine.connect() as conn:
        [row] = admin.list_jobs(conn, schema, admin.Filter(queue="mail"), 10)
    assert row["last_error"] == long_error[:admin.LIST_ERROR_CHARS] and row["last_error_chars"] == len(long_error)
    [listed] = cli_json(cli, "list", "--queue", "mail")
    assert len(listed["last_error"]) == admin.LIST_ERROR_CHARS and listed["last_error_chars"] == len(long_error)
    assert cli_json(cli, "show", str(failed))["errors"][-1]["error"] == long_error


def test_list_reads_keyset_pages_newest_first_without_repeats(engine, schema):
    ids = add(engine, schema, "available", queue="mail", n=7) + add(engine, schema, "completed", queue="pdf", n=4)
    mail = sorted(ids[:7], reverse=True)
    with engine.connect() as conn:
        for limit in (1, 3, 5, 6, 7, 100):
            got = [j["id"] for j in admin.iter_jobs(conn, schema, admin.Filter(queue="mail"), limit, page=3)]
            assert got == mail[:limit], limit
        everything = [j["id"] for j in admin.iter_jobs(conn, schema, admin.Filter(), 1000, page=2)]
    assert everything == sorted(ids, reverse=True)


def _listing(conn, schema, flt, limit, page):
    return [(j["id"], j) for j in admin.iter_jobs(conn, schema, flt, limit, page=page)]


def test_list_of_a_rare_queue_reads_its_jobs_not_the_whole_table(engine, schema, layout):
    """`jobs list --queue Q` without --state was one scan of the primary key newest first,
    filtered by queue: with Q rare in a big table it read every other queue's rows (to its
    statement timeout in production). Each state is now read by its own index (the queue's
    entries where the index leads by queue) and the scans merged by id: no primary-key scan. The
    rows and their order are those of the one statement over the whole table, page by page."""
    for i, state in enumerate(ALL):
        add(engine, schema, state, queue="big", n=6000, due_in=timedelta(minutes=i))
    rare = []
    for i, state in enumerate(ALL):
        rare += add(engine, schema, state, queue="rare", kind=f"k{i % 2}", n=3, due_in=timedelta(minutes=i))
        add(engine, schema, state, queue="big", n=500, due_in=timedelta(minutes=i))
    with engine.begin() as conn:
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    pkey = index_names(layout, "jobs_pkey")[0]
    for before in (None, rare[-1], rare[8]):
        for flt in (admin.Filter(queue="rare"), admin.Filter(queue="rare", kind="k1")):
            query, params = admin.list_statement(flt, before)
            with engine.begin() as conn:
                plan = explain(conn, query, schema, {**params, "limit": 1000, "error_chars": 10})
            # scheduled, retryable and running have no index leading by queue: those scans read the
            # live rows of their states (partitioned: the live partition), never a final one
            assert pkey not in plan and set(seq_scans(plan, layout)) <= {"jobs_live"}, (before, flt, plan)
            assert layout == "partitioned" or "Seq Scan" not in plan, plan
    reference = admin_queries.LIST.format(where="WHERE j.queue = :queue AND (CAST(:kind AS text) IS NULL OR j.kind = :kind)")
    with engine.connect() as conn:
        for kind in (None, "k1"):
            with conn.begin():
                want = [dict(r._mapping) for r in conn.execute(sql(reference, schema), {
                    "queue": "rare", "kind": kind, "limit": 1000, "error_chars": admin.LIST_ERROR_CHARS})]
            assert len(want) == (21 if kind is None else 9)
            for limit, page in ((1000, 1000), (5, 2), (len(want), 4), (7, 3)):
                got = list(admin.iter_jobs(conn, schema, admin.Filter(queue="rare", kind=kind), limit, page=page))
                assert got == want[:limit], (kind, limit, page)
        # a page at a time, 21 runs of one statement: psycopg prepared it, and the server planned
        # it each time with the queue known (its generic plan is the primary-key scan again)
        assert [j["id"] for j in admin.iter_jobs(conn, schema, admin.Filter(queue="rare"), 100, page=1)] == \
            sorted(rare, reverse=True)
        prepared = conn.execute(text("SELECT generic_plans, custom_plans FROM pg_prepared_statements"
                                     " WHERE statement LIKE '%UNION ALL%'")).all()
        assert prepared and all(g == 0 and c > 0 for g, c in prepared), prepared


STREAM_ROWS = 200_000


@pytest.mark.slow
def test_cli_list_memory_stays_flat_at_any_limit(pg_dsn, engine, schema, cfg):
    """Issue 28 row 7: `jobs list --limit 100000000` on 200 k rows took 401 MB RSS (650 MB with
    --json). Each run's peak RSS (ru_maxrss of the process, measured by a parent of its own) at
    an unbounded limit stays within 40 MB of a run listing 100 jobs."""
    import subprocess
    import sys

    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, args, errors) SELECT 'k.' || (g % 7), 'q', "
                         "jsonb_build_object('n', g), jsonb_build_array(jsonb_build_object('error', repeat('e', 200)))"
                         " FROM generate_series(1, :n) g", schema), {"n": STREAM_ROWS})
    measure = ("import resource, subprocess, sys\n"
               "out = open(sys.argv[1], 'wb')\n"
               "rc = subprocess.run(sys.argv[2:], stdout=out).returncode\n"
               "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")

    def peak(tmp: str, *argv: str) -> tuple[int, str]:
        res = subprocess.run([sys.executable, "-c", measure, tmp, sys.executable, "-m", "maintd", "--config", cfg,
                              "jobs", "list", *argv], capture_output=True, text=True, timeout=600)
        rc, kb = res.stdout.split()
        assert rc == "0", res.stderr
        return int(kb) // 1024, open(tmp).read()

    import tempfile
    with tempfile.TemporaryDirectory() as d:
        out = f"{d}/out"
        small, _ = peak(out, "--limit", "100", "--json")
        for fmt in ((), ("--json",)):
            big, text_out = peak(out, "--limit", "100000000", *fmt)
            listed = len(json.loads(text_out)) if fmt else len(text_out.splitlines()) - 1
            assert listed == STREAM_ROWS
            print(f"jobs list {' '.join(fmt) or '(text)'}: peak RSS {small} MB at --limit 100, "
                  f"{big} MB at --limit 100000000 ({STREAM_ROWS:,} rows)")
            assert big < small + 40, (fmt, small, big)


def test_cli_show_prints_args_metadata_errors(engine, schema, cli):
    with engine.begin() as conn:
        job_id = JobQueue(schema).enqueue(conn, "send", {"to": "a@b"}, queue="mail", metadata={"m": 1})
    rc, out, _ = cli("show", str(job_id))
    assert rc == 0 and f"id:           {job_id}" in out and '"to": "a@b"' in out and "queue:        mail" in out
    data = cli_json(cli, "show", str(job_id))
    assert data["args"] == {"to": "a@b"} and data["metadata"] == {"m": 1} and data["errors"] == []
    rc, _, err = cli("show", "999999999")
    assert rc == 1 and "maintd jobs: error: no job 999999999" in err  # as the README and the actions say


def test_cli_show_prints_long_values_whole_and_escaped(engine, schema, cli):
    """`show` cut kind, queue, unique_key and attempted_by at 48 characters as the list's cells
    ("report:customer-000000000000000000000000001:2..."): the operator could not copy the key for
    remove_job, nor tell two such jobs apart. Whole now, control characters still neutralised."""
    key = "report:customer-" + "0" * 60 + "1:2026-11"
    kind = "billing.invoices.regenerate_for_" + "x" * 80
    with engine.begin() as conn:
        job_id = JobQueue(schema).enqueue(conn, kind, queue="q\x1b[31m\nred", unique_key=key)
    rc, out, err = cli("show", str(job_id))
    assert rc == 0, err
    assert f"unique_key:   {key}\n" in out and f"kind:         {kind}\n" in out, out
    assert "\x1b" not in out and "queue:        q?[31m?red\n" in out, out


# ---------------------------------------------------------------- maintd jobs: actions

def test_cli_cancel_by_ids_reports_changed_and_skipped(engine, schema, cli):
    ids = one_of_each(engine, schema)
    before = rows(engine, schema)
    rc, out, err = cli("cancel", *map(str, ids.values()), "424242")
    assert rc == 1 and "no job 424242 (deleted by the cleaner, or never there)" in err  # a missing id fails
    assert out.startswith("3 jobs cancelled:")
    assert f"{ids['scheduled']}" in out and "scheduled -> cancelled" in out
    assert "5 jobs skipped:" in out and "running: maintd never touches a running job" in out
    assert "424242" in out and "not found" in out and "nothing to do: the job is completed" in out
    after = rows(engine, schema)
    assert after[ids["running"]] == before[ids["running"]]
    assert {after[ids[s]]["state"] for s in IDLE} == {"cancelled"}


def test_cli_json_report_parses_and_lists_everything(engine, schema, cli):
    ids = one_of_each(engine, schema)
    data = cli_json(cli, "discard", *map(str, ids.values()), "--reason", "operator: bad input")
    assert data["action"] == "discard" and data["dry_run"] is False
    assert data["changed"] == 3 and data["skipped"] == 4 and data["batches"] == 1
    assert {j["id"] for j in data["jobs"]} == {ids[s] for s in IDLE}
    assert {j["to"] for j in data["jobs"]} == {"discarded"}
    assert {s["id"]: s["state"] for s in data["skipped_jobs"]} == {
        ids[s]: s for s in ("running", *FINAL_STATES)}
    errors = rows(engine, schema, [ids["available"]])[ids["available"]]["errors"]
    assert errors[-1]["error"] == "operator: bad input"


def test_cli_retry_and_delete(engine, schema, cli):
    dead = add(engine, schema, "discarded", attempt=25, max_attempts=25, n=2)
    running = add(engine, schema, "running")[0]
    data = cli_json(cli, "retry", *map(str, dead + [running]))
    assert {j["id"] for j in data["jobs"]} == set(dead)
    assert [s["id"] for s in data["skipped_jobs"]] == [running]
    assert {j["state"] for j in rows(engine, schema, dead).values()} == {"available"}
    data = cli_json(cli, "delete", "--state", "available")
    assert data["changed"] == 2 and set(rows(engine, schema)) == {running}


def test_cli_reschedule(engine, schema, cli):
    waiting = add(engine, schema, "available", n=2)
    final = add(engine, schema, "completed")[0]
    rc, out, _ = cli("reschedule", *map(str, waiting + [final]), "--at", "+2h", "--priority", "5",
                     "--max-attempts", "3")
    assert rc == 0 and "2 jobs rescheduled:" in out and "available -> scheduled" in out
    after = rows(engine, schema)
    for job_id in waiting:
        job = after[job_id]
        assert (job["state"], job["priority"], job["max_attempts"]) == ("scheduled", 5, 3)
        delta = job["scheduled_at"] - datetime.now(timezone.utc)
        assert timedelta(hours=1, minutes=50) < delta <= timedelta(hours=2)
    assert after[final]["state"] == "completed"
    data = cli_json(cli, "reschedule", str(waiting[0]), "--at", "2020-01-01T00:00:00")
    assert data["jobs"][0]["to"] == "available"
    assert rows(engine, schema, [waiting[0]])[waiting[0]]["scheduled_at"] == datetime(2020, 1, 1, tzinfo=timezone.utc)
    assert cli_json(cli, "reschedule", str(waiting[1]), "--at", "now")["jobs"][0]["to"] == "available"


@pytest.mark.parametrize("argv", [
    ("cancel",),  # neither ids nor a filter
    ("cancel", "1", "--queue", "q"),  # both
    ("retry", "--state", "bogus"),
    ("delete", "--queue", "q", "--batch-size", "0"),
    ("reschedule", "1", "--at", "tomorrow-ish"),
    ("reschedule", "1", "--at", "now", "--priority", "40000"),
    ("list", "--limit", "0"),
    ("delete", "--state", "completed", "--batch-size", "1000001"),
])
def test_cli_usage_errors_exit_2(cli, argv):
    rc, out, err = cli(*argv)
    assert rc == 2 and out == "" and "error" in err


@pytest.mark.parametrize("action", ["retry", "cancel", "discard", "delete"])
def test_a_state_the_action_never_changes_is_a_usage_error(cli, engine, schema, action):
    """`jobs cancel --state completed` printed '0 jobs cancelled' and exit 0: an operator read it
    as nothing to do, not as a command that can never do anything. A state the action never
    changes is now refused (exit 2) naming the states it changes; running is still read, its
    jobs listed as skipped with the reason, and every other state is taken."""
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, finalized_at) VALUES "
                         "('k', 'completed', now()), ('k', 'cancelled', now()), ('k', 'discarded', now())", schema))
    never = {"cancel": FINAL_STATES, "discard": FINAL_STATES}.get(action, ())
    for state in JOB_STATES:
        rc, out, err = cli(action, "--state", state, "--dry-run")
        if state in never:
            assert rc == 2 and out == "", (state, out, err)
            assert f"--state {state}: {action} changes only available, scheduled or retryable jobs" in err, err
        else:
            assert rc == 0 and not err, (state, err)
    with engine.connect() as conn:
        assert conn.execute(sql("SELECT count(*) FROM {schema}.jobs", schema)).scalar() == 3


def test_cli_argparse_errors_exit_2(cli, capsys):
    with pytest.raises(SystemExit) as exc:
        cli("reschedule", "1")  # --at is required
    assert exc.value.code == 2
    # Issue 28 row 12: an id out of bigint's range was "bigint out of range", exit 1.
    for argv in (("retry", "99999999999999999999"), ("show", "0"), ("cancel", "12a")):
        with pytest.raises(SystemExit) as exc:
            cli(*argv)
        assert exc.value.code == 2, argv
        err = capsys.readouterr().err
        assert "argument ID: job id" in err and ("out of range" in err or "not a whole number" in err), err


def test_cli_help_of_each_action_tells_how_it_selects_jobs(capsys):
    """Issue 28: `jobs reschedule --help` said "by ids, or by filters" but takes ids only."""
    for action in ("retry", "cancel", "discard", "delete", "reschedule"):
        with pytest.raises(SystemExit):
            main(["jobs", action, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        takes_filters = "--state STATE" in text
        assert takes_filters == (action != "reschedule")
        assert ("by ids only (no filters)" in text) == (not takes_filters), (action, text)
        assert ("or by filters (--state, --queue, --kind" in text) == takes_filters, (action, text)


def test_cli_action_on_ids_that_do_not_exist_exits_1_and_names_them(engine, schema, cli):
    """Issue 28: `jobs retry 999999` (no such job) exited 0; "prints what it changed" (SPEC 7.5)
    must not hide that nothing was there to change."""
    (job,) = add(engine, schema, "discarded")
    rc, out, err = cli("retry", "999999", str(job))
    assert rc == 1 and "1 job retried" in out and "no job 999999" in err
    data = json.loads(cli("retry", "999998", "--json")[1])
    assert data["not_found"] == 1 and data["changed"] == 0
    assert cli("retry", str(job))[0] == 0  # found (and skipped: nothing to do: the job is available)


def test_cli_on_a_schema_without_the_functions_exits_1(pg_dsn, schema, cli):
    mig = make_engine(pg_dsn, application_name="t", pooled=False)
    with mig.connect() as conn:
        migrate.downgrade(conn, schema, "0001")
    mig.dispose()
    rc, _, err = cli("cancel", "1")
    assert rc == 1 and "maintd migrate" in err


@pytest.mark.parametrize("action", ["retry", "cancel", "discard", "delete", "reschedule"])
def test_dry_run_changes_nothing_and_predicts_exactly_what_the_run_changes(engine, schema, cli, action):
    ids = list(one_of_each(engine, schema).values())
    ids += list(one_of_each(engine, schema, queue="other", due_in=timedelta(hours=1)).values())
    ids += add(engine, schema, "discarded", unique_key="u")  # retry: key free, revived
    add(engine, schema, "scheduled", unique_key="v", due_in=timedelta(hours=1))
    ids += add(engine, schema, "cancelled", unique_key="v")  # retry: key taken, skipped
    extra = ("--at", "+1h") if action == "reschedule" else ()
    digest = table_digest(engine, schema)
    dry = cli_json(cli, action, *map(str, ids), *extra, "--dry-run")
    assert table_digest(engine, schema) == digest
    real = cli_json(cli, action, *map(str, ids), *extra)
    assert dry["dry_run"] is True and dry["changed"] > 0
    assert [(j["id"], j["to"]) for j in dry["jobs"]] == [(j["id"], j["to"]) for j in real["jobs"]]
    assert [s["id"] for s in dry["skipped_jobs"]] == [s["id"] for s in real["skipped_jobs"]]
    assert table_digest(engine, schema) != digest
    if action != "reschedule":  # filters too (reschedule takes ids only)
        digest = table_digest(engine, schema)
        rc, out, _ = cli(action, "--queue", "other", "--dry-run")
        assert rc == 0 and "(dry run: nothing changed)" in out
        assert table_digest(engine, schema) == digest


def test_filter_works_in_batches_of_short_transactions(pg_dsn, engine, schema, cli):
    """5,000 jobs cancelled by filter with --batch-size 700: eight transactions (one xmin per
    batch on the changed rows), none larger than a batch; running ones reported as skipped."""
    add(engine, schema, "available", queue="bulk", n=3000)
    add(engine, schema, "scheduled", queue="bulk", n=2000, due_in=timedelta(hours=1))
    running = add(engine, schema, "running", queue="bulk", n=3)
    other = add(engine, schema, "available", queue="keep", n=10)
    data = cli_json(cli, "cancel", "--queue", "bulk", "--batch-size", "700")
    assert data["changed"] == 5000 and data["skipped"] == 3
    assert sorted(s["id"] for s in data["skipped_jobs"]) == running
    assert data["batches"] == 8  # ceil(5003 / 700)
    with engine.connect() as conn:
        per_tx = [r[0] for r in conn.execute(sql(
            "SELECT count(*) FROM {schema}.jobs WHERE state = 'cancelled' GROUP BY xmin::text", schema))]
    assert len(per_tx) == 8 and max(per_tx) <= 700
    states = {j["state"] for j in rows(engine, schema, other + running).values()}
    assert states == {"available", "running"}


def test_filter_by_state_walks_the_index_keyset_without_repeats(engine, schema, cli):
    add(engine, schema, "discarded", queue="a", n=1200)
    add(engine, schema, "discarded", queue="b", n=5)
    add(engine, schema, "completed", queue="a", n=7)
    data = cli_json(cli, "retry", "--state", "discarded", "--queue", "a", "--batch-size", "250")
    assert data["changed"] == 1200 and data["batches"] == 5
    assert len({j["id"] for j in data["jobs"]}) == 1200
    counts = {}
    for job in rows(engine, schema).values():
        counts[(job["queue"], job["state"])] = counts.get((job["queue"], job["state"]), 0) + 1
    assert counts == {("a", "available"): 1200, ("b", "discarded"): 5, ("a", "completed"): 7}


def test_cli_failure_after_committed_batches_still_reports_what_changed(engine, schema, cli):
    """A batch that fails (here a trigger refusing one job; in production a statement timeout, a
    lost connection) after earlier batches committed: the command printed only the error, so the
    operator could not tell that jobs had been cancelled. The committed batches are reported,
    then the error, exit 1."""
    first, second = add(engine, schema, "available", queue="q", n=2)
    [poison] = add(engine, schema, "available", queue="q", kind="poison")
    with engine.begin() as conn:
        conn.execute(sql(
            "CREATE FUNCTION {schema}.refuse() RETURNS trigger LANGUAGE plpgsql AS"
            " $$BEGIN RAISE EXCEPTION 'refused job %', NEW.id; END$$;"
            " CREATE TRIGGER refuse BEFORE UPDATE ON {schema}.jobs FOR EACH ROW"
            " WHEN (OLD.kind = 'poison') EXECUTE FUNCTION {schema}.refuse()", schema))
    rc, out, err = cli("cancel", str(first), str(second), str(poison), "--batch-size", "2")
    assert rc == 1 and f"refused job {poison}" in err, (rc, out, err)
    assert "2 jobs cancelled" in out, out + err
    assert {j["state"] for j in rows(engine, schema, [first, second]).values()} == {"cancelled"}
    rc, out, err = cli("cancel", str(poison), "--json")
    data = json.loads(out)
    assert rc == 1 and data["changed"] == 0 and "refused job" in data["error"], out + err


def test_cli_race_with_a_worker_completing_the_job_meanwhile(pg_dsn, engine, schema, cli):
    """The worker claims and completes a job in one open transaction (holding the row lock) while
    the operator cancels it: the CLI does not wait, reports it skipped as locked, and after the
    worker commits the job is completed, not cancelled."""
    job_id = add(engine, schema, "available", queue="race")[0]
    other = add(engine, schema, "available", queue="race")[0]
    q = JobQueue(schema)
    with engine.connect() as worker:  # one open transaction until commit
        [job] = q.claim(worker, "race", "w9")
        assert job.id == job_id and q.complete(worker, job)
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(json=cli_json(cli, "cancel", str(job_id), str(other))))
        started = time.monotonic()
        thread.start()
        thread.join(timeout=20)
        assert not thread.is_alive(), "the admin command waited for the worker's row lock"
        assert time.monotonic() - started < 15
        worker.commit()
    data = result["json"]
    assert [j["id"] for j in data["jobs"]] == [other]
    [skipped] = data["skipped_jobs"]
    assert skipped["id"] == job_id and skipped["reason"].startswith("locked by another transaction")
    assert rows(engine, schema, [job_id])[job_id]["state"] == "completed"


# ---------------------------------------------------------------- plans

def _plan_params(state):
    return {"queue": "q1", "kind": None, "limit": 1000, "reason": None, "at": None, "offset": None,
            "began": datetime.now(timezone.utc), "upto": 2 ** 62,
            "k0": "q1" if state == "available" else (datetime.now(timezone.utc) if state else 10),
            "k1": 0 if state == "available" else 10, "k2": datetime.now(timezone.utc), "k3": 10}


# A queue without a state (None) expected jobs_pkey: the one walk of the whole table by id that was
# the defect (with the queue rare, a batch read every other queue's rows). Each state is now read by
# its own index or, the queue being common (q1 is a third of the table here), by the primary key
# stopped at :limit matches, as the planner costs it: no one index is expected.
# test_a_filter_on_a_rare_queue_reads_its_jobs_not_the_whole_table pins the rare queue's reads.
EXPECTED_INDEX = {None: None, "available": "jobs_fetch_idx", "scheduled": "jobs_scheduled_idx",
                  "retryable": "jobs_scheduled_idx", "discarded": "jobs_finalized_queue_idx",
                  "completed": "jobs_finalized_queue_idx", "cancelled": "jobs_finalized_queue_idx"}


def test_filter_batches_are_index_backed(engine, schema, layout):
    """EXPLAIN of each filter batch query (first and next batch, custom and generic plans) on
    60,000 jobs: the state's partial index (a queue without a state: see EXPECTED_INDEX), never a
    sequential scan."""
    for i, state in enumerate(ALL):
        add(engine, schema, state, queue=f"q{i % 3}", n=8000, due_in=timedelta(minutes=i))
    add(engine, schema, "discarded", queue="q1", n=4000)
    with engine.begin() as conn:
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    for state, index in EXPECTED_INDEX.items():
        action = admin.ACTIONS["delete" if state in FINAL_STATES or state is None else "cancel"]
        for first in (True, False):
            query = admin.filter_query(action, admin.Filter(state=state, queue="q1"), first=first)
            for generic in (False, True):
                with engine.begin() as conn:
                    plan = explain(conn, query, schema, _plan_params(state), generic=generic)
                assert not seq_scans(plan, layout), plan
                assert index is None or index_names(layout, index)[0] in plan, (state, first, generic, plan)


FILTER_ACTIONS = ("cancel", "discard", "delete", "retry")


def test_a_filter_on_a_rare_queue_reads_its_jobs_not_the_whole_table(engine, schema, layout):
    """`maintd jobs cancel|discard|delete|retry --queue Q` without --state walked the primary key
    by id, filtered by queue: with Q rare in a big table one batch read every other queue's rows
    until it had --batch-size matches (to its statement timeout in production). Each state the
    action can touch (and running, reported) is now read by its own index and the reads merged by
    id: no primary-key scan. Every batch is planned with the queue known (no generic plan)."""
    rare = []
    for i, state in enumerate(ALL):
        rare += add(engine, schema, state, queue="rare", kind=f"k{i % 2}", n=3, due_in=timedelta(minutes=i))
        add(engine, schema, state, queue="big", n=500, due_in=timedelta(minutes=i))
    for i, state in enumerate(ALL):  # after the rare jobs: every batch's id range holds them
        add(engine, schema, state, queue="big", n=6000, due_in=timedelta(minutes=i))
    with engine.begin() as conn:
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    pkey = index_names(layout, "jobs_pkey")[0]
    params = {**_plan_params(None), "queue": "rare", "k0": rare[4]}
    for name in FILTER_ACTIONS:
        for flt in (admin.Filter(queue="rare"), admin.Filter(queue="rare", kind="k1")):
            for first in (True, False):
                query = admin.filter_query(admin.ACTIONS[name], flt, first=first)
                with engine.begin() as conn:
                    plan = explain(conn, query, schema, {**params, "kind": flt.kind})
                # scheduled, retryable and running have no index leading by queue: those reads take
                # the live rows of their states (partitioned: the live partition), never a final one
                assert pkey not in plan and set(seq_scans(plan, layout)) <= {"jobs_live"}, (name, flt, first, plan)
                assert layout == "partitioned" or "Seq Scan" not in plan, (name, flt, first, plan)
                if name in ("cancel", "discard"):  # live jobs only: no final state is read
                    assert not re.search(r"finalized|jobs_(completed|cancelled|discarded)", plan), (name, plan)
    with engine.connect() as conn:  # one batch per job, on one connection: psycopg prepares the batch
        report = admin.run_action(conn, schema, "delete", flt=admin.Filter(queue="rare"), batch_size=1)
        prepared = conn.execute(text("SELECT generic_plans, custom_plans FROM pg_prepared_statements"
                                     " WHERE statement LIKE '%UNION ALL%'")).all()
    assert report.batches == len(rare) and report.changed_count == len(rare) - 3
    assert prepared and all(g == 0 and c > 0 for g, c in prepared), prepared


def _rare_queue_jobs(engine, schema):
    """Jobs of queue 'rare' in every state (kinds k0, k1), interleaved by id with another queue's;
    available ones due (retry leaves those with attempts left) and not due; a final one whose
    unique_key a live job of the other queue holds (retry leaves it)."""
    for round_ in range(3):
        for i, state in enumerate(ALL):
            add(engine, schema, state, queue="rare", kind=f"k{(i + round_) % 2}", due_in=timedelta(hours=round_))
            add(engine, schema, state, queue="big", n=2, due_in=timedelta(hours=round_))
    add(engine, schema, "scheduled", queue="big", unique_key="held", due_in=timedelta(hours=1))
    add(engine, schema, "cancelled", queue="rare", kind="k1", unique_key="held")
    return rows(engine, schema)


def _acts_on(name, job, now):
    """Whether the action changes this job (the functions' rules, written out)."""
    if job["state"] == "running":
        return False
    if name in ("cancel", "discard"):
        return job["state"] in IDLE
    if name == "delete":
        return True
    if job["state"] == "available" and job["scheduled_at"] <= now:
        return False  # retry: due, attempts left
    return not (job["state"] in FINAL_STATES and job["unique_key"] == "held")


@pytest.mark.parametrize("batch", [1, 4, 1000])
@pytest.mark.parametrize("name", FILTER_ACTIONS)
def test_a_filter_on_a_queue_acts_on_exactly_its_jobs_in_id_order(engine, schema, cli, name, batch):
    """`jobs <action> --queue rare` (and with --kind) without --state: every job of the queue the
    action applies to is changed, in id order, batch after batch; its running jobs are reported as
    skipped; no other job is touched or reported (one read per state, merged by id)."""
    before = _rare_queue_jobs(engine, schema)
    with engine.connect() as conn:
        now = conn.execute(text("SELECT now()")).scalar()
    kind = "k1" if batch == 4 else None
    picked = {i: j for i, j in before.items() if j["queue"] == "rare" and kind in (None, j["kind"])}
    changed = sorted(i for i, j in picked.items() if _acts_on(name, j, now))
    running = sorted(i for i, j in picked.items() if j["state"] == "running")
    extra = ("--kind", kind) if kind else ()
    data = cli_json(cli, name, "--queue", "rare", *extra, "--batch-size", str(batch))
    assert [j["id"] for j in data["jobs"]] == changed, data["jobs"]
    assert [s["id"] for s in data["skipped_jobs"]] == running, data["skipped_jobs"]
    assert data["batches"] == -(-(len(changed) + len(running)) // batch)
    after = rows(engine, schema)
    to = {"cancel": "cancelled", "discard": "discarded", "retry": "available"}
    for i, job in before.items():
        if i in changed:
            assert (after[i]["state"] if i in after else "deleted") == to.get(name, "deleted"), (i, job)
        else:
            assert after[i] == job, (i, job)


def test_jobs_with_times_no_python_value_holds_are_listed_shown_and_acted_on(cli, engine, schema):
    """The README's enqueue takes scheduled_at = 'infinity', and SPEC 7.3 names such rows: the
    operator's tool failed exactly on them ('timestamp too large', exit 1), for list (its --json
    cut off after '['), show, and every filter whose keyset holds a time. They load as
    PostgreSQL's text now, shown as is and walked past by the keysets."""
    with engine.begin() as conn:
        ids = [r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, queue, state, scheduled_at, finalized_at) VALUES "
            "('k', 'q', 'scheduled', 'infinity', NULL), ('k', 'q', 'scheduled', now() + interval '1 hour', NULL), "
            "('k', 'q', 'available', '-infinity', NULL), ('k', 'q', 'available', now(), NULL), "
            "('k', 'q', 'cancelled', now(), 'infinity'), ('k', 'q', 'cancelled', now(), '0044-03-15 BC') "
            "RETURNING id", schema))]
    rc, out, err = cli("list")
    assert rc == 0 and "infinity" in out and "-infinity" in out, err
    listed = cli_json(cli, "list")
    assert sorted(j["id"] for j in listed) == sorted(ids)
    assert {j["scheduled_at"] for j in listed if j["id"] in ids[:1]} == {"infinity"}
    rc, out, err = cli("show", str(ids[0]))
    assert rc == 0 and "infinity" in out, err
    rc, out, err = cli("cancel", "--state", "scheduled", "--batch-size", "1")
    assert rc == 0, err
    rc, out, err = cli("cancel", "--state", "available", "--queue", "q", "--batch-size", "1")
    assert rc == 0, err
    rc, out, err = cli("delete", "--state", "cancelled", "--batch-size", "1")
    assert rc == 0, err
    with engine.connect() as conn:
        assert conn.execute(sql("SELECT count(*) FROM {schema}.jobs", schema)).scalar() == 0


# JSON PostgreSQL takes and Python's json cannot load: nested past its recursion limit, an integer
# of over 4,300 digits. Sources: Python docs, "Integer string conversion length limitation"
# (stdtypes.html#int-max-str-digits: the default limit is 4300 digits, json.loads included) and
# sys.getrecursionlimit(); PostgreSQL docs, "JSON Types" (datatype-json.html: jsonb stores numbers
# as numeric, whose range is up to 131072 digits before the decimal point, datatype-numeric.html).
UNLOADABLE_JSON = {"nested 3000 deep": "[" * 3000 + "]" * 3000, "a 5001-digit number": '{"n": 1e5000}'}


@pytest.mark.parametrize("column", ["args", "metadata", "errors"])
@pytest.mark.parametrize("value", UNLOADABLE_JSON)
def test_a_job_whose_json_python_cannot_load_is_shown(cli, engine, schema, column, value):
    """`maintd jobs show` exited 1 ('maximum recursion depth exceeded while decoding a JSON array',
    'Exceeds the limit (4300 digits) for integer string conversion') on such a job, the one the
    operator wants to look at. Its other columns are shown, that value as its text."""
    odd = UNLOADABLE_JSON[value]
    with engine.begin() as conn:
        job_id = conn.execute(sql(f"INSERT INTO {{schema}}.jobs (kind, state, {column}) "
                                  "VALUES ('poison', 'available', CAST(:v AS jsonb)) RETURNING id", schema),
                              {"v": f"[{odd}]" if column == "errors" else odd}).scalar()
    rc, out, err = cli("show", str(job_id))
    assert rc == 0 and "poison" in out and ("1" + "0" * 100 if "digit" in value else "[[[[") in out, err
    data = cli_json(cli, "show", str(job_id))
    assert data["kind"] == "poison" and isinstance(data[column], str), data[column][:100]


@pytest.mark.parametrize("select", [("--batch-size", "1"), ("--state", "cancelled", "--batch-size", "1")])
def test_retry_dry_run_across_batches_predicts_one_revival_per_unique_key(engine, schema, cli, select):
    """Final jobs sharing a unique_key in different batches: the first batch revives one, and the
    key is then held by a live job, so the next batch's is skipped. --dry-run changes nothing, so
    each batch predicted its own revival: "2 jobs would be retried", then 1 was."""
    twins = add(engine, schema, "cancelled", unique_key="K", n=2)
    ids = list(map(str, twins)) if "--state" not in select else []
    rc, out, err = cli("retry", *ids, *select, "--dry-run")
    assert rc == 0 and "1 job would be retried" in out, out + err
    rc, out, err = cli("retry", *ids, *select)
    assert rc == 0 and "1 job retried" in out, out + err


@pytest.mark.parametrize("state", ["discarded", "retryable"])
def test_cli_retry_by_state_ends_while_workers_fail_the_retried_jobs_again(engine, schema, cli, state):
    """`retry --state discarded` walks (finalized_at, id), `--state retryable` (scheduled_at, id).
    A worker that fails a retried job again puts it back in that state at a later key, ahead of
    the walk: the walk met it again and retried it again, and the command ran as long as the
    workers kept failing the jobs. It now acts on the jobs no worker attempted since it began."""
    ids = add(engine, schema, state, n=40, attempt=1, max_attempts=1 if state == "discarded" else 25)
    stop = threading.Event()

    def worker() -> None:  # claims every job made available and fails it at once
        queue = JobQueue(schema)
        while not stop.is_set():
            with engine.begin() as conn:
                for job in queue.claim(conn, "default", "w-fail", limit=10):
                    queue.fail(conn, job, "boom", discard=state == "discarded")

    failing = threading.Thread(target=worker, daemon=True)
    failing.start()
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(out=cli(
        "retry", "--state", state, "--batch-size", "1", "--json")), daemon=True)
    try:
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive(), f"`maintd jobs retry --state {state}` did not end"
    finally:
        stop.set()
        # before the schema goes: a claim after the drop failed the next test ("jobs does not exist")
        failing.join(timeout=30)
    rc, out, err = result["out"]
    data = json.loads(out)
    assert rc == 0 and data["changed"] == len(ids), out[:2000] + err
    assert sorted(j["id"] for j in data["jobs"]) == ids


def test_cli_cancel_by_queue_ends_while_producers_enqueue_into_that_queue(engine, schema, cli):
    """A filter without ``--state`` walks the primary key, and jobs enqueued after the command
    began get higher ids, ahead of the walk: `cancel --queue q` cancelled them too and ended only
    when a batch came back short, never while producers outpaced it. It now acts on the jobs that
    existed when it began (the highest id read once, at the start)."""
    ids = add(engine, schema, queue="q", n=30)
    stop = threading.Event()

    def producer() -> None:
        while not stop.is_set():
            add(engine, schema, queue="q", n=5)

    producing = threading.Thread(target=producer, daemon=True)
    producing.start()
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(out=cli(
        "cancel", "--queue", "q", "--batch-size", "1", "--json")), daemon=True)
    try:
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive(), "`maintd jobs cancel --queue q` did not end"
    finally:
        stop.set()
        producing.join(timeout=30)  # before the schema goes (see above)
    rc, out, err = result["out"]
    data = json.loads(out)
    assert rc == 0, out[:2000] + err
    # Every job up to the highest id when it began (the producer's first ones too), none after.
    now = rows(engine, schema)
    upto = max(i for i, r in now.items() if r["state"] == "cancelled")
    assert set(ids) <= {i for i, r in now.items() if r["state"] == "cancelled"}
    assert {r["state"] for i, r in now.items() if i <= upto} == {"cancelled"}
    assert data["changed"] == sum(1 for i in now if i <= upto)
    later = [r for i, r in now.items() if i > upto]
    assert later and {r["state"] for r in later} == {"available"}


def test_a_reschedule_that_keeps_the_run_time_is_predicted_as_the_function_changes_it(engine, schema):
    """Python API: ``reschedule`` with neither ``at`` nor ``offset`` keeps each job's run time (the
    function's NULL keeps a field). The dry run took the NULL time as never due and predicted
    'scheduled' for a due job the function makes available."""
    due = add(engine, schema, "scheduled", due_in=timedelta(minutes=-5))
    later = add(engine, schema, "scheduled", due_in=timedelta(hours=1))
    predicted, done = {}, {}
    for dry_run, out in ((True, predicted), (False, done)):
        with engine.connect() as conn:
            report = admin.run_action(conn, schema, "reschedule", ids=due + later, params={"priority": 3},
                                      dry_run=dry_run)
        out.update({j["id"]: j["to"] for j in report.changed})
    assert predicted == done == {due[0]: "available", later[0]: "scheduled"}


def test_a_reschedule_by_filter_is_refused_in_the_python_api_as_in_the_cli(engine, schema):
    """``maintd jobs reschedule`` takes ids only. The Python API accepted a filter: with a relative
    ``offset`` and ``state=scheduled``, each batch moved the jobs it changed ahead of the walk's
    position, and the walk met them again and again: it never ended. Refused, as the CLI does,
    and nothing is changed."""
    ids = add(engine, schema, "scheduled", due_in=timedelta(minutes=5))
    with engine.connect() as conn, pytest.raises(admin.UsageError, match="reschedule takes job ids"):
        admin.run_action(conn, schema, "reschedule", flt=admin.Filter(state="scheduled"),
                         params={"offset": timedelta(hours=1)})
    with engine.connect() as conn:
        assert conn.execute(sql("SELECT count(*) FROM {schema}.jobs WHERE id = ANY(:ids) AND scheduled_at > now() + "
                                "interval '10 minutes'", schema), {"ids": ids}).scalar() == 0


@pytest.mark.parametrize("action, state, meanwhile", [
    ("delete", "discarded", "retry_jobs"),  # revived meanwhile: a live job again
    ("delete", "completed", "retry_jobs"),
    ("discard", "retryable", "reschedule_now"),  # available meanwhile, not the retryable one asked for
])
def test_a_filter_never_acts_on_a_job_that_left_the_filter_between_read_and_write(
        engine, schema, cli, monkeypatch, action, state, meanwhile):
    """A filter's batch read the matching jobs, then called the admin function with their ids;
    the function checks only its own states, not the filter. A job that left the filter in
    between (another operator's retry_jobs committed meanwhile) was acted on as it was then:
    `maintd jobs delete --state discarded` deleted a job just revived to available, a live job
    lost. Such a job is skipped, reported as changed meanwhile, and kept."""
    [moved] = add(engine, schema, state, queue="race")
    [stays] = add(engine, schema, state, queue="race")
    original = admin.apply_batch

    def racing(conn, schema_, action_, found, *args, **kw):
        with engine.begin() as other:  # another session, committed before the function runs
            if meanwhile == "retry_jobs":
                other.execute(text(f"SELECT 1 FROM {quote_ident(schema)}.retry_jobs(ARRAY[{moved}]::bigint[])"))
            else:
                other.execute(text(f"SELECT 1 FROM {quote_ident(schema)}.reschedule_jobs("
                                   f"ARRAY[{moved}]::bigint[], run_at => now())"))
        return original(conn, schema_, action_, found, *args, **kw)

    monkeypatch.setattr(admin, "apply_batch", racing)
    data = cli_json(cli, action, "--state", state, "--queue", "race")
    after = rows(engine, schema, [moved, stays])
    assert moved in after and after[moved]["state"] == "available", after.get(moved)
    assert [j["id"] for j in data["jobs"]] == [stays]
    [skipped] = data["skipped_jobs"]
    assert skipped["id"] == moved and skipped["reason"] == "changed meanwhile: now available", skipped


def test_a_filter_batch_never_holds_a_running_job_locked(engine, schema, cli, monkeypatch):
    """The filter's re-check locks the batch's rows for the function; a running job (reported
    as skipped) is never one of them: the worker's heartbeat or completion must not wait for an
    operator's batch."""
    [running] = add(engine, schema, "running", queue="busy")
    add(engine, schema, "available", queue="busy")
    seen = []
    original = admin.skip_reason

    def probing(action, row, now_state, revived):  # inside the batch's transaction, after the call
        if row.id == running:
            with engine.connect() as worker:
                worker.execute(text("SET lock_timeout = '100ms'"))
                seen.append(worker.execute(sql("UPDATE {schema}.jobs SET heartbeat_at = now()"
                                               " WHERE id = :id RETURNING id", schema), {"id": running}).scalar())
                worker.rollback()
        return original(action, row, now_state, revived)

    monkeypatch.setattr(admin, "skip_reason", probing)
    data = cli_json(cli, "cancel", "--queue", "busy")
    assert data["changed"] == 1 and [s["id"] for s in data["skipped_jobs"]] == [running]
    assert seen == [running]


@pytest.mark.parametrize("argv, option", [
    (("list", "--queue", "mail\udcff"), "--queue"),
    (("cancel", "--kind", "\udce9t\udce9", "--dry-run"), "--kind"),
    (("delete", "--state", "completed", "--queue", "q\udcc3"), "--queue"),
    (("discard", "7", "--reason", "upstream \udcff gone"), "--reason"),
])
def test_cli_text_that_is_not_utf8_is_a_usage_error_naming_the_option(cli, engine, schema, argv, option):
    """Bytes that are not UTF-8 in an argument (a queue name copied from a log in Latin-1) reach
    Python as lone surrogates: the command failed at the database call with exit 1 and "'utf-8'
    codec can't encode character '\\udcff' in position 4: surrogates not allowed", naming no
    option. It is bad usage (exit 2), said before any connection, naming the option and its bytes."""
    [job] = add(engine, schema, "available", queue="mail")
    rc, out, err = cli(*argv)
    assert rc == 2, (rc, out, err)
    assert f"maintd jobs: error: {option} " in err and "not UTF-8" in err and "\\x" in err, err
    assert rows(engine, schema, [job])[job]["state"] == "available"
