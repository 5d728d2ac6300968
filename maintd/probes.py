"""Reads batched across the targets of one database (SPEC 8.3): one statement for all of them, not
one per target, so that what a replica costs at idle does not grow with its targets. A target whose
probe fails (its schema dropped) is probed alone for a while, so that it does not fail the others'.

:class:`CountProbe`: the job counts of every leading target (``maintd_jobs``, the oldest available
job's age, ``/status``'s figures) and whether its table is partitioned now, live states every
15 s, final states (which read the heap) every 5 minutes, and a target whose term just began
within a second.

:class:`ServiceProbe`: for a service that describes a probe (:meth:`maintd.services.base.Service.
probe`: the scheduler with precise timing, the cleaner, the rescuer), whether a pass of each leading
target would find work: one statement of index probes for every target due for a look (every
``probe_every()``), and per target a pass now, a pass at a time (a job falling due, a stuck
deadline: :meth:`maintd.runner.Runner.wake`), or an idle pass counted without running
(:meth:`maintd.runner.Runner.idle`). A target whose probe fails gets a pass of its own, which says
what fails. Its read of the server's time renews the runners' carried reading of it
(:meth:`maintd.clock.ServerClock.take`), so a step of the server's clock moves their wake-ups
within a look.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any, Sequence

from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from . import faults
from .db import describe_db_error
from .logs import kv
from .metrics import JobGauges
from .queries import catalog, jobs, render

if TYPE_CHECKING:
    from .target import Target

log = logging.getLogger("maintd.probes")

SET_ASIDE = 60.0  # seconds a target whose probe failed is left out of the shared statement
PROBE_TIMEOUT_MS = 1000
TICK = 1.0  # seconds between two runs of a probe (a job of the daemon's timetable)


class _Batched:
    """One statement over many targets, with the failing ones set aside and probed alone."""

    TIMEOUT_MS = PROBE_TIMEOUT_MS

    def __init__(self, engine: Engine, targets: Sequence["Target"]):
        self.engine = engine
        self.targets = list(targets)
        self._aside: dict[str, float] = {}  # schema: until when it is probed alone
        self._since: float | None = None  # a read in flight since then (monotonic)

    def stalled_for(self) -> float:
        """Seconds the read in flight has waited past its statement timeout (0: none). A leader's reads go over its maintenance
        connections: a read that hangs is a maintenance stall (:meth:`maintd.target.Target.tick`),
        even while no pass runs because the reads never said there was work."""
        since = self._since
        return 0.0 if since is None else max(0.0, time.monotonic() - since - self.TIMEOUT_MS / 1000)

    def _each(self, targets: list["Target"], probe, failed=lambda target: None) -> None:  # noqa: ANN001
        now = time.monotonic()
        shared = [t for t in targets if self._aside.get(t.settings.schema, 0.0) <= now]
        alone = [t for t in targets if t not in shared]
        if shared:
            try:
                self._timed(probe, shared)
            except Exception as exc:
                if faults.sqlstate(exc) is None and faults.transient(exc):
                    # the server or the network, not one target's schema: no read alone (each would
                    # wait as long again); the passes run and say what fails
                    log.debug("batched read failed", extra=kv(error=describe_db_error(exc)))
                    for target in shared:
                        failed(target)
                else:
                    alone += shared  # find the one that fails, and set it aside
        for target in alone:
            try:
                self._timed(probe, [target])
                self._aside.pop(target.settings.schema, None)
            except Exception as exc:
                self._aside[target.settings.schema] = now + SET_ASIDE
                log.debug("batched read failed", extra=kv(target=target.name, error=describe_db_error(exc)))
                failed(target)

    def _timed(self, probe, targets: list["Target"]) -> None:  # noqa: ANN001
        self._since = time.monotonic()
        try:
            probe(targets)
        finally:
            self._since = None


class CountProbe(_Batched):
    TICK = 1.0  # seconds between two looks (a count runs when due)
    INTERVAL = 15.0
    TIMEOUT_MS = 10_000

    def __init__(self, engine: Engine, targets: Sequence["Target"]):
        super().__init__(engine, targets)
        self._counted_at = -float("inf")

    def run(self) -> None:
        # A read-only primary pauses maintenance (writes), not the counts (reads): stopped, they
        # stayed at what they were before it, the backlog's age no longer growing.
        leading = [t for t in self.targets if t.is_leader]
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
        """The live states and the oldest available age; the final states too when ``final``, in
        a statement of their own: they read the heap and may pass the timeout, which then leaves
        the live counts taken (and the final ones tried again after FINAL_INTERVAL, not at once)."""
        finished: list | None = None
        with self.engine.connect() as conn:
            conn.execute(text(catalog.SET_LOCAL), {"name": "statement_timeout", "value": str(self.TIMEOUT_MS)})
            at = conn.execute(text(catalog.TRANSACTION_TIME)).scalar_one()
            rows = conn.execute(text(_union(targets, [(jobs.COUNT_LIVE, "c"), (jobs.OLDEST_AVAILABLE, "o"),
                                                      (jobs.LAYOUT_NOW, "l")]))).all()
            if final:
                finished = self._finished(conn, targets)
            conn.rollback()
        missed, rows = final and finished is None, rows + (finished or [])
        counts: dict[int, list[dict]] = {i: [] for i in range(len(targets))}
        oldest: dict[int, dict[str, float]] = {i: {} for i in range(len(targets))}
        partitioned: dict[int, bool] = {}
        for t, kind, queue, state, value in rows:
            if kind == "c":
                counts[t].append({"queue": queue, "state": state, "count": int(value)})
            elif kind == "o":
                oldest[t][queue] = value
            else:
                partitioned[t] = bool(value)
        for i, target in enumerate(targets):
            target.runner.take_counts(counts[i], oldest[i], at, final=final and not missed, missed_final=missed)
            target.runner.take_layout(partitioned[i])

    def _finished(self, conn: Any, targets: list["Target"]) -> list | None:
        """The final states' counts, or None when they passed the statement timeout (logged)."""
        try:
            with conn.begin_nested():
                return conn.execute(text(_union(targets, [(jobs.COUNT_FINAL, "c")]))).all()
        except OperationalError as exc:
            if faults.sqlstate(exc) != faults.QUERY_CANCELED:
                raise
            log.warning("finished jobs not counted: the count passed its statement timeout (live states counted)",
                        extra=kv(targets=",".join(t.name for t in targets), timeout_ms=self.TIMEOUT_MS,
                                 retry_seconds=round(JobGauges.FINAL_INTERVAL)))
            return None


