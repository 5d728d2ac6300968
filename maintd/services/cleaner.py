"""Cleaner: deletes final jobs whose ``finalized_at`` is older than their state's retention.

A pass works through *targets*: per final state, one for the default retention (every queue
without an override for that state) and one per queue overriding it; ``-1`` (``None``) keeps
forever, so such a target does not exist.

Each batch is one short fenced transaction deleting at most ``batch_size`` rows: a range
``lo <= finalized_at < hi`` of one state, deleted through ``jobs_finalized_idx (state,
finalized_at, id)``. Ranges move forward (keyset on ``finalized_at``), so rows kept by a longer
override are read at most once per pass, never once per batch. ``hi`` comes from one of two places:

* a *probe*: walk ``batch_size`` entries of the index (an index-only scan) and take the
  ``finalized_at`` where they end. Exact, but it reads every entry a second time: about a quarter
  of a batch's cost. The first two batches of every target are probed, and so is any batch after
  a surprise.
* a *prediction*: the width (in time) of the previous batch, scaled so that the next batch holds
  about ``FILL`` of ``batch_size`` rows and takes at most about ``BATCH_TARGET`` (growing at most
  ``GROWTH`` times per batch). The DELETE's own row count checks it: a predicted batch that
  would delete more than ``batch_size`` rows (a burst of jobs finished at one instant, e.g. a mass
  cancel) is rolled back and redone with a probe. A committed batch never exceeds ``batch_size``.

Across passes a target starts where the previous pass finished (minus ``LOOKBACK``, for jobs
committed a little after their ``finalized_at``), so rows kept by a longer override are not
re-read every pass either; every ``FULL_SCAN_EVERY`` a pass starts from the oldest row again.
This can only delay a deletion (never delete early): a job whose ``finalized_at`` lies further in
the past than ``LOOKBACK`` when it commits (e.g. imported, or finished by a transaction open for
hours) is deleted by the next full scan. Rows skipped because another session held their lock are
looked at again by the next pass.

A batch that hits its statement timeout halves the batch size (down to ``MIN_BATCH``); three
successes in a row double it again, up to ``batch_size``. The size lives on the service
instance, so it carries over from pass to pass. A final row locked by someone else makes the
range DELETE give up after ``LOCK_WAIT_MS`` and redo that batch with ``SKIP LOCKED``.

``batch_pause`` (default 0) idles after each batch that deleted rows, except the one that reached
the horizon, to leave the database to the workers while a large backlog is worked through.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from psycopg import errors as pg_errors
from sqlalchemy.exc import OperationalError

from ..logs import kv
from ..models import FINAL_STATES
from .base import PassContext, PassResult, Service

log = logging.getLogger("maintd.cleaner")

FAR_PAST = datetime(1900, 1, 1, tzinfo=timezone.utc)
MIN_BATCH = 100
FILL = 0.9  # a predicted batch aims at this fraction of batch_size rows
GROWTH = 2.0  # a predicted range is at most this many times wider than the previous one
BATCH_TARGET = 0.2  # seconds: a predicted range narrows when a batch took longer than this
GROW_AFTER = 3  # successful batches in a row before the batch size doubles again
BATCH_TIMEOUT = timedelta(seconds=5)  # statement timeout of one batch (at most statement_timeout)
LOCK_WAIT_MS = 500
LOOKBACK = timedelta(minutes=5)
FULL_SCAN_EVERY = timedelta(hours=1)


# Where a batch ends: the finalized_at of the (:limit + 1)-th row of the state from :lo on. The
# range [lo, that) then holds at most :limit rows of the state. NULL: the rest fits in a batch.
PROBE = """
SELECT finalized_at FROM {schema}.jobs
 WHERE state = CAST(:state AS {schema}.job_state)
   AND finalized_at IS NOT NULL AND finalized_at >= :lo AND finalized_at < :horizon
 ORDER BY finalized_at
OFFSET :limit LIMIT 1
"""

# Which queues a target covers: one queue (:queue), or all but the overridden ones (:excluded).
QUEUES = """
   AND (CAST(:queue AS text) IS NULL OR queue = :queue)
   AND queue <> ALL(CAST(:excluded AS text[]))"""

DELETE_RANGE = """
DELETE FROM {schema}.jobs
 WHERE state = CAST(:state AS {schema}.job_state)
   AND finalized_at IS NOT NULL AND finalized_at >= :lo AND finalized_at < :hi""" + QUEUES

# The same range when one of its rows is locked by another session (final rows normally are
# not): delete the others, skip that one.
DELETE_RANGE_SKIP_LOCKED = """
DELETE FROM {schema}.jobs
 WHERE id = ANY(ARRAY(
         SELECT id FROM {schema}.jobs
          WHERE state = CAST(:state AS {schema}.job_state)
            AND finalized_at IS NOT NULL AND finalized_at >= :lo AND finalized_at < :hi""" + QUEUES + """
            FOR UPDATE SKIP LOCKED))
   AND state = CAST(:state AS {schema}.job_state) AND finalized_at >= :lo AND finalized_at < :hi
