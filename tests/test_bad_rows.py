"""Bad rows never stop a service (issue 13, SPEC 7.3).

Rows a worker, an import or an operator's UPDATE can leave behind: timestamps at ``'infinity'``,
``'-infinity'``, past year 9999 or before year 1 (Python's ``datetime`` cannot hold any of them),
``attempted_at`` NULL on a running job, an attempt counter at the top of its smallint. The odd
times are PostgreSQL's own: the special values ``infinity`` and ``-infinity`` and the range of
``timestamptz`` (4713 BC to 294276 AD), from the PostgreSQL documentation, "Date/Time Types",
section 8.5.1.4 "Special Values" and Table 8.9 (datatype-datetime.html); Python's ``datetime``
holds years 1 to 9999 only (``datetime.MINYEAR``/``MAXYEAR``, Python docs, datetime). Each must
be processed like its neighbours, or skipped with a logged reason and counted in
``maintd_rows_skipped_total{service,reason}``; every other row is still processed and the pass
succeeds. Passes run in-process (like tests/test_scheduler.py) through
:func:`maintd.runner.execute_pass`, which gives the outcome the daemon would record.

The attempt counter's contract (tested by ``test_claim_survives_an_exhausted_attempt_counter``):
the claim never fails because of one row and never hands out a job whose attempts are used up
(``attempt >= max_attempts``; so ``attempt + 1`` cannot overflow, as ``max_attempts`` is a
smallint too), and the maintenance discards such a job with an error entry saying why. A CHECK
constraint alone could not do it: ``attempt = max_attempts = 32767`` would pass it and still
overflow in the claim. (A schema that refuses the row outright is accepted too.)
"""

from __future__ import annotations

import json
import math
import re
from datetime import timedelta

import pytest
from sqlalchemy.exc import IntegrityError

from maintd.clock import FrozenClock
from maintd.queries import sql
from maintd.jobs import JobQueue
from maintd.metrics import Metrics
from maintd.passes import execute_pass
from maintd.services.base import PassContext
from maintd.services.cleaner import Cleaner
from maintd.services.rescuer import Rescuer
from maintd.services.scheduler import Scheduler
from maintd.metrics import JobGauges
from maintd.status import collect_status

from .conftest import T0

# Every test here runs on both jobs layouts (SPEC 8.1): tests/conftest.py.
pytestmark = pytest.mark.both_layouts

# Timestamps psycopg cannot turn into a Python datetime.
TOO_LATE = ["infinity", "10000-01-01 00:00:00+00"]
TOO_EARLY = ["-infinity", "0044-03-15 00:00:00+00 BC", "0001-01-01 00:00:00+00"]


TARGET = "maintd"  # Metrics() default target: every series carries it (SPEC 7.4)

def insert(engine, schema, state: str, *, queue: str = "default", scheduled_at: str | None = None,
           attempted_at: str | None = None, finalized_at: str | None = None, attempt: int = 0,
           max_attempts: int = 25, priority: int = 0, kind: str = "k") -> int:
    """One job; timestamps as PostgreSQL literals (``'infinity'`` etc.), NULL when None."""
    with engine.begin() as conn:
        return conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, queue, state, scheduled_at, attempted_at, attempted_by, "
            "finalized_at, attempt, max_attempts, priority) VALUES (:kind, :queue, "
            "CAST(:state AS {schema}.job_state), coalesce(CAST(:scheduled_at AS timestamptz), now()), "
            "CAST(:attempted_at AS timestamptz), CASE WHEN :state = 'running' THEN 'w1' END, "
            "CAST(:finalized_at AS timestamptz), :attempt, :max_attempts, :priority) RETURNING id", schema),
            {"kind": kind, "queue": queue, "state": state, "scheduled_at": scheduled_at,
             "attempted_at": attempted_at, "finalized_at": finalized_at, "attempt": attempt,
             "max_attempts": max_attempts, "priority": priority}).scalar_one()


def ago(delta: timedelta) -> str:
    return (T0 - delta).isoformat()


