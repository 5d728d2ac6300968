"""The daemons registry: every running maintd keeps its row in ``{schema}.daemons`` fresh (for
``maintd status`` and the dashboard); rows unseen for an hour are forgotten."""

from __future__ import annotations

import os
import socket
import time

import psycopg

from . import __version__
from .queries import daemons, psycopg_sql

REGISTER_EVERY = 10.0  # seconds between heartbeats


class DaemonRegistry:
    def __init__(self, schema: str, instance_id: str, *, enabled: bool = True):
        self.schema = schema
        self.instance_id = instance_id
        self.enabled = enabled
        self.host = socket.gethostname()
        self._last = float("-inf")

    def heartbeat(self, conn: psycopg.Connection, *, force: bool = False) -> None:
        """Refresh this process's row (at most every ``REGISTER_EVERY`` s unless ``force``;
        a forced one, after a (re)connect, also forgets stale rows)."""
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < REGISTER_EVERY):
            return
        conn.execute(psycopg_sql(daemons.REGISTER, self.schema), {
            "instance": self.instance_id, "host": self.host, "pid": os.getpid(), "version": __version__})
        if force:
            conn.execute(psycopg_sql(daemons.FORGET_STALE, self.schema))
        self._last = now
