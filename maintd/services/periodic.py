"""Periodic enqueuer: exactly one job per (periodic id, slot), whatever happens to the replicas.

The guard is durable: a row in ``periodic_slots`` (primary key ``(periodic_id, slot)``) inserted
in the same transaction as the job. It outlives the job (the cleaner may delete the job; the slot
stays taken), and two instances racing for a slot serialize on the primary key, so the loser
inserts nothing. Leadership only saves work; it is not what makes this exactly-once.

Per entry and pass, with ``hwm`` = the newest slot taken so far:

* never seen: no backfill. The current slot becomes the baseline (taken without a job) unless
  ``run_on_start``, which enqueues it.
* due slots ``hwm < s <= now``: with ``backfill``, each slot inside ``[now - backfill, now]`` is
  enqueued once, oldest first; older ones are skipped (``outside_backfill``). Without ``backfill``,
  or when the window holds none of them (a pass later than the window is long), only the most
  recent due slot is enqueued (missed older runs are skipped, as cron does): a window only adds runs.
  A pass enqueues at most ``SLOTS_PER_PASS`` slots of an entry; the next pass, at the next tick,
  goes on from the newest one taken.
* disabled: nothing is enqueued; each new slot is taken without a job and counted as skipped
  (``disabled``), so an entry enabled again does not backfill the slots it was disabled for; the
  newest is marked paused (``taken_paused``), so a row enabled again while no leader ran counts
  its missed slots from that change, and a config or crontab entry (its change time unknown)
  runs from its next slot.

Entries come from ``[[periodic]]`` (and the crontab) and from the rows of ``periodic_jobs``
(:mod:`maintd.services.periodic_rows`), read again whenever they change. A row that changed after
its newest slot starts afresh from its next slot; a row never seen counts its missed slots from
when it was last changed (so ``backfill`` covers a row added while no leader ran). A row that takes
over the id of a config or crontab entry gone (the row refused until then) does so at a time
unknown: its first pass is that of a config entry changed (the id's slots before are the entry's).
So is a row's change of schedule or resume that a transaction begun before the row's newest slot
was taken committed after: ``updated_at`` is the transaction's start, the change in force later.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from itertools import islice
from typing import Any

from apscheduler.triggers.interval import IntervalTrigger
from prometheus_client import Counter
from sqlalchemy.exc import DBAPIError

from ..crontab import cron_args
from ..db import describe_db_error
from ..logs import clip, kv
from ..metrics import OTHER, RESULT_KEYS, Family, label_value
from ..queries import jobs, periodic_slots
from ..schedules import Schedule, common_slots, count_common, latest_common, parse_schedule
from .base import NotLeader, PassContext, PassResult, PassStopped, Service
from .periodic_config import PeriodicJob
from .periodic_rows import Entry, RowSource

log = logging.getLogger("maintd.periodic")

PRUNE_EVERY = timedelta(hours=1)
PRUNE_RETRY = timedelta(minutes=1)  # after a prune that failed
PRUNE_BATCH = 10_000  # slot rows a prune statement deletes at most
# Between idle passes, the rows of periodic_jobs are read again this often: a safety net only, as
# their trigger's NOTIFY, passed on by the lock session, makes the next pass read them at once, and
# the session pokes every target when it reconnects (NOTIFYs sent meanwhile were not delivered).
ROWS_EVERY = timedelta(minutes=10)
_TINY = timedelta(microseconds=1)
KEEP_HISTORY = timedelta(days=7)
# Slots of a changed schedule walked at most to find the latest both schedules have, or to count
# exactly those before the backfill window (see PeriodicEnqueuer._due_both).
CHANGED_WALK = 5_000
# Slots of one entry a pass enqueues at most (oldest first); the pass after it, at the next tick,
# goes on from there. A row first seen long after its creation, with a long backfill, listed and
# enqueued its whole window in one pass (a year of '@every 1s': 31 million slots) while the
# entries after it waited.
SLOTS_PER_PASS = 1_000
ENQUEUED = Family(Counter, "maintd_periodic_enqueued", "Periodic jobs enqueued.", ("periodic_id",))
SKIP_REASONS = ("duplicate", "replaced", "disabled", "outside_backfill", "error")
SKIPPED = Family(Counter, "maintd_periodic_skipped", f"Periodic slots not enqueued (reason: {', '.join(SKIP_REASONS)}).",
                 ("periodic_id", "reason"))


def taken_under(job: PeriodicJob) -> str:
    """What a slot is taken under (``periodic_slots.schedule``): the entry's schedule and zone."""
    return f"{job.schedule} ({job.timezone})"


