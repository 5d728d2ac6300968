"""The statements of ``maintd migrate --convert partitioned`` (:mod:`maintd.convert`), run by the
schema's owner. ``{schema}`` is the quoted schema; other braces (``{states}``, ``{old}``,
``{signature}``, ...) are quoted identifiers, SQL lists or numbers the conversion fills in."""

# Before step 1, and again under the swap's lock: what depends on the plain table that the swap
# would leave on it (dropped with it at the clean-up, or failing it): views and rules, foreign
# keys to or from it, triggers, indexes and policies of the user's, publications naming it.
# (:t is the table, :own its indexes that maintd made; functions typed by its row are carried.)
NOT_CARRIED = """
SELECT 'view' AS kind, CAST(CAST(r.ev_class AS regclass) AS text) AS name
  FROM pg_depend AS d JOIN pg_rewrite AS r ON r.oid = d.objid
 WHERE d.classid = CAST('pg_rewrite' AS regclass) AND d.refclassid = CAST('pg_class' AS regclass)
   AND d.refobjid = to_regclass(:t) AND r.ev_class <> to_regclass(:t)
UNION
SELECT 'rule', r.rulename FROM pg_rewrite AS r WHERE r.ev_class = to_regclass(:t)
UNION
SELECT 'foreign key', c.conname || ' of ' || CAST(CAST(c.conrelid AS regclass) AS text)
  FROM pg_constraint AS c
 WHERE c.contype = 'f' AND to_regclass(:t) IN (c.conrelid, c.confrelid)
UNION
SELECT 'trigger', t.tgname FROM pg_trigger AS t
 WHERE t.tgrelid = to_regclass(:t) AND NOT t.tgisinternal
   AND t.tgname NOT IN ('jobs_convert_sync', 'jobs_convert_truncate')
UNION
SELECT 'index', i.relname FROM pg_index AS x JOIN pg_class AS i ON i.oid = x.indexrelid
 WHERE x.indrelid = to_regclass(:t) AND i.relname <> ALL(CAST(:own AS text[]))
UNION
SELECT 'policy', p.polname FROM pg_policy AS p WHERE p.polrelid = to_regclass(:t)
UNION
SELECT 'publication', b.pubname FROM pg_publication_rel AS pr JOIN pg_publication AS b ON b.oid = pr.prpubid
 WHERE pr.prrelid = to_regclass(:t)
UNION
SELECT 'column grant on', a.attname FROM pg_attribute AS a
 WHERE a.attrelid = to_regclass(:t) AND a.attacl IS NOT NULL AND NOT a.attisdropped
UNION
SELECT 'row level security', 'enabled' FROM pg_class AS c WHERE c.oid = to_regclass(:t) AND c.relrowsecurity
ORDER BY 1, 2
"""

# Step 1, prepare.
CREATE_CONV = """
CREATE TABLE {schema}.jobs_conv (LIKE {schema}.jobs INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING IDENTITY)
PARTITION BY LIST (state)
"""
CREATE_SEEN = "CREATE TABLE {schema}.jobs_convert_seen (id bigint PRIMARY KEY)"
CREATE_PROGRESS = "CREATE TABLE {schema}.jobs_convert_progress (phase text NOT NULL, cursor bigint NOT NULL, copied bigint NOT NULL)"
# The cursor is where the phase's next batch starts (``id >= cursor``): the smallest bigint at
# first, as jobs.id may be 0 or negative (an identity BY DEFAULT takes an import's own ids).
START_PROGRESS = "INSERT INTO {schema}.jobs_convert_progress VALUES ('live', -9223372036854775808, 0)"
# The sync triggers made (2 when both are; they are made and dropped together).
HAS_TRIGGER = """
SELECT count(*) FROM pg_trigger
 WHERE tgrelid = to_regclass(:t) AND tgname IN ('jobs_convert_sync', 'jobs_convert_truncate')
"""
CREATE_TRIGGER = """
CREATE TRIGGER jobs_convert_sync AFTER INSERT OR UPDATE OR DELETE ON {schema}.jobs
FOR EACH ROW EXECUTE FUNCTION {schema}.jobs_convert_sync()
"""
# A TRUNCATE of jobs fires no row trigger: without this one, the rows already copied came back
# at the swap (jobs emptied in an emergency ran again).
CREATE_TRUNCATE_TRIGGER = """
CREATE TRIGGER jobs_convert_truncate AFTER TRUNCATE ON {schema}.jobs
FOR EACH STATEMENT EXECUTE FUNCTION {schema}.jobs_convert_sync()
"""
PROGRESS = "SELECT phase, cursor, copied FROM {schema}.jobs_convert_progress"
# A copy that no trigger followed for a while (an abandon cut off after dropping it): started over,
# before the trigger is made again (nothing is seen, so every row is copied as it is then).
RESTART_COPY = (
    "TRUNCATE {schema}.jobs_conv, {schema}.jobs_convert_seen",
    "UPDATE {schema}.jobs_convert_progress SET phase = 'live', cursor = -9223372036854775808, copied = 0",
)

# Step 2, copy: one phase's rows (``{states}``), a batch at a time from the cursor on (a row read
# again, e.g. by a run resuming a conversion that an earlier release began, is seen: not copied twice).
COUNT_PHASE = "SELECT count(*) FROM {schema}.jobs WHERE state IN {states}"
LOCK_BATCH = """
SELECT id FROM {schema}.jobs WHERE id >= :cursor AND state IN {states} ORDER BY id LIMIT :n FOR SHARE
"""
# A batch whose wait for a row ran out (another transaction holds it): its ids read without a lock,
# then those of them no one holds locked without waiting (the first one missing is the held row).
PEEK_BATCH = "SELECT id FROM {schema}.jobs WHERE id >= :cursor AND state IN {states} ORDER BY id LIMIT :n"
LOCK_FREE = """
SELECT id FROM {schema}.jobs WHERE id >= :cursor AND id <= :upto AND state IN {states} ORDER BY id
   FOR SHARE SKIP LOCKED
"""
SAVE_PROGRESS = "UPDATE {schema}.jobs_convert_progress SET phase = :phase, cursor = :cursor, copied = :copied"

# When the lock on jobs (:t) never came: the other sessions holding one (granted), for the error.
LOCK_HOLDERS = """
SELECT DISTINCT a.pid, a.application_name, a.state, a.xact_start
  FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
 WHERE l.locktype = 'relation' AND l.relation = to_regclass(:t) AND l.granted AND l.pid <> pg_backend_pid()
 ORDER BY a.xact_start NULLS LAST, a.pid
 LIMIT 5
"""

# Step 3, swap, under LOCK_JOBS.
LOCK_JOBS = "LOCK TABLE {schema}.jobs IN ACCESS EXCLUSIVE MODE"
LAST_ID = "SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM {schema}.jobs_id_seq"
DROP_FUNCTION = "DROP FUNCTION {signature}"
DROP_TRIGGER = "DROP TRIGGER jobs_convert_sync ON {schema}.jobs"
DROP_TRUNCATE_TRIGGER = "DROP TRIGGER jobs_convert_truncate ON {schema}.jobs"
RENAME_INDEX = "ALTER INDEX {schema}.{old} RENAME TO {new}"
RENAME_TABLES = (
    "ALTER SEQUENCE {schema}.jobs_id_seq RENAME TO jobs_plain_id_seq",
    "ALTER TABLE {schema}.jobs RENAME TO jobs_plain",
    "ALTER TABLE {schema}.jobs_conv RENAME TO jobs",
    "ALTER SEQUENCE {schema}.jobs_conv_id_seq RENAME TO jobs_id_seq",
)
RESTART_IDS = "ALTER TABLE {schema}.jobs ALTER COLUMN id RESTART WITH {restart}"
GRANT_TABLE = "GRANT {privilege} ON {schema}.jobs TO {grantee}"
COMMENT_FUNCTION = "COMMENT ON FUNCTION {signature} IS {comment}"
REVOKE_FUNCTION = "REVOKE ALL ON FUNCTION {signature} FROM PUBLIC"
GRANT_FUNCTION = "GRANT EXECUTE ON FUNCTION {signature} TO {grantee}"

# An unfinished conversion abandoned (`--convert plain`): the trigger first (under a short
# lock_timeout, as it was made), then everything step 1 made. The plain table is untouched.
ABANDON_TRIGGER = "DROP TRIGGER IF EXISTS jobs_convert_sync ON {schema}.jobs"
ABANDON_TRUNCATE_TRIGGER = "DROP TRIGGER IF EXISTS jobs_convert_truncate ON {schema}.jobs"
ABANDON = (
    "DROP TABLE IF EXISTS {schema}.jobs_conv",
    "DROP TABLE IF EXISTS {schema}.jobs_convert_seen",
    "DROP TABLE IF EXISTS {schema}.jobs_convert_progress",
    "DROP FUNCTION IF EXISTS {schema}.jobs_convert_sync()",
)

# Before a new jobs_conv: what an abandon cut off after dropping the copy left behind.
STALE = ABANDON[1:]

# Step 4, clean up.
# After the swap, in a transaction of its own; again by a later run when a conversion was cut off
# between the two (IF EXISTS: whatever is left).
# Step 4, before the plain table is dropped: the statements that give its storage parameters
# (migrate's autovacuum settings and any of the operator's, its TOAST table's too) to the live
# jobs' partition (a partitioned table takes none), and its comment to the new jobs.
CARRY_STORAGE = """
SELECT format('ALTER TABLE {schema}.%I SET (%s)', CAST(:live AS text), string_agg(o.setting, ', '))
  FROM (SELECT format('%I = %L', split_part(r, '=', 1), substr(r, strpos(r, '=') + 1)) AS setting
          FROM pg_class AS c, unnest(c.reloptions) AS r WHERE c.oid = to_regclass(:plain)
        UNION ALL
        SELECT format('toast.%I = %L', split_part(r, '=', 1), substr(r, strpos(r, '=') + 1))
          FROM pg_class AS c JOIN pg_class AS t ON t.oid = c.reltoastrelid, unnest(t.reloptions) AS r
         WHERE c.oid = to_regclass(:plain)) AS o
HAVING count(*) > 0
UNION ALL
SELECT format('COMMENT ON TABLE {schema}.jobs IS %L', d.description)
  FROM pg_description AS d
 WHERE d.objoid = to_regclass(:plain) AND d.classoid = CAST('pg_class' AS regclass) AND d.objsubid = 0
"""

# Step 5: the statistics of the partitioned table as a whole and of every partition (sampled).
ANALYZE = "ANALYZE {schema}.jobs"
# Before it (PostgreSQL 15+): the copy's row counts, still pending in this backend (flushed when
# idle, at most once a second), reach the cumulative statistics at this statement's commit;
# flushed after ANALYZE instead, they were added to the count it set (n_live_tup twice the rows).
FLUSH_STATS = "SELECT pg_stat_force_next_flush()"

CLEAN_UP = (
    "DROP TABLE IF EXISTS {schema}.jobs_plain",
    "DROP TABLE IF EXISTS {schema}.jobs_convert_seen",
    "DROP TABLE IF EXISTS {schema}.jobs_convert_progress",
    "DROP FUNCTION IF EXISTS {schema}.jobs_convert_sync()",
)

# Repeats a change of a plain row in jobs_conv (pruned to the row's partition), and notes the id;
# a TRUNCATE of jobs empties the copy and the seen ids with it (the rows after it are all new).
# OR REPLACE: a conversion begun by a release before the TRUNCATE trigger, resumed, has that
# release's function (row code only), which the TRUNCATE trigger must not run.
SYNC_FUNCTION = """
CREATE OR REPLACE FUNCTION {schema}.jobs_convert_sync() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  IF TG_OP = 'TRUNCATE' THEN
    TRUNCATE {schema}.jobs_conv, {schema}.jobs_convert_seen;
    RETURN NULL;
  END IF;
  IF TG_OP <> 'INSERT' THEN
    IF OLD.finalized_at IS NULL THEN
      DELETE FROM {schema}.jobs_conv AS c WHERE c.id = OLD.id AND c.state = OLD.state;
    ELSE
      DELETE FROM {schema}.jobs_conv AS c
       WHERE c.id = OLD.id AND c.state = OLD.state AND c.finalized_at = OLD.finalized_at;
    END IF;
  END IF;
  IF TG_OP <> 'DELETE' THEN
    INSERT INTO {schema}.jobs_conv SELECT NEW.*;
  END IF;
  INSERT INTO {schema}.jobs_convert_seen (id) VALUES (CASE WHEN TG_OP = 'DELETE' THEN OLD.id ELSE NEW.id END)
  ON CONFLICT DO NOTHING;
  RETURN NULL;
END
$fn$
"""

# The locked rows of a batch not seen yet (no trigger repeated them), copied and noted.
COPY = """
WITH fresh AS (
  INSERT INTO {schema}.jobs_convert_seen (id)
  SELECT o.id FROM {schema}.jobs AS o WHERE o.id = ANY(:ids)
  ON CONFLICT DO NOTHING
  RETURNING id
)
INSERT INTO {schema}.jobs_conv SELECT o.* FROM {schema}.jobs AS o WHERE o.id IN (SELECT id FROM fresh)
"""

# Functions whose arguments or result are typed by the plain table's row (its type or array).
DEPENDENT_FUNCTIONS = """
SELECT DISTINCT p.proname AS name, pg_get_function_identity_arguments(p.oid) AS args,
       pg_get_functiondef(p.oid) AS definition, obj_description(p.oid, 'pg_proc') AS comment,
       CASE WHEN p.proacl IS NULL THEN NULL ELSE ARRAY(
         SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END
           FROM aclexplode(p.proacl) AS a WHERE a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner) END AS acl
  FROM pg_proc AS p
  JOIN pg_depend AS d ON d.classid = CAST('pg_proc' AS regclass) AND d.objid = p.oid
 WHERE d.refclassid = CAST('pg_type' AS regclass)
   AND d.refobjid IN (SELECT t.oid FROM pg_type AS t JOIN pg_class AS c ON t.oid = c.reltype
                       WHERE c.oid = to_regclass(:t)
                      UNION ALL
                      SELECT t.typarray FROM pg_type AS t JOIN pg_class AS c ON t.oid = c.reltype
                       WHERE c.oid = to_regclass(:t))
"""

TABLE_ACL = """
SELECT a.privilege_type AS privilege,
       CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END AS grantee
  FROM pg_class AS c, aclexplode(c.relacl) AS a
 WHERE c.oid = to_regclass(:t) AND a.grantee <> c.relowner
"""

# Index names: the plain table's get "_plain" (its primary key's too), jobs_conv's lose "_conv".
PLAIN_INDEXES = """
SELECT i.relname, i.relname || '_plain' FROM pg_index AS x
  JOIN pg_class AS i ON i.oid = x.indexrelid JOIN pg_class AS t ON t.oid = x.indrelid
 WHERE t.relnamespace = to_regnamespace(:schema) AND t.relname = 'jobs'
"""
CONV_INDEXES = """
SELECT i.relname, left(i.relname, -5) FROM pg_class AS i
 WHERE i.relnamespace = to_regnamespace(:schema) AND i.relkind IN ('i', 'I') AND i.relname LIKE '%\\_conv'
"""
