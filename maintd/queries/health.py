"""Statements of the table-health read (SPEC 8.2) and its history (``{schema}.health_history``).

``HOLDERS`` and ``TABLES`` read PostgreSQL's own views and statistics functions only (no table of
maintd's, no transaction id): one round trip each, per database, per ``health.interval``. Their
only locks are the ACCESS SHARE that ``pg_total_relation_size`` and ``pg_partition_tree`` take on
each table, partition and index they size, bounded by the read's 5 s ``lock_timeout``.
"""

# Everything that holds back the xmin horizon of this database, one row per holder:
#
# * a backend's transaction (``backend_xid``) or snapshot (``backend_xmin``), in this database or
#   in none (a physical walsender holds the feedback of a standby that streams without a slot:
#   PostgreSQL marks it PROC_AFFECTS_ALL_HORIZONS). Another database's backend holds it back by its
#   transaction id alone: an id still running is below the xmin of every snapshot taken in this
#   database meanwhile (GetSnapshotData() reads the ids of all databases), so the workers' own
#   snapshots keep vacuum from the rows deleted since; its snapshot holds back only its own
#   database. Lazy VACUUMs (``pg_stat_progress_vacuum``, whose pids every role sees, where
#   ``backend_type`` is hidden without pg_read_all_stats), their parallel workers (``leader_pid``,
#   which share their snapshot and PROC_IN_VACUUM) and this read's own backend are left out (a lazy
#   VACUUM's snapshot is ignored by other vacuums). A parallel query's workers are their leader's
#   holder, not holders of their own: they hold a copy of a snapshot of its (its xmin is at most
#   theirs), and a transaction id only its (a parallel apply worker, another backend_type, has its own);
# * a prepared transaction, of any database (its id, like a running one's, is in every snapshot);
# * a replication slot's ``xmin`` (a physical slot fed by hot_standby_feedback, or a logical one
#   while it exports its snapshot) for the data, and its ``catalog_xmin`` (logical slots), which
#   holds back the system catalogs only: PostgreSQL's ComputeXidHorizons() applies
#   replication_slot_catalog_xmin to catalog relations, never to user tables such as jobs. Both
#   are the server's, whatever the slot's database: ReplicationSlotsComputeRequiredXmin() takes
#   the oldest of every slot, and a logical slot of another database holds back this one's
#   catalogs (pg_class, pg_attribute: every partition made and dropped) as much as its own. An
#   invalidated slot (``wal_status`` 'lost', on every version since 13) still shows both, but
#   PostgreSQL no longer applies them (ReplicationSlotsComputeRequiredXmin() skips it): left out;
# * PostgreSQL 15's ``vacuum_defer_cleanup_age`` (gone in 16: ``current_setting(.., true)`` is NULL
#   there): ComputeXidHorizons() retreats the data horizon by that many ids behind the oldest of
#   the running transactions (the next id when none holds), then takes the older of that and the
#   slots' xmin, which it does not retreat: a holder of its own, that many ids older than the
#   oldest data row above other than a slot (its ``xmin``: that id, 32 bits like the others').
#
# ``xmin`` is the holder's oldest transaction id as text (an identity, not compared here),
# ``age_xids`` how many ids were assigned since (``age()``: 0 while nothing newer was assigned),
# ``since`` when the holder began where PostgreSQL says so (a backend's transaction start, a
# prepared transaction's PREPARE, an inactive slot's ``inactive_since`` on PostgreSQL 17+),
# ``statement_start`` the running statement's start for a snapshot read mid-statement (READ
# COMMITTED takes a snapshot per statement, so its transaction's start would overstate it); the
# columns other roles' backends hide without pg_read_all_stats (state, client, start, query) are
# NULL then. ``to_jsonb(s) ->> 'inactive_since'`` reads a column that PostgreSQL 15 lacks.
HOLDERS = """
WITH backends AS (
  SELECT CASE WHEN r.pid IS NOT NULL AND a.datid IS NULL THEN 'standby_feedback'
              WHEN a.backend_xid IS NOT NULL THEN 'transaction'
              ELSE 'snapshot' END AS kind,
         a.pid, CAST(a.usename AS text) AS usename, a.application_name,
         host(coalesce(r.client_addr, a.client_addr)) AS client_addr,
         coalesce(r.state, a.state) AS state,
         CASE WHEN elsewhere OR coalesce(age(a.backend_xid), -1) >= coalesce(age(a.backend_xmin), -1)
              THEN a.backend_xid ELSE a.backend_xmin END AS oldest,
         CASE WHEN r.pid IS NOT NULL THEN NULL ELSE a.xact_start END AS since,
         CASE WHEN r.pid IS NULL AND a.backend_xid IS NULL AND a.state NOT LIKE 'idle%'
              THEN a.query_start END AS statement_start,
         CASE WHEN elsewhere THEN 'in database ' || a.datname ELSE a.backend_type END AS detail,
         CASE WHEN :show_query THEN a.query END AS query
    FROM pg_stat_activity a
    LEFT JOIN pg_stat_replication r ON r.pid = a.pid
   CROSS JOIN LATERAL (SELECT a.datid IS NOT NULL AND a.datname <> current_database() AS elsewhere) AS o
   WHERE a.pid <> pg_backend_pid()
     AND (a.backend_xid IS NOT NULL OR (a.backend_xmin IS NOT NULL AND NOT elsewhere))
     AND NOT EXISTS (SELECT 1 FROM pg_stat_progress_vacuum v WHERE v.pid IN (a.pid, a.leader_pid))
     AND NOT (a.backend_type = 'parallel worker' AND a.leader_pid IS NOT NULL)
), slots AS (
  SELECT s.slot_name, s.slot_type, s.active_pid, s.xmin, s.catalog_xmin,
         CAST(to_jsonb(s) ->> 'inactive_since' AS timestamptz) AS inactive_since,
         CAST(r.usename AS text) AS usename, r.application_name, host(r.client_addr) AS client_addr, r.state
    FROM pg_replication_slots s
    LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
   WHERE s.wal_status IS DISTINCT FROM 'lost'
), held AS (
SELECT kind, 'data' AS scope, pid, usename, application_name, client_addr, state,
       CAST(oldest AS text) AS xmin, age(oldest) AS age_xids, since, statement_start, NULL AS name,
       detail, query
  FROM backends
UNION ALL
SELECT 'prepared_transaction', 'data', NULL, CAST(owner AS text), NULL, NULL, NULL,
       CAST(transaction AS text), age(transaction), prepared, NULL, gid,
       CASE WHEN database <> current_database() THEN 'in database ' || database END, NULL
  FROM pg_prepared_xacts
UNION ALL
SELECT 'replication_slot', 'data', active_pid, usename, application_name, client_addr, state,
       CAST(xmin AS text), age(xmin), inactive_since, NULL, slot_name, slot_type, NULL
  FROM slots WHERE xmin IS NOT NULL
UNION ALL
SELECT 'replication_slot', 'catalog', active_pid, usename, application_name, client_addr, state,
       CAST(catalog_xmin AS text), age(catalog_xmin), inactive_since, NULL, slot_name, slot_type, NULL
  FROM slots WHERE catalog_xmin IS NOT NULL
)
SELECT * FROM held
UNION ALL
SELECT 'setting', 'data', NULL, NULL, NULL, NULL, NULL,
       CAST(mod(CAST(CAST(pg_snapshot_xmax(pg_current_snapshot()) AS text) AS bigint) % 4294967296 - d.behind
                + 4294967296, 4294967296) AS text),
       d.behind, NULL, NULL, 'vacuum_defer_cleanup_age', d.defer || ' transactions behind the rest', NULL
  FROM (SELECT defer, defer + coalesce((SELECT max(age_xids) FROM held
                                         WHERE scope = 'data' AND kind <> 'replication_slot'), 0) AS behind
          FROM (SELECT CAST(current_setting('vacuum_defer_cleanup_age', true) AS bigint) AS defer) s) d
 WHERE d.defer > 0
"""

