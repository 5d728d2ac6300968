"""One target of a daemon (SPEC 7.9): its :class:`Seat` in its database's election (the state the
:class:`maintd.leader.ElectionLoop` advances), its service runner, metrics and health. A daemon
runs one :class:`Target` per target, one or many, all alike."""

from __future__ import annotations

import logging
import math
import socket
import time
from typing import TYPE_CHECKING, Any, Callable

from sqlalchemy import Engine, text

from . import migrate
from .clock import Clock
from .config import Settings
from .db import advisory_key, describe_db_error, periodic_channel
from .election import Following, Request, State, Term, due, leading_term
from .identifiers import qualified
from .logs import kv
from .metrics import Metrics
from .queries import Statements, catalog
from .registry import DaemonRegistry
from .runner import Runner

if TYPE_CHECKING:
    from .leader import ElectionLoop, LeaderFence
    from .lockconn import LockSession

log = logging.getLogger("maintd")


class SchemaNotReady(RuntimeError):
    pass


class Seat:
    """A target's place in its database's election: what its loop reads and writes (``state``,
    the gate's bookkeeping) and what it calls (``on_elected``, ``on_demoted``, ``on_poke``)."""

    def __init__(self, settings: Settings, *, on_elected: Callable[[Term], None] = lambda term: None,
                 on_demoted: Callable[[str], None] = lambda reason: None, on_poke: Callable[[], None] = lambda: None,
                 log_name: str | None = None):
        self.settings = settings
        self.name, self.schema, self.log_name = settings.target_name, settings.schema, log_name
        self.key = advisory_key(settings.schema)
        self.statements = Statements(settings.schema)
        self.psql = self.statements.psql
        self.periodic_channel = periodic_channel(settings.schema)
        self.registry = DaemonRegistry(settings.schema, settings.instance_id)
        self.registry_host = socket.gethostname()
        self.on_elected, self.on_demoted, self.poke = on_elected, on_demoted, on_poke
        self.on_health: Callable[[bool], None] = lambda ok: None
        self.on_writable: Callable[[bool], None] = lambda writable: None
        self.state: State = Following()
        self.loop: ElectionLoop | None = None
        self.started = False  # the loop tries for it only once started (its schema checked)
        self.keep_trying = True  # run-once: a term lost is not taken again
        self.gate_at, self.notified, self.bump_waiting = 0.0, False, False

    @property
    def term(self) -> Term | None:
        return leading_term(self.state)

    @property
    def is_leader(self) -> bool:
        return self.term is not None

    def fence(self) -> "LeaderFence":
        from .leader import LeaderFence
        from .services.base import NotLeader

        term = self.term
        if term is None:
            raise NotLeader("not the leader")
        return LeaderFence(self.schema, term, lambda: self.term, self.statements.sql)

    def next_due(self) -> float:
        """When the loop must look at this target again (monotonic)."""
        if not self.started and isinstance(self.state, Following) and self.state.won_at is None:
            return math.inf
        when = due(self.state)
        return max(when, self.gate_at) if isinstance(self.state, Following) and self.state.won_at is None else when

    def elected(self, term: Term) -> None:
        log.info("became leader", extra=kv(epoch=term.epoch, instance=term.instance_id))
        self.on_elected(term)

    def demoted(self, reason: str, term: Term | None) -> None:
        if reason != "shutdown":
            log.warning("lost leadership", extra=kv(reason=reason, epoch=term.epoch if term else None))
        if not self.keep_trying:
            self.started = False
        self.on_demoted(reason)

    def request(self, req: Request) -> None:
        if self.loop is not None:
            self.loop.request(self, req)

    def register(self, session: "LockSession") -> None:
        """After the lock session (re)connects: this process's row in the target's ``daemons``."""
        try:
            self.registry.register(lambda template, params: session.run(self.psql(template), params))
        except Exception as exc:  # a missing schema: reported by the target's own checks
            import psycopg

            if isinstance(exc, psycopg.OperationalError):
                raise
            log.debug("could not register", extra=kv(target=self.name, error=describe_db_error(exc)))

    def database_health(self, ok: bool) -> None:
        self.on_health(ok)

    def database_writable(self, writable: bool) -> None:
        self.on_writable(writable)


