"""The daemons registry: every running maintd writes its row in ``{schema}.daemons`` when its
lock session (re)connects (for ``maintd status`` and the dashboard). Readers count a daemon as
alive while that session is connected (``pg_stat_activity``), so the row needs no periodic
refresh and an idle daemon writes nothing; rows of daemons gone for an hour are forgotten."""

from __future__ import annotations

import os
import socket

from typing import Callable

from . import __version__
from .queries import daemons

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
