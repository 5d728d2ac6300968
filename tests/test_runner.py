"""The runner with small fake services: error handling, no overlap, stop within 1 s, the
service_runs record and log line, reload rescheduling, fenced passes, job gauges on the leader."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DataError, DBAPIError

from maintd.clock import ServerClock
from maintd.queries import sql
from maintd.metrics import Metrics
from maintd.passes import execute_pass, maintenance_engine
from maintd.probes import CountProbe
from maintd.runner import Runner
from maintd.services.base import NoFence, NotLeader, PassContext, PassResult, PassStopped, Service

from .procs import wait_for


TARGET = "maintd"  # Metrics() default target: every series carries it (SPEC 7.4)

@dataclass
class CountResult(PassResult):
    n: int = 0

    def did_something(self) -> bool:
        return self.n > 0

    def summary(self) -> str:
        return f"touched n={self.n}"


class Flaky(Service):
    """Fails every other pass; records overlap."""

    def __init__(self, config, state):
        super().__init__(config)
        self.state = state

    def run_once(self, ctx):
        with self.state["lock"]:
            self.state["running"] += 1
            self.state["max_running"] = max(self.state["max_running"], self.state["running"])
            self.state["calls"] += 1
            n = self.state["calls"]
        try:
            time.sleep(0.05)
            if n % 2 == 0:
                raise RuntimeError("boom")
            return CountResult(n)
        finally:
            with self.state["lock"]:
                self.state["running"] -= 1


class Slow(Service):
    def run_once(self, ctx):
        with ctx.transaction() as conn:
            conn.execute(text("SELECT pg_sleep(30)"))
        return CountResult(1)


def fake(result=lambda: CountResult(0)):
    """A Service class whose passes return ``result()``."""
    return type("Fake", (Service,), {"run_once": lambda self, ctx: result()})


def fakes(**classes):
    """A ``build`` for the runner: the named fake services, each with that section of the settings."""
    return lambda settings: {name: cls(getattr(settings, name)) for name, cls in classes.items()}


def sample(metrics, name, labels):
    return metrics.registry.get_sample_value(name, labels) or 0


def test_failing_pass_is_counted_and_never_overlaps(settings, engine, maintd_log):
    state = {"lock": threading.Lock(), "running": 0, "max_running": 0, "calls": 0}
    metrics = Metrics()
    settings.cleaner.interval = timedelta(milliseconds=100)
    runner = Runner(settings, engine, metrics, build=lambda s: {"cleaner": Flaky(s.cleaner, state)})
    runner.start()
    try:
        runner.activate(NoFence())
        wait_for(lambda: state["calls"] >= 6, 10, what="six passes")
    finally:
        runner.shutdown()
    assert state["max_running"] == 1
    assert sample(metrics, "maintd_service_runs_total", {"target": TARGET, "service": "cleaner", "outcome": "error"}) >= 2
    assert sample(metrics, "maintd_service_runs_total", {"target": TARGET, "service": "cleaner", "outcome": "success"}) >= 2
    errors = [m for m in maintd_log if "pass failed" in m]
    assert errors and "error=boom" in errors[0] and "\n" not in errors[0]  # one readable line


def slow_pass(settings, engine, metrics) -> Runner:
    """A started, leading runner whose rescuer pass is under way (a 30 s query)."""
    runner = Runner(settings, engine, metrics, build=lambda s: {"rescuer": Slow(s.rescuer)})
    runner.start()
    try:
        runner.activate(NoFence())
        wait_for(lambda: runner._active, 5, what="the slow pass to start")
    except BaseException:
        runner.shutdown()
        raise
    return runner


def test_losing_leadership_stops_passes_within_a_second(settings, engine):
    metrics = Metrics()
    runner = slow_pass(settings, engine, metrics)
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        runner.deactivate()
        took = time.monotonic() - t0
        assert not runner._active and took < 1.0
        assert runner.timetable.get_jobs() == []
    finally:
        runner.shutdown()
    # Its query was cancelled because we asked: "stopped", not an error.
    assert sample(metrics, "maintd_service_runs_total", {"target": TARGET, "service": "rescuer", "outcome": "stopped"}) == 1
    assert sample(metrics, "maintd_service_runs_total", {"target": TARGET, "service": "rescuer", "outcome": "error"}) == 0


class Done(Service):
    """A pass that does something at once (so its record is written), and says when it has."""

    def __init__(self, config, done: threading.Event):
        super().__init__(config)
        self.done = done

    def run_once(self, ctx):
        self.done.set()
        return CountResult(1)


def test_a_demotion_stops_a_finished_pass_s_record_too(settings, engine, schema):
    """deactivate() returns once no pass of the term writes any more. A pass that had finished
    but whose service_runs record still waited (here on a lock) used to count as ended: its
    record landed after deactivate() returned; a test's DROP SCHEMA once deadlocked with such a
    late write (CI, PostgreSQL 18)."""
    done = threading.Event()
    runner = Runner(settings, engine, Metrics(), build=lambda s: {"cleaner": Done(s.cleaner, done)})
    runner.start()
    try:
        with engine.connect() as blocker:
            blocker.execute(text(f'LOCK TABLE "{schema}".service_runs IN EXCLUSIVE MODE'))
            runner.activate(NoFence())
            wait_for(done.is_set, 5, what="the pass")
            waiting = text("SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = "
                           "CAST(:t AS regclass)")
            wait_for(lambda: blocker.execute(waiting, {"t": f'"{schema}".service_runs'}).scalar() == 1,
                     5, what="the record waiting on the lock")
            t0 = time.monotonic()
            runner.deactivate(timeout=2.0)
            assert time.monotonic() - t0 < 1.0 and not runner._active
            blocker.rollback()  # the lock goes: a record still on its way would land now
        time.sleep(0.5)
        with engine.connect() as conn:
            written = conn.execute(text(f'SELECT count(*) FROM "{schema}".service_runs')).scalar()
        assert written == 0
    finally:
        runner.shutdown()


def test_execute_pass_reports_fenced(settings, engine, schema):
    """A pass whose write is refused by the fence is "fenced", and its write is rolled back; an
    idle pass (nothing to write) never asks the fence."""
    checks = []

    class Fenced:
        def check(self, conn):
            checks.append(1)
            raise NotLeader("stale")

    from maintd.services.cleaner import Cleaner

    ctx = PassContext.for_settings(settings, engine, ServerClock(), fence=Fenced())
    idle = execute_pass("cleaner", Cleaner(settings.cleaner), ctx)
    assert idle.outcome == "success" and checks == []
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, finalized_at) "
                         "VALUES ('k', 'completed', now() - interval '30 days')", schema))
    record = execute_pass("cleaner", Cleaner(settings.cleaner), ctx)
    assert record.outcome == "fenced" and not record.result.did_something() and "stale" in record.error
    assert checks
    with engine.connect() as conn:
        assert conn.execute(sql("SELECT count(*) FROM {schema}.jobs", schema)).scalar() == 1


def test_a_pass_that_fails_half_way_counts_what_its_committed_batches_did(settings, engine, schema):
    """A poison row fails the batch it is in; the batches committed before it deleted their rows,
    and the counters, the record and the log say so. Before, a failed (or fenced) pass reported
    nothing: an independent review counted 2,380 deletions missing from maintd_jobs_deleted_total."""
    from maintd.services.cleaner import Cleaner

    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, finalized_at) SELECT 'k', 'completed', "
                         "now() - interval '2 days' + g * interval '1 ms' FROM generate_series(1, 1000) g", schema))
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, finalized_at) "
                         "VALUES ('poison', 'completed', now() - interval '2 days' + interval '5 s')", schema))
        conn.execute(sql("CREATE FUNCTION {schema}.poison() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                         "IF OLD.kind = 'poison' THEN RAISE EXCEPTION 'poison row'; END IF; RETURN OLD; END $$", schema))
        conn.execute(sql("CREATE TRIGGER poison BEFORE DELETE ON {schema}.jobs FOR EACH ROW "
                         "EXECUTE FUNCTION {schema}.poison()", schema))
    settings.cleaner.batch_size = 100
    metrics = Metrics()
    record = execute_pass("cleaner", Cleaner(settings.cleaner), PassContext.for_settings(settings, engine, ServerClock()),
                          metrics)
    with engine.connect() as conn:
        gone = 1001 - conn.execute(sql("SELECT count(*) FROM {schema}.jobs", schema)).scalar()
    assert record.outcome == "error" and "poison row" in record.error
    assert gone >= 100 and record.result.deleted["completed"] == gone
    assert sample(metrics, "maintd_jobs_deleted_total", {"target": TARGET, "state": "completed"}) == gone


def test_pass_is_recorded_logged_and_measured(settings, engine, schema, monkeypatch, maintd_log):
    calls = []
    first_read = threading.Event()

    def result():  # 1: touched 3 rows; 2: idle (once the test has read pass 1's record); 3+: fails
        calls.append(1)
        if len(calls) == 1:
            return CountResult(3)
        if len(calls) == 2:
            first_read.wait(5)
            return CountResult(0)
        raise RuntimeError("disk full")

    settings.cleaner.interval = timedelta(milliseconds=300)
    metrics = Metrics()
    runner = Runner(settings, engine, metrics, build=fakes(cleaner=fake(result)))
    runner.start()

    def row():
        with engine.connect() as conn:
            return conn.execute(sql("SELECT outcome, result, error, instance_id, last_success_at, "
                                    "finished_at FROM {schema}.service_runs WHERE service = 'cleaner'",
                                    schema)).first()

    try:
        runner.activate(NoFence())
        first = wait_for(row, 5, what="the first record")
        first_read.set()
        assert first.outcome == "success" and first.result == {"n": 3} and first.error is None
        assert first.instance_id == settings.instance_id and first.last_success_at == first.finished_at
        wait_for(lambda: row().outcome == "error", 5, what="the failing third pass")
    finally:
        runner.shutdown()
    failed = row()
    assert failed.error == "disk full" and failed.last_success_at > first.last_success_at
    # One line for the pass that did something, none for the idle one.
    touched = [m for m in maintd_log if "touched" in m]
    assert len(touched) == 1 and touched[0].startswith("maintd.cleaner: cleaner pass result=touched n=3 seconds=")
    assert sample(metrics, "maintd_service_run_seconds_count", {"target": TARGET, "service": "cleaner"}) >= 3
    assert sample(metrics, "maintd_service_last_success_timestamp_seconds", {"target": TARGET, "service": "cleaner"}) > 0


def test_reload_reschedules_toggles_and_intervals(settings, engine, monkeypatch):
    settings.cleaner.interval = settings.rescuer.interval = settings.scheduler.interval = timedelta(hours=1)
    runner = Runner(settings, engine, Metrics(), build=fakes(cleaner=fake(), rescuer=fake(), scheduler=fake()))
    runner.start()
    try:
        runner.activate(NoFence())
        # Each interval service runs once at once, then every hour.
        wait_for(lambda: all(j.next_run_time.timestamp() > time.time() + 3000
                             for j in runner.timetable.get_jobs() if j.id != "_job_gauges"), 5,
                 what="the first passes")
        rescuer_next = runner.timetable.get_job("rescuer").next_run_time
        new = settings.model_copy(deep=True)
        new.cleaner.enabled = False
        new.scheduler.interval = timedelta(seconds=30)
        runner.reload(new)
        assert runner.timetable.get_job("cleaner") is None
        assert runner.timetable.get_job("rescuer").next_run_time == rescuer_next  # unchanged
        assert runner.timetable.get_job("scheduler").trigger.interval == timedelta(seconds=30)
        assert runner.services["scheduler"].config is new.scheduler
        new2 = new.model_copy(deep=True)
        new2.cleaner.enabled = True
        runner.reload(new2)
        assert runner.timetable.get_job("cleaner") is not None
    finally:
        runner.shutdown()
    # Not leading: a reload schedules nothing.
    runner = Runner(settings, engine, Metrics())
    runner.reload(settings)
    assert runner.timetable.get_jobs() == []


def test_a_reload_stops_a_running_pass_whose_settings_changed(settings, engine, schema):
    """An operator who lengthens a retention that was too short, or disables the cleaner, stops
    its deletions at once. Before, the pass running at the reload went on under the old settings
    until the whole backlog was gone (an independent review watched 23,000 rows go in 30 s after
    `completed_retention = "30d"` was reloaded). A service whose settings did not change keeps
    its pass."""
    from maintd.services import build_services

    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, finalized_at) SELECT 'k', 'completed', "
                         "now() - interval '2 days' FROM generate_series(1, 3000)", schema))
    settings.cleaner.batch_size, settings.cleaner.batch_pause = 100, timedelta(milliseconds=200)
    metrics = Metrics()
    runner = Runner(settings, engine, metrics, build=lambda s: {"cleaner": build_services(s)["cleaner"]})

    def left() -> int:
        with engine.connect() as conn:
            return conn.execute(sql("SELECT count(*) FROM {schema}.jobs", schema)).scalar()

    runner.start()
    try:
        runner.activate(NoFence())
        wait_for(lambda: left() <= 2800, 20, what="the cleaner's first batches")
        same = settings.model_copy(deep=True)
        same.log.level = "debug"  # another section: the cleaner's pass goes on
        runner.reload(same)
        at = left()
        wait_for(lambda: left() <= at - 300, 20, what="the cleaner's pass to go on")
        longer = same.model_copy(deep=True)
        longer.cleaner.completed_retention = timedelta(days=30)
        runner.reload(longer)
        wait_for(lambda: "cleaner" not in runner._active, 5, what="the pass to stop")
        at = left()
        time.sleep(1.5)  # seven batch pauses: the old pass would have deleted 700 more
        assert left() == at > 0  # the passes since, under the new settings, deleted nothing
        stopped = {"target": TARGET, "service": "cleaner", "outcome": "stopped"}
        assert sample(metrics, "maintd_service_runs_total", stopped) == 1
        # What the stopped pass deleted before it stopped is counted: its committed batches.
        deleted = {"target": TARGET, "state": "completed"}
        assert sample(metrics, "maintd_jobs_deleted_total", deleted) == 3000 - at
    finally:
        runner.shutdown()


def test_a_reload_leaves_a_rebuild_running_unless_it_disables_the_reindexer(settings, engine):
    """A REINDEX CONCURRENTLY cancelled by a reload leaves its invalid copy until the next
    scheduled pass (a day later, say), so a changed [reindexer] section applies from the next
    pass (an independent review of the reload fix); disabling the service still stops it."""
    from apscheduler.triggers.interval import IntervalTrigger

    from maintd.services.reindexer import Reindexer

    class Rebuild(Reindexer):
        def trigger(self):
            return IntervalTrigger(hours=1)  # its first pass at once

        def run_once(self, ctx):
            for _ in range(100):
                ctx.pause(0.05)
            return CountResult(1)

    settings.reindexer.enabled = True
    runner = Runner(settings, engine, Metrics(), build=lambda s: {"reindexer": Rebuild(s.reindexer)})
    runner.start()
    try:
        runner.activate(NoFence())
        wait_for(lambda: "reindexer" in runner._active, 5, what="the rebuild to start")
        changed = settings.model_copy(deep=True)
        changed.reindexer.indexes = ["jobs_pkey"]
        runner.reload(changed)
        time.sleep(0.5)
        assert "reindexer" in runner._active  # goes on
        disabled = changed.model_copy(deep=True)
        disabled.reindexer.enabled = False
        runner.reload(disabled)
        wait_for(lambda: "reindexer" not in runner._active, 2, what="the rebuild to stop")
    finally:
        runner.shutdown()


def test_a_fenced_pass_demotes_only_its_own_live_term(settings, engine, monkeypatch):
    release = threading.Event()
    calls: list[int] = []

    def pass_():  # 1: term 1's straggler, refused late; 2: term 2, fine; 3: term 2, refused
        calls.append(1)
        if len(calls) == 1:
            release.wait(5)
        if len(calls) in (1, 3):
            raise NotLeader("epoch is no longer ours")
        return CountResult(0)

    settings.cleaner.interval = timedelta(milliseconds=200)
    fenced: list = []
    runner = Runner(settings, engine, Metrics(), on_fenced=lambda reason, fence: fenced.append(fence),
                    build=fakes(cleaner=fake(pass_)))
    runner.start()
    term1, term2 = NoFence(), NoFence()
    try:
        runner.activate(term1)
        wait_for(lambda: runner._active, 5, what="a pass of term 1")
        runner.deactivate(timeout=0.1)
        runner.activate(term2)
        release.set()  # term 1's straggler now finds itself fenced: old news, term 2 stays
        # Term 2's first pass starts only after the straggler's run returned (no overlap).
        wait_for(lambda: len(calls) >= 2, 5, what="term 2's first pass")
        assert term1 not in fenced
        wait_for(lambda: fenced, 5, what="term 2's own fenced pass")
        assert fenced == [term2]
    finally:
        runner.shutdown()


@contextmanager
def leading_count_probe(settings, engine, metrics):
    """A runner that leads (no services) and the CountProbe the daemon runs every second for a
    database, over that one target; yields (runner, probe)."""
    runner = Runner(settings, engine, metrics, build=lambda s: {})
    runner.start()
    try:
        runner.activate(NoFence())
        target = SimpleNamespace(is_leader=True, runner=runner, settings=settings, name=settings.schema)
        yield runner, CountProbe(engine, [target])
    finally:
        runner.shutdown()


def test_job_gauges_only_while_leading(settings, engine, queue, monkeypatch):
    with engine.begin() as conn:
        queue.enqueue(conn, "k", queue="mail")
    metrics = Metrics()
    with leading_count_probe(settings, engine, metrics) as (runner, probe):
        probe.run()
        assert sample(metrics, "maintd_jobs", {"target": TARGET, "queue": "mail", "state": "available"}) == 1
        runner.deactivate()
        assert sample(metrics, "maintd_jobs", {"target": TARGET, "queue": "mail", "state": "available"}) == 0
        assert b"maintd_oldest_available_job_age_seconds{" not in metrics.render()


def test_a_count_of_finished_jobs_past_its_timeout_leaves_the_live_counts_taken(settings, engine, queue, monkeypatch,
                                                                                  maintd_log):
    """Counting finished jobs reads the heap (the README says so): on a big table it passes the
    count's statement timeout. The live states, the oldest available age and the finished states
    went in one statement, so the live ones failed with it: maintd_jobs and
    maintd_oldest_available_job_age_seconds never appeared (a backlog alert stayed silent),
    /status said "not counted yet", and the doomed heap read ran again every 15 s (twice: the
    batch, then the target alone), logged at debug only. Here the final count sleeps past a
    200 ms timeout."""
    from maintd.queries import jobs as q_jobs

    with engine.begin() as conn:
        queue.enqueue(conn, "k", queue="mail")
    monkeypatch.setattr(q_jobs, "COUNT_FINAL", q_jobs.COUNT_FINAL.replace("FROM {schema}.jobs", "FROM {schema}.jobs, pg_sleep(0.5) s"))
    monkeypatch.setattr(CountProbe, "TIMEOUT_MS", 200)
    metrics = Metrics()
    with leading_count_probe(settings, engine, metrics) as (runner, probe):
        probe.run()
        assert sample(metrics, "maintd_jobs", {"target": TARGET, "queue": "mail", "state": "available"}) == 1
        assert metrics.registry.get_sample_value("maintd_oldest_available_job_age_seconds",
                                                 {"target": TARGET, "queue": "mail"}) is not None
        assert runner.gauges.counts is not None and runner.gauges.counts.final_at is None
        assert not runner.gauges.final_due(), "the heap read that timed out is tried again at once"
        assert any("finished jobs not counted" in line for line in maintd_log), maintd_log


def test_maintenance_sessions_are_bounded(settings):
    engine = maintenance_engine(settings)
    try:
        with engine.connect() as conn:
            st = conn.execute(text("SHOW statement_timeout")).scalar()
            idle = conn.execute(text("SHOW idle_in_transaction_session_timeout")).scalar()
            app = conn.execute(text("SHOW application_name")).scalar()
    finally:
        engine.dispose()
    assert st == "30s" and idle == "10s" and app == f"maintd:{settings.instance_id}:work"


def timeouts(conn) -> tuple[int, str, str]:
    return tuple(conn.execute(text("SELECT pg_backend_pid(), current_setting('lock_timeout'), "
                                   "current_setting('statement_timeout')")).one())


def test_an_autocommit_ddl_connection_goes_back_to_the_pool_with_its_own_bounds(settings):
    """The reindexer's DDL sets its own timeouts on a pooled connection. Putting them back with
    RESET would give the next pass on that connection the role's defaults (usually no timeout at
    all), not the session settings the pool set at connect (PostgreSQL docs, RESET: "the value
    that the parameter would have had, if no SET had ever been issued for it in the current
    session")."""
    engine = maintenance_engine(settings)
    ctx = PassContext.for_settings(settings, engine, ServerClock())
    try:
        with engine.connect() as conn:
            pid, lock_timeout, statement_timeout = timeouts(conn)
        assert statement_timeout == "30s" and lock_timeout not in ("0", "77ms")
        with ctx.autocommit(lock_timeout_ms=77, statement_timeout_ms=1234) as conn:
            assert timeouts(conn) == (pid, "77ms", "1234ms")
        with engine.connect() as conn:
            assert timeouts(conn) == (pid, lock_timeout, statement_timeout)
    finally:
        engine.dispose()


def test_an_autocommit_connection_whose_timeouts_could_not_all_be_set_goes_back_with_its_own(settings):
    """The second SET failing (here a value the server refuses) left the first in force on the
    pooled connection: the next pass on it ran with the DDL's lock_timeout."""
    engine = maintenance_engine(settings)
    ctx = PassContext.for_settings(settings, engine, ServerClock())
    try:
        with engine.connect() as conn:
            pid, lock_timeout, statement_timeout = timeouts(conn)
        with pytest.raises(DBAPIError, match="statement_timeout"):
            with ctx.autocommit(lock_timeout_ms=77, statement_timeout_ms=-5):
                pass
        with engine.connect() as conn:
            now = timeouts(conn)
        assert now[1:] == (lock_timeout, statement_timeout)
    finally:
        engine.dispose()


def backend(ctx: PassContext, **kw) -> tuple[int, str, str]:
    with ctx.transaction(**kw) as conn:
        return (conn.execute(text("SELECT pg_backend_pid()")).scalar(),
                conn.execute(text("SHOW lock_timeout")).scalar(),
                conn.execute(text("SHOW statement_timeout")).scalar())


def test_a_pass_session_keeps_one_connection_and_local_settings_end_with_their_transaction(settings):
    engine = maintenance_engine(settings)
    ctx = PassContext.for_settings(settings, engine, ServerClock())
    try:
        with ctx.session():
            pid, lock_timeout, timeout = backend(ctx, statement_timeout_ms=1234, settings={"lock_timeout": "77"})
            assert (lock_timeout, timeout) == ("77ms", "1234ms")
            assert engine.pool.checkedout() == 1  # held between the pass's transactions
            # Same backend, and the settings were the last transaction's only.
            assert backend(ctx) == (pid, "5s", "30s")
            # A failing transaction gives the connection back; the next one gets a working one.
            with pytest.raises(DataError, match="division by zero"):
                with ctx.transaction() as conn:
                    conn.execute(text("SELECT 1/0"))
            assert engine.pool.checkedout() == 0
            assert backend(ctx)[1:] == ("5s", "30s")
        assert engine.pool.checkedout() == 0 and not ctx.query.active
        # Outside a session (e.g. a test driving run_once) each transaction checks one out.
        backend(ctx)
        assert engine.pool.checkedout() == 0
    finally:
        engine.dispose()


def test_execute_pass_runs_the_pass_in_one_session(settings, engine):
    pids = []

    class TwoTransactions(Service):
        def run_once(self, ctx):
            for _ in range(2):
                with ctx.transaction() as conn:
                    pids.append(conn.execute(text("SELECT pg_backend_pid()")).scalar())
                held.append(engine.pool.checkedout())
            return CountResult(0)

    held: list[int] = []
    ctx = PassContext.for_settings(settings, engine, ServerClock())
    assert execute_pass("rescuer", TwoTransactions(settings.rescuer), ctx).outcome == "success"
    assert len(set(pids)) == 1 and held == [1, 1]  # kept between the transactions of the pass
    assert engine.pool.checkedout() == 0  # and given back at its end
    with pytest.raises(ValueError):  # setting names are code, never config: checked all the same
        with ctx.transaction(settings={"lock_timeout'); DROP TABLE x; --": "1"}):
            pass


def test_pause_sleeps_unless_stopped(settings, engine):
    ctx = PassContext.for_settings(settings, engine, ServerClock())
    t0 = time.monotonic()
    ctx.pause(0.1)
    assert 0.09 <= time.monotonic() - t0 < 2
    ctx.pause(0)  # no pause, nothing to wait for
    ctx.stop_event.set()
    ctx.pause(0)  # a zero pause does not look at the stop flag
    t0 = time.monotonic()
    with pytest.raises(PassStopped):
        ctx.pause(5)
    assert time.monotonic() - t0 < 1


class CountingLock:
    """A lock that counts its acquisitions (APScheduler's job store lock, wrapped)."""

    def __init__(self, lock):
        self.lock, self.taken = lock, 0

    def __enter__(self):
        self.lock.acquire()
        self.taken += 1
        return self

    def __exit__(self, *exc):
        self.lock.release()

    def acquire(self, *a, **kw):
        got = self.lock.acquire(*a, **kw)
        self.taken += bool(got)
        return got

    def release(self):
        self.lock.release()


def returns_while_another_thread_holds(lock, fn, within: float = 10.0) -> bool:
    """Whether ``fn()``, on a thread of its own, returns within ``within`` seconds while another
    thread holds ``lock`` (as the timetable's thread does while it submits due jobs), which it lets
    go only after that. The timetable's lock is reentrant: held by the thread that calls ``fn``, a
    ``fn`` that took it itself went straight through. Not a time bound on ``fn``: a ``fn`` that
    waits for the lock waits for as long as it is held."""
    taken, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold() -> None:
        with lock:
            taken.set()
            release.wait(within + 30)

    def call() -> None:
        try:
            fn()
        except BaseException as exc:  # raised below, on the test's thread
            errors.append(exc)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert taken.wait(10), "the lock was not taken"
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(within)
        returned = not caller.is_alive()
    finally:
        release.set()
        holder.join(10)
    if errors:
        raise errors[0]
    return returned


def test_a_term_begins_and_ends_without_waiting_for_the_timetable(settings, engine):
    """Several targets share one timetable, whose thread holds its job store lock while it submits
    due jobs (at a start of 200 targets, 46 leases once ran out while the election loop waited for
    it). Activation and demotion, on the election loop's thread, only set the term's state: the
    timetable changes are made by the daemon's Changes thread, in order. With the lock held, both
    return at once; once it is free the services run, and a term that ended before its services
    were scheduled leaves none."""
    from maintd.runner import Changes, new_timetable

    timetable = new_timetable(4)
    timetable.start()
    changes = Changes()
    ran: list[str] = []
    build = fakes(cleaner=type("C", (Service,), {"run_once": lambda self, ctx: ran.append("c") or CountResult(0)}),
                  rescuer=type("R", (Service,), {"run_once": lambda self, ctx: ran.append("r") or CountResult(0)}))
    runner = Runner(settings, engine, Metrics(), build=build, timetable=timetable, prefix="t1:", changes=changes)
    try:
        assert returns_while_another_thread_holds(timetable._jobstores_lock, lambda: runner.activate(NoFence()))
        wait_for(lambda: "c" in ran and "r" in ran, 10, what="both services' first passes")
        assert returns_while_another_thread_holds(timetable._jobstores_lock, lambda: (
            runner.deactivate(timeout=0), runner.activate(NoFence()), runner.deactivate(timeout=0)))
        wait_for(lambda: runner._jobs() == [], 5, what="the ended terms' jobs removed")
        time.sleep(0.5)
        assert runner._jobs() == [] and not runner._active
    finally:
        changes.stop()
        runner.shutdown()
        timetable.shutdown(wait=False)


def test_deactivate_survives_a_one_off_job_that_fired_since_it_was_listed(settings, engine, monkeypatch):
    """A one-off job (a wake) fires, and the timetable's thread then removes it. A demotion listing
    the runner's jobs just before that removal must still remove the others and stop the term,
    not raise JobLookupError."""
    from maintd.runner import new_timetable

    timetable = new_timetable(2)
    timetable.start()
    build = fakes(cleaner=type("C", (Service,), {"run_once": lambda self, ctx: CountResult(0)}))
    runner = Runner(settings, engine, Metrics(), build=build, timetable=timetable, prefix="t1:")
    try:
        with timetable._jobstores_lock:  # nothing fires meanwhile
            runner.activate(NoFence())
            gone = timetable.add_job(lambda: None, "date", id="t1:gone")
            listed = runner._jobs()
            timetable.remove_job("t1:gone")  # as the timetable's thread does once it fired
            other = timetable.add_job(lambda: None, "interval", seconds=60, id="t1:other")
        assert gone in listed or any(j.id == "t1:gone" for j in listed)
        monkeypatch.setattr(runner, "_jobs", lambda: [*listed, other])
        runner.deactivate()
        assert timetable.get_job("t1:other") is None and runner._stop_event.is_set()
    finally:
        runner.shutdown()
        timetable.shutdown(wait=False)




def test_a_follower_exports_the_enabled_services_series_at_0_and_keeps_them(settings, engine):
    """SPEC 7.4: the series with a known label set exist from the start at 0, on every replica.
    Before, only a leader's runner created them (at the start of its term): after a failover the
    new leader's first sample of maintd_jobs_deleted_total already held its first pass's deletions,
    and rate() and increase() never saw them."""
    settings.cleaner.interval = timedelta(hours=1)
    metrics = Metrics()
    runner = Runner(settings, engine, metrics)

    def series(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"target": TARGET, **labels})

    def exported() -> dict[str, float | None]:
        return {"deleted": series("maintd_jobs_deleted_total", state="completed"),
                "runs": series("maintd_service_runs_total", service="cleaner", outcome="success"),
                "errors": series("maintd_service_runs_total", service="cleaner", outcome="error")}

    runner.start()
    try:
        assert exported() == {"deleted": 0.0, "runs": 0.0, "errors": 0.0}  # a follower, from the start
        runner.activate(NoFence())
        wait_for(lambda: (series("maintd_service_runs_total", service="cleaner", outcome="success") or 0) >= 1, 10,
                 what="the cleaner's first pass")
        runner.deactivate()
        assert exported()["deleted"] == 0.0 and exported()["runs"] >= 1  # kept when it stops leading
        off = settings.model_copy(deep=True)
        off.cleaner.enabled = False
        runner.reload(off)  # a follower's reload: a disabled service has no series
        assert exported() == {"deleted": None, "runs": None, "errors": None}
        runner.reload(settings)
        assert exported() == {"deleted": 0.0, "runs": 0.0, "errors": 0.0}
    finally:
        runner.shutdown()


