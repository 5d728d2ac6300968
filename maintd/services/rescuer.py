"""Rescuer: gives stuck ``running`` jobs back (``retryable`` after the backoff) or discards them.

A job is stuck when ``coalesce(heartbeat_at, attempted_at) < now - rescue_stuck_jobs_after``, or,
with ``heartbeat_timeout`` set, when it has heartbeated and ``heartbeat_at < now - heartbeat_timeout``,
with the values of the job's rule: its kind's ``[rescuer.kinds.NAME]``, else its queue's
``[rescuer.queues.NAME]``, else ``[rescuer]`` (:meth:`RescuerConfig.rule`). The rules go into the
statements as arrays (names are data), one rule number per row (``{rule}``).

Each batch is one fenced transaction of one statement: up to ``batch_size`` candidates read
through ``jobs_running_idx`` in keyset order up to the latest horizon of any rule (so rows that
cannot be rescued now are passed over once, never re-read by every batch), locked ``FOR NO KEY
UPDATE SKIP LOCKED`` (a worker finishing a job right now holds its row: we skip it rather than
wait), and updated. ``scheduled_at = now + backoff(attempt)`` uses :func:`maintd.jobs.backoff`,
tabulated here and passed as an array. The update re-checks ``state = 'running'``, the same
attempt and the stuck condition, so a job completed or re-claimed in between is never overwritten.
Each rescued job is announced on :func:`maintd.db.events_channel` (``stalled``, sent on commit).
While the server's NOTIFY queue is full (a listening session idle in a transaction), a COMMIT that
notifies fails: the batch is redone, and the rest of the pass runs, without the events (logged),
rather than rescue nothing.

Precise timing (SPEC 7.7, ``precise_timing``, default): after its batches, a pass reads the
earliest stuck deadline from now on (one probe of ``jobs_running_idx`` per distinct grace, see
``RESCUER_NEXT_STUCK``) and, if it comes before the next tick, asks the runner for another pass
just after it (:meth:`RescuerResult.wake_at`; the pass holds no thread while it waits), so a
stuck job leaves ``running`` within about ``MIN_WAKE`` of its deadline. A deadline that appears
later (a claim, a heartbeat) is at least the shortest grace away, so the pass asks to look again
at least that often ("look again"). Passes are at least ``MIN_WAKE`` apart, however many jobs fall
due, and a job the last batch saw stuck but could not take (locked) is left to the next tick.

A running job whose sign of life lies more than ``FUTURE_AHEAD`` in the server's future (a worker
writing its own clock's time, an import), which the keyset would reach only then, has it dated now
(``heartbeat_at``, or ``attempted_at`` for a job that never heartbeated, so that only jobs that
heartbeat come under ``heartbeat_timeout``; logged, counted as
``maintd_rows_skipped_total{reason="future_sign"}``): a live worker's next
heartbeat replaces it, and a dead worker's job is rescued once its grace has passed.

A running job whose ``heartbeat_at`` is older than its ``attempted_at`` carries an earlier
attempt's heartbeat (SPEC 2's claim leaves it): by SPEC 2's rule it would be rescued as soon as its
claim, though its worker is alive. A candidate whose claim is within its grace has that heartbeat
cleared instead (logged, ``maintd_rows_skipped_total{reason="stale_heartbeat"}``), and is judged
by its claim; a rescue clears ``heartbeat_at`` too, so the next attempt starts without one.

Waiting jobs (``available``, ``scheduled``, ``retryable``) with no attempt left (``attempt >=
max_attempts``), which the workers' claim passes over, are discarded with the reason appended to
``errors`` (through ``jobs_exhausted_idx``), counted as ``maintd_jobs_rescued_total{outcome=
"exhausted"}`` and logged one line per job.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from typing import Annotated, Any, Iterator

from prometheus_client import Counter
from pydantic import AfterValidator, Field, ValidationInfo, model_validator
from sqlalchemy.exc import DBAPIError

from .. import faults
from ..db import events_channel
from ..durations import format_duration
from ..jobs import BACKOFF_CAP, backoff
from ..logs import clip, kv
from ..metrics import Family
from ..queries import jobs
from ..sections import OptionalDuration, PositiveDuration, Section, ServiceConfig, names_like_queues
from .base import PassContext, PassResult, Service
from .scheduler import MIN_WAKE, NOTIFY_QUEUE_FULL, NOTIFY_QUEUE_FULL_WHY


class RescueRule(Section):
    """``[rescuer.queues.NAME]`` / ``[rescuer.kinds.NAME]``: the stuck rule for some jobs. Keys not
    given (None here) take the ``[rescuer]`` value, not another section's."""

    rescue_stuck_jobs_after: OptionalDuration = None
    heartbeat_timeout: OptionalDuration = None
    job_timeout: OptionalDuration = None


