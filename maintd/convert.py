"""``maintd migrate --convert partitioned``: a live plain ``jobs`` table becomes the partitioned
layout (SPEC 8.1) while workers and the daemon keep running. Run by the schema's owner.

0. *Refuse* what the swap would leave on the plain table: views, rules, foreign keys, triggers,
   indexes and policies of the user's, publications (checked again under the swap's lock).
1. *Prepare* (once): ``jobs_conv``, partitioned like a new table (maintd/partitions.py), its index
   names suffixed ``_conv``; ``jobs_convert_seen`` (ids already in ``jobs_conv``); a progress row;
   and a trigger on ``jobs`` that repeats every insert, update and delete in ``jobs_conv`` (in the
   writer's transaction, as the owner: ``SECURITY DEFINER``) and notes the id as seen; a second
   one empties ``jobs_conv`` and the seen ids when ``jobs`` is truncated. Creating
   the trigger waits at most ``LOCK_TIMEOUT`` for the writers of the moment (and is tried again).
2. *Copy*, live jobs first (``available``, ``scheduled``, ``running``, ``retryable``), then final
   ones, each in id order, ``BATCH`` rows per transaction: the rows are locked ``FOR SHARE`` (a
   worker changing one waits for that batch; a claim skips it), then those not seen yet are
   copied and noted. A row another transaction holds is waited for at most ``LOCK_TIMEOUT_MS``;
   held longer (a worker keeping its job's row locked while it runs), the batch gives its rows
   back, copies those before it, and waits for that row alone, a try at a time, until it is free. A row changed after its copy is repeated by the trigger; one changed before
   it was seen already. The cursor is in the progress row after every batch: an interrupted
   conversion resumes there, and the trigger keeps ``jobs_conv`` current meanwhile.
3. *Swap*, in one transaction holding ``jobs`` for a few milliseconds (its ACCESS EXCLUSIVE lock
   is waited for at most ``LOCK_TIMEOUT``, and tried again): the tables, their indexes and the
   identity sequence change names (the plain table becomes ``jobs_plain``), the identity goes on
   from the plain table's, its grants are given to the new table, and the functions typed by the
   plain table's row (the admin functions) are created again for the new one, with their
   comments and grants. Statements of workers and of the daemon name ``jobs``: their next
   execution plans against the new table.
4. *Clean up*: the trigger went with the swap; the plain table's storage parameters (migrate's
   autovacuum settings and the operator's) go to the live partition and its comment to the new
   table; ``jobs_plain``, the seen ids and the progress row are dropped.
5. *Analyze* the new table and its partitions (sampled, as autovacuum would; it never analyzes a
   partitioned table itself): until then the planner knows nothing of the copied rows, and status
   shows a catch-all holding a retention's finished jobs at the floor of its estimate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from sqlalchemy import Connection, TextClause, text
from sqlalchemy.exc import OperationalError

from . import migrate, partitions
from .faults import LOCK_NOT_AVAILABLE, sqlstate
from .identifiers import quote_ident
from .migrate import Layout
from .queries import FINAL_STATES_SQL, LIVE_STATES_SQL, catalog, render, sql
from .queries import convert as q

BATCH = 5000
FIRST_ID, LAST_ID = -(2 ** 63), 2 ** 63 - 1  # jobs.id's range: an import may give 0 or negative ids
LOCK_TIMEOUT_MS = 200  # the longest a worker waits behind the trigger's creation or the swap
SWAP_TRIES = 100
PHASES = (("live", LIVE_STATES_SQL), ("final", FINAL_STATES_SQL))


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
    if conn.execute(text(catalog.JOBS_PARTITIONED), {"schema": schema}).scalar():
        if conn.execute(text(catalog.TABLE_EXISTS), {"qualified": f"{quote_ident(schema)}.jobs_convert_progress"}).scalar():
            _check_owner(conn, schema)
            _clean_up(conn, schema)  # a run cut off after its swap: its copies go now
            say(f"schema {schema}: jobs is partitioned already; dropped what an interrupted conversion left")
            _analyze(conn, schema, say)
            return "already"
        conn.commit()
        say(f"schema {schema}: jobs is partitioned already; nothing to do")
        return "already"
    _check_owner(conn, schema)
    _refuse_what_is_not_carried(conn, schema)
    progress = _prepare(conn, schema, layout, say)
    for phase, states in PHASES:
        if _phase_index(progress.phase) > _phase_index(phase):
            continue
        if not _copy(conn, schema, phase, states, progress, say, stop):
            say(f"schema {schema}: stopped; run the same command again to resume")
            return "stopped"
    _swap(conn, schema, say)
    _clean_up(conn, schema)
    _analyze(conn, schema, say)
    say(f"schema {schema}: jobs is partitioned; set layout = \"partitioned\" so the leader keeps its partitions")
    return "done"


def _refuse_what_is_not_carried(conn: Connection, schema: str) -> None:
    """Raise ConvertError naming what depends on the plain table and would stay with it: a view
    would go on reading the old copy, a foreign key would refuse the workers' inserts, and the
    clean-up would fail on them, or drop an index or a trigger of the user's with it."""
    own = ["jobs_pkey", *partitions.LIVE_INDEXES, partitions.UNIQUE_KEY_INDEX[0], *partitions.FINAL_INDEXES]
    found = conn.execute(text(q.NOT_CARRIED), {"t": f"{quote_ident(schema)}.jobs", "own": own}).all()
    if found:
        conn.rollback()
        raise ConvertError(
            f"schema {schema}: the conversion cannot carry these over to the partitioned table: "
            + ", ".join(f"{kind} {name}" for kind, name in found)
            + ". Drop them, run the command again, then create them again on the new table (a foreign "
            "key to jobs cannot be: the partitioned table's ids are unique per partition only)")


