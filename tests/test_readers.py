"""Readers apart from maintenance (SPEC 8.5): ``/status`` and the dashboard read through a small
read-only pool named ``maintd:<id>:read``, ``/status`` shows the leader's job counts from memory
(a follower says whose figures they are), its size is bounded, and a missing schema says what to
run wherever a reader meets it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import InternalError

from maintd.cli import main
from maintd.config import Settings
from maintd.daemon import Daemon
from maintd.dashboard import Dashboard
from maintd.http import Request
from maintd.metrics import OTHER, bounded_jobs
from maintd.queries import sql
from maintd.readers import Readers, reader_engine
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


def test_status_serves_the_leaders_counts_from_memory_through_the_readers(settings, engine, schema, queue):
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
