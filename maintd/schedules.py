"""Schedules for periodic jobs and the reindexer.

Fire times come from APScheduler's triggers; this module only translates the classic crontab
conventions APScheduler 3 does not follow (day-of-week 0 = Sunday, and the day-of-month /
day-of-week OR rule) and adds ``@every <duration>`` intervals anchored at the Unix epoch, so
every replica computes the same slots without talking to the others.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Iterator
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.triggers.combining import OrTrigger
from apscheduler.triggers.cron import CronTrigger

from .durations import parse_duration

UTC = timezone.utc
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_TINY = timedelta(microseconds=1)

SHORTCUTS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_DOW_NAMES = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]
_DOW_PART = re.compile(r"^(\*|[0-7a-z]{1,3})(?:-([0-7a-z]{1,3}))?(?:/(\d+))?$")


def load_timezone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(f"unknown time zone {name!r}") from exc


class Schedule:
    """A set of slot times. ``next_after(t)`` is the first slot strictly after ``t``."""

    text: str

    def next_after(self, t: datetime) -> datetime:  # pragma: no cover - interface
        raise NotImplementedError

    def slots_between(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """Slots ``s`` with ``start < s <= end``, oldest first."""
        t = self.next_after(start)
        while t <= end:
            yield t
            t = self.next_after(t)

    def latest_at_or_before(self, t: datetime) -> datetime:
        """The most recent slot ``<= t`` (searches back with growing windows)."""
        window = timedelta(seconds=1)
        while window < timedelta(days=366 * 30):
            last = None
            for s in self.slots_between(t - window, t):
                last = s
            if last is not None:
                return last
            window *= 4
        raise ValueError(f"schedule {self.text!r} has no slot in the last 30 years")


@dataclass(frozen=True)
class IntervalSchedule(Schedule):
    text: str
    every: timedelta

    def next_after(self, t: datetime) -> datetime:
        step = self.every.total_seconds()
        elapsed = (t - EPOCH).total_seconds()
        n = int(elapsed // step) + 1
        slot = EPOCH + timedelta(seconds=n * step)
        if slot <= t:  # float rounding at an exact boundary
            slot += self.every
        return slot


@dataclass(frozen=True)
class CronSchedule(Schedule):
    text: str
    tz: ZoneInfo
    trigger: object = field(compare=False, repr=False)

    def next_after(self, t: datetime) -> datetime:
        while True:
            nxt = self.trigger.get_next_fire_time(None, (t + _TINY).astimezone(self.tz))
            if nxt is None:  # pragma: no cover - cron schedules never end
                raise ValueError(f"schedule {self.text!r} has no next fire time")
            nxt = nxt.astimezone(UTC)
            # A wall-clock time repeated when the clocks go back fires once, like cron: skip the
            # second occurrence (fold=1).
            if nxt.astimezone(self.tz).fold == 0:
                return nxt
            t = nxt


def parse_schedule(text: str, tz: str = "UTC") -> Schedule:
    """Parse ``*/15 * * * *``, ``@hourly`` or ``@every 30s``; raise ``ValueError`` if invalid."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("schedule must be a non-empty string")
    raw = " ".join(text.split())
    lowered = raw.lower()
    if lowered.startswith("@every"):
        every = parse_duration(raw[len("@every"):].strip() or "missing")
        if every < timedelta(seconds=1):
            raise ValueError(f"interval in {text!r} must be at least 1s")
        return IntervalSchedule(text=raw, every=every)
    expr = SHORTCUTS.get(lowered, raw)
    if expr.startswith("@"):
        raise ValueError(f"unknown schedule shortcut {raw!r}")
    zone = load_timezone(tz)
    fields_ = expr.split()
    if len(fields_) != 5:
        raise ValueError(f"cron schedule {text!r} must have 5 fields (minute hour day month weekday)")
    minute, hour, dom, month, dow = fields_
    dow_names = _translate_dow(dow)
    try:
        if dom != "*" and dow != "*":
            # Classic cron: when both day fields are restricted, either one matching fires.
            trigger: object = OrTrigger([
                CronTrigger(minute=minute, hour=hour, day=dom, month=month, timezone=zone),
                CronTrigger(minute=minute, hour=hour, month=month, day_of_week=dow_names,
                            timezone=zone),
            ])
        else:
            trigger = CronTrigger(minute=minute, hour=hour, day=dom, month=month,
                                  day_of_week=dow_names, timezone=zone)
    except ValueError as exc:
        raise ValueError(f"invalid cron schedule {text!r}: {exc}") from exc
    return CronSchedule(text=raw, tz=zone, trigger=trigger)


def _dow_number(token: str, text: str) -> int:
    if token.isdigit():
        n = int(token)
        if n > 7:
            raise ValueError(f"day of week {token!r} out of range 0-7 in {text!r}")
        return n % 7
    if token in _DOW_NAMES:
        return _DOW_NAMES.index(token)
    raise ValueError(f"invalid day of week {token!r} in {text!r}")


def _translate_dow(field_: str) -> str:
    """Crontab weekday field (0/7 = Sunday, names) -> APScheduler's list of weekday names."""
    if field_ == "*":
        return "*"
    days: set[int] = set()
    for part in field_.lower().split(","):
        m = _DOW_PART.match(part)
        if not m:
            raise ValueError(f"invalid day-of-week field {field_!r}")
        start_s, end_s, step_s = m.groups()
        step = int(step_s) if step_s else 1
        if step < 1:
            raise ValueError(f"step must be at least 1 in {field_!r}")
        if start_s == "*":
            if end_s:
                raise ValueError(f"invalid day-of-week field {field_!r}")
            lo, hi = 0, 6
        else:
            lo = _dow_number(start_s, field_)
            if end_s:
                hi = int(end_s) if end_s.isdigit() else _dow_number(end_s, field_)
                if hi > 7:
                    raise ValueError(f"day of week {end_s!r} out of range 0-7 in {field_!r}")
                if start_s.isdigit() and hi < lo:
                    raise ValueError(f"day-of-week range {part!r} runs backwards")
            else:
                hi = 6 if step_s else lo
        days.update(d % 7 for d in range(lo, hi + 1, step))
    return ",".join(_DOW_NAMES[d] for d in sorted(days))
