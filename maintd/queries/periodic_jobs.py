"""Statements on ``{schema}.periodic_jobs``: periodic schedules kept as rows (SPEC 7.10)."""

from . import PYTHON_TIMES

# What changed since the last read: cheap enough for every pass of the periodic enqueuer.
# What changes with any committed change of the rows, whatever the order of the commits: each
# row's xmin (a new row version's own). max(updated_at) did not: the trigger stamps now(), the
# writing transaction's start, so a long transaction committing after a shorter one that began
# later left the maximum as it was, and its change unread until a restart.
VERSION = """
SELECT count(*) AS n, md5(string_agg(id || ':' || xmin::text, ',' ORDER BY id)) AS changed
  FROM {schema}.periodic_jobs
"""

# Every row (or the first :n by id; NULL: all), its times and intervals guarded: one that no
# Python value holds ('infinity', past year 9999, an interval of billions of days) would fail the
# read of every row, and with it the whole enqueuer; such a row comes back with NULL there, to be
# refused with its ``error`` set.
ALL = """
SELECT id, schedule, timezone, kind, queue, args, priority, max_attempts, unique_key,
       CASE WHEN backfill BETWEEN interval '0' AND interval '1000000 days' THEN backfill END AS backfill,
       backfill IS NOT NULL AND NOT backfill BETWEEN interval '0' AND interval '1000000 days' AS backfill_out_of_range,
       run_on_start, enabled, error,
       CASE WHEN updated_at BETWEEN """ + PYTHON_TIMES + """
            THEN updated_at END AS updated_at,
       CASE WHEN created_at BETWEEN """ + PYTHON_TIMES + """
            THEN created_at END AS created_at,
       CASE WHEN resumed_at BETWEEN """ + PYTHON_TIMES + """
            THEN resumed_at END AS resumed_at
  FROM {schema}.periodic_jobs ORDER BY id LIMIT CAST(:n AS bigint)
"""

# The daemon's note on a row it cannot use (NULL clears it); written only when it changes.
SET_ERROR = """
UPDATE {schema}.periodic_jobs SET error = CAST(:error AS text)
 WHERE id = :id AND error IS DISTINCT FROM CAST(:error AS text)
"""

# Add a row; with :replace, an existing row takes the new values (else no row is returned).
UPSERT = """
INSERT INTO {schema}.periodic_jobs (id, schedule, timezone, kind, queue, args, priority,
                                    max_attempts, unique_key, backfill, run_on_start, enabled)
VALUES (:id, :schedule, :timezone, :kind, :queue, CAST(:args AS jsonb), :priority, :max_attempts,
        :unique_key, CAST(:backfill AS interval), :run_on_start, true)
ON CONFLICT (id) DO UPDATE
   SET schedule = excluded.schedule, timezone = excluded.timezone, kind = excluded.kind,
       queue = excluded.queue, args = excluded.args, priority = excluded.priority,
       max_attempts = excluded.max_attempts, unique_key = excluded.unique_key,
       backfill = excluded.backfill, run_on_start = excluded.run_on_start
 WHERE CAST(:replace AS boolean)
RETURNING id
"""

DELETE = "DELETE FROM {schema}.periodic_jobs WHERE id = :id RETURNING id"

SET_ENABLED = "UPDATE {schema}.periodic_jobs SET enabled = :enabled WHERE id = :id RETURNING id"

# The rows `maintd periodic list`, /status and the dashboard list: those whose id is a configured
# entry's (:configured; the daemon refuses them and notes why in their error), then the first :n
# others by id (the primary key; NULL: all), one more to tell there are more. Every row was read,
# a last slot and a next fire time each: 20,000 rows (SPEC 7.10's rows are an application's, one
# per customer, say) took 7-10 s and 6 MB a dashboard render, seconds of CPU per /status.
LISTED = """
SELECT id, schedule, timezone, kind, queue, enabled, error, true AS shadowed
  FROM {schema}.periodic_jobs WHERE id = ANY(CAST(:configured AS text[]))
UNION ALL
(SELECT id, schedule, timezone, kind, queue, enabled, error, false AS shadowed
   FROM {schema}.periodic_jobs WHERE NOT id = ANY(CAST(:configured AS text[])) ORDER BY id LIMIT CAST(:n AS bigint) + 1)
"""
