"""The dashboard's history (SPEC 8.2): one row of ``{schema}.health_history`` per sample, written
by the leader of the target only when something changed (at most one a minute) or every ten
minutes when nothing did, so an idle daemon's WAL stays far under 2 KiB a minute. The writer
deletes rows older than :data:`KEEP` too (at most once every :data:`PRUNE_EVERY`, after a read-only
probe, fenced like its writes), whether the cleaner is enabled or not.

A sample holds jobs by state and by queue (waiting and running ones), the jobs finished in its
window (completed, discarded), the jobs table's size and dead rows, and the xmin horizon's age
with its holder when held over :data:`HOLDER_AFTER`.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Callable, Iterable

from sqlalchemy import Connection

from .health import HealthReport
from .logs import kv
from .metrics import top_with_other
from .queries import health as q
from .queries import jobs as q_jobs
from .queries import sql
from .services.base import PassContext

log = logging.getLogger("maintd.history")

KEEP = timedelta(days=2)  # the day chart, and a margin
PRUNE_EVERY = timedelta(hours=1)
IDLE_EVERY = timedelta(minutes=10)
CHANGE_EVERY = timedelta(minutes=1)
HOLDER_AFTER = 60.0  # seconds: a younger holder is not marked on the chart
TOP_QUEUES = 10
LIVE_STATES = ("available", "scheduled", "running", "retryable")


@dataclass(frozen=True)
class Sample:
    at: datetime
    since: datetime
    completed: int = 0
    discarded: int = 0
    depth: dict[str, int] = field(default_factory=dict)
    queues: dict[str, int] = field(default_factory=dict)
    jobs_bytes: int | None = None
    dead_tuples: int | None = None
    live_tuples: int | None = None
    horizon_age_seconds: float = 0.0
    horizon_age_xids: int = 0
    holder: dict[str, Any] | None = None

    def state(self) -> tuple:
        """What a new sample must differ in to be written before IDLE_EVERY (the horizon's age
        grows by itself while held: its holder, not its age, is the change)."""
        return (sorted(self.depth.items()), sorted(self.queues.items()), self.jobs_bytes, self.dead_tuples,
                holder_identity(self.holder))

    def finished_any(self) -> bool:
        return self.completed > 0 or self.discarded > 0

    def params(self) -> dict[str, Any]:
        return {"at": self.at, "since": self.since, "completed": self.completed, "discarded": self.discarded,
                "depth": json.dumps(self.depth), "queues": json.dumps(self.queues),
                "jobs_bytes": self.jobs_bytes, "dead_tuples": self.dead_tuples, "live_tuples": self.live_tuples,
                "horizon_age_seconds": self.horizon_age_seconds, "horizon_age_xids": self.horizon_age_xids,
                "holder": None if self.holder is None else json.dumps(self.holder)}

    @classmethod
    def from_row(cls, r: Any) -> "Sample":
        return cls(at=r.at, since=r.since, completed=r.completed, discarded=r.discarded, depth=dict(r.depth),
                   queues=dict(r.queues), jobs_bytes=r.jobs_bytes, dead_tuples=r.dead_tuples,
                   live_tuples=r.live_tuples, horizon_age_seconds=r.horizon_age_seconds or 0.0,
                   horizon_age_xids=r.horizon_age_xids or 0, holder=r.holder)


def depth_of(rows: Iterable[tuple[str, str, int]], top: int = TOP_QUEUES) -> tuple[dict[str, int], dict[str, int]]:
    """(jobs by state, jobs by queue: the ``top`` largest, the rest summed as ``_other``) from
    (queue, state, count) rows (``jobs.COUNT_LIVE``'s)."""
    states = {s: 0 for s in LIVE_STATES}
    queues: dict[str, int] = {}
    for queue, state, n in rows:
        states[state] = states.get(state, 0) + n
        queues[queue] = queues.get(queue, 0) + n
    return states, top_with_other(queues, top)


def holder_mark(report: HealthReport) -> dict[str, Any] | None:
    h = report.horizon.holder
    if h is None or h.age_seconds < HOLDER_AFTER:
        return None
    return {"kind": h.kind, "pid": h.pid, "user": h.user, "application_name": h.application_name,
            "client_addr": h.client_addr, "state": h.state, "name": h.name, "xmin": h.xmin,
            "age_seconds": round(h.age_seconds), "exact": h.exact, "describe": h.describe()}


def holder_identity(holder: dict[str, Any] | None) -> tuple:
    """Who a sample's holder is, as the warning tells holders apart (Holder.warned_as): a standby's
    feedback by its walsender and a slot by its name, whose xmin moves at every read while a
    replica's queries keep it behind; anything else at its xmin too."""
    h = holder or {}
    if h.get("kind") == "standby_feedback":
        return (h["kind"], h.get("pid"))
    if h.get("kind") == "replication_slot":
        return (h["kind"], h.get("name"))
    return tuple(h.get(k) for k in ("kind", "pid", "name", "xmin"))


class HistoryWriter:
    """One target's history rows, written and pruned. :meth:`step` runs after each health read
    while the target is led here; :meth:`reset` at a new term (the last row is read again from the
    table)."""

    def __init__(self, idle_every: timedelta = IDLE_EVERY, change_every: timedelta = CHANGE_EVERY):
        self.idle_every, self.change_every = idle_every, change_every
        self._last: Sample | None = None
        self._loaded = False
        self._checked_at: datetime | None = None
        self._seen: tuple | None = None  # what the health read showed at the last check
        self._pruned_at: datetime | None = None  # the server's time of the last prune (None: not yet)

    def reset(self) -> None:
        self._last, self._loaded, self._checked_at, self._seen = None, False, None, None

    def step(self, ctx: PassContext, report: HealthReport,
             live: Callable[[], list[tuple[str, str, int]] | None] = lambda: None) -> Sample | None:
        """Prune the rows past :data:`KEEP` if due, then write a sample if one is due; returns it
        (None: nothing written). ``live``: recent counts of waiting and running jobs (the leader's
        job gauges count them every 15 s), else they are counted here."""
        at = report.at
        self._prune(ctx, at)
        if not self._loaded:
            with ctx.read() as conn:
                row = conn.execute(ctx.sql(q.LAST)).first()
            self._last, self._loaded = (Sample.from_row(row) if row else None), True
        last, seen = self._last, self._what_read(ctx.schema, report)
        due = last is None or at - last.at >= self.idle_every
        if not due and (at - last.at < self.change_every  # at most one a minute
                        or (self._checked_at is not None and at - self._checked_at < self.change_every)
                        or seen == self._seen):  # the jobs table unwritten since the last look: no query
            return None
        self._checked_at, self._seen = at, seen
        sample = self._sample(ctx, report, last, live())
        if not due and sample.state() == last.state() and not sample.finished_any():
            return None
        with ctx.transaction() as conn:
            conn.execute(ctx.sql(q.INSERT), sample.params())
        self._last = sample
        return sample

    def _prune(self, ctx: PassContext, at: datetime) -> None:
        if self._pruned_at is not None and at - self._pruned_at < PRUNE_EVERY:
            return
        n = prune(ctx, at)
        self._pruned_at = at
        if n:
            log.info("pruned the dashboard's history", extra=kv(rows=n, older_than=(at - KEEP).isoformat()))

    @staticmethod
    def _what_read(schema: str, report: HealthReport) -> tuple:
        """The jobs table's writes, dead rows and size, and the holder, as the health read saw them."""
        jobs = report.table(schema)
        return ((jobs.writes, jobs.dead, jobs.bytes) if jobs else None, holder_identity(holder_mark(report)))

    def _sample(self, ctx: PassContext, report: HealthReport, last: Sample | None,
                live: list[tuple[str, str, int]] | None) -> Sample:
        at = report.at
        since = last.at if last is not None and at - last.at < KEEP else at - self.change_every
        with ctx.read() as conn:
            finished = conn.execute(ctx.sql(q.FINISHED), {"since": since, "until": at}).one()
            if live is None:
                live = [(r.queue, r.state, r.n) for r in conn.execute(ctx.sql(q_jobs.COUNT_LIVE))]
        states, queues = depth_of(live)
        jobs = report.table(ctx.schema)
        return Sample(at=at, since=since, completed=finished.completed, discarded=finished.discarded,
                      depth=states, queues=queues, jobs_bytes=jobs.bytes if jobs else None,
                      dead_tuples=jobs.dead if jobs else None, live_tuples=jobs.live if jobs else None,
                      horizon_age_seconds=round(report.horizon.age_seconds, 1),
                      horizon_age_xids=report.horizon.age_xids, holder=holder_mark(report))


# -- reading it back (the dashboard) ---------------------------------------------------------------


def series(conn: Connection, schema: str, start: datetime, bucket: timedelta) -> list[Sample]:
    """The samples from ``start`` on, one per ``bucket`` (its last; finished jobs summed over it)."""
    rows = conn.execute(sql(q.SERIES, schema), {"start": start, "bucket": bucket})
    return [Sample(at=r.at, since=r.since, completed=r.completed, discarded=r.discarded, depth=r.depth,
                   queues=r.queues, jobs_bytes=r.jobs_bytes, dead_tuples=r.dead_tuples,
                   horizon_age_seconds=r.horizon_age_seconds or 0.0, holder=_holder(r.holder))
            for r in rows if drawable(r)]


def _holder(h: dict[str, Any] | None) -> dict[str, Any] | None:
    """A row's holder with what the overview shows of one (its kind, name and pid) always there:
    the leader writes them all; a row written by hand may name fewer."""
    return None if h is None else {"name": None, "pid": None, **h, "kind": str(h.get("kind") or "?")}


def _counts(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in v.values())


def drawable(r: Any) -> bool:
    """Whether the charts can draw a bucket of samples: the leader writes only such rows, but one
    written by hand or by a restore (a time no datetime holds, loaded as text by a reader; counts
    that are not an object of numbers; a holder that is not one; a horizon age of NaN or infinity) made the whole overview a 500."""
    holder_ok = r.holder is None or isinstance(r.holder, dict)
    return isinstance(r.at, datetime) and isinstance(r.since, datetime) and _counts(r.depth) \
        and _counts(r.queues) and holder_ok and math.isfinite(r.horizon_age_seconds or 0.0)


# -- pruning (the writer) ---------------------------------------------------------------------------


def prune(ctx: PassContext, now: datetime, *, batch: int = 10_000) -> int:
    """Delete rows older than KEEP, in batches; a probe first, so an idle cleaner writes nothing."""
    before = now - KEEP
    with ctx.read() as conn:
        if not conn.execute(ctx.sql(q.PRUNE_PROBE), {"before": before}).scalar():
            return 0
    deleted, from_at = 0, "-infinity"
    while True:
        with ctx.transaction() as conn:
            gone = conn.execute(ctx.sql(q.PRUNE), {"before": before, "from_at": from_at, "limit": batch})
            n = gone.rowcount
            last = max(gone, key=lambda r: r.k, default=None)  # where the next batch starts
            from_at = from_at if last is None else last.at
        deleted += n
        if n < batch:
            return deleted
        ctx.check_stop()