# The server's time as the read starts (not its transaction's: `maintd status` reads last): the ages count from it.
NOW = "SELECT statement_timestamp() AS now, CAST(CAST(pg_snapshot_xmax(pg_current_snapshot()) AS text) AS bigint) AS next_xid"

# Per table of the given schemas (plain tables, and partitioned ones with the leaves of their
# partition tree summed: pg_partition_tree() lists nothing for a plain table), from the statistics
# functions (the pg_stat_user_tables view computes every column of every table of the database).
# Without :all_tables only the jobs tables are read. :sizes says whose sizes are read ('all',
# 'jobs' or 'none'): a size is a stat() per file of the table and each of its indexes, most of
# the read's cost, so the reader asks for the jobs tables' once a minute and the rest less often.
# The last vacuum of a partitioned table is that of its least recently vacuumed leaf that owes one
# (more dead rows than autovacuum's threshold for it: its storage parameters, else the server's
# settings, as PostgreSQL's relation_needs_vacanalyze() computes it), else of its most recently
# vacuumed leaf: a finished state's leaf with a few dead rows, which autovacuum leaves alone, does
# not pin it. -infinity: never. The threshold is computed only for a leaf with dead rows: with
# 2,020 leaves (20 schemas), none with dead rows, the read took 10.5 ms against 10.3 ms without it
# (EXPLAIN ANALYZE, PostgreSQL 15); all with dead rows, 22 ms against 11. ``writes``: rows
# inserted, updated and deleted since the statistics were reset (the history's test of whether
# anything happened).
TABLES = """
SELECT n.nspname AS schema, t.relname AS "table",
       sum(l.live)::bigint AS live, sum(l.dead)::bigint AS dead, sum(l.writes)::bigint AS writes,
       sum(CASE WHEN CAST(:sizes AS text) = 'all' OR (CAST(:sizes AS text) = 'jobs' AND t.relname = 'jobs')
                THEN pg_total_relation_size(l.relid) END)::bigint AS bytes,  -- (inside: called only then)
       extract(epoch FROM CASE
         WHEN bool_or(l.dead > l.vacuum_after)
         THEN min(coalesce(l.vacuumed, '-infinity')) FILTER (WHERE l.dead > l.vacuum_after)
         ELSE coalesce(max(l.vacuumed), '-infinity')
       END)::float8 AS last_vacuum
  FROM pg_class t
  JOIN pg_namespace n ON n.oid = t.relnamespace
 CROSS JOIN (  -- the server's settings; autovacuum_vacuum_max_threshold is PostgreSQL 18's (-1: none)
       SELECT current_setting('autovacuum_vacuum_threshold')::float8 AS threshold,
              current_setting('autovacuum_vacuum_scale_factor')::float8 AS scale,
              coalesce(current_setting('autovacuum_vacuum_max_threshold', true)::float8, -1) AS cap) g
 CROSS JOIN LATERAL (
       SELECT leaf.relid, pg_stat_get_live_tuples(leaf.relid) AS live,
              pg_stat_get_dead_tuples(leaf.relid) AS dead,
              pg_stat_get_tuples_inserted(leaf.relid) + pg_stat_get_tuples_updated(leaf.relid)
                + pg_stat_get_tuples_deleted(leaf.relid) AS writes,
              greatest(pg_stat_get_last_vacuum_time(leaf.relid),
                       pg_stat_get_last_autovacuum_time(leaf.relid)) AS vacuumed,
              CASE WHEN pg_stat_get_dead_tuples(leaf.relid) > 0 THEN (  -- autovacuum's threshold for it
                SELECT least(coalesce(o.threshold, g.threshold) + coalesce(o.scale, g.scale) * greatest(c.reltuples, 0),
                             coalesce(nullif(coalesce(o.cap, g.cap), -1), 'infinity'))
                  FROM pg_class c
                 CROSS JOIN LATERAL (  -- its storage parameters (none: NULLs)
                       SELECT max(CAST(option_value AS float8)) FILTER (WHERE option_name = 'autovacuum_vacuum_threshold') AS threshold,
                              max(CAST(option_value AS float8)) FILTER (WHERE option_name = 'autovacuum_vacuum_scale_factor') AS scale,
                              max(CAST(option_value AS float8)) FILTER (WHERE option_name = 'autovacuum_vacuum_max_threshold') AS cap
                         FROM pg_options_to_table(c.reloptions)) o
                 WHERE c.oid = leaf.relid) END AS vacuum_after
         FROM (SELECT p.relid FROM pg_partition_tree(t.oid) p WHERE p.isleaf AND t.relkind = 'p'
               UNION ALL SELECT t.oid WHERE t.relkind = 'r') leaf) l
 WHERE n.nspname = ANY(CAST(:schemas AS text[]))
   AND t.relkind IN ('r', 'p') AND NOT t.relispartition
   AND (CAST(:all_tables AS boolean) OR t.relname = 'jobs')
 GROUP BY n.nspname, t.relname
"""

