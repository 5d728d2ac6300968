"""Periodic enqueuer: exactly once per slot, backfill edges, baselines, run_on_start, unique_key."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from maintd.clock import FrozenClock
from maintd.config import Settings
from maintd.queries import sql
from maintd.metrics import Metrics

from .conftest import run_concurrently
from maintd.services.base import PassContext
from maintd.services.periodic import ENQUEUED, SKIPPED, PeriodicEnqueuer

# Every test here runs on both jobs layouts (SPEC 8.1): tests/conftest.py.
pytestmark = pytest.mark.both_layouts

UTC = timezone.utc
START = datetime(2026, 3, 1, 12, 0, 0, 500000, tzinfo=UTC)


def make_settings(pg_dsn, schema, **entry):
    base = {"id": "tick", "schedule": "@every 10s", "kind": "tick.kind", "queue": "periodic",
            "args": {"a": 1}}
    return Settings(database_url=pg_dsn, schema=schema, periodic=[{**base, **entry}])


def run(settings, engine, clock, service=None, **kw):
    service = service or PeriodicEnqueuer(settings.periodic)
    return service.run_once(PassContext.for_settings(settings, engine, clock, **kw))


def jobs(engine, schema):
    with engine.connect() as conn:
        return list(conn.execute(sql(
            "SELECT id, kind, queue, args, scheduled_at, state, metadata, unique_key FROM {schema}.jobs "
            "ORDER BY scheduled_at, id", schema)))


def slots(engine, schema):
    with engine.connect() as conn:
        return [r.slot for r in conn.execute(sql(
            "SELECT slot FROM {schema}.periodic_slots ORDER BY slot", schema))]


def test_new_id_is_baselined_not_backfilled_then_enqueues_each_slot(pg_dsn, schema, engine):
    settings = make_settings(pg_dsn, schema, backfill="1h")
    clock = FrozenClock(START)
    result = run(settings, engine, clock)
    assert result.enqueued == [] and result.baselined == ["tick"]
    assert jobs(engine, schema) == []
    clock.advance(10)  # 12:00:10.5 -> slot 12:00:10
    result = run(settings, engine, clock)
    [job] = jobs(engine, schema)
    assert job.scheduled_at == datetime(2026, 3, 1, 12, 0, 10, tzinfo=UTC)
    assert (job.kind, job.queue, job.args) == ("tick.kind", "periodic", {"a": 1})
    assert job.metadata == {"periodic_id": "tick", "slot": "2026-03-01T12:00:10+00:00", "backfilled": False}
    assert job.state == "available"
    assert [e["periodic_id"] for e in result.enqueued] == ["tick"]
    # Same slot again: nothing.
    assert run(settings, engine, clock).enqueued == []
    assert len(jobs(engine, schema)) == 1


def test_two_instances_at_once_enqueue_each_slot_once(pg_dsn, schema, engine):
    settings = make_settings(pg_dsn, schema, backfill="10m")
    clock = FrozenClock(START)
    run(settings, engine, clock)
    clock.advance(300)  # 30 slots due
    results = run_concurrently(lambda: run(settings, engine, clock), 3)
    got = [j.scheduled_at for j in jobs(engine, schema)]
    assert len(got) == 30 and len(set(got)) == 30
    assert sum(len(r.enqueued) for r in results) == 30


def test_skewed_replica_does_not_double_a_slot(pg_dsn, schema, engine):
    settings = make_settings(pg_dsn, schema, backfill="5m")
    a, b = FrozenClock(START), FrozenClock(START - timedelta(seconds=3))
    run(settings, engine, a)
    for step in range(20):
        a.advance(2.7)
        b.advance(2.7)
        run(settings, engine, a if step % 2 else b)
        run(settings, engine, b if step % 2 else a)
    got = [j.scheduled_at for j in jobs(engine, schema)]
    assert len(got) == len(set(got))
    # Every slot up to the fastest clock (START + 20 x 2.7 s = 12:00:54.5), once.
    assert a.now() == START + timedelta(seconds=54)
    assert got == [datetime(2026, 3, 1, 12, 0, s, tzinfo=UTC) for s in (10, 20, 30, 40, 50)]


def test_deleted_jobs_do_not_make_a_slot_fire_again(pg_dsn, schema, engine):
    settings = make_settings(pg_dsn, schema, backfill="1h")
    clock = FrozenClock(START)
    run(settings, engine, clock)
    clock.advance(30)
    run(settings, engine, clock)
    assert len(jobs(engine, schema)) == 3
    with engine.begin() as conn:  # what the cleaner does
        conn.execute(sql("DELETE FROM {schema}.jobs", schema))
    result = run(settings, engine, clock)
    assert result.enqueued == [] and jobs(engine, schema) == []



def test_pruning_keeps_the_newest_slot_of_an_entry_that_fires_rarely(pg_dsn, schema, engine):
    """A yearly entry's last slot is older than the slot history kept: the prune must keep it (the
    high-water mark), or the next leader takes the entry for a new one and baselines it, and the
    slot it missed during a failover within the backfill window is never enqueued."""
    settings = make_settings(pg_dsn, schema, schedule="@yearly", backfill="1d")
    clock = FrozenClock(START)
    run(settings, engine, clock)  # baseline
    clock.advance((datetime(2027, 1, 1, 0, 0, 1, tzinfo=UTC) - clock.now()).total_seconds())
    leader = PeriodicEnqueuer(settings.periodic)
    assert len(run(settings, engine, clock, leader).enqueued) == 1  # 2027-01-01
    clock.advance(100 * 86400)
    run(settings, engine, clock, leader)  # prunes the slot history
    # The leader is down over the next slot; its successor comes an hour late.
    clock.advance((datetime(2028, 1, 1, 1, 0, 0, tzinfo=UTC) - clock.now()).total_seconds())
    result = run(settings, engine, clock)
    assert [e["slot"] for e in result.enqueued] == ["2028-01-01T00:00:00+00:00"]
    assert [j.scheduled_at for j in jobs(engine, schema)] == [
        datetime(2027, 1, 1, tzinfo=UTC), datetime(2028, 1, 1, tzinfo=UTC)]

def test_backfill_window_edges_oldest_first(pg_dsn, schema, engine):
    settings = make_settings(pg_dsn, schema, backfill="60s")
    clock = FrozenClock(datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC))
    run(settings, engine, clock)  # baseline at 12:00:00
    clock.set(datetime(2026, 3, 1, 12, 5, 0, tzinfo=UTC))  # downtime: 30 slots missed
    metrics = Metrics()
    service = PeriodicEnqueuer(settings.periodic)
    result = run(settings, engine, clock, service=service)
    service.observe(metrics, result)
    got = [j.scheduled_at for j in jobs(engine, schema)]
    # Window [12:04:00, 12:05:00]: the slot exactly at the edge is in, 12:03:50 is out.
    assert got[0] == datetime(2026, 3, 1, 12, 4, 0, tzinfo=UTC)
    assert got[-1] == datetime(2026, 3, 1, 12, 5, 0, tzinfo=UTC)
    assert len(got) == 7 and got == sorted(got)
    metas = [j.metadata for j in jobs(engine, schema)]
    assert all(m["backfilled"] for m in metas[:-1]) and not metas[-1]["backfilled"]
    assert result.skipped == {"tick": {"outside_backfill": 23}}
    assert metrics[SKIPPED].labels("tick", "outside_backfill")._value.get() == 23
    assert metrics[ENQUEUED].labels("tick")._value.get() == 7


def test_a_latest_slot_just_outside_the_backfill_window_runs_in_that_pass(pg_dsn, schema, engine):
    """The window is ``[now - backfill, now]``: a pass one microsecond after it has closed on the
    latest slot runs that slot all the same (as any later pass would), never an empty pass. An
    empty one went quiet until the next slot, whose pass counted this one outside_backfill."""
    settings = make_settings(pg_dsn, schema, backfill="1s")
    clock = FrozenClock(datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC))
    service = PeriodicEnqueuer(settings.periodic)
    run(settings, engine, clock, service)  # baseline at 12:00:00
    clock.set(datetime(2026, 3, 1, 12, 0, 11, 1, tzinfo=UTC))  # 12:00:10 + backfill + 1 µs
    result = run(settings, engine, clock, service)
    assert [(e["slot"], e["backfilled"]) for e in result.enqueued] == [("2026-03-01T12:00:10+00:00", False)]
    assert result.skipped == {}
    clock.set(datetime(2026, 3, 1, 12, 0, 20, tzinfo=UTC))
    assert [e["slot"] for e in run(settings, engine, clock, service).enqueued] == ["2026-03-01T12:00:20+00:00"]
    assert [j.scheduled_at for j in jobs(engine, schema)] == [
        datetime(2026, 3, 1, 12, 0, 10, tzinfo=UTC), datetime(2026, 3, 1, 12, 0, 20, tzinfo=UTC)]


def test_without_backfill_only_the_latest_missed_slot_runs(pg_dsn, schema, engine):
    settings = make_settings(pg_dsn, schema)
    clock = FrozenClock(datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC))
    run(settings, engine, clock)
    clock.set(datetime(2026, 3, 1, 12, 1, 5, tzinfo=UTC))
    result = run(settings, engine, clock)
    assert [j.scheduled_at for j in jobs(engine, schema)] == [datetime(2026, 3, 1, 12, 1, 0, tzinfo=UTC)]
    assert result.skipped == {"tick": {"outside_backfill": 5}}


def test_a_backfill_window_shorter_than_the_delay_still_runs_the_latest_missed_slot(pg_dsn, schema, engine):
    """A backfill only adds runs: a nightly entry with ``backfill = "1m"`` whose 03:00 slot is
    first seen at 03:05 (a leader change, a pass delayed) runs it late, as the same entry without
    a backfill does (SPEC 2: the window is for older slots "missed while no leader ran"). It ran
    nothing, the day's run counted outside_backfill; graphile-worker catches up a late timer
    whatever its ``fill`` (src/cron.ts, "Cron fired too late; catching up"). Also for a config
    entry whose schedule changed meanwhile (the slot both schedules have)."""
    day = datetime(2026, 3, 1, tzinfo=UTC)
    for entry_id, later in (("same", "0 3 * * *"), ("changed", "0 3 * * 0-6")):
        clock = FrozenClock(day + timedelta(hours=4))
        run(make_settings(pg_dsn, schema, id=entry_id, schedule="0 3 * * *", backfill="1m"), engine, clock)
        clock.set(day + timedelta(days=1, hours=3, minutes=5))
        result = run(make_settings(pg_dsn, schema, id=entry_id, schedule=later, backfill="1m"), engine, clock)
        assert [(e["slot"], e["backfilled"]) for e in result.enqueued] == [
            ((day + timedelta(days=1, hours=3)).isoformat(), False)], entry_id
        assert result.skipped == {}, entry_id
    # Several missed, none in the window: the latest runs, the older ones are counted.
    clock = FrozenClock(day + timedelta(hours=4))
    run(make_settings(pg_dsn, schema, id="hourly", schedule="0 * * * *", backfill="1m"), engine, clock)
    clock.set(day + timedelta(hours=7, minutes=5))
    result = run(make_settings(pg_dsn, schema, id="hourly", schedule="0 * * * *", backfill="1m"), engine, clock)
    assert [e["slot"] for e in result.enqueued] == [(day + timedelta(hours=7)).isoformat()]
    assert result.skipped == {"hourly": {"outside_backfill": 2}}


def test_run_on_start_enqueues_the_current_slot_once(pg_dsn, schema, engine):
    settings = make_settings(pg_dsn, schema, schedule="0 3 * * *", run_on_start=True)
    clock = FrozenClock(START)
    run(settings, engine, clock)
    run(settings, engine, clock, service=PeriodicEnqueuer(settings.periodic))  # a restart: a new instance
    [job] = jobs(engine, schema)
    assert job.scheduled_at == datetime(2026, 3, 1, 3, 0, tzinfo=UTC)


def test_disabled_entry_enqueues_nothing_and_counts(pg_dsn, schema, engine):
    settings = make_settings(pg_dsn, schema, enabled=False)
    clock = FrozenClock(START)
    service = PeriodicEnqueuer(settings.periodic)
    run(settings, engine, clock, service=service)
    clock.advance(10)
    result = run(settings, engine, clock, service=service)
    assert jobs(engine, schema) == [] and len(slots(engine, schema)) == 1  # taken without a job, the last only
    assert result.skipped == {"tick": {"disabled": 1}}
    # Counted once per slot, whichever daemon takes it: another one at the same slot counts nothing.
    assert run(settings, engine, clock).skipped == {}


def test_an_entry_enabled_again_does_not_backfill_the_slots_it_was_disabled_for(pg_dsn, schema, engine):
    """SPEC 4: backfill is for slots "missed while no leader ran", not for slots skipped on
    purpose (counted as skipped{reason="disabled"}). A nightly job paused Monday and resumed
    Friday must not run four times on resume."""
    on, off = (make_settings(pg_dsn, schema, backfill="1h", enabled=e) for e in (True, False))
    clock = FrozenClock(START)
    run(on, engine, clock)  # baselined
    disabled = PeriodicEnqueuer(off.periodic)
    for _ in range(3):
        clock.advance(10)
        assert run(off, engine, clock, service=disabled).skipped == {"tick": {"disabled": 1}}
    assert len(slots(engine, schema)) == 2  # the baseline and the latest: a paused entry keeps few rows
    assert run(on, engine, clock).enqueued == []
    clock.advance(10)
    assert [e["slot"] for e in run(on, engine, clock).enqueued] == [START.replace(second=40, microsecond=0).isoformat()]
    assert len(jobs(engine, schema)) == 1


def test_pausing_an_entry_keeps_the_slot_of_the_job_it_enqueued(pg_dsn, schema, engine):
    """A paused entry forgets the slot it took without a job when it takes the next (a paused
    entry keeps few rows), never a slot that has its job: disabled at the slot it had just
    enqueued, the next disabled slot must leave that one with its job_id (which job a slot ran)."""
    on, off = (make_settings(pg_dsn, schema, enabled=e) for e in (True, False))
    clock = FrozenClock(START)
    run(on, engine, clock)  # baselined
    clock.advance(10)
    [enqueued] = run(on, engine, clock).enqueued  # this slot has its job
    disabled = PeriodicEnqueuer(off.periodic)
    run(off, engine, clock, service=disabled)  # paused within the same slot: taken already
    clock.advance(10)
    assert run(off, engine, clock, service=disabled).skipped == {"tick": {"disabled": 1}}
    with engine.connect() as conn:
        linked = conn.execute(sql("SELECT slot, job_id FROM {schema}.periodic_slots WHERE job_id IS NOT NULL",
                                  schema)).all()
    [job] = jobs(engine, schema)
    assert [(r.slot.isoformat(), r.job_id) for r in linked] == [(enqueued["slot"], job.id)]


def test_an_entry_paused_in_the_slot_it_enqueued_and_enabled_while_no_leader_ran_does_not_backfill(
        pg_dsn, schema, engine):
    """Paused within the slot it had just enqueued (12:00:10: no new slot to take, the one taken
    has its job), then no leader ran until the entry, enabled again at a time unknown (a config
    file), is seen at 12:00:40: that slot must say paused, or the slots of the pause (12:00:20,
    12:00:30, 12:00:40) were backfilled as missed. It runs from its next slot, 12:00:50."""
    on, off = (make_settings(pg_dsn, schema, backfill="1h", enabled=e) for e in (True, False))
    clock = FrozenClock(START)
    run(on, engine, clock)  # baselined
    clock.advance(10)
    [enqueued] = run(on, engine, clock).enqueued
    assert run(off, engine, clock).skipped == {}  # paused within the same slot: taken already
    clock.advance(30)
    result = run(on, engine, clock)  # the next leader, the entry enabled again
    assert result.enqueued == [] and result.skipped == {}
    clock.advance(10)
    assert [e["slot"] for e in run(on, engine, clock).enqueued] == ["2026-03-01T12:00:50+00:00"]
    assert [j.scheduled_at for j in jobs(engine, schema)] == [
        datetime(2026, 3, 1, 12, 0, 10, tzinfo=UTC), datetime(2026, 3, 1, 12, 0, 50, tzinfo=UTC)]
    assert enqueued["slot"] == "2026-03-01T12:00:10+00:00"


def test_unique_key_skips_while_the_previous_job_lives(pg_dsn, schema, engine):
    settings = make_settings(pg_dsn, schema, unique_key=True, backfill="1h")
    clock = FrozenClock(START)
    run(settings, engine, clock)
    clock.advance(10)
    run(settings, engine, clock)
    clock.advance(10)
    result = run(settings, engine, clock)
    [job] = jobs(engine, schema)
    assert job.unique_key == "periodic:tick"
    assert result.skipped == {"tick": {"duplicate": 1}}
    # The skipped slot stays taken: it does not fire later when the key frees up.
    with engine.begin() as conn:
        conn.execute(sql("UPDATE {schema}.jobs SET state = 'completed', finalized_at = now()", schema))
    assert run(settings, engine, clock).enqueued == []


def test_reload_adds_and_changes_entries(pg_dsn, schema, engine):
    clock = FrozenClock(START)
    first = make_settings(pg_dsn, schema, backfill="1h")
    run(first, engine, clock)
    second = Settings(database_url=pg_dsn, schema=schema, periodic=[
        {"id": "tick", "schedule": "@every 20s", "kind": "tick.kind", "backfill": "1h"},
        {"id": "new", "schedule": "@every 10s", "kind": "new.kind", "backfill": "1h"},
    ])
    clock.advance(40)
    run(second, engine, clock)
    got = [(j.metadata["periodic_id"], j.scheduled_at.second) for j in jobs(engine, schema)]
    assert got == [("tick", 20), ("tick", 40)]  # new id: baseline only


def test_dry_run_takes_no_slot(pg_dsn, schema, engine):
    settings = make_settings(pg_dsn, schema, backfill="1h")
    clock = FrozenClock(START)
    run(settings, engine, clock)
    clock.advance(20)
    result = run(settings, engine, clock, dry_run=True)
    assert len(result.enqueued) == 2
    assert jobs(engine, schema) == [] and len(slots(engine, schema)) == 1



def test_dry_run_says_what_the_pass_then_does_with_a_unique_key(pg_dsn, schema, engine):
    """SPEC 8.4: with a unique key and missed slots, `run-once periodic --dry-run` said "would
    enqueue 3": each slot's transaction was rolled back before the next, so the key the first
    slot's job would hold was free again for the others. The pass then enqueued 1 and skipped 2
    (duplicate). The dry run now sees what its earlier slots would have done."""
    settings = make_settings(pg_dsn, schema, unique_key=True, backfill="1h")
    clock = FrozenClock(START)
    run(settings, engine, clock)  # the baseline
    clock.advance(30)
    dry = run(settings, engine, clock, dry_run=True)
    assert jobs(engine, schema) == [] and len(slots(engine, schema)) == 1
    real = run(settings, engine, clock)
    assert len(jobs(engine, schema)) == 1
    assert (len(dry.enqueued), dry.skipped) == (len(real.enqueued), real.skipped) == (1, {"tick": {"duplicate": 2}})


def test_bad_entries_are_config_errors_naming_the_entry():
    from maintd.config import ConfigError, load_settings

    with pytest.raises(ConfigError, match=r"periodic\[1\] \(id='b'\)\.schedule"):
        load_settings(None, periodic=[{"id": "a", "schedule": "@hourly", "kind": "k"},
                                      {"id": "b", "schedule": "61 * * * *", "kind": "k"}])


def enqueued_over(settings, engine, schema, start: datetime, end: datetime, step: timedelta) -> dict[str, list[str]]:
    """Run the enqueuer every ``step`` from ``start`` to ``end`` (one service, as a daemon
    would); the jobs it enqueued, per periodic id, as local ISO times of their slots."""
    service, t = PeriodicEnqueuer(settings.periodic), start
    while t <= end:
        run(settings, engine, FrozenClock(t), service)
        t += step
    zones = {e.id: ZoneInfo(e.timezone) for e in settings.periodic}
    out: dict[str, list[str]] = {e.id: [] for e in settings.periodic}
    for job in jobs(engine, schema):
        pid = job.metadata["periodic_id"]
        out[pid].append(job.scheduled_at.astimezone(zones[pid]).isoformat())
    return out


def test_through_a_dst_fold_fixed_time_jobs_run_once_and_others_follow_the_clock(pg_dsn, schema, engine):
    """America/New_York, 2026-11-01: 01:00-02:00 happens twice. cronie (man/cron.8): a job at a
    fixed time runs once ("if time was adjusted backward, running the same job twice is
    avoided"); jobs whose minute or hour field starts with '*' are "scheduled normally", in both
    passes. Through the enqueuer, a pass every 10 minutes across the fold."""
    ny = "America/New_York"
    settings = Settings(database_url=pg_dsn, schema=schema, periodic=[
        {"id": "fixed", "schedule": "30 1 * * *", "timezone": ny, "kind": "k"},
        {"id": "minutes", "schedule": "*/30 1 * * *", "timezone": ny, "kind": "k"},
        {"id": "hourly", "schedule": "30 * * * *", "timezone": ny, "kind": "k"}])
    got = enqueued_over(settings, engine, schema, datetime(2026, 11, 1, 3, 50, tzinfo=UTC),
                        datetime(2026, 11, 1, 8, 0, tzinfo=UTC), timedelta(minutes=10))
    assert got == {
        "fixed": ["2026-11-01T01:30:00-04:00"],
        "minutes": ["2026-11-01T01:00:00-04:00", "2026-11-01T01:30:00-04:00",
                    "2026-11-01T01:00:00-05:00", "2026-11-01T01:30:00-05:00"],
        "hourly": ["2026-11-01T00:30:00-04:00", "2026-11-01T01:30:00-04:00", "2026-11-01T01:30:00-05:00",
                   "2026-11-01T02:30:00-05:00"],
    }


def test_a_clock_correction_skips_fixed_time_jobs_of_the_skipped_day(pg_dsn, schema, engine):
    """Samoa (Pacific/Apia) skipped 2011-12-30: 23:59:59 on the 29th (UTC-10) was followed by
    00:00 on the 31st (UTC+14). cronie (man/cron.8): "time changes of more than 3 hours are
    considered to be corrections to the clock or the timezone, and the new time is used
    immediately", so the fixed-time job of the skipped day does not run at the end of the gap
    (as it would after a one-hour change); an hourly job goes on with the new time. Depends on
    which jobs are fixed-time (cronie's MIN_STAR/HR_STAR flags)."""
    apia = "Pacific/Apia"
    settings = Settings(database_url=pg_dsn, schema=schema, periodic=[
        {"id": "noon", "schedule": "0 12 * * *", "timezone": apia, "kind": "k"},
        {"id": "hourly", "schedule": "0 * * * *", "timezone": apia, "kind": "k"}])
    got = enqueued_over(settings, engine, schema, datetime(2011, 12, 29, 21, 30, tzinfo=UTC),
                        datetime(2011, 12, 30, 22, 30, tzinfo=UTC), timedelta(minutes=30))
    assert got["noon"] == ["2011-12-29T12:00:00-10:00", "2011-12-31T12:00:00+14:00"]
    assert got["hourly"][:3] == ["2011-12-29T12:00:00-10:00", "2011-12-29T13:00:00-10:00",
                                 "2011-12-29T14:00:00-10:00"]
    assert "2011-12-29T23:00:00-10:00" in got["hourly"] and "2011-12-31T00:00:00+14:00" in got["hourly"]
    assert len(got["hourly"]) == 25  # 21:00Z (the baseline) to 22:30Z on the 30th: 25 more hours


def test_the_high_water_read_is_one_index_entry_per_entry_whatever_the_history(engine, schema):
    """The newest slot of each entry was a max() grouped by id over every slot of the history
    (62 days of an '@every 1s' entry: five million rows, every pass, and every /status): now one
    entry of the primary key per id, with values known or as a generic plan."""
    from maintd.queries import periodic_slots

    from .plans import explain

    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.periodic_slots (periodic_id, slot, backfilled, instance_id) "
                         "SELECT 'e' || (g % 5), timestamptz '2026-01-01' + g * interval '1 second', false, 'i' "
                         "FROM generate_series(1, 100000) g", schema))
        conn.execute(sql("ANALYZE {schema}.periodic_slots", schema))
    params = {"ids": ["e0", "e1", "e2", "e3", "e4", "absent"]}
    with engine.connect() as conn:
        for generic in (False, True):
            plan = explain(conn, periodic_slots.HIGH_WATER, schema, params, generic=generic)
            assert "Seq Scan" not in plan and "Limit" in plan and "periodic_slots_pkey" in plan, plan
        hwm = {r.periodic_id: r.hwm for r in conn.execute(sql(periodic_slots.HIGH_WATER, schema), params)}
        expected = dict(conn.execute(sql("SELECT periodic_id, max(slot) FROM {schema}.periodic_slots "
                                         "GROUP BY periodic_id", schema)).all())
    assert hwm == expected and len(hwm) == 5


