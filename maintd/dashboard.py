"""The dashboard (SPEC 7.6): ``GET /`` per target, ``/jobs`` (paged) and ``/jobs/{id}``.

Read-only, server-rendered HTML (Jinja2, autoescape on), no JavaScript. Every query reads an
index and is bounded, so a page stays fast on a table of millions of jobs:

* counts read at most ``cap`` index entries per cell and say "at least" beyond; totals beyond
  that are the planner's estimates;
* queues with available jobs come from a loose index scan (one probe per queue and priority);
* lists are keyset-paged in the order of the state's index; a queue filter that no index serves
  searches a bounded window of the state's index and offers to continue past it.

Pages read through the daemon's readers (:mod:`maintd.readers`): a small pool of read-only
sessions per database, apart from maintenance, one REPEATABLE READ snapshot per page.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Sequence
from urllib.parse import urlencode

from jinja2 import Environment, PackageLoader, StrictUndefined, pass_context
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DataError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolBusy

from . import charts, history, periodic_table
from .config import PeriodicJob, Settings
from .db import UnloadableJson, advisory_key, describe_db_error, load_json, quote_ident
from .queries import catalog, sql
from .http import HttpError, Recent, Request, Response
from .readers import Readers
from .layout_status import layout_summary
from .queries import FINAL_STATES, JOB_STATES
from .pass_summary import describe, work_seconds
from .queries import daemons as q_daemons
from .queries import leader as q_leader
from .queries import service_runs as q_runs
from .queries.dashboard import (AVAILABLE_COUNTS, DISCARDED, ESTIMATES, FINAL_COUNTS, FINAL_QUEUES, HEADS, INDEX,
                                JOB, LIST, LIST_AVAILABLE, LIST_COLUMNS, WINDOW,
                                WINDOW_END)

CAP = 10_000            # a count (per queue and state, or per window) past this many index entries says "at least"
PAGE_SIZE = 50
SCAN_WINDOW = 100_000   # jobs of a state searched per page for a queue no index leads with
WINDOWED = ("scheduled", "retryable", "running")  # states counted in a window of their index
MAX_HEADS = 1_000       # (queue, priority) groups of available jobs probed on the overview
DISCARDED_SHOWN = 10
PERIODIC_SHOWN = 200  # rows of periodic_jobs listed on the overview (besides the configured entries)
REFRESH_SECONDS = 10
TEXT_LIMIT = 65_536     # characters of args, metadata or one error shown on a job's page

# -- targets ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One schema the page shows: its name, schema, a read-only engine and its periodic entries."""

    name: str
    schema: str
    engine: Engine
    periodic: Sequence[PeriodicJob] = ()


def target_specs(settings: Settings) -> list[tuple[str, str, str, Sequence[PeriodicJob]]]:
    """(name, schema, dsn, periodic entries) per target: each ``[[targets]]`` entry, or the
    configured schema alone."""
    return [(t.target_name, t.schema, t.database_url.get_secret_value(), t.periodic_entries)
            for t in settings.target_settings()]


def begin_snapshot(conn: Connection) -> datetime:
    """One read-only snapshot for the whole page; returns the database's ``now()``."""
    conn.execute(text(catalog.READ_ONLY_SNAPSHOT))
    return conn.execute(text(catalog.TRANSACTION_TIME)).scalar_one()


# -- counts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Count:
    """A job count: ``exact``, ``atleast`` (a bounded count hit its cap), ``estimate`` (the
    statistics) or ``unknown`` (a full window held none of this queue)."""

    value: int
    kind: str = "exact"




def estimates(conn: Connection, schema: str) -> dict[str, int]:
    """The statistics' row count per state (empty before the first ANALYZE)."""
    rows = conn.execute(text(ESTIMATES), {"schema": schema, "table": f"{quote_ident(schema)}.jobs"})
    return {r.state: r.n for r in rows}


