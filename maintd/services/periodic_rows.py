"""Periodic schedules kept as rows of ``periodic_jobs`` (SPEC 7.10), turned into entries for the
periodic enqueuer.

The rows are re-read when their version changes (the row count and an md5 of the rows' ids and
xmins, which any committed change moves, whatever the order of the commits). The enqueuer checks
it on every pass: at its entries' slots, when the table's trigger NOTIFYs (a committed change is
applied within about a second, with no reload) and at least every 10 minutes, whatever happened
to notifications. Each row is validated like a ``[[periodic]]`` entry; a row that fails,
or whose id a config or crontab entry already uses, is reported with the reason so the pass can
write it to the row's ``error``; every other entry keeps running.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy.exc import DBAPIError

from .periodic_config import PeriodicJob
from ..db import UnloadableJson, describe_db_error
from ..logs import kv
from ..queries import periodic_jobs
from .base import PassContext

log = logging.getLogger("maintd.periodic")
NOTE_LOCK_WAIT_MS = "500"  # a row's error note waits no longer for an application's lock on the row


@dataclass(frozen=True)
class Entry:
    """A periodic entry and where it comes from. ``since``: for a row, when it last changed (a
    change starts the row afresh from its next slot; a new row's missed slots count from it).
    ``created``: for a row, when it was inserted (the slots of its id before then were another
    row's, or a config entry's: none of them is this row's to run). ``took_over``: a row read
    still noted as refused for its id being a config or crontab entry's (:func:`shadowed`), now
    that the entry is gone: the row uses the id from a time unknown (a reload, or a restart with
    the new file), after its ``since`` and ``created``. ``resumed``: for a row, when it was last
    enabled again (its trigger's ``resumed_at``): the slots before were its pause's, whether or
    not a leader ran to take them."""

    job: PeriodicJob
    origin: str  # "config", "crontab" or "table"
    since: datetime | None = None
    created: datetime | None = None
    took_over: bool = False
    resumed: datetime | None = None


def shadowed(row_id: str) -> str:
    """The ``error`` of a row whose id a config or crontab entry uses."""
    return f"id {row_id!r} is already defined in the config file or crontab, which wins"


def row_problem(exc: ValidationError) -> str:
    """One line naming the column, like the config's errors name the key."""
    parts = []
    for err in exc.errors():
        column = ".".join(str(x) for x in err.get("loc", ()))
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{column}: {msg}" if column else msg)  # a row-level check names its column
    return "; ".join(parts)


def to_entry(row: Any, taken: set[str]) -> tuple[Entry | None, str | None]:
    """(the row's entry, None) or (None, why the row cannot be used). Whatever a row holds, it
    is refused alone: the other entries keep running."""
    if row.id in taken:
        return None, shadowed(row.id)
    if row.backfill_out_of_range:
        return None, "backfill: must be from 0 to 1,000,000 days"
    if row.updated_at is None:
        return None, "updated_at: must be a time from year 1 to 9999 (set it to now())"
    if isinstance(row.args, UnloadableJson):
        return None, f"args: {row.args.reason}"
    try:
        job = PeriodicJob(id=row.id, schedule=row.schedule, timezone=row.timezone, kind=row.kind,
                          queue=row.queue, args=row.args, priority=row.priority,
                          max_attempts=row.max_attempts, unique_key=bool(row.unique_key),
                          backfill=row.backfill, run_on_start=row.run_on_start, enabled=row.enabled)
    except ValidationError as exc:
        return None, row_problem(exc)
    except Exception as exc:  # a check that failed in an unforeseen way: this row's problem only
        return None, f"invalid: {exc}"[:500]
    return Entry(job, "table", row.updated_at, row.created_at, row.error == shadowed(row.id), row.resumed_at), None


class RowSource:
    """The rows of one schema, read again only when they changed."""

    def __init__(self) -> None:
        self._version: tuple | None = None
        self._rows: list[Any] = []
        # The last validation, by (version, ids taken): a pass at every slot re-validated every
        # row (31 ms for 1,000 rows, every second with an '@every 1s' entry among them).
        self._validated: tuple[tuple, tuple[list[Entry], dict[str, str | None]]] | None = None
        self.unwritten: set[str] = set()  # ids whose error note the last pass could not write

    def rows(self, ctx: PassContext) -> list[Any]:
        with ctx.transaction(fenced=False) as conn:
            version = tuple(conn.execute(ctx.sql(periodic_jobs.VERSION)).one())
            if version != self._version:
                self._rows = list(conn.execute(ctx.sql(periodic_jobs.ALL), {"n": None}))
                self._version = version
        return self._rows

    def entries(self, ctx: PassContext, taken: set[str]) -> tuple[list[Entry], dict[str, str | None]]:
        """Usable entries, and per row the ``error`` it should carry (None: none) where that
        differs from what the row carries now. Validated again only when the rows changed."""
        rows = self.rows(ctx)
        key = (self._version, frozenset(taken))
        if self._validated is not None and self._validated[0] == key:
            return self._validated[1]
        entries, notes = [], {}
        for row in rows:
            entry, problem = to_entry(row, taken)
            if entry is not None:
                entries.append(entry)
            if problem != row.error:
                notes[row.id] = problem
        self._validated = (key, (entries, notes))
        return entries, notes

    def note(self, ctx: PassContext, notes: dict[str, str | None]) -> set[str]:
        """Write (or clear) the rows' ``error``, each in its own transaction; the version check
        then re-reads them. Bookkeeping: a row an application holds locked (an edit under way)
        is logged and noted by a later pass; it never keeps the entries from running. Returns
        (and keeps in ``unwritten``) the ids whose note is still to be written."""
        self.unwritten = set()
        if not notes or ctx.dry_run:
            return self.unwritten
        for row_id, error in notes.items():
            try:
                with ctx.transaction(settings={"lock_timeout": NOTE_LOCK_WAIT_MS}) as conn:
                    conn.execute(ctx.sql(periodic_jobs.SET_ERROR), {"id": row_id, "error": error})
            except DBAPIError as exc:
                self.unwritten.add(row_id)
                log.warning("could not write a periodic_jobs row's error; trying again next pass",
                            extra=kv(periodic_id=row_id, error=describe_db_error(exc)))
            else:
                self._version = None
        return self.unwritten
