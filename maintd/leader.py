"""Leader election: one loop per database (SPEC 3, 7.2, 8.3), a lease per target, and fencing.

* :class:`ElectionLoop` is one thread per database URL, the only user of that database's
  :class:`~maintd.lockconn.LockSession`. Each round it advances every target's :class:`Seat`
  (:func:`maintd.election.step`), sends the tries, proofs and unlocks of all of them in one
  statement, then the rare epoch bumps and releases, and sleeps until something is due, a NOTIFY
  arrives or a request comes in (fenced, stalled, hand-over, stop: :meth:`Seat.request`).
* Winning a lock bumps ``leader.epoch`` after locking the leader row ``FOR UPDATE`` under a short
  ``lock_timeout``: a bump that meets an old leader's in-flight fenced transaction is sent again
  the next round, never waited for, so no target holds up another's renewal.
* Every maintenance transaction that wrote anything runs :meth:`LeaderFence.check_writes` right
  before COMMIT: it locks the leader row ``FOR KEY SHARE`` and commits only while the epoch is
  ours and our lock session (by its ``pg_backend_pid()``, which a session pooler does not change)
  still holds the target's lock. A transaction that wrote nothing takes no lock and writes no WAL.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import random
import select
import socket
import threading
import time
from typing import TYPE_CHECKING, Callable, Sequence

import psycopg
from sqlalchemy import Connection

from .config import Settings
from .db import HostOrder, advisory_key, describe_db_error, periodic_channel
from .election import (BumpBlocked, BumpFailed, Bumped, Demoted, Elected, Following, Leading, Lost, Notified, Released,
                       Releasing, Renewed, Request, Round, State, Step, Term, Timing, Tried, due, leading_term, step)
from .faults import transient
from .lockconn import LeaderSessionError, LockSession
from .logs import about_target, kv
from .queries import Statements
from .queries import daemons as q_daemons
from .queries import leader as q
from .registry import DaemonRegistry
from .services.base import NotLeader

if TYPE_CHECKING:
    from .spread import Spread

log = logging.getLogger("maintd.leader")

__all__ = ["ElectionLoop", "LeaderFence", "LeaderSessionError", "Seat", "Term", "acquire_once",
           "handover_channel"]

BACKOFF_START, BACKOFF_CAP = 0.2, 5.0
BUMP_SLICE_MS = 100  # the epoch bump's row-lock wait per round
REFRESH = 1.0  # seconds between two reads of the live replicas (and whether the server takes writes)
REGISTER_RETRY = 30.0  # seconds between two tries of a daemons row that could not be written


def session_lost(exc: psycopg.Error) -> bool:
    """Whether an error may have ended the lock session, not only its statement: a lock or
    statement timeout on one target's table (a migration's ALTER TABLE) is that target's."""
    return isinstance(exc, psycopg.OperationalError) and not isinstance(
        exc, (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled))


def handover_channel(schema: str) -> str:
    return f"{schema}_maintd_leader"


class LeaderFence:
    """The :class:`maintd.services.base.Fence` of one term; ``current()`` is the target's term now."""

    def __init__(self, schema: str, term: Term, current: Callable[[], Term | None],
                 sql: Callable[[str], object] | None = None):
        self.term, self._current, self._sql = term, current, sql or Statements(schema).sql
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
        """Right before COMMIT: if the transaction wrote anything, prove the term (one statement)."""
        wrote, leads = conn.execute(self._sql(q.FENCE_WRITES), self._params).one()
        if wrote:
            self._check_term()
            if not leads:
                raise NotLeader(f"epoch {self.term.epoch} is no longer the leader's")


