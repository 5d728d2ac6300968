"""``maintd grants ROLE [--worker]``: the SQL granting a role exactly what the daemon (or, with
``--worker``, a worker following the README's SQL) needs on the configured schema.

Two roles are meant to exist: an *owner* that runs ``maintd migrate`` (it owns the schema and
everything in it, and is the only one that runs DDL), and a *runtime* role for the daemon that
gets these grants and nothing else. ``--apply`` runs them through the configured connection (the
owner's), which is what the deploy files do right after ``migrate``, so an upgrade that adds a
table grants it too. The privileges are declared here, per table, with the reason;
``tests/test_grants.py`` derives them from the SQL in the code and fails when the two disagree.

Notes on what is *not* granted:

* UPDATE on ``periodic_jobs`` (the applications' schedules) is granted on two columns only:
  ``error``, the daemon's note on a row it cannot use, and ``enabled``, so that ``maintd periodic
  pause|resume`` work with the daemon's own config; the script first revokes an UPDATE on the whole
  table (which an earlier maintd granted: a column grant adds to it, it takes nothing away), but
  not from the table's owner (an owner may revoke its own privileges).
* ``jobs.id`` is an identity column: an INSERT draws from its sequence without any privilege on
  it (only ``nextval()``/``currval()`` called by hand would need USAGE).
* The type ``job_state`` and functions are usable by PUBLIC unless revoked; the partition
  functions (SPEC 8.1) are revoked from PUBLIC, and EXECUTE on them is granted.
* The reindexer's ``REINDEX INDEX CONCURRENTLY`` needs ownership of the jobs table (PostgreSQL 17+:
  the MAINTAIN privilege also allows the REINDEX, but not dropping a failed build's leftover
  index), so it is left to the owner role; the output says so in a comment.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError

from . import __version__
from .config import validate_identifier
from .db import quote_ident
from .migrate import (SchemaNotReady, behind, current_revision, grants_lock_key, head_revision, let_go,
                      revisions, take_lock)
from .partitions import definer_functions as partition_functions
from .queries import catalog

PRIVILEGE_ORDER = ("SELECT", "INSERT", "UPDATE", "DELETE")
RESERVED_ROLES = {"public", "none", "current_user", "current_role", "session_user"}


@dataclass(frozen=True)
class TableGrant:
    table: str
    privileges: tuple[str, ...]
    why: str
    # UPDATE on these columns only (a column-level grant); empty: on the whole table.
    update_columns: tuple[str, ...] = ()


# What the daemon runs: the services, leader election and fencing, registration, pass records,
# job gauges, /status, and the schema revision check.
DAEMON: tuple[TableGrant, ...] = (
    TableGrant("alembic_version", ("SELECT",),
               "schema revision check at start; `maintd migrate` on a current schema"),
    TableGrant("jobs", ("SELECT", "INSERT", "UPDATE", "DELETE"),
               "cleaner DELETE, rescuer/scheduler UPDATE, periodic INSERT, gauges SELECT "
               "(SELECT ... FOR UPDATE needs UPDATE)"),
    TableGrant("leader", ("SELECT", "INSERT", "UPDATE"),
               "election (INSERT ... ON CONFLICT DO UPDATE), renewal, fencing "
               "(FOR UPDATE / FOR KEY SHARE need UPDATE)"),
    TableGrant("daemons", ("SELECT", "INSERT", "UPDATE", "DELETE"),
               "replica registration; DELETE forgets replicas silent for an hour"),
    TableGrant("service_runs", ("SELECT", "INSERT", "UPDATE"), "last pass of each service"),
    TableGrant("periodic_slots", ("SELECT", "INSERT", "UPDATE", "DELETE"),
               "exactly-once slot per periodic entry; DELETE prunes old history"),
    TableGrant("periodic_jobs", ("SELECT", "UPDATE"),
               "periodic schedules kept as rows; UPDATE of error (the daemon's note on a bad row) and "
               "enabled (`maintd periodic pause|resume` with the daemon's config) only; applications that "
               "add, change or remove schedules need SELECT/INSERT/UPDATE/DELETE of their own",
               update_columns=("error", "enabled")),
    TableGrant("health_history", ("SELECT", "INSERT", "DELETE"),
               "the dashboard's charts: the leader's samples (INSERT ... ON CONFLICT needs SELECT); "
               "DELETE: the leader prunes samples older than two days (hourly)"),
)

# Functions the daemon calls whose EXECUTE is revoked from PUBLIC: the partitioned layout's DDL
# (SPEC 8.1), run as the schema's owner (SECURITY DEFINER) so that this role needs no DDL right.
# Granted on every schema (they exist whatever the layout), so a schema converted later works.
_FUNCTION_USE = {
    "maintain_partitions": "make partitions ahead, move stray rows, empty and detach partitions past retention",
    "drop_detached_partitions": "drop the partitions it detached",
    "catch_all_rows": "count the stray rows left in the catch-all partitions",
}
DAEMON_FUNCTIONS: tuple[tuple[str, str], ...] = tuple(
    (signature, f"partitioned layout: {_FUNCTION_USE[signature.split('(')[0]]} (runs as the schema's owner)")
    for signature in partition_functions())

# The README's worker SQL: enqueue, claim, heartbeat, complete, fail, cancel.
WORKER: tuple[TableGrant, ...] = (
    TableGrant("jobs", ("SELECT", "INSERT", "UPDATE"),
               "enqueue (ON CONFLICT/RETURNING need SELECT), claim (FOR UPDATE SKIP LOCKED needs "
               "UPDATE), heartbeat, complete, fail, cancel; no DELETE: the cleaner removes finished jobs"),
)


def validate_role(role: str) -> str:
    """A role name as ``CREATE ROLE name`` (unquoted) makes it: lower-case identifier rules."""
    validate_identifier(role, "role name")
    if role in RESERVED_ROLES:
        raise ValueError(f"invalid role name {role!r}: reserved by PostgreSQL")
    return role


def grant_statements(schema: str, role: str, *, worker: bool = False) -> list[tuple[str, str]]:
    """(``GRANT`` statement, reason) pairs for one schema; identifiers validated and quoted."""
    q_schema, q_role = quote_ident(schema), quote_ident(validate_role(role))
    out = [(f"GRANT USAGE ON SCHEMA {q_schema} TO {q_role};", "look up maintd's tables")]
    for grant in WORKER if worker else DAEMON:
        table = f"{q_schema}.{quote_ident(grant.table)}"
        if grant.update_columns:  # a column grant adds to one on the whole table: take that back first
            out.append((_revoke_update(table, q_role),
                        f"the daemon may update some columns of {grant.table} only: an UPDATE on the whole "
                        "table (an earlier maintd's grant) and its column grants are taken back first "
                        "(not from the table's owner, which would lose its own)"))
        privileges = ", ".join(_privilege(p, grant) for p in PRIVILEGE_ORDER if p in grant.privileges)
        out.append((f"GRANT {privileges} ON TABLE {table} TO {q_role};", grant.why))
    for signature, why in () if worker else DAEMON_FUNCTIONS:
        out.append((f"GRANT EXECUTE ON FUNCTION {q_schema}.{signature} TO {q_role};", why))
    return out


def _revoke_update(table: str, q_role: str) -> str:
    """REVOKE UPDATE on ``table`` from the role, unless it owns the table: an owner may revoke its
    own privileges, and `maintd grants OWNER` left the owner unable to change a schedule. (The
    identifiers are validated: no quote or dollar sign in them.)"""
    return (f"DO $$BEGIN IF (SELECT relowner FROM pg_catalog.pg_class WHERE oid = CAST('{table}' AS "
            f"pg_catalog.regclass)) <> CAST('{q_role}' AS pg_catalog.regrole) THEN REVOKE UPDATE ON TABLE "
            f"{table} FROM {q_role}; END IF; END$$;")


def _privilege(privilege: str, grant: TableGrant) -> str:
    if privilege == "UPDATE" and grant.update_columns:
        return f"{privilege} ({', '.join(quote_ident(c) for c in grant.update_columns)})"
    return privilege


def render(schemas: list[str], role: str, *, worker: bool = False, partitioned: Collection[str] = ()) -> str:
    """The full script for psql: one transaction, a block per schema, reasons as comments.
    ``partitioned``: the schemas configured with the partitioned layout, whose MAINTAIN example
    names ``jobs_live`` (MAINTAIN on the partitioned ``jobs`` does not reach it)."""
    validate_role(role)
    who = "a worker" if worker else "the maintd daemon"
    lines = [
        f"-- maintd {__version__}: what {who} needs, granted to role {quote_ident(role)}.",
        "-- Run as the owner role (the one that runs `maintd migrate`), after `maintd migrate`,",
        "-- and again after every upgrade (new tables need new grants; `--apply` does both). E.g.:",
        f"--   maintd grants {role}{' --worker' if worker else ''} | psql -v ON_ERROR_STOP=1 \"$OWNER_URL\"",
        "BEGIN;",
    ]
    for schema in schemas:
        lines.append(f"-- schema {quote_ident(schema)}")
        for statement, why in grant_statements(schema, role, worker=worker):
            lines += [f"-- {why}", statement]
    lines.append("-- jobs.id is an identity column: INSERT needs no privilege on its sequence.")
    if not worker:
        lines += [
            "-- Not granted: the reindexer (off by default) needs ownership of the jobs table's indexes",
            "-- (REINDEX INDEX CONCURRENTLY, dropping a failed build's leftover index) or, on PostgreSQL",
            "-- 17+, MAINTAIN on the table (the partitioned layout: on jobs_live), which the owner may grant",
            "-- (the daemon then names a failed build's leftovers for the owner to drop):",
            *(f"--   GRANT MAINTAIN ON TABLE {quote_ident(schema)}."
              f"{quote_ident('jobs_live' if schema in partitioned else 'jobs')} TO {quote_ident(role)};"
              for schema in schemas),
            "-- Otherwise keep reindexer.enabled = false for this role: `maintd run-once reindexer` as the",
            "-- owner needs the leader lock the daemons hold; run REINDEX INDEX CONCURRENTLY as the owner.",
            "-- Optional, as a superuser (not applied by --apply): the table-health read names other",
            "-- roles' sessions holding back vacuum by pid, user and application_name; with",
            f"--   GRANT pg_read_all_stats TO {quote_ident(role)};",
            "-- it also shows their state, client address and transaction start (the age in seconds),",
            "-- and, with health.show_query = true, their query text.",
        ]
    lines.append("COMMIT;")
    return "\n".join(lines) + "\n"


class NotGranted(RuntimeError):
    """``--apply`` run by a role that may not grant on the schema's objects (not their owner)."""