def test_the_slot_prune_deletes_in_batches_keeping_each_entry_s_newest(pg_dsn, schema, engine, monkeypatch):
    """The slot history past what is kept goes in batches of PRUNE_BATCH rows, each its own
    transaction (an '@every 1s' entry leaves 86,400 rows a day; the first prune after weeks of
    history was one DELETE of them all, under one statement timeout), across entries, and each
    entry's newest slot (its high-water mark) stays, however old. Index-backed: a loose scan of
    the primary key for the ids, then each id's oldest slots in its order."""
    from sqlalchemy import event

    from maintd.queries import periodic_slots
    from maintd.services import periodic

    from .plans import at_page_costs, explain

    monkeypatch.setattr(periodic, "PRUNE_BATCH", 10)
    old = START - timedelta(days=100)
    with engine.begin() as conn:  # 'a': 14 old slots; 'b': 8 old and 2 recent; 'c': one old slot, its newest
        conn.execute(sql("INSERT INTO {schema}.periodic_slots (periodic_id, slot, backfilled, instance_id) "
                         "SELECT id, CAST(:old AS timestamptz) + g * interval '1 minute', false, 'i' "
                         "FROM (VALUES ('a', 14), ('b', 8), ('c', 1)) AS e(id, n), generate_series(1, e.n) g", schema),
                     {"old": old})
        conn.execute(sql("INSERT INTO {schema}.periodic_slots (periodic_id, slot, backfilled, instance_id) "
                         "VALUES ('b', :t, false, 'i'), ('b', :t2, false, 'i')", schema),
                     {"t": START - timedelta(hours=1), "t2": START})
        # 'd': an old slot and one at 'infinity' (an import): the old one is its newest that counts
        conn.execute(sql("INSERT INTO {schema}.periodic_slots (periodic_id, slot, backfilled, instance_id) "
                         "VALUES ('d', :old, false, 'i'), ('d', 'infinity', false, 'i')", schema), {"old": old})
    deleted: list[int] = []

    def count(conn, cursor, statement, parameters, context, executemany):
        if "DELETE FROM" in statement and "periodic_slots" in statement:
            deleted.append(cursor.rowcount)

    settings = make_settings(pg_dsn, schema, schedule="@yearly")
    event.listen(engine, "after_cursor_execute", count)
    try:
        run(settings, engine, FrozenClock(START))
    finally:
        event.remove(engine, "after_cursor_execute", count)
    assert deleted == [10, 10, 1]  # 13 of 'a' (all but its newest) and the 8 old ones of 'b'
    with engine.connect() as conn:
        left = conn.execute(sql("SELECT periodic_id, slot FROM {schema}.periodic_slots "
                                "WHERE periodic_id IN ('a', 'b', 'c', 'd') AND isfinite(slot) ORDER BY 1, 2",
                                schema)).all()
    assert left == [("a", old + timedelta(minutes=14)), ("b", START - timedelta(hours=1)), ("b", START),
                    ("c", old + timedelta(minutes=1)), ("d", old)]
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.periodic_slots (periodic_id, slot, backfilled, instance_id) "
                         "SELECT 'e' || (g % 50), timestamptz '2026-01-01' + g * interval '1 second', false, 'i' "
                         "FROM generate_series(1, 100000) g", schema))
        conn.execute(sql("ANALYZE {schema}.periodic_slots", schema))
        for page_cost in at_page_costs(conn):
            for generic in (False, True):
                plan = explain(conn, periodic_slots.PRUNE, schema, {"before": START, "limit": 10_000,
                                                                        "from_id": "", "from_slot": "-infinity"},
                               generic=generic)
                assert "Seq Scan" not in plan and "periodic_slots_pkey" in plan and "Tid Scan" in plan, (page_cost, plan)


