"""Rescuer, issue 17: stuck rules per queue and per kind, ``stalled`` events, precise timing.

The per-type thresholds follow the guidance of the seed Reaper (../shared/seeds/: about twice the
p95 duration of the job type); precise timing is its one-timer-per-job visibility timeout, done
with one index probe (SPEC 7.7).
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from typing import Iterator
from datetime import timedelta

import psycopg
import pytest
from sqlalchemy import text

from maintd.clock import ServerClock
from maintd.config import ConfigError, load_settings
from maintd.db import events_channel
from maintd.metrics import Metrics
from maintd.queries import sql
from maintd.queries.jobs import RESCUER_BATCH, RESCUER_NEXT_STUCK, RESCUER_PROBE_PLANNING
from maintd.runner import Runner
from maintd.services.base import NoFence, PassContext
from maintd.services.rescuer import DELAYS, FAR_PAST, Rescuer
from maintd.services.scheduler import MIN_WAKE

from .procs import wait_for, jobs_locked
from .conftest import T0
from .plans import explain

# Every test here runs on both jobs layouts (SPEC 8.1): tests/conftest.py.
pytestmark = pytest.mark.both_layouts

S = timedelta(seconds=1)


def add(engine, schema, *, seen_ago=None, at=None, heartbeat_ago=None, queue="default", kind="k",
        attempt=1, max_attempts=25, n=1):
    """Running jobs whose attempted_at is ``T0 - seen_ago`` (or the server's ``now() + at``)."""
    with engine.begin() as conn:
        return [r[0] for r in conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, queue, state, attempt, max_attempts, attempted_at, attempted_by, "
            "heartbeat_at) SELECT :kind, :queue, 'running', :attempt, :max, "
            "CASE WHEN :rel THEN now() + CAST(:at AS interval) + (g - 1) * interval '1 millisecond' "
            "     ELSE CAST(:t0 AS timestamptz) - CAST(:seen AS interval) END, 'w1', "
            "CASE WHEN :hb THEN CAST(:t0 AS timestamptz) - CAST(:hb_ago AS interval) END "
            "FROM generate_series(1, :n) AS g RETURNING id", schema),
            {"kind": kind, "queue": queue, "attempt": attempt, "max": max_attempts, "t0": T0,
             "seen": seen_ago or timedelta(0), "rel": at is not None, "at": at or timedelta(0),
             "hb": heartbeat_ago is not None, "hb_ago": heartbeat_ago or timedelta(0), "n": n})]


def states(engine, schema) -> dict[int, str]:
    with engine.connect() as conn:
        return dict(conn.execute(sql("SELECT id, state::text FROM {schema}.jobs", schema)).all())


def ctx_for(settings, engine, clock, **kw) -> PassContext:
    return PassContext.for_settings(settings, engine, clock, **kw)


def rules(settings, **rescuer):
    fresh = load_settings(None, database_url=settings.database_url.get_secret_value(), schema=settings.schema,
                          instance_id="test-1", rescuer=rescuer)
    return fresh


# -- thresholds per queue and per kind -----------------------------------------------------------


def test_kind_over_queue_over_default_at_the_edges(settings, engine, schema, clock):
    settings = rules(settings, precise_timing=False, rescue_stuck_jobs_after="1h",
                     queues={"api": {"rescue_stuck_jobs_after": "1m"}, "it's; --": {"rescue_stuck_jobs_after": "5m"}},
                     kinds={"video": {"rescue_stuck_jobs_after": "2h"},
                            "ping": {"heartbeat_timeout": "10s"}})
    h, m = timedelta(hours=1), timedelta(minutes=1)
    cases = {  # (queue, kind, seen ago, heartbeat ago): rescued?
        ("default", "k", h + S, None): True, ("default", "k", h - S, None): False,
        ("api", "k", m + S, None): True, ("api", "k", m - S, None): False,
        ("default", "video", 2 * h + S, None): True, ("default", "video", 2 * h - S, None): False,
        # the kind's rule wins over the queue's (1m), both ways
        ("api", "video", 2 * h - S, None): False, ("api", "video", 2 * h + S, None): True,
        # a name with quotes and a comment marker is data, not SQL
        ("it's; --", "k", 5 * m + S, None): True, ("it's; --", "k", 5 * m - S, None): False,
        # heartbeat_timeout of the kind only; the default has none (1 h from the last heartbeat)
        ("default", "ping", h - S, 10 * S + S): True, ("default", "ping", h - S, 10 * S - S): False,
        ("default", "k", h - S, 10 * S + S): False,
        ("api", "ping", h - S, 10 * S - S): False,  # the kind's section: 1h (from [rescuer]), not api's 1m
    }
    ids = {case: add(engine, schema, queue=case[0], kind=case[1], seen_ago=case[2], heartbeat_ago=case[3])[0]
           for case in cases}
    dry = Rescuer(settings.rescuer).run_once(ctx_for(settings, engine, clock, dry_run=True))
    assert dry.retried == sum(cases.values())
    result = Rescuer(settings.rescuer).run_once(ctx_for(settings, engine, clock))
    assert result.retried == sum(cases.values())
    now = states(engine, schema)
    assert {case: now[i] == "retryable" for case, i in ids.items()} == cases



