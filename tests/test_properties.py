"""Property-based tests: config parsing, and each service on random job populations doing exactly
what its rule says (expected sets computed in Python from the generated rows)."""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import HealthCheck, given, settings as hsettings
from hypothesis import strategies as st

from maintd.clock import FrozenClock
from maintd.config import ConfigError, Settings, load_settings, validate_identifier
from maintd.identifiers import quote_ident
from maintd.queries import sql
from maintd.durations import parse_duration
from maintd.services.base import PassContext
from maintd.services.cleaner import Cleaner
from maintd.services.rescuer import Rescuer
from maintd.services.scheduler import Scheduler

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
STATES = ["available", "scheduled", "running", "retryable", "completed", "cancelled", "discarded"]
FINAL = {"completed", "cancelled", "discarded"}
QUEUES = ["a", "b", "billing"]
# 200 examples of up to 40 jobs each; one schema per property, TRUNCATEd between examples.
EXAMPLES = hsettings(max_examples=200, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# Pure-Python properties: no per-example deadline either (a loaded CI box can stall any example).
PURE = hsettings(deadline=None)

US = timedelta(microseconds=1)
# The thresholds the services compare ages with (retentions, rescue_stuck_jobs_after,
# heartbeat_timeout, "due now"); generated configs use only these, and ages cluster around them.
THRESHOLDS = [timedelta(0), timedelta(minutes=10), timedelta(minutes=30), timedelta(hours=1), timedelta(hours=2),
              timedelta(days=1), timedelta(days=3)]
ages = st.one_of(
    # exactly at a threshold, or one microsecond either side
    st.builds(lambda t, d: t + d, st.sampled_from(THRESHOLDS), st.sampled_from([-US, timedelta(0), US])),
    st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=5)),  # anywhere in the past
    st.timedeltas(min_value=-timedelta(days=1), max_value=timedelta(0)),  # in the future
)

def jobs(weighted: tuple[str, ...] = ()):
    """Lists of jobs; the states in ``weighted`` (what the service under test acts on) come up
    about half the time."""
    return st.lists(job(st.one_of(st.sampled_from(STATES), st.sampled_from(weighted)) if weighted
                        else st.sampled_from(STATES)), max_size=40)


job = lambda states: st.fixed_dictionaries({  # noqa: E731
    "state": states,
    "queue": st.sampled_from(QUEUES),
    "age": ages,                # finalized_at / attempted_at / scheduled_at = NOW - age
    "hb_age": st.one_of(st.none(), ages),
    "attempt": st.integers(min_value=1, max_value=12),
    "max_attempts": st.integers(min_value=1, max_value=12),
})

retentions = st.sampled_from([-1] + [int(t.total_seconds()) for t in THRESHOLDS[1:]])  # seconds; -1 keeps
cleaner_configs = st.fixed_dictionaries({
    "completed_retention": retentions, "cancelled_retention": retentions, "discarded_retention": retentions,
    # per-queue overrides of some states for some queues
    "queues": st.dictionaries(st.sampled_from(QUEUES), st.dictionaries(
        st.sampled_from(["completed_retention", "cancelled_retention", "discarded_retention"]), retentions,
        min_size=1)),
})


def load(engine, schema, jobs):
    """TRUNCATE, then insert the jobs in one statement; their ids in order (identity values are
    assigned in insertion order)."""
    rows = [{"queue": j["queue"], "state": j["state"], "attempt": j["attempt"], "max_attempts": j["max_attempts"],
             "t": (NOW - j["age"]).isoformat(),
             "hb": None if j["hb_age"] is None else (NOW - j["hb_age"]).isoformat(),
             "final": j["state"] in FINAL, "n": n} for n, j in enumerate(jobs)]
    with engine.begin() as conn:
        conn.execute(sql("TRUNCATE {schema}.jobs", schema))
        return sorted(r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, queue, state, attempt, max_attempts, scheduled_at, attempted_at, "
            "heartbeat_at, finalized_at) "
            "SELECT 'p', r.queue, CAST(r.state AS {schema}.job_state), r.attempt, r.max_attempts, r.t, r.t, r.hb, "
            "CASE WHEN r.final THEN r.t END "
            "FROM jsonb_to_recordset(CAST(:rows AS jsonb)) AS r(queue text, state text, "
            "attempt int, max_attempts int, t timestamptz, hb timestamptz, final bool, n int) "
            "ORDER BY r.n RETURNING id", schema), {"rows": json.dumps(rows)}))  # ids follow the order


