"""One target of a daemon (SPEC 7.9): its :class:`~maintd.leader.Seat` in its database's election
(it is one), its service runner, metrics and health. A daemon runs one :class:`Target` per target,
one or many, all alike."""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy import Engine

from .clock import Clock
from .config import Settings
from .election import Request, Term
from .leader import Seat
from .logs import kv
from .metrics import Metrics
from .migrate import SchemaNotReady, check_ready
from .runner import Runner

log = logging.getLogger("maintd")

__all__ = ["SchemaNotReady", "Target"]


class Target(Seat):
    def __init__(self, settings: Settings, engine: Engine, metrics: Metrics, clock: Clock, timetable: Any,
                 *, name_in_logs: bool, changes: Any = None):
        super().__init__(settings, log_name=settings.target_name if name_in_logs else None)
        self.engine, self.metrics = engine, metrics
        self.runner = Runner(settings, engine, metrics, clock=clock, on_fenced=self._fenced, timetable=timetable,
                             prefix=f"{self.name}:", log_target=self.log_name, statements=self.statements,
                             changes=changes)
        self.db_ok, self.writable = False, True
        self.problem: str | None = None  # why this target is not started (schema missing, ...)
        self.schema_not_ready = False  # the problem: its schema was read, and is missing or behind
        self.unreachable = False  # the problem: its database did not answer (waiting may fix it)
        self.maintenance_stall: str | None = None  # why the last term was given up, if stalled

    def check_schema(self) -> None:
        self.runner.take_layout(check_ready(self.engine, self.settings.schema))

    def start(self) -> None:
        self.started, self.problem = True, None
        self.wake()

    def reload(self, settings: Settings) -> None:
        self.settings = settings
        self.runner.reload(settings)

    def hand_over(self, reason: str, hold_off: float) -> None:
        """Give this target's leadership up gracefully (released, followers woken, the lock
        session kept) and do not try for it again for ``hold_off`` seconds (the spread)."""
        term = self.term  # once: the loop may end the term meanwhile
        if term is not None:
            self.request(Request("handover", reason, term.epoch, hold_off))

    # -- from the election loop ----------------------------------------------------------------------
    def on_elected(self, term: Term) -> None:
        self.maintenance_stall = None
        if self.loop is not None and self.loop.session.hosts.multi_host:
            # Idle pooled connections may lead to a server that has since gone silent (a frozen
            # old primary): a term starts with fresh ones, to the server the lock session reached.
            self.engine.dispose()
        self.metrics.is_leader.set(1)
        self.metrics.leadership_changes.inc()
        self.runner.activate(self.fence())

    def on_demoted(self, reason: str) -> None:
        self.metrics.is_leader.set(0)
        self.metrics.leadership_changes.inc()
        self.runner.deactivate(timeout=0)  # the loop waits for no pass: the fence refuses them

    def poke(self) -> None:
        self.runner.poke()

    def _fenced(self, reason: str, fence: Any) -> None:
        """The database refused a pass of the current term: give that term up."""
        self.request(Request("fenced", reason, fence.epoch))

    def on_health(self, ok: bool) -> None:
        self.db_ok = ok
        self.metrics.up.set(1 if ok else 0)

    def on_writable(self, writable: bool) -> None:
        self.writable = writable
        self.metrics.writable.set(1 if writable else 0)
        self.runner.pause(not writable)

    # -- health ----------------------------------------------------------------------------------------
    def health_problem(self) -> str | None:
        """None while this target's election goes round, else why not. A replica that gave up a
        term because its maintenance hung is healthy again once it follows."""
        loop, cfg = self.loop, self.settings.leader
        if not self.started or loop is None:
            return None
        if not loop.alive:
            return "leader election thread not running"
        if loop.stalled_for() > (cfg.lease + max(cfg.retry_interval, cfg.renew_interval)).total_seconds():
            return "leader election loop stalled (database connection hanging?)"
        return self.maintenance_stall if self.is_leader else None

    def not_ready_reason(self) -> str | None:
        """Why /readyz is 503 for this target (None: ready), in words that name no host, port,
        role or database: /readyz answers anyone who reaches the port, even with
        ``http.auth_token`` set. The error itself is in ``/status`` and the log."""
        if self.started and self.db_ok and self.writable and self.health_problem() is None:
            return self.schema_problem() and "schema missing or behind: run `maintd migrate`"
        if not self.writable:
            return "database is read-only"
        if self.problem is not None and self.schema_not_ready:  # checked: missing or behind
            return "not started: its schema is missing or behind: run `maintd migrate`"
        if self.problem is not None and self.unreachable:  # down since the start: no schema read
            return "database unreachable (see /status or the log)"
        if self.problem is not None:
            return "not started: its schema could not be checked (see /status or the log)"
        return self.health_problem() or "database unreachable (see /status or the log)"

    def schema_problem(self) -> str | None:
        """A pass failed because the schema is missing or behind (dropped while running, say)."""
        for run in list(self.runner.last_runs.values()):
            if run.get("outcome") == "error" and "maintd migrate" in str(run.get("error")):
                return str(run["error"])
        return None

    def status(self) -> dict[str, Any]:
        term = self.term  # a term past its trust leads no more: its fence refuses every write
        now = time.monotonic()
        trusted = term is not None and term.trusted(now)
        # The lease as this process knows it: how long its last proof of the lock is trusted
        # (the leader table is written when a term starts, not at each renewal).
        left = round(term.trusted_until - now, 1) if trusted else None
        return {"target": self.name, "schema": self.settings.schema, "is_leader": trusted,
                "lease_trusted_for_seconds": left,
                "database_ok": self.db_ok, "database_writable": self.writable, "problem": self.problem,
                "last_runs": self.runner.last_runs}

    # -- the daemon's main loop, a few times a second --------------------------------------------------
    def tick(self, reads_stalled: float = 0.0) -> None:
        """``reads_stalled``: how long the batched reads over this target's engine (its probes)
        have hung, which counts as a maintenance stall (read once per tick for all its targets)."""
        term, lease = self.term, self.settings.leader.lease.total_seconds()
        if term is None:
            return
        if not term.trusted():  # the loop may be stuck in a call to a silent server: stop the passes now
            self.metrics.is_leader.set(0)
            self.runner.deactivate(timeout=0)
            self.request(Request("fenced", "lease expired", term.epoch))
        elif (stalled := max(self.runner.stalled_for(), reads_stalled)) > lease:
            # Maintenance transactions hang (the server or the network silent while the lock session
            # is fine): give the term up, and let a replica whose connections work go first.
            self.maintenance_stall = f"maintenance connections made no progress for {stalled:.0f}s: gave up epoch {term.epoch}"
            log.error("maintenance transactions hang, giving up leadership",
                      extra=kv(target=self.name, epoch=term.epoch, seconds=round(stalled, 1)))
            self.metrics.is_leader.set(0)
            self.runner.deactivate(timeout=0)
            self.runner.sever_stalled(lease)  # a silent server answers no cancel either
            self.request(Request("stalled", "maintenance connections hang", term.epoch, 3 * lease))
