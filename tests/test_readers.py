"""Readers apart from maintenance (SPEC 8.5): ``/status`` and the dashboard read through a small
read-only pool named ``maintd:<id>:read``, ``/status`` shows the leader's job counts from memory
(a follower says whose figures they are), its size is bounded, and a missing schema says what to
run wherever a reader meets it."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime

import psycopg
import pytest
from sqlalchemy import event, text
from sqlalchemy.exc import InternalError

from maintd.cli import main
from maintd.config import Settings
from maintd.daemon import Daemon
from maintd.dashboard import Dashboard
from maintd.http import Request
from maintd.metrics import OTHER, bounded_jobs
from maintd.queries import sql
from maintd.readers import MOST, Readers, reader_engine
from maintd.status import collect_status

from .procs import wait_for


def get(port: int, path: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            body = r.read().decode()
            return r.status, json.loads(body) if path == "/status" else body
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def app_names(dsn: str, instance: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return dict(conn.execute("SELECT application_name, count(*) FROM pg_stat_activity "
                                 "WHERE application_name LIKE %s GROUP BY 1", (f"maintd:{instance}:%",)).fetchall())


def test_a_reader_session_is_named_read_only_and_short(pg_dsn, schema):
    engine = reader_engine(pg_dsn, "rd-1", kept=1, most=1)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SHOW statement_timeout")).scalar() == "5s"
            assert conn.execute(text("SHOW application_name")).scalar() == "maintd:rd-1:read"
            with pytest.raises(InternalError, match="read-only transaction"):
                conn.execute(sql("DELETE FROM {schema}.jobs", schema))
    finally:
        engine.dispose()


def test_status_serves_the_leaders_counts_from_memory_through_the_readers(configured, engine, schema, queue):
    # An instance id of this test's own: its reader sessions are counted by name in pg_stat_activity,
    # and the settings fixture's "test-1" is every test's (other xdist workers' daemons on a shared
    # server open "maintd:test-1:read" sessions too: counted here, past the bound or in place of ours).
    settings = configured(instance_id=f"counts-{schema}", http={"listen": "127.0.0.1:0"})
    with engine.begin() as conn:
        for i in range(3):
            queue.enqueue(conn, "k", {}, queue="mail")
    daemon = Daemon(settings)
    daemon.start()
    try:
        port = daemon.http_port
        wait_for(lambda: daemon.is_leader and daemon.targets[0].runner.gauges.counts is not None, 15, what="counts")
        status, data = get(port, "/status")
        assert status == 200 and data["jobs"] == [{"queue": "mail", "state": "available", "count": 3}]
        assert data["jobs_counted_at"]["live"] and data["jobs_counted_at"]["finished"]
        with engine.begin() as conn:  # not counted until the leader's next refresh (every 15 s)
            queue.enqueue(conn, "k", {}, queue="mail")
        assert get(port, "/status")[1]["jobs"][0]["count"] == 3
        get(port, "/")
        names = app_names(settings.database_url.get_secret_value(), settings.instance_id)
        assert 1 <= names.get(f"maintd:{settings.instance_id}:read", 0) <= 4, names
    finally:
        daemon.stop()


def reader_sessions(dsn: str, instance: str) -> dict[int, datetime]:
    """The server's sessions named as ``instance``'s readers: pid -> backend_start."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return dict(conn.execute("SELECT pid, backend_start FROM pg_stat_activity WHERE application_name = %s",
                                 (f"maintd:{instance}:read",)).fetchall())


