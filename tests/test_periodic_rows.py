"""Periodic jobs as rows of ``periodic_jobs`` (SPEC 7.10): applied by a running leader within 2 s,
exactly once per (id, slot) like config entries, invalid rows contained, ids shared with config."""

from __future__ import annotations

import json
import signal
import statistics
import time
from datetime import datetime, timedelta, timezone

import psycopg
import pytest

from maintd.cli import main
from maintd.clock import FrozenClock
from maintd.config import Settings
from maintd.daemon import Daemon
from maintd.metrics import Metrics
from maintd.passes import execute_pass
from maintd.queries import sql
from maintd.services.base import PassContext
from maintd.services.periodic import PeriodicEnqueuer
from maintd.services.periodic_config import PeriodicJob

from .procs import START, DaemonProc, wait_for

# Every test here runs on both jobs layouts (SPEC 8.1): tests/conftest.py.
pytestmark = pytest.mark.both_layouts

UTC = timezone.utc
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def execute(engine, schema, statement, params=None):
    with engine.begin() as conn:
        return conn.execute(sql(statement, schema), params or {})


def add_row(engine, schema, row_id, schedule="@every 1s", **cols):
    values = {"id": row_id, "schedule": schedule, "kind": cols.pop("kind", f"k.{row_id}"), **cols}
    names = ", ".join(values)
    marks = ", ".join(f"CAST(:{k} AS interval)" if k == "backfill" else f":{k}" for k in values)
    execute(engine, schema, f"INSERT INTO {{schema}}.periodic_jobs ({names}) VALUES ({marks})", values)


def jobs_of(engine, schema, kind):
    with engine.connect() as conn:
        return conn.execute(sql("SELECT scheduled_at, metadata FROM {schema}.jobs WHERE kind = :k "
                                "ORDER BY scheduled_at", schema), {"k": kind}).all()


def row_error(engine, schema, row_id):
    with engine.connect() as conn:
        return conn.execute(sql("SELECT error FROM {schema}.periodic_jobs WHERE id = :id", schema),
                            {"id": row_id}).scalar()


def one_pass(settings, engine, clock, service):
    return service.run_once(PassContext.for_settings(settings, engine, clock))


def changed_at(engine, schema, when, row_id=None):
    """Date the rows' last change (the trigger stamps the server's time) to a frozen clock's; a
    row created after it (the server's time) is dated as created then (a change of created_at is
    one the trigger stamps, so first), and a resume stamped after it (``resumed_at``) as made then."""
    for column in ("created_at", "resumed_at"):
        execute(engine, schema, f"UPDATE {{schema}}.periodic_jobs SET {column} = :t "
                                f"WHERE (CAST(:id AS text) IS NULL OR id = :id) AND {column} > :t", {"t": when, "id": row_id})
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET updated_at = :t "
                            "WHERE CAST(:id AS text) IS NULL OR id = :id", {"t": when, "id": row_id})


def created_at(engine, schema, when, row_id):
    """Date a row's creation (and so its last change) to a frozen clock's."""
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET created_at = :t WHERE id = :id", {"t": when, "id": row_id})
    changed_at(engine, schema, when, row_id)


@pytest.fixture
def leader(settings):
    """A running in-process daemon that leads at once."""
    s = settings.model_copy(update={"http": settings.http.model_copy(update={"enabled": False})})
    daemon = Daemon(s)
    daemon.start()
    try:
        wait_for(lambda: daemon.is_leader, 10, what="leadership")
        yield daemon
    finally:
        daemon.stop()


def test_an_entry_added_by_a_reload_runs_at_once_not_after_the_quiet_ticks(settings, engine, schema):
    """After a pass, the enqueuer skips its ticks until its entries' next slot (up to 10
    minutes). A reload kept those ticks put off: an entry added by SIGHUP ran 10 minutes late,
    its slots meanwhile lost, and its run_on_start with them."""
    s = settings.model_copy(update={"http": settings.http.model_copy(update={"enabled": False}),
                                    "periodic": [PeriodicJob(id="nightly", schedule="0 3 * * *", kind="nightly")]})
    daemon = Daemon(s)
    daemon.start()
    try:
        target = daemon.targets[0]
        wait_for(lambda: target.runner.last_runs.get("periodic"), 10, what="a first periodic pass")
        added = PeriodicJob(id="often", schedule="@every 1s", kind="often", run_on_start=True)
        daemon.reload(s.model_copy(update={"periodic": [*s.periodic, added]}))
        wait_for(lambda: len(jobs_of(engine, schema, "often")) >= 2, 5, what="the added entry's jobs")
    finally:
        daemon.stop()


def test_add_change_pause_and_remove_apply_within_two_seconds(leader, engine, schema):
    add_row(engine, schema, "r1", kind="report")
    wait_for(lambda: jobs_of(engine, schema, "report"), 2.5, what="the new row's first job")
    # A change of schedule: hourly, at the minute half an hour away (not '@every 1h': its slots
    # fall on the hour, and a run that crossed one got a second job, failing CI at 22:00:00).
    with engine.connect() as conn:
        minute = (conn.execute(sql("SELECT extract(minute FROM now() AT TIME ZONE 'UTC')::int", schema)).scalar() + 30) % 60
    execute(engine, schema, f"UPDATE {{schema}}.periodic_jobs SET schedule = '{minute} * * * *' WHERE id = 'r1'")
    time.sleep(2)
    settled = len(jobs_of(engine, schema, "report"))
    time.sleep(2.5)
    assert len(jobs_of(engine, schema, "report")) == settled
    # Back to every second, then paused: no job after the pause is applied.
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET schedule = '@every 1s' WHERE id = 'r1'")
    wait_for(lambda: len(jobs_of(engine, schema, "report")) > settled, 3, what="every second again")
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET enabled = false WHERE id = 'r1'")
    time.sleep(2)
    paused = len(jobs_of(engine, schema, "report"))
    time.sleep(2.5)
    assert len(jobs_of(engine, schema, "report")) == paused
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET enabled = true WHERE id = 'r1'")
    wait_for(lambda: len(jobs_of(engine, schema, "report")) > paused, 3, what="resumed")
    execute(engine, schema, "DELETE FROM {schema}.periodic_jobs WHERE id = 'r1'")
    time.sleep(2)
    removed = len(jobs_of(engine, schema, "report"))
    time.sleep(2.5)
    assert len(jobs_of(engine, schema, "report")) == removed  # and its jobs stay
    assert removed > paused


