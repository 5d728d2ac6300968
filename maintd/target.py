"""One target of a daemon (SPEC 7.9): its leader elector, its service runner, its metrics (its
``target`` label on the process's registry) and its health. A daemon runs one unit per target;
they share the HTTP listener, the registry and the maintenance engine of their database."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from sqlalchemy import Engine, text

from . import migrate
from .clock import Clock
from .config import Settings
from .db import HostOrder
from .identifiers import qualified
from .leader import LeaderElector, Term
from .lockconn import LockConnection
from .logs import kv
from .metrics import Metrics
from .queries import catalog
from .runner import Runner

log = logging.getLogger("maintd")


class SchemaNotReady(RuntimeError):
    pass


class TargetUnit:
    """``on_change(unit)`` is called after each election or demotion (the daemon's status line
    and the spread's count)."""

    def __init__(self, settings: Settings, engine: Engine, metrics: Metrics, clock: Clock, *,
                 hosts: HostOrder | None = None, lock_conn: LockConnection | None = None,
                 on_change: Callable[["TargetUnit"], None] = lambda unit: None,
                 timetable: Any = None):
        """``timetable``: the process's shared pass scheduler (several targets), else its own;
        ``hosts``: the host order of the engine's database URL, shared with the lock session;
        ``lock_conn``: the lock session shared with the other targets on the database (else its own)."""
        self.settings = settings
        self.name = settings.target_name
        self.engine = engine
        self.hosts = hosts or HostOrder(settings.database_url.get_secret_value())
        self.metrics = metrics
        self.on_change = on_change
        several = timetable is not None  # a daemon with several targets: lines name theirs
        self.elector = LeaderElector(settings, on_elected=self._elected, on_demoted=self._demoted,
                                     on_health=self._health, hosts=self.hosts, shared=lock_conn,
                                     log_target=self.name if several else None)
        self.runner = Runner(settings, engine, metrics, clock=clock, on_fenced=self._fenced,
                             timetable=timetable, prefix=f"{self.name}:" if several else "",
                             log_target=self.name if several else None)
        self.elector.session.on_notify = lambda channel: self.runner.poke()
        self.started = False
        self.db_ok = False
        self.problem: str | None = None  # why this target is not started (schema missing, ...)
        self.maintenance_stall: str | None = None  # why the last term was given up, if stalled
        self.last_reason = ""

    @property
    def is_leader(self) -> bool:
        return self.elector.is_leader

    def check_schema(self) -> None:
        """Raise :class:`SchemaNotReady` (one line) when the schema is missing or behind."""
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

    def start(self) -> None:
        self.runner.start()
        self.elector.start()
        self.started = True
        self.problem = None

    def stop(self, timeout: float) -> None:
        if not self.started:
            return
        self.started = False
        self.runner.deactivate()
        self.elector.stop(timeout)
        self.runner.shutdown()

    def reload(self, settings: Settings) -> None:
        self.settings = settings
        self.elector.update_settings(settings)
        self.runner.reload(settings)

    def hand_over(self, reason: str, hold_off: float) -> None:
        """Give this target's leadership up gracefully (released, followers woken, the lock
        session kept) and do not try for it again for ``hold_off`` seconds."""
        term = self.elector.term
        if term is not None:
            self.elector.request_demotion(reason, term.epoch, hold_off=hold_off, graceful=True)

    def wake(self) -> None:
        """The spread made this replica the target's owner: its follower tries now."""
        self.elector.wake()

    # -- callbacks (from the elector and runner threads) ------------------------------------
    def _elected(self, term: Term) -> None:
        self.maintenance_stall = None
        if self.hosts.multi_host:
            # Idle pooled connections may lead to a server that has since gone silent (a frozen
            # old primary): a term starts with fresh ones, to the server the lock session reached.
            self.engine.dispose()
        self.metrics.is_leader.set(1)
        self.metrics.leadership_changes.inc()
        self.runner.activate(self.elector.fence())
        self.last_reason = f"epoch {term.epoch}"
        self.on_change(self)

    def _demoted(self, reason: str) -> None:
        self.metrics.is_leader.set(0)
        self.metrics.leadership_changes.inc()
        self.runner.deactivate()
        self.last_reason = reason
        self.on_change(self)

    def _fenced(self, reason: str, fence: Any) -> None:
        """The database refused a pass of the current term: give that term up."""
        self.elector.request_demotion(reason, fence.epoch)

    def _health(self, ok: bool) -> None:
        self.db_ok = ok
        self.metrics.up.set(1 if ok else 0)

    # -- health -----------------------------------------------------------------------------
    def health_problem(self) -> str | None:
        """None while this target's loops are alive, else why not."""
        cfg = self.settings.leader
        stall = (cfg.lease + max(cfg.retry_interval, cfg.renew_interval)).total_seconds()
        if self.maintenance_stall is not None:
            return self.maintenance_stall
        if not self.started:
            return None
        if not self.elector.alive:
            return "leader election thread not running"
        if time.monotonic() - self.elector.last_progress > stall:
            return "leader election loop stalled (database connection hanging?)"
        return None

    @property
    def ready(self) -> bool:
        return self.started and self.elector.healthy

    def status(self) -> dict[str, Any]:
        return {"target": self.name, "schema": self.settings.schema, "is_leader": self.is_leader,
                "database_ok": self.db_ok, "problem": self.problem, "last_runs": self.runner.last_runs}

    # -- main loop --------------------------------------------------------------------------
    def tick(self) -> None:
        """From the daemon's main loop, a few times a second."""
        if not self.started:
            return
        term = self.elector.term
        if term is not None and not term.trusted():
            # The elector thread may be stuck in a network call: stop the passes right now, and
            # stop saying we lead.
            self.metrics.is_leader.set(0)
            self.runner.deactivate()
            self.elector.request_demotion("lease expired", term.epoch)
        self._check_progress(term)
        self._check_election()

    def _check_election(self) -> None:
        """The election loop goes round at least every renew/retry interval; one stuck for a
        lease in a call to a silent server (frozen primary, partition) has its socket shut down,
        so it reconnects (with a multi-host URL, to whichever server now accepts writes)."""
        stuck = time.monotonic() - self.elector.last_progress
        lease = self.settings.leader.lease.total_seconds()
        # Waiting in line for the shared session is not hanging: its statement in flight is.
        if stuck > lease and self.elector.session.open and self.elector.session.stuck_for() > lease:
            log.warning("the lock session is not answering, reconnecting",
                        extra=kv(target=self.name, seconds=round(stuck, 1)))
            self.elector.session.sever()
            self.elector.last_progress = time.monotonic()

    def _check_progress(self, term: Term | None) -> None:
        """A leader whose maintenance transactions hang (the server or the network silent while
        the lock session is fine) gives up the term after a lease without progress."""
        stalled = self.runner.stalled_for()
        lease = self.settings.leader.lease.total_seconds()
        if term is not None and stalled > lease:
            self.maintenance_stall = (f"maintenance connections made no progress for {stalled:.0f}s: "
                                      f"gave up epoch {term.epoch}")
            log.error("maintenance transactions hang, giving up leadership",
                      extra=kv(target=self.name, epoch=term.epoch, seconds=round(stalled, 1)))
            self.metrics.is_leader.set(0)
            self.runner.deactivate()
            self.runner.sever_stalled(lease)  # a silent server answers no cancel either
            # Stay a follower for a few leases: a replica whose connections work goes first.
            self.elector.request_demotion("maintenance connections hang", term.epoch, hold_off=3 * lease)
