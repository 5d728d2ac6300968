"""The jobs table's layout as ``maintd status``, ``/status`` and the dashboard show it (SPEC 8.1):
plain, or partitioned with its proper partitions (count, the oldest start, the newest end) and
the rows in its catch-all partitions."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, text

from .identifiers import qualified
from .partitions import EXACT_UP_TO
from .queries import catalog, partitions, sql


# A table converted while the config still says plain (the README's last step forgotten).
NOT_KEPT = ('the jobs table is partitioned but the config says layout = "plain": the leader keeps no '
            'partitions (none made ahead, so finished jobs soon all land in the catch-all; none dropped): '
            'set layout = "partitioned" and reload')
# The other way round: layout = "partitioned" set on a schema whose table `maintd migrate` made plain
# (it builds the partitioned layout for a new schema only) and no conversion begun.
NOT_CONVERTED = ('the config says layout = "partitioned" but the jobs table is plain: the leader keeps no '
                 'partitions and the cleaner deletes as on the plain layout: as the owner role, run '
                 '`maintd migrate --convert partitioned`')


def layout_summary(conn: Connection, schema: str, configured: str | None = None) -> dict[str, Any]:
    """The table's layout; ``configured``: the config's, which a note compares with it."""
    if not conn.execute(text(catalog.JOBS_PARTITIONED), {"schema": schema}).scalar():
        # a conversion's copy (under way, or interrupted, its trigger doubling every write): from
        # the catalog, which every role may read (the progress table is the owner's)
        copying = conn.execute(text(catalog.TABLE_EXISTS), {"qualified": qualified(schema, "jobs_conv")}).scalar()
        return {"layout": "plain", **({"converting": True} if copying else
                                      {"note": NOT_CONVERTED} if configured == "partitioned" else {})}
    row = conn.execute(sql(partitions.SUMMARY, schema), {"cap": EXACT_UP_TO}).one()
    return {"layout": "partitioned", "partitions": int(row.partitions), "oldest": row.oldest,
            "newest": row.newest, "stray_rows": int(row.stray_rows),
            **({"stray_rows_estimated": True} if row.stray_estimated else {}),
            **({"note": NOT_KEPT} if configured == "plain" else {})}


def format_layout(summary: dict[str, Any]) -> str:
    if summary.get("layout") != "partitioned":
        return f"layout: {summary.get('layout', 'plain')}" + (
            "\n  note: a conversion to partitioned is under way (or was interrupted): `maintd migrate --convert "
            "partitioned` finishes it, `--convert plain` gives it up" if summary.get("converting") else
            f"\n  warning: {summary['note']}" if summary.get("note") else "")
    return (f"layout: partitioned, {summary['partitions']:,} partitions of final jobs from "
            f"{_iso(summary['oldest'])} to {_iso(summary['newest'])}, "
            f"{'~' if summary.get('stray_rows_estimated') else ''}{summary['stray_rows']:,} stray rows in the "
            "catch-all partitions" + (f" (an estimate: over {EXACT_UP_TO:,} in a catch-all)"
                                      if summary.get("stray_rows_estimated") else "")
            + (f"\n  warning: {summary['note']}" if summary.get("note") else ""))


def _iso(v: Any) -> Any:
    return v.isoformat() if hasattr(v, "isoformat") else v
