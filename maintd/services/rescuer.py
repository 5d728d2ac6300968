"""Rescuer: gives stuck ``running`` jobs back (``retryable`` after the backoff) or discards them.

A job is stuck when ``coalesce(heartbeat_at, attempted_at) < now - rescue_stuck_jobs_after``, or,
with ``heartbeat_timeout`` set, when it has heartbeated and ``heartbeat_at < now - heartbeat_timeout``.

Each batch is one fenced transaction of one statement: up to ``batch_size`` candidates read
through ``jobs_running_idx`` in keyset order (so rows that cannot be rescued now are passed over
once, never re-read by every batch), locked ``FOR NO KEY UPDATE SKIP LOCKED`` (a worker finishing
a job right now holds its row: we skip it rather than wait), and updated. ``scheduled_at = now +
backoff(attempt)`` uses :func:`maintd.jobs.backoff`, tabulated here and passed as an array. The
update re-checks ``state = 'running'``, the same attempt and the stuck condition, so a job
completed or re-claimed in between is never overwritten.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone

from ..jobs import BACKOFF_CAP, backoff
from ..logs import kv
from .base import PassContext, PassResult, Service

log = logging.getLogger("maintd.rescuer")

FAR_PAST = datetime(1900, 1, 1, tzinfo=timezone.utc)

# :hb_before is NULL when heartbeat_timeout is not set.
STUCK = """
      coalesce(heartbeat_at, attempted_at) < :stuck_before
   OR (heartbeat_at IS NOT NULL AND heartbeat_at < CAST(:hb_before AS timestamptz))
"""

# One batch, one statement: up to :limit candidates in keyset order over jobs_running_idx, locked
# (rows a worker is finishing right now are skipped, not waited for: the worker's update wins),
# then rescued. The update re-checks the state, the attempt and the stuck rule on the row as it is
# now. :delays[k + 1] is backoff(k) in seconds for k = 0 .. :cap (it is constant from :cap on).
RESCUE_BATCH = """
WITH candidates AS MATERIALIZED (
  SELECT id, attempt, coalesce(heartbeat_at, attempted_at) AS seen
    FROM {schema}.jobs
   WHERE state = 'running'
     AND coalesce(heartbeat_at, attempted_at) < :scan_until
     AND (coalesce(heartbeat_at, attempted_at), id) > (:after_seen, :after_id)
     AND (""" + STUCK + """)
   ORDER BY coalesce(heartbeat_at, attempted_at), id
   LIMIT :limit
     FOR NO KEY UPDATE SKIP LOCKED
), rescued AS (
  UPDATE {schema}.jobs AS j
     SET state = CASE WHEN j.attempt >= j.max_attempts
                      THEN 'discarded' ELSE 'retryable' END::{schema}.job_state,
         scheduled_at = CASE WHEN j.attempt >= j.max_attempts THEN j.scheduled_at
                             ELSE CAST(:now AS timestamptz) + make_interval(
                                    secs => (CAST(:delays AS float8[]))[least(greatest(j.attempt, 0), :cap) + 1])
                        END,
         finalized_at = CASE WHEN j.attempt >= j.max_attempts THEN CAST(:now AS timestamptz) END,
         errors = j.errors || jsonb_build_array(jsonb_build_object(
                    'at', CAST(:now AS timestamptz),
                    'attempt', j.attempt,
                    'error', 'stuck: no sign of life since ' || (to_jsonb(c.seen) #>> '{}')
                             || ' (rescued by maintd ' || CAST(:instance AS text) || ')'))
    FROM candidates AS c
   WHERE j.id = ANY(ARRAY(SELECT id FROM candidates))  -- a primary-key path for the candidates
     AND j.id = c.id                                    -- alone, whatever the planner thinks of c
     AND j.state = 'running'
     AND j.attempt = c.attempt
     AND (""" + STUCK.replace("heartbeat_at", "j.heartbeat_at").replace("attempted_at", "j.attempted_at") + """)
  RETURNING j.state = 'discarded' AS discarded
)
SELECT (SELECT count(*) FROM candidates) AS candidates,
       last.seen AS last_seen, last.id AS last_id,
       (SELECT count(*) FROM rescued WHERE discarded) AS discarded,
       (SELECT count(*) FROM rescued WHERE NOT discarded) AS retried
  FROM (SELECT 1) AS one
  LEFT JOIN LATERAL (SELECT seen, id FROM candidates ORDER BY seen DESC, id DESC LIMIT 1) AS last ON true
"""

COUNT_STUCK = """
SELECT count(*) FILTER (WHERE attempt < max_attempts) AS retry,
       count(*) FILTER (WHERE attempt >= max_attempts) AS discard
  FROM {schema}.jobs
 WHERE state = 'running'
   AND coalesce(heartbeat_at, attempted_at) < :scan_until
   AND (""" + STUCK + """)
"""


@dataclass
class RescuerResult(PassResult):
    retried: int = 0
    discarded: int = 0
    batches: int = 0
    dry_run: bool = False

    def did_something(self) -> bool:
        return self.retried + self.discarded > 0

    def summary(self) -> str:
        verb = "would rescue" if self.dry_run else "rescued"
        return f"{verb} retried={self.retried} discarded={self.discarded}"


class Rescuer(Service):
    name = "rescuer"

    def horizons(self, now: datetime) -> dict:
        cfg = self.config
        stuck_before = now - cfg.rescue_stuck_jobs_after
        hb_before = now - cfg.heartbeat_timeout if cfg.heartbeat_timeout else None
        scan_until = max(stuck_before, hb_before) if hb_before else stuck_before
        return {"stuck_before": stuck_before, "hb_before": hb_before, "scan_until": scan_until}

    def run_once(self, ctx: PassContext) -> RescuerResult:
        now = ctx.now()
        params = self.horizons(now)
        result = RescuerResult(dry_run=ctx.dry_run)
        if ctx.dry_run:
            with ctx.transaction() as conn:
                row = conn.execute(ctx.sql(COUNT_STUCK), params).one()
            result.retried, result.discarded = row.retry, row.discard
            return result
        after_seen, after_id = FAR_PAST, 0
        limit = self.config.batch_size
        delays = [backoff(k).total_seconds() for k in range(BACKOFF_CAP + 1)]
        try:
            while True:
                ctx.check_stop()
                with ctx.transaction() as conn:
                    batch = conn.execute(ctx.sql(RESCUE_BATCH), {
                        **params, "after_seen": after_seen, "after_id": after_id, "limit": limit,
                        "now": now, "instance": ctx.instance_id, "delays": delays, "cap": BACKOFF_CAP,
                    }).one()
                if batch.retried or batch.discarded:
                    result.batches += 1
                result.discarded += batch.discarded
                result.retried += batch.retried
                if batch.candidates < limit:
                    break
                after_seen, after_id = batch.last_seen, batch.last_id
        finally:  # also when the pass stops or fails half-way: say what was committed
            if result.did_something():
                log.info("released stale running jobs",
                         extra=kv(count=result.retried + result.discarded, retried=result.retried,
                                  discarded=result.discarded))
        return result

    def observe(self, metrics, result: RescuerResult) -> None:
        if result.retried:
            metrics.jobs_rescued.labels("retried").inc(result.retried)
        if result.discarded:
            metrics.jobs_rescued.labels("discarded").inc(result.discarded)


