"""The one place that runs service passes: scheduling (APScheduler), leadership gating, fencing,
timing, metrics, error handling and the ``service_runs`` record. Services hold only their logic.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from datetime import datetime, timezone
from typing import Callable

from apscheduler.schedulers.background import BackgroundScheduler
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


def build_services(settings: Settings) -> dict[str, Service]:
    return {name: cls(settings) for name, cls in SERVICES.items()}


def maintenance_engine(settings: Settings, *, pool_size: int = 4) -> Engine:
    """Pooled connections for maintenance transactions, bounded by the statement timeout; a
    frozen process's open transaction is ended by the server within the lease."""
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
        result = service.run_once(ctx)
        outcome = "success"
    except NotLeader as exc:
        outcome, error = "fenced", str(exc)
        slog.warning("pass refused: not the leader", extra=kv(service=name, reason=str(exc)))
    except PassStopped:
        outcome, error = "stopped", "stopped: leadership lost or shutting down"
    except Exception as exc:  # a failing pass never kills the daemon
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
        slog.info("%s %s", name, result.summary(), extra=kv(seconds=round(elapsed, 3)))
    return outcome, result, error


class Runner:
    """Schedules the enabled services while this instance leads."""

    def __init__(self, settings: Settings, engine: Engine, metrics: Metrics, *,
                 clock: Clock | None = None, on_fenced: Callable[[str], None] | None = None):
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.clock = clock or SystemClock()
        self.on_fenced = on_fenced or (lambda reason: None)
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
            self._fence = None
            self._stop_event.set()
            for job in self.scheduler.get_jobs():
                job.remove()
            active = list(self._active.values())
        for ctx in active:
            _cancel(ctx)
        deadline = time.monotonic() + timeout
        while self._active and time.monotonic() < deadline:
            time.sleep(0.01)

    def reload(self, settings: Settings) -> None:
        with self._lock:
            self.settings = settings
            self.services = build_services(settings)
            if self._fence is not None:
                for job in self.scheduler.get_jobs():
                    job.remove()
                self._schedule_all()

    def _schedule_all(self) -> None:
        now = datetime.now(timezone.utc)
        for name, service in self.services.items():
            try:
                if not service.enabled():
                    continue
                trigger = service.trigger()
            except Exception as exc:  # one broken service must not keep the others from running
                log.error("cannot schedule service", extra=kv(service=name, error=str(exc)))
                continue
            # Interval services run at once on election; cron ones (reindexer) at their time.
            first = {"next_run_time": now} if isinstance(trigger, IntervalTrigger) else {}
            self.scheduler.add_job(self._run, trigger=trigger, args=[name], id=name, name=name,
                                   replace_existing=True, **first)
            if not isinstance(trigger, IntervalTrigger):
                job = self.scheduler.get_job(name)
                log.info("scheduled", extra=kv(service=name, next_run=job.next_run_time if job else None))
        self.scheduler.add_job(self._refresh_stats, IntervalTrigger(seconds=STATS_INTERVAL),
                               id="_stats", next_run_time=now, replace_existing=True)

    # -- one pass -------------------------------------------------------------------------
    def _run(self, name: str) -> None:
        with self._lock:
            fence, stop_event = self._fence, self._stop_event
            service = self.services.get(name)
        if fence is None or service is None or stop_event.is_set():
            return
        ctx = PassContext(engine=self.engine, settings=service.settings, clock=self.clock, fence=fence,
                          stop_event=stop_event, log=logging.getLogger(f"maintd.{name}"))
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
            self.on_fenced(error or "fenced")
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
            self.on_fenced(str(exc))
        except PassStopped:
            pass
        except Exception as exc:
            log.warning("could not record the pass", extra=kv(service=record["service"],
                                                              error=describe_db_error(exc)))

    def _refresh_stats(self) -> None:
        from .status import refresh_job_gauges

        now = time.monotonic()
        final = now - self._final_counted_at >= FINAL_STATS_INTERVAL
        try:
            refresh_job_gauges(self.engine, self.settings, self.metrics, final=final)
            if final:
                self._final_counted_at = now
        except Exception as exc:
            log.debug("could not refresh job gauges", extra=kv(error=describe_db_error(exc)))


def _cancel(ctx: PassContext) -> None:
    conn = ctx.current
    if conn is None:
        return
    try:
        raw = conn.connection.dbapi_connection
        if raw is not None:
            cancel = getattr(raw, "cancel_safe", None) or raw.cancel
            cancel()
    except Exception:  # pragma: no cover - the connection may be gone already
        pass


def cli_run_once(args: argparse.Namespace) -> int:
    from .config import load_settings
    from .leader import acquire_once
    from .logs import setup_logging

    settings = load_settings(args.config)
    setup_logging(settings.log.level, settings.log.format)
    service = SERVICES[args.service](settings)
    engine = maintenance_engine(settings, pool_size=2)
    held = None
    try:
        if args.dry_run:
            fence: Fence = NoFence()
        else:
            held = acquire_once(settings, wait=args.wait)
            if held is None:
                leader = _current_leader(engine, settings)
                print(f"maintd: error: another instance holds the leader lock ({leader}); "
                      "stop it, use --wait, or run with --dry-run", file=__import__("sys").stderr)
                return 1
            fence = held[1]
        ctx = PassContext(engine=engine, settings=settings, clock=SystemClock(), fence=fence,
                          dry_run=args.dry_run)
        outcome, result, error = execute_pass(service, ctx)
        out = {"service": service.name, "dry_run": args.dry_run, "outcome": outcome,
               "result": result.as_dict() if result is not None else None}
        if error:
            out["error"] = error
        print(json.dumps(out, indent=2, default=str))
        return 0 if outcome == "success" else 1
    finally:
        if held is not None:
            held[0]._release()
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