def test_a_change_committed_after_a_later_one_is_read(pg_dsn, settings, engine, schema, clock):
    """The trigger stamps updated_at with now(), the writing transaction's start. T1 pauses a
    row, T2 (begun later) changes another and commits first, the daemon reads, then T1 commits:
    with max(updated_at) as the rows' version, T1's pause was never read (the maximum is T2's)."""
    from maintd.services.periodic_rows import RowSource

    add_row(engine, schema, "a")
    add_row(engine, schema, "b")
    rows = RowSource()
    ctx = PassContext.for_settings(settings, engine, clock)
    assert [r.enabled for r in rows.rows(ctx)] == [True, True]
    with psycopg.connect(pg_dsn) as t1:
        t1.execute(f'UPDATE "{schema}".periodic_jobs SET enabled = false WHERE id = %s', ("a",))
        time.sleep(0.05)
        execute(engine, schema, "UPDATE {schema}.periodic_jobs SET priority = 3 WHERE id = 'b'")
        assert [(r.id, r.enabled, r.priority) for r in rows.rows(ctx)] == [("a", True, 0), ("b", True, 3)]
        t1.commit()
    assert [(r.id, r.enabled, r.priority) for r in rows.rows(ctx)] == [("a", False, 0), ("b", True, 3)]


def test_time_from_insert_to_first_job(leader, engine, schema):
    """The measured latency of the closing note (median of 10)."""
    took = []
    for i in range(10):
        kind = f"lat{i}"
        t0 = time.monotonic()
        add_row(engine, schema, f"lat{i}", kind=kind, run_on_start=True)
        wait_for(lambda: jobs_of(engine, schema, kind), 3, interval=0.01, what="the first job")
        took.append(time.monotonic() - t0)
    print(f"\nMEASURE periodic row INSERT -> first job: median {statistics.median(took) * 1000:.0f} ms, "
          f"max {max(took) * 1000:.0f} ms (10 rows)")
    assert statistics.median(took) < 2.0


def test_a_row_added_while_no_leader_ran_is_backfilled_from_its_creation(settings, engine, schema):
    # Added 35 minutes before the leader's pass; one with backfill, one without.
    for row_id, backfill in (("with", "1 hour"), ("without", None)):
        add_row(engine, schema, row_id, schedule="*/10 * * * *", kind=row_id, backfill=backfill)
        execute(engine, schema, "UPDATE {schema}.periodic_jobs SET updated_at = :t WHERE id = :id",
                {"t": T0 - timedelta(minutes=35), "id": row_id})
    # (the trigger does not touch updated_at when only it changes: set it straight)
    with engine.connect() as conn:
        assert conn.execute(sql("SELECT count(*) FROM {schema}.periodic_jobs "
                                "WHERE updated_at = :t", schema), {"t": T0 - timedelta(minutes=35)}).scalar() == 2
    one_pass(settings, engine, FrozenClock(T0), PeriodicEnqueuer(settings.periodic))
    assert [j.scheduled_at for j in jobs_of(engine, schema, "with")] == [
        T0 - timedelta(minutes=30), T0 - timedelta(minutes=20), T0 - timedelta(minutes=10), T0]
    assert [j.metadata["backfilled"] for j in jobs_of(engine, schema, "with")] == [True, True, True, False]
    assert [j.scheduled_at for j in jobs_of(engine, schema, "without")] == [T0]


def test_an_invalid_row_gets_an_error_and_does_not_disturb_a_valid_one(settings, engine, schema):
    add_row(engine, schema, "good", schedule="*/10 * * * *", kind="good", run_on_start=True)
    add_row(engine, schema, "bad", schedule="61 * * * *", kind="bad")
    add_row(engine, schema, "badtz", schedule="0 * * * *", kind="badtz", timezone="Mars/Olympus")
    add_row(engine, schema, "bad id!", schedule="0 * * * *", kind="badid")
    changed_at(engine, schema, T0 - timedelta(hours=1))
    service = PeriodicEnqueuer(settings.periodic)
    result = one_pass(settings, engine, FrozenClock(T0), service)
    assert [j.scheduled_at for j in jobs_of(engine, schema, "good")] == [T0]
    assert row_error(engine, schema, "bad").startswith("schedule:")
    assert "Mars/Olympus" in row_error(engine, schema, "badtz")
    assert row_error(engine, schema, "bad id!").startswith("id:")
    assert set(result.invalid_rows) == {"bad", "badtz", "bad id!"} and not result.failed()
    assert row_error(engine, schema, "good") is None
    # Fixing the row clears the error and the row runs from its next slot.
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET schedule = '*/10 * * * *' WHERE id = 'bad'")
    changed_at(engine, schema, T0, "bad")
    one_pass(settings, engine, FrozenClock(T0 + timedelta(seconds=1)), service)
    assert row_error(engine, schema, "bad") is None
    one_pass(settings, engine, FrozenClock(T0 + timedelta(minutes=10)), service)
    assert [j.scheduled_at for j in jobs_of(engine, schema, "bad")] == [T0 + timedelta(minutes=10)]
    assert len(jobs_of(engine, schema, "good")) == 2


def test_a_row_changed_in_its_args_keeps_a_slot_due_and_runs_it_with_the_new_args(settings, engine, schema):
    """The leader died before 10:00; the application updated the row's args at 10:00:04; the new
    leader passed at 10:00:09: any change of a row started it afresh from the change, so the
    10:00 slot, due and within backfill, was lost. Only a change of schedule or time zone starts
    a row afresh now."""
    add_row(engine, schema, "hourly", schedule="0 * * * *", kind="hourly", backfill="2 hours", run_on_start=True)
    changed_at(engine, schema, T0 - timedelta(hours=1))
    service = PeriodicEnqueuer([])
    one_pass(settings, engine, FrozenClock(T0 - timedelta(hours=1) + timedelta(seconds=1)), service)  # 11:00
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET args = '{\"v\": 2}' WHERE id = 'hourly'")
    changed_at(engine, schema, T0 + timedelta(seconds=4), "hourly")
    one_pass(settings, engine, FrozenClock(T0 + timedelta(seconds=9)), PeriodicEnqueuer([]))  # a new leader
    with engine.connect() as conn:
        got = conn.execute(sql("SELECT scheduled_at, args FROM {schema}.jobs WHERE kind = 'hourly' "
                               "ORDER BY scheduled_at", schema)).all()
    assert [(when, args) for when, args in got] == [(T0 - timedelta(hours=1), {}), (T0, {"v": 2})]
    # A changed schedule still starts the row afresh from the change: nothing before it runs.
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET schedule = '30 * * * *' WHERE id = 'hourly'")
    changed_at(engine, schema, T0 + timedelta(minutes=31), "hourly")
    one_pass(settings, engine, FrozenClock(T0 + timedelta(minutes=40)), PeriodicEnqueuer([]))
    assert len(jobs_of(engine, schema, "hourly")) == 2


