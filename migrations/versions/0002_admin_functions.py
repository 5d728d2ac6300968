"""SQL admin functions (SPEC 7.5): complete_jobs, permanently_fail_jobs, retry_jobs, cancel_jobs,
reschedule_jobs, remove_job, delete_jobs

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23

Modelled on graphile-worker's administration functions (README "Administration functions";
``complete_jobs``, ``permanently_fail_jobs``, ``reschedule_jobs``, ``remove_job``) and River's
``JobRetry`` (riverdriver/riverpgxv5/internal/dbsqlc/river_job.sql), adapted to maintd's states.
Shared rules, for every function:

- the ``ids`` are locked ``FOR UPDATE SKIP LOCKED`` with ``state <> 'running'`` in the WHERE: a
  ``running`` job, or a row a worker holds locked (claiming or finishing it), is skipped at once,
  never waited for and never changed;
- ``finalized_at`` is set exactly when the new state is final and cleared otherwise (the table's
  ``jobs_finalized_at_iff_final_check`` enforces it);
- each returns the rows it changed (``SETOF jobs``), possibly fewer than asked for;
- a function that leaves jobs ``available`` sends the scheduler's ``NOTIFY`` (channel
  ``maintd_jobs``, or ``<schema>_maintd_jobs``; payload: the queue, once per queue), delivered
  at commit;
- times come from the server's ``now()`` (the caller's transaction start).
"""

from alembic import op

from maintd.db import notify_channel, quote_ident

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

FINAL = "('completed', 'cancelled', 'discarded')"
IDLE = "('available', 'scheduled', 'retryable')"  # non-final and not running
HEADER = "SET search_path = pg_catalog, pg_temp"

