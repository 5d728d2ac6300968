"""Worker-side helpers for applications that share the jobs table.

Each helper is one SQL statement of :mod:`maintd.queries.jobs`, shown verbatim in the README for
workers in other languages.
Callers own the transaction: pass a SQLAlchemy ``Connection`` and commit when it suits you.
Every finishing update is guarded by ``state = 'running' AND attempted_by = :worker AND
attempt = :attempt``, so a worker whose job was rescued (or cancelled) meanwhile changes nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Mapping

from sqlalchemy import Connection

from .identifiers import validate_identifier

from .queries import jobs as q
from .queries import sql


BACKOFF_CAP = 10  # the backoff grows with the attempt up to this one, then stays (about 6 h)


def backoff(attempt: int) -> timedelta:
    """The one retry backoff (workers' failures and rescued jobs): e^min(attempt, 10) seconds."""
    return timedelta(seconds=math.exp(min(max(attempt, 0), BACKOFF_CAP)))


def _json_object(name: str, value: Mapping[str, Any] | None) -> str:
    """args and metadata as JSON: an object (None is ``{}``); anything else is the caller's bug,
    not something to store (0 silently became ``{}``, a list stayed a list)."""
    if value is None:
        return "{}"
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a mapping (a JSON object), not {type(value).__name__}")
    return json.dumps(dict(value))


def error_text(error: object) -> str:
    """A failure's text as PostgreSQL's ``text`` holds it: ``str()`` of an exception, NUL bytes
    and lone surrogates (bytes decoded with ``surrogateescape``) written as escapes."""
    out = str(error).replace("\x00", "\\x00")
    return out.encode("utf-8", "backslashreplace").decode("utf-8")


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
        self.schema = validate_identifier(schema, "schema name")

    def _sql(self, template: str):
        return sql(template, self.schema)

    def enqueue(self, conn: Connection, kind: str, args: dict[str, Any] | None = None, *,
                queue: str = "default", priority: int = 0, max_attempts: int = 25,
                scheduled_at: datetime | None = None, unique_key: str | None = None,
                metadata: dict[str, Any] | None = None) -> int | None:
        """Insert a job; returns its id, or ``None`` when a live job holds ``unique_key``.
        A naive ``scheduled_at`` is UTC (as ``maintd jobs reschedule --at`` reads one), never the
        session's TimeZone."""
        if scheduled_at is not None and scheduled_at.tzinfo is None:
            scheduled_at = scheduled_at.replace(tzinfo=timezone.utc)
        row = conn.execute(self._sql(q.ENQUEUE), {
            "kind": kind, "queue": queue, "args": _json_object("args", args), "priority": priority,
            "max_attempts": max_attempts, "scheduled_at": scheduled_at, "unique_key": unique_key,
            "metadata": _json_object("metadata", metadata),
        }).first()
        return None if row is None else row[0]

    def claim(self, conn: Connection, queue: str, worker: str, limit: int = 1) -> list[ClaimedJob]:
        """Up to ``limit`` due jobs of ``queue``, now ``running`` as ``worker``'s."""
        if not isinstance(worker, str):
            raise ValueError(f"worker must be a worker id (text), not {worker!r}")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit must be a number of jobs (0 or more), not {limit!r}")
        rows = conn.execute(self._sql(q.CLAIM), {"queue": queue, "worker": worker, "limit": limit})
        return [ClaimedJob(**row._mapping) for row in rows]

    def heartbeat(self, conn: Connection, job: ClaimedJob) -> bool:
        """Refresh ``heartbeat_at``; ``False`` means the job is no longer yours: stop working."""
        return self._guarded(conn, q.HEARTBEAT, job)

    def complete(self, conn: Connection, job: ClaimedJob) -> bool:
        return self._guarded(conn, q.COMPLETE, job)

    def fail(self, conn: Connection, job: ClaimedJob, error: str | BaseException, *,
             discard: bool = False) -> str | None:
        """Record a failure: ``retryable`` after ``backoff(attempt)``, or ``discarded`` when the
        attempts are used up (or ``discard``). Returns the new state, ``None`` if not yours.
        ``error`` is any text or exception (see :func:`error_text`)."""
        row = conn.execute(self._sql(q.FAIL), {
            "id": job.id, "worker": job.attempted_by, "attempt": job.attempt, "discard": discard,
            "backoff": backoff(job.attempt).total_seconds(), "error": error_text(error),
        }).first()
        return None if row is None else row[0]

    def cancel(self, conn: Connection, job_id: int) -> bool:
        return conn.execute(self._sql(q.CANCEL), {"id": job_id}).first() is not None

    def _guarded(self, conn: Connection, template: str, job: ClaimedJob) -> bool:
        params = {"id": job.id, "worker": job.attempted_by, "attempt": job.attempt}
        return conn.execute(self._sql(template), params).first() is not None