def test_rows_are_validated_again_only_when_they_changed(settings, engine, schema, monkeypatch):
    """Every pass validated every row again (31 ms for 1,000 rows, every second with one '@every
    1s' entry among them); now only a pass after a change of the rows does."""
    from maintd.services import periodic_rows

    for i in range(50):
        add_row(engine, schema, f"r{i}", schedule="*/5 * * * *")
    add_row(engine, schema, "bad", schedule="61 * * * *")
    changed_at(engine, schema, T0 - timedelta(hours=1))
    calls = []
    validate = periodic_rows.to_entry
    monkeypatch.setattr(periodic_rows, "to_entry", lambda row, taken: (calls.append(row.id), validate(row, taken))[1])
    service = PeriodicEnqueuer(settings.periodic)
    first = one_pass(settings, engine, FrozenClock(T0), service)
    assert len(calls) == 51 and set(first.invalid_rows) == {"bad"}
    one_pass(settings, engine, FrozenClock(T0 + timedelta(seconds=1)), service)  # its error written: read again
    before = len(calls)
    for k in range(2, 5):
        one_pass(settings, engine, FrozenClock(T0 + timedelta(seconds=k)), service)
    assert len(calls) == before and row_error(engine, schema, "bad").startswith("schedule:")
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET args = '{\"v\": 1}' WHERE id = 'r7'")
    one_pass(settings, engine, FrozenClock(T0 + timedelta(seconds=5)), service)
    assert len(calls) == before + 51


def test_rows_no_python_value_holds_are_refused_alone(settings, engine, schema):
    """A zone name that is a directory of the zone database ('America') or too long for a file
    name raised OSError, a backfill of billions of days or an updated_at of 'infinity' failed the
    read of every row: each stopped the whole enqueuer, config entries too, every second, and
    the row's error stayed empty. Each is now that row's error."""
    add_row(engine, schema, "good", schedule="*/10 * * * *", kind="good", run_on_start=True)
    add_row(engine, schema, "dir", schedule="0 * * * *", timezone="America")
    add_row(engine, schema, "long", schedule="0 * * * *", timezone="Europe/" + "x" * 300)
    add_row(engine, schema, "huge", schedule="0 * * * *", backfill="1500000000 days")
    add_row(engine, schema, "never", schedule="0 * * * *")
    changed_at(engine, schema, T0 - timedelta(hours=1))
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET updated_at = 'infinity' WHERE id = 'never'")
    service = PeriodicEnqueuer(settings.periodic)
    result = one_pass(settings, engine, FrozenClock(T0), service)
    assert [j.scheduled_at for j in jobs_of(engine, schema, "good")] == [T0] and not result.failed()
    assert set(result.invalid_rows) == {"dir", "long", "huge", "never"}
    assert "unknown time zone 'America'" in row_error(engine, schema, "dir")
    assert "unknown time zone" in row_error(engine, schema, "long")
    assert row_error(engine, schema, "huge").startswith("backfill:")
    assert row_error(engine, schema, "never").startswith("updated_at:")
    one_pass(settings, engine, FrozenClock(T0 + timedelta(minutes=10)), service)
    assert len(jobs_of(engine, schema, "good")) == 2


def test_a_row_whose_id_is_in_the_config_gets_an_error_and_the_config_wins(pg_dsn, schema, engine):
    settings = Settings(database_url=pg_dsn, schema=schema, instance_id="t", periodic=[
        {"id": "nightly", "schedule": "0 3 * * *", "kind": "from.config", "run_on_start": True}])
    add_row(engine, schema, "nightly", schedule="@every 1s", kind="from.table", run_on_start=True)
    one_pass(settings, engine, FrozenClock(T0), PeriodicEnqueuer(settings.periodic))
    assert "config" in row_error(engine, schema, "nightly")
    assert len(jobs_of(engine, schema, "from.config")) == 1 and jobs_of(engine, schema, "from.table") == []


def test_cli_add_list_pause_resume_remove(settings, schema, engine, tmp_path, capsys):
    cfg = tmp_path / "m.toml"
    cfg.write_text(f'database_url = "{settings.database_url.get_secret_value()}"\nschema = "{schema}"\n'
                   '[[periodic]]\nid = "cfg"\nschedule = "0 3 * * *"\nkind = "c"\n')
    base = ["--config", str(cfg), "periodic"]
    assert main(base + ["add", "hourly", "--schedule", "@hourly", "--kind", "h", "--args", '{"a": 1}']) == 0
    assert main(base + ["add", "hourly", "--schedule", "@daily", "--kind", "h"]) == 1  # exists
    assert main(base + ["add", "y", "--schedule", "61 * * * *", "--kind", "h"]) == 2
    capsys.readouterr()
    assert main(base + ["list", "--json"]) == 0
    listed = {e["id"]: e for e in json.loads(capsys.readouterr().out)}
    assert listed["hourly"]["origin"] == "table" and listed["cfg"]["origin"] == "config"
    assert listed["hourly"]["next_slot"] is not None
    def enabled():
        with engine.connect() as conn:
            return conn.execute(sql("SELECT enabled FROM {schema}.periodic_jobs WHERE id = 'hourly'", schema)).scalar()

    assert main(base + ["pause", "hourly"]) == 0
    assert enabled() is False
    assert main(base + ["resume", "hourly"]) == 0
    assert enabled() is True
    assert main(base + ["remove", "hourly"]) == 0
    assert main(base + ["remove", "hourly"]) == 1  # not found
    assert main(base + ["list"]) == 0
    assert "cfg" in capsys.readouterr().out


def live_leader(engine, schema, procs):
    with engine.connect() as conn:
        pid = conn.execute(sql("SELECT pid FROM {schema}.leader", schema)).scalar()
    return next((p for p in procs if p.proc.pid == pid and p.proc.poll() is None), None)


