"""The periodic enqueuer's entries (SPEC 7.8, 7.10): a ``[[periodic]]`` section, a crontab line, or
(validated the same way) a row of ``periodic_jobs``.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from ..sections import OptionalDuration, Scheduled

# graphile-worker's task identifiers too (``nested/task``, ``_private_id``).
PERIODIC_ID_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:/-]{0,127}\Z")


class PeriodicJob(Scheduled):
    id: str
    kind: str = Field(min_length=1, max_length=128)
    queue: str = Field(default="default", min_length=1, max_length=128)
    args: dict[str, Any] = Field(default_factory=dict)
    priority: int = Field(default=0, ge=-32768, le=32767)
    max_attempts: int = Field(default=25, ge=1, le=32767)
    unique_key: str | bool | None = None
    run_on_start: bool = False
    backfill: OptionalDuration = None
    enabled: bool = True
    # With a unique key: a waiting job holding it is updated ("replace": args and run time;
    # "preserve_run_at": args only) instead of the slot being skipped.
    job_key_mode: Literal["replace", "preserve_run_at"] | None = None

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not PERIODIC_ID_RE.match(v):
            raise ValueError(
                f"invalid periodic id {v!r}: 1-128 letters, digits, '_', '.', ':', '/' or '-'"
            )
        return v

    @property
    def effective_unique_key(self) -> str | None:
        if self.unique_key is True:
            return f"periodic:{self.id}"
        if self.unique_key in (False, None, ""):
            return None
        return str(self.unique_key)

    # A [[periodic]] entry's args are the job's args as they are; a crontab line's get ``_cron``.
    cron_args: ClassVar[bool] = False


class CrontabJob(PeriodicJob):
    """A line of the crontab file (SPEC 7.8): a periodic entry whose job args are the payload plus
    ``"_cron": {"ts", "backfilled"}``, and whose ``jobKey`` replaces a waiting job's (or, with
    ``jobKeyMode=preserve_run_at``, keeps its run time)."""

    cron_args: ClassVar[bool] = True
    line: str = ""  # "crontab:3", for messages

    @classmethod
    def from_entry(cls, e: Any) -> "CrontabJob":
        return cls(id=e.id, schedule=e.schedule, timezone=e.timezone, kind=e.kind, queue=e.queue,
                   priority=e.priority, max_attempts=e.max_attempts, backfill=e.backfill,
                   args=e.payload, unique_key=e.job_key, line=f"{e.source}:{e.line}",
                   job_key_mode=(e.job_key_mode or "replace") if e.job_key else None)
