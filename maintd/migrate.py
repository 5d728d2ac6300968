"""``maintd migrate``: Alembic revisions applied under an advisory lock, so several replicas
starting at once apply them exactly once.

The revision is read first, from the catalog and ``alembic_version``: a schema already at the
target needs no DDL and no CREATE privilege, so the daemon's runtime role (``maintd grants``) can
run ``migrate`` at start and get ``nothing to do``. Real work is done by the owner role; a role that
lacks what the work needs gets one line naming the privilege and the object, checked before any DDL.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import re
import time
import zlib
from typing import Callable
from dataclasses import dataclass
from datetime import timedelta
from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from psycopg import errors as pg_errors
from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError

from .identifiers import quote_ident
from .queries import catalog

LOCK_POLL = 0.2  # seconds between tries for the migrate lock
WAIT_SAID = 2.0  # seconds of waiting for it before a command says who holds it
# The longest a migration's statement waits for a table lock: while it waits, every session that
# wants that table queues behind it, so a long transaction on the table (a report, pg_dump, a
# worker's) must not hold them all up. The migrations are tried again, LOCK_RETRY_PAUSE apart,
# for LOCK_WAIT seconds; CREATE INDEX CONCURRENTLY, which blocks no one, waits as long as it needs.
LOCK_TIMEOUT = "1s"
LOCK_RETRY_PAUSE = 1.0
LOCK_WAIT = 600.0


def _script_location() -> str:
    return str(Path(str(resources.files("maintd.migrations"))))


@dataclass(frozen=True)
class Layout:
    """What ``migrate`` builds for a new schema (SPEC 8.1): ``plain`` or ``partitioned``, with
    the partitioned layout's step and how many steps are made ahead."""

    name: str = "plain"
    step: timedelta = timedelta(hours=1)
    premake: int = 24

    @classmethod
    def of(cls, settings) -> "Layout":
        return cls(settings.layout, settings.partitions.interval, settings.partitions.premake)


PLAIN = Layout()


def alembic_config(schema: str, layout: Layout = PLAIN) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", _script_location())
    cfg.attributes["schema"] = schema
    cfg.attributes["layout"] = layout.name
    cfg.attributes["partitions"] = layout
    return cfg


def lock_key(schema: str) -> int:
    """The advisory lock serializing DDL and GRANTs on a schema (concurrent GRANTs on one table
    fail with 'tuple concurrently updated')."""
    return zlib.crc32(f"maintd-migrate:{schema}".encode()) - (1 << 31)


def grants_lock_key(schema: str) -> int:
    """The advisory lock serializing GRANTs on a schema's objects (``maintd grants --apply``):
    taken by a migration for its whole run (a grant waits for the tables it adds) and by a
    conversion for its swap alone (which moves the grants of jobs), not for its copy of hours."""
    return zlib.crc32(f"maintd-grants:{schema}".encode()) - (1 << 31)


@functools.cache
def _scripts() -> ScriptDirectory:
    """The migration scripts shipped with this package: read once per process (6 ms a read, paid
    by every target's schema check at start: 1.3 s for 200 targets)."""
    return ScriptDirectory.from_config(alembic_config("maintd"))


def head_revision() -> str:
    return _scripts().get_current_head() or ""


class SchemaNotReady(RuntimeError):
    """The schema is missing or behind this maintd (one line, naming what to run)."""


def check_ready(engine, schema: str) -> bool:
    """Raise :class:`SchemaNotReady` unless the schema has maintd's tables at this maintd's
    revision; else return whether its jobs table is partitioned (read on the same connection)."""
    from .db import connected_to
    from .identifiers import qualified

    with engine.connect() as conn:
        current = current_revision(conn, schema)
        has_jobs = conn.execute(text(catalog.TABLE_EXISTS), {"qualified": qualified(schema, "jobs")}).scalar()
        partitioned = bool(conn.execute(text(catalog.JOBS_PARTITIONED), {"schema": schema}).scalar())
        where = connected_to(conn)
    if current is None or not has_jobs:
        raise SchemaNotReady(f"schema {schema!r} has no maintd tables in {where}: run `maintd migrate` first")
    if current != head_revision():
        raise SchemaNotReady(behind(schema, current))
    return partitioned


