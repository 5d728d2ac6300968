"""Property-based tests: config parsing, and each service on random job populations doing exactly
what its rule says (expected sets computed in Python from the generated rows)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import HealthCheck, given, settings as hsettings
from hypothesis import strategies as st

from maintd.clock import FrozenClock
from maintd.config import ConfigError, IDENT_RE, Settings, load_settings, validate_identifier
from maintd.db import sql
from maintd.durations import parse_duration
from maintd.services.base import PassContext
from maintd.services.cleaner import Cleaner
from maintd.services.rescuer import Rescuer
from maintd.services.scheduler import Scheduler

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
STATES = ["available", "scheduled", "running", "retryable", "completed", "cancelled", "discarded"]
FINAL = {"completed", "cancelled", "discarded"}
EXAMPLES = hsettings(max_examples=25, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# Pure-Python properties: no per-example deadline either (a loaded CI box can stall any example).
PURE = hsettings(deadline=None)

offsets = st.integers(min_value=-3 * 86400 * 4, max_value=3 * 86400)  # seconds relative to NOW

job = st.fixed_dictionaries({
    "state": st.sampled_from(STATES),
    "queue": st.sampled_from(["a", "b", "billing"]),
    "age": offsets,             # finalized_at / attempted_at / scheduled_at = NOW - age
    "hb_age": st.one_of(st.none(), offsets),
    "attempt": st.integers(min_value=1, max_value=4),
    "max_attempts": st.integers(min_value=1, max_value=4),
})


def load(engine, schema, jobs):
    with engine.begin() as conn:
        conn.execute(sql("TRUNCATE {schema}.jobs", schema))
        ids = []
        for j in jobs:
            t = NOW - timedelta(seconds=j["age"])
            hb = None if j["hb_age"] is None else NOW - timedelta(seconds=j["hb_age"])
            final = j["state"] in FINAL
            ids.append(conn.execute(sql(
                "INSERT INTO {schema}.jobs (kind, queue, state, attempt, max_attempts, scheduled_at, "
                "attempted_at, heartbeat_at, finalized_at) VALUES ('p', :q, CAST(:s AS {schema}.job_state), "
                ":a, :m, :t, :t, :hb, :f) RETURNING id", schema),
                {"q": j["queue"], "s": j["state"], "a": j["attempt"], "m": j["max_attempts"], "t": t,
                 "hb": hb, "f": t if final else None}).scalar())
    return ids


def states(engine, schema):
    with engine.connect() as conn:
        return dict(conn.execute(sql("SELECT id, state::text FROM {schema}.jobs", schema)).all())


@EXAMPLES
@given(st.lists(job, max_size=40), st.integers(min_value=1, max_value=7))
def test_cleaner_deletes_exactly_the_expired_final_rows(pg_dsn, schema, engine, jobs, batch):
    s = Settings(database_url=pg_dsn, schema=schema, cleaner={
        "batch_size": batch, "completed_retention": "1d", "cancelled_retention": "2h",
        "discarded_retention": -1, "queues": {"billing": {"completed_retention": "3d"}}})
    ids = load(engine, schema, jobs)
    Cleaner(s).run_once(PassContext(engine=engine, settings=s, clock=FrozenClock(NOW)))
    expected = set()
    for i, j in zip(ids, jobs):
        r = s.cleaner.retention(j["state"], j["queue"]) if j["state"] in FINAL else None
        if r is not None and timedelta(seconds=j["age"]) > r:
            continue
        expected.add(i)
    assert set(states(engine, schema)) == expected


@EXAMPLES
@given(st.lists(job, max_size=40), st.booleans(), st.integers(min_value=1, max_value=5))
def test_rescuer_touches_exactly_the_stuck_running_rows(pg_dsn, schema, engine, jobs, with_hb, batch):
    s = Settings(database_url=pg_dsn, schema=schema, rescuer={
        "batch_size": batch, "rescue_stuck_jobs_after": "1h",
        **({"heartbeat_timeout": "10m"} if with_hb else {})})
    ids = load(engine, schema, jobs)
    before = states(engine, schema)
    Rescuer(s).run_once(PassContext(engine=engine, settings=s, clock=FrozenClock(NOW)))
    after = states(engine, schema)
    for i, j in zip(ids, jobs):
        seen = j["age"] if j["hb_age"] is None else j["hb_age"]
        stuck = j["state"] == "running" and (
            seen > 3600 or (with_hb and j["hb_age"] is not None and j["hb_age"] > 600))
        if stuck:
            assert after[i] == ("discarded" if j["attempt"] >= j["max_attempts"] else "retryable")
        else:
            assert after[i] == before[i]


@EXAMPLES
@given(st.lists(job, max_size=40), st.integers(min_value=1, max_value=5))
def test_scheduler_promotes_exactly_the_due_rows(pg_dsn, schema, engine, jobs, batch):
    s = Settings(database_url=pg_dsn, schema=schema, scheduler={"batch_size": batch, "precise_timing": False})
    ids = load(engine, schema, jobs)
    before = states(engine, schema)
    Scheduler(s).run_once(PassContext(engine=engine, settings=s, clock=FrozenClock(NOW)))
    after = states(engine, schema)
    for i, j in zip(ids, jobs):
        due = j["state"] in ("scheduled", "retryable") and j["age"] >= 0
        assert after[i] == ("available" if due else before[i])


@PURE
@given(st.text(max_size=70))
def test_identifiers_are_accepted_only_when_safe(name):
    try:
        validate_identifier(name)
    except ValueError:
        return
    assert IDENT_RE.match(name) and '"' not in name and not name.startswith("pg_")


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
