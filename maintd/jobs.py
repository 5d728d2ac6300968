"""Worker-side helpers for applications that share the jobs table.

Each helper is one SQL statement, shown verbatim in the README for workers in other languages.
Callers own the transaction: pass a SQLAlchemy ``Connection`` and commit when it suits you.
Every finishing update is guarded by ``state = 'running' AND attempted_by = :worker AND
attempt = :attempt``, so a worker whose job was rescued (or cancelled) meanwhile changes nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection

from .db import sql


BACKOFF_CAP = 10  # the backoff grows with the attempt up to this one, then stays (about 6 h)


def backoff(attempt: int) -> timedelta:
    """The one retry backoff (workers' failures and rescued jobs): e^min(attempt, 10) seconds."""
    return timedelta(seconds=math.exp(min(max(attempt, 0), BACKOFF_CAP)))


ENQUEUE = """
INSERT INTO {schema}.jobs (kind, queue, args, priority, max_attempts, scheduled_at, state,
                           unique_key, metadata)
VALUES (:kind, :queue, CAST(:args AS jsonb), :priority, :max_attempts,
        coalesce(CAST(:scheduled_at AS timestamptz), now()),
        CASE WHEN coalesce(CAST(:scheduled_at AS timestamptz), now()) <= now()
             THEN 'available' ELSE 'scheduled' END::{schema}.job_state,
        :unique_key, CAST(:metadata AS jsonb))
ON CONFLICT (unique_key)
   WHERE unique_key IS NOT NULL AND state NOT IN ('completed', 'cancelled', 'discarded')
   DO NOTHING
RETURNING id
"""

CLAIM = """
UPDATE {schema}.jobs
   SET state = 'running', attempt = attempt + 1, attempted_at = now(),
       attempted_by = :worker, heartbeat_at = NULL
 WHERE id = ANY(ARRAY(
         SELECT id FROM {schema}.jobs
          WHERE state = 'available' AND queue = :queue AND scheduled_at <= now()
          ORDER BY priority, scheduled_at, id
          LIMIT :limit
            FOR UPDATE SKIP LOCKED))
   AND state = 'available'
RETURNING id, kind, queue, args, attempt, max_attempts, attempted_by, metadata
"""

HEARTBEAT = """
UPDATE {schema}.jobs SET heartbeat_at = now()
 WHERE id = :id AND state = 'running' AND attempted_by = :worker AND attempt = :attempt
RETURNING id
"""

COMPLETE = """
UPDATE {schema}.jobs SET state = 'completed', finalized_at = now()
 WHERE id = :id AND state = 'running' AND attempted_by = :worker AND attempt = :attempt
RETURNING id
"""

FAIL = """
UPDATE {schema}.jobs
   SET state = CASE WHEN attempt >= max_attempts OR :discard
                    THEN 'discarded' ELSE 'retryable' END::{schema}.job_state,
       scheduled_at = CASE WHEN attempt >= max_attempts OR :discard
                           THEN scheduled_at ELSE now() + make_interval(secs => :backoff) END,
       finalized_at = CASE WHEN attempt >= max_attempts OR :discard THEN now() END,
       errors = errors || jsonb_build_array(jsonb_build_object(
                   'at', now(), 'attempt', attempt, 'error', CAST(:error AS text)))
 WHERE id = :id AND state = 'running' AND attempted_by = :worker AND attempt = :attempt
RETURNING state::text
"""

CANCEL = """
UPDATE {schema}.jobs SET state = 'cancelled', finalized_at = now()
 WHERE id = :id AND state NOT IN ('completed', 'cancelled', 'discarded')
RETURNING id
"""


@dataclass(frozen=True)
class ClaimedJob:
    id: int
    kind: str
    queue: str
    args: dict[str, Any]
    attempt: int
    max_attempts: int
    attempted_by: str
    metadata: dict[str, Any] = field(default_factory=dict)


class JobQueue:
    """Worker helpers bound to one schema: ``JobQueue("maintd").claim(conn, "default", "w1")``."""

    def __init__(self, schema: str = "maintd"):
        from .config import validate_identifier

        self.schema = validate_identifier(schema, "schema name")

    def _sql(self, template: str):
        return sql(template, self.schema)

    def enqueue(self, conn: Connection, kind: str, args: dict[str, Any] | None = None, *,
                queue: str = "default", priority: int = 0, max_attempts: int = 25,
                scheduled_at: datetime | None = None, unique_key: str | None = None,
                metadata: dict[str, Any] | None = None) -> int | None:
        """Insert a job; returns its id, or ``None`` when a live job holds ``unique_key``."""
        row = conn.execute(self._sql(ENQUEUE), {
            "kind": kind, "queue": queue, "args": json.dumps(args or {}), "priority": priority,
            "max_attempts": max_attempts, "scheduled_at": scheduled_at, "unique_key": unique_key,
            "metadata": json.dumps(metadata or {}),
        }).first()
        return None if row is None else row[0]

    def claim(self, conn: Connection, queue: str, worker: str, limit: int = 1) -> list[ClaimedJob]:
        rows = conn.execute(self._sql(CLAIM), {"queue": queue, "worker": worker, "limit": limit})
        return [ClaimedJob(**row._mapping) for row in rows]

    def heartbeat(self, conn: Connection, job: ClaimedJob) -> bool:
        """Refresh ``heartbeat_at``; ``False`` means the job is no longer yours: stop working."""
        return self._guarded(conn, HEARTBEAT, job)

    def complete(self, conn: Connection, job: ClaimedJob) -> bool:
        return self._guarded(conn, COMPLETE, job)

    def fail(self, conn: Connection, job: ClaimedJob, error: str, *, discard: bool = False) -> str | None:
        """Record a failure: ``retryable`` after ``backoff(attempt)``, or ``discarded`` when the
        attempts are used up (or ``discard``). Returns the new state, ``None`` if not yours."""
        row = conn.execute(self._sql(FAIL), {
            "id": job.id, "worker": job.attempted_by, "attempt": job.attempt, "discard": discard,
            "backoff": backoff(job.attempt).total_seconds(), "error": error,
        }).first()
        return None if row is None else row[0]

    def cancel(self, conn: Connection, job_id: int) -> bool:
        return conn.execute(self._sql(CANCEL), {"id": job_id}).first() is not None

    def _guarded(self, conn: Connection, template: str, job: ClaimedJob) -> bool:
        params = {"id": job.id, "worker": job.attempted_by, "attempt": job.attempt}
        return conn.execute(self._sql(template), params).first() is not None