class Seat:
    """A target's place in its database's election: the state its loop advances and the spread's
    bookkeeping. The loop calls its hooks on its own thread (no-ops here; a daemon's
    :class:`maintd.target.Target` is a seat and acts on them)."""

    def __init__(self, settings: Settings, *, log_name: str | None = None):
        self.settings, self.name, self.schema = settings, settings.target_name, settings.schema
        self.log_name, self.key = log_name, advisory_key(settings.schema)
        self.statements = Statements(settings.schema)
        self.psql = self.statements.psql
        self.channels = {handover_channel(self.schema): True, periodic_channel(self.schema): False}
        self.state: State = Following()
        self.loop: ElectionLoop | None = None
        self.started = False  # the loop tries for it only once started (its schema checked)
        self.keep_trying = True  # run-once: a term lost is not taken again
        self.gate_at, self.notified, self.bump_waiting = 0.0, False, False
        self.failure: str | None = None  # why the last try's won lock gave no term (None: lost, or not tried)

    def on_elected(self, term: Term) -> None:
        """A term began."""

    def on_demoted(self, reason: str) -> None:
        """The term ended (lost, given up or released)."""

    def poke(self) -> None:
        """A NOTIFY on the target's periodic channel, or a reconnect that may have missed one."""

    def on_health(self, ok: bool) -> None:
        """The lock session works (True) or was lost."""

    def on_writable(self, writable: bool) -> None:
        """The server takes writes, or is read-only."""

    @property
    def term(self) -> Term | None:
        return leading_term(self.state)

    @property
    def is_leader(self) -> bool:
        return self.term is not None

    def fence(self) -> LeaderFence:
        term = self.term
        if term is None:
            raise NotLeader("not the leader")
        return LeaderFence(self.schema, term, lambda: self.term, self.statements.sql)

    def next_due(self) -> float:
        """When the loop must look at this target again (monotonic)."""
        waiting = isinstance(self.state, Following) and self.state.won_at is None
        if waiting and not self.started:
            return math.inf
        return max(due(self.state), self.gate_at) if waiting else due(self.state)

    def request(self, req: Request) -> None:
        if self.loop is not None:
            self.loop.request(self, req)

    def wake(self) -> None:
        """Ask the spread's gate again at once; through the loop, whose thread alone writes
        ``gate_at`` (a write from another thread could be overwritten by a gate asked meanwhile)."""
        if self.loop is not None:
            self.loop.request(self, None)

    def gave_up(self, reason: str) -> None:
        """A won lock is given back without a term: said, and a next win's wait is said again."""
        self.bump_waiting, self.failure = False, reason
        with about_target(self.log_name):
            log.warning("gave the won lock back without a term", extra=kv(reason=reason))

    def effect(self, effect: Elected | Demoted | None, was: Term | None) -> None:
        if effect is None:
            return
        with about_target(self.log_name):
            if isinstance(effect, Elected):
                self.bump_waiting = False
                log.info("became leader", extra=kv(epoch=effect.term.epoch, instance=effect.term.instance_id))
                self.on_elected(effect.term)
            elif isinstance(effect, Demoted):
                if effect.reason != "shutdown":
                    log.warning("lost leadership", extra=kv(reason=effect.reason, epoch=was and was.epoch))
                self.started = self.started and self.keep_trying
                self.on_demoted(effect.reason)