def abandon(conn: Connection, schema: str, say: Callable[[str], None] = print) -> str:
    """``--convert plain``: drop an unfinished conversion (its trigger, which doubles every write
    of the workers meanwhile, and its copy); the plain table is untouched. Returns ``"done"`` or
    ``"nothing"``; a table already partitioned is not converted back (ConvertError)."""
    if conn.execute(text(catalog.JOBS_PARTITIONED), {"schema": schema}).scalar():
        left = conn.execute(text(catalog.TABLE_EXISTS),
                            {"qualified": f"{quote_ident(schema)}.jobs_convert_progress"}).scalar()
        conn.rollback()
        raise ConvertError(f"schema {schema}: jobs is partitioned; converting it back to plain is not supported"
                           + ("; a conversion was cut off after its swap, before its clean-up: "
                              "`maintd migrate --convert partitioned` drops what it left (jobs_plain, the old "
                              "plain table, and the progress tables)" if left else ""))
    qualified = f"{quote_ident(schema)}.jobs"
    made = conn.execute(text(q.HAS_TRIGGER), {"t": qualified}).scalar() or any(
        conn.execute(text(catalog.TABLE_EXISTS), {"qualified": f"{qualified}_{t}"}).scalar()
        for t in ("conv", "convert_progress", "convert_seen"))
    if not made:
        conn.commit()
        say(f"schema {schema}: no conversion under way; nothing to do")
        return "nothing"
    _check_owner(conn, schema, "plain")
    _with_lock_timeout(conn, schema, "dropping the sync triggers", sql(q.ABANDON_TRIGGER, schema),
                       sql(q.ABANDON_TRUNCATE_TRIGGER, schema))
    for template in q.ABANDON:
        _with_lock_timeout(conn, schema, "dropping the copy", sql(template, schema))
    say(f"schema {schema}: the unfinished conversion is dropped; jobs stays plain")
    return "done"


def _check_owner(conn: Connection, schema: str, to: str = "partitioned") -> None:
    """Before any DDL: the role must be able to make and swap tables (the schema's owner), as
    for ``maintd migrate``; otherwise a MigratePermissionError names the role to use, and the
    command run (`--convert`), not a bare `maintd migrate`, which would convert nothing."""
    migrate.check_privileges(conn.execute(text(catalog.SCHEMA_PRIVILEGES), {"schema": schema}).one(), schema,
                             command=f"maintd migrate --convert {to}", making="the conversion's tables")
    conn.commit()


def _phase_index(phase: str) -> int:
    return {"live": 0, "final": 1, "swap": 2}[phase]


