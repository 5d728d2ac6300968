"""``maintd periodic``: the schedules of one schema (rows of ``periodic_jobs`` and the configured
entries together, marked by origin) and plain-SQL changes to the rows."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError
from sqlalchemy import Connection, Engine

from .config import PeriodicJob, Settings
from .logs import escaped
from .queries import catalog, periodic_jobs, periodic_slots, sql
from .schedules import parse_schedule, zone_read
from .services.periodic_rows import row_problem


STATUS_ROWS = 200  # rows of periodic_jobs /status lists (besides the configured entries)


def list_entries(engine: Engine, settings: Settings, rows_shown: int | None = None) -> tuple[list[dict[str, Any]], bool]:
    """Every schedule (with ``rows_shown``, of the rows only the first that many by id: an answer
    to any HTTP client is bounded) as :func:`listing` reads it, at the server's time."""
    with engine.connect() as conn:
        now = conn.execute(sql(catalog.TRANSACTION_TIME, settings.schema)).scalar_one()
        return listing(conn, settings.schema, settings.periodic_entries, now, rows_shown)


def listing(conn: Connection, schema: str, configured: Sequence[PeriodicJob], now: datetime,
            rows_shown: int | None = None) -> tuple[list[dict[str, Any]], bool]:
    """The configured entries, then the rows of periodic_jobs by id (those whose id is a
    configured entry's, which the daemon refuses, and the first ``rows_shown`` others; None: all),
    each with its origin, error, newest slot taken, the job it enqueued and its next slot (None for
    one that will not run: disabled, refused or unreadable). Returns them and whether rows were
    left out."""
    origin = {e.id: "crontab" if e.cron_args else "config" for e in configured}
    table = conn.execute(sql(periodic_jobs.LISTED, schema), {"configured": list(origin), "n": rows_shown}).all()
    others = [r for r in table if not r.shadowed]
    more = rows_shown is not None and len(others) > rows_shown
    rows = sorted([r for r in table if r.shadowed] + others[:rows_shown], key=lambda r: r.id)
    entries = [*({**e.model_dump(), "origin": origin[e.id], "error": None} for e in configured),
               *({**r._asdict(), "origin": "table"} for r in rows)]
    last = {r.id: r for r in conn.execute(sql(periodic_slots.LATEST, schema), {"ids": [e["id"] for e in entries]})}
    out = []
    for e in entries:
        slot = last.get(e["id"])
        out.append({"id": e["id"], "origin": e["origin"], "schedule": e["schedule"],
                    "timezone": zone_read(e["schedule"], e["timezone"]), "kind": e["kind"], "queue": e["queue"],
                    "enabled": e["enabled"], "last_slot": slot.slot if slot else None,
                    "last_job_id": slot.job_id if slot else None,
                    "next_slot": _next_slot(e["schedule"], e["timezone"], now) if e["enabled"] and not e["error"] else None,
                    "error": e["error"]})  # a row refused (error set) never runs
    return out, more


def as_json(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries for a JSON answer (`periodic list --json`, /status): slots in ISO 8601 as every
    other time there, not str()'s "2026-03-01 12:00:00+00:00"; one no datetime holds ('infinity',
    BC) stays as PostgreSQL writes it."""
    return [{k: v.isoformat() if isinstance(v, datetime) else v for k, v in e.items()} for e in entries]


def _next_slot(schedule: str, timezone: str | None, now: datetime) -> datetime | None:
    try:
        return parse_schedule(schedule, timezone).next_after(now)
    except ValueError:
        return None


def validated(values: dict[str, Any]) -> PeriodicJob:
    """The row as the daemon will read it; ValueError naming the column otherwise."""
    try:
        return PeriodicJob(**values)
    except ValidationError as exc:
        raise ValueError(row_problem(exc)) from None


def add(engine: Engine, schema: str, job: PeriodicJob, *, replace: bool = False) -> bool:
    """Insert the row (or, with ``replace``, update it); False when it exists and not replaced."""
    params = {"id": job.id, "schedule": job.schedule, "timezone": job.timezone, "kind": job.kind,
              "queue": job.queue, "args": json.dumps(job.args), "priority": job.priority,
              "max_attempts": job.max_attempts, "unique_key": bool(job.unique_key),
              "backfill": _interval(job.backfill), "run_on_start": job.run_on_start, "replace": replace}
    with engine.begin() as conn:
        return conn.execute(sql(periodic_jobs.UPSERT, schema), params).first() is not None


def remove(engine: Engine, schema: str, periodic_id: str) -> bool:
    with engine.begin() as conn:
        return conn.execute(sql(periodic_jobs.DELETE, schema), {"id": periodic_id}).first() is not None


def set_enabled(engine: Engine, schema: str, periodic_id: str, enabled: bool) -> bool:
    with engine.begin() as conn:
        return conn.execute(sql(periodic_jobs.SET_ENABLED, schema),
                            {"id": periodic_id, "enabled": enabled}).first() is not None


def _interval(td: timedelta | None) -> str | None:
    return None if td is None else f"{td.total_seconds()} seconds"


def format_entries(entries: list[dict[str, Any]]) -> str:
    if not entries:
        return "no periodic entries"
    lines = [f"{'ID':<24} {'ORIGIN':<7} {'SCHEDULE':<18} {'ENABLED':<7} {'LAST SLOT':<25} NEXT SLOT"]
    for e in escaped(entries):  # rows anyone with INSERT on periodic_jobs wrote
        last, nxt = _when(e["last_slot"]), _when(e["next_slot"])
        lines.append(f"{e['id']:<24} {e['origin']:<7} {e['schedule']:<18} {str(e['enabled']).lower():<7} "
                     f"{last:<25} {nxt}")
        if e["error"]:
            lines.append(f"  error: {e['error']}")
    return "\n".join(lines)


def _when(t: datetime | str | None) -> str:
    """A slot as ISO 8601; one no datetime holds ('infinity', BC) as PostgreSQL writes it."""
    return "-" if t is None else t if isinstance(t, str) else t.isoformat()
