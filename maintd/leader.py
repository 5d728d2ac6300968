"""Leader election: a session-level advisory lock on a dedicated connection, a lease, and fencing.

* The lock is held by one non-pooled connection, the :class:`~maintd.lockconn.LockConnection`
  (``application_name=maintd:<instance>``; shared by up to 5 targets of a database, each
  through its :class:`LockSession`), with TCP keepalives and ``tcp_user_timeout = lease``. That
  session has ``idle_session_timeout = lease`` (PostgreSQL 14+): if this process freezes or is
  cut off, the server ends the session (and frees its locks) within the lease.
* A leadership is a :class:`Term`: the epoch, the server-side pid of the lock session, and until
  when (monotonic) it can be trusted. The leader proves the lock every ``renew_interval``; the term
  is trusted for ``lease - renew_interval`` after the last proof was sent (the server's idle timer
  cannot have started earlier); on any failure, or when that runs out, it demotes itself.
* Winning the lock bumps ``leader.epoch`` after locking the leader row ``FOR UPDATE``. Every
  maintenance transaction that wrote anything runs :meth:`LeaderFence.check_writes` last, right
  before COMMIT: it locks the leader row ``FOR KEY SHARE`` and commits only while the epoch is
  ours and our lock session (by its ``pg_backend_pid()``, which a session pooler does not change)
  still holds the lock; otherwise the transaction rolls back. A new leader's epoch bump waits for
  such in-flight transactions; once it commits, a stale ex-leader's writes never commit. A
  transaction that wrote nothing (an idle pass) takes no lock and writes no WAL. (KEY SHARE, not
  SHARE: it must not conflict with updates of the row's other columns.)
* Renewing the lease is read-only (the lock is still held by this session, the term is still
  ours, the server is a primary): an idle leader writes no WAL.
* The elector thread is a follower (:meth:`LeaderElector._follow`: try the lock every
  ``retry_interval``, waking early on the hand-over NOTIFY a leader sends when it stops
  gracefully) or a leader (:meth:`LeaderElector._lead`: renew, or demote).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import psycopg
from sqlalchemy import Connection

from .config import Settings
from .db import HostOrder, advisory_key, bounded_answer, describe_db_error, ms, periodic_channel
from .identifiers import quote_ident
from .lockconn import POOLER_HINT, LeaderSessionError, LockConnection, SessionClosed
from .logs import about_target, kv
from .queries import leader as q
from .queries import psycopg_sql, sql
from .registry import DaemonRegistry
from .services.base import NotLeader

log = logging.getLogger("maintd.leader")

BACKOFF_START, BACKOFF_CAP = 0.2, 5.0
BUMP_SLICE = timedelta(milliseconds=100)  # the epoch bump's row-lock wait, per attempt
MAX_STACKED = 16  # unlock attempts: a session-level advisory lock stacks once per success
UNLOCK_ANSWER = 1.0  # seconds an unlock on the shared session may take before it is closed


def handover_channel(schema: str) -> str:
    return f"{schema}_maintd_leader"


@dataclass(frozen=True)
class Term:
    epoch: int
    lock_pid: int  # pg_backend_pid() of the lock session: the server's pid, not a pooler's key
    instance_id: str
    trusted_until: float  # monotonic time after which the lease may have run out

    def trusted(self) -> bool:
        return time.monotonic() < self.trusted_until


class LeaderFence:
    """The :class:`maintd.services.base.Fence` of one term. ``current`` returns the elector's
    term now (None when it has none)."""

    def __init__(self, schema: str, term: Term, current: Callable[[], Term | None]):
        self.schema = schema
        self.term = term
        self._current = current
        self._key = advisory_key(schema)

    @property
    def epoch(self) -> int:
        return self.term.epoch

    def _params(self) -> dict:
        return {"epoch": self.term.epoch, "instance": self.term.instance_id, "lock_pid": self.term.lock_pid,
                "classid": self._key[0], "objid": self._key[1]}

    def _check_term(self) -> None:
        now = self._current()
        if now is None or now.epoch != self.term.epoch or not now.trusted():
            raise NotLeader("leadership lease expired or lost")

    def check(self, conn: Connection) -> None:
        self._check_term()
        if conn.execute(sql(q.FENCE, self.schema), self._params()).first() is None:
            raise NotLeader(f"epoch {self.term.epoch} is no longer the leader's")

    def check_writes(self, conn: Connection) -> None:
        """Right before COMMIT: if the transaction wrote anything, prove the term (one statement;
        none of it when nothing was written)."""
        wrote, leads = conn.execute(sql(q.FENCE_WRITES, self.schema), self._params()).one()
        if not wrote:
            return
        self._check_term()
        if not leads:
            raise NotLeader(f"epoch {self.term.epoch} is no longer the leader's")


class LockSession:
    """One target's view of its database's :class:`~maintd.lockconn.LockConnection`: the advisory
    lock of one schema (held, or tried for), its hand-over and ``periodic_jobs`` channels."""

    def __init__(self, settings: Settings, hosts: HostOrder | None = None,
                 shared: LockConnection | None = None):
        self.settings = settings
        self.shared = shared or LockConnection(settings, hosts)
        self.schema = settings.schema
        self.classid, self.objid = advisory_key(settings.schema)
        self._generation: int | None = None  # of the shared connection while attached
        self._handover = threading.Event()  # a hand-over NOTIFY arrived
        self._bell = threading.Event()  # wakes wait_for_handover (a NOTIFY, or ring())
        # Called (from the thread that read it) with each NOTIFY on the periodic_jobs channel.
        self.on_notify: Callable[[str], None] = lambda channel: None

    @property
    def open(self) -> bool:
        return self._generation is not None and self._generation == self.shared.generation and self.shared.open

    @property
    def conn(self) -> psycopg.Connection | None:
        return self.shared.conn if self.open else None

    @property
    def server(self) -> tuple[str | None, int | None]:
        return self.shared.server

    def _channels(self) -> dict[str, Callable[[], None]]:
        periodic = periodic_channel(self.schema)
        return {handover_channel(self.schema): self._handed_over,
                periodic: lambda: self.on_notify(periodic)}

    def _handed_over(self) -> None:
        self._handover.set()
        self._bell.set()

    def ring(self) -> None:
        """Make a :meth:`wait_for_handover` in progress look at its ``stop`` and ``wake`` now."""
        self._bell.set()

    def _key(self, **extra: object) -> dict:
        return {"classid": self.classid, "objid": self.objid, **extra}

    def run(self, template: str, params: dict | None = None) -> tuple | None:
        """One statement of this schema on the shared session; its first row."""
        if self._generation is None:
            raise psycopg.OperationalError("the lock session is not connected")
        with self.shared.using(self._generation) as conn:
            cur = conn.execute(psycopg_sql(template, self.schema), params or {})
            return cur.fetchone() if cur.description else None

    def keep_alive(self) -> float:
        """See :meth:`LockConnection.keep_alive` (a follower that does not try the lock)."""
        assert self._generation is not None
        return self.shared.keep_alive(self._generation)

    def connect(self, progress: Callable[[], None] = lambda: None) -> psycopg.Connection:
        """Attach to the shared session, opening and checking it if needed; ``progress`` is called
        once the server is reached (a multi-host URL may first spend a connect timeout on a
        silent host)."""
        if self._generation is not None:
            self.close()
        conn, self._generation = self.shared.attach(self._channels(), progress)
        return conn

    def try_lock(self) -> bool:
        return bool(self.run(q.TRY_LOCK, self._key())[0])

    def holds_lock(self) -> int | None:
        """The server-side pid of this session when it holds the lock, else None; raises
        :class:`LeaderSessionError` when the session is not the one we set up any more."""
        held, ours, pid = self.run(q.HOLDS_LOCK, self._key(marker=self.shared.marker))
        if not ours:
            raise LeaderSessionError(f"the lock connection reached a session it did not set up {POOLER_HINT}")
        return pid if held else None

    def start_term(self, params: dict, deadline: float, stop: threading.Event,
                   progress: Callable[[], None]) -> tuple[int, int, float]:
        """Just after winning the lock: check the lock is ours, then bump the epoch, waiting
        (bounded) for an old leader's in-flight fenced transactions. The wait is cut in slices of
        ``BUMP_SLICE``, the shared session free in between: the other targets' renewals go on.
        Returns (epoch, lock pid, when the successful attempt was sent)."""
        lock_pid = self.holds_lock()
        if lock_pid is None:
            raise LeaderSessionError(f"the advisory lock is not visible in this backend {POOLER_HINT}")
        waiting = False
        while True:
            sent = time.monotonic()
            try:
                assert self._generation is not None
                with self.shared.using(self._generation) as conn, conn.transaction():
                    conn.execute(f"SET LOCAL lock_timeout = {ms(self._bump_slice())}")
                    conn.execute(psycopg_sql(q.LOCK_ROW, self.schema))
                    epoch = conn.execute(psycopg_sql(q.BUMP_EPOCH, self.schema), params).fetchone()[0]
                    return epoch, lock_pid, sent
            except psycopg.errors.LockNotAvailable:
                progress()
                if time.monotonic() > deadline or stop.is_set():
                    raise
                if not waiting:
                    log.info("waiting for the previous leader's transactions to end")
                    waiting = True
                time.sleep(0.01)  # the other targets' statements first

    def _bump_slice(self) -> timedelta:
        return min(self.settings.leader.renew_interval, BUMP_SLICE)

    def renew(self, term: Term) -> bool:
        """Prove the lock and the term (one statement); False when either is gone."""
        held, ours, current = self.run(q.RENEW, self._key(marker=self.shared.marker, epoch=term.epoch,
                                                         instance=term.instance_id))
        if not ours:
            raise LeaderSessionError(f"the lock connection reached a session it did not set up {POOLER_HINT}")
        return bool(held and current)

    def release(self, term: Term) -> None:
        """Give the term and the lock back and wake the followers."""
        self.run(q.RELEASE, {"epoch": term.epoch, "instance": term.instance_id})
        self.run(q.UNLOCK, self._key())
        self.run(q.HANDOVER_NOTIFY, {"channel": handover_channel(self.schema), "instance": term.instance_id})

    def wait_for_handover(self, seconds: float, stop: threading.Event,
                          wake: threading.Event | None = None, handover: bool = True) -> bool:
        """Sleep up to ``seconds``, waking early on a hand-over NOTIFY (unless not ``handover``:
        a leader ignores them), or on stop or when ``wake`` is set (at once after :meth:`ring`,
        else within half a second); True when a hand-over NOTIFY ended it.
        Notifications on the ``periodic_jobs`` channel go to :attr:`on_notify` meanwhile."""
        deadline = time.monotonic() + seconds
        if not handover:
            self._handover.clear()
        while not stop.is_set() and not (wake is not None and wake.is_set()):
            if handover and self._handover.is_set():
                self._handover.clear()
                return True
            left = deadline - time.monotonic()
            if left <= 0 or not self.open:
                return False
            self._bell.wait(min(left, 0.5))
            self._bell.clear()  # the loop looks at what rang it
        return False

    def sever(self) -> None:
        """From another thread: make a call blocked on a silent server fail now (every target
        of the shared session reconnects)."""
        self.shared.sever()

    def silent(self) -> None:
        """The server stopped answering: with a multi-host URL, try the others first."""
        self.shared.silent()

    def stuck_for(self) -> float:
        """Seconds the shared session's statement in flight has waited for the server (a target
        waiting for its turn is not stuck)."""
        return self.shared.stuck_for()

    def discard(self) -> None:
        """The shared session is broken or not ours: close it (the server frees every lock it
        held); every target on it reconnects."""
        if self._generation is not None:  # never someone else's session
            self.shared.close(self._generation)
        self.close()

    def close(self) -> None:
        """Give up this target's lock and stop listening: the session is closed if no other
        target uses it, else the lock is unlocked on it (and the session closed if that fails:
        a lock is never kept without a term)."""
        generation, self._generation = self._generation, None
        if generation is None:
            return
        with self.shared.mutex:
            if generation != self.shared.generation or not self.shared.open:
                return  # closed already (the server freed the lock), views reattach to a new one
            if self.shared.detach(list(self._channels())):
                return
            try:
                with self.shared.using(generation) as conn, bounded_answer(conn, UNLOCK_ANSWER):
                    for _ in range(MAX_STACKED):  # a session-level lock is taken once per success
                        if not conn.execute(psycopg_sql(q.UNLOCK_HELD, self.schema), self._key()).fetchone()[0]:
                            break
                    for channel in self._channels():
                        conn.execute(f"UNLISTEN {quote_ident(channel)}")
            except (psycopg.Error, OSError) as exc:
                log.warning("could not unlock on the shared lock session, closing it",
                            extra=kv(error=describe_db_error(exc)))
                self.shared.close()


class LeaderElector:
    """Runs in its own thread; calls ``on_elected(term)`` / ``on_demoted(reason)`` from it.

    ``register``: keep this process's row in ``<schema>.daemons`` fresh (daemons do; ``run-once``
    does not). ``keep_trying``: take a new term after losing one (daemons do; ``run-once`` not).
    """

    def __init__(self, settings: Settings, *, on_elected: Callable[[Term], None],
                 on_demoted: Callable[[str], None], on_health: Callable[[bool], None] | None = None,
                 register: bool = True, keep_trying: bool = True, hosts: HostOrder | None = None,
                 shared: LockConnection | None = None, log_target: str | None = None):
        self.settings = settings
        self.on_elected = on_elected
        self.on_demoted = on_demoted
        self.on_health = on_health or (lambda ok: None)
        self.keep_trying = keep_trying
        self.log_target = log_target  # named in this thread's lines (several targets)
        self.session = LockSession(settings, hosts, shared)
        self.registry = DaemonRegistry(settings.schema, settings.instance_id, enabled=register)
        self.term: Term | None = None
        self.healthy = False
        self.last_progress = time.monotonic()  # when the loop last went round (for /healthz)
        self._ever_connected = False
        self._stop = threading.Event()
        self._demote_requested: tuple[str, int | None] | None = None
        self._hold_off_until = 0.0
        # Consulted before each try for the lock (several targets: the spread's gate, see
        # maintd.spread), told whether a hand-over NOTIFY arrived since it was last asked: 0 tries
        # now, else the round waits that many seconds (or a hand-over).
        self.gate: Callable[[bool], float] = lambda notified: 0.0
        self._notified = False  # a hand-over NOTIFY ended the last wait
        self._wake = threading.Event()  # ask the gate again now (see wake())
        # After each try the gate let through, with whether it won.
        self.tried: Callable[[bool], None] = lambda won: None
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None

    # -- public API -------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return self.term is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def lease_valid(self) -> bool:
        """Whether our lease can still be trusted (checked before and inside every pass)."""
        term = self.term
        return term is not None and term.trusted()

    def fence(self) -> LeaderFence:
        term = self.term
        if term is None:
            raise NotLeader("not the leader")
        return LeaderFence(self.settings.schema, term, lambda: self.term)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="maintd-leader", daemon=True)
        self._thread.start()

    def request_demotion(self, reason: str, epoch: int | None = None, hold_off: float = 0.0,
                         graceful: bool = False) -> None:
        """Ask the elector thread to give up leadership (e.g. a pass found itself fenced).
        With ``epoch``, only that term is given up (a late report about an old term is ignored).
        ``hold_off``: seconds not to try for the lock again (a healthier replica goes first).
        ``graceful``: release the lock and wake the followers, keeping the session (a hand-over
        of a working leadership); else the session is closed, which frees the lock."""
        self._hold_off_until = time.monotonic() + hold_off
        self._demote_requested = (reason, epoch, graceful)
        self._wake.set()  # a leader waiting to renew acts on it now
        self.session.ring()

    def wake(self) -> None:
        """A follower waiting for its gate asks it again now: the spread made this replica the
        target's owner."""
        self._wake.set()
        self.session.ring()

    def update_settings(self, settings: Settings) -> None:
        self.settings = settings
        self.session.settings = settings

    def stop(self, timeout: float = 5.0) -> None:
        """Graceful: release the lock, tell followers, close the session (done by the thread)."""
        self._stop.set()
        self.session.ring()
        if self._thread is not None:
            self._thread.join(timeout)
        elif self.session.open:
            self._release()

    def connect(self) -> None:
        """Open (and check) the lock session; raises :class:`LeaderSessionError` for a pooler
        that cannot keep a session, database errors otherwise."""
        conn = self.session.connect(progress=self._progress)
        server = conn.info.server_version
        if self._ever_connected:
            log.info("reconnected to database")
        else:
            log.info("connected to database", extra=kv(server_version=server))
            if server < 140000:
                log.warning("PostgreSQL before 14 has no idle_session_timeout: a frozen leader keeps "
                            "the lock until its TCP connection dies (fencing still prevents writes)")
        self._ever_connected = True
        self._set_health(True)
        self.registry.register(self.session.run)

    def acquire(self, wait: float) -> LeaderFence | None:
        """For ``run-once``: take the lock (trying for up to ``wait`` s), then keep renewing it in
        the thread until :meth:`stop`. None if another instance holds it."""
        deadline = time.monotonic() + wait
        self.connect()
        while True:
            self._follow(wait=False)
            if self.term is not None:
                fence = self.fence()
                self.start()
                return fence
            if time.monotonic() >= deadline:
                self.session.close()
                return None
            self._stop.wait(min(0.2, max(0.0, deadline - time.monotonic())))

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        with about_target(self.log_target):
            self._loop()

    def _loop(self) -> None:
        delay = BACKOFF_START
        while not self._stop.is_set():
            self.last_progress = time.monotonic()
            if self.term is None and not self.keep_trying:
                break  # run-once: the term ended, do not take another one
            try:
                if not self.session.open:
                    self.connect()
                    delay = BACKOFF_START
                if self.term is None:
                    self._follow()
                else:
                    self._lead()
            except SessionClosed:  # another target found the shared session broken (and said so)
                self._end_term("the lock session was closed")
            except LeaderSessionError as exc:
                log.error("%s", exc)
                self.session.discard()
                self._end_term(f"unusable lock session: {exc}")
                self._set_health(False)
                self._stop.wait(BACKOFF_CAP)
            except psycopg.errors.InsufficientPrivilege as exc:  # a grant problem, not an outage
                error = describe_db_error(exc)
                log.error("missing privilege: %s (grant what `maintd grants ROLE` prints, as the "
                          "owner role)", error, extra=kv(error=error))
                self._end_term(f"missing privilege: {error}")
                self._set_health(False)
                self._stop.wait(BACKOFF_CAP)
            except (psycopg.Error, OSError) as exc:
                error = describe_db_error(exc)
                if isinstance(exc, (psycopg.OperationalError, OSError)):
                    self.session.silent()
                    self.session.discard()  # broken for every target on it
                self._end_term(f"database error: {error}")
                self._set_health(False)
                sleep = min(BACKOFF_CAP, delay) * random.uniform(0.7, 1.3)
                log.warning("database unreachable, retrying in %.1fs", sleep, extra=kv(error=error))
                self._stop.wait(sleep)
                delay = min(BACKOFF_CAP, delay * 2)
        self._release()

    def _follow(self, wait: bool = True) -> None:
        """One follower round: try the lock; on a win, start a term; else wait for a retry."""
        retry = self.settings.leader.retry_interval.total_seconds()
        pause = self._hold_off_until - time.monotonic()  # stepped down for a reason: others first
        if pause <= 0:
            pause, self._notified = self.gate(self._notified), False
        if pause > 0:
            self._wake.clear()
            self._notified |= self.session.wait_for_handover(min(pause, self.session.keep_alive()),
                                                             self._stop, self._wake)
            return
        won = False
        try:
            won = self._try_for_term()
        finally:
            self.tried(won)
        if not won and wait:
            self._notified |= self.session.wait_for_handover(retry, self._stop)

    def _try_for_term(self) -> bool:
        """Try the lock; on a win, start a term (and the services). False when the lock is taken."""
        if not self.session.try_lock():
            return False
        cfg, s = self.settings.leader, self.settings
        try:
            epoch, lock_pid, sent = self.session.start_term(
                {"instance": s.instance_id, "host": self.registry.host, "pid": os.getpid()},
                deadline=time.monotonic() + cfg.lease.total_seconds() * 3, stop=self._stop,
                progress=self._progress)
        except BaseException:
            self.session.close()  # never keep the lock without a term
            raise
        self._demote_requested = None
        self.term = Term(epoch, lock_pid, s.instance_id, sent + self._trust())
        log.info("became leader", extra=kv(epoch=epoch, instance=s.instance_id))
        try:
            self.on_elected(self.term)
        except Exception as exc:  # never hold the lock without running
            log.error("could not start the services, stepping down", extra=kv(error=str(exc)))
            self._end_term("services failed to start")
        return True

    def _lead(self) -> None:
        """One leader round: give the term up if asked or untrusted, else wait for the next proof
        (``renew_interval`` after the previous one was sent, however long that took) and send it."""
        term = self.term
        assert term is not None
        requested, self._demote_requested = self._demote_requested, None
        if requested and requested[1] in (None, term.epoch):
            if requested[2]:
                return self._release(requested[0], close=False)
            return self._end_term(requested[0])
        if not term.trusted():
            return self._end_term("lease expired before it could be renewed")
        last_sent = term.trusted_until - self._trust()
        due = last_sent + self.settings.leader.renew_interval.total_seconds() - time.monotonic()
        if due > 0:  # listening meanwhile: a periodic_jobs change is passed on at once
            self._wake.clear()
            self.session.wait_for_handover(due, self._stop, self._wake, handover=False)
        if self._stop.is_set() or self.term is not term or self._demote_requested:
            return None
        sent = time.monotonic()
        if not self.session.renew(term):
            return self._end_term("advisory lock no longer held or another instance took a newer term")
        self.term = dataclasses.replace(term, trusted_until=sent + self._trust())
        return None

    def _trust(self) -> float:
        cfg = self.settings.leader
        return (cfg.lease - cfg.renew_interval).total_seconds()

    def _progress(self) -> None:
        self.last_progress = time.monotonic()

    def _end_term(self, reason: str) -> None:
        """Lose the term (if any) and give the lock up (see :meth:`LockSession.close`)."""
        with self._lock:
            term, self.term = self.term, None
        if term is not None:
            log.warning("lost leadership", extra=kv(reason=reason, epoch=term.epoch))
            self.on_demoted(reason)
        self.session.close()

    def _release(self, reason: str = "shutdown", close: bool = True) -> None:
        """Give the lock back and wake the followers: at a graceful stop (and close the session),
        or at a hand-over (the session stays, unless the release failed)."""
        with self._lock:
            term, self.term = self.term, None
        if term is not None:
            self.on_demoted(reason)
        if self.session.open and term is not None:
            try:
                self.session.release(term)
                log.info("released leadership", extra=kv(epoch=term.epoch, reason=reason))
            except psycopg.Error as exc:
                log.warning("could not release leadership cleanly (the session end frees it)",
                            extra=kv(error=describe_db_error(exc)))
                close = True
        if close:
            self.session.close()

    def _set_health(self, ok: bool) -> None:
        self.healthy = ok
        self.on_health(ok)


def acquire_once(settings: Settings, wait: float = 0.0, *,
                 on_demoted: Callable[[str], None] | None = None) -> tuple[LeaderElector, LeaderFence] | None:
    """For ``run-once``: the lock (waiting up to ``wait`` s), renewed in a thread until
    ``elector.stop()`` releases it; a lost term is never re-taken. None if another instance holds
    it. Database errors while connecting propagate."""
    elector = LeaderElector(settings, on_elected=lambda term: None,
                            on_demoted=on_demoted or (lambda reason: None), register=False,
                            keep_trying=False)
    fence = elector.acquire(wait)
    return None if fence is None else (elector, fence)
