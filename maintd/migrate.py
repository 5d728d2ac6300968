"""``maintd migrate``: Alembic revisions applied under an advisory lock, so several replicas
starting at once apply them exactly once."""

from __future__ import annotations

import io
import zlib
from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, text

from .db import quote_ident


def _script_location() -> str:
    return str(Path(str(resources.files("maintd.migrations"))))


def alembic_config(schema: str) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", _script_location())
    cfg.attributes["schema"] = schema
    return cfg


def _lock_key(schema: str) -> int:
    return zlib.crc32(f"maintd-migrate:{schema}".encode()) - (1 << 31)


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config("maintd")).get_current_head() or ""


def current_revision(conn: Connection, schema: str) -> str | None:
    exists = conn.execute(
        text("SELECT to_regclass(:t) IS NOT NULL"), {"t": f"{quote_ident(schema)}.alembic_version"}
    ).scalar()
    if not exists:
        return None
    ctx = MigrationContext.configure(conn, opts={"version_table_schema": schema})
    return ctx.get_current_revision()


def upgrade(conn: Connection, schema: str, revision: str = "head") -> tuple[str | None, str | None]:
    """Apply migrations up to ``revision``. Returns (before, after). Safe to run concurrently."""
    return _run(conn, schema, lambda cfg: command.upgrade(cfg, revision))


def downgrade(conn: Connection, schema: str, revision: str) -> tuple[str | None, str | None]:
    return _run(conn, schema, lambda cfg: command.downgrade(cfg, revision))


def _run(conn: Connection, schema: str, action) -> tuple[str | None, str | None]:
    key = _lock_key(schema)
    conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
    conn.commit()
    try:
        conn.execute(text(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(schema)}"))
        conn.commit()
        before = current_revision(conn, schema)
        conn.commit()
        cfg = alembic_config(schema)
        cfg.attributes["connection"] = conn
        action(cfg)
        conn.commit()
        after = current_revision(conn, schema)
        conn.commit()
        return before, after
    finally:
        conn.rollback()
        conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
        conn.commit()


def offline_sql(schema: str, revision: str = "head") -> str:
    """The SQL of the migrations for a DBA to review or apply by hand."""
    buf = io.StringIO()
    cfg = alembic_config(schema)
    cfg.attributes["output_buffer"] = buf
    command.upgrade(cfg, revision, sql=True)
    return buf.getvalue()