def states(engine, schema) -> dict[int, str]:
    with engine.connect() as conn:
        return {r.id: r.state for r in conn.execute(sql("SELECT id, state::text AS state FROM {schema}.jobs", schema))}


def run(service, settings, engine, clock, metrics: Metrics):
    ctx = PassContext.for_settings(settings, engine, clock)
    record = execute_pass(type(service).__name__.lower(), service, ctx, metrics)
    return record.outcome, record.result, record.error


def skipped(metrics: Metrics, service: str | None = None) -> float:
    """Sum of ``maintd_rows_skipped_total`` samples (of one service)."""
    total = 0.0
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == "maintd_rows_skipped_total" and (service is None or s.labels.get("service") == service):
                total += s.value
    return total


def handled_or_reported(row_id: int, now_state: str, was: str, logs: list[str], metrics: Metrics,
                        service: str) -> bool:
    """Processed (its state moved on), or skipped with a log line naming it and a count."""
    if now_state != was:
        return True
    named = any(line.startswith(f"maintd.{service}") and re.search(rf"\b{row_id}\b", line) for line in logs)
    return named and skipped(metrics, service) > 0


# -- scheduler ---------------------------------------------------------------------------------

@pytest.mark.parametrize("never", TOO_LATE)
def test_scheduler_promotes_due_jobs_past_never_due_rows(settings, engine, schema, clock, never):
    stuck = insert(engine, schema, "scheduled", queue="a", scheduled_at=never)
    due = [insert(engine, schema, "scheduled", queue="a", scheduled_at=ago(timedelta(seconds=s)))
           for s in (1, 2, 3)]
    due.append(insert(engine, schema, "retryable", queue="b", scheduled_at="-infinity"))  # due forever
    metrics = Metrics()
    for _ in range(2):  # the next pass too (the broken one fails the same way every time)
        outcome, result, error = run(Scheduler(settings.scheduler), settings, engine, clock, metrics)
        assert (outcome, error) == ("success", None)
    s = states(engine, schema)
    assert [s[i] for i in due] == ["available"] * 4
    assert s[stuck] == "scheduled"  # not due: nothing to do with it


# -- rescuer -----------------------------------------------------------------------------------

def test_rescuer_handles_running_jobs_without_a_usable_attempted_at(settings, engine, schema, clock,
                                                                     maintd_log):
    odd = {insert(engine, schema, "running", attempted_at=t, attempt=1): t
           for t in (None, "-infinity", "0044-03-15 00:00:00+00 BC", "0001-01-01 00:00:00+00", *TOO_LATE)}
    stuck = insert(engine, schema, "running", attempted_at=ago(timedelta(hours=2)), attempt=1)
    fresh = insert(engine, schema, "running", attempted_at=ago(timedelta(minutes=1)), attempt=1)
    metrics = Metrics()
    outcome, result, error = run(Rescuer(settings.rescuer), settings, engine, clock, metrics)
    assert (outcome, error) == ("success", None)
    s = states(engine, schema)
    assert s[stuck] == "retryable" and s[fresh] == "running"
    unhandled = [t for i, t in odd.items()
                 if not handled_or_reported(i, s[i], "running", maintd_log, metrics, "rescuer")]
    assert not unhandled, f"running jobs neither rescued nor reported: attempted_at={unhandled}"


@pytest.mark.parametrize("when", ["-infinity", "infinity"])
def test_the_rescuers_probe_reads_odd_rows_and_asks_for_a_pass(settings, engine, schema, when):
    """The daemon's probe reads the oldest sign of life of a running job: a '-infinity' (or, the
    only running job, an 'infinity') one failed to load into Python, so the probe failed and set
    the target aside. It reads now, and asks for the pass that rescues the job."""
    from maintd.queries import jobs, render

    insert(engine, schema, "running", attempted_at=when, attempt=1)
    columns = ", ".join(render(column, schema) for column in jobs.RESCUER_PROBE)
    with engine.connect() as conn:
        values = tuple(conn.execute(sql(f"SELECT {columns}", schema)).one())
    assert Rescuer(settings.rescuer).after_probe(values, T0) is True


