"""Rescuer: gives stuck ``running`` jobs back (``retryable`` after the backoff) or discards them.

A job is stuck when ``coalesce(heartbeat_at, attempted_at) < now - rescue_stuck_jobs_after``, or,
with ``heartbeat_timeout`` set, when it has heartbeated and ``heartbeat_at < now - heartbeat_timeout``.

Candidates are read through ``jobs_running_idx`` in keyset order and locked ``FOR UPDATE SKIP
LOCKED`` (a worker finishing a job right now holds its row: we skip it). The update re-checks
``state = 'running'``, the same attempt and the stuck condition, so a job completed or re-claimed
in between is never overwritten.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone

from ..jobs import backoff
from ..logs import kv
from .base import PassContext, PassResult, Service

log = logging.getLogger("maintd.rescuer")

FAR_PAST = datetime(1900, 1, 1, tzinfo=timezone.utc)

# :hb_before is NULL when heartbeat_timeout is not set.
STUCK = """
      coalesce(heartbeat_at, attempted_at) < :stuck_before
   OR (heartbeat_at IS NOT NULL AND heartbeat_at < CAST(:hb_before AS timestamptz))
"""

SELECT_CANDIDATES = """
SELECT id, attempt, max_attempts, coalesce(heartbeat_at, attempted_at) AS seen
  FROM {schema}.jobs
 WHERE state = 'running'
   AND coalesce(heartbeat_at, attempted_at) < :scan_until
   AND (coalesce(heartbeat_at, attempted_at), id) > (:after_seen, :after_id)
   AND (""" + STUCK + """)
 ORDER BY coalesce(heartbeat_at, attempted_at), id
 LIMIT :limit
   FOR UPDATE SKIP LOCKED
"""

RESCUE = """
UPDATE {schema}.jobs AS j
   SET state = CASE WHEN j.attempt >= j.max_attempts
                    THEN 'discarded' ELSE 'retryable' END::{schema}.job_state,
       scheduled_at = CASE WHEN j.attempt >= j.max_attempts THEN j.scheduled_at ELSE u.retry_at END,
       finalized_at = CASE WHEN j.attempt >= j.max_attempts THEN CAST(:now AS timestamptz) END,
       errors = j.errors || jsonb_build_array(jsonb_build_object(
                  'at', CAST(:now AS timestamptz), 'attempt', j.attempt, 'error', u.error))
  FROM unnest(CAST(:ids AS bigint[]), CAST(:attempts AS int[]), CAST(:retry_at AS timestamptz[]),
              CAST(:errors AS text[])) AS u(id, attempt, retry_at, error)
 WHERE j.id = u.id
   AND j.state = 'running'
   AND j.attempt = u.attempt
   AND (""" + STUCK.replace("heartbeat_at", "j.heartbeat_at").replace("attempted_at", "j.attempted_at") + """)
RETURNING j.id, j.state::text AS state
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
        while True:
            ctx.check_stop()
            with ctx.transaction() as conn:
                rows = conn.execute(ctx.sql(SELECT_CANDIDATES), {
                    **params, "after_seen": after_seen, "after_id": after_id, "limit": limit}).all()
                if not rows:
                    break
                updated = conn.execute(ctx.sql(RESCUE), {
                    **params, "now": now,
                    "ids": [r.id for r in rows],
                    "attempts": [r.attempt for r in rows],
                    "retry_at": [now + backoff(r.attempt) for r in rows],
                    "errors": [f"stuck: no sign of life since {r.seen.isoformat()} "
                               f"(rescued by maintd {ctx.instance_id})" for r in rows],
                }).all()
            result.batches += 1
            for r in updated:
                if r.state == "discarded":
                    result.discarded += 1
                else:
                    result.retried += 1
            if len(rows) < limit:
                break
            after_seen, after_id = rows[-1].seen, rows[-1].id
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


