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

Every pass starts at the oldest expired row of each target, so a row whose ``finalized_at`` lies
far in the past when it commits (imported, back-dated, finished by a long transaction) goes with
the next pass, and ``--dry-run`` counts exactly what a pass deletes (from where the pass starts,
in keyset chunks of the same index, each under a batch's statement timeout and halved on a
timeout, so that it fits wherever the pass does). Rows kept by a longer
per-queue retention are not walked again every pass for that: a per-queue target reads its own
queue through ``jobs_finalized_queue_idx (state, queue, finalized_at, id)``, and a default target
with overridden queues starts at the first expired row of the queues it covers, found by a loose
scan of that index (one probe per distinct queue of the state). Rows skipped because another
session held their lock are looked at again by the next pass; ``--dry-run`` counts them as
skipped too, read from their ``xmax`` (it takes no lock: none may be taken read-only).

A batch that hits its statement timeout halves the batch size (down to ``MIN_BATCH``); three
successes in a row double it again, up to ``batch_size``. A *probe* that hits it is walking
entries that cost without counting: the dead index entries a large delete leaves until vacuum
removes them (an index-only scan cannot mark them dead as a plain scan does), by the million
under a statement timeout of milliseconds. Then the walk goes on *stepping*: every batch is a
predicted range, no probe; a range that times out or holds too many rows is halved, an empty one
doubles. Each range walks only its own entries, and its DELETE (a plain index scan) marks the
dead ones it meets so later scans skip them. Predicted ranges aim at half the statement timeout
when that is shorter than ``BATCH_TARGET``. The size lives on the service
instance, so it carries over from pass to pass. A final row locked by someone else makes the
range DELETE give up after ``LOCK_WAIT_MS`` and redo that batch with ``SKIP LOCKED`` (probed,
or, stepping, the same predicted range). On the
partitioned layout a row moved to another partition meanwhile (``retry_jobs``: SQLSTATE 40001)
halves the batch size as a timeout does (and a predicted range), and the batch is redone: a table
busy with such moves still loses its expired rows, in smaller batches.

``batch_pause`` (default 0) idles after each batch that deleted rows, except the one that reached
the horizon, to leave the database to the workers while a large backlog is worked through.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone

from typing import Annotated

from prometheus_client import Counter
from pydantic import BeforeValidator, Field
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from ..db import ms
from ..faults import LOCK_NOT_AVAILABLE, QUERY_CANCELED
from ..durations import parse_duration
from ..logs import kv
from ..metrics import Family
from ..queries import FINAL_STATES, catalog, for_queue, jobs, partitions
from ..sections import DURATION_JSON, Retention, Section, ServiceConfig, names_like_queues
from .base import MIN_BATCH, PassContext, PassResult, Service


class QueueRetention(Section):
    completed_retention: Retention = None
    cancelled_retention: Retention = None
    discarded_retention: Retention = None
    # Fields not given fall back to the global value; keep track of which were given.


def _pause(v: object) -> timedelta:
    td = parse_duration(v)
    if td > timedelta(seconds=10):
        raise ValueError("must be at most 10s")
    return td


class CleanerConfig(ServiceConfig):
    batch_size: int = Field(default=10_000, ge=1, le=1_000_000)
    # Idle time after each batch that deleted rows, leaving the database to the workers.
    batch_pause: Annotated[timedelta, BeforeValidator(_pause), DURATION_JSON] = timedelta(0)
    completed_retention: Retention = timedelta(hours=24)
    cancelled_retention: Retention = timedelta(hours=24)
    discarded_retention: Retention = timedelta(days=7)
    queues: Annotated[dict[str, QueueRetention], names_like_queues("queue")] = Field(default_factory=dict)

    def longest_retention(self, state: str) -> timedelta | None:
        """The longest retention of a final state, default or per queue (None: some keep it
        forever): what the partitioned layout's drops follow (SPEC 8.1)."""
        retentions = [self.retention(state)] + [self.retention(state, q) for q in self.queues]
        return None if any(r is None for r in retentions) else max(retentions)

    def retention(self, state: str, queue: str | None = None) -> timedelta | None:
        """Effective retention for a final state (and queue); ``None`` keeps forever."""
        key = f"{state}_retention"
        if queue is not None and queue in self.queues:
            override = self.queues[queue]
            if key in override.model_fields_set:
                return getattr(override, key)
        return getattr(self, key)


log = logging.getLogger("maintd.cleaner")

