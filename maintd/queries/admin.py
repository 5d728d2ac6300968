"""Statements of ``maintd jobs`` (on ``{schema}.jobs``, through the SQL admin functions of
migration 0002). Filters are composed from fixed pieces: the state is a validated literal (so the
partial indexes can be proved), every other value is a parameter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import FINAL_STATES, FINAL_STATES_SQL, JOB_STATES

_FINAL = FINAL_STATES_SQL
IDLE = "j.state IN ('available', 'scheduled', 'retryable')"  # non-final and not running
IDLE_STATES = ("available", "scheduled", "retryable")
NOT_RUNNING = tuple(s for s in JOB_STATES if s != "running")
RUN_AT = "coalesce(CAST(:at AS timestamptz), now() + make_interval(secs => CAST(:offset AS float8)))"


@dataclass(frozen=True)
class Action:
    verb: str  # past tense, for the output
    call: str  # the SQL function call on the jobs {ids}, returning the changed rows' id and state
    applies: str  # predicate on alias j: exactly the jobs the function changes
    to_state: str  # SQL expression: the job's state after the change (for --dry-run)
    states: tuple[str, ...]  # every state ``applies`` holds in: a queue's batch reads these (and running)


ACTIONS: dict[str, Action] = {
    "retry": Action(
        "retried", "SELECT id, state::text AS state FROM {schema}.retry_jobs({ids})",
        "j.state <> 'running' AND NOT (j.state = 'available' AND j.scheduled_at <= now()"
        " AND (j.attempt < j.max_attempts OR j.attempt >= 32767))"
        f" AND NOT (j.state IN {_FINAL} AND j.unique_key IS NOT NULL AND EXISTS ("
        "SELECT 1 FROM {schema}.jobs AS o"
        f" WHERE o.unique_key = j.unique_key AND o.state NOT IN {_FINAL}))",
        "'available'", NOT_RUNNING),
    "cancel": Action(
        "cancelled", "SELECT id, state::text AS state FROM {schema}.cancel_jobs({ids})",
        IDLE, "'cancelled'", IDLE_STATES),
    "discard": Action(
        "discarded",
        "SELECT id, state::text AS state"
        " FROM {schema}.permanently_fail_jobs({ids}, CAST(:reason AS text))",
        IDLE, "'discarded'", IDLE_STATES),
    "delete": Action(
        "deleted", "SELECT id, 'deleted' AS state FROM {schema}.delete_jobs({ids})",
        "j.state <> 'running'", "'deleted'", NOT_RUNNING),
    "reschedule": Action(
        "rescheduled",
        "SELECT id, state::text AS state FROM {schema}.reschedule_jobs({ids},"
        f" run_at => {RUN_AT}, priority => CAST(:priority AS int),"
        " max_attempts => CAST(:max_attempts AS int))",
        IDLE,
        f"CASE WHEN coalesce({RUN_AT}, j.scheduled_at) <= now() THEN 'available' WHEN j.state = 'retryable' THEN 'retryable'"
        " ELSE 'scheduled' END", IDLE_STATES),
}

# Keyset per state filter: the columns of the partial index serving that state, in its order.
_ID = (("j.id", "bigint"),)
_SCHEDULED = (("j.scheduled_at", "timestamptz"), ("j.id", "bigint"))
_FINALIZED = (("j.finalized_at", "timestamptz"), ("j.id", "bigint"))
KEYSETS: dict[str | None, tuple[tuple[str, str], ...]] = {
    "available": (("j.queue", "text"), ("j.priority", "smallint"),
                  ("j.scheduled_at", "timestamptz"), ("j.id", "bigint")),  # jobs_fetch_idx
    "scheduled": _SCHEDULED, "retryable": _SCHEDULED,  # jobs_scheduled_idx
    "completed": _FINALIZED, "cancelled": _FINALIZED, "discarded": _FINALIZED,  # jobs_finalized(_queue)_idx
}

ROW = "j.id, j.kind, j.queue, j.state::text AS state, j.unique_key"

BY_IDS = """
SELECT {row}, ({applies}) AS applies, ({to_state}) AS to_state
  FROM {{schema}}.jobs AS j WHERE j.id = ANY(CAST(:ids AS bigint[])) ORDER BY j.id
"""

BY_FILTER = """
SELECT {row}, ({applies}) AS applies, ({to_state}) AS to_state, {keys}
  FROM {{schema}}.jobs AS j
 WHERE {where}
 ORDER BY {order} LIMIT :limit
