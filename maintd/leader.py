"""Leader election: a session-level advisory lock on a dedicated connection, a lease, and fencing.

* The lock is held by one non-pooled connection, the :class:`LockSession`
  (``application_name=maintd:<instance>``), with TCP keepalives and ``tcp_user_timeout = lease``.
  On winning, that session gets ``idle_session_timeout = lease`` (PostgreSQL 14+): if this process
  freezes or is cut off, the server ends the session (and frees the lock) within the lease.
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
import secrets
import select
import threading
import time
from dataclasses import dataclass
from typing import Callable

import psycopg
from sqlalchemy import Connection

from .config import Settings
from .db import HostOrder, advisory_key, connect, describe_db_error, ms, sever
from .identifiers import quote_ident
from .logs import kv
from .queries import leader as q
from .queries import psycopg_sql, sql
from .registry import DaemonRegistry
from .services.base import NotLeader

log = logging.getLogger("maintd.leader")

BACKOFF_START, BACKOFF_CAP = 0.2, 5.0
SESSION_MARKER = "maintd.session"  # a custom setting only our own session carries
POOLER_HINT = ("(PgBouncer pool_mode=transaction or statement?): connect maintd directly to "
               "PostgreSQL or through a pooler with pool_mode=session")


class LeaderSessionError(RuntimeError):
    """The lock session is not a real, stable PostgreSQL session (e.g. PgBouncer transaction
    pooling): leadership cannot be guaranteed, so maintd refuses to lead."""


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
    """The dedicated connection that holds (or tries for) the advisory lock of one schema."""

    def __init__(self, settings: Settings, hosts: HostOrder | None = None):
        self.settings = settings
        self.hosts = hosts or HostOrder(settings.database_url.get_secret_value())
        self.server: tuple[str | None, int | None] = (None, None)  # host, port last reached
        self.schema = settings.schema
        self.classid, self.objid = advisory_key(settings.schema)
        self.conn: psycopg.Connection | None = None
        self._marker = ""

    @property
    def open(self) -> bool:
        return self.conn is not None and not self.conn.closed

    def _key(self, **extra: object) -> dict:
        return {"classid": self.classid, "objid": self.objid, **extra}

    def _run(self, template: str, params: dict | None = None):
        assert self.conn is not None
        return self.conn.execute(psycopg_sql(template, self.schema), params or {})

    def connect(self, progress: Callable[[], None] = lambda: None) -> psycopg.Connection:
        """Open and check the session; ``progress`` is called once the server is reached (a
        multi-host URL may first spend a connect timeout on a silent host)."""
        cfg = self.settings.leader
        self._marker = secrets.token_hex(8)
        self.conn = connect(
            self.hosts.dsn(),
            application_name=f"maintd:{self.settings.instance_id}",
            settings={"statement_timeout": ms(cfg.lease / 2), "lock_timeout": ms(cfg.renew_interval),
                      # the epoch bump's transaction, frozen half-way, ends within the lease
                      "idle_in_transaction_session_timeout": ms(cfg.lease),
                      SESSION_MARKER: self._marker},
            tcp_user_timeout=ms(cfg.lease),  # a send nobody acknowledges fails within the lease
            answer_timeout=cfg.lease.total_seconds(),  # a frozen server acknowledges, never answers
        )
        progress()
        self.server = (self.conn.info.host, self.conn.info.port)
        self.hosts.reached(*self.server)  # the work pool's new connections go there first
        self.conn.execute(f"LISTEN {quote_ident(handover_channel(self.schema))}")
        self.verify()
        if self.conn.info.server_version >= 140000:
            # Before the first pg_try_advisory_lock: if this process freezes (even right after
            # winning), the server ends the session and frees the lock within the lease.
            self.conn.execute(f"SET idle_session_timeout = {ms(cfg.lease)}")
        return self.conn

    def verify(self) -> None:
        """Refuse a pooler that does not keep one server session per client (PgBouncer transaction
        or statement pooling), before any lock is taken: the backend must stay the same across
        statements, and, behind a pooler, no other client may get it."""
        pids = {self._run(q.BACKEND_PID).fetchone()[0] for _ in range(3)}
        if len(pids) != 1:
            raise LeaderSessionError(f"the lock connection changes backend between statements {POOLER_HINT}")
        assert self.conn is not None
        if self.conn.info.backend_pid in pids:
            return  # a direct connection: the client-side pid is the server's
        with connect(self.hosts.dsn(), application_name=f"maintd:{self.settings.instance_id}:probe",
                     answer_timeout=self.settings.leader.lease.total_seconds()) as probe:
            for _ in range(3):  # a session pooler never hands our backend to another client
                other = probe.execute(q.BACKEND_PID).fetchone()[0]
                mine = self._run(q.BACKEND_PID).fetchone()[0]
                if other in pids or mine not in pids:
                    raise LeaderSessionError(f"another client got the lock connection's backend {POOLER_HINT}")

    def try_lock(self) -> bool:
        return bool(self._run(q.TRY_LOCK, self._key()).fetchone()[0])

    def holds_lock(self) -> int | None:
        """The server-side pid of this session when it holds the lock, else None; raises
        :class:`LeaderSessionError` when the session is not the one we set up any more."""
        held, ours, pid = self._run(q.HOLDS_LOCK, self._key(marker=self._marker)).fetchone()
        if not ours:
            raise LeaderSessionError(f"the lock connection reached a session it did not set up {POOLER_HINT}")
        return pid if held else None

    def start_term(self, params: dict, deadline: float, stop: threading.Event,
                   progress: Callable[[], None]) -> tuple[int, int, float]:
        """Just after winning the lock: check the lock is ours, then bump the epoch, waiting (bounded) for an old leader's in-flight fenced transactions.
        Returns (epoch, lock pid, when the successful attempt was sent)."""
        assert self.conn is not None
        lock_pid = self.holds_lock()
        if lock_pid is None:
            raise LeaderSessionError(f"the advisory lock is not visible in this backend {POOLER_HINT}")
        while True:
            sent = time.monotonic()
            try:
                with self.conn.transaction():
                    self._run(q.LOCK_ROW)
                    return self._run(q.BUMP_EPOCH, params).fetchone()[0], lock_pid, sent
            except psycopg.errors.LockNotAvailable:
                progress()
                if time.monotonic() > deadline or stop.is_set():
                    raise
                log.info("waiting for the previous leader's transactions to end")

    def renew(self, term: Term) -> bool:
        """Prove the lock and the term; False when either is gone."""
        if self.holds_lock() is None:
            return False
        return self._run(q.RENEW, {"epoch": term.epoch, "instance": term.instance_id}).fetchone() is not None

    def release(self, term: Term) -> None:
        """Give the term and the lock back and wake the followers."""
        self._run(q.RELEASE, {"epoch": term.epoch, "instance": term.instance_id})
        self._run(q.UNLOCK, self._key())
        self._run(q.HANDOVER_NOTIFY, {"channel": handover_channel(self.schema), "instance": term.instance_id})

    def wait_for_handover(self, seconds: float, stop: threading.Event) -> None:
        """Sleep up to ``seconds``, waking early on a hand-over NOTIFY or on stop."""
        assert self.conn is not None
        deadline = time.monotonic() + seconds
        while not stop.is_set():
            for _ in self.conn.notifies(timeout=0, stop_after=1):  # one already received
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            # Sleep in the kernel until the server sends something: notifies() with a timeout
            # polls about ten times a second, which adds up over many targets (SPEC 7.9).
            select.select([self.conn.fileno()], [], [], min(left, 0.5))

    def sever(self) -> None:
        """From another thread: make a call blocked on a silent server fail now."""
        self.silent()
        sever(self.conn)

    def silent(self) -> None:
        """The server stopped answering: with a multi-host URL, try the others first."""
        self.hosts.silent(*self.server)

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:  # pragma: no cover - closing a broken socket
                pass
        self.conn = None


class LeaderElector:
    """Runs in its own thread; calls ``on_elected(term)`` / ``on_demoted(reason)`` from it.

    ``register``: keep this process's row in ``<schema>.daemons`` fresh (daemons do; ``run-once``
    does not). ``keep_trying``: take a new term after losing one (daemons do; ``run-once`` not).
    """

    def __init__(self, settings: Settings, *, on_elected: Callable[[Term], None],
                 on_demoted: Callable[[str], None], on_health: Callable[[bool], None] | None = None,
                 register: bool = True, keep_trying: bool = True, hosts: HostOrder | None = None):
        self.settings = settings
        self.on_elected = on_elected
        self.on_demoted = on_demoted
        self.on_health = on_health or (lambda ok: None)
        self.keep_trying = keep_trying
        self.session = LockSession(settings, hosts)
        self.registry = DaemonRegistry(settings.schema, settings.instance_id, enabled=register)
        self.term: Term | None = None
        self.healthy = False
        self.last_progress = time.monotonic()  # when the loop last went round (for /healthz)
        self._ever_connected = False
        self._stop = threading.Event()
        self._demote_requested: tuple[str, int | None] | None = None
        self._hold_off_until = 0.0
        # Consulted before each try for the lock (several targets: the spread's gate, see
        # maintd.spread); False makes the round wait like a hold-off.
        self.may_try: Callable[[], bool] = lambda: True
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

    def request_demotion(self, reason: str, epoch: int | None = None, hold_off: float = 0.0) -> None:
        """Ask the elector thread to give up leadership (e.g. a pass found itself fenced).
        With ``epoch``, only that term is given up (a late report about an old term is ignored).
        ``hold_off``: seconds not to try for the lock again (a healthier replica goes first)."""
        self._hold_off_until = time.monotonic() + hold_off
        self._demote_requested = (reason, epoch)

    def update_settings(self, settings: Settings) -> None:
        self.settings = settings
        self.session.settings = settings

    def stop(self, timeout: float = 5.0) -> None:
        """Graceful: release the lock, tell followers, close the session (done by the thread)."""
        self._stop.set()
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
        self.registry.register(conn)

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
            except LeaderSessionError as exc:
                log.error("%s", exc)
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
        hold_off = self._hold_off_until - time.monotonic()
        if hold_off > 0 or not self.may_try():  # stepped down for a reason: let others lead
            self.session.holds_lock()  # a statement a round keeps the idle session alive
            self.session.wait_for_handover(min(retry, hold_off) if hold_off > 0 else retry, self._stop)
            return
        if not self.session.try_lock():
            if wait:
                self.session.wait_for_handover(retry, self._stop)
            return
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

    def _lead(self) -> None:
        """One leader round: give the term up if asked or untrusted, else wait for the next proof
        (``renew_interval`` after the previous one was sent, however long that took) and send it."""
        term = self.term
        assert term is not None
        requested, self._demote_requested = self._demote_requested, None
        if requested and requested[1] in (None, term.epoch):
            return self._end_term(requested[0])
        if not term.trusted():
            return self._end_term("lease expired before it could be renewed")
        last_sent = term.trusted_until - self._trust()
        self._stop.wait(max(0.0, last_sent + self.settings.leader.renew_interval.total_seconds() - time.monotonic()))
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
        """Lose the term (if any) and close the session: the server frees the lock with it."""
        with self._lock:
            term, self.term = self.term, None
        if term is not None:
            log.warning("lost leadership", extra=kv(reason=reason, epoch=term.epoch))
            self.on_demoted(reason)
        self.session.close()

    def _release(self) -> None:
        """Graceful stop: give the lock back and wake the followers."""
        with self._lock:
            term, self.term = self.term, None
        if term is not None:
            self.on_demoted("shutdown")
        if self.session.open and term is not None:
            try:
                self.session.release(term)
                log.info("released leadership", extra=kv(epoch=term.epoch))
            except psycopg.Error as exc:
                log.warning("could not release leadership cleanly (the session end frees it)",
                            extra=kv(error=describe_db_error(exc)))
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
