"""Statements on ``{schema}.jobs``: the workers' contract (shown verbatim in the README), the
maintenance services' batches, and the counts behind ``status`` and the job gauges.

Times the daemon passes in (``:now``, horizons) come from the server's clock
(:class:`maintd.clock.ServerClock`); workers use ``now()``.
"""

# -- workers (maintd.jobs.JobQueue) ---------------------------------------------------------------

# ({enqueue}: the INSERT of a job, see maintd/queries/__init__.py.) Also the periodic enqueuer's,
# with scheduled_at = the slot. No conflict target: on the partitioned layout (SPEC 8.1) the unique
# index on unique_key is the live partition's, and PostgreSQL infers a target only from the
# partitioned table's own indexes (which cannot be unique without the partition key); without a
# target every unique index of the partition the row goes to is an arbiter, on both layouts.
ENQUEUE = """
{enqueue}
ON CONFLICT DO NOTHING
RETURNING id
"""

# The periodic enqueuer's, for an entry with a job key mode (graphile-worker's jobKeyMode): a
# waiting job holding the key takes the new args (and, unless :preserve_run_at, the new run time
# and the state that goes with it); a running one is left alone (no row returned). An UPDATE,
# then the INSERT if it changed nothing (ON CONFLICT DO UPDATE needs a conflict target: see
# ENQUEUE); a running holder makes the INSERT conflict, and nothing is returned.
ENQUEUE_REPLACING = """
WITH new AS (
  SELECT CAST(:args AS jsonb) AS args, coalesce(CAST(:scheduled_at AS timestamptz), now()) AS scheduled_at,
         CASE WHEN coalesce(CAST(:scheduled_at AS timestamptz), now()) <= now()
              THEN 'available' ELSE 'scheduled' END::{schema}.job_state AS state
), replaced AS (
  UPDATE {schema}.jobs AS j
     SET args = new.args, kind = :kind, queue = :queue, priority = :priority,
         max_attempts = :max_attempts, metadata = CAST(:metadata AS jsonb),
         scheduled_at = CASE WHEN :preserve_run_at THEN j.scheduled_at ELSE new.scheduled_at END,
         state = CASE WHEN :preserve_run_at OR j.state = 'retryable' THEN j.state ELSE new.state END
    FROM new
   WHERE j.unique_key = :unique_key AND j.state IN ('available', 'scheduled', 'retryable')
  RETURNING j.id
), inserted AS (
  INSERT INTO {schema}.jobs (kind, queue, args, priority, max_attempts, scheduled_at, state,
                             unique_key, metadata)
  SELECT :kind, :queue, new.args, :priority, :max_attempts, new.scheduled_at, new.state,
         :unique_key, CAST(:metadata AS jsonb)
    FROM new
   WHERE NOT EXISTS (SELECT 1 FROM replaced)
  ON CONFLICT DO NOTHING
  RETURNING id
)
SELECT id, true AS replaced FROM replaced UNION ALL SELECT id, false FROM inserted
"""

# Every parameter of the workers' statements is typed in the SQL (CAST), so that any driver runs
# them as they are, whatever types it sends (psql's \bind sends text of unknown type).
CLAIM = """
UPDATE {schema}.jobs
   SET state = 'running', attempt = attempt + 1, attempted_at = now(),
       attempted_by = CAST(:worker AS text), heartbeat_at = NULL
 WHERE id = ANY(ARRAY(
         SELECT id FROM {schema}.jobs
          WHERE state = 'available' AND queue = CAST(:queue AS text) AND scheduled_at <= now()
            AND attempt < max_attempts AND CAST(:worker AS text) IS NOT NULL
          ORDER BY priority, scheduled_at, id
          LIMIT coalesce(CAST(:limit AS integer), 0)
            FOR UPDATE SKIP LOCKED))
   AND state = 'available'
RETURNING id, kind, queue, args, attempt, max_attempts, attempted_by, metadata
"""

# The guard of a worker's own running job (heartbeat, complete, fail).
_MINE = """id = CAST(:id AS bigint) AND state = 'running'
   AND attempted_by = CAST(:worker AS text) AND attempt = CAST(:attempt AS smallint)"""

HEARTBEAT = """
UPDATE {schema}.jobs SET heartbeat_at = now()
 WHERE """ + _MINE + """
RETURNING id
"""

COMPLETE = """
UPDATE {schema}.jobs SET state = 'completed', finalized_at = now()
 WHERE """ + _MINE + """
RETURNING id
"""

FAIL = """
UPDATE {schema}.jobs
   SET state = CASE WHEN attempt >= max_attempts OR CAST(:discard AS boolean)
                    THEN 'discarded' ELSE 'retryable' END::{schema}.job_state,
       scheduled_at = CASE WHEN attempt >= max_attempts OR CAST(:discard AS boolean) THEN scheduled_at
                           ELSE now() + make_interval(secs => coalesce(CAST(:backoff AS float8),
                                                             exp(least(greatest(attempt, 0), 10)))) END,
       finalized_at = CASE WHEN attempt >= max_attempts OR CAST(:discard AS boolean) THEN now() END,
       errors = errors || jsonb_build_array(jsonb_build_object(
                   'at', now(), 'attempt', attempt, 'error', CAST(:error AS text)))
 WHERE """ + _MINE + """
RETURNING state::text
"""

CANCEL = """
UPDATE {schema}.jobs SET state = 'cancelled', finalized_at = now()
 WHERE id = CAST(:id AS bigint) AND state NOT IN {final_states}
RETURNING id
"""

# -- cleaner ------------------------------------------------------------------------------------