# Each: (signature, returns, language, body, comment). {q} is the quoted schema, {channel} the
# NOTIFY channel. Column references are always qualified: parameter names (priority,
# max_attempts) would otherwise shadow or clash with columns.
FUNCTIONS = [
    ("complete_jobs(ids bigint[])", "sql", """
  UPDATE {q}.jobs AS j SET state = 'completed', finalized_at = now()
   WHERE j.id = ANY(ARRAY(SELECT c.id FROM {q}.jobs AS c
                           WHERE c.id = ANY(complete_jobs.ids)
                             AND c.state <> 'running' AND c.state <> 'completed'
                           ORDER BY c.id FOR UPDATE SKIP LOCKED))
     AND j.state <> 'running' AND j.state <> 'completed'
  RETURNING j.*
""", "Marks jobs completed (any state but running/completed; discarded and cancelled ones too, as "
     "graphile-worker allows), finalized_at = now(). Skips running and locked jobs."),

    ("permanently_fail_jobs(ids bigint[], reason text DEFAULT NULL)", "sql", f"""
  UPDATE {{q}}.jobs AS j
     SET state = 'discarded', finalized_at = now(),
         errors = j.errors || jsonb_build_array(jsonb_build_object(
           'at', now(), 'attempt', j.attempt,
           'error', coalesce(permanently_fail_jobs.reason, 'permanently failed by an operator')))
   WHERE j.id = ANY(ARRAY(SELECT c.id FROM {{q}}.jobs AS c
                           WHERE c.id = ANY(permanently_fail_jobs.ids) AND c.state IN {IDLE}
                           ORDER BY c.id FOR UPDATE SKIP LOCKED))
     AND j.state IN {IDLE}
  RETURNING j.*
""", "Discards available/scheduled/retryable jobs, finalized_at = now(), appending "
     "{at, attempt, error: reason} to errors. Skips running, locked and final jobs."),

    ("cancel_jobs(ids bigint[])", "sql", f"""
  UPDATE {{q}}.jobs AS j SET state = 'cancelled', finalized_at = now()
   WHERE j.id = ANY(ARRAY(SELECT c.id FROM {{q}}.jobs AS c
                           WHERE c.id = ANY(cancel_jobs.ids) AND c.state IN {IDLE}
                           ORDER BY c.id FOR UPDATE SKIP LOCKED))
     AND j.state IN {IDLE}
  RETURNING j.*
""", "Cancels available/scheduled/retryable jobs, finalized_at = now(). Skips running, locked "
     "and final jobs."),

    ("delete_jobs(ids bigint[])", "sql", """
  DELETE FROM {q}.jobs AS j
   WHERE j.id = ANY(ARRAY(SELECT c.id FROM {q}.jobs AS c
                           WHERE c.id = ANY(delete_jobs.ids) AND c.state <> 'running'
                           ORDER BY c.id FOR UPDATE SKIP LOCKED))
     AND j.state <> 'running'
  RETURNING j.*
""", "Deletes jobs in any state but running; returns the deleted rows. Skips running and locked "
     "jobs."),

    ("remove_job(key text)", "sql STRICT", f"""
  DELETE FROM {{q}}.jobs AS j
   WHERE j.id = ANY(ARRAY(SELECT c.id FROM {{q}}.jobs AS c
                           WHERE c.unique_key = remove_job.key
                             AND c.state NOT IN {FINAL} AND c.state <> 'running'
                             FOR UPDATE SKIP LOCKED))
     AND j.state IN {IDLE}
  RETURNING j.*
""", "Deletes the pending (available/scheduled/retryable) job holding unique_key = key, freeing "
     "the key. A running or locked job is left as it is (graphile-worker would also stop it "
     "retrying; maintd never touches a running job). Final jobs keep their key as history."),

    ("retry_jobs(ids bigint[])", "plpgsql", f"""
DECLARE
  changed {{q}}.jobs[];
BEGIN
  WITH candidates AS (
    SELECT c.id, c.state, c.unique_key FROM {{q}}.jobs AS c
     WHERE c.id = ANY(retry_jobs.ids) AND c.state <> 'running'
       AND NOT (c.state = 'available' AND c.scheduled_at <= now())
     ORDER BY c.id
       FOR UPDATE SKIP LOCKED
  ), revivable AS (
    -- A final job whose unique_key a live job holds stays final (the key is taken); of several
    -- final jobs with one key, the newest is revived.
    SELECT c.id FROM candidates AS c
     WHERE c.state NOT IN {FINAL} OR c.unique_key IS NULL
        OR (c.id = (SELECT max(d.id) FROM candidates AS d
                     WHERE d.unique_key = c.unique_key AND d.state IN {FINAL})
            AND NOT EXISTS (SELECT 1 FROM {{q}}.jobs AS o
                             WHERE o.unique_key = c.unique_key AND o.state NOT IN {FINAL}))
  ), updated AS (
    UPDATE {{q}}.jobs AS j
       SET state = 'available', scheduled_at = now(), finalized_at = NULL,
           max_attempts = greatest(j.max_attempts, least(j.attempt + 1, 32767))
      FROM revivable AS r
     WHERE j.id = r.id AND j.state <> 'running'
    RETURNING j AS job
  )
  SELECT coalesce(array_agg(u.job ORDER BY (u.job).id), '{{}}') INTO changed FROM updated AS u;
  PERFORM pg_notify('{{channel}}', x.queue) FROM (SELECT DISTINCT c.queue FROM unnest(changed) AS c) AS x;
  RETURN QUERY SELECT * FROM unnest(changed);
END
""", "Makes jobs available now (River's JobRetry): scheduled, retryable, completed, cancelled and "
     "discarded ones, and available ones due later. finalized_at = NULL; a job out of attempts "
     "gets one more (max_attempts = greatest(max_attempts, attempt + 1)); attempt and errors are "
     "kept. Skips running and locked jobs, and final jobs whose unique_key a live job holds. "
     "NOTIFYs each queue."),

    ("reschedule_jobs(ids bigint[], run_at timestamptz DEFAULT NULL, priority int DEFAULT NULL, "
     "attempts int DEFAULT NULL, max_attempts int DEFAULT NULL)", "plpgsql", f"""
DECLARE
  changed {{q}}.jobs[];
BEGIN
  WITH updated AS (
    UPDATE {{q}}.jobs AS j
       SET scheduled_at = coalesce(reschedule_jobs.run_at, j.scheduled_at),
           state = (CASE WHEN coalesce(reschedule_jobs.run_at, j.scheduled_at) <= now() THEN 'available'
                         WHEN j.state = 'retryable' THEN 'retryable'
                         ELSE 'scheduled' END)::{{q}}.job_state,
           priority = coalesce(reschedule_jobs.priority, j.priority),
           attempt = coalesce(reschedule_jobs.attempts, j.attempt),
           max_attempts = coalesce(reschedule_jobs.max_attempts, j.max_attempts)
     WHERE j.id = ANY(ARRAY(SELECT c.id FROM {{q}}.jobs AS c
                             WHERE c.id = ANY(reschedule_jobs.ids) AND c.state IN {IDLE}
                             ORDER BY c.id FOR UPDATE SKIP LOCKED))
       AND j.state IN {IDLE}
    RETURNING j AS job
  )
  SELECT coalesce(array_agg(u.job ORDER BY (u.job).id), '{{}}') INTO changed FROM updated AS u;
  PERFORM pg_notify('{{channel}}', x.queue)
     FROM (SELECT DISTINCT c.queue FROM unnest(changed) AS c WHERE c.state = 'available') AS x;
  RETURN QUERY SELECT * FROM unnest(changed);
END
""", "Changes run time, priority, attempt and max_attempts (NULL keeps a field) of available/"
     "scheduled/retryable jobs. The state follows the run time: available if due, else scheduled "
     "(retryable stays retryable). Final jobs are not revived here: retry_jobs does that. Skips "
     "running and locked jobs. NOTIFYs each queue with a job made available."),
]


def _schema() -> str:
    return op.get_context().version_table_schema


def upgrade() -> None:
    schema = _schema()
    q, channel = quote_ident(schema), notify_channel(schema)
    for signature, language, body, comment in FUNCTIONS:
        name = signature.split("(", 1)[0]
        lang, _, strict = language.partition(" ")
        op.execute(
            f"CREATE FUNCTION {q}.{signature} RETURNS SETOF {q}.jobs\n"
            f"LANGUAGE {lang} VOLATILE {strict} {HEADER}\nAS $fn$"
            + body.replace("{q}", q).replace("{channel}", channel)
            + "$fn$"
        )
        args = _arg_types(signature)
        literal = "'" + comment.replace("'", "''") + "'"
        op.execute(f"COMMENT ON FUNCTION {q}.{name}({args}) IS {literal}")


def _arg_types(signature: str) -> str:
    """'f(ids bigint[], reason text DEFAULT NULL)' -> 'bigint[], text'."""
    params = signature.split("(", 1)[1].rsplit(")", 1)[0]
    return ", ".join(p.split()[1] for p in params.split(","))


def downgrade() -> None:
    q = quote_ident(_schema())
    for signature, *_ in reversed(FUNCTIONS):
        name = signature.split("(", 1)[0]
        op.execute(f"DROP FUNCTION IF EXISTS {q}.{name}({_arg_types(signature)})")