@pytest.mark.slow
def test_failover_while_rows_change_neither_doubles_nor_loses_a_slot(pg_dsn, schema, engine):
    add_row(engine, schema, "steady", schedule="@every 1s", kind="steady", backfill="1 minute")
    procs = [DaemonProc(pg_dsn, schema, f"p{i}", {"log": {"level": "warning"}}).start() for i in range(3)]
    try:
        for round_ in range(3):
            wait_for(lambda: len(jobs_of(engine, schema, "steady")) >= 2 * (round_ + 1), START, what="slots")
            execute(engine, schema, f"INSERT INTO {{schema}}.periodic_jobs (id, schedule, kind) "
                                    f"VALUES ('churn{round_}', '@every 2s', 'churn')")
            execute(engine, schema, "UPDATE {schema}.periodic_jobs SET args = jsonb_build_object('r', :r) "
                                    "WHERE id LIKE 'churn%'", {"r": round_})
            victim = wait_for(lambda: live_leader(engine, schema, procs), 15, what="a live leader")
            victim.kill(signal.SIGKILL)
        time.sleep(3)
    finally:
        for p in procs:
            p.stop()
    slots = [j.scheduled_at for j in jobs_of(engine, schema, "steady")]
    assert len(slots) == len(set(slots)), "a slot was enqueued twice"
    gaps = [b - a for a, b in zip(slots, slots[1:])]
    assert all(g == timedelta(seconds=1) for g in gaps), f"a slot was lost: {gaps}"
    assert len(slots) >= 6


def test_dashboard_and_status_show_rows_and_config_entries_by_origin(pg_dsn, schema, engine):
    from maintd.dashboard import periodic_rows
    from maintd.periodic_table import list_entries

    settings = Settings(database_url=pg_dsn, schema=schema, instance_id="t", periodic=[
        {"id": "from-config", "schedule": "0 3 * * *", "kind": "c", "timezone": "Europe/Paris"},
        {"id": "interval", "schedule": "@every 1h", "kind": "c", "timezone": "Asia/Tokyo"}])
    add_row(engine, schema, "from-table", schedule="*/5 * * * *")
    add_row(engine, schema, "broken", schedule="61 * * * *")
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET error = 'schedule: bad' WHERE id = 'broken'")
    with engine.connect() as conn:
        shown = {r["id"]: r for r in periodic_rows(conn, schema, settings.periodic_entries, T0)}
    assert {k: v["origin"] for k, v in shown.items()} == {
        "from-config": "config", "interval": "config", "from-table": "table", "broken": "table"}
    assert shown["from-table"]["next_slot"] == T0 + timedelta(minutes=5)
    assert shown["broken"]["error"] == "schedule: bad"
    listed = {e["id"]: e for e in list_entries(engine, settings)[0]}  # /status's "periodic"
    assert {k: e["origin"] for k, e in listed.items()} == {
        "from-config": "config", "interval": "config", "from-table": "table", "broken": "table"}
    # The zone a schedule is read in is shown; an @every interval counts from the epoch in no
    # zone, and showed "(Asia/Tokyo)" beside it as if it followed that zone's clock.
    for entries in (shown, listed):
        assert entries["from-config"]["timezone"] == "Europe/Paris"
        assert entries["interval"]["timezone"] is None


def test_the_metric_series_of_a_deleted_row_go_with_it(settings, engine, schema):
    """An application that makes a row per customer and deletes it: each id kept its
    maintd_periodic_enqueued_total and _skipped_total series until a restart, 400 after 200 rows
    made and deleted twice. The series of an id gone from the entries go at the next pass."""
    from maintd.metrics import Metrics
    from maintd.services.periodic import ENQUEUED, SKIPPED

    metrics, service, clock = Metrics(target="t"), PeriodicEnqueuer([]), FrozenClock(T0)

    def series() -> set:
        return {s.labels["periodic_id"] for m in metrics.registry.collect() for s in m.samples
                if s.name in ("maintd_periodic_enqueued_total", "maintd_periodic_skipped_total")}

    for batch in ("a", "b"):
        for i in range(20):
            add_row(engine, schema, f"rot_{batch}{i}", run_on_start=True, enabled=i % 2 == 0)
        changed_at(engine, schema, T0)
        service.observe(metrics, one_pass(settings, engine, clock, service))
        assert series() == {f"rot_{batch}{i}" for i in range(20)}  # enqueued (even) or skipped (odd)
        execute(engine, schema, "DELETE FROM {schema}.periodic_jobs")
        clock.advance(1)
        service.poke()
        service.observe(metrics, one_pass(settings, engine, clock, service))
        assert series() == set()
    add_row(engine, schema, "kept", run_on_start=True)
    changed_at(engine, schema, T0)
    service.observe(metrics, one_pass(settings, engine, clock, service))
    clock.advance(1)
    service.observe(metrics, one_pass(settings, engine, clock, service))
    assert series() == {"kept"} and metrics[ENQUEUED].labels("kept")._value.get() == 2
    assert metrics[SKIPPED].children() == []


@pytest.mark.parametrize("args", ["[" * 3000 + "]" * 3000, '{"n": 1e5000}'])
def test_a_row_whose_args_python_cannot_load_is_refused_alone(settings, engine, schema, args):
    """args nested past Python's recursion limit, or holding an integer of over 4,300 digits (both
    valid jsonb), failed the read of every row: the whole enqueuer stopped, config entries too.
    That row now gets an error naming args; the others run."""
    add_row(engine, schema, "good", schedule="*/10 * * * *", kind="good", run_on_start=True)
    add_row(engine, schema, "bad", schedule="*/10 * * * *", kind="bad", run_on_start=True)
    changed_at(engine, schema, T0 - timedelta(hours=1))
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET args = CAST(:a AS jsonb) WHERE id = 'bad'", {"a": args})
    service, metrics = PeriodicEnqueuer(settings.periodic), Metrics(target=settings.target_name)
    record = execute_pass("periodic", service, PassContext.for_settings(settings, engine, FrozenClock(T0)), metrics)
    assert [j.scheduled_at for j in jobs_of(engine, schema, "good")] == [T0] and not record.result.failed()
    assert set(record.result.invalid_rows) == {"bad"} and row_error(engine, schema, "bad").startswith("args:")
    # Counted once, when its error is set and logged, not again every pass while it stays so.
    service.poke()
    execute_pass("periodic", service, PassContext.for_settings(settings, engine, FrozenClock(T0 + timedelta(seconds=1))), metrics)
    assert metrics.registry.get_sample_value("maintd_rows_skipped_total", {
        "target": settings.target_name, "service": "periodic", "reason": "invalid_row"}) == 1