def _prepare(conn: Connection, schema: str, layout: Layout, say: Callable[[str], None]) -> Progress:
    """Everything of step 1 that is not there yet; returns the progress to resume from."""
    jobs = f"{quote_ident(schema)}.jobs"
    if not conn.execute(text(catalog.TABLE_EXISTS), {"qualified": f"{jobs}_conv"}).scalar():
        say(f"schema {schema}: preparing jobs_conv (partitioned), the seen ids and the sync trigger")
        for template in q.STALE:
            conn.execute(sql(template, schema))
        conn.execute(sql(q.CREATE_CONV, schema))
        for statement in [*partitions.partitions_ddl(schema, "jobs_conv", "_conv"),
                          *partitions.start_sql(schema, layout.step),
                          *partitions.premake_sql(schema, layout.step, layout.premake)]:
            conn.execute(text(statement))
        for template in (q.CREATE_SEEN, q.CREATE_PROGRESS, q.START_PROGRESS):
            conn.execute(sql(template, schema))
        conn.connection.dbapi_connection.execute(render(q.SYNC_FUNCTION, schema))  # no parameter markers
        conn.commit()
    elif conn.execute(text(q.HAS_TRIGGER), {"t": jobs}).scalar() < 2:
        # jobs_conv without its triggers (gone, or begun by a release without the TRUNCATE one):
        # writes since then were not all repeated there (the copied rows would come back as they
        # were copied), so the copy starts over, and the function is this release's
        say(f"schema {schema}: a sync trigger was missing; copying again from the start")
        for template in q.RESTART_COPY:
            conn.execute(sql(template, schema))
        conn.connection.dbapi_connection.execute(render(q.SYNC_FUNCTION, schema))  # no parameter markers
        conn.commit()
    if conn.execute(text(q.HAS_TRIGGER), {"t": jobs}).scalar() < 2:
        _with_lock_timeout(conn, schema, "the sync triggers", *(sql(t, schema) for t in (
            q.ABANDON_TRIGGER, q.ABANDON_TRUNCATE_TRIGGER, q.CREATE_TRIGGER, q.CREATE_TRUNCATE_TRIGGER)))
    row = conn.execute(sql(q.PROGRESS, schema)).one()
    conn.commit()
    return Progress(*row)


def _with_lock_timeout(conn: Connection, schema: str, what: str, *statements: TextClause) -> float:
    """Run DDL that locks ``jobs`` (in one transaction), waiting at most LOCK_TIMEOUT_MS per try;
    returns how long the lock was held (the try that got it)."""
    for _ in range(SWAP_TRIES):
        try:
            _lock_timeout(conn)
            for statement in statements:
                conn.execute(statement)
            conn.commit()
            return 0.0
        except OperationalError as exc:
            conn.rollback()
            if sqlstate(exc) != LOCK_NOT_AVAILABLE:
                raise
            time.sleep(0.05)
    raise ConvertError(f"could not lock jobs for {what} in {SWAP_TRIES} tries{_holders(conn, schema)}; "
                       "run the command again")


def _holders(conn: Connection, schema: str) -> str:
    """Who holds jobs, for the error of a lock that never came: the sessions to look at (a worker
    idle in a transaction, a long report), instead of a run again that fails the same way."""
    rows = conn.execute(text(q.LOCK_HOLDERS), {"t": f"{quote_ident(schema)}.jobs"}).all()
    conn.rollback()
    if not rows:
        return " (held by sessions that have let go since)"
    return ", held by " + "; ".join(
        f"pid {r.pid} ({r.application_name or 'no application_name'}, {r.state or 'state unknown'}"
        + (f", in a transaction since {r.xact_start:%Y-%m-%d %H:%M:%S %Z}" if r.xact_start else "") + ")"
        for r in rows)


def _lock_timeout(conn: Connection) -> None:
    conn.execute(text(catalog.SET_LOCAL), {"name": "lock_timeout", "value": str(LOCK_TIMEOUT_MS)})


@dataclass
class Batch:
    ids: list[int]  # locked FOR SHARE by this transaction: to copy
    cursor: int  # where the next batch starts: every row of the phase before it is copied (or seen)
    last: bool  # no row of the phase after it
    held: int | None = None  # the row another transaction held longer than LOCK_TIMEOUT_MS


