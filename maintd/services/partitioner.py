"""Partitioner (the partitioned layout only, SPEC 8.1): keeps each final state's partitions made
``[partitions] premake`` steps ahead, handles the rows that landed in a catch-all, and drops the
partitions whose whole range is past the state's retention (the longest per-queue one; the
cleaner's batched DELETE takes care of queues with a shorter one).

Its own service rather than a part of the cleaner: partitions must be made ahead whether or not
the cleaner runs (with the cleaner disabled nothing is dropped, but completions still need a
partition), its work is DDL with a lock discipline of its own, and its cadence follows the
partition step. Retention comes from the ``[cleaner]`` section.

A pass reads the layout and the catch-alls (one read-only statement); only a state that needs
something calls ``maintain_partitions`` (maintd/partitions.py), after proving leadership, in a
fenced transaction. Its locks are taken with ``NOWAIT``: when another session holds one (55P03),
the call is tried again a moment later, so no worker waits behind it. Under a steady stream of
completions ``jobs_<state>`` may never be free at an instant: the last of ``TRIES`` calls waits
for it in the lock queue, at most ``LAST_TRY_WAIT_MS`` (the completions in flight end within
milliseconds; those arriving meanwhile wait behind it); after that the state is left to the next
pass (``busy``). Detached tables are dropped in a fenced
transaction of their own. Rows dropped count as deleted (``maintd_jobs_deleted_total``),
counted up to ``EXACT_UP_TO``, past that estimated (``estimated``): the rows the cleaner deleted
since the last analyze are not counted again. A call
that emptied partitions returns at once: its commit unlinks their old files while it holds no
lock on ``jobs_<state>``, and the next call detaches them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Annotated, Any

from prometheus_client import Gauge
from pydantic import BeforeValidator, Field, model_validator
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from ..durations import format_duration, parse_duration
from ..faults import LOCK_NOT_AVAILABLE
from ..logs import kv
from ..metrics import Family
from ..partitions import DETACHED_COMMENT, EXACT_UP_TO, MAKE_CAP
from ..queries import FINAL_STATES, catalog
from ..queries import partitions as q
from ..sections import DURATION_JSON, Section
from .base import PassContext, PassResult, Service
from .cleaner import JOBS_DELETED, CleanerConfig


MOST_AHEAD = timedelta(days=365 * 1000)  # how far ahead partitions may be made


def _partition_step(v: object) -> timedelta:
    td = parse_duration(v)
    if td < timedelta(minutes=1):
        raise ValueError("must be at least 1m (one partition per state and step)")
    if td.microseconds:
        raise ValueError("must be a whole number of seconds")
    return td


class PartitionsConfig(Section):
    """``[partitions]``: the partitioned layout (SPEC 8.1). ``interval`` is the time range of one
    final-state partition; ``premake`` how many of them the leader keeps made ahead."""

    interval: Annotated[timedelta, BeforeValidator(_partition_step), DURATION_JSON] = timedelta(hours=1)
    premake: int = Field(default=24, ge=1, le=1000)

    @model_validator(mode="after")
    def _ahead(self) -> "PartitionsConfig":
        if self.premake * self.interval > MOST_AHEAD:  # past year 9999: no timestamp holds it
            raise ValueError(f"premake: {self.premake} partitions of {format_duration(self.interval)} reach more "
                             f"than {MOST_AHEAD.days // 365} years ahead: lower premake or interval")
        return self


log = logging.getLogger("maintd.partitioner")

STRAY_ROWS = Family(Gauge, "maintd_partition_stray_rows", "Jobs in the partitioned layout's catch-all partitions "
                    "(SPEC 8.1), read by the partitioner's last pass.", known=((),))

TRIES = 10  # calls of maintain_partitions per state and pass while its locks are held by others
RETRY_PAUSE = 0.02  # seconds between them
# The last try waits in the lock queue for jobs_<state>, at most this long: under a steady stream
# of completions (each holds a lock on it until its commit) there may be no instant it is free.
LAST_TRY_WAIT_MS = 50
MANY_PARTITIONS = 1000  # of one final state: more is worth a warning (PartitionerConfig.advice)


@dataclass(frozen=True)
class PartitionerConfig:
    """The service's section: the layout and ``[partitions]``, with the cleaner's retentions."""

    layout: str
    partitions: PartitionsConfig
    cleaner: CleanerConfig

    @classmethod
    def of(cls, settings: Any) -> "PartitionerConfig":
        return cls(settings.layout, settings.partitions, settings.cleaner)

    @property
    def enabled(self) -> bool:
        return self.layout == "partitioned"

    @property
    def interval(self) -> timedelta:
        return min(timedelta(seconds=30), self.partitions.interval / 4)

    def drop_after(self, state: str) -> timedelta | None:
        """How long after its range ends a partition of ``state`` is dropped: the longest
        retention of the state, default or per queue; None: never (kept forever, or no cleaner)."""
        return self.cleaner.longest_retention(state) if self.cleaner.enabled else None

    def advice(self) -> list[str]:
        """What this config will cost in partitions, when it is a lot: a statement on ``jobs``
        that names neither state nor ``finalized_at`` (a job by id) is planned over all of them."""
        if not self.enabled:
            return []
        step, out = self.partitions.interval, []
        for state in FINAL_STATES:
            keep = self.drop_after(state)
            if keep is None:
                out.append(f"{state} jobs are kept forever: one more partition every {format_duration(step)}, without end")
            elif (count := -(-keep // step) + self.partitions.premake + 1) > MANY_PARTITIONS:
                out.append(f"{state} jobs keep about {count} partitions ({format_duration(keep)} of retention "
                           f"in steps of {format_duration(step)}): raise partitions.interval")
        return out


@dataclass
class PartitionerResult(PassResult):
    layout: str = "partitioned"
    made: int = 0  # partitions made ahead
    closed: int = 0  # high catch-alls closed into a partition of their range (rows beyond it moved)
    moved: int = 0  # rows moved out of a catch-all
    emptied: int = 0  # partitions past retention emptied (TRUNCATE: their rows gone)
    detached: int = 0  # emptied partitions detached (dropped next)
    dropped: int = 0  # detached tables dropped
    deleted: dict[str, int] = field(default_factory=lambda: {s: 0 for s in FINAL_STATES})
    estimated: bool = False  # some of ``deleted`` is an estimate (a partition past EXACT_UP_TO rows)
    busy: list[str] = field(default_factory=list)  # states left to the next pass (locks held)
    partitions: int = 0  # proper partitions, all final states
    stray_rows: int = 0  # rows in the catch-alls
    waited_seconds: float = 0.0
    dry_run: bool = False

    def did_something(self) -> bool:
        return bool(self.made or self.closed or self.moved or self.emptied or self.detached or self.dropped
                    or self.busy)

    def waited(self) -> float:
        return self.waited_seconds

    def summary(self) -> str:
        verb = "would " if self.dry_run else ""
        deleted = " ".join(f"{s}={n}" for s, n in self.deleted.items())
        return (f"{verb}made={self.made} closed={self.closed} moved={self.moved} emptied={self.emptied} "
                f"detached={self.detached} "
                f"dropped={self.dropped} deleted {deleted}{' (estimated)' if self.estimated else ''} "
                f"partitions={self.partitions} stray_rows={self.stray_rows}"
                + (f" busy={','.join(self.busy)}" if self.busy else ""))


class Partitioner(Service):

    METRICS = (JOBS_DELETED, STRAY_ROWS)
    config: PartitionerConfig

    def __init__(self, config: PartitionerConfig):
        super().__init__(config)
        self._warned_plain = False

    def run_once(self, ctx: PassContext) -> PartitionerResult:
        result = ctx.begin(PartitionerResult(dry_run=ctx.dry_run))
        with ctx.read() as conn:
            if not conn.execute(text(catalog.JOBS_PARTITIONED), {"schema": ctx.schema}).scalar():
                return self._plain(result)
            states = {r.state: r for r in conn.execute(ctx.sql(q.LAYOUT))}
            detached = conn.execute(text(q.DETACHED), {"schema": ctx.schema, "marker": DETACHED_COMMENT}).scalar()
        now = ctx.now(fresh=True)  # what is dropped: never past the server's clock
        make_until = now + self.config.partitions.premake * self.config.partitions.interval
        for state in FINAL_STATES:
            row = states[state]
            drop_after = self.config.drop_after(state)
            drop_before = None if drop_after is None else now - drop_after
            if row.high_start < make_until or self._expired(row, drop_before):
                self._maintain(ctx, state, make_until, drop_before, result, urgent=row.high_start < make_until)
        if detached or result.detached:
            self._drop_detached(ctx, result, pending=detached)
        if result.did_something() and not ctx.dry_run:  # what the pass left, not what it found
            with ctx.read() as conn:
                states = {r.state: r for r in conn.execute(ctx.sql(q.LAYOUT))}
        result.partitions = sum(states[s].partitions for s in FINAL_STATES)
        result.stray_rows = sum(states[s].low_rows + states[s].high_rows for s in FINAL_STATES)
        return result

    def _expired(self, row: Any, drop_before: datetime | None) -> bool:
        """Whether a state has something past retention: its first proper partition (from where
        the low catch-all ends; as wide as it was made, whatever the step is now), or rows in the
        low catch-all, whose whole range is."""
        if drop_before is None or row.low_end > drop_before:
            return False
        return row.low_rows > 0 or (row.first_end is not None and row.first_end <= drop_before)

    def _plain(self, result: PartitionerResult) -> PartitionerResult:
        result.layout = "plain"
        if self.config.layout != "partitioned":  # `run-once partitioner` on a plain config
            log.info('the jobs table is plain (layout = "plain"): the partitioner has nothing to do')
        elif not self._warned_plain:
            self._warned_plain = True
            log.warning('layout = "partitioned" but the jobs table is plain: run '
                        "`maintd migrate --convert partitioned`; nothing to do until then")
        return result

    def _maintain(self, ctx: PassContext, state: str, make_until: datetime, drop_before: datetime | None,
                  result: PartitionerResult, *, urgent: bool = True) -> None:
        """One state's call of maintain_partitions, tried again while another session holds a
        lock it needs, when partitions must be made (``urgent``); otherwise (only emptied tables
        to detach: the rows are gone after the first call) once a pass."""
        if ctx.dry_run:
            return self._plan(ctx, state, make_until, drop_before, result)
        ctx.prove_leader()  # no DDL (and no lock) from an instance that no longer leads
        args = {"state": state, "step": self.config.partitions.interval.total_seconds(),
                "make_until": make_until, "drop_before": drop_before}
        for attempt in range(TRIES if urgent else 1):
            if attempt:
                ctx.pause(RETRY_PAUSE)
                result.waited_seconds += RETRY_PAUSE
            wait = LAST_TRY_WAIT_MS if attempt == TRIES - 1 else 0
            try:
                for _ in range(2):  # a call that emptied partitions returns: committed, it is called again
                    with ctx.transaction() as conn:
                        rows = conn.execute(ctx.sql(q.MAINTAIN), {**args, "lock_wait_ms": wait}).all()
                    self._count(state, rows, result)  # what was emptied stands, busy or not
                    if not any(r.action == "emptied" for r in rows):
                        break
            except OperationalError as exc:
                if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                    raise
                continue
            if not any(r.action in ("busy", "emptied") for r in rows):
                return
        result.busy.append(state)
        log.info("partitions of a state left to the next pass: its locks were held each try",
                 extra=kv(state=state, tries=TRIES if urgent else 1))

    @staticmethod
    def _count(state: str, rows: list[Any], result: PartitionerResult) -> None:
        for r in rows:
            if r.action == "made":
                result.made += 1
            elif r.action == "closed":
                result.closed += 1
            elif r.action == "moved":
                result.moved += r.row_count
            elif r.action == "emptied":  # its rows are gone (counted here; detached after, empty)
                result.emptied += 1
                result.deleted[state] += r.row_count
                result.estimated = result.estimated or r.estimated
            elif r.action == "detached":
                result.detached += 1
            if r.action not in ("made", "busy"):
                rows = None if r.action == "detached" else f"~{r.row_count}" if r.estimated else r.row_count
                log.info(f"partition {r.action}", extra=kv(state=state, partition=r.partition_name,
                                                             start=r.range_start, end=r.range_end, rows=rows))

    def _plan(self, ctx: PassContext, state: str, make_until: datetime, drop_before: datetime | None,
              result: PartitionerResult) -> None:
        """Dry run: what a pass would empty, detach (its rows counted as the pass counts them), close,
        move and make."""
        with ctx.read() as conn:
            row = next(r for r in conn.execute(ctx.sql(q.LAYOUT)) if r.state == state)
            if drop_before is not None:
                expired = conn.execute(ctx.sql(q.EXPIRED), {"state": state, "before": drop_before,
                                                             "schema_name": ctx.schema, "cap": EXACT_UP_TO}).all()
                # As maintain_partitions: it empties those with rows, and detaches them all (the low
                # catch-all among them) once a proper partition is past; alone, that one stays.
                result.detached += len(expired) if any(r.proper for r in expired) else 0
                for r in expired:
                    result.emptied += r.nonempty
                    result.deleted[state] += r.rows
                    result.estimated = result.estimated or r.estimated  # past the cap: not empty
            self._plan_make(conn, ctx, state, row.high_start, make_until, result)

    def _plan_make(self, conn: Any, ctx: PassContext, state: str, start: datetime, make_until: datetime,
                   result: PartitionerResult) -> None:
        """Dry run: as make_partitions, the high catch-all closed after its latest row before the
        step at or after ``make_until`` (its rows beyond moved), then at most MAKE_CAP steps made."""
        if start >= make_until:
            return
        step = self.config.partitions.interval
        target = start - ((start - make_until) // step) * step  # the step boundary at or after make_until
        latest = conn.execute(ctx.sql(q.HIGH_LATEST), {"state": state, "start": start, "target": target}).scalar()
        x = start if latest is None else start + ((latest - start) // step + 1) * step
        if x > start:
            result.closed += 1
            result.moved += conn.execute(ctx.sql(q.HIGH_BEYOND), {"state": state, "beyond": x}).scalar()
        result.made += (min(target, x + MAKE_CAP * step) - x) // step

    def _drop_detached(self, ctx: PassContext, result: PartitionerResult, pending: int) -> None:
        """The detached tables dropped: those left by an earlier pass (``pending``) and this one's
        (a dry run counts them as dropped, as the pass would)."""
        if ctx.dry_run:
            result.dropped += pending + result.detached
            return
        ctx.prove_leader()
        with ctx.transaction() as conn:
            result.dropped += len(conn.execute(ctx.sql(q.DROP_DETACHED)).all())

    def observe(self, metrics: Any, result: PassResult) -> None:
        assert isinstance(result, PartitionerResult)
        for state, n in result.deleted.items():
            if n:
                metrics[JOBS_DELETED].labels(state).inc(n)
        metrics[STRAY_ROWS].set(result.stray_rows)