# Where a batch ends: the finalized_at of the (:limit + 1)-th row of the state from :lo on. The
# range [lo, that) then holds at most :limit rows of the state. NULL: the rest fits in a batch.
CLEANER_PROBE = """
SELECT finalized_at FROM {schema}.jobs
 WHERE state = CAST(:state AS {schema}.job_state)
   AND finalized_at IS NOT NULL AND finalized_at >= :lo AND finalized_at < :horizon
 ORDER BY finalized_at
OFFSET :limit LIMIT 1
"""

# The same for a per-queue target, over jobs_finalized_queue_idx: only that queue's rows are read.
CLEANER_PROBE_QUEUE = """
SELECT finalized_at FROM {schema}.jobs
 WHERE state = CAST(:state AS {schema}.job_state) AND queue = :queue
   AND finalized_at IS NOT NULL AND finalized_at >= :lo AND finalized_at < :horizon
 ORDER BY finalized_at
OFFSET :limit LIMIT 1
"""

# Where a default target's pass starts: the oldest final row of the state among the queues it
# covers, found by a loose index scan of jobs_finalized_queue_idx (one probe per distinct queue of
# the state), so rows kept by a longer per-queue retention are not walked to get there. NULL:
# nothing of these queues is older than the horizon. One before year 1 (passed over by the deletion
# of those, locked) reads as year 1, where the walk starts anyway: no Python datetime holds it.
CLEANER_FIRST_EXPIRED = """
WITH RECURSIVE oldest AS (
  (SELECT queue, finalized_at FROM {schema}.jobs
    WHERE state = CAST(:state AS {schema}.job_state) AND finalized_at IS NOT NULL
    ORDER BY queue, finalized_at LIMIT 1)
  UNION ALL
  SELECT next.queue, next.finalized_at FROM oldest, LATERAL (
    SELECT queue, finalized_at FROM {schema}.jobs
     WHERE state = CAST(:state AS {schema}.job_state) AND finalized_at IS NOT NULL
       AND queue > oldest.queue
     ORDER BY queue, finalized_at LIMIT 1) AS next
)
SELECT CASE WHEN m < '0001-01-02 00:00:00+00' THEN CAST('0001-01-02 00:00:00+00' AS timestamptz) ELSE m END
  FROM (SELECT min(finalized_at) AS m FROM oldest
         WHERE queue <> ALL(CAST(:excluded AS text[])) AND finalized_at < :horizon) AS first
"""

CLEANER_DELETE_RANGE = """
DELETE FROM {schema}.jobs
 WHERE state = CAST(:state AS {schema}.job_state)
   AND finalized_at IS NOT NULL AND finalized_at >= :lo AND finalized_at < :hi
   AND {target_queues}
"""

# The same range when one of its rows is locked by another session (final rows normally are
# not): delete the others, skip that one.
CLEANER_DELETE_RANGE_SKIP_LOCKED = """
DELETE FROM {schema}.jobs
 WHERE id = ANY(ARRAY(
         SELECT id FROM {schema}.jobs
          WHERE state = CAST(:state AS {schema}.job_state)
            AND finalized_at IS NOT NULL AND finalized_at >= :lo AND finalized_at < :hi
            AND {target_queues}
            FOR UPDATE SKIP LOCKED))
   AND state = CAST(:state AS {schema}.job_state) AND finalized_at >= :lo AND finalized_at < :hi
"""

# After a SKIP LOCKED delete of [lo, hi), in its transaction: the rows it passed over (held by
# another session), for the log and maintd_rows_skipped_total; they are looked at next pass.
CLEANER_LEFT_IN_RANGE = """
SELECT id FROM {schema}.jobs
 WHERE state = CAST(:state AS {schema}.job_state)
   AND finalized_at IS NOT NULL AND finalized_at >= :lo AND finalized_at < :hi
   AND {target_queues}
 ORDER BY finalized_at, id
 LIMIT :limit
"""

# More than :limit rows finalized at the very same instant (a mass cancel: one statement's now()):
# delete them in id batches, from :from_id on (in the Index Cond: the next batch starts after the
# largest id returned), so that the tie's entries are read once, not again in every batch: the
# deleted rows' entries stay in the index until a vacuum, and while a transaction older than the
# delete is open anywhere (a report, a pg_dump) a scan cannot mark them dead.
CLEANER_DELETE_TIED = """
DELETE FROM {schema}.jobs
 WHERE id = ANY(ARRAY(
         SELECT id FROM {schema}.jobs
          WHERE state = CAST(:state AS {schema}.job_state) AND finalized_at = :lo
            AND id >= CAST(:from_id AS bigint)
            AND {target_queues}
          ORDER BY id LIMIT :limit
            FOR UPDATE SKIP LOCKED))
   AND state = CAST(:state AS {schema}.job_state) AND finalized_at = :lo
RETURNING id
"""

# Rows finalized before year 1 ('-infinity', BC dates: no Python datetime holds them), deleted
# first, in batches, so the ranges that follow start at :far_past. Keyset batches from
# (:from_at, :from_id) on (in the Index Cond; text, as it lies before year 1): each starts at the
# last one's last candidate (next_at and next_id, the same on every row returned), so that the
# entries are read once, not again in every batch: the deleted rows' entries stay in the index
# until a vacuum, and while a transaction older than the delete is open anywhere (a report, a
# pg_dump) a scan cannot mark them dead. The DELETE finds the locked rows by id (jobs_pkey), its
# guards checks of the rows.
CLEANER_DELETE_ANCIENT = """
WITH candidates AS MATERIALIZED (
  SELECT id, ctid, finalized_at FROM {schema}.jobs
   WHERE state = CAST(:state AS {schema}.job_state)
     AND finalized_at IS NOT NULL AND finalized_at < :far_past
     AND (finalized_at, id) >= (CAST(:from_at AS timestamptz), CAST(:from_id AS bigint))
     AND {target_queues}
   ORDER BY finalized_at, id LIMIT :limit
     FOR UPDATE SKIP LOCKED
)
DELETE FROM {schema}.jobs
 WHERE id = ANY(ARRAY(SELECT id FROM candidates))  -- (an Index Cond: a ctid = ANY with this as a Filter compared each row with every id)
   AND state = CAST(:state AS {schema}.job_state)  -- (IS TRUE: a check of the locked rows, not a range of the index)
   AND (finalized_at < :far_past) IS TRUE
RETURNING (SELECT CAST(finalized_at AS text) FROM candidates ORDER BY finalized_at DESC, id DESC LIMIT 1) AS next_at,
          (SELECT id FROM candidates ORDER BY finalized_at DESC, id DESC LIMIT 1) AS next_id
"""