class ElectionLoop:
    """The elections of every target of one database, in one thread. ``register``: write each
    target's ``daemons`` row at connect (daemons do; ``run-once`` does not)."""

    def __init__(self, settings: Settings, seats: Sequence[Seat], hosts: HostOrder, *,
                 spread: "Spread | None" = None, register: bool = True):
        self.settings, self.targets, self.spread, self.register = settings, list(seats), spread, register
        self.session = LockSession(settings, hosts, self._notified)
        self.writable = True
        self.replicas: tuple[str, ...] | None = None  # the live replicas, as last read
        self.last_progress = time.monotonic()  # when the loop last went round or woke (for /healthz)
        self.sleeping = False  # in a deliberate wait (bounded), not in a call
        self.refused: LeaderSessionError | None = None  # the session was refused before it ever worked: the loop ended
        self._allowed = 0.0  # how long the call in progress may take by its own timeouts (a connect)
        self._by_channel = {channel: (seat, handover) for seat in self.targets
                            for channel, handover in seat.channels.items()}
        for seat in self.targets:
            seat.loop = self
        self._requests: queue.SimpleQueue[tuple[Seat, Request | Notified | None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stopping = self._ever_connected = False
        self._read_at = -math.inf
        self._unregistered: set[Seat] = set()  # targets whose daemons row the last connect could not write
        self._register_at = 0.0  # when to try them again (monotonic), unless the server takes writes again first
        self._thread: threading.Thread | None = None
        cfg = settings.leader
        # REFRESH, or often enough that idle_session_timeout (the lease) never ends an idle follower's session
        self.refresh = min(REFRESH, cfg.lease.total_seconds() / 2)
        self.timing = Timing(renew=cfg.renew_interval.total_seconds(), trust=(cfg.lease - cfg.renew_interval).total_seconds(),
                             bump_deadline=3 * cfg.lease.total_seconds(), retry=cfg.retry_interval.total_seconds())

    # -- from other threads ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="maintd-election", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_leader(self) -> bool:
        return any(seat.is_leader for seat in self.targets)

    def stalled_for(self) -> float:
        """Seconds a call has held the loop beyond what its own timeouts allow (a connect: each
        host's connect timeout), its waits between rounds and backoffs not counted."""
        return 0.0 if self.sleeping else max(0.0, time.monotonic() - self.last_progress - self._allowed)

    def request(self, seat: Seat, event: Request | Notified | None) -> None:
        """``event`` None: only ask the seat's gate again."""
        self._requests.put((seat, event))
        self.wake()

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b".")
        except OSError:  # pragma: no cover - a full pipe is awake already
            pass

    def stop(self, timeout: float = 5.0) -> None:
        """Graceful: every lock released, the followers woken, the session closed (by the thread)."""
        self._stopping = True
        for seat in self.targets:
            self.request(seat, Request("stop", "shutdown"))
        if self._thread is not None:
            self._thread.join(timeout)
        elif self.session.open:  # run-once's, without a thread
            try:
                self.round()
            except (psycopg.Error, OSError):
                pass
        self.session.close()

    # -- the loop ------------------------------------------------------------------------------------
    def run(self) -> None:
        delay = BACKOFF_START
        while True:
            self.last_progress = time.monotonic()
            try:
                if not self.session.open:
                    if self._stopping:
                        break
                    self._connect_bounded()
                    delay = BACKOFF_START
                self.round()
                if self._stopping and all(isinstance(t.state, Following) and t.state.won_at is None for t in self.targets):
                    self._left()
                    break  # every lock released
                self._sleep(min([self._read_at + self.refresh] + [t.next_due() for t in self.targets]))
            except Exception as exc:  # the loop survives anything a round meets
                delay = self._failed(exc, delay)
                if self.refused is not None:
                    break
        self.session.close()

    def _failed(self, exc: Exception, delay: float) -> float:
        """Every lock is gone with the session; say why, and wait before reconnecting."""
        error = describe_db_error(exc)
        self.session.close()
        self._lose(f"database error: {error}" if isinstance(exc, psycopg.Error) else str(exc))
        self._set(healthy=False)
        if isinstance(exc, LeaderSessionError) and not self.session.proven:
            self.refused = exc  # as at start-up (the first connect was cut short): the daemon exits 1
            return delay
        sleep = BACKOFF_CAP
        if isinstance(exc, LeaderSessionError):
            log.error("unusable lock session", extra=kv(error=error))
        elif isinstance(exc, psycopg.errors.InsufficientPrivilege):
            log.error("missing privilege: grant what `maintd grants ROLE` prints, as the owner role", extra=kv(error=error))
        elif isinstance(exc, (psycopg.Error, OSError)):
            sleep = min(BACKOFF_CAP, delay) * random.uniform(0.7, 1.3)
            what = "database unreachable" if transient(exc) else "database refused the lock session"
            log.warning(f"{what}, retrying", extra=kv(seconds=round(sleep, 1), error=error))
        else:
            log.exception("election loop error", extra=kv(error=error))
        self._take_requests(time.monotonic())  # a request left queued would cut every backoff short,
        self._drain_wake()  # and so would the wake-ups it left in the pipe
        self._sleep(time.monotonic() + sleep, session=False)
        return min(BACKOFF_CAP, delay * 2)

    def _connect_bounded(self) -> None:
        """:meth:`connect`, which may take each host's connect timeout without counting as a stall."""
        self._allowed = self.session.connect_bound()
        try:
            self.connect()
        finally:
            self._allowed, self.last_progress = 0.0, time.monotonic()

    def connect(self) -> None:
        """Open (and check) the lock session, LISTEN on every target's channels, register."""
        conn = self.session.connect(list(self._by_channel))
        version = conn.info.server_version
        log.info("reconnected to database" if self._ever_connected else "connected to database",
                 extra=kv(server_version=version))
        if version < 140000 and not self._ever_connected:
            log.warning("PostgreSQL before 14 has no idle_session_timeout: a frozen leader keeps "
                        "the lock until its TCP connection dies (fencing still prevents writes)")
        self._ever_connected = True
        self._register(self.targets if self.register else [])
        self._set(healthy=True)
        self._read_at = -math.inf
        for seat in self.targets:  # NOTIFYs sent while the session was away were not delivered
            seat.poke()

    def _register(self, seats: Sequence[Seat]) -> None:
        """Write each target's ``daemons`` row from this session. One that cannot be written (a
        read-only server) is written at the refresh that finds the server taking writes again, or
        every ``REGISTER_RETRY`` s: until then, `maintd status` and the other replicas' spread do
        not see this daemon alive."""
        self._register_at = time.monotonic() + REGISTER_RETRY
        for seat in seats:
            if self._try(seat, lambda s: DaemonRegistry(s.schema, self.settings.instance_id).register(
                    lambda template, params: self.session.run(s.psql(template), params)), "could not register"):
                self._unregistered.discard(seat)
            else:
                self._unregistered.add(seat)

    def _left(self) -> None:
        """Stopping: each registered target's ``daemons`` row says when this daemon left."""
        for seat in self.targets if self.register else []:
            if seat not in self._unregistered:
                self._try(seat, lambda s: self.session.run(s.psql(q_daemons.STOPPED),
                                                           {"instance": self.settings.instance_id}), "could not record")

    def round(self) -> None:
        """Requests, then one statement with every try, proof and unlock due, then the bumps and
        releases; again at once while a won lock waits for its bump. A round that fails closes
        the session (the server frees its locks): no lock is kept in an unknown state."""
        try:
            while self._round():
                pass
        except BaseException:
            self.session.close()
            raise

    def _round(self) -> bool:
        now = time.monotonic()
        self._take_requests(now)
        sends: dict[str, list[Seat]] = {"try": [], "renew": [], "unlock": [], "bump": [], "release": []}
        # Renewals go together: when one is due, those due within half an interval are sent with
        # it (early proofs are sound), so the leases of many targets cost one statement, not one each.
        due_now = any(isinstance(s.state, Leading) and s.state.renew_at <= now for s in self.targets)
        renew_by = now + self.timing.renew / 2 if due_now else -math.inf
        for seat in self.targets:
            send = self._apply(seat, Round(self._gate(seat, now), renew_by), now)
            if send is not None:
                sends[send].append(seat)
        for seat in sends["try"]:  # a new try: what an earlier one met is not what this one meets
            seat.failure = None
        if sends["try"] or sends["renew"] or sends["unlock"]:
            won, held, sent = self.session.round_trip(*([s.key for s in sends[k]] for k in ("try", "renew", "unlock")))
            for seat, event in [*((s, Tried(w)) for s, w in zip(sends["try"], won)),
                                *((s, Renewed(h, sent)) for s, h in zip(sends["renew"], held)),
                                *((s, Released()) for s in sends["unlock"])]:
                if isinstance(event, Tried) and not event.won and self.spread is not None:
                    self.spread.tried(seat.name, False)
                self._apply(seat, event, time.monotonic())
        # Bumps and releases are a transaction each: past half a renew interval the rest wait for
        # the next round, so the renewals due go first (many locks won at once are many bumps).
        until = time.monotonic() + self.timing.renew / 2  # (the first always goes)
        for seat, act in [*((s, self._bump) for s in sends["bump"]), *((s, self._release) for s in sends["release"])]:
            if time.monotonic() < until:
                act(seat)
        self._refresh()
        return any(isinstance(s.state, Following) and s.state.won_at is not None for s in sends["try"])

    def _take_requests(self, now: float) -> None:
        while not self._requests.empty():
            seat, event = self._requests.get_nowait()
            seat.notified = seat.notified or isinstance(event, Notified)
            seat.gate_at = 0.0 if event is None or isinstance(event, Notified) else seat.gate_at
            if event is not None:
                self._apply(seat, event, now)

    def _apply(self, seat: Seat, event: object, now: float) -> str | None:
        was, following = seat.term, isinstance(seat.state, Following)
        result: Step = step(seat.state, event, now, self.timing, self.settings.instance_id)
        seat.state = result.state
        if following and isinstance(event, Round) and isinstance(result.state, Releasing):
            seat.gave_up(result.state.reason)  # a won lock whose bump stayed blocked past its deadline
        seat.effect(result.effect, was)
        return result.send

    def _gate(self, seat: Seat, now: float) -> bool:
        """Whether a follower may try now: its state would, and so does the spread."""
        s = seat.state
        if self._stopping or not (seat.started and isinstance(s, Following) and s.won_at is None and now >= max(due(s), seat.gate_at)):
            return False
        wait = 0.0 if self.spread is None else self.spread.gate(seat.name, seat.notified)
        # (from a clock read after the gate's own: at or just after the due it keeps, never
        # before, so the loop does not wake for a round in which it is not due yet)
        seat.notified, seat.gate_at = False, time.monotonic() + wait
        return wait <= 0

    def _bump(self, seat: Seat) -> None:
        params = {"instance": self.settings.instance_id, "host": socket.gethostname(), "pid": os.getpid()}
        try:
            event: object = Bumped(*self.session.bump(seat.key, seat.psql, params, BUMP_SLICE_MS))
        except psycopg.errors.LockNotAvailable:
            if not seat.bump_waiting:
                with about_target(seat.log_name):
                    log.info("waiting for the previous leader's transactions to end")
            seat.bump_waiting, event = True, BumpBlocked()
        except psycopg.Error as exc:
            if session_lost(exc):
                raise
            seat.failure = describe_db_error(exc, role=self.session.user)
            if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):  # a reported state, not an error
                self._set(writable=False)  # (SPEC 8.5): said once, /readyz 503, writable 0
            else:
                with about_target(seat.log_name):
                    log.error("could not start a term", extra=kv(error=seat.failure))
            event = BumpFailed(seat.failure)
        if self.spread is not None and not isinstance(event, BumpBlocked):
            self.spread.tried(seat.name, isinstance(event, Bumped))
        self._apply(seat, event, time.monotonic())

    def _release(self, seat: Seat) -> None:
        """A graceful release: the term ended in ``leader`` (if the row can still be written), the
        lock given back, the followers woken."""
        term, reason = seat.state.term, seat.state.reason
        self._try(seat, lambda s: self.session.run(s.psql(q.RELEASE), {"epoch": term.epoch, "instance": term.instance_id}),
                  "could not record the release")
        self.session.round_trip([], [], [seat.key])
        self.session.run(seat.psql(q.HANDOVER_NOTIFY), {"channel": handover_channel(seat.schema), "instance": term.instance_id})
        with about_target(seat.log_name):
            log.info("released leadership", extra=kv(epoch=term.epoch, reason=reason))
        self._apply(seat, Released(), time.monotonic())

    def _try(self, seat: Seat, statement: Callable[[Seat], object], failed: str) -> bool:
        """A statement on one target's tables: its failure (a schema gone) is that target's."""
        try:
            statement(seat)
            return True
        except psycopg.Error as exc:
            if session_lost(exc):
                raise
            with about_target(seat.log_name):
                log.debug(failed, extra=kv(error=describe_db_error(exc)))
            return False

    def _lose(self, reason: str) -> None:
        for seat in self.targets:
            self._apply(seat, Lost(reason), time.monotonic())
        if self.spread is not None:  # a try granted and not answered is over
            self.spread.forget([seat.name for seat in self.targets])

    def _refresh(self) -> None:
        """Every ``refresh`` s, one statement: the live replicas (the spread's R, from the first target
        whose schema answers) and whether the server takes writes. It also keeps the session from
        looking idle, so ``idle_session_timeout`` ends it only when this process is frozen or cut off."""
        if time.monotonic() - self._read_at < self.refresh:
            return
        self._read_at, was = time.monotonic(), self.replicas
        for seat in self.targets:
            rows: list = []
            if self._try(seat, lambda s: rows.extend(self.session.run(s.psql(q_daemons.REFRESH))), "could not read"):
                self.replicas = tuple(rows[0][1])
                break
        else:
            rows = self.session.run(q.WRITABLE)
        writable_again = bool(rows[0][0]) and not self.writable
        self._set(writable=bool(rows[0][0]))
        if self._unregistered and self.writable and (writable_again or time.monotonic() >= self._register_at):
            # (a target whose schema is not checked yet is not tried)
            self._register([seat for seat in self._unregistered if seat.started])
        if left := sorted(set(was or ()) - set(self.replicas or ())):  # when they left (/status: gone)
            for seat in self.targets:
                self._try(seat, lambda s: self.session.run(s.psql(q_daemons.LEFT), {"ids": left}), "could not record")
        if self.spread is not None and self.replicas != was:
            self.spread.refresh(at_once=True)  # a replica came or went: its targets move now

    def _sleep(self, until: float, session: bool = True) -> None:
        """Until ``until`` (monotonic), a request, or (``session``) what the server sends: NOTIFYs
        read at once, or its goodbye (raises)."""
        if not self._requests.empty():
            return
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        if session and self.session.open:
            poller.register(self.session.conn.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        self.sleeping = True
        try:
            ready = poller.poll(max(0.0, min(until - time.monotonic(), 60.0)) * 1000)
        finally:
            self.sleeping, self.last_progress = False, time.monotonic()
        for fd, _ in ready:
            if fd == self._wake_r:
                self._drain_wake()
            else:
                self.session.drain()

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _notified(self, channel: str) -> None:
        seat, handover = self._by_channel.get(channel, (None, False))
        if seat is not None and handover:  # applied at the next round's start, not amid this one
            self._requests.put((seat, Notified()))
        elif seat is not None:
            seat.poke()

    def _set(self, *, healthy: bool | None = None, writable: bool | None = None) -> None:
        if writable is not None and writable != self.writable:
            log.warning("database takes writes again: maintenance resumed" if writable
                        else "database is read-only: maintenance paused")
        for seat in self.targets:
            if healthy is not None:
                seat.on_health(healthy)
            if writable is not None:
                seat.on_writable(writable)
        self.writable = self.writable if writable is None else writable


class _OnceSeat(Seat):
    """run-once's seat: a term lost is not taken again, and its end is told to ``demoted``."""

    def __init__(self, settings: Settings, demoted: Callable[[str], None]):
        super().__init__(settings)
        self.keep_trying, self._demoted = False, demoted

    def on_demoted(self, reason: str) -> None:
        self._demoted(reason)


def acquire_once(settings: Settings, wait: float = 0.0, *,
                 on_demoted: Callable[[str], None] | None = None) -> tuple[ElectionLoop, LeaderFence] | None:
    """For ``run-once``: the lock (trying for up to ``wait`` s), renewed by the loop's thread until
    ``loop.stop()`` releases it; a term lost is not taken again. None if another instance holds
    it. Database errors while connecting propagate."""
    seat = _OnceSeat(settings, on_demoted or (lambda reason: None))
    loop = ElectionLoop(settings, [seat], HostOrder(settings.database_url.get_secret_value()), register=False)
    loop.connect()
    seat.started = True
    deadline = time.monotonic() + wait
    loop.round()
    while seat.term is None and time.monotonic() < deadline:
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        loop.round()
    if seat.term is None:
        loop.stop()
        if seat.failure is not None:  # the lock was won, not held by another instance
            raise RuntimeError(f"could not start a term: {seat.failure}")
        if seat.bump_waiting:  # won too, but its epoch bump never got the leader row
            raise RuntimeError("could not start a term: the previous leader's transactions held the leader row "
                               "for all of --wait (they end within its statement timeout): try again, or raise --wait")
        return None
    loop.start()
    return loop, seat.fence()
