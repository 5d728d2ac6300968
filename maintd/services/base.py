"""What a maintenance service is: its own config section in, one pass against a
:class:`PassContext` (connections, fencing, the server's clock, a stop flag), a typed
:class:`PassResult` out. Scheduling, leadership gating, timing, metrics, error handling and the
``service_runs`` record live in :mod:`maintd.runner` and :mod:`maintd.passes`, not here.

A pass does its work in short transactions opened with :meth:`PassContext.transaction`, each
bounded by the statement timeout. A transaction that wrote anything is fenced: right before its
COMMIT it proves, inside the transaction, that this instance still leads (or it rolls back); one
that wrote nothing commits without a fence, a lock or WAL. A pass first looks whether there is
work with a read-only probe (:meth:`PassContext.read`, one round trip, no transaction), so an idle
pass writes nothing. Between batches a pass checks :meth:`PassContext.check_stop`.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Protocol, TypeVar

from sqlalchemy import Connection, Engine, TextClause, text

from ..clock import Clock
from ..metrics import Family
from ..queries import Statements, catalog

if TYPE_CHECKING:
    from apscheduler.triggers.base import BaseTrigger

    from ..config import Settings
    from ..metrics import Metrics

CANCEL_TIMEOUT = 2.0  # seconds a cancel request may take (it opens its own connection)


# SQLSTATE 40001, "tuple to be locked was already moved to another partition due to concurrent
# update": on the partitioned layout (SPEC 8.1) a row a statement meant to lock or change was moved
# to another partition (a completion, a cancel) by a transaction that committed meanwhile. For a
# maintenance statement that row finished meanwhile: the batch is redone, and sees it as it is now.
# A busy table can move rows under every batch of a pass: what is bounded is how often one batch
# is redone in a row (a committed transaction starts the count again), and the services redo it
# smaller (see :meth:`PassContext.redo_limit`), so the pass still makes progress.
MOVED_MEANWHILE = "40001"
MIN_BATCH = 100  # a batch that hits the statement timeout is redone at half the size, down to this
MOVED_MAX = 100  # redos in a row of one batch; past this the error is the pass's (something else)
R = TypeVar("R")


class NotLeader(Exception):
    """This instance does not (or no longer) hold the leader lock: the transaction was not run."""


class PassStopped(Exception):
    """Raised by a pass that noticed a stop (lost leadership, shutdown) and gave up early."""


class Fence(Protocol):
    """Proves leadership inside a transaction. ``epoch`` names the term (None: no term).

    A fence may also have ``check_writes(conn)``: the same proof, made only when the transaction
    wrote anything, in one statement (:class:`maintd.leader.LeaderFence` has it); without it,
    :class:`PassContext` asks the server whether the transaction wrote, then calls ``check``."""

    epoch: int | None

    def check(self, conn: Connection) -> None:
        """Inside the caller's open transaction: raise :class:`NotLeader` unless we still lead.

        Must also lock what a new leader has to change to take over (so a takeover waits for
        this transaction to end)."""
        ...


class NoFence:
    """For dry runs and tests of a single pass."""

    epoch = None

    def check(self, conn: Connection) -> None:
        return None

    def check_writes(self, conn: Connection) -> None:
        return None


class RunningQuery:
    """The connection whose statement a pass is running now, so that the runner can cancel it
    when leadership is lost or the daemon stops (a cancel request opens its own connection, so it
    runs in a thread: it must not hold up a demotion when the server is unreachable)."""

    def __init__(self) -> None:
        self._conn: Connection | None = None
        self._since: float | None = None  # monotonic start of the fenced transaction now open
        self._lock = threading.Lock()
        self._cancelling: threading.Thread | None = None  # a cancel of the tracked connection on its way

    @property
    def active(self) -> bool:
        return self._conn is not None

    def stalled_for(self) -> float:
        """Seconds the open transaction (from its connection checkout on) has been waiting; 0
        when none is open. DDL on an autocommit connection is not counted (it has a timeout)."""
        since = self._since
        return 0.0 if since is None else time.monotonic() - since

    @contextmanager
    def timing(self) -> Iterator[None]:
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None

    @contextmanager
    def tracking(self, conn: Connection) -> Iterator[Connection]:
        """While open, :meth:`cancel` and :meth:`sever` reach ``conn``. A cancel on its way when
        it ends is waited for (up to ``CANCEL_TIMEOUT``): arriving later, it would cancel what the
        connection's next user runs (the pool hands it on at once); an idle session ignores it."""
        self._conn = conn
        try:
            yield conn
        finally:
            with self._lock:
                self._conn, cancelling, self._cancelling = None, self._cancelling, None
            if cancelling is not None:
                cancelling.join(CANCEL_TIMEOUT)

    def sever(self) -> None:
        """Shut the running query's socket down (a silent server never answers a cancel)."""
        from ..db import sever

        conn = self._conn
        try:
            sever(conn.connection.dbapi_connection if conn is not None else None)
        except Exception:  # pragma: no cover - the connection may be gone already
            pass

    def cancel(self) -> None:
        with self._lock:
            conn = self._conn
            try:
                raw = conn.connection.dbapi_connection if conn is not None else None
            except Exception:  # pragma: no cover - the connection may be gone already
                raw = None
            if raw is None or (self._cancelling is not None and self._cancelling.is_alive()):
                return  # nothing running, or a cancel on its way already

            def cancel() -> None:
                try:
                    raw.cancel_safe(timeout=CANCEL_TIMEOUT)
                except Exception:  # the pass ends anyway: statement timeout or a dead connection
                    pass

            self._cancelling = threading.Thread(target=cancel, name="maintd-cancel", daemon=True)
            self._cancelling.start()