def test_a_job_exactly_at_its_own_rule_s_limit_is_alive_under_a_rule_with_a_later_horizon(settings, engine,
                                                                                          schema, clock):
    """Exactly at a limit is not older than it: alive. The edge of one rule is checked by {stuck}
    itself only when the scan reaches it: the scan stops at the latest horizon of any rule, which
    is the edge of a single rule but lies after the edges of the others. Here the queue 'api'
    (1 min) sets it, so a job of the kind 'slow' seen or heartbeated exactly 2 min ago, and one of
    the default rule seen exactly 1 h ago, are inside the scan and kept only by {stuck}'s ``<``
    (``<=`` in the heartbeat rule rescued the live 'slow' job, and the dry run counted it)."""
    settings = rules(settings, precise_timing=False, rescue_stuck_jobs_after="1h",
                     queues={"api": {"rescue_stuck_jobs_after": "1m"}},
                     kinds={"slow": {"heartbeat_timeout": "2m"}})
    h, m = timedelta(hours=1), timedelta(minutes=1)
    cases = {  # (kind, seen ago, heartbeat ago): rescued?
        ("slow", 30 * m, 2 * m): False, ("slow", 30 * m, 2 * m + timedelta(microseconds=1)): True,
        ("k", h, None): False, ("k", h + timedelta(microseconds=1), None): True,
    }
    ids = {case: add(engine, schema, kind=case[0], seen_ago=case[1], heartbeat_ago=case[2])[0] for case in cases}
    add(engine, schema, queue="api", seen_ago=m)  # the latest horizon: exactly at it, alive too
    dry = Rescuer(settings.rescuer).run_once(ctx_for(settings, engine, clock, dry_run=True))
    result = Rescuer(settings.rescuer).run_once(ctx_for(settings, engine, clock))
    assert (dry.retried, result.retried) == (2, 2), (dry.retried, result.retried)
    now = states(engine, schema)
    assert {case: now[i] == "retryable" for case, i in ids.items()} == cases


def test_rules_keep_the_statement_batched_and_index_backed(settings, engine, schema):
    """Overrides are bound arrays in the same statement: the candidates still come from
    jobs_running_idx and the rows through their ctids, with custom and generic plans."""
    settings = rules(settings, queues={"api": {"rescue_stuck_jobs_after": "1m"}},
                     kinds={"video": {"rescue_stuck_jobs_after": "2h", "heartbeat_timeout": "5m"}})
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, finalized_at) "
                         "SELECT 'k', 'completed', now() FROM generate_series(1, 30000)", schema))
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state, attempt, attempted_at) "
                         "SELECT CASE WHEN g % 3 = 0 THEN 'video' ELSE 'k' END, CASE WHEN g % 2 = 0 THEN 'api' "
                         "ELSE 'default' END, 'running', 1, CAST(:t0 AS timestamptz) - g * interval '1 second' "
                         "FROM generate_series(1, 20000) g", schema), {"t0": T0})
        # 10,000 jobs heartbeating in the probe's window, of the shortest grace (5m): the probe
        # must stop at the first, not sort them all
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at, heartbeat_at) "
                         "SELECT 'video', 'running', 1, CAST(:t0 AS timestamptz) - interval '1 hour', "
                         "CAST(:t0 AS timestamptz) - interval '5 minutes' + g * interval '1 millisecond' "
                         "FROM generate_series(1, 10000) g", schema), {"t0": T0})
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    rescuer = Rescuer(settings.rescuer)
    params = {**rescuer.horizons(T0), "after_seen": FAR_PAST, "after_id": 0, "limit": 100, "now": T0,
              "instance": "i", "cap": len(DELAYS) - 1, "delays": DELAYS, "events_channel": "e", "announce": True,
              **rescuer.graces(), "since": T0, "until": T0 + timedelta(seconds=30)}
    with engine.connect() as conn:
        for generic in (False, True):
            plan = explain(conn, RESCUER_BATCH, schema, params, generic=generic)
            candidates, update = plan.split("CTE rescued")
            assert "Index Scan using jobs_running_idx" in candidates, plan
            assert "Tid Scan" in update and "Seq Scan" not in plan, plan
            conn.execute(sql(RESCUER_PROBE_PLANNING, schema))
            plan = explain(conn, RESCUER_NEXT_STUCK, schema, params, generic=generic)
            assert "Index Scan using jobs_running_idx" in plan, plan
            assert "Seq Scan" not in plan and "Sort" not in plan and "Bitmap" not in plan, plan
        conn.rollback()