class ProbedWhenPrecise(Service):
    """Like the scheduler: with precise timing a probe drives its passes, else it ticks."""

    def probe(self):
        return ["(SELECT 1)"] if self.config.precise_timing else None

    def run_once(self, ctx):
        return CountResult(0)


def test_a_reload_that_hands_a_service_to_its_probe_removes_its_ticks(settings, engine):
    """``scheduler.precise_timing`` turned on by a reload: the probe drives the passes from then
    on. Before, the interval job of the ticks stayed in the timetable beside the probe's wakes, so
    the service ran on both (a pass every ``interval`` that the probe was there to save)."""
    settings.scheduler.precise_timing = False
    settings.scheduler.interval = timedelta(hours=1)
    runner = Runner(settings, engine, Metrics(), build=fakes(scheduler=ProbedWhenPrecise))
    runner.start()
    try:
        runner.activate(NoFence())
        wait_for(lambda: runner.timetable.get_job("scheduler") is not None, 5, what="the ticks")
        new = settings.model_copy(deep=True)
        new.scheduler.precise_timing = True
        runner.reload(new)
        ticks = runner.timetable.get_job("scheduler")
        assert ticks is None, f"the ticks stayed beside the probe: {ticks}"
        assert runner.probed("scheduler")
    finally:
        runner.shutdown()


