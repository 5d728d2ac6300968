"""Statements on ``{schema}.daemons``: the registry of running maintd processes."""

# Run on the lock session itself: lock_pid is that session's backend.
REGISTER = """
INSERT INTO {schema}.daemons (instance_id, host, pid, version, started_at, last_seen_at, lock_pid)
VALUES (:instance, :host, :pid, :version, now(), now(), pg_backend_pid())
ON CONFLICT (instance_id) DO UPDATE
   SET host = excluded.host, pid = excluded.pid, version = excluded.version,
       last_seen_at = now(), lock_pid = excluded.lock_pid,
       started_at = CASE WHEN daemons.pid = excluded.pid THEN daemons.started_at ELSE now() END
"""

# A daemon is alive while its lock session is connected: the backend it registered from
# (lock_pid), still named maintd:<instance_id> (application_name, at most 63 bytes, and pid are
# shown to every role) on this database. The pid tells it from a daemon of another deployment
# (other schemas) that uses the same instance_id; a row without one (an older daemon's) is
# matched by name alone. So the row is written only when the daemon (re)connects, and an idle
# daemon writes nothing.
# LIVE_MATCH: session ``a`` is the lock session of daemon row ``d``.
LIVE_MATCH = """a.datname = current_database()
                  AND a.application_name = left('maintd:' || d.instance_id, 63)
                  AND a.pid = coalesce(d.lock_pid, a.pid)"""
LIVE_SESSION = """EXISTS (SELECT 1 FROM pg_stat_activity a WHERE """ + LIVE_MATCH + ")"

FORGET_STALE = """
DELETE FROM {schema}.daemons d
 WHERE d.last_seen_at < now() - interval '1 hour' AND NOT """ + LIVE_SESSION

# Replicas a live daemon saw leave (their lock sessions gone): when, so that one that ran for
# longer than an hour is shown gone for an hour from its end, not dropped at once. Written only
# when the live replicas change.
LEFT = """
UPDATE {schema}.daemons d SET last_seen_at = now()
 WHERE d.instance_id = ANY(CAST(:ids AS text[])) AND NOT """ + LIVE_SESSION + """
"""

# A daemon that stops, on its lock session right before it closes: when it left (/status shows it
# gone for an hour from then, not from when it connected, even with no live replica to see it).
STOPPED = """
UPDATE {schema}.daemons SET last_seen_at = now()
 WHERE instance_id = :instance AND lock_pid = pg_backend_pid()
"""

# Every daemon registered within the last hour, with whether it is alive: whether its lock session
# is connected now (a SIGKILLed replica's session ends with it, so it reads as gone at once; a
# frozen one's within the lease). last_seen_at: now for a live daemon, else when it last (re)connected
# or when a live daemon saw it leave (LEFT), the later of the two.
REGISTERED = """
SELECT instance_id, host, pid, version, started_at, alive,
       CASE WHEN alive THEN now() ELSE last_seen_at END AS last_seen_at
  FROM (SELECT d.*, """ + LIVE_SESSION + """ AS alive FROM {schema}.daemons d) d
 WHERE alive OR d.last_seen_at > now() - interval '1 hour'
 ORDER BY instance_id
"""

# Every second, in one statement (maintd.leader.ElectionLoop): whether the server takes writes (not
# a standby, not a primary set read-only) and the live replicas.
REFRESH = """
SELECT current_setting('transaction_read_only') = 'off' AS writable,
       ARRAY(SELECT instance_id FROM {schema}.daemons d WHERE """ + LIVE_SESSION + """ ORDER BY instance_id) AS replicas
"""

# Replicas alive now (SPEC 7.9's R): those with a lock session connected to this database (a
# SIGKILLed replica's sessions end at once, a frozen one's within the lease by idle_session_timeout).
LIVE_REPLICAS = """
SELECT instance_id FROM {schema}.daemons d WHERE """ + LIVE_SESSION + """ ORDER BY instance_id
"""

# Another live daemon with this instance id on this database (its session named after it), and
# where it said it runs (its row in this schema, if it registered here).
DUPLICATE = """
SELECT d.host, d.pid, host(a.client_addr) AS addr
  FROM {schema}.daemons d
  JOIN pg_stat_activity a ON """ + LIVE_MATCH + """
 WHERE d.instance_id = :instance
 LIMIT 1
"""
