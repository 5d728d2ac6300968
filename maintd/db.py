"""Connections: raw psycopg sessions and SQLAlchemy engines with keepalives and timeouts, the
leader lock's key, the NOTIFY channel, and password-free error lines. (The SQL itself lives in
:mod:`maintd.queries`.)"""

from __future__ import annotations

import re
import zlib
from datetime import timedelta
from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.pool import NullPool, QueuePool

from .config import redact_dsn
from .identifiers import quote_ident  # noqa: F401  (the migrations import it from here)
from .queries import catalog, psycopg_sql

KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "connect_timeout": 5,
}


def libpq_dsn(dsn: str) -> str:
    """Accept ``postgresql+psycopg://`` (SQLAlchemy style) as well as plain libpq strings."""
    return re.sub(r"^postgres(ql)?\+psycopg2?://", "postgresql://", dsn)


def ms(td: timedelta) -> int:
    return max(1, int(td.total_seconds() * 1000))


def connect(dsn: str, *, application_name: str, autocommit: bool = True,
            settings: dict[str, Any] | None = None, **params: Any) -> psycopg.Connection:
    """A raw psycopg connection with TCP keepalives and the given session settings; ``params``
    are extra libpq parameters (e.g. ``tcp_user_timeout``)."""
    conn = psycopg.connect(libpq_dsn(dsn), autocommit=True, application_name=application_name[:63],
                           **{**KEEPALIVES, **params})
    try:
        for key, value in (settings or {}).items():
            conn.execute(psycopg_sql(catalog.SET_SESSION), {"name": key, "value": str(value)})
        conn.autocommit = autocommit
    except BaseException:
        conn.close()
        raise
    return conn


def sever(conn: psycopg.Connection | None) -> None:
    """Shut the connection's socket down from another thread: a call blocked on a silent peer (a
    frozen server whose kernel still acknowledges, a partition) fails at once instead of waiting
    for a server that may never answer. The connection is unusable afterwards."""
    import os
    import socket

    try:
        fd = conn.pgconn.socket if conn is not None and not conn.closed else -1
    except Exception:  # pragma: no cover - already gone
        return
    if fd < 0:
        return
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def session_settings(statement_timeout: timedelta, *, lock_timeout: timedelta | None = None,
                     idle_in_transaction: timedelta | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"statement_timeout": ms(statement_timeout)}
    if lock_timeout is not None:
        out["lock_timeout"] = ms(lock_timeout)
    if idle_in_transaction is not None:
        out["idle_in_transaction_session_timeout"] = ms(idle_in_transaction)
    return out


def make_engine(dsn: str, *, application_name: str, session: dict[str, Any] | None = None,
                pool_size: int = 4, pooled: bool = True, **params: Any) -> Engine:
    """A SQLAlchemy engine over psycopg 3 whose connections carry ``session`` settings (and extra
    libpq ``params``, e.g. ``tcp_user_timeout``)."""

    def creator() -> psycopg.Connection:
        return connect(dsn, application_name=application_name, autocommit=False, settings=session, **params)

    kwargs: dict[str, Any] = {"creator": creator, "pool_pre_ping": True}
    if pooled:
        kwargs.update(poolclass=QueuePool, pool_size=pool_size, max_overflow=2, pool_recycle=1800)
    else:
        kwargs.update(poolclass=NullPool)
    engine = create_engine("postgresql+psycopg://", **kwargs)

    @event.listens_for(engine, "handle_error")
    def _hide_password(ctx: Any) -> None:  # pragma: no cover - defensive
        exc = ctx.original_exception
        if exc is not None and exc.args and isinstance(exc.args[0], str):
            exc.args = (redact_dsn(exc.args[0]),) + tuple(exc.args[1:])

    return engine


def advisory_key(schema: str) -> tuple[int, int]:
    """The (classid, objid) pair of the leader lock of a schema: stable across processes."""
    classid = 0x6D61_696E - (1 << 32) if 0x6D61_696E >= (1 << 31) else 0x6D61_696E  # 'main'
    crc = zlib.crc32(f"maintd:{schema}".encode())
    objid = crc - (1 << 32) if crc >= (1 << 31) else crc
    return classid, objid


def notify_channel(schema: str) -> str:
    """SPEC: ``maintd_jobs``; prefixed with the schema when the schema is not ``maintd``."""
    return "maintd_jobs" if schema == "maintd" else f"{schema}_maintd_jobs"


def events_channel(schema: str) -> str:
    """``maintd_events`` (the rescuer's ``stalled`` events), prefixed like :func:`notify_channel`."""
    return "maintd_events" if schema == "maintd" else f"{schema}_maintd_events"


def describe_db_error(exc: BaseException) -> str:
    """One line for an operator, without the password."""
    msg = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    line = msg[0] if msg else exc.__class__.__name__
    return redact_dsn(line)
