"""The SQL statements maintd runs, one module per table (plus ``catalog`` for PostgreSQL's own).
Outside: the DDL of the schema (the Alembic migrations, and for the partitioned layout
``maintd/partitions.py``), and utility commands that take an identifier
(``LISTEN channel``, ``REINDEX INDEX CONCURRENTLY``, ``GRANT``), built where they run from a
validated and quoted name. ``tests/test_sql_home.py`` holds everything else to that.

Statements are plain SQL with ``:name`` parameters. Placeholders in braces are filled in when a
statement is rendered; each fragment used by more than one statement is defined once, here:

* ``{schema}``: the validated, quoted schema name;
* ``{final_states}``: the final states as a SQL list (also in the schema's constraints);
* ``{advisory_lock}``: the ``pg_locks`` row of the leader lock (bound by ``:classid`` and
  ``:objid``, the signed key halves of :func:`maintd.db.advisory_key`, compared as ``oid``);
* ``{stuck}``: the rescuer's rule for a running job that shows no sign of life, under the job's
  own rule ``{rule}`` (bound by ``:stuck_befores`` and ``:hb_befores``, a NULL element without
  ``heartbeat_timeout``, each moved back by ``{ahead}``);
* ``{stale_heartbeat}``: a running job whose heartbeat is an earlier attempt's and whose claim
  is within its rule's grace (bound as ``{stuck}``): not stuck, its heartbeat to be cleared;
* ``{clear_stale}``: the rescuer's update of its locked ``candidates`` whose heartbeat is an
  earlier attempt's (``{stale_heartbeat}``): that heartbeat cleared (``cleared``, their ids), so
  they are judged by their claim; disjoint from ``{rescue}``'s rows;
* ``{ahead}``: how far ``:now`` (the daemon's carried reading of the server's clock) is ahead of
  the server's ``statement_timestamp()``, 0 when it is not;
* ``{rule}``: which of the rescuer's rules (1-based) holds for a job: its kind's, else its
  queue's (``:rule_kinds``/``:rule_queues`` name them, NULL elsewhere), else the default (1);
* ``{grace}``: how long a running job may show no sign of life under its rule, in seconds
  (``:afters``, ``:hbs``): its stuck deadline is ``coalesce(heartbeat_at, attempted_at)`` plus it;
* ``{target_queues}``: the queues a default cleaner target covers: every queue but ``:excluded``
  (a per-queue target's statement is made with :func:`for_queue`);
* ``{enqueue}``: a job's INSERT (the workers' enqueue and the periodic enqueuer's);
* ``{rescue}``: the rescuer's update of its locked ``candidates`` (``retryable`` after
  ``:delays[attempt + 1]`` seconds, or ``discarded``), re-checking each row as it is now;
* ``{announce}``: one ``stalled`` event per ``rescued`` row on ``:events_channel`` (sent only if
  the transaction commits).

A statement's own placeholders (a quoted index name, a list of states, a number) are given to
:func:`render` by name, and filled in with ``{schema}``.

:func:`sql` gives a SQLAlchemy ``text()``; :func:`psycopg_sql` the same statement in psycopg's
``%(name)s`` style for the raw connections of the leader lock.
"""

from __future__ import annotations

import re

from sqlalchemy import TextClause, text

from ..identifiers import quote_ident

FINAL_STATES = ("completed", "cancelled", "discarded")
JOB_STATES = ("available", "scheduled", "running", "retryable", *FINAL_STATES)
FINAL_STATES_SQL = "(" + ", ".join(f"'{s}'" for s in FINAL_STATES) + ")"
LIVE_STATES_SQL = "(" + ", ".join(f"'{s}'" for s in JOB_STATES if s not in FINAL_STATES) + ")"

# The range of times a Python datetime holds, for ``BETWEEN``: a row outside it ('-infinity', Go's
# zero time; 'infinity'; BC; past year 9999: SPEC 7.3) cannot be loaded, and one such row failed a
# whole read (every periodic pass, periodic list, the dashboard's last slots).
PYTHON_TIMES = "'0001-01-02 00:00:00+00' AND '9999-12-31 00:00:00+00'"

# The advisory lock of a leadership, as PostgreSQL lists it: pg_locks shows a two-key lock's
# halves as unsigned oids; the int4 -> oid cast maps the signed halves onto them.
ADVISORY_LOCK = """SELECT 1 FROM pg_locks
                WHERE locktype = 'advisory' AND objsubid = 2 AND granted
                  AND classid = CAST(CAST(:classid AS int4) AS oid)
                  AND objid = CAST(CAST(:objid AS int4) AS oid)"""

