"""The runner schedules passes: while this instance leads, it runs each enabled service on its
trigger (APScheduler), one pass at a time per service, and stops them all at once when the term
ends. How a pass runs and is recorded is :mod:`maintd.passes`; the job gauges of every target of
a database are counted together (:class:`maintd.probes.CountProbe`) and handed to each runner."""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Iterable

from apscheduler.jobstores.base import JobLookupError
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger
from sqlalchemy import Engine

from .clock import Clock, ServerClock
from .config import Settings
from .layout_status import NOT_KEPT
from .logs import about_target, kv
from .metrics import JobGauges, Metrics
from .pass_summary import counts
from .passes import Outcome, PassRecord, execute_pass, record_pass, worth_recording
from .schedules import ScheduleTrigger
from .services import build_services
from .queries import Statements
from .services.base import Fence, NotLeader, PassContext, PassResult, PassStopped, Service

log = logging.getLogger("maintd.runner")


def _about_target(method: Callable[..., Any]) -> Callable[..., Any]:
    """A job of the (shared) timetable logs about its runner's target."""
    @functools.wraps(method)
    def job(self: "Runner", *args: Any, **kwargs: Any) -> Any:
        with about_target(self.log_target):
            return method(self, *args, **kwargs)
    return job

IDLE_SUMMARY = "nothing to do (the database's probe)"
WAKE_SUFFIX = ":wake:"  # one-off passes a service asked for (see Runner.wake), numbered