@pytest.mark.parametrize("when", ["-infinity", "0001-01-01 00:00:00+00", "0044-03-15 BC"])
def test_the_schedulers_probe_wakes_it_for_a_job_due_before_year_1(settings, engine, schema, when):
    """With precise_timing (the default) the scheduler has no ticks of its own: it passes when
    its probe says the next due time. The probe left out jobs due before year 1 ('-infinity',
    Go's zero time.Time), which no Python datetime holds: such a job stayed scheduled until
    another one fell due. It says year 1 now (due at once), and the pass promotes it."""
    from maintd.queries import jobs, render

    job = insert(engine, schema, "scheduled", scheduled_at=when)
    insert(engine, schema, "scheduled", scheduled_at="9999-12-31")  # never due: not a wake
    with engine.connect() as conn:
        values = tuple(conn.execute(sql(f"SELECT {render(jobs.NEXT_DUE, schema)}", schema)).one())
        now = conn.execute(sql("SELECT now()", schema)).scalar()
    scheduler = Scheduler(settings.scheduler)
    assert scheduler.after_probe(values, now) == now
    result = scheduler.run_once(PassContext.for_settings(settings, engine, FrozenClock(now)))
    with engine.connect() as conn:
        state = conn.execute(sql("SELECT state::text FROM {schema}.jobs WHERE id = :id", schema), {"id": job}).scalar()
    assert sum(result.promoted.values()) == 1 and state == "available"


def test_the_rescuers_probe_finds_nothing_to_do_with_no_running_job_or_only_fresh_ones(settings, engine, schema):
    """The other side of the case above: the probe must not ask for a pass when nothing is
    running (a clamp of min() to year 1 turned the NULL into a deadline long past, and the rescuer
    ran a pass at every look)."""
    from maintd.queries import jobs, render

    columns = ", ".join(render(column, schema) for column in jobs.RESCUER_PROBE)
    rescuer = Rescuer(settings.rescuer)
    for _ in range(2):
        with engine.connect() as conn:
            values = tuple(conn.execute(sql(f"SELECT {columns}", schema)).one())
            now = conn.execute(sql("SELECT now()", schema)).scalar()
        assert rescuer.after_probe(values, now) is None, values
        insert(engine, schema, "running", attempted_at=now.isoformat(), attempt=1)  # a fresh one


# -- cleaner -----------------------------------------------------------------------------------

def test_cleaner_deletes_expired_rows_with_odd_finalized_at(settings, engine, schema, clock):
    settings.cleaner.batch_size = 2  # batch boundaries (probes) fall on the odd rows too
    odd = [insert(engine, schema, state, finalized_at=t)
           for state in ("completed", "discarded") for t in TOO_EARLY]
    expired = [insert(engine, schema, "completed", finalized_at=ago(timedelta(days=2, seconds=s)))
               for s in range(5)]
    kept = insert(engine, schema, "completed", finalized_at=ago(timedelta(hours=1)))
    metrics = Metrics()
    outcome, result, error = run(Cleaner(settings.cleaner), settings, engine, clock, metrics)
    assert (outcome, error) == ("success", None)
    left = states(engine, schema)
    assert not [i for i in expired if i in left]
    assert not [i for i in odd if i in left], "odd finalized_at rows skipped by the cleaner"
    assert kept in left


# -- the attempt counter -----------------------------------------------------------------------