"""

# More than :limit rows finalized at the very same instant: delete them in id batches.
DELETE_TIED = """
DELETE FROM {schema}.jobs
 WHERE id = ANY(ARRAY(
         SELECT id FROM {schema}.jobs
          WHERE state = CAST(:state AS {schema}.job_state) AND finalized_at = :lo""" + QUEUES + """
          ORDER BY id LIMIT :limit
            FOR UPDATE SKIP LOCKED))
   AND state = CAST(:state AS {schema}.job_state) AND finalized_at = :lo
"""

# Dry run: what a full pass would delete (one index range count per target, no loop).
COUNT_EXPIRED = """
SELECT count(*) FROM {schema}.jobs
 WHERE state = CAST(:state AS {schema}.job_state)
   AND finalized_at IS NOT NULL AND finalized_at < :horizon""" + QUEUES


@dataclass
class CleanerResult(PassResult):
    deleted: dict[str, int] = field(default_factory=lambda: {s: 0 for s in FINAL_STATES})
    batches: int = 0  # transactions that deleted at least one row
    batch_size: int = 0  # the (adaptive) batch size at the end of the pass
    timeouts: int = 0
    overflows: int = 0  # predicted batches rolled back because they held more than batch_size rows
    full_scan: bool = False
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
            f" timeouts={self.timeouts}" if self.timeouts else "") + (
            f" overflows={self.overflows}" if self.overflows else "")


@dataclass(frozen=True)
class Target:
    """One keyset scan of a pass: a state, its retention, and the queues it covers."""

    state: str
    retention: timedelta
    queue: str | None  # None: every queue except ``excluded``
    excluded: tuple[str, ...]

    def params(self, horizon: datetime) -> dict:
        return {"state": self.state, "horizon": horizon, "queue": self.queue,
                "excluded": list(self.excluded)}


class Cleaner(Service):
    name = "cleaner"

    def __init__(self, settings):
        super().__init__(settings)
        self._batch = self.config.batch_size
        self._successes = 0
        self._cleaned_through: dict[Target, datetime] = {}
        self._last_full_scan: datetime | None = None

    def targets(self) -> list[Target]:
        cfg = self.config
        out: list[Target] = []
        for state in FINAL_STATES:
            key = f"{state}_retention"
            overridden = tuple(sorted(q for q, o in cfg.queues.items() if key in o.model_fields_set))
            default = cfg.retention(state)
            if default is not None:
                out.append(Target(state, default, None, overridden))
            for queue in overridden:
                retention = cfg.retention(state, queue)
                if retention is not None:
                    out.append(Target(state, retention, queue, ()))
        return out

    def run_once(self, ctx: PassContext) -> CleanerResult:
        now = ctx.now()
        result = CleanerResult(dry_run=ctx.dry_run)
        targets = self.targets()
        if ctx.dry_run:
            for target in targets:
                with ctx.transaction() as conn:
                    result.deleted[target.state] += conn.execute(
                        ctx.sql(COUNT_EXPIRED), target.params(now - target.retention)).scalar_one()
            result.batch_size = self.batch_size
            return result
        last_full = self._last_full_scan
        result.full_scan = last_full is None or not (timedelta(0) <= now - last_full < FULL_SCAN_EVERY)
        # Forget the cursors of targets that are no longer configured (after a reload).
        self._cleaned_through = {t: c for t, c in self._cleaned_through.items() if t in targets}
        for target in targets:
            horizon = now - target.retention
            lo = FAR_PAST
            if not result.full_scan and target in self._cleaned_through:
                lo = max(FAR_PAST, min(self._cleaned_through[target], horizon) - LOOKBACK)
            self._cleaned_through[target] = self._clean(ctx, target, horizon, lo, result)
        if result.full_scan:
            self._last_full_scan = now
        result.batch_size = self.batch_size
        return result

    @property
    def batch_size(self) -> int:
        return min(self._batch, self.config.batch_size)

    def _clean(self, ctx: PassContext, target: Target, horizon: datetime, lo: datetime,
               result: CleanerResult) -> datetime:
        """Delete the target's expired rows from ``lo`` on; return where the next pass may start
        (``horizon``, or where rows were skipped because someone held their lock)."""
        params = target.params(horizon)
        resume = horizon
        timeout_ms = int(min(BATCH_TIMEOUT, self.settings.statement_timeout).total_seconds() * 1000)
        # Per batch: a short lock wait (a locked row is skipped, not waited for until the timeout),
        # and no wait for the WAL flush at commit (a deletion lost in a crash is done again by the
        # next pass; any later synchronous commit, e.g. a worker's, flushes it anyway).
        batch_settings = {"lock_timeout": str(max(1, min(LOCK_WAIT_MS, timeout_ms // 2))),
                          "synchronous_commit": "off"}
        pause = self.config.batch_pause.total_seconds()
        skip_locked = False
        width: timedelta | None = None  # predicted width of the next range; None: probe it
        at_boundary = False  # whether lo is where a probed batch ended (so a probe measures density)
        while True:
            ctx.check_stop()
            limit = self.batch_size
            predicted = width is not None and not skip_locked
            started = time.monotonic()
            try:
                with ctx.transaction(statement_timeout_ms=timeout_ms, settings=batch_settings) as conn:
                    if predicted:
                        hi = min(lo + width, horizon)
                        last = hi >= horizon
                    else:
                        hi = conn.execute(ctx.sql(PROBE), {"state": target.state, "lo": lo,
                                                           "horizon": horizon, "limit": limit}).scalar()
                        last = hi is None
                        if last:
                            hi = horizon
                    if hi == lo:  # more than a batch finalized at this very instant
                        stmt, args = DELETE_TIED, {**params, "lo": lo, "limit": limit}
                    else:
                        stmt = DELETE_RANGE_SKIP_LOCKED if skip_locked else DELETE_RANGE
                        args = {**params, "lo": lo, "hi": hi}
                    n = conn.execute(ctx.sql(stmt), args).rowcount
                    if n > limit:  # only a prediction can overshoot: undo it, probe instead
                        raise _Overflow()
            except _Overflow:
                result.overflows += 1
                width = None
                continue
            except OperationalError as exc:
                if isinstance(exc.orig, pg_errors.LockNotAvailable) and not skip_locked:
                    skip_locked = True  # redo this batch, skipping the locked rows
                    resume = min(resume, lo)
                    continue
                if not isinstance(exc.orig, pg_errors.QueryCanceled) or ctx.should_stop():
                    raise
                result.timeouts += 1
                if predicted:  # the prediction was too wide: probe, keep the batch size
                    width = None
                    continue
                if limit <= MIN_BATCH:
                    raise
                self._shrink()
                log.warning("delete batch hit the statement timeout, shrinking the batch",
                            extra=kv(state=target.state, batch_size=self.batch_size))
                continue
            seconds = time.monotonic() - started
            skip_locked = False
            self._grow()
            if n:
                result.batches += 1
                result.deleted[target.state] += n
            if last:
                return resume
            if n:
                ctx.pause(pause)
            if hi == lo:
                if n < limit:
                    resume = min(resume, lo)  # some tied rows were locked: look again next pass
                    lo = hi + timedelta(microseconds=1)  # the tie is done: move just past it
                    at_boundary = False
                width = None
                continue
            if predicted:  # an empty range says nothing of what follows (a gap): probe it
                width = next_width(hi - lo, n, limit, seconds) if n else None
            elif at_boundary:  # [lo, hi) held exactly ``limit`` rows of the state
                width = next_width(hi - lo, limit, limit, seconds)
            at_boundary = not predicted
            lo = hi

    def _shrink(self) -> None:
        self._batch = max(MIN_BATCH, self.batch_size // 2)
        self._successes = 0

    def _grow(self) -> None:
        self._successes += 1
        if self._successes >= GROW_AFTER and self._batch < self.config.batch_size:
            self._batch = min(self.config.batch_size, self._batch * 2)
            self._successes = 0

    def observe(self, metrics, result: CleanerResult) -> None:
        for state, n in result.deleted.items():
            if n:
                metrics.jobs_deleted.labels(state).inc(n)


class _Overflow(Exception):
    """A predicted batch held more than ``batch_size`` rows (its transaction is rolled back)."""


def next_width(width: timedelta, rows: int, limit: int, seconds: float) -> timedelta:
    """The width of the next predicted range, from the last range: ``rows`` deleted (of at most
    ``limit``) in ``seconds``. Aims at ``FILL * limit`` rows and at most ``BATCH_TARGET`` seconds,
    growing at most ``GROWTH`` times."""
    factor = min(GROWTH, FILL * limit / max(rows, 1), BATCH_TARGET / max(seconds, 1e-6))
    return max(timedelta(microseconds=1), width * factor)
