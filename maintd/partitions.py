"""The partitioned layout of ``jobs`` (SPEC 8.1): its DDL and the partition functions.

``jobs`` is partitioned by ``LIST (state)``: ``jobs_live`` holds the four live states (a claim, a
heartbeat or a retry never moves a row between partitions) and ``jobs_<state>`` each final state,
itself partitioned by ``RANGE (finalized_at)``. The ranges of a final state tile the whole time
line, always:

* ``jobs_<state>_min``: ``[MINVALUE, L)``, the low catch-all;
* the *proper* partitions ``jobs_<state>_p<YYYYMMDD>t<HHMMSS>`` (named by their start, UTC):
  ``[L, H)`` in steps of ``[partitions] interval``;
* ``jobs_<state>_max``: ``[H, MAXVALUE)``, the high catch-all.

Catch-alls, not a ``DEFAULT`` partition: adding a partition beside a DEFAULT one means scanning it
under an ACCESS EXCLUSIVE lock, and a DEFAULT partition holding rows of the new range makes the add
fail for good (pgmq issue 583). A row outside the made ranges (a clock ahead or behind, an import,
``'infinity'``, a burst while no leader made partitions) lands in a catch-all. There it is counted
(``maintd_partition_stray_rows``) and handled by the leader (:data:`FUNCTIONS`):

* the low catch-all's rows are older than every proper partition: the catch-all is dropped (and a
  new empty one put in its place) once its whole range is past the state's retention;
* when the premade range grows over rows of the high catch-all, the catch-all itself becomes the
  proper partition of its range up to the step after its latest such row (no row of that range is
  moved, however many a burst left there), and its rows beyond move into the new partitions;
  ``'infinity'`` and far-future rows stay in the high catch-all until time reaches them.

Changing a catch-all's range means detaching it, which takes an ACCESS EXCLUSIVE lock on
``jobs_<state>``; so does detaching an expired partition without ``CONCURRENTLY``, and
``DETACH ... CONCURRENTLY`` cannot run inside a function (PostgreSQL refuses it there, and only
a function lets the runtime role, which has no DDL rights, do DDL). Every change is therefore made
by ``maintain_partitions`` in one short transaction that takes its locks with ``NOWAIT``. An
expired partition is emptied first (``TRUNCATE``, under a lock on itself alone: every completion
locks ``jobs_<state>``, none an expired range), so its rows go without any completion waiting;
the empty tables are detached by the next call, in a transaction of its own (migration 0009: the
emptying's commit unlinks the old files, which takes time proportional to their size, while no
lock on ``jobs_<state>`` is held), when ``jobs_<state>`` is free (``NOWAIT``; a later pass when it
is not). Only making partitions waits for it in the lock queue, briefly (migration 0008). Under that
lock only the catalog changes (and the few rows named above move). Dropping the detached tables
(their files) comes after, in a transaction of its own that locks only them.

The functions are created by ``maintd migrate`` (migration 0006), owned by the schema's owner,
``SECURITY DEFINER`` with ``search_path`` pinned; ``maintd grants`` grants EXECUTE on them to the
daemon's role.
"""

from __future__ import annotations

from datetime import timedelta

from .identifiers import quote_ident
from .queries import FINAL_STATES, LIVE_STATES_SQL

LIVE_PARTITION = "jobs_live"
# What marks a table detached by maintain_partitions, for drop_detached_partitions.
DETACHED_COMMENT = "maintd: detached partition, to be dropped"

# An emptied partition's rows are counted exactly up to this many, beyond it estimated (a literal
# in maintain_partitions, as of migration 0015; partitions.EXPIRED's :cap), and so are a
# catch-all's (a literal in catch_all_rows; partitions.SUMMARY's :cap).
EXACT_UP_TO = 100_000
# The most partitions one call of maintain_partitions makes a state (a literal there: make_partitions'
# and prepare_partitions' p_cap); a dry run counts as many.
MAKE_CAP = 50

# Indexes of the live partition (the plain layout's names: migrations 0001 and 0005). The final
# states' two are partitioned indexes on jobs itself (every partition gets its own).
LIVE_INDEXES = {
    "jobs_fetch_idx": "(queue, priority, scheduled_at, id) WHERE state = 'available'",
    "jobs_scheduled_idx": "(scheduled_at, id) WHERE state IN ('scheduled', 'retryable')",
    "jobs_running_idx": "(coalesce(heartbeat_at, attempted_at), id) WHERE state = 'running'",
    "jobs_exhausted_idx": "(id) WHERE state IN ('available', 'scheduled', 'retryable') "
                          "AND attempt >= max_attempts",
}
UNIQUE_KEY_INDEX = ("jobs_unique_key_idx", "(unique_key) WHERE unique_key IS NOT NULL "
                    "AND state NOT IN ('completed', 'cancelled', 'discarded')")