def readme_claim(schema: str):
    """The README's claim statement, verbatim, for ``schema``: workers in other languages copy it."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    m = re.search(r"-- claim up to[^\n]*\n(UPDATE maintd\.jobs.*?;)", readme, re.S)
    assert m, "no claim statement in the README"
    return sql(m.group(1).rstrip(";").replace("maintd.jobs", "{schema}.jobs"), schema)


def test_readme_claim_is_the_one_jobqueue_runs(schema):
    from maintd.queries import jobs as q

    def words(t: str) -> list[str]:
        return re.sub(r"\s+", " ", t).strip().split(" ")

    assert words(str(readme_claim(schema))) == words(str(sql(q.CLAIM, schema)))


def test_claim_survives_an_exhausted_attempt_counter(settings, engine, schema, clock, maintd_log):
    """Through JobQueue and through the README's claim statement."""
    queue = JobQueue(schema)
    try:
        bad = insert(engine, schema, "available", queue="q", attempt=32767, max_attempts=25, priority=-5)
    except IntegrityError:
        bad = None  # the schema refuses the row: an acceptable contract
    good = [insert(engine, schema, "available", queue="q") for _ in range(3)]
    with engine.begin() as conn:
        claimed = queue.claim(conn, "q", "w1", limit=10)
    assert sorted(j.id for j in claimed) == good  # the whole queue still works
    more = [insert(engine, schema, "available", queue="q") for _ in range(2)]
    with engine.begin() as conn:
        rows = conn.execute(readme_claim(schema), {"queue": "q", "worker": "w2", "limit": 10}).all()
    assert sorted(r.id for r in rows) == more
    # used up below the smallint's top too (reschedule_jobs lowering max_attempts): not handed out
    used_up = insert(engine, schema, "scheduled", queue="q", attempt=3, max_attempts=3,
                     scheduled_at="2000-01-01 00:00:00+00")
    untouched = insert(engine, schema, "retryable", queue="q", attempt=2, max_attempts=3,
                       scheduled_at="2999-01-01 00:00:00+00")
    exhausted = [job for job in (bad, used_up) if job is not None]
    metrics = Metrics()
    for service in (Rescuer(settings.rescuer), Scheduler(settings.scheduler), Cleaner(settings.cleaner)):
        outcome, _, error = run(service, settings, engine, clock, metrics)
        assert (outcome, error) == ("success", None)
    with engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(sql(
            "SELECT id, state::text AS state, errors, finalized_at FROM {schema}.jobs", schema))}
    for job in exhausted:
        assert rows[job].state == "discarded" and rows[job].finalized_at is not None
        assert re.search(r"no attempt left.*attempt (32767|3) >= max_attempts (25|3)", rows[job].errors[-1]["error"]), \
            rows[job].errors
        assert any(re.search(rf"maintd\.rescuer.*\b{job}\b", line) for line in maintd_log)
    assert rows[untouched].state == "retryable"
    assert metrics.registry.get_sample_value("maintd_jobs_rescued_total",
                                             {"target": TARGET, "outcome": "exhausted"}) == len(exhausted)


# -- the job gauges and /status ----------------------------------------------------------------

@pytest.mark.parametrize("when", ["-infinity", "infinity"])
def test_job_gauges_and_status_survive_infinite_timestamps(settings, engine, schema, when):
    insert(engine, schema, "available", queue="odd", scheduled_at=when)
    insert(engine, schema, "available", queue="fine", scheduled_at=ago(timedelta(0)))
    metrics = Metrics()
    JobGauges(metrics).refresh(engine, settings.schema, final=True)
    status = collect_status(engine, settings.schema)
    assert {r["queue"] for r in status["jobs"]} == {"odd", "fine"}
    ages = status["oldest_available_age_seconds"]
    assert "fine" in ages
    json.dumps(ages, allow_nan=False)  # /status is JSON: no Infinity (PostgreSQL 17+ computes one)
    gauges = [s.value for f in metrics.registry.collect() for s in f.samples
              if s.name == "maintd_oldest_available_job_age_seconds"]
    assert gauges and all(math.isfinite(v) for v in gauges)
    assert metrics.registry.get_sample_value("maintd_jobs", {"target": TARGET, "queue": "odd", "state": "available"}) == 1


# -- the count of what was passed over -----------------------------------------------------------

