"""Statements on ``{schema}.daemons``: the registry of running maintd processes."""

REGISTER = """
INSERT INTO {schema}.daemons (instance_id, host, pid, version, started_at, last_seen_at)
VALUES (:instance, :host, :pid, :version, now(), now())
ON CONFLICT (instance_id) DO UPDATE
   SET host = excluded.host, pid = excluded.pid, version = excluded.version,
       last_seen_at = now(),
       started_at = CASE WHEN daemons.pid = excluded.pid THEN daemons.started_at ELSE now() END
"""

FORGET_STALE = "DELETE FROM {schema}.daemons WHERE last_seen_at < now() - interval '1 hour'"

LIVE = """
SELECT instance_id, host, pid, version, started_at, last_seen_at
  FROM {schema}.daemons WHERE last_seen_at > now() - interval '1 minute' ORDER BY instance_id
"""

# Replicas alive now (SPEC 7.9's R): a recent heartbeat, and a session of that instance still
# connected (a SIGKILLed replica's sessions end at once, a frozen one's within the lease by
# idle_session_timeout; its heartbeat row alone would count it for :window seconds more).
LIVE_REPLICAS = """
SELECT count(*) FROM {schema}.daemons d
 WHERE d.last_seen_at > now() - make_interval(secs => :window)
   AND EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.application_name = 'maintd:' || d.instance_id)
"""
