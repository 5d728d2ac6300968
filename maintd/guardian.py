"""The guardian: one :class:`HealthMonitor` per database drives the table-health read (SPEC 8.2)
for the targets of that database that this replica leads: one read per ``health.interval`` for
all of them, their gauges, the once-per-holder warning, and each target's history row.

A monitor runs in a thread of its own (:meth:`HealthMonitor.start`) or is driven by its owner's
loop (:meth:`HealthMonitor.run_once` once per interval, :meth:`HealthMonitor.poll` more often). It
sees the targets through :class:`Member`, so the election's shape stays its own business:
:class:`TargetMember` adapts :class:`maintd.target.Target`.

The read runs on a connection of the monitor's own (``application_name`` ``maintd:<id>:health``,
autocommit, a 5 s statement timeout, generic plans, no JIT: the tables' generic plan is estimated
over ``jit_above_cost``, and compiling it cost 70-85 ms a read for a statement of under 1 ms), open while this replica leads a target of the
database: its prepared statements must outlive the maintenance pool's rollbacks, which drop a
psycopg connection's prepared statements (and cost a DEALLOCATE round trip to the pass that rolls
back). The history rows are written through the maintenance engine, fenced.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime
from typing import Any, Callable, Protocol, Sequence

import psycopg
from psycopg.pq import TransactionStatus
from sqlalchemy import Engine

from .clock import ServerClock
from .config import HealthConfig, Settings
from .db import HostOrder, connect, describe_db_error
from .health import READ_TIMEOUT_MS, HealthReader, HealthReport, HolderWarnings, apply_metrics, clear_metrics
from .history import HistoryWriter
from .logs import about_target, kv
from .metrics import Metrics
from .queries import FINAL_STATES
from .services.base import CANCEL_TIMEOUT, Fence, NotLeader, PassContext, PassStopped

log = logging.getLogger("maintd.health")

POLL = 0.25  # seconds: how soon a new term gets its first read, and a lost one loses its gauges
LIVE_MAX_AGE = 60.0  # seconds: the job gauges' counts reused for a history sample


class Member(Protocol):
    """One target as the monitor sees it."""

    name: str
    schema: str
    settings: Settings
    metrics: Metrics
    engine: Engine  # its maintenance engine (the history rows are written through it, fenced)

    def leading(self) -> bool: ...

    def fence(self) -> Fence:
        """The current term's fence (raises :class:`NotLeader` without one)."""
        ...

    def connect(self) -> psycopg.Connection:
        """A new connection to the member's database for the health read."""
        ...

    def live_counts(self, at: datetime) -> list[tuple[str, str, int]] | None:
        """(queue, state, n) of waiting and running jobs if the leader counted them shortly
        before the server time ``at``."""
        ...


class TargetMember:
    """A :class:`maintd.target.Target` (its seat in the election loop of its database) as a
    :class:`Member`; ``hosts``: its database's host order (shared with the lock session)."""

    def __init__(self, target: Any, hosts: HostOrder):
        self.target, self.hosts = target, hosts

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def schema(self) -> str:
        return self.target.settings.schema

    @property
    def settings(self) -> Settings:
        return self.target.settings

    @property
    def metrics(self) -> Metrics:
        return self.target.metrics

    def leading(self) -> bool:
        return bool(self.target.is_leader)

    def fence(self) -> Fence:
        return self.target.fence()

    @property
    def engine(self) -> Engine:
        return self.target.engine

    def live_counts(self, at: datetime) -> list[tuple[str, str, int]] | None:
        counts = self.target.runner.gauges.counts  # the job gauges' last count (every 15 s)
        if counts is None or counts.live_at is None or (at - counts.live_at).total_seconds() > LIVE_MAX_AGE:
            return None
        return [(r["queue"], r["state"], r["count"]) for r in counts.rows if r["state"] not in FINAL_STATES]

    def connect(self) -> psycopg.Connection:
        s = self.target.settings
        return connect(self.hosts.dsn(), application_name=f"maintd:{s.instance_id}:health",
                       answer_timeout=READ_TIMEOUT_MS / 1000 + s.leader.lease.total_seconds(),
                       settings={"statement_timeout": READ_TIMEOUT_MS, "plan_cache_mode": "force_generic_plan",
                                 "lock_timeout": READ_TIMEOUT_MS, "jit": "off"})


