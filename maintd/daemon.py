"""The daemon process: one unit (leader elector + service runner) per target, the HTTP listener,
signals, reloads, systemd readiness. (``maintd run`` in :mod:`maintd.cli` starts it.)

With ``[[targets]]`` (SPEC 7.9) the units share the HTTP listener, the Prometheus registry (one
``target`` label each) and one maintenance engine per database; each has its own lock session,
leadership and fencing, and :class:`maintd.spread.Spread` shares the leaderships out between the
replicas. A target whose database is down or whose schema is missing does not stop the others:
it is retried in the background and reported by ``/readyz`` and ``/status``."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from .clock import Clock, ServerClock
from .config import ConfigError, Settings, _target_settings, load_settings
from .dashboard import Dashboard
from .db import HostOrder, connect, describe_db_error, ms
from .guardian import HealthMonitor, monitors
from .http import HttpServer, as_json, metrics_body
from .http import text as text_body
from .lockconn import LOCK_GROUP, LockConnection
from .logs import kv, setup_logging
from .metrics import Metrics
from .passes import maintenance_engine
from .queries import daemons as q_daemons
from .queries import psycopg_sql
from .sdnotify import SystemdNotifier
from .runner import new_timetable
from .services import SERVICES
from .spread import Spread
from .target import SchemaNotReady, TargetUnit

log = logging.getLogger("maintd")

__all__ = ["Daemon", "HttpListenError", "SchemaNotReady", "pass_workers", "pool_size"]

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


def pool_size(targets: int) -> int:
    """Maintenance connections kept per database engine: a pass holds one while it works (not
    while it sleeps until the next due job, see PassContext.sleep), so one target needs at most one
    per service plus the job gauges. Several targets share the pool; a pass waiting for a connection
    counts as a stalled one (a lease of that gives the term up), so it grows with them, half a
    connection per target (+2 overflow; all opened on demand)."""
    one = len(SERVICES) + 1
    return one if targets <= 1 else min(100, one + targets // 2)


def pass_workers(targets: int) -> int:
    """Threads running the passes of the targets of one process (started on demand): the
    scheduler's and the rescuer's passes of each leading target sleep until their next due time
    (without a connection, see PassContext.sleep), so two per target, plus some for the others."""
    return min(1000, 10 + 2 * targets)


def _engine_key(s: Settings) -> tuple:
    return (s.database_url.get_secret_value(), s.statement_timeout, s.leader.lease)


class Daemon:
    def __init__(self, settings: Settings, *, clock: Clock | None = None,
                 config_path: str | None = None, metrics: Metrics | None = None):
        self.settings = settings
        self.config_path = config_path
        self.clock = clock or ServerClock()
        self.multi = bool(settings.targets)
        targets = settings.target_settings()
        per_engine = Counter(_engine_key(t) for t in targets)
        self.engines: dict[tuple, Engine] = {}
        self.hosts: dict[tuple, HostOrder] = {}  # multi-host URLs: who answers (engine + lock sessions)
        self.lock_conns: dict[str, list[LockConnection]] = {}  # per database URL
        per_database: Counter[str] = Counter()
        self.units: list[TargetUnit] = []
        shared = metrics
        # One scheduler thread and one pool of pass threads for every target of the process.
        self.timetable = new_timetable(pass_workers(len(targets))) if self.multi else None
        for t in targets:
            key = _engine_key(t)
            if key not in self.engines:
                self.hosts[key] = HostOrder(t.database_url.get_secret_value())
                self.engines[key] = maintenance_engine(t, pool_size=pool_size(per_engine[key]), hosts=self.hosts[key])
            # The targets of a database share lock sessions, LOCK_GROUP targets to a session.
            url = t.database_url.get_secret_value()
            if per_database[url] % LOCK_GROUP == 0:
                self.lock_conns.setdefault(url, []).append(LockConnection(t, self.hosts[key]))
            per_database[url] += 1
            unit_metrics = shared if shared is not None and not self.units else \
                Metrics(target=t.target_name, max_queues=settings.metrics.max_queues, shared=shared)
            shared = shared or unit_metrics
            self.units.append(TargetUnit(t, self.engines[key], unit_metrics, self.clock, hosts=self.hosts[key],
                                         lock_conn=self.lock_conns[url][-1],
                                         on_change=self._changed, timetable=self.timetable))
        # One table-health monitor per database (SPEC 8.2), for the targets this replica leads there.
        groups: dict[tuple, tuple[Engine, list[TargetUnit]]] = {}
        for unit in self.units:
            groups.setdefault(_engine_key(unit.settings), (unit.engine, []))[1].append(unit)
        self.health: list[HealthMonitor] = monitors(groups, lambda: self.settings.health)
        lead = settings.leader
        self.spread = Spread(self.units, me=settings.instance_id, retry_interval=lead.retry_interval.total_seconds(),
                             settle=lead.lease.total_seconds(), lease=lead.lease.total_seconds(),
                             live_replicas=self._live_replicas)
        if self.multi:
            for unit in self.units:
                unit.elector.gate = partial(self.spread.gate, unit.name)
                unit.elector.tried = partial(self.spread.tried, unit.name)
        self.http: HttpServer | None = None
        self.notifier = SystemdNotifier()
        self._stopping = threading.Event()
        self._reload_requested = threading.Event()
        self._last_tick: float | None = None  # set by tick(); None while nobody ticks
        self._started = False
        self._retry_thread: threading.Thread | None = None
        self._spread_conns: dict[tuple, Any] = {}  # per database: the spread's reads (several targets)

    # -- the first target (the only one without [[targets]]) ------------------------------
    @property
    def unit(self) -> TargetUnit:
        return self.units[0]

    @property
    def elector(self):  # noqa: ANN201
        return self.unit.elector

    @property
    def runner(self):  # noqa: ANN201
        return self.unit.runner

    @property
    def metrics(self) -> Metrics:
        return self.unit.metrics

    @property
    def engine(self) -> Engine:
        return self.unit.engine

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return any(u.is_leader for u in self.units)

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http else None

    def check_schema(self) -> None:
        """Fail fast (exit 1) with one line when the schema is missing or behind."""
        self.unit.check_schema()

    def wait_for_database(self) -> bool:
        """At start: retry while the server is unreachable (it may be starting too), but fail at
        once on what waiting cannot fix (bad password, missing database or schema). False when a
        stop was asked for meanwhile."""
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
            }, pages=Dashboard(lambda: self.settings, health=self.health_status).pages(),  # /, /jobs, /jobs/{id}
               auth_token=lambda: self.settings.http.auth_token)  # all but the probes and /metrics
        except OSError as exc:
            raise HttpListenError(f"http.listen {address}: cannot listen: {exc.strerror or exc}") from None
        self.http.start()
        log.info("http listening", extra=kv(address=f"{self.settings.http.host}:{self.http.port}"))

    def start(self) -> bool:
        """HTTP, then the database, then the runner and the elector. False when stopped during
        the start-up retries."""
        self.start_http()
        if self.multi:
            return self._start_targets()
        if not self.wait_for_database():
            return False
        self.unit.db_ok = True
        self.runner.start()
        self._first_lock_session()
        self.elector.start()
        self.unit.started = True
        self._started = True
        for monitor in self.health:
            monitor.start()
        log.info("maintd started", extra=kv(instance=self.settings.instance_id, schema=self.settings.schema))
        return True

    def _start_targets(self) -> bool:
        """Every target whose schema is ready starts now; the others are retried in the
        background (a target's outage or missing schema must not stop the rest)."""
        if self.timetable is not None:
            self.timetable.start()
        self.spread.hold()  # no tries until every target is started and the replicas are read
        waiting = [u for u in self.units if not self._try_start(u)]
        self.spread.started()
        self._started = True
        for monitor in self.health:
            monitor.start()
        if waiting:
            self._retry_thread = threading.Thread(target=self._retry_targets, args=(waiting,),
                                                  name="maintd-targets", daemon=True)
            self._retry_thread.start()
        log.info("maintd started", extra=kv(instance=self.settings.instance_id, targets=len(self.units),
                                            waiting=len(waiting)))
        return True

    def _try_start(self, unit: TargetUnit) -> bool:
        try:
            unit.check_schema()
        except (OperationalError, SchemaNotReady) as exc:
            problem = describe_db_error(exc)
            if problem != unit.problem:
                log.error("target not started, retrying in the background",
                          extra=kv(target=unit.name, error=problem))
            unit.problem, unit.db_ok = problem, False
            return False
        unit.db_ok = True
        unit.start()
        return True

    def _retry_targets(self, waiting: list[TargetUnit]) -> None:
        delay = 0.5
        while waiting and not self._stopping.wait(delay):
            waiting = [u for u in waiting if not self._try_start(u)]
            delay = min(5.0, delay * 2)

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
        started = [u for u in self.units if u.started]
        if len(started) == 1:
            started[0].stop(timeout)
        elif started:  # every lock released at once, not one after the other
            with ThreadPoolExecutor(min(32, len(started)), thread_name_prefix="maintd-stop") as pool:
                list(pool.map(lambda u: u.stop(timeout), started))
        for monitor in self.health:
            monitor.stop()
        if self.timetable is not None:
            self.timetable.shutdown(wait=False)
        if self.http:
            self.http.stop()
        for engine in self.engines.values():
            engine.dispose()
        for conn in self._spread_conns.values():
            conn.close()
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
        self._reload_units(settings)
        setup_logging(settings.log.level, settings.log.format)
        enabled = [n for n, s in self.runner.services.items() if s.enabled()]
        log.info("config reloaded", extra=kv(services=",".join(enabled) or "none",
                                             periodic=len(settings.periodic)))

    def _reload_units(self, settings: Settings) -> None:
        """Each unit gets its target's new sections; adding, removing or moving a target needs a
        restart (kept as it was, with a log line)."""
        if not self.multi or not settings.targets:
            if self.multi or settings.targets:
                log.warning("config reload: targets needs a restart; kept the old value", extra=kv(keys="targets"))
                return
            self.unit.reload(settings)
            return
        settings._targets = _target_settings(settings)  # over the kept restart-only keys
        new = {t.target_name: t for t in settings.target_settings()}
        old = {u.name: u for u in self.units}
        moved = [n for n, u in old.items() if n not in new or _engine_key(new[n]) != _engine_key(u.settings)
                 or new[n].schema != u.settings.schema] + [n for n in new if n not in old]
        if moved:
            log.warning("config reload: targets need a restart to be added, removed or moved; kept "
                        "those as they were", extra=kv(targets=",".join(moved)))
        for name, unit in old.items():
            if name in new and name not in moved:
                unit.reload(new[name])

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
    def _changed(self, unit: TargetUnit) -> None:
        if not self.multi:
            self.notifier.status(f"leader ({unit.last_reason})" if unit.is_leader
                                 else f"follower ({unit.last_reason})")
        else:
            self.notifier.status(f"leading {self.spread.leading()} of {len(self.units)} targets")

    def _live_replicas(self) -> list[str] | None:
        """The spread's live replicas (instance ids), as the first target that answers sees them,
        read on a connection of its own (a busy maintenance pool must not delay a failover)."""
        for unit in self.units:
            if not unit.db_ok:
                continue
            key = _engine_key(unit.settings)
            try:
                conn = self._spread_conns.get(key)
                if conn is None or conn.closed:
                    conn = self._spread_conns[key] = connect(
                        unit.hosts.dsn(), application_name=f"maintd:{self.settings.instance_id}:spread",
                        answer_timeout=unit.settings.leader.lease.total_seconds() / 2,
                        settings={"statement_timeout": ms(unit.settings.leader.lease / 4)})
                return [r[0] for r in conn.execute(psycopg_sql(q_daemons.LIVE_REPLICAS, unit.settings.schema))]
            except Exception as exc:  # the next target, or keep the last R
                log.debug("could not count the replicas", extra=kv(target=unit.name, error=describe_db_error(exc)))
        return None

    # -- HTTP -----------------------------------------------------------------------------
    def health_problem(self) -> str | None:
        """None while the process and its loops are alive, else why not (for /healthz; whether
        the database can be reached is /readyz's business). With several targets, one target's
        stalled loop is that target's problem (/readyz, /status), not the process's."""
        if not self.multi:
            problem = self.unit.health_problem()
            if problem is not None or not self._started:
                return problem
        elif any(u.started and not u.elector.alive for u in self.units):
            return "leader election thread not running"
        if self._last_tick is not None and time.monotonic() - self._last_tick > 10:
            return "main loop stalled"
        return None

    def _healthz(self) -> tuple[int, str, bytes]:
        problem = self.health_problem()
        if problem is None:
            return text_body(200, "ok\n")
        return text_body(503, f"unhealthy: {problem}\n")

    def _readyz(self) -> tuple[int, str, bytes]:
        """Ready when every target's lock session works (the body names the targets that do not)."""
        if not self._started:
            return text_body(503, "not ready\n")
        if not self.multi:
            return text_body(200, "ready\n") if self.unit.ready else text_body(503, "not ready\n")
        bad = [f"{u.name} ({u.problem or u.health_problem() or 'database unreachable'})"
               for u in self.units if not u.ready or u.health_problem()]
        if not bad:
            return text_body(200, "ready\n")
        return text_body(503, f"not ready: {len(bad)} of {len(self.units)} targets: {', '.join(bad)}\n")

    def _status(self) -> tuple[int, str, bytes]:
        if not self.multi:
            data, status = self._target_status(self.unit)
            data["this_instance"] = {"instance_id": self.settings.instance_id, "is_leader": self.is_leader,
                                     "database_ok": self.unit.db_ok, "last_runs": self.runner.last_runs}
            data["health"] = self.health_status(self.unit.name)
            return as_json(status, data)
        targets = []
        for unit in self.units:
            data, _ = self._target_status(unit)
            targets.append({"target": unit.name, "schema": unit.settings.schema, **data,
                            "this_instance": unit.status(), "health": self.health_status(unit.name)})
        return as_json(200, {"targets": targets, "this_instance": {
            "instance_id": self.settings.instance_id, "leading": self.spread.leading(),
            "targets": len(self.units), "replicas": self.spread.replicas, "cap": self.spread.cap}})

    def health_status(self, target: str) -> dict[str, Any] | None:
        """A target's table health from this replica's last read (None: it does not lead it)."""
        for monitor in self.health:
            status = monitor.status(target)
            if status is not None:
                return status
        return None

    def _target_status(self, unit: TargetUnit) -> tuple[dict[str, Any], int]:
        from .periodic_table import list_entries
        from .status import collect_status

        try:
            data: dict[str, Any] = collect_status(unit.engine, unit.settings.schema)
            data["periodic"] = list_entries(unit.engine, unit.settings)
            return data, 200
        except Exception as exc:
            return {"error": describe_db_error(exc)}, 503

    # -- main loop ------------------------------------------------------------------------
    def tick(self) -> None:
        """Called a few times a second by :meth:`run_forever` (and tests)."""
        self._last_tick = time.monotonic()
        for unit in self.units:
            unit.tick()
        if self.multi and self._started:
            self.spread.balance()
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
