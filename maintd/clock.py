"""Time. Every cutoff maintd computes comes from the database server's clock (SPEC 7.1): the
workers write ``now()`` of the server, so a daemon whose host clock is minutes off must still
agree with them. Services never read a clock themselves; their :class:`PassContext` hands them
one, which tests replace with a :class:`FrozenClock`.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

UTC = timezone.utc


class Clock(Protocol):
    reads_server: bool  # whether it reads the database server's time (a test's frozen clock does not)

    @property
    def due(self) -> bool:
        """Whether the last reading of the server's time is too old to carry forward."""
        ...

    def sync(self, conn: Any) -> None:
        """Read the server's time on ``conn`` (a SQLAlchemy connection)."""
        ...

    def take(self, server: datetime, sent: float, got: float) -> None:
        """A reading of the server's time made elsewhere."""
        ...

    def now(self) -> datetime:
        """The current time, timezone-aware (UTC)."""
        ...

    def skew(self) -> timedelta | None:
        """This clock minus the host's wall clock (for timers that run on the host's: the
        reindexer's cron trigger); None while unknown."""
        ...


class ServerClock:
    """The server's time, read with ``clock_timestamp()`` and carried forward on the host's
    monotonic clock (which no wall-clock skew or NTP step moves). A reading older than
    ``max_age`` seconds is ``due`` again; a pass then re-reads it on its own connection
    (:meth:`maintd.services.base.PassContext.now`), so most passes cost no extra round trip."""

    reads_server = True

    def __init__(self, max_age: float = 30.0):
        self.max_age = max_age
        self._lock = threading.Lock()
        self._reading: tuple[datetime, float] | None = None  # (server time, monotonic then)

    @property
    def due(self) -> bool:
        with self._lock:
            reading = self._reading
        return reading is None or time.monotonic() - reading[1] >= self.max_age

    def sync(self, conn: Any) -> None:
        """Read the server's time on ``conn`` (a SQLAlchemy connection)."""
        from sqlalchemy import text

        from .queries import catalog

        sent = time.monotonic()
        server = conn.execute(text(catalog.SERVER_TIME)).scalar_one()
        self.take(server, sent, time.monotonic())

    def take(self, server: datetime, sent: float, got: float) -> None:
        """A reading of the server's time made elsewhere (the due-time probe's, every second): the
        statement was sent at monotonic ``sent`` and answered at ``got``. A step of the server's
        clock (NTP) then reaches the carried reading within a probe's look, not only when a pass
        reads it again: a reading left behind a step forward turned the probe's "due now" into a
        wake-up a whole step away on the host's clock, and no pass ran to read it again."""
        with self._lock:
            self._reading = (server.astimezone(UTC), (sent + got) / 2)

    def now(self) -> datetime:
        with self._lock:
            reading = self._reading
        if reading is None:
            raise RuntimeError("ServerClock.now() before the first sync()")
        server, mono = reading
        return server + timedelta(seconds=time.monotonic() - mono)

    def skew(self) -> timedelta | None:
        try:
            return self.now() - datetime.now(UTC)
        except RuntimeError:  # never read yet
            return None


class FrozenClock:
    """A clock that only moves when told to (thread-safe), for tests: it takes no reading of the
    server's time."""

    reads_server = False
    due = False

    def sync(self, conn: Any) -> None:
        return None

    def take(self, server: datetime, sent: float, got: float) -> None:
        return None

    def __init__(self, start: datetime | None = None):
        self._now = start or datetime(2026, 1, 1, tzinfo=UTC)
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def skew(self) -> timedelta:
        """Zero: a frozen clock does not move the host's timers."""
        return timedelta(0)

    def set(self, when: datetime) -> None:
        with self._lock:
            self._now = when

    def advance(self, delta: timedelta | float) -> datetime:
        if not isinstance(delta, timedelta):
            delta = timedelta(seconds=delta)
        with self._lock:
            self._now += delta
            return self._now