class HealthMonitor:
    """The health of one database, for the members (targets) on it that lead here."""

    def __init__(self, members: Sequence[Member], config: Callable[[], HealthConfig], *,
                 history: Callable[[], HistoryWriter] = HistoryWriter):
        self.members, self.config = list(members), config
        self.reader = HealthReader()
        self.warnings = HolderWarnings()
        self.writers = {m.name: history() for m in self.members}
        self.clock = ServerClock()
        self.last: HealthReport | None = None
        self.error: str | None = None
        self._conn: psycopg.Connection | None = None
        # Members whose gauges this monitor set (led at the last look), with the tables it set.
        self._led: dict[str, frozenset[str]] = {}
        self._seen: set[str] = set()  # members leading at the last read (a new one is read at once)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- one read -------------------------------------------------------------------------------
    def poll(self) -> list[Member]:
        """No database: the members leading now; those that stopped lose their gauges and their
        history state (a new term reads the last row again)."""
        leading = [m for m in self.members if m.leading()]
        names = {m.name for m in leading}
        for m in self.members:
            if m.name in self._led and m.name not in names:
                clear_metrics(m.metrics)
                self.writers[m.name].reset()
        self._led = {k: v for k, v in self._led.items() if k in names}
        self._seen &= names
        return leading

    def run_once(self) -> HealthReport | None:
        """Read the health of the database (if this replica leads any of its targets) and apply it."""
        cfg = self.config()
        leading = self.poll() if cfg.enabled else []
        self._seen = {m.name for m in leading}
        if not leading:
            for m in self.members if not cfg.enabled else ():
                clear_metrics(m.metrics)
            self.last, self._led = None, {}
            self.warnings.forget()
            self._close()
            return None
        self.reader.show_query = cfg.show_query
        try:
            if self._conn is None or self._conn.closed:
                self._conn = leading[0].connect()
            report = self.reader.read(self._conn, sorted({m.schema for m in leading}))
        except Exception as exc:  # the next interval tries again; the gauges keep their last value
            self._failed(exc)
            self._close()
            return None
        self.error, self.last = None, report
        for m in leading:
            if m.leading():
                self._led[m.name] = apply_metrics(m.metrics, report, m.schema, self._led.get(m.name, frozenset()))
                self._history(m, report)
        self.warnings.check(report.horizon, cfg.xmin_warn_after, [m.name for m in leading])
        return report

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # pragma: no cover - gone already
                pass

    def _failed(self, exc: Exception) -> None:
        error = describe_db_error(exc)
        if self._stop.is_set():
            return  # cancelled by the stop: not a failure worth a line
        if error != self.error:
            log.warning("health read failed", extra=kv(error=error))
        self.error = error

    def _history(self, member: Member, report: HealthReport) -> None:
        with about_target(member.name if len(self.members) > 1 else None):
            try:
                ctx = PassContext.for_settings(member.settings, member.engine, self.clock, fence=member.fence())
                self.writers[member.name].step(ctx, report, lambda: member.live_counts(report.at))
            except (NotLeader, PassStopped):
                self.writers[member.name].reset()
            except Exception as exc:  # a history row is not worth more than a debug line
                log.debug("health history not written", extra=kv(target=member.name, error=describe_db_error(exc)))

    def status(self, name: str) -> dict[str, Any] | None:
        """The last read as one target's /status shows it, with ``error`` while the reads fail
        (None: this replica does not lead it)."""
        report, error = self.last, self.error
        member = next((m for m in self.members if m.name == name), None)
        if member is None or name not in self._seen:
            return None
        out = report.status(member.schema) if report is not None and name in self._led else {}
        return {**out, "error": error} if error is not None else out or None

    # -- a thread of its own --------------------------------------------------------------------
    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="maintd-health", daemon=True)
        self._thread.start()

    def stopping(self) -> None:
        """Ask the thread to end, cancelling the read it waits on (a lock: up to READ_TIMEOUT_MS)."""
        self._stop.set()
        conn = self._conn
        try:
            if conn is not None and conn.info.transaction_status == TransactionStatus.ACTIVE:
                conn.cancel_safe(timeout=CANCEL_TIMEOUT)
        except Exception:  # the read ends anyway: its statement timeout, or the connection gone
            pass

    def stop(self, timeout: float = 5.0) -> None:
        self.stopping()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for m in self.members:  # a stopped daemon leads nothing: no gauge of a read gone stale
            clear_metrics(m.metrics)
        self._led, self._seen, self.last = {}, set(), None
        self._close()

    def _loop(self) -> None:
        due = 0.0
        while not self._stop.wait(POLL):
            try:
                # a new term's first read at once; none while disabled (its run clears the gauges)
                leading = {m.name for m in self.poll()} if self.config().enabled else set()
                if time.monotonic() >= due or leading - self._seen:
                    self.run_once()
                    due = time.monotonic() + self.config().interval.total_seconds()
            except Exception as exc:  # the loop must outlive anything a read meets
                log.error("health monitor error", extra=kv(error=describe_db_error(exc)))


def monitors(groups: dict[Any, tuple[HostOrder, Sequence[Any]]], config: Callable[[], HealthConfig]
             ) -> list[HealthMonitor]:
    """One monitor per database: ``groups`` maps a database to its host order and its targets."""
    return [HealthMonitor([TargetMember(t, hosts) for t in targets], config)
            for hosts, targets in groups.values() if targets]
