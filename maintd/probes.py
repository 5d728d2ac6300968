"""Reads batched across the targets of one database (SPEC 8.3): one statement for all of them, not
one per target, so that what a replica costs at idle does not grow with its targets.

:class:`DueProbe`: every second, the next due time of every leading target whose scheduler times
its passes precisely. A job that falls due before the scheduler's next pass (enqueued, or failed
with a short backoff, right after a tick: the scheduler only knew the due times of its last pass)
gets a pass of its own when it is due (:meth:`maintd.runner.Runner.wake`). One index probe per
target (``jobs_scheduled_idx``), all in one statement. A target whose probe fails (its schema
dropped) is probed alone for a while, so that it does not fail the others'.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Sequence

from sqlalchemy import Engine, text

from .db import describe_db_error
from .logs import kv
from .queries import catalog, jobs, render

if TYPE_CHECKING:
    from .target import Target

log = logging.getLogger("maintd.probes")

SET_ASIDE = 60.0  # seconds a target whose probe failed is left out of the shared statement


class DueProbe:
    INTERVAL = 1.0  # seconds: the bound on promotion lag for a job due sooner than the last pass saw
    TIMEOUT_MS = 1000

    def __init__(self, engine: Engine, targets: Sequence["Target"]):
        self.engine = engine
        self.targets = list(targets)
        self._aside: dict[str, float] = {}  # schema: until when it is probed alone
        self._statement: tuple[tuple[str, ...], object] | None = None

    def run(self) -> None:
        """One probe (a job of the daemon's timetable, every INTERVAL)."""
        now_mono = time.monotonic()
        due = [t for t in self.targets if t.is_leader and t.runner.precise("scheduler")]
        shared = [t for t in due if self._aside.get(t.settings.schema, 0.0) <= now_mono]
        alone = [t for t in due if t not in shared]
        if shared:
            try:
                self._probe(shared)
            except Exception:
                alone += shared  # find the one that fails, and set it aside
        for target in alone:
            try:
                self._probe([target])
                self._aside.pop(target.settings.schema, None)
            except Exception as exc:
                self._aside[target.settings.schema] = now_mono + SET_ASIDE
                log.debug("due-time probe failed", extra=kv(target=target.name, error=describe_db_error(exc)))

    def _probe(self, targets: list["Target"]) -> None:
        with self.engine.connect() as conn:
            conn.execute(text(catalog.SET_LOCAL), {"name": "statement_timeout", "value": str(self.TIMEOUT_MS)})
            row = conn.execute(self._compiled(targets)).one()
            conn.rollback()
        now: datetime = row[0]
        horizon = now + timedelta(seconds=self.INTERVAL)
        for target, next_due in zip(targets, row[1:]):
            if next_due is not None and next_due < horizon:
                target.runner.wake("scheduler", max(next_due, now))

    def _compiled(self, targets: list["Target"]) -> object:
        schemas = tuple(t.settings.schema for t in targets)
        if self._statement is None or self._statement[0] != schemas:
            columns = ", ".join(f"{render(jobs.NEXT_DUE, s)} AS d{i}" for i, s in enumerate(schemas))
            self._statement = (schemas, text(f"SELECT statement_timestamp() AS now, {columns}"))
        return self._statement[1]
