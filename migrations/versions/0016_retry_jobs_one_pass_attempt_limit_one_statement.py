"""retry_jobs: the newest final job of each unique_key found in one pass, a job at attempt 32767
left alone, and the keyed final jobs revived in one statement

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-29

Three faults of 0012's body, fixed together (none of them changes the signature):

* The newest final job of each unique_key was found by a subquery over the call's other
  candidates, once per keyed job: quadratic (16,000 jobs took 13 s; `maintd jobs retry
  --batch-size 1000000` hours). One grouped pass now.
* 0012 made retry_jobs give an available job out of attempts one more (max_attempts = attempt + 1,
  at most 32767). A job at attempt 32767 (the README's odd row, "The attempt counter") cannot have
  one more: retry_jobs still returned it as changed, with scheduled_at = now(). That moved it ahead
  of the keyset of a ``--state available`` filter, so every later batch retried it again and the
  command never ended. Such a job is now "nothing to do"; the rescuer discards it.
* Each final job with a unique_key was updated in a BEGIN ... EXCEPTION block of its own (a live
  job with its key may have been enqueued meanwhile: a unique_violation leaves that one job final).
  Each block is a subtransaction with a transaction id of its own: a `maintd jobs retry` batch of
  1,000 such jobs opened 1,000. Past 64 in one transaction, PostgreSQL's per-backend cache of
  subtransactions overflows, and every other session's snapshot must then look them up in
  pg_subtrans until the transaction ends (the workers' claims included). Now the keyed jobs are
  revived by one UPDATE in one block; only when that meets a conflict does it fall back to one
  block per job.

Same signature: ``CREATE OR REPLACE`` keeps the comment's place and the grants.
"""

from alembic import op

from maintd.db import notify_channel, quote_ident

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

FINAL = "('completed', 'cancelled', 'discarded')"

BODY = f"""
DECLARE
  plain bigint[];
  keyed bigint[];
  changed {{q}}.jobs[];
  one {{q}}.jobs;
  job_id bigint;
BEGIN
  WITH candidates AS (
    SELECT c.id, c.state, c.unique_key FROM {{q}}.jobs AS c
     WHERE c.id = ANY(retry_jobs.ids) AND c.state <> 'running'
       AND NOT (c.state = 'available' AND c.scheduled_at <= now()
                AND (c.attempt < c.max_attempts OR c.attempt >= 32767))  -- nothing to give
     ORDER BY c.id
       FOR UPDATE SKIP LOCKED
  ), revivable AS (
    -- A final job whose unique_key a live job holds stays final (the key is taken); of several
    -- final jobs with one key, the newest is revived.
    SELECT c.id, c.state IN {FINAL} AND c.unique_key IS NOT NULL AS keyed FROM candidates AS c
     WHERE c.state NOT IN {FINAL} OR c.unique_key IS NULL
        OR (c.id IN (SELECT max(d.id) FROM candidates AS d
                      WHERE d.unique_key IS NOT NULL AND d.state IN {FINAL}
                      GROUP BY d.unique_key)  -- one hashed pass, not one scan per job
            AND NOT EXISTS (SELECT 1 FROM {{q}}.jobs AS o
                             WHERE o.unique_key = c.unique_key AND o.state NOT IN {FINAL}))
  )
  SELECT coalesce(array_agg(r.id) FILTER (WHERE NOT r.keyed), '{{}}'),
         coalesce(array_agg(r.id ORDER BY r.id) FILTER (WHERE r.keyed), '{{}}')
    INTO plain, keyed FROM revivable AS r;
  WITH updated AS (
    UPDATE {{q}}.jobs AS j
       SET state = 'available', scheduled_at = now(), finalized_at = NULL,
           max_attempts = greatest(j.max_attempts, least(j.attempt + 1, 32767))
     WHERE j.id = ANY(plain) AND j.state <> 'running'
    RETURNING j AS job
  )
  SELECT coalesce(array_agg(u.job), '{{}}') INTO changed FROM updated AS u;
  IF cardinality(keyed) > 0 THEN
    BEGIN  -- all at once: one subtransaction (one per job overflowed the backend's cache of 64)
      WITH updated AS (
        UPDATE {{q}}.jobs AS j
           SET state = 'available', scheduled_at = now(), finalized_at = NULL,
               max_attempts = greatest(j.max_attempts, least(j.attempt + 1, 32767))
         WHERE j.id = ANY(keyed) AND j.state <> 'running'
        RETURNING j AS job
      )
      SELECT changed || coalesce(array_agg(u.job), '{{}}') INTO changed FROM updated AS u;
    EXCEPTION WHEN unique_violation OR lock_not_available THEN
      -- a live job with one of the keys was enqueued meanwhile (not yet committed when read):
      -- one job at a time, so that only the jobs whose key is taken stay final
      FOREACH job_id IN ARRAY keyed LOOP
        BEGIN
          UPDATE {{q}}.jobs AS j
             SET state = 'available', scheduled_at = now(), finalized_at = NULL,
                 max_attempts = greatest(j.max_attempts, least(j.attempt + 1, 32767))
           WHERE j.id = job_id AND j.state <> 'running'
          RETURNING j.* INTO one;
          IF FOUND THEN
            changed := changed || one;
          END IF;
        EXCEPTION WHEN unique_violation OR lock_not_available THEN
          NULL;  -- the key is taken: the job stays final
        END;
      END LOOP;
    END;
  END IF;
  PERFORM pg_notify('{{channel}}', x.queue) FROM (SELECT DISTINCT c.queue FROM unnest(changed) AS c) AS x;
  RETURN QUERY SELECT * FROM unnest(changed) AS c ORDER BY c.id;
END
"""

COMMENT = ("Makes jobs available now (River's JobRetry): scheduled, retryable, completed, cancelled and "
           "discarded ones, available ones due later, and available ones out of attempts. "
           "finalized_at = NULL; a job out of attempts gets one more (max_attempts = "
           "greatest(max_attempts, attempt + 1)); attempt and errors are kept. Skips running and "
           "locked jobs, and final jobs whose unique_key a live job holds (also one enqueued "
           "meanwhile). An available job due now is left alone unless it is out of attempts and below "
           "attempt 32767. NOTIFYs each queue.")


def upgrade() -> None:
    schema = op.get_context().version_table_schema
    q, channel = quote_ident(schema), notify_channel(schema)
    op.execute(f"CREATE OR REPLACE FUNCTION {q}.retry_jobs(ids bigint[]) RETURNS SETOF {q}.jobs\n"
               "LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp\nAS $fn$"
               + BODY.replace("{q}", q).replace("{channel}", channel) + "$fn$")
    literal = "'" + COMMENT.replace("'", "''") + "'"
    op.execute(f"COMMENT ON FUNCTION {q}.retry_jobs(bigint[]) IS {literal}")


def downgrade() -> None:
    pass  # the new body works with every earlier revision's tables