# SQLSTATE 01007 privilege_not_granted: a GRANT by a role holding some of the privileges but not
# their grant option is a warning, not an error ("no privileges were granted for ...", PostgreSQL's
# GRANT page, "Notes"): the daemon's own role applying a worker's grants granted nothing, and said
# it had granted them.
PRIVILEGE_NOT_GRANTED = "01007"
# SQLSTATE 01006 privilege_not_revoked: the same warning for a REVOKE (the column-limited grants'
# REVOKE of UPDATE on the whole table, run by a role without the grant option).
PRIVILEGE_NOT_REVOKED = "01006"


def _check_revision(conn: Connection, schema: str) -> None:
    """Raise :class:`maintd.migrate.SchemaNotReady` when the schema is at an older revision than
    this maintd's: its grants name tables a later migration adds, and the first of them failed
    the whole script with 'relation "S.health_history" does not exist', saying nothing of
    `maintd migrate`. Read only by a role that owns the tables (one that does not is refused
    by the grants themselves, naming the owner); a revision newer than this maintd's is left be."""
    state = conn.execute(text(catalog.SCHEMA_PRIVILEGES), {"schema": schema}).one()
    current = current_revision(conn, schema) if state.versioned and state.owns_tables else None
    conn.rollback()
    if current is not None and current != head_revision() and current in revisions():
        raise SchemaNotReady(f"{behind(schema, current)} first, then grant")