class LongProbed(Service):
    """Driven by a probe; its pass takes a second."""

    def probe(self):
        return ["(SELECT 1)"]

    def run_once(self, ctx):
        time.sleep(1.0)
        return CountResult(0)


def test_a_wake_during_a_long_pass_waits_for_it_without_spinning(settings, engine):
    """The probe asks for a pass while one is running (a long cleaner pass: the probe still sees
    expired rows). Before, the wake was put off by 10 ms again and again for as long as the pass
    ran: a hundred one-off jobs a second for the whole pass. Now it runs once, after the pass."""
    runner = Runner(settings, engine, Metrics(), build=fakes(cleaner=LongProbed))
    runner.start()
    try:
        runner.activate(NoFence())
        wait_for(lambda: "cleaner" in runner._active, 5, what="the first pass")
        first = runner._wake_seq
        runner.wake("cleaner")
        wait_for(lambda: runner.metrics.registry.get_sample_value(
            "maintd_service_runs_total", {"target": TARGET, "service": "cleaner", "outcome": "success"}) == 2,
            10, what="the pass asked for during the first")
        assert runner._wake_seq - first <= 3, f"{runner._wake_seq - first} wakes for one asked-for pass"
    finally:
        runner.shutdown()


def test_a_probe_finding_nothing_while_a_pass_runs_counts_no_idle_pass(settings, engine):
    """The probe reads the database between passes: one that found nothing while a pass of the
    same service was running (its rows gone meanwhile, say) counted an idle success and made
    "nothing to do" the service's last run in /status, while the real pass was still at work."""
    metrics = Metrics()
    runner = slow_pass(settings, engine, metrics)
    try:
        runner.idle("rescuer", datetime.now(timezone.utc))
        runs = sample(metrics, "maintd_service_runs_total", {"target": TARGET, "service": "rescuer", "outcome": "success"})
        assert runs == 0 and "rescuer" not in runner.last_runs, f"{runs} idle pass(es) counted during a pass"
    finally:
        runner.deactivate()
        runner.shutdown()



