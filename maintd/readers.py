"""Readers (SPEC 8.5): the database sessions of ``/status``, the dashboard and the read commands,
apart from maintenance.

A reader never borrows a maintenance connection or the lock session, so no number of people (or
scripts) reading can starve a pass or delay a renewal. Per database URL it has a small pool of
its own: at most :data:`MOST` sessions (:data:`KEPT` kept open between reads), named
``maintd:<instance>:read`` in ``pg_stat_activity``, read-only, with a short statement timeout, a
short connect timeout and a bound on the wait for an answer (a frozen server). The HTTP listener
renders at most two pages at once (:mod:`maintd.listener`), so a flood of dashboard clients
holds at most that many sessions; a page that finds the pool busy for :data:`POOL_WAIT` seconds
is a 503.

Expensive figures (jobs counted by queue and state) are not read here: the leader counts them
on its schedule (:class:`maintd.metrics.JobGauges`) and ``/status`` serves them from memory.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Callable

from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import Engine, event

from .db import libpq_dsn, load_any_time, make_engine, session_attrs, session_settings

KEPT = 2  # sessions a pool keeps open between reads
MOST = 4  # sessions a pool opens at most (two renders; a CLI or a test may share it)
READ_TIMEOUT = timedelta(seconds=5)  # statement_timeout of a reader session
CONNECT_TIMEOUT = 3  # seconds (libpq connect_timeout)
POOL_WAIT = 2.0  # seconds a read waits for a free session before it gives up (503)


def reader_engine(dsn: str, instance_id: str, *, kept: int = KEPT, most: int = MOST,
                  statement_timeout: timedelta = READ_TIMEOUT) -> Engine:
    """A small pool of read-only sessions named ``maintd:<instance_id>:read``."""
    session = session_settings(statement_timeout, lock_timeout=timedelta(seconds=1),
                               idle_in_transaction=statement_timeout * 2)
    session["default_transaction_read_only"] = "on"
    engine = make_engine(dsn, application_name=f"maintd:{instance_id}:read", session=session,
                         pool_size=kept, max_overflow=max(0, most - kept), pool_timeout=POOL_WAIT,
                         connect_timeout=CONNECT_TIMEOUT, **_primary(dsn),
                         answer_timeout=statement_timeout.total_seconds() + CONNECT_TIMEOUT)
    # A time no Python datetime holds ('infinity', Go's zero time, BC, past year 9999: SPEC 7.3) in
    # any row a reader reads loads as PostgreSQL's text of it, shown as is: one such row of the
    # leader, daemons, periodic_slots or jobs tables made a whole page or command fail.
    event.listen(engine, "connect", lambda dbapi_conn, _record: load_any_time(dbapi_conn))
    return engine


def _primary(dsn: str) -> dict[str, str]:
    """A multi-host URL without ``target_session_attrs`` reads the primary (read-only or not): the
    leader's lock and the daemons' sessions are the primary's, a standby shows none of them."""
    return session_attrs(conninfo_to_dict(libpq_dsn(dsn)), "primary")


class Readers:
    """One reader pool per database URL, opened on first use; ``instance_id`` is read then (the
    daemon's, possibly from a reloaded config)."""

    def __init__(self, instance_id: Callable[[], str], *, kept: int = KEPT, most: int = MOST,
                 statement_timeout: timedelta = READ_TIMEOUT):
        self.instance_id = instance_id
        self.kept, self.most, self.statement_timeout = kept, most, statement_timeout
        self._engines: dict[str, Engine] = {}
        self._lock = threading.Lock()

    def engine(self, dsn: str) -> Engine:
        with self._lock:
            engine = self._engines.get(dsn)
            if engine is None:
                engine = self._engines[dsn] = reader_engine(
                    dsn, self.instance_id(), kept=self.kept, most=self.most,
                    statement_timeout=self.statement_timeout)
            return engine

    def dispose(self) -> None:
        with self._lock:
            engines, self._engines = list(self._engines.values()), {}
        for engine in engines:
            engine.dispose()