@pytest.mark.parametrize("section,values,key", [
    ("queues", {"api": {"rescue_stuck_jobs_after": "5m"}}, "rescuer.queues.api.rescue_stuck_jobs_after"),
    ("kinds", {"video": {"job_timeout": "2h"}}, "rescuer.kinds.video.job_timeout"),
    ("kinds", {"video": {"rescue_stuck_jobs_after": "10m", "job_timeout": "10m"}},
     "rescuer.kinds.video.rescue_stuck_jobs_after"),
])
def test_a_section_must_keep_rescue_after_above_job_timeout(section, values, key):
    with pytest.raises(ConfigError) as err:
        load_settings(None, rescuer={"job_timeout": "10m", section: values})
    assert str(err.value).startswith(f"{key}: rescue_stuck_jobs_after must be greater than job_timeout")


def test_a_section_may_lower_job_timeout_with_its_threshold():
    cfg = load_settings(None, rescuer={"job_timeout": "10m", "queues": {
        "api": {"rescue_stuck_jobs_after": "1m", "job_timeout": "30s"}}}).rescuer
    assert cfg.rule(queue="api").rescue_stuck_jobs_after == timedelta(minutes=1)
    assert cfg.rule(queue="other").rescue_stuck_jobs_after == timedelta(hours=1)


@pytest.mark.parametrize("rescuer,problem", [
    ({"queues": {"": {}}}, "rescuer.queues: invalid queue name ''"),
    ({"kinds": {"a\nb": {}}}, "rescuer.kinds: invalid kind name 'a\\nb'"),
    ({"kinds": {"v": {"interval": "5s"}}}, "rescuer.kinds.v.interval: unknown key"),
    ({"queues": {"q": {"rescue_stuck_jobs_after": "0s"}}},
     "rescuer.queues.q.rescue_stuck_jobs_after: must be greater than zero"),
])
def test_bad_sections_name_their_key(rescuer, problem):
    with pytest.raises(ConfigError) as err:
        load_settings(None, rescuer=rescuer)
    assert problem in str(err.value).splitlines()


def test_sections_from_toml_and_environment(tmp_path, monkeypatch):
    path = tmp_path / "maintd.toml"
    path.write_text('[rescuer.queues."fast api"]\nrescue_stuck_jobs_after = "2m"\n'
                    '[rescuer.kinds.video]\nrescue_stuck_jobs_after = "3h"\n')
    monkeypatch.setenv("MAINTD_RESCUER__KINDS__VIDEO__HEARTBEAT_TIMEOUT", "5m")
    cfg = load_settings(path).rescuer
    assert cfg.rule(kind="video", queue="fast api").rescue_stuck_jobs_after == timedelta(hours=3)
    assert cfg.rule(kind="video").heartbeat_timeout == timedelta(minutes=5)
    assert cfg.rule(kind="x", queue="fast api").rescue_stuck_jobs_after == timedelta(minutes=2)
    assert cfg.precise_timing is True


# -- stalled events ---------------------------------------------------------------------------------


@contextmanager
def listening(pg_dsn, channel):
    conn = psycopg.connect(pg_dsn, autocommit=True)
    try:
        conn.execute(f'LISTEN "{channel}"')
        yield conn
    finally:
        conn.close()


def received(conn, timeout=0.5) -> list[dict]:
    return [json.loads(n.payload) for n in conn.notifies(timeout=timeout, stop_after=None)]