def _rescue_rule_check(rule: RescueRule, info: ValidationInfo) -> RescueRule:
    """A section keeps the rule rescue_stuck_jobs_after > job_timeout, with the ``[rescuer]``
    values for the keys it does not set (the error's key is the section's)."""
    defaults = info.data
    given = rule.model_fields_set
    after = rule.rescue_stuck_jobs_after or defaults.get("rescue_stuck_jobs_after")
    timeout = rule.job_timeout if "job_timeout" in given else defaults.get("job_timeout")
    if after is not None and timeout is not None and after <= timeout:
        key = "rescue_stuck_jobs_after" if "rescue_stuck_jobs_after" in given else "job_timeout"
        raise ValueError(
            f"{key}: rescue_stuck_jobs_after must be greater than job_timeout here "
            f"({format_duration(after)} <= {format_duration(timeout)}), or jobs still running within "
            "their timeout would be rescued")
    return rule


RescueRules = dict[str, Annotated[RescueRule, AfterValidator(_rescue_rule_check)]]


class RescuerConfig(ServiceConfig):
    # Stuck rows have no worker left to wait for them, so a batch may be large: at 1,000 its fixed
    # cost (planning, round trips, commit) was a fifth of the work (bench/rescue.py).
    batch_size: int = Field(default=5_000, ge=1, le=100_000)
    rescue_stuck_jobs_after: PositiveDuration = timedelta(hours=1)
    heartbeat_timeout: OptionalDuration = None
    job_timeout: OptionalDuration = None
    # Between passes, wake up when the next running job becomes stuck (SPEC 7.7), so a stuck job
    # is rescued within about a second of its deadline instead of up to `interval` later.
    precise_timing: bool = True
    # Announce each rescued job with NOTIFY maintd_events ("stalled"); about 1.5 us of server CPU
    # per rescued job, which a deployment that never LISTENs can save.
    events: bool = True
    # Per-queue and per-kind rules; a job's kind section wins over its queue's, which wins over
    # the [rescuer] values.
    queues: Annotated[RescueRules, names_like_queues("queue")] = Field(default_factory=dict)
    kinds: Annotated[RescueRules, names_like_queues("kind")] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> "RescuerConfig":
        if self.job_timeout is not None and self.rescue_stuck_jobs_after <= self.job_timeout:
            raise ValueError(
                "rescue_stuck_jobs_after: must be greater than rescuer.job_timeout "
                f"({format_duration(self.rescue_stuck_jobs_after)} <= {format_duration(self.job_timeout)}),"
                " or jobs still running within their timeout would be rescued"
            )
        return self

    def rule(self, *, kind: str | None = None, queue: str | None = None) -> RescueRule:
        """The effective stuck rule of a job (kind section, else queue section, else [rescuer]),
        with every key resolved."""
        section = self.kinds.get(kind) if kind is not None else None
        if section is None and queue is not None:
            section = self.queues.get(queue)
        values = {k: getattr(self, k) for k in RescueRule.model_fields}
        if section is not None:
            values.update({k: getattr(section, k) for k in section.model_fields_set})
            values["rescue_stuck_jobs_after"] = section.rescue_stuck_jobs_after or self.rescue_stuck_jobs_after
        return RescueRule.model_construct(**values)


