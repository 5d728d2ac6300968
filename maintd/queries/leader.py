"""Statements of the leadership: the advisory lock (on the lock session, psycopg style via
:func:`maintd.queries.psycopg_sql`) and the fencing record ``{schema}.leader``."""

TRY_LOCK = "SELECT pg_try_advisory_lock(:classid, :objid)"
UNLOCK = "SELECT pg_advisory_unlock(:classid, :objid)"
# A target giving its lock up on the shared lock session: unlock only when held (an unlock of a
# lock not held draws a WARNING in the server's log); true when one level was unlocked.
UNLOCK_HELD = """
SELECT CASE WHEN EXISTS ({advisory_lock} AND pid = pg_backend_pid())
            THEN pg_advisory_unlock(:classid, :objid) ELSE false END
"""

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

# The lease's proof, every renew_interval, in one round trip: this backend still holds the lock
# (HOLDS_LOCK's columns), and the term is still ours on a primary (a standby cannot take a
# maintenance write). Read-only, so an idle leader writes no WAL; ``renewed_at`` is written when
# a term starts, liveness is the lock itself.
RENEW = """
SELECT EXISTS ({advisory_lock} AND pid = pg_backend_pid()) AS held,
       current_setting('maintd.session', true) = :marker AS ours,
       EXISTS (SELECT 1 FROM {schema}.leader
                WHERE name = 'leader' AND epoch = :epoch AND instance_id = :instance
                  AND NOT pg_is_in_recovery()) AS term
"""

RELEASE = """
UPDATE {schema}.leader SET released_at = now()
 WHERE name = 'leader' AND epoch = :epoch AND instance_id = :instance
"""

HANDOVER_NOTIFY = "SELECT pg_notify(:channel, :instance)"

# Runs last (right before COMMIT) inside every maintenance transaction: did it write (has it a
# transaction id)? Only then is the leader row locked FOR KEY SHARE and the term checked: ours
# (:epoch, :instance), and its lock session (:lock_pid, the server-side pid) still holding the
# lock. A transaction that wrote nothing takes no lock and commits without WAL. The filter on the
# transaction id sits below the row lock, so no row reaches the lock when nothing was written.
FENCE_WRITES = """
SELECT txid_current_if_assigned() IS NOT NULL AS wrote,
       EXISTS (SELECT 1 FROM {schema}.leader
                WHERE txid_current_if_assigned() IS NOT NULL
                  AND name = 'leader' AND epoch = :epoch AND instance_id = :instance
                  AND EXISTS ({advisory_lock} AND pid = :lock_pid)
                  FOR KEY SHARE) AS leads
"""

# The same check, unconditionally (a proof of leadership before DDL, which cannot be fenced).
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
