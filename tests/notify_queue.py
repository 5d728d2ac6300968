"""A PostgreSQL of a test's own whose NOTIFY queue is full (SQLSTATE 54000 at the COMMIT of any
transaction that notifies), for the services that notify: the scheduler's wake-ups, the rescuer's
events. PostgreSQL's documentation, sql-notify.html, Notes: one queue for the whole server; a
session that LISTENs and stays in a transaction stops its cleanup. Its size is a setting
(max_notify_queue_pages) from PostgreSQL 17 on, so the server is the embedded 18 whatever the
suite's (filling PostgreSQL 15's fixed 8 GB would take the suite's whole budget)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import psycopg
import pytest
from sqlalchemy import Engine

from maintd import migrate
from maintd.db import make_engine
from maintd.embedded import EmbeddedPostgres

from .conftest import migrate_layout


@contextmanager
def notify_queue_full(layout: str) -> Iterator[tuple[str, Engine]]:
    """(dsn, engine) of a server with schema ``maintd`` in ``layout`` and its NOTIFY queue full."""
    with EmbeddedPostgres(settings={"max_notify_queue_pages": "64"}) as pg:  # the least: 512 kB
        engine = make_engine(pg.dsn, application_name="maintd-test", pool_size=4)
        stuck = psycopg.connect(pg.dsn)
        filler = psycopg.connect(pg.dsn, autocommit=True)
        try:
            with engine.connect() as conn:
                migrate.upgrade(conn, "maintd", layout=migrate_layout(layout))
            stuck.execute("LISTEN some_other_application")
            stuck.commit()
            stuck.execute("SELECT 1")  # and now idle in a transaction, never reading
            with pytest.raises(psycopg.errors.ProgramLimitExceeded):
                for i in range(1000):
                    filler.execute("SELECT pg_notify('some_other_application', repeat('x', 7000) || %s)", (str(i),))
            yield pg.dsn, engine
        finally:
            stuck.close()
            filler.close()
            engine.dispose()