def _union(targets: list["Target"], parts: list[tuple[str, str]]) -> str:
    """``parts`` ((statement, tag) pairs of jobs.TAGGED) of every target, in one statement."""
    return " UNION ALL ".join(
        render(jobs.TAGGED[kind], t.settings.schema, t=str(i), rows=render(template, t.settings.schema))
        for i, t in enumerate(targets) for template, kind in parts)


class ServiceProbe(_Batched):
    """The probe of one service over the targets of one database (see the module)."""

    def __init__(self, engine: Engine, targets: Sequence["Target"], service: str):
        super().__init__(engine, targets)
        self.service = service
        self._next: dict[str, float] = {}  # target name: when it is looked at next (monotonic)
        self._idled: dict[str, float] = {}  # target name: when an idle pass was last counted
        self._statement: tuple[tuple[str, ...], object] | None = None

    def run(self) -> None:
        """Every second (a job of the daemon's timetable): the targets due for a look."""
        now, due = time.monotonic(), []
        for target in self.targets:
            if not (target.is_leader and target.runner.probed(self.service)):
                self._next.pop(target.name, None)  # a new term: its first pass runs anyway
            elif now + TICK / 2 >= self._next.setdefault(target.name, now + self._every(target)):
                self._next[target.name] = now + self._every(target)
                due.append(target)
        self._each(due, self._probe, failed=lambda target: target.runner.wake(self.service))

    def _every(self, target: "Target") -> float:
        return target.runner.services[self.service].probe_every()

    def _probe(self, targets: list["Target"]) -> None:
        with self.engine.connect() as conn:
            conn.execute(text(catalog.SET_LOCAL), {"name": "statement_timeout", "value": str(self.TIMEOUT_MS)})
            rows = {r[0]: r[1:] for r in conn.execute(self._compiled(targets)).all()}
            sent = time.monotonic()
            now = conn.execute(text(catalog.STATEMENT_TIME)).scalar_one()
            got = time.monotonic()
            conn.rollback()
        for clock in {id(t.runner.clock): t.runner.clock for t in targets}.values():
            clock.take(now, sent, got)
        for i, target in enumerate(targets):
            service = target.runner.services[self.service]
            verdict = service.after_probe(rows[i], now)
            if verdict is None:
                # Counted as the service's idle pass once per its interval (the scheduler's probe
                # looks every second), as its ticks were. The looks come on a 1 s tick, a few ms
                # early or late: within half a tick of the interval is the interval (compared
                # exactly, about every other count waited for the next look).
                interval = service.config.interval.total_seconds()
                if time.monotonic() - self._idled.get(target.name, -math.inf) >= interval - TICK / 2:
                    self._idled[target.name] = time.monotonic()
                    target.runner.idle(self.service, now)
            else:
                target.runner.wake(self.service, None if verdict is True else verdict)

    def _compiled(self, targets: list["Target"]) -> object:
        schemas = tuple(t.settings.schema for t in targets)
        if self._statement is None or self._statement[0] != schemas:
            fragments = targets[0].runner.services[self.service].probe() or []
            rows = (render(catalog.PROBE_ROW, s, t=str(i), columns=", ".join(f"{render(f, s)} AS c{j}"
                                                                           for j, f in enumerate(fragments)))
                    for i, s in enumerate(schemas))
            self._statement = (schemas, text(" UNION ALL ".join(rows)))
        return self._statement[1]
