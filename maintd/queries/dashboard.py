"""Statements of the dashboard (read-only, on ``{schema}.jobs`` and maintd's tables): bounded
counts that read an index and stop, keyset pages in each state's index order. Where a statement
follows a state's index, ``{where}`` and ``{order}`` are filled from ``INDEX`` (fixed text of
this module, never user input)."""

from . import FINAL_STATES
from .jobs import WAITING_SINCE

# Each state's index: (its predicate, its order). scheduled and retryable share jobs_scheduled_idx;
# available's (jobs_fetch_idx) leads with the queue.
_SCHEDULED_IDX = ("state IN ('scheduled', 'retryable')", "scheduled_at, id")

INDEX = {
    "available": ("state = 'available'", "queue, priority, scheduled_at, id"),
    "scheduled": _SCHEDULED_IDX,
    "retryable": _SCHEDULED_IDX,
    "running": ("state = 'running'", "coalesce(heartbeat_at, attempted_at), id"),
    **{s: (f"state = '{s}' AND finalized_at IS NOT NULL", "finalized_at DESC, id DESC")
       for s in FINAL_STATES},
}

# Counts of scheduled, retryable and running (whose indexes do not hold the queue): (state, queue)
# among the first `cap` entries of the state's index (the soonest due, the longest running).
WINDOW = """
SELECT state::text AS state, queue, count(*) AS n
  FROM (SELECT state, queue FROM {schema}.jobs WHERE {where} ORDER BY {order} LIMIT :cap) w
 GROUP BY state, queue
"""

# The first job of each (queue, priority) group of available jobs, by a loose index scan of
# jobs_fetch_idx: the smallest scheduled_at per queue is among them. Of the first :max_heads groups;
# ``more``: whether there is another past them (one more probe, not a guess from finding :max_heads).
# A head due before year 1 (Go's zero time, '-infinity') waits since it was made (WAITING_SINCE), so
# the group's first job due from year 1 on may wait longer: one more probe of the index for it
# (taking the head alone, a job made now at Go's zero time hid one due an hour ago, unlike the gauge).
HEADS = """
WITH RECURSIVE heads AS (
  (SELECT queue, priority, scheduled_at, created_at FROM {schema}.jobs WHERE state = 'available'
    ORDER BY queue, priority, scheduled_at, id LIMIT 1)
  UNION ALL
  SELECT n.queue, n.priority, n.scheduled_at, n.created_at
    FROM heads h CROSS JOIN LATERAL (
         SELECT queue, priority, scheduled_at, created_at FROM {schema}.jobs
          WHERE state = 'available' AND (queue, priority) > (h.queue, h.priority)
          ORDER BY queue, priority, scheduled_at, id LIMIT 1) n
)
SELECT queue, min(CASE WHEN scheduled_at >= '0001-01-02 00:00:00+00' THEN """ + WAITING_SINCE + """
                       ELSE least(""" + WAITING_SINCE + """, (
                            SELECT j.scheduled_at FROM {schema}.jobs j
                             WHERE j.state = 'available' AND j.queue = h.queue AND j.priority = h.priority
                               AND j.scheduled_at >= '0001-01-02 00:00:00+00'
                               AND j.scheduled_at < '9999-12-31 00:00:00+00'
                             ORDER BY j.queue, j.priority, j.scheduled_at, j.id LIMIT 1)) END) AS oldest,
       count(*) AS groups,
       (SELECT count(*) FROM (SELECT FROM heads LIMIT :max_heads + 1) m) > :max_heads AS more
  FROM (SELECT * FROM heads LIMIT :max_heads) h GROUP BY queue
"""

AVAILABLE_COUNTS = """
SELECT q.queue, (SELECT count(*) FROM (SELECT 1 FROM {schema}.jobs j
                                        WHERE j.state = 'available' AND j.queue = q.queue
                                        ORDER BY j.priority, j.scheduled_at, j.id
                                        LIMIT :cap) s) AS n
  FROM unnest(CAST(:queues AS text[])) AS q(queue)
"""

# The queues holding final jobs of a state: a loose index scan of jobs_finalized_queue_idx (one
# probe per distinct queue).
FINAL_QUEUES = """
WITH RECURSIVE q AS (
  (SELECT queue FROM {schema}.jobs
    WHERE state = CAST(:state AS {schema}.job_state) AND finalized_at IS NOT NULL ORDER BY queue LIMIT 1)
  UNION ALL
  SELECT (SELECT j.queue FROM {schema}.jobs j
           WHERE j.state = CAST(:state AS {schema}.job_state) AND j.finalized_at IS NOT NULL
             AND j.queue > q.queue ORDER BY j.queue LIMIT 1)
    FROM q WHERE q.queue IS NOT NULL
)
SELECT queue FROM q WHERE queue IS NOT NULL LIMIT :max_queues
"""

# Final jobs of a state per queue, at most :cap index entries of jobs_finalized_queue_idx each, in
# its order (as AVAILABLE_COUNTS): unordered, the first :cap rows of a Seq Scan looked as cheap as
# the index's from random_page_cost 4 on, a whole-table read per queue.
FINAL_COUNTS = """
SELECT q.queue, (SELECT count(*) FROM (SELECT 1 FROM {schema}.jobs j
                                        WHERE j.state = CAST(:state AS {schema}.job_state)
                                          AND j.queue = q.queue AND j.finalized_at IS NOT NULL
                                        ORDER BY j.finalized_at, j.id
                                        LIMIT :cap) s) AS n
  FROM unnest(CAST(:queues AS text[])) AS q(queue)
"""