def windowed_counts(conn: Connection, schema: str, cap: int
                    ) -> tuple[dict[str, dict[str, int]], dict[str, bool]]:
    """(state -> queue -> jobs among the first ``cap`` entries of the state's index, state ->
    whether that window was full) for scheduled, retryable and running: their indexes do not
    hold the queue, so a queue's count is what the window shows of it."""
    windows = sorted({INDEX[s] for s in WINDOWED})
    out: dict[str, dict[str, int]] = {s: {} for s in WINDOWED}
    seen: dict[tuple[str, str], int] = {w: 0 for w in windows}
    for where, order in windows:
        for row in conn.execute(sql(WINDOW.replace("{where}", where).replace("{order}", order), schema),
                                {"cap": cap + 1}):  # one more: a window of exactly cap is not full
            out[row.state][row.queue] = min(row.n, cap)
            seen[(where, order)] += row.n
    return out, {s: seen[INDEX[s]] > cap for s in out}


def final_counts(conn: Connection, schema: str, cap: int
                 ) -> tuple[dict[str, dict[str, int]], dict[str, int], set[str]]:
    """(state -> queue -> final jobs, each count reading one entry past the per-queue bound
    of jobs_finalized_queue_idx; state -> that bound; the states with more than ``MAX_HEADS``
    queues, whose queues past the first ``MAX_HEADS`` are not counted) for completed,
    cancelled and discarded."""
    out, bounds, cut = {}, {}, set()
    for state in FINAL_STATES:
        queues = [r.queue for r in conn.execute(sql(FINAL_QUEUES, schema),
                                                {"state": state, "max_queues": MAX_HEADS + 1})]
        if len(queues) > MAX_HEADS:
            queues, _ = queues[:MAX_HEADS], cut.add(state)
        bounds[state] = per_queue_cap(cap, len(queues))
        out[state] = {r.queue: r.n for r in conn.execute(
            sql(FINAL_COUNTS, schema), {"state": state, "queues": queues, "cap": bounds[state] + 1})} if queues else {}
    return out, bounds, cut


def available_counts(conn: Connection, schema: str, cap: int
                     ) -> tuple[dict[str, int], dict[str, datetime | None], bool, int]:
    """(bounded count per queue, since when its oldest head waits (None: no time for it), whether
    queues were cut off, the per-queue bound)."""
    heads = list(conn.execute(sql(HEADS, schema), {"max_heads": MAX_HEADS}))
    oldest = {r.queue: r.oldest for r in heads}
    cut = any(r.more for r in heads)
    limit = per_queue_cap(cap, len(oldest))
    counts = {r.queue: r.n for r in conn.execute(sql(AVAILABLE_COUNTS, schema),
                                                  {"queues": sorted(oldest), "cap": limit + 1})}
    return counts, oldest, cut, limit