# After the last deletion of those, in its transaction: the rows it passed over (held by another
# session), as CLEANER_LEFT_IN_RANGE. The year is a literal, as in CLEANER_ANY_ANCIENT below.
CLEANER_LEFT_ANCIENT = """
SELECT id FROM {schema}.jobs
 WHERE state = CAST(:state AS {schema}.job_state)
   AND finalized_at IS NOT NULL AND finalized_at < '0001-01-02 00:00:00+00'
   AND {target_queues}
 ORDER BY finalized_at, id
 LIMIT :limit
"""

# Asked on every pass, normally of an empty range. The year is a literal (FAR_PAST of
# maintd.services.cleaner), as in RESCUER_NO_SIGN_BATCH: with ``finalized_at < :far_past`` the
# generic plan the server caches after five runs guessed a third of the rows that old, and took
# the first row of a Seq Scan of the whole table (or catch-all) over the index. Known, the range
# is empty to the planner, and on the partitioned layout only the low catch-all is read.
CLEANER_ANY_ANCIENT = """
SELECT EXISTS (SELECT 1 FROM {schema}.jobs
                WHERE state = CAST(:state AS {schema}.job_state)
                  AND finalized_at IS NOT NULL AND finalized_at < '0001-01-02 00:00:00+00')
"""

# Whether another session holds a row (a lock of any mode, or an update or delete not committed
# yet): what makes the pass's DELETE wait for it and then pass it over (SKIP LOCKED). Read from the
# row's xmax, without a lock of the dry run's own (none may be taken in a read-only transaction:
# "cannot execute SELECT FOR KEY SHARE in a read-only transaction"): the row is held while its
# xmax is a transaction in progress. xmax has 32 bits, pg_xact_status wants the full id: the one
# below the snapshot's xmax ``n`` with those low bits (``d``: how far xmax lies after n, modulo
# 2^32; an xmax from n on began after the snapshot, so it is in progress). A row held by several
# sessions at once (shared locks) has a MultiXactId for xmax, which this reads as the transaction
# of that number, normally long over: such a row is counted as one the pass would delete.
# (pg_xact_status is NULL for a transaction too old to know: not held, never NULL, which would
# leave the row out of both counts.)
ROW_HELD = """coalesce(x <> 0 AND (d < 2147483648 OR (n + d - 4294967296 >= 3 AND
          pg_xact_status(CAST(CAST(n + d - 4294967296 AS text) AS xid8)) = 'in progress')), false)"""

# A dry run's count of what a pass deletes, in chunks: the next :limit index entries of the state
# from (:from_at, :from_id) on, in (finalized_at, id) order, up to the horizon; of those, the rows
# of the target's queues, and of them those another session holds (the pass passes them over),
# and where the next chunk starts (NULL: this one reached the horizon). Each entry is read once
# (a row kept by a longer override too), so a chunk reads at most :limit + 1 of them. The position
# is text, as it may lie before year 1 ('-infinity', BC), which no Python datetime holds.
def _count_chunk(walked: str) -> str:
    return """
WITH walk AS (
  SELECT j.finalized_at, j.id, j.queue, CAST(CAST(j.xmax AS text) AS bigint) AS x, snap.n,
         mod(CAST(CAST(j.xmax AS text) AS bigint) - mod(snap.n, 4294967296) + 4294967296, 4294967296) AS d,
         row_number() OVER (ORDER BY j.finalized_at, j.id) AS k
    FROM {schema}.jobs AS j,
         (SELECT CAST(CAST(pg_snapshot_xmax(pg_current_snapshot()) AS text) AS bigint) AS n) AS snap
   WHERE j.state = CAST(:state AS {schema}.job_state) AND """ + walked + """
     AND j.finalized_at IS NOT NULL AND j.finalized_at < :horizon
     AND (j.finalized_at, j.id) >= (CAST(:from_at AS timestamptz), CAST(:from_id AS bigint))
   ORDER BY j.finalized_at, j.id
   LIMIT :limit + 1
)
SELECT count(*) FILTER (WHERE k <= :limit AND {target_queues} AND NOT """ + ROW_HELD + """) AS n,
       count(*) FILTER (WHERE k <= :limit AND {target_queues} AND """ + ROW_HELD + """) AS held,
       max(CAST(finalized_at AS text)) FILTER (WHERE k > :limit) AS next_at,
       max(id) FILTER (WHERE k > :limit) AS next_id
  FROM walk
"""


# Over jobs_finalized_idx (a default target: the entries of every queue, counted for its own),
# or jobs_finalized_queue_idx (a per-queue target: that queue's entries only).
CLEANER_COUNT_CHUNK = _count_chunk("true")
CLEANER_COUNT_CHUNK_QUEUE = _count_chunk("j.queue = :queue")

# -- rescuer ------------------------------------------------------------------------------------

