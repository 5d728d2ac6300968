"""Leader election: a session-level advisory lock on a dedicated connection, a lease, and fencing.

* The lock is held by one non-pooled connection (``application_name=maintd:<instance>``) with TCP
  keepalives and ``idle_session_timeout = lease``: if this process freezes or is cut off, the
  server ends the session (and frees the lock) within the lease.
* The leader proves the lock every ``renew_interval``; if it cannot for ``lease - renew_interval``
  (or on any error) it demotes itself and closes the session.
* Winning the lock bumps ``leader.epoch``. Every maintenance transaction runs
  :meth:`LeaderFence.check` first: it locks the leader row ``FOR SHARE`` and proceeds only while
  the epoch is ours and our lock session still holds the lock. A new leader's epoch bump waits for
  such in-flight transactions, and once it commits, a stale ex-leader's transactions do nothing.
* Followers retry every ``retry_interval`` and LISTEN for the hand-over NOTIFY a leader sends when
  it stops gracefully, so a planned failover takes milliseconds.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

import psycopg
from sqlalchemy import Connection

from . import __version__
from .config import Settings
from .db import advisory_key, connect, describe_db_error, ms, quote_ident, render_sql
from .logs import kv
from .services.base import NotLeader

log = logging.getLogger("maintd.leader")


class LeaderSessionError(RuntimeError):
    """The lock session is not a real, stable PostgreSQL session (e.g. PgBouncer transaction
    pooling): leadership cannot be guaranteed, so maintd refuses to run."""


def _unsigned(n: int) -> int:
    return n & 0xFFFFFFFF


TRY_LOCK = "SELECT pg_try_advisory_lock(%s, %s)"
UNLOCK = "SELECT pg_advisory_unlock(%s, %s)"
HOLDS_LOCK = """
SELECT count(*) FROM pg_locks
 WHERE locktype = 'advisory' AND classid::bigint = %s AND objid::bigint = %s AND objsubid = 2
   AND pid = pg_backend_pid() AND granted
"""
BUMP_EPOCH = """
UPDATE {schema}.leader
   SET epoch = epoch + 1, instance_id = %s, host = %s, pid = %s, backend_pid = pg_backend_pid(),
       elected_at = now(), renewed_at = now(), released_at = NULL
 WHERE name = 'leader'
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
   FOR SHARE
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

    def check(self, conn: Connection) -> None:
        if not self._is_valid():
            raise NotLeader("leadership lease expired or lost")
        from .db import sql

        row = conn.execute(sql(FENCE, self.schema), {
            "epoch": self.token.epoch, "instance": self.token.instance_id,
            "classid": _unsigned(self.token.classid), "objid": _unsigned(self.token.objid),
            "lock_pid": self.token.lock_pid,
        }).first()
        if row is None:
            raise NotLeader(f"epoch {self.token.epoch} is no longer the leader's")