@dataclass
class PassContext:
    engine: Engine
    schema: str
    clock: Clock
    instance_id: str = "maintd"
    statement_timeout: timedelta = timedelta(seconds=30)
    layout: str = "plain"  # the configured layout (SPEC 8.1); the catalog says what the table is
    fence: Fence = field(default_factory=NoFence)
    dry_run: bool = False
    stop_event: threading.Event = field(default_factory=threading.Event)
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("maintd"))
    query: RunningQuery = field(default_factory=RunningQuery)
    statements: Statements | None = None  # the target's SQL, rendered once (else rendered here)
    moved: int = 0  # batches redone because a row had moved to another partition meanwhile
    redos: int = 0  # of them, since the last committed transaction (the batch now being redone)
    partial: Any = None  # the pass's result so far (see begin): what a stopped pass reports
    _conn: Any = field(default=None, repr=False)
    _in_session: bool = field(default=False, repr=False)
    _rehearsal: Any = field(default=None, repr=False)  # a dry run's one transaction (see rehearsal)

    @classmethod
    def for_settings(cls, settings: "Settings", engine: Engine, clock: Clock, **kw: Any) -> "PassContext":
        return cls(engine=engine, schema=settings.schema, clock=clock, instance_id=settings.instance_id,
                   statement_timeout=settings.statement_timeout, layout=settings.layout, **kw)

    def sql(self, template: str) -> TextClause:
        if self.statements is None:
            self.statements = Statements(self.schema)
        return self.statements.sql(template)

    def now(self, fresh: bool = False) -> datetime:
        """The server's time (a test's frozen time), read again on this pass's connection when the
        last reading is old, or (``fresh``) now: a reading carried forward runs ahead of the
        server's clock for up to 30 s after that clock steps back, which a retention must not."""
        if self.clock.due or (fresh and self.clock.reads_server):
            self.check_stop()  # no new statement once stopped (a cancel is sent once)
            outside = self.query.stalled_for() == 0.0  # (inside, the transaction is timed and tracked)
            with self.query.timing() if outside else nullcontext(), self._checkout() as conn, \
                    self.query.tracking(conn) if outside else nullcontext():  # a demotion cancels it
                self.clock.sync(conn)  # (in a transaction: that one's connection)
                if outside:
                    conn.rollback()  # end the read's transaction: a probe may follow in autocommit
        return self.clock.now()

    def begin(self, result: R) -> R:
        """The pass's result, kept here too: a pass stopped half-way (a demotion, a reload)
        reports what its committed transactions did (the services count a batch after its
        commit), so its deleted, rescued or promoted jobs are not missing from the counters."""
        self.partial = result
        return result

    def should_stop(self) -> bool:
        return self.stop_event.is_set()

    def moved_meanwhile(self, exc: BaseException) -> bool:
        """Whether ``exc`` (from a batch's transaction, rolled back) is SQLSTATE 40001 (a row
        moved to another partition meanwhile, see ``MOVED_MEANWHILE``): counted, and the caller
        redoes the batch. Not an error of the pass, up to ``MOVED_MAX`` redos of one batch in a row
        (a committed transaction starts the count again)."""
        if getattr(getattr(exc, "orig", None), "sqlstate", None) != MOVED_MEANWHILE or self.redos >= MOVED_MAX:
            return False
        self.moved += 1
        self.redos += 1
        self.log.info("a row moved to another partition meanwhile (it finished): batch redone",
                      extra={"fields": {"schema": self.schema}})
        return True

    def redo_limit(self, limit: int) -> int:
        """A batch's ``limit`` halved for each time it was redone in a row (a row of it moved
        meanwhile): the fewer rows a batch locks, the less a busy table moves under it."""
        return max(1, limit >> min(self.redos, 30))

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

    @contextmanager
    def _checkout(self) -> Iterator[Connection]:
        """The session's connection (kept) or, outside a session, a connection of its own."""
        conn = self._conn or self.engine.connect()
        if self._in_session:
            self._conn = conn
        try:
            yield conn
        except BaseException:
            if conn is self._conn:
                self._release()
            raise
        finally:
            if conn is not self._conn:
                conn.close()

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    @contextmanager
    def rehearsal(self) -> Iterator[None]:
        """In a dry run, the transactions opened meanwhile are savepoints of one transaction,
        rolled back at the end: each sees what the earlier ones would have done (a unique key the
        job of an earlier slot would hold), so the dry run says what the pass would do; nothing
        stays. Outside a dry run, nothing changes. No :meth:`read` inside (it ends a transaction),
        and the transactions' ``settings`` and timeout are not applied (they would outlive them)."""
        if not self.dry_run or self._rehearsal is not None:
            yield
            return
        self.check_stop()
        with self.query.timing(), self.engine.connect() as conn, self.query.tracking(conn):
            self._rehearsal = conn
            try:
                yield
            finally:
                self._rehearsal = None
                conn.rollback()

    @contextmanager
    def transaction(self, *, statement_timeout_ms: int | None = None, fenced: bool = True,
                    settings: dict[str, str] | None = None) -> Iterator[Connection]:
        """One short transaction. Commits on success; in a dry run it always rolls back (at the
        end of a :meth:`rehearsal`). If it wrote anything (and ``fenced``), the fence is checked
        right before COMMIT, in the same transaction: a write commits only while this instance
        leads. ``statement_timeout_ms`` and ``settings`` (e.g. ``lock_timeout``) hold for this
        transaction only."""
        self.check_stop()
        if self._rehearsal is not None:  # a savepoint of the rehearsal's transaction, kept when it ends well
            with self._rehearsal.begin_nested():
                yield self._rehearsal
            return
        with self.query.timing(), self._checkout() as conn, self.query.tracking(conn):
            try:
                local = dict(settings or {})
                if statement_timeout_ms is not None:
                    local["statement_timeout"] = str(int(statement_timeout_ms))
                if local:
                    conn.execute(self.sql(catalog.set_local(tuple(local))),
                                 {f"v{i}": v for i, v in enumerate(local.values())})
                yield conn
                if self.dry_run:
                    conn.rollback()
                else:
                    if fenced:
                        self._fence_writes(conn)
                    conn.commit()
                self.redos = 0  # the batch went through: the next one may be redone again
            except BaseException:
                try:
                    conn.rollback()
                except Exception:  # e.g. the connection is gone: the original error is what matters
                    pass
                raise

    def _fence_writes(self, conn: Connection) -> None:
        check_writes = getattr(self.fence, "check_writes", None)
        if check_writes is not None:
            check_writes(conn)
        elif conn.execute(self.sql(catalog.WROTE)).scalar():
            self.fence.check(conn)

    def prove_leader(self) -> None:
        """Check the fence now, in a transaction of its own (before work no transaction can
        fence, such as DDL on an autocommit connection). Raises :class:`NotLeader`."""
        self.check_stop()
        if self.dry_run:
            return
        with self.query.timing(), self._checkout() as conn, self.query.tracking(conn):
            try:
                self.fence.check(conn)
            finally:
                conn.rollback()

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A read-only probe (is there work?): statements in autocommit, one round trip each, no
        transaction, no fence, no WAL. Must not write."""
        self.check_stop()
        with self.query.timing(), self._checkout() as conn, self.query.tracking(conn):
            if conn.in_transaction():
                conn.rollback()
            # Autocommit set on the driver's connection: SQLAlchemy's isolation-level switch
            # (there and back, and again at check-in) was 8 driver calls, a sixth of an idle tick.
            driver = conn.connection.dbapi_connection
            driver.autocommit = True
            try:
                yield conn
            finally:
                try:
                    conn.rollback()  # ends SQLAlchemy's autobegun Transaction (nothing is sent)
                    driver.autocommit = False
                except Exception:  # never let a transaction run on it in autocommit: drop it
                    conn.invalidate()
                    self._release()

    @contextmanager
    def autocommit(self, *, lock_timeout_ms: int, statement_timeout_ms: int) -> Iterator[Connection]:
        """A connection of its own in autocommit mode (for DDL such as ``REINDEX CONCURRENTLY``,
        which cannot run in a transaction), with the given timeouts; the runner can cancel it. The
        pooled connection goes back with the timeouts it came with (or is discarded)."""
        with self.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            was = conn.execute(text(catalog.TIMEOUTS)).one()._asdict()
            raw = conn.connection.dbapi_connection
            bound = getattr(raw, "answer_timeout", None)  # db.BoundedConnection: follows the timeout
            try:  # (a SET that fails leaves the ones before it in force: put back too)
                _set_session(conn, lock_timeout=str(int(lock_timeout_ms)), statement_timeout=str(int(statement_timeout_ms)))
                if bound is not None:
                    raw.answer_timeout = bound + statement_timeout_ms / 1000
                with self.query.tracking(conn):
                    yield conn
            finally:
                if bound is not None:
                    raw.answer_timeout = bound
                try:
                    _set_session(conn, **was)
                except Exception:  # never back to the pool without its bounds
                    conn.invalidate()


def _set_session(conn: Connection, **settings: str) -> None:
    for name, value in settings.items():
        conn.execute(text(catalog.SET_SESSION), {"name": name, "value": value})


def _rounded(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 3)
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return v


class PassResult:
    """Base for a service's typed one-pass result (a dataclass)."""

    def as_dict(self) -> dict[str, Any]:
        """The result as JSON-ready data, seconds rounded to the millisecond (no 18.557157819999986)."""
        return _rounded(dataclasses.asdict(self))  # type: ignore[call-overload]

    def did_something(self) -> bool:
        """Whether the pass changed (or in a dry run, would change) anything worth a log line."""
        return False

    def failed(self) -> bool:
        """Whether part of the pass failed although it ran to its end (outcome ``error``)."""
        return False

    def waited(self) -> float:
        """Seconds the pass spent waiting on purpose (not work: left out of its duration)."""
        return 0.0

    def wake_at(self) -> datetime | None:
        """When (the server's time) the service wants its next pass, if before its next tick
        (precise timing: a job falls due); None: at the next tick."""
        return None

    def skipped_rows(self) -> dict[str, int]:
        """Rows the pass passed over, by reason (each logged with its id, or many in one line with
        their count and a few ids): fed to ``maintd_rows_skipped_total{service,reason}``."""
        return {}

    def summary(self) -> str:
        """A short human line, e.g. ``deleted completed=10 discarded=2``."""
        return " ".join(f"{k}={v}" for k, v in self.as_dict().items())