# One batch, one statement: up to :limit candidates in keyset order over jobs_running_idx up to
# the latest horizon of any rule (:scan_until), each checked against its own rule ({stuck}),
# locked (rows a worker is finishing right now are skipped, not waited for: the worker's update
# wins), then rescued by {rescue} (see maintd/queries/__init__.py), which re-checks the state, the
# attempt and the stuck rule on the row as it is now, and announced by {announce}; or, for a
# candidate whose heartbeat is an earlier attempt's ({stale_heartbeat}), that heartbeat cleared
# (the two updates take disjoint rows).
RESCUER_BATCH = """
WITH candidates AS MATERIALIZED (
  SELECT id, ctid, attempt, coalesce(heartbeat_at, attempted_at) AS seen
    FROM {schema}.jobs
   WHERE state = 'running'
     AND coalesce(heartbeat_at, attempted_at) < CAST(:scan_until AS timestamptz) - {ahead}
     AND (coalesce(heartbeat_at, attempted_at), id) > (:after_seen, :after_id)
     AND {stuck}
   ORDER BY coalesce(heartbeat_at, attempted_at), id
   LIMIT :limit
     FOR NO KEY UPDATE SKIP LOCKED
), {rescue}, {clear_stale}
SELECT (SELECT count(*) FROM candidates) AS candidates,
       last.seen AS last_seen, last.id AS last_id,
       (SELECT count(*) FROM rescued WHERE discarded) AS discarded,
       (SELECT count(*) FROM rescued WHERE NOT discarded) AS retried,
       ARRAY(SELECT id FROM cleared ORDER BY id) AS cleared,
       CASE WHEN :announce THEN {announce} ELSE 0 END AS announced
  FROM (SELECT 1) AS one
  LEFT JOIN LATERAL (SELECT seen, id FROM candidates ORDER BY seen DESC, id DESC LIMIT 1) AS last ON true
"""

# Running jobs with no usable sign of life (attempted_at and heartbeat_at NULL, or before year 1:
# '-infinity', BC), which the keyset above cannot reach: stuck by definition, rescued the same
# way; or, for a candidate whose heartbeat is an earlier attempt's (Go's zero time left by a claim
# that does not clear it), that heartbeat cleared, so that it is judged by its claim in the keyset
# above (left alone, it was a candidate of every batch, and the pass never ended). A sign from
# 9999-12-31 on ('infinity', a heartbeat or a claim) is one from the future, which
# RESCUER_FUTURE_SIGN_BATCH dates: taken for none, a job claimed a minute ago was rescued at once,
# and two workers ran it. The year is a literal (maintd.services.rescuer.FAR_PAST), so that even a
# generic plan knows the range is empty and reads the index.
#
# A walk of jobs_running_idx in its order, in keyset batches: the signs before year 1 from
# (:from_seen, :from_id) on, then the rows with none from :from_none on, up to :limit locked
# candidates in all; rows held by another session are passed over (SKIP LOCKED) and not read
# again this pass. Where the next batch starts is the entry after the batch's last candidate of
# each part (next_seen and next_id, next_none; NULL: that part is done). The sign is text, as it
# lies before year 1, which no Python datetime holds. (The ids were picked before SKIP LOCKED,
# with no keyset: a batch whose first entries were held locked none of them, and the pass ended.)
RESCUER_NO_SIGN_BATCH = """
WITH early AS MATERIALIZED (
  SELECT id, ctid, attempt, coalesce(heartbeat_at, attempted_at) AS seen
    FROM {schema}.jobs
   WHERE state = 'running'
     AND coalesce(heartbeat_at, attempted_at) < '0001-01-02 00:00:00+00'
     AND (coalesce(heartbeat_at, attempted_at), id) >= (CAST(:from_seen AS timestamptz), CAST(:from_id AS bigint))
   ORDER BY coalesce(heartbeat_at, attempted_at), id
   LIMIT :limit
     FOR NO KEY UPDATE SKIP LOCKED
), never AS MATERIALIZED (
  SELECT id, ctid, attempt, coalesce(heartbeat_at, attempted_at) AS seen
    FROM {schema}.jobs
   WHERE state = 'running'
     AND coalesce(heartbeat_at, attempted_at) IS NULL AND id >= CAST(:from_none AS bigint)
   ORDER BY coalesce(heartbeat_at, attempted_at), id
   LIMIT :limit - (SELECT count(*) FROM early)
     FOR NO KEY UPDATE SKIP LOCKED
), candidates AS (
  SELECT * FROM early UNION ALL SELECT * FROM never
), {rescue}, {clear_stale}
SELECT (SELECT count(*) FROM candidates) AS candidates,
       (SELECT count(*) FROM rescued WHERE discarded) AS discarded,
       (SELECT count(*) FROM rescued WHERE NOT discarded) AS retried,
       ARRAY(SELECT id FROM rescued) AS ids,
       ARRAY(SELECT id FROM cleared ORDER BY id) AS cleared,
       CASE WHEN :announce THEN {announce} ELSE 0 END AS announced,
       after_early.seen AS next_seen, after_early.id AS next_id,
       CASE WHEN (SELECT count(*) FROM early) < :limit THEN after_never.id
            ELSE CAST(:from_none AS bigint) END AS next_none
  FROM (SELECT 1) AS one
  LEFT JOIN LATERAL (
    SELECT CAST(coalesce(j.heartbeat_at, j.attempted_at) AS text) AS seen, j.id
      FROM {schema}.jobs AS j
     WHERE (SELECT count(*) FROM early) = :limit AND j.state = 'running'
       AND coalesce(j.heartbeat_at, j.attempted_at) < '0001-01-02 00:00:00+00'
       AND (coalesce(j.heartbeat_at, j.attempted_at), j.id)
           > ((SELECT seen FROM early ORDER BY seen DESC, id DESC LIMIT 1),
              (SELECT id FROM early ORDER BY seen DESC, id DESC LIMIT 1))
     ORDER BY coalesce(j.heartbeat_at, j.attempted_at), j.id
     LIMIT 1) AS after_early ON true
  LEFT JOIN LATERAL (
    SELECT j.id
      FROM {schema}.jobs AS j
     WHERE (SELECT count(*) FROM candidates) = :limit AND j.state = 'running'
       AND coalesce(j.heartbeat_at, j.attempted_at) IS NULL AND j.id > (SELECT max(id) FROM never)
     ORDER BY coalesce(j.heartbeat_at, j.attempted_at), j.id
     LIMIT 1) AS after_never ON true
"""

