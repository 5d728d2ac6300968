"""Leader election: a session-level advisory lock on a dedicated connection, a lease, and fencing.

* The lock is held by one non-pooled connection (``application_name=maintd:<instance>``) with TCP
  keepalives and ``tcp_user_timeout = lease``. On winning, that session gets
  ``idle_session_timeout = lease`` (PostgreSQL 14+): if this process freezes or is cut off, the
  server ends the session (and frees the lock) within the lease.
* The leader proves the lock every ``renew_interval``; if it cannot for ``lease - renew_interval``
  (or on any error) it demotes itself and closes the session. (The lease runs from when a proof
  was sent: the server's idle timer cannot have started earlier.)
* Winning the lock bumps ``leader.epoch`` after locking the leader row ``FOR UPDATE``. Every
  maintenance transaction runs :meth:`LeaderFence.check` first: it locks the leader row
  ``FOR KEY SHARE`` and proceeds only while the epoch is ours and our lock session still holds the
  lock. A new leader's epoch bump waits for such in-flight transactions, and once it commits, a
  stale ex-leader's transactions do nothing. (KEY SHARE, not SHARE: the leader's own ``renewed_at``
  update must not wait for its own maintenance transactions.)
* Followers retry every ``retry_interval`` and LISTEN for the hand-over NOTIFY a leader sends when
  it stops gracefully, so a planned failover takes milliseconds.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

import psycopg
from sqlalchemy import Connection

from . import __version__
from .config import Settings
from .db import advisory_key, connect, describe_db_error, ms, quote_ident, render_sql, sql
from .logs import kv
from .services.base import NotLeader

log = logging.getLogger("maintd.leader")

BACKOFF_START, BACKOFF_CAP = 0.2, 5.0
REGISTER_EVERY = 10.0  # seconds between daemons-table heartbeats
SESSION_MARKER = "maintd.session"  # a custom setting only our own session carries


class LeaderSessionError(RuntimeError):
    """The lock session is not a real, stable PostgreSQL session (e.g. PgBouncer transaction
    pooling): leadership cannot be guaranteed, so maintd refuses to lead."""


POOLER_HINT = ("(PgBouncer transaction pooling?): connect maintd directly to PostgreSQL or "
               "through session pooling")


def _unsigned(n: int) -> int:
    return n & 0xFFFFFFFF


TRY_LOCK = "SELECT pg_try_advisory_lock(%s, %s)"
UNLOCK = "SELECT pg_advisory_unlock(%s, %s)"
# Is the lock held by this very backend, and is this backend still the session we set up?
HOLDS_LOCK = f"""
SELECT EXISTS (SELECT 1 FROM pg_locks
                WHERE locktype = 'advisory' AND classid::bigint = %s AND objid::bigint = %s
                  AND objsubid = 2 AND pid = pg_backend_pid() AND granted),
       current_setting('{SESSION_MARKER}', true) = %s
"""
# FOR UPDATE conflicts with the fences' FOR KEY SHARE: the bump waits for in-flight fenced
# transactions of an old leader (bounded by their statement/idle-in-transaction timeouts).
LOCK_LEADER_ROW = "SELECT epoch FROM {schema}.leader WHERE name = 'leader' FOR UPDATE"
BUMP_EPOCH = """
INSERT INTO {schema}.leader AS l (name, epoch, instance_id, host, pid, backend_pid,
                                  elected_at, renewed_at, released_at)
VALUES ('leader', 1, %(instance)s, %(host)s, %(pid)s, pg_backend_pid(), now(), now(), NULL)
ON CONFLICT (name) DO UPDATE
   SET epoch = l.epoch + 1, instance_id = excluded.instance_id, host = excluded.host,
       pid = excluded.pid, backend_pid = excluded.backend_pid, elected_at = now(),
       renewed_at = now(), released_at = NULL
RETURNING epoch
"""
RENEW = """
UPDATE {schema}.leader SET renewed_at = now()
 WHERE name = 'leader' AND epoch = %s AND instance_id = %s
RETURNING epoch
"""
RELEASE = """
UPDATE {schema}.leader SET released_at = now()
 WHERE name = 'leader' AND epoch = %s AND instance_id = %s
"""
REGISTER = """
INSERT INTO {schema}.daemons (instance_id, host, pid, version, started_at, last_seen_at)
VALUES (%s, %s, %s, %s, now(), now())
ON CONFLICT (instance_id) DO UPDATE
   SET host = excluded.host, pid = excluded.pid, version = excluded.version,
       last_seen_at = now(),
       started_at = CASE WHEN daemons.pid = excluded.pid THEN daemons.started_at ELSE now() END