FINAL_INDEXES = {
    "jobs_finalized_idx": "(state, finalized_at, id) WHERE finalized_at IS NOT NULL",
    "jobs_finalized_queue_idx": "(state, queue, finalized_at, id) WHERE finalized_at IS NOT NULL",
}


def partitions_ddl(schema: str, root: str = "jobs", suffix: str = "") -> list[str]:
    """The partitions of a new partitioned ``root`` (already created, ``PARTITION BY LIST
    (state)``): the live partition with its indexes, each final state's range-partitioned table
    with its two catch-alls meeting at the current step of time, and the final states' indexes.
    ``suffix`` is appended to index names (``--convert`` builds beside the plain table's)."""
    q = quote_ident(schema)
    out = [f"CREATE TABLE {q}.{LIVE_PARTITION} PARTITION OF {q}.{root} FOR VALUES IN {LIVE_STATES_SQL}",
           f"ALTER TABLE {q}.{LIVE_PARTITION} ADD CONSTRAINT {LIVE_PARTITION}_pkey PRIMARY KEY (id)"]
    for name, definition in LIVE_INDEXES.items():
        out.append(f"CREATE INDEX {name}{suffix} ON {q}.{LIVE_PARTITION} {definition}")
    name, definition = UNIQUE_KEY_INDEX
    out.append(f"CREATE UNIQUE INDEX {name}{suffix} ON {q}.{LIVE_PARTITION} {definition}")
    for state in FINAL_STATES:
        out.append(f"CREATE TABLE {q}.jobs_{state} PARTITION OF {q}.{root} FOR VALUES IN ('{state}') "
                   "PARTITION BY RANGE (finalized_at)")
    for name, definition in FINAL_INDEXES.items():
        out.append(f"CREATE INDEX {name}{suffix} ON {q}.{root} {definition}")
    return out


def start_sql(schema: str, step: timedelta) -> list[str]:
    """Each final state's two catch-alls, meeting at the current step of time (from the epoch),
    unless the state has partitions already: a schema downgraded below migration 0006 keeps them
    (they hold its finished jobs) and 0006 runs again on the way up."""
    q = quote_ident(schema)
    secs = int(step.total_seconds())
    return [f"SELECT {q}.start_partitions('{state}', make_interval(secs => {secs})) WHERE NOT EXISTS "
            f"(SELECT FROM pg_catalog.pg_inherits WHERE inhparent = CAST('{q}.jobs_{state}' AS regclass))"
            for state in FINAL_STATES]


def premake_sql(schema: str, step: timedelta, premake: int) -> list[str]:
    """Statements making each final state's partitions ``premake`` steps ahead of now."""
    q = quote_ident(schema)
    secs = int(step.total_seconds())
    return [f"SELECT count(*) FROM {q}.maintain_partitions('{state}', make_interval(secs => {secs}), "
            f"now() + make_interval(secs => {secs * premake}))" for state in FINAL_STATES]