def _copy(conn: Connection, schema: str, phase: str, states: str, progress: Progress,
          say: Callable[[str], None], stop: Callable[[], bool]) -> bool:
    """Copy one phase's rows, batch by batch, from the cursor on. False when stopped."""
    if progress.phase != phase:
        progress.phase, progress.cursor = phase, FIRST_ID
    total = conn.execute(sql(q.COUNT_PHASE, schema, states=states)).scalar()
    conn.commit()
    copy, save = (sql(t, schema, states=states) for t in (q.COPY, q.SAVE_PROGRESS))
    done, last_said, held = 0, 0.0, None
    while True:
        if stop():
            return False
        batch = _lock_batch(conn, schema, states, progress.cursor, 1 if held else BATCH)
        copied = conn.execute(copy, {"ids": batch.ids}).rowcount if batch.ids else 0
        progress.cursor = batch.cursor
        progress.copied += copied
        conn.execute(save, {"phase": "swap" if batch.last and phase == "final" else phase,
                            "cursor": progress.cursor, "copied": progress.copied})
        conn.commit()
        done += len(batch.ids)
        if batch.held is not None and batch.held != held:
            say(f"{phase} jobs: waiting for job {batch.held}, whose row another transaction holds (a worker "
                "running it?); the rows before it are copied, the workers are not held up")
        held = batch.held
        if batch.last or time.monotonic() - last_said > 2:
            say(f"{phase} jobs: {done} of about {total} read; {progress.copied} copied in all (rows "
                "already carried over by the trigger or an earlier run are not copied again)")
            last_said = time.monotonic()
        if batch.last:
            return True


def _lock_batch(conn: Connection, schema: str, states: str, cursor: int, n: int) -> Batch:
    """The next ``n`` rows of the phase from ``cursor`` on, locked FOR SHARE, each waited for at most
    LOCK_TIMEOUT_MS. When another transaction holds one longer (a worker keeping its job's row
    locked while it runs), the rows locked so far are given back (the workers completing them
    would wait too), and those before the held row that no one holds are locked without waiting:
    the cursor stops before the held row, which is never skipped."""
    try:
        _lock_timeout(conn)
        ids = conn.execute(sql(q.LOCK_BATCH, schema, states=states), {"cursor": cursor, "n": n}).scalars().all()
        return Batch(ids, _after(ids, cursor), len(ids) < n or ids[-1] == LAST_ID)
    except OperationalError as exc:
        conn.rollback()
        if sqlstate(exc) != LOCK_NOT_AVAILABLE:
            raise
    ahead = conn.execute(sql(q.PEEK_BATCH, schema, states=states), {"cursor": cursor, "n": n}).scalars().all()
    if not ahead:  # gone meanwhile
        return Batch([], cursor, False)
    _lock_timeout(conn)
    free = conn.execute(sql(q.LOCK_FREE, schema, states=states), {"cursor": cursor, "upto": ahead[-1]}).scalars().all()
    locked = set(free)
    held = next((i for i in ahead if i not in locked), None)
    if held is None:  # let go meanwhile
        return Batch(free, _after(ahead, cursor), ahead[-1] == LAST_ID)
    return Batch([i for i in free if i < held], held, False, held)


def _after(ids: list[int], cursor: int) -> int:
    """Where the batch after ``ids`` (read in order from ``cursor``) starts. After LAST_ID there is
    no row: the cursor stays on it (a bigint), and the batch is the phase's last."""
    return min(ids[-1] + 1, LAST_ID) if ids else cursor