def behind(schema: str, current: str | None) -> str:
    """Why a schema at revision ``current`` is not ready for this maintd."""
    return f"schema {schema!r} is at revision {current}, this maintd needs {head_revision()}: run `maintd migrate`"


class MigratePermissionError(RuntimeError):
    """The connected role may not do what the migration needs; the message names the privilege,
    the object and the role to use instead."""


# What the connected role may do, read from the catalog (needs no privilege on the schema).



def current_revision(conn: Connection, schema: str) -> str | None:
    row = conn.execute(text(catalog.SCHEMA_PRIVILEGES), {"schema": schema}).one()
    if not row.versioned:
        return None
    ctx = MigrationContext.configure(conn, opts={"version_table_schema": schema})
    return ctx.get_current_revision()


_UNKNOWN = object()  # a target revision that cannot be resolved without running Alembic
# A relative revision: steps from a named one (``head-1``) or from the schema's own (``+1``).
RELATIVE = re.compile(r"(\w*)[+-][0-9]+")


class BadRevision(ValueError):
    """A relative revision that leads to no migration (``head+1``, ``+1`` on a current schema):
    bad usage. ``option`` is the argument at fault: ``revision``, ``downgrade`` or ``start``."""

    def __init__(self, option: str, revision: str, exc: Exception):
        self.option, self.revision = option, revision
        why = str(exc).strip() or "no such revision"  # Alembic's bare assert for head+N
        super().__init__(f"{why} (known: base, {', '.join(revisions())}, head; relative: -1, head-2, +1)")


def revisions() -> list[str]:
    """The migrations' revision ids, oldest first."""
    return [script.revision for script in reversed(list(_scripts().walk_revisions()))]


def known_revision(name: str) -> bool:
    """Whether ``name`` is a revision Alembic can find (an id, a unique prefix, head, base)."""
    try:
        _scripts().get_revisions(name)
        return True
    except Exception:  # alembic.util.CommandError and its kin
        return False


def _resolve(revision: str):
    """The single revision id ``revision`` names (``None`` for base), or ``_UNKNOWN``: also for
    a relative one ("-1"), which Alembic resolves against the schema's revision when run (its
    ``get_revisions`` reads "-1" from head: a schema a revision behind was "there already")."""
    if RELATIVE.fullmatch(revision):
        return _UNKNOWN
    try:
        revs = _scripts().get_revisions(revision)
    except Exception:  # relative ("+1") or unknown revisions: Alembic reports them when run
        return _UNKNOWN
    if not revs:
        return None
    return revs[0].revision if len(revs) == 1 else _UNKNOWN


def upgrade(conn: Connection, schema: str, revision: str = "head", layout: Layout = PLAIN, *,
            waiting: Callable[[str], None] | None = None) -> tuple[str | None, str | None]:
    """Apply migrations up to ``revision``. Returns (before, after). Safe to run concurrently.
    ``layout`` is what a new schema's jobs table is built as (an existing one is left as it is);
    ``waiting`` is told once when another run holds the migrate lock (:func:`take_lock`)."""
    return _run(conn, schema, _resolve(revision), _relative("revision", revision, command.upgrade), layout,
                waiting=waiting, command="maintd migrate" + ("" if revision == "head" else f" --revision {revision}"))


def downgrade(conn: Connection, schema: str, revision: str, *,
              waiting: Callable[[str], None] | None = None) -> tuple[str | None, str | None]:
    return _run(conn, schema, _resolve(revision), _relative("downgrade", revision, command.downgrade),
                waiting=waiting, creates=False, command=f"maintd migrate --downgrade {revision}")


