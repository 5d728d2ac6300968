"""``maintd jobs``: look at jobs and act on them (SPEC 7.5).

One implementation. Every action calls the schema's SQL admin function (revision 0002:
``retry_jobs``, ``cancel_jobs``, ``permanently_fail_jobs``, ``delete_jobs``,
``reschedule_jobs``), so the CLI and workers or operators in any other language behave alike:
a ``running`` job, or a row some worker holds locked right now, is skipped (never waited for,
never changed) and reported as skipped with the reason.

Selection. Jobs come by ids (in chunks of ``--batch-size``) or by ``--state/--queue/--kind``
filters. A filter walks the matching jobs in keyset order over the index that serves it (the
state's partial index, else the primary key), ``--batch-size`` jobs (default 1,000) per
transaction, so cancelling a million jobs is a thousand short transactions, never one long
one; each batch's changes are committed (and their NOTIFYs delivered) before the next. A walk
acts on the jobs that existed when it began (a job enqueued since has a higher id), and a
``--state`` walk leaves out jobs a worker attempted since it began (a retried job failed again
comes back in that state at a later key: it would be met and acted on again).

Dry run. ``--dry-run`` reads the same batches in read-only transactions and evaluates, per job,
the predicate that guards the SQL function (``applies`` below; a test holds the two equal), so
it prints what would change without writing anything.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Collection, Iterable, Iterator, Sequence

from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError

from .db import connected_to, describe_db_error, quote_ident
from .queries import catalog, sql
from .queries.admin import (ACTIONS, BY_IDS, CUSTOM_PLANS, REREAD, ROW, SHOW, WALK_START, Action,  # noqa: F401
                            Filter, call_query, filter_query, list_statement)
from .durations import parse_duration
from .queries import FINAL_STATES, JOB_STATES

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
DEFAULT_BATCH = 1000
MAX_BATCH = 1_000_000  # jobs per transaction at most
LIST_PAGE = 1000  # jobs per page of `maintd jobs list` (one short transaction each)
LIST_ERROR_CHARS = 4096  # of each job's last error in `jobs list` (its length: last_error_chars)
KEEP_LISTED = 10_000  # changed/skipped jobs kept for the output (counts are always exact)
TEXT_ROWS = 20  # rows per section in the text output; --json lists up to KEEP_LISTED
CELL_WIDTH = 48
LOCK_TIMEOUT = timedelta(seconds=5)  # DDL on the table, never row locks (those are skipped)

class UsageError(Exception):
    """Bad arguments: exit 2."""


class AdminError(Exception):
    """The database cannot serve the command (e.g. not migrated): exit 1."""


class ActionFailed(Exception):
    """A batch failed; ``report`` holds what the batches before it changed (committed)."""

    def __init__(self, report: "Report", error: str):
        super().__init__(error)
        self.report = report


# ---------------------------------------------------------------- the report

@dataclass
class Report:
    action: str
    verb: str
    dry_run: bool
    changed_count: int = 0
    skipped_count: int = 0
    not_found: list[int] = field(default_factory=list)  # ids given that no job has (at most KEEP_LISTED)
    not_found_count: int = 0
    batches: int = 0
    error: str | None = None  # what stopped the command (the batches reported are committed)
    transitions: Counter = field(default_factory=Counter)  # (queue, from, to) -> jobs
    changed: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    # --dry-run of retry: the unique_keys of final jobs revived by earlier batches (a live job
    # holds them then, so a later batch's final job with one stays final, as the real run does)
    revived_keys: set[str] = field(default_factory=set, repr=False)

    def add_changed(self, row: Any, to_state: str) -> None:
        self.changed_count += 1
        self.transitions[(row.queue, row.state, to_state)] += 1
        if len(self.changed) < KEEP_LISTED:
            self.changed.append({"id": row.id, "queue": row.queue, "kind": row.kind,
                                 "from": row.state, "to": to_state})

    def add_skipped(self, job_id: int, row: Any, reason: str) -> None:
        self.skipped_count += 1
        if len(self.skipped) < KEEP_LISTED:
            self.skipped.append({"id": job_id, "queue": getattr(row, "queue", None),
                                 "kind": getattr(row, "kind", None),
                                 "state": getattr(row, "state", None), "reason": reason})

    def merge(self, other: "Report") -> None:
        """Add a batch's report (kept apart until its transaction committed)."""
        self.changed_count += other.changed_count
        self.skipped_count += other.skipped_count
        self.transitions.update(other.transitions)
        self.revived_keys |= other.revived_keys
        self.changed.extend(other.changed[:KEEP_LISTED - len(self.changed)])
        self.skipped.extend(other.skipped[:KEEP_LISTED - len(self.skipped)])

    def as_json(self) -> dict[str, Any]:
        return {
            "action": self.action, "dry_run": self.dry_run, "changed": self.changed_count,
            "skipped": self.skipped_count, "not_found": self.not_found_count, "batches": self.batches,
            "by_queue": [{"queue": q, "from": f, "to": t, "count": n}
                         for (q, f, t), n in sorted(self.transitions.items())],
            "jobs": self.changed, "skipped_jobs": self.skipped,
            "truncated": max(self.changed_count, self.skipped_count) > KEEP_LISTED,
            **({"error": self.error} if self.error is not None else {}),
        }


