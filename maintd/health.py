"""Table health (SPEC 8.2): what holds back vacuum on the jobs table's database, and the state of
maintd's tables. One read per database per ``health.interval`` (:class:`HealthReader`), whatever
the number of targets on it: the holders of the xmin horizon are the database's, the tables are
read for every schema at once.

A *holder* is anything that keeps VACUUM from removing rows deleted after its oldest transaction
id: a backend's transaction or snapshot, a prepared transaction, a replication slot, a standby's
``hot_standby_feedback``, and on PostgreSQL 15 ``vacuum_defer_cleanup_age`` (kind ``setting``:
that many ids behind the rest, aged by when the counter was there). Each is named (kind, pid,
user, application_name, client address, state, age) and, once it has been held longer than
``health.xmin_warn_after``, warned about in one log line (:class:`HolderWarnings`). Its query
text is read only with ``health.show_query``.

Ages in seconds: a backend's from its transaction's start, a prepared transaction's from its
PREPARE, an inactive slot's from ``inactive_since`` (PostgreSQL 17+: when it was last released) or
from when a read first saw it hold, whichever is earlier. A snapshot read while its
statement runs is aged from the statement's start, or from the earliest start a read saw it hold
since (a lower bound: READ COMMITTED takes a snapshot per statement, REPEATABLE READ keeps the
first; PostgreSQL does not show which). PostgreSQL keeps no time for
the rest (a standby's feedback, an active slot, a backend of another role without
``pg_read_all_stats``): their age counts from the first read that saw a transaction id assigned
after their xmin (before that they hold nothing back), a lower bound marked ``exact = false``.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Iterable, Sequence

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import Connection

from .logs import kv
from .queries import health as q
from .queries import psycopg_sql

log = logging.getLogger("maintd.health")

SHOWN_AFTER = 1.0  # seconds: younger holders (every worker's transaction) are not named
XID_SAMPLES = 10_000  # reads whose next transaction id is kept (a day at a read every 10 s)
BACKEND_KINDS = ("transaction", "snapshot")  # one backend's transaction: a snapshot until it writes
UNTIMED_KINDS = ("replication_slot", "standby_feedback")  # long-lived, often without a start time
SETTING = "setting"  # PostgreSQL 15's vacuum_defer_cleanup_age: ids behind the rest, no start of its own
SHOWN = 5  # holders listed per scope, oldest horizon first
READ_TIMEOUT_MS = 5000  # the statement timeout of the monitor's connection
FULL_EVERY = timedelta(minutes=1)  # the jobs tables' sizes
SIZES_EVERY = timedelta(minutes=10)  # maintd's own tables (rows and sizes)


@dataclass(frozen=True)
class Holder:
    """One holder of the xmin horizon. ``scope`` is ``data`` (holds back every table of the
    database, jobs too) or ``catalog`` (a logical slot's ``catalog_xmin``: system catalogs only)."""

    kind: str  # transaction, snapshot, prepared_transaction, replication_slot, standby_feedback, setting
    scope: str
    pid: int | None
    user: str | None
    application_name: str | None
    client_addr: str | None
    state: str | None
    xmin: str
    age_xids: int
    age_seconds: float
    exact: bool  # False: PostgreSQL keeps no start time; counted from the first read that saw it hold
    since: datetime | None = None
    name: str | None = None  # the slot's name, the prepared transaction's gid
    detail: str | None = None  # the backend type, the slot type
    query: str | None = None  # only with health.show_query

    @property
    def key(self) -> tuple:
        """Who it is, for the once-per-holder warning: a backend's transaction by its pid and its
        start, whatever it holds (a snapshot, then a transaction id too once it writes), or by its
        xmin when the start is hidden (another role's; a REPEATABLE READ snapshot's stays the
        oldest when it writes); a prepared transaction, a slot or a standby at one xmin (a slot
        by its name alone: its active_pid changes whenever its consumer reconnects); a setting
        by its name (its xmin follows the counter)."""
        if self.kind == SETTING:
            return (self.kind, self.scope, self.name)
        if self.kind in BACKEND_KINDS:
            return ("backend", self.scope, self.pid, self.since.isoformat() if self.since else self.xmin)
        return (self.kind, self.scope, None if self.kind == "replication_slot" else self.pid, self.name, self.xmin)

    @property
    def warned_as(self) -> tuple:
        """Who it is for the warning: its :attr:`key`, except a standby's feedback (its walsender)
        and a slot (its name), whose xmin moves on while a replica's overlapping queries keep it
        behind: one holder, however often its xmin (and so its key, which ages it) moves."""
        if self.kind == "standby_feedback":
            return (self.kind, self.scope, self.pid)
        if self.kind == "replication_slot":
            return (self.kind, self.scope, self.name)
        return self.key

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["since"] = self.since.isoformat() if self.since else None
        out["age_seconds"] = round(self.age_seconds, 1)
        if out["query"] is None:
            del out["query"]
        return out

    def describe(self) -> str:
        """A short human name: ``snapshot pid 4711 (psql, user alice, 10.0.0.5)``."""
        who = f"pid {self.pid}" if self.pid is not None else ""
        if self.name:
            who = f"{self.name!r}" + (f" {who}" if who else "")
        extra = ", ".join(x for x in (self.application_name, self.user and f"user {self.user}",
                                      self.client_addr, elsewhere(self.detail)) if x)
        return f"{self.kind.replace('_', ' ')} {who}".strip() + (f" ({extra})" if extra else "")


@dataclass(frozen=True)
class Horizon:
    age_seconds: float = 0.0
    age_xids: int = 0
    holders: tuple[Holder, ...] = ()  # data scope, older than SHOWN_AFTER, oldest xmin first
    catalog_holders: tuple[Holder, ...] = ()  # catalog scope, the same
    unaged: int = 0  # other roles' sessions holding ids back, their start hidden, not yet aged

    @property
    def holder(self) -> Holder | None:
        """The holder of the jobs table's horizon: the oldest xmin of the data scope."""
        return self.holders[0] if self.holders else None

    def as_dict(self) -> dict[str, Any]:
        holder = self.holder
        return {"age_seconds": round(self.age_seconds, 1), "age_xids": self.age_xids,
                "holder": holder.as_dict() if holder else None,
                "holders": [h.as_dict() for h in self.holders[:SHOWN]],
                "more_holders": max(0, len(self.holders) - SHOWN),
                "catalog_holders": [h.as_dict() for h in self.catalog_holders[:SHOWN]],
                "unaged": self.unaged}


@dataclass(frozen=True)
class TableHealth:
    table: str
    live: int
    dead: int
    bytes: int | None  # None: not read yet (see HealthReader._plan)
    last_vacuum: float | None  # Unix time; None: never
    writes: int = 0  # rows inserted, updated, deleted since the statistics' reset (not shown)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["writes"]
        return out


@dataclass(frozen=True)
class HealthReport:
    at: datetime  # the server's time of the read
    horizon: Horizon
    tables: dict[str, tuple[TableHealth, ...]] = field(default_factory=dict)  # per schema

    def table(self, schema: str, name: str = "jobs") -> TableHealth | None:
        return next((t for t in self.tables.get(schema, ()) if t.table == name), None)

    def status(self, schema: str) -> dict[str, Any]:
        """What /status and ``maintd status`` show for one schema."""
        return {"at": self.at.isoformat(), "horizon": self.horizon.as_dict(),
                "tables": [t.as_dict() for t in self.tables.get(schema, ())]}


class HealthReader:
    """Reads the horizon and the tables of a database. Keeps, between reads, when each holder
    without a start time was first seen holding (so one reader per database, kept)."""

    def __init__(self, show_query: bool = False):
        self.show_query = show_query
        self._holding_since: dict[tuple, datetime] = {}
        # (time, next transaction id) of each read, oldest first: when the counter passed an xmin
        self._xids: deque[tuple[datetime, int]] = deque(maxlen=XID_SAMPLES)
        self._snapshot_since: dict[tuple, datetime] = {}  # (pid, xact start, xmin): held at least since
        self._full_at: datetime | None = None
        self._sizes_at: datetime | None = None
        self._full_schemas: set[str] = set()
        self._last_tables: dict[str, tuple[TableHealth, ...]] = {}

    def read(self, conn: psycopg.Connection, schemas: Sequence[str]) -> HealthReport:
        """One read on ``conn`` (a psycopg connection: the monitor's own, in autocommit; or a
        caller's, inside its transaction). Its statements are prepared, so each connection plans
        them once (with ``plan_cache_mode = force_generic_plan``, as the monitor's connection
        has it): planning the views of the holders' read cost 1-4 ms a call, 5-30 times its
        execution. See :meth:`_plan` for what is read when."""
        schemas = sorted(schemas)
        cur = conn.cursor(row_factory=dict_row)
        clock = cur.execute(psycopg_sql(q.NOW), prepare=True).fetchone()
        now = clock["now"]
        rows = cur.execute(psycopg_sql(q.HOLDERS), {"show_query": self.show_query}, prepare=True).fetchall()
        full, sizes = self._plan(now, schemas)
        tables = cur.execute(psycopg_sql(q.TABLES), {"schemas": schemas, "all_tables": full, "sizes": sizes},
                             prepare=True).fetchall() if schemas else []
        return HealthReport(at=now, horizon=self.horizon(rows, now, int(clock["next_xid"])),
                            tables=self._tables(tables, full, schemas))

    def _plan(self, now: datetime, schemas: Sequence[str]) -> tuple[bool, str]:
        """(read every table, whose sizes): the jobs tables' rows every read, their sizes every
        FULL_EVERY; maintd's own tables (rows and sizes) every SIZES_EVERY, and everything for a
        schema not read yet. Measured on 40 schemas (bench/health.py, PostgreSQL 18, a busy
        machine): the jobs tables' rows 0.7 ms, with their sizes 10-14 ms, everything 35-65 ms."""
        new = not set(schemas) <= self._full_schemas
        if new or self._sizes_at is None or now - self._sizes_at >= SIZES_EVERY:
            self._full_at = self._sizes_at = now
            self._full_schemas = set(schemas)
            return True, "all"
        if self._full_at is None or now - self._full_at >= FULL_EVERY:
            self._full_at = now
            return False, "jobs"
        return False, "none"

    def _tables(self, rows: Iterable[Any], full: bool, schemas: Sequence[str]) -> dict[str, tuple[TableHealth, ...]]:
        """The tables of ``schemas``: from this read, or (sizes, maintd's own tables) from the
        last read that read them."""
        fresh = _tables(rows)
        out = {}
        for schema in schemas:
            last = {t.table: t for t in self._last_tables.get(schema, ())}
            known = {} if full else dict(last)  # a full read drops the tables gone
            for t in fresh.get(schema, ()):
                kept = last.get(t.table)
                known[t.table] = t if t.bytes is not None or kept is None else replace(t, bytes=kept.bytes)
            out[schema] = tuple(sorted(known.values(), key=lambda t: t.table))
        self._last_tables.update(out)
        return out

    def horizon(self, rows: Iterable[dict[str, Any]], now: datetime, next_xid: int | None = None) -> Horizon:
        """The holders of ``rows`` (:data:`maintd.queries.health.HOLDERS`) with their ages;
        ``next_xid``: the server's next transaction id as of ``now`` (a sample kept)."""
        rows = list(rows)
        if next_xid is not None and (not self._xids or next_xid >= self._xids[-1][1]):
            self._xids.append((now, next_xid))
        holders = [self._holder(r, now) for r in rows]
        self._holding_since = {k: v for k, v in self._holding_since.items()
                               if k in {h.key for h in holders}}
        present = {(r["pid"], r["since"], r["xmin"]) for r in rows}
        self._snapshot_since = {k: v for k, v in self._snapshot_since.items() if k in present}
        data = [h for h in holders if h.scope == "data"]

        def named(scope: str) -> tuple[Holder, ...]:
            # A slot, a standby's feedback or a setting is never a worker's short transaction: named as soon
            # as it holds anything back, its age unknown on a first read (`maintd status`'s only).
            shown = [h for h in holders if h.scope == scope and (
                h.age_seconds >= SHOWN_AFTER or (h.kind in UNTIMED_KINDS + (SETTING,) and h.age_xids > 0))]
            return tuple(sorted(shown, key=lambda h: (-h.age_xids, -h.age_seconds)))

        shown = named("data")
        unaged = sum(1 for h in data if h.kind in BACKEND_KINDS and h.since is None and h.age_xids > 0
                     and h not in shown)
        return Horizon(age_seconds=max((h.age_seconds for h in data), default=0.0),
                       age_xids=max((h.age_xids for h in data), default=0),
                       holders=shown, catalog_holders=named("catalog"), unaged=unaged)

    def _holder(self, r: dict[str, Any], now: datetime) -> Holder:
        since = r["since"]
        holder = Holder(kind=r["kind"], scope=r["scope"], pid=r["pid"], user=r["usename"],
                        application_name=r["application_name"] or None, client_addr=r["client_addr"],
                        state=r["state"], xmin=r["xmin"], age_xids=max(0, int(r["age_xids"] or 0)),
                        age_seconds=0.0, exact=since is not None, since=since, name=r["name"],
                        detail=r["detail"], query=r["query"] if self.show_query else None)
        if since is not None and holder.kind == "snapshot":
            return self._snapshot_age(holder, r.get("statement_start"), now)
        if since is not None and holder.kind not in UNTIMED_KINDS:
            return _with_age(holder, (now - since).total_seconds())
        if holder.age_xids == 0:  # no transaction id assigned after its xmin: holds nothing back yet
            return holder
        if holder.kind == SETTING:  # its xmin follows the counter: aged by when the counter was there
            return replace(_with_age(holder, (now - self._passed(holder.age_xids, now)).total_seconds()), exact=False)
        # A slot's inactive_since is when it was last released, not when its xmin began to hold
        # (a consumer that connects and leaves resets it): the earlier of the two.
        first = min(self._holding_since.setdefault(holder.key, now), self._passed(holder.age_xids, now))
        if since is not None and since <= first:
            return _with_age(holder, (now - since).total_seconds())
        return replace(_with_age(holder, (now - first).total_seconds()), exact=False)

    def _passed(self, age_xids: int, now: datetime) -> datetime:
        """The first sampled time by which the counter had passed an xmin ``age_xids`` behind
        the latest sample (its xmin was current before then: a standby's feedback that keeps
        moving but stays behind is aged by how far behind it stays); ``now`` if none had."""
        if not self._xids:
            return now
        xmin = self._xids[-1][1] - age_xids
        i = bisect_right(self._xids, xmin, key=lambda sample: sample[1])
        return self._xids[i][0] if i < len(self._xids) else now
    def _snapshot_age(self, holder: Holder, statement_start: datetime | None, now: datetime) -> Holder:
        """Between statements a snapshot is its transaction's (REPEATABLE READ, a cursor): aged
        from the transaction's start. Mid-statement it may be the statement's own (READ COMMITTED):
        aged from the earliest start seen for this snapshot, marked a lower bound when after the
        transaction's start."""
        assert holder.since is not None
        key = (holder.pid, holder.since, holder.xmin)
        start = min(self._snapshot_since.get(key, now), statement_start or holder.since)
        self._snapshot_since[key] = start
        return replace(_with_age(holder, (now - start).total_seconds()), exact=start <= holder.since)


def elsewhere(detail: str | None) -> str | None:
    """A holder's ``detail`` when it names another database (``in database NAME``, written by
    :data:`maintd.queries.health.HOLDERS`), else None."""
    return detail if (detail or "").startswith("in database ") else None


def _with_age(holder: Holder, seconds: float) -> Holder:
    return replace(holder, age_seconds=max(0.0, seconds))


def _tables(rows: Iterable[Any]) -> dict[str, tuple[TableHealth, ...]]:
    out: dict[str, list[TableHealth]] = {}
    for r in rows:
        last = r["last_vacuum"]
        finite = last is not None and last not in (float("inf"), float("-inf")) and last == last
        out.setdefault(r["schema"], []).append(TableHealth(
            table=r["table"], live=int(r["live"] or 0), dead=int(r["dead"] or 0), writes=int(r["writes"] or 0),
            bytes=None if r["bytes"] is None else int(r["bytes"]),
            last_vacuum=float(last) if finite else None))
    return {s: tuple(sorted(ts, key=lambda t: t.table)) for s, ts in out.items()}


def read_once(conn: Connection, schema: str, *, show_query: bool = False) -> HealthReport:
    """One read for one schema in ``conn``'s transaction (``maintd status``); holders without a
    start time show age 0 (slots and standbys' feedback are named still, "for an unknown time")."""
    return HealthReader(show_query).read(conn.connection.dbapi_connection, [schema])


class HolderWarnings:
    """One warning line per holder once it is older than ``warn_after``; one info line when a
    holder warned about is gone, or younger than half ``warn_after`` (a standby or a slot that
    caught up: the next time it falls behind is warned about again)."""

    def __init__(self) -> None:
        self._warned: dict[tuple, Holder] = {}

    def check(self, horizon: Horizon, warn_after: timedelta, targets: Sequence[str]) -> list[Holder]:
        """Log for the holders of the jobs table's horizon (data scope); returns those newly
        warned about."""
        limit = warn_after.total_seconds()
        present = {h.warned_as: h for h in horizon.holders}
        self._rekey(present)
        new = [h for k, h in present.items() if h.age_seconds >= limit and k not in self._warned]
        for holder in sorted(new, key=lambda h: -h.age_seconds):
            self._warned[holder.warned_as] = holder
            log.warning("vacuum is held back: dead jobs cannot be removed while this holds the xmin "
                        "horizon", extra=kv(holder=holder.describe(), **_fields(holder),
                                            targets=",".join(targets)))
        for key in [k for k in self._warned if k not in present or present[k].age_seconds < limit / 2]:
            gone = self._warned.pop(key)  # or caught up: a standby or slot that stays, younger now
            log.info("xmin horizon holder gone" if key not in present else "xmin horizon holder caught up", extra=kv(holder=gone.describe(), kind=gone.kind,
                                                          pid=gone.pid, targets=",".join(targets)))
        return new

    def _rekey(self, present: dict[tuple, Holder]) -> None:
        """A backend warned about while its start was hidden (keyed by its xmin) whose start is
        now shown (keyed by it; pg_read_all_stats granted meanwhile), or the other way round:
        the same holder, not a new one and a gone one."""
        for key in [k for k in self._warned if k not in present]:
            same = next((k for k, h in present.items() if k not in self._warned
                         and _same_backend(self._warned[key], h)), None)
            if same is not None:
                del self._warned[key]
                self._warned[same] = present[same]

    def forget(self) -> None:
        self._warned.clear()


def _same_backend(a: Holder, b: Holder) -> bool:
    """Two reads of one backend's transaction, its start seen by one of them only: the same pid
    holding the same xmin (a transaction's oldest id, which its key uses when its start is hidden)."""
    return (a.kind in BACKEND_KINDS and b.kind in BACKEND_KINDS and (a.scope, a.pid, a.xmin) == (b.scope, b.pid, b.xmin)
            and (a.since is None) != (b.since is None))


def _fields(h: Holder) -> dict[str, Any]:
    out = {"kind": h.kind, "pid": h.pid, "user": h.user, "application_name": h.application_name,
           "client_addr": h.client_addr, "state": h.state, "age_seconds": round(h.age_seconds),
           "age_exact": h.exact, "age_xids": h.age_xids, "name": h.name}
    return {k: v for k, v in out.items() if v is not None}


def apply_metrics(metrics: Any, report: HealthReport, schema: str,
                  before: frozenset[str] = frozenset()) -> frozenset[str]:
    """Set one target's health gauges from a read; returns the tables set. The tables of ``before``
    (what the last call returned; a target's first read after its gauges were cleared has none)
    gone from the schema lose their series. (Scanning the family for this target's series instead
    made a read of many targets quadratic.)"""
    metrics.health_read.set(report.at.timestamp())
    metrics.xmin_horizon_age_seconds.set(report.horizon.age_seconds)
    metrics.xmin_horizon_age_xids.set(report.horizon.age_xids)
    tables = report.tables.get(schema, ())
    names = frozenset(t.table for t in tables)
    for gauge in (metrics.table_dead_tuples, metrics.table_live_tuples, metrics.table_bytes,
                  metrics.table_last_vacuum):
        for table in before - names:
            gauge.remove(table)
    for t in tables:
        metrics.table_dead_tuples.labels(t.table).set(t.dead)
        metrics.table_live_tuples.labels(t.table).set(t.live)
        if t.bytes is not None:
            metrics.table_bytes.labels(t.table).set(t.bytes)
        metrics.table_last_vacuum.labels(t.table).set(t.last_vacuum or 0)
    return names


def clear_metrics(metrics: Any) -> None:
    for gauge in metrics.health_series():
        gauge.clear()