class Service(abc.ABC):
    """One maintenance service, built from its own config section (any object with ``enabled``
    and ``interval`` for the defaults below). Subclasses implement :meth:`run_once`, and declare
    the metric families :meth:`observe` records in ``METRICS``."""

    METRICS: ClassVar[tuple[Family, ...]] = ()
    # Whether a reload that changes the section stops a running pass (a retention lengthened must
    # stop the deletions); one that disables the service always does.
    STOP_ON_CHANGE: ClassVar[bool] = True

    def __init__(self, config: Any):
        self.config = config

    def enabled(self) -> bool:
        return bool(self.config.enabled)

    def trigger(self) -> "BaseTrigger | None":
        """When passes run; by default every ``interval``. None (a service with a :meth:`probe`): no
        ticks of its own, a probe of the database asks for its passes (:mod:`maintd.probes`)."""
        from apscheduler.triggers.interval import IntervalTrigger

        if self.probe() is not None:
            return None
        return IntervalTrigger(seconds=self.config.interval.total_seconds())

    def probe(self) -> list[str] | None:
        """Scalar subqueries of ``{schema}`` (index probes) that tell whether a pass would find
        work, asked for every target of a database in one statement (:class:`maintd.probes.
        ServiceProbe`) every :meth:`probe_every` seconds; None: the service ticks by itself."""
        return None

    def probe_every(self) -> float:
        return self.config.interval.total_seconds()

    def after_probe(self, values: tuple, now: datetime) -> "bool | datetime | None":
        """What the probe's ``values`` mean at the server's ``now``: True, a pass now; a time, a
        pass then; None, nothing to do (an idle pass, counted without running)."""
        return True

    def poke(self) -> bool:
        """What the service reads changed (a NOTIFY); True: run a pass now."""
        return False

    def succeed(self, old: "Service") -> None:
        """A reload replaced ``old`` (the same service) with this one: carry over what it knew."""
        return None

    def quiet_until(self) -> datetime | None:
        """The daemon skips this service's scheduled passes (no connection, no record) until this
        server time, before which a pass cannot find anything to do; None: never skip. Passes
        called directly (``run-once``, tests) always run."""
        return None

    @abc.abstractmethod
    def run_once(self, ctx: PassContext) -> PassResult:
        """Do one pass. Must be safe to run concurrently with another instance of itself."""

    def observe(self, metrics: "Metrics", result: PassResult) -> None:
        """Record the service-specific metrics of a committed pass (on ``metrics[F]`` for the
        families ``F`` of :attr:`METRICS`; optional)."""
        return None