def _relative(option: str, revision: str, step):
    """Alembic's ``step(cfg, revision)``; a revision that resolves to none (Alembic raises only
    when run, relative to the schema's revision) is :class:`BadRevision`."""
    def action(cfg: AlembicConfig) -> None:
        try:
            step(cfg, revision)
        except (CommandError, AssertionError) as exc:
            if not RELATIVE.fullmatch(revision):
                raise  # a named revision: the fault is elsewhere (the schema's own revision, say)
            raise BadRevision(option, revision, exc) from None
    return action


def _run(conn: Connection, schema: str, target, action, layout: Layout = PLAIN, *,
         waiting: Callable[[str], None] | None = None, creates: bool = True,
         command: str = "maintd migrate") -> tuple[str | None, str | None]:
    """``action`` (an upgrade or a downgrade to ``target``) under the migrate locks; a privilege
    error names ``command``, the one run, to run as the owner role instead."""
    if _at(conn, schema, target):  # no lock to wait for (a conversion holds it for hours)
        return target, target
    key, grants_key = lock_key(schema), grants_lock_key(schema)
    take_lock(conn, key, waiting=waiting and (lambda holder: waiting(f"schema {schema}: waiting for {holder}")))
    take_lock(conn, grants_key)
    try:
        result = _migrate(conn, schema, target, action, layout, creates=creates, command=command)
    except BaseException as exc:
        let_go(conn, [key, grants_key], quiet=True)
        if isinstance(exc, DBAPIError) and isinstance(exc.orig, pg_errors.InsufficientPrivilege):
            raise MigratePermissionError(
                f"{str(exc.orig).strip().splitlines()[0]}: run `{command}` as the owner role "
                f"of schema {schema!r}") from None
        raise
    let_go(conn, [key, grants_key])
    return result


def jobs_partitioned(op) -> bool:
    """In a migration: whether the schema's jobs table is partitioned (SPEC 8.1), read from the
    catalog (offline, from the layout asked for)."""
    ctx = op.get_context()
    if ctx.as_sql:
        return ctx.config.attributes.get("layout") == "partitioned"
    return bool(op.get_bind().execute(text(catalog.JOBS_PARTITIONED),
                                      {"schema": ctx.version_table_schema}).scalar())