@pytest.mark.parametrize("slot", ["-infinity", "infinity", "0044-03-15 00:00:00+00 BC", "10000-01-01 00:00:00+00"])
def test_a_slot_row_at_an_odd_time_never_stops_the_enqueuer(settings, engine, schema, slot):
    """One periodic_slots row of an entry at a time no Python datetime holds (by hand, an import)
    failed the read of every entry's high-water mark ('timestamp too small'): every pass an
    error, no entry enqueued anything. Such a slot is not a high-water mark; the entries run."""
    add_row(engine, schema, "odd", schedule="*/10 * * * *", kind="odd", run_on_start=True)
    add_row(engine, schema, "other", schedule="*/10 * * * *", kind="other", run_on_start=True)
    changed_at(engine, schema, T0 - timedelta(hours=1))
    execute(engine, schema, "INSERT INTO {schema}.periodic_slots (periodic_id, slot) VALUES ('odd', CAST(:s AS timestamptz))",
            {"s": slot})
    service = PeriodicEnqueuer(settings.periodic)
    result = one_pass(settings, engine, FrozenClock(T0), service)
    assert not result.failed() and [j.scheduled_at for j in jobs_of(engine, schema, "other")] == [T0]
    assert [j.scheduled_at for j in jobs_of(engine, schema, "odd")] == [T0]
    one_pass(settings, engine, FrozenClock(T0 + timedelta(minutes=10)), service)
    assert len(jobs_of(engine, schema, "odd")) == 2


def test_a_row_removed_and_added_again_runs_from_its_new_creation_not_the_slots_in_between(settings, engine, schema):
    """`maintd periodic remove hourly` at 07:30, `add hourly` again at 11:30 (same schedule, a
    backfill of a day): the new row took the old one's newest slot (07:00) as its own, and its
    first pass enqueued 08:00 to 12:00 at once, five runs for four hours the row did not exist
    while a leader ran (SPEC 4: backfill is for slots missed while no leader ran). The new row
    runs from its creation, like a row never seen."""
    add_row(engine, schema, "hourly", schedule="0 * * * *", kind="hourly", backfill="1 day")
    created_at(engine, schema, T0 - timedelta(hours=5, minutes=30), "hourly")
    one_pass(settings, engine, FrozenClock(T0 - timedelta(hours=5) + timedelta(seconds=1)), PeriodicEnqueuer([]))
    assert [j.scheduled_at for j in jobs_of(engine, schema, "hourly")] == [T0 - timedelta(hours=5)]
    execute(engine, schema, "DELETE FROM {schema}.periodic_jobs WHERE id = 'hourly'")
    add_row(engine, schema, "hourly", schedule="0 * * * *", kind="hourly", backfill="1 day")
    created_at(engine, schema, T0 - timedelta(minutes=30), "hourly")
    result = one_pass(settings, engine, FrozenClock(T0 + timedelta(seconds=1)), PeriodicEnqueuer([]))
    assert [e["slot"] for e in result.enqueued] == [T0.isoformat()], result.enqueued
    assert [j.scheduled_at for j in jobs_of(engine, schema, "hourly")] == [T0 - timedelta(hours=5), T0]


def test_an_entry_removed_by_a_reload_and_added_again_does_not_backfill_its_absence(settings, engine, schema):
    """SPEC 4: backfill is for slots missed while no leader ran. A [[periodic]] entry removed by
    SIGHUP and added again by another took its newest slot from before its removal as its own:
    its backfill enqueued every slot of its absence at once, while a leader ran all along. Like a
    disabled entry, it now runs from the slots after it came back."""
    entry = PeriodicJob(id="often", schedule="@every 1s", kind="often", backfill="1h")
    s = settings.model_copy(update={"http": settings.http.model_copy(update={"enabled": False}), "periodic": [entry]})

    def server_now():
        with engine.connect() as conn:
            return conn.execute(sql("SELECT now()", schema)).scalar_one()

    daemon = Daemon(s)
    daemon.start()
    try:
        wait_for(lambda: len(jobs_of(engine, schema, "often")) >= 2, 10, what="the entry's jobs")
        daemon.reload(s.model_copy(update={"periodic": []}))
        removed = server_now()
        time.sleep(4)
        added = server_now()
        daemon.reload(s)
        wait_for(lambda: jobs_of(engine, schema, "often")[-1].scheduled_at > added + timedelta(seconds=1), 10,
                 what="the entry's jobs again")
    finally:
        daemon.stop()
    absent = [j.scheduled_at for j in jobs_of(engine, schema, "often")
              if removed + timedelta(seconds=1) < j.scheduled_at < added]
    assert absent == [], f"{len(absent)} jobs for slots while the entry was removed"


def test_a_removal_that_cannot_be_marked_keeps_no_entry_from_running_and_is_marked_next_pass(
        pg_dsn, settings, engine, schema, maintd_log):
    """Marking the newest slot of an id gone (MARK_REMOVED) is bookkeeping: when it fails (here
    its row is locked past lock_timeout), the other entries run their slots in that pass all the
    same, and the mark is made by the next pass."""
    from maintd.db import make_engine

    for row_id in ("a", "b"):
        add_row(engine, schema, row_id, schedule="0 * * * *", kind=f"k.{row_id}")
        created_at(engine, schema, T0 - timedelta(minutes=30), row_id)
    service = PeriodicEnqueuer([])
    short = make_engine(pg_dsn, application_name="maintd-test-short", session={"lock_timeout": "300ms"})
    try:
        one_pass(settings, short, FrozenClock(T0 + timedelta(seconds=1)), service)
        execute(engine, schema, "DELETE FROM {schema}.periodic_jobs WHERE id = 'b'")
        with engine.begin() as blocker:
            blocker.execute(sql("SELECT * FROM {schema}.periodic_slots WHERE periodic_id = 'b' FOR UPDATE", schema))
            result = one_pass(settings, short, FrozenClock(T0 + timedelta(hours=1, seconds=1)), service)
        assert [e["slot"] for e in result.enqueued] == [(T0 + timedelta(hours=1)).isoformat()], result.enqueued
        assert [j.scheduled_at for j in jobs_of(engine, schema, "k.a")] == [T0, T0 + timedelta(hours=1)]
        assert any("could not mark removed periodic entries" in line and "b" in line for line in maintd_log)
        one_pass(settings, short, FrozenClock(T0 + timedelta(hours=1, seconds=2)), service)
    finally:
        short.dispose()
    with engine.connect() as conn:
        marks = conn.execute(sql("SELECT schedule FROM {schema}.periodic_slots WHERE periodic_id = 'b' "
                                 "ORDER BY slot DESC LIMIT 1", schema)).scalar()
    assert marks == "(removed)"