log = logging.getLogger("maintd.rescuer")

JOBS_RESCUED = Family(Counter, "maintd_jobs_rescued", "Stuck running jobs rescued (outcome: retried or discarded), "
                      "and waiting jobs with no attempt left discarded (outcome: exhausted).", ("outcome",),
                      known=(("retried",), ("discarded",), ("exhausted",)))

# Where the keyset starts; earlier signs of life (and none at all) are RESCUER_NO_SIGN_BATCH's.
FAR_PAST = datetime(1, 1, 2, tzinfo=timezone.utc)
# Just before (FAR_PAST, any id): the keyset's (seen, id) > KEYSET_START holds exactly for seen >=
# FAR_PAST, whatever the id (an identity BY DEFAULT: an import may write 0 or a negative one).
KEYSET_START = (FAR_PAST - timedelta(microseconds=1), 2 ** 63 - 1)
# Where RESCUER_NO_SIGN_BATCH's walk starts: the first entry before year 1 (from '-infinity' and
# the lowest id on), and the first with no sign at all.
NO_SIGN_START = {"from_seen": "-infinity", "from_id": -2 ** 63, "from_none": -2 ** 63}
# A sign of life further ahead of the server's clock than this is dated now (RESCUER_FUTURE_SIGN_BATCH).
FUTURE_AHEAD = timedelta(minutes=1)
# A rescue's commit does not wait for its WAL flush (synchronous_commit = off for that transaction
# only). Losing the last rescues in a server crash is harmless: those jobs are running and stuck
# again after recovery and are rescued (and announced) again. Nothing else can build on a lost
# rescue either: whatever commits after it durably (a worker's claim) flushes the WAL up to its
# own commit, which holds the rescue's. Saves a WAL flush per batch (~3 ms here).
RESCUE_TRANSACTION = {"synchronous_commit": "off"}
# A rescue matters more than its events (as promotion does more than the scheduler's NOTIFY).
EVENTS_QUEUE_FULL_LOG = NOTIFY_QUEUE_FULL_WHY + ": jobs rescued without their stalled events"
# backoff(k) in seconds for k = 0 .. BACKOFF_CAP (the statement indexes it by attempt)
DELAYS = [backoff(k).total_seconds() for k in range(BACKOFF_CAP + 1)]


@dataclass
class RescuerResult(PassResult):
    retried: int = 0
    discarded: int = 0
    exhausted: int = 0  # waiting jobs with no attempt left, discarded
    dated: int = 0  # running jobs whose sign of life lay in the future, dated now
    cleared: int = 0  # running jobs whose heartbeat was an earlier attempt's, cleared
    batches: int = 0
    next_pass_at: datetime | None = None  # precise timing: the next deadline, before the next tick
    dry_run: bool = False

    def wake_at(self) -> datetime | None:
        return self.next_pass_at

    def did_something(self) -> bool:
        return self.retried + self.discarded + self.exhausted + self.dated + self.cleared > 0

    def skipped_rows(self) -> dict[str, int]:
        return {"future_sign": self.dated, "stale_heartbeat": self.cleared}

    def summary(self) -> str:
        verb = "would rescue" if self.dry_run else "rescued"
        return f"{verb} retried={self.retried} discarded={self.discarded}" + (
            f" exhausted={self.exhausted}" if self.exhausted else "") + (f" dated={self.dated}" if self.dated else "") + (
            f" cleared={self.cleared}" if self.cleared else "")


def _log_rescued(retried: int, discarded: int) -> None:
    """One line per round of batches (a pass with precise timing has several)."""
    if retried or discarded:
        log.info("released stale running jobs",
                 extra=kv(count=retried + discarded, retried=retried, discarded=discarded))


def _count_cleared(result: RescuerResult, cleared: list[int]) -> None:
    """A batch's candidates whose earlier attempt's heartbeat it cleared: counted, one line."""
    result.cleared += len(cleared)
    if cleared:
        log.warning("cleared the heartbeat_at of running jobs left from an earlier attempt (a claim "
                    "that does not clear it): they are judged by their claim's attempted_at",
                    extra=kv(count=len(cleared), job_ids=clip(cleared)))