class Runner:
    """Runs the enabled services while this instance leads (between :meth:`activate` and
    :meth:`deactivate`). ``build`` makes the services from the settings (tests pass their own)."""

    def __init__(self, settings: Settings, engine: Engine, metrics: Metrics, *,
                 clock: Clock | None = None, on_fenced: Callable[[str, Fence], None] | None = None,
                 build: Callable[[Settings], dict[str, Service]] = build_services,
                 timetable: BackgroundScheduler | None = None, prefix: str = "", log_target: str | None = None,
                 statements: Statements | None = None, changes: "Changes | None" = None):
        """``timetable``, ``prefix``: the process's scheduler (one thread and one worker pool for
        every target; without one, the runner makes its own), this runner's job ids prefixed;
        ``log_target``: the target named in the lines its passes log; ``statements``: the
        target's SQL, rendered once for its schema."""
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.clock = clock or ServerClock()
        # Called when the database refuses a pass of the current term: (reason, that term's fence).
        self.on_fenced = on_fenced or (lambda reason, fence: None)
        self.build = build
        self.services = build(settings)
        self._known_series()
        self.gauges = JobGauges(metrics)
        self.timetable = timetable or new_timetable()
        self._own_timetable = timetable is None
        self.statements = statements or Statements(settings.schema)
        # Where the timetable changes of a term's start and end (and pokes) are made: the
        # daemon's Changes thread, so that the election loop never waits; else right away.
        self.changes: Callable[[Callable[[], None]], None] = changes or (lambda change: change())
        self._paused = False  # the database takes no writes: no pass runs
        self._said_not_kept = False  # the table partitioned under layout = "plain" was warned of
        self._wakes: dict[str, tuple[str, datetime]] = {}  # service: its asked-for pass (job id, when)
        self._wake_seq = 0
        self._deferred: set[str] = set()  # services asked for while their pass ran: again after it
        self._pushed: set[str] = set()  # services whose next tick was put off (quiet_until)
        self.prefix = prefix
        self.log_target = log_target
        self._fence: Fence | None = None
        self._stop_event = threading.Event()
        self._active: dict[str, PassContext] = {}
        self._pass_ended = threading.Event()
        self._lock = threading.Lock()
        self.last_runs: dict[str, dict] = {}
        self._recorded: dict[str, PassRecord] = {}  # the last pass of each service written this term
        self._last_success: dict[str, datetime] = {}

    def start(self) -> None:
        if self._own_timetable:
            self.timetable.start()

    def shutdown(self) -> None:
        self.deactivate()
        if self._own_timetable:
            self.timetable.shutdown(wait=False)

    def _jobs(self) -> list[Any]:
        return [j for j in self.timetable.get_jobs() if j.id.startswith(self.prefix)]

    @staticmethod
    def _unschedule(jobs: Iterable[Any]) -> None:
        """Remove ``jobs``. A one-off job (a new term's :meth:`_start_term`, a
        :meth:`_schedule_later`) listed a moment ago may have fired since, and the timetable's
        thread removed it: it is gone already, and the rest are still removed."""
        for job in jobs:
            with contextlib.suppress(JobLookupError):
                job.remove()

    # -- leadership -----------------------------------------------------------------------
    def activate(self, fence: Fence) -> None:
        """A new term: its services are scheduled by :attr:`changes`, not here: this runs on the
        election loop's thread, which must never wait for the timetable's lock (its thread holds
        it while it submits due jobs; 46 of 200 leases once ran out at a start while the loop
        waited for it)."""
        with self._lock:
            self._fence = fence
            self._stop_event = stop_event = threading.Event()
            self._recorded = {}  # a new term: the first pass of each service is written
        self.changes(lambda: self._start_term(stop_event))

    @_about_target
    def _start_term(self, stop_event: threading.Event) -> None:
        with self._lock:
            if self._stop_event is stop_event and not stop_event.is_set():
                # A pass of an ended term still running ignored its cancel (a frozen server; the
                # stall detection counts this term's only): its socket is shut, or this term's
                # passes of its service were turned away (its timetable job "already running")
                # until its wait for an answer ran out, statement_timeout + lease later.
                for ctx in self._active.values():
                    if ctx.fence is not self._fence:
                        ctx.query.sever()
                self._schedule_all()

    def deactivate(self, timeout: float = 1.0) -> None:
        """Stop every pass within ``timeout``: no new passes, stop flags set, queries cancelled."""
        with self._lock:
            was_active = self._fence is not None
            self._fence = None
            self._stop_event.set()
            active = list(self._active.values())
        self.changes(lambda: self._unschedule(self._jobs()))  # none of them runs a pass any more
        for ctx in active:
            _stop(ctx)
        if was_active:
            self.gauges.clear()  # only the leader exports job gauges: a follower's would be stale
            self._clear_term_gauges()
        deadline = time.monotonic() + timeout
        while self._active and time.monotonic() < deadline:
            # Woken by each pass that ends (a timed Event wait, not time.sleep: clock_nanosleep is
            # what LD_PRELOADed clock shims such as libfaketime get wrong).
            self._pass_ended.wait(0.01)
            self._pass_ended.clear()

    def _clear_term_gauges(self) -> None:
        """The services' gauges (stray rows, a rebuild's duration) are figures of this term's
        passes: a replica that no longer leads must not export them as current. Back to what a
        replica that never led exports: their known series at 0, no others (counters stay)."""
        self.metrics.clear_gauges(f for service in self.services.values() for f in service.METRICS)
        self._known_series()

    def _clear_term_gauges_if_following(self) -> None:
        """Under the lock: a term activated between the check and the clearing would lose its
        first gauges (activate takes the lock to set its fence)."""
        with self._lock:
            if self._fence is None:
                self._clear_term_gauges()

    def reload(self, settings: Settings) -> None:
        """New settings and services; while leading, reschedule: disabled services stop, new
        ones start at once, changed triggers are replaced, unchanged ones keep their next run."""
        with self._lock:
            self.settings = settings
            self._said_not_kept = False  # still partitioned under plain: said again at the next count
            old, self.services = self.services, self.build(settings)
            for name, service in self.services.items():
                if type(old.get(name)) is type(service):
                    try:
                        service.succeed(old[name])
                    except Exception as exc:  # what it knew is lost; the new service still runs
                        log.error("cannot carry a service over a reload", extra=kv(service=name, error=str(exc)))
            self._recorded = {}  # new settings: the first pass of each service is written
            self._stop_changed(old)
            if self._fence is None:
                self._known_series()
            else:  # which also sets the known series
                self._schedule_all(reload=True)
                # Ticks the old services put off (quiet_until: the periodic enqueuer's next slot,
                # up to 10 minutes away) are not the new ones': a pass now, which puts them off
                # again only if the new entries say so (an entry added runs from its first slot).
                now = datetime.now(timezone.utc)
                for name in self._pushed & set(self.services):
                    self._add_wake(name, now)

    def _stop_changed(self, old: dict[str, Service]) -> None:
        """A pass running under settings that changed stops now (a retention lengthened or a
        service disabled must stop its deletions); the new settings run from the next tick."""
        for name, ctx in list(self._active.items()):
            new = self.services.get(name)
            if new is None or not _same_settings(name, old.get(name), new):
                log.info("pass stopped: its settings changed", extra=kv(service=name))
                _stop(ctx)

    def _known_series(self, enabled: Iterable[str] | None = None) -> None:
        """The series of the enabled services exist at 0 whether this replica leads or not (SPEC
        7.4), and stay when it stops: a follower that takes over exports its counters at 0 before
        its first pass, so that rate() and increase() count that pass. ``enabled``: by default,
        the services that say so."""
        if enabled is None:
            enabled = [name for name, service in self.services.items() if _says_enabled(name, service)]
        self.metrics.known_series(sorted(enabled), {name: s.METRICS for name, s in self.services.items()})

    def _schedule_all(self, reload: bool = False) -> None:
        now = datetime.now(timezone.utc)  # APScheduler's own time base (host clock)
        wanted = {name for name in self.services if self._schedule(name, now, reload)}
        self._known_series(wanted)
        self._unschedule(job for job in self._jobs()
                         if job.id[len(self.prefix):].split(WAKE_SUFFIX)[0] not in wanted)

    def _schedule(self, name: str, now: datetime, reload: bool) -> bool:
        """(Re)schedule one service; returns whether it is enabled."""
        service = self.services[name]
        try:
            if not service.enabled():
                return False
            trigger = service.trigger()
        except Exception as exc:  # one broken service must not keep the others from running
            log.error("cannot schedule service", extra=kv(service=name, error=str(exc)))
            return False
        if trigger is None:  # driven by a probe of the database: its first pass of the term now
            # and no ticks (a reload that turned precise timing on leaves none behind)
            self._unschedule(filter(None, [self.timetable.get_job(self.prefix + name)]))
            self._add_wake(name, now)
            return True
        if isinstance(trigger, ScheduleTrigger) and not self._server_timed(name, trigger, now):
            return True
        job = self.timetable.get_job(self.prefix + name) if reload else None
        if job is not None and _trigger_key(job.trigger) == _trigger_key(trigger):
            return True  # same schedule: keep its next run time
        # Interval services run at once when they start; cron ones (reindexer) at their time.
        first = {"next_run_time": now} if isinstance(trigger, IntervalTrigger) and job is None else {}
        self.timetable.add_job(self._run, trigger=trigger, args=[name], id=self.prefix + name,
                               name=self.prefix + name, replace_existing=True, **first)
        if not isinstance(trigger, IntervalTrigger):
            job = self.timetable.get_job(self.prefix + name)
            log.info("scheduled", extra=kv(service=name, next_run=job.next_run_time if job else None))
        return True

    # -- one pass -------------------------------------------------------------------------
    def sever_stalled(self, seconds: float) -> None:
        """Shut down the sockets of passes waiting longer than ``seconds`` on the database."""
        with self._lock:
            active = list(self._active.values())
        for ctx in active:
            if ctx.query.stalled_for() > seconds:
                ctx.query.sever()

    def _server_timed(self, name: str, trigger: ScheduleTrigger, now: datetime) -> bool:
        """A cron trigger's slots are the server's time (the reindexer's 03:00), APScheduler's are
        the host's: the trigger is given the difference. False when the server's time was never
        read yet: the service is scheduled again a second later, in its place."""
        if self.clock.skew() is None:
            self.timetable.add_job(self._schedule_later, trigger=DateTrigger(now + timedelta(seconds=1)),
                                   args=[name], id=self.prefix + name, replace_existing=True)
            return False
        trigger.skew = lambda: self.clock.skew() or timedelta(0)
        return True

    @_about_target
    def _schedule_later(self, name: str) -> None:
        with self._lock:
            if self._fence is not None:
                self._schedule(name, datetime.now(timezone.utc), reload=False)

    def stalled_for(self) -> float:
        """Seconds the longest-waiting transaction of a running pass of the current term has been
        open (0: none). A pass of an ended term still blocked on a frozen server (its cancel
        unanswered) does not count against the next term, whose passes use fresh connections."""
        if not self._active:  # most ticks (no pass running): no lock taken
            return 0.0
        with self._lock:
            active = [ctx for ctx in self._active.values() if not ctx.stop_event.is_set()]
        return max((ctx.query.stalled_for() for ctx in active), default=0.0)

    def poke(self) -> None:
        """A NOTIFY said what the services read changed (a ``periodic_jobs`` row): those that
        care run now."""
        def poke() -> None:
            for name, service in list(self.services.items()):
                if service.poke():
                    self.wake(name)

        self.changes(poke)

    def pause(self, paused: bool) -> None:
        """The database takes no writes (a read-only primary): no pass runs until it does. Then
        each service that a probe drives gets a pass at once, as at a term's start: the passes
        asked for meanwhile (a precise rescue's look again, a job falling due) were dropped, and
        its probe looks again only an interval later (the rescuer's: 30 s by default)."""
        resumed = self._paused and not paused
        self._paused = paused
        if resumed:
            self.changes(self._resume)

    @_about_target
    def _resume(self) -> None:
        with self._lock:
            now = datetime.now(timezone.utc)
            for name in self.services:
                if self.probed(name):
                    self._add_wake(name, now)

    @property
    def paused(self) -> bool:
        return self._paused

    def _quiet(self, service: Service) -> bool:
        """Whether the service says a pass now cannot find anything to do (see quiet_until)."""
        until = service.quiet_until()
        if until is None:
            return False
        try:
            return self.clock.now() < until
        except RuntimeError:  # the server's time was never read: run the pass
            return False

    @_about_target
    def _run(self, name: str, wake: bool = False) -> None:
        with self._lock:
            fence, stop_event = self._fence, self._stop_event
            service = self.services.get(name)
            if wake and name in self._active:  # asked for while a pass runs: one more once it ends
                self._deferred.add(name)
                return
            # Disabled by a reload meanwhile: a wake asked for before it (a probe, a follow-up) runs no pass.
            if fence is None or service is None or stop_event.is_set() or self._paused or name in self._active \
                    or not _says_enabled(name, service) or (not wake and self._quiet(service)):
                return
            # Its own stop: set with the term's (deactivate), or alone when a reload changes it.
            ctx = PassContext.for_settings(self.settings, self.engine, self.clock, fence=fence,
                                           stop_event=threading.Event(), log=logging.getLogger(f"maintd.{name}"),
                                           statements=self.statements)
            self._active[name] = ctx
        record: PassRecord | None = None
        try:  # the pass is active until its record is written: a demotion stops that write too
            record = self._pass(name, service, ctx, fence, stop_event)
        except Exception as exc:  # execute_pass raised (a service's observe, say): no record
            log.error("pass failed outside the service", extra=kv(service=name, error=str(exc)),
                      exc_info=log.isEnabledFor(logging.DEBUG))
        finally:
            if stop_event.is_set():  # a pass of an ended term: it observed after the demotion
                self._clear_term_gauges_if_following()
            with self._lock:
                self._active.pop(name, None)
                again = name in self._deferred
                self._deferred.discard(name)
            self._pass_ended.set()
        # Also after a pass that raised: a wake asked for while it ran, and the ticks it put off
        # (quiet_until) brought back if the service no longer says so, are not lost with it.
        result = record.result if record is not None else ctx.partial  # (what the pass said so far)
        self._follow_up(name, service, result if isinstance(result, PassResult) else None, stop_event)
        if again:  # a wake came while it ran: one pass now
            self.wake(name)

    def _pass(self, name: str, service: Service, ctx: PassContext, fence: Fence,
              stop_event: threading.Event) -> PassRecord:
        """Run the pass, keep its figures, and record it (or give the term up if it was fenced)."""
        record = execute_pass(name, service, ctx, self.metrics)
        self.last_runs[name] = record.as_dict()
        if record.outcome is Outcome.SUCCESS:
            self._last_success[name] = record.finished_at
        record.last_success_at = self._last_success.get(name)
        if record.outcome is Outcome.FENCED:
            if not stop_event.is_set():  # this term is still ours as far as the elector knows
                self.on_fenced(record.error or "fenced", fence)
        elif record.outcome is not Outcome.STOPPED and worth_recording(self._recorded.get(name), record):
            self._record(ctx, record)
        return record

    def _follow_up(self, name: str, service: Service, result: PassResult | None,
                   stop_event: threading.Event) -> None:
        """What the pass (its ``result``; of a pass that raised, what it had said so far) said
        about the next one: run again at ``wake_at`` (a job falling due before the next tick: a
        one-off job, so the pass holds no thread while it waits), or nothing to do before
        ``quiet_until`` (the regular ticks until then are skipped)."""
        wake = result.wake_at() if result is not None else None
        if wake is not None and not stop_event.is_set():
            self.wake(name, wake)
            return
        quiet = service.quiet_until()
        host = self._host_time(quiet) if quiet is not None else None
        if stop_event.is_set() or (host is None and name not in self._pushed):
            return
        with self._lock:
            if self.services.get(name) is service:  # not replaced by a reload meanwhile
                self._push(name, host)

    def _push(self, name: str, host: datetime | None) -> None:
        """Put the service's next regular tick off to ``host`` (None: back to its regular time)."""
        with contextlib.suppress(JobLookupError):
            job = self.timetable.get_job(self.prefix + name)
            if job is None or job.next_run_time is None:
                return
            now = datetime.now(timezone.utc)
            regular = job.trigger.get_next_fire_time(None, now) or now
            # Past the ticks that cannot find work (none: back to the regular ticks).
            wanted = regular if host is None else max(regular, host)
            if wanted != job.next_run_time:
                job.modify(next_run_time=wanted)
            if wanted == regular:
                self._pushed.discard(name)
            else:
                self._pushed.add(name)

    def wake(self, name: str, at: datetime | None = None) -> None:
        """Run a pass of ``name`` at ``at`` (the server's time; None: now) if this runner leads,
        besides its regular ticks; an earlier one asked for already stands. Each is a one-off job
        of its own id: a pass that asks for the next one never waits for itself (one id would be
        "already running" if its follow-up came due before it returned)."""
        when = (self._host_time(at) if at is not None else None) or datetime.now(timezone.utc)
        with self._lock:
            self._add_wake(name, when)

    def _add_wake(self, name: str, when: datetime) -> None:
        if self._fence is None or name not in self.services:
            return
        pending = self._wakes.get(name)
        if pending is not None and self.timetable.get_job(pending[0]) is not None:
            if pending[1] <= when:
                return
            self._unschedule([self.timetable.get_job(pending[0])])
        self._wake_seq += 1
        job_id = f"{self.prefix}{name}{WAKE_SUFFIX}{self._wake_seq}"
        self.timetable.add_job(self._wake_run, trigger=DateTrigger(when), args=[name, self._stop_event], id=job_id)
        self._wakes[name] = (job_id, when)

    def idle(self, name: str, at: datetime) -> None:
        """A probe of the database found nothing for ``name`` to do (a pass it drives, not run):
        counted as the idle pass it stands for (``maintd_service_runs_total``, the last success)."""
        with self._lock:
            if self._fence is None or self._stop_event.is_set() or name in self._active:  # the pass says
                return
            self._last_success[name] = at
            last = self.last_runs.get(name)
            if last is None or last.get("summary") != IDLE_SUMMARY:
                last = {**PassRecord(name, Outcome.SUCCESS, at, at, 0.0).as_dict(),
                        "counts": counts(name, {}), "summary": IDLE_SUMMARY}  # did nothing: each count 0
            last["started_at"] = last["finished_at"] = at.isoformat()
            self.last_runs[name] = last
        self.metrics.service_runs.labels(name, Outcome.SUCCESS.value).inc()
        self.metrics.service_last_success.labels(name).set(at.timestamp())

    def probed(self, name: str) -> bool:
        """Whether a probe of the database drives ``name``'s passes now (leading, enabled, the
        database writable, and the service describes a probe: it has no ticks of its own)."""
        service = self.services.get(name)
        if self._fence is None or self._paused or service is None or not service.enabled():
            return False
        return service.probe() is not None

    @_about_target
    def _wake_run(self, name: str, stop_event: threading.Event) -> None:
        if stop_event is not self._stop_event or stop_event.is_set():
            return
        self._run(name, wake=True)

    def _host_time(self, server_time: datetime) -> datetime | None:
        """A server time as APScheduler's (the host's) clock reads it."""
        skew = self.clock.skew()
        return None if skew is None else server_time - skew

    def _record(self, ctx: PassContext, record: PassRecord) -> None:
        recorded = self._recorded
        try:
            if record_pass(ctx, record):
                recorded[record.service] = record
        except NotLeader as exc:
            if not ctx.should_stop():
                self.on_fenced(str(exc), ctx.fence)
        except PassStopped:
            pass

    def take_layout(self, partitioned: bool) -> None:
        """Whether the jobs table is partitioned, as read at the start's schema check and with
        every count (SPEC 8.1). A table partitioned under layout = "plain" (converted before the
        start, or swapped by a conversion while this daemon runs) keeps no partitions: said once,
        and again after a reload that left it so."""
        kept_none = partitioned and self.settings.layout == "plain"
        if kept_none and not self._said_not_kept:  # (named even when it is the only target)
            log.warning(NOT_KEPT, extra=kv(target=self.settings.target_name))
        self._said_not_kept = kept_none

    def take_counts(self, counts: list[dict], oldest: dict[str, float], at: datetime, *, final: bool,
                    missed_final: bool = False) -> None:
        """Job counts read for this target (by the database's :class:`maintd.probes.CountProbe`)."""
        stop_event = self._stop_event
        self.gauges.take(counts, oldest, at, final=final, lock=self._lock, missed_final=missed_final,
                         still_leading=lambda: self._fence is not None and not stop_event.is_set())