class Counted(Service):
    """Counts its passes."""

    def __init__(self, config, calls: list):
        super().__init__(config)
        self.calls = calls

    def run_once(self, ctx):
        self.calls.append(time.monotonic())
        return CountResult(1)


def test_a_wake_that_comes_after_a_reload_disabled_the_service_runs_no_pass(settings, engine):
    """A wake asked for before a reload disabled the service (the probe's read in flight, which
    found a job due; a precise-timing pass's follow-up) came after it: the disabled scheduler
    promoted jobs once more. A disabled service runs no pass, however it is asked for."""
    calls: list = []
    settings.scheduler.interval = timedelta(hours=1)
    runner = Runner(settings, engine, Metrics(), build=lambda s: {"scheduler": Counted(s.scheduler, calls)})
    runner.start()
    try:
        runner.activate(NoFence())
        wait_for(lambda: len(calls) == 1, 5, what="the first pass")
        new = settings.model_copy(deep=True)
        new.scheduler.enabled = False
        runner.reload(new)
        runner.wake("scheduler")  # the probe's verdict, read before the reload
        time.sleep(1.0)
        assert len(calls) == 1, f"{len(calls) - 1} pass(es) of a disabled service"
    finally:
        runner.shutdown()


class HangingClock(ServerClock):
    """The server's time, read by a statement that hangs once ``hang`` is set (as on a frozen
    server)."""

    def __init__(self):
        super().__init__()
        self.hang = threading.Event()
        self.hanging = threading.Event()

    def sync(self, conn):
        if self.hang.is_set():
            self.hanging.set()
            conn.execute(text("SELECT pg_sleep(30)"))
        super().sync(conn)