def test_an_error_note_that_cannot_be_written_keeps_no_entry_from_running_and_is_written_next_pass(
        pg_dsn, settings, engine, schema, maintd_log):
    """Writing a row's ``error`` is bookkeeping: when the row is locked by an application's
    transaction (an edit under way), the pass failed as a whole and no entry ran, pass after pass,
    for as long as the lock was held. Now the other entries run, and the note is written once the
    row is free."""
    from maintd.db import make_engine

    add_row(engine, schema, "good", schedule="0 * * * *", kind="good")
    add_row(engine, schema, "bad", schedule="61 * * * *", kind="bad")
    created_at(engine, schema, T0 - timedelta(minutes=30), "good")
    created_at(engine, schema, T0 - timedelta(minutes=30), "bad")
    service = PeriodicEnqueuer([PeriodicJob(id="conf", schedule="0 * * * *", kind="conf", run_on_start=True)])
    short = make_engine(pg_dsn, application_name="maintd-test-short", session={"lock_timeout": "300ms"})
    try:
        with engine.begin() as blocker:
            blocker.execute(sql("SELECT * FROM {schema}.periodic_jobs WHERE id = 'bad' FOR UPDATE", schema))
            result = one_pass(settings, short, FrozenClock(T0 + timedelta(seconds=1)), service)
        assert sorted(e["periodic_id"] for e in result.enqueued) == ["conf", "good"], result.enqueued
        assert any("could not write a periodic_jobs row's error" in line and "bad" in line for line in maintd_log)
        assert row_error(engine, schema, "bad") is None  # not written yet, nor counted
        assert result.invalid_rows == {} and service.quiet_until() is None
        again = one_pass(settings, short, FrozenClock(T0 + timedelta(seconds=2)), service)
        assert list(again.invalid_rows) == ["bad"]  # rows_skipped{reason="invalid_row"}: once
    finally:
        short.dispose()
    assert row_error(engine, schema, "bad").startswith("schedule:")


def test_a_row_with_run_on_start_added_while_no_leader_ran_is_backfilled_too(settings, engine, schema):
    """``run_on_start`` enqueues a new row's current slot at once; with ``backfill`` too, the
    slots it missed since it was added (no leader ran) were lost: only the current one ran."""
    add_row(engine, schema, "both", schedule="*/10 * * * *", kind="both", backfill="1 hour", run_on_start=True)
    add_row(engine, schema, "late", schedule="*/10 * * * *", kind="late", backfill="1 hour", run_on_start=True)
    created_at(engine, schema, T0 - timedelta(minutes=35), "both")
    created_at(engine, schema, T0 + timedelta(minutes=5), "late")  # added after its latest slot
    one_pass(settings, engine, FrozenClock(T0 + timedelta(minutes=5, seconds=1)), PeriodicEnqueuer(settings.periodic))
    assert [j.scheduled_at for j in jobs_of(engine, schema, "both")] == [
        T0 - timedelta(minutes=30), T0 - timedelta(minutes=20), T0 - timedelta(minutes=10), T0]
    assert [j.scheduled_at for j in jobs_of(engine, schema, "late")] == [T0]  # at once, as before


def test_what_the_enqueuer_keeps_per_row_goes_with_the_row(settings, engine, schema):
    """An application that makes and deletes rows (a schedule per customer, say) must not grow the
    leader's memory: the parsed schedules and the disabled rows' marks of deleted rows went only
    with a restart."""
    service = PeriodicEnqueuer(settings.periodic)
    for rnd in range(3):
        for i in range(40):
            add_row(engine, schema, f"r{rnd}-{i}", schedule=f"@every {rnd * 40 + i + 2}s", enabled=i % 2 == 0)
        one_pass(settings, engine, FrozenClock(T0 + timedelta(minutes=rnd)), service)
        execute(engine, schema, "DELETE FROM {schema}.periodic_jobs")
    one_pass(settings, engine, FrozenClock(T0 + timedelta(minutes=4)), service)
    assert len(service._disabled_seen) == 0
    assert len(service._schedules) <= 40, len(service._schedules)


def test_the_periodic_id_series_are_bounded_by_metrics_max_periodic_ids(settings, engine, schema):
    """Schedules are rows: an application (or an operator's script) can make thousands, and each id
    had series of its own in maintd_periodic_enqueued_total and _skipped_total: 300 rows (half of them
    disabled), 300 periodic_id values, without bound. As per-queue series are (metrics.max_queues), they are bounded by
    metrics.max_periodic_ids (default 100): the configured entries and then the first ids seen
    keep their name, the rest are counted under periodic_id="_other", every job still counted.
    (Prometheus on label cardinality: https://prometheus.io/docs/practices/naming/#labels)"""
    from maintd.metrics import OTHER, Metrics

    metrics, service, clock = Metrics(target="t"), PeriodicEnqueuer([]), FrozenClock(T0)
    assert metrics.max_periodic_ids == 100  # the default, as settings.metrics.max_periodic_ids
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.periodic_jobs (id, schedule, kind, run_on_start, enabled) "
                         "SELECT 'row_' || g, '@every 1s', 'k', true, g % 2 = 0 FROM generate_series(1, 300) g", schema))
    changed_at(engine, schema, T0)
    service.observe(metrics, one_pass(settings, engine, clock, service))

    def series(name: str) -> dict:
        return {s.labels["periodic_id"]: s.value for m in metrics.registry.collect() for s in m.samples
                if s.name == name and s.labels.get("target") == "t"}

    enqueued, skipped = series("maintd_periodic_enqueued_total"), series("maintd_periodic_skipped_total")
    assert len(set(enqueued) | set(skipped)) <= 101, f"{len(enqueued)} and {len(skipped)} periodic_id series"
    assert OTHER in enqueued and OTHER in skipped
    assert sum(enqueued.values()) == 150 and sum(skipped.values()) == 150  # every slot still counted
    # A deleted row frees its place: an id seen later takes it, the rest still go to _other.
    execute(engine, schema, "DELETE FROM {schema}.periodic_jobs")
    clock.advance(1)
    service.poke()
    service.observe(metrics, one_pass(settings, engine, clock, service))
    assert set(series("maintd_periodic_enqueued_total")) <= {OTHER}
    execute(engine, schema, "INSERT INTO {schema}.periodic_jobs (id, schedule, kind, run_on_start) "
                            "VALUES ('late', '@every 1s', 'k', true)")
    clock.advance(1)
    service.poke()
    service.observe(metrics, one_pass(settings, engine, clock, service))
    assert series("maintd_periodic_enqueued_total").get("late") == 1