def rows_by_id(engine, schema):
    with engine.connect() as conn:
        return {r.id: r for r in conn.execute(sql(
            "SELECT id, state::text AS state, scheduled_at, finalized_at, errors, heartbeat_at FROM {schema}.jobs",
            schema))}


def states(engine, schema):
    return {i: r.state for i, r in rows_by_id(engine, schema).items()}


def kept_for(config: dict, state: str, queue: str) -> timedelta | None:
    """The retention the configuration gives (None: forever), written out independently of
    CleanerConfig.retention: a queue's override of that state, else the global value."""
    key = f"{state}_retention"
    seconds = config["queues"].get(queue, {}).get(key, config[key])
    return None if seconds == -1 else timedelta(seconds=seconds)


@EXAMPLES
@given(jobs(("completed", "cancelled", "discarded")), cleaner_configs, st.integers(min_value=1, max_value=7))
def test_cleaner_deletes_exactly_the_expired_final_rows(pg_dsn, schema, engine, jobs, config, batch):
    s = Settings(database_url=pg_dsn, schema=schema, cleaner={"batch_size": batch, **config})
    ids = load(engine, schema, jobs)
    Cleaner(s.cleaner).run_once(PassContext.for_settings(s, engine, FrozenClock(NOW)))
    expected = set()
    for i, j in zip(ids, jobs):
        kept = kept_for(config, j["state"], j["queue"]) if j["state"] in FINAL else None
        if j["state"] in FINAL and kept is not None and j["age"] > kept:  # strictly older: deleted
            continue
        expected.add(i)
    assert set(states(engine, schema)) == expected


@EXAMPLES
@given(jobs(("running",)), st.sampled_from([None, 600, 1800]), st.sampled_from([3600, 7200]),
       st.integers(min_value=1, max_value=5))
def test_rescuer_touches_exactly_the_stuck_running_rows(pg_dsn, schema, engine, jobs, hb_timeout, stuck_after,
                                                       batch):
    s = Settings(database_url=pg_dsn, schema=schema, rescuer={
        "batch_size": batch, "rescue_stuck_jobs_after": stuck_after,
        **({"heartbeat_timeout": hb_timeout} if hb_timeout else {})})
    ids = load(engine, schema, jobs)
    before = rows_by_id(engine, schema)
    Rescuer(s.rescuer).run_once(PassContext.for_settings(s, engine, FrozenClock(NOW)))
    after = rows_by_id(engine, schema)
    for i, j in zip(ids, jobs):
        seen = j["age"] if j["hb_age"] is None else j["hb_age"]
        spec_stuck = j["state"] == "running" and (  # SPEC 2's rule: what the scan finds
            seen > timedelta(seconds=stuck_after)
            or (hb_timeout is not None and j["hb_age"] is not None and j["hb_age"] > timedelta(seconds=hb_timeout)))
        # A heartbeat older than the claim is an earlier attempt's: with the claim within its
        # grace, such a candidate is not rescued but has that heartbeat cleared.
        stale = j["hb_age"] is not None and j["hb_age"] > j["age"] and j["age"] <= timedelta(seconds=stuck_after)
        stuck = spec_stuck and not stale
        row = after[i]
        if spec_stuck and stale:
            assert row._asdict() == {**before[i]._asdict(), "heartbeat_at": None}, j
            continue
        exhausted = j["state"] in ("available", "scheduled", "retryable") and j["attempt"] >= j["max_attempts"]
        if exhausted:  # waiting with no attempt left: the claim passes it over, the rescuer discards it
            assert (row.state, row.finalized_at) == ("discarded", NOW) and len(row.errors) == 1, j
        elif not stuck:
            assert row == before[i], j
        elif j["attempt"] >= j["max_attempts"]:
            assert (row.state, row.finalized_at, row.heartbeat_at) == ("discarded", NOW, None), j
            assert row.scheduled_at == before[i].scheduled_at and len(row.errors) == 1
        else:
            # e^min(attempt, 10) seconds, the documented backoff (to the microsecond)
            delay = timedelta(seconds=math.exp(min(j["attempt"], 10)))
            assert row.state == "retryable" and row.finalized_at is None and row.heartbeat_at is None, j
            assert abs(row.scheduled_at - (NOW + delay)) <= US, (j, row.scheduled_at)
            assert len(row.errors) == 1 and row.errors[0]["attempt"] == j["attempt"]