def test_status_requests_reuse_the_readers_few_sessions_and_never_the_maintenance_pool(configured, schema):
    """/status reads through the daemon's one bounded reader pool: however many requests, the
    server sees at most MOST sessions named ``maintd:<id>:read`` (the same ones, reused), and none
    of the leader's maintenance connections is checked out to answer one; nor for the dashboard's
    pages, which share that pool. Each /status comes after the 0.5 s it keeps an answer
    (http.Recent), so each one reads the database; no page is asked for before the last, so until
    then the reader sessions are /status's alone."""
    settings = configured(instance_id=f"reuse-{schema}", http={"listen": "127.0.0.1:0"})
    dsn = settings.database_url.get_secret_value()
    daemon = Daemon(settings)
    # The threads that checked out a connection of each pool: the answers are rendered on the
    # listener's ("maintd-http-..."), the passes on their own (not counted here).
    work: list[str] = []
    read: list[str] = []
    [target] = daemon.targets
    try:
        event.listen(target.engine, "checkout", lambda *_: work.append(threading.current_thread().name))
        event.listen(daemon.readers.engine(dsn), "checkout", lambda *_: read.append(threading.current_thread().name))
        daemon.start()
        wait_for(lambda: daemon.is_leader and target.runner.gauges.counts is not None, 15, what="counts")

        def http(names: list[str]) -> int:
            return sum(name.startswith("maintd-http") for name in names)

        seen: dict[int, datetime] = {}
        for i in range(3 * MOST):
            time.sleep(0.7)  # past the 0.5 s http.Recent keeps a /status answer
            status, data = get(daemon.http_port, "/status")
            assert status == 200 and data["this_instance"]["is_leader"], (i, data)
            now = reader_sessions(dsn, settings.instance_id)
            assert 1 <= len(now) <= MOST, (i, now)  # read through the readers, within their bound
            seen.update(now)
        assert http(work) == 0, f"{http(work)} maintenance connections checked out for {3 * MOST} /status"
        assert http(read) >= 3 * MOST, f"{http(read)} reader checkouts for {3 * MOST} /status: {read}"
        assert len(seen) <= MOST, f"{len(seen)} reader sessions for {3 * MOST} /status: {seen}"
        for i in range(3 * MOST):  # the dashboard's pages share that pool (/jobs is read each time)
            status, body = get(daemon.http_port, "/jobs" if i % 2 else "/")
            assert status == 200, (i, body[-300:])
            now = reader_sessions(dsn, settings.instance_id)
            assert 1 <= len(now) <= MOST, (i, now)
            seen.update(now)
        assert http(work) == 0, f"{http(work)} maintenance connections checked out for the pages"
        assert len(seen) <= MOST, f"{len(seen)} reader sessions for {6 * MOST} requests: {seen}"
    finally:
        daemon.stop()


def test_a_follower_says_whose_figures_the_job_counts_are(settings, engine, schema, queue):
    with engine.begin() as conn:
        queue.enqueue(conn, "k", {}, queue="mail")
    leader = Daemon(settings)
    leader.start()
    follower = Daemon(settings.model_copy(update={"instance_id": "test-2"}))
    try:
        wait_for(lambda: leader.is_leader, 15, what="leadership")
        follower.start()
        status, data = get(follower.http_port, "/status")
        assert status == 200 and data["jobs"] == [] and data["this_instance"]["is_leader"] is False
        assert "counted by the leader" in data["jobs_note"] and data["leader"]["instance_id"] == "test-1"
    finally:
        follower.stop()
        leader.stop()


def test_status_names_the_largest_queues_and_sums_the_rest_as_other():
    rows = [{"queue": f"q{i:03}", "state": "available", "count": i} for i in range(1, 301)]
    rows.append({"queue": "q300", "state": "completed", "count": 5})
    out = bounded_jobs({"jobs": rows, "oldest_available_age_seconds": {f"q{i:03}": float(i) for i in range(1, 301)}},
                       keep=100)
    shown = {(r["queue"], r["state"]): r["count"] for r in out["jobs"]}
    assert len(shown) == 102 and shown[("q300", "completed")] == 5 and ("q200", "available") not in shown
    assert shown[(OTHER, "available")] == sum(range(1, 201))  # the total is kept
    assert out["oldest_available_age_seconds"][OTHER] == 200.0 and len(out["oldest_available_age_seconds"]) == 101
    assert "300 queues: the 100 with the most jobs shown, the other 200 as _other" in out["jobs_note"]