STUCK = """(coalesce(heartbeat_at, attempted_at) < (CAST(:stuck_befores AS timestamptz[]))[{rule}] - {ahead}
          OR (heartbeat_at IS NOT NULL
              AND heartbeat_at < (CAST(:hb_befores AS timestamptz[]))[{rule}] - {ahead}))"""

# A heartbeat older than the attempt's own start is an earlier attempt's (SPEC 2's claim sets
# attempted_at and leaves heartbeat_at), while the claim itself is within the rule's grace: the
# job is not stuck, though {stuck} (SPEC 2's rule, which jobs_running_idx serves) says it is. Such
# a candidate has its heartbeat_at cleared instead of being rescued; NULL (no attempted_at) is false.
STALE_HEARTBEAT = """(heartbeat_at < attempted_at
          AND attempted_at >= (CAST(:stuck_befores AS timestamptz[]))[{rule}] - {ahead})"""

# How far the daemon's reading of the server's clock (:now, carried forward on the host's
# monotonic clock for up to 30 s) runs ahead of the server's own: the server's clock stepped back
# since the reading. The rescuer's horizons move back by that much, so that a heartbeat written
# by the server's clock is never judged by a clock ahead of it (a live job rescued early).
AHEAD = "greatest(interval '0', CAST(:now AS timestamptz) - statement_timestamp())"

# Names are data: the rules' kinds and queues are bound arrays, never spliced into the SQL.
# Without overrides (one rule) the planner folds it to 1, and the rule's values to constants.
RULE = """CASE WHEN cardinality(CAST(:rule_kinds AS text[])) = 1 THEN 1
            ELSE coalesce(array_position(CAST(:rule_kinds AS text[]), kind),
                          array_position(CAST(:rule_queues AS text[]), queue), 1) END"""

# With a heartbeat, seen = heartbeat_at, and either rule may end the job's life: the shorter one.
GRACE = """CASE WHEN heartbeat_at IS NULL THEN (CAST(:afters AS float8[]))[{rule}]
               ELSE least((CAST(:afters AS float8[]))[{rule}], (CAST(:hbs AS float8[]))[{rule}]) END"""

# The payload stays far below NOTIFY's 8000 bytes: kind and queue hold at most 128 characters
# (at most 6 bytes each once JSON-escaped). Concatenated (to_json escapes the names): half the CPU
# of json_build_object, which was a fifth of a batch's.
ANNOUNCE = """(SELECT count(pg_notify(CAST(:events_channel AS text),
           '{"event": "stalled", "id": ' || id || ', "queue": ' || to_json(queue) || ', "kind": '
           || to_json(kind) || ', "attempt": ' || attempt || ', "outcome": "' || outcome || '"}'))
      FROM rescued)"""

TARGET_QUEUES = "queue <> ALL(CAST(:excluded AS text[]))"
# A per-queue target's statements say ``queue = :queue`` instead (see :func:`for_queue`), so that
# the planner can use jobs_finalized_queue_idx whatever plan it caches.
ONE_QUEUE = "queue = :queue"

# :delays[k + 1] is backoff(k) in seconds for k = 0 .. :cap (constant from :cap on). Unqualified
# columns in the WHERE are the jobs row's (the candidates carry id, attempt and seen only).
RESCUE = """rescued AS (
  UPDATE {schema}.jobs AS j
     SET state = CASE WHEN j.attempt >= j.max_attempts
                      THEN 'discarded' ELSE 'retryable' END::{schema}.job_state,
         scheduled_at = CASE WHEN j.attempt >= j.max_attempts THEN j.scheduled_at
                             ELSE CAST(:now AS timestamptz) + make_interval(
                                    secs => (CAST(:delays AS float8[]))[least(greatest(j.attempt, 0), :cap) + 1])
                        END,
         finalized_at = CASE WHEN j.attempt >= j.max_attempts THEN CAST(:now AS timestamptz) END,
         heartbeat_at = NULL,  -- this attempt's: the next one starts without (the error keeps when)
         errors = j.errors || jsonb_build_array(jsonb_build_object(
                    'at', CAST(:now AS timestamptz),
                    'attempt', j.attempt,
                    'error', 'stuck: no sign of life since '
                             || coalesce(to_jsonb(c.seen) #>> '{}', 'ever (attempted_at and heartbeat_at are NULL)')
                             || ' (rescued by maintd ' || CAST(:instance AS text) || ')'))
    FROM candidates AS c
   WHERE j.ctid = ANY(ARRAY(SELECT ctid FROM candidates))  -- a TID path to the locked row versions
     AND j.id = c.id                                        -- alone, whatever the planner thinks of c
     AND j.state = 'running'
     AND j.attempt = c.attempt
     AND {stale_heartbeat} IS NOT TRUE
     AND ({stuck} OR coalesce(heartbeat_at, attempted_at) IS NULL
          OR coalesce(heartbeat_at, attempted_at) < '0001-01-02 00:00:00+00'
          OR coalesce(heartbeat_at, attempted_at) >= '9999-12-31 00:00:00+00')
  RETURNING j.id, j.queue, j.kind, j.attempt, j.state::text AS outcome, j.state = 'discarded' AS discarded
)"""