def test_a_long_backfill_is_enqueued_over_bounded_passes_and_keeps_no_other_row_waiting(settings, engine, schema):
    """A row with a long ``backfill`` first seen long after its creation (restored from a dump,
    added while no leader ran, the window as large as a row may ask: 100 years) listed every slot
    of its window and enqueued them all in one pass: a year of '@every 1s' was 31 million
    datetimes in memory and as many transactions before the rows after it had their turn. A pass
    now enqueues at most ``SLOTS_PER_PASS`` slots of an entry, oldest first, and asks for the next
    pass at once; every slot of the window is still enqueued once, with no gap."""
    from maintd.services.periodic import SLOTS_PER_PASS

    missed = 2 * SLOTS_PER_PASS + 500
    add_row(engine, schema, "filled", schedule="@every 1s", kind="filled", backfill="36500 days")
    add_row(engine, schema, "zother", schedule="@every 1s", kind="zother")  # after it, by id
    changed_at(engine, schema, T0)
    clock = FrozenClock(T0 + timedelta(seconds=missed, milliseconds=500))
    service = PeriodicEnqueuer(settings.periodic)
    result = one_pass(settings, engine, clock, service)
    assert len(jobs_of(engine, schema, "filled")) == SLOTS_PER_PASS
    assert [j.scheduled_at for j in jobs_of(engine, schema, "zother")] == [T0 + timedelta(seconds=missed)]
    assert service.quiet_until() is None  # more to enqueue: the next tick runs a pass
    passes = 1
    while service.quiet_until() is None and passes < 10:
        one_pass(settings, engine, clock, service)
        passes += 1
    got = [j.scheduled_at for j in jobs_of(engine, schema, "filled")]
    assert got == [T0 + timedelta(seconds=s) for s in range(1, missed + 1)]
    assert passes == 3 and result.skipped == {"zother": {"outside_backfill": missed - 1}}  # (no backfill)


def test_a_row_paused_and_resumed_while_no_leader_ran_does_not_backfill_its_pause(settings, engine, schema):
    """A paused row's slots are taken without a job, so that resumed it does not enqueue (or
    backfill) them; but those of its pause after the last leader stopped were not taken, and
    resumed before a leader came back, the row backfilled them as missed. A row resumed counts
    its missed slots from its change (``updated_at``), as a row whose schedule changed does."""
    add_row(engine, schema, "hourly", schedule="0 * * * *", kind="hourly", backfill="1 day")
    changed_at(engine, schema, T0 - timedelta(minutes=30))
    service = PeriodicEnqueuer(settings.periodic)
    one_pass(settings, engine, FrozenClock(T0 + timedelta(seconds=1)), service)  # 12:00 enqueued
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET enabled = false")
    changed_at(engine, schema, T0 + timedelta(minutes=30))
    one_pass(settings, engine, FrozenClock(T0 + timedelta(hours=1, seconds=1)), service)  # 13:00 taken, paused
    # The leaders stop at 13:10; the row is resumed at 15:30; a leader is back at 16:05.
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET enabled = true")
    changed_at(engine, schema, T0 + timedelta(hours=3, minutes=30))
    result = one_pass(settings, engine, FrozenClock(T0 + timedelta(hours=4, minutes=5)), PeriodicEnqueuer(settings.periodic))
    assert [j.scheduled_at for j in jobs_of(engine, schema, "hourly")] == [T0, T0 + timedelta(hours=4)]
    assert [e["backfilled"] for e in result.enqueued] == [False]


def test_a_row_paused_and_resumed_while_no_leader_ran_at_all_does_not_run_its_pause(settings, engine, schema):
    """As above, but no leader ran during the whole pause, so no slot of it was taken (paused):
    the row, paused at 12:30 and resumed at 13:30 while the leaders were down, ran its 13:00 slot
    (a slot of its pause) when a leader came back at 13:45, with backfill or without. Had a
    leader been up at 13:00, it would have taken that slot without a job. A resume is stamped
    (``resumed_at``) and the row counts its missed slots from it."""
    for row_id, backfill in (("with", "1 day"), ("without", None)):
        add_row(engine, schema, row_id, schedule="0 * * * *", kind=row_id, backfill=backfill)
    changed_at(engine, schema, T0 - timedelta(minutes=30))
    one_pass(settings, engine, FrozenClock(T0 + timedelta(seconds=1)), PeriodicEnqueuer(settings.periodic))  # 12:00
    # The leaders stop at 12:10; the rows are paused at 12:30 and resumed at 13:30; a leader is back at 13:45.
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET enabled = false")
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET enabled = true")
    changed_at(engine, schema, T0 + timedelta(hours=1, minutes=30))
    result = one_pass(settings, engine, FrozenClock(T0 + timedelta(hours=1, minutes=45)),
                      PeriodicEnqueuer(settings.periodic))
    assert result.enqueued == []
    one_pass(settings, engine, FrozenClock(T0 + timedelta(hours=2, seconds=1)), PeriodicEnqueuer(settings.periodic))
    for row_id in ("with", "without"):
        assert [j.scheduled_at for j in jobs_of(engine, schema, row_id)] == [T0, T0 + timedelta(hours=2)], row_id


def test_the_trigger_stamps_a_resume_and_only_a_resume(settings, engine, schema):
    add_row(engine, schema, "r", schedule="0 * * * *")
    stamp = "SELECT resumed_at FROM {schema}.periodic_jobs WHERE id = 'r'"
    assert execute(engine, schema, stamp).scalar() is None  # added: not a resume
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET enabled = false")
    assert execute(engine, schema, stamp).scalar() is None
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET enabled = true")
    resumed = execute(engine, schema, stamp).scalar()
    assert resumed is not None
    execute(engine, schema, "UPDATE {schema}.periodic_jobs SET args = '{\"v\": 1}'")  # not a resume
    assert execute(engine, schema, stamp).scalar() == resumed


