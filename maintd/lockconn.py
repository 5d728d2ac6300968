"""The lock connection: one dedicated, non-pooled PostgreSQL session that holds the advisory locks
of several targets on one database (SPEC 7.9: "share what can be shared"): :data:`LOCK_GROUP`
targets per session, so with 200 targets on one database a replica keeps 40 lock sessions there,
not 200.

* Each target's :class:`maintd.leader.LockSession` is a view of it: its statements run one at a
  time, in arrival order, under :attr:`LockConnection.mutex`, each short and bounded
  (``statement_timeout``, and the epoch bump's row-lock wait in slices, see
  :meth:`maintd.leader.LockSession.start_term`), so one target cannot stall the others' renewals.
* Fencing stays exact: a term is the pair (epoch, ``pg_backend_pid()`` of this session), and every
  fence checks that this backend holds *that target's* advisory lock; the locks of several targets
  on one backend are distinct keys.
* A frozen process or server affects all its targets at once, as a frozen process always did: the
  server ends the session (``idle_session_timeout``) and frees every lock it held.
* NOTIFY: the session LISTENs on the channels of every attached target; one thread per connection
  reads the socket while nobody runs a statement and hands each notification to the listener of its
  channel (notifications that arrive during another statement are handed on right after it).
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import psycopg

from .config import Settings
from .db import HostOrder, connect, describe_db_error, ms, readable, sever
from .identifiers import quote_ident
from .queries import leader as q

log = logging.getLogger("maintd.leader")

SESSION_MARKER = "maintd.session"  # a custom setting only our own session carries
POOLER_HINT = ("(PgBouncer pool_mode=transaction or statement?): connect maintd directly to "
               "PostgreSQL or through a pooler with pool_mode=session")


class SessionClosed(psycopg.OperationalError):
    """A view's statement found the shared session closed or replaced (another target found it
    broken, and said so): the view reattaches."""


class FairLock:
    """A reentrant lock granted in arrival order: with many targets queueing for one session, a
    renewal waits behind those that came first, never for an unlucky number of turns."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self._since = 0.0  # monotonic time the owner got it
        self._queue: collections.deque[tuple[threading.Event, int]] = collections.deque()

    def acquire(self, blocking: bool = True) -> bool:
        me = threading.get_ident()
        with self._guard:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is None:
                self._owner, self._depth, self._since = me, 1, time.monotonic()
                return True
            if not blocking:
                return False
            turn = threading.Event()
            self._queue.append((turn, me))
        turn.wait()  # release() made us the owner before setting it
        return True

    def release(self) -> None:
        with self._guard:
            self._depth -= 1
            if self._depth:
                return
            if self._queue:
                turn, waiter = self._queue.popleft()
                self._owner, self._depth, self._since = waiter, 1, time.monotonic()
                turn.set()
            else:
                self._owner = None

    def __enter__(self) -> "FairLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def held_for(self) -> float:
        """Seconds the current owner has held it (0 when free)."""
        with self._guard:
            return 0.0 if self._owner is None else time.monotonic() - self._since


class LeaderSessionError(RuntimeError):
    """The lock session is not a real, stable PostgreSQL session (e.g. PgBouncer transaction
    pooling): leadership cannot be guaranteed, so maintd refuses to lead."""


# Targets per lock session. Their statements take turns on it, and on a CPU-starved host each
# turn can take 50-100 ms (the holder waits for the GIL and a core at every step): measured with
# bench/targets.py (200 targets x 3 replicas on 2 cores), one session for all of a database's
# targets could not keep their leases renewed (turns waited 1-3 s with 20 targets per session);
# with 5, turns wait under a second, and a replica keeps 40 lock sessions instead of 200.
LOCK_GROUP = 5


