"""Scheduler: makes due ``scheduled``/``retryable`` jobs ``available`` and wakes the workers.

Each batch is one fenced transaction that promotes up to ``batch_size`` due jobs (found through
``jobs_scheduled_idx``, locked ``SKIP LOCKED``) and sends ``NOTIFY <channel>, '<queue>'`` once per
affected queue; PostgreSQL delivers the notifications only if the transaction commits.

With ``precise_timing`` (default) a pass does not just promote what is due at the tick: if the next
job falls due before the next tick, it sleeps until then and promotes it, so promotion lag is a few
milliseconds rather than up to ``interval``. An idle tick is one index probe.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..db import notify_channel
from .base import PassContext, PassResult, Service

PROMOTE_BATCH = """
WITH promoted AS (
  UPDATE {schema}.jobs SET state = 'available'
   WHERE id = ANY(ARRAY(
           SELECT id FROM {schema}.jobs
            WHERE state IN ('scheduled', 'retryable') AND scheduled_at <= :now
            ORDER BY scheduled_at, id
            LIMIT :limit
              FOR UPDATE SKIP LOCKED))
     AND state IN ('scheduled', 'retryable')
     AND scheduled_at <= :now
  RETURNING queue
)
SELECT queue, count(*) AS n FROM promoted GROUP BY queue
"""

NOTIFY = "SELECT pg_notify(:channel, q) FROM unnest(CAST(:queues AS text[])) AS q"

NEXT_DUE = """
SELECT min(scheduled_at) FROM {schema}.jobs WHERE state IN ('scheduled', 'retryable')
"""

COUNT_DUE = """
SELECT queue, count(*) AS n FROM {schema}.jobs
 WHERE state IN ('scheduled', 'retryable') AND scheduled_at <= :now
 GROUP BY queue
"""


@dataclass
class SchedulerResult(PassResult):
    promoted: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    wakeups: int = 0
    dry_run: bool = False

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
    name = "scheduler"

    def run_once(self, ctx: PassContext) -> SchedulerResult:
        result = SchedulerResult(dry_run=ctx.dry_run)
        if ctx.dry_run:
            with ctx.transaction() as conn:
                for row in conn.execute(ctx.sql(COUNT_DUE), {"now": ctx.now()}):
                    result.promoted[row.queue] = row.n
            return result
        deadline = time.monotonic() + self.config.interval.total_seconds() * 0.9
        while True:
            self._promote_due(ctx, result)
            if not self.config.precise_timing:
                return result
            # Sleep until the next job falls due if that is before the next tick.
            with ctx.transaction() as conn:
                next_due = conn.execute(ctx.sql(NEXT_DUE)).scalar()
            if next_due is None:
                return result
            wait = (next_due - ctx.now()).total_seconds()
            if wait > deadline - time.monotonic():
                return result
            if wait > 0 and ctx.stop_event.wait(wait):
                return result
            result.wakeups += 1
            if time.monotonic() >= deadline:
                return result

    def _promote_due(self, ctx: PassContext, result: SchedulerResult) -> None:
        channel = notify_channel(ctx.schema)
        limit = self.config.batch_size
        while True:
            ctx.check_stop()
            with ctx.transaction() as conn:
                rows = conn.execute(ctx.sql(PROMOTE_BATCH), {"now": ctx.now(), "limit": limit}).all()
                if rows:
                    conn.execute(ctx.sql(NOTIFY), {"channel": channel, "queues": [r.queue for r in rows]})
            result.batches += 1
            for r in rows:
                result.promoted[r.queue] = result.promoted.get(r.queue, 0) + r.n
            if sum(r.n for r in rows) < limit:
                return

    def observe(self, metrics, result: SchedulerResult) -> None:
        for queue, n in result.promoted.items():
            metrics.jobs_promoted.labels(queue).inc(n)