class Changes:
    """One thread making the timetable changes of terms that begin and end, in order (see
    :meth:`Runner.activate`); callable with a change."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="maintd-terms", daemon=True)
        self._thread.start()

    def __call__(self, change: Callable[[], None]) -> None:
        self._queue.put(change)

    def _run(self) -> None:
        while (change := self._queue.get()) is not None:
            try:
                change()
            except Exception as exc:  # a change that failed must not stop the next ones
                log.error("could not change the timetable", extra=kv(error=str(exc)))

    def stop(self, timeout: float = 2.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)


def new_timetable(workers: int = 10) -> BackgroundScheduler:
    """APScheduler for the passes: one pass at a time per job, missed runs coalesced."""
    from apscheduler.executors.pool import BasePoolExecutor

    class Executor(BasePoolExecutor):
        def __init__(self) -> None:
            super().__init__(DaemonThreads(workers))

    return BackgroundScheduler(timezone=timezone.utc, executors={"default": Executor()},
                               job_defaults={"max_instances": 1, "coalesce": True, "misfire_grace_time": None})


class DaemonThreads:
    """The timetable's worker threads (``concurrent.futures``' ``submit`` and ``shutdown``, each
    started when no idle one is left, up to ``workers``), daemon threads: the process exits once
    the daemon has stopped, whatever they still wait for. A pass or probe hung on a silent server
    (its cancel unanswered; the lock is released and the fence refuses its commit) held the exit
    of a ``concurrent.futures.ThreadPoolExecutor``, whose threads are joined at exit, until its
    wait for an answer ran out (statement_timeout + lease), past systemd's TimeoutStopSec."""

    def __init__(self, workers: int):
        self._workers = workers
        self._work: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple, dict] | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._work.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._workers:
                thread = threading.Thread(target=self._serve, name=f"maintd-pass-{len(self._threads)}", daemon=True)
                thread.start()
                self._threads.append(thread)
        return future

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:
                    future.set_exception(exc)
            item = future = None  # type: ignore[assignment]  # (no reference kept while idle)
            self._idle.release()

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            self._closed, threads = True, list(self._threads)
        for _ in threads:
            self._work.put(None)
        if wait:
            for thread in threads:
                thread.join()


def _trigger_key(trigger: BaseTrigger) -> Any:
    """What makes two triggers the same schedule (reprs carry a fresh start date)."""
    if isinstance(trigger, IntervalTrigger):
        return ("interval", trigger.interval)
    return ("other", getattr(trigger, "key", None) or str(trigger), str(getattr(trigger, "timezone", "")))


def _stop(ctx: PassContext) -> None:
    """Stop a running pass: its stop flag set (checked between batches) and its query cancelled."""
    ctx.stop_event.set()
    ctx.query.cancel()


def _says_enabled(name: str, service: Service) -> bool:
    """Whether ``service`` is enabled (a service that cannot tell is not: see Runner._schedule)."""
    try:
        return service.enabled()
    except Exception as exc:
        log.debug("cannot tell whether a service is enabled", extra=kv(service=name, error=str(exc)))
        return False


def _same_settings(name: str, old: Service | None, new: Service) -> bool:
    """Whether a pass of ``old`` may go on under ``new``'s settings (see Service.STOP_ON_CHANGE)."""
    try:
        return old is not None and _says_enabled(name, new) and (not new.STOP_ON_CHANGE or old.config == new.config)
    except Exception:  # a section that cannot even be compared has changed
        return False