def per_queue_cap(cap: int, queues: int) -> int:
    """Entries one queue's available count may read: ``cap``, shared out when queues are many,
    so the whole column reads at most 10 x ``cap`` entries."""
    return max(1, min(cap, (10 * cap) // max(1, queues)))


def queue_table(conn: Connection, schema: str, now: datetime, cap: int = CAP) -> dict[str, Any]:
    """Jobs by queue and state (bounded counts), per-state totals, the oldest available age.

    available and the final states are counted per queue through an index that leads with the
    queue, ``cap`` entries each and one more (shared out when queues are many): a cell is exact,
    or "at least" at its bound. scheduled, retryable and running are counted in a window of the
    ``cap`` first entries of their index: when it is full, a queue's cell is "at least" what the
    window holds of it, or unknown (``?``) when it holds none of it."""
    avail, oldest, cut, limit = available_counts(conn, schema, cap)
    windowed, full = windowed_counts(conn, schema, cap)
    finals, bounds, finals_cut = final_counts(conn, schema, cap)
    counted = {"available": avail, **windowed, **finals}
    bound = {"available": limit, **bounds}
    queues = sorted(set().union(*(set(w) for w in counted.values())))
    rows = []
    for q in queues:
        counts = {}
        for s in JOB_STATES:
            n = counted[s].get(q, 0)  # (bounded counts read one entry past their bound)
            capped = (n > bound[s]) if s in bound else full[s]
            n = min(n, bound[s]) if s in bound else n
            capped = capped or (s in finals_cut and q not in counted[s])  # a queue past MAX_HEADS: "?"
            counts[s] = Count(n, "exact" if not capped else "atleast" if n else "unknown")
        age = (now - oldest[q]).total_seconds() if oldest.get(q) is not None else None
        rows.append({"queue": q, "counts": counts, "oldest_age": None if age is None else max(0.0, age)})
    capped_state = {s: (any(n > bound[s] for n in counted[s].values()) if s in bound else full[s])
                    for s in JOB_STATES}
    capped_state["available"] = capped_state["available"] or cut
    for s in finals_cut:  # queues past MAX_HEADS not counted: the sum is a lower bound
        capped_state[s] = True
    guess = estimates(conn, schema) if any(capped_state.values()) else {}
    totals = {}
    for s in JOB_STATES:
        n = sum(min(n, bound.get(s, n)) for n in counted[s].values())
        if not capped_state[s]:
            totals[s] = Count(n)
        else:  # past the bound: the statistics, or the lower bound if they know less
            totals[s] = Count(guess[s], "estimate") if guess.get(s, 0) > n else Count(n, "atleast")
    return {"rows": rows, "totals": totals, "cut": cut or bool(finals_cut),
            "oldest_age": max((r["oldest_age"] for r in rows if r["oldest_age"] is not None),
                              default=None),
            "oldest_atleast": cut}  # queues of available jobs past the bound: it may wait there


# -- the rest of the overview -------------------------------------------------------------------



def leadership(conn: Connection, schema: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(the leader whose session holds the lock, or None; the replicas registered in the last hour,
    each ``alive`` while its lock session is connected: a killed one reads as gone at once)."""
    classid, objid = advisory_key(schema)
    row = conn.execute(sql(q_leader.CURRENT, schema), {"classid": classid, "objid": objid}).mappings().first()
    leader = dict(row) if row and row["instance_id"] and row["released_at"] is None \
        and row["holds_lock"] else None
    daemons = [dict(r) for r in conn.execute(sql(q_daemons.REGISTERED, schema)).mappings()]
    for d in daemons:
        d["is_leader"] = bool(d["alive"] and leader and leader["instance_id"] == d["instance_id"])
    return leader, daemons


def service_runs(conn: Connection, schema: str) -> list[dict[str, Any]]:
    runs = []
    for r in conn.execute(sql(q_runs.ALL, schema)).mappings():
        run = dict(r)
        # The work, not the pauses between batches. None when a time is one no datetime holds
        # (a reader loads it as text): shown as is
        run["duration"] = work_seconds(r["started_at"], r["finished_at"], r["result"]) \
            if isinstance(r["started_at"], datetime) and isinstance(r["finished_at"], datetime) else None
        run["summary"] = describe(r["service"], r["result"])
        runs.append(run)
    return runs


def periodic_rows(conn: Connection, schema: str, entries: Sequence[PeriodicJob],
                  now: datetime) -> list[dict[str, Any]]:
    """Each entry (configured, then the first rows of periodic_jobs by id, marked by origin) with
    its last slot taken (the database) and its next slot (the schedule)."""
    return periodic_listing(conn, schema, entries, now)[0]


def periodic_listing(conn: Connection, schema: str, entries: Sequence[PeriodicJob], now: datetime,
                     shown: int = PERIODIC_SHOWN) -> tuple[list[dict[str, Any]], bool]:
    """:func:`periodic_table.listing` of the configured entries and the first ``shown`` rows, a
    row whose id is a configured entry's folded into that entry (its error, why the daemon
    refuses it, shown there); whether rows were left out."""
    listed, more = periodic_table.listing(conn, schema, entries, now, shown)
    configured = {e.id for e in entries}
    shadowed = {e["id"]: e["error"] for e in listed if e["origin"] == "table" and e["id"] in configured}
    out = [e for e in listed if e["origin"] != "table" or e["id"] not in configured]
    for e in out:
        if e["origin"] != "table":
            e["error"] = shadowed.get(e["id"])
    return out, more


# The charts' ranges (SPEC 8.2): (name, how far back, one point per bucket).
CHART_RANGES = (("last hour", timedelta(hours=1), timedelta(minutes=1)),
                ("last day", timedelta(days=1), timedelta(minutes=10)))


def health_charts(conn: Connection, schema: str, now: datetime) -> dict[str, Any]:
    """The charts of each range from the target's history (``health_history``), and its latest
    sample; ``{"error": ...}`` when it cannot be read (the snapshot stays usable)."""
    out: dict[str, Any] = {"ranges": [], "last": None}
    try:
        with conn.begin_nested():
            for name, back, bucket in CHART_RANGES:
                samples = history.series(conn, schema, now - back, bucket)
                out["ranges"].append({"name": name, "start": (now - back).timestamp(), "end": now.timestamp(),
                                      "charts": charts.target_charts(samples)})
                out["last"] = out["last"] or (samples[-1] if samples else None)
    except SQLAlchemyError as exc:
        return {"error": describe_db_error(exc), "ranges": [], "last": None}
    return out


def target_overview(target: Target, *, cap: int = CAP,
                    health: Callable[[str], dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """Everything ``GET /`` shows for one target, read in one snapshot. ``health``: the table
    health this replica read last for a target (None where it does not lead it)."""
    schema = target.schema
    with target.engine.connect() as conn:
        now = begin_snapshot(conn)
        leader, daemons = leadership(conn, schema)
        data = {
            "name": target.name, "schema": schema, "now": now, "leader": leader, "daemons": daemons,
            "writable": conn.execute(text(catalog.SERVER_WRITABLE)).scalar(),  # else maintenance is paused
            "services": service_runs(conn, schema), "queues": queue_table(conn, schema, now, cap),
            **dict(zip(("periodic", "periodic_more"), periodic_listing(conn, schema, target.periodic, now))),
            "discarded": [dict(r) for r in conn.execute(sql(DISCARDED, schema),
                                                        {"n": DISCARDED_SHOWN}).mappings()],
            "health": health(target.name) if health else None,
            "history": health_charts(conn, schema, now),
            "layout": layout_summary(conn, schema),
        }
        conn.rollback()
    return data


def overview(targets: Sequence[Target], *, cap: int = CAP,
             health: Callable[[str], dict[str, Any] | None] | None = None) -> list[dict[str, Any]]:
    """Per target its overview, or ``{"name", "schema", "error"}`` when it cannot be read."""
    out = []
    for t in targets:
        try:
            out.append(target_overview(t, cap=cap, health=health))
        except SQLAlchemyError as exc:
            out.append({"name": t.name, "schema": t.schema, "error": describe_db_error(exc)})
    return out


# -- /jobs --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Order:
    """A keyset order: (SQL expression, SQL type) columns, all ascending or all descending.
    ``nulls``: the first column may be NULL (ascending only; NULLs come last, as in the index)."""

    columns: tuple[tuple[str, str], ...]
    descending: bool
    nulls: bool = False

    def sql(self) -> str:
        return ", ".join(f"{c} {'DESC' if self.descending else 'ASC'}" for c, _ in self.columns)

    def after(self, keys: dict[str, Any]) -> str:
        """The condition for the rows after the cursor ``keys`` (parsed)."""
        left = ", ".join(c for c, _ in self.columns)
        right = ", ".join(f"CAST(:k{i} AS {t})" for i, (_, t) in enumerate(self.columns))
        past = f"({left}) {'<' if self.descending else '>'} ({right})"
        if not self.nulls:
            return f"AND {past}"
        first, rest = self.columns[0][0], self.columns[1:]
        if keys["k0"] is None:  # among the NULLs, by the other columns
            tail = ", ".join(c for c, _ in rest)
            keys_tail = ", ".join(f"CAST(:k{i + 1} AS {t})" for i, (_, t) in enumerate(rest))
            return f"AND {first} IS NULL AND ({tail}) > ({keys_tail})"
        return f"AND ({past} OR {first} IS NULL)"

    def cursor(self, row: Any) -> str:
        return ",".join("null" if v is None else v.isoformat() if isinstance(v, datetime) else str(v)
                        for v in (row._mapping[f"k{i}"] for i in range(len(self.columns))))

    def parse(self, cursor: str) -> dict[str, Any]:
        parts = cursor.split(",")
        if len(parts) != len(self.columns):
            raise HttpError(400, f"invalid 'after' cursor {cursor!r}: use the page's own links")
        try:
            return {f"k{i}": (None if self.nulls and i == 0 and v == "null" else
                              _time(v) if t == "timestamptz" else _in_range(int(v), t))
                    for i, ((_, t), v) in enumerate(zip(self.columns, parts))}
        except ValueError:
            raise HttpError(400, f"invalid 'after' cursor {cursor!r}: use the page's own links") from None


INT_BITS = {"smallint": 16, "bigint": 64}
# A time no Python datetime holds, as PostgreSQL writes it (a reader session loads it so): given
# back as text, for the server to read (CAST(:k AS timestamptz)).
ODD_TIME = re.compile(r"-?infinity|\d{4,}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d{1,6})?[+-]\d\d(:\d\d){0,2}( BC)?")


def _time(v: str) -> datetime | str:
    """A cursor's time: ISO 8601, or one of PostgreSQL's own that no datetime holds, else ValueError."""
    if ODD_TIME.fullmatch(v):
        return v
    return datetime.fromisoformat(v)


def _in_range(n: int, sql_type: str) -> int:
    """``n`` if the column's type holds it (else the database's error made a client's bad cursor
    a 503), else ValueError."""
    half = 1 << (INT_BITS[sql_type] - 1)
    if not -half <= n < half:
        raise ValueError(f"{n} is out of range for {sql_type}")
    return n


_FINAL_ORDER = Order((("finalized_at", "timestamptz"), ("id", "bigint")), True)
ORDERS: dict[str | None, Order] = {
    None: Order((("id", "bigint"),), True),
    "available": Order((("priority", "smallint"), ("scheduled_at", "timestamptz"), ("id", "bigint")), False),
    "scheduled": Order((("scheduled_at", "timestamptz"), ("id", "bigint")), False),
    "retryable": Order((("scheduled_at", "timestamptz"), ("id", "bigint")), False),
    # the index's order (jobs_running_idx): the longest without a sign of life first. By id, the
    # page walked jobs_pkey past every older finished job (95 ms a page per million of them).
    "running": Order((("coalesce(heartbeat_at, attempted_at)", "timestamptz"), ("id", "bigint")), False, nulls=True),
    **{s: _FINAL_ORDER for s in FINAL_STATES},
}


@dataclass(frozen=True)
class JobFilter:
    state: str | None = None
    queue: str | None = None
    after: str | None = None


@dataclass
class JobPage:
    jobs: list[dict[str, Any]]
    next_after: str | None = None
    searched: int | None = None  # set when the page stopped at the search window, not at a match
    now: datetime | None = None
    filters: JobFilter = field(default_factory=JobFilter)


def _list_sql(f: JobFilter, order: Order, cursor: dict[str, Any] | None) -> tuple[str, str, bool]:
    """(the SQL of one page after ``cursor`` (``f.after`` parsed), its inner WHERE, whether it
    searches a bounded window of the index: when it filters on what the index does not lead with)."""
    keys = ", ".join(f"{c} AS k{i}" for i, (c, _) in enumerate(order.columns))
    after = order.after(cursor) if cursor else ""
    if f.state == "available" and f.queue is None:
        outer_order = ", ".join(f"k{i}" for i in range(len(order.columns)))
        heads_order = ", ".join(f"h.k{i}" for i in range(len(order.columns)))
        return (LIST_AVAILABLE.replace("{outer_order}", outer_order).replace("{heads_order}", heads_order)
                .replace("{columns}", LIST_COLUMNS)
                .replace("{keys}", keys).replace("{after}", after).replace("{order}", order.sql()),
                "", False)
    where = INDEX[f.state][0] if f.state else "TRUE"
    outer = []
    if f.state in ("scheduled", "retryable"):
        outer.append(f"state = '{f.state}'")
    if f.queue is not None:
        if f.state == "available":
            where += " AND queue = :queue"
        else:
            outer.append("queue = :queue")
    query = (LIST.replace("{columns}", LIST_COLUMNS).replace("{keys}", keys).replace("{where}", where)
             .replace("{after}", after).replace("{order}", order.sql())
             .replace("{outer}", " AND ".join(outer) or "TRUE"))
    return query, where, bool(outer)


def list_jobs(conn: Connection, schema: str, f: JobFilter, *, page_size: int = PAGE_SIZE,
              scan_window: int = SCAN_WINDOW) -> JobPage:
    """One page of jobs in the order of the state's index, keyset-paged by ``f.after``."""
    order = ORDERS[f.state]
    cursor = order.parse(f.after) if f.after else None
    params: dict[str, Any] = {"queue": f.queue, "limit": page_size + 1, **(cursor or {})}
    query, where, windowed = _list_sql(f, order, cursor)
    params["scan"] = scan_window if windowed else page_size + 1
    rows = list(conn.execute(sql(query, schema), params))
    page = JobPage(jobs=[dict(r._mapping) for r in rows[:page_size]], filters=f)
    if len(rows) > page_size:
        page.next_after = order.cursor(rows[page_size - 1])
    elif windowed:
        keys = ", ".join(f"{c} AS k{i}" for i, (c, _) in enumerate(order.columns))
        end = conn.execute(sql(WINDOW_END.replace("{keys}", keys).replace("{where}", where)
                               .replace("{after}", order.after(cursor) if cursor else "")
                               .replace("{order}", order.sql()), schema), params).first()
        if end is not None:
            page.next_after, page.searched = order.cursor(end), scan_window
    return page




def _clip(s: Any, length: int | None = None) -> Any:
    """``s`` cut at TEXT_LIMIT characters, saying how many more it has (of ``length`` in all:
    the statement ships at most TEXT_LIMIT of a long text)."""
    length = len(s) if length is None and isinstance(s, str) else length
    return s[:TEXT_LIMIT] + f"\n... ({length - TEXT_LIMIT} more characters)" \
        if isinstance(s, str) and length is not None and length > TEXT_LIMIT else s


def job_detail(conn: Connection, schema: str, job_id: int) -> dict[str, Any] | None:
    row = conn.execute(sql(JOB, schema), {"id": job_id, "limit": TEXT_LIMIT}).mappings().first()
    if row is None:
        return None
    job = {k: _clip(v) for k, v in row.items() if not k.endswith("_chars")}
    for key in ("args", "metadata", "unique_key", "attempted_by"):
        job[key] = _clip(row[key], row[f"{key}_chars"])
    job["errors"] = [_error(load_json(text)) if chars <= TEXT_LIMIT else _clipped_error(load_json(text), chars)
                     for text, chars in zip(row["errors"], row["error_chars"])]
    return job


def _clipped_error(e: Any, chars: int) -> dict[str, Any]:
    """An entry of errors of over TEXT_LIMIT characters, as the statement ships it (its at,
    attempt and the start of its error or text)."""
    e = e if isinstance(e, dict) else {"error": str(e)}
    attempt, shown = e.get("attempt"), str(e.get("error"))[:TEXT_LIMIT]
    return {"at": e.get("at"), "attempt": int(attempt) if _digits(str(attempt), 9) else attempt, "extra": {},
            "error": shown + f"\n... ({chars - len(shown):,} more characters of this entry)"}


def _error(e: Any) -> dict[str, Any]:
    """One entry of a job's errors as the page shows it, whatever the worker wrote there."""
    if isinstance(e, dict):
        return {"at": e.get("at"), "attempt": e.get("attempt"), "error": _clip(str(e.get("error"))),
                "extra": {k: v for k, v in e.items() if k not in ("at", "attempt", "error")}}
    shown = f"{e} ({e.reason})" if isinstance(e, UnloadableJson) else json.dumps(e)
    return {"at": None, "attempt": None, "extra": {}, "error": _clip(shown)}


# -- rendering ----------------------------------------------------------------------------------


def _fmt_seconds(s: float) -> str:
    s = abs(s)
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


@pass_context
def _ago(ctx: Any, ts: datetime | str | None) -> str:
    if ts is None:
        return "never"
    if isinstance(ts, str):  # 'infinity', BC, past year 9999: as PostgreSQL writes it
        return ts
    delta = (ctx["now"] - ts).total_seconds()
    return f"in {_fmt_seconds(delta)}" if delta < 0 else f"{_fmt_seconds(delta)} ago"


@pass_context
def _unix_ago(ctx: Any, ts: float | None) -> str:
    return _ago(ctx, None if ts is None else datetime.fromtimestamp(ts, timezone.utc))


def _iso(ts: datetime | str | None) -> str:
    if isinstance(ts, str):
        return ts
    return "" if ts is None else ts.isoformat(sep=" ", timespec="seconds")


def _count(c: Count) -> str:
    """``1,234`` exact, ``≥ 10,000`` at least, ``≈ 200,000`` estimated, ``?`` not counted."""
    if c.kind == "atleast":
        return f"≥ {c.value:,}"
    if c.kind == "unknown":
        return "?"
    return f"≈ {c.value:,}" if c.kind == "estimate" else f"{c.value:,}"


def make_env() -> Environment:
    env = Environment(loader=PackageLoader("maintd", "templates"), autoescape=True,
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(ago=_ago, iso=_iso, seconds=lambda s: "" if s is None else _fmt_seconds(s),
                       count=_count, num=lambda n: f"{n:,}", bytes=charts.size, unixago=_unix_ago)
    env.globals.update(states=JOB_STATES, final_states=FINAL_STATES)
    return env


class Links:
    """URLs of the dashboard's pages; carry the token when the request brought it by query."""

    def __init__(self, req: Request, target: str | None):
        self.token = (req.query.get("token") or [None])[0]
        refresh = (req.query.get("refresh") or [None])[0]  # kept from page to page once given,
        self.refresh = refresh if refresh is not None and _refresh_ok(refresh) else None  # if valid
        self.target = target

    def __call__(self, path: str, **params: Any) -> str:
        q = {k: v for k, v in params.items() if v is not None}
        if self.target is not None and path != "/":  # the overview shows every target
            q.setdefault("target", self.target)
        if self.token:
            q["token"] = self.token
        if self.refresh is not None:
            q.setdefault("refresh", self.refresh)
        return path + ("?" + urlencode(q) if q else "")


# -- the pages ----------------------------------------------------------------------------------


def _digits(raw: str, most: int) -> bool:
    """ASCII digits only, at most ``most`` of them: str.isdigit() also takes '²' and '١٢', which
    int() refuses or reads as other digits, and int() refuses over 4,300 digits."""
    return raw.isascii() and raw.isdigit() and len(raw) <= most


def refresh_seconds(req: Request, default: int) -> int:
    """``?refresh=N`` on any page: 0 turns refreshing off, 2 to 3600 sets it (the overview
    refreshes every 10 s by default, the job pages not at all)."""
    raw = req.arg("refresh")
    if raw is None:
        return default
    if not _refresh_ok(raw):
        raise HttpError(400, f"refresh must be 0 (off) or 2 to 3600 seconds, not {raw!r}")
    return int(raw)


def _refresh_ok(raw: str) -> bool:
    return _digits(raw, 4) and (raw == "0" or 2 <= int(raw) <= 3600)


class Dashboard:
    """The pages on the HTTP listener. ``settings`` is read per request (reloads apply)."""

    def __init__(self, settings: Callable[[], Settings], *, readers: Readers | None = None,
                 page_size: int = PAGE_SIZE, scan_window: int = SCAN_WINDOW, cap: int = CAP,
                 refresh: int = REFRESH_SECONDS, health: Callable[[str], dict[str, Any] | None] | None = None,
                 max_age: float | None = None):
        """``readers``: the daemon's reader pools (else pools of its own); ``health``: a target's
        table health as the daemon read it last (None: not read here); ``max_age``: the overview's
        figures are read at most once per ``max_age`` seconds however many ask (None: each time)."""
        self.health = health
        self._overview = None if max_age is None else Recent(self._read_overview, max_age)
        self.settings, self.page_size, self.scan_window = settings, page_size, scan_window
        self.cap, self.refresh = cap, refresh
        self.env = make_env()
        self.readers = readers or Readers(lambda: settings().instance_id)

    def pages(self) -> dict[str, Callable[[Request], Response]]:
        return {"/": self._guard(self.index), "/jobs": self._guard(self.jobs),
                "/jobs/{id}": self._guard(self.job)}

    def targets(self) -> list[Target]:
        settings = self.settings()
        out = []
        for name, schema, dsn, periodic in target_specs(settings):
            out.append(Target(name, schema, self.readers.engine(dsn), periodic))
        return out

    def _target(self, req: Request) -> tuple[Target, Links]:
        targets = self.targets()
        name = req.arg("target")
        if name is None:
            return targets[0], Links(req, None if len(targets) == 1 else targets[0].name)
        for t in targets:
            if t.name == name:
                return t, Links(req, name)
        raise HttpError(404, f"unknown target {name!r} (known: {', '.join(t.name for t in targets)})")

    def render(self, template: str, status: int = 200, **ctx: Any) -> Response:
        body = self.env.get_template(template).render(instance=self.settings().instance_id, **ctx)
        return status, "text/html; charset=utf-8", body.encode(), {
            "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
                                       "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"}

    def _guard(self, page: Callable[[Request], Response]) -> Callable[[Request], Response]:
        def run(req: Request) -> Response:
            links = Links(req, None)
            try:
                return page(req)
            except HttpError as exc:
                return self.render("error.html", exc.status, message=exc.message, link=links, now=None)
            except PoolBusy:  # every reader session is in use (many pages of several targets)
                status, ctype, body, headers = self.render(
                    "error.html", 503, link=links, now=None,
                    message="busy: every reader connection is in use, retry in a second")
                return status, ctype, body, {**headers, "Retry-After": "1"}
            except SQLAlchemyError as exc:
                return self.render("error.html", 503, link=links, now=None,
                                   message=f"database error: {describe_db_error(exc)}")
        return run

    def index(self, req: Request) -> Response:
        req.only({"refresh"})
        refresh = refresh_seconds(req, self.refresh)
        targets = self.targets()
        data = self._overview() if self._overview is not None else self._read_overview()
        now = next((d["now"] for d in data if "now" in d), None)
        multi = len(targets) > 1
        return self.render("index.html", 503 if any("error" in d for d in data) else 200,
                           targets=data, now=now, refresh=refresh, cap=self.cap, periodic_shown=PERIODIC_SHOWN,
                           warn_after=self.settings().health.xmin_warn_after.total_seconds(),
                           link=Links(req, None), links={d["name"]: Links(req, d["name"] if multi else None)
                                                         for d in data})

    def _read_overview(self) -> list[dict[str, Any]]:
        return overview(self.targets(), cap=self.cap, health=self.health)

    def _filter(self, req: Request) -> JobFilter:
        req.only({"state", "queue", "after", "target", "refresh"})
        state = req.arg("state") or None
        if state is not None and state not in JOB_STATES:
            raise HttpError(400, f"unknown state {state!r} (one of: {', '.join(JOB_STATES)})")
        queue = req.arg("queue") or None
        if queue is not None and len(queue) > 128:
            raise HttpError(400, "queue must be at most 128 characters (leave it empty for every queue)")
        after = req.arg("after") or None
        if after is not None:
            ORDERS[state].parse(after)  # 400 before touching the database
        return JobFilter(state=state, queue=queue, after=after)

    def jobs(self, req: Request) -> Response:
        f = self._filter(req)
        refresh = refresh_seconds(req, 0)
        target, links = self._target(req)
        with target.engine.connect() as conn:
            now = begin_snapshot(conn)
            try:
                page = list_jobs(conn, target.schema, f, page_size=self.page_size, scan_window=self.scan_window)
            except DataError:  # a cursor's time no datetime holds goes as text: one the server refuses too
                if f.after is None:
                    raise
                raise HttpError(400, f"invalid 'after' cursor {f.after!r}: use the page's own links") from None
            conn.rollback()
        page.now = now
        return self.render("jobs.html", page=page, f=f, target=target.name, now=now, link=links,
                           refresh=refresh)

    def job(self, req: Request) -> Response:
        req.only({"target", "refresh"})
        refresh = refresh_seconds(req, 0)
        raw = req.params["id"]
        if not _digits(raw, 19) or int(raw) > 2**63 - 1 or int(raw) == 0:
            raise HttpError(400, f"job id must be a positive integer, not {raw[:40]!r}")
        target, links = self._target(req)
        with target.engine.connect() as conn:
            now = begin_snapshot(conn)
            job = job_detail(conn, target.schema, int(raw))
            conn.rollback()
        if job is None:
            raise HttpError(404, f"no job {raw} in {target.name} (deleted by the cleaner, or never there)")
        return self.render("job.html", job=job, target=target.name, now=now, link=links, refresh=refresh)