@pytest.mark.parametrize("where", ["status", "dashboard", "cli"])
def test_a_missing_schema_says_run_maintd_migrate_wherever_a_reader_meets_it(pg_dsn, tmp_path, capsys, where):
    settings = Settings(database_url=pg_dsn, schema="never_migrated_26", instance_id="t")
    if where == "status":
        with pytest.raises(Exception, match="run `maintd migrate`"):
            collect_status(reader_engine(pg_dsn, "t", kept=1, most=1), settings.schema)
    elif where == "dashboard":
        pages = Dashboard(lambda: settings, readers=Readers(lambda: "t")).pages()
        for path, req in (("/", Request("/", {})), ("/jobs", Request("/jobs", {})),
                          ("/jobs/{id}", Request("/jobs/1", {}, params={"id": "1"}))):
            status, _, body, _ = pages[path](req)
            assert status == 503 and "run `maintd migrate`" in body.decode(), body.decode()[-400:]
    else:
        cfg = tmp_path / "m.toml"
        cfg.write_text(f'database_url = "{pg_dsn}"\nschema = "never_migrated_26"\n')
        for args in (["status"], ["jobs", "list"], ["jobs", "show", "1"], ["periodic", "list"]):
            assert main(["--config", str(cfg), *args]) == 1
            err = capsys.readouterr().err
            assert "run `maintd migrate`" in err and "unreachable" not in err, (args, err)


# One row of maintd's own tables at a time no Python datetime holds (SPEC 7.3: '-infinity' is Go's
# zero time; an import, a restore or an operator's UPDATE can leave the others): (what, the SQL).
ODD_TIME_ROWS = {
    f"{table}.{column}={value}": statement.format(column=column, value=f"'{value}'")
    for value in ("-infinity", "infinity", "0044-03-15 00:00:00+00 BC", "10000-01-01 00:00:00+00")
    for table, column, statement in (
        ("leader", "elected_at", "UPDATE {{schema}}.leader SET instance_id = 'old', host = 'h', pid = 1, "
                                 "{column} = {value}"),
        ("leader", "released_at", "UPDATE {{schema}}.leader SET instance_id = 'old', host = 'h', pid = 1, "
                                  "elected_at = now(), {column} = {value}"),
        ("daemons", "started_at", "INSERT INTO {{schema}}.daemons (instance_id, host, pid, version, {column}) "
                                  "VALUES ('imported', 'h', 1, 'v', {value})"),
        ("daemons", "last_seen_at", "INSERT INTO {{schema}}.daemons (instance_id, host, pid, version, {column}) "
                                    "VALUES ('imported', 'h', 1, 'v', {value})"),
        ("periodic_slots", "slot", "INSERT INTO {{schema}}.periodic_slots (periodic_id, {column}) "
                                   "VALUES ('nightly', {value})"))
}


@pytest.mark.parametrize("row", ODD_TIME_ROWS)
def test_one_row_at_an_odd_time_never_hides_the_status_or_the_periodic_list(settings, engine, schema, queue,
                                                                         tmp_path, capsys, row):
    """One leader, daemons or periodic_slots row at '-infinity', 'infinity', a BC date or past year
    9999 made `maintd status` (and --json) exit 1 with 'timestamp too small', the daemon's /status a
    503 with nothing else in it, and `maintd periodic list` fail for every entry. Every reader now
    loads such a time as PostgreSQL writes it, and shows the rest."""
    with engine.begin() as conn:
        queue.enqueue(conn, "k", {}, queue="mail")
        conn.execute(sql("INSERT INTO {schema}.periodic_jobs (id, schedule, kind) VALUES "
                         "('nightly', '0 3 * * *', 'k'), ('hourly', '@every 1h', 'k')", schema))
        conn.execute(sql(ODD_TIME_ROWS[row], schema))
    cfg = tmp_path / "m.toml"
    cfg.write_text(f'database_url = "{settings.database_url.get_secret_value()}"\nschema = "{schema}"\n')
    out = {}
    for args, shown in ((["status"], "mail"), (["status", "--json"], '"mail"'),
                        (["periodic", "list"], "hourly"), (["periodic", "list", "--json"], '"hourly"')):
        rc, printed = main(["--config", str(cfg), *args]), capsys.readouterr()
        out[" ".join(args)] = printed.out
        assert rc == 0 and shown in printed.out and "nightly" in (printed.out if args[0] == "periodic" else "nightly"), \
            (args, printed.err)
    value = ODD_TIME_ROWS[row].split("'")[-2]  # shown as PostgreSQL writes it where a reader shows that column
    where = {"daemons.started_at": "status --json"}.get(row.split("=")[0])
    assert where is None or value in out[where], out[where]
    if row.startswith("periodic_slots"):  # not a slot that counts: the list goes by the enqueuer's mark
        assert re.search(r"^nightly .* - ", out["periodic list"], re.M), out["periodic list"]
    daemon = Daemon(settings)  # its /status, without electing: what a follower serves
    try:
        status, _, body = daemon._status()
        data = json.loads(body)
        assert status == 200 and [e["id"] for e in data["periodic"]] == ["hourly", "nightly"], body[-300:]
    finally:
        daemon.readers.dispose()