def test_a_row_that_takes_over_a_removed_config_entry_s_id_runs_from_the_takeover(settings, engine, schema):
    """A row whose id a [[periodic]] entry used (the row refused meanwhile, its ``error`` saying so)
    takes the id over when the entry is removed; the id's slots are the entry's before that. The
    row counted its missed slots from the entry's newest slot (its own ``updated_at`` being older),
    or from when it was added (while refused): a reload at 12:50 removing an hourly entry enqueued
    the row's '*/15' slots 12:15 to 12:45 at once, a row added at 12:10 its '*/5' slots since
    12:10; and a row taking over an entry that was disabled, the entry removed while no leader
    ran, backfilled the entry's pause (14:00 and 15:00). When a row took over is not known (a reload,
    or a restart with the new file): it runs like a config entry changed then, the slots both had
    (none here) and then from its next slot."""
    hourly = {"schedule": "0 * * * *", "kind": "from.config", "backfill": timedelta(days=1)}
    config = [PeriodicJob(id="quarter", **hourly), PeriodicJob(id="late", **hourly),
              PeriodicJob(id="paused", enabled=False, **hourly)]
    add_row(engine, schema, "quarter", schedule="*/15 * * * *", kind="quarter", backfill="1 day")
    add_row(engine, schema, "paused", schedule="0 * * * *", kind="paused", backfill="1 day")
    changed_at(engine, schema, T0 - timedelta(days=1))
    old = PeriodicEnqueuer(config)
    one_pass(settings, engine, FrozenClock(T0 + timedelta(seconds=1)), old)  # the config's: 12:00 taken
    add_row(engine, schema, "late", schedule="*/5 * * * *", kind="late", backfill="1 day")
    created_at(engine, schema, T0 + timedelta(minutes=10), "late")
    one_pass(settings, engine, FrozenClock(T0 + timedelta(minutes=10, seconds=1)), old)
    assert all("config" in row_error(engine, schema, i) for i in ("quarter", "late", "paused"))
    new = PeriodicEnqueuer(config[2:])  # a reload removes 'quarter' and 'late'
    new.succeed(old)  # what the runner does on a reload
    result = one_pass(settings, engine, FrozenClock(T0 + timedelta(minutes=50)), new)
    assert [(e["periodic_id"], e["slot"][11:16]) for e in result.enqueued] == []
    assert all(row_error(engine, schema, i) is None for i in ("quarter", "late"))
    one_pass(settings, engine, FrozenClock(T0 + timedelta(hours=1, seconds=1)), new)  # 13:00; 'paused' takes it
    # The leaders stop at 13:10; 'paused' is removed from the file; a leader is back at 15:05.
    result = one_pass(settings, engine, FrozenClock(T0 + timedelta(hours=3, minutes=5)), PeriodicEnqueuer([]))
    assert [e for e in result.enqueued if e["periodic_id"] == "paused"] == [], result.enqueued
    one_pass(settings, engine, FrozenClock(T0 + timedelta(hours=4, seconds=1)), PeriodicEnqueuer([]))
    assert [j.scheduled_at for j in jobs_of(engine, schema, "paused")] == [T0 + timedelta(hours=4)]
    for kind in ("quarter", "late"):  # from their next slot after the takeover (12:55, 13:00), then as any row
        assert jobs_of(engine, schema, kind)[0].scheduled_at > T0 + timedelta(minutes=50), kind


def test_a_schedule_change_committed_after_slots_of_the_old_one_runs_no_slot_only_the_new_one_has(
        pg_dsn, settings, engine, schema):
    """The trigger stamps updated_at with the writing transaction's start. An hourly row changed to
    '30 * * * *' by a transaction begun before 13:00 that commits at 14:40, the leader having run
    13:00 and 14:00 under the old schedule meanwhile (it read the row as it was): the change looked
    older than the row's newest slot, so its slots since 14:00 counted as missed, and 14:30 ran at
    14:45, half an hour after 14:00, a slot of neither schedule while it was in force. When such a
    change took effect is not known (after the newest slot, by its commit): the row runs like a
    config entry changed then, the slots both schedules have, then from its next slot."""
    add_row(engine, schema, "hourly", schedule="0 * * * *", kind="hourly", backfill="1 day")
    with engine.connect() as conn:  # the leader's passes at the server's next hours
        hour = conn.execute(sql("SELECT date_trunc('hour', now()) + interval '1 hour'", schema)).scalar_one()
    service = PeriodicEnqueuer(settings.periodic)
    with psycopg.connect(pg_dsn) as t1:
        t1.execute(f'UPDATE "{schema}".periodic_jobs SET schedule = %s WHERE id = %s', ("30 * * * *", "hourly"))
        one_pass(settings, engine, FrozenClock(hour + timedelta(seconds=1)), service)  # 13:00, read as it was
        one_pass(settings, engine, FrozenClock(hour + timedelta(hours=1, seconds=1)), service)  # 14:00
        t1.commit()
    result = one_pass(settings, engine, FrozenClock(hour + timedelta(hours=1, minutes=45)), service)
    assert [e["slot"] for e in result.enqueued] == [], result.enqueued
    one_pass(settings, engine, FrozenClock(hour + timedelta(hours=2, minutes=30, seconds=1)), service)
    assert [j.scheduled_at - hour for j in jobs_of(engine, schema, "hourly")] == [
        timedelta(0), timedelta(hours=1), timedelta(hours=2, minutes=30)]


def test_a_row_the_daemon_refuses_shows_no_next_slot(pg_dsn, schema, engine):
    """`maintd periodic list`, /status and the dashboard show each entry's next slot. A row the
    daemon refuses (its id a config entry's, or invalid other than by its schedule) never runs,
    yet was shown with the next slot of its schedule, as if it would run then."""
    from maintd.dashboard import periodic_rows
    from maintd.periodic_table import list_entries

    settings = Settings(database_url=pg_dsn, schema=schema, instance_id="t", periodic=[
        {"id": "nightly", "schedule": "0 3 * * *", "kind": "from.config"}])
    add_row(engine, schema, "nightly", schedule="*/5 * * * *", kind="from.table")
    add_row(engine, schema, "bad id", schedule="*/5 * * * *")
    add_row(engine, schema, "good", schedule="*/5 * * * *")
    one_pass(settings, engine, FrozenClock(T0), PeriodicEnqueuer(settings.periodic))
    assert row_error(engine, schema, "nightly") and row_error(engine, schema, "bad id")
    tables = [e for e in list_entries(engine, settings)[0] if e["origin"] == "table"]
    assert {e["id"]: e["next_slot"] is not None for e in tables} == {"nightly": False, "bad id": False, "good": True}
    with engine.connect() as conn:
        shown = {r["id"]: r for r in periodic_rows(conn, schema, settings.periodic_entries, T0)}
    assert shown["bad id"]["next_slot"] is None and shown["good"]["next_slot"] is not None
    assert shown["nightly"]["origin"] == "config" and shown["nightly"]["next_slot"] == T0 + timedelta(hours=15)
