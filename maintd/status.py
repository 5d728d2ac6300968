"""``maintd status`` and ``/status``: who leads, the live daemons, each service's last run, jobs
by queue and state. Read from the database; all times are the server's."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import OperationalError, ProgrammingError

from .db import advisory_key, describe_db_error
from .identifiers import qualified
from .layout_status import format_layout, layout_summary
from .metrics import job_counts, oldest_available
from .queries import catalog, daemons, leader, service_runs, sql

STATUS_TIMEOUT_MS = 5000


class SchemaMissing(RuntimeError):
    """The schema has no maintd tables (``maintd migrate`` has not run)."""


def _iso(v: Any) -> Any:
    return v.isoformat() if isinstance(v, datetime) else v


def _rows(conn: Connection, template: str, schema: str, params: dict | None = None) -> list[dict[str, Any]]:
    return [{k: _iso(v) for k, v in r.items()} for r in conn.execute(sql(template, schema), params or {}).mappings()]


def collect_status(engine: Engine, schema: str) -> dict[str, Any]:
    classid, objid = advisory_key(schema)
    with engine.connect() as conn:
        conn.exec_driver_sql(f"SET LOCAL statement_timeout = {STATUS_TIMEOUT_MS}")
        if not conn.execute(text(catalog.TABLE_EXISTS), {"qualified": qualified(schema, "leader")}).scalar():
            raise SchemaMissing(f"schema {schema!r} has no maintd tables: run `maintd migrate` first")
        now = conn.execute(text("SELECT now()")).scalar_one()
        lead = _rows(conn, leader.CURRENT, schema, {"classid": classid, "objid": objid})
        status = {
            "schema": schema,
            "time": _iso(now),
            "leader": _leader(lead[0] if lead else None),
            "daemons": _rows(conn, daemons.LIVE, schema),
            "services": _rows(conn, service_runs.ALL, schema),
            "oldest_available_age_seconds": oldest_available(conn, schema),
            "layout": {k: _iso(v) for k, v in layout_summary(conn, schema).items()},
        }
        status.update(_jobs(conn, schema))
    return status


def _leader(row: dict[str, Any] | None) -> dict[str, Any] | None:
    if not row or not row["instance_id"] or row["released_at"] is not None or not row["holds_lock"]:
        return None
    return {"instance_id": row["instance_id"], "host": row["host"], "pid": row["pid"],
            "since": row["elected_at"], "epoch": row["epoch"], "renewed_at": row["renewed_at"]}


def _jobs(conn: Connection, schema: str) -> dict[str, Any]:
    """Counting finished jobs reads the heap: it may time out, then only live states count."""
    try:
        with conn.begin_nested():
            return {"jobs": job_counts(conn, schema)}
    except (OperationalError, ProgrammingError) as exc:
        return {"jobs": job_counts(conn, schema, final=False),
                "jobs_note": f"finished jobs not counted: {describe_db_error(exc)}"}


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
    if st.get("layout"):
        lines.append(format_layout(st["layout"]))
    lines += ["services:"] + _format_runs(st["services"])
    lines.append("jobs:")
    if not st["jobs"]:
        lines.append("  (none)")
    for j in st["jobs"]:
        lines.append(f"  {j['queue']:<20} {j['state']:<10} {j['count']}")
    if st.get("jobs_note"):
        lines.append(f"  ({st['jobs_note']})")
    return "\n".join(lines)


def _format_runs(runs: list[dict[str, Any]]) -> list[str]:
    if not runs:
        return ["  (no pass recorded yet)"]
    lines = []
    for r in runs:
        extra = f"  error: {r['error']}" if r.get("error") else ""
        result = r.get("result") or {}
        brief = " ".join(f"{k}={v}" for k, v in result.items() if not isinstance(v, (list, dict)))
        lines.append(f"  {r['service']:<10} {r['outcome']:<8} at {r['finished_at']} "
                     f"by {r['instance_id']}  {brief}{extra}")
    return lines
