"""``maintd migrate --convert partitioned``: a live plain ``jobs`` table becomes the partitioned
layout (SPEC 8.1) while workers and the daemon keep running. Run by the schema's owner.

1. *Prepare* (once): ``jobs_conv``, partitioned like a new table (maintd/partitions.py), its index
   names suffixed ``_conv``; ``jobs_convert_seen`` (ids already in ``jobs_conv``); a progress row;
   and a trigger on ``jobs`` that repeats every insert, update and delete in ``jobs_conv`` (in the
   writer's transaction, as the owner: ``SECURITY DEFINER``) and notes the id as seen. Creating
   the trigger waits at most ``LOCK_TIMEOUT`` for the writers of the moment (and is tried again).
2. *Copy*, live jobs first (``available``, ``scheduled``, ``running``, ``retryable``), then final
   ones, each in id order, ``BATCH`` rows per transaction: the rows are locked ``FOR SHARE`` (a
   worker changing one waits for that batch; a claim skips it), then those not seen yet are
   copied and noted. A row changed after its copy is repeated by the trigger; one changed before
   it was seen already. The cursor is in the progress row after every batch: an interrupted
   conversion resumes there, and the trigger keeps ``jobs_conv`` current meanwhile.
3. *Swap*, in one transaction holding ``jobs`` for a few milliseconds (its ACCESS EXCLUSIVE lock
   is waited for at most ``LOCK_TIMEOUT``, and tried again): the tables, their indexes and the
   identity sequence change names (the plain table becomes ``jobs_plain``), the identity goes on
   from the plain table's, its grants are given to the new table, and the functions typed by the
   plain table's row (the admin functions) are created again for the new one, with their
   comments and grants. Statements of workers and of the daemon name ``jobs``: their next
   execution plans against the new table.
4. *Clean up*: the trigger went with the swap; ``jobs_plain``, the seen ids and the progress row
   are dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from sqlalchemy import Connection, text
from sqlalchemy.exc import OperationalError

from . import partitions
from .identifiers import quote_ident
from .migrate import Layout
from .queries import catalog

BATCH = 5000
LOCK_TIMEOUT_MS = 200  # the longest a worker waits behind the trigger's creation or the swap
SWAP_TRIES = 100
LIVE = "('available', 'scheduled', 'running', 'retryable')"
FINAL = "('completed', 'cancelled', 'discarded')"
PHASES = (("live", LIVE), ("final", FINAL))


class ConvertError(RuntimeError):
    """The conversion cannot go on (e.g. the swap's lock was never free): run it again later."""


@dataclass
class Progress:
    phase: str
    cursor: int
    copied: int


def convert(conn: Connection, schema: str, layout: Layout, say: Callable[[str], None] = print,
            stop: Callable[[], bool] = lambda: False) -> str:
    """Convert (or resume converting) ``schema``'s jobs table. Returns ``"done"``, ``"already"``
    (it is partitioned) or ``"stopped"`` (``stop()`` said so between batches: resumable)."""
    q = quote_ident(schema)
    if conn.execute(text(catalog.JOBS_PARTITIONED), {"schema": schema}).scalar():
        conn.commit()
        say(f"schema {schema}: jobs is partitioned already; nothing to do")
        return "already"
    progress = _prepare(conn, q, schema, layout, say)
    for phase, states in PHASES:
        if _phase_index(progress.phase) > _phase_index(phase):
            continue
        if not _copy(conn, q, phase, states, progress, say, stop):
            say(f"schema {schema}: stopped; run the same command again to resume")
            return "stopped"
    _swap(conn, q, schema, say)
    _clean_up(conn, q)
    say(f"schema {schema}: jobs is partitioned; set layout = \"partitioned\" so the leader keeps its partitions")
    return "done"


def _phase_index(phase: str) -> int:
    return {"live": 0, "final": 1, "swap": 2}[phase]


def _prepare(conn: Connection, q: str, schema: str, layout: Layout, say: Callable[[str], None]) -> Progress:
    """Everything of step 1 that is not there yet; returns the progress to resume from."""
    if not conn.execute(text("SELECT to_regclass(:t) IS NOT NULL"), {"t": f"{q}.jobs_conv"}).scalar():
        say(f"schema {schema}: preparing jobs_conv (partitioned), the seen ids and the sync trigger")
        conn.execute(text(f"CREATE TABLE {q}.jobs_conv (LIKE {q}.jobs INCLUDING DEFAULTS INCLUDING CONSTRAINTS "
                          "INCLUDING IDENTITY) PARTITION BY LIST (state)"))
        for statement in [*partitions.partitions_ddl(schema, "jobs_conv", "_conv"),
                          *partitions.start_sql(schema, layout.step),
                          *partitions.premake_sql(schema, layout.step, layout.premake)]:
            conn.execute(text(statement))
        conn.execute(text(f"CREATE TABLE {q}.jobs_convert_seen (id bigint PRIMARY KEY)"))
        conn.execute(text(f"CREATE TABLE {q}.jobs_convert_progress (phase text NOT NULL, cursor bigint NOT NULL, "
                          "copied bigint NOT NULL)"))
        conn.execute(text(f"INSERT INTO {q}.jobs_convert_progress VALUES ('live', 0, 0)"))
        conn.connection.dbapi_connection.execute(SYNC_FUNCTION.replace("{q}", q))
        conn.commit()
    if not conn.execute(text("SELECT count(*) FROM pg_trigger WHERE tgrelid = to_regclass(:t) "
                             "AND tgname = 'jobs_convert_sync'"), {"t": f"{q}.jobs"}).scalar():
        _with_lock_timeout(conn, f"CREATE TRIGGER jobs_convert_sync AFTER INSERT OR UPDATE OR DELETE ON {q}.jobs "
                                 f"FOR EACH ROW EXECUTE FUNCTION {q}.jobs_convert_sync()", "the sync trigger")
    row = conn.execute(text(f"SELECT phase, cursor, copied FROM {q}.jobs_convert_progress")).one()
    conn.commit()
    return Progress(*row)


def _with_lock_timeout(conn: Connection, statement: str, what: str) -> float:
    """Run DDL that locks ``jobs``, waiting at most LOCK_TIMEOUT_MS per try; returns how long the
    lock was held (the try that got it)."""
    for _ in range(SWAP_TRIES):
        try:
            conn.execute(text(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}"))
            conn.execute(text(statement))
            conn.commit()
            return 0.0
        except OperationalError as exc:
            conn.rollback()
            if getattr(exc.orig, "sqlstate", None) != "55P03":
                raise
            time.sleep(0.05)
    raise ConvertError(f"could not lock jobs for {what} in {SWAP_TRIES} tries; run the command again")


def _copy(conn: Connection, q: str, phase: str, states: str, progress: Progress,
          say: Callable[[str], None], stop: Callable[[], bool]) -> bool:
    """Copy one phase's rows, batch by batch, from the cursor on. False when stopped."""
    if progress.phase != phase:
        progress.phase, progress.cursor = phase, 0
    total = conn.execute(text(f"SELECT count(*) FROM {q}.jobs WHERE state IN {states}")).scalar()
    conn.commit()
    done, last_said = 0, 0.0
    while True:
        if stop():
            return False
        ids = conn.execute(text(f"SELECT id FROM {q}.jobs WHERE id > :cursor AND state IN {states} "
                                "ORDER BY id LIMIT :n FOR SHARE"), {"cursor": progress.cursor, "n": BATCH}).scalars().all()
        copied = conn.execute(text(COPY.replace("{q}", q)), {"ids": ids}).rowcount if ids else 0
        progress.cursor = max(ids, default=progress.cursor)
        progress.copied += copied
        last = len(ids) < BATCH
        conn.execute(text(f"UPDATE {q}.jobs_convert_progress SET phase = :phase, cursor = :cursor, copied = :copied"),
                     {"phase": "swap" if last and phase == "final" else phase, "cursor": progress.cursor,
                      "copied": progress.copied})
        conn.commit()
        done += len(ids)
        if last or time.monotonic() - last_said > 2:
            say(f"copied {phase} jobs: {done} of about {total} ({progress.copied} copied in all)")
            last_said = time.monotonic()
        if last:
            return True


def _swap(conn: Connection, q: str, schema: str, say: Callable[[str], None]) -> float:
    """Step 3, tried until the ACCESS EXCLUSIVE lock on jobs comes within LOCK_TIMEOUT_MS.
    Returns the seconds jobs was held."""
    for _ in range(SWAP_TRIES):
        functions = conn.execute(text(DEPENDENT_FUNCTIONS), {"t": f"{q}.jobs"}).all()  # read before the lock
        acl = conn.execute(text(TABLE_ACL), {"t": f"{q}.jobs"}).all()
        try:
            conn.execute(text(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}"))
            conn.execute(text(f"LOCK TABLE {q}.jobs IN ACCESS EXCLUSIVE MODE"))
        except OperationalError as exc:
            conn.rollback()
            if getattr(exc.orig, "sqlstate", None) != "55P03":
                raise
            time.sleep(0.05)
            continue
        locked = time.monotonic()
        _swap_locked(conn, q, schema, functions, acl)
        conn.commit()
        held = time.monotonic() - locked
        say(f"schema {schema}: swapped; jobs was locked {1000 * held:.0f} ms")
        return held
    raise ConvertError(f"could not lock jobs for the swap in {SWAP_TRIES} tries; run the command again")


def _swap_locked(conn: Connection, q: str, schema: str, functions: list, acl: list) -> None:
    last = conn.execute(text(f"SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END "
                             f"FROM {q}.jobs_id_seq")).scalar()
    for f in functions:
        conn.execute(text(f"DROP FUNCTION {q}.{quote_ident(f.name)}({f.args})"))
    conn.execute(text(f"DROP TRIGGER jobs_convert_sync ON {q}.jobs"))
    for renames in (PLAIN_INDEXES, CONV_INDEXES):  # the plain table's first: it frees the names
        for old, new in conn.execute(text(renames), {"schema": schema}).all():
            conn.execute(text(f"ALTER INDEX {q}.{quote_ident(old)} RENAME TO {quote_ident(new)}"))
    conn.execute(text(f"ALTER SEQUENCE {q}.jobs_id_seq RENAME TO jobs_plain_id_seq"))
    conn.execute(text(f"ALTER TABLE {q}.jobs RENAME TO jobs_plain"))
    conn.execute(text(f"ALTER TABLE {q}.jobs_conv RENAME TO jobs"))
    conn.execute(text(f"ALTER SEQUENCE {q}.jobs_conv_id_seq RENAME TO jobs_id_seq"))
    conn.execute(text(f"ALTER TABLE {q}.jobs ALTER COLUMN id RESTART WITH {int(last or 0) + 1}"))
    for g in acl:
        conn.execute(text(f"GRANT {g.privilege} ON {q}.jobs TO {g.grantee}"))
    for f in functions:
        _recreate_function(conn, q, f)


def _recreate_function(conn: Connection, q: str, f) -> None:
    driver = conn.connection.dbapi_connection  # the definition as it is: no parameter markers
    driver.execute(f.definition)
    signature = f"{q}.{quote_ident(f.name)}({f.args})"
    if f.comment is not None:
        driver.execute(f"COMMENT ON FUNCTION {signature} IS " + _literal(f.comment))
    if f.acl is not None:
        conn.execute(text(f"REVOKE ALL ON FUNCTION {signature} FROM PUBLIC"))
        for grantee in f.acl:
            conn.execute(text(f"GRANT EXECUTE ON FUNCTION {signature} TO {grantee}"))


def _literal(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _clean_up(conn: Connection, q: str) -> None:
    for statement in (f"DROP TABLE {q}.jobs_plain", f"DROP TABLE {q}.jobs_convert_seen",
                      f"DROP TABLE {q}.jobs_convert_progress", f"DROP FUNCTION {q}.jobs_convert_sync()"):
        conn.execute(text(statement))
    conn.commit()


# Repeats a change of a plain row in jobs_conv (pruned to the row's partition), and notes the id.
SYNC_FUNCTION = """
CREATE FUNCTION {q}.jobs_convert_sync() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  IF TG_OP <> 'INSERT' THEN
    IF OLD.finalized_at IS NULL THEN
      DELETE FROM {q}.jobs_conv AS c WHERE c.id = OLD.id AND c.state = OLD.state;
    ELSE
      DELETE FROM {q}.jobs_conv AS c
       WHERE c.id = OLD.id AND c.state = OLD.state AND c.finalized_at = OLD.finalized_at;
    END IF;
  END IF;
  IF TG_OP <> 'DELETE' THEN
    INSERT INTO {q}.jobs_conv SELECT NEW.*;
  END IF;
  INSERT INTO {q}.jobs_convert_seen (id) VALUES (CASE WHEN TG_OP = 'DELETE' THEN OLD.id ELSE NEW.id END)
  ON CONFLICT DO NOTHING;
  RETURN NULL;
END
$fn$
"""

# The locked rows of a batch not seen yet (no trigger repeated them), copied and noted.
COPY = """
WITH fresh AS (
  INSERT INTO {q}.jobs_convert_seen (id)
  SELECT o.id FROM {q}.jobs AS o WHERE o.id = ANY(:ids)
  ON CONFLICT DO NOTHING
  RETURNING id
)
INSERT INTO {q}.jobs_conv SELECT o.* FROM {q}.jobs AS o WHERE o.id IN (SELECT id FROM fresh)
"""

# Functions whose arguments or result are typed by the plain table's row (its type or array).
DEPENDENT_FUNCTIONS = """
SELECT DISTINCT p.proname AS name, pg_get_function_identity_arguments(p.oid) AS args,
       pg_get_functiondef(p.oid) AS definition, obj_description(p.oid, 'pg_proc') AS comment,
       CASE WHEN p.proacl IS NULL THEN NULL ELSE ARRAY(
         SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END
           FROM aclexplode(p.proacl) AS a WHERE a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner) END AS acl
  FROM pg_proc AS p
  JOIN pg_depend AS d ON d.classid = CAST('pg_proc' AS regclass) AND d.objid = p.oid
 WHERE d.refclassid = CAST('pg_type' AS regclass)
   AND d.refobjid IN (SELECT t.oid FROM pg_type AS t JOIN pg_class AS c ON t.oid = c.reltype
                       WHERE c.oid = to_regclass(:t)
                      UNION ALL
                      SELECT t.typarray FROM pg_type AS t JOIN pg_class AS c ON t.oid = c.reltype
                       WHERE c.oid = to_regclass(:t))
"""

TABLE_ACL = """
SELECT a.privilege_type AS privilege,
       CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END AS grantee
  FROM pg_class AS c, aclexplode(c.relacl) AS a
 WHERE c.oid = to_regclass(:t) AND a.grantee <> c.relowner
"""

# Index names: the plain table's get "_plain" (its primary key's too), jobs_conv's lose "_conv".
PLAIN_INDEXES = """
SELECT i.relname, i.relname || '_plain' FROM pg_index AS x
  JOIN pg_class AS i ON i.oid = x.indexrelid JOIN pg_class AS t ON t.oid = x.indrelid
 WHERE t.relnamespace = to_regnamespace(:schema) AND t.relname = 'jobs'
"""
CONV_INDEXES = """
SELECT i.relname, left(i.relname, -5) FROM pg_class AS i
 WHERE i.relnamespace = to_regnamespace(:schema) AND i.relkind IN ('i', 'I') AND i.relname LIKE '%\\_conv'
"""
