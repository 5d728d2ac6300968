"""The daemon: leader elector + service runner + HTTP, signals, reloads, systemd readiness."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from typing import Any

from sqlalchemy import text

from . import migrate
from .clock import Clock, SystemClock
from .config import ConfigError, Settings, load_settings
from .db import describe_db_error, quote_ident
from .http import HttpServer, as_json, metrics_body
from .http import text as text_body
from .leader import LeaderElector, LeaderToken
from .logs import kv, setup_logging
from .metrics import Metrics
from .runner import Runner, maintenance_engine
from .sdnotify import SystemdNotifier

log = logging.getLogger("maintd")


class SchemaNotReady(RuntimeError):
    pass


def _transient(exc: Exception) -> bool:
    """Worth waiting for (server down or restarting) vs. needs a human (bad role, password,
    database name): the server's FATAL rejections are final unless they say it is starting."""
    orig = getattr(exc, "orig", exc)
    if getattr(orig, "sqlstate", None):
        return str(orig.sqlstate).startswith(("08", "57P"))
    msg = str(orig).lower()
    if "fatal:" in msg:
        return any(t in msg for t in ("starting up", "shutting down", "in recovery", "too many"))
    return True


class Daemon:
    def __init__(self, settings: Settings, *, clock: Clock | None = None,
                 config_path: str | None = None, metrics: Metrics | None = None):
        self.settings = settings
        self.config_path = config_path
        self.clock = clock or SystemClock()
        self.metrics = metrics or Metrics()
        self.engine = maintenance_engine(settings)
        self.elector = LeaderElector(settings, on_elected=self._elected, on_demoted=self._demoted,
                                     on_health=self._health)
        self.runner = Runner(settings, self.engine, self.metrics, clock=self.clock,
                             on_fenced=self._fenced)
        self.http: HttpServer | None = None
        self.notifier = SystemdNotifier()
        self._stopping = threading.Event()
        self._reload_requested = threading.Event()
        self._last_tick: float | None = None  # set by tick(); None while nobody ticks
        self._started = False
        self._db_ok = False

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return self.elector.is_leader

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http else None

    def check_schema(self) -> None:
        """Fail fast (exit 1) with one line when the schema is missing or behind."""
        schema = self.settings.schema
        with self.engine.connect() as conn:
            current = migrate.current_revision(conn, schema)
            has_jobs = conn.execute(text("SELECT to_regclass(:t) IS NOT NULL"),
                                    {"t": f"{quote_ident(schema)}.jobs"}).scalar()
        head = migrate.head_revision()
        if current is None or not has_jobs:
            raise SchemaNotReady(f"schema {schema!r} has no maintd tables: run `maintd migrate` first")
        if current != head:
            raise SchemaNotReady(f"schema {schema!r} is at revision {current}, this maintd needs "
                                 f"{head}: run `maintd migrate`")

    def wait_for_database(self) -> None:
        """At start: retry while the server is unreachable (it may be starting too), but fail at
        once on what waiting cannot fix (bad password, missing database or schema)."""
        from sqlalchemy.exc import OperationalError

        delay = 0.2
        while True:
            try:
                self.check_schema()
                return
            except OperationalError as exc:
                if not _transient(exc) or self._stopping.is_set():
                    raise  # authentication, missing database, ...: a human must act
                log.warning("database unreachable, retrying in %.1fs", delay,
                            extra=kv(error=describe_db_error(exc)))
                if self._stopping.wait(delay):
                    raise
                delay = min(5.0, delay * 2)

    def start(self) -> None:
        self.wait_for_database()
        self._db_ok = True
        if self.settings.http.enabled:
            self.http = HttpServer(self.settings.http.host, self.settings.http.port, {
                "/metrics": lambda: metrics_body(self.metrics.render),
                "/healthz": self._healthz,
                "/readyz": self._readyz,
                "/status": self._status,
            })
            self.http.start()
            log.info("http listening", extra=kv(address=f"{self.settings.http.host}:{self.http.port}"))
        self.runner.start()
        self.elector.start()
        self._started = True
        log.info("maintd started", extra=kv(instance=self.settings.instance_id, schema=self.settings.schema))

    def stop(self, timeout: float = 10.0) -> None:
        if not self._started:
            return
        self._started = False
        self._stopping.set()
        self.notifier.stopping()
        self.runner.deactivate("shutdown")
        self.elector.stop(timeout)
        self.runner.shutdown()
        if self.http:
            self.http.stop()
        self.engine.dispose()
        log.info("maintd stopped", extra=kv(instance=self.settings.instance_id))

    def reload(self, settings: Settings) -> None:
        if settings.schema != self.settings.schema or settings.database_url != self.settings.database_url:
            log.warning("config reload: database_url and schema changes need a restart; kept the old ones")
            settings = settings.model_copy(update={"schema": self.settings.schema,
                                                   "database_url": self.settings.database_url})
        settings = settings.model_copy(update={"instance_id": self.settings.instance_id})
        self.settings = settings
        self.elector.update_settings(settings)
        self.runner.reload(settings)
        setup_logging(settings.log.level, settings.log.format)
        enabled = [n for n, s in self.runner.services.items() if s.enabled()]
        log.info("config reloaded", extra=kv(services=",".join(enabled) or "none",
                                             periodic=len(settings.periodic)))

    def reload_from_file(self) -> bool:
        """SIGHUP: apply the config file; an invalid one changes nothing."""
        try:
            settings = load_settings(self.config_path)
        except ConfigError as exc:
            log.error("config reload rejected, keeping the old config",
                      extra=kv(problems="; ".join(exc.problems)))
            return False
        old = self.settings
        try:
            self.reload(settings)
        except Exception as exc:  # never let a reload take the daemon down
            log.error("config reload failed, keeping the old config", extra=kv(error=str(exc)))
            self.reload(old)
            return False
        return True

    # -- callbacks ------------------------------------------------------------------------
    def _elected(self, token: LeaderToken) -> None:
        self.metrics.is_leader.set(1)
        self.metrics.leadership_changes.inc()
        self.runner.activate(self.elector.fence())
        self.notifier.status(f"leader (epoch {token.epoch})")

    def _demoted(self, reason: str) -> None:
        self.metrics.is_leader.set(0)
        self.metrics.leadership_changes.inc()
        self.runner.deactivate(reason)
        self.notifier.status(f"follower ({reason})")

    def _fenced(self, reason: str, fence: Any) -> None:
        """The database refused a pass of the current term: give that term up."""
        self.elector.request_demotion(reason, getattr(fence, "epoch", None))

    def _health(self, ok: bool) -> None:
        self._db_ok = ok
        self.metrics.up.set(1 if ok else 0)

    # -- HTTP -----------------------------------------------------------------------------
    def health_problem(self) -> str | None:
        """None while healthy, else why not (for /healthz)."""
        now = time.monotonic()
        cfg = self.settings.leader
        stall = (cfg.lease + max(cfg.retry_interval, cfg.renew_interval)).total_seconds()
        if not self._db_ok:
            return "database unreachable"
        if not self.elector.alive:
            return "leader election thread not running"
        if now - self.elector.last_progress > stall:
            return "leader election loop stalled (database connection hanging?)"
        if self._last_tick is not None and now - self._last_tick > 10:
            return "main loop stalled"
        return None

    def _healthz(self) -> tuple[int, str, bytes]:
        problem = self.health_problem()
        if problem is None:
            return text_body(200, "ok\n")
        return text_body(503, f"unhealthy: {problem}\n")

    def _readyz(self) -> tuple[int, str, bytes]:
        if self._started and self.elector.healthy:
            return text_body(200, "ready\n")
        return text_body(503, "not ready\n")

    def _status(self) -> tuple[int, str, bytes]:
        from .status import collect_status

        try:
            data: dict[str, Any] = collect_status(self.engine, self.settings)
            status = 200
        except Exception as exc:
            data, status = {"error": describe_db_error(exc)}, 503
        data["this_instance"] = {"instance_id": self.settings.instance_id, "is_leader": self.is_leader,
                                 "database_ok": self._db_ok, "last_runs": self.runner.last_runs}
        return as_json(status, data)

    # -- main loop ------------------------------------------------------------------------
    def tick(self) -> None:
        """Called a few times a second by :meth:`run_forever` (and tests)."""
        self._last_tick = time.monotonic()
        token = self.elector.token
        if token is not None and not self.elector.lease_valid():
            # The elector thread may be stuck in a network call: stop the passes right now.
            self.runner.deactivate("lease expired")
            self.elector.request_demotion("lease expired", token.epoch)
        if self._reload_requested.is_set():
            self._reload_requested.clear()
            self.reload_from_file()

    def run_forever(self) -> int:
        def on_stop(signum: int, frame: Any) -> None:
            log.info("received %s, stopping", signal.Signals(signum).name)
            self._stopping.set()

        def on_hup(signum: int, frame: Any) -> None:
            self._reload_requested.set()

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGHUP, on_hup)
        self.start()
        self.notifier.ready()
        last_ping = 0.0
        try:
            while not self._stopping.wait(0.2):
                try:
                    self.tick()
                except Exception as exc:  # the main loop must survive anything a tick meets
                    log.error("main loop error", extra=kv(error=describe_db_error(exc)))
                interval = self.notifier.watchdog_interval
                if interval and time.monotonic() - last_ping >= interval:
                    self.notifier.watchdog()
                    last_ping = time.monotonic()
        finally:
            self.stop()
        return 0


def cli_run(args: argparse.Namespace) -> int:
    import sys

    settings = load_settings(args.config)
    setup_logging(settings.log.level, settings.log.format)
    daemon = Daemon(settings, config_path=args.config)
    try:
        return daemon.run_forever()
    except SchemaNotReady as exc:
        print(f"maintd: error: {exc}", file=sys.stderr)
        return 1