def skip_reason(action: Action, row: Any, now_state: str | None, revived_keys: set[str]) -> str:
    """Why a selected job was not changed."""
    if row.state == "running":
        return "running: maintd never touches a running job"
    if not row.applies:
        if action.verb == "retried" and row.state in FINAL_STATES and row.unique_key:
            return "its unique_key is held by a live job"
        return f"nothing to do: the job is {row.state}"
    if now_state is None:
        return "deleted meanwhile"
    if now_state != row.state:
        return f"changed meanwhile: now {now_state}"
    if row.unique_key and row.unique_key in revived_keys:
        return "a newer job with its unique_key was retried"
    return "locked by another transaction (a worker claiming or finishing it)"


# ---------------------------------------------------------------- running an action

def apply_batch(conn: Connection, schema: str, action: Action, rows: Sequence[Any],
                params: dict[str, Any], report: Report, *, dry_run: bool,
                taken: Collection[str] = (), flt: Filter = Filter()) -> None:
    """Change one batch through the SQL function (or predict it, ``taken`` holding the keys that
    earlier batches of the dry run revived), and report every row. A filter's batch changes only
    the jobs that still match ``flt`` when the function runs (see STILL_MATCHING)."""
    if dry_run:
        held = {r.id for r in rows if r.state in FINAL_STATES and r.unique_key in taken}
        for r in rows:
            if r.id in held:
                report.add_skipped(r.id, r, "its unique_key is held by a live job")
        rows = [r for r in rows if r.id not in held]
        changed = {r.id: r.to_state for r in _revived(action, rows)}
        report.revived_keys |= {r.unique_key for r in rows if r.id in changed and r.unique_key
                                and r.state in FINAL_STATES and action.verb == "retried"}
    else:
        result = conn.execute(sql(call_query(action, flt), schema),
                              {**params, **flt.params(), "ids": [r.id for r in rows]})
        changed = {c.id: c.state for c in result}
    pending = [r.id for r in rows if r.id not in changed and r.applies]
    now_state = {}
    if pending:
        now_state = {r.id: r.state for r in conn.execute(sql(REREAD, schema), {"ids": pending})}
    revived = {r.unique_key for r in rows if r.id in changed and r.unique_key}
    for r in rows:
        if r.id in changed:
            report.add_changed(r, changed[r.id])
        else:
            report.add_skipped(r.id, r, skip_reason(action, r, now_state.get(r.id), revived))


def _revived(action: Action, rows: Sequence[Any]) -> list[Any]:
    """The rows the action would change: those it applies to; for retry, of final jobs sharing a
    unique_key, the newest only (as retry_jobs revives them)."""
    rows = [r for r in rows if r.applies]
    if action.verb != "retried":
        return rows
    newest: dict[str, int] = {}
    for r in rows:
        if r.state in FINAL_STATES and r.unique_key:
            newest[r.unique_key] = max(newest.get(r.unique_key, r.id), r.id)
    return [r for r in rows if not (r.state in FINAL_STATES and r.unique_key) or newest[r.unique_key] == r.id]


