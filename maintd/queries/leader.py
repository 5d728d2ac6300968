"""Statements of the leadership: the advisory lock (on the lock session, psycopg style via
:func:`maintd.queries.psycopg_sql`) and the fencing record ``{schema}.leader``."""

TRY_LOCK = "SELECT pg_try_advisory_lock(:classid, :objid)"
UNLOCK = "SELECT pg_advisory_unlock(:classid, :objid)"

# Does this very backend hold the lock, and is it still the session we set up (:marker)?
HOLDS_LOCK = """
SELECT EXISTS ({advisory_lock} AND pid = pg_backend_pid()) AS held,
       current_setting('maintd.session', true) = :marker AS ours,
       pg_backend_pid() AS backend_pid
"""

BACKEND_PID = "SELECT pg_backend_pid()"

# FOR UPDATE conflicts with the fences' FOR KEY SHARE: the bump waits for in-flight fenced
# transactions of an old leader (bounded by their statement/idle-in-transaction timeouts).
LOCK_ROW = "SELECT epoch FROM {schema}.leader WHERE name = 'leader' FOR UPDATE"

BUMP_EPOCH = """
INSERT INTO {schema}.leader AS l (name, epoch, instance_id, host, pid, backend_pid,
                                  elected_at, renewed_at, released_at)
VALUES ('leader', 1, :instance, :host, :pid, pg_backend_pid(), now(), now(), NULL)
ON CONFLICT (name) DO UPDATE
   SET epoch = l.epoch + 1, instance_id = excluded.instance_id, host = excluded.host,
       pid = excluded.pid, backend_pid = excluded.backend_pid, elected_at = now(),
       renewed_at = now(), released_at = NULL
RETURNING epoch
"""

RENEW = """
UPDATE {schema}.leader SET renewed_at = now()
 WHERE name = 'leader' AND epoch = :epoch AND instance_id = :instance
RETURNING epoch
"""

RELEASE = """
UPDATE {schema}.leader SET released_at = now()
 WHERE name = 'leader' AND epoch = :epoch AND instance_id = :instance
"""

HANDOVER_NOTIFY = "SELECT pg_notify(:channel, :instance)"

# Runs first inside every fenced maintenance transaction: the term is still ours, and the lock
# session of that term (:lock_pid, the server-side pid) still holds the lock.
FENCE = """
SELECT 1 FROM {schema}.leader
 WHERE name = 'leader' AND epoch = :epoch AND instance_id = :instance
   AND EXISTS ({advisory_lock} AND pid = :lock_pid)
   FOR KEY SHARE
"""

# The recorded term counts only while its session still holds the advisory lock.
CURRENT = """
SELECT l.epoch, l.instance_id, l.host, l.pid, l.elected_at, l.renewed_at, l.released_at,
       EXISTS ({advisory_lock} AND pid = l.backend_pid) AS holds_lock
  FROM {schema}.leader l WHERE l.name = 'leader'
"""