# (signature, returns, attributes, body). {schema} is the quoted schema. Helpers run as the caller
# (the definer, when called from a definer function); EXECUTE on all but the read-only
# PUBLIC_HELPERS is revoked from PUBLIC (catch_all_rows runs as the owner: the daemon's role gets
# EXECUTE on it, a worker's does not).
PUBLIC_HELPERS = ("job_partitions(",)
HELPERS = [
    ("job_partitions(p_state text)",
     "TABLE (partition_name text, range_start timestamptz, range_end timestamptz)",
     "LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp "
     "SET \"TimeZone\" = 'UTC' SET \"DateStyle\" = 'ISO, MDY'", """
  -- The range partitions of a final state, in order; NULL is MINVALUE (start) or MAXVALUE (end).
  -- Bounds are printed and read back in ISO and UTC, pinned for the call whatever the caller's
  -- settings (before PostgreSQL 18 a zone abbreviation such as IST, printed in the SQL style,
  -- read back as another zone's): "FOR VALUES FROM ('<start>') TO ('<end>')", MINVALUE and
  -- MAXVALUE unquoted. The quoted values
  -- are cut out by position (regular expressions made it twice as slow; it runs several times a
  -- pass).
  SELECT c.relname::text,
         CASE WHEN b.low THEN NULL ELSE CAST(split_part(b.expr, '''', 2) AS timestamptz) END,
         CASE WHEN strpos(b.expr, 'TO (MAXVALUE)') > 0 THEN NULL
              ELSE CAST(split_part(b.expr, '''', CASE WHEN b.low THEN 2 ELSE 4 END) AS timestamptz) END
    FROM pg_inherits AS i
    JOIN pg_class AS c ON c.oid = i.inhrelid
   CROSS JOIN LATERAL (SELECT x.expr, strpos(x.expr, 'FROM (MINVALUE)') > 0 AS low
                         FROM (SELECT pg_get_expr(c.relpartbound, c.oid) AS expr) AS x) AS b
   WHERE i.inhparent = to_regclass(format('{schema}.%I', 'jobs_' || p_state))
   ORDER BY 2 NULLS FIRST
"""),
    ("catch_all_rows()", "TABLE (state text, low_rows bigint, high_rows bigint)",
     "LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp", """
DECLARE
  s text;
  cap constant bigint := 100000;
BEGIN
  -- The rows in each final state's catch-alls (strays), counted in those tables themselves:
  -- through jobs, the plan would cover every partition. Counts only; the daemon's role may call it.
  -- Up to cap rows each, then the planner's estimate if larger: a conversion leaves the finished
  -- jobs of a whole retention in the low catch-all (ten million: 0.4 s a count), and the
  -- partitioner, `maintd status` and the dashboard read this often.
  FOREACH s IN ARRAY ARRAY['completed', 'cancelled', 'discarded'] LOOP
    state := s;
    EXECUTE format('SELECT (SELECT count(*) FROM (SELECT FROM {schema}.%I LIMIT %s) AS l), '
                   '(SELECT count(*) FROM (SELECT FROM {schema}.%I LIMIT %s) AS h)',
                   'jobs_' || s || '_min', cap + 1, 'jobs_' || s || '_max', cap + 1) INTO low_rows, high_rows;
    IF low_rows > cap THEN
      SELECT greatest(low_rows, CAST(c.reltuples AS bigint)) INTO low_rows FROM pg_class AS c
       WHERE c.oid = to_regclass(format('{schema}.%I', 'jobs_' || s || '_min'));
    END IF;
    IF high_rows > cap THEN
      SELECT greatest(high_rows, CAST(c.reltuples AS bigint)) INTO high_rows FROM pg_class AS c
       WHERE c.oid = to_regclass(format('{schema}.%I', 'jobs_' || s || '_max'));
    END IF;
    RETURN NEXT;
  END LOOP;
END
"""),
    ("partition_name(p_state text, p_start timestamptz)", "text",
     "LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp", """
  SELECT 'jobs_' || p_state || '_p' || to_char(p_start AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISS')
"""),
    ("new_partition_table(p_state text, p_name text)", "void",
     "LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp", """
BEGIN
  -- A table shaped like the state's partitions (columns, checks, the indexes of jobs' own two,
  -- named after the table), not yet attached.
  EXECUTE format('CREATE TABLE {schema}.%I (LIKE {schema}.%I INCLUDING CONSTRAINTS)', p_name, 'jobs_' || p_state);
  EXECUTE format('ALTER TABLE {schema}.%I ADD CONSTRAINT %I PRIMARY KEY (id)', p_name, p_name || '_pkey');
@FINAL_INDEXES@
END
"""),
    ("attach_partition(p_state text, p_name text, p_start timestamptz, p_end timestamptz)", "void",
     "LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp "
     "SET \"TimeZone\" = 'UTC' SET \"DateStyle\" = 'ISO, MDY'", """
BEGIN
  -- The bounds are printed into the statement and read back, in ISO and UTC whatever the
  -- caller's settings (migrate and --convert call it from the owner's session: before PostgreSQL
  -- 18, "IST" printed in the SQL style was read back as Israel's time, 3.5 hours off).
  EXECUTE format('ALTER TABLE {schema}.%I ATTACH PARTITION {schema}.%I FOR VALUES FROM (%s) TO (%s)',
                 'jobs_' || p_state, p_name,
                 CASE WHEN p_start IS NULL THEN 'MINVALUE' ELSE quote_literal(p_start) END,
                 CASE WHEN p_end IS NULL THEN 'MAXVALUE' ELSE quote_literal(p_end) END);
END
"""),
    ("rename_partition(p_old text, p_new text)", "void",
     "LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp", """
DECLARE
  r record;
BEGIN
  -- A partition's table and its indexes (named after it: new_partition_table) take a new name.
  EXECUTE format('ALTER TABLE {schema}.%I RENAME TO %I', p_old, p_new);
  FOR r IN SELECT i.relname FROM pg_index AS x JOIN pg_class AS i ON i.oid = x.indexrelid
            WHERE x.indrelid = to_regclass(format('{schema}.%I', p_new)) AND starts_with(i.relname, p_old || '_') LOOP
    EXECUTE format('ALTER INDEX {schema}.%I RENAME TO %I', r.relname, p_new || substr(r.relname, length(p_old) + 1));
  END LOOP;
END
"""),
    ("start_partitions(p_state text, p_step interval, p_at timestamptz DEFAULT NULL)", "void",
     "LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp", """
DECLARE
  secs float8 := extract(epoch FROM p_step);
  at timestamptz := to_timestamp(floor(extract(epoch FROM coalesce(p_at, now())) / secs) * secs);
BEGIN
  -- The two catch-alls of a new state table, meeting at the step of time of p_at (now).
  PERFORM {schema}.new_partition_table(p_state, 'jobs_' || p_state || '_min');
  PERFORM {schema}.attach_partition(p_state, 'jobs_' || p_state || '_min', NULL, at);
  PERFORM {schema}.new_partition_table(p_state, 'jobs_' || p_state || '_max');
  PERFORM {schema}.attach_partition(p_state, 'jobs_' || p_state || '_max', at, NULL);
END
"""),
    ("drop_expired_partitions(p_state text, p_before timestamptz)",
     "TABLE (action text, partition_name text, range_start timestamptz, range_end timestamptz, "
     "row_count bigint, estimated boolean)",
     "LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp", """
DECLARE
  r record;
  new_start timestamptz;
  min_name text := 'jobs_' || p_state || '_min';
BEGIN
  -- Under the caller's lock on jobs_<state>: detach every partition whose whole range ends by
  -- p_before (the low catch-all first among them), and put a new empty low catch-all below the
  -- first partition left. The detached tables are marked for drop_detached_partitions.
  SELECT max(p.range_end) INTO new_start FROM {schema}.job_partitions(p_state) AS p
   WHERE p.range_end <= p_before;
  IF new_start IS NULL THEN
    RETURN;
  END IF;
  FOR r IN SELECT p.partition_name FROM {schema}.job_partitions(p_state) AS p WHERE p.range_end <= p_before LOOP
    EXECUTE format('LOCK TABLE ONLY {schema}.%I IN ACCESS EXCLUSIVE MODE NOWAIT', r.partition_name);
  END LOOP;
  IF to_regclass(format('{schema}.%I', min_name || '_new')) IS NULL THEN  -- prepare_partitions made it
    PERFORM {schema}.new_partition_table(p_state, min_name || '_new');
  END IF;
  FOR r IN SELECT p.* FROM {schema}.job_partitions(p_state) AS p WHERE p.range_end <= p_before LOOP
    -- One left pending by an interrupted DETACH ... CONCURRENTLY (an operator's): PostgreSQL
    -- refuses a plain detach of it and completes it only with FINALIZE (allowed in a function).
    EXECUTE format('ALTER TABLE {schema}.%I DETACH PARTITION {schema}.%I', 'jobs_' || p_state, r.partition_name)
      || CASE WHEN EXISTS (SELECT FROM pg_inherits AS i
                            WHERE i.inhrelid = to_regclass(format('{schema}.%I', r.partition_name))
                              AND i.inhdetachpending) THEN ' FINALIZE' ELSE '' END;
    EXECUTE format('COMMENT ON TABLE {schema}.%I IS %L', r.partition_name, '@DETACHED@');
    IF r.partition_name = min_name THEN
      PERFORM {schema}.rename_partition(min_name,
                                        min_name || '_' || to_char(r.range_end AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISS'));
    END IF;
    action := 'detached';
    partition_name := CASE WHEN r.partition_name = min_name
                           THEN min_name || '_' || to_char(r.range_end AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISS')
                           ELSE r.partition_name END;
    range_start := r.range_start; range_end := r.range_end;
    row_count := 0; estimated := false;  -- emptied before (and counted then)
    RETURN NEXT;
  END LOOP;
  PERFORM {schema}.rename_partition(min_name || '_new', min_name);
  PERFORM {schema}.attach_partition(p_state, min_name, NULL, new_start);
END
"""),
    ("prepare_partitions(p_state text, p_step interval, p_until timestamptz, p_cap int, p_drop boolean)",
     "void", "LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp", """
DECLARE
  secs float8 := extract(epoch FROM p_step);
  s timestamptz;
  made_to timestamptz;
BEGIN
  -- Before any lock on jobs_<state>: the new tables a change will attach (not attached yet, so
  -- making them holds up no one): the low catch-all's successor, the partitions ahead.
  IF p_drop AND to_regclass(format('{schema}.%I', 'jobs_' || p_state || '_min_new')) IS NULL THEN
    PERFORM {schema}.new_partition_table(p_state, 'jobs_' || p_state || '_min_new');
  END IF;
  SELECT p.range_start INTO s FROM {schema}.job_partitions(p_state) AS p WHERE p.range_end IS NULL;
  IF s >= p_until THEN
    RETURN;
  END IF;
  made_to := least(s + ceil(extract(epoch FROM p_until - s) / secs) * p_step, s + p_cap * p_step);
  WHILE s < made_to LOOP
    IF to_regclass(format('{schema}.%I', {schema}.partition_name(p_state, s))) IS NULL THEN
      PERFORM {schema}.new_partition_table(p_state, {schema}.partition_name(p_state, s));
    END IF;
    s := s + p_step;
  END LOOP;
END
"""),
    ("make_partitions(p_state text, p_step interval, p_until timestamptz, p_cap int)",
     "TABLE (action text, partition_name text, range_start timestamptz, range_end timestamptz, "
     "row_count bigint, estimated boolean)",
     "LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp", """
DECLARE
  max_name text := 'jobs_' || p_state || '_max';
  secs float8 := extract(epoch FROM p_step);
  made_from timestamptz;  -- H: where the high catch-all starts
  target timestamptz;     -- the first step boundary at or after p_until
  latest timestamptz;     -- the catch-all's latest row before target
  x timestamptz;          -- where proper partitions start to be made (H, or after latest)
  made_to timestamptz;
  s timestamptz;
  n bigint;
BEGIN
  -- Under the caller's lock on jobs_<state>: make the partitions from H up to p_until (at most
  -- p_cap new tables), the high catch-all starting after them.
  SELECT p.range_start INTO made_from FROM {schema}.job_partitions(p_state) AS p WHERE p.range_end IS NULL;
  IF made_from >= p_until THEN
    RETURN;
  END IF;
  target := made_from + ceil(extract(epoch FROM p_until - made_from) / secs) * p_step;
  EXECUTE format('LOCK TABLE ONLY {schema}.%I IN ACCESS EXCLUSIVE MODE NOWAIT', max_name);
  EXECUTE format('SELECT max(finalized_at) FROM {schema}.%I WHERE state = %L AND finalized_at < %L',
                 max_name, p_state, target) INTO latest;
  x := CASE WHEN latest IS NULL THEN made_from
            ELSE made_from + (floor(extract(epoch FROM latest - made_from) / secs) + 1) * p_step END;
  made_to := least(target, x + p_cap * p_step);
  EXECUTE format('ALTER TABLE {schema}.%I DETACH PARTITION {schema}.%I', 'jobs_' || p_state, max_name);
  IF x > made_from THEN
    -- Rows of the catch-all below x stay where they are: it becomes the partition [H, x). The
    -- tables prepare_partitions made for that range are not needed.
    s := made_from;
    WHILE s < x LOOP
      EXECUTE format('DROP TABLE IF EXISTS {schema}.%I', {schema}.partition_name(p_state, s));
      s := s + p_step;
    END LOOP;
    PERFORM {schema}.rename_partition(max_name, {schema}.partition_name(p_state, made_from));
    PERFORM {schema}.new_partition_table(p_state, max_name);
  END IF;
  s := x;
  WHILE s < made_to LOOP
    IF to_regclass(format('{schema}.%I', {schema}.partition_name(p_state, s))) IS NULL THEN
      PERFORM {schema}.new_partition_table(p_state, {schema}.partition_name(p_state, s));
    END IF;
    PERFORM {schema}.attach_partition(p_state, {schema}.partition_name(p_state, s), s, s + p_step);
    action := 'made'; partition_name := {schema}.partition_name(p_state, s);
    range_start := s; range_end := s + p_step; row_count := 0; estimated := false;
    RETURN NEXT;
    s := s + p_step;
  END LOOP;
  PERFORM {schema}.attach_partition(p_state, max_name, made_to, NULL);
  IF x > made_from THEN
    EXECUTE format('WITH m AS (DELETE FROM {schema}.%I WHERE state = %L AND finalized_at >= %L RETURNING *) '
                   'INSERT INTO {schema}.%I SELECT * FROM m',
                   {schema}.partition_name(p_state, made_from), p_state, x, 'jobs_' || p_state);
    GET DIAGNOSTICS n = ROW_COUNT;
    PERFORM {schema}.attach_partition(p_state, {schema}.partition_name(p_state, made_from), made_from, x);
    action := 'closed'; partition_name := {schema}.partition_name(p_state, made_from);
    range_start := made_from; range_end := x; row_count := NULL; estimated := false;
    RETURN NEXT;  -- the catch-all's rows below x, now in a proper partition
    action := 'moved'; partition_name := max_name;
    range_start := x; range_end := NULL; row_count := n;
    RETURN NEXT;  -- its rows from x on, into the partitions made and the new catch-all
  END IF;
END
"""),
]