# Rows per state from the statistics (ANALYZE, autovacuum): no row is read.
ESTIMATES = """
SELECT v.state, round(greatest(c.reltuples, 0) * v.freq)::bigint AS n
  FROM pg_class c
  JOIN pg_stats s ON s.schemaname = :schema AND s.tablename = 'jobs' AND s.attname = 'state'
 CROSS JOIN unnest(s.most_common_vals::text::text[], s.most_common_freqs) AS v(state, freq)
 WHERE c.oid = to_regclass(:table)
"""

DISCARDED = """
SELECT id, kind, queue, attempt, max_attempts, finalized_at,
       left(errors->-1->>'error', 2000) AS last_error
  FROM {schema}.jobs WHERE state = 'discarded' AND finalized_at IS NOT NULL
 ORDER BY finalized_at DESC, id DESC LIMIT :n
"""

LIST_COLUMNS = """id, kind, queue, state::text AS state, priority, attempt, max_attempts, scheduled_at,
       created_at, attempted_at, finalized_at, left(args::text, 160) AS args_brief,
       left(errors->-1->>'error', 300) AS last_error"""

LIST = """
SELECT {columns}, {keys}
  FROM (SELECT * FROM {schema}.jobs WHERE {where} {after} ORDER BY {order} LIMIT :scan) w
 WHERE {outer} ORDER BY {order} LIMIT :limit
"""

# Available jobs of every queue (jobs_fetch_idx): each queue's first job after the cursor (its head),
# then a page of only those queues whose head is among the :limit smallest heads. A job of any other
# queue comes after those :limit heads, so it cannot be on the page; read in full, a page of every
# queue (51 jobs, args and last error included) cost 51 rows a queue: 0.27 s for 5,000 queues, so
# about 100,000 would pass the readers' statement timeout (0.045 s for 5,000 so).
LIST_AVAILABLE = """
WITH RECURSIVE queues AS (
  (SELECT queue FROM {schema}.jobs WHERE state = 'available' ORDER BY queue LIMIT 1)
  UNION ALL
  SELECT (SELECT j.queue FROM {schema}.jobs j WHERE j.state = 'available' AND j.queue > q.queue
           ORDER BY j.queue LIMIT 1)
    FROM queues q WHERE q.queue IS NOT NULL
), heads AS (
  SELECT q.queue, h.* FROM queues q CROSS JOIN LATERAL (
    SELECT {keys} FROM {schema}.jobs
     WHERE state = 'available' AND queue = q.queue {after} ORDER BY {order} LIMIT 1) h
   WHERE q.queue IS NOT NULL
), bound AS (SELECT {outer_order} FROM heads ORDER BY {outer_order} OFFSET CAST(:limit AS int) - 1 LIMIT 1)
SELECT j.* FROM heads h CROSS JOIN LATERAL (
  SELECT {columns}, {keys} FROM {schema}.jobs
   WHERE state = 'available' AND queue = h.queue {after} ORDER BY {order} LIMIT :limit) j
 WHERE NOT EXISTS (SELECT FROM bound) OR ({heads_order}) <= (SELECT {outer_order} FROM bound)
 ORDER BY {outer_order} LIMIT :limit
"""

WINDOW_END = """
SELECT {keys} FROM {schema}.jobs WHERE {where} {after} ORDER BY {order} OFFSET :scan - 1 LIMIT 1
"""

# The newest 50 errors each as its text, loaded one by one (db.load_json): one that Python cannot load
# (nested too deep, an integer of over 4,300 digits) is shown as text, the others as they are.
# Args, metadata, each error, unique_key and attempted_by (text of any length, written by producers
# and workers): at most :limit characters, with their whole length (*_chars), so
# a job of hundreds of MB costs the daemon what its page shows, not the whole row. An error longer
# than that comes as its at, attempt and the start of its error (or of its text).
JOB = """
SELECT id, kind, queue, state::text AS state, priority, attempt, max_attempts, scheduled_at,
       created_at, attempted_at, left(attempted_by, :limit) AS attempted_by,
       length(attempted_by) AS attempted_by_chars, heartbeat_at, finalized_at,
       left(unique_key, :limit) AS unique_key, length(unique_key) AS unique_key_chars,
       left(p.args, :limit) AS args, length(p.args) AS args_chars,
       left(p.metadata, :limit) AS metadata, length(p.metadata) AS metadata_chars,
       jsonb_array_length(errors) AS error_count,
       ARRAY(SELECT CASE WHEN length(e::text) <= :limit THEN e::text
                         ELSE jsonb_build_object('at', left(e->>'at', 100), 'attempt', left(e->>'attempt', 20),
                                                 'error', left(coalesce(e->>'error', e::text), :limit))::text END
               FROM jsonb_array_elements(errors) WITH ORDINALITY AS x(e, i)
              WHERE i > jsonb_array_length(errors) - 50 ORDER BY i DESC) AS errors,
       ARRAY(SELECT length(e::text) FROM jsonb_array_elements(errors) WITH ORDINALITY AS x(e, i)
              WHERE i > jsonb_array_length(errors) - 50 ORDER BY i DESC) AS error_chars
  FROM {schema}.jobs j
 CROSS JOIN LATERAL (SELECT jsonb_pretty(j.args) AS args, jsonb_pretty(j.metadata) AS metadata) p
 WHERE id = :id
"""
