"""``maintd status`` and ``/status``: who leads, each service's last run, jobs by queue and state."""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from .config import Settings
from .db import advisory_key, describe_db_error, sql
from .metrics import Metrics
from .models import FINAL_STATES, JOB_STATES

# The recorded term counts only while its session still holds the advisory lock.
LEADER = """
SELECT l.epoch, l.instance_id, l.host, l.pid, l.elected_at, l.renewed_at, l.released_at,
       EXISTS (SELECT 1 FROM pg_locks k
                WHERE k.locktype = 'advisory' AND k.classid::bigint = :classid
                  AND k.objid::bigint = :objid AND k.objsubid = 2 AND k.pid = l.backend_pid
                  AND k.granted) AS holds_lock
  FROM {schema}.leader l WHERE l.name = 'leader'
"""
DAEMONS = """
SELECT instance_id, host, pid, version, started_at, last_seen_at
  FROM {schema}.daemons WHERE last_seen_at > now() - interval '1 minute' ORDER BY instance_id
"""
RUNS = """
SELECT service, instance_id, started_at, finished_at, outcome, result, error, last_success_at
  FROM {schema}.service_runs ORDER BY service
"""
# Live states are served by their partial indexes; final ones are bounded by the statement timeout.
LIVE_COUNTS = """
SELECT queue, state::text AS state, count(*) AS n FROM {schema}.jobs
 WHERE state IN ('available', 'scheduled', 'retryable', 'running') GROUP BY queue, state
"""
FINAL_COUNTS = """
SELECT queue, state::text AS state, count(*) AS n FROM {schema}.jobs
 WHERE finalized_at IS NOT NULL GROUP BY queue, state
"""
OLDEST_AVAILABLE = """
SELECT queue, extract(epoch FROM now() - min(scheduled_at))::float8 AS age
  FROM {schema}.jobs WHERE state = 'available' GROUP BY queue
"""


def _iso(v: Any) -> Any:
    return v.isoformat() if isinstance(v, datetime) else v


def job_counts(conn, schema: str, *, final: bool = True) -> list[dict[str, Any]]:
    rows = list(conn.execute(sql(LIVE_COUNTS, schema)))
    if final:
        rows += list(conn.execute(sql(FINAL_COUNTS, schema)))
    return sorted(({"queue": r.queue, "state": r.state, "count": r.n} for r in rows),
                  key=lambda r: (r["queue"], JOB_STATES.index(r["state"])))


def collect_status(engine: Engine, settings: Settings) -> dict[str, Any]:
    schema = settings.schema
    classid, objid = advisory_key(schema)
    jobs_note = None
    with engine.connect() as conn:
        conn.exec_driver_sql("SET LOCAL statement_timeout = 5000")
        leader = conn.execute(sql(LEADER, schema), {"classid": classid & 0xFFFFFFFF,
                                                    "objid": objid & 0xFFFFFFFF}).mappings().first()
        daemons = [dict(r) for r in conn.execute(sql(DAEMONS, schema)).mappings()]
        runs = [dict(r) for r in conn.execute(sql(RUNS, schema)).mappings()]
        oldest = {r.queue: r.age for r in conn.execute(sql(OLDEST_AVAILABLE, schema))}
        try:
            with conn.begin_nested():  # counting finished jobs reads the heap: may time out
                jobs = job_counts(conn, schema)
        except OperationalError as exc:
            jobs = job_counts(conn, schema, final=False)
            jobs_note = f"finished jobs not counted: {describe_db_error(exc)}"
    lead: dict[str, Any] | None = None
    if leader and leader["instance_id"] and leader["released_at"] is None and leader["holds_lock"]:
        lead = {"instance_id": leader["instance_id"], "host": leader["host"], "pid": leader["pid"],
                "since": _iso(leader["elected_at"]), "epoch": leader["epoch"],
                "renewed_at": _iso(leader["renewed_at"])}
    return {
        "schema": schema,
        "time": datetime.now(timezone.utc).isoformat(),
        "leader": lead,
        "daemons": [{k: _iso(v) for k, v in d.items()} for d in daemons],
        "services": [{k: _iso(v) for k, v in r.items()} for r in runs],
        "jobs": jobs,
        **({"jobs_note": jobs_note} if jobs_note else {}),
        "oldest_available_age_seconds": oldest,
    }