JOBS_DELETED = Family(Counter, "maintd_jobs_deleted", "Final jobs deleted past their retention: by the cleaner, "
                      "or with their partition by the partitioner.", ("state",),
                      known=tuple((state,) for state in FINAL_STATES))

# Where a full scan starts: rows finalized earlier (BC, '-infinity') go first, in id batches
# (also a literal in jobs.CLEANER_ANY_ANCIENT).
FAR_PAST = datetime(1, 1, 2, tzinfo=timezone.utc)
FILL = 0.9  # a predicted batch aims at this fraction of batch_size rows
GROWTH = 2.0  # a predicted range is at most this many times wider than the previous one
BATCH_TARGET = 0.2  # seconds: a predicted range narrows when a batch took longer than this
GROW_AFTER = 3  # successful batches in a row before the batch size doubles again
BATCH_TIMEOUT = timedelta(seconds=5)  # statement timeout of one batch (at most statement_timeout)
LOCK_WAIT_MS = 500
COUNT_CHUNK = 100_000  # index entries a dry run counts in one statement, at most
# A chunk is bounded by its LIMIT only if it walks the index in order: on a table whose statistics
# lag (a backlog just imported) the planner took a Bitmap Heap Scan of every expired row and a
# Sort (400,000 rows read for 101). No sort, no bitmap: in the chunk's transaction only.
COUNT_PLANNING = {"enable_sort": "off", "enable_bitmapscan": "off"}
FIRST_ID = -(2 ** 63)  # where a dry run's (finalized_at, id) walk starts at its first finalized_at
LOCKED_SHOWN = 5  # ids named in the line about a batch's rows passed over as locked
TINY = timedelta(microseconds=1)
STEP_START = timedelta(minutes=1)  # the first range of a walk that steps (it doubles while empty)


@dataclass
class CleanerResult(PassResult):
    deleted: dict[str, int] = field(default_factory=lambda: {s: 0 for s in FINAL_STATES})
    batches: int = 0  # transactions that deleted at least one row
    batch_size: int = 0  # the (adaptive) batch size at the end of the pass
    timeouts: int = 0
    overflows: int = 0  # predicted batches rolled back because they held more than batch_size rows
    dry_run: bool = False
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> rows passed over
    waited_seconds: float = 0.0  # batch pauses: idle, not work (out of the pass's duration)

    @property
    def total(self) -> int:
        return sum(self.deleted.values())

    def waited(self) -> float:
        return self.waited_seconds

    def skipped_rows(self) -> dict[str, int]:
        return self.skipped

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
    # The partitioned layout's drops handle this target's rows (SPEC 8.1) but for those finalized
    # before ``until`` (the low catch-all's, a wide partition's): only those are left to the DELETE.
    until: datetime | None = None

    def horizon(self, now: datetime) -> datetime:
        return now - self.retention if self.until is None else min(now - self.retention, self.until)

    def params(self, horizon: datetime) -> dict:
        return {"state": self.state, "horizon": horizon, "queue": self.queue,
                "excluded": list(self.excluded)}

    def statement(self, template: str) -> str:
        """``template`` for this target's queues (``{target_queues}`` or ``queue = :queue``)."""
        return template if self.queue is None else for_queue(template)


