"""Cleaner: deletes final jobs whose ``finalized_at`` is older than their state's retention.

Each batch is one short fenced transaction deleting at most ``batch_size`` rows: a range of
``finalized_at`` found through ``jobs_finalized_idx (state, finalized_at, id)``. Within a pass the
ranges move forward, so rows kept by a longer per-queue retention are read at most once per pass,
never once per batch. A batch that hits the statement timeout halves the batch size;
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

FAR_PAST = datetime(1900, 1, 1, tzinfo=timezone.utc)
MIN_BATCH = 100

# A batch is a range of finalized_at holding at most :limit rows of the state. The probe walks
# :limit entries of jobs_finalized_idx (an index-only scan) to find where the range ends; the
# DELETE then removes that range through the same index: no sort, no id array, no primary-key
# probes, and an exact bound on the batch.
PROBE = """
SELECT finalized_at FROM {schema}.jobs
 WHERE state = CAST(:state AS {schema}.job_state)
   AND finalized_at IS NOT NULL AND finalized_at >= :lo AND finalized_at < :horizon
 ORDER BY finalized_at
OFFSET :limit LIMIT 1
"""

FILTER = """
   AND (CAST(:queue AS text) IS NULL OR queue = :queue)
   AND queue <> ALL(CAST(:excluded AS text[]))
"""

DELETE_RANGE = """
WITH deleted AS (
  DELETE FROM {schema}.jobs
   WHERE state = CAST(:state AS {schema}.job_state)
     AND finalized_at IS NOT NULL AND finalized_at >= :lo AND finalized_at < :hi""" + FILTER + """
  RETURNING 1
)
SELECT count(*) FROM deleted
"""

# The same range when some of its rows are locked by another session (final rows normally are
# not): delete the others, skip those.
DELETE_RANGE_SKIP_LOCKED = """
WITH deleted AS (
  DELETE FROM {schema}.jobs
   WHERE id = ANY(ARRAY(
           SELECT id FROM {schema}.jobs
            WHERE state = CAST(:state AS {schema}.job_state)
              AND finalized_at IS NOT NULL AND finalized_at >= :lo AND finalized_at < :hi""" + FILTER + """
              FOR UPDATE SKIP LOCKED))
     AND state = CAST(:state AS {schema}.job_state) AND finalized_at >= :lo AND finalized_at < :hi
  RETURNING 1
)
SELECT count(*) FROM deleted
"""
LOCK_WAIT_MS = 500

# More than :limit rows finalized at the very same instant: delete them by id batches.
DELETE_TIED = """
WITH deleted AS (
  DELETE FROM {schema}.jobs
   WHERE id = ANY(ARRAY(
           SELECT id FROM {schema}.jobs
            WHERE state = CAST(:state AS {schema}.job_state) AND finalized_at = :lo""" + FILTER + """
            ORDER BY id LIMIT :limit
              FOR UPDATE SKIP LOCKED))
     AND state = CAST(:state AS {schema}.job_state) AND finalized_at = :lo
  RETURNING 1
)
SELECT count(*) FROM deleted
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
        lo = FAR_PAST
        while True:
            ctx.check_stop()
            limit = self._batch
            try:
                with ctx.transaction() as conn:
                    hi = conn.execute(ctx.sql(PROBE), {"state": params["state"], "lo": lo,
                                                       "horizon": params["horizon"], "limit": limit}).scalar()
                    last = hi is None
                    if last:
                        hi = params["horizon"]
                    if hi == lo:  # a tie bigger than a batch
                        n = conn.execute(ctx.sql(DELETE_TIED), {**params, "lo": lo, "limit": limit}).scalar_one()
                    else:
                        n = self._delete_range(ctx, conn, {**params, "lo": lo, "hi": hi})
            except OperationalError as exc:
                msg = str(exc.orig)
                if not any(t in msg for t in ("statement timeout", "canceling statement", "lock timeout")):
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
            result.deleted[params["state"]] += n
            self._grow()
            if last:
                return
            if hi == lo and n < limit:
                # The tie is done: move just past it.
                lo = hi + timedelta(microseconds=1)
            else:
                lo = hi

    def _delete_range(self, ctx: PassContext, conn, params: dict) -> int:
        """The fast range DELETE; if a row of the range is locked, skip it instead of waiting."""
        try:
            with conn.begin_nested():
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = {LOCK_WAIT_MS}")
                return conn.execute(ctx.sql(DELETE_RANGE), params).scalar_one()
        except OperationalError as exc:
            if "lock timeout" not in str(exc.orig):
                raise
        return conn.execute(ctx.sql(DELETE_RANGE_SKIP_LOCKED), params).scalar_one()

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