def test_a_leader_on_a_read_only_primary_keeps_counting_jobs(make_private_pg, monkeypatch):
    """A read-only primary pauses maintenance (writes), not the counts (reads): the leader stopped
    counting, so /status kept showing the counts from before (no note saying so) and
    maintd_jobs and maintd_oldest_available_job_age_seconds froze where they were, the age no
    longer growing (MaintdBacklogAgeGrowing cannot fire) while jobs waited."""
    from maintd.probes import CountProbe

    from .test_connection_faults import migrated

    def sample(body: str, name: str, labels: str) -> float | None:
        found = re.search(rf'^{name}{{{labels},target="maintd"}} (\S+)$', body, re.M)
        return float(found.group(1)) if found else None

    monkeypatch.setattr(CountProbe, "INTERVAL", 1.0)  # a count every second instead of every 15
    pg = make_private_pg()
    migrated(pg.dsn)
    daemon = Daemon(Settings(database_url=pg.dsn, schema="maintd", instance_id="ro-count",
                             http={"listen": "127.0.0.1:0"}))
    daemon.start()
    try:
        [target] = daemon.targets
        wait_for(lambda: daemon.is_leader and target.runner.gauges.counts is not None, 15, what="counts")
        with psycopg.connect(pg.dsn, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM SET default_transaction_read_only = on")
            admin.execute("SELECT pg_reload_conf()")
        wait_for(lambda: target.runner.paused, 10, what="maintenance paused")
        with psycopg.connect(pg.dsn, autocommit=True, options="-c default_transaction_read_only=off") as app:
            app.execute("INSERT INTO maintd.jobs (kind, queue, scheduled_at) VALUES ('k', 'mail', now() - interval '1 min')")
        try:
            wait_for(lambda: get(daemon.http_port, "/status")[1]["jobs"] == [
                {"queue": "mail", "state": "available", "count": 1}], 10, what="the job counted")
        except AssertionError:
            raise AssertionError(f"jobs of a read-only primary not counted: {get(daemon.http_port, '/status')[1]['jobs']}")
        body = get(daemon.http_port, "/metrics")[1]
        assert sample(body, "maintd_jobs", 'queue="mail",state="available"') == 1.0, body
        assert (sample(body, "maintd_oldest_available_job_age_seconds", 'queue="mail"') or 0) >= 59, body
        assert daemon.is_leader and target.runner.paused
    finally:
        daemon.stop()


def test_status_lists_a_bounded_number_of_periodic_rows_and_says_there_are_more(settings, engine, schema):
    """/status is served to anyone who can reach the HTTP port. It read every row of periodic_jobs
    and worked out each one's next fire time, as the dashboard did before it was bounded: 20,000
    rows (one schedule per customer, say) cost seconds of the daemon's CPU per request. It lists
    the configured entries and the first rows by id, and says that `maintd periodic list` has the
    rest."""
    from maintd.periodic_table import STATUS_ROWS, list_entries

    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.periodic_jobs (id, schedule, kind) "
                         "SELECT 'row-' || lpad(g::text, 5, '0'), '@every 1h', 'k' FROM generate_series(1, :n) g",
                         schema), {"n": STATUS_ROWS + 5})
    daemon = Daemon(Settings(database_url=settings.database_url.get_secret_value(), schema=schema, instance_id="t",
                             periodic=[{"id": "configured", "schedule": "0 3 * * *", "kind": "c"}]))
    try:
        status, _, body = daemon._status()
    finally:
        daemon.readers.dispose()
    data = json.loads(body)
    ids = [e["id"] for e in data["periodic"]]
    assert status == 200 and ids[0] == "configured", body[-300:]
    assert ids[1:] == [f"row-{g:05}" for g in range(1, STATUS_ROWS + 1)]
    assert data["periodic_more"] is True
    engine = reader_engine(settings.database_url.get_secret_value(), "t")  # `maintd periodic list`'s: all
    try:
        listed, more = list_entries(engine, settings)
        assert len(listed) == STATUS_ROWS + 5 and not more
    finally:
        engine.dispose()