def test_rows_passed_over_are_counted_and_logged(settings, engine, schema, clock, maintd_log):
    settings.cleaner.batch_size = 2
    eligible = {  # id -> the state it is in while a pass should do something with it
        **{insert(engine, schema, "scheduled", scheduled_at=t): "scheduled" for t in ("-infinity",)},
        **{insert(engine, schema, "running", attempted_at=t, attempt=1): "running"
           for t in (None, "-infinity", "0044-03-15 00:00:00+00 BC")},
        **{insert(engine, schema, "completed", finalized_at=t): "completed" for t in TOO_EARLY},
        insert(engine, schema, "available", attempt=32767, max_attempts=25): "available",
    }
    for t in TOO_LATE:
        insert(engine, schema, "scheduled", scheduled_at=t)
    metrics = Metrics()
    for service in (Scheduler(settings.scheduler), Rescuer(settings.rescuer), Cleaner(settings.cleaner)):
        outcome, _, error = run(service, settings, engine, clock, metrics)
        assert outcome == "success", error
    assert b"maintd_rows_skipped" in metrics.render()
    now = states(engine, schema)
    passed_over = [i for i, was in eligible.items() if now.get(i) == was]
    for i in passed_over:
        assert any(re.search(rf"\b{i}\b", line) for line in maintd_log), f"job {i} skipped without a log line"
    assert skipped(metrics) == len(passed_over)


@pytest.mark.parametrize("tied", [False, True])
def test_cleaner_counts_and_logs_the_expired_rows_it_passes_over(settings, engine, schema, clock, maintd_log,
                                                                  tied):
    """A final row held by another session (an operator's open transaction, an admin function) is
    skipped after a short lock wait: the rest of its range is deleted, the pass succeeds, and the
    row is logged by id and counted in maintd_rows_skipped_total{service="cleaner",reason="locked"}."""
    settings.cleaner.batch_size = 3 if tied else 100
    ids = [insert(engine, schema, "completed",
                  finalized_at=ago(timedelta(days=2, seconds=0 if tied else s))) for s in range(6)]
    held = ids[2] if tied else ids[4]
    with engine.connect() as other:
        other.execute(sql("SELECT 1 FROM {schema}.jobs WHERE id = :id FOR UPDATE", schema), {"id": held})
        metrics = Metrics()
        outcome, result, error = run(Cleaner(settings.cleaner), settings, engine, clock, metrics)
        other.rollback()
    assert (outcome, error) == ("success", None)
    assert set(states(engine, schema)) == {held}
    assert result.skipped == {"locked": 1}
    assert skipped(metrics, "cleaner") == 1
    assert metrics.registry.get_sample_value("maintd_rows_skipped_total", {
        "target": TARGET, "service": "cleaner", "reason": "locked"}) == 1
    assert [line for line in maintd_log if re.search(rf"^maintd\.cleaner: passed over .* count=1 job_ids={held}\b",
                                                     line)]
    outcome, result, _ = run(Cleaner(settings.cleaner), settings, engine, clock, metrics)
    assert outcome == "success" and states(engine, schema) == {}  # looked at again next pass


def test_thousands_of_locked_expired_rows_make_one_line_per_batch_and_an_exact_count(settings, engine, schema,
                                                                                      clock, maintd_log):
    """A report holds FOR SHARE on 600 expired rows while the cleaner passes: one warning line for
    the batch (the count, a few ids), not one per row; the counter counts every row."""
    settings.cleaner.batch_size = 1000
    with engine.begin() as conn:
        ids = conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, finalized_at) SELECT 'k', 'completed', "
                               "CAST(:t0 AS timestamptz) - interval '2 days' + g * interval '1 ms' "
                               "FROM generate_series(1, 600) g RETURNING id", schema), {"t0": T0}).scalars().all()
    with engine.connect() as other:
        other.execute(sql("SELECT 1 FROM {schema}.jobs FOR SHARE", schema))
        metrics = Metrics()
        outcome, result, error = run(Cleaner(settings.cleaner), settings, engine, clock, metrics)
        other.rollback()
    assert (outcome, error) == ("success", None)
    assert result.skipped == {"locked": 600} and skipped(metrics, "cleaner") == 600
    lines = [line for line in maintd_log if line.startswith("maintd.cleaner: passed over")]
    first = ",".join(map(str, sorted(ids)[:5]))
    assert lines == [f"maintd.cleaner: passed over expired jobs locked by another session (retried next pass) "
                     f"count=600 job_ids={first} state=completed"]