# Running jobs whose sign of life lies more than :ahead seconds in the server's future (a worker
# writing its own clock's time, an import): the keyset above would reach them only then. Such a
# sign was given no later than now, so it is dated now (the statement's time, never before a sign
# committed by then): a live worker's next one replaces it, and a dead worker's job is stuck once
# its grace has passed, like any other. The sign dated is the one that was given: heartbeat_at
# if the job heartbeated, else attempted_at (a heartbeat_at written for a job that never
# heartbeated would put it under heartbeat_timeout, which holds only for jobs that heartbeat). A
# sign from 9999-12-31 on ('infinity', a heartbeat or a claim) is one too. Newest first, through
# jobs_running_idx backwards, in keyset batches from (:from_seen, :from_id) down: each starts at the
# entry after the last one's candidates (next_seen and next_id, the sign as text as it may be
# 'infinity'; NULL: done), so that a pass reads each entry once, though the entries of the rows
# dated stay at the index's end until a vacuum.
RESCUER_FUTURE_SIGN_BATCH = """
WITH candidates AS MATERIALIZED (
  SELECT id, ctid, coalesce(heartbeat_at, attempted_at) AS seen FROM {schema}.jobs
   WHERE state = 'running'
     AND coalesce(heartbeat_at, attempted_at) > statement_timestamp() + make_interval(secs => :ahead)
     AND (coalesce(heartbeat_at, attempted_at), id) <= (CAST(:from_seen AS timestamptz), CAST(:from_id AS bigint))
   ORDER BY coalesce(heartbeat_at, attempted_at) DESC, id DESC
   LIMIT :limit
     FOR NO KEY UPDATE SKIP LOCKED
), dated AS (
  UPDATE {schema}.jobs AS j
     SET heartbeat_at = CASE WHEN j.heartbeat_at IS NOT NULL THEN statement_timestamp() END,
         attempted_at = CASE WHEN j.heartbeat_at IS NULL THEN statement_timestamp() ELSE j.attempted_at END
    FROM candidates AS c
   WHERE j.ctid = ANY(ARRAY(SELECT ctid FROM candidates))  -- a TID path to the locked row versions
     AND j.id = c.id                                        -- alone, whatever the planner thinks of c
     AND j.state = 'running'  -- (IS TRUE: a check of the locked rows, not a range of the index to read)
     AND (coalesce(j.heartbeat_at, j.attempted_at) > statement_timestamp() + make_interval(secs => :ahead)) IS TRUE
  RETURNING j.id
)
SELECT (SELECT count(*) FROM candidates) AS candidates, ARRAY(SELECT id FROM dated ORDER BY id) AS ids,
       after.seen AS next_seen, after.id AS next_id
  FROM (SELECT 1) AS one
  LEFT JOIN LATERAL (
    SELECT CAST(coalesce(j.heartbeat_at, j.attempted_at) AS text) AS seen, j.id
      FROM {schema}.jobs AS j
     WHERE (SELECT count(*) FROM candidates) = :limit AND j.state = 'running'
       AND coalesce(j.heartbeat_at, j.attempted_at) > statement_timestamp() + make_interval(secs => :ahead)
       AND (coalesce(j.heartbeat_at, j.attempted_at), j.id)
           < ((SELECT seen FROM candidates ORDER BY seen, id LIMIT 1),
              (SELECT id FROM candidates ORDER BY seen, id LIMIT 1))
     ORDER BY coalesce(j.heartbeat_at, j.attempted_at) DESC, j.id DESC
     LIMIT 1) AS after ON true
"""

# A dry run's count of the running jobs RESCUER_FUTURE_SIGN_BATCH would date (same conditions).
RESCUER_COUNT_FUTURE = """
SELECT count(*) FROM {schema}.jobs
 WHERE state = 'running'
   AND coalesce(heartbeat_at, attempted_at) > statement_timestamp() + make_interval(secs => :ahead)
"""

# Waiting jobs with no attempt left (attempt >= max_attempts: an import, an operator's UPDATE, or
# reschedule_jobs lowering max_attempts), which the claim passes over: discarded with the reason
# in errors. jobs_exhausted_idx (migration 0005) holds exactly these rows, so this is one probe
# of an empty index in the normal case. Keyset batches from :from_id on (in the Index Cond): each
# starts after the last one's candidates (next_id; NULL past the largest id), so a pass reads each
# entry once, not again in every batch: the entries of the rows discarded stay in the index until
# a vacuum, and a transaction open anywhere keeps them from being skipped.
RESCUER_EXHAUSTED_BATCH = """
WITH candidates AS MATERIALIZED (
  SELECT id, ctid FROM {schema}.jobs
   WHERE state IN ('available', 'scheduled', 'retryable') AND attempt >= max_attempts
     AND id >= CAST(:from_id AS bigint)
   ORDER BY id
   LIMIT :limit
     FOR NO KEY UPDATE SKIP LOCKED
), discarded AS (
  UPDATE {schema}.jobs AS j
     SET state = 'discarded', finalized_at = CAST(:now AS timestamptz),
         errors = j.errors || jsonb_build_array(jsonb_build_object(
                    'at', CAST(:now AS timestamptz), 'attempt', j.attempt,
                    'error', format('discarded by maintd (%s): no attempt left to claim, attempt %s >= max_attempts %s',
                                    CAST(:instance AS text), j.attempt, j.max_attempts)))
    FROM candidates AS c
   WHERE j.ctid = ANY(ARRAY(SELECT ctid FROM candidates))  -- a TID path to the locked row versions
     AND j.id = c.id                                        -- alone, whatever the planner thinks of c
     AND j.state IN ('available', 'scheduled', 'retryable')
     AND (j.attempt >= j.max_attempts) IS TRUE  -- (a check of the locked rows: no read of the whole index)
  RETURNING j.id, j.queue
)
SELECT (SELECT count(*) FROM candidates) AS candidates,
       ARRAY(SELECT id FROM discarded ORDER BY id) AS ids,
       (SELECT CASE WHEN max(id) < 9223372036854775807 THEN max(id) + 1 END FROM candidates) AS next_id
"""

