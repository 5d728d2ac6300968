"""Scheduler: makes due ``scheduled``/``retryable`` jobs ``available`` and wakes the workers.

Each batch is one fenced transaction that promotes up to ``batch_size`` due jobs (found through
``jobs_scheduled_idx``, locked ``SKIP LOCKED``) and sends ``NOTIFY <channel>, '<queue>'`` once per
affected queue; PostgreSQL delivers the notifications only if the transaction commits.

Promotion lag. Workers claim ``available`` jobs with ``scheduled_at <= now()``, so promoting a job
before it is due would be harmless to workers using that SQL, but it would make ``available`` lie
(status, ``maintd_jobs``, oldest-available age), and the NOTIFY would wake the workers before
the job can be claimed, so they would find nothing and the job would wait for their next poll.
Instead, with ``precise_timing`` (default), a pass that finds the next job due before the next
tick sleeps until that moment and promotes it then (waking at most every ``MIN_WAKE`` under a
dense stream of due times, re-reading the next due time at least every ``MAX_SLEEP`` so a job
enqueued meanwhile is not missed, and ending ``TICK_MARGIN`` before the next tick): a job due
before the next tick is promoted, and its queue notified, within about ``MIN_WAKE`` of
``scheduled_at``. Without it, lag is up to ``interval``.

An idle tick is one read-only statement in autocommit (:data:`maintd.queries.jobs.SCHEDULER_PROBE`,
two probes of ``jobs_scheduled_idx``): no transaction, no fence, no WAL. Only when something is
due do the promoting (fenced) transactions run.

Never early: the pass's ``now`` is the server's clock carried forward on the host's monotonic
clock, which drifts from the server's by a fraction of a millisecond; the promotion is bounded by
the server's own ``statement_timestamp()`` as well, so no job becomes ``available`` before the
server's clock reaches its ``scheduled_at`` (a pass woken a little early promotes it on its next
wake-up, within ``MIN_WAKE``). A test's FrozenClock in the server's past still decides alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy.exc import DBAPIError

from ..config import SchedulerConfig
from ..db import notify_channel
from ..queries import jobs
from .base import PassContext, PassResult, Service

MIN_WAKE = 0.05  # seconds: at most ~20 wake-ups a second, whatever the due times
MAX_SLEEP = 1.0  # seconds: re-read the next due time at least this often while waiting
TICK_MARGIN = 0.25  # seconds (at most 10 % of interval): a pass ends this long before the next tick


@dataclass
class SchedulerResult(PassResult):
    promoted: dict[str, int] = field(default_factory=dict)
    batches: int = 0  # transactions that promoted at least one job
    wakeups: int = 0  # precise timing: times the pass slept and looked again
    slept: float = 0.0  # precise timing: seconds spent waiting for due times
    dry_run: bool = False

    def waited(self) -> float:
        return self.slept

    @property
    def total(self) -> int:
        return sum(self.promoted.values())

    def did_something(self) -> bool:
        return self.total > 0

    def summary(self) -> str:
        verb = "would promote" if self.dry_run else "promoted"
        queues = " ".join(f"{q}={n}" for q, n in sorted(self.promoted.items()))
        return f"{verb} {self.total} jobs {queues}".rstrip()


class Scheduler(Service):
    config: SchedulerConfig

    def run_once(self, ctx: PassContext) -> SchedulerResult:
        result = SchedulerResult(dry_run=ctx.dry_run)
        if ctx.dry_run:
            with ctx.transaction() as conn:
                for row in conn.execute(ctx.sql(jobs.SCHEDULER_COUNT_DUE), {"now": ctx.now()}):
                    result.promoted[row.queue] = row.n
            return result
        interval = self.config.interval.total_seconds()
        deadline = time.monotonic() + interval - min(TICK_MARGIN, interval * 0.1)
        precise = self.config.precise_timing
        while True:
            next_due = self._promote_due(ctx, result)
            if next_due is None or not precise:
                return result
            # Sleep until the next job falls due, if that is before the next tick.
            wait = (next_due - ctx.now()).total_seconds()
            if max(wait, MIN_WAKE) > deadline - time.monotonic():
                return result
            started = time.monotonic()
            stopped = ctx.sleep(min(max(wait, MIN_WAKE), MAX_SLEEP))
            result.slept += time.monotonic() - started
            if stopped:
                return result
            result.wakeups += 1

    def _promote_due(self, ctx: PassContext, result: SchedulerResult) -> datetime | None:
        """Probe (read-only); if anything is due, promote it, one batch per transaction. Returns
        the next due time (from the probe, or read in the last batch's transaction)."""
        ctx.check_stop()
        with ctx.read() as conn:
            probe = conn.execute(ctx.sql(jobs.SCHEDULER_PROBE), {"now": ctx.now()}).one()
        if not probe.due:
            return probe.next_due
        channel = notify_channel(ctx.schema)
        limit = self.config.batch_size
        while True:
            ctx.check_stop()
            next_due = None
            try:
                with ctx.transaction() as conn:
                    rows = conn.execute(ctx.sql(jobs.SCHEDULER_PROMOTE), {"now": ctx.now(), "limit": limit}).all()
                    if rows:
                        conn.execute(ctx.sql(jobs.NOTIFY_QUEUES), {"channel": channel, "queues": [r.queue for r in rows]})
                    promoted = sum(r.n for r in rows)
                    if promoted < limit:
                        next_due = conn.execute(ctx.sql(jobs.SCHEDULER_NEXT_DUE)).scalar()
            except DBAPIError as exc:
                if ctx.moved_meanwhile(exc):  # cancelled (say) meanwhile
                    continue
                raise
            if rows:
                result.batches += 1
            for r in rows:
                result.promoted[r.queue] = result.promoted.get(r.queue, 0) + r.n
            if promoted < limit:
                return next_due

    def observe(self, metrics, result: SchedulerResult) -> None:
        for queue, n in result.promoted.items():
            metrics.jobs_promoted.labels(metrics.queue_label(queue)).inc(n)
