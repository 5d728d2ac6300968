"""A daemon whose host clock is minutes off behaves exactly like one whose clock is right (SPEC 7.1).

Real processes under Debian's libfaketime (``FAKETIME=+300s``: the host clock runs 5 minutes fast;
``-120s``: 2 minutes slow; the monotonic clock is left alone), against the real server, whose
``now()`` is what the workers write. Every expectation below is what a correct clock gives; the
comments say what the skewed host clock would have done if maintd trusted it.
"""

from __future__ import annotations

import re
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from maintd.queries import sql

from .procs import START, DaemonProc, wait_for
from .tools import path, require

FAKETIME_LIB = Path(path("libfaketime"))

pytestmark = pytest.mark.slow


def skewed(offset: str) -> dict[str, str]:
    require("libfaketime")
    # Both spellings: libfaketime renamed DONT_FAKE_MONOTONIC in 0.9.9 (Debian 12 ships 0.9.10).
    return {"LD_PRELOAD": str(FAKETIME_LIB), "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "DONT_FAKE_MONOTONIC": "1"}


def saw_the_skew(d: DaemonProc, offset: float, started: float) -> None:
    """The daemon's host clock was skewed (its log stamps come from it): else every check below
    would hold for a right clock too, and libfaketime failing to load is only a warning."""
    first = wait_for(lambda: re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z", d.log()), START,
                     what="the daemon's first log line")
    logged = datetime.strptime(first.group(1), "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
    assert abs(logged - started - offset) < 30, (first.group(0), offset)


def insert(engine, schema, statement: str) -> list[int]:
    with engine.begin() as conn:
        return [r[0] for r in conn.execute(sql(statement + " RETURNING id", schema))]


def state_of(engine, schema, job_id: int) -> str | None:
    with engine.connect() as conn:
        return conn.execute(sql("SELECT state::text FROM {schema}.jobs WHERE id = :id", schema),
                            {"id": job_id}).scalar()


CONFIG = {
    "cleaner": {"interval": "1s", "completed_retention": "2m"},
    "rescuer": {"interval": "1s", "rescue_stuck_jobs_after": "3m"},
    "scheduler": {"interval": "1s"},
}


def test_a_fast_host_clock_neither_rescues_live_jobs_nor_deletes_or_promotes_early(pg_dsn, schema, engine):
    [live] = insert(engine, schema, "INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at) "
                                    "VALUES ('live', 'running', 1, now() - interval '1 minute')")
    [dead] = insert(engine, schema, "INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at) "
                                    "VALUES ('dead', 'running', 1, now() - interval '10 minutes')")
    [fresh] = insert(engine, schema, "INSERT INTO {schema}.jobs (kind, state, finalized_at) "
                                     "VALUES ('fresh', 'completed', now() - interval '30 seconds')")
    [old] = insert(engine, schema, "INSERT INTO {schema}.jobs (kind, state, finalized_at) "
                                   "VALUES ('old', 'completed', now() - interval '10 minutes')")
    [later] = insert(engine, schema, "INSERT INTO {schema}.jobs (kind, state, scheduled_at) "
                                     "VALUES ('later', 'scheduled', now() + interval '2 minutes')")
    [due] = insert(engine, schema, "INSERT INTO {schema}.jobs (kind, state, scheduled_at) "
                                   "VALUES ('due', 'scheduled', now() - interval '1 second')")
    started = time.time()
    d = DaemonProc(pg_dsn, schema, "fast", CONFIG, env=skewed("+300s")).start()
    try:
        saw_the_skew(d, 300, started)
        # The work a right clock does happens...
        wait_for(lambda: state_of(engine, schema, dead) == "retryable", 30, what="the dead job rescued")
        wait_for(lambda: state_of(engine, schema, old) is None, 30, what="the old job deleted")
        wait_for(lambda: state_of(engine, schema, due) == "available", 30, what="the due job promoted")
        time.sleep(3)  # a few more passes of each service
        # ... and nothing a clock 5 minutes fast would have done: rescue a job that was heard from a
        # minute ago (it would run twice), delete a job finished 30 s ago, promote one due in 2 min.
        assert state_of(engine, schema, live) == "running"
        assert state_of(engine, schema, fresh) == "completed"
        assert state_of(engine, schema, later) == "scheduled"
    finally:
        assert d.stop() == 0, d.log()


def test_a_slow_host_clock_still_promotes_due_jobs_and_enqueues_periodic_slots(pg_dsn, schema, engine):
    [due] = insert(engine, schema, "INSERT INTO {schema}.jobs (kind, state, scheduled_at) "
                                   "VALUES ('due', 'scheduled', now() - interval '10 seconds')")
    # A correct leader ran the periodic entry until just now: its newest slot is the server's now.
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.periodic_slots (periodic_id, slot) "
                         "VALUES ('tick', to_timestamp(floor(extract(epoch FROM now()) / 2) * 2))", schema))
    config = {**CONFIG, "periodic": [{"id": "tick", "schedule": "@every 2s", "kind": "tick"}]}
    started = time.time()
    d = DaemonProc(pg_dsn, schema, "slow", config, env=skewed("-120s")).start()
    try:
        saw_the_skew(d, -120, started)
        # A clock 2 minutes slow would see the job as not due for another 110 s, and the next
        # periodic slot 2 minutes away.
        wait_for(lambda: state_of(engine, schema, due) == "available", 20, what="the due job promoted")

        def enqueued():
            with engine.connect() as conn:
                return conn.execute(sql("SELECT count(*) FROM {schema}.jobs j "
                                        "WHERE kind = 'tick' AND scheduled_at > now() - interval '30 seconds'",
                                        schema)).scalar()

        wait_for(enqueued, 20, what="a periodic slot of the server's present")
    finally:
        assert d.stop() == 0, d.log()


