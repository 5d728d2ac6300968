"""Statements on the partitioned layout's partitions (SPEC 8.1; maintd/partitions.py has the DDL and
the functions they call). Read-only ones read the catalog and the catch-alls; the changes go
through the schema's SECURITY DEFINER functions."""

# Per final state: its range partitions (catch-alls included), where the low catch-all ends and
# the high one starts (the proper partitions lie between), where the first proper one ends (NULL:
# none; a step wide, or another width made before the step changed), and the rows in each catch-all.
LAYOUT = """
SELECT b.state, b.partitions, b.low_end, b.high_start, b.first_end, c.low_rows, c.high_rows, b.oldest_start
  FROM (SELECT s.state, count(*) - 2 AS partitions,
               max(p.range_end) FILTER (WHERE p.range_start IS NULL) AS low_end,
               max(p.range_start) FILTER (WHERE p.range_end IS NULL) AS high_start,
               min(p.range_end) FILTER (WHERE p.range_start IS NOT NULL) AS first_end,
               min(p.range_start) AS oldest_start
          FROM unnest(CAST(ARRAY['completed', 'cancelled', 'discarded'] AS text[])) AS s(state)
         CROSS JOIN LATERAL {schema}.job_partitions(s.state) AS p
         GROUP BY s.state) AS b
  JOIN {schema}.catch_all_rows() AS c ON c.state = b.state
"""

# Per final state, the end of the last partition whose rows the cleaner's DELETE removes rather
# than a drop: the low catch-all (strays finalized before every partition) and any partition
# wider than the narrowest (a high catch-all closed after an outage longer than premake: its rows
# span the outage, and it is dropped only once all of them are past the retention).
WIDE_PARTITIONS_END = """
SELECT w.state, max(w.range_end) FILTER (WHERE w.range_start IS NULL OR w.range_end - w.range_start > w.step)
  FROM (SELECT s.state, p.range_start, p.range_end,
               min(p.range_end - p.range_start) OVER (PARTITION BY s.state) AS step
          FROM unnest(CAST(ARRAY['completed', 'cancelled', 'discarded'] AS text[])) AS s(state)
         CROSS JOIN LATERAL {schema}.job_partitions(s.state) AS p) AS w
 GROUP BY w.state
"""

# Tables maintain_partitions detached that wait for drop_detached_partitions.
DETACHED = """
SELECT count(*) FROM pg_class AS c
  JOIN pg_description AS d ON d.objoid = c.oid AND d.classoid = CAST('pg_class' AS regclass) AND d.objsubid = 0
 WHERE c.relnamespace = to_regnamespace(:schema) AND c.relkind = 'r' AND NOT c.relispartition
   AND d.description = :marker
"""

# A dry run: the partitions a pass would empty (those with a row) and detach (the proper ones),
# with their rows counted as maintain_partitions counts them: exactly up to :cap (through the
# parent: the range prunes to the partition), beyond it the live rows the statistics follow, else
# the planner's estimate.
EXPIRED = """
SELECT p.partition_name, p.range_start IS NOT NULL AS proper, r.n > 0 AS nonempty, r.n > :cap AS estimated,
       CASE WHEN r.n <= :cap THEN r.n
            ELSE greatest(r.n, CASE WHEN pg_stat_get_live_tuples(c.oid) > 0 THEN pg_stat_get_live_tuples(c.oid)
                                    ELSE CAST(c.reltuples AS bigint) END) END AS rows
  FROM {schema}.job_partitions(:state) AS p
  JOIN pg_class AS c ON c.oid = to_regclass(format('%I.%I', CAST(:schema_name AS text), p.partition_name))
 CROSS JOIN LATERAL (
   SELECT count(*) AS n
     FROM (SELECT FROM {schema}.jobs AS j
            WHERE j.state = CAST(:state AS {schema}.job_state) AND j.finalized_at < p.range_end
              AND (p.range_start IS NULL OR j.finalized_at >= p.range_start)
            LIMIT :cap + 1) AS l) AS r
 WHERE p.range_end <= :before
"""

# A dry run: the high catch-all's latest row before :target (where a pass closes it: make_partitions),
# and its rows from :beyond on (those the pass moves), through jobs (pruned to the catch-all).
HIGH_LATEST = """
SELECT max(j.finalized_at) FROM {schema}.jobs AS j
 WHERE j.state = CAST(:state AS {schema}.job_state) AND j.finalized_at >= :start AND j.finalized_at < :target
"""
HIGH_BEYOND = """
SELECT count(*) FROM {schema}.jobs AS j WHERE j.state = CAST(:state AS {schema}.job_state) AND j.finalized_at >= :beyond
"""

MAINTAIN = """
SELECT action, partition_name, range_start, range_end, row_count, estimated
  FROM {schema}.maintain_partitions(:state, make_interval(secs => :step), :make_until, :drop_before, :lock_wait_ms)
"""

DROP_DETACHED = "SELECT name FROM {schema}.drop_detached_partitions() AS name"

# What status and the dashboard show of the partitioned layout: every final state's proper
# partitions, the first start and the last end among them, and the rows in the catch-alls, with
# whether that is an estimate (catch_all_rows counts up to :cap a catch-all, then gives the
# planner's estimate: right after a conversion, before an ANALYZE, 100,001 whatever is there).
SUMMARY = """
SELECT sum(partitions) AS partitions, min(low_end) AS oldest, max(high_start) AS newest,
       sum(low_rows + high_rows) AS stray_rows,
       coalesce(bool_or(low_rows > :cap OR high_rows > :cap), false) AS stray_estimated
  FROM (""" + LAYOUT + """) AS per_state
"""