@dataclass
class RangePlan:
    """The walk of one target through ``[lo, horizon)``: where the next batch ends (a probe when
    ``width`` is None, else a prediction ``lo + width``)."""

    lo: datetime
    horizon: datetime
    width: timedelta | None = None
    at_boundary: bool = False  # lo is where a probed batch ended (so a probe measures density)
    skip_locked: bool = False  # redo the range skipping a row someone else holds
    stepping: bool = False  # a probe timed out: every batch is predicted, widths adapt (no probe)
    target: float = 0.2  # seconds a predicted batch aims at (BATCH_TARGET, or less under a short timeout)
    tie_from: int | None = None  # in a tie at lo: the next id batch starts at this id (no probe)

    @property
    def predicted(self) -> bool:
        """Whether the next batch is ``lo + width``. A range redone skipping a locked row is
        probed (exact), unless probes time out (stepping): then it is the same predicted range."""
        return self.width is not None and (self.stepping or not self.skip_locked)

    def skip_lock_holders(self) -> None:
        self.skip_locked = True  # the rows skipped are looked at again by the next pass

    def step(self) -> None:
        """The probe from ``lo`` timed out: walk on in predicted ranges from here."""
        self.stepping, self.at_boundary = True, False
        self.width = STEP_START if self.width is None else max(TINY, self.width / 2)

    def narrow(self) -> bool:
        """A stepped range timed out or held too many rows: halve it. False when it cannot be
        narrower (a tie: more rows at one instant than a batch holds)."""
        if self.width is None or self.width <= TINY:
            return False
        self.width = max(TINY, self.width / 2)
        return True

    def advance(self, hi: datetime, n: int, limit: int, seconds: float, predicted: bool,
                next_id: int | None = None) -> None:
        """After a committed batch ``[lo, hi)`` that deleted ``n`` rows in ``seconds`` (a tie's:
        up to id ``next_id``, exclusive)."""
        self.skip_locked = False
        if hi == self.lo:  # a tie: more than a batch finalized at this very instant
            if n < limit or next_id is None:  # the tie is done (rows skipped as locked are looked at next pass)
                self.lo = hi + TINY
                self.at_boundary = False
                self.tie_from = None
            else:  # the next batch of the tie starts after this one's ids
                self.tie_from = next_id
            self.width = None
            return
        if predicted:  # an empty range says nothing of what follows (a gap): probe it, unless stepping
            self.width = next_width(hi - self.lo, n, limit, seconds, self.target) \
                if n or self.stepping else None
        elif self.at_boundary:  # [lo, hi) held exactly ``limit`` rows of the state
            self.width = next_width(hi - self.lo, limit, limit, seconds, self.target)
        self.at_boundary = not predicted
        self.lo = hi