def test_targets_on_two_servers_each_take_their_own_server_s_time(pg_dsn, pg_version, schema, engine, monkeypatch):
    """SPEC 7.1: the times maintd computes (the periodic slots due, a rescue's horizon) are the
    server's, and with targets on two servers, each target's own server's. The daemon carried one
    reading of "the server's time" for all its targets: here the other server's, so the periodic
    entry of the target whose server runs an hour ahead enqueued each slot an hour late (its jobs'
    scheduled_at 3,600 s behind its server's now()), and with the clocks the other way round it
    would have enqueued the coming hour's slots at once. The SQL guards hold the rest: a live job
    (seen 2 minutes ago, rescued after 30) stays running, and the one seen 40 minutes ago is
    rescued (the control: the rescuer runs)."""
    import contextlib

    from maintd import migrate
    from maintd.config import Settings
    from maintd.daemon import Daemon
    from maintd.db import make_engine

    from .conftest import private_server

    with contextlib.ExitStack() as stack:
        with monkeypatch.context() as m:  # the private server runs an hour ahead; nothing else does
            for key, value in skewed("+3600s").items():
                m.setenv(key, value)
            ahead = stack.enter_context(private_server(pg_version))
        other = make_engine(ahead.dsn, application_name="maintd-test-migrate", pooled=False)
        stack.callback(other.dispose)
        with other.connect() as conn:
            migrate.upgrade(conn, "ahead")
            ahead_now = conn.execute(sql("SELECT now()", "ahead")).scalar_one()
        with engine.connect() as conn:
            here_now = conn.execute(sql("SELECT now()", schema)).scalar_one()
        assert (ahead_now - here_now).total_seconds() > 3000, "the private server's clock is not ahead"
        live, dead = insert(engine, schema, """INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at,
            heartbeat_at) VALUES ('live', 'running', 1, now() - interval '2 minutes', now() - interval '2 minutes'),
                                 ('dead', 'running', 1, now() - interval '40 minutes', now() - interval '40 minutes')""")
        tick = {"id": "tick", "schedule": "@every 5s", "kind": "tick"}
        daemon = Daemon(Settings(
            database_url=pg_dsn, instance_id="two-clocks", http={"enabled": False},
            leader={"lease": "3s", "renew_interval": "1s", "retry_interval": "0.2s"},
            rescuer={"interval": "1s", "rescue_stuck_jobs_after": "30m"}, cleaner={"enabled": False},
            targets=[{"name": "here", "schema": schema, "periodic": [tick]},
                     {"name": "ahead", "schema": "ahead", "database_url": ahead.dsn, "periodic": [tick]}]))
        stack.callback(daemon.stop)
        daemon.start()
        wait_for(lambda: all(t.is_leader for t in daemon.targets), 20, what="both targets led")
        wait_for(lambda: state_of(engine, schema, dead) == "retryable", 20, what="the control job rescued")

        def slots(e, name: str) -> tuple[float, float] | None:
            """How far the target's tick slots lie from its own server's time (earliest, latest)."""
            with e.connect() as conn:
                row = conn.execute(sql("SELECT extract(epoch FROM min(scheduled_at) - now()), extract(epoch FROM "
                                       "max(scheduled_at) - now()) FROM {schema}.jobs WHERE kind = 'tick'", name)).one()
            return None if row[0] is None else (float(row[0]), float(row[1]))

        wait_for(lambda: slots(engine, schema) and slots(other, "ahead"), 20, what="both targets' first slot")
        deadline = time.monotonic() + 8  # several passes of both targets and as many probes
        while time.monotonic() < deadline:
            daemon.tick()
            for e, name in ((engine, schema), (other, "ahead")):  # the slots of these seconds
                earliest, latest = slots(e, name)
                assert earliest >= -60 and latest <= 30, f"{name}: slots {earliest:.0f} s .. {latest:.0f} s from its server's time"
            assert state_of(engine, schema, live) == "running", "a live job was rescued by the other server's clock"
            time.sleep(0.2)