def job_gauge_values(engine: Engine, settings: Settings, *, final: bool = True
                     ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """(job counts, oldest available age per queue), bounded by a 10 s statement timeout."""
    with engine.connect() as conn:
        conn.exec_driver_sql("SET LOCAL statement_timeout = 10000")
        counts = job_counts(conn, settings.schema, final=final)
        oldest = {r.queue: r.age for r in conn.execute(sql(OLDEST_AVAILABLE, settings.schema))}
    return counts, oldest


def refresh_job_gauges(engine: Engine, settings: Settings, metrics: Metrics, *, final: bool = True) -> None:
    """Refresh ``maintd_jobs`` and the backlog age. Live states are cheap (partial indexes); the
    per-queue counts of final states read the heap, so callers refresh them less often."""
    counts, oldest = job_gauge_values(engine, settings, final=final)
    apply_job_gauges(metrics, counts, oldest, final=final)


def apply_job_gauges(metrics: Metrics, counts: list[dict[str, Any]], oldest: dict[str, float], *,
                     final: bool) -> None:
    live = [s for s in JOB_STATES if s not in FINAL_STATES]
    for labels in [m.labels for m in metrics.jobs.collect()[0].samples]:
        if labels["state"] in live or final:
            metrics.jobs.remove(labels["queue"], labels["state"])
    for row in counts:
        metrics.jobs.labels(row["queue"], row["state"]).set(row["count"])
    metrics.oldest_available_age.clear()
    for queue, age in oldest.items():
        metrics.oldest_available_age.labels(queue).set(max(0.0, age or 0.0))


def format_status(st: dict[str, Any]) -> str:
    lines = [f"schema: {st['schema']}"]
    lead = st["leader"]
    if lead:
        lines.append(f"leader: {lead['instance_id']} (host {lead['host']}, pid {lead['pid']}, "
                     f"epoch {lead['epoch']}, since {lead['since']})")
    else:
        lines.append("leader: none")
    if st["daemons"]:
        lines.append("daemons:")
        for d in st["daemons"]:
            lines.append(f"  {d['instance_id']:<24} host {d['host']}  pid {d['pid']}  "
                         f"v{d['version']}  last seen {d['last_seen_at']}")
    lines.append("services:")
    if not st["services"]:
        lines.append("  (no pass recorded yet)")
    for r in st["services"]:
        extra = f"  error: {r['error']}" if r.get("error") else ""
        result = r.get("result") or {}
        brief = " ".join(f"{k}={v}" for k, v in result.items() if not isinstance(v, (list, dict)))
        lines.append(f"  {r['service']:<10} {r['outcome']:<8} at {r['finished_at']} "
                     f"by {r['instance_id']}  {brief}{extra}")
    lines.append("jobs:")
    if not st["jobs"]:
        lines.append("  (none)")
    for j in st["jobs"]:
        lines.append(f"  {j['queue']:<20} {j['state']:<10} {j['count']}")
    if st.get("jobs_note"):
        lines.append(f"  ({st['jobs_note']})")
    return "\n".join(lines)


def cli_status(args: argparse.Namespace) -> int:
    from .config import load_settings
    from .db import make_engine

    settings = load_settings(args.config)
    engine = make_engine(settings.database_url.get_secret_value(),
                         application_name=f"maintd:{settings.instance_id}:status", pooled=False)
    try:
        st = collect_status(engine, settings)
    finally:
        engine.dispose()
    print(json.dumps(st, indent=2, default=str) if args.json else format_status(st))
    return 0


__all__ = ["collect_status", "refresh_job_gauges", "job_gauge_values", "apply_job_gauges",
           "format_status", "cli_status", "FINAL_STATES"]
