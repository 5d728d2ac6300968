"""The daemon process: one :class:`maintd.target.Target` per target (one, or many with
``[[targets]]``, all alike), one :class:`maintd.leader.ElectionLoop` per database, the HTTP listener,
signals, reloads, systemd readiness. (``maintd run`` in :mod:`maintd.cli` starts it.)

The targets share the HTTP listener, the Prometheus registry (one ``target`` label each), one
timetable for their passes, and one maintenance engine and one lock session per database;
:class:`maintd.spread.Spread` shares the leaderships out between the replicas. A target whose
database is down or whose schema is missing does not stop the others: it is retried in the
background and reported by ``/readyz`` and ``/status``."""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from apscheduler.triggers.interval import IntervalTrigger
from sqlalchemy import Engine

from .clock import Clock, ServerClock
from .config import ConfigError, Settings, _target_settings, load_settings, periodic_counts
from .dashboard import Dashboard
from .db import HostOrder, describe_db_error, replaced_params
from .guardian import HealthMonitor, monitors
from .faults import transient
from .http import HttpServer, Recent, as_json, metrics_body, ready_metrics
from .http import text as text_body
from .leader import ElectionLoop
from .listener import raise_descriptor_limit
from .logs import kv, setup_logging
from .metrics import Metrics
from .passes import maintenance_engine
from .probes import TICK, CountProbe, ServiceProbe
from .readers import Readers
from .registry import DuplicateInstance, check_unique_instance
from .runner import Changes, new_timetable
from .sdnotify import SystemdNotifier
from .services import SERVICES
from .services.base import Service
from .services.partitioner import PartitionerConfig
from .spread import Spread
from .target import SchemaNotReady, Target

log = logging.getLogger("maintd")

__all__ = ["Daemon", "DuplicateInstance", "HttpListenError", "SchemaNotReady", "pass_workers", "pool_size"]


class HttpListenError(RuntimeError):
    """The HTTP listener cannot bind (``http.listen`` names the address)."""


# Keys a reload cannot change in a running process (kept, with a log line naming them).
RESTART_ONLY = ("database_url", "schema", "instance_id", "http", "leader", "statement_timeout")


