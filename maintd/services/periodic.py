"""Periodic enqueuer: exactly one job per (periodic id, slot), whatever happens to the replicas.

The guard is durable: a row in ``periodic_slots`` (primary key ``(periodic_id, slot)``) inserted
in the same transaction as the job. It outlives the job (the cleaner may delete the job; the slot
stays taken), and two instances racing for a slot serialize on the primary key, so the loser
inserts nothing. Leadership only saves work; it is not what makes this exactly-once.

Per entry and pass, with ``hwm`` = the newest slot taken so far:

* never seen: no backfill. The current slot becomes the baseline (taken without a job) unless
  ``run_on_start``, which enqueues it.
* due slots ``hwm < s <= now``: with ``backfill``, each slot inside ``[now - backfill, now]`` is
  enqueued once, oldest first; older ones are skipped (``outside_backfill``). Without ``backfill``
  only the most recent due slot is enqueued (missed older runs are skipped, as cron does).
* disabled: nothing is enqueued; each new slot is counted as skipped (``disabled``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from apscheduler.triggers.interval import IntervalTrigger

from ..config import PeriodicJob
from ..logs import kv
from ..schedules import Schedule, parse_schedule
from .base import PassContext, PassResult, Service

log = logging.getLogger("maintd.periodic")

HIGH_WATER = """
SELECT periodic_id, max(slot) AS hwm FROM {schema}.periodic_slots
 WHERE periodic_id = ANY(CAST(:ids AS text[])) GROUP BY periodic_id
"""

TAKE_SLOT = """
INSERT INTO {schema}.periodic_slots (periodic_id, slot, backfilled, instance_id)
VALUES (:periodic_id, :slot, :backfilled, :instance)
ON CONFLICT (periodic_id, slot) DO NOTHING
RETURNING slot
"""

ENQUEUE = """
INSERT INTO {schema}.jobs (kind, queue, args, priority, max_attempts, scheduled_at, state,
                           unique_key, metadata)
VALUES (:kind, :queue, CAST(:args AS jsonb), :priority, :max_attempts, :slot,
        CASE WHEN CAST(:slot AS timestamptz) <= now() THEN 'available'
             ELSE 'scheduled' END::{schema}.job_state,
        :unique_key, CAST(:metadata AS jsonb))
ON CONFLICT (unique_key)
   WHERE unique_key IS NOT NULL AND state NOT IN ('completed', 'cancelled', 'discarded')
   DO NOTHING
RETURNING id
"""

LINK_JOB = """
UPDATE {schema}.periodic_slots SET job_id = :job_id WHERE periodic_id = :periodic_id AND slot = :slot
"""

# Old slot rows are only history; the newest per id (the high-water mark) always stays.
PRUNE = """
DELETE FROM {schema}.periodic_slots s
 WHERE s.slot < :before
   AND s.slot < (SELECT max(slot) FROM {schema}.periodic_slots m WHERE m.periodic_id = s.periodic_id)