def test_each_rescued_job_is_announced(settings, engine, schema, clock, pg_dsn):
    settings.rescuer.precise_timing = False
    settings.rescuer.batch_size = 2
    retry = add(engine, schema, seen_ago=timedelta(hours=2), queue='a "q"\\ é\n', kind="mail.send", attempt=3, n=3)
    last = add(engine, schema, seen_ago=timedelta(hours=2), kind="x" * 128, attempt=5, max_attempts=5)
    alive = add(engine, schema, seen_ago=timedelta(minutes=5))
    with engine.begin() as conn:  # no sign of life at all: rescued by the other statement, announced too
        blank = conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, attempt) VALUES ('blank', 'running', 1) "
                                 "RETURNING id", schema)).scalar()
    with listening(pg_dsn, events_channel(schema)) as conn:
        Rescuer(settings.rescuer).run_once(ctx_for(settings, engine, clock))
        events = received(conn)
    assert sorted(events, key=lambda e: e["id"]) == sorted(
        [{"event": "stalled", "id": i, "queue": 'a "q"\\ é\n', "kind": "mail.send", "attempt": 3,
          "outcome": "retryable"}
         for i in retry]
        + [{"event": "stalled", "id": last[0], "queue": "default", "kind": "x" * 128, "attempt": 5,
            "outcome": "discarded"},
           {"event": "stalled", "id": blank, "queue": "default", "kind": "blank", "attempt": 1,
            "outcome": "retryable"}], key=lambda e: e["id"])
    assert alive[0] not in {e["id"] for e in events}


class CrashBeforeCommit(PassContext):
    """The rescue's statement runs, then the transaction fails before its commit."""

    @contextmanager
    def transaction(self, **kw):
        with super().transaction(**kw) as conn:
            yield conn
            raise RuntimeError("crash before commit")


def test_a_rolled_back_rescue_announces_nothing(settings, engine, schema, clock, pg_dsn):
    settings.rescuer.precise_timing = False
    ids = add(engine, schema, seen_ago=timedelta(hours=2), n=3)
    with listening(pg_dsn, events_channel(schema)) as conn:
        with pytest.raises(RuntimeError, match="crash before commit"):
            Rescuer(settings.rescuer).run_once(CrashBeforeCommit.for_settings(settings, engine, clock))
        assert received(conn) == []
        assert {states(engine, schema)[i] for i in ids} == {"running"}
        Rescuer(settings.rescuer).run_once(ctx_for(settings, engine, clock))
        assert sorted(e["id"] for e in received(conn)) == ids


def test_events_can_be_turned_off(settings, engine, schema, clock, pg_dsn):
    settings.rescuer.precise_timing = False
    settings.rescuer.events = False
    ids = add(engine, schema, seen_ago=timedelta(hours=2), n=2)
    with listening(pg_dsn, events_channel(schema)) as conn:
        result = Rescuer(settings.rescuer).run_once(ctx_for(settings, engine, clock))
        assert result.retried == 2 and received(conn) == []
    assert {states(engine, schema)[i] for i in ids} == {"retryable"}


def test_a_full_notify_queue_does_not_stop_rescues(layout, caplog):
    """PostgreSQL's NOTIFY queue is one for the whole server; a session that LISTENs (on any channel,
    for any application) and then sits idle in a transaction keeps every notification from being
    freed, and once the queue is full COMMIT of any transaction that notifies fails ("too many
    notifications in the NOTIFY queue", SQLSTATE 54000; PostgreSQL's documentation, sql-notify.html,
    Notes: a full queue fails the COMMIT of every transaction that notifies). The rescue and its ``stalled``
    events were one transaction, so every pass failed and no stuck job left ``running`` for as
    long as that session stayed. Rescue matters more than the events (the scheduler's NOTIFY
    goes the same way, test_scheduler): the batch is redone without them, with a warning. On a
    PostgreSQL 18 of its own (max_notify_queue_pages exists from 17 on)."""
    from .notify_queue import notify_queue_full

    with notify_queue_full(layout) as (dsn, engine):
        _rescue_with_the_notify_queue_full(dsn, engine, layout, caplog)