class Fresh(Service):
    """Reads the server's time afresh first, as every cleaner pass does."""

    def run_once(self, ctx):
        ctx.now(fresh=True)
        return CountResult(0)


@contextmanager
def pass_hung_on_the_server_s_time(settings, engine, service):
    """A runner whose cleaner (``service``, every 200 ms) hangs reading the server's time in the
    first pass of its term (a HangingClock); yields (runner, clock) once it hangs, and lets go of
    the clock and shuts the runner down afterwards."""
    clock = HangingClock()
    settings.cleaner.interval = timedelta(milliseconds=200)
    runner = Runner(settings, engine, Metrics(), clock=clock, build=fakes(cleaner=service))
    runner.start()
    try:
        clock.hang.set()
        runner.activate(NoFence())
        wait_for(clock.hanging.is_set, 5, what="the pass reading the server's time")
        yield runner, clock
    finally:
        clock.hang.clear()
        runner.shutdown()


def test_a_pass_hanging_on_the_server_s_time_is_stopped_and_severed(settings, engine):
    """A pass's first statement is often the read of the server's time (the cleaner's, every
    pass). It was not tracked: a demotion did not cancel it and sever_stalled did not shut its
    socket, so on a frozen server the pass hung on until the answer timeout (statement timeout +
    lease), holding a thread, a pooled connection and the service (the next term's passes of it
    wait for it)."""
    with pass_hung_on_the_server_s_time(settings, engine, Fresh) as (runner, _):
        time.sleep(0.2)
        assert runner.stalled_for() > 0.1  # the hang is seen
        t0 = time.monotonic()
        runner.deactivate(timeout=5.0)
        took = time.monotonic() - t0
        assert not runner._active and took < 3.0, f"the pass still ran {took:.1f} s after the demotion"


