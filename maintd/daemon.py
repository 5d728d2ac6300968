"""The daemon process: leader elector + service runner + HTTP, signals, reloads, systemd
readiness. (``maintd run`` in :mod:`maintd.cli` starts it.)"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

from sqlalchemy import text

from . import migrate
from .clock import Clock, ServerClock
from .config import ConfigError, Settings, load_settings
from .dashboard import Dashboard
from .db import HostOrder, describe_db_error
from .http import HttpServer, as_json, metrics_body
from .http import text as text_body
from .identifiers import qualified
from .leader import LeaderElector, Term
from .logs import kv, setup_logging
from .metrics import Metrics
from .passes import maintenance_engine
from .queries import catalog
from .runner import Runner
from .sdnotify import SystemdNotifier

log = logging.getLogger("maintd")


class SchemaNotReady(RuntimeError):
    pass


class HttpListenError(RuntimeError):
    """The HTTP listener cannot bind (``http.listen`` names the address)."""


# Keys a reload cannot change in a running process (kept, with a log line naming them).
RESTART_ONLY = ("database_url", "schema", "instance_id", "http", "leader", "statement_timeout")


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
        self.clock = clock or ServerClock()
        self.metrics = metrics or Metrics(target=settings.schema, max_queues=settings.metrics.max_queues)
        hosts = HostOrder(settings.database_url.get_secret_value())  # multi-host URLs: who answers
        self.engine = maintenance_engine(settings, hosts=hosts)
        self.elector = LeaderElector(settings, on_elected=self._elected, on_demoted=self._demoted,
                                     on_health=self._health, hosts=hosts)
        self.runner = Runner(settings, self.engine, self.metrics, clock=self.clock,
                             on_fenced=self._fenced)
        self.http: HttpServer | None = None
        self.notifier = SystemdNotifier()
        self._stopping = threading.Event()
        self._reload_requested = threading.Event()
        self._last_tick: float | None = None  # set by tick(); None while nobody ticks
        self._started = False
        self._db_ok = False
        self._maintenance_stall: str | None = None  # why the last term was given up, if stalled

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
            has_jobs = conn.execute(text(catalog.TABLE_EXISTS), {"qualified": qualified(schema, "jobs")}).scalar()
        head = migrate.head_revision()
        if current is None or not has_jobs:
            raise SchemaNotReady(f"schema {schema!r} has no maintd tables: run `maintd migrate` first")
        if current != head:
            raise SchemaNotReady(f"schema {schema!r} is at revision {current}, this maintd needs "
                                 f"{head}: run `maintd migrate`")

    def wait_for_database(self) -> bool:
        """At start: retry while the server is unreachable (it may be starting too), but fail at
        once on what waiting cannot fix (bad password, missing database or schema). False when a
        stop was asked for meanwhile."""
        from sqlalchemy.exc import OperationalError

        delay = 0.2
        while not self._stopping.is_set():
            try:
                self.check_schema()
                return True
            except OperationalError as exc:
                if not _transient(exc):
                    raise  # authentication, missing database, ...: a human must act
                log.warning("database unreachable, retrying in %.1fs", delay,
                            extra=kv(error=describe_db_error(exc)))
                self._stopping.wait(delay)
                delay = min(5.0, delay * 2)
        return False

    def start_http(self) -> None:
        """The listener comes first, so probes answer during the start-up retries (/readyz 503)."""
        if not self.settings.http.enabled or self.http is not None:
            return
        address = self.settings.http.listen
        try:
            self.http = HttpServer(self.settings.http.host, self.settings.http.port, {
                "/metrics": lambda: metrics_body(self.metrics.render),
                "/healthz": self._healthz,
                "/readyz": self._readyz,
                "/status": self._status,
            }, pages=Dashboard(lambda: self.settings).pages(),  # /, /jobs, /jobs/{id}
               auth_token=lambda: self.settings.http.auth_token)  # all but the probes and /metrics
        except OSError as exc:
            raise HttpListenError(f"http.listen {address}: cannot listen: {exc.strerror or exc}") from None
        self.http.start()
        log.info("http listening", extra=kv(address=f"{self.settings.http.host}:{self.http.port}"))

    def start(self) -> bool:
        """HTTP, then the database, then the runner and the elector. False when stopped during
        the start-up retries."""
        self.start_http()
        if not self.wait_for_database():
            return False
        self._db_ok = True
        self.runner.start()
        self._first_lock_session()
        self.elector.start()
        self._started = True
        log.info("maintd started", extra=kv(instance=self.settings.instance_id, schema=self.settings.schema))
        return True

    def _first_lock_session(self) -> None:
        """Open the lock session before the elector thread starts, so that a pooler that cannot
        keep a session (pool_mode=transaction) ends the start with exit 1 and no lock taken."""
        import psycopg

        from .leader import LeaderSessionError

        try:
            self.elector.connect()
        except LeaderSessionError:
            self.runner.shutdown()
            raise
        except (psycopg.Error, OSError) as exc:  # the elector thread retries
            log.warning("could not open the lock session yet", extra=kv(error=describe_db_error(exc)))

    def stop(self, timeout: float = 10.0) -> None:
        if not self._started:
            if self.http:
                self.http.stop()
                self.http = None
            return
        self._started = False
        self._stopping.set()
        self.notifier.stopping()
        self.runner.deactivate()
        self.elector.stop(timeout)
        self.runner.shutdown()
        if self.http:
            self.http.stop()
        self.engine.dispose()
        log.info("maintd stopped", extra=kv(instance=self.settings.instance_id))

    def reload(self, settings: Settings) -> None:
        changed = [k for k in RESTART_ONLY if getattr(settings, k) != getattr(self.settings, k)
                   and not (k == "http" and settings.http.listen == self.settings.http.listen
                            and settings.http.enabled == self.settings.http.enabled)]
        if "instance_id" in changed and self.config_path is not None:
            changed.remove("instance_id")  # a default derived from the pid, not set in the file
        if changed:
            log.warning("config reload: %s needs a restart; kept the old value", ", ".join(changed),
                        extra=kv(keys=",".join(changed)))
        keep = {k: getattr(self.settings, k) for k in RESTART_ONLY if k != "http"}
        keep["http"] = self.settings.http.model_copy(update={"auth_token": settings.http.auth_token})
        settings = settings.model_copy(update=keep)
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
    def _elected(self, term: Term) -> None:
        self._maintenance_stall = None
        # Idle pooled connections may lead to a server that has since gone silent (a frozen old
        # primary): a term starts with fresh ones, to the server the lock session reached.
        self.engine.dispose()
        self.metrics.is_leader.set(1)
        self.metrics.leadership_changes.inc()
        self.runner.activate(self.elector.fence())
        self.notifier.status(f"leader (epoch {term.epoch})")

    def _demoted(self, reason: str) -> None:
        self.metrics.is_leader.set(0)
        self.metrics.leadership_changes.inc()
        self.runner.deactivate()
        self.notifier.status(f"follower ({reason})")

    def _fenced(self, reason: str, fence: Any) -> None:
        """The database refused a pass of the current term: give that term up."""
        self.elector.request_demotion(reason, fence.epoch)

    def _health(self, ok: bool) -> None:
        self._db_ok = ok
        self.metrics.up.set(1 if ok else 0)

    # -- HTTP -----------------------------------------------------------------------------
    def health_problem(self) -> str | None:
        """None while the process and its loops are alive, else why not (for /healthz; whether
        the database can be reached is /readyz's business)."""
        now = time.monotonic()
        cfg = self.settings.leader
        stall = (cfg.lease + max(cfg.retry_interval, cfg.renew_interval)).total_seconds()
        if self._maintenance_stall is not None:
            return self._maintenance_stall
        if not self._started:
            return None  # starting: waiting for the database is alive and well (/readyz says 503)
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
        from .periodic_table import list_entries
        from .status import collect_status

        try:
            data: dict[str, Any] = collect_status(self.engine, self.settings.schema)
            data["periodic"] = list_entries(self.engine, self.settings)
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
        term = self.elector.term
        if term is not None and not term.trusted():
            # The elector thread may be stuck in a network call: stop the passes right now, and
            # stop saying we lead.
            self.metrics.is_leader.set(0)
            self.runner.deactivate()
            self.elector.request_demotion("lease expired", term.epoch)
        self._check_progress(term)
        self._check_election()
        if self._reload_requested.is_set():
            self._reload_requested.clear()
            self.reload_from_file()

    def _check_election(self) -> None:
        """The election loop goes round at least every renew/retry interval; one stuck for a
        lease in a call to a silent server (frozen primary, partition) has its socket shut down,
        so it reconnects (with a multi-host URL, to whichever server now accepts writes)."""
        stuck = time.monotonic() - self.elector.last_progress
        if self._started and stuck > self.settings.leader.lease.total_seconds() and self.elector.session.open:
            log.warning("the lock session is not answering, reconnecting", extra=kv(seconds=round(stuck, 1)))
            self.elector.session.sever()
            self.elector.last_progress = time.monotonic()

    def _check_progress(self, term: Term | None) -> None:
        """A leader whose maintenance transactions hang (the server or the network silent while
        the lock session is fine) gives up the term after a lease without progress."""
        stalled = self.runner.stalled_for()
        lease = self.settings.leader.lease.total_seconds()
        if term is not None and stalled > lease:
            self._maintenance_stall = (f"maintenance connections made no progress for {stalled:.0f}s: "
                                       f"gave up epoch {term.epoch}")
            log.error("maintenance transactions hang, giving up leadership",
                      extra=kv(epoch=term.epoch, seconds=round(stalled, 1)))
            self.metrics.is_leader.set(0)
            self.runner.deactivate()
            self.runner.sever_stalled(lease)  # a silent server answers no cancel either
            # Stay a follower for a few leases: a replica whose connections work goes first.
            self.elector.request_demotion("maintenance connections hang", term.epoch, hold_off=3 * lease)

    def run_forever(self) -> int:
        def on_stop(signum: int, frame: Any) -> None:
            log.info("received %s, stopping", signal.Signals(signum).name)
            self._stopping.set()

        def on_hup(signum: int, frame: Any) -> None:
            self._reload_requested.set()

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGHUP, on_hup)
        try:
            if not self.start():
                log.info("stopped during start-up")
                return 0
        except BaseException:
            self.stop()
            raise
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
            # Exiting now: a second SIGTERM (an impatient supervisor) must not kill the process
            # while the interpreter shuts down, where Python's own handlers are gone.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return 0