# The functions the daemon's role calls (EXECUTE granted by `maintd grants`): (signature,
# returns, body). SECURITY DEFINER, owned by the schema's owner.
FUNCTIONS = [
    ("maintain_partitions(p_state text, p_step interval, p_make_until timestamptz, "
     "p_drop_before timestamptz DEFAULT NULL, p_lock_wait_ms int DEFAULT 0)",
     "TABLE (action text, partition_name text, range_start timestamptz, range_end timestamptz, "
     "row_count bigint, estimated boolean)", """
DECLARE
  done jsonb := '[]';
  part jsonb;
  r record;
  n bigint;
  cap constant bigint := 100000;  -- EXACT_UP_TO
  big boolean;
  needs_empty boolean;
  needs_drop boolean;
  needs_make boolean;
  held boolean := false;
BEGIN
  -- One state's partitions: empty, then detach, those whose whole range ends by p_drop_before
  -- (NULL: none), and make them up to p_make_until. Every lock is taken with NOWAIT (someone holds
  -- it now: try again later), but jobs_<state>'s with p_lock_wait_ms > 0 when partitions must be
  -- made: waited for at most that long (at most 1 s). Does nothing (takes no lock) when nothing is
  -- due. Returns what it did; a row 'busy' when jobs_<state>'s lock was held (the emptying stands),
  -- or when an expired partition was held and nothing was to be made (nothing else said so).
  -- Each guard is refused when true; a comparison with NULL is NULL, so NULLs are refused first
  -- (migration 0020), and a step with a month part: months are not of one size, and the ranges
  -- are fixed steps from the epoch (p_drop_before NULL: nothing expires; p_lock_wait_ms NULL: 0).
  IF p_state IS NULL OR p_step IS NULL OR p_make_until IS NULL THEN
    RAISE EXCEPTION 'maintain_partitions: % is NULL',
      CASE WHEN p_state IS NULL THEN 'p_state' WHEN p_step IS NULL THEN 'p_step' ELSE 'p_make_until' END
      USING ERRCODE = '22023';
  END IF;
  IF extract(year FROM p_step) * 12 + extract(month FROM p_step) <> 0 THEN
    RAISE EXCEPTION 'maintain_partitions: p_step % has a month part (partitions are of one size: give it in days, hours, minutes or seconds)',
      p_step USING ERRCODE = '22023';
  END IF;
  IF p_state NOT IN ('completed', 'cancelled', 'discarded') THEN
    RAISE EXCEPTION 'maintain_partitions: % is not a final state', p_state USING ERRCODE = '22023';
  END IF;
  IF p_step < interval '1 minute' THEN
    RAISE EXCEPTION 'maintain_partitions: step % is under a minute', p_step USING ERRCODE = '22023';
  END IF;
  IF p_drop_before > now() THEN
    RAISE EXCEPTION 'maintain_partitions: % is not past', p_drop_before USING ERRCODE = '22023';
  END IF;
  IF p_make_until > now() + 1000 * p_step THEN
    RAISE EXCEPTION 'maintain_partitions: % is more than 1000 steps ahead', p_make_until USING ERRCODE = '22023';
  END IF;
  -- Something to empty: a range past p_drop_before (the low catch-all's included: its rows are
  -- all expired then). To detach: a proper partition past it (the low catch-all moves up then;
  -- alone, an empty one is left where it is).
  SELECT bool_or(p.range_end <= p_drop_before),
         bool_or(p.range_start IS NOT NULL AND p.range_end <= p_drop_before),
         bool_or(p.range_end IS NULL AND p.range_start < p_make_until)
    INTO needs_empty, needs_drop, needs_make
    FROM {schema}.job_partitions(p_state) AS p;
  IF NOT coalesce(needs_empty, false) AND NOT coalesce(needs_make, false) THEN
    RETURN;
  END IF;
  -- Empty what will be dropped, each partition under a lock on itself alone: TRUNCATE takes no
  -- lock on jobs_<state>, so no completion waits for it, and leaves no dead tuple. Its rows: counted
  -- up to cap, beyond it an estimate: the live rows the statistics follow (every insert and delete:
  -- the cleaner's deletes since the last analyze are not counted again), else the planner's. A
  -- partition someone reads right now is left to the next pass.
  FOR r IN SELECT p.partition_name, p.range_start, p.range_end, c.reltuples,
                  pg_stat_get_live_tuples(c.oid) AS live
             FROM {schema}.job_partitions(p_state) AS p
             JOIN pg_class AS c ON c.oid = to_regclass(format('{schema}.%I', p.partition_name))
            WHERE p.range_end <= p_drop_before LOOP
    BEGIN
      EXECUTE format('LOCK TABLE ONLY {schema}.%I IN ACCESS EXCLUSIVE MODE NOWAIT', r.partition_name);
      EXECUTE format('SELECT count(*) FROM (SELECT FROM {schema}.%I LIMIT %s) AS l', r.partition_name, cap + 1) INTO n;
      IF n > 0 THEN
        big := n > cap;
        IF big THEN
          n := greatest(n, CASE WHEN r.live > 0 THEN r.live ELSE CAST(r.reltuples AS bigint) END);
        END IF;
        EXECUTE format('TRUNCATE ONLY {schema}.%I', r.partition_name);
        done := done || jsonb_build_array(jsonb_build_object(
          'action', 'emptied', 'partition_name', r.partition_name, 'range_start', r.range_start,
          'range_end', r.range_end, 'row_count', n, 'estimated', big));
      END IF;
    EXCEPTION WHEN lock_not_available THEN
      needs_drop := false;  -- not detached before it is emptied (its rows counted)
      held := true;
    END;
  END LOOP;
  -- Anything emptied: return, so that the caller commits (the old files are unlinked then, while
  -- this transaction holds locks on the emptied partitions alone) and calls again to detach them.
  IF jsonb_array_length(done) > 0 OR (NOT coalesce(needs_drop, false) AND NOT coalesce(needs_make, false)) THEN
    IF held AND NOT coalesce(needs_make, false) THEN  -- left to the next pass: said, not silent
      done := done || jsonb_build_array(jsonb_build_object('action', 'busy'));
    END IF;
    RETURN QUERY SELECT * FROM jsonb_to_recordset(done) AS (action text, partition_name text,
      range_start timestamptz, range_end timestamptz, row_count bigint, estimated boolean);
    RETURN;
  END IF;
  BEGIN  -- jobs_<state>'s lock held by another: undone, the emptying stands
    IF coalesce(p_lock_wait_ms, 0) <= 0 OR NOT coalesce(needs_make, false) THEN
      -- is jobs_<state> free now? (the probe's lock is undone: the new tables are made first)
      BEGIN
        EXECUTE format('LOCK TABLE ONLY {schema}.%I IN ACCESS EXCLUSIVE MODE NOWAIT', 'jobs_' || p_state);
        RAISE EXCEPTION 'probe' USING ERRCODE = 'P0001';
      EXCEPTION WHEN raise_exception THEN
        NULL;
      END;
    END IF;
    PERFORM {schema}.prepare_partitions(p_state, p_step, p_make_until, 50, coalesce(needs_drop, false));
    IF coalesce(p_lock_wait_ms, 0) <= 0 OR NOT coalesce(needs_make, false) THEN
      EXECUTE format('LOCK TABLE ONLY {schema}.%I IN ACCESS EXCLUSIVE MODE NOWAIT', 'jobs_' || p_state);
    ELSE  -- in the lock queue for at most that long (completions arriving meanwhile wait behind it)
      PERFORM set_config('lock_timeout', least(p_lock_wait_ms, 1000) || 'ms', true);
      EXECUTE format('LOCK TABLE ONLY {schema}.%I IN ACCESS EXCLUSIVE MODE', 'jobs_' || p_state);
      PERFORM set_config('lock_timeout', '1s', true);
    END IF;
    IF coalesce(needs_drop, false) THEN
      SELECT coalesce(jsonb_agg(to_jsonb(x)), '[]') INTO part
        FROM {schema}.drop_expired_partitions(p_state, p_drop_before) AS x;
      done := done || part;
    END IF;
    IF coalesce(needs_make, false) THEN
      SELECT coalesce(jsonb_agg(to_jsonb(x)), '[]') INTO part
        FROM {schema}.make_partitions(p_state, p_step, p_make_until, 50) AS x;
      done := done || part;
    END IF;
  EXCEPTION WHEN lock_not_available THEN
    done := (SELECT coalesce(jsonb_agg(e), '[]') FROM jsonb_array_elements(done) AS e
              WHERE e ->> 'action' = 'emptied') || jsonb_build_array(jsonb_build_object('action', 'busy'));
  END;
  RETURN QUERY SELECT * FROM jsonb_to_recordset(done) AS (action text, partition_name text,
    range_start timestamptz, range_end timestamptz, row_count bigint, estimated boolean);
END
"""),
    ("drop_detached_partitions()", "SETOF text", """
DECLARE
  r record;
  names text[] := '{}';
BEGIN
  -- Drop the tables maintain_partitions detached (marked so) that no one holds, in one statement
  -- (one pass over the buffer cache for all of them).
  FOR r IN SELECT c.relname FROM pg_class AS c
             JOIN pg_description AS d ON d.objoid = c.oid AND d.classoid = CAST('pg_class' AS regclass)
                                      AND d.objsubid = 0
            WHERE c.relnamespace = to_regnamespace('{schema}') AND c.relkind = 'r' AND NOT c.relispartition
              AND d.description = '@DETACHED@' AND c.relname ~ '^jobs_(completed|cancelled|discarded)_'
            ORDER BY c.relname LOOP
    BEGIN
      EXECUTE format('LOCK TABLE {schema}.%I IN ACCESS EXCLUSIVE MODE NOWAIT', r.relname);
      names := names || r.relname;
    EXCEPTION WHEN lock_not_available THEN
      NULL;  -- someone reads it right now: next time
    END;
  END LOOP;
  IF cardinality(names) > 0 THEN
    EXECUTE 'DROP TABLE ' || (SELECT string_agg(format('{schema}.%I', n), ', ') FROM unnest(names) AS n);
  END IF;
  RETURN QUERY SELECT unnest(names);
END
"""),
]


