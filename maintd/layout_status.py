"""The jobs table's layout as ``maintd status``, ``/status`` and the dashboard show it (SPEC 8.1):
plain, or partitioned with its proper partitions (count, the oldest start, the newest end) and
the rows in its catch-all partitions."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, text

from .queries import catalog, partitions, sql


def layout_summary(conn: Connection, schema: str) -> dict[str, Any]:
    if not conn.execute(text(catalog.JOBS_PARTITIONED), {"schema": schema}).scalar():
        return {"layout": "plain"}
    row = conn.execute(sql(partitions.SUMMARY, schema)).one()
    return {"layout": "partitioned", "partitions": int(row.partitions), "oldest": row.oldest,
            "newest": row.newest, "stray_rows": int(row.stray_rows)}


def format_layout(summary: dict[str, Any]) -> str:
    if summary.get("layout") != "partitioned":
        return f"layout: {summary.get('layout', 'plain')}"
    return (f"layout: partitioned, {summary['partitions']} partitions of final jobs from "
            f"{_iso(summary['oldest'])} to {_iso(summary['newest'])}, "
            f"{summary['stray_rows']} stray rows in the catch-all partitions")


def _iso(v: Any) -> Any:
    return v.isoformat() if hasattr(v, "isoformat") else v