def test_a_queue_named_other_beside_the_overflow_is_not_summed_into_it():
    """A real queue named ``_other`` among the queues shown was summed into the overflow's
    ``_other`` row (its jobs counted as the other queues', and theirs as its). Beside the overflow
    each queue shown is named as in /metrics: ``_other`` is ``\\_other``, a name with a backslash
    has it doubled."""
    rows = [{"queue": f"q{i}", "state": "available", "count": i} for i in range(1, 6)]
    rows += [{"queue": "_other", "state": "available", "count": 50}, {"queue": "a\\b", "state": "available", "count": 40}]
    out = bounded_jobs({"jobs": rows, "oldest_available_age_seconds": {"_other": 9.0, "q1": 1.0, "q5": 5.0}}, keep=3)
    shown = {(r["queue"], r["state"]): r["count"] for r in out["jobs"]}
    assert shown == {("\\_other", "available"): 50, ("a\\\\b", "available"): 40, ("q5", "available"): 5,
                     (OTHER, "available"): 1 + 2 + 3 + 4}, shown
    assert out["oldest_available_age_seconds"] == {"\\_other": 9.0, "q5": 5.0, OTHER: 1.0}


def test_periodic_slots_in_json_are_iso_8601_as_every_other_time_there(settings, engine, schema, tmp_path, capsys):
    """`maintd periodic list --json` and /status's "periodic" wrote last_slot and next_slot as
    Python's str() ("2026-03-01 12:00:00+00:00", with a space), while every other time in the same
    answers ("time", "since", "finalized_at" ...) is ISO 8601 with a "T": a client parsing them as
    ISO 8601 (jq's fromdateiso8601, a strict RFC 3339 parser) refused the slots only."""
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.periodic_jobs (id, schedule, kind) VALUES ('hourly', '@every 1h', 'k')",
                         schema))
        conn.execute(sql("INSERT INTO {schema}.periodic_slots (periodic_id, slot) "
                         "VALUES ('hourly', '2026-03-01 12:00:00+00')", schema))
    cfg = tmp_path / "m.toml"
    cfg.write_text(f'database_url = "{settings.database_url.get_secret_value()}"\nschema = "{schema}"\n')
    rc, printed = main(["--config", str(cfg), "periodic", "list", "--json"]), capsys.readouterr()
    assert rc == 0, printed.err
    [listed] = json.loads(printed.out)
    daemon = Daemon(settings)  # its /status, without electing
    try:
        status, _, body = daemon._status()
        assert status == 200, body[-300:]
        [shown] = json.loads(body)["periodic"]
    finally:
        daemon.readers.dispose()
    for entry in (listed, shown):
        assert entry["last_slot"] == "2026-03-01T12:00:00+00:00", entry
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:00:00\+00:00", entry["next_slot"]), entry