def _rescue_with_the_notify_queue_full(dsn: str, engine, layout: str, caplog) -> None:
    import logging

    from maintd.config import Settings

    from .conftest import TEST_PARTITIONS

    with engine.begin() as conn:  # stuck (the keyset's batch), and no sign of life (the other one)
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at) SELECT 'k', "
                         "'running', 1, now() - interval '2 hours' FROM generate_series(1, 3)", "maintd"))
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, attempt) VALUES ('blank', 'running', 1)",
                         "maintd"))
    settings = Settings(database_url=dsn, schema="maintd", layout=layout, partitions=TEST_PARTITIONS,
                        instance_id="test-1")
    settings.rescuer.precise_timing = False
    with caplog.at_level(logging.WARNING, logger="maintd"):
        result = Rescuer(settings.rescuer).run_once(PassContext.for_settings(settings, engine, ServerClock()))
    assert (result.retried, result.discarded) == (4, 0)
    assert set(states(engine, "maintd").values()) == {"retryable"}
    assert any("NOTIFY queue" in r.getMessage() and "without their stalled events" in r.getMessage()
               and getattr(r, "fields", {}).get("schema") == "maintd" for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


def test_events_channel_follows_the_schema():
    assert events_channel("maintd") == "maintd_events"
    assert events_channel("tenant_a") == "tenant_a_maintd_events"


# -- precise timing ------------------------------------------------------------------------------


def server_now(engine):
    with engine.connect() as conn:
        return conn.execute(text("SELECT now()")).scalar()


def rescued_at(engine, schema, job_id):
    with engine.connect() as conn:
        row = conn.execute(sql("SELECT state::text, CAST(errors -> 0 ->> 'at' AS timestamptz) AS at, "
                               "attempted_at FROM {schema}.jobs WHERE id = :id", schema), {"id": job_id}).one()
    return row


def test_a_stuck_job_leaves_running_within_a_second_of_its_deadline(settings, engine, schema):
    """A real Runner, rescuer.interval at its default (30 s): each job is rescued within 1 s after
    its deadline (attempted_at + rescue_stuck_jobs_after), not at the next tick."""
    settings = rules(settings, rescue_stuck_jobs_after="10s")
    assert settings.rescuer.interval == timedelta(seconds=30) and settings.rescuer.precise_timing
    settings.scheduler.enabled = settings.cleaner.enabled = False
    first = add(engine, schema, at=timedelta(seconds=-7))[0]    # due in about 3 s
    second = add(engine, schema, at=timedelta(seconds=-4.5))[0]  # due in about 5.5 s
    runner = Runner(settings, engine, Metrics(), clock=ServerClock())
    runner.start()
    runner.activate(NoFence())
    try:
        deadline = time.monotonic() + 12
        while time.monotonic() < deadline and rescued_at(engine, schema, second).state == "running":
            time.sleep(0.05)
    finally:
        runner.shutdown()
    for job in (first, second):
        row = rescued_at(engine, schema, job)
        assert row.state == "retryable", "not rescued before the next tick: no precise timing"
        late = row.at - (row.attempted_at + timedelta(seconds=10))
        assert timedelta(0) < late < timedelta(seconds=1), late


def rescuer_passes(metrics) -> float:
    return sum(metrics.registry.get_sample_value("maintd_service_runs_total", {
        "target": "maintd", "service": "rescuer", "outcome": o}) or 0 for o in ("success", "error"))


def test_many_jobs_falling_due_get_a_pass_at_most_every_min_wake(settings, engine, schema):
    """3,000 jobs falling due one millisecond apart over 3 s: the rescuer runs at most one pass
    per MIN_WAKE (here ~60, not ~3,000) and still rescues each within two seconds of its deadline
    (under one when idle)."""
    settings = rules(settings, rescue_stuck_jobs_after="10s", interval="30s")
    settings.scheduler.enabled = settings.cleaner.enabled = False
    ids = add(engine, schema, at=timedelta(seconds=-9), n=3000)
    metrics = Metrics()
    runner = Runner(settings, engine, metrics, clock=ServerClock())
    runner.start()
    started = time.monotonic()
    runner.activate(NoFence())
    try:
        wait_for(lambda: states(engine, schema) and "running" not in states(engine, schema).values(), 10,
                 what="every job rescued")
        elapsed = time.monotonic() - started
        passes = rescuer_passes(metrics)
    finally:
        runner.shutdown()
    assert 2 <= passes <= elapsed / MIN_WAKE + 2, (passes, elapsed)
    with engine.connect() as conn:
        worst = conn.execute(sql("SELECT max(CAST(errors -> 0 ->> 'at' AS timestamptz) - attempted_at) "
                                 "FROM {schema}.jobs WHERE id = ANY(:ids)", schema), {"ids": ids}).scalar()
    assert worst < timedelta(seconds=12), worst  # 2 s late at most (idle: under 1 s; 1.12 s once on a loaded CI machine)


def test_a_job_the_rescue_cannot_take_does_not_make_it_spin(settings, engine, schema):
    """A stuck job locked by a worker (finishing it) is skipped; the pass does not ask for another
    at its past deadline, again and again: it leaves it to the next tick."""
    settings = rules(settings, rescue_stuck_jobs_after="10s", interval="3s")
    locked = add(engine, schema, at=timedelta(seconds=-20))
    with jobs_locked(engine, schema, locked):
        result = Rescuer(settings.rescuer).run_once(ctx_for(settings, engine, ServerClock()))
    assert (result.retried, result.wake_at()) == (0, None)


def test_without_precise_timing_the_pass_asks_for_no_pass(settings, engine, schema):
    settings = rules(settings, rescue_stuck_jobs_after="10s", interval="5s", precise_timing=False)
    job = add(engine, schema, at=timedelta(seconds=-8))[0]
    result = Rescuer(settings.rescuer).run_once(ctx_for(settings, engine, ServerClock()))
    assert result.wake_at() is None and states(engine, schema)[job] == "running"



def test_a_job_whose_deadline_is_exactly_the_pass_s_reading_gets_a_pass_at_once(settings, engine, schema):
    """A job whose stuck deadline is the very microsecond of the pass's reading of the clock is not
    stuck yet (not older than its limit) and is the next deadline to wait for: the pass asks for
    another MIN_WAKE later. With the deadline window open at its start (``>`` for ``>=``) that job
    was nobody's (not the batch's, not the probe's), and with nothing else due the pass looked
    again only a whole grace later: rescued 10 s late here (up to the interval without a short
    grace)."""
    from maintd.clock import FrozenClock

    settings = rules(settings, rescue_stuck_jobs_after="10s", interval="60s")
    with engine.begin() as conn:
        at = conn.execute(sql("SELECT date_trunc('second', now()) - interval '1 minute'", schema)).scalar()
    [job] = add(engine, schema, seen_ago=T0 - at + timedelta(seconds=10))  # attempted_at = at - 10 s
    result = Rescuer(settings.rescuer).run_once(ctx_for(settings, engine, FrozenClock(at)))
    assert states(engine, schema) == {job: "running"} and result.retried == 0
    assert result.wake_at() is not None and result.wake_at() - at <= timedelta(seconds=1), result.wake_at() - at


def test_a_job_whose_deadline_is_exactly_the_next_tick_is_left_to_the_tick(settings, engine, schema):
    """The window's other edge: a job whose stuck deadline is the very microsecond of the next tick
    (the pass's reading plus the interval, the grace no shorter) is the tick's (its batch rescues
    it, or its probe asks for a pass just after the deadline): this pass asks for none. With the
    window closed at its end (``<=`` for ``<``) it asked for a pass a millisecond after the tick,
    a second pass for the tick's job."""
    from maintd.clock import FrozenClock

    settings = rules(settings, rescue_stuck_jobs_after="10s", interval="5s")
    with engine.begin() as conn:
        at = conn.execute(sql("SELECT date_trunc('second', now()) - interval '1 minute'", schema)).scalar()
    [job] = add(engine, schema, seen_ago=T0 - at + timedelta(seconds=5))  # attempted_at = at - 5 s: due at at + 5 s
    result = Rescuer(settings.rescuer).run_once(ctx_for(settings, engine, FrozenClock(at)))
    assert states(engine, schema) == {job: "running"} and result.retried == 0
    assert result.wake_at() is None, f"asked for a pass {result.wake_at() - at} after the pass's reading"


def test_a_pass_asks_for_one_just_after_the_next_deadline(settings, engine, schema):
    """A job stuck in about 5 s (within the 30 s interval): the pass asks for a pass just after
    its deadline; after the term ends, none is left waiting."""
    settings = rules(settings, rescue_stuck_jobs_after="10s")
    settings.scheduler.enabled = settings.cleaner.enabled = False
    [job] = add(engine, schema, at=timedelta(seconds=-5))
    with engine.connect() as conn:
        deadline = conn.execute(sql("SELECT attempted_at + interval '10 seconds' FROM {schema}.jobs "
                                    "WHERE id = :id", schema), {"id": job}).scalar()
    result = Rescuer(settings.rescuer).run_once(ctx_for(settings, engine, ServerClock()))
    assert timedelta(0) < result.wake_at() - deadline <= timedelta(milliseconds=1)
    runner = Runner(settings, engine, Metrics(), clock=ServerClock())
    runner.start()
    runner.activate(NoFence())
    try:
        wait_for(lambda: "rescuer" in runner._wakes, 5, what="the pass asked for")
        runner.deactivate()
        assert runner.timetable.get_jobs() == []
    finally:
        runner.shutdown()


def test_the_probe_is_planned_as_an_ordered_index_walk(settings, engine, schema):
    """The service sets the probe's planner settings in the probe's own transaction, right before it
    (see RESCUER_PROBE_PLANNING: otherwise a sort of every heartbeating job in the window)."""
    from sqlalchemy import event

    settings = rules(settings, rescue_stuck_jobs_after="10s", interval="1s")
    seen: list[str] = []
    listener = lambda conn, cursor, statement, *a: seen.append(statement)  # noqa: E731
    event.listen(engine, "before_cursor_execute", listener)
    try:
        Rescuer(settings.rescuer).run_once(ctx_for(settings, engine, ServerClock()))
    finally:
        event.remove(engine, "before_cursor_execute", listener)
    probe = next(i for i, s in enumerate(seen) if "AS deadline" in s)
    assert "enable_bitmapscan" in seen[probe - 1] and "enable_sort" in seen[probe - 1]


def test_each_pass_logs_what_it_rescued(settings, engine, schema, caplog):
    """Each pass says what it rescued, as it happens: two stuck now, one 1.5 s later."""
    import logging

    settings = rules(settings, rescue_stuck_jobs_after="10s", interval="4s")
    add(engine, schema, at=timedelta(seconds=-20), n=2)  # stuck now
    add(engine, schema, at=timedelta(seconds=-8.5))      # stuck in about 1.5 s
    clock, total = ServerClock(), 0
    with caplog.at_level(logging.INFO, logger="maintd.rescuer"):
        for _ in range(10):
            result = Rescuer(settings.rescuer).run_once(ctx_for(settings, engine, clock))
            total += result.retried
            if result.wake_at() is None or total == 3:
                break
            time.sleep(max(0.0, (result.wake_at() - clock.now()).total_seconds()))
    assert total == 3
    assert [r.fields for r in caplog.records if r.getMessage() == "released stale running jobs"] == [
        {"count": 2, "retried": 2, "discarded": 0}, {"count": 1, "retried": 1, "discarded": 0}]


@contextmanager
def passing(settings, engine) -> Iterator[threading.Event]:
    """The rescuer of a leading runner (real clock, its passes and the ones they ask for);
    stopped on the way out. Yields the event set once its first deadline probe has run."""
    from sqlalchemy import event

    probed = threading.Event()

    def after(conn, cursor, statement, *a):
        if "AS deadline" in statement:
            probed.set()

    event.listen(engine, "after_cursor_execute", after)
    runner = Runner(settings, engine, Metrics(), clock=ServerClock(), build=lambda s: {"rescuer": Rescuer(s.rescuer)})
    runner.start()
    runner.activate(NoFence())
    try:
        yield probed
    finally:
        runner.shutdown()
        event.remove(engine, "after_cursor_execute", after)


def wait_rescued(engine, schema, job_id, seconds: float):
    deadline = time.monotonic() + seconds
    while rescued_at(engine, schema, job_id).state == "running" and time.monotonic() < deadline:
        time.sleep(0.02)
    return rescued_at(engine, schema, job_id)


def test_a_heartbeat_deadline_is_waited_for_exactly(settings, engine, schema):
    """heartbeat_timeout 5 s (rescue_stuck_jobs_after 1 h, interval 10 s): a job that heartbeated
    4.5 s ago falls due in 0.5 s by its heartbeat. The pass's probe finds that deadline (the
    grace of a heartbeating job is the shorter of its two rules), asks for a pass then, and that
    one rescues it within a second of it. A grace that ignored heartbeat_timeout found nothing,
    and the look-again fallback (at the shortest grace, 5 s) rescued it 4.5 s late; without the
    heartbeat grace among the probed ones, at the next tick."""
    settings = rules(settings, rescue_stuck_jobs_after="1h", heartbeat_timeout="5s", interval="10s")
    with engine.begin() as conn:
        job = conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at, attempted_by, heartbeat_at)"
            " VALUES ('k', 'running', 1, now() - interval '10 minutes', 'w1', now() - interval '4.5 seconds')"
            " RETURNING id", schema)).scalar_one()
        beat = conn.execute(sql("SELECT heartbeat_at FROM {schema}.jobs WHERE id = :id", schema),
                            {"id": job}).scalar_one()
    with passing(settings, engine):
        row = wait_rescued(engine, schema, job, 8)
    assert row.state == "retryable", "not rescued before the next tick"
    late = row.at - (beat + timedelta(seconds=5))
    assert timedelta(0) < late < timedelta(seconds=1), late


