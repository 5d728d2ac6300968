"""The periodic enqueuer's entries (SPEC 7.8, 7.10): a ``[[periodic]]`` section, a crontab line, or
(validated the same way) a row of ``periodic_jobs``.
"""

from __future__ import annotations

import math
import re
from datetime import date, datetime, time
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

    @field_validator("kind", "queue", "unique_key")
    @classmethod
    def _no_nul(cls, v: Any) -> Any:
        if isinstance(v, str) and "\x00" in v:  # every enqueue would fail
            raise ValueError("holds a NUL character (\\u0000), which PostgreSQL's text cannot store")
        return v

    @field_validator("args")
    @classmethod
    def _args(cls, v: dict[str, Any]) -> dict[str, Any]:
        if (problem := jsonb_problem(v)) is not None:
            raise ValueError(problem)
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


def jsonb_problem(args: dict[str, Any]) -> str | None:
    """Why PostgreSQL's jsonb cannot hold ``args`` (each enqueue of the entry would fail), naming
    the value's place (``a.b[1]``), or None. TOML and Python's json take NaN and Infinity, TOML has
    dates, and both take \\u0000; jsonb has none of them."""
    todo: list[tuple[str, Any]] = [("", args)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, dict):
            if (key := next((k for k in value if "\x00" in k), None)) is not None:
                return f"key {key!r} holds a NUL character (\\u0000), which PostgreSQL's jsonb cannot store"
            todo += [(f"{where}.{k}" if where else k, x) for k, x in value.items()]
        elif isinstance(value, list):
            todo += [(f"{where}[{i}]", x) for i, x in enumerate(value)]
        elif isinstance(value, str) and "\x00" in value:
            return f"{where} holds a NUL character (\\u0000), which PostgreSQL's jsonb cannot store"
        elif isinstance(value, float) and not math.isfinite(value):
            big = "" if math.isnan(value) else " (a number past a double's range, as 1e400, reads as infinite)"
            return f"{where} is {value}{big}: PostgreSQL's jsonb has no NaN or Infinity"
        elif isinstance(value, (date, time)):
            what = "date-time" if isinstance(value, datetime) else type(value).__name__
            return f"{where} is a TOML {what}, which JSON has no type for: quote it as a string"
        elif value is not None and not isinstance(value, (str, int, float)):
            return f"{where} is a {type(value).__name__}, which JSON has no type for"
    return None
