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