PAUSED = " paused"


def taken_paused(job: PeriodicJob) -> str:
    """What the newest slot of a disabled entry is taken under: a row enabled again counts its
    missed slots from its change, not from that slot (those between were its pause's)."""
    return taken_under(job) + PAUSED


@dataclass
class PeriodicResult(PassResult):
    enqueued: list[dict] = field(default_factory=list)
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)
    baselined: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # periodic id -> why its turn failed
    invalid_rows: dict[str, str] = field(default_factory=dict)  # row id -> why it is not used
    behind: list[str] = field(default_factory=list)  # ids with more due slots than a pass enqueues
    dry_run: bool = False

    def fail(self, periodic_id: str, error: str) -> None:
        self.errors[periodic_id] = error

    def failed(self) -> bool:
        return bool(self.errors)

    def skip(self, periodic_id: str, reason: str, n: int = 1) -> None:
        if n:
            by_reason = self.skipped.setdefault(periodic_id, {})
            by_reason[reason] = by_reason.get(reason, 0) + n

    def skipped_rows(self) -> dict[str, int]:
        """Rows of ``periodic_jobs`` found unusable, counted once when their ``error`` is set
        (logged then, by id)."""
        return {"invalid_row": len(self.invalid_rows)}

    def did_something(self) -> bool:
        return bool(self.enqueued) or bool(self.errors) or any(
            r != "disabled" for reasons in self.skipped.values() for r in reasons)

    def as_dict(self) -> dict[str, Any]:
        """As recorded (``service_runs``, ``/status``), bounded however many rows there are (a
        schedule per customer): the per-id lists and maps keep ``RESULT_KEYS`` ids, the jobs
        enqueued are counted in ``enqueued_count``, and the skips of the other ids are summed by
        reason under ``_other`` (beside which an id is keyed as its label: ``_other`` is ``\\_other``)."""
        d = super().as_dict()
        d["enqueued_count"], d["enqueued"] = len(d["enqueued"]), d["enqueued"][:RESULT_KEYS]
        ids = sorted(d["skipped"])
        if len(ids) > RESULT_KEYS:
            other: dict[str, int] = {}
            for reasons in (d["skipped"][i] for i in ids[RESULT_KEYS:]):
                for reason, n in reasons.items():
                    other[reason] = other.get(reason, 0) + n
            d["skipped"] = {**{label_value(i): d["skipped"][i] for i in ids[:RESULT_KEYS]}, OTHER: other}
        for key in ("errors", "invalid_rows"):
            if len(d[key]) > RESULT_KEYS:
                kept = sorted(d[key])[:RESULT_KEYS]
                d[key] = {**{label_value(i): d[key][i] for i in kept}, OTHER: f"{len(d[key]) - RESULT_KEYS} more"}
        d["baselined"], d["behind"] = d["baselined"][:RESULT_KEYS], d["behind"][:RESULT_KEYS]
        return d

    def summary(self) -> str:
        verb = "would enqueue" if self.dry_run else "enqueued"
        ids = clip(sorted({e["periodic_id"] for e in self.enqueued})) or "-"
        skipped = sum(n for reasons in self.skipped.values() for n in reasons.values())
        return f"{verb} {len(self.enqueued)} jobs ids={ids} skipped={skipped}"