class LockConnection:
    """One lock session for up to :data:`LOCK_GROUP` targets with the same database URL (the
    leader settings are the daemon's, so their sessions are set up alike); thread-safe."""

    def __init__(self, settings: Settings, hosts: HostOrder | None = None):
        self.settings = settings
        self.hosts = hosts or HostOrder(settings.database_url.get_secret_value())
        self.server: tuple[str | None, int | None] = (None, None)  # host, port last reached
        self.conn: psycopg.Connection | None = None
        self.marker = ""
        self.generation = 0  # bumped at each (re)connect: a view attached to an older one is closed
        self.last_used = 0.0  # monotonic time of the last statement sent
        self.mutex = FairLock()
        self._listeners: dict[str, Callable[[], None]] = {}
        self._users = 0
        # Why the connection broke, as its listener saw it (told to the first view that finds it
        # closed, as a database error; the others just reattach).
        self._lost: str | None = None
        self._reported = False

    @property
    def open(self) -> bool:
        conn = self.conn
        return conn is not None and not conn.closed

    # -- sessions ------------------------------------------------------------------------------
    def attach(self, channels: dict[str, Callable[[], None]],
               progress: Callable[[], None] = lambda: None) -> tuple[psycopg.Connection, int]:
        """Listen on ``channels`` (name: called for each NOTIFY on it), connecting first if
        needed; returns the connection and its generation."""
        with self.mutex:
            if not self.open:
                self._connect(progress)
            assert self.conn is not None
            for channel, listener in channels.items():
                if channel not in self._listeners:
                    self.conn.execute(f"LISTEN {quote_ident(channel)}")
                self._listeners[channel] = listener
            self._users += 1
            return self.conn, self.generation

    def detach(self, channels: list[str]) -> bool:
        """A view stops using the session; True when it was the last (the session is closed)."""
        with self.mutex:
            for channel in channels:
                self._listeners.pop(channel, None)
            self._users = max(0, self._users - 1)
            if self._users == 0:
                self.close()
                return True
            return False

    def _connect(self, progress: Callable[[], None]) -> None:
        cfg = self.settings.leader
        self.marker = secrets.token_hex(8)
        self.conn = conn = connect(
            self.hosts.dsn(),
            application_name=f"maintd:{self.settings.instance_id}",
            settings={"statement_timeout": ms(cfg.lease / 2), "lock_timeout": ms(cfg.renew_interval),
                      # the epoch bump's transaction, frozen half-way, ends within the lease
                      "idle_in_transaction_session_timeout": ms(cfg.lease),
                      SESSION_MARKER: self.marker},
            tcp_user_timeout=ms(cfg.lease),  # a send nobody acknowledges fails within the lease
            answer_timeout=cfg.lease.total_seconds(),  # a frozen server acknowledges, never answers
        )
        self.generation += 1
        self._users, self._lost, self._reported = 0, None, False
        try:
            progress()
            self.server = (conn.info.host, conn.info.port)
            self.hosts.reached(*self.server)  # the work pool's new connections go there first
            for channel in self._listeners:
                conn.execute(f"LISTEN {quote_ident(channel)}")
            self._verify(conn)
            if conn.info.server_version >= 140000:
                # Before the first pg_try_advisory_lock: if this process freezes (even right after
                # winning), the server ends the session and frees its locks within the lease.
                conn.execute(f"SET idle_session_timeout = {ms(cfg.lease)}")
        except BaseException:
            self.close()
            raise
        self.last_used = time.monotonic()
        threading.Thread(target=self._listen, args=(conn,), name="maintd-lock-listen", daemon=True).start()

    def _verify(self, conn: psycopg.Connection) -> None:
        """Refuse a pooler that does not keep one server session per client (PgBouncer transaction
        or statement pooling), before any lock is taken: the backend must stay the same across
        statements, and, behind a pooler, no other client may get it."""
        pids = {conn.execute(q.BACKEND_PID).fetchone()[0] for _ in range(3)}
        if len(pids) != 1:
            raise LeaderSessionError(f"the lock connection changes backend between statements {POOLER_HINT}")
        if conn.info.backend_pid in pids:
            return  # a direct connection: the client-side pid is the server's
        with connect(self.hosts.dsn(), application_name=f"maintd:{self.settings.instance_id}:probe",
                     answer_timeout=self.settings.leader.lease.total_seconds()) as probe:
            for _ in range(3):  # a session pooler never hands our backend to another client
                other = probe.execute(q.BACKEND_PID).fetchone()[0]
                mine = conn.execute(q.BACKEND_PID).fetchone()[0]
                if other in pids or mine not in pids:
                    raise LeaderSessionError(f"another client got the lock connection's backend {POOLER_HINT}")

    # -- statements ----------------------------------------------------------------------------
    @contextmanager
    def using(self, generation: int) -> Iterator[psycopg.Connection]:
        """The connection, for statements of a view attached at ``generation``, one caller at a
        time; notifications that arrived meanwhile are handed on after."""
        with self.mutex:
            conn = self.conn
            if conn is None or conn.closed or generation != self.generation:
                if generation == self.generation and not self._reported:
                    self._reported = True
                    raise psycopg.OperationalError(self._lost or "the lock session's connection was lost")
                raise SessionClosed("the lock session was closed")
            self.last_used = time.monotonic()
            yield conn
            self._dispatch(conn)

    def _dispatch(self, conn: psycopg.Connection) -> None:
        """Hand on the notifications received (under the mutex)."""
        for note in conn.notifies(timeout=0):
            listener = self._listeners.get(note.channel)
            if listener is not None:
                listener()

    def _listen(self, conn: psycopg.Connection) -> None:
        """Sleep in the kernel until the server sends something, then read it (the thread of one
        connection: it ends with it). Most often what arrived is the answer to a statement in
        flight, which its caller reads (and hands on what came with it): the listener then waits
        for its turn on the session, blocked, and reads only what is still unread. (It used to
        poll every 5 ms until the caller had read the answer: with 40 sessions per replica on
        busy cores those polls kept the callers from the GIL they needed to read their answers,
        and leases ran out.)"""
        fd = conn.fileno()
        while self.conn is conn and not conn.closed:
            try:
                if readable(fd, 1.0):
                    with self.mutex:
                        if self.conn is conn and not conn.closed and readable(fd):
                            self._dispatch(conn)
            except (psycopg.Error, OSError, ValueError) as exc:
                self._lost = describe_db_error(exc) if isinstance(exc, psycopg.Error) else str(exc)
                log.debug("lock session listener stopped: %s", exc)
                return

    def keep_alive(self, generation: int) -> float:
        """A statement every third of the lease, so that ``idle_session_timeout`` (meant for a
        frozen process) does not end a session nobody used; returns the seconds until the next
        one is due."""
        every = self.settings.leader.lease.total_seconds() / 3
        if time.monotonic() - self.last_used >= every:
            with self.using(generation) as conn:
                conn.execute(q.BACKEND_PID)
        return max(0.05, self.last_used + every - time.monotonic())

    # -- faults --------------------------------------------------------------------------------
    def sever(self) -> None:
        """From another thread: make a call blocked on a silent server fail now."""
        self.silent()
        sever(self.conn)

    def silent(self) -> None:
        """The server stopped answering: with a multi-host URL, try the others first."""
        self.hosts.silent(*self.server)

    def stuck_for(self) -> float:
        """Seconds the current statement (or connect) has been waiting for the server."""
        return self.mutex.held_for()

    def close(self, generation: int | None = None) -> None:
        """Close the session (the server frees every lock it held); views attached reconnect.
        With ``generation``, only if the session is still that one (a view that found an old one
        broken must not close the new one)."""
        if generation is not None and generation != self.generation:
            return
        self._reported = True  # whoever closes it knows why
        conn, self.conn = self.conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # pragma: no cover - closing a broken socket
                pass