def apply(conn: Connection, schemas: list[str], role: str, *, worker: bool = False) -> int:
    """Run the grants on ``conn`` (as the owner role) in one transaction, under the grants lock
    of each schema (:func:`maintd.migrate.grants_lock_key`), so replicas applying them at once do not collide. Returns the statement count.
    Raises :class:`NotGranted`, with nothing granted, when the connected role may not grant them."""
    refused: list[str] = []
    raw = conn.connection.driver_connection

    def on_notice(diag: Any) -> None:
        if diag.sqlstate in (PRIVILEGE_NOT_GRANTED, PRIVILEGE_NOT_REVOKED):
            refused.append(diag.message_primary)

    raw.add_notice_handler(on_notice)
    count = 0
    # Waited for by tries in short transactions (migrate.take_lock), before the grants' transaction:
    # waited for in it (pg_advisory_xact_lock), with a snapshot, it deadlocked with the CREATE
    # INDEX CONCURRENTLY of a migration holding the lock, which waits for every older snapshot.
    keys = sorted({grants_lock_key(schema) for schema in schemas})
    taken: list[int] = []
    try:
        for key in keys:
            take_lock(conn, key)
            taken.append(key)
        for schema in schemas:
            _check_revision(conn, schema)
        with conn.begin():
            for schema in schemas:
                owner, me = conn.execute(text(catalog.SCHEMA_OWNER), {"schema": schema}).one()
                for statement, _ in grant_statements(schema, role, worker=worker):
                    try:
                        conn.execute(text(statement))
                    except DBAPIError as exc:
                        if getattr(exc.orig, "sqlstate", None) != "42501":
                            raise
                        refused.append(str(exc.orig).splitlines()[0])
                    if refused:  # the transaction rolls back: nothing is granted
                        raise NotGranted(f"{refused[0]}: role {me} may not grant on schema {schema}; run "
                                         f"`maintd grants {role}{' --worker' if worker else ''} --apply` as the schema's owner, {owner}")
                    count += 1
    except BaseException:
        let_go(conn, taken, quiet=True)  # (the server that stopped answering is not asked again)
        raise
    else:
        let_go(conn, taken)
    finally:
        raw.remove_notice_handler(on_notice)
    return count