def _events_failed(ctx: PassContext, exc: DBAPIError, params: dict) -> bool:
    """Whether a batch's COMMIT failed because the server's NOTIFY queue is full (SQLSTATE 54000)
    while it announced: then the pass's ``params`` announce nothing from now on (logged once)."""
    if not params.get("announce") or faults.sqlstate(exc) != NOTIFY_QUEUE_FULL:
        return False
    params["announce"] = False
    ctx.log.warning(EVENTS_QUEUE_FULL_LOG, extra=kv(schema=ctx.schema))
    return True


class Rescuer(Service):

    METRICS = (JOBS_RESCUED,)
    config: RescuerConfig

    def __init__(self, config: RescuerConfig):
        super().__init__(config)
        # Signs of life from the future are looked for once per interval, not at every precise
        # wake (a pass every 50 ms while many jobs fall due): they are a minute ahead at least.
        self._future_looked_at: datetime | None = None

    def rules(self) -> list[tuple[str | None, str | None, timedelta, timedelta | None]]:
        """(kind, queue, rescue_stuck_jobs_after, heartbeat_timeout) of each rule, the default
        first (rule 1 in the SQL), then the kinds', then the queues'."""
        cfg = self.config
        rules = [(None, None, cfg.rule())]
        rules += [(kind, None, cfg.rule(kind=kind)) for kind in cfg.kinds]
        rules += [(None, queue, cfg.rule(queue=queue)) for queue in cfg.queues]
        return [(k, q, r.rescue_stuck_jobs_after, r.heartbeat_timeout) for k, q, r in rules]

    def horizons(self, now: datetime) -> dict:
        rules = self.rules()
        stuck = [now - after for _, _, after, _ in rules]
        hb = [now - t if t else None for _, _, _, t in rules]
        return {"rule_kinds": [k for k, _, _, _ in rules], "rule_queues": [q for _, q, _, _ in rules],
                "stuck_befores": stuck, "hb_befores": hb,
                "scan_until": max([*stuck, *(t for t in hb if t is not None)])}

    def graces(self) -> dict:
        """The rules as seconds (``{grace}``), and their distinct graces (one probe each)."""
        rules = self.rules()
        afters = [after.total_seconds() for _, _, after, _ in rules]
        hbs = [t.total_seconds() if t else None for _, _, _, t in rules]
        graces = set(afters) | {min(a, h) for a, h in zip(afters, hbs) if h is not None}
        return {"rule_kinds": [k for k, _, _, _ in rules], "rule_queues": [q for _, q, _, _ in rules],
                "afters": afters, "hbs": hbs, "graces": sorted(graces)}

    def probe(self) -> list[str] | None:
        """No ticks of its own: every ``interval`` the database's probe reads, for every target,
        the oldest sign of life of a running job and whether odd rows wait; a pass runs where a
        job may be stuck (by the shortest grace of any rule: never late, at worst early), and with
        precise timing one is asked for at the next such deadline before the next look."""
        return jobs.RESCUER_PROBE

    def after_probe(self, values: tuple, now: datetime) -> bool | datetime | None:
        oldest, no_sign, exhausted, newest = values
        if no_sign or exhausted or (newest is not None and newest > now + FUTURE_AHEAD):
            return True
        shortest = timedelta(seconds=self.graces()["graces"][0])
        deadline = oldest + shortest if oldest is not None else None
        if deadline is not None and deadline <= now:
            return True
        if not self.config.precise_timing:
            return None
        # The oldest running job's deadline; and a job claimed from now on falls due a grace from
        # now at the earliest (a sign from the near future dates a deadline later than that): a
        # look then, as a pass asks for (one that failed asked for none, and the looks would end
        # until a probe saw a running job: an interval late for a job claimed meanwhile).
        ahead = now + shortest if deadline is None else min(deadline, now + shortest)
        return ahead + timedelta(milliseconds=1) if ahead < now + self.config.interval else None

    def run_once(self, ctx: PassContext) -> RescuerResult:
        result = ctx.begin(RescuerResult(dry_run=ctx.dry_run))
        if ctx.dry_run:  # what each of the three batches would do
            with ctx.transaction() as conn:
                now = ctx.now()
                horizons = {**self.horizons(now), "now": now}
                stuck = conn.execute(ctx.sql(jobs.RESCUER_COUNT_STUCK), horizons).one()
                odd = conn.execute(ctx.sql(jobs.RESCUER_COUNT_ODD), horizons).one()
                if self._future_due(now):
                    result.dated = conn.execute(ctx.sql(jobs.RESCUER_COUNT_FUTURE),
                                                {"ahead": FUTURE_AHEAD.total_seconds()}).scalar()
            result.retried, result.discarded = stuck.retry + odd.retry, stuck.discard + odd.discard
            result.cleared = stuck.cleared + odd.cleared
            result.exhausted = odd.exhausted
            return result
        now = ctx.now()
        done = (result.retried, result.discarded)
        try:
            if self._future_due(now):
                self._date_future_signs(ctx, result)
                self._future_looked_at = now
            params = self._params(ctx, now)  # the rules and horizons, once per pass
            self._rescue_without_sign(ctx, params, result)
            self._discard_exhausted(ctx, params, result)
            deadline = self._rescue(ctx, params, result)
        finally:  # also when the pass stops or fails half-way: say what was committed
            _log_rescued(result.retried - done[0], result.discarded - done[1])
        if deadline is not None:
            result.next_pass_at = max(deadline + timedelta(milliseconds=1), now + timedelta(seconds=MIN_WAKE))
        return result

    def _params(self, ctx: PassContext, now: datetime) -> dict:
        return {**self.horizons(now), "now": now, "instance": ctx.instance_id, "delays": DELAYS,
                "cap": BACKOFF_CAP, "events_channel": events_channel(ctx.schema), "announce": self.config.events}

    def _next_deadline(self, ctx: PassContext, conn, now: datetime) -> datetime | None:
        """The earliest stuck deadline in [now, until): until the next tick, or the shortest grace
        from now (a job claimed or heartbeating from now on cannot fall due earlier), when sooner."""
        graces = self.graces()
        to_tick, shortest = self.config.interval.total_seconds(), graces["graces"][0]
        until = now + timedelta(seconds=min(to_tick, shortest))
        conn.execute(ctx.sql(jobs.RESCUER_PROBE_PLANNING))
        found = conn.execute(ctx.sql(jobs.RESCUER_NEXT_STUCK), {**graces, "since": now, "until": until}).scalar()
        if found is None and shortest < to_tick:
            return until  # look again then
        return found

    def _rescue(self, ctx: PassContext, params: dict, result: RescuerResult) -> datetime | None:
        """Batches in keyset order until one finds fewer than ``batch_size`` candidates; with
        precise timing, the last one also reads the next time to look again (None: the next tick)."""
        after_seen, after_id = KEYSET_START
        while True:
            ctx.check_stop()
            limit = ctx.redo_limit(self.config.batch_size)  # smaller when redone (40001)
            deadline = None
            try:
                with ctx.transaction(settings=RESCUE_TRANSACTION) as conn:
                    batch = conn.execute(ctx.sql(jobs.RESCUER_BATCH), {
                        **params, "after_seen": after_seen, "after_id": after_id, "limit": limit}).one()
                    if batch.candidates < limit and self.config.precise_timing:
                        deadline = self._next_deadline(ctx, conn, params["now"])
            except DBAPIError as exc:
                if ctx.moved_meanwhile(exc):  # a worker finished a candidate meanwhile
                    continue
                if _events_failed(ctx, exc, params):  # redone without the events
                    continue
                raise
            if batch.retried or batch.discarded:
                result.batches += 1
            result.discarded += batch.discarded
            result.retried += batch.retried
            _count_cleared(result, batch.cleared)
            if batch.candidates < limit:
                return deadline
            after_seen, after_id = batch.last_seen, batch.last_id

    def _batches(self, ctx: PassContext, statement: str, params: dict, settings: dict | None = None,
                 position: dict | None = None) -> Iterator[Any]:
        """One statement's batches, each committed, until one finds fewer than ``batch_size``
        candidates; a batch a row of which moved meanwhile (40001) is redone, smaller. A keyset
        statement's ``position`` (its parameters) is read anew for each batch: the caller moves it."""
        while True:
            ctx.check_stop()
            limit = ctx.redo_limit(self.config.batch_size)
            try:
                with ctx.transaction(settings=settings) as conn:
                    batch = conn.execute(ctx.sql(statement), {**params, **(position or {}), "limit": limit}).one()
            except DBAPIError as exc:
                if ctx.moved_meanwhile(exc):  # finished, claimed or cancelled meanwhile
                    continue
                if _events_failed(ctx, exc, params):  # redone without the events
                    continue
                raise
            yield batch
            if batch.candidates < limit:
                return

    def _rescue_without_sign(self, ctx: PassContext, params: dict, result: RescuerResult) -> None:
        """Running jobs with no usable attempted_at/heartbeat_at: stuck, rescued, one line per batch
        (or, with an earlier attempt's heartbeat and a claim within its grace, that heartbeat cleared).
        Keyset batches (RESCUER_NO_SIGN_BATCH): each starts where the last one ended."""
        position = dict(NO_SIGN_START)
        for batch in self._batches(ctx, jobs.RESCUER_NO_SIGN_BATCH, params, RESCUE_TRANSACTION, position):
            position.update(from_seen=batch.next_seen, from_id=batch.next_id, from_none=batch.next_none)
            result.discarded += batch.discarded
            result.retried += batch.retried
            _count_cleared(result, batch.cleared)
            if batch.ids:
                log.warning("rescued running jobs with no usable attempted_at or heartbeat_at",
                            extra=kv(count=len(batch.ids), job_ids=clip(batch.ids)))

    def _future_due(self, now: datetime) -> bool:
        """Whether this pass looks for future signs of life (once an interval)."""
        return self._future_looked_at is None or now - self._future_looked_at >= self.config.interval

    def _date_future_signs(self, ctx: PassContext, result: RescuerResult) -> None:
        """Running jobs whose sign of life lies in the future: dated now, one line per batch."""
        params, position = {"ahead": FUTURE_AHEAD.total_seconds()}, {"from_seen": "infinity", "from_id": 2 ** 63 - 1}
        for batch in self._batches(ctx, jobs.RESCUER_FUTURE_SIGN_BATCH, params, position=position):
            position.update(from_seen=batch.next_seen, from_id=batch.next_id)
            result.dated += len(batch.ids)
            if batch.ids:
                log.warning("dated now the sign of life of running jobs whose heartbeat_at or attempted_at lay "
                            "in the future (a worker writing its own clock?)",
                            extra=kv(count=len(batch.ids), job_ids=clip(batch.ids)))

    def _discard_exhausted(self, ctx: PassContext, params: dict, result: RescuerResult) -> None:
        """Waiting jobs with no attempt left (the claim passes them over): discarded, one line per batch."""
        params, position = {"now": params["now"], "instance": ctx.instance_id}, {"from_id": -2 ** 63}
        for batch in self._batches(ctx, jobs.RESCUER_EXHAUSTED_BATCH, params, position=position):
            position["from_id"] = batch.next_id
            result.exhausted += len(batch.ids)
            if batch.ids:
                log.warning("discarded waiting jobs with no attempt left (attempt >= max_attempts)",
                            extra=kv(count=len(batch.ids), job_ids=clip(batch.ids)))

    def observe(self, metrics, result: RescuerResult) -> None:
        if result.retried:
            metrics[JOBS_RESCUED].labels("retried").inc(result.retried)
        if result.discarded:
            metrics[JOBS_RESCUED].labels("discarded").inc(result.discarded)
        if result.exhausted:
            metrics[JOBS_RESCUED].labels("exhausted").inc(result.exhausted)
