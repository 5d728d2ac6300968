"""Reads batched across the targets of one database (SPEC 8.3): one statement for all of them, not
one per target, so that what a replica costs at idle does not grow with its targets. A target whose
probe fails (its schema dropped) is probed alone for a while, so that it does not fail the others'.

:class:`CountProbe`: the job counts of every leading target (``maintd_jobs``, the oldest available
job's age, ``/status``'s figures), live states every 15 s, final states (which read the heap)
every 5 minutes, and a target whose term just began within a second.

:class:`DueProbe`: every second, the next due time of every leading target whose scheduler times
its passes precisely. A job that falls due before the scheduler's next pass (enqueued, or failed
with a short backoff, right after a tick: the scheduler only knew the due times of its last pass)
gets a pass of its own when it is due (:meth:`maintd.runner.Runner.wake`). One index probe per
target (``jobs_scheduled_idx``), all in one statement.
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


class _Batched:
    """One statement over many targets, with the failing ones set aside and probed alone."""

    def __init__(self, engine: Engine, targets: Sequence["Target"]):
        self.engine = engine
        self.targets = list(targets)
        self._aside: dict[str, float] = {}  # schema: until when it is probed alone

    def _each(self, targets: list["Target"], probe, failed=lambda target: None) -> None:  # noqa: ANN001
        now = time.monotonic()
        shared = [t for t in targets if self._aside.get(t.settings.schema, 0.0) <= now]
        alone = [t for t in targets if t not in shared]
        if shared:
            try:
                probe(shared)
            except Exception:
                alone += shared  # find the one that fails, and set it aside
        for target in alone:
            try:
                probe([target])
                self._aside.pop(target.settings.schema, None)
            except Exception as exc:
                self._aside[target.settings.schema] = now + SET_ASIDE
                log.debug("batched read failed", extra=kv(target=target.name, error=describe_db_error(exc)))
                failed(target)


class CountProbe(_Batched):
    TICK = 1.0  # seconds between two looks (a count runs when due)
    INTERVAL = 15.0
    TIMEOUT_MS = 10_000

    def __init__(self, engine: Engine, targets: Sequence["Target"]):
        super().__init__(engine, targets)
        self._counted_at = -float("inf")

    def run(self) -> None:
        leading = [t for t in self.targets if t.is_leader and not t.runner.paused]
        if not leading:
            return
        new = [t for t in leading if t.runner.gauges.counts is None]
        if time.monotonic() - self._counted_at < self.INTERVAL and not new:
            return
        if time.monotonic() - self._counted_at >= self.INTERVAL:
            self._counted_at, new = time.monotonic(), leading
        final = [t for t in new if t.runner.gauges.final_due()]
        self._each([t for t in new if t not in final], lambda ts: self._count(ts, final=False))
        self._each(final, lambda ts: self._count(ts, final=True))

    def _count(self, targets: list["Target"], *, final: bool) -> None:
        parts = [(jobs.COUNT_LIVE, "c"), (jobs.OLDEST_AVAILABLE, "o")] + ([(jobs.COUNT_FINAL, "c")] if final else [])
        union = " UNION ALL ".join(
            f"SELECT {i} AS t, '{kind}' AS k, x.queue, {'x.state' if kind == 'c' else 'NULL'} AS state, "
            f"{'x.n' if kind == 'c' else 'x.age'}::float8 AS v FROM ({render(template, t.settings.schema)}) x"
            for i, t in enumerate(targets) for template, kind in parts)
        with self.engine.connect() as conn:
            conn.execute(text(catalog.SET_LOCAL), {"name": "statement_timeout", "value": str(self.TIMEOUT_MS)})
            at = conn.exec_driver_sql("SELECT now()").scalar_one()
            rows = conn.execute(text(union)).all()
            conn.rollback()
        counts: dict[int, list[dict]] = {i: [] for i in range(len(targets))}
        oldest: dict[int, dict[str, float]] = {i: {} for i in range(len(targets))}
        for t, kind, queue, state, value in rows:
            if kind == "c":
                counts[t].append({"queue": queue, "state": state, "count": int(value)})
            else:
                oldest[t][queue] = value
        for i, target in enumerate(targets):
            target.runner.take_counts(counts[i], oldest[i], at, final=final)


class DueProbe(_Batched):
    INTERVAL = 1.0  # seconds: the bound on promotion lag for a job due sooner than the last pass saw
    TIMEOUT_MS = 1000

    def __init__(self, engine: Engine, targets: Sequence["Target"]):
        super().__init__(engine, targets)
        self._statement: tuple[tuple[str, ...], object] | None = None

    def run(self) -> None:
        """One probe (a job of the daemon's timetable, every INTERVAL); a target whose probe fails
        gets a pass of its own (its scheduler says what fails)."""
        self._each([t for t in self.targets if t.is_leader and t.runner.probed("scheduler")], self._probe,
                    failed=lambda target: target.runner.wake("scheduler"))

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
            else:
                target.runner.idle("scheduler", now)

    def _compiled(self, targets: list["Target"]) -> object:
        schemas = tuple(t.settings.schema for t in targets)
        if self._statement is None or self._statement[0] != schemas:
            columns = ", ".join(f"{render(jobs.NEXT_DUE, s)} AS d{i}" for i, s in enumerate(schemas))
            self._statement = (schemas, text(f"SELECT statement_timestamp() AS now, {columns}"))
        return self._statement[1]