def test_a_job_claimed_after_the_probe_is_rescued_by_the_pass_looking_again(settings, engine, schema):
    """The probe reads deadlines up to the shortest grace ahead; a job claimed after it (here just
    after the first probe found nothing) cannot fall due before then. So the pass asks to look
    again at the shortest grace, and that pass asks for one at the new job's deadline: rescued
    within a second of it, not at the next tick (10 s). Without that fallback nothing was asked."""
    settings = rules(settings, rescue_stuck_jobs_after="2s", interval="10s")
    with passing(settings, engine) as probed:
        assert probed.wait(10), "the pass did not probe"
        with engine.begin() as conn:
            job = conn.execute(sql(
                "INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at, attempted_by)"
                " VALUES ('k', 'running', 1, clock_timestamp(), 'w1') RETURNING id", schema)).scalar_one()
        row = wait_rescued(engine, schema, job, 6)
    assert row.state == "retryable", "not rescued before the next tick"
    late = row.at - (row.attempted_at + timedelta(seconds=2))
    assert timedelta(0) < late < timedelta(seconds=1), late


def test_a_job_falling_due_while_the_database_was_read_only_is_rescued_once_it_takes_writes(settings, engine,
                                                                                              schema):
    """rescue_stuck_jobs_after 2 s, interval 30 s. While the database takes no writes (a read-only
    primary) no pass runs, and the passes asked for meanwhile (here the look again at +2 s) are
    dropped. Once it takes writes again, a job that fell due meanwhile is rescued within a second,
    not at the rescuer's next look (its interval later; here, with no probe, never)."""
    settings = rules(settings, rescue_stuck_jobs_after="2s", interval="30s")
    runner = Runner(settings, engine, Metrics(), clock=ServerClock(), build=lambda s: {"rescuer": Rescuer(s.rescuer)})
    runner.start()
    runner.activate(NoFence())
    try:
        wait_for(lambda: "rescuer" in runner.last_runs, 10, what="the term's first pass")
        runner.pause(True)
        with engine.begin() as conn:
            job = conn.execute(sql(
                "INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at, attempted_by)"
                " VALUES ('k', 'running', 1, clock_timestamp(), 'w1') RETURNING id", schema)).scalar_one()
        time.sleep(3)  # stuck 2 s after its claim; the passes asked for meanwhile did not run
        assert rescued_at(engine, schema, job).state == "running"
        resumed = server_now(engine)
        runner.pause(False)
        row = wait_rescued(engine, schema, job, 5)
    finally:
        runner.shutdown()
    assert row.state == "retryable", "not rescued after the database took writes again"
    assert row.at - resumed < timedelta(seconds=1), row.at - resumed


@pytest.mark.parametrize("rescuer,oldest,wanted", [
    # (the rescuer's section, the oldest sign of life a probe read, seconds before now; the pass
    # the probe asks for, seconds from now: None, none before the next look)
    ({"rescue_stuck_jobs_after": "2s", "interval": "10s"}, None, 2.001),  # nothing running: look again
    ({"rescue_stuck_jobs_after": "2s", "interval": "10s"}, 0.5, 1.501),  # a job's deadline comes first
    ({"rescue_stuck_jobs_after": "2s", "interval": "10s"}, 3.0, True),  # stuck now
    ({"rescue_stuck_jobs_after": "1h", "heartbeat_timeout": "5s", "interval": "30s"}, None, 5.001),
    ({"rescue_stuck_jobs_after": "1h", "interval": "30s"}, None, None),  # the next look comes first
    ({"rescue_stuck_jobs_after": "1h", "interval": "30s"}, 3600 - 20, 20.001),
    ({"rescue_stuck_jobs_after": "2s", "interval": "10s", "precise_timing": False}, None, None),
])
def test_the_probe_keeps_looking_again_at_the_shortest_grace_when_it_is_below_the_interval(rescuer, oldest, wanted):
    """A pass with precise timing asks to look again at the shortest grace (a job claimed later
    falls due then at the earliest), and so each pass asks for the next. A pass that failed (a
    connection cut, a lock or statement timeout) asked for none, and the probe, with no job
    running, asked for none either: the chain of looks ended, and until a probe next saw a running
    job, a job claimed after a look was rescued at the probe an interval later (SPEC 7.7: within
    1 s of its deadline, whatever the interval). The probe now asks for the look again itself."""
    now = T0
    service = Rescuer(load_settings(None, database_url="postgresql://u@127.0.0.1/app", rescuer=rescuer).rescuer)
    seen = None if oldest is None else now - timedelta(seconds=oldest)
    got = service.after_probe((seen, False, False, None), now)
    assert got == (wanted if wanted in (None, True) else now + timedelta(seconds=wanted)), got
