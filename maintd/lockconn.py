"""The lock session of one database: a dedicated, non-pooled PostgreSQL session holding the advisory
locks of every target of that database, used by one thread only (its
:class:`maintd.leader.ElectionLoop`), so it needs no lock of its own.

* It is set up so that a frozen or cut-off process loses its locks within the lease: the server ends
  the session after ``idle_session_timeout = lease`` without a statement (PostgreSQL 14+), a send
  nobody acknowledges fails within ``tcp_user_timeout = lease``, and a server that never answers is
  given up after the lease (:class:`maintd.db.BoundedConnection`).
* A pooler that cannot keep one server session per client (PgBouncer transaction or statement
  pooling) is refused before any lock is taken (:meth:`LockSession._verify`), and every proof checks
  that the statement still reaches the session we set up (a marker setting only ours carries); it
  prepares no statement, which would live in one backend only.
* The statements of all targets go together: the tries, the proofs and the unlocks of one round in
  one statement (:data:`maintd.queries.leader.ROUND`). NOTIFYs are read between rounds (:meth:`LockSession.drain`)
  and during statements (a handler), and handed to ``on_notify(channel)``.
"""

from __future__ import annotations

import math
import secrets
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import psycopg

from .config import Settings
from .db import HostOrder, NoAnswer, connect, ms, sever
from .identifiers import quote_ident
from .queries import catalog
from .queries import leader as q
from .queries import psycopg_sql

SESSION_MARKER = "maintd.session"  # a custom setting only our own session carries
POOLER_HINT = ("(PgBouncer pool_mode=transaction or statement?): connect maintd directly to "
               "PostgreSQL or through a pooler with pool_mode=session")
Key = tuple[int, int]
# A lock the session's bookkeeping meets (a target's daemons table locked by a migration): one
# statement waits this long, so several targets' locked tables cannot hold the renewals up.
LOCK_WAIT_MS = 200


class LeaderSessionError(RuntimeError):
    """The lock session is not a real, stable PostgreSQL session (e.g. PgBouncer transaction
    pooling): leadership cannot be guaranteed, so maintd refuses to lead."""