class PeriodicEnqueuer(Service):
    """Built from the list of configured periodic entries; rows of ``periodic_jobs`` join them
    at run time, so the service always runs (an idle pass is one read of the rows' version)."""

    METRICS = (ENQUEUED, SKIPPED)

    config: list[PeriodicJob]

    def __init__(self, config: list[PeriodicJob]):
        super().__init__(list(config))
        self._configured = [Entry(e, "crontab" if e.cron_args else "config") for e in self.config]
        self._rows = RowSource()
        self._schedules: dict[tuple[str, str], Schedule] = {}
        self._disabled_seen: dict[str, datetime] = {}
        self._last_prune: datetime | None = None
        self._quiet_until: datetime | None = None
        self._ids: set[str] = set()  # the ids of the last pass's entries and rows
        self._labelled: set[str] = set()  # the ids this service's metric series carry

    def enabled(self) -> bool:
        return True

    def schedule(self, job: PeriodicJob) -> Schedule:
        return self._parse(job.schedule, job.timezone)

    def _parse(self, expression: str, zone: str) -> Schedule:
        key = (expression, zone)
        if key not in self._schedules:
            self._schedules[key] = parse_schedule(expression, zone)
        return self._schedules[key]

    def _taken_under(self, under: str) -> Schedule | None:
        """The schedule a slot was taken under (see :func:`taken_under`); None if it no longer parses."""
        expression, _, zone = under.removesuffix(PAUSED).rpartition(" (")
        try:
            return self._parse(expression, zone.removesuffix(")"))
        except ValueError:
            return None

    def entries(self, ctx: PassContext, result: PeriodicResult) -> list[Entry]:
        """The configured entries, then the usable rows (their ``error`` kept up to date)."""
        rows, notes = self._rows.entries(ctx, {e.job.id for e in self._configured})
        unwritten = self._rows.note(ctx, notes)
        for row_id, problem in notes.items():
            if problem is not None and row_id not in unwritten:  # counted once, when noted
                result.invalid_rows[row_id] = problem
                log.warning("periodic_jobs row not used", extra=kv(periodic_id=row_id, error=problem))
        return self._configured + rows

    def trigger(self) -> IntervalTrigger:
        return IntervalTrigger(seconds=1)

    def quiet_until(self) -> datetime | None:
        """After a pass that went well, the daemon skips the ticks before the next slot of any
        entry, and before ``ROWS_EVERY``, unless a row changed (:meth:`poke`). A missed NOTIFY
        only delays a change: a new row is baselined or backfilled from its change."""
        return self._quiet_until

    def poke(self) -> bool:
        self._quiet_until = None
        return True

    def _quiet_after(self, now: datetime, entries: list[Entry], result: PeriodicResult) -> None:
        if result.failed() or result.invalid_rows or result.dry_run or self._rows.unwritten or result.behind:
            self._quiet_until = None
            return
        upcoming = [self.schedule(e.job).next_after(now) for e in entries]
        self._quiet_until = min([now + ROWS_EVERY, *upcoming])

    def succeed(self, old: Service) -> None:
        """The ids of the entries the replaced service ran: those the reload removed are marked,
        and the metric series it made for them go."""
        self._ids = set(getattr(old, "_ids", ()))
        self._labelled = set(getattr(old, "_labelled", ()))

    def run_once(self, ctx: PassContext) -> PeriodicResult:
        now = ctx.now()
        result = ctx.begin(PeriodicResult(dry_run=ctx.dry_run))
        entries = self.entries(ctx, result)
        ids = {e.job.id for e in entries} | set(result.invalid_rows)
        self._ids = ids | self._mark_removed(ctx, self._ids - ids)
        self._forget(entries)
        try:
            self._run_entries(ctx, entries, now, result)
        except BaseException:
            self._quiet_until = None
            raise
        self._quiet_after(now, entries, result)
        return result

    def _forget(self, entries: list[Entry]) -> None:
        """What is kept per entry goes with it: an application that makes and deletes rows (a
        schedule per customer) must not grow the leader's memory. (A schedule a slot was taken
        under is parsed again when needed.)"""
        ids, live = {e.job.id for e in entries}, {(e.job.schedule, e.job.timezone) for e in entries}
        if self._disabled_seen.keys() - ids:
            self._disabled_seen = {k: v for k, v in self._disabled_seen.items() if k in ids}
        if len(self._schedules) > 2 * len(live) + 16:
            self._schedules = {k: v for k, v in self._schedules.items() if k in live}

    def _mark_removed(self, ctx: PassContext, gone: set[str]) -> set[str]:
        """Entries gone since the last pass (see ``periodic_slots.MARK_REMOVED``): added again,
        they do not count the slots of their absence as missed. Not in a dry run. Returns the ids
        still to mark: a failure is tried again next pass, and never keeps the entries from running."""
        if not gone or ctx.dry_run:
            return set()
        try:
            with ctx.transaction() as conn:
                conn.execute(ctx.sql(periodic_slots.MARK_REMOVED), {"ids": sorted(gone)})
        except DBAPIError as exc:
            log.warning("could not mark removed periodic entries; trying again next pass",
                        extra=kv(periodic_ids=sorted(gone), error=describe_db_error(exc)))
            return gone
        return set()

    def _run_entries(self, ctx: PassContext, entries: list[Entry], now: datetime,
                     result: PeriodicResult) -> None:
        if entries:
            self._take_slots(ctx, entries, now, result)
        if not ctx.dry_run:  # also with no entry left: the history of those that were
            self._prune(ctx, now)

    def _take_slots(self, ctx: PassContext, entries: list[Entry], now: datetime,
                    result: PeriodicResult) -> None:
        with ctx.transaction(fenced=False) as conn:
            hwms = {r.periodic_id: (r.hwm, r.taken_under) for r in conn.execute(
                ctx.sql(periodic_slots.HIGH_WATER), {"ids": [e.job.id for e in entries]})}
        with ctx.rehearsal():  # a dry run's slots see what its earlier ones would have done
            for entry in entries:
                ctx.check_stop()
                try:
                    self._run_entry(ctx, entry, hwms.get(entry.job.id), now, result)
                except (NotLeader, PassStopped):
                    raise
                except Exception as exc:  # one broken entry never starves the others
                    if ctx.should_stop():  # its statement cancelled by a stop (a reload, a demotion)
                        raise PassStopped() from exc
                    result.fail(entry.job.id, describe_db_error(exc))
                    result.skip(entry.job.id, "error")
                    log.error("periodic entry failed", extra=kv(periodic_id=entry.job.id,
                                                                error=describe_db_error(exc)))

    def _run_entry(self, ctx: PassContext, entry: Entry, newest: tuple[datetime, str | None] | None,
                   now: datetime, result: PeriodicResult) -> None:
        """``newest``: the entry's newest slot taken, and the schedule it was taken under."""
        job, schedule = entry.job, self.schedule(entry.job)
        latest = schedule.latest_at_or_before(now)
        if not job.enabled:
            previous = self._disabled_seen.get(job.id)
            if previous != latest:
                self._skip_disabled(ctx, job, latest, previous, result)
                self._disabled_seen[job.id] = latest  # once taken (a failed take is tried again)
            return
        self._disabled_seen.pop(job.id, None)
        if entry.took_over:  # a row using a config entry's id since a time unknown: as that entry changed
            entry = Entry(job, entry.origin)
        hwm, under = newest or (None, None)
        # Its newest slot was taken while it was disabled (under this schedule or another).
        paused = under is not None and under.endswith(PAUSED)
        changed = hwm is not None and under is not None and under != taken_under(job) and not paused
        if entry.since is not None and (changed or paused) and entry.since <= hwm:
            # A row's change committed after its newest slot was taken under the row as it was, by a
            # transaction begun before (``updated_at`` is a transaction's start): in force since a time unknown.
            entry = Entry(job, entry.origin)
        if paused and entry.since is None:  # a config or crontab entry, enabled again at a time unknown
            self._resumed(ctx, job, hwm, latest, result)
            return
        if changed and entry.since is None:  # a config or crontab entry, changed at a time unknown
            self._changed(ctx, job, hwm, under, latest, now, result)
            return
        if hwm is None and job.run_on_start and (entry.since is None or job.backfill is None or entry.since >= latest):
            self._enqueue(ctx, job, latest, False, result)  # a new row with backfill: from its creation, below
            return
        if hwm is None and entry.since is None:
            self._baseline(ctx, job, latest, result)
            return
        if entry.since is not None and (hwm is None or (changed or paused or under is None) and entry.since > hwm):
            hwm = entry.since  # a new row, or one whose schedule changed or that was enabled again: from the change
        elif entry.created is not None and entry.created > hwm:
            hwm = entry.created  # a row added again (its id's slots are the removed one's): from its creation
        if entry.resumed is not None and entry.resumed > hwm:
            hwm = entry.resumed  # paused after its newest slot (no leader took its pause's): from the resume
        self._run_due(ctx, job, hwm, latest, now, result)

    def _run_due(self, ctx: PassContext, job: PeriodicJob, after: datetime, latest: datetime, now: datetime,
                 result: PeriodicResult, had: Schedule | None = None, stamp: str | None = None) -> list[datetime]:
        """Enqueue the slots missed since ``after`` (with ``had``, those it has too, taken under
        ``stamp``): within ``backfill``, or (none) the latest only; the others are counted.
        Returns those enqueued."""
        keep, outside = self._due(job, after, latest, now, had) if after < latest else ([], 0)
        result.skip(job.id, "outside_backfill", outside)
        if len(keep) >= SLOTS_PER_PASS:  # (the rest, if any, in the next pass)
            result.behind.append(job.id)
        for slot in keep:
            self._enqueue(ctx, job, slot, slot != latest, result, stamp)
        return keep

    def _due(self, job: PeriodicJob, after: datetime, latest: datetime, now: datetime,
             had: Schedule | None) -> tuple[list[datetime], int]:
        """(the slots to enqueue, how many others): only the slots enqueued are kept, and for a
        schedule unchanged, only they are computed (a list of every slot since ``after`` was 31
        million datetimes for an '@every 1s' entry back after a year)."""
        schedule = self.schedule(job)
        # s > edge: inside the window (a window past year 1, a row's 1,000,000 days: from ``after``)
        edge = after if job.backfill is None or job.backfill >= now - after else now - job.backfill - _TINY
        if had is not None:
            return self._due_both(job, schedule, had, after, edge, now)
        if job.backfill is None or latest <= edge:  # a window the latest is not in: it runs all the same
            return [latest], max(0, schedule.count_between(after, latest) - 1)
        return list(islice(schedule.slots_between(edge, now), SLOTS_PER_PASS)), schedule.count_between(after, edge)

    @staticmethod
    def _due_both(job: PeriodicJob, schedule: Schedule, had: Schedule, after: datetime, edge: datetime,
                  now: datetime) -> tuple[list[datetime], int]:
        """``_due`` for a changed schedule: of the slots both schedules have, those in the backfill
        window, or (no backfill, or none in it) the latest, found walking back from ``now`` at most ``CHANGED_WALK`` slots
        (an older one is not run). Only the window is listed: the slots before it are counted, exactly
        when the sparser schedule has at most ``CHANGED_WALK`` there (or both are ``@every``), else
        estimated from its first ``CHANGED_WALK`` (a year of '@every 1s' was 31 million slots walked)."""
        inside = [] if job.backfill is None else list(islice(common_slots(schedule, had, edge, now), SLOTS_PER_PASS))
        if not inside:  # no backfill, or none in its window: the latest slot both have runs all the same
            last = latest_common(schedule, had, after, now, CHANGED_WALK)
            if last is None:
                return [], count_common(schedule, had, after, now, CHANGED_WALK)
            return [last], count_common(schedule, had, after, last - _TINY, CHANGED_WALK)
        return inside, count_common(schedule, had, after, edge, CHANGED_WALK) if edge > after else 0

    def _baseline(self, ctx: PassContext, entry: PeriodicJob, slot: datetime, result: PeriodicResult) -> None:
        with ctx.transaction() as conn:
            conn.execute(ctx.sql(periodic_slots.TAKE), {"periodic_id": entry.id, "slot": slot, "backfilled": False,
                                                        "instance": ctx.instance_id, "schedule": taken_under(entry)})
        result.baselined.append(entry.id)

    def _changed(self, ctx: PassContext, job: PeriodicJob, hwm: datetime, under: str,
                 latest: datetime, now: datetime, result: PeriodicResult) -> None:
        """The entry's schedule or time zone changed since its newest slot was taken (a config or
        crontab entry: when, unknown). Of the new schedule's slots since then, those the old one
        had too were missed, and run as usual; the others never were (a 05:00 job at 10:00, after
        a 03:00 one, would be a second run that day). Its latest slot is taken, with a job or
        without: it runs from the next one."""
        old = self._taken_under(under)
        # The missed slots are taken under the old schedule (``under``): a pass stopped before the
        # end sees the change again, not a new schedule whose slots since the last one were missed.
        ran = self._run_due(ctx, job, hwm, latest, now, result, old, under) if old is not None else []
        if job.id in result.behind:  # more missed slots: still the old schedule's until they are in
            return
        log.info("periodic entry's schedule changed: slots of the old one only are not run",
                 extra=kv(periodic_id=job.id, schedule=taken_under(job), missed=len(ran)))
        self._from_next(ctx, job, hwm, latest, result, ran)

    def _resumed(self, ctx: PassContext, job: PeriodicJob, hwm: datetime, latest: datetime,
                 result: PeriodicResult) -> None:
        """A config or crontab entry enabled again, its newest slot taken while it was disabled:
        when it was enabled (after that slot) is unknown, so any slot since may be its pause's,
        none is owed. It runs from its next slot, without backfill or ``run_on_start``, as when a
        leader saw the change (a config file has no change time; a row's ``updated_at`` is one)."""
        if latest > hwm:
            log.info("periodic entry enabled again: runs from its next slot",
                     extra=kv(periodic_id=job.id, paused_since=hwm.isoformat()))
        self._from_next(ctx, job, hwm, latest, result)

    def _from_next(self, ctx: PassContext, job: PeriodicJob, hwm: datetime, latest: datetime,
                   result: PeriodicResult, ran: Collection[datetime] = ()) -> None:
        """The entry runs from its next slot: its latest is taken, with a job (``ran``) or
        without, and its newest slot says its schedule as it is now."""
        if latest > hwm and latest not in ran:
            self._baseline(ctx, job, latest, result)
            return
        with ctx.transaction() as conn:  # the newest slot taken now says the new schedule
            conn.execute(ctx.sql(periodic_slots.RESTAMP), {"periodic_id": job.id, "slot": max(latest, hwm),
                                                           "schedule": taken_under(job)})

    def _skip_disabled(self, ctx: PassContext, entry: PeriodicJob, slot: datetime, previous: datetime | None,
                       result: PeriodicResult) -> None:
        """A disabled entry's slot is taken without a job (the ``previous`` one this daemon took
        forgotten), and counted by whichever daemon takes it: enabled again, the entry does not
        enqueue (or backfill) the slots it was disabled for. Taken already (enqueued before the
        entry was disabled), it is marked paused all the same: a row enabled again while no leader
        ran counts its missed slots from its change, not from the last slot a leader took."""
        stamp = taken_paused(entry)
        with ctx.transaction() as conn:
            taken = conn.execute(ctx.sql(periodic_slots.TAKE_DISABLED), {
                "periodic_id": entry.id, "slot": slot, "previous": previous, "instance": ctx.instance_id,
                "schedule": stamp}).first()
            if taken is None:
                conn.execute(ctx.sql(periodic_slots.RESTAMP), {"periodic_id": entry.id, "slot": slot, "schedule": stamp})
        if taken is not None:
            result.skip(entry.id, "disabled")

    def _enqueue(self, ctx: PassContext, entry: PeriodicJob, slot: datetime, backfilled: bool,
                 result: PeriodicResult, stamp: str | None = None) -> None:
        try:
            self._enqueue_once(ctx, entry, slot, backfilled, result, stamp)
        except DBAPIError as exc:
            # The waiting job holding the entry's key (job key mode) was moved to another
            # partition meanwhile (cancelled, say): taken and enqueued again, as it is now.
            if not ctx.moved_meanwhile(exc):
                raise
            self._enqueue_once(ctx, entry, slot, backfilled, result, stamp)

    def _enqueue_once(self, ctx: PassContext, entry: PeriodicJob, slot: datetime, backfilled: bool,
                      result: PeriodicResult, stamp: str | None = None) -> None:
        with ctx.transaction() as conn:
            taken = conn.execute(ctx.sql(periodic_slots.TAKE), {
                "periodic_id": entry.id, "slot": slot, "backfilled": backfilled,
                "instance": ctx.instance_id, "schedule": stamp or taken_under(entry)}).first()
            if taken is None:
                result.skip(entry.id, "duplicate")
                return
            metadata = {"periodic_id": entry.id, "slot": slot.isoformat(), "backfilled": backfilled}
            args = cron_args(entry.args, slot, backfilled) if entry.cron_args else entry.args
            replacing = entry.job_key_mode is not None and entry.effective_unique_key is not None
            job = conn.execute(ctx.sql(jobs.ENQUEUE_REPLACING if replacing else jobs.ENQUEUE), {
                "kind": entry.kind, "queue": entry.queue, "args": json.dumps(args),
                "priority": entry.priority, "max_attempts": entry.max_attempts, "scheduled_at": slot,
                "unique_key": entry.effective_unique_key, "metadata": json.dumps(metadata),
                "preserve_run_at": entry.job_key_mode == "preserve_run_at",
            }).first()
            if job is None:  # a live job still holds the entry's unique_key; the slot stays taken
                result.skip(entry.id, "duplicate")
                return
            conn.execute(ctx.sql(periodic_slots.LINK_JOB), {"job_id": job.id, "periodic_id": entry.id, "slot": slot})
        if getattr(job, "replaced", False):  # job_key_mode: the waiting job took the slot's args, no new job
            result.skip(entry.id, "replaced")
            if not ctx.dry_run:
                log.info("periodic slot given to the waiting job", extra=kv(periodic_id=entry.id, slot=slot.isoformat(),
                                                                            job_id=job.id))
            return
        result.enqueued.append({"periodic_id": entry.id, "slot": slot.isoformat(),
                                "job_id": None if ctx.dry_run else job.id, "backfilled": backfilled})
        if not ctx.dry_run:
            log.info("enqueued periodic job", extra=kv(periodic_id=entry.id, slot=slot.isoformat(),
                                                       job_id=job.id, backfilled=backfilled))

    def _prune(self, ctx: PassContext, now: datetime) -> None:
        """History older than the longest backfill window, once an hour. Bookkeeping: a failure
        is logged and tried again a minute later; the slots enqueued by the pass stand."""
        if self._last_prune is not None and now - self._last_prune < PRUNE_EVERY:
            return
        longest = max((e.backfill for e in self.config if e.backfill), default=timedelta(0))
        longest = max(longest, timedelta(days=31))  # rows' backfill windows are not known here
        params = {"before": now - max(KEEP_HISTORY, longest * 2), "limit": PRUNE_BATCH,
                  "from_id": "", "from_slot": "-infinity"}  # before every slot
        try:
            while True:  # each batch its own short transaction
                with ctx.transaction() as conn:
                    gone = conn.execute(ctx.sql(periodic_slots.PRUNE), params)
                    if gone.rowcount < PRUNE_BATCH:
                        break
                    first = gone.first()  # where the next batch starts (on every row)
                    params.update(from_id=first.next_id, from_slot=first.next_slot)
                ctx.check_stop()
        except DBAPIError as exc:
            if ctx.should_stop():  # its statement cancelled by a stop (a reload, a demotion)
                raise PassStopped() from exc
            log.warning("could not prune the periodic slots' history; trying again in a minute",
                        extra=kv(error=describe_db_error(exc)))
            self._last_prune = now - PRUNE_EVERY + PRUNE_RETRY
            return
        self._last_prune = now

    def observe(self, metrics, result: PeriodicResult) -> None:
        """Count the pass; the series of ids gone (a row deleted, an entry removed) go too: an
        application that makes a row per customer and deletes it would grow them without bound.
        At most ``metrics.max_periodic_ids`` ids have series of their own (rows are many): the
        configured entries first, then the first ids counted; the others count as ``_other``."""
        for pid in self._labelled - self._ids:
            metrics[ENQUEUED].remove(pid)
            for reason in SKIP_REASONS:
                metrics[SKIPPED].remove(pid, reason)
        self._labelled &= self._ids
        cap = metrics.max_periodic_ids
        for entry in self._configured:  # an operator's few entries are named before the rows
            self._label(entry.job.id, cap)
        for e in result.enqueued:
            metrics[ENQUEUED].labels(self._label(e["periodic_id"], cap)).inc()
        for pid, reasons in result.skipped.items():
            label = self._label(pid, cap)
            for reason, n in reasons.items():
                metrics[SKIPPED].labels(label, reason).inc(n)

    def _label(self, periodic_id: str, cap: int) -> str | None:
        """The id's label: its own while fewer than ``cap`` ids have one (a deleted id's place is
        free again), else the overflow, None (``_other``, which no id's label is: bounded
        cardinality, as ``metrics.max_queues``)."""
        if periodic_id in self._labelled or len(self._labelled) < cap:
            self._labelled.add(periodic_id)
            return periodic_id
        return None