class LeaderElector:
    """Runs in its own thread; calls ``on_elected(token)`` / ``on_demoted(reason)``."""

    def __init__(self, settings: Settings, *, on_elected: Callable[[LeaderToken], None],
                 on_demoted: Callable[[str], None], on_health: Callable[[bool], None] | None = None):
        self.settings = settings
        self.on_elected = on_elected
        self.on_demoted = on_demoted
        self.on_health = on_health or (lambda ok: None)
        self.classid, self.objid = advisory_key(settings.schema)
        self.host = socket.gethostname()
        self.conn: psycopg.Connection | None = None
        self.token: LeaderToken | None = None
        self._last_renewed = 0.0
        self._stop = threading.Event()
        self._demote_requested: str | None = None
        self._lock = threading.RLock()
        self.healthy = False
        self._last_register = 0.0
        self._thread: threading.Thread | None = None

    # -- public API -------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return self.token is not None

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

    def request_demotion(self, reason: str) -> None:
        """Ask the elector thread to give up leadership (e.g. a pass found itself fenced)."""
        self._demote_requested = reason

    def update_settings(self, settings: Settings) -> None:
        self.settings = settings

    def stop(self, timeout: float = 5.0) -> None:
        """Graceful: release the lock, tell followers, close the session."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        delay = 0.2
        while not self._stop.is_set():
            try:
                if self.conn is None or self.conn.closed:
                    self._connect()
                    delay = 0.2
                if self.token is None:
                    self._try_acquire()
                else:
                    self._renew_or_demote()
            except LeaderSessionError as exc:
                log.error("%s", exc)
                self._lose(f"unusable lock session: {exc}")
                self._close()
                self._set_health(False)
                self._stop.wait(5.0)
            except (psycopg.Error, OSError) as exc:
                self._lose(f"database error: {describe_db_error(exc)}")
                self._close()
                self._set_health(False)
                sleep = min(5.0, delay) * random.uniform(0.7, 1.3)
                log.warning("database unreachable, retrying in %.1fs", sleep,
                            extra=kv(error=describe_db_error(exc)))
                self._stop.wait(sleep)
                delay = min(5.0, delay * 2)
        self._release()

    def _connect(self) -> None:
        cfg = self.settings.leader
        self.conn = connect(
            self.settings.database_url.get_secret_value(),
            application_name=f"maintd:{self.settings.instance_id}",
            settings={"statement_timeout": ms(cfg.lease / 2), "lock_timeout": ms(cfg.renew_interval)},
        )
        server = self.conn.info.server_version
        if server >= 140000:
            self.conn.execute(f"SET idle_session_timeout = {ms(cfg.lease)}")
        self.conn.execute(f"LISTEN {quote_ident(handover_channel(self.settings.schema))}")
        self._check_session()
        if not self.healthy:
            log.info("connected to database", extra=kv(server_version=server))
        self._set_health(True)
        self._register(force=True)

    def _check_session(self) -> None:
        """Refuse PgBouncer transaction pooling: the backend must stay the same across statements."""
        assert self.conn is not None
        pids = {self.conn.execute("SELECT pg_backend_pid()").fetchone()[0] for _ in range(3)}
        if len(pids) != 1:
            raise LeaderSessionError(
                "the lock connection changes backend between statements (PgBouncer transaction "
                "pooling?): connect maintd directly to PostgreSQL or through session pooling")

    def _register(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_register < 10:
            return
        assert self.conn is not None
        s = self.settings
        self.conn.execute(render_sql(REGISTER, s.schema), (s.instance_id, self.host, os.getpid(), __version__))
        if force:
            self.conn.execute(render_sql(FORGET_STALE, s.schema))
        self._last_register = now

    def _try_acquire(self, wait_for_handover: bool = True) -> None:
        assert self.conn is not None
        got = self.conn.execute(TRY_LOCK, (self.classid, self.objid)).fetchone()[0]
        if not got:
            self._register()
            if not wait_for_handover:
                return
            # Sleep until the retry interval passes or the leader announces a hand-over.
            for _ in self.conn.notifies(timeout=self.settings.leader.retry_interval.total_seconds(),
                                        stop_after=1):
                pass
            return
        try:
            if self.conn.execute(HOLDS_LOCK, (_unsigned(self.classid), _unsigned(self.objid))).fetchone()[0] != 1:
                raise LeaderSessionError(
                    "the advisory lock is not visible in this backend (PgBouncer transaction "
                    "pooling?): connect maintd directly to PostgreSQL or through session pooling")
            epoch = self._bump_epoch()
        except BaseException:
            self._close()  # never keep the lock without a term
            raise
        pid = self.conn.info.backend_pid
        self._last_renewed = time.monotonic()
        self._demote_requested = None
        self.token = LeaderToken(epoch, pid, self.settings.instance_id, self.classid, self.objid)
        log.info("became leader", extra=kv(epoch=epoch, instance=self.settings.instance_id))
        try:
            self.on_elected(self.token)
        except Exception as exc:  # never hold the lock without running
            log.error("could not start the services, stepping down", extra=kv(error=str(exc)))
            self._lose("services failed to start")
            self._close()

    def _bump_epoch(self) -> int:
        """Waits (bounded) for an old leader's in-flight fenced transactions, then takes the term."""
        assert self.conn is not None
        s = self.settings
        deadline = time.monotonic() + s.leader.lease.total_seconds() * 3
        while True:
            try:
                with self.conn.transaction():
                    return self.conn.execute(render_sql(BUMP_EPOCH, s.schema),
                                             (s.instance_id, self.host, os.getpid())).fetchone()[0]
            except psycopg.errors.LockNotAvailable:
                if time.monotonic() > deadline or self._stop.is_set():
                    raise
                log.info("waiting for the previous leader's transactions to end")

    def _renew_or_demote(self) -> None:
        assert self.conn is not None and self.token is not None
        if self._demote_requested:
            reason, self._demote_requested = self._demote_requested, None
            self._lose(reason)
            self._close()
            return
        if not self.lease_valid():
            self._lose("lease expired before it could be renewed")
            self._close()
            return
        self._stop.wait(self.settings.leader.renew_interval.total_seconds())
        if self._stop.is_set() or self.token is None:
            return
        held = self.conn.execute(HOLDS_LOCK, (_unsigned(self.classid), _unsigned(self.objid))).fetchone()[0]
        if held != 1:
            self._lose("advisory lock no longer held")
            self._close()
            return
        row = self.conn.execute(render_sql(RENEW, self.settings.schema),
                                (self.token.epoch, self.token.instance_id)).fetchone()
        if row is None:
            self._lose("another instance took a newer term")
            self._close()
            return
        self._last_renewed = time.monotonic()
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
        token = self.token
        if token is not None:
            with self._lock:
                self.token = None
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
        if ok != self.healthy:
            self.healthy = ok
            if ok:
                log.info("database connection healthy")
        self.on_health(ok)


def acquire_once(settings: Settings, wait: float = 0.0) -> tuple[LeaderElector, LeaderFence] | None:
    """For ``run-once``: take the leader lock (waiting up to ``wait`` s) without starting a thread.

    Returns the elector (call ``_release()`` when done) and its fence, or None if another
    instance holds the lock.
    """
    elected: list[LeaderToken] = []
    elector = LeaderElector(settings, on_elected=elected.append, on_demoted=lambda r: None)
    deadline = time.monotonic() + wait
    elector._connect()
    while True:
        elector._try_acquire(wait_for_handover=False)
        if elector.token is not None:
            return elector, elector.fence()
        if time.monotonic() >= deadline:
            elector._close()
            return None
        time.sleep(0.2)