"""
FORGET_STALE = "DELETE FROM {schema}.daemons WHERE last_seen_at < now() - interval '1 hour'"
# Runs first inside every maintenance transaction (SQLAlchemy text, hence :names).
FENCE = """
SELECT 1 FROM {schema}.leader
 WHERE name = 'leader' AND epoch = :epoch AND instance_id = :instance
   AND EXISTS (SELECT 1 FROM pg_locks
                WHERE locktype = 'advisory' AND classid::bigint = :classid
                  AND objid::bigint = :objid AND objsubid = 2 AND pid = :lock_pid AND granted)
   FOR KEY SHARE
"""


def handover_channel(schema: str) -> str:
    return f"{schema}_maintd_leader"


@dataclass(frozen=True)
class LeaderToken:
    epoch: int
    lock_pid: int
    instance_id: str
    classid: int
    objid: int


class LeaderFence:
    """The :class:`maintd.services.base.Fence` of one leadership term."""

    def __init__(self, schema: str, token: LeaderToken, is_valid: Callable[[], bool] = lambda: True):
        self.schema = schema
        self.token = token
        self._is_valid = is_valid

    @property
    def epoch(self) -> int:
        return self.token.epoch

    def check(self, conn: Connection) -> None:
        if not self._is_valid():
            raise NotLeader("leadership lease expired or lost")
        row = conn.execute(sql(FENCE, self.schema), {
            "epoch": self.token.epoch, "instance": self.token.instance_id,
            "classid": _unsigned(self.token.classid), "objid": _unsigned(self.token.objid),
            "lock_pid": self.token.lock_pid,
        }).first()
        if row is None:
            raise NotLeader(f"epoch {self.token.epoch} is no longer the leader's")


class LeaderElector:
    """Runs in its own thread; calls ``on_elected(token)`` / ``on_demoted(reason)`` from it.

    ``register``: keep this process's row in ``<schema>.daemons`` fresh (daemons do; ``run-once``
    does not).
    """

    def __init__(self, settings: Settings, *, on_elected: Callable[[LeaderToken], None],
                 on_demoted: Callable[[str], None], on_health: Callable[[bool], None] | None = None,
                 register: bool = True):
        self.settings = settings
        self.on_elected = on_elected
        self.on_demoted = on_demoted
        self.on_health = on_health or (lambda ok: None)
        self.register = register
        self.classid, self.objid = advisory_key(settings.schema)
        self.host = socket.gethostname()
        self.conn: psycopg.Connection | None = None
        self.token: LeaderToken | None = None
        self.healthy = False
        # Monotonic time the loop last made progress (for /healthz).
        self.last_progress = time.monotonic()
        self._marker = ""
        self._ever_connected = False
        self._last_renewed = 0.0  # monotonic send time of the last successful proof
        self._last_register = float("-inf")
        self._stop = threading.Event()
        self._demote_requested: tuple[str, int | None] | None = None
        self._lock = threading.RLock()
        self._keep_trying = True
        self._thread: threading.Thread | None = None

    # -- public API -------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return self.token is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def lease_valid(self) -> bool:
        """Whether our lease can still be trusted (checked before and inside every pass)."""
        if self.token is None:
            return False
        cfg = self.settings.leader
        budget = (cfg.lease - cfg.renew_interval).total_seconds()
        return time.monotonic() - self._last_renewed < budget

    def fence(self) -> LeaderFence:
        token = self.token
        if token is None:
            raise NotLeader("not the leader")
        return LeaderFence(self.settings.schema, token,
                           lambda: self.token is token and self.lease_valid())

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="maintd-leader", daemon=True)
        self._thread.start()

    def request_demotion(self, reason: str, epoch: int | None = None) -> None:
        """Ask the elector thread to give up leadership (e.g. a pass found itself fenced).
        With ``epoch``, only that term is given up (a late report about an old term is ignored)."""
        self._demote_requested = (reason, epoch)

    def update_settings(self, settings: Settings) -> None:
        self.settings = settings

    def stop(self, timeout: float = 5.0) -> None:
        """Graceful: release the lock, tell followers, close the session (done by the thread)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        elif self.conn is not None:
            self._release()

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        delay = BACKOFF_START
        while not self._stop.is_set():
            self.last_progress = time.monotonic()
            if self.token is None and not self._keep_trying:
                break  # run-once: the term ended, do not take another one
            try:
                if self.conn is None or self.conn.closed:
                    self._connect()
                    delay = BACKOFF_START
                if self.token is None:
                    self._try_acquire()
                else:
                    self._renew_or_demote()
            except LeaderSessionError as exc:
                log.error("%s", exc)
                self._lose(f"unusable lock session: {exc}")
                self._close()
                self._set_health(False)
                self._stop.wait(BACKOFF_CAP)
            except (psycopg.Error, OSError) as exc:
                error = describe_db_error(exc)
                self._lose(f"database error: {error}")
                self._close()
                self._set_health(False)
                sleep = min(BACKOFF_CAP, delay) * random.uniform(0.7, 1.3)
                log.warning("database unreachable, retrying in %.1fs", sleep, extra=kv(error=error))
                self._stop.wait(sleep)
                delay = min(BACKOFF_CAP, delay * 2)
        self._release()

    def _connect(self) -> None:
        cfg = self.settings.leader
        self._marker = secrets.token_hex(8)
        self.conn = connect(
            self.settings.database_url.get_secret_value(),
            application_name=f"maintd:{self.settings.instance_id}",
            settings={"statement_timeout": ms(cfg.lease / 2), "lock_timeout": ms(cfg.renew_interval),
                      SESSION_MARKER: self._marker},
            # A send nobody acknowledges (cut-off network) fails within the lease.
            tcp_user_timeout=ms(cfg.lease),
        )
        self.conn.execute(f"LISTEN {quote_ident(handover_channel(self.settings.schema))}")
        self._check_session()
        server = self.conn.info.server_version
        if self._ever_connected:
            log.info("reconnected to database")
        else:
            log.info("connected to database", extra=kv(server_version=server))
            if server < 140000:
                log.warning("PostgreSQL before 14 has no idle_session_timeout: a frozen leader keeps "
                            "the lock until its TCP connection dies (fencing still prevents writes)")
        self._ever_connected = True
        self._set_health(True)
        self._register(force=True)

    def _check_session(self) -> None:
        """Refuse PgBouncer transaction pooling: the backend must stay the same across statements."""
        assert self.conn is not None
        pids = {self.conn.execute("SELECT pg_backend_pid()").fetchone()[0] for _ in range(3)}
        if len(pids) != 1:
            raise LeaderSessionError(f"the lock connection changes backend between statements {POOLER_HINT}")

    def _holds_lock(self) -> bool:
        """Whether this session holds the lock; raises if the session is not ours any more."""
        assert self.conn is not None
        held, ours = self.conn.execute(HOLDS_LOCK, (_unsigned(self.classid), _unsigned(self.objid),
                                                    self._marker)).fetchone()
        if not ours:
            raise LeaderSessionError(f"the lock connection reached a session it did not set up {POOLER_HINT}")
        return bool(held)

    def _register(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.register or (not force and now - self._last_register < REGISTER_EVERY):
            return
        assert self.conn is not None
        s = self.settings
        self.conn.execute(render_sql(REGISTER, s.schema), (s.instance_id, self.host, os.getpid(), __version__))
        if force:
            self.conn.execute(render_sql(FORGET_STALE, s.schema))
        self._last_register = now

    def _wait_for_retry(self) -> None:
        """Sleep ``retry_interval``, waking early on a hand-over NOTIFY or on stop."""
        assert self.conn is not None
        deadline = time.monotonic() + self.settings.leader.retry_interval.total_seconds()
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            for _ in self.conn.notifies(timeout=min(left, 0.25), stop_after=1):
                return

    def _try_acquire(self, wait: bool = True) -> None:
        assert self.conn is not None
        if not self.conn.execute(TRY_LOCK, (self.classid, self.objid)).fetchone()[0]:
            self._register()
            if wait:
                self._wait_for_retry()
            return
        try:
            if self.conn.info.server_version >= 140000:
                # From now on the server ends this session if we stop talking for a lease.
                self.conn.execute(f"SET idle_session_timeout = {ms(self.settings.leader.lease)}")
            if not self._holds_lock():
                raise LeaderSessionError(f"the advisory lock is not visible in this backend {POOLER_HINT}")
            epoch, sent = self._bump_epoch()
        except BaseException:
            self._close()  # never keep the lock without a term
            raise
        self._last_renewed = sent
        self._demote_requested = None
        self.token = LeaderToken(epoch, self.conn.info.backend_pid, self.settings.instance_id,
                                 self.classid, self.objid)
        log.info("became leader", extra=kv(epoch=epoch, instance=self.settings.instance_id))
        try:
            self.on_elected(self.token)
        except Exception as exc:  # never hold the lock without running
            log.error("could not start the services, stepping down", extra=kv(error=str(exc)))
            self._lose("services failed to start")
            self._close()

    def _bump_epoch(self) -> tuple[int, float]:
        """Waits (bounded) for an old leader's in-flight fenced transactions, then takes the term.
        Returns the epoch and when the successful attempt began."""
        assert self.conn is not None
        s = self.settings
        deadline = time.monotonic() + s.leader.lease.total_seconds() * 3
        params = {"instance": s.instance_id, "host": self.host, "pid": os.getpid()}
        while True:
            sent = time.monotonic()
            try:
                with self.conn.transaction():
                    self.conn.execute(render_sql(LOCK_LEADER_ROW, s.schema))
                    return self.conn.execute(render_sql(BUMP_EPOCH, s.schema), params).fetchone()[0], sent
            except psycopg.errors.LockNotAvailable:
                self.last_progress = time.monotonic()
                if time.monotonic() > deadline or self._stop.is_set():
                    raise
                log.info("waiting for the previous leader's transactions to end")

    def _renew_or_demote(self) -> None:
        assert self.conn is not None and self.token is not None
        requested, self._demote_requested = self._demote_requested, None
        if requested and requested[1] in (None, self.token.epoch):
            self._lose(requested[0])
            self._close()
            return
        if not self.lease_valid():
            self._lose("lease expired before it could be renewed")
            self._close()
            return
        # The next proof goes out renew_interval after the previous one was sent, however long
        # that took. (A proof that fails ends the term, so the last one sent is the last success.)
        next_renewal = self._last_renewed + self.settings.leader.renew_interval.total_seconds()
        self._stop.wait(max(0.0, next_renewal - time.monotonic()))
        if self._stop.is_set() or self.token is None or self._demote_requested:
            return
        sent = time.monotonic()
        if not self._holds_lock():
            self._lose("advisory lock no longer held")
            self._close()
            return
        row = self.conn.execute(render_sql(RENEW, self.settings.schema),
                                (self.token.epoch, self.token.instance_id)).fetchone()
        if row is None:
            self._lose("another instance took a newer term")
            self._close()
            return
        self._last_renewed = sent
        self._register()

    def _lose(self, reason: str) -> None:
        with self._lock:
            if self.token is None:
                return
            epoch = self.token.epoch
            self.token = None
        log.warning("lost leadership", extra=kv(reason=reason, epoch=epoch))
        self.on_demoted(reason)

    def _release(self) -> None:
        """Graceful stop: give the lock back and wake the followers."""
        with self._lock:
            token, self.token = self.token, None
        if token is not None:
            self.on_demoted("shutdown")
        if self.conn is not None and not self.conn.closed:
            try:
                if token is not None:
                    s = self.settings
                    self.conn.execute(render_sql(RELEASE, s.schema), (token.epoch, token.instance_id))
                    self.conn.execute(UNLOCK, (self.classid, self.objid))
                    self.conn.execute("SELECT pg_notify(%s, %s)",
                                      (handover_channel(s.schema), s.instance_id))
                    log.info("released leadership", extra=kv(epoch=token.epoch))
            except psycopg.Error as exc:
                log.warning("could not release leadership cleanly (the session end frees it)",
                            extra=kv(error=describe_db_error(exc)))
        self._close()

    def _close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:  # pragma: no cover - closing a broken socket
                pass
        self.conn = None

    def _set_health(self, ok: bool) -> None:
        self.healthy = ok
        self.on_health(ok)


def acquire_once(settings: Settings, wait: float = 0.0, *,
                 on_demoted: Callable[[str], None] | None = None) -> tuple[LeaderElector, LeaderFence] | None:
    """For ``run-once``: take the leader lock (waiting up to ``wait`` s) and keep renewing it in a
    thread until ``elector.stop()`` (which releases it). The term is never re-taken once lost.

    Returns the elector and its fence, or None if another instance holds the lock. Database
    errors while connecting propagate.
    """
    elector = LeaderElector(settings, on_elected=lambda token: None,
                            on_demoted=on_demoted or (lambda reason: None), register=False)
    elector._keep_trying = False
    deadline = time.monotonic() + wait
    elector._connect()
    while True:
        elector._try_acquire(wait=False)
        if elector.token is not None:
            fence = elector.fence()
            elector.start()
            return elector, fence
        if time.monotonic() >= deadline:
            elector._close()
            return None
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
