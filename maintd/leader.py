"""Leader election: one loop per database (SPEC 3, 7.2, 8.3), a lease per target, and fencing.

* :class:`ElectionLoop` is one thread per database URL and the only user of that database's
  :class:`~maintd.lockconn.LockSession`. Each round it advances every target's state
  (:func:`maintd.election.step`), sends the tries, proofs and unlocks of all of them in one round
  trip, then the rare epoch bumps and releases, and sleeps until something is due, a NOTIFY
  arrives or a request comes in (:meth:`ElectionLoop.request`: fenced, stalled, hand-over, stop).
* Winning a lock bumps ``leader.epoch`` after locking the leader row ``FOR UPDATE`` under a short
  ``lock_timeout``; a bump that meets an old leader's in-flight fenced transaction is retried the
  next round, never waited for, so no target holds up another's renewal.
* Every maintenance transaction that wrote anything runs :meth:`LeaderFence.check_writes` last,
  right before COMMIT: it locks the leader row ``FOR KEY SHARE`` and commits only while the epoch
  is ours and our lock session (by its ``pg_backend_pid()``, which a session pooler does not
  change) still holds the target's lock; otherwise it rolls back. A transaction that wrote nothing
  takes no lock and writes no WAL.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import select
import threading
import time
from typing import TYPE_CHECKING, Callable, Sequence

import psycopg
from sqlalchemy import Connection

from .config import Settings
from .db import HostOrder, advisory_key, describe_db_error
from .faults import transient
from .election import (INF, BumpBlocked, BumpFailed, Bumped, Demoted, Elected, Following, Leading, Lost,
                       Notified, Released, Releasing, Renewed, Request, Round, Step, Term, Timing, Tried, due, step)
from .lockconn import LeaderSessionError, LockSession
from .logs import about_target, kv
from .queries import Statements
from .queries import daemons as q_daemons
from .queries import leader as q
from .services.base import NotLeader

if TYPE_CHECKING:
    from .spread import Spread
    from .target import Seat

log = logging.getLogger("maintd.leader")

__all__ = ["ElectionLoop", "Held", "LeaderFence", "LeaderSessionError", "Term", "acquire_once", "handover_channel"]

BACKOFF_START, BACKOFF_CAP = 0.2, 5.0
BUMP_SLICE_MS = 100  # the epoch bump's row-lock wait per round
REFRESH = 1.0  # seconds between two reads of the live replicas


def handover_channel(schema: str) -> str:
    return f"{schema}_maintd_leader"


class LeaderFence:
    """The :class:`maintd.services.base.Fence` of one term. ``current`` returns the target's term
    now (None when it has none)."""

    def __init__(self, schema: str, term: Term, current: Callable[[], Term | None],
                 sql: Callable[[str], object] | None = None):
        self.term = term
        self._current = current
        self._sql = sql or Statements(schema).sql
        classid, objid = advisory_key(schema)
        self._params = {"epoch": term.epoch, "instance": term.instance_id, "lock_pid": term.lock_pid,
                        "classid": classid, "objid": objid}

    @property
    def epoch(self) -> int:
        return self.term.epoch

    def _check_term(self) -> None:
        now = self._current()
        if now is None or now.epoch != self.term.epoch or not now.trusted():
            raise NotLeader("leadership lease expired or lost")

    def check(self, conn: Connection) -> None:
        self._check_term()
        if conn.execute(self._sql(q.FENCE), self._params).first() is None:
            raise NotLeader(f"epoch {self.term.epoch} is no longer the leader's")

    def check_writes(self, conn: Connection) -> None:
        """Right before COMMIT: if the transaction wrote anything, prove the term (one statement;
        none of it when nothing was written)."""
        wrote, leads = conn.execute(self._sql(q.FENCE_WRITES), self._params).one()
        if not wrote:
            return
        self._check_term()
        if not leads:
            raise NotLeader(f"epoch {self.term.epoch} is no longer the leader's")


class ElectionLoop:
    """The elections of every target of one database, in one thread. ``register``: write each
    target's ``daemons`` row at connect (daemons do; ``run-once`` does not)."""

    def __init__(self, settings: Settings, targets: Sequence["Seat"], hosts: HostOrder, *,
                 spread: "Spread | None" = None, register: bool = True):
        self.settings = settings
        self.targets = list(targets)
        self.spread = spread
        self.register = register
        self.session = LockSession(settings, hosts, self._notified)
        self.healthy = False
        self.writable = True
        self.replicas: tuple[str, ...] | None = None  # the live replicas, as last read
        self.last_progress = time.monotonic()  # when the loop last went round (for /healthz)
        self._by_channel: dict[str, tuple["Seat", bool]] = {}
        for t in self.targets:
            t.loop = self
            self._by_channel[handover_channel(t.schema)] = (t, True)
            self._by_channel[t.periodic_channel] = (t, False)
        self._requests: queue.SimpleQueue[tuple["Seat", Request | Notified]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stopping = False
        self._ever_connected = False
        self._read_at = float("-inf")
        self._thread: threading.Thread | None = None

    def timing(self) -> Timing:
        cfg = self.settings.leader
        return Timing(renew=cfg.renew_interval.total_seconds(), trust=(cfg.lease - cfg.renew_interval).total_seconds(),
                      bump_deadline=3 * cfg.lease.total_seconds(), retry=cfg.retry_interval.total_seconds())

    # -- from other threads ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="maintd-election", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def request(self, target: "Seat", req: Request) -> None:
        self._requests.put((target, req))
        self.wake()

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b".")
        except (BlockingIOError, OSError):  # pragma: no cover - a full pipe is awake already
            pass

    def stop(self, timeout: float = 5.0) -> None:
        """Graceful: release every lock, tell followers, close the session (done by the thread)."""
        self._stopping = True
        for t in self.targets:
            self.request(t, Request("stop", "shutdown"))
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self._round_until_settled()
        self.session.close()

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        delay = BACKOFF_START
        while not (self._stopping and self._settled()):
            self.last_progress = time.monotonic()
            try:
                if not self.session.open:
                    if self._stopping:
                        break
                    self.connect()
                    delay = BACKOFF_START
                self.round()
                self._wait()
            except Exception as exc:  # the loop survives anything a round meets
                delay = self._failed(exc, delay)
        self.session.close()

    def _failed(self, exc: Exception, delay: float) -> float:
        """Every lock is gone with the session; say why, and wait before reconnecting."""
        error = describe_db_error(exc)
        self.session.close()
        self._lose(f"database error: {error}" if isinstance(exc, psycopg.Error) else f"{exc}")
        self._set_health(False)
        if isinstance(exc, LeaderSessionError):
            log.error("%s", exc)
            sleep = BACKOFF_CAP
        elif isinstance(exc, psycopg.errors.InsufficientPrivilege):
            log.error("missing privilege (grant what `maintd grants ROLE` prints, as the owner role)",
                      extra=kv(error=error))
            sleep = BACKOFF_CAP
        elif isinstance(exc, (psycopg.Error, OSError)):
            sleep = min(BACKOFF_CAP, delay) * random.uniform(0.7, 1.3)
            what = "database unreachable" if transient(exc) else "database refused the lock session"
            log.warning(f"{what}, retrying", extra=kv(seconds=round(sleep, 1), error=error))
        else:
            log.exception("election loop error", extra=kv(error=error))
            sleep = BACKOFF_CAP
        self._sleep(sleep)
        return min(BACKOFF_CAP, delay * 2)

    def connect(self) -> None:
        """Open (and check) the lock session, LISTEN on every target's channels, register."""
        conn = self.session.connect(list(self._by_channel))
        if self._ever_connected:
            log.info("reconnected to database")
        else:
            log.info("connected to database", extra=kv(server_version=conn.info.server_version))
            if conn.info.server_version < 140000:
                log.warning("PostgreSQL before 14 has no idle_session_timeout: a frozen leader keeps "
                            "the lock until its TCP connection dies (fencing still prevents writes)")
        self._ever_connected = True
        if self.register:
            for t in self.targets:
                t.register(self.session)
        self._set_health(True)
        self._read_at = float("-inf")

    def _settled(self) -> bool:
        return all(isinstance(t.state, Following) and t.state.won_at is None for t in self.targets)

    def _round_until_settled(self) -> None:
        """Without a thread (``run-once``'s stop): release what is held, on this thread."""
        for _ in range(3):
            if self._settled() or not self.session.open:
                return
            try:
                self.round()
            except (psycopg.Error, OSError):
                return

    def round(self) -> None:
        """Requests, then one round trip with every try, proof and unlock due, then the bumps
        and releases; again at once while a won lock waits for its bump. A round that fails
        closes the session (the server frees its locks): no lock is kept in an unknown state."""
        try:
            self._round()
        except BaseException:
            self.session.close()
            raise

    def _round(self) -> None:
        now = time.monotonic()
        while True:
            try:
                seat, event = self._requests.get_nowait()
            except queue.Empty:
                break
            if isinstance(event, Notified):
                seat.notified, seat.gate_at = True, 0.0
            self._apply(seat, step(seat.state, event, now, self.timing(), self.settings.instance_id))
        sends: dict[str, list["Seat"]] = {"try": [], "renew": [], "unlock": [], "bump": [], "release": []}
        for t in self.targets:
            s = self._apply(t, step(t.state, Round(self._gate(t, now)), now, self.timing(), self.settings.instance_id))
            if s is not None:
                sends[s].append(t)
        if sends["try"] or sends["renew"] or sends["unlock"]:
            self._round_trip(sends["try"], sends["renew"], sends["unlock"])
        for t in sends["bump"]:
            self._bump(t)
        for t in sends["release"]:
            self._release(t)
        self._refresh()
        if any(isinstance(t.state, Following) and t.state.won_at is not None for t in sends["try"]):
            self._round()  # bump the epochs just won now

    def _gate(self, t: "Seat", now: float) -> bool:
        """Whether a follower may try now (asked only when its own state would)."""
        s = t.state
        if not (isinstance(s, Following) and s.won_at is None and now >= due(s) and t.started):
            return False
        if now < t.gate_at:
            return False
        wait = 0.0 if self.spread is None else self.spread.gate(t.name, t.notified)
        t.notified = False
        t.gate_at = now + wait
        return wait <= 0

    def _round_trip(self, tries: list["Seat"], renewals: list["Seat"], unlocks: list["Seat"]) -> None:
        won, held, sent = self.session.round_trip([t.key for t in tries], [t.key for t in renewals],
                                                  [t.key for t in unlocks])
        now, timing, me = time.monotonic(), self.timing(), self.settings.instance_id
        for t, w in zip(tries, won):
            if self.spread is not None and not w:
                self.spread.tried(t.name, False)
            self._apply(t, step(t.state, Tried(bool(w)), now, timing, me))
        for t, h in zip(renewals, held):
            self._apply(t, step(t.state, Renewed(h, sent), now, timing, me))
        for t in unlocks:
            self._apply(t, step(t.state, Released(), now, timing, me))

    def _bump(self, t: "Seat") -> None:
        params = {"instance": self.settings.instance_id, "host": t.registry_host, "pid": os.getpid()}
        try:
            epoch, pid, sent = self.session.bump(t.key, t.psql, params, BUMP_SLICE_MS)
            event: object = Bumped(epoch, pid, sent)
        except psycopg.errors.LockNotAvailable:
            if not t.bump_waiting:
                with about_target(t.log_name):
                    log.info("waiting for the previous leader's transactions to end")
            t.bump_waiting = True
            event = BumpBlocked()
        except psycopg.Error as exc:
            if isinstance(exc, psycopg.OperationalError) or self.session.conn.broken:
                raise
            with about_target(t.log_name):
                log.error("could not start a term", extra=kv(error=describe_db_error(exc)))
            event = BumpFailed(describe_db_error(exc))
        if self.spread is not None and not isinstance(event, BumpBlocked):
            self.spread.tried(t.name, isinstance(event, Bumped))
        self._apply(t, step(t.state, event, time.monotonic(), self.timing(), self.settings.instance_id))

    def _release(self, t: "Seat") -> None:
        """A graceful release: the term ended in ``leader``, the lock given back, the followers
        woken; if the row cannot be written (the schema gone), the lock is given back all the same."""
        term = t.state.term
        try:
            self.session.run(t.psql(q.RELEASE), {"epoch": term.epoch, "instance": term.instance_id})
        except psycopg.Error as exc:
            if isinstance(exc, psycopg.OperationalError):
                raise
            with about_target(t.log_name):
                log.warning("could not record the release", extra=kv(error=describe_db_error(exc)))
        self.session.round_trip([], [], [t.key])
        self.session.run(t.psql(q.HANDOVER_NOTIFY), {"channel": handover_channel(t.schema), "instance": term.instance_id})
        with about_target(t.log_name):
            log.info("released leadership", extra=kv(epoch=term.epoch, reason=t.state.reason))
        self._apply(t, step(t.state, Released(), time.monotonic(), self.timing(), self.settings.instance_id))

    def _apply(self, t: "Seat", result: Step) -> str | None:
        was = t.term
        t.state = result.state
        if isinstance(result.effect, Elected):
            t.bump_waiting = False
            with about_target(t.log_name):
                t.elected(result.effect.term)
        elif isinstance(result.effect, Demoted):
            with about_target(t.log_name):
                t.demoted(result.effect.reason, was)
        return result.send

    def _lose(self, reason: str) -> None:
        now = time.monotonic()
        for t in self.targets:
            self._apply(t, step(t.state, Lost(reason), now, self.timing(), self.settings.instance_id))

    def _refresh(self) -> None:
        """Every REFRESH s: the live replicas (the spread's R) and whether the server takes writes,
        read from the first target whose schema answers; keeps the session busy meanwhile, so
        ``idle_session_timeout`` ends it only when this process is frozen or cut off."""
        now = time.monotonic()
        if now - self._read_at < REFRESH:
            return
        self._read_at = now
        for t in self.targets:
            try:
                rows = self.session.run(t.psql(q_daemons.LIVE_REPLICAS))
            except psycopg.Error as exc:
                if isinstance(exc, psycopg.OperationalError):
                    raise
                continue
            self.replicas = tuple(r[0] for r in rows)
            break
        else:
            self.session.run(q.BACKEND_PID)
        [(writable,)] = self.session.run(q.WRITABLE)
        self._set_writable(bool(writable))
        if self.spread is not None:
            self.spread.refresh()

    def _wait(self) -> None:
        """Sleep until the next thing is due, a NOTIFY arrives (read at once) or a request."""
        now = time.monotonic()
        due = min([self._read_at + REFRESH] + [t.next_due() for t in self.targets])
        if not self._requests.empty():
            return
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        if self.session.open:
            poller.register(self.session.conn.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        ready = poller.poll(max(0.0, min(due - now, 60.0)) * 1000)
        for fd, _ in ready:
            if fd == self._wake_r:
                while True:
                    try:
                        if not os.read(self._wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
            else:
                self.session.drain()  # NOTIFYs (or the server's goodbye: raises)

    def _sleep(self, seconds: float) -> None:
        """Wait before reconnecting; a request (stop) ends it."""
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        poller.poll(seconds * 1000)

    def _notified(self, channel: str) -> None:
        found = self._by_channel.get(channel)
        if found is None:
            return
        seat, handover = found
        if handover:  # applied at the next round's start, not in the middle of this one
            self._requests.put((seat, Notified()))
        else:
            seat.poke()

    def _set_health(self, ok: bool) -> None:
        self.healthy = ok
        for t in self.targets:
            t.database_health(ok)

    def _set_writable(self, writable: bool) -> None:
        if writable != self.writable:
            log.warning("database is read-only: maintenance paused" if not writable
                        else "database takes writes again: maintenance resumed")
        self.writable = writable
        for t in self.targets:
            t.database_writable(writable)


class Held:
    """``run-once``'s hold on one target's lock, renewed by a loop thread until :meth:`stop`
    releases it; a term lost is not taken again."""

    def __init__(self, loop: ElectionLoop, seat: "Seat"):
        self.loop, self.seat = loop, seat

    @property
    def is_leader(self) -> bool:
        return self.seat.is_leader

    def stop(self, timeout: float = 5.0) -> None:
        self.loop.stop(timeout)


def acquire_once(settings: Settings, wait: float = 0.0, *,
                 on_demoted: Callable[[str], None] | None = None) -> "tuple[Held, LeaderFence] | None":
    """For ``run-once``: the lock (trying for up to ``wait`` s), renewed in a thread until
    ``held.stop()``. None if another instance holds it. Database errors while connecting propagate."""
    from .target import Seat

    seat = Seat(settings, on_demoted=on_demoted or (lambda reason: None))
    seat.keep_trying = False
    loop = ElectionLoop(settings, [seat], HostOrder(settings.database_url.get_secret_value()), register=False)
    loop.connect()
    seat.started = True
    deadline = time.monotonic() + wait
    while seat.term is None:
        loop.round()
        if seat.term is not None:
            break
        if time.monotonic() >= deadline:
            loop.stop()
            return None
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    loop.start()
    return Held(loop, seat), seat.fence()
