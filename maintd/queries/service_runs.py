"""Statements on ``{schema}.service_runs``: the last recorded pass of each service (the daemon
skips idle passes that repeat the last record, see :mod:`maintd.passes`)."""

# :last_success: the latest successful pass the daemon knows of (this one if it succeeded; NULL
# keeps the row's).
RECORD = """
INSERT INTO {schema}.service_runs AS r
       (service, instance_id, started_at, finished_at, outcome, result, error, last_success_at)
VALUES (:service, :instance, :started, :finished, :outcome, CAST(:result AS jsonb), :error,
        CAST(:last_success AS timestamptz))
ON CONFLICT (service) DO UPDATE
   SET instance_id = excluded.instance_id, started_at = excluded.started_at,
       finished_at = excluded.finished_at, outcome = excluded.outcome, result = excluded.result,
       error = excluded.error, last_success_at = coalesce(excluded.last_success_at, r.last_success_at)
"""

ALL = """
SELECT service, instance_id, started_at, finished_at, outcome, result, error, last_success_at
  FROM {schema}.service_runs ORDER BY service
"""
