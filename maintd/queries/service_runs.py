"""Statements on ``{schema}.service_runs``: the last pass of each service."""

RECORD = """
INSERT INTO {schema}.service_runs AS r
       (service, instance_id, started_at, finished_at, outcome, result, error, last_success_at)
VALUES (:service, :instance, :started, :finished, :outcome, CAST(:result AS jsonb), :error,
        CASE WHEN :outcome = 'success' THEN CAST(:finished AS timestamptz) END)
ON CONFLICT (service) DO UPDATE
   SET instance_id = excluded.instance_id, started_at = excluded.started_at,
       finished_at = excluded.finished_at, outcome = excluded.outcome, result = excluded.result,
       error = excluded.error, last_success_at = coalesce(excluded.last_success_at, r.last_success_at)
"""

ALL = """
SELECT service, instance_id, started_at, finished_at, outcome, result, error, last_success_at
  FROM {schema}.service_runs ORDER BY service
"""