# A dry run's count of what RESCUER_BATCH would rescue (from year 1 on, as its keyset starts there;
# earlier signs of life are RESCUER_COUNT_ODD's).
RESCUER_COUNT_STUCK = """
SELECT count(*) FILTER (WHERE attempt < max_attempts AND {stale_heartbeat} IS NOT TRUE) AS retry,
       count(*) FILTER (WHERE attempt >= max_attempts AND {stale_heartbeat} IS NOT TRUE) AS discard,
       count(*) FILTER (WHERE {stale_heartbeat}) AS cleared
  FROM {schema}.jobs
 WHERE state = 'running'
   AND coalesce(heartbeat_at, attempted_at) >= '0001-01-02 00:00:00+00'
   AND coalesce(heartbeat_at, attempted_at) < CAST(:scan_until AS timestamptz) - {ahead}
   AND {stuck}
"""

# A dry run's count of what the two batches above would handle: running jobs with no usable sign
# of life (rescued, or their earlier attempt's heartbeat cleared, by RESCUER_NO_SIGN_BATCH) and waiting jobs with no attempt left (discarded by
# RESCUER_EXHAUSTED_BATCH), each read by its index as those batches read it.
RESCUER_COUNT_ODD = """
SELECT count(*) FILTER (WHERE state = 'running' AND attempt < max_attempts AND {stale_heartbeat} IS NOT TRUE) AS retry,
       count(*) FILTER (WHERE state = 'running' AND attempt >= max_attempts AND {stale_heartbeat} IS NOT TRUE) AS discard,
       count(*) FILTER (WHERE state = 'running' AND {stale_heartbeat}) AS cleared,
       count(*) FILTER (WHERE state <> 'running') AS exhausted
  FROM {schema}.jobs
 WHERE id = ANY(ARRAY(
         SELECT id FROM {schema}.jobs WHERE state = 'running' AND coalesce(heartbeat_at, attempted_at) IS NULL
         UNION ALL
         SELECT id FROM {schema}.jobs
          WHERE state = 'running' AND coalesce(heartbeat_at, attempted_at) < '0001-01-02 00:00:00+00'
         UNION ALL
         SELECT id FROM {schema}.jobs
          WHERE state IN ('available', 'scheduled', 'retryable') AND attempt >= max_attempts))
   AND state IN ('available', 'scheduled', 'running', 'retryable')
"""

# Precise timing: the earliest stuck deadline in [:since, :until), one probe of jobs_running_idx
# per distinct grace (:graces, seconds): the first running job in seen order whose own grace it
# is, within the seen range that puts its deadline in the window. Rows whose deadline is before
# :since were the last batch's to rescue (or skip, when locked): not a time to wait for.
RESCUER_NEXT_STUCK = """
SELECT min(first.deadline) AS deadline
  FROM unnest(CAST(:graces AS float8[])) AS g(secs)
 CROSS JOIN LATERAL (
  SELECT coalesce(heartbeat_at, attempted_at) + make_interval(secs => g.secs) AS deadline
    FROM {schema}.jobs
   WHERE state = 'running'
     AND coalesce(heartbeat_at, attempted_at) >= CAST(:since AS timestamptz) - make_interval(secs => g.secs)
     AND coalesce(heartbeat_at, attempted_at) < CAST(:until AS timestamptz) - make_interval(secs => g.secs)
     AND {grace} = g.secs
   ORDER BY coalesce(heartbeat_at, attempted_at), id
   LIMIT 1) AS first
"""

# Run just before RESCUER_NEXT_STUCK, in its transaction. The planner cannot know how many rows a
# lateral range holds (0.5 % by default) and would rather sort a bitmap scan of the whole window
# (35 ms with 10,000 heartbeating jobs in it) than walk jobs_running_idx in order to the first
# match (0.1 ms). Transaction-local, so only the probe (the transaction's last statement) sees it.
RESCUER_PROBE_PLANNING = """
SELECT set_config('enable_bitmapscan', 'off', true), set_config('enable_sort', 'off', true)
"""

# -- scheduler ----------------------------------------------------------------------------------

# Due: scheduled_at <= :now (the daemon's reading of the server's clock, carried forward on the
# host's monotonic clock, or a test's FrozenClock) and never ahead of the server's own clock:
# statement_timestamp() is when the server got this statement, so a job is never promoted before
# clock_timestamp() reaches its scheduled_at, whatever the carried reading's drift. (Unlike
# clock_timestamp(), it is stable, so the bound stays an index condition on jobs_scheduled_idx.)
# In keyset batches after (:after_at, :after_id) (in the Index Cond): each starts after the last
# one's candidates (last_at and last_id, the due time as text as it may lie before year 1), so that
# a pass reads each entry once: the entries of the rows promoted stay in the index until a vacuum,
# and while a transaction older than the promotion is open anywhere (a report, a pg_dump) a scan
# cannot mark them dead, so a batch that started at the index's start read them all again. The
# UPDATE finds the locked rows by id (jobs_pkey), its guards checks of the rows, not a range to read.
SCHEDULER_PROMOTE = """
WITH candidates AS MATERIALIZED (
  SELECT id, ctid, scheduled_at FROM {schema}.jobs
   WHERE state IN ('scheduled', 'retryable')
     AND scheduled_at <= least(CAST(:now AS timestamptz), statement_timestamp())
     AND (scheduled_at, id) > (CAST(:after_at AS timestamptz), CAST(:after_id AS bigint))
   ORDER BY scheduled_at, id
   LIMIT :limit
     FOR UPDATE SKIP LOCKED
), promoted AS (
  UPDATE {schema}.jobs AS j SET state = 'available'
   WHERE j.id = ANY(ARRAY(SELECT id FROM candidates))
     AND j.state IN ('scheduled', 'retryable')  -- (IS TRUE: a check of the locked rows, not a range of the index to read)
     AND (j.scheduled_at <= least(CAST(:now AS timestamptz), statement_timestamp())) IS TRUE
  RETURNING j.queue
)
SELECT queue, count(*) AS n, last.at AS last_at, last.id AS last_id
  FROM promoted,
       (SELECT CAST(scheduled_at AS text) AS at, id FROM candidates ORDER BY scheduled_at DESC, id DESC LIMIT 1) AS last
 GROUP BY queue, last.at, last.id
"""

