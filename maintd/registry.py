"""The daemons registry: every running maintd writes its row in ``{schema}.daemons`` when its
lock session (re)connects (for ``maintd status`` and the dashboard). Readers count a daemon as
alive while that session is connected (``pg_stat_activity``), so the row needs no periodic
refresh and an idle daemon writes nothing; rows of daemons gone for an hour are forgotten."""

from __future__ import annotations

import os
import socket

import time
from typing import TYPE_CHECKING, Callable

import psycopg

from . import __version__
from .queries import daemons, psycopg_sql

if TYPE_CHECKING:
    from .config import Settings
    from .leader import ElectionLoop


class DuplicateInstance(RuntimeError):
    """Another live daemon uses this ``instance_id`` (exit 2: a configuration error)."""


def check_unique_instance(loop: "ElectionLoop", settings: "Settings") -> None:
    """At start, before this daemon's lock session exists: refuse an ``instance_id`` that a live
    daemon already uses on one of its targets' schemas (two replicas with one id would both own
    every target, and the registry would show one of them). A predecessor whose session is still
    ending (a restart) is waited for, up to a lease."""
    from .db import connect

    deadline = time.monotonic() + settings.leader.lease.total_seconds()
    with connect(loop.session.hosts.dsn(), application_name=f"maintd-check:{settings.instance_id}"[:63],
                 answer_timeout=settings.leader.lease.total_seconds()) as conn:
        while True:
            found = None
            for seat in loop.targets:
                try:
                    found = found or conn.execute(psycopg_sql(daemons.DUPLICATE, seat.schema),
                                                  {"instance": settings.instance_id}).fetchone()
                except psycopg.Error as exc:  # no schema yet: nothing registered there
                    if isinstance(exc, psycopg.OperationalError):
                        raise
            if found is None:
                return
            if time.monotonic() > deadline:
                host, pid, addr = found
                raise DuplicateInstance(
                    f"instance_id {settings.instance_id!r} is already used by a live daemon (host {host}, "
                    f"pid {pid}, connected from {addr or 'a local socket'}): give each replica its own instance_id")
            time.sleep(0.5)


class DaemonRegistry:
    def __init__(self, schema: str, instance_id: str, *, enabled: bool = True):
        self.schema = schema
        self.instance_id = instance_id
        self.enabled = enabled
        self.host = socket.gethostname()

    def register(self, run: Callable[[str, dict], object]) -> None:
        """After the lock session (re)connects: write this process's row, forget stale ones;
        ``run(template, params)`` runs a statement of this schema on it."""
        if not self.enabled:
            return
        run(daemons.REGISTER, {"instance": self.instance_id, "host": self.host, "pid": os.getpid(),
                               "version": __version__})
        run(daemons.FORGET_STALE, {})