DEFINER_ATTRIBUTES = ("LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp "
                      "SET lock_timeout = '1s' SET \"TimeZone\" = 'UTC'")


def functions_ddl(schema: str) -> list[str]:
    """CREATE FUNCTION statements of the helpers and the definer functions, with their grants."""
    return [st for entry in HELPERS for st in _helper_ddl(schema, entry, replace=False)] + [
        st for entry in FUNCTIONS for st in _function_ddl(schema, entry, replace=False)]


def replace_helper_ddl(schema: str, name: str) -> list[str]:
    """CREATE OR REPLACE of one helper (a later migration's new body or signature), revoked from
    PUBLIC as :func:`functions_ddl` does."""
    return _helper_ddl(schema, _entry(HELPERS, name), replace=True)


def replace_function_ddl(schema: str, name: str) -> str:
    """CREATE OR REPLACE of one definer function (a later migration's new body: its grants kept)."""
    return _function_ddl(schema, _entry(FUNCTIONS, name), replace=True)[0]


def _entry(entries: list, name: str) -> tuple:
    for entry in entries:
        if entry[0].startswith(name + "("):
            return entry
    raise KeyError(name)


def _helper_ddl(schema: str, entry: tuple, *, replace: bool) -> list[str]:
    signature, returns, attributes, body = entry
    out = [_create(schema, signature, returns, attributes, body, replace=replace)]
    if not signature.startswith(PUBLIC_HELPERS):
        out.append(f"REVOKE EXECUTE ON FUNCTION {quote_ident(schema)}.{_name_args(signature)} FROM PUBLIC")
    return out