def pool_size(targets: int) -> int:
    """Maintenance connections kept per database engine: a pass holds one while it works (not
    while it waits for its next due time), so one target needs at most one per service plus the
    job gauges. Several targets share the pool; a pass waiting for a connection counts as a
    stalled one (a lease of that gives the term up), so it grows with them, half a connection per
    target (+2 overflow; all opened on demand)."""
    one = len(SERVICES) + 1
    return one if targets <= 1 else min(100, one + targets // 2)


def pass_workers(targets: int) -> int:
    """Threads running the passes of a process's targets (started on demand). A pass holds its
    thread only while it works (a precise-timing wait holds none), and an idle target's scheduler
    runs no pass at all (the database's due-time probe), so few are needed however many targets."""
    return min(16, 8 + targets // 50)


def _engine_key(s: Settings) -> tuple:
    return (s.database_url.get_secret_value(), s.statement_timeout, s.leader.lease)


class Daemon:
    def __init__(self, settings: Settings, *, clock: Clock | None = None,
                 config_path: str | None = None, metrics: Metrics | None = None):
        self.settings = settings
        self.config_path = config_path
        # The server's time per database (a test's clock for all): each server's own clock, never
        # another's carried over (SPEC 7.1: retention and rescue horizons are that server's times).
        self.clocks: dict[str, Clock] = {}
        targets = settings.target_settings()
        self.timetable = new_timetable(pass_workers(len(targets)))
        self.changes = Changes()  # the timetable changes of terms, off the election loops' threads
        self.hosts: dict[str, HostOrder] = {}  # per database URL: who answers (engine + lock session)
        self.engines: dict[tuple, Engine] = {}
        bounds = {"max_queues": settings.metrics.max_queues, "max_periodic_ids": settings.metrics.max_periodic_ids}
        self.metrics = metrics or Metrics(target=targets[0].target_name, **bounds)
        self.targets = [self._target(t, targets, clock, bounds) for t in targets]
        lead = settings.leader
        self.spread = Spread(self.targets, me=settings.instance_id, retry_interval=lead.retry_interval.total_seconds(),
                             settle=lead.lease.total_seconds(), lease=lead.lease.total_seconds(),
                             live_replicas=self._live_replicas)
        # per engine: the probes reading over it (their stalls count)
        self.reads: dict[Engine, list] = {e: self._probes(e) for e in self.engines.values()}
        self.probes: list = [p for probes in self.reads.values() for p in probes]
        on = {url: [t for t in self.targets if t.settings.database_url.get_secret_value() == url] for url in self.hosts}
        self.loops = [ElectionLoop(settings, on[url], hosts, spread=self.spread) for url, hosts in self.hosts.items()]
        # One table-health monitor per database (SPEC 8.2), for the targets this replica leads there.
        self.health: list[HealthMonitor] = monitors({url: (hosts, on[url]) for url, hosts in self.hosts.items()},
                                                    lambda: self.settings.health)
        self.http: HttpServer | None = None
        self.readers = Readers(lambda: self.settings.instance_id)  # /status and the dashboard
        self.notifier = SystemdNotifier()
        self._stopping = threading.Event()
        self._reload_requested = threading.Event()
        self._last_tick: float | None = None  # set by tick(); None while nobody ticks
        self._balanced_at = -1.0
        self._started = False
        self._retry_thread: threading.Thread | None = None

    def _target(self, t: Settings, every: list[Settings], clock: Clock | None, bounds: dict) -> Target:
        """A target of ``t``: its database's engine (one per pool key) and clock, its metrics."""
        url = t.database_url.get_secret_value()
        hosts = self.hosts.setdefault(url, HostOrder(url))
        key = _engine_key(t)
        if key not in self.engines:
            same = sum(_engine_key(o) == key for o in every)
            self.engines[key] = maintenance_engine(t, pool_size=pool_size(same), hosts=hosts)
        metrics_t = self.metrics if t is every[0] else Metrics(target=t.target_name, **bounds, shared=self.metrics)
        return Target(t, self.engines[key], metrics_t, clock or self.clocks.setdefault(url, ServerClock()),
                      self.timetable, name_in_logs=len(every) > 1, changes=self.changes)

    def _probes(self, engine: Engine) -> list:
        """The reads over ``engine`` for its targets: the job counts and each probed service's."""
        mine = [t for t in self.targets if t.engine is engine]
        return [CountProbe(engine, mine)] + [
            ServiceProbe(engine, mine, name) for name, spec in SERVICES.items() if spec.cls.probe is not Service.probe]

    @property
    def is_leader(self) -> bool:
        return any(t.is_leader for t in self.targets)

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http else None

    def start_http(self) -> None:
        """The listener comes first, so probes answer during the start-up retries (/readyz 503)."""
        if not self.settings.http.enabled or self.http is not None:
            return
        address = self.settings.http.listen
        was, now = raise_descriptor_limit()
        if now != was:
            log.info("raised the open-file limit", extra=kv(soft=now, was=was))
        scrape = Recent(self.metrics.render)
        status = Recent(self._status)  # read at most twice a second however many ask (SPEC 8.5)
        try:
            self.http = HttpServer(self.settings.http.host, self.settings.http.port, {
                "/metrics": lambda: metrics_body(scrape),
                "/healthz": self._healthz,
                "/readyz": self._readyz,
                "/status": status,
            }, pages=Dashboard(lambda: self.settings, readers=self.readers, health=self.health_status,
                               max_age=scrape.max_age).pages(),  # /, /jobs, /jobs/{id}
               auth_token=lambda: self.settings.http.auth_token,  # all but the probes and /metrics
               ready={"/metrics": lambda: ready_metrics(scrape)})  # on the loop while no render is due
        except OSError as exc:
            raise HttpListenError(f"http.listen {address}: cannot listen: {exc.strerror or exc}") from None
        self.http.start()
        log.info("http listening", extra=kv(address=f"{self.settings.http.host}:{self.http.port}",
                                            max_connections=self.http.listener.max_connections))

    def start(self) -> bool:
        """HTTP, then the targets and their election loops. Each target whose schema is ready
        starts now, the others are retried in the background; but when none can start and
        waiting cannot help (no schema, a bad password, no such database), the start fails (exit 1).
        False when stopped during the start."""
        self.start_http()
        for target in self.targets:
            for advice in PartitionerConfig.of(target.settings).advice():
                log.warning("partitioned layout: many partitions", extra=kv(target=target.name, advice=advice))
        for url, loop in zip(self.hosts, self.loops):
            if replaced := replaced_params(url):
                log.warning("database_url: parameters replaced by maintd's own",
                            extra=kv(targets=",".join(seat.name for seat in loop.targets), **replaced))
        self.timetable.start()
        for i, probe in enumerate(self.probes):  # every second; a probe reads when something is due
            # (an id no target's jobs begin with, ``<target name>:``: a target name never has a colon)
            self.timetable.add_job(probe.run, IntervalTrigger(seconds=TICK), id=f":probe:{i}")
        self.spread.hold()  # no tries until every target is started and the replicas are read
        silent = {url: exc for url, loop in zip(self.hosts, self.loops)
                  if (exc := self._first_connect(loop)) is not None and transient(exc)}
        tried = [(t, self._try_start(t, silent.get(t.settings.database_url.get_secret_value())))
                 for t in self.targets]
        failures = [f for _, f in tried if f is not None]
        waiting = [t for t in self.targets if not t.started]
        if waiting and len(failures) == len(self.targets) and not any(transient(f) for f in failures):
            self.stop()  # (the start ends: nothing said to be retried)
            raise failures[0] if isinstance(failures[0], SchemaNotReady) else SchemaNotReady(describe_db_error(failures[0]))
        for target, failure in tried:
            if failure is not None:
                _not_started(target)
        for loop in self.loops:
            loop.start()
        for monitor in self.health:
            monitor.start()
        self.spread.started()
        self._started = True
        if waiting:
            self._retry_thread = threading.Thread(target=self._retry_targets, args=(waiting,),
                                                  name="maintd-targets", daemon=True)
            self._retry_thread.start()
        log.info("maintd started", extra=kv(instance=self.settings.instance_id, targets=len(self.targets),
                                            waiting=len(waiting)))
        return not self._stopping.is_set()

    def _first_connect(self, loop: ElectionLoop) -> Exception | None:
        """Open each lock session before its loop starts: a pooler that cannot keep a session
        (pool_mode=transaction) ends the start with exit 1 and no lock taken, and an instance id
        that a live daemon already uses, with exit 2. An outage is left to the loop's retries (and
        the loop's first session that works is checked the same way: ``ElectionLoop.refused``).
        Returns the outage (None: connected), so that its targets are not tried one by one, a
        connect timeout each (a start past systemd's TimeoutStartSec with many targets)."""
        import psycopg

        from .lockconn import LeaderSessionError

        try:
            check_unique_instance(loop, self.settings)
            loop.connect()
        except (LeaderSessionError, DuplicateInstance):
            self.stop()
            raise
        except (psycopg.Error, OSError) as exc:
            if transient(exc):  # anything else ends the start, or is said per target
                log.warning("database unreachable, retrying", extra=kv(error=describe_db_error(exc)))
            return exc
        return None

    @staticmethod
    def _try_start(target: Target, unreachable: Exception | None = None) -> Exception | None:
        """Start the target if its schema is ready; else why not (also in ``target.problem``).
        ``unreachable``: its database did not answer the lock session just now; not asked again
        (the background retries do)."""
        try:
            if unreachable is not None:
                raise unreachable
            target.check_schema()
        except Exception as exc:
            target.problem, target.schema_not_ready = describe_db_error(exc), isinstance(exc, SchemaNotReady)
            target.unreachable = not target.schema_not_ready and transient(exc)
            return exc
        target.start()
        return None

    def _retry_targets(self, waiting: list[Target]) -> None:
        """Every 0.5 s, doubling up to 5 s; a target's problem is logged again only when it changed."""
        delay = 0.5
        while waiting and not self._stopping.wait(delay):
            was = {t.name: t.problem for t in waiting}
            waiting = [t for t in waiting if self._try_start(t) is not None]
            for target in waiting:
                if target.problem != was[target.name]:
                    _not_started(target)
            delay = min(5.0, delay * 2)

    def _on_signals(self, signals: list[int]) -> bool:
        """Act on the signals noted since the last turn (SIGHUP: reload at the next tick; SIGTERM,
        SIGINT: stop); True once stopping."""
        while signals:
            signum = signals.pop(0)
            if signum == signal.SIGHUP:
                self._reload_requested.set()
            else:
                log.info("stopping on a signal", extra=kv(signal=signal.Signals(signum).name))
                self._stopping.set()
        return self._stopping.is_set()

    def stop(self, timeout: float = 10.0) -> None:
        """Every lock released at once (one round per database), the passes stopped."""
        stopping_started = self._started
        self._started = False
        self._stopping.set()
        if stopping_started:
            self.notifier.stopping()
        began = time.monotonic()
        for monitor in self.health:  # their reads cancelled now, their threads joined below
            monitor.stopping()
        for target in self.targets:
            target.runner.deactivate(timeout=0)
        if len(self.loops) == 1:
            self.loops[0].stop(timeout)
        else:
            with ThreadPoolExecutor(min(32, len(self.loops)), thread_name_prefix="maintd-stop") as pool:
                list(pool.map(lambda loop: loop.stop(timeout), self.loops))
        deadline = time.monotonic() + 1.0  # one second for every target's passes, not one each
        for target in self.targets:
            target.runner.deactivate(timeout=max(0.0, deadline - time.monotonic()))
        for monitor in self.health:  # (fenced, as the passes: one left running writes nothing)
            monitor.stop(timeout=max(0.2, deadline - time.monotonic()))
        self.changes.stop()
        if self.timetable.running:
            self.timetable.shutdown(wait=False)
        if self.http:
            self.http.stop()
            self.http = None
        self.readers.dispose()
        for engine in self.engines.values():
            engine.dispose()
        if stopping_started:
            log.info("maintd stopped", extra=kv(instance=self.settings.instance_id,
                                                seconds=round(time.monotonic() - began, 1)))

    def reload(self, settings: Settings, *, restoring: bool = False) -> None:
        """Apply ``settings`` (``restoring``: the old ones, after a reload that failed: not said
        as a reload)."""
        changed = [k for k in RESTART_ONLY if getattr(settings, k) != getattr(self.settings, k)
                   and not (k == "http" and settings.http.listen == self.settings.http.listen
                            and settings.http.enabled == self.settings.http.enabled)]
        if "instance_id" in changed and "instance_id" not in settings.model_fields_set:
            changed.remove("instance_id")  # a default (<host>-<pid>) read again, not set in the file
        if changed:
            log.warning("config reload: needs a restart; kept the old value", extra=kv(keys=",".join(changed)))
        keep = {k: getattr(self.settings, k) for k in RESTART_ONLY if k != "http"}
        keep["http"] = self.settings.http.model_copy(update={"auth_token": settings.http.auth_token})
        self.settings = settings = self._reload_targets(settings.model_copy(update=keep))
        for metrics in {id(t.metrics): t.metrics for t in self.targets}.values():
            metrics.max_queues = settings.metrics.max_queues  # from the next refresh of the gauges
            metrics.max_periodic_ids = settings.metrics.max_periodic_ids  # from the enqueuer's next pass
        setup_logging(settings.log.level, settings.log.format)
        if restoring:
            return
        enabled = [n for n, s in self.targets[0].runner.services.items() if s.enabled()]
        log.info("config reloaded", extra=kv(services=",".join(enabled) or "none", **periodic_counts(settings)))

    def _reload_targets(self, settings: Settings) -> Settings:
        """Each target gets its new sections; adding, removing or moving a target needs a
        restart (kept as it was, with a log line). Returns the settings of the targets that run
        (what /status and the dashboard show)."""
        settings._targets = _target_settings(settings) if settings.targets else []  # over the kept keys
        new = {t.target_name: t for t in settings.target_settings()}
        old = {t.name: t for t in self.targets}
        moved = [n for n, t in old.items() if n not in new or _engine_key(new[n]) != _engine_key(t.settings)
                 or new[n].schema != t.settings.schema] + [n for n in new if n not in old]
        if moved:
            log.warning("config reload: targets need a restart to be added, removed or moved; kept "
                        "those as they were", extra=kv(targets=",".join(moved)))
            entries = {t.target_name: t for t in settings.targets}
            running = [t if t.target_name in moved else entries.get(t.target_name, t) for t in self.settings.targets]
            settings = settings.model_copy(update={"targets": running})
            settings._targets = _target_settings(settings) if running else []
            new = {t.target_name: t for t in settings.target_settings()}
        for name, target in old.items():
            if name in new and name not in moved:
                target.reload(new[name])
        return settings

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
            self.reload(old, restoring=True)
            return False
        return True

    def _live_replicas(self) -> list[str] | None:
        """The spread's live replicas: those the election loops saw last (None: none read yet)."""
        seen = [loop.replicas for loop in self.loops if loop.replicas is not None]
        return None if not seen else sorted(set().union(*seen))

    # -- HTTP -----------------------------------------------------------------------------
    def health_problem(self) -> str | None:
        """None while the process and its loops are alive, else why not (for /healthz; whether
        the database can be reached is /readyz's business). A target whose loop is stalled is
        that target's problem (/readyz, /status), unless every target has it."""
        problems = [p for p in (t.health_problem() for t in self.targets) if p is not None]
        if problems and len(problems) == len(self.targets):
            return problems[0]
        if self._last_tick is not None and time.monotonic() - self._last_tick > 10:
            return "main loop stalled"
        return None

    def _healthz(self) -> tuple[int, str, bytes]:
        problem = self.health_problem()
        if problem is None:
            return text_body(200, "ok\n")
        return text_body(503, f"unhealthy: {problem}\n")

    def _readyz(self) -> tuple[int, str, bytes]:
        """Ready when every target's lock session works and its database takes writes (the
        body names the targets that are not)."""
        if not self._started:
            return text_body(503, "not ready\n")
        bad = [(t.name, t.not_ready_reason()) for t in self.targets]
        bad = [(name, why) for name, why in bad if why is not None]
        if not bad:
            return text_body(200, "ready\n")
        if not self.settings.targets:
            return text_body(503, f"not ready: {bad[0][1]}\n")
        named = ", ".join(f"{name} ({why})" for name, why in bad)
        return text_body(503, f"not ready: {len(bad)} of {len(self.targets)} targets: {named}\n")

    def _status(self) -> tuple[int, str, bytes]:
        """``{"targets": [...]}``, or with no ``[[targets]]`` the one target's fields at the top."""
        if not self.settings.targets:
            target = self.targets[0]
            data, status = self._target_status(target)
            data["this_instance"] = {"instance_id": self.settings.instance_id, **target.status()}
            data.update(self._health_fields(target))
            return as_json(status, data)
        targets, worst = [], 200
        for target in self.targets:
            data, status = self._target_status(target)
            worst = max(worst, status)  # a target that could not be read: 503, as the dashboard
            targets.append({"target": target.name, "schema": target.settings.schema, **data,
                            "this_instance": target.status(), **self._health_fields(target)})
        return as_json(worst, {"targets": targets, "this_instance": {
            "instance_id": self.settings.instance_id, "leading": self.spread.leading(),
            "targets": len(self.targets), "replicas": self.spread.replicas, "cap": self.spread.cap}})

    def _health_fields(self, target: Target) -> dict[str, Any]:
        """``health``: this replica's last read; when it has none, ``health_note`` says where it is
        (as ``jobs_note`` does for the job figures)."""
        health = self.health_status(target.name)
        if health is not None:
            return {"health": health}
        note = ("off (health.enabled = false)" if not target.settings.health.enabled else
                "not read yet: the leader reads it every health.interval" if target.is_leader else
                "read by the leader: see its /status, or run `maintd status`")
        return {"health": None, "health_note": note}

    def health_status(self, target: str) -> dict[str, Any] | None:
        """A target's table health from this replica's last read (None: it does not lead it)."""
        for monitor in self.health:
            status = monitor.status(target)
            if status is not None:
                return status
        return None

    def _target_status(self, target: Target) -> tuple[dict[str, Any], int]:
        """Read through the readers (never the maintenance pool); the jobs are what the leader
        counted last, from memory (SPEC 8.5)."""
        from .periodic_table import STATUS_ROWS, as_json, list_entries
        from .status import collect_status, leader_figures

        try:
            engine = self.readers.engine(target.settings.database_url.get_secret_value())
            data: dict[str, Any] = collect_status(
                engine, target.settings.schema, max_queues=self.settings.metrics.max_queues,
                configured_layout=target.settings.layout,
                jobs=leader_figures(target.runner.gauges.counts, leading=target.is_leader))
            if data.get("schema_behind"):  # what could be read of it, and the error as before
                return {**data, "error": data["schema_behind"]}, 503
            entries, data["periodic_more"] = list_entries(engine, target.settings, STATUS_ROWS)
            data["periodic"] = as_json(entries)
            return data, 200
        except Exception as exc:
            return {"error": describe_db_error(exc)}, 503

    # -- main loop ------------------------------------------------------------------------
    def tick(self) -> None:
        """Called a few times a second by :meth:`run_forever` (and tests)."""
        self._last_tick = time.monotonic()
        stalled = {engine: max(r.stalled_for() for r in reads) for engine, reads in self.reads.items()}
        for target in self.targets:
            target.tick(stalled[target.engine])
        for loop in self.loops:
            lease = loop.settings.leader.lease.total_seconds()
            if loop.session.stuck_for() > lease:  # a statement to a silent server: reconnect
                log.warning("the lock session is not answering, reconnecting",
                            extra=kv(seconds=round(loop.session.stuck_for(), 1)))
                loop.session.sever()
        if self._started and time.monotonic() - self._balanced_at >= 1.0:  # about a second is enough
            self._balanced_at = time.monotonic()
            self.spread.balance()
            leading = self.spread.leading()
            self.notifier.status(f"leading {leading} of {len(self.targets)} targets")
        if self._reload_requested.is_set():
            self._reload_requested.clear()
            self.reload_from_file()

    def run_forever(self) -> int:
        # A handler only notes its signal, taking no lock: it runs between two bytecodes of the
        # main thread, which may be inside ``_stopping.wait`` holding that Event's own lock, and
        # setting the Event there waited for itself forever (a SIGTERM that never stopped the
        # daemon). The main loop acts on the notes within its 0.2 s turn.
        signals: list[int] = []
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, lambda signum, frame: signals.append(signum))
        try:
            if not self.start() or self._on_signals(signals):
                log.info("stopped during start-up")
                self.stop()
                return 0
        except BaseException:
            self.stop()
            raise
        self.notifier.ready()
        last_ping = 0.0
        try:
            while not self._stopping.wait(0.2) and not self._on_signals(signals):
                for loop in self.loops:
                    if loop.refused is not None:
                        raise loop.refused
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


def _not_started(target: Target) -> None:
    log.error("target not started, retrying in the background", extra=kv(target=target.name, error=target.problem))
