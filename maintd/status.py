"""``maintd status`` and ``/status``: who leads, the live daemons, each service's last run, jobs
by queue and state. Read from the database; all times are the server's.

The size is bounded whatever the table holds: jobs of the ``max_queues`` largest queues, the
others summed under ``_other`` (as for the metrics), and recorded pass results likewise. The
daemon's ``/status`` reads through its readers (:mod:`maintd.readers`) and never counts jobs: it
shows what the leader counted last (:class:`maintd.metrics.JobCounts`), or says that those are
the leader's figures; ``maintd status`` counts them itself, bounded by a timeout."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any, Callable

import psycopg
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import OperationalError, ProgrammingError

from .db import advisory_key, connected_to, describe_db_error
from .health import elsewhere
from .identifiers import qualified
from .layout_status import format_layout, layout_summary
from .logs import escaped
from .metrics import JobCounts, bounded_jobs, bounded_result, job_counts, oldest_available
from .pass_summary import annotate, describe, seconds, work_seconds
from .queries import catalog, daemons, leader, service_runs, sql

STATUS_TIMEOUT_MS = 5000
MAX_QUEUES = 100  # metrics.max_queues' default


class SchemaMissing(RuntimeError):
    """The schema has no maintd tables (``maintd migrate`` has not run)."""


class OnStandby(RuntimeError):
    """The server is a standby: the leader's lock and the daemons' sessions are the primary's."""


def _iso(v: Any) -> Any:
    return v.isoformat() if isinstance(v, datetime) else v


def _rows(conn: Connection, template: str, schema: str, params: dict | None = None) -> list[dict[str, Any]]:
    return [{k: _iso(v) for k, v in r.items()} for r in conn.execute(sql(template, schema), params or {}).mappings()]


def collect_status(engine: Engine, schema: str, *, jobs: dict[str, Any] | None = None,
                   max_queues: int = MAX_QUEUES, health: bool = False, show_query: bool = False,
                   configured_layout: str | None = None) -> dict[str, Any]:
    """``jobs``: the job figures to show (:func:`leader_figures`); None: count them here.
    ``configured_layout``: the config's ``layout``, which the table's is compared with.
    ``health``: read the table health too (``maintd status``; the daemon's /status serves its
    leader's last read from memory instead).

    A schema behind this maintd (a rolling upgrade, the package first) is read as far as it can
    be: ``schema_behind`` says so, and each part its statements cannot read (a column a later
    migration adds) is empty, with why in ``not_read``; the callers fail as before."""
    classid, objid = advisory_key(schema)
    with engine.connect() as conn:
        conn.execute(text(catalog.SET_LOCAL), {"name": "statement_timeout", "value": str(STATUS_TIMEOUT_MS)})
        if conn.execute(text(catalog.IN_RECOVERY)).scalar():  # its pg_locks would say "no leader"
            raise OnStandby(f"{connected_to(conn)} is a standby (in recovery): the leader's lock and "
                                "the daemons' sessions are the primary's; point this at the primary")
        if not conn.execute(text(catalog.TABLE_EXISTS), {"qualified": qualified(schema, "leader")}).scalar():
            raise SchemaMissing(f"schema {schema!r} has no maintd tables in {connected_to(conn)}: "
                                "run `maintd migrate` first")
        behind = _behind(conn, schema)
        part = _Parts(conn, tolerant=behind is not None)
        now = conn.execute(text(catalog.TRANSACTION_TIME)).scalar_one()
        status: dict[str, Any] = {"schema": schema, "time": _iso(now)}
        if behind is not None:
            status["schema_behind"] = behind
        lead = part("leader", lambda: _rows(conn, leader.CURRENT, schema, {"classid": classid, "objid": objid}), [])
        status["leader"] = _leader(lead[0] if lead else None)
        status["database_writable"] = conn.execute(text(catalog.SERVER_WRITABLE)).scalar_one()
        status.update(replicas(part("daemons", lambda: _rows(conn, daemons.REGISTERED, schema), [])))
        status["services"] = part("services", lambda: _services(conn, schema, max_queues), [])
        status["layout"] = part("layout", lambda: {k: _iso(v) for k, v in layout_summary(
            conn, schema, configured_layout).items()}, None)
        # The leader's figures are bounded already (JobGauges keeps them as shown).
        status.update(part("jobs", lambda: bounded_jobs(_count(conn, schema), max_queues),
                           {"jobs": [], "oldest_available_age_seconds": {}}) if jobs is None else jobs)
        if part.errors:
            status["not_read"] = part.errors
        if health:  # last: a failed read ends the transaction
            status["health"] = _health(conn, schema, show_query)
    return status


