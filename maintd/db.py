"""Connections, identifier quoting and SQL templates.

SQL lives next to the service that runs it as plain text with one placeholder, ``{schema}``,
replaced by the validated, quoted schema name. Bound values always travel as parameters.
"""

from __future__ import annotations

import functools
import re
import zlib
from datetime import timedelta
from typing import Any

import psycopg
from sqlalchemy import Engine, TextClause, create_engine, event, text
from sqlalchemy.pool import NullPool, QueuePool

from .config import IDENT_RE, redact_dsn

KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "connect_timeout": 5,
}


def quote_ident(name: str) -> str:
    """Quote an identifier that has already passed :func:`maintd.config.validate_identifier`."""
    if not IDENT_RE.match(name):
        raise ValueError(f"refusing to quote unvalidated identifier {name!r}")
    return '"' + name + '"'


@functools.lru_cache(maxsize=512)
def render_sql(template: str, schema: str) -> str:
    return template.replace("{schema}", quote_ident(schema))


@functools.lru_cache(maxsize=512)
def sql(template: str, schema: str) -> TextClause:
    """A SQLAlchemy ``text()`` for a template, cached per (template, schema)."""
    return text(render_sql(template, schema))


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
            conn.execute("SELECT set_config(%s, %s, false)", (key, str(value)))
        conn.autocommit = autocommit
    except BaseException:
        conn.close()
        raise
    return conn


def session_settings(statement_timeout: timedelta, *, lock_timeout: timedelta | None = None,
                     idle_in_transaction: timedelta | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"statement_timeout": ms(statement_timeout)}
    if lock_timeout is not None:
        out["lock_timeout"] = ms(lock_timeout)
    if idle_in_transaction is not None:
        out["idle_in_transaction_session_timeout"] = ms(idle_in_transaction)
    return out


def make_engine(dsn: str, *, application_name: str, session: dict[str, Any] | None = None,
                pool_size: int = 4, pooled: bool = True) -> Engine:
    """A SQLAlchemy engine over psycopg 3 whose connections carry ``session`` settings."""

    def creator() -> psycopg.Connection:
        return connect(dsn, application_name=application_name, autocommit=False, settings=session)

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


def describe_db_error(exc: BaseException) -> str:
    """One line for an operator, without the password."""
    msg = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    line = msg[0] if msg else exc.__class__.__name__
    return redact_dsn(line)