# -- history ---------------------------------------------------------------------------------------

# Jobs finished in a window of the server's time, through jobs_finalized_idx (state, finalized_at).
FINISHED = """
SELECT count(*) FILTER (WHERE state = 'completed') AS completed,
       count(*) FILTER (WHERE state = 'discarded') AS discarded
  FROM {schema}.jobs
 WHERE state IN ('completed', 'discarded')
   AND finalized_at >= :since AND finalized_at < :until
"""

LAST = """
SELECT at, since, completed, discarded, depth, queues, jobs_bytes, dead_tuples, live_tuples,
       horizon_age_seconds, horizon_age_xids, holder
  FROM {schema}.health_history ORDER BY at DESC LIMIT 1
"""

INSERT = """
INSERT INTO {schema}.health_history (at, since, completed, discarded, depth, queues, jobs_bytes,
                                     dead_tuples, live_tuples, horizon_age_seconds, horizon_age_xids, holder)
VALUES (:at, :since, :completed, :discarded, CAST(:depth AS jsonb), CAST(:queues AS jsonb), :jobs_bytes,
        :dead_tuples, :live_tuples, :horizon_age_seconds, :horizon_age_xids, CAST(:holder AS jsonb))
ON CONFLICT (at) DO NOTHING
"""

# The charts' points: one per bucket of :bucket (the last sample of each; the finished jobs of
# all its samples, over the window they cover), from :start on.
SERIES = """
SELECT max(at) AS at, min(since) AS since, sum(completed)::bigint AS completed,
       sum(discarded)::bigint AS discarded,
       (array_agg(depth ORDER BY at DESC))[1] AS depth,
       (array_agg(queues ORDER BY at DESC))[1] AS queues,
       (array_agg(jobs_bytes ORDER BY at DESC))[1] AS jobs_bytes,
       (array_agg(dead_tuples ORDER BY at DESC))[1] AS dead_tuples,
       max(horizon_age_seconds) AS horizon_age_seconds,
       (array_agg(holder ORDER BY horizon_age_seconds DESC NULLS LAST) FILTER (WHERE holder IS NOT NULL))[1]
         AS holder
  FROM {schema}.health_history
 WHERE at >= :start
 GROUP BY date_bin(CAST(:bucket AS interval), at, TIMESTAMPTZ '2000-01-01 00:00:00+00')
 ORDER BY 1
"""

PRUNE_PROBE = "SELECT EXISTS (SELECT 1 FROM {schema}.health_history WHERE at < :before)"

# Batched through the primary key; rows are one a minute at most, so a batch is hours of them. In
# keyset batches from :from_at on (in the Index Cond; text, as a row may lie at '-infinity'): each
# starts at the last one's last row (the at with the largest epoch, k: exact numeric, -Infinity for
# '-infinity'), so that a prune reads each entry
# once: the deleted rows' entries stay in the index until a vacuum, and while a transaction older
# than the delete is open anywhere (a report, a pg_dump) a scan cannot mark them dead, so a batch
# that started at the index's start read them all again.
PRUNE = """
DELETE FROM {schema}.health_history
 WHERE at IN (SELECT at FROM {schema}.health_history
               WHERE at < :before AND at >= CAST(:from_at AS timestamptz) ORDER BY at LIMIT :limit)
RETURNING CAST(at AS text) AS at, extract(epoch FROM at) AS k
"""
