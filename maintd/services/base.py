"""What every maintenance service is: config in, one pass against a connection and a clock, a
typed result out. Scheduling, leadership gating, fencing, timing, metrics and error handling live
in :mod:`maintd.runner`, not here.

A pass does its work in short transactions opened with :meth:`PassContext.transaction`, each
fenced (it proves, inside the transaction, that this instance still leads) and each bounded by
the statement timeout. Between batches a pass checks :meth:`PassContext.should_stop`.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Protocol

from sqlalchemy import Connection, Engine, TextClause

from ..clock import Clock
from ..db import sql as render

if TYPE_CHECKING:
    from apscheduler.triggers.base import BaseTrigger

    from ..config import Settings
    from ..metrics import Metrics


class NotLeader(Exception):
    """This instance does not (or no longer) hold the leader lock: the transaction was not run."""


class Fence(Protocol):
    def check(self, conn: Connection) -> None:
        """Inside the caller's open transaction: raise :class:`NotLeader` unless we still lead.

        Must also lock what a new leader has to change to take over (so a takeover waits for
        this transaction to end)."""
        ...


class NoFence:
    """For dry runs and unit tests of a single pass."""

    def check(self, conn: Connection) -> None:
        return None


class PassStopped(Exception):
    """Raised by a pass that noticed ``should_stop()`` and gave up early."""


@dataclass
class PassContext:
    engine: Engine
    settings: "Settings"
    clock: Clock
    fence: Fence = field(default_factory=NoFence)
    dry_run: bool = False
    stop_event: threading.Event = field(default_factory=threading.Event)
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("maintd"))
    # The connection of the transaction now running, so the runner can cancel its query when
    # leadership is lost or the daemon stops.
    current: Any = None
    _conn: Any = field(default=None, repr=False)
    _in_session: bool = field(default=False, repr=False)

    @property
    def schema(self) -> str:
        return self.settings.schema

    @property
    def instance_id(self) -> str:
        return self.settings.instance_id

    def sql(self, template: str) -> TextClause:
        return render(template, self.schema)

    def now(self) -> datetime:
        return self.clock.now()

    def should_stop(self) -> bool:
        return self.stop_event.is_set()

    def check_stop(self) -> None:
        if self.stop_event.is_set():
            raise PassStopped()

    def pause(self, seconds: float) -> None:
        """Sleep between transactions; a stop (lost leadership, shutdown) ends it at once."""
        if seconds > 0 and self.stop_event.wait(seconds):
            raise PassStopped()

    @contextmanager
    def session(self) -> Iterator["PassContext"]:
        """While open, the pass's transactions share one pooled connection instead of checking
        one out (with a ping and a reset) per transaction. A transaction that fails gives the
        connection back; the next one checks out a fresh one. The runner opens it around a pass."""
        if self._in_session:
            yield self
            return
        self._in_session = True
        try:
            yield self
        finally:
            self._in_session = False
            self._release()

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    @contextmanager
    def transaction(self, *, statement_timeout_ms: int | None = None, fenced: bool = True,
                    settings: dict[str, str] | None = None) -> Iterator[Connection]:
        """One short fenced transaction. Commits on success; in a dry run it always rolls back.
        ``statement_timeout_ms`` and ``settings`` (e.g. ``lock_timeout``) hold for this
        transaction only."""
        self.check_stop()
        conn = self._conn or self.engine.connect()
        if self._in_session:
            self._conn = conn
        self.current = conn
        try:
            local = dict(settings or {})
            if statement_timeout_ms is not None:
                local["statement_timeout"] = str(int(statement_timeout_ms))
            if local:
                conn.execute(self.sql(_set_local(tuple(local))),
                             {f"v{i}": v for i, v in enumerate(local.values())})
            if fenced and not self.dry_run:
                self.fence.check(conn)
            yield conn
            if self.dry_run:
                conn.rollback()
            else:
                conn.commit()
        except BaseException:
            try:
                conn.rollback()
            except Exception:  # e.g. the connection is gone: the original error is what matters
                pass
            if conn is self._conn:
                self._release()
            raise
        finally:
            self.current = None
            if conn is not self._conn:
                conn.close()


def _set_local(names: tuple[str, ...]) -> str:
    """``SELECT set_config('name', :v0, true), ...``: transaction-local settings in one round trip
    (names are maintd's own constants, values travel as parameters)."""
    if not all(n.replace("_", "").isalnum() for n in names):
        raise ValueError(f"not a setting name: {names!r}")
    return "SELECT " + ", ".join(f"set_config('{n}', :v{i}, true)" for i, n in enumerate(names))


class PassResult:
    """Base for a service's typed one-pass result (a dataclass)."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def did_something(self) -> bool:
        """Whether the pass changed (or in a dry run, would change) anything worth a log line."""
        return False

    def summary(self) -> str:
        """A short human line, e.g. ``deleted completed=10 discarded=2``."""
        return " ".join(f"{k}={v}" for k, v in self.as_dict().items())


class Service(abc.ABC):
    """One maintenance service. Subclasses set ``name`` and implement :meth:`run_once`."""

    name: ClassVar[str]

    def __init__(self, settings: "Settings"):
        self.settings = settings

    @property
    def config(self) -> Any:
        """This service's config section (``settings.<name>``)."""
        return getattr(self.settings, self.name)

    def enabled(self) -> bool:
        return bool(self.config.enabled)

    def trigger(self) -> "BaseTrigger":
        """When passes run; by default every ``interval``."""
        from apscheduler.triggers.interval import IntervalTrigger

        return IntervalTrigger(seconds=self.config.interval.total_seconds())

    @abc.abstractmethod
    def run_once(self, ctx: PassContext) -> PassResult:
        """Do one pass. Must be safe to run concurrently with another instance of itself."""

    def observe(self, metrics: "Metrics", result: PassResult) -> None:
        """Record the service-specific metrics of a committed pass (optional)."""
        return None