@hsettings(EXAMPLES, max_examples=100)  # one comparison with NOW: fewer examples suffice
@given(jobs(("scheduled", "retryable")), st.integers(min_value=1, max_value=5))
def test_scheduler_promotes_exactly_the_due_rows(pg_dsn, schema, engine, jobs, batch):
    s = Settings(database_url=pg_dsn, schema=schema, scheduler={"batch_size": batch, "precise_timing": False})
    ids = load(engine, schema, jobs)
    before = states(engine, schema)
    Scheduler(s.scheduler).run_once(PassContext.for_settings(s, engine, FrozenClock(NOW)))
    after = states(engine, schema)
    for i, j in zip(ids, jobs):
        due = j["state"] in ("scheduled", "retryable") and j["age"] >= timedelta(0)  # due at NOW exactly
        assert after[i] == ("available" if due else before[i]), j


# Hand-written, independent of maintd.identifiers.IDENT_RE: 1-63 of [a-z0-9_], not starting with a
# digit, not starting with pg_ (reserved by PostgreSQL).
SAFE_IDENTIFIERS = ["a", "_", "jobs", "maintd", "maintd_2", "_private", "a" * 63, "pgx", "pg", "x_pg_",
                    "z9_"]
UNSAFE_IDENTIFIERS = [
    "", "jobs;drop", "jobs; DROP TABLE jobs", "a$b", "$1", '"', 'a"b', '"jobs"', "a'b", "'jobs'",
    "a`b", "Jobs", "JOBS", "a" * 64, "b" * 200, "1jobs", "0", "pg_", "pg_catalog", "pg_jobs", "a-b",
    "a b", " jobs", "jobs ", "a.b", "maintd.jobs", "a\\b", "a/b", "a*", "a(b)", "a--b", "a/*b*/",
    "\tjobs", "jobs\x00", "\x00", "ünïcode", "jobsé", "job\u0131", "ｊｏｂｓ", "日本", "a\u200bb", "a\rb",
]


@pytest.mark.parametrize("name,safe", [(n, True) for n in SAFE_IDENTIFIERS] + [(n, False) for n in UNSAFE_IDENTIFIERS])
def test_identifiers_are_accepted_only_when_safe(name, safe):
    if safe:
        assert validate_identifier(name) == name
        assert quote_ident(name) == f'"{name}"'
        return
    with pytest.raises(ValueError):
        validate_identifier(name)
    if not name.startswith("pg_"):  # quote_ident re-checks the character rule only
        with pytest.raises(ValueError):
            quote_ident(name)


def test_a_trailing_newline_is_rejected():
    with pytest.raises(ValueError):
        validate_identifier("jobs\n")


def _safe(name: str) -> bool:
    return (1 <= len(name) <= 63 and all(c in "abcdefghijklmnopqrstuvwxyz0123456789_" for c in name)
            and not name[0].isdigit() and not name.startswith("pg_"))


@PURE
@given(st.text(alphabet=st.sampled_from(list("abpgz09_AZ$;\"' -.\\\x00\tüｊ\u0131")), max_size=70))
def test_identifier_rule_on_generated_names(name):
    """The same rule on names built from the characters that matter (a trailing newline is the
    known exception above, hence not in the alphabet)."""
    try:
        validate_identifier(name)
    except ValueError:
        assert not _safe(name), name
    else:
        assert _safe(name), name


@PURE
@given(st.one_of(st.text(max_size=20), st.integers(), st.floats(allow_nan=True)))
def test_durations_parse_or_raise_valueerror(value):
    try:
        td = parse_duration(value)
    except ValueError:
        return
    assert td >= timedelta(0)


@PURE
@given(st.text(alphabet="0123456789*/,-LW#? abcdefghijklmnopqrstuvwxyz@", max_size=30))
def test_any_schedule_string_is_accepted_or_a_config_error(expr):
    try:
        load_settings(None, periodic=[{"id": "p", "schedule": expr, "kind": "k"}])
    except ConfigError as exc:
        assert exc.problems and all(p.startswith("periodic") for p in exc.problems)


@pytest.mark.parametrize("n", [2**15, 2**31, 10**30])
def test_huge_numbers_are_config_errors(n):
    with pytest.raises(ConfigError):
        load_settings(None, periodic=[{"id": "p", "schedule": "@hourly", "kind": "k", "priority": n}])
