"""The building blocks of config sections: durations, ``Section`` (unknown keys refused), a
service's ``enabled``/``interval``, and a cron or interval ``schedule``.

:mod:`maintd.config` assembles the settings; each service's own section lives beside the service
(``maintd/services/<name>.py``) and is built from these.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, PlainSerializer, field_validator,
                      model_validator)

from .durations import format_duration, parse_duration
from .schedules import load_timezone, parse_schedule

QUEUE_RE = re.compile(r"^[^\x00-\x1f]{1,128}\Z")


def names_like_queues(kind: str) -> AfterValidator:
    """The keys of a per-queue (or per-kind) table: 1-128 characters, no control character; the
    error names the bad one (``invalid queue name ''``)."""
    def check(v: dict[str, object]) -> dict[str, object]:
        for name in v:
            if not QUEUE_RE.match(name):
                raise ValueError(f"invalid {kind} name {name!r}")
        return v
    return AfterValidator(check)


def _positive_duration(v: object) -> timedelta:
    td = parse_duration(v)
    if td <= timedelta(0):
        raise ValueError("must be greater than zero")
    return td


def _retention(v: object) -> timedelta | None:
    """A retention: a duration, or -1 (keep forever)."""
    if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == -1):
        return None
    if isinstance(v, str) and v.strip() == "-1":
        return None
    return parse_duration(v)


# The server takes its timeouts (statement_timeout, lock_timeout, idle_session_timeout) in
# milliseconds as a 32-bit integer: a longer one fails every session that sets it.
SERVER_TIMEOUT_MAX = timedelta(milliseconds=2**31 - 1)


def _server_timeout(v: object) -> timedelta:
    td = _positive_duration(v)
    if td > SERVER_TIMEOUT_MAX:
        raise ValueError(f"must be at most {format_duration(timedelta(seconds=SERVER_TIMEOUT_MAX // timedelta(seconds=1)))} "
                         f"(PostgreSQL's longest timeout, {2**31 - 1} ms)")
    return td


DURATION_JSON = PlainSerializer(format_duration, return_type=str, when_used="json")
PositiveDuration = Annotated[timedelta, BeforeValidator(_positive_duration), DURATION_JSON]
ServerTimeout = Annotated[timedelta, BeforeValidator(_server_timeout), DURATION_JSON]
Retention = Annotated[timedelta | None, BeforeValidator(_retention), DURATION_JSON]
OptionalDuration = Annotated[
    timedelta | None, BeforeValidator(lambda v: None if v is None else _positive_duration(v)),
    PlainSerializer(lambda v: None if v is None else format_duration(v), when_used="json"),
]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


PASS_FLOOR = timedelta(milliseconds=100)  # the shortest interval: '1ms' for '1m' is a typo


class ServiceConfig(Section):
    enabled: bool = True
    interval: PositiveDuration = timedelta(seconds=30)

    @field_validator("interval", check_fields=False)
    @classmethod
    def _floor(cls, v: timedelta) -> timedelta:
        if v < PASS_FLOOR:
            raise ValueError(f"must be at least {format_duration(PASS_FLOOR)} (a pass each; a typo "
                             "such as '1ms' for '1m' would run one a millisecond)")
        return v


class Scheduled(Section):
    """A section with a cron/interval ``schedule`` evaluated in ``timezone``."""

    schedule: str
    timezone: str = "UTC"

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str) -> str:
        load_timezone(v)
        return v

    @model_validator(mode="after")
    def _check_schedule(self) -> "Scheduled":
        try:
            parse_schedule(self.schedule, self.timezone)
        except ValueError as exc:
            raise ValueError(f"schedule: {exc}") from None
        return self