# Wake the workers of each queue (delivered only if the transaction commits).
NOTIFY_QUEUES = "SELECT pg_notify(:channel, q) FROM unnest(CAST(:queues AS text[])) AS q"

# -- the services' probes (maintd.probes.ServiceProbe: scalar subqueries, one statement over the
# targets of a database; each one index entry) ---------------------------------------------------

# The scheduler's: the next due time (jobs_scheduled_idx), or year 1 (due now) while a job is due
# before it ('-infinity', Go's zero time): no Python datetime holds its own time, and without
# ticks of its own (precise_timing) the scheduler would wait for another job to fall due.
NEXT_DUE = """(SELECT CASE WHEN (SELECT min(scheduled_at) FROM {schema}.jobs
                          WHERE state IN ('scheduled', 'retryable')) < '0001-01-02 00:00:00+00'
                    THEN CAST('0001-01-02 00:00:00+00' AS timestamptz)
                    ELSE (SELECT min(scheduled_at) FROM {schema}.jobs
                           WHERE state IN ('scheduled', 'retryable')
                             AND scheduled_at >= '0001-01-02 00:00:00+00'
                             AND scheduled_at < '9999-12-31 00:00:00+00') END)"""

# The cleaner's: the oldest finalized_at of each final state (jobs_finalized_idx), only values a
# Python datetime holds, so an odd row never fails the read: one before year 1 ('-infinity', BC)
# reads as year 1 (expired), one from year 9999 on ('infinity') as NULL (never expires).
OLDEST_FINALIZED = [f"""(SELECT CASE WHEN m < '0001-01-02 00:00:00+00' THEN CAST('0001-01-02 00:00:00+00' AS timestamptz)
                   WHEN m < '9999-12-31 00:00:00+00' THEN m END
  FROM (SELECT min(finalized_at) AS m FROM {{schema}}.jobs
         WHERE state = '{state}' AND finalized_at IS NOT NULL) AS oldest)"""
                    for state in ("completed", "cancelled", "discarded")]

# The rescuer's: the oldest usable sign of life of a running job (jobs_running_idx; only values a
# Python datetime holds, so an odd row never fails the read; NULL: none), whether one has no
# usable sign at all (or one from 9999-12-31 on, to date), whether a waiting job has no attempt left (jobs_exhausted_idx), and the newest
# usable sign of life (one in the server's future is dated now: RESCUER_FUTURE_SIGN_BATCH).
RESCUER_PROBE = ["""(SELECT min(coalesce(heartbeat_at, attempted_at)) FROM {schema}.jobs WHERE state = 'running'
     AND coalesce(heartbeat_at, attempted_at) >= '0001-01-02 00:00:00+00'
     AND coalesce(heartbeat_at, attempted_at) < '9999-12-31 00:00:00+00')""",
                 # three reads of one index entry each: its NULLs, its first and its last value
                 # (conditions joined by OR, or an EXISTS of a range, were planned as a Seq Scan,
                 # reading every row: 45 ms at 450,000 rows)
                 """(SELECT coalesce(EXISTS (SELECT 1 FROM {schema}.jobs WHERE state = 'running'
                                AND coalesce(heartbeat_at, attempted_at) IS NULL)
                OR (SELECT min(coalesce(heartbeat_at, attempted_at)) FROM {schema}.jobs
                     WHERE state = 'running') < '0001-01-02 00:00:00+00'
                OR (SELECT max(coalesce(heartbeat_at, attempted_at)) FROM {schema}.jobs
                     WHERE state = 'running') >= '9999-12-31 00:00:00+00', false))""",
                 # min(id), not EXISTS: with many waiting jobs the planner guesses a third of them
                 # exhausted, and the first row of a Seq Scan then costs about as little as the
                 # first entry of the empty index (the plan flipped between runs); an aggregate
                 # over a Seq Scan costs the whole table, so the index is always taken
                 """((SELECT min(id) FROM {schema}.jobs
   WHERE state IN ('available', 'scheduled', 'retryable') AND attempt >= max_attempts) IS NOT NULL)""",
                 # the newest usable sign of life (one index entry): one in the future is dated now
                 """(SELECT max(coalesce(heartbeat_at, attempted_at)) FROM {schema}.jobs WHERE state = 'running'
     AND coalesce(heartbeat_at, attempted_at) >= '0001-01-02 00:00:00+00'
     AND coalesce(heartbeat_at, attempted_at) < '9999-12-31 00:00:00+00')"""]

