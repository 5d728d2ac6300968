"""Cleaner: deletes final jobs whose ``finalized_at`` is older than their state's retention.

Each batch is one short fenced transaction deleting at most ``batch_size`` rows chosen through
``jobs_finalized_idx (state, finalized_at, id)``. Within a pass the scan moves forward by keyset
(``(finalized_at, id) > last``), so rows kept by a longer per-queue retention are read at most once
per pass, never once per batch. A batch that hits the statement timeout halves the batch size;
successes grow it back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from sqlalchemy.exc import OperationalError

from ..logs import kv
from ..models import FINAL_STATES
from .base import PassContext, PassResult, Service

log = logging.getLogger("maintd.cleaner")

EPOCH_START = datetime(1970, 1, 1, tzinfo=timezone.utc)
MIN_BATCH = 100

# :queue_filter is either no-op (all queues but the excluded ones) or one queue.
DELETE_BATCH = """
WITH deleted AS (
  DELETE FROM {schema}.jobs
   WHERE id = ANY(ARRAY(
           SELECT id FROM {schema}.jobs
            WHERE state = CAST(:state AS {schema}.job_state)
              AND finalized_at IS NOT NULL
              AND finalized_at < :horizon
              AND (finalized_at, id) > (:after_ts, :after_id)
              AND (CAST(:queue AS text) IS NULL OR queue = :queue)
              AND queue <> ALL(CAST(:excluded AS text[]))
            ORDER BY finalized_at, id
            LIMIT :limit
              FOR UPDATE SKIP LOCKED))
     AND state = CAST(:state AS {schema}.job_state)
     AND finalized_at < :horizon
  RETURNING finalized_at, id
)
SELECT count(*) AS n, max(finalized_at) AS last_ts,
       (SELECT max(id) FROM deleted d2
         WHERE d2.finalized_at = (SELECT max(finalized_at) FROM deleted)) AS last_id
  FROM deleted
"""

COUNT_EXPIRED = """
SELECT count(*) FROM {schema}.jobs
 WHERE state = CAST(:state AS {schema}.job_state)
   AND finalized_at IS NOT NULL
   AND finalized_at < :horizon
   AND (CAST(:queue AS text) IS NULL OR queue = :queue)
   AND queue <> ALL(CAST(:excluded AS text[]))
"""


@dataclass
class CleanerResult(PassResult):
    deleted: dict[str, int] = field(default_factory=lambda: {s: 0 for s in FINAL_STATES})
    batches: int = 0
    batch_size: int = 0
    timeouts: int = 0
    dry_run: bool = False

    @property
    def total(self) -> int:
        return sum(self.deleted.values())

    def did_something(self) -> bool:
        return self.total > 0 or self.timeouts > 0

    def summary(self) -> str:
        verb = "would delete" if self.dry_run else "deleted"
        states = " ".join(f"{s}={n}" for s, n in self.deleted.items())
        return f"{verb} {states} batches={self.batches} batch_size={self.batch_size}" + (
            f" timeouts={self.timeouts}" if self.timeouts else "")


@dataclass(frozen=True)
class _Target:
    """One scan: a state, a horizon, and which queues it covers."""

    state: str
    horizon: datetime
    queue: str | None  # None: every queue except ``excluded``
    excluded: tuple[str, ...]


class Cleaner(Service):
    name = "cleaner"

    def __init__(self, settings):
        super().__init__(settings)
        self._batch = self.config.batch_size
        self._successes = 0

    def targets(self, now: datetime) -> list[_Target]:
        cfg = self.config
        out: list[_Target] = []
        for state in FINAL_STATES:
            overridden = tuple(sorted(q for q in cfg.queues
                                      if f"{state}_retention" in cfg.queues[q].model_fields_set))
            default = cfg.retention(state)
            if default is not None:
                out.append(_Target(state, now - default, None, overridden))
            for q in overridden:
                retention = cfg.retention(state, q)
                if retention is not None:
                    out.append(_Target(state, now - retention, q, ()))
        return out

    def run_once(self, ctx: PassContext) -> CleanerResult:
        now = ctx.now()
        result = CleanerResult(dry_run=ctx.dry_run)
        for target in self.targets(now):
            params = {"state": target.state, "horizon": target.horizon, "queue": target.queue,
                      "excluded": list(target.excluded)}
            if ctx.dry_run:
                with ctx.transaction() as conn:
                    result.deleted[target.state] += conn.execute(ctx.sql(COUNT_EXPIRED), params).scalar_one()
                continue
            self._clean(ctx, params, result)
        result.batch_size = self._batch
        return result

    def _clean(self, ctx: PassContext, params: dict, result: CleanerResult) -> None:
        after_ts, after_id = EPOCH_START - timedelta(days=36500), 0
        while True:
            ctx.check_stop()
            limit = self._batch
            try:
                with ctx.transaction() as conn:
                    row = conn.execute(ctx.sql(DELETE_BATCH), {
                        **params, "after_ts": after_ts, "after_id": after_id, "limit": limit}).one()
            except OperationalError as exc:
                if "statement timeout" not in str(exc.orig) and "canceling statement" not in str(exc.orig):
                    raise
                if ctx.should_stop():
                    raise
                result.timeouts += 1
                self._shrink()
                log.warning("delete batch hit the statement timeout, shrinking the batch",
                            extra=kv(state=params["state"], batch_size=self._batch))
                if limit <= MIN_BATCH:
                    raise
                continue
            result.batches += 1
            result.deleted[params["state"]] += row.n
            self._grow()
            if row.n < limit:
                return
            after_ts, after_id = row.last_ts, row.last_id

    def _shrink(self) -> None:
        self._batch = max(MIN_BATCH, self._batch // 2)
        self._successes = 0

    def _grow(self) -> None:
        self._successes += 1
        if self._batch < self.config.batch_size and self._successes >= 3:
            self._batch = min(self.config.batch_size, self._batch * 2)
            self._successes = 0

    def observe(self, metrics, result: CleanerResult) -> None:
        for state, n in result.deleted.items():
            if n:
                metrics.jobs_deleted.labels(state).inc(n)