class Target:
    """A target of the daemon: its seat, runner, metrics and health."""

    def __init__(self, settings: Settings, engine: Engine, metrics: Metrics, clock: Clock, timetable: Any,
                 *, name_in_logs: bool):
        self.settings = settings
        self.name = settings.target_name
        self.engine = engine
        self.metrics = metrics
        log_name = self.name if name_in_logs else None
        self.seat = Seat(settings, on_elected=self._elected, on_demoted=self._demoted,
                         on_poke=lambda: self.runner.poke(), log_name=log_name)
        self.seat.on_health, self.seat.on_writable = self._health, self._writable
        self.runner = Runner(settings, engine, metrics, clock=clock, on_fenced=self._fenced, timetable=timetable,
                             prefix=f"{self.name}:", log_target=log_name, statements=self.seat.statements)
        self.db_ok = False
        self.writable = True
        self.problem: str | None = None  # why this target is not started (schema missing, ...)
        self.maintenance_stall: str | None = None  # why the last term was given up, if stalled
        self.last_reason = ""

    @property
    def term(self) -> Term | None:
        return self.seat.term

    @property
    def is_leader(self) -> bool:
        return self.seat.is_leader

    @property
    def started(self) -> bool:
        return self.seat.started

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
        self.seat.started = True
        self.problem = None
        if self.seat.loop is not None:
            self.seat.loop.wake()

    def reload(self, settings: Settings) -> None:
        self.settings = self.seat.settings = settings
        self.runner.reload(settings)

    def hand_over(self, reason: str, hold_off: float) -> None:
        """Give this target's leadership up gracefully (released, followers woken, the lock
        session kept) and do not try for it again for ``hold_off`` seconds."""
        term = self.term
        if term is not None:
            self.seat.request(Request("handover", reason, term.epoch, hold_off))

    def wake(self) -> None:
        """The spread made this replica the target's owner: its follower asks the gate again now."""
        self.seat.gate_at = 0.0
        if self.seat.loop is not None:
            self.seat.loop.wake()

    # -- from the election loop --------------------------------------------------------------------
    def _elected(self, term: Term) -> None:
        self.maintenance_stall = None
        if self.seat.loop is not None and self.seat.loop.session.hosts.multi_host:
            # Idle pooled connections may lead to a server that has since gone silent (a frozen
            # old primary): a term starts with fresh ones, to the server the lock session reached.
            self.engine.dispose()
        self.metrics.is_leader.set(1)
        self.metrics.leadership_changes.inc()
        self.runner.activate(self.seat.fence())
        self.last_reason = f"epoch {term.epoch}"

    def _demoted(self, reason: str) -> None:
        self.metrics.is_leader.set(0)
        self.metrics.leadership_changes.inc()
        self.runner.deactivate(timeout=0)  # the loop waits for no pass: the fence refuses them
        self.last_reason = reason

    def _fenced(self, reason: str, fence: Any) -> None:
        """The database refused a pass of the current term: give that term up."""
        self.seat.request(Request("fenced", reason, fence.epoch))

    def _health(self, ok: bool) -> None:
        self.db_ok = ok
        self.metrics.up.set(1 if ok else 0)

    def _writable(self, writable: bool) -> None:
        self.writable = writable
        self.metrics.writable.set(1 if writable else 0)
        self.runner.pause(not writable)

    # -- health --------------------------------------------------------------------------------------
    def health_problem(self) -> str | None:
        """None while this target's election goes round, else why not. A replica that gave up
        a term because its maintenance hung is healthy again once it follows (its loop goes round)."""
        loop = self.seat.loop
        if not self.started or loop is None:
            return None
        cfg = self.settings.leader
        if not loop.alive:
            return "leader election thread not running"
        if time.monotonic() - loop.last_progress > (cfg.lease + max(cfg.retry_interval, cfg.renew_interval)).total_seconds():
            return "leader election loop stalled (database connection hanging?)"
        if self.maintenance_stall is not None and self.is_leader:
            return self.maintenance_stall
        return None

    @property
    def ready(self) -> bool:
        return self.started and self.db_ok and self.writable

    def not_ready_reason(self) -> str | None:
        if self.ready and self.health_problem() is None:
            return None
        if not self.writable:
            return "database is read-only"
        return self.problem or self.health_problem() or "database unreachable"

    def status(self) -> dict[str, Any]:
        return {"target": self.name, "schema": self.settings.schema, "is_leader": self.is_leader,
                "database_ok": self.db_ok, "database_writable": self.writable, "problem": self.problem,
                "last_runs": self.runner.last_runs}

    # -- the daemon's main loop, a few times a second ------------------------------------------------
    def tick(self) -> None:
        term = self.term
        if term is None:
            return
        lease = self.settings.leader.lease.total_seconds()
        if not term.trusted():
            # The loop may be stuck in a call to a silent server: stop the passes right now, and
            # stop saying we lead.
            self.metrics.is_leader.set(0)
            self.runner.deactivate(timeout=0)
            self.seat.request(Request("fenced", "lease expired", term.epoch))
            return
        stalled = self.runner.stalled_for()
        if stalled > lease:
            # Maintenance transactions hang (the server or the network silent while the lock
            # session is fine): give the term up, and let a replica whose connections work go first.
            self.maintenance_stall = (f"maintenance connections made no progress for {stalled:.0f}s: "
                                      f"gave up epoch {term.epoch}")
            log.error("maintenance transactions hang, giving up leadership",
                      extra=kv(target=self.name, epoch=term.epoch, seconds=round(stalled, 1)))
            self.metrics.is_leader.set(0)
            self.runner.deactivate(timeout=0)
            self.runner.sever_stalled(lease)  # a silent server answers no cancel either
            self.seat.request(Request("stalled", "maintenance connections hang", term.epoch, 3 * lease))