# After a batch that promoted fewer than its limit: the next due time to wait for, after the due
# bound of SCHEDULER_PROMOTE (its :now). A row due by then that is still waiting is one the batch
# could not take (held by another session): it is the due-time probe's (once a second), not a time
# to wake for again and again (every MIN_WAKE while it is held). In the batch's transaction, so
# the server's side of the bound is now() (the transaction's start, never after the batch's
# statement_timestamp()), not this statement's own later time: with :now ahead of the server's
# clock, a job falling due while the batch ran was taken for one it had passed over.
SCHEDULER_NEXT_DUE = """
SELECT min(scheduled_at) FROM {schema}.jobs
 WHERE state IN ('scheduled', 'retryable')
   AND scheduled_at > least(CAST(:now AS timestamptz), now())
   AND scheduled_at >= '0001-01-02 00:00:00+00' AND scheduled_at < '9999-12-31 00:00:00+00'
"""

# An idle tick's only statement (read-only, in autocommit): is anything due (the first entry of
# jobs_scheduled_idx, whatever :now is, even in a generic plan), and when is the next due time
# (as SCHEDULER_NEXT_DUE)? Two probes of the index, each reading one entry.
SCHEDULER_PROBE = """
SELECT coalesce((SELECT min(scheduled_at) FROM {schema}.jobs
                  WHERE state IN ('scheduled', 'retryable')) <= CAST(:now AS timestamptz), false) AS due,
       (SELECT min(scheduled_at) FROM {schema}.jobs
         WHERE state IN ('scheduled', 'retryable')
           AND scheduled_at >= '0001-01-02 00:00:00+00' AND scheduled_at < '9999-12-31 00:00:00+00') AS next_due
"""

SCHEDULER_COUNT_DUE = """
SELECT queue, count(*) AS n FROM {schema}.jobs
 WHERE state IN ('scheduled', 'retryable')
   AND scheduled_at <= least(CAST(:now AS timestamptz), statement_timestamp())  -- SCHEDULER_PROMOTE's bound
 GROUP BY queue
"""

# -- status and job gauges ------------------------------------------------------------------------

# Live states are served by their partial indexes; final ones read the heap (bounded by a timeout).
# One condition per index (jobs_fetch_idx, jobs_scheduled_idx, jobs_running_idx), joined by OR:
# ``state IN`` all four implies no index's predicate, so on the plain layout the count was a Seq
# Scan of every final row too (the bulk of the table); this way a BitmapOr of the three reads only
# live rows (partitioned, the planner reads the live partition once, as before).
COUNT_LIVE = """
SELECT queue, state::text AS state, count(*) AS n FROM {schema}.jobs
 WHERE state = 'available' OR state IN ('scheduled', 'retryable') OR state = 'running'
 GROUP BY queue, state
"""

COUNT_FINAL = """
SELECT queue, state::text AS state, count(*) AS n FROM {schema}.jobs
 WHERE finalized_at IS NOT NULL GROUP BY queue, state
"""

# An infinite scheduled_at has no age (PostgreSQL 15 cannot subtract it, 17+ gives infinity).
# Since when an available job waits, as a time a Python datetime holds: due before year 1
# ('-infinity', Go's zero time: the scheduler promotes such jobs), since it was made; due past year
# 9999, never (no claim takes it). The gauge and the dashboard's oldest available agree; loaded as
# is, such a time made the dashboard's whole overview a 503.
WAITING_SINCE = """CASE WHEN scheduled_at < '0001-01-02 00:00:00+00'
                    THEN CASE WHEN created_at >= '0001-01-02 00:00:00+00'
                               AND created_at < '9999-12-31 00:00:00+00' THEN created_at END
                    WHEN scheduled_at < '9999-12-31 00:00:00+00' THEN scheduled_at END"""

# A queue whose available jobs are all due later waits for none of them yet: 0, as the gauge and
# the dashboard say (passed on as is, /status said -3600 for a job due in an hour).
OLDEST_AVAILABLE = """
SELECT queue, CASE WHEN since > now() THEN 0 ELSE extract(epoch FROM now() - since)::float8 END AS age
  FROM (SELECT queue, min(""" + WAITING_SINCE + """) AS since
          FROM {schema}.jobs WHERE state = 'available' GROUP BY queue) AS o
"""

COUNT_BY_STATE = "SELECT state::text, count(*) FROM {schema}.jobs GROUP BY state"

# -- demo -----------------------------------------------------------------------------------------

# Old finished jobs (for the cleaner) and jobs of workers that died before the demo (rescuer).
DEMO_SEED_OLD = """
INSERT INTO {schema}.jobs (kind, queue, state, attempt, attempted_at, finalized_at, created_at)
SELECT 'demo.old', 'default', CAST(:state AS {schema}.job_state), 1, now() - CAST(:age AS interval),
       CASE WHEN :state = 'running' THEN NULL ELSE now() - CAST(:age AS interval) END,
       now() - CAST(:age AS interval)
  FROM generate_series(1, :n)
"""


# The counts of several targets of one database in one statement (maintd.probes.CountProbe): each
# of COUNT_LIVE, COUNT_FINAL ("c"), OLDEST_AVAILABLE ("o") and LAYOUT_NOW ("l", 1: partitioned) of
# target ``t``, tagged, as (t, k, queue, state, v) rows, joined with UNION ALL.
TAGGED = {"c": "SELECT {t} AS t, 'c' AS k, x.queue, x.state, x.n::float8 AS v FROM ({rows}) x",
          "o": "SELECT {t} AS t, 'o' AS k, x.queue, NULL AS state, x.age::float8 AS v FROM ({rows}) x",
          "l": "SELECT {t} AS t, 'l' AS k, NULL AS queue, NULL AS state, x.p::int::float8 AS v FROM ({rows}) x"}

# Whether the jobs table is partitioned now (SPEC 8.1), read with the counts: a conversion swaps the
# table under a running daemon. A catalog lookup by oid (the schema is a validated identifier).
LAYOUT_NOW = """
SELECT coalesce((SELECT c.relkind = 'p' FROM pg_class AS c WHERE c.oid = to_regclass('{schema}.jobs')), false) AS p
"""