class _Parts:
    """Reads one part of the status each; ``tolerant`` (a schema behind this maintd): a part whose
    statement fails is rolled back to its savepoint and left at its default, with why in ``errors``.
    A lost connection is no such part: nothing more can be read, and it is raised as it came (the
    next read said only "Can't reconnect until invalid transaction is rolled back")."""

    def __init__(self, conn: Connection, tolerant: bool):
        self.conn, self.tolerant, self.errors = conn, tolerant, {}

    def __call__(self, name: str, read: Callable[[], Any], default: Any) -> Any:
        if not self.tolerant:
            return read()
        try:
            with self.conn.begin_nested():
                return read()
        except (psycopg.Error, OperationalError, ProgrammingError) as exc:
            if getattr(exc, "connection_invalidated", False) or self.conn.invalidated:
                raise
            self.errors[name] = describe_db_error(exc)
            return default


def _services(conn: Connection, schema: str, max_queues: int) -> list[dict[str, Any]]:
    services = _rows(conn, service_runs.ALL, schema)
    for run in services:
        run["result"] = bounded_result(run["result"], max_queues)
    return [{**r, **annotate(r["service"], r["result"]),
             "work_seconds": work_seconds(r["started_at"], r["finished_at"], r["result"])} for r in services]


def _behind(conn: Connection, schema: str) -> str | None:
    """Why the schema is too old for this maintd's statements, if it is (one newer than this
    maintd is read as it is)."""
    from .migrate import behind, current_revision, head_revision, revisions

    current, head, known = current_revision(conn, schema), head_revision(), revisions()
    if current in known and head in known and known.index(current) < known.index(head):
        return behind(schema, current)
    return None


def _health(conn: Connection, schema: str, show_query: bool) -> dict[str, Any]:
    from .health import read_once

    try:
        return read_once(conn, schema, show_query=show_query).status(schema)
    except (psycopg.Error, OperationalError, ProgrammingError) as exc:
        conn.rollback()
        return {"error": describe_db_error(exc)}