MOVED_TRIES = 20  # SQLSTATE 40001 (a row moved to another partition meanwhile): batch redone


def in_batch(conn: Connection, work: Callable[[], Any]) -> Any:
    """``work()`` in a transaction of its own. On the partitioned layout (SPEC 8.1) a job the
    function would lock may have been moved to another partition by a transaction that committed
    meanwhile (a worker completing it): PostgreSQL then fails the statement with SQLSTATE 40001.
    The job finished meanwhile; the batch is redone and reports it as it is now."""
    for attempt in range(MOVED_TRIES):
        try:
            with conn.begin():
                return work()
        except DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) != "40001" or attempt == MOVED_TRIES - 1:
                raise


def run_ids(conn: Connection, schema: str, action: Action, ids: Iterable[int],
            params: dict[str, Any], report: Report, *, batch_size: int, dry_run: bool) -> None:
    wanted = sorted(set(ids))
    for start in range(0, len(wanted), batch_size):
        chunk = wanted[start:start + batch_size]
        query = BY_IDS.format(row=ROW, applies=action.applies, to_state=action.to_state)

        def batch() -> tuple[list[Any], Report]:
            part = Report(report.action, report.verb, report.dry_run)
            found = conn.execute(sql(query, schema), {**params, "ids": chunk}).all()
            apply_batch(conn, schema, action, found, params, part, dry_run=dry_run,
                        taken=report.revived_keys)
            return found, part

        rows, part = in_batch(conn, batch)
        report.merge(part)
        report.batches += 1
        found = {r.id for r in rows}
        for job_id in chunk:
            if job_id not in found:
                report.add_skipped(job_id, None, "not found")
                report.not_found_count += 1
                if len(report.not_found) < KEEP_LISTED:
                    report.not_found.append(job_id)


def run_filter(conn: Connection, schema: str, action: Action, flt: Filter,
               params: dict[str, Any], report: Report, *, batch_size: int, dry_run: bool) -> None:
    """Walk the filter's jobs in keyset order, one transaction per batch: the jobs that existed
    when the walk began (see WALK_START) and, when the order is not by id, that no worker
    attempted since (see NOT_ATTEMPTED_SINCE)."""
    keyset: dict[str, Any] | None = None
    with conn.begin():
        start = conn.execute(sql(WALK_START, schema)).one()._asdict()
    while True:
        query = filter_query(action, flt, first=keyset is None)

        def batch() -> tuple[list[Any], Report]:
            part = Report(report.action, report.verb, report.dry_run)
            conn.execute(sql(CUSTOM_PLANS, schema))  # planned with the queue known (see CUSTOM_PLANS)
            found = conn.execute(sql(query, schema), {**params, **flt.params(), **(keyset or {}),
                                                      **start, "limit": batch_size}).all()
            if found:
                apply_batch(conn, schema, action, found, params, part, dry_run=dry_run,
                            taken=report.revived_keys, flt=flt)
            return found, part

        rows, part = in_batch(conn, batch)
        report.merge(part)
        if not rows:
            return
        report.batches += 1
        if len(rows) < batch_size:
            return
        last = rows[-1]._mapping
        keyset = {k: v for k, v in last.items() if re.fullmatch(r"k\d+", k)}


