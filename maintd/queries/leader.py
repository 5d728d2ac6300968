"""Statements of the leadership: the advisory lock (on the lock session, psycopg style via
:func:`maintd.queries.psycopg_sql`) and the fencing record ``{schema}.leader``."""

# A round of the loop of a database (:class:`maintd.lockconn.LockSession`): the tries, the lease
# proofs and the unlocks of all of its targets, in one statement (one round trip). Each kind's keys
# are bound arrays (the signed halves of maintd.db.advisory_key); each row answers one key: its
# kind (1 try, 2 proof, 3 unlock), its position, and whether it won / is held / was unlocked. It
# reads only pg_locks and the session, so a target's dropped schema cannot fail the others'.
# * A proof: this very backend holds the lock, on a primary. The lock alone proves the term: an
#   epoch is bumped only by whoever holds the lock, so while this session has held it since its
#   bump, its epoch is the current one. Read-only: an idle leader writes no WAL.
# * ``ours``: this is still the session we set up and checked (:marker, :backend; a transaction
#   pooler would hand us another backend, maybe one it ran our marker's SET on). A try or an unlock
#   acts only there: a lock taken on a pooled backend would stay with whoever gets it next.
# * An unlock only of what is held (an unlock of a lock not held draws a WARNING in the server's
#   log). The loop never tries for a lock it holds, so none is taken twice.
# * pg_locks shows a two-key lock's halves as unsigned oids (the int4 -> oid cast maps the signed
#   halves onto them); read once, in ``mine``.
# (One statement, not a pipeline of three: after psycopg's pipeline the server did not re-arm
# idle_session_timeout, measured on PostgreSQL 15 and 18, so a frozen leader's session outlived
# the lease.)
_KEYS = "unnest(CAST(:{k}_c AS int4[]), CAST(:{k}_o AS int4[])) WITH ORDINALITY AS k(c, o, ord)"
_OURS = "(coalesce(current_setting('maintd.session', true) = :marker, false) AND pg_backend_pid() = CAST(:backend AS int4))"
_HELD = "EXISTS (SELECT 1 FROM mine WHERE mine.classid = CAST(k.c AS oid) AND mine.objid = CAST(k.o AS oid))"
ROUND = f"""
WITH mine AS (SELECT classid, objid FROM pg_locks
               WHERE locktype = 'advisory' AND objsubid = 2 AND granted AND pid = pg_backend_pid()),
     tried AS (SELECT 1 AS kind, k.ord, CASE WHEN {_OURS} THEN pg_try_advisory_lock(k.c, k.o) ELSE false END AS ok
                 FROM {_KEYS.format(k="try")}),
     proven AS (SELECT 2 AS kind, k.ord, {_HELD} AS ok FROM {_KEYS.format(k="renew")}),
     unlocked AS (SELECT 3 AS kind, k.ord,
                         CASE WHEN {_OURS} AND {_HELD} THEN pg_advisory_unlock(k.c, k.o) ELSE false END AS ok
                    FROM {_KEYS.format(k="unlock")}),
     answers AS (SELECT * FROM tried UNION ALL SELECT * FROM proven UNION ALL SELECT * FROM unlocked)
SELECT a.kind, a.ord, a.ok, {_OURS} AS ours,
       NOT pg_is_in_recovery() AS primary_, pg_backend_pid() AS backend_pid
  FROM answers a ORDER BY a.kind, a.ord"""

BACKEND_PID = "SELECT pg_backend_pid()"

# Whether a transaction started now may write: false on a standby, and on a primary set read-only
# (default_transaction_read_only = on): maintenance then pauses instead of failing every write.
WRITABLE = "SELECT current_setting('transaction_read_only') = 'off'"

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
SELECT l.epoch, l.instance_id, l.host, l.pid, l.elected_at, l.released_at,
       EXISTS ({advisory_lock} AND pid = l.backend_pid) AS holds_lock
  FROM {schema}.leader l WHERE l.name = 'leader'
"""