"""

# A queue's batch without a state filter: BY_FILTER by id over the whole table was a scan of the
# primary key filtered by queue, which read every other queue's rows when the queue is rare, until
# it had :limit matches (to the statement timeout in a big table). Instead, each state the batch can
# return (the action's states, and running, reported) is read by its own index (STATE_SCANS), each
# read's first :limit by id merged by id: same rows, same order, same keyset as BY_FILTER.
BY_FILTER_SCAN = """(SELECT {row}, ({applies}) AS applies, ({to_state}) AS to_state, {keys}
     FROM {{schema}}.jobs AS j
    WHERE {where}
    ORDER BY {order} LIMIT :limit)"""
BY_FILTER_MERGED = """
SELECT j.id, j.kind, j.queue, j.state, j.unique_key, j.applies, j.to_state, j.k0
  FROM ({scans}) AS j
 ORDER BY j.k0 LIMIT :limit
"""

# A state filter's walk follows keys a worker moves ahead (a retried job failed again is discarded
# or retryable at a later finalized_at/scheduled_at): jobs attempted since the walk began are left
# out, or the walk meets them again, acts on them again, and lasts as long as the workers fail them.
NOT_ATTEMPTED_SINCE = "(j.attempted_at IS NULL OR j.attempted_at < CAST(:began AS timestamptz))"

# Where a filter's walk starts: the time (above), and the highest id then, since every walk acts on
# the jobs that existed when it began (a job enqueued since has a higher id: a walk by id met every
# new job, and never ended while producers outpaced it).
WALK_START = "SELECT now() AS began, coalesce(max(id), 0) AS upto FROM {schema}.jobs"
EXISTED = "j.id <= CAST(:upto AS bigint)"

# The jobs a call acts on. By ids: those ids. In a filter's batch: of the ids the batch read, those
# that still match the filter, locked here, in the call's own statement. The functions check only
# their own states, so a job that left the filter between the batch's read and the call (a
# discarded job revived to available by another session's retry_jobs) was acted on all the same:
# `jobs delete --state discarded` deleted a live job. FOR UPDATE reads each row as it is now
# (waiting for none: a row another session holds is skipped and reported as locked), and the
# function's own FOR UPDATE SKIP LOCKED takes the rows this transaction holds. A running job is
# never locked: no function changes it, and its worker's heartbeat or completion would wait.
IDS = "CAST(:ids AS bigint[])"
STILL_MATCHING = """ARRAY(SELECT j.id FROM {schema}.jobs AS j
   WHERE j.id = ANY(CAST(:ids AS bigint[])) AND j.state <> 'running' AND {where}
   ORDER BY j.id FOR UPDATE SKIP LOCKED)"""

REREAD = "SELECT id, state::text AS state FROM {schema}.jobs WHERE id = ANY(CAST(:ids AS bigint[]))"

# The last error: at most :error_chars characters of it and its whole length (a worker's error is
# text of any length; `jobs list` holds a page, `jobs show` prints the error whole).
LIST = """
SELECT j.id, j.state::text AS state, j.queue, j.kind, j.attempt, j.max_attempts, j.priority,
       j.scheduled_at, j.finalized_at, left(e.error, :error_chars) AS last_error,
       length(e.error) AS last_error_chars
  FROM {{schema}}.jobs AS j CROSS JOIN LATERAL (SELECT j.errors -> -1 ->> 'error' AS error) AS e {where}
 ORDER BY j.id DESC LIMIT :limit
"""


# Each state (or pair of states) read by its own partial index, the state a literal so the index's
# predicate is proved: the queue's entries of jobs_fetch_idx and jobs_finalized_queue_idx (which lead
# by queue), the live rows of jobs_scheduled_idx and jobs_running_idx. With the states each covers.
STATE_SCANS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("available",), "j.state = 'available'"),
    (("scheduled", "retryable"), "j.state IN ('scheduled', 'retryable')"),
    (("running",), "j.state = 'running'"),
    *(((s,), f"j.state = '{s}' AND j.finalized_at IS NOT NULL") for s in FINAL_STATES))

# A queue's page without a state filter: ORDER BY id over the whole table was a scan of the primary
# key newest first, filtered by queue, which read every other queue's rows when the queue is rare
# (to the statement timeout in a big table). Instead, every state is read by its own index
# (STATE_SCANS); each read's newest :limit merged by id. Same rows, same order, same keyset
# (``id < :before``) as LIST.
LIST_SCANS = tuple(scan for _, scan in STATE_SCANS)
LIST_SCAN = """(SELECT j.id, j.state, j.queue, j.kind, j.attempt, j.max_attempts, j.priority,
         j.scheduled_at, j.finalized_at, j.errors
    FROM {schema}.jobs AS j WHERE {where}
   ORDER BY j.id DESC LIMIT :limit)"""
LIST_MERGED = """
SELECT j.id, j.state::text AS state, j.queue, j.kind, j.attempt, j.max_attempts, j.priority,
       j.scheduled_at, j.finalized_at, left(e.error, :error_chars) AS last_error,
       length(e.error) AS last_error_chars
  FROM ({scans}) AS j CROSS JOIN LATERAL (SELECT j.errors -> -1 ->> 'error' AS error) AS e
 ORDER BY j.id DESC LIMIT :limit