def replicas(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """``daemons``: the live ones (lock session connected now); ``gone``: registered within the
    last hour, session gone (killed, stopped, frozen past the lease), with when it was last seen
    (when it stopped, or a live replica saw it leave; else its last connect)."""
    return {"daemons": [{k: v for k, v in r.items() if k != "alive"} for r in rows if r["alive"]],
            "gone": [{k: r[k] for k in ("instance_id", "host", "pid", "version", "started_at", "last_seen_at")}
                     for r in rows if not r["alive"]]}


def _leader(row: dict[str, Any] | None) -> dict[str, Any] | None:
    if not row or not row["instance_id"] or row["released_at"] is not None or not row["holds_lock"]:
        return None
    return {"instance_id": row["instance_id"], "host": row["host"], "pid": row["pid"],
            "since": row["elected_at"], "epoch": row["epoch"]}


def _count(conn: Connection, schema: str) -> dict[str, Any]:
    """Counting finished jobs reads the heap: it may time out, then only live states count."""
    figures: dict[str, Any] = {"oldest_available_age_seconds": oldest_available(conn, schema)}
    try:
        with conn.begin_nested():
            figures["jobs"] = job_counts(conn, schema)
    except (OperationalError, ProgrammingError) as exc:
        figures["jobs"] = job_counts(conn, schema, final=False)
        figures["jobs_note"] = f"finished jobs not counted: {describe_db_error(exc)}"
    return figures


def leader_figures(counts: JobCounts | None, *, leading: bool) -> dict[str, Any]:
    """The job figures of a daemon's ``/status``: the leader's last counts from memory; a
    follower says where they are."""
    if counts is not None:
        figures = {"jobs": counts.rows, "oldest_available_age_seconds": counts.oldest,
                   "jobs_counted_at": {"live": _iso(counts.live_at), "finished": _iso(counts.final_at)}}
        return {**figures, "jobs_note": counts.note} if counts.note else figures
    note = ("not counted yet: the leader counts jobs every 15 s" if leading else
            "jobs are counted by the leader: see its /status, or maintd_jobs on its /metrics")
    return {"jobs": [], "oldest_available_age_seconds": {}, "jobs_note": note}


def format_status(st: dict[str, Any]) -> str:
    st = escaped(st)  # queue names, errors, application names: written by anyone who can enqueue
    lines = [f"schema: {st['schema']}"]
    if st.get("schema_behind"):
        lines.append(f"schema behind: {st['schema_behind']} (shown: what this maintd can read of it)")
    not_read = st.get("not_read") or {}
    lead = st["leader"]
    if "leader" in not_read:
        lines.append(f"leader: not read ({not_read['leader']})")
    elif lead:
        lines.append(f"leader: {lead['instance_id']} (host {lead['host']}, pid {lead['pid']}, "
                     f"epoch {lead['epoch']}, since {_time(lead['since'])})")
    else:
        lines.append("leader: none")
    if st.get("database_writable") is False:
        lines.append("database: read-only (maintenance paused)")
    if "daemons" in not_read:
        lines.append(f"daemons: not read ({not_read['daemons']})")
    elif st["daemons"]:
        lines.append("daemons:")
        for d in st["daemons"]:
            lines.append(f"  {d['instance_id']:<24} host {d['host']}  pid {d['pid']}  "
                         f"v{d['version']}  alive (lock session connected)")
    else:
        lines.append("daemons: none alive")
    for d in st.get("gone", []):
        lines.append(f"  {d['instance_id']:<24} host {d['host']}  pid {d['pid']}  "
                     f"v{d['version']}  gone (no lock session; last seen {_time(d['last_seen_at'])})")
    if "layout" in not_read:
        lines.append(f"layout: not read ({not_read['layout']})")
    elif st.get("layout"):
        lines.append(format_layout(st["layout"]))
    # idle passes that repeat the record are not written (no WAL): the daemon's /status has every one
    lines += ["services (last recorded pass; idle passes that repeat it are not recorded):"] + (
        [f"  (not read: {not_read['services']})"] if "services" in not_read else _format_runs(st["services"]))
    lines.append("jobs:")
    if "jobs" in not_read:
        lines.append(f"  (not read: {not_read['jobs']})")
    elif not st["jobs"]:
        lines.append("  (none)")
    for j in st["jobs"]:
        n = j["count"]
        lines.append(f"  {j['queue']:<20} {j['state']:<10} {n:,}" if isinstance(n, int) else
                     f"  {j['queue']:<20} {j['state']:<10} {n}")
    if st.get("jobs_note"):
        lines.append(f"  ({st['jobs_note']})")
    if st.get("health"):
        lines += format_health(st["health"])
    return "\n".join(lines)


def format_health(h: dict[str, Any]) -> list[str]:
    """The table-health lines of ``maintd status`` (SPEC 8.2)."""
    if h.get("error"):
        return ["health:", f"  (not read: {h['error']})"]
    hz = h["horizon"]
    # held by sessions whose start is hidden alone: "0 s" would be false
    age = "for a time this read cannot tell" if hz["holder"] is None and hz.get("unaged") else _age(hz["age_seconds"])
    lines = [f"health (read at {h['at']}):", f"  xmin horizon: {age}, {hz['age_xids']:,} transaction ids"]
    if hz["holder"] is None and not hz.get("unaged"):
        lines.append("  held by: nothing older than a second")
    for i, holder in enumerate(hz["holders"]):
        lines.append(f"  {'held by' if i == 0 else '   also'}: {_holder(holder)}")
    if hz.get("more_holders"):
        lines.append(f"     and {hz['more_holders']} more")
    if n := hz.get("unaged"):  # PostgreSQL hides their start from this role: no age on one read
        lines.append(f"  {'held by' if hz['holder'] is None else '   also'}: {n:,} session{'s' if n > 1 else ''} "
                     f"of {'other roles' if n > 1 else 'another role'}, for a time this read cannot tell (their start "
                     "is hidden: GRANT pg_read_all_stats, or see the daemon's /status and log)")
    for holder in hz["catalog_holders"]:
        lines.append(f"  catalogs only (not jobs): {_holder(holder)}")
    lines.append("  tables:")
    for t in h["tables"]:
        vacuumed = "never" if t["last_vacuum"] is None else \
            datetime.fromtimestamp(t["last_vacuum"], timezone.utc).isoformat(timespec="seconds")
        lines.append(f"    {t['table']:<16} live {t['live']:>10,}  dead {t['dead']:>10,}  "
                     f"{_bytes(t['bytes']):>9}  last vacuum {vacuumed}")
    return lines


def _holder(h: dict[str, Any]) -> str:
    """``snapshot pid 4711 user alice app psql client 10.0.0.5 state idle in transaction, for 12 min
    (4,512 xids)`` and the query when shown."""
    parts = [h["kind"].replace("_", " ")]
    if h.get("name"):
        parts.append(repr(h["name"]) + (f" ({h['detail']})" if h["kind"] in ("replication_slot", "setting") else ""))
    for key, label in (("pid", "pid"), ("user", "user"), ("application_name", "app"),
                       ("client_addr", "client"), ("state", "state")):
        if h.get(key) not in (None, ""):
            parts.append(f"{label} {h[key]}")
    if h["exact"]:
        age = f"for {_age(h['age_seconds'])}"
    else:  # counted from the first read that saw it hold: unknown on a first read
        age = f"for at least {_age(h['age_seconds'])}" if h["age_seconds"] >= 1 else "for an unknown time"
    if elsewhere(h.get("detail")):
        parts.append(h["detail"])
    text = " ".join(parts) + f", {age} ({h['age_xids']:,} xids)"
    if h.get("query"):
        text += f"\n           query: {' '.join(str(h['query']).split())[:200]}"
    return text


def _age(seconds: float) -> str:
    s = float(seconds)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h" if s < 172800 else f"{s / 86400:.1f} d"


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"


def _format_runs(runs: list[dict[str, Any]]) -> list[str]:
    if not runs:
        return ["  (no pass recorded yet)"]
    lines, width = [], max(10, *(len(r["service"]) for r in runs))  # 'partitioner' is 11
    for r in runs:
        extra = f"; error: {r['error']}" if r.get("error") else ""
        took = _took(r)
        summary = r.get("summary") or describe(r["service"], r.get("result"))
        lines.append(f"  {r['service']:<{width}} {r['outcome']:<8} at {_time(r['finished_at'])} by {r['instance_id']}"
                     f"{took}: {summary or 'nothing to report'}{extra}")
    return lines


def _time(iso: Any) -> Any:
    """``2026-03-01 12:00:05 UTC`` from an ISO time (text output; JSON keeps the full ISO time)."""
    try:
        t = datetime.fromisoformat(iso)
    except (TypeError, ValueError):
        return iso
    return t.strftime("%Y-%m-%d %H:%M:%S ") + ("UTC" if t.utcoffset() == timedelta(0) else t.strftime("%z"))


def _took(run: dict[str, Any]) -> str:
    """``, worked 50 ms``: the pass's work, its pauses between batches left out."""
    work = run.get("work_seconds")
    if work is None:
        work = work_seconds(run.get("started_at"), run.get("finished_at"), run.get("result"))
    return "" if work is None else f", worked {seconds(work)}"