"""
PRUNE_EVERY = timedelta(hours=1)
KEEP_HISTORY = timedelta(days=7)


@dataclass
class PeriodicResult(PassResult):
    enqueued: list[dict] = field(default_factory=list)
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)
    baselined: list[str] = field(default_factory=list)
    dry_run: bool = False

    def skip(self, periodic_id: str, reason: str, n: int = 1) -> None:
        if n:
            by_reason = self.skipped.setdefault(periodic_id, {})
            by_reason[reason] = by_reason.get(reason, 0) + n

    def did_something(self) -> bool:
        return bool(self.enqueued) or any(
            r != "disabled" for reasons in self.skipped.values() for r in reasons)

    def summary(self) -> str:
        verb = "would enqueue" if self.dry_run else "enqueued"
        ids = ",".join(sorted({e["periodic_id"] for e in self.enqueued})) or "-"
        skipped = sum(n for reasons in self.skipped.values() for n in reasons.values())
        return f"{verb} {len(self.enqueued)} jobs ids={ids} skipped={skipped}"


class PeriodicEnqueuer(Service):
    name = "periodic"

    def __init__(self, settings):
        super().__init__(settings)
        self._schedules: dict[str, Schedule] = {
            e.id: parse_schedule(e.schedule, e.timezone) for e in settings.periodic}
        self._disabled_seen: dict[str, datetime] = {}
        self._last_prune: datetime | None = None

    @property
    def config(self):
        return self.settings.periodic

    def enabled(self) -> bool:
        return bool(self.settings.periodic)

    def trigger(self) -> IntervalTrigger:
        return IntervalTrigger(seconds=1)

    def run_once(self, ctx: PassContext) -> PeriodicResult:
        now = ctx.now()
        result = PeriodicResult(dry_run=ctx.dry_run)
        entries: list[PeriodicJob] = list(self.settings.periodic)
        if not entries:
            return result
        with ctx.transaction(fenced=False) as conn:
            hwms = {r.periodic_id: r.hwm for r in conn.execute(
                ctx.sql(HIGH_WATER), {"ids": [e.id for e in entries]})}
        for entry in entries:
            ctx.check_stop()
            schedule = self._schedules[entry.id]
            latest = schedule.latest_at_or_before(now)
            if not entry.enabled:
                if self._disabled_seen.get(entry.id) != latest:
                    if entry.id in self._disabled_seen:
                        result.skip(entry.id, "disabled")
                    self._disabled_seen[entry.id] = latest
                continue
            self._disabled_seen.pop(entry.id, None)
            hwm = hwms.get(entry.id)
            if hwm is None:
                if entry.run_on_start:
                    self._enqueue(ctx, entry, latest, False, result)
                else:
                    self._baseline(ctx, entry, latest, result)
                continue
            due = list(schedule.slots_between(hwm, now)) if hwm < latest else []
            if not due:
                continue
            if entry.backfill is not None:
                window_start = now - entry.backfill
                keep = [s for s in due if s >= window_start]
            else:
                keep = due[-1:]
            result.skip(entry.id, "outside_backfill", len(due) - len(keep))
            for slot in keep:
                self._enqueue(ctx, entry, slot, slot != latest, result)
        if not ctx.dry_run:
            self._prune(ctx, now)
        return result

    def _baseline(self, ctx: PassContext, entry: PeriodicJob, slot: datetime, result: PeriodicResult) -> None:
        with ctx.transaction() as conn:
            conn.execute(ctx.sql(TAKE_SLOT), {"periodic_id": entry.id, "slot": slot,
                                              "backfilled": False, "instance": ctx.instance_id})
        result.baselined.append(entry.id)

    def _enqueue(self, ctx: PassContext, entry: PeriodicJob, slot: datetime, backfilled: bool,
                 result: PeriodicResult) -> None:
        with ctx.transaction() as conn:
            taken = conn.execute(ctx.sql(TAKE_SLOT), {"periodic_id": entry.id, "slot": slot,
                                                      "backfilled": backfilled,
                                                      "instance": ctx.instance_id}).first()
            if taken is None:
                result.skip(entry.id, "duplicate")
                return
            metadata = {"periodic_id": entry.id, "slot": slot.isoformat(), "backfilled": backfilled}
            job = conn.execute(ctx.sql(ENQUEUE), {
                "kind": entry.kind, "queue": entry.queue, "args": json.dumps(entry.args),
                "priority": entry.priority, "max_attempts": entry.max_attempts, "slot": slot,
                "unique_key": entry.effective_unique_key, "metadata": json.dumps(metadata),
            }).first()
            if job is None:  # a live job still holds the entry's unique_key; the slot stays taken
                result.skip(entry.id, "duplicate")
                return
            conn.execute(ctx.sql(LINK_JOB), {"job_id": job.id, "periodic_id": entry.id, "slot": slot})
        result.enqueued.append({"periodic_id": entry.id, "slot": slot.isoformat(),
                                "job_id": None if ctx.dry_run else job.id, "backfilled": backfilled})
        if not ctx.dry_run:
            log.info("enqueued periodic job", extra=kv(periodic_id=entry.id, slot=slot.isoformat(),
                                                       job_id=job.id, backfilled=backfilled))

    def _prune(self, ctx: PassContext, now: datetime) -> None:
        if self._last_prune is not None and now - self._last_prune < PRUNE_EVERY:
            return
        self._last_prune = now
        longest = max((e.backfill for e in self.settings.periodic if e.backfill), default=timedelta(0))
        with ctx.transaction() as conn:
            conn.execute(ctx.sql(PRUNE), {"before": now - max(KEEP_HISTORY, longest * 2)})

    def observe(self, metrics, result: PeriodicResult) -> None:
        for e in result.enqueued:
            metrics.periodic_enqueued.labels(e["periodic_id"]).inc()
        for pid, reasons in result.skipped.items():
            for reason, n in reasons.items():
                metrics.periodic_skipped.labels(pid, reason).inc(n)