class LockSession:
    def __init__(self, settings: Settings, hosts: HostOrder, on_notify: Callable[[str], None]):
        self.settings = settings
        self.hosts = hosts
        self.on_notify = on_notify
        self.conn: psycopg.Connection | None = None
        self.marker = ""
        self.backend = 0  # the server backend the session was checked on (LockSession._verify)
        self.proven = False  # a round has reached a session we set up (a refusal after that is a pooler changed under us)
        self.server: tuple[str | None, int | None] = (None, None)  # host, port last reached
        self._since: float | None = None  # a statement (or connect) in flight since then

    @property
    def open(self) -> bool:
        return self.conn is not None and not self.conn.closed

    @property
    def user(self) -> str | None:
        """The role the session logged in as: an error a grant fixes names it."""
        return self.conn.info.user if self.open else None

    def connect_bound(self) -> float:
        """How long :meth:`connect` may take by its timeouts alone: each host's connect timeout."""
        return self.hosts.count * self._connect_timeout()

    def _connect_timeout(self) -> int:
        # per host: a frozen host costs a lease, not libpq's 5 s, before the next is tried
        return max(2, math.ceil(self.settings.leader.lease.total_seconds()))

    def connect(self, channels: Sequence[str]) -> psycopg.Connection:
        """Open and check the session, and LISTEN on ``channels``."""
        cfg = self.settings.leader
        self.close()
        self.marker, self.backend = secrets.token_hex(8), 0
        with self._in_flight():
            conn = connect(
                self.hosts.dsn(), application_name=f"maintd:{self.settings.instance_id}",
                settings={"statement_timeout": ms(cfg.lease / 2), "lock_timeout": min(ms(cfg.renew_interval), LOCK_WAIT_MS),
                          # the epoch bump's transaction, frozen half-way, ends within the lease
                          "idle_in_transaction_session_timeout": ms(cfg.lease), SESSION_MARKER: self.marker},
                tcp_user_timeout=ms(cfg.lease), answer_timeout=cfg.lease.total_seconds(),
                connect_timeout=self._connect_timeout())
        self.conn = conn
        # Nothing prepared server-side: a prepared statement lives in one backend, and a pooler
        # switched to transaction mode sends the next round to another, where it would fail on
        # the name before it could see the marker and say the session is not ours.
        conn.prepare_threshold = None
        try:
            self.server = (conn.info.host, conn.info.port)
            self.hosts.reached(*self.server)  # the work pool's new connections go there first
            conn.add_notify_handler(lambda note: self.on_notify(note.channel))
            self._verify(conn)
            for channel in channels:
                conn.execute(f"LISTEN {quote_ident(channel)}")
            if conn.info.server_version >= 140000:
                # Before the first try: if this process freezes (even right after winning), the
                # server ends the session and frees its locks within the lease.
                conn.execute(psycopg_sql(catalog.SET_SESSION), {"name": "idle_session_timeout", "value": str(ms(cfg.lease))})
        except BaseException:
            self.close()
            raise
        return conn

    def _verify(self, conn: psycopg.Connection) -> None:
        """Refuse a pooler that does not keep one server session per client, before any lock is
        taken: the backend must stay the same across statements, and, behind a pooler, no other
        client may get it."""
        pids = {conn.execute(q.BACKEND_PID).fetchone()[0] for _ in range(3)}
        if len(pids) != 1:
            raise LeaderSessionError(f"the lock connection changes backend between statements {POOLER_HINT}")
        self.backend = next(iter(pids))
        if conn.info.backend_pid in pids:
            return  # a direct connection: the client-side pid is the server's
        with connect(self.hosts.dsn(), application_name=f"maintd:{self.settings.instance_id}:probe",
                     answer_timeout=self.settings.leader.lease.total_seconds()) as probe:
            for _ in range(5):  # a session pooler never hands our backend to another client
                other = probe.execute(q.BACKEND_PID).fetchone()[0]
                mine = conn.execute(q.BACKEND_PID).fetchone()[0]
                if other in pids or mine not in pids:
                    raise LeaderSessionError(f"another client got the lock connection's backend {POOLER_HINT}")

    # -- statements (one thread only) ---------------------------------------------------------------
    def round_trip(self, tries: Sequence[Key], renewals: Sequence[Key],
                   unlocks: Sequence[Key]) -> tuple[list[bool], list[bool], float]:
        """The tries, the proofs and the unlocks of a round in one statement; returns whether each
        try won, whether each lock is still proven, and when the proofs were sent."""
        sent = time.monotonic()
        rows = self._round(tries, renewals, unlocks)
        answers: dict[int, list[bool]] = {1: [], 2: [], 3: []}
        for kind, _, ok, ours, primary, _ in rows:
            if not ours:
                raise LeaderSessionError(f"the lock connection reached a session it did not set up {POOLER_HINT}")
            answers[kind].append(bool(ok and (primary or kind != 2)))
        self.proven = self.proven or bool(rows)
        return answers[1], answers[2], sent

    def bump(self, key: Key, rendered: Callable[[str], str], params: dict,
             lock_timeout_ms: int) -> tuple[int, int, float]:
        """A won lock's epoch bump: first check that the lock is visible in this very backend (a
        pooler could have run the try elsewhere), then bump in one short transaction. Returns (epoch,
        lock pid, when the bump was sent); raises LockNotAvailable when an old leader's in-flight
        fenced transaction holds the row longer than ``lock_timeout_ms``."""
        [(_, _, held, ours, _, pid)] = self._round([], [key], [])
        if not (ours and held):
            raise LeaderSessionError(f"the advisory lock is not visible in this backend {POOLER_HINT}")
        conn = self._conn()
        sent = time.monotonic()
        with self._in_flight(), conn.transaction():
            conn.execute(psycopg_sql(catalog.SET_LOCAL), {"name": "lock_timeout", "value": str(int(lock_timeout_ms))})
            conn.execute(rendered(q.LOCK_ROW))
            epoch = conn.execute(rendered(q.BUMP_EPOCH), params).fetchone()[0]
        return epoch, pid, sent

    def _round(self, tries: Sequence[Key], renewals: Sequence[Key], unlocks: Sequence[Key]) -> list[tuple]:
        """One ROUND statement as this session (its marker and checked backend)."""
        params = {"marker": self.marker, "backend": self.backend}
        for kind, keys in (("try", tries), ("renew", renewals), ("unlock", unlocks)):
            params |= {f"{kind}_c": [k[0] for k in keys], f"{kind}_o": [k[1] for k in keys]}
        return self.run(psycopg_sql(q.ROUND), params)

    def run(self, statement: str, params: dict | None = None) -> list[tuple]:
        """One statement (rendered); its rows."""
        conn = self._conn()
        with self._in_flight():
            cur = conn.execute(statement, params or {})
            return cur.fetchall() if cur.description else []

    def drain(self) -> None:
        """Read what the server sent while no statement ran (NOTIFYs, or its goodbye: raises)."""
        conn = self._conn()
        conn.pgconn.consume_input()
        while (note := conn.pgconn.notifies()) is not None:
            self.on_notify(note.relname.decode())

    def _conn(self) -> psycopg.Connection:
        if self.conn is None or self.conn.closed:
            raise psycopg.OperationalError("the lock session is not connected")
        return self.conn

    @contextmanager
    def _in_flight(self) -> Iterator[None]:
        self._since = time.monotonic()
        try:
            yield
        except NoAnswer:  # a frozen server: the next connect tries the other hosts first
            self.hosts.silent(*self.server)
            raise
        finally:
            self._since = None

    # -- faults (from any thread) ---------------------------------------------------------------
    def stuck_for(self) -> float:
        """Seconds the statement (or connect) in flight has waited for the server (0: none)."""
        since = self._since
        return 0.0 if since is None else time.monotonic() - since

    def sever(self) -> None:
        """From another thread: make a call blocked on a silent server fail now, and try the
        other hosts of a multi-host URL first."""
        self.hosts.silent(*self.server)
        self._since = None  # once per wait: a connect in flight has no socket to shut yet
        sever(self.conn)

    def close(self) -> None:
        """Close the session: the server frees every lock it held."""
        conn, self.conn = self.conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # pragma: no cover - closing a broken socket
                pass