def run_action(conn: Connection, schema: str, name: str, *, ids: Sequence[int] = (),
               flt: Filter = Filter(), params: dict[str, Any] | None = None,
               batch_size: int = DEFAULT_BATCH, dry_run: bool = False) -> Report:
    """Python entry point of ``maintd jobs retry|cancel|discard|delete|reschedule``."""
    if name == "reschedule" and flt:  # a walk whose batches move the jobs it changes ahead of it never ends
        raise UsageError("reschedule takes job ids, not a filter")
    if bool(ids) == bool(flt):
        raise UsageError("give job ids or at least one of --state/--queue/--kind (not both)")
    if flt.state is not None and flt.state not in JOB_STATES:
        raise UsageError(f"unknown state {flt.state!r}: one of {', '.join(JOB_STATES)}")
    action = ACTIONS[name]
    if flt.state is not None and flt.state not in (*action.states, "running"):  # (running: listed as skipped)
        raise UsageError(f"--state {flt.state}: {name} changes only {', '.join(action.states[:-1])} or "
                         f"{action.states[-1]} jobs")
    report = Report(name, action.verb, dry_run)
    base = {"reason": None, "at": None, "offset": None, "priority": None, "max_attempts": None,
            **(params or {})}
    check_migrated(conn, schema)
    if dry_run:  # every batch transaction starts as BEGIN READ ONLY: the server refuses writes
        conn.execution_options(postgresql_readonly=True)
    try:
        if ids:
            run_ids(conn, schema, action, ids, base, report, batch_size=batch_size, dry_run=dry_run)
        else:
            run_filter(conn, schema, action, flt, base, report, batch_size=batch_size, dry_run=dry_run)
    except DBAPIError as exc:  # earlier batches are committed: the caller reports them
        report.error = describe_db_error(exc)
        raise ActionFailed(report, report.error) from exc
    return report


def check_migrated(conn: Connection, schema: str) -> None:
    with conn.begin():
        found = conn.execute(text(catalog.FUNCTION_EXISTS),
                             {"f": f"{quote_ident(schema)}.retry_jobs(bigint[])"}).scalar()
    if not found:
        raise AdminError(f"schema {schema} has no admin functions (revision 0002) in {connected_to(conn)}: "
                         "run `maintd migrate` first")


# ---------------------------------------------------------------- list and show

def iter_jobs(conn: Connection, schema: str, flt: Filter, limit: int,
              page: int = LIST_PAGE) -> Iterator[dict[str, Any]]:
    """Newest first, at most ``limit``, read in keyset pages of ``page`` jobs (``id < the last
    one seen``), one short transaction each: memory holds one page, whatever ``limit`` is."""
    if flt.state is not None and flt.state not in JOB_STATES:
        raise UsageError(f"unknown state {flt.state!r}: one of {', '.join(JOB_STATES)}")
    before: int | None = None
    while limit > 0:
        statement, params = list_statement(flt, before)
        n = min(page, limit)
        with conn.begin():
            conn.execute(sql(CUSTOM_PLANS, schema))
            rows = [dict(r._mapping) for r in conn.execute(sql(statement, schema),
                                                           {**params, "limit": n, "error_chars": LIST_ERROR_CHARS})]
        yield from rows
        if len(rows) < n:
            return
        limit -= n
        before = rows[-1]["id"]


def list_jobs(conn: Connection, schema: str, flt: Filter, limit: int) -> list[dict[str, Any]]:
    return list(iter_jobs(conn, schema, flt, limit))


def show_job(conn: Connection, schema: str, job_id: int) -> dict[str, Any] | None:
    with conn.begin():
        row = conn.execute(sql(SHOW, schema), {"id": job_id}).mappings().first()
    return None if row is None else dict(row)


# ---------------------------------------------------------------- output

def _cell(value: Any) -> str:
    """One table cell: a field's text, long text cut."""
    out = _field(value)
    return out if len(out) <= CELL_WIDTH else out[:CELL_WIDTH - 3] + "..."