def _function_ddl(schema: str, entry: tuple, *, replace: bool) -> list[str]:
    """The definer function and, created anew, its REVOKE (a replacement keeps its grants)."""
    signature, returns, body = entry
    return [_create(schema, signature, returns, DEFINER_ATTRIBUTES, body, replace=replace),
            f"REVOKE EXECUTE ON FUNCTION {quote_ident(schema)}.{_name_args(signature)} FROM PUBLIC"]


def _create(schema: str, signature: str, returns: str, attributes: str, body: str, *, replace: bool) -> str:
    q = quote_ident(schema)
    if replace:
        head = f"CREATE OR REPLACE FUNCTION {q}.{signature} RETURNS {returns} {attributes}\nAS $fn$"
    else:
        head = f"CREATE FUNCTION {q}.{signature} RETURNS {returns} {attributes}\nAS $fn$"
    return head + _render(body, schema) + "$fn$"


def definer_functions() -> list[str]:
    """``name(arg types)`` of each function the daemon's role needs EXECUTE on."""
    return [_name_args(signature) for signature, *_ in FUNCTIONS] + ["catch_all_rows()"]


def drop_functions_ddl(schema: str) -> list[str]:
    q = quote_ident(schema)
    return [f"DROP FUNCTION IF EXISTS {q}.{_name_args(sig)}"
            for sig, *_ in [*reversed(FUNCTIONS), *reversed(HELPERS)]]


def _render(body: str, schema: str) -> str:
    return (body.replace("@FINAL_INDEXES@", _final_indexes()).replace("{schema}", quote_ident(schema))
            .replace("@DETACHED@", DETACHED_COMMENT))


def _final_indexes() -> str:
    """new_partition_table's statements for FINAL_INDEXES, each named ``<table>_<suffix>``
    (jobs_finalized_idx -> jobs_completed_p20260301t120000_finalized_idx): the same definitions
    as jobs' own, so attaching the table adopts them."""
    return "\n".join(
        f"  EXECUTE format('CREATE INDEX %I ON {{schema}}.%I {definition}', "
        f"p_name || '{name.removeprefix('jobs')}', p_name);"
        for name, definition in FINAL_INDEXES.items())


def _name_args(signature: str) -> str:
    """'f(a text, b interval DEFAULT NULL)' -> 'f(text, interval)'."""
    name, _, params = signature.partition("(")
    params = params.rsplit(")", 1)[0]
    types = [p.split()[1] for p in params.split(",") if p.strip()]
    return f"{name}({', '.join(types)})"