def build_index_concurrently(op, name: str, definition: str) -> None:
    """In a migration: ``CREATE INDEX CONCURRENTLY`` of ``name`` on the schema's jobs table
    (``definition``: the columns and any ``WHERE``), outside a transaction so that workers keep
    writing while it builds. A build interrupted half-way leaves an invalid index: it is dropped
    first and built again. A partitioned jobs table was built with its indexes (migration 0001)."""
    if jobs_partitioned(op):
        return
    schema = quote_ident(op.get_context().version_table_schema)
    with op.get_context().autocommit_block():
        op.execute(f"""
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
              WHERE c.relname = '{name}' AND c.relnamespace = '{schema}'::regnamespace
                AND NOT i.indisvalid) THEN
    EXECUTE 'DROP INDEX {schema}.{name}';
  END IF;
END $$""")
        _without_lock_timeout(op, f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {schema}.jobs {definition}")


def drop_index_concurrently(op, name: str) -> None:
    """In a migration's downgrade: the index built by :func:`build_index_concurrently`."""
    if jobs_partitioned(op):
        return
    schema = quote_ident(op.get_context().version_table_schema)
    with op.get_context().autocommit_block():
        _without_lock_timeout(op, f"DROP INDEX CONCURRENTLY IF EXISTS {schema}.{name}")


# Autovacuum settings of the jobs table (SPEC 8.2), set by revision 0007: a queue's table churns
# (every job is inserted, updated at least twice and deleted) while its waiting rows are few, so
# vacuum must come after a fixed number of dead rows, not after a fifth of a table that mostly
# holds finished jobs kept for their retention (PostgreSQL's autovacuum_vacuum_scale_factor 0.2
# waited for 400,000 dead rows with 2 M finished jobs retained). Measured in bench/autovacuum.py;
# the README's "When the queue bloats" gives the numbers.
JOBS_AUTOVACUUM = {
    "autovacuum_vacuum_scale_factor": "0.01",
    "autovacuum_vacuum_threshold": "1000",
    "autovacuum_analyze_scale_factor": "0.02",
    "autovacuum_analyze_threshold": "1000",
}


def jobs_autovacuum_sql(schema: str, *, reset: bool = False) -> str:
    """``ALTER TABLE ... SET (JOBS_AUTOVACUUM)`` (or ``RESET``) on the schema's jobs table; on the
    partitioned layout (a partitioned table takes no storage parameters) on every leaf partition
    that holds live jobs: the leaves under a partition whose bound lists ``'available'``. A final
    state's partitions are only inserted into and then dropped: vacuum owes them nothing. (No
    ``%`` in it: Alembic's ``--sql`` output would print it doubled.)"""
    q = quote_ident(schema)
    params = ", ".join(JOBS_AUTOVACUUM) if reset else ", ".join(f"{k} = {v}" for k, v in JOBS_AUTOVACUUM.items())
    action = f"{'RESET' if reset else 'SET'} ({params})"
    return f"""
DO $$
DECLARE
  leaf regclass;
BEGIN
  IF (SELECT relkind FROM pg_class WHERE oid = '{q}.jobs'::regclass) <> 'p' THEN
    EXECUTE 'ALTER TABLE {q}.jobs {action}';
    RETURN;
  END IF;
  FOR leaf IN
    SELECT t.relid::regclass FROM pg_partition_tree('{q}.jobs'::regclass) t
     WHERE t.isleaf AND EXISTS (
           SELECT 1 FROM pg_partition_ancestors(t.relid) a JOIN pg_class c ON c.oid = a.relid
            WHERE strpos(pg_get_expr(c.relpartbound, c.oid), '''available''') > 0)
  LOOP
    EXECUTE 'ALTER TABLE ' || leaf::text || ' {action}';
  END LOOP;
END $$"""


def release_lock(conn: Connection, key: int) -> None:
    """Give the schema's migrate lock (:func:`take_lock`) back."""
    conn.execute(text(catalog.ADVISORY_UNLOCK), {"k": key})
    conn.commit()


def let_go(conn: Connection, keys: list[int], *, quiet: bool = False) -> None:
    """End the transaction and give the locks ``keys`` (:func:`take_lock`) back, the last taken
    first. A connection an error invalidated is not used again: it would reconnect, to a server
    that may not answer, and that error would hide the first; its session, and the locks with it,
    ended. ``quiet`` (another error is on its way): an error here is not raised over it."""
    if conn.invalidated:
        return
    try:
        conn.rollback()
        for key in reversed(keys):
            release_lock(conn, key)
    except Exception:
        if not quiet:
            raise


def take_lock(conn: Connection, key: int, *, waiting: Callable[[str], None] | None = None) -> None:
    """Wait for the schema's migrate lock by polling, not in ``pg_advisory_lock``: a session
    blocked in a statement keeps a snapshot open, and ``CREATE INDEX CONCURRENTLY`` in the holder's
    migration waits for every such snapshot, a deadlock. Each try is a short transaction. After
    ``WAIT_SAID`` s, ``waiting`` is told once who holds it (a migration or a conversion of hours:
    a command that waits says so, instead of looking hung)."""
    say_at = time.monotonic() + WAIT_SAID
    while True:
        got = conn.execute(text(catalog.TRY_ADVISORY_LOCK), {"k": key}).scalar()
        if not got and waiting is not None and time.monotonic() >= say_at:
            holders = conn.execute(text(catalog.ADVISORY_HOLDERS), {"k": key}).all()
            waiting("the migrate lock, held by " + (", ".join(
                f"pid {h.pid} ({h.application_name or 'no application_name'}, since {h.backend_start:%Y-%m-%d %H:%M:%S %Z})"
                for h in holders) or "a session that has just let it go"))
            waiting = None
        conn.commit()
        if got:
            return
        time.sleep(LOCK_POLL)


def revision_for_sql(conn: Connection, schema: str) -> str:
    """The schema's revision ('base' when it has none) for ``migrate --sql``, which prints what is
    left to do; raises :class:`MigratePermissionError` when the role cannot look into the schema."""
    state = conn.execute(text(catalog.SCHEMA_PRIVILEGES), {"schema": schema}).one()
    if state.schema_exists and not state.schema_usage:
        owner = state.tables_owner or state.schema_owner
        raise MigratePermissionError(
            f"role {state.role!r} lacks USAGE on schema {schema!r} (needed to read its revision): run "
            f"`maintd migrate --sql` as the owner role{f' ({owner!r})' if owner else ''}, or name the "
            "schema's revision with --from")
    return current_revision(conn, schema) or "base"


def layout_for_sql(conn: Connection, schema: str, configured: Layout) -> Layout:
    """The layout ``migrate --sql`` prints for: the jobs table's, as ``migrate`` reads it from
    the catalog (:func:`jobs_partitioned`); the configured one only for a schema without it (the
    config's layout shapes a new table, and may be set ahead of a conversion)."""
    from .identifiers import qualified

    if not conn.execute(text(catalog.TABLE_EXISTS), {"qualified": qualified(schema, "jobs")}).scalar():
        return configured
    partitioned = bool(conn.execute(text(catalog.JOBS_PARTITIONED), {"schema": schema}).scalar())
    return dataclasses.replace(configured, name="partitioned" if partitioned else "plain")


def _at(conn: Connection, schema: str, target) -> bool:
    """Whether the schema is at ``target`` already (read before the migrate lock is waited for)."""
    if target is _UNKNOWN:
        return False
    state = conn.execute(text(catalog.SCHEMA_PRIVILEGES), {"schema": schema}).one()
    current = current_revision(conn, schema) if state.schema_usage else None
    conn.commit()
    return current == target and state.schema_usage and (state.versioned or target is None)


def _migrate(conn: Connection, schema: str, target, action, layout: Layout = PLAIN,
             creates: bool = True, command: str = "maintd migrate") -> tuple[str | None, str | None]:
    state = conn.execute(text(catalog.SCHEMA_PRIVILEGES), {"schema": schema}).one()
    before = current_revision(conn, schema) if state.schema_usage else None
    conn.commit()
    # Already there: no DDL, no CREATE privilege needed (a schema the role cannot look into has
    # no revision it could read: check_privileges names the USAGE it lacks).
    readable = state.schema_usage or not state.schema_exists
    if before == target and (state.versioned or target is None) and readable:
        return before, before
    check_privileges(state, schema, creates=creates, command=command)
    if not state.schema_exists:
        conn.execute(text(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(schema)}"))
        conn.commit()
    cfg = alembic_config(schema, layout)
    cfg.attributes["connection"] = conn
    _apply(conn, schema, cfg, action)
    after = current_revision(conn, schema)
    conn.commit()
    return before, after


class MigrateLockTimeout(RuntimeError):
    """A lock a migration needs was held by another transaction for LOCK_WAIT seconds."""


def _apply(conn: Connection, schema: str, cfg: AlembicConfig, action) -> None:
    """``action(cfg)`` with every lock waited for at most LOCK_TIMEOUT, tried again until LOCK_WAIT
    (a try that met a held lock rolls back: what an index built concurrently committed stays, and
    the next try goes on from there); the session's own lock_timeout is set back after."""
    was = conn.execute(text(catalog.TIMEOUTS)).one().lock_timeout
    deadline = time.monotonic() + LOCK_WAIT
    try:
        while True:
            conn.execute(text(catalog.SET_SESSION), {"name": "lock_timeout", "value": LOCK_TIMEOUT})
            conn.commit()
            try:
                action(cfg)
                conn.commit()
                return
            except DBAPIError as exc:
                if not isinstance(exc.orig, pg_errors.LockNotAvailable):
                    raise
                conn.rollback()
                if time.monotonic() >= deadline:
                    raise MigrateLockTimeout(
                        f"schema {schema!r}: another transaction held a lock the migration needs for "
                        f"{LOCK_WAIT:.0f} s ({str(exc.orig).strip().splitlines()[0]}; each try waits at most "
                        f"{LOCK_TIMEOUT} so that the others do not queue behind it): end the long "
                        "transaction (pg_stat_activity, oldest xact_start) and run `maintd migrate` again") from None
                time.sleep(LOCK_RETRY_PAUSE)
    finally:
        conn.rollback()
        conn.execute(text(catalog.SET_SESSION), {"name": "lock_timeout", "value": was})
        conn.commit()


def _without_lock_timeout(op, statement: str) -> None:
    """In an autocommit block: ``statement`` (a concurrent index build or drop, which blocks no
    worker but waits for the transactions of the moment) with no lock_timeout, set back after."""
    if op.get_context().as_sql:
        op.execute(statement)
        return
    bind = op.get_bind()
    was = bind.execute(text(catalog.TIMEOUTS)).one().lock_timeout
    bind.execute(text(catalog.SET_SESSION), {"name": "lock_timeout", "value": "0"})
    try:
        op.execute(statement)
    finally:
        bind.execute(text(catalog.SET_SESSION), {"name": "lock_timeout", "value": was})


def check_privileges(state, schema: str, creates: bool = True, command: str = "maintd migrate",
                     making: str = "maintd's tables") -> None:
    """Before any DDL: raise :class:`MigratePermissionError` naming what the role lacks (for a
    downgrade, not ``creates``, the tables' ownership first: it drops them), and the command
    (``command``: the one run, e.g. ``maintd migrate --convert partitioned``) to run as the
    owner role instead."""
    owner = state.tables_owner or state.schema_owner
    fix = f"run `{command}` as the owner role ({owner!r})" if owner else \
        f"run `{command}` as the owner role"
    if not state.schema_exists and not state.database_create:
        raise MigratePermissionError(
            f"role {state.role!r} lacks CREATE on database {state.database!r} (needed to create "
            f"schema {schema!r}): {fix}, or have an administrator run "
            f"CREATE SCHEMA {quote_ident(schema)} AUTHORIZATION <owner role>")
    if state.schema_exists and not state.schema_usage:
        raise MigratePermissionError(
            f"role {state.role!r} lacks USAGE on schema {schema!r} (needed to read its revision): {fix}")
    if state.schema_exists and not state.schema_create and (creates or state.owns_tables):
        raise MigratePermissionError(
            f"role {state.role!r} lacks CREATE on schema {schema!r} (needed to create {making}): {fix}")
    if state.versioned and not state.owns_tables:
        raise MigratePermissionError(
            f"role {state.role!r} does not own the tables of schema {schema!r} (needed to "
            f"{'alter' if creates else 'drop or alter'} them): {fix}")


def offline_sql(schema: str, revision: str = "head", start: str | None = None, layout: Layout = PLAIN,
                *, down: bool = False) -> str:
    """The SQL of the migrations from ``start`` (None: base) to ``revision`` (down to it with
    ``down``), for a DBA to review or apply by hand; a comment saying so when there is nothing
    to do."""
    target = _resolve(revision)
    begin = None if start in (None, "base") else _resolve(start)
    if target is not _UNKNOWN and begin is not _UNKNOWN and begin == target:
        return (f"-- schema {schema} is at revision {target or 'base'}"
                f"{' (head)' if target == head_revision() else ''}; nothing to do\n")
    buf = io.StringIO()
    cfg = alembic_config(schema, layout)
    cfg.attributes["output_buffer"] = buf
    try:
        if down:  # Alembic's offline downgrade needs its start named
            command.downgrade(cfg, f"{start or 'base'}:{revision}", sql=True)
        else:
            command.upgrade(cfg, f"{start}:{revision}" if begin is not None else revision, sql=True)
    except (CommandError, AssertionError) as exc:  # a relative --from or --revision leading nowhere
        blamed = ("start", start) if begin is _UNKNOWN else ("downgrade" if down else "revision", revision)
        raise BadRevision(*blamed, exc) from None
    return buf.getvalue()