class Cleaner(Service):

    METRICS = (JOBS_DELETED,)
    config: CleanerConfig

    def __init__(self, config: CleanerConfig):
        super().__init__(config)
        self._batch = config.batch_size
        self._successes = 0
        self._chunk = COUNT_CHUNK  # a dry run's count: index entries per statement (adaptive too)
        self._chunk_successes = 0

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

    def probe(self) -> list[str] | None:
        """No ticks of its own: every ``interval`` the database's probe reads the oldest finished
        job of each state of every target, and a pass runs only where one is past its retention."""
        return jobs.OLDEST_FINALIZED

    def after_probe(self, values: tuple, now: datetime) -> bool | None:
        shortest: dict[str, timedelta] = {}
        for target in self.targets():
            shortest[target.state] = min(shortest.get(target.state, target.retention), target.retention)
        expired = [oldest is not None and state in shortest and oldest < now - shortest[state]
                   for state, oldest in zip(FINAL_STATES, values)]
        return True if any(expired) else None

    @property
    def batch_size(self) -> int:
        return min(self._batch, self.config.batch_size)

    def run_once(self, ctx: PassContext) -> CleanerResult:
        now = ctx.now(fresh=True)  # the horizons: never past the server's clock
        result = ctx.begin(CleanerResult(dry_run=ctx.dry_run))
        targets = self._targets(ctx)
        if ctx.dry_run:
            return self._count(ctx, now, result, targets)
        for target in targets:
            horizon = target.horizon(now)
            self._delete_ancient(ctx, target, result)
            lo = self._start(ctx, target, horizon)
            if lo is not None:
                aim = min(BATCH_TARGET, self._timeout_ms(ctx) / 2000)
                self._clean(ctx, target, RangePlan(lo, horizon, target=aim), result)
        result.batch_size = self.batch_size
        return result

    def _start(self, ctx: PassContext, target: Target, horizon: datetime) -> datetime | None:
        """Where the target's walk starts: the oldest row (the first probe finds it), or, for a
        default target whose range holds rows of overridden queues, the first expired row of the
        queues it covers (None: there is none)."""
        if target.queue is not None or not target.excluded:
            return FAR_PAST
        try:
            with ctx.transaction(fenced=False) as conn:
                first = conn.execute(ctx.sql(jobs.CLEANER_FIRST_EXPIRED), target.params(horizon)).scalar()
        except OperationalError as exc:  # dead entries in the way: the walk steps past them
            if getattr(exc.orig, "sqlstate", None) != QUERY_CANCELED or ctx.should_stop():
                raise
            return FAR_PAST
        return None if first is None else max(first, FAR_PAST)

    def _targets(self, ctx: PassContext) -> list[Target]:
        """This pass's targets. On the partitioned layout the partitioner drops whole partitions
        past the longest retention of their state (SPEC 8.1): the targets of queues with a shorter
        one are left to the batched DELETE, and of the others only the expired rows of the low
        catch-all (strays finalized before every partition: an import, a clock behind) and of
        partitions wider than a step (a high catch-all closed after an outage), which would
        otherwise wait for the whole range to pass the retention."""
        targets = self.targets()
        if ctx.layout != "partitioned":
            return targets
        with ctx.read() as conn:
            if not conn.execute(text(catalog.JOBS_PARTITIONED), {"schema": ctx.schema}).scalar():
                return targets
            until = dict(conn.execute(ctx.sql(partitions.WIDE_PARTITIONS_END)).all())
        return [t if t.retention != self.config.longest_retention(t.state) else replace(t, until=until[t.state])
                for t in targets]

    def _count(self, ctx: PassContext, now: datetime, result: CleanerResult,
               targets: list[Target]) -> CleanerResult:
        """Dry run: what a full pass would delete, counted from where the pass starts up to the
        horizon in keyset chunks of the index it reads, each under a batch's statement timeout."""
        for target in targets:
            horizon = target.horizon(now)
            start = self._start(ctx, target, horizon)
            if start is None:
                continue
            # Rows finalized before year 1 are the pass's too (deleted first): the walk starts there.
            at: str | None = "-infinity" if start <= FAR_PAST else start.isoformat()
            after = FIRST_ID
            while at is not None:
                at, after = self._count_chunk(ctx, target, horizon, (at, after), result)
        result.batch_size = self.batch_size
        return result

    def _count_chunk(self, ctx: PassContext, target: Target, horizon: datetime, start: tuple[str, int],
                     result: CleanerResult) -> tuple[str | None, int]:
        """Count one chunk from ``start`` (finalized_at as text, id) on; returns where the next one
        starts (None: the horizon is reached). A chunk that hits the statement timeout is halved
        (down to ``MIN_BATCH``), three successes double it again, as a batch of the pass. Rows
        another session holds are counted as the pass counts them: skipped, locked."""
        stmt = jobs.CLEANER_COUNT_CHUNK if target.queue is None else jobs.CLEANER_COUNT_CHUNK_QUEUE
        while True:
            ctx.check_stop()
            limit = min(self._chunk, COUNT_CHUNK)
            try:
                with ctx.transaction(statement_timeout_ms=self._timeout_ms(ctx), settings=COUNT_PLANNING) as conn:
                    row = conn.execute(ctx.sql(target.statement(stmt)), {
                        **target.params(horizon), "from_at": start[0], "from_id": start[1],
                        "limit": limit}).one()
            except OperationalError as exc:
                if getattr(exc.orig, "sqlstate", None) != QUERY_CANCELED or ctx.should_stop() or limit <= MIN_BATCH:
                    raise
                result.timeouts += 1
                self._chunk, self._chunk_successes = max(MIN_BATCH, limit // 2), 0
                continue
            self._chunk_successes += 1
            if self._chunk_successes >= GROW_AFTER and self._chunk < COUNT_CHUNK:
                self._chunk, self._chunk_successes = min(COUNT_CHUNK, self._chunk * 2), 0
            result.deleted[target.state] += row.n
            if row.held:
                result.skipped["locked"] = result.skipped.get("locked", 0) + row.held
            return row.next_at, row.next_id

    def _clean(self, ctx: PassContext, target: Target, plan: RangePlan, result: CleanerResult) -> None:
        """Delete the target's expired rows, batch by batch, up to the horizon."""
        pause = self.config.batch_pause.total_seconds()
        while True:
            ctx.check_stop()
            limit, predicted, started = self.batch_size, plan.predicted, time.monotonic()
            try:
                hi, last, n, next_id = self._delete_batch(ctx, target, plan, limit, result)
            except _Overflow:  # only a prediction can overshoot: it was rolled back; probe instead
                result.overflows += 1
                if not (plan.stepping and plan.narrow()):
                    plan.stepping, plan.width = False, None
                continue
            except _ProbeTimeout as exc:
                if ctx.should_stop():
                    raise exc.error from None
                result.timeouts += 1
                if not plan.stepping:
                    log.warning("probe hit the statement timeout (dead index entries?): stepping "
                                "through the range", extra=kv(state=target.state, timeout_ms=self._timeout_ms(ctx)))
                plan.step()
                continue
            except OperationalError as exc:
                self._recover(exc, ctx, plan, predicted, limit, target, result)
                continue
            seconds = time.monotonic() - started  # the batch's own time: the pause is idle
            self._grow()
            if n:
                result.batches += 1
                result.deleted[target.state] += n
            if last:
                return
            if n:
                self._pause(ctx, pause, result)
            plan.advance(hi, n, limit, seconds, predicted, next_id)

    @staticmethod
    def _pause(ctx: PassContext, seconds: float, result: CleanerResult) -> None:
        """``batch_pause``, counted as waited (a stop during it ends the pass at once)."""
        started = time.monotonic()
        try:
            ctx.pause(seconds)
        finally:
            result.waited_seconds += time.monotonic() - started

    def _delete_ancient(self, ctx: PassContext, target: Target, result: CleanerResult) -> None:
        """Rows finalized before ``FAR_PAST`` (odd but final, so expired): one index probe, in a
        read-only transaction, when there are none."""
        with ctx.transaction(fenced=False) as conn:
            if not conn.execute(ctx.sql(jobs.CLEANER_ANY_ANCIENT), {"state": target.state}).scalar():
                return
        position = {"from_at": "-infinity", "from_id": FIRST_ID}  # before every entry
        while True:
            ctx.check_stop()
            limit = self.batch_size
            try:
                with ctx.transaction(statement_timeout_ms=self._timeout_ms(ctx),
                                     settings=self._batch_settings(ctx)) as conn:
                    args = {**target.params(FAR_PAST), "far_past": FAR_PAST, "limit": limit, **position}
                    gone = conn.execute(ctx.sql(target.statement(jobs.CLEANER_DELETE_ANCIENT)), args)
                    n, first = gone.rowcount, gone.first()
                    if n < limit:  # the last: what it passed over is held by another session
                        self._report_locked(ctx, conn, target.statement(jobs.CLEANER_LEFT_ANCIENT), args, result)
            except OperationalError as exc:
                if ctx.moved_meanwhile(exc):  # redone smaller
                    self._shrink()
                    continue
                if getattr(exc.orig, "sqlstate", None) != QUERY_CANCELED or ctx.should_stop() or limit <= MIN_BATCH:
                    raise
                result.timeouts += 1  # redone smaller, as a range batch is
                self._shrink()
                log.warning("delete batch hit the statement timeout, shrinking the batch",
                            extra=kv(state=target.state, batch_size=self.batch_size))
                continue
            if first is not None:  # committed: the next batch starts at this one's last candidate
                position = {"from_at": first.next_at, "from_id": first.next_id}
            if n:
                result.batches += 1
                result.deleted[target.state] += n
                log.info("deleted jobs finalized before year 1", extra=kv(state=target.state, count=n))
            if n < limit:
                return

    def _delete_batch(self, ctx: PassContext, target: Target, plan: RangePlan,
                      limit: int, result: CleanerResult) -> tuple[datetime, bool, int, int | None]:
        """One fenced transaction: where the range ends (predicted or probed), then its DELETE.
        Returns (hi, whether the range reached the horizon, rows deleted, in a tie the id the next
        batch of the tie starts at: None past the largest)."""
        next_id = None
        with ctx.transaction(statement_timeout_ms=self._timeout_ms(ctx),
                             settings=self._batch_settings(ctx)) as conn:
            if plan.tie_from is not None and not plan.predicted:  # more of the tie at lo: no probe
                hi, last = plan.lo, False
            elif plan.predicted:
                hi = min(plan.lo + plan.width, plan.horizon)  # type: ignore[operator]
                last = hi >= plan.horizon
            else:
                probe = jobs.CLEANER_PROBE if target.queue is None else jobs.CLEANER_PROBE_QUEUE
                try:
                    probed = conn.execute(ctx.sql(probe), {"state": target.state, "queue": target.queue,
                                                           "lo": plan.lo, "horizon": plan.horizon,
                                                           "limit": limit}).scalar()
                except OperationalError as exc:
                    if getattr(exc.orig, "sqlstate", None) == QUERY_CANCELED:
                        raise _ProbeTimeout(exc) from exc
                    raise
                last = probed is None
                hi = plan.horizon if probed is None else probed
            args = {**target.params(plan.horizon), "lo": plan.lo, "hi": hi, "limit": limit,
                    "from_id": FIRST_ID if plan.tie_from is None else plan.tie_from}
            # A tie: the probe found more than a batch at ``lo`` itself. Not an empty last range
            # (``lo`` moved onto the horizon past a tie): the rows at the horizon are kept.
            tied = hi == plan.lo and not last
            if tied:
                stmt = jobs.CLEANER_DELETE_TIED
            else:
                stmt = jobs.CLEANER_DELETE_RANGE_SKIP_LOCKED if plan.skip_locked else jobs.CLEANER_DELETE_RANGE
            gone = conn.execute(ctx.sql(target.statement(stmt)), args)
            n = gone.rowcount
            if tied:
                largest = max((r.id for r in gone), default=None)
                next_id = largest + 1 if largest is not None and largest < 2 ** 63 - 1 else None
            if n > limit:
                raise _Overflow()
            # What SKIP LOCKED left is locked, once the batch is through its range: a tie batch
            # that deleted ``limit`` rows leaves the rest of the tie to the next one.
            if (tied and n < limit) or (plan.skip_locked and not tied):
                self._report_locked(ctx, conn, target.statement(jobs.CLEANER_LEFT_IN_RANGE),
                                    {**args, "hi": plan.lo + TINY if tied else hi}, result)
        return hi, last, n, next_id

    @staticmethod
    def _report_locked(ctx: PassContext, conn, stmt: str, args: dict, result: CleanerResult) -> None:
        """The expired rows a SKIP LOCKED delete left in its range (``stmt``, for the target's
        queues: a per-queue target's range holds other queues' rows, kept): held by another
        session. One line per batch, with the count and the first few ids (a session may hold
        thousands)."""
        ids = conn.execute(ctx.sql(stmt), args).scalars().all()
        if not ids:
            return
        log.warning("passed over expired jobs locked by another session (retried next pass)",
                    extra=kv(count=len(ids), job_ids=",".join(map(str, ids[:LOCKED_SHOWN])), state=args["state"]))
        result.skipped["locked"] = result.skipped.get("locked", 0) + len(ids)

    def _recover(self, exc: OperationalError, ctx: PassContext, plan: RangePlan, predicted: bool,
                 limit: int, target: Target, result: CleanerResult) -> None:
        """A batch failed: decide how to redo it (by SQLSTATE), or re-raise."""
        sqlstate = getattr(exc.orig, "sqlstate", None)
        if ctx.moved_meanwhile(exc):  # revived (retry_jobs) meanwhile: redo the batch, smaller
            self._shrink()
            if predicted:
                plan.narrow()
            return
        if sqlstate == LOCK_NOT_AVAILABLE and not plan.skip_locked:
            plan.skip_lock_holders()
            return
        if sqlstate != QUERY_CANCELED or ctx.should_stop():
            raise exc
        result.timeouts += 1
        if plan.stepping:  # too many entries (dead or alive) in the range: halve it
            if not plan.narrow():
                raise exc
            return
        if predicted:  # the prediction was too wide: probe, keep the batch size
            plan.width = None
            return
        if limit <= MIN_BATCH:
            raise exc
        self._shrink()
        log.warning("delete batch hit the statement timeout, shrinking the batch",
                    extra=kv(state=target.state, batch_size=self.batch_size))

    @staticmethod
    def _timeout_ms(ctx: PassContext) -> int:
        return ms(min(BATCH_TIMEOUT, ctx.statement_timeout))  # at least 1 ms: 0 is no timeout

    def _batch_settings(self, ctx: PassContext) -> dict[str, str]:
        """Per batch: a short lock wait (a locked row is skipped, not waited for until the
        timeout), and no wait for the WAL flush at commit (a deletion lost in a crash is done
        again by the next pass; any later synchronous commit, e.g. a worker's, flushes it)."""
        return {"lock_timeout": str(max(1, min(LOCK_WAIT_MS, self._timeout_ms(ctx) // 2))),
                "synchronous_commit": "off"}

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
                metrics[JOBS_DELETED].labels(state).inc(n)


class _Overflow(Exception):
    """A predicted batch held more than ``batch_size`` rows (its transaction is rolled back)."""


class _ProbeTimeout(Exception):
    """The probe of a batch hit the statement timeout (its transaction is rolled back)."""

    def __init__(self, error: OperationalError):
        super().__init__(str(error))
        self.error = error


def next_width(width: timedelta, rows: int, limit: int, seconds: float,
               target: float = BATCH_TARGET) -> timedelta:
    """The width of the next predicted range, from the last range: ``rows`` deleted (of at most
    ``limit``) in ``seconds``. Aims at ``FILL * limit`` rows and at most ``target`` seconds,
    growing at most ``GROWTH`` times."""
    factor = min(GROWTH, FILL * limit / max(rows, 1), target / max(seconds, 1e-6))
    return max(TINY, width * factor)