def _field(value: Any) -> str:
    """One value as text: UTC times, control characters neutralised, whole (``show``)."""
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
    return "".join(c if c.isprintable() else "?" for c in str(value))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ") -> str:
    cells = [[_cell(v) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = [headers] + cells
    return "\n".join(indent + "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
                     for line in lines)


def _plural(n: int, word: str = "job") -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def format_report(rep: Report) -> str:
    verb = f"would be {rep.verb}" if rep.dry_run else rep.verb
    head = f"{_plural(rep.changed_count)} {verb}"
    head += f" in {rep.batches} batches" if rep.batches > 1 else ""
    lines = [head + (" (dry run: nothing changed)" if rep.dry_run else "") + ":"]
    if rep.changed:
        lines.append(table(("ID", "QUEUE", "KIND", "STATE"),
                           [(j["id"], j["queue"], j["kind"], f"{j['from']} -> {j['to']}")
                            for j in rep.changed[:TEXT_ROWS]]))
        lines += _more(rep.changed_count, TEXT_ROWS)
    if len(rep.transitions) > 1 or rep.changed_count > TEXT_ROWS:
        lines.append("by queue:")
        lines.append(table(("QUEUE", "FROM", "TO", "JOBS"),
                           [(q, f, t, n) for (q, f, t), n in sorted(rep.transitions.items())]))
    if rep.skipped_count:
        lines.append(f"{_plural(rep.skipped_count)} skipped:")
        lines.append(table(("ID", "QUEUE", "KIND", "STATE", "REASON"),
                           [(s["id"], s["queue"], s["kind"], s["state"], s["reason"])
                            for s in rep.skipped[:TEXT_ROWS]]))
        lines += _more(rep.skipped_count, TEXT_ROWS)
    return "\n".join(lines)


def _more(total: int, shown: int) -> list[str]:
    return [f"  ... and {total - shown} more (--json lists up to {KEEP_LISTED:,})"] if total > shown else []


LIST_HEADERS = ("ID", "STATE", "QUEUE", "KIND", "ATTEMPT", "PRIO", "SCHEDULED_AT", "LAST_ERROR")


def _list_row(j: dict[str, Any]) -> list[str]:
    return [_cell(v) for v in (j["id"], j["state"], j["queue"], j["kind"], f"{j['attempt']}/{j['max_attempts']}",
                               j["priority"], j["scheduled_at"], j["last_error"])]


def stream_list(jobs: Iterator[dict[str, Any]]) -> Iterator[str]:
    """The table's lines as the jobs come: column widths are set by the first page (a later
    wider cell widens its own line only), so nothing waits for the last job."""
    first = [_list_row(j) for j in itertools.islice(jobs, LIST_PAGE)]
    if not first:
        yield "(no jobs)"
        return
    widths = [max([len(h)] + [len(r[i]) for r in first]) for i, h in enumerate(LIST_HEADERS)]
    for cells in itertools.chain([list(LIST_HEADERS)], first, (_list_row(j) for j in jobs)):
        yield "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()


def stream_json(items: Iterator[Any]) -> Iterator[str]:
    """A JSON array written element by element (the same document as ``_json(list(items))``)."""
    yield "["
    previous = None
    for item in items:
        if previous is not None:
            yield previous + ","
        previous = "\n".join("  " + line for line in _json(item).splitlines())
    if previous is not None:
        yield previous
    yield "]"


def format_job(job: dict[str, Any]) -> str:
    lines = []
    for key in ("id", "state", "kind", "queue", "priority", "attempt", "max_attempts",
                "scheduled_at", "created_at", "attempted_at", "attempted_by", "heartbeat_at",
                "finalized_at", "unique_key"):
        lines.append(f"{key + ':':<14}{_field(job[key])}")
    for key in ("args", "metadata", "errors"):
        body = json.dumps(job[key], indent=2, ensure_ascii=True, default=str)
        lines.append(f"{key}:" + ("\n" + "\n".join("  " + ln for ln in body.splitlines())))
    return "\n".join(lines)


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=lambda v: v.isoformat() if isinstance(v, datetime) else str(v))


# ---------------------------------------------------------------- command line

def parse_time(value: str) -> tuple[datetime | None, float | None]:
    """``--at``: ISO 8601 (naive = UTC), ``now``, or ``+5m`` / ``-1h`` from the server's clock.
    Returns (absolute time, offset seconds); one of them is None."""
    value = value.strip()
    if value.lower() == "now":
        return None, 0.0
    if value[:1] in ("+", "-"):
        try:
            seconds = parse_duration(value[1:]).total_seconds()
        except ValueError as exc:
            raise UsageError(f"--at {value!r}: {exc}") from None
        return None, -seconds if value[0] == "-" else seconds
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        raise UsageError(f"--at {value!r}: use an ISO 8601 time (2026-03-01T12:00:00Z), "
                         "'now', or '+DURATION' (e.g. +30m)") from None
    return (at if at.tzinfo else at.replace(tzinfo=timezone.utc)), None


def _action_params(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {"reason": _text(args, "reason")}
    if args.jobs_command == "reschedule":
        params["at"], params["offset"] = parse_time(args.at)
        if args.priority is not None and not -32768 <= args.priority <= 32767:
            raise UsageError("--priority must be between -32768 and 32767")
        if args.max_attempts is not None and not 1 <= args.max_attempts <= 32767:
            raise UsageError("--max-attempts must be between 1 and 32767")
        params.update(priority=args.priority, max_attempts=args.max_attempts)
    return params


def _filter(args: argparse.Namespace) -> Filter:
    return Filter(getattr(args, "state", None), _text(args, "queue"), _text(args, "kind"))


def _text(args: argparse.Namespace, name: str) -> str | None:
    """An option's text, checked here: bytes that are not UTF-8 in the command line reach Python
    as lone surrogates, which failed the command at its first statement (exit 1, "'utf-8' codec
    can't encode character '\\udcff' ...", naming no option)."""
    value = getattr(args, name, None)
    try:
        value is None or value.encode("utf-8")
    except UnicodeEncodeError:  # shown as the bytes given (argv's are surrogate-escaped)
        raw = value.encode("utf-8", "surrogateescape")
        raise UsageError(f"--{name} {str(raw)[1:]}: not UTF-8 text (queues, kinds and "
                         "reasons are text in the database)") from None
    return value


def plan_command(args: argparse.Namespace) -> Callable[[Connection, str], int]:
    """Check the arguments (before any connection) and return the work to do."""
    cmd, flt = args.jobs_command, _filter(args)
    if flt.state is not None and flt.state not in JOB_STATES:
        raise UsageError(f"unknown state {flt.state!r}: one of {', '.join(JOB_STATES)}")
    if cmd == "list":
        if args.limit < 1:
            raise UsageError("--limit must be at least 1")
        return functools.partial(_cmd_list, flt=flt, limit=args.limit, as_json=args.json)
    if cmd == "show":
        return functools.partial(_cmd_show, job_id=args.id, as_json=args.json)
    if not 1 <= args.batch_size <= MAX_BATCH:
        raise UsageError(f"--batch-size must be between 1 and {MAX_BATCH:,}")
    if bool(args.ids) == bool(flt):
        raise UsageError("give job ids or at least one of --state/--queue/--kind (not both)")
    return functools.partial(_cmd_action, name=cmd, ids=args.ids, flt=flt,
                             params=_action_params(args), batch_size=args.batch_size,
                             dry_run=args.dry_run, as_json=args.json)


def _cmd_list(conn: Connection, schema: str, *, flt: Filter, limit: int, as_json: bool) -> int:
    """Streams: each page is printed before the next is read."""
    jobs = iter_jobs(conn, schema, flt, limit)
    lines = stream_json(jobs) if as_json else stream_list(jobs)
    for line in lines:
        sys.stdout.write(line + "\n")
    return EXIT_OK


def _cmd_show(conn: Connection, schema: str, *, job_id: int, as_json: bool) -> int:
    job = show_job(conn, schema, job_id)
    if job is None:
        print(f"maintd jobs: error: no job {job_id} (deleted by the cleaner, or never there)", file=sys.stderr)
        return EXIT_FAILURE
    print(_json(job) if as_json else format_job(job))
    return EXIT_OK


def _cmd_action(conn: Connection, schema: str, *, name: str, as_json: bool, **kw: Any) -> int:
    """Exit 0 when every job was found (skipped running or locked jobs are reported, not
    failures), 1 when a job id given does not exist: a typo or a job the cleaner deleted is
    something the operator must see."""
    try:
        report = run_action(conn, schema, name, **kw)
    except ActionFailed as exc:  # what the committed batches changed, then the error
        print(_json(exc.report.as_json()) if as_json else format_report(exc.report))
        print(f"maintd jobs: error: {exc} (stopped there: the report above covers the batches "
              "done before it)", file=sys.stderr)
        return EXIT_FAILURE
    print(_json(report.as_json()) if as_json else format_report(report))
    if report.not_found_count:
        ids = ", ".join(str(i) for i in report.not_found[:TEXT_ROWS])
        more = f" and {report.not_found_count - TEXT_ROWS} more" if report.not_found_count > TEXT_ROWS else ""
        print(f"maintd jobs: error: no job {ids}{more} (deleted by the cleaner, or never there)", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK
