"""Statements on PostgreSQL's catalogs (the reindexer, schema checks, the server clock)."""

from ..identifiers import quote_catalog_name

SERVER_TIME = "SELECT clock_timestamp()"
TRANSACTION_TIME = "SELECT now()"  # the time the transaction began: one instant for all its reads
STATEMENT_TIME = "SELECT statement_timestamp()"
# Whether the server takes writes, from a session that made itself read-only (a reader): the
# setting's reset_val is the server's (file, ALTER SYSTEM/DATABASE/ROLE), which a SET leaves alone.
SERVER_WRITABLE = """
SELECT NOT pg_is_in_recovery() AND reset_val = 'off' FROM pg_settings WHERE name = 'default_transaction_read_only'
"""
# A standby: its pg_locks and pg_stat_activity show none of the primary's lock or sessions.
IN_RECOVERY = "SELECT pg_is_in_recovery()"

# A session setting of a new connection (maintd.db.connect).
SET_SESSION = "SELECT set_config(:name, :value, false)"
# Several session settings in one round trip (names and values in step), every name qualified:
# it runs before search_path is pinned (maintd.db.PINNED).
SET_SESSIONS = """
SELECT pg_catalog.count(pg_catalog.set_config(s.name, s.value, false))
  FROM ROWS FROM (pg_catalog.unnest(CAST(:names AS pg_catalog.text[])),
                  pg_catalog.unnest(CAST(:values AS pg_catalog.text[]))) AS s(name, value)"""
# A setting for the current transaction only (e.g. statement_timeout of a read).
SET_LOCAL = "SELECT set_config(:name, :value, true)"

# Did the current transaction write anything (has it been given a transaction id)?
WROTE = "SELECT txid_current_if_assigned() IS NOT NULL"

TABLE_EXISTS = "SELECT to_regclass(:qualified) IS NOT NULL"

# Is the schema's jobs table partitioned (SPEC 8.1)? False when it is plain or missing.
JOBS_PARTITIONED = """
SELECT coalesce((SELECT c.relkind = 'p' FROM pg_class c
                  WHERE c.oid = to_regclass(format('%I.jobs', CAST(:schema AS text)))), false)
"""

# can_reindex: whether this role may REINDEX the index: a superuser, a member of the table's
# owner role, or (PostgreSQL 17+) a holder of MAINTAIN on the index's own table (jobs_live on the
# partitioned layout: MAINTAIN on jobs does not reach a partition's index). can_drop: whether it may DROP
# it (a failed build's leftover): the owner only, MAINTAIN does not allow it. has_maintain: whether
# the server has the MAINTAIN privilege at all (17+), for the refusal's advice.
JOBS_INDEXES = """
SELECT c.relname AS name, t.relname AS table, i.indisvalid AS valid, pg_relation_size(c.oid) AS bytes,
       o.owns OR CASE WHEN v.has_maintain THEN has_table_privilege(t.oid, 'MAINTAIN') ELSE false END AS can_reindex,
       o.owns AS can_drop, v.has_maintain
  FROM pg_index i
  JOIN pg_class c ON c.oid = i.indexrelid
  JOIN pg_class t ON t.oid = i.indrelid
  JOIN pg_namespace n ON n.oid = t.relnamespace
 CROSS JOIN LATERAL (SELECT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
                            OR pg_has_role(current_user, c.relowner, 'USAGE') AS owns) o
 CROSS JOIN (SELECT current_setting('server_version_num')::int >= 170000 AS has_maintain) v
 WHERE n.nspname = :schema AND c.relkind = 'i'
   AND (t.relname = 'jobs'
        -- the partitioned layout's live partition (SPEC 8.1); not a conversion's copy under way
        -- (its live partition is jobs_live of jobs_conv until the swap)
        OR t.relname = 'jobs_live' AND EXISTS (SELECT FROM pg_inherits AS h JOIN pg_class AS p ON p.oid = h.inhparent
                                                WHERE h.inhrelid = t.oid AND p.relname = 'jobs'))
 ORDER BY c.relname
"""

# The table an index of the schema belongs to (a configured name that is not one of the jobs table's),
# whether it is a partitioned index (the partitioned layout's jobs_finalized_idx, say), and then its
# piece on the live partition (SPEC 8.1), if any.
INDEX_TABLE = """
SELECT t.relname AS table, c.relkind = 'I' AS partitioned,
       (SELECT p.relname FROM pg_inherits h
          JOIN pg_class p ON p.oid = h.inhrelid
          JOIN pg_index pi ON pi.indexrelid = p.oid
          JOIN pg_class pt ON pt.oid = pi.indrelid
         WHERE h.inhparent = c.oid AND pt.relname = 'jobs_live' AND pt.relnamespace = n.oid) AS live_piece
  FROM pg_index i
  JOIN pg_class c ON c.oid = i.indexrelid
  JOIN pg_class t ON t.oid = i.indrelid
  JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = :schema AND c.relname = :index
"""

# The schema pgstattuple is installed in (NULL: not installed): its pgstatindex is called there,
# never through the search_path, where a role that may create in a schema listed before it
# (public, say) could plant one that runs as the reindexer's role (CVE-2018-1058).
PGSTATTUPLE_SCHEMA = """
SELECT n.nspname FROM pg_extension AS e JOIN pg_namespace AS n ON n.oid = e.extnamespace
 WHERE e.extname = 'pgstattuple'
"""

# Leaf density of a btree: a fresh index is about 90 % full (the default fillfactor). {ext}: the
# extension's schema, quoted (:func:`pgstatindex_bloat`).
PGSTATINDEX_BLOAT = """
SELECT greatest(0, 90 - avg_leaf_density)::float8 AS bloat
  FROM {ext}.pgstatindex(CAST(:qualified AS regclass))
"""


def pgstatindex_bloat(ext_schema: str) -> str:
    """:data:`PGSTATINDEX_BLOAT` calling the ``pgstatindex`` of schema ``ext_schema`` (a name
    read from the catalog, quoted as the server's ``%I`` does)."""
    return PGSTATINDEX_BLOAT.format(ext=quote_catalog_name(ext_schema))

# Catalog estimate: pages the index would need at 90 % fill for its tuples, vs its size. The
# widths are the statistics of the index's own table (jobs, or the partitioned layout's jobs_live).
ESTIMATED_BLOAT = """
SELECT CASE WHEN c.relpages <= 1 OR c.reltuples <= 0 THEN 0
            ELSE greatest(0, 100 * (1 - (c.reltuples * (8 + coalesce(w.width, 8))
                 / (current_setting('block_size')::float8 * 0.9)) / c.relpages)) END::float8 AS bloat
  FROM pg_class c
  JOIN pg_namespace n ON n.oid = c.relnamespace
  LEFT JOIN LATERAL (
       SELECT sum(s.avg_width)::float8 AS width
         FROM pg_index i
         JOIN pg_class t ON t.oid = i.indrelid
         JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
         JOIN pg_stats s ON s.schemaname = n.nspname AND s.tablename = t.relname AND s.attname = a.attname
        WHERE i.indexrelid = c.oid) w ON true
 WHERE n.nspname = :schema AND c.relname = :index
"""

RELATION_SIZE = "SELECT pg_relation_size(CAST(:qualified AS regclass))"

# migrate: what the connected role may do on the schema, and whether it is versioned yet.
SCHEMA_PRIVILEGES = """
SELECT current_user AS role, current_database() AS database,
       has_database_privilege(current_database(), 'CREATE') AS database_create,
       n.oid IS NOT NULL AS schema_exists,
       pg_get_userbyid(n.nspowner) AS schema_owner,
       n.oid IS NOT NULL AND has_schema_privilege(n.oid, 'USAGE') AS schema_usage,
       n.oid IS NOT NULL AND has_schema_privilege(n.oid, 'CREATE') AS schema_create,
       v.oid IS NOT NULL AS versioned,
       pg_get_userbyid(v.relowner) AS tables_owner,
       v.oid IS NOT NULL AND pg_has_role(v.relowner, 'USAGE') AS owns_tables
  FROM (SELECT 1) AS one
  LEFT JOIN pg_namespace n ON n.nspname = :schema
  LEFT JOIN pg_class v ON v.relnamespace = n.oid AND v.relname = 'alembic_version'
"""


# Advisory locks of a session (maintd migrate's per-schema lock) or of a transaction (grants).
TRY_ADVISORY_LOCK = "SELECT pg_try_advisory_lock(:k)"
ADVISORY_UNLOCK = "SELECT pg_advisory_unlock(:k)"
ADVISORY_XACT_LOCK = "SELECT pg_advisory_xact_lock(:k)"
# Who holds the advisory lock of bigint key :k (pg_locks: its high half in classid, its low half
# in objid, objsubid 1 for a one-key lock).
ADVISORY_HOLDERS = """
SELECT a.pid, a.application_name, a.backend_start
  FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
   AND l.classid = CAST((CAST(:k AS bigint) >> 32) & 4294967295 AS oid)
   AND l.objid = CAST(CAST(:k AS bigint) & 4294967295 AS oid)
 ORDER BY a.pid
"""
# Who may grant on a schema's objects: its owner (maintd's owner role), named in an error.
SCHEMA_OWNER = """
SELECT coalesce((SELECT CAST(nspowner AS regrole)::text FROM pg_namespace WHERE nspname = :schema), '?'),
       current_user
"""

FUNCTION_EXISTS = "SELECT to_regprocedure(:f) IS NOT NULL"

# The dashboard's reads: one snapshot for every figure of a page, and no write by mistake.
READ_ONLY_SNAPSHOT = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"

# A pooled connection's timeouts, read before an autocommit DDL changes them and set back after
# (RESET would go back to the role's defaults, not to the pool's session settings).
TIMEOUTS = "SELECT current_setting('lock_timeout') AS lock_timeout, current_setting('statement_timeout') AS statement_timeout"

# One target's row of a service's probe (maintd.probes.ServiceProbe): the services' index probes
# as columns c0, c1, ...; the rows of every target of a database joined with UNION ALL.
PROBE_ROW = "SELECT {t} AS t, {columns}"


def set_local(names: tuple[str, ...]) -> str:
    """``SELECT set_config('name', :v0, true), ...``: transaction-local settings in one round trip
    (names are maintd's own constants, values travel as parameters)."""
    if not all(n.replace("_", "").isalnum() for n in names):
        raise ValueError(f"not a setting name: {names!r}")
    return "SELECT " + ", ".join(f"set_config('{n}', :v{i}, true)" for i, n in enumerate(names))