def test_a_new_term_does_not_wait_for_a_pass_of_the_ended_term_hung_on_a_frozen_server(
        settings, engine, monkeypatch):
    """The term ends while a pass waits on a frozen server, which answers no cancel (with a
    multi-host URL the next term leads on the promoted standby). Nothing shut that pass's socket
    (the stall detection counts the current term's passes only), and the new term's passes of
    the service were turned away as "already running" until the old one's wait for an answer ran
    out (statement_timeout + lease, 40 s by default): no cleaner, say, in the new term."""
    from maintd.services.base import RunningQuery

    monkeypatch.setattr(RunningQuery, "cancel", lambda self: None)  # a frozen server answers no cancel
    terms: list = []

    class Counted(Service):
        def run_once(self, ctx):
            ctx.now(fresh=True)
            terms.append(ctx.fence)
            return CountResult(0)

    with pass_hung_on_the_server_s_time(settings, engine, Counted) as (runner, clock):
        clock.hang.clear()
        runner.deactivate(timeout=0)
        new_term = NoFence()
        runner.activate(new_term)
        t0 = time.monotonic()
        wait_for(lambda: new_term in terms, 10, what="a pass of the new term")
        assert time.monotonic() - t0 < 3.0
        assert terms[0] is new_term  # the hung pass did not go on (its socket shut)


