"""Scheduler: makes due ``scheduled``/``retryable`` jobs ``available`` and wakes the workers.

Each batch is one fenced transaction that promotes up to ``batch_size`` due jobs (found through
``jobs_scheduled_idx``, locked ``SKIP LOCKED``) and sends ``NOTIFY <channel>, '<queue>'`` once per
affected queue; PostgreSQL delivers the notifications only if the transaction commits. While the
server's NOTIFY queue is full (a listening session idle in a transaction), such a COMMIT fails: the
pass then promotes without NOTIFY and logs a warning (workers poll), rather than promote nothing.

Promotion lag. Workers claim ``available`` jobs with ``scheduled_at <= now()``, so promoting a job
before it is due would be harmless to workers using that SQL, but it would make ``available`` lie
(status, ``maintd_jobs``, oldest-available age), and the NOTIFY would wake the workers before
the job can be claimed, so they would find nothing and the job would wait for their next poll.
Instead, with ``precise_timing`` (default), a pass that finds the next job due before the next
tick asks the runner for another pass then (:meth:`SchedulerResult.wake_at`; at least
``MIN_WAKE`` after this one, so a dense stream of due times wakes it at most every ``MIN_WAKE``):
a job due before the next tick is promoted, and its queue notified, within about ``MIN_WAKE`` of
``scheduled_at``. The pass holds no thread and no connection while it waits. A job that becomes
due sooner than anything the last pass saw (enqueued or failed with a short delay right after a
tick) is found by the database's due-time probe (:mod:`maintd.probes`, one statement a second
for every target of a database). Without precise timing, lag is up to ``interval``.

An idle tick is one read-only statement in autocommit (:data:`maintd.queries.jobs.SCHEDULER_PROBE`,
two probes of ``jobs_scheduled_idx``): no transaction, no fence, no WAL. Only when something is
due do the promoting (fenced) transactions run.

Never early: the pass's ``now`` is the server's clock carried forward on the host's monotonic
clock, which drifts from the server's by a fraction of a millisecond; the promotion is bounded by
the server's own ``statement_timestamp()`` as well, so no job becomes ``available`` before the
server's clock reaches its ``scheduled_at`` (a pass woken a little early promotes it on its next
wake-up, within ``MIN_WAKE``). A test's FrozenClock in the server's past still decides alone.

Clock steps: after the server's clock steps back (an NTP correction), the carried reading runs
ahead of it until it is read again (up to 30 s). A job due within the step then looks overdue,
yet the server's own bound promotes nothing: a pass whose next due time is not after its own
``now`` (which the next-due read, bounded by the server's clock, can return only then) reads the
server's time again before it asks for the next pass, so it sleeps until the job is due by the
server's clock, instead of waking every ``MIN_WAKE`` until the server's time catches up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from prometheus_client import Counter
from pydantic import Field
from sqlalchemy.exc import DBAPIError

from .. import faults
from ..db import notify_channel
from ..logs import kv
from ..metrics import Family
from ..queries import jobs
from ..sections import PositiveDuration, ServiceConfig
from .base import MIN_BATCH, PassContext, PassResult, Service

MIN_WAKE = 0.05  # seconds: at most ~20 wake-ups a second, whatever the due times
PROBE_EVERY = 1.0  # seconds: the due-time probe's period, the lag bound for a job due sooner than known


# COMMIT of a transaction that notifies fails with this while the server's NOTIFY queue is full
# (one for all databases: a session that LISTENs, on any channel, and stays idle in a transaction
# keeps every notification from being freed). Promotion matters more than the wake-up (workers
# poll): the pass goes on without NOTIFY.
NOTIFY_QUEUE_FULL = "54000"
# Why a COMMIT that notifies fails (54000), and where to look; each service says what it did without.
NOTIFY_QUEUE_FULL_WHY = ("the server's NOTIFY queue is full (a session that LISTENs is idle in a transaction: "
                         "see pg_notification_queue_usage() and pg_stat_activity)")
NOTIFY_QUEUE_FULL_LOG = NOTIFY_QUEUE_FULL_WHY + ": jobs promoted without waking the workers"
SUMMARY_QUEUES = 10  # queues named in a pass's summary line (the largest), the rest counted
JOBS_PROMOTED = Family(Counter, "maintd_jobs_promoted", "Scheduled/retryable jobs made available.", ("queue",))


class SchedulerConfig(ServiceConfig):
    interval: PositiveDuration = timedelta(seconds=5)
    batch_size: int = Field(default=10_000, ge=1, le=1_000_000)
    # Between ticks, wake up when the next job falls due (if that is before the next tick), so
    # promotion lag is milliseconds instead of up to `interval`.
    precise_timing: bool = True



@dataclass
class SchedulerResult(PassResult):
    promoted: dict[str, int] = field(default_factory=dict)
    batches: int = 0  # transactions that promoted at least one job
    timeouts: int = 0  # batches that hit the statement timeout (redone at half the size)
    next_pass_at: datetime | None = None  # precise timing: the next job's due time, before the next tick
    dry_run: bool = False

    def wake_at(self) -> datetime | None:
        return self.next_pass_at

    @property
    def total(self) -> int:
        return sum(self.promoted.values())

    def did_something(self) -> bool:
        return self.total > 0

    def summary(self) -> str:
        verb = "would promote" if self.dry_run else "promoted"
        shown = sorted(sorted(self.promoted, key=lambda q: (-self.promoted[q], q))[:SUMMARY_QUEUES])
        queues = " ".join(f"{q}={self.promoted[q]}" for q in shown)
        more = len(self.promoted) - len(shown)
        return f"{verb} {self.total} jobs {queues}".rstrip() + (f" (+{more} more queues)" if more else "") + (
            f" timeouts={self.timeouts}" if self.timeouts else "")


class Scheduler(Service):

    METRICS = (JOBS_PROMOTED,)
    config: SchedulerConfig

    def __init__(self, config: SchedulerConfig):
        super().__init__(config)
        # A batch that hits the statement timeout (a large backlog due at once on a busy server) is
        # redone at half the size, down to MIN_BATCH, and the size carries over to the next pass:
        # the same size would fail every pass and promote nothing. A full batch done within a
        # quarter of the timeout doubles it again, up to batch_size.
        self._batch = config.batch_size

    def succeed(self, old: Service) -> None:
        """A reload keeps the batch size that worked (within the new batch_size): started again
        at batch_size, the next pass would hit the statement timeout again."""
        self._batch = min(getattr(old, "_batch", self._batch), self.config.batch_size)

    def probe(self) -> list[str] | None:
        """With precise timing, no ticks of its own: every second the database's probe reads the
        next due time of every target (SPEC 8.3: an idle target costs nothing of its own), so a job
        due sooner than the last pass knew (failed with a short backoff) is promoted when due."""
        return [jobs.NEXT_DUE] if self.config.precise_timing else None

    def probe_every(self) -> float:
        return min(PROBE_EVERY, self.config.interval.total_seconds())

    def after_probe(self, values: tuple, now: datetime) -> datetime | None:
        (next_due,) = values
        if next_due is None or next_due >= now + timedelta(seconds=self.probe_every()):
            return None
        return max(next_due, now)

    def run_once(self, ctx: PassContext) -> SchedulerResult:
        result = ctx.begin(SchedulerResult(dry_run=ctx.dry_run))
        if ctx.dry_run:
            with ctx.transaction() as conn:
                for row in conn.execute(ctx.sql(jobs.SCHEDULER_COUNT_DUE), {"now": ctx.now()}):
                    result.promoted[row.queue] = row.n
            return result
        next_due = self._promote_due(ctx, result)
        if next_due is not None and self.config.precise_timing:
            now = ctx.now()
            if next_due <= now:  # our reading runs ahead of the server's clock (it stepped back)
                now = ctx.now(fresh=True)
            if next_due < now + self.config.interval:
                result.next_pass_at = max(next_due, now + timedelta(seconds=MIN_WAKE))
        return result

    def _promote_due(self, ctx: PassContext, result: SchedulerResult) -> datetime | None:
        """Probe (read-only); if anything is due, promote it, one batch per transaction. Returns
        the next due time (from the probe, or read in the last batch's transaction)."""
        ctx.check_stop()
        with ctx.read() as conn:
            probe = conn.execute(ctx.sql(jobs.SCHEDULER_PROBE), {"now": ctx.now()}).one()
        if not probe.due:
            return probe.next_due
        channel, notify = notify_channel(ctx.schema), True
        position = {"after_at": "-infinity", "after_id": -2 ** 63}  # before every entry ('-infinity', id)
        while True:
            ctx.check_stop()
            limit = ctx.redo_limit(min(self._batch, self.config.batch_size))  # smaller when redone (40001)
            next_due, rows, started = None, [], time.monotonic()
            try:
                with ctx.transaction() as conn:
                    now = ctx.now()
                    rows = conn.execute(ctx.sql(jobs.SCHEDULER_PROMOTE), {"now": now, "limit": limit, **position}).all()
                    if rows and notify:
                        conn.execute(ctx.sql(jobs.NOTIFY_QUEUES), {"channel": channel, "queues": [r.queue for r in rows]})
                    promoted = sum(r.n for r in rows)
                    if promoted < limit:  # what is due and left is held by another session: not waited for
                        next_due = conn.execute(ctx.sql(jobs.SCHEDULER_NEXT_DUE), {"now": now}).scalar()
            except DBAPIError as exc:
                if ctx.moved_meanwhile(exc):  # cancelled (say) meanwhile
                    continue
                if notify and rows and faults.sqlstate(exc) == NOTIFY_QUEUE_FULL:
                    notify = False  # this batch redone, and the pass's next ones run, without NOTIFY
                    ctx.log.warning(NOTIFY_QUEUE_FULL_LOG, extra=kv(schema=ctx.schema))
                    continue
                if self._halved(ctx, exc, limit, result):
                    continue
                raise
            if promoted == limit and time.monotonic() - started < ctx.statement_timeout.total_seconds() / 4:
                # (a limit made smaller by a redo for a moved row says nothing about the timeout)
                self._batch = max(self._batch, min(self.config.batch_size, limit * 2))
            if rows:
                result.batches += 1
                position = {"after_at": rows[0].last_at, "after_id": rows[0].last_id}
            for r in rows:
                result.promoted[r.queue] = result.promoted.get(r.queue, 0) + r.n
            if promoted < limit:
                return next_due

    def _halved(self, ctx: PassContext, exc: DBAPIError, limit: int, result: SchedulerResult) -> bool:
        """A batch cancelled by the statement timeout (not by a stop): redo it at half the size."""
        if faults.sqlstate(exc) != faults.QUERY_CANCELED or limit <= MIN_BATCH:
            return False
        ctx.check_stop()  # the runner's cancel of a stopped pass is the same SQLSTATE
        self._batch, result.timeouts = max(MIN_BATCH, limit // 2), result.timeouts + 1
        ctx.log.warning("a batch hit the statement timeout: redone smaller",
                        extra=kv(schema=ctx.schema, batch_size=self._batch))
        return True

    def observe(self, metrics, result: SchedulerResult) -> None:
        for queue, n in result.promoted.items():
            metrics[JOBS_PROMOTED].labels(metrics.queue_label(queue)).inc(n)
