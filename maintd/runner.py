"""The one place that runs service passes: scheduling (APScheduler), leadership gating, fencing,
timing, metrics, error handling and the ``service_runs`` record. Services hold only their logic.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable

from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from sqlalchemy import Engine

from .clock import Clock, SystemClock
from .config import Settings
from .db import describe_db_error, make_engine, session_settings, sql
from .logs import kv
from .metrics import Metrics
from .services import SERVICES
from .services.base import Fence, NoFence, NotLeader, PassContext, PassResult, PassStopped, Service

log = logging.getLogger("maintd.runner")

RECORD_RUN = """
INSERT INTO {schema}.service_runs AS r
       (service, instance_id, started_at, finished_at, outcome, result, error, last_success_at)
VALUES (:service, :instance, :started, :finished, :outcome, CAST(:result AS jsonb), :error,
        CASE WHEN :outcome = 'success' THEN CAST(:finished AS timestamptz) END)
ON CONFLICT (service) DO UPDATE
   SET instance_id = excluded.instance_id, started_at = excluded.started_at,
       finished_at = excluded.finished_at, outcome = excluded.outcome, result = excluded.result,
       error = excluded.error, last_success_at = coalesce(excluded.last_success_at, r.last_success_at)
"""

STATS_INTERVAL = 15.0
FINAL_STATS_INTERVAL = 300.0  # per-queue counts of finished jobs read the heap: every 5 minutes
CANCEL_TIMEOUT = 2.0  # seconds a cancel request may take (it opens its own connection)


def build_services(settings: Settings) -> dict[str, Service]:
    return {name: cls(settings) for name, cls in SERVICES.items()}


def maintenance_engine(settings: Settings, *, pool_size: int = len(SERVICES) + 1) -> Engine:
    """Pooled connections for maintenance transactions, bounded by the statement timeout; a
    frozen process's open transaction is ended by the server within the lease. Each running pass
    holds one (:meth:`PassContext.session`), the job gauges another; connections open on demand."""
    return make_engine(
        settings.database_url.get_secret_value(),
        application_name=f"maintd:{settings.instance_id}:work",
        session=session_settings(settings.statement_timeout, lock_timeout=settings.leader.lease / 2,
                                 idle_in_transaction=settings.leader.lease),
        pool_size=pool_size,
    )


def execute_pass(service: Service, ctx: PassContext, metrics: Metrics | None = None) -> tuple[str, PassResult | None, str | None]:
    """Run one pass; return (outcome, result, error). Outcomes: success, error, fenced, stopped."""
    name = service.name
    slog = logging.getLogger(f"maintd.{name}")
    started = time.monotonic()
    result: PassResult | None = None
    error: str | None = None
    try:
        with ctx.session():
            result = service.run_once(ctx)
        outcome = "success"
    except NotLeader as exc:
        outcome, error = "fenced", str(exc)
        slog.warning("pass refused: not the leader", extra=kv(service=name, reason=str(exc)))
    except PassStopped:
        outcome, error = "stopped", "stopped: leadership lost or shutting down"
    except Exception as exc:  # a failing pass never kills the daemon
        if ctx.should_stop():  # e.g. its query was cancelled because we lost leadership
            outcome, error = "stopped", f"stopped: {describe_db_error(exc)}"
        else:
            outcome, error = "error", describe_db_error(exc)
            slog.error("pass failed", extra=kv(service=name, error=error),
                       exc_info=slog.isEnabledFor(logging.DEBUG))
    elapsed = time.monotonic() - started
    if metrics is not None:
        metrics.service_runs.labels(name, outcome).inc()
        metrics.service_run_seconds.labels(name).observe(elapsed)
        if outcome == "success":
            metrics.service_last_success.labels(name).set(time.time())
            if result is not None and not ctx.dry_run:
                service.observe(metrics, result)
    if result is not None and result.did_something():
        slog.info("%s: %s", name, result.summary(), extra=kv(seconds=round(elapsed, 3)))
    return outcome, result, error


class Runner:
    """Schedules the enabled services while this instance leads."""

    def __init__(self, settings: Settings, engine: Engine, metrics: Metrics, *,
                 clock: Clock | None = None, on_fenced: Callable[[str, Fence], None] | None = None):
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.clock = clock or SystemClock()
        # Called when the database refuses a pass of the current term: (reason, that term's fence).
        self.on_fenced = on_fenced or (lambda reason, fence: None)
        self.services = build_services(settings)
        self.scheduler = BackgroundScheduler(timezone=timezone.utc, job_defaults={
            "max_instances": 1, "coalesce": True, "misfire_grace_time": None})
        self._fence: Fence | None = None
        self._stop_event = threading.Event()
        self._active: dict[str, PassContext] = {}
        self._lock = threading.Lock()
        self.last_runs: dict[str, dict] = {}
        self._final_counted_at = float("-inf")

    def start(self) -> None:
        self.scheduler.start()

    def shutdown(self) -> None:
        self.deactivate("shutdown")
        self.scheduler.shutdown(wait=False)

    # -- leadership -----------------------------------------------------------------------
    def activate(self, fence: Fence) -> None:
        with self._lock:
            self._fence = fence
            self._stop_event = threading.Event()
            self._schedule_all()

    def deactivate(self, reason: str, timeout: float = 1.0) -> None:
        """Stop every pass within ``timeout``: no new passes, stop flags set, queries cancelled."""
        with self._lock:
            was_active = self._fence is not None
            self._fence = None
            self._stop_event.set()
            for job in self.scheduler.get_jobs():
                job.remove()
            active = list(self._active.values())
        for ctx in active:
            _cancel(ctx)
        if was_active:
            # Only the leader refreshes the job gauges: a follower must not export stale ones.
            self.metrics.jobs.clear()
            self.metrics.oldest_available_age.clear()
            self._final_counted_at = float("-inf")
        deadline = time.monotonic() + timeout
        while self._active and time.monotonic() < deadline:
            time.sleep(0.01)

    def reload(self, settings: Settings) -> None:
        """New settings and services; while leading, reschedule: disabled services stop, new
        ones start at once, changed triggers are replaced, unchanged ones keep their next run."""
        with self._lock:
            self.settings = settings
            self.services = build_services(settings)
            if self._fence is not None:
                self._schedule_all(reload=True)

    def _schedule_all(self, reload: bool = False) -> None:
        now = datetime.now(timezone.utc)
        wanted: set[str] = set()
        for name, service in self.services.items():
            try:
                if not service.enabled():
                    continue
                trigger = service.trigger()
            except Exception as exc:  # one broken service must not keep the others from running
                log.error("cannot schedule service", extra=kv(service=name, error=str(exc)))
                continue
            wanted.add(name)
            job = self.scheduler.get_job(name) if reload else None
            if job is not None and _trigger_key(job.trigger) == _trigger_key(trigger):
                continue  # same schedule: keep its next run time
            # Interval services run at once when they start; cron ones (reindexer) at their time.
            first = {"next_run_time": now} if isinstance(trigger, IntervalTrigger) and job is None else {}
            self.scheduler.add_job(self._run, trigger=trigger, args=[name], id=name, name=name,
                                   replace_existing=True, **first)
            if not isinstance(trigger, IntervalTrigger):
                job = self.scheduler.get_job(name)
                log.info("scheduled", extra=kv(service=name, next_run=job.next_run_time if job else None))
        for job in self.scheduler.get_jobs():
            if job.id != "_stats" and job.id not in wanted:
                job.remove()
        if self.scheduler.get_job("_stats") is None:
            self.scheduler.add_job(self._refresh_stats, IntervalTrigger(seconds=STATS_INTERVAL),
                                   id="_stats", next_run_time=now)

    # -- one pass -------------------------------------------------------------------------
    def _run(self, name: str) -> None:
        with self._lock:
            fence, stop_event = self._fence, self._stop_event
            service = self.services.get(name)
            if fence is None or service is None or stop_event.is_set():
                return
            ctx = PassContext(engine=self.engine, settings=service.settings, clock=self.clock,
                              fence=fence, stop_event=stop_event, log=logging.getLogger(f"maintd.{name}"))
            self._active[name] = ctx
        started = datetime.now(timezone.utc)
        try:
            outcome, result, error = execute_pass(service, ctx, self.metrics)
        finally:
            self._active.pop(name, None)
        finished = datetime.now(timezone.utc)
        record = {"service": name, "outcome": outcome, "started_at": started.isoformat(),
                  "finished_at": finished.isoformat(), "error": error,
                  "result": result.as_dict() if result is not None else {}}
        self.last_runs[name] = record
        if outcome == "fenced":
            if not stop_event.is_set():  # this term is still ours as far as the elector knows
                self.on_fenced(error or "fenced", fence)
            return
        if outcome == "stopped":
            return
        self._record(ctx, record, started, finished)

    def _record(self, ctx: PassContext, record: dict, started: datetime, finished: datetime) -> None:
        try:
            with ctx.transaction() as conn:
                conn.execute(sql(RECORD_RUN, self.settings.schema), {
                    "service": record["service"], "instance": self.settings.instance_id,
                    "started": started, "finished": finished, "outcome": record["outcome"],
                    "result": json.dumps(record["result"], default=str), "error": record["error"],
                })
        except NotLeader as exc:
            if not ctx.should_stop():
                self.on_fenced(str(exc), ctx.fence)
        except PassStopped:
            pass
        except Exception as exc:
            log.warning("could not record the pass", extra=kv(service=record["service"],
                                                              error=describe_db_error(exc)))

    def _refresh_stats(self) -> None:
        from .status import apply_job_gauges, job_gauge_values

        stop_event = self._stop_event
        now = time.monotonic()
        final = now - self._final_counted_at >= FINAL_STATS_INTERVAL
        try:
            counts, oldest = job_gauge_values(self.engine, self.settings, final=final)
        except Exception as exc:
            log.debug("could not refresh job gauges", extra=kv(error=describe_db_error(exc)))
            return
        with self._lock:
            if stop_event.is_set():  # leadership ended meanwhile: followers export no job gauges
                return
            apply_job_gauges(self.metrics, counts, oldest, final=final)
        if final:
            self._final_counted_at = now


def _trigger_key(trigger: BaseTrigger) -> Any:
    """What makes two triggers the same schedule (reprs carry a fresh start date)."""
    if isinstance(trigger, IntervalTrigger):
        return ("interval", trigger.interval)
    if isinstance(trigger, CronTrigger):
        return ("cron", str(trigger), str(trigger.timezone))
    return ("other", repr(trigger))


def _cancel(ctx: PassContext) -> None:
    """Cancel the query of a pass in a thread of its own: a cancel request opens a new
    connection, which must not hold up a demotion when the server is unreachable."""
    conn = ctx.current
    if conn is None:
        return
    try:
        raw = conn.connection.dbapi_connection
    except Exception:  # pragma: no cover - the connection may be gone already
        return
    if raw is None:
        return

    def cancel() -> None:
        try:
            raw.cancel_safe(timeout=CANCEL_TIMEOUT)
        except Exception:  # the pass ends anyway: statement timeout or a dead connection
            pass

    threading.Thread(target=cancel, name="maintd-cancel", daemon=True).start()


def cli_run_once(args: argparse.Namespace) -> int:
    from .config import load_settings
    from .leader import acquire_once
    from .logs import setup_logging

    settings = load_settings(args.config)
    setup_logging(settings.log.level, settings.log.format)
    service = SERVICES[args.service](settings)
    engine = maintenance_engine(settings, pool_size=2)
    stop_event = threading.Event()
    held = None
    try:
        if args.dry_run:
            fence: Fence = NoFence()
        else:
            # The lock is renewed in a thread while the pass runs; losing it stops the pass.
            held = acquire_once(settings, wait=args.wait, on_demoted=lambda reason: stop_event.set())
            if held is None:
                leader = _current_leader(engine, settings)
                print(f"maintd: error: another instance holds the leader lock ({leader}); "
                      "stop it, use --wait, or run with --dry-run", file=sys.stderr)
                return 1
            fence = held[1]
        ctx = PassContext(engine=engine, settings=settings, clock=SystemClock(), fence=fence,
                          dry_run=args.dry_run, stop_event=stop_event)
        outcome, result, error = execute_pass(service, ctx)
        out = {"service": service.name, "dry_run": args.dry_run, "outcome": outcome,
               "result": result.as_dict() if result is not None else None}
        if error:
            out["error"] = error
        print(json.dumps(out, indent=2, default=str))
        return 0 if outcome == "success" else 1
    finally:
        if held is not None:
            held[0].stop()
        engine.dispose()


def _current_leader(engine: Engine, settings: Settings) -> str:
    try:
        with engine.connect() as conn:
            row = conn.execute(sql("SELECT instance_id, host, pid, epoch FROM {schema}.leader", settings.schema)).first()
        if row is None or row.instance_id is None:
            return "unknown"
        return f"instance={row.instance_id} host={row.host} pid={row.pid} epoch={row.epoch}"
    except Exception as exc:
        return f"unknown: {describe_db_error(exc)}"