def test_a_cancel_that_arrives_late_never_hits_the_connection_s_next_user(engine, monkeypatch):
    """A demotion cancels the statement a pass is running; the cancel request goes out from a
    thread of its own and may arrive after that statement has ended (a short one: the read of
    the server's time). The connection went back to the pool at once, and the cancel hit
    whatever its next user ran there (a probe, the next term's pass, a test's SELECT: "canceling
    statement due to user request"). Its release now waits for the cancel to be delivered."""
    import psycopg

    from maintd.services.base import RunningQuery

    real = psycopg.Connection.cancel_safe

    def late(self, *args, **kwargs):  # the cancel's own connection takes a while (a busy server)
        time.sleep(0.3)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "cancel_safe", late)
    query = RunningQuery()
    with engine.connect() as conn:
        with query.tracking(conn):
            conn.execute(text("SELECT 1"))
            query.cancel()  # the statement has ended already
        conn.rollback()
        conn.execute(text("SELECT pg_sleep(0.8)"))  # the connection's next user: not cancelled


class ObserveFails(Service):
    """Its first pass waits until told to end; its ``observe`` fails (a bug in a service's metrics),
    so that ``execute_pass`` raises instead of returning a record."""

    def __init__(self, config, calls: list, release: threading.Event):
        super().__init__(config)
        self.calls, self.release = calls, release

    def run_once(self, ctx):
        self.calls.append(time.monotonic())
        if len(self.calls) == 1:
            self.release.wait(10)
        return CountResult(1)

    def observe(self, metrics, result):
        raise RuntimeError("observe failed")