def test_a_changed_schedule_runs_no_slot_that_only_the_new_one_has(pg_dsn, schema, engine):
    """A config entry changed from '0 3 * * *' (run at 03:00) to '0 5 * * *', noticed at 10:00:
    the 05:00 slot counted as missed and ran at once, a second run that day; with a backfill, an
    hourly entry changed to '*/5' ran every five minutes since the hour at once. A slot missed is
    now one both schedules have; the entry runs from the new schedule's next slot."""
    day = datetime(2026, 3, 1, tzinfo=UTC)
    clock = FrozenClock(day + timedelta(hours=3, seconds=1))
    nightly = make_settings(pg_dsn, schema, id="nightly", schedule="0 3 * * *", backfill="1d")
    run(nightly, engine, clock)  # baseline 03:00 (first sight, no run_on_start)
    clock.set(day + timedelta(hours=10))
    result = run(make_settings(pg_dsn, schema, id="nightly", schedule="0 5 * * *", backfill="1d"), engine, clock)
    assert result.enqueued == [] and jobs(engine, schema) == []
    clock.set(day + timedelta(days=1, hours=5, seconds=1))
    run(make_settings(pg_dsn, schema, id="nightly", schedule="0 5 * * *", backfill="1d"), engine, clock)
    assert [j.scheduled_at for j in jobs(engine, schema)] == [day + timedelta(days=1, hours=5)]

    clock.set(day + timedelta(hours=10, seconds=1))  # hourly, then every 5 minutes
    run(make_settings(pg_dsn, schema, id="h", schedule="0 * * * *", backfill="1d"), engine, clock)
    clock.set(day + timedelta(hours=10, minutes=32))
    result = run(make_settings(pg_dsn, schema, id="h", schedule="*/5 * * * *", backfill="1d"), engine, clock)
    assert result.enqueued == [] and result.skipped == {}  # 10:00, the newest slot taken, is not tried again
    clock.set(day + timedelta(hours=10, minutes=35, seconds=1))
    result = run(make_settings(pg_dsn, schema, id="h", schedule="*/5 * * * *", backfill="1d"), engine, clock)
    assert [e["slot"] for e in result.enqueued] == [(day + timedelta(hours=10, minutes=35)).isoformat()]

    clock.set(day + timedelta(hours=11, seconds=1))  # a zone is part of the schedule too
    run(make_settings(pg_dsn, schema, id="z", schedule="0 * * * *", backfill="1d"), engine, clock)
    clock.set(day + timedelta(hours=13))
    result = run(make_settings(pg_dsn, schema, id="z", schedule="0 * * * *", timezone="Asia/Kolkata",
                               backfill="1d"), engine, clock)
    assert result.enqueued == []  # Kolkata's hours fall on the half hour: none was ever a slot


