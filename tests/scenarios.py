"""Shared pieces of the real-infrastructure scenario tests (issue 13, SPEC 7.2): an audit trigger
that records who wrote to the jobs table while which session held the leader lock, a canary job
that tells when a leader really works, bounded reads of a daemon's /metrics and /healthz, and the
measurements the tests print (``MEASURE scenario=... seconds=...``; with
``MAINTD_TEST_MEASUREMENTS=FILE`` also appended to FILE as JSON lines).
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request

import psycopg

from maintd.db import advisory_key

from .procs import AUDIT_AT_COMMIT, DaemonProc, wait_for

# Every statement that writes jobs from a maintd session (application_name maintd:...) records,
# in the writing transaction: who wrote, from which backend, the leader row it saw, and which
# session held the schema's leader lock at that moment (the server's truth, not the daemon's).
# At COMMIT (procs.AUDIT_AT_COMMIT), the leader row again: a statement run under one term must
# not commit under the next (the fence's FOR KEY SHARE holds the bump off).
AUDIT = """
CREATE TABLE {schema}.write_audit (
  app text, backend_pid int, txid bigint, at timestamptz, op text,
  leader_epoch bigint, leader_instance text, leader_backend int, holder_pid int, holder_app text,
  seq bigserial PRIMARY KEY, committed_at timestamptz, committed_epoch bigint, committed_instance text);
CREATE FUNCTION {schema}.write_audit() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  l record;
  h record;
BEGIN
  IF current_setting('application_name') LIKE 'maintd:%' THEN
    SELECT epoch, instance_id, backend_pid INTO l FROM {schema}.leader WHERE name = 'leader';
    SELECT k.pid, a.application_name AS app INTO h
      FROM pg_locks k LEFT JOIN pg_stat_activity a ON a.pid = k.pid
     WHERE k.locktype = 'advisory' AND k.classid::bigint = {classid} AND k.objid::bigint = {objid}
       AND k.objsubid = 2 AND k.granted;
    INSERT INTO {schema}.write_audit (app, backend_pid, txid, at, op, leader_epoch, leader_instance,
                                      leader_backend, holder_pid, holder_app) VALUES (
      current_setting('application_name'), pg_backend_pid(), txid_current(), clock_timestamp(),
      TG_OP, l.epoch, l.instance_id, l.backend_pid, h.pid, h.app);
  END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER write_audit AFTER INSERT OR UPDATE OR DELETE ON {schema}.jobs
  FOR EACH STATEMENT EXECUTE FUNCTION {schema}.write_audit();
""" + AUDIT_AT_COMMIT


def q(schema: str) -> str:
    return '"' + schema + '"'


def install_audit(dsn: str, schema: str) -> None:
    classid, objid = advisory_key(schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(AUDIT.replace("{schema}", q(schema)).replace("{classid}", str(classid & 0xFFFFFFFF))
                     .replace("{objid}", str(objid & 0xFFFFFFFF)))


def instance_of(app: str | None) -> str | None:
    """``maintd:d1:work`` -> ``d1`` (the lock session is ``maintd:d1``)."""
    return app.split(":")[1] if app and app.startswith("maintd:") else None


def audit_rows(dsn: str, schema: str) -> list[dict]:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        cur = conn.execute(f"SELECT * FROM {q(schema)}.write_audit ORDER BY at")
        names = [c.name for c in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]


def foreign_writes(rows: list[dict]) -> list[dict]:
    """Maintenance writes committed while the writer was not the leader: when the statement ran,
    the leader row named someone else or the leader lock was held by another instance's session
    (or by nobody); or at COMMIT the leader row named someone else, or a later epoch."""
    return [r for r in rows if instance_of(r["app"]) != r["leader_instance"]
            or instance_of(r["holder_app"]) != instance_of(r["app"])
            or (r["committed_epoch"], r["committed_instance"]) != (r["leader_epoch"], r["leader_instance"])]


def insert_canary(dsn: str, schema: str) -> int:
    """A scheduled job due now: a working leader's scheduler makes it available."""
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        return conn.execute(f"INSERT INTO {q(schema)}.jobs (kind, state, scheduled_at) "
                            "VALUES ('canary', 'scheduled', now()) RETURNING id").fetchone()[0]


def promoted(dsn: str, schema: str, job_id: int) -> bool:
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=3) as conn:
            row = conn.execute(f"SELECT state::text FROM {q(schema)}.jobs WHERE id = %s", (job_id,)).fetchone()
    except psycopg.OperationalError:
        return False
    return row is not None and row[0] == "available"


def working_leader_after(dsn: str, schema: str, since: float, timeout: float) -> float:
    """Seconds from ``since`` (monotonic) until a canary inserted now is promoted."""
    job = insert_canary(dsn, schema)
    wait_for(lambda: promoted(dsn, schema, job), timeout, interval=0.05, what="a working leader")
    return time.monotonic() - since


def http(daemon: DaemonProc, path: str, timeout: float = 2.0) -> tuple[int | None, str]:
    """GET with a bounded timeout; (None, reason) when the daemon does not answer in time."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon.http_port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (OSError, TimeoutError) as e:
        return None, f"no answer: {e}"


def metric(body: str, name: str, labels: str = "") -> float | None:
    """A sample's value; ``labels`` as rendered (``{a="b"}``), the target label aside (every
    series carries one, SPEC 7.4)."""
    wanted = sorted(re.findall(r'(\w+)="([^"]*)"', labels))
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})?\s+(\S+)$", body, re.M):
        got = [kv for kv in re.findall(r'(\w+)="([^"]*)"', m.group(1) or "") if kv[0] != "target"]
        if sorted(got) == wanted:
            return float(m.group(2))
    return None
    return float(m.group(1)) if m else None


def is_leader_metric(daemon: DaemonProc, timeout: float = 2.0) -> float | None:
    status, body = http(daemon, "/metrics", timeout)
    return metric(body, "maintd_is_leader") if status == 200 else None


def record(scenario: str, seconds: float, **extra: object) -> None:
    line = {"scenario": scenario, "seconds": round(seconds, 2), **extra}
    print(f"MEASURE scenario={scenario} seconds={seconds:.2f} " + " ".join(f"{k}={v}" for k, v in extra.items()))
    path = os.environ.get("MAINTD_TEST_MEASUREMENTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


FAST_SERVICES = {
    "statement_timeout": "2s",
    "scheduler": {"interval": "0.5s"},
    "cleaner": {"interval": "1s"},
    "rescuer": {"interval": "1s"},
}