def test_a_wake_asked_for_during_a_pass_that_raises_still_runs(settings, engine):
    """A wake asked for while a pass runs (the probe found work) is deferred until the pass ends.
    When execute_pass raised rather than returned a record (here the service's observe failed),
    the deferred wake was dropped with the exception: no second pass until the next tick (an
    hour here), the work the probe saw left waiting."""
    calls: list = []
    release = threading.Event()
    settings.cleaner.interval = timedelta(hours=1)
    runner = Runner(settings, engine, Metrics(), build=lambda s: {"cleaner": ObserveFails(s.cleaner, calls, release)})
    runner.start()
    try:
        runner.activate(NoFence())
        wait_for(lambda: "cleaner" in runner._active, 5, what="the first pass")
        runner.wake("cleaner")  # deferred: the pass runs
        wait_for(lambda: "cleaner" in runner._deferred, 5, what="the wake deferred")
        release.set()
        wait_for(lambda: len(calls) >= 2, 10, what="the pass asked for during the first (which raised)")
        wait_for(lambda: not runner._active, 5, what="the second pass to end")
    finally:
        release.set()
        runner.shutdown()


@dataclass
class WakeResult(CountResult):
    next_pass_at: datetime | None = None

    def wake_at(self):
        return self.next_pass_at


class AsksAgainObserveFails(Service):
    """Each pass asks for the next one half a second later (as the scheduler does for a job due
    before its next tick); its ``observe`` fails, so that ``execute_pass`` raises."""

    def __init__(self, config, calls: list):
        super().__init__(config)
        self.calls = calls

    def run_once(self, ctx):
        self.calls.append(time.monotonic())
        result = ctx.begin(WakeResult(1))
        result.next_pass_at = ctx.now() + timedelta(seconds=0.5)
        return result

    def observe(self, metrics, result):
        raise RuntimeError("observe failed")


def test_the_follow_up_a_pass_asked_for_survives_execute_pass_raising(settings, engine):
    """A pass that asked for its next one at a time (wake_at: a job due before the next tick)
    lost that follow-up when execute_pass raised after the pass (its service's observe failed):
    the job waited for the next tick (an hour here) instead of half a second."""
    calls: list = []
    settings.cleaner.interval = timedelta(hours=1)
    runner = Runner(settings, engine, Metrics(), build=lambda s: {"cleaner": AsksAgainObserveFails(s.cleaner, calls)})
    runner.start()
    try:
        runner.activate(NoFence())
        wait_for(lambda: len(calls) >= 3, 10, what="the passes each pass asked for")
        assert calls[2] - calls[0] > 0.8, "the follow-ups came sooner than asked"
    finally:
        runner.shutdown()


def test_a_demoted_replica_drops_the_reindex_durations_of_its_term(settings, engine):
    """maintd_reindex_duration_seconds{index} is the leader's figure of its last rebuild. A replica
    that stopped leading kept exporting it as current (a dashboard showing max or last across the
    replicas showed the ex-leader's), unlike maintd_jobs, which a demotion clears. Its counters
    (maintd_reindex_total) stay, as every counter does."""
    from maintd.services.reindexer import Reindexer

    settings.reindexer.enabled = True
    settings.reindexer.indexes = ["jobs_pkey"]
    metrics = Metrics()
    runner = Runner(settings, engine, metrics, build=lambda s: {"reindexer": Reindexer(s.reindexer)})
    runner.start()
    labels = {"target": TARGET, "index": "jobs_pkey"}
    try:
        runner.activate(NoFence())
        runner.wake("reindexer")  # a pass now (its cron slot is midnight)
        wait_for(lambda: metrics.registry.get_sample_value("maintd_reindex_duration_seconds", labels) is not None,
                 30, what="the rebuild's duration")
        runner.deactivate()
        assert metrics.registry.get_sample_value("maintd_reindex_duration_seconds", labels) is None
        assert b"maintd_reindex_duration_seconds{" not in metrics.render()
        assert sample(metrics, "maintd_reindex_total", {**labels, "outcome": "reindexed"}) == 1
    finally:
        runner.shutdown()


class SlowCounter(Service):
    """Declares the stray-rows gauge and sets it from what its pass did so far, also when the pass
    is stopped half-way (as the partitioner's observe does with a stopped pass's partial result)."""

    from maintd.services.partitioner import STRAY_ROWS
    METRICS = (STRAY_ROWS,)

    def run_once(self, ctx):
        ctx.begin(CountResult(7))
        with ctx.transaction() as conn:
            conn.execute(text("SELECT pg_sleep(30)"))
        return CountResult(7)

    def observe(self, metrics, result):
        metrics[self.STRAY_ROWS].set(result.n)


def test_a_pass_that_ends_after_the_demotion_leaves_no_gauge_of_its_term(settings, engine):
    """The election loop demotes without waiting for the passes (deactivate(timeout=0)): a pass
    stopped then reports what it did after deactivate() returned, and its gauge was set again on
    the follower. The term's gauges are cleared once more when such a pass ends."""
    metrics = Metrics()
    runner = Runner(settings, engine, metrics, build=lambda s: {"partitioner": SlowCounter(s.cleaner)})
    runner.start()
    try:
        runner.activate(NoFence())
        wait_for(lambda: runner._active, 5, what="the slow pass to start")
        runner.deactivate(timeout=0)
        wait_for(lambda: sample(metrics, "maintd_service_runs_total",
                                {"target": TARGET, "service": "partitioner", "outcome": "stopped"}) == 1,
                 5, what="the stopped pass reported")
        wait_for(lambda: not runner._active, 5, what="the pass to end")
        assert metrics.registry.get_sample_value("maintd_partition_stray_rows", {"target": TARGET}) in (None, 0)
    finally:
        runner.shutdown()