"""

# Run first in each page's (and each filter batch's) transaction. A page's statement is the same
# text page after page, so psycopg prepares it (its 5th run) and the server may then plan it once
# for any queue: with ``queue = $1`` it guesses the queue as common as the average one, and a
# primary-key scan newest first, stopped after :limit matches, looks cheapest again (EXPLAIN of the
# generic plan showed it in every branch). Transaction-local: planned with the queue known, every time.
CUSTOM_PLANS = "SELECT set_config('plan_cache_mode', 'force_custom_plan', true)"


def list_statement(flt: "Filter", before: int | None) -> tuple[str, dict[str, Any]]:
    """`jobs list`'s page: the statement and its parameters (but :limit and :error_chars), newest
    first, ids below ``before`` when given."""
    clauses = flt.clauses() + (["j.id < :before"] if before is not None else [])
    params = {**flt.params(), "before": before}
    if flt.queue is not None and flt.state is None:
        scans = "\n  UNION ALL\n  ".join(LIST_SCAN.replace("{where}", " AND ".join([scan, *clauses]))
                                          for scan in LIST_SCANS)
        return LIST_MERGED.replace("{scans}", scans), params
    where = ("WHERE " + " AND ".join(clauses)) if clauses else ""
    return LIST.format(where=where), params


SHOW = "SELECT j.*, j.state::text AS state FROM {schema}.jobs AS j WHERE j.id = :id"


# ---------------------------------------------------------------- selection

@dataclass(frozen=True)
class Filter:
    state: str | None = None
    queue: str | None = None
    kind: str | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.state, self.queue, self.kind))

    def clauses(self) -> list[str]:
        """SQL conditions; the state is a literal (validated) so partial indexes can be proved."""
        out = []
        if self.state is not None:
            out.append(f"j.state = '{self.state}'")
            if self.state in FINAL_STATES:
                out.append("j.finalized_at IS NOT NULL")  # jobs_finalized_idx's predicate
        if self.queue is not None:
            out.append("j.queue = :queue")
        if self.kind is not None:
            out.append("j.kind = :kind")
        return out

    def params(self) -> dict[str, Any]:
        return {"queue": self.queue, "kind": self.kind}


def call_query(action: Action, flt: "Filter") -> str:
    """The action's call on the ids of a batch, guarded by the filter when there is one."""
    ids = STILL_MATCHING.replace("{where}", " AND ".join(flt.clauses())) if flt else IDS
    return action.call.replace("{ids}", ids)


def filter_query(action: Action, flt: Filter, *, first: bool) -> str:
    """The batch query of a filter: matching jobs the action applies to, plus running ones (to
    report them), in the keyset order of the index serving the state filter. A queue without a
    state: each state the batch can return read by its own index, merged by id (BY_FILTER_MERGED)."""
    keys = KEYSETS.get(flt.state, _ID)
    where = [f"(({action.applies}) OR j.state = 'running')", *flt.clauses(), EXISTED]
    if keys != _ID:
        where.append(NOT_ATTEMPTED_SINCE)
    if not first:
        cols = ", ".join(col for col, _ in keys)
        marks = ", ".join(f"CAST(:k{i} AS {typ})" for i, (_, typ) in enumerate(keys))
        where.append(f"({cols}) > ({marks})")
    parts = dict(row=ROW, applies=action.applies, to_state=action.to_state,
                 keys=", ".join(f"{col} AS k{i}" for i, (col, _) in enumerate(keys)),
                 order=", ".join(col for col, _ in keys))
    if flt.queue is None or flt.state is not None:
        return BY_FILTER.format(where="\n   AND ".join(where), **parts)
    read = {*action.states, "running"}  # the states a batch returns (running ones are reported)
    scans = [BY_FILTER_SCAN.format(where="\n      AND ".join([scan, *where]), **parts)
             for states, scan in STATE_SCANS if read.intersection(states)]
    return BY_FILTER_MERGED.format(scans="\n  UNION ALL\n  ".join(scans))
