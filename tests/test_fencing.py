"""Every maintenance write is fenced (SPEC 3 and 7.2; 8.3: "fencing of every maintenance write
included"), checked per write path, not per mechanism (issue 29).

Two halves that hold each other to the code:

* **The inventory.** Every statement in maintd's code that writes (INSERT, UPDATE, DELETE, DDL,
  row locks, NOTIFY, a call of one of maintd's own SQL functions, advisory locks) is found: the
  statements of ``maintd/queries/*.py`` by name, and SQL written as literals elsewhere in the
  package (the reindexer's DDL, say) by file and text. Each must be covered by a case of
  :data:`CASES` or listed in :data:`NOT_MAINTENANCE` with the reason. A new write path (a
  partition detach, a health history row) fails :func:`test_every_write_is_fenced_by_a_case_or_listed`
  until it is one or the other.
* **The cases.** One per write path of every service. Each runs its pass twice on the same rows:
  first under a *stale* fence (the previous term, trusted on the client side, so that only the
  database's check can refuse it), which must raise ``NotLeader`` after sending its writes and
  leave every row, relation and notification as it was; then under the term's own fence, which
  must change something. Both runs record the statements sent: each run sent every write the
  case claims to cover (DDL, which no transaction can fence, must not even be sent under the
  stale fence).

The stale and the valid fence are made in one place, :func:`fences` (the election is being
rewritten; this test depends on ``maintd.leader`` there only).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import pkgutil
import re
import types
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import psycopg
import pytest
from sqlalchemy import Engine, event

import maintd
import maintd.queries
from maintd.clock import FrozenClock
from maintd.config import Settings
from maintd.db import events_channel, notify_channel, periodic_channel, quote_ident
from maintd.passes import Outcome, PassRecord, record_pass
from maintd.queries import FRAGMENTS, for_queue, sql
from maintd.services.base import NotLeader, PassContext
from maintd.services.cleaner import Cleaner
from maintd.services.periodic import PeriodicEnqueuer
from maintd.services.reindexer import Reindexer
from maintd.services.rescuer import Rescuer
from maintd.services.scheduler import Scheduler

from .conftest import T0
from .source_literals import string_literals

PACKAGE = Path(maintd.__file__).resolve().parent

# -- the inventory ----------------------------------------------------------------------------------

WRITES = re.compile(
    r"\b(INSERT\s+INTO|UPDATE\s+\S+(\s+AS\s+\w+)?\s+SET|DELETE\s+FROM|MERGE\s+INTO|TRUNCATE|CREATE|DROP|ALTER"
    r"|REINDEX|VACUUM|CLUSTER|GRANT|REVOKE|COPY|COMMENT\s+ON|LOCK\s+TABLE|REFRESH\s+MATERIALIZED|NOTIFY"
    r"|FOR\s+(NO\s+KEY\s+)?UPDATE|FOR\s+(KEY\s+)?SHARE)\b"
    r"|\{schema\}\.\w+\s*\("  # one of maintd's functions (admin functions, partition functions)
    r"|\b(pg_notify|nextval|setval|pg_(try_)?advisory\w*|pg_terminate_backend|pg_cancel_backend|dblink\w*)\s*\(")
# A literal elsewhere in the package is SQL when it starts like a statement (upper case).
STATEMENT = re.compile(r"^\s*(WITH|SELECT|INSERT|UPDATE|DELETE|MERGE|CREATE|DROP|ALTER|REINDEX|VACUUM|ANALYZE"
                       r"|CLUSTER|TRUNCATE|GRANT|REVOKE|COMMENT|LOCK|DO|CALL|COPY|NOTIFY|REFRESH)\b")

# Writes that are not maintenance writes (so not fenced), with the reason.
NOT_MAINTENANCE: dict[str, str] = {
    **{f"jobs.{n}": "the workers' SQL (README): their own transactions, no leadership involved"
       for n in ("CLAIM", "HEARTBEAT", "COMPLETE", "FAIL", "CANCEL")},
    "jobs.DEMO_SEED_OLD": "`maintd demo`'s workload, written as a worker would",
    **{f"admin.ACTIONS[{a!r}].call": "`maintd jobs` (an operator's command through the admin functions)"
       for a in ("retry", "cancel", "discard", "delete", "reschedule")},
    "admin.STILL_MATCHING": "`maintd jobs`: the rows of a filter's batch locked for the admin function's call",
    **{f"periodic_jobs.{n}": "`maintd periodic` (an operator's command)" for n in ("UPSERT", "DELETE", "SET_ENABLED")},
    "daemons.REGISTER": "the registry of running daemons: every replica, leader or not, registers itself",
    "daemons.FORGET_STALE": "the registry of running daemons, pruned by whichever replica (re)connects",
    "daemons.STOPPED": "the registry of running daemons: a replica, leader or not, says when it left",
    **{f"leader.{n}": "leadership itself: the election writes the term that the fence checks"
       for n in ("ROUND", "LOCK_ROW", "BUMP_EPOCH", "RELEASE", "HANDOVER_NOTIFY")},
    "leader.FENCE_WRITES": "the fence (FOR KEY SHARE of the leader row)",
    "leader.FENCE": "the fence (FOR KEY SHARE of the leader row)",
    "grants.py: GRANT USAGE ON SCHEMA {} TO {};": "`maintd grants` (the owner role)",
    "grants.py: GRANT {} ON TABLE {} TO {};": "`maintd grants` (the owner role)",
    "grants.py: DO $$BEGIN IF (SELECT relowner FROM pg_catalog.pg_class WHERE oid = CAST('{}' AS "
    "pg_catalog.regclass)) <> CAST('{}' AS pg_catalog.regrole) THEN REVOKE UPDATE ON TABLE {} FROM {}; "
    "END IF; END$$;": "`maintd grants` (the owner role): a table-wide UPDATE taken back before a "
                      "column-limited one (not from the table's owner)",
    "catalog.ADVISORY_XACT_LOCK": "`maintd grants`: the schema's migration lock",
    "catalog.TRY_ADVISORY_LOCK": "`maintd migrate`: the schema's migration lock",
    "catalog.ADVISORY_UNLOCK": "`maintd migrate` (and `--convert`): the schema's migration lock given back",
    "migrate.py: CREATE SCHEMA IF NOT EXISTS {}": "`maintd migrate` (the owner role)",
    "migrate.py: CREATE INDEX CONCURRENTLY IF NOT EXISTS {} ON {}.jobs {}": "a migration (the owner role)",
    "migrate.py: DROP INDEX CONCURRENTLY IF EXISTS {}.{}": "a migration's downgrade (the owner role)",
    # The partitioned layout (SPEC 8.1): DDL of migrate and of `maintd migrate --convert partitioned`,
    # run by the schema's owner; and the partition functions' own definitions.
    **{f"partitions.py: {n}": "the partition functions and partitions that `maintd migrate` creates (the owner role)"
       for n in ("ALTER TABLE {}.{} ADD CONSTRAINT {}_pkey PRIMARY KEY (id)",
                 "CREATE OR REPLACE FUNCTION {}.{} RETURNS {} {} AS $fn$",
                 "CREATE FUNCTION {}.{} RETURNS {} {} AS $fn$", "CREATE INDEX {}{} ON {}.{} {}",
                 "CREATE TABLE {}.jobs_{} PARTITION OF {}.{} FOR VALUES IN ('{}') PARTITION BY RANGE (finalized_at)",
                 "CREATE TABLE {}.{} PARTITION OF {}.{} FOR VALUES IN {}", "CREATE UNIQUE INDEX {}{} ON {}.{} {}",
                 "DROP FUNCTION IF EXISTS {}.{}", "REVOKE EXECUTE ON FUNCTION {}.{} FROM PUBLIC")},
    "grants.py: GRANT EXECUTE ON FUNCTION {}.{} TO {};": "`maintd grants` (the owner role)",
    **{f"partitions.{n}": "reads of the partition functions (no change: they only list partitions)"
       for n in ("LAYOUT", "WIDE_PARTITIONS_END", "EXPIRED", "SUMMARY")},
}
CONVERT = "`maintd migrate --convert partitioned` (the owner role, a one-off conversion)"
NOT_MAINTENANCE.update({f"convert.{name}": CONVERT for name in (
    "CREATE_CONV", "CREATE_SEEN", "CREATE_PROGRESS", "START_PROGRESS", "SYNC_FUNCTION", "CREATE_TRIGGER",
    "CREATE_TRUNCATE_TRIGGER", "DROP_TRUNCATE_TRIGGER", "ABANDON_TRUNCATE_TRIGGER",
    "LOCK_BATCH", "COPY", "SAVE_PROGRESS",
    "LOCK_JOBS", "DROP_FUNCTION", "DROP_TRIGGER", "RENAME_INDEX", *(f"RENAME_TABLES[{i}]" for i in range(4)),
    "RESTART_IDS", "GRANT_TABLE", "COMMENT_FUNCTION", "REVOKE_FUNCTION", "GRANT_FUNCTION",
    *(f"CLEAN_UP[{i}]" for i in range(4)), "ABANDON_TRIGGER", *(f"ABANDON[{i}]" for i in range(4)),
    "LOCK_FREE", *(f"RESTART_COPY[{i}]" for i in range(2)), *(f"STALE[{i}]" for i in range(3)),
)})


def _writes(text: str) -> bool:
    """Whether a statement writes: its shared fragments filled in, comments and string
    literals ('CREATE' as a privilege name) left out."""
    for name, fragment in FRAGMENTS.items():
        text = text.replace(name, fragment)
    text = re.sub(r"--[^\n]*", "", text)
    return bool(WRITES.search(re.sub(r"'(?:[^']|'')*'", "''", text)))


def _values(value: Any, name: str) -> Iterator[tuple[str, str]]:
    """(name, string) of a module constant and of the strings inside it (dicts, tuples, dataclasses)."""
    if isinstance(value, str):
        yield name, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _values(v, f"{name}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _values(v, f"{name}[{i}]")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _values(getattr(value, f.name), f"{name}.{f.name}")


@functools.lru_cache(maxsize=1)
def query_statements() -> dict[str, str]:
    """Every statement of ``maintd/queries/*.py`` by name (``jobs.CLEANER_DELETE_RANGE``); the
    package's own module holds only fragments, which count inside the statements using them."""
    out: dict[str, str] = {}
    for info in pkgutil.iter_modules(maintd.queries.__path__):
        module = importlib.import_module(f"maintd.queries.{info.name}")
        for attr, value in vars(module).items():
            if attr.startswith("_") or isinstance(value, (types.ModuleType, type)) or callable(value):
                continue
            out.update(_values(value, f"{info.name}.{attr}"))
    return out


@functools.lru_cache(maxsize=1)
def literal_statements() -> dict[str, str]:
    """SQL written as literals (f-strings too) in the package outside the statement modules'
    constants, by ``file: text``: in any module's functions, and at module level outside
    ``maintd/queries``. Docstrings are prose."""
    out: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        roots = ([n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
                 if path.parent.name == "queries" else None)
        for _, text in string_literals(tree, roots):
            if STATEMENT.match(text):
                out[f"{path.relative_to(PACKAGE)}: {' '.join(text.split())}"] = text
    return out


@functools.lru_cache(maxsize=1)
def write_statements() -> dict[str, str]:
    return {name: text for name, text in {**query_statements(), **literal_statements()}.items() if _writes(text)}


# -- fences, snapshots, what was sent ------------------------------------------------------------------


@contextmanager
def fences(settings: Settings) -> Iterator[tuple[Any, Any]]:
    """(the fence of a term this test holds, a stale fence: the previous epoch of the same
    instance and lock session, trusted on the client side, so only the database refuses it).
    The one place this test depends on ``maintd.leader``."""
    from maintd.leader import LeaderFence, acquire_once

    held = acquire_once(settings)
    assert held is not None, "no leadership for the test"
    elector, fence = held
    stale_term = dataclasses.replace(fence.term, epoch=fence.term.epoch - 1)
    try:
        yield fence, LeaderFence(settings.schema, stale_term, lambda: stale_term)
    finally:
        elector.stop()


def snapshot(engine: Engine, schema: str) -> dict[str, Any]:
    """Every row of every table of the schema, and every relation (a rebuilt index has a new
    file node; a dropped or detached one is gone)."""
    with engine.connect() as conn:
        tables = conn.execute(sql("SELECT c.relname FROM pg_class c WHERE c.relnamespace = CAST(:s AS regnamespace)"
                                  " AND c.relkind IN ('r', 'p') ORDER BY 1", schema), {"s": quote_ident(schema)}).scalars().all()
        rows = {t: conn.execute(sql(f"SELECT coalesce(jsonb_agg(to_jsonb(x) ORDER BY to_jsonb(x)::text), '[]')"
                                    f" FROM {{schema}}.{quote_ident(t)} AS x", schema)).scalar() for t in tables}
        relations = conn.execute(sql(
            "SELECT c.relname, c.relkind, c.relfilenode, i.indisvalid FROM pg_class c"
            " LEFT JOIN pg_index i ON i.indexrelid = c.oid"
            " WHERE c.relnamespace = CAST(:s AS regnamespace) ORDER BY 1", schema), {"s": quote_ident(schema)}).all()
        conn.rollback()
    return {"rows": rows, "relations": [tuple(r) for r in relations]}


class Inbox:
    """Notifications on the schema's channels (queues, events, periodic_jobs changes)."""

    def __init__(self, dsn: str, schema: str):
        self.conn = psycopg.connect(dsn, autocommit=True)
        for channel in (notify_channel(schema), events_channel(schema), periodic_channel(schema)):
            self.conn.execute(f"LISTEN {quote_ident(channel)}")

    def drain(self, timeout: float = 0.3, stop_after: int | None = None) -> list[tuple[str, str]]:
        return [(n.channel, n.payload) for n in self.conn.notifies(timeout=timeout, stop_after=stop_after)]


class Sent:
    """The write statements a pass sent, by inventory name."""

    def __init__(self, engine: Engine, schema: str):
        self.names: list[str] = []
        compiled: dict[str, set[str]] = {}
        self.patterns: list[tuple[str, re.Pattern[str]]] = []
        literals = literal_statements()
        for name, text in write_statements().items():
            if name in literals:  # an f-string: its expressions match anything
                parts = [re.escape(" ".join(p.split())) for p in text.split("{}")]
                self.patterns.append((name, re.compile(r"\s*" + r".+?".join(parts) + r"\s*", re.S)))
                continue
            for variant in {text, for_queue(text)}:
                key = " ".join(str(sql(variant, schema).compile(dialect=engine.dialect)).split())
                compiled.setdefault(key, set()).add(name)
        self.compiled = compiled

    def __call__(self, conn, cursor, statement, parameters, context, executemany) -> None:
        flat = " ".join(statement.split())
        self.names += sorted(self.compiled.get(flat, ()))
        self.names += [name for name, pattern in self.patterns if pattern.fullmatch(flat)]

    def take(self) -> set[str]:
        names, self.names = set(self.names), []
        return names


# -- the cases ----------------------------------------------------------------------------------------


@dataclass
class Env:
    settings: Settings
    engine: Engine
    schema: str
    dsn: str
    clock: FrozenClock = field(default_factory=lambda: FrozenClock(T0))

    def execute(self, statement: str, **params: Any) -> None:
        with self.engine.begin() as conn:
            conn.execute(sql(statement, self.schema), params)

    def context(self, fence: Any) -> PassContext:
        return PassContext.for_settings(self.settings, self.engine, self.clock, fence=fence)


@dataclass(frozen=True)
class Case:
    name: str
    covers: tuple[str, ...]  # the inventory's names of the writes this path sends
    seed: Callable[[Env], None]
    run: Callable[[Env, PassContext], Any]
    settings: dict[str, Any] = field(default_factory=dict)
    hold: Callable[[Env], ContextManager[Any]] | None = None  # held across both runs
    ddl: bool = False  # proved before it is sent: the stale run must not send it at all
    notifies: bool = False  # the valid run notifies (so the inbox is seen to work)
    layout: str = "plain"  # the jobs layout of the case's schema (SPEC 8.1)


def jobs(state: str, *, n: int = 1, kind: str = "k", queue: str = "default", attempt: int = 1,
         max_attempts: int = 25, finalized: str = "NULL", attempted: str = "NULL", scheduled: str = "now()",
         unique_key: str | None = None) -> Callable[[Env], None]:
    """A seed: ``n`` jobs in ``state``; times are SQL over ``:t0`` (the pass's frozen now)."""
    def seed(env: Env) -> None:
        env.execute(
            "INSERT INTO {schema}.jobs (kind, queue, state, attempt, max_attempts, finalized_at, attempted_at,"
            " scheduled_at, unique_key) SELECT :kind, :queue, CAST(:state AS {schema}.job_state), :attempt,"
            f" :max_attempts, {finalized}, {attempted}, {scheduled}, :unique_key"
            " FROM generate_series(1, :n)",
            kind=kind, queue=queue, state=state, attempt=attempt, max_attempts=max_attempts, n=n,
            unique_key=unique_key, t0=T0)
    return seed


def both(*seeds: Callable[[Env], None]) -> Callable[[Env], None]:
    def seed(env: Env) -> None:
        for s in seeds:
            s(env)
    return seed


@contextmanager
def row_locked(env: Env) -> Iterator[None]:
    """Another session holds one expired final row (FOR UPDATE) across both runs."""
    with env.engine.connect() as holder:
        holder.execute(sql("SELECT id FROM {schema}.jobs ORDER BY id LIMIT 1 FOR UPDATE", env.schema))
        try:
            yield
        finally:
            holder.rollback()


def invalid_index(env: Env) -> None:
    """A leftover of a failed concurrent build (invalid), for the reindexer to drop."""
    jobs("available", n=2)(env)
    with psycopg.connect(env.dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute(f"CREATE UNIQUE INDEX CONCURRENTLY jobs_fetch_idx_ccnew ON {quote_ident(env.schema)}.jobs (kind)")


def slots(*rows: tuple[str, str]) -> Callable[[Env], None]:
    def seed(env: Env) -> None:
        for periodic_id, at in rows:
            env.execute(f"INSERT INTO {{schema}}.periodic_slots (periodic_id, slot, backfilled, instance_id)"
                        f" VALUES (:id, {at}, false, 'old')", id=periodic_id, t0=T0)
    return seed


def slot_of_another_schedule(env: Env) -> None:
    """The newest slot of 'moved' taken under another schedule, and no slot of its new one
    since: the enqueuer restamps that slot with the new schedule."""
    env.execute("INSERT INTO {schema}.periodic_slots (periodic_id, slot, backfilled, instance_id, schedule)"
                " VALUES ('moved', CAST(:t0 AS timestamptz), false, 'old', '0 3 * * * (UTC)')", t0=T0)


def periodic_row(env: Env) -> None:
    env.execute("INSERT INTO {schema}.periodic_jobs (id, schedule, kind) VALUES ('bad', 'every now and then', 'k')")


def cleaner(env: Env, ctx: PassContext) -> Any:
    return Cleaner(env.settings.cleaner).run_once(ctx)


def rescuer(env: Env, ctx: PassContext) -> Any:
    return Rescuer(env.settings.rescuer).run_once(ctx)


def scheduler(env: Env, ctx: PassContext) -> Any:
    return Scheduler(env.settings.scheduler).run_once(ctx)


def periodic(env: Env, ctx: PassContext) -> Any:
    return PeriodicEnqueuer(env.settings.periodic).run_once(ctx)


def periodic_after_a_removal(env: Env, ctx: PassContext) -> Any:
    """A pass after the one that ran the entry 'gone', since removed (by a reload)."""
    before = PeriodicEnqueuer([])
    before._ids = {"gone"}  # what the replaced service's last pass ran
    service = PeriodicEnqueuer(env.settings.periodic)
    service.succeed(before)
    return service.run_once(ctx)


def reindexer(env: Env, ctx: PassContext) -> Any:
    return Reindexer(env.settings.reindexer).run_once(ctx)


def expired_partitions(env: Env) -> None:
    """A partitioned schema whose completed partitions end 8 hours ago (past a 1 h retention; a
    row in one), none made ahead: the partitioner has partitions to empty, detach and drop, and
    to make."""
    with env.engine.begin() as conn:
        for name, *_ in conn.execute(sql("SELECT * FROM {schema}.job_partitions('completed')", env.schema)).all():
            conn.execute(sql(f"ALTER TABLE {{schema}}.jobs_completed DETACH PARTITION {{schema}}.{name}", env.schema))
            conn.execute(sql(f"DROP TABLE {{schema}}.{name}", env.schema))
        conn.execute(sql("SELECT {schema}.start_partitions('completed', interval '1 hour', now() - interval '10 hours')",
                         env.schema))
        conn.execute(sql("SELECT * FROM {schema}.maintain_partitions('completed', interval '1 hour', "
                         "now() - interval '8 hours')", env.schema))  # two proper partitions, both expired
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, finalized_at) "
                         "VALUES ('k', 'completed', now() - interval '9 hours 30 minutes')", env.schema))


def partitioner(env: Env, ctx: PassContext) -> Any:
    from maintd.services.partitioner import Partitioner, PartitionerConfig

    s = env.settings
    ctx.layout, ctx.clock = "partitioned", FrozenClock(datetime.now(timezone.utc))
    return Partitioner(PartitionerConfig("partitioned", s.partitions, s.cleaner)).run_once(ctx)


def service_run(env: Env, ctx: PassContext) -> Any:
    return record_pass(ctx, PassRecord("cleaner", Outcome.SUCCESS, T0, T0, 0.01))


def health_sample(env: Env, ctx: PassContext) -> Any:
    """The leader's history row of the dashboard's charts (maintd.history, SPEC 8.2)."""
    from maintd.health import HealthReport, Horizon, TableHealth
    from maintd.history import HistoryWriter

    report = HealthReport(at=T0, horizon=Horizon(), tables={env.schema: (TableHealth("jobs", 1, 0, 8192, None),)})
    return HistoryWriter().step(ctx, report)


def history_rows(env: Env) -> None:
    env.execute("INSERT INTO {schema}.health_history (at, since) VALUES (CAST(:t0 AS timestamptz) - interval '3 days',"
                " CAST(:t0 AS timestamptz) - interval '3 days 1 minute')", t0=T0)


OLD = "CAST(:t0 AS timestamptz) - interval '2 days'"
STUCK = "CAST(:t0 AS timestamptz) - interval '2 hours'"
HOURLY = {"schedule": "@every 1h", "kind": "tick"}
NO_WAIT = {"rescuer": {"precise_timing": False}, "scheduler": {"precise_timing": False}}
REINDEX = "services/reindexer.py: REINDEX INDEX CONCURRENTLY {}"
DROP_INDEX = "services/reindexer.py: DROP INDEX CONCURRENTLY IF EXISTS {}"

CASES = [
    Case("cleaner-range", ("jobs.CLEANER_DELETE_RANGE",), jobs("completed", n=3, finalized=OLD), cleaner),
    Case("cleaner-range-per-queue", ("jobs.CLEANER_DELETE_RANGE",),
         jobs("cancelled", n=3, queue="mail", finalized=OLD), cleaner,
         settings={"cleaner": {"queues": {"mail": {"cancelled_retention": "1h"}}}}),
    Case("cleaner-skip-locked", ("jobs.CLEANER_DELETE_RANGE", "jobs.CLEANER_DELETE_RANGE_SKIP_LOCKED"),
         jobs("completed", n=3, finalized=OLD), cleaner, hold=row_locked),
    Case("cleaner-tie", ("jobs.CLEANER_DELETE_TIED",), jobs("discarded", n=3, finalized=f"{OLD} - interval '7 days'"),
         cleaner, settings={"cleaner": {"batch_size": 1}}),
    Case("cleaner-ancient", ("jobs.CLEANER_DELETE_ANCIENT",), jobs("completed", finalized="'-infinity'"), cleaner),
    Case("rescuer-retry", ("jobs.RESCUER_BATCH",), jobs("running", attempted=STUCK), rescuer,
         settings=NO_WAIT, notifies=True),
    Case("rescuer-discard", ("jobs.RESCUER_BATCH",), jobs("running", attempt=3, max_attempts=3, attempted=STUCK),
         rescuer, settings=NO_WAIT, notifies=True),
    Case("rescuer-no-sign-of-life", ("jobs.RESCUER_NO_SIGN_BATCH",), jobs("running"), rescuer,
         settings=NO_WAIT, notifies=True),
    Case("rescuer-future-sign", ("jobs.RESCUER_FUTURE_SIGN_BATCH",),
         jobs("running", attempted="now() + interval '10 years'"), rescuer, settings=NO_WAIT),
    Case("rescuer-exhausted", ("jobs.RESCUER_EXHAUSTED_BATCH",), jobs("available", attempt=5, max_attempts=5),
         rescuer, settings=NO_WAIT),
    Case("scheduler", ("jobs.SCHEDULER_PROMOTE", "jobs.NOTIFY_QUEUES"),
         jobs("scheduled", attempt=0, scheduled="CAST(:t0 AS timestamptz) - interval '1 minute'"), scheduler,
         settings=NO_WAIT, notifies=True),
    Case("periodic-job", ("periodic_slots.TAKE", "jobs.ENQUEUE", "periodic_slots.LINK_JOB"), lambda env: None,
         periodic, settings={"periodic": [{"id": "job", **HOURLY, "run_on_start": True}]}),
    Case("periodic-slot", ("periodic_slots.TAKE",), lambda env: None, periodic,
         settings={"periodic": [{"id": "slot", **HOURLY}]}),
    Case("periodic-job-key-replace", ("periodic_slots.TAKE", "jobs.ENQUEUE_REPLACING", "periodic_slots.LINK_JOB"),
         jobs("available", attempt=0, kind="tick", unique_key="periodic:key"), periodic,
         settings={"periodic": [{"id": "key", **HOURLY, "run_on_start": True, "unique_key": True,
                                 "job_key_mode": "replace"}]}),
    Case("periodic-disabled", ("periodic_slots.TAKE_DISABLED",), lambda env: None, periodic,
         settings={"periodic": [{"id": "off", **HOURLY, "enabled": False}]}),
    Case("periodic-schedule-changed", ("periodic_slots.RESTAMP",), slot_of_another_schedule, periodic,
         settings={"periodic": [{"id": "moved", **HOURLY}]}),
    Case("periodic-entry-removed", ("periodic_slots.MARK_REMOVED",), slots(("gone", "CAST(:t0 AS timestamptz)")),
         periodic_after_a_removal),
    Case("periodic-row-error-note", ("periodic_jobs.SET_ERROR",), periodic_row, periodic),
    Case("periodic-prune", ("periodic_slots.PRUNE",),
         slots(("old", "CAST(:t0 AS timestamptz) - interval '100 days'"), ("old", "CAST(:t0 AS timestamptz)")),
         periodic, settings={"periodic": [{"id": "old", **HOURLY}]}),
    Case("reindexer", (DROP_INDEX, REINDEX), invalid_index, reindexer, ddl=True,
         settings={"reindexer": {"enabled": True, "indexes": ["jobs_fetch_idx"]}}),
    Case("partitioner-make-and-drop", ("partitions.MAINTAIN", "partitions.DROP_DETACHED"), expired_partitions,
         partitioner, ddl=True, layout="partitioned",
         settings={"cleaner": {"completed_retention": "1h"}, "partitions": {"interval": "1h", "premake": 2}}),
    Case("service-run-record", ("service_runs.RECORD",), lambda env: None, service_run),
    Case("health-history-sample", ("health.INSERT",), lambda env: None, health_sample),
    Case("health-history-prune", ("health.PRUNE",), history_rows, health_sample),
]


# -- the tests ----------------------------------------------------------------------------------------


def test_every_write_is_fenced_by_a_case_or_listed():
    """A write path that is neither a case nor listed fails here (name it in a Case's ``covers``
    with a case that reaches it, or in NOT_MAINTENANCE with the reason). Listed or covered names
    that no longer write fail too, so the lists stay true."""
    writes = set(write_statements())
    covered = {name for case in CASES for name in case.covers}
    assert not covered & set(NOT_MAINTENANCE), "both a case and listed"
    assert sorted(writes - covered - set(NOT_MAINTENANCE)) == [], "write paths with no fencing case"
    assert sorted((covered | set(NOT_MAINTENANCE)) - writes) == [], "listed, but not a write (any more)"


def test_the_inventory_finds_writes_wherever_they_are_written():
    """The detector itself: statements, literals and f-strings, not prose or privilege names."""
    assert _writes("UPDATE {schema}.jobs AS j SET state = 'x'") and _writes("DELETE FROM {schema}.t")
    assert _writes("SELECT {schema}.detach_partition(:name)") and _writes("SELECT pg_notify(:c, :p)")
    assert _writes("WITH c AS (SELECT id FROM {schema}.jobs FOR NO KEY UPDATE SKIP LOCKED) SELECT 1")
    assert _writes("ALTER TABLE {schema}.jobs DETACH PARTITION {schema}.p CONCURRENTLY")
    assert not _writes("SELECT has_database_privilege(current_database(), 'CREATE')")
    assert not _writes("SELECT min(scheduled_at) FROM {schema}.jobs -- DELETE FROM nothing")
    found = literal_statements()
    assert REINDEX in found and DROP_INDEX in found  # f-strings in a service
    assert not any("cleaner.py" in name for name in found)  # its docstrings are prose


@pytest.mark.parametrize("case, layout", [(c, c.layout) for c in CASES], ids=[c.name for c in CASES],
                         indirect=["layout"])
def test_a_stale_fence_writes_nothing(case: Case, pg_dsn, schema, engine, layout):
    settings = Settings(database_url=pg_dsn, schema=schema, instance_id="test-1", layout=layout, **case.settings)
    env = Env(settings, engine, schema, pg_dsn)
    case.seed(env)
    sent = Sent(engine, schema)
    event.listen(engine, "before_cursor_execute", sent)
    inbox = Inbox(pg_dsn, schema)
    try:
        with fences(settings) as (fence, stale), (case.hold or nullcontext)(env):
            before = snapshot(engine, schema)
            with pytest.raises(NotLeader, match=r"^epoch \d+ is no longer the leader's$"):
                case.run(env, env.context(stale))
            stale_sent = sent.take()
            assert snapshot(engine, schema) == before, "written under a stale fence"
            assert inbox.drain() == [], "notified under a stale fence"
            case.run(env, env.context(fence))  # the same pass in the term: it writes
            valid_sent = sent.take()
            assert snapshot(engine, schema) != before, "the case's pass writes nothing: it proves nothing"
            assert bool(inbox.drain(timeout=5.0, stop_after=1) if case.notifies else inbox.drain()) == case.notifies
    finally:
        event.remove(engine, "before_cursor_execute", sent)
        inbox.conn.close()
    assert set(case.covers) <= valid_sent, "the case's pass does not send what it claims to cover"
    if case.ddl:  # no transaction can fence DDL: it is sent only after a proof of leadership
        assert not stale_sent & set(case.covers), "DDL sent under a stale fence"
    else:  # sent, and refused by the database's check before COMMIT
        assert set(case.covers) <= stale_sent, "the stale run never reached the write"