def test_a_changed_schedule_still_runs_the_slots_both_schedules_have(pg_dsn, schema, engine):
    """The other side: '@every 10s' down for 40 s, changed to '@every 20s' meanwhile: 20 and 40
    were slots of both, missed, and run (with the backfill)."""
    clock = FrozenClock(START)
    run(make_settings(pg_dsn, schema, backfill="1h"), engine, clock)
    clock.advance(40)
    run(make_settings(pg_dsn, schema, schedule="@every 20s", backfill="1h"), engine, clock)
    assert [j.scheduled_at.second for j in jobs(engine, schema)] == [20, 40]
    clock.advance(20)
    run(make_settings(pg_dsn, schema, schedule="@every 20s", backfill="1h"), engine, clock)
    assert [j.scheduled_at.second for j in jobs(engine, schema)] == [20, 40, 0]


def test_a_changed_schedule_whose_latest_slot_ran_runs_the_new_one_s_next_slot(pg_dsn, schema, engine):
    """'@every 10s' changed to '@every 5s' and first seen just after 12:00:10, a slot of both: it
    runs, and its slot then says the new schedule. The pass at 12:00:15 (the next slot, at which a
    quiet enqueuer wakes) runs that slot, which only the new schedule has: a slot left under the
    old schedule saw the change again, ran none of the new one's slots and took it without a job."""
    base = datetime(2026, 3, 1, 12, 0, 0, 500000, tzinfo=UTC)
    clock = FrozenClock(base)
    run(make_settings(pg_dsn, schema), engine, clock)  # baseline 12:00:00 under '@every 10s'
    new = make_settings(pg_dsn, schema, schedule="@every 5s")
    service = PeriodicEnqueuer(new.periodic)
    clock.set(base + timedelta(seconds=10))
    assert [e["slot"] for e in run(new, engine, clock, service).enqueued] == ["2026-03-01T12:00:10+00:00"]
    with engine.connect() as conn:
        stamps = conn.execute(sql("SELECT slot, schedule FROM {schema}.periodic_slots ORDER BY slot", schema)).all()
    assert [(r.slot.second, r.schedule) for r in stamps] == [(0, "@every 10s (UTC)"), (10, "@every 5s (UTC)")]
    clock.set(base + timedelta(seconds=15))
    result = run(new, engine, clock, service)
    assert [e["slot"] for e in result.enqueued] == ["2026-03-01T12:00:15+00:00"]
    assert result.baselined == [] and result.skipped == {}
    assert [j.scheduled_at.second for j in jobs(engine, schema)] == [10, 15]


def test_the_listing_shows_each_entry_s_newest_slot_and_its_job(pg_dsn, schema, engine):
    """`maintd periodic list`, /status and the dashboard: the last slot is the newest taken (of a
    history of several), with the job it enqueued."""
    from maintd.periodic_table import listing

    settings = make_settings(pg_dsn, schema)
    clock = FrozenClock(START)
    for _ in range(3):  # baseline 12:00:00, then 12:00:10 and 12:00:20 enqueued
        run(settings, engine, clock)
        clock.advance(10)
    newest = jobs(engine, schema)[-1]
    with engine.connect() as conn:
        [entry], more = listing(conn, schema, settings.periodic_entries, clock.now())
    assert (entry["id"], entry["last_slot"], entry["last_job_id"], more) == (
        "tick", datetime(2026, 3, 1, 12, 0, 20, tzinfo=UTC), newest.id, False)
    assert newest.scheduled_at == entry["last_slot"]
    assert entry["next_slot"] == datetime(2026, 3, 1, 12, 0, 40, tzinfo=UTC)


def test_a_long_outage_computes_the_slots_it_enqueues_not_every_slot_missed(pg_dsn, schema, engine, monkeypatch):
    """A leader back after 3 days (or an entry added again after months): the pass made a list
    of every slot since the entry's newest one, to enqueue the latest or the few in its backfill
    window: 259,200 datetimes for an '@every 1s' entry (31 million, gigabytes, after a year).
    Now only the slots it enqueues are computed; the others are counted."""
    from maintd.schedules import IntervalSchedule

    settings = Settings(database_url=pg_dsn, schema=schema, periodic=[
        {"id": "fast", "schedule": "@every 1s", "kind": "k"},
        {"id": "filled", "schedule": "@every 1s", "kind": "k", "backfill": "5s"}])
    clock = FrozenClock(START)
    run(settings, engine, clock)  # both baselined at 12:00:00
    computed = []
    real = IntervalSchedule.next_after
    monkeypatch.setattr(IntervalSchedule, "next_after", lambda self, t: computed.append(t) or real(self, t))
    clock.advance(3 * 86400)
    result = run(settings, engine, clock)
    assert [(e["periodic_id"], e["slot"][11:19]) for e in result.enqueued] == [
        ("fast", "12:00:00"), *[("filled", f"11:59:{s}") for s in range(56, 60)], ("filled", "12:00:00")]
    assert result.skipped == {"fast": {"outside_backfill": 3 * 86400 - 1},
                              "filled": {"outside_backfill": 3 * 86400 - 5}}
    assert len(computed) < 100, f"{len(computed)} slots computed to enqueue 6"


def test_a_prune_that_fails_leaves_the_pass_a_success_and_is_tried_again_a_minute_later(
        pg_dsn, schema, engine, maintd_log):
    """The slot history's prune runs after the pass's slots are enqueued. It failed the whole
    pass (here a lock held on an old slot row past lock_timeout), and, marked done before it ran,
    was not tried again for an hour. Now it is logged, the pass stands, and the next pass a
    minute later prunes."""
    from maintd.db import make_engine

    old = START - timedelta(days=100)
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.periodic_slots (periodic_id, slot, backfilled, instance_id) "
                         "VALUES ('gone', :old, false, 'i'), ('gone', :newer, false, 'i')", schema),
                     {"old": old, "newer": old + timedelta(minutes=1)})
    settings = make_settings(pg_dsn, schema)
    service = PeriodicEnqueuer(settings.periodic)
    clock = FrozenClock(START)
    short = make_engine(pg_dsn, application_name="maintd-test-short", session={"lock_timeout": "300ms"})
    try:
        run(settings, short, clock, service)  # the baseline; its prune runs too
        with engine.connect() as conn:
            assert conn.execute(sql("SELECT count(*) FROM {schema}.periodic_slots WHERE periodic_id = 'gone'",
                                    schema)).scalar() == 1  # the newest of an id always stays
            conn.execute(sql("INSERT INTO {schema}.periodic_slots (periodic_id, slot, backfilled, instance_id) "
                             "VALUES ('gone', :old, false, 'i')", schema), {"old": old})
            conn.commit()
            conn.execute(sql("SELECT 1 FROM {schema}.periodic_slots WHERE slot = :old FOR UPDATE", schema),
                         {"old": old})  # held: the next prune's DELETE waits past lock_timeout
            clock.advance(3600 + 10)
            result = run(settings, short, clock, service)
            conn.rollback()
        assert [e["slot"] for e in result.enqueued][-1:] == [(START + timedelta(seconds=3610)).replace(microsecond=0).isoformat()]
        assert any("could not prune the periodic slots' history" in line for line in maintd_log)
        clock.advance(30)
        run(settings, short, clock, service)  # within the minute: not yet
        assert old in [s for s in slots(engine, schema)]
        clock.advance(40)
        run(settings, short, clock, service)
        assert old not in slots(engine, schema)
    finally:
        short.dispose()


def test_the_metric_series_of_an_entry_removed_by_a_reload_go_with_it(pg_dsn, schema, engine):
    """A reload builds a new enqueuer: it knew the old one's ids but not which of them its
    metric series carried, so the series of an entry the reload removed stayed until a restart."""
    both = Settings(database_url=pg_dsn, schema=schema, periodic=[
        {"id": "kept", "schedule": "@every 10s", "kind": "k", "run_on_start": True},
        {"id": "gone", "schedule": "@every 10s", "kind": "g", "run_on_start": True}])
    metrics, clock = Metrics(target="t"), FrozenClock(START)
    old = PeriodicEnqueuer(both.periodic)
    old.observe(metrics, run(both, engine, clock, old))
    new = PeriodicEnqueuer(both.periodic[:1])
    new.succeed(old)  # what the runner does on a reload
    clock.advance(10)
    new.observe(metrics, run(both, engine, clock, new))
    ids = {s.labels["periodic_id"] for m in metrics.registry.collect() for s in m.samples
           if s.name in ("maintd_periodic_enqueued_total", "maintd_periodic_skipped_total")}
    assert ids == {"kept"}


def test_an_entry_removed_by_a_reload_marks_only_its_newest_slot(pg_dsn, schema, engine):
    """Only an id's newest slot says it was removed (it is the high-water mark): its older slots
    are history, and keep the schedule they were taken under. Marking every slot of the id
    rewrote the whole history of the entry (millions of rows for an '@every 1s' one) in one
    statement."""
    both = Settings(database_url=pg_dsn, schema=schema, periodic=[
        {"id": "kept", "schedule": "@every 10s", "kind": "k", "run_on_start": True},
        {"id": "gone", "schedule": "@every 10s", "kind": "g", "run_on_start": True}])
    clock = FrozenClock(START)
    old = PeriodicEnqueuer(both.periodic)
    for _ in range(3):
        run(both, engine, clock, old)
        clock.advance(10)
    new = PeriodicEnqueuer(both.periodic[:1])
    new.succeed(old)  # what the runner does on a reload
    run(both, engine, clock, new)
    with engine.connect() as conn:
        taken = conn.execute(sql("SELECT schedule FROM {schema}.periodic_slots WHERE periodic_id = 'gone' "
                                 "ORDER BY slot", schema)).scalars().all()
    assert len(taken) == 3 and taken[-1] == "(removed)"
    assert "(removed)" not in taken[:-1], taken


def test_a_changed_schedule_stopped_after_a_missed_slot_runs_no_slot_only_the_new_one_has(pg_dsn, schema, engine):
    """'0 * * * *' changed to '*/30 * * * *' while down, noticed at 11:40: 11:00 (both had it) is
    missed and runs, 11:30 (the new one's only) is taken without a job. A pass stopped between the
    two (a demotion, a second reload) left 11:00 taken under the new schedule: the next pass saw
    nothing changed and ran 11:30 as a missed slot."""
    from maintd.services.base import PassStopped

    class StoppedOnce(PeriodicEnqueuer):
        stops = 1

        def _baseline(self, ctx, entry, slot, result):
            if self.stops:
                self.stops -= 1
                raise PassStopped()
            super()._baseline(ctx, entry, slot, result)

    day = datetime(2026, 3, 1, tzinfo=UTC)
    clock = FrozenClock(day + timedelta(hours=10, seconds=1))
    run(make_settings(pg_dsn, schema, id="h", schedule="0 * * * *"), engine, clock)  # baseline 10:00
    clock.set(day + timedelta(hours=11, minutes=40))
    changed = make_settings(pg_dsn, schema, id="h", schedule="*/30 * * * *")
    with pytest.raises(PassStopped):
        run(changed, engine, clock, StoppedOnce(changed.periodic))
    run(changed, engine, clock)
    assert [j.scheduled_at for j in jobs(engine, schema)] == [day + timedelta(hours=11)]


def test_a_schedule_changed_after_a_long_outage_is_not_walked_slot_by_slot(pg_dsn, schema, engine):
    """'@every 1s' entries changed to '@every 2s' while no leader ran for a year: the pass walked
    each of the new schedule's 15.8 million slots since the newest one taken, asking the old
    schedule about each, for minutes (the leader's pass making no progress). Now the backfill
    window is walked, the slots before it are counted, and without a backfill the latest slot both
    schedules have is found walking back from now."""
    import time

    def settings(every, cron):
        return Settings(database_url=pg_dsn, schema=schema, periodic=[
            {"id": "fast", "schedule": every, "kind": "k"},
            {"id": "filled", "schedule": every, "kind": "k", "backfill": "5s"},
            {"id": "minutes", "schedule": cron, "kind": "k", "backfill": "3m"}])

    clock = FrozenClock(START)
    run(settings("@every 1s", "* * * * *"), engine, clock)  # all baselined at 12:00:00 (2026)
    clock.advance(365 * 86400)
    began = time.monotonic()
    result = run(settings("@every 2s", "*/2 * * * *"), engine, clock)
    took = time.monotonic() - began
    assert took < 10, f"the pass took {took:.0f} s"
    assert [(e["periodic_id"], e["slot"][:19]) for e in result.enqueued] == [
        ("fast", "2027-03-01T12:00:00"),
        *[("filled", f"2027-03-01T11:59:{s}") for s in (56, 58)], ("filled", "2027-03-01T12:00:00"),
        ("minutes", "2027-03-01T11:58:00"), ("minutes", "2027-03-01T12:00:00")]
    assert result.skipped == {"fast": {"outside_backfill": 365 * 43200 - 1},
                              "filled": {"outside_backfill": 365 * 43200 - 3},
                              "minutes": {"outside_backfill": 365 * 720 - 2}}


def test_a_changed_schedule_s_long_backfill_goes_on_over_bounded_passes(pg_dsn, schema, engine):
    """The bound of a pass (``SLOTS_PER_PASS``) on a config entry whose schedule changed while no
    leader ran: the slots both schedules have are enqueued over several passes, every one once,
    before the entry goes on under its new schedule (its latest slot is not taken early, losing
    the rest)."""
    from maintd.services.periodic import SLOTS_PER_PASS

    clock = FrozenClock(START)
    run(make_settings(pg_dsn, schema, schedule="@every 1s", backfill="1d"), engine, clock)  # baseline 12:00:00
    missed = 2 * (SLOTS_PER_PASS + 100)  # every second: half of them are slots of '@every 2s' too
    clock.advance(missed)
    changed = make_settings(pg_dsn, schema, schedule="@every 2s", backfill="1d")
    service = PeriodicEnqueuer(changed.periodic)
    assert len(run(changed, engine, clock, service=service).enqueued) == SLOTS_PER_PASS
    assert service.quiet_until() is None
    assert len(run(changed, engine, clock, service=service).enqueued) == 100
    base = START.replace(microsecond=0)
    assert [j.scheduled_at for j in jobs(engine, schema)] == [base + timedelta(seconds=s) for s in range(2, missed + 1, 2)]
    clock.advance(2)
    assert [e["slot"] for e in run(changed, engine, clock, service=service).enqueued] == [
        (base + timedelta(seconds=missed + 2)).isoformat()]


def test_an_entry_enabled_again_while_no_leader_ran_does_not_backfill_its_pause(pg_dsn, schema, engine):
    """An hourly entry with a day's backfill, disabled in the config at 12:30 (a leader took 13:00
    without a job, marked paused), the leaders stopped at 13:10, and the entry enabled again (its
    schedule changed too, for the second entry) before a leader came back at 16:05: 14:00, 15:00
    and 16:00 were enqueued at once as missed, though some or all of them were its pause's (a config
    file has no change time: when it was enabled again is unknown). As when a leader sees the
    change (README: "enabling it again starts at its next slot, without backfill"), it now runs
    from its next slot."""
    day = datetime(2026, 3, 1, tzinfo=UTC)

    def settings(enabled, changed=False):
        return Settings(database_url=pg_dsn, schema=schema, periodic=[
            {"id": "same", "schedule": "0 * * * *", "kind": "k", "backfill": "1d", "enabled": enabled},
            {"id": "moved", "schedule": "*/30 * * * *" if changed else "0 * * * *", "kind": "k",
             "backfill": "1d", "enabled": enabled}])

    clock = FrozenClock(day + timedelta(hours=11, seconds=1))
    run(settings(True), engine, clock)  # both baselined at 11:00
    clock.set(day + timedelta(hours=12, seconds=1))
    assert len(run(settings(True), engine, clock).enqueued) == 2  # 12:00
    clock.set(day + timedelta(hours=13, seconds=1))
    assert run(settings(False), engine, clock).skipped == {"same": {"disabled": 1}, "moved": {"disabled": 1}}
    clock.set(day + timedelta(hours=16, minutes=5))
    result = run(settings(True, changed=True), engine, clock)
    assert result.enqueued == [], result.enqueued
    clock.set(day + timedelta(hours=16, minutes=30, seconds=1))
    assert [e["periodic_id"] for e in run(settings(True, changed=True), engine, clock).enqueued] == ["moved"]
    clock.set(day + timedelta(hours=17, seconds=1))
    run(settings(True, changed=True), engine, clock)
    with engine.connect() as conn:
        got = conn.execute(sql("SELECT metadata->>'periodic_id', scheduled_at FROM {schema}.jobs "
                               "ORDER BY 1, 2", schema)).all()
    assert [(pid, when - day) for pid, when in got] == [
        ("moved", timedelta(hours=12)), ("moved", timedelta(hours=16, minutes=30)), ("moved", timedelta(hours=17)),
        ("same", timedelta(hours=12)), ("same", timedelta(hours=17))]


def test_a_pass_stopped_mid_entry_counts_no_error_for_the_entry(pg_dsn, schema, engine, caplog):
    """A reload that changes the entries (or a demotion) stops the running pass as the runner does:
    its stop flag set and its query cancelled. The entry whose statement was cancelled was counted
    as failing (maintd_periodic_skipped_total{reason="error"} +1, 'periodic entry failed' logged
    at error level) though nothing was wrong with it: its slot was not taken and the next pass
    takes it. The pass is stopped, and says so."""
    import threading

    from maintd.passes import execute_pass
    from maintd.runner import _stop

    settings = make_settings(pg_dsn, schema)
    clock = FrozenClock(START)
    run(settings, engine, clock)  # the baseline
    clock.advance(10)

    class CancelledMidEntry(PeriodicEnqueuer):
        def _enqueue_once(self, ctx, entry, slot, backfilled, result, stamp=None):
            timer = threading.Timer(0.3, _stop, [ctx])  # the runner's stop, from another thread
            timer.start()
            try:
                with ctx.transaction() as conn:
                    conn.execute(sql("SELECT pg_sleep(10)", schema))
            finally:
                timer.cancel()

    metrics = Metrics(target="t")
    ctx = PassContext.for_settings(settings, engine, clock, stop_event=threading.Event())
    record = execute_pass("periodic", CancelledMidEntry(settings.periodic), ctx, metrics)
    assert record.outcome == "stopped", record.error
    assert not record.result.errors and "error" not in record.result.skipped.get("tick", {})
    assert metrics.registry.get_sample_value("maintd_periodic_skipped_total",
                                             {"target": "t", "periodic_id": "tick", "reason": "error"}) in (None, 0.0)
    assert "periodic entry failed" not in caplog.text
    run(settings, engine, clock)  # the next pass takes the slot
    assert [j.scheduled_at for j in jobs(engine, schema)] == [START.replace(microsecond=0) + timedelta(seconds=10)]


def test_a_pass_stopped_during_its_prune_is_stopped_not_a_success(pg_dsn, schema, engine, caplog, monkeypatch):
    """The prune's cancelled statement (a reload changing the entries, a demotion) was taken for a
    failed prune: 'could not prune the periodic slots' history' logged as a warning, and the pass
    recorded as a success although it was stopped."""
    import threading

    from maintd.passes import execute_pass
    from maintd.queries import periodic_slots
    from maintd.runner import _stop

    settings = make_settings(pg_dsn, schema)
    clock = FrozenClock(START)
    monkeypatch.setattr(periodic_slots, "PRUNE", "SELECT pg_sleep(10) /* :before :limit */")
    ctx = PassContext.for_settings(settings, engine, clock, stop_event=threading.Event())
    service = PeriodicEnqueuer(settings.periodic)
    original = service._prune

    def prune(ctx, now):
        timer = threading.Timer(0.3, _stop, [ctx])  # the runner's stop, from another thread
        timer.start()
        try:
            original(ctx, now)
        finally:
            timer.cancel()

    service._prune = prune
    record = execute_pass("periodic", service, ctx, Metrics(target="t"))
    assert record.outcome == "stopped", (record.outcome, record.error)
    assert "could not prune" not in caplog.text


def test_the_slot_history_is_pruned_also_once_every_entry_is_gone(pg_dsn, schema, engine):
    """The prune ran only after a pass's entries: with none left (every entry removed, no rows),
    the history of the entries that were there stayed for good, a row a slot."""
    old = START - timedelta(days=100)
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.periodic_slots (periodic_id, slot, backfilled, instance_id) "
                         "SELECT 'gone', CAST(:old AS timestamptz) + g * interval '1 minute', false, 'i' "
                         "FROM generate_series(1, 5) g", schema), {"old": old})
    settings = Settings(database_url=pg_dsn, schema=schema, periodic=[])
    run(settings, engine, FrozenClock(START), PeriodicEnqueuer(settings.periodic))
    with engine.connect() as conn:
        left = conn.execute(sql("SELECT slot FROM {schema}.periodic_slots WHERE periodic_id = 'gone'", schema)).scalars().all()
    assert left == [old + timedelta(minutes=5)]  # the newest of an id always stays


def test_the_slot_prune_reads_each_entry_once_while_a_snapshot_keeps_them(pg_dsn, schema, engine, monkeypatch):
    """Each batch of the slot prune read each id's slots of periodic_slots_pkey from its oldest.
    A deleted slot's entry stays there until a vacuum, and while any transaction older than the
    delete is open (a report, a pg_dump) the scan cannot mark it dead, so every batch read again
    the entries of every earlier one: 400 old slots of two entries in batches of 20 read 8,060
    entries, 1,600 read 131,444 (quadratic). Each batch now starts at the last one's last slot."""
    from maintd.services import periodic

    from .plans import entries_read_while_a_snapshot_is_held

    monkeypatch.setattr(periodic, "PRUNE_BATCH", 20)
    with engine.begin() as conn:  # 'a' and 'b': 200 old slots each, and a newest that stays
        conn.execute(sql("INSERT INTO {schema}.periodic_slots (periodic_id, slot, backfilled, instance_id) "
                         "SELECT e.id, CAST(:old AS timestamptz) + g * interval '1 minute', false, 'i' "
                         "FROM (VALUES ('a'), ('b')) AS e(id), generate_series(1, 201) g", schema),
                     {"old": START - timedelta(days=100)})
        conn.execute(sql("ANALYZE {schema}.periodic_slots", schema))
    settings = make_settings(pg_dsn, schema, schedule="@yearly")
    _, read = entries_read_while_a_snapshot_is_held(engine, pg_dsn, schema, "periodic_slots",
                                                    lambda e: run(settings, e, FrozenClock(START)))
    with engine.connect() as conn:
        left = conn.execute(sql("SELECT periodic_id, count(*) FROM {schema}.periodic_slots "
                                "WHERE periodic_id IN ('a', 'b') GROUP BY 1 ORDER BY 1", schema)).all()
    assert left == [("a", 1), ("b", 1)]  # each one's newest
    # about two reads per slot deleted (its oldest ones, the delete), and a few per batch (the ids,
    # each one's newest slot): about 1,100 here
    assert read <= 2000, f"{read} entries of periodic_slots_pkey read to prune 400 slots"