def _swap(conn: Connection, schema: str, say: Callable[[str], None]) -> float:
    """Step 3, tried until the ACCESS EXCLUSIVE lock on jobs comes within LOCK_TIMEOUT_MS.
    Returns the seconds jobs was held."""
    jobs = f"{quote_ident(schema)}.jobs"
    for _ in range(SWAP_TRIES):
        # No `grants --apply` between the read of jobs' grants and their copy to the new table.
        conn.execute(text(catalog.ADVISORY_XACT_LOCK), {"k": migrate.grants_lock_key(schema)})
        functions = conn.execute(text(q.DEPENDENT_FUNCTIONS), {"t": jobs}).all()  # read before the lock
        acl = conn.execute(text(q.TABLE_ACL), {"t": jobs}).all()
        try:
            _lock_timeout(conn)
            conn.execute(sql(q.LOCK_JOBS, schema))
        except OperationalError as exc:
            conn.rollback()
            if sqlstate(exc) != LOCK_NOT_AVAILABLE:
                raise
            time.sleep(0.05)
            continue
        locked = time.monotonic()
        _refuse_what_is_not_carried(conn, schema)  # made since the start? (rolls the lock back)
        _swap_locked(conn, schema, functions, acl)
        conn.commit()
        held = time.monotonic() - locked
        say(f"schema {schema}: swapped; jobs was locked {1000 * held:.0f} ms")
        return held
    raise ConvertError(f"could not lock jobs for the swap in {SWAP_TRIES} tries{_holders(conn, schema)}; "
                       "run the command again")


def _swap_locked(conn: Connection, schema: str, functions: list, acl: list) -> None:
    last = conn.execute(sql(q.LAST_ID, schema)).scalar()
    for f in functions:
        conn.execute(sql(q.DROP_FUNCTION, schema, signature=_signature(schema, f)))
    conn.execute(sql(q.DROP_TRIGGER, schema))
    conn.execute(sql(q.DROP_TRUNCATE_TRIGGER, schema))
    for renames in (q.PLAIN_INDEXES, q.CONV_INDEXES):  # the plain table's first: it frees the names
        for old, new in conn.execute(text(renames), {"schema": schema}).all():
            conn.execute(sql(q.RENAME_INDEX, schema, old=quote_ident(old), new=quote_ident(new)))
    for template in q.RENAME_TABLES:
        conn.execute(sql(template, schema))
    conn.execute(sql(q.RESTART_IDS, schema, restart=str(int(last or 0) + 1)))
    for g in acl:
        conn.execute(sql(q.GRANT_TABLE, schema, privilege=g.privilege, grantee=g.grantee))
    for f in functions:
        _recreate_function(conn, schema, f)


def _signature(schema: str, f) -> str:
    return f"{quote_ident(schema)}.{quote_ident(f.name)}({f.args})"


def _recreate_function(conn: Connection, schema: str, f) -> None:
    driver = conn.connection.dbapi_connection  # the definition as it is: no parameter markers
    driver.execute(f.definition)
    signature = _signature(schema, f)
    if f.comment is not None:
        driver.execute(render(q.COMMENT_FUNCTION, schema, signature=signature, comment=_literal(f.comment)))
    if f.acl is not None:
        conn.execute(sql(q.REVOKE_FUNCTION, schema, signature=signature))
        for grantee in f.acl:
            conn.execute(sql(q.GRANT_FUNCTION, schema, signature=signature, grantee=grantee))


def _literal(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _clean_up(conn: Connection, schema: str) -> None:
    """Step 4: the plain table's storage parameters (migrate's autovacuum settings, and whatever
    the operator set) go to the new live partition, its comment to the new table; then it goes."""
    plain = f"{quote_ident(schema)}.jobs_plain"
    for statement in conn.execute(sql(q.CARRY_STORAGE, schema), {"plain": plain, "live": partitions.LIVE_PARTITION}).scalars():
        conn.execute(text(statement))
    for template in q.CLEAN_UP:
        conn.execute(sql(template, schema))
    conn.commit()


def _analyze(conn: Connection, schema: str, say: Callable[[str], None]) -> None:
    """Step 5: ANALYZE of the partitioned jobs gathers its statistics as a whole and each
    partition's (PostgreSQL's ANALYZE documentation). It takes a SHARE UPDATE EXCLUSIVE lock:
    the workers' reads and writes go on."""
    started = time.monotonic()
    if conn.dialect.server_version_info >= (15,):
        conn.execute(text(q.FLUSH_STATS))
        conn.commit()  # (the flush: as the backend goes idle, before it answers the commit)
    conn.execute(sql(q.ANALYZE, schema))
    conn.commit()
    say(f"schema {schema}: analyzed jobs and its partitions in {time.monotonic() - started:.1f} s")