# Unqualified columns in the WHERE are the jobs row's, as in RESCUE.
CLEAR_STALE = """cleared AS (
  UPDATE {schema}.jobs AS j SET heartbeat_at = NULL
    FROM candidates AS c
   WHERE j.ctid = ANY(ARRAY(SELECT ctid FROM candidates))
     AND j.id = c.id AND j.state = 'running' AND j.attempt = c.attempt
     AND {stale_heartbeat}
  RETURNING j.id
)"""

# A job's INSERT, before its ON CONFLICT: due now ('available') or later ('scheduled'). Every
# parameter is typed in the SQL, so that any driver (psql's \bind, server-side binding) can run it.
ENQUEUE = """INSERT INTO {schema}.jobs (kind, queue, args, priority, max_attempts, scheduled_at, state,
                           unique_key, metadata)
VALUES (CAST(:kind AS text), CAST(:queue AS text), CAST(:args AS jsonb), CAST(:priority AS smallint),
        CAST(:max_attempts AS smallint), coalesce(CAST(:scheduled_at AS timestamptz), now()),
        CASE WHEN coalesce(CAST(:scheduled_at AS timestamptz), now()) <= now()
             THEN 'available' ELSE 'scheduled' END::{schema}.job_state,
        CAST(:unique_key AS text), CAST(:metadata AS jsonb))"""

# Order matters: a fragment may hold the ones after it.
FRAGMENTS = {"{enqueue}": ENQUEUE, "{rescue}": RESCUE, "{clear_stale}": CLEAR_STALE, "{advisory_lock}": ADVISORY_LOCK, "{stuck}": STUCK,
             "{stale_heartbeat}": STALE_HEARTBEAT, "{ahead}": AHEAD, "{grace}": GRACE, "{rule}": RULE, "{announce}": ANNOUNCE, "{target_queues}": TARGET_QUEUES,
             "{final_states}": FINAL_STATES_SQL}

_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def for_queue(template: str) -> str:
    """A cleaner statement for a per-queue target: ``{target_queues}`` becomes ``queue = :queue``."""
    return template.replace("{target_queues}", ONE_QUEUE)


def render(template: str, schema: str, **names: str) -> str:
    """The statement for one schema: the shared fragments, then ``{schema}`` and the statement's
    own ``names`` in one pass (a value is never read as a placeholder; braces around another
    name are left as they are)."""
    for name, fragment in FRAGMENTS.items():
        template = template.replace(name, fragment)
    values = {"schema": quote_ident(schema), **names}
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), template)


def sql(template: str, schema: str, **names: str) -> TextClause:
    """A SQLAlchemy ``text()`` for a statement (rendered anew: code that runs often holds a
    :class:`Statements`)."""
    return text(render(template, schema, **names))


def psycopg_sql(template: str, schema: str = "maintd") -> str:
    """The statement with ``:name`` turned into psycopg's ``%(name)s`` (and ``%`` escaped)."""
    return _PARAM.sub(r"%(\1)s", render(template, schema).replace("%", "%%"))


class Statements:
    """The statements of one schema, each rendered once (a target holds one: no cache is shared
    by targets, so none thrashes however many there are)."""

    def __init__(self, schema: str):
        self.schema = schema
        self._text: dict[str, TextClause] = {}
        self._psql: dict[str, str] = {}

    def sql(self, template: str) -> TextClause:
        found = self._text.get(template)
        if found is None:
            found = self._text[template] = sql(template, self.schema)
        return found

    def psql(self, template: str) -> str:
        found = self._psql.get(template)
        if found is None:
            found = self._psql[template] = psycopg_sql(template, self.schema)
        return found
