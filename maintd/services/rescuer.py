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

Waiting jobs (``available``, ``scheduled``, ``retryable``) with no attempt left (``attempt >=
max_attempts``), which the workers' claim passes over, are discarded with the reason appended to
``errors`` (through ``jobs_exhausted_idx``), counted as ``maintd_jobs_rescued_total{outcome=
"exhausted"}`` and logged one line per job.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone

from ..config import RescuerConfig
from ..jobs import BACKOFF_CAP, backoff
from ..logs import kv
from ..queries import jobs
from .base import PassContext, PassResult, Service

log = logging.getLogger("maintd.rescuer")

# Where the keyset starts; earlier signs of life (and none at all) are RESCUER_NO_SIGN_BATCH's.
FAR_PAST = datetime(1, 1, 2, tzinfo=timezone.utc)
# backoff(k) in seconds for k = 0 .. BACKOFF_CAP (the statement indexes it by attempt)
DELAYS = [backoff(k).total_seconds() for k in range(BACKOFF_CAP + 1)]


@dataclass
class RescuerResult(PassResult):
    retried: int = 0
    discarded: int = 0
    exhausted: int = 0  # waiting jobs with no attempt left, discarded
    batches: int = 0
    dry_run: bool = False

    def did_something(self) -> bool:
        return self.retried + self.discarded + self.exhausted > 0

    def summary(self) -> str:
        verb = "would rescue" if self.dry_run else "rescued"
        return f"{verb} retried={self.retried} discarded={self.discarded}" + (
            f" exhausted={self.exhausted}" if self.exhausted else "")


class Rescuer(Service):
    config: RescuerConfig

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
                row = conn.execute(ctx.sql(jobs.RESCUER_COUNT_STUCK), params).one()
            result.retried, result.discarded = row.retry, row.discard
            return result
        try:
            params = {**params, "now": now, "instance": ctx.instance_id, "delays": DELAYS,
                      "cap": BACKOFF_CAP}
            self._rescue_without_sign(ctx, params, result)
            self._rescue(ctx, params, result)
            self._discard_exhausted(ctx, params, result)
        finally:  # also when the pass stops or fails half-way: say what was committed
            if result.retried + result.discarded:
                log.info("released stale running jobs",
                         extra=kv(count=result.retried + result.discarded, retried=result.retried,
                                  discarded=result.discarded))
        return result

    def _rescue(self, ctx: PassContext, params: dict, result: RescuerResult) -> None:
        """Batches in keyset order until one finds fewer than ``batch_size`` candidates."""
        after_seen, after_id = FAR_PAST, 0
        limit = self.config.batch_size
        while True:
            ctx.check_stop()
            with ctx.transaction() as conn:
                batch = conn.execute(ctx.sql(jobs.RESCUER_BATCH), {
                    **params, "after_seen": after_seen, "after_id": after_id, "limit": limit}).one()
            if batch.retried or batch.discarded:
                result.batches += 1
            result.discarded += batch.discarded
            result.retried += batch.retried
            if batch.candidates < limit:
                return
            after_seen, after_id = batch.last_seen, batch.last_id

    def _rescue_without_sign(self, ctx: PassContext, params: dict, result: RescuerResult) -> None:
        """Running jobs with no usable attempted_at/heartbeat_at: stuck, rescued, each logged."""
        limit = self.config.batch_size
        while True:
            ctx.check_stop()
            with ctx.transaction() as conn:
                batch = conn.execute(ctx.sql(jobs.RESCUER_NO_SIGN_BATCH), {**params, "limit": limit}).one()
            result.discarded += batch.discarded
            result.retried += batch.retried
            for job_id in batch.ids:
                log.warning("rescued a running job with no usable attempted_at or heartbeat_at",
                            extra=kv(job_id=job_id))
            if batch.candidates < limit:
                return

    def _discard_exhausted(self, ctx: PassContext, params: dict, result: RescuerResult) -> None:
        """Waiting jobs with no attempt left (the claim passes them over): discarded, each logged."""
        limit = self.config.batch_size
        while True:
            ctx.check_stop()
            with ctx.transaction() as conn:
                batch = conn.execute(ctx.sql(jobs.RESCUER_EXHAUSTED_BATCH), {
                    "now": params["now"], "instance": ctx.instance_id, "limit": limit}).one()
            result.exhausted += len(batch.ids)
            for job_id in batch.ids:
                log.warning("discarded a waiting job with no attempt left (attempt >= max_attempts)",
                            extra=kv(job_id=job_id))
            if batch.candidates < limit:
                return

    def observe(self, metrics, result: RescuerResult) -> None:
        if result.retried:
            metrics.jobs_rescued.labels("retried").inc(result.retried)
        if result.discarded:
            metrics.jobs_rescued.labels("discarded").inc(result.discarded)
        if result.exhausted:
            metrics.jobs_rescued.labels("exhausted").inc(result.exhausted)
