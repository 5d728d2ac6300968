"""Schedules for periodic jobs and the reindexer: cron expressions and ``@every`` intervals.

Cron expressions follow cronie (and croniter where cronie says nothing). This module parses and
validates the five fields itself, with cronie's grammar and readable errors, and hands a canonical
expression to ``cronsim`` (a cron iterator written for healthchecks.io after Debian/cronie cron)
for the date arithmetic, including the daylight-saving rules of cronie's ``cron.8``:

- a *fixed-time* job (neither the minute nor the hour field starts with ``*``; cronie's
  ``MIN_STAR``/``HR_STAR`` flags in ``src/entry.c``, used by ``find_jobs`` in ``src/cron.c``) runs
  once when its local time repeats (the first occurrence), and once at the end of a skipped
  interval when its time falls inside it;
- every other job (``*/15 * * * *``, ``0 * * * *``, ``0 */2 * * *``) runs at each real instant its
  fields match: in both passes of a repeated hour, and not at all in a skipped one;
- a forward change of more than three hours is a clock correction: fixed-time jobs that fell in
  the skipped interval do not run.

``@every <duration>`` intervals are anchored at the Unix epoch, so every replica computes the same
slots without talking to the others. Schedules take aware datetimes and return slots in UTC.
"""

from __future__ import annotations

import calendar
import math
import re
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from datetime import time as dtime
from itertools import islice
from typing import Callable, Iterator
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.triggers.base import BaseTrigger
from cronsim import CronSim, CronSimError

from .durations import parse_duration

UTC = timezone.utc
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_TINY = timedelta(microseconds=1)
_DAY = timedelta(days=1)
_HALF = timedelta(milliseconds=500)
_SECOND = timedelta(seconds=1)
# cronie treats a forward jump of more than three hours as a clock correction (src/cron.c).
_CORRECTION = timedelta(hours=3)
# How far apart a wildcard schedule's offset checks are (see CronSchedule._offset_change).
_STRETCH = timedelta(hours=6)
# Upper bound on candidates examined per call; real schedules need a handful.
_MAX_CANDIDATES = 10_000

SHORTCUTS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_NUMBER = re.compile(r"[0-9]{1,9}")
# Quartz's (and croniter's, AWS's) day extensions, which cronie has not: named as such in errors.
_EXTENSIONS = (
    (re.compile(r"\?"), "'?' (no specific value)"),
    (re.compile(r"(?i)L|LW|[0-9]{1,2}L|[a-z]{3}L"), "'L' (the last day)"),
    (re.compile(r"(?i)[0-9]{1,2}W"), "'W' (the nearest weekday)"),
    (re.compile(r"(?i)[0-9a-z]{1,3}#[0-9]"), "'#' (the nth weekday)"),
)


@dataclass(frozen=True)
class _Spec:
    """One cron field: its name, cronie's bounds and the names it accepts."""

    name: str
    lo: int
    hi: int
    names: tuple[str, ...] = ()

    def name_value(self, token: str) -> int | None:
        """The number a name stands for (``jan`` = 1, ``sun`` = 0), or None."""
        lowered = token.lower()
        if lowered not in self.names:
            return None
        return self.names.index(lowered) + self.lo


_SPECS = (
    _Spec("minute", 0, 59),
    _Spec("hour", 0, 23),
    _Spec("day-of-month", 1, 31),
    _Spec("month", 1, 12, _MONTHS),
    _Spec("day-of-week", 0, 7, _DAYS),
)
_DOW = _SPECS[4]


def load_timezone(name: str) -> ZoneInfo:
    """The IANA zone called ``name``; ``ValueError`` if there is none (also for a directory of
    the zone database, such as ``America``, or a name too long for a file: ``OSError`` there)."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, TypeError, OSError) as exc:
        raise ValueError(f"unknown time zone {name[:100]!r}") from exc


def _require_aware(t: datetime) -> None:
    if not isinstance(t, datetime) or t.tzinfo is None or t.utcoffset() is None:
        raise ValueError(f"expected an aware datetime, got {t!r}")


class Schedule:
    """A set of slot times.

    ``next_after(t)`` is the first slot strictly after ``t``; ``latest_at_or_before(t)`` the last
    slot at or before ``t`` (cached, so calling it every second costs a comparison);
    ``slots_between(start, end)`` the slots ``s`` with ``start < s <= end``, oldest first.
    """

    text: str
    timezone: str

    def __init__(self) -> None:
        self._bracket: tuple[datetime, datetime] | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        """What makes two schedules the same: kind, normalised text and time zone."""
        return (type(self).__name__, self.text, self.timezone)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schedule) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.text!r}, timezone={self.timezone!r})"

    def next_after(self, t: datetime) -> datetime:  # pragma: no cover - interface
        raise NotImplementedError

    def _previous(self, t: datetime) -> datetime:  # pragma: no cover - interface
        """A slot at or before ``t``, ideally the latest; ``latest_at_or_before`` corrects it."""
        raise NotImplementedError

    def slots_between(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """Slots ``s`` with ``start < s <= end``, oldest first."""
        _require_aware(end)
        t = self.next_after(start)
        while t <= end:
            yield t
            t = self.next_after(t)

    def count_between(self, start: datetime, end: datetime) -> int:
        """How many slots ``s`` with ``start < s <= end``, without keeping them."""
        return sum(1 for _ in self.slots_between(start, end))

    def latest_at_or_before(self, t: datetime) -> datetime:
        """The most recent slot ``<= t``. Remembers the slot pair around the last answer, so
        repeated calls with a clock that moves forward by seconds do no date arithmetic."""
        _require_aware(t)
        bracket = self._bracket
        if bracket is not None and bracket[0] <= t < bracket[1]:
            return bracket[0]
        prev = self._previous(t)
        nxt = self.next_after(prev)
        while nxt <= t:  # _previous may land early around DST changes; walk forward to the latest
            prev, nxt = nxt, self.next_after(nxt)
        self._bracket = (prev, nxt)
        return prev


class IntervalSchedule(Schedule):
    """``@every <duration>``: slots at whole multiples of the interval since the Unix epoch."""

    def __init__(self, text: str, every: timedelta, timezone_name: str = "UTC") -> None:
        super().__init__()
        self.text = text
        self.every = every
        self.timezone = timezone_name

    def _index(self, t: datetime) -> int:
        """How many whole intervals lie between the epoch and ``t`` (floor)."""
        _require_aware(t)
        return (t - EPOCH) // self.every

    def next_after(self, t: datetime) -> datetime:
        return EPOCH + (self._index(t) + 1) * self.every

    def _previous(self, t: datetime) -> datetime:
        return EPOCH + self._index(t) * self.every

    def count_between(self, start: datetime, end: datetime) -> int:
        return max(0, self._index(end) - self._index(start))


@dataclass(frozen=True)
class CronFields:
    """A validated five-field expression.

    ``values`` holds the matching numbers of each field (day-of-week 0-6, Sunday = 0); ``expr``
    is the same schedule in the canonical form given to cronsim (numbers only, and ``*`` /
    ``*/n`` kept where the field had them, since cron's day and DST rules look at a leading ``*``).
    """

    expr: str
    values: tuple[frozenset[int], ...]
    dom_star: bool
    dow_star: bool
    fixed_time: bool

    def day_matches(self, year: int, month: int, day: int) -> bool:
        """cron's day rule: both day fields must match if either starts with ``*``, else either."""
        dom_ok = day in self.values[2]
        dow_ok = (calendar.weekday(year, month, day) + 1) % 7 in self.values[4]
        if self.dom_star or self.dow_star:
            return dom_ok and dow_ok
        return dom_ok or dow_ok

    def matches(self, wall: datetime) -> bool:
        """True when the wall-clock minute ``wall`` matches every field."""
        return (wall.minute in self.values[0] and wall.hour in self.values[1]
                and wall.month in self.values[3] and self.day_matches(wall.year, wall.month, wall.day))


def parse_cron_fields(expr: str) -> CronFields:
    """Validate a five-field cron expression with cronie's grammar; ``ValueError`` names the
    field and the offending value (``minute 61 out of range 0-59``)."""
    parts = expr.split()
    if len(parts) != 5:
        raise ValueError(f"a cron expression has 5 fields (minute hour day-of-month month "
                         f"day-of-week), got {len(parts)} in {expr!r}")
    parsed = [_parse_field(spec, part) for spec, part in zip(_SPECS, parts)]
    values = tuple(v for v, _ in parsed)
    fields = CronFields(
        expr=" ".join(c for _, c in parsed), values=values,
        dom_star=parts[2].startswith("*"), dow_star=parts[4].startswith("*"),
        fixed_time=not (parts[0].startswith("*") or parts[1].startswith("*")),
    )
    _check_can_fire(fields)
    return fields


def _parse_field(spec: _Spec, text: str) -> tuple[frozenset[int], str]:
    """The values of one field and its canonical text (comma-separated terms)."""
    values: set[int] = set()
    canonical = []
    for term in text.split(","):
        if not term:
            raise ValueError(f"{spec.name} field {text!r} has an empty list item")
        _check_tokens(spec, text, term)
        term_values, term_text = _parse_term(spec, term)
        values |= term_values
        canonical.append(term_text)
    return frozenset(values), ",".join(canonical)


def _check_tokens(spec: _Spec, field: str, term: str) -> None:
    """An empty part of a term (``-90``, ``0-10/``) is named with the field as written, not as
    ``minute ''``."""
    base, slash, step = term.partition("/")
    lo, dash, hi = base.partition("-")
    missing = ("nothing before '/' (e.g. */5 or 0-30/5)" if slash and not base else
               "nothing after '/' (a step, e.g. */5)" if slash and not step else
               "nothing before '-' (a range is a-b, e.g. 0-30)" if dash and not lo else
               "nothing after '-' (a range is a-b, e.g. 0-30)" if dash and not hi else None)
    if missing:
        raise ValueError(f"{spec.name} field {field!r}: {missing}")


def _parse_term(spec: _Spec, term: str) -> tuple[set[int], str]:
    """``*``, ``*/n``, ``a``, ``a-b``, ``a-b/n`` or ``a/n`` (croniter's ``a-max/n``)."""
    base, slash, step_text = term.partition("/")
    step = _step(spec, step_text) if slash else 1
    if base == "*":
        values = set(range(spec.lo, spec.hi + 1, step))
        return _fold_sunday(spec, values), "*" if step == 1 else f"*/{step}"
    lo, dash, hi_text = base.partition("-")
    first = _value(spec, lo)
    if dash:
        last = _value(spec, hi_text)
        if spec is _DOW and first > last and last == 0:
            last = 7  # cronie (src/entry.c get_range): Sunday as a range end is 7, so mon-sun works
        if first > last:
            raise ValueError(f"{spec.name} range {base!r} runs backwards")
    elif slash:
        if spec is _DOW and first == 7:
            first = 0  # croniter: 7/2 is 0/2
        last = 6 if spec is _DOW else spec.hi
    else:
        last = first
    values = _fold_sunday(spec, set(range(first, last + 1, step)))
    return values, ",".join(str(v) for v in sorted(values))


def _step(spec: _Spec, text: str) -> int:
    if not _NUMBER.fullmatch(text) or int(text) < 1:
        raise ValueError(f"{spec.name} step {text!r} must be a whole number of at least 1")
    return int(text)


def _value(spec: _Spec, token: str) -> int:
    if _NUMBER.fullmatch(token):
        n = int(token)
        if not spec.lo <= n <= spec.hi:
            raise ValueError(f"{spec.name} {n} out of range {spec.lo}-{spec.hi}")
        return n
    named = spec.name_value(token)
    extension = next((what for pattern, what in _EXTENSIONS if pattern.fullmatch(token)), None)
    if named is None and extension is not None and spec.name in ("day-of-month", "day-of-week"):
        raise ValueError(f"{spec.name} {token!r}: {extension}, an extension of Quartz and croniter, "
                         "is not supported (cron expressions follow cronie)")
    if named is None:
        what = f"a number or a name ({', '.join(spec.names)})" if spec.names else "a number"
        raise ValueError(f"{spec.name} {token!r} is not {what}")
    return named


def _fold_sunday(spec: _Spec, values: set[int]) -> set[int]:
    return {v % 7 for v in values} if spec is _DOW else values


def _check_can_fire(fields: CronFields) -> None:
    """Reject expressions no calendar date satisfies (``0 0 30 2 *``). With the OR rule any
    weekday of any month matches; with the AND rule every day number that exists in a month
    falls on every weekday within the 400-year Gregorian cycle, so only the month length matters."""
    if not (fields.dom_star or fields.dow_star):
        return
    longest = {1: 31, 2: 29, 3: 31, 4: 30, 5: 31, 6: 30, 7: 31, 8: 31, 9: 30, 10: 31, 11: 30, 12: 31}
    if min(fields.values[2]) > max(longest[m] for m in fields.values[3]):
        days = ",".join(str(d) for d in sorted(fields.values[2]))
        months = ",".join(str(m) for m in sorted(fields.values[3]))
        raise ValueError(f"never fires: day-of-month {days} does not occur in month {months}")


class CronSchedule(Schedule):
    """A five-field cron expression evaluated in one time zone (see the module docstring)."""

    def __init__(self, text: str, fields: CronFields, zone: ZoneInfo) -> None:
        super().__init__()
        self.text = text
        self.fields = fields
        self.zone = zone
        self.timezone = zone.key
        self._iter_zone = UTC if zone.key in ("UTC", "Etc/UTC") else zone

    def _candidates(self, start: datetime, reverse: bool = False) -> Iterator[datetime]:
        """cronsim's slots from ``start`` (local), in UTC, dropping fixed-time slots that only
        exist because a clock correction (> 3 h) skipped their day."""
        sim = CronSim(self.fields.expr, start.astimezone(self._iter_zone), reverse=reverse)
        for _ in range(_MAX_CANDIDATES):
            try:
                local = next(sim)
            except StopIteration:
                break
            if self.fields.fixed_time and self._after_correction(local):
                continue
            yield local.astimezone(UTC)
        raise ValueError(f"schedule {self.text!r} has no slot within 50 years of {start.isoformat()}")

    def _after_correction(self, local: datetime) -> bool:
        """True for a slot moved to the end of a forward jump longer than three hours that its
        own fields do not match (cronie just adopts the new time then)."""
        before = (local.astimezone(UTC) - _TINY).astimezone(self.zone)
        jump = local.utcoffset() - before.utcoffset()
        return jump > _CORRECTION and not self.fields.matches(local)

    def count_between(self, start: datetime, end: datetime) -> int:
        """As the walk counts, but a whole local day whose UTC offset does not change (each of its
        wall-clock minutes happens once) is counted from the fields: a year's outage of a
        per-minute entry is 365 day checks, not 525,600 slots. Days with a change are walked."""
        _require_aware(start)
        _require_aware(end)
        first, last = start.astimezone(self.zone).date() + _DAY, end.astimezone(self.zone).date()
        if (last - first).days < 2:
            return super().count_between(start, end)
        per_day = len(self.fields.values[0]) * len(self.fields.values[1])
        walk = super().count_between
        edge = self._day_edge
        count = walk(start, edge(first)) + walk(edge(last), end)
        for i in range((last - first).days):
            day = first + timedelta(days=i)
            lo, hi = edge(day), edge(day + _DAY)
            if hi - lo != _DAY:
                count += walk(lo, hi)
            elif day.month in self.fields.values[3] and self.fields.day_matches(day.year, day.month, day.day):
                count += per_day
        return count

    def _day_edge(self, day: date) -> datetime:
        """Just before the local day's first instant: slots ``edge(d) < s <= edge(d + 1)`` are the day's."""
        return datetime.combine(day, dtime(), self.zone).astimezone(UTC) - _TINY

    def next_after(self, t: datetime) -> datetime:
        _require_aware(t)
        if not self.fields.fixed_time and self._iter_zone is not UTC:
            return self._wildcard_next(t)
        for slot in self._candidates(t):
            # In a repeated hour cronsim counts fixed-time slots from the wall clock, so the
            # first candidates can lie before ``t``; skip them.
            if slot > t:
                return slot
        raise AssertionError("unreachable")  # pragma: no cover - _candidates raises first

    def _wildcard_next(self, t: datetime) -> datetime:
        """A wildcard job's first slot after ``t``: the first instant whose wall-clock minute
        matches. cronsim steps such jobs in real time (an hour, then to the minute), which across
        a change of offset that is not whole hours (Lord Howe's 30-minute DST) lands off the wall
        clock's grid and skips slots; so within each stretch of one UTC offset, match the wall
        clock (cronsim without a zone) and move to the next stretch when the match lies past it."""
        start = t.astimezone(UTC)
        for _ in range(_MAX_CANDIDATES):
            offset = self._offset(start + _TINY)
            wall = (start + offset).replace(tzinfo=None)
            try:
                slot = next(CronSim(self.fields.expr, wall)).replace(tzinfo=UTC) - offset
            except StopIteration:
                break
            change = self._offset_change(start + _TINY, slot, offset)
            if change is None:
                return slot
            start = change - _TINY
        raise ValueError(f"schedule {self.text!r} has no slot within 50 years of {t.isoformat()}")

    def _offset(self, t: datetime) -> timedelta:
        return t.astimezone(self.zone).utcoffset()  # type: ignore[return-value]

    def _offset_change(self, lo: datetime, hi: datetime, offset: timedelta) -> datetime | None:
        """The first instant in ``(lo, hi]`` whose UTC offset is not ``offset`` (that of ``lo``),
        or None: stepping six hours (no zone changes twice within that), then bisecting."""
        while lo < hi:
            step = hi if hi - lo <= _STRETCH else lo + _STRETCH
            if self._offset(step) != offset:
                while step - lo > _TINY:
                    mid = lo + (step - lo) // 2
                    lo, step = (mid, step) if self._offset(mid) == offset else (lo, mid)
                return step
            lo = step
        return None

    def _previous(self, t: datetime) -> datetime:
        # cronsim walks back from ``start`` (exclusive) over whole seconds. In the second pass of
        # a repeated hour it walks the wall clock, so it can miss a fixed-time slot of the first
        # pass that is later on the wall but earlier in time; latest_at_or_before walks forward
        # from here and finds it.
        start = (t.astimezone(UTC).replace(microsecond=0) + _SECOND).astimezone(self.zone)
        for slot in self._candidates(start, reverse=True):
            if slot <= t:
                return slot
        raise AssertionError("unreachable")  # pragma: no cover - _candidates raises first


def _sparser(a: Schedule, b: Schedule, start: datetime, end: datetime) -> tuple[Schedule, Schedule, int]:
    """The schedule with fewer slots in ``(start, end]`` (two ``@every`` ones: their common
    multiple, which has exactly the slots both have), the other, and how many it has there."""
    if isinstance(a, IntervalSchedule) and isinstance(b, IntervalSchedule):
        every = timedelta(microseconds=math.lcm(a.every // _TINY, b.every // _TINY))
        both = IntervalSchedule(f"@every {every}", every)
        return both, both, both.count_between(start, end)
    counts = a.count_between(start, end), b.count_between(start, end)
    return (a, b, counts[0]) if counts[0] <= counts[1] else (b, a, counts[1])


def common_slots(a: Schedule, b: Schedule, start: datetime, end: datetime) -> Iterator[datetime]:
    """The slots ``a`` and ``b`` both have in ``(start, end]``, oldest first: the sparser one's,
    each asked of the other."""
    few, other, _ = _sparser(a, b, start, end)
    return (s for s in few.slots_between(start, end) if other.latest_at_or_before(s) == s)


def count_common(a: Schedule, b: Schedule, start: datetime, end: datetime, walk: int) -> int:
    """How many slots ``a`` and ``b`` both have in ``(start, end]``. Exact for two ``@every``
    schedules and when the sparser one has at most ``walk`` slots there; otherwise an estimate:
    its slot count times the share of its first ``walk`` slots the other has too."""
    few, other, total = _sparser(a, b, start, end)
    if few is other:
        return total
    shared = sum(other.latest_at_or_before(s) == s for s in islice(few.slots_between(start, end), walk))
    return shared if total <= walk else round(total * shared / walk)


def latest_common(a: Schedule, b: Schedule, start: datetime, end: datetime, walk: int) -> datetime | None:
    """The latest slot ``a`` and ``b`` both have in ``(start, end]``, walking the sparser one back
    from ``end`` at most ``walk`` slots; None when there is none within them."""
    few, other, _ = _sparser(a, b, start, end)
    s = few.latest_at_or_before(end)
    for _ in range(walk):
        if s <= start:
            return None
        if other.latest_at_or_before(s) == s:
            return s
        s = few.latest_at_or_before(s - _TINY)
    return None


def _is_interval(lowered: str) -> bool:
    """``@every ...`` (``lowered``: the schedule with its spaces collapsed, in lower case)."""
    return lowered == "@every" or lowered.startswith("@every ")


def zone_read(text: str, timezone: str) -> str | None:
    """The time zone a schedule is read in, to show beside it: None for ``@every`` (slots counted
    from the Unix epoch, in no zone), so an interval does not seem to follow a zone it ignores."""
    return None if _is_interval(" ".join(str(text).split()).lower()) else timezone


def parse_schedule(text: str, timezone: str = "UTC") -> Schedule:
    """Parse ``*/15 * * * *``, ``@hourly`` or ``@every 30s`` evaluated in ``timezone``.

    Raises ``ValueError`` for anything the config rejects: bad syntax, values out of range,
    backwards ranges, unknown names or zones, and expressions that can never fire.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("schedule must be a non-empty string")
    raw = " ".join(text.split())
    zone = load_timezone(timezone)
    lowered = raw.lower()
    if _is_interval(lowered):
        if not raw[len("@every"):].strip():
            raise ValueError("'@every' needs a duration, e.g. '@every 30s'")
        every = parse_duration(raw[len("@every"):].strip())
        if every < _SECOND:
            raise ValueError(f"interval in {raw!r} must be at least 1s")
        return IntervalSchedule(raw, every, zone.key)
    expr = SHORTCUTS.get(lowered, raw)
    if expr.startswith("@"):
        raise ValueError(f"unknown schedule shortcut {raw!r} (use one of "
                         f"{', '.join(SHORTCUTS)} or @every <duration>)")
    fields = parse_cron_fields(expr)
    _check_cronsim_accepts(fields)
    return CronSchedule(raw, fields, zone)


def _check_cronsim_accepts(fields: CronFields) -> None:
    try:
        CronSim(fields.expr, datetime(2000, 1, 1, tzinfo=UTC))
    except CronSimError as exc:  # pragma: no cover - our grammar is a subset of cronsim's
        raise ValueError(f"cron expression {fields.expr!r} rejected: {exc}") from exc


def upcoming(expr: str, timezone: str = "UTC", after: datetime | None = None,
             n: int = 10) -> list[datetime]:
    """The next ``n`` slots of ``expr`` after ``after`` (default: now), in the schedule's zone.

    A naive ``after`` is read as wall-clock time in ``timezone`` (see :func:`_wall_time`). For
    ``maintd schedule``. Fewer than ``n`` when Python's datetime (year 9999) ends first.
    """
    if not 1 <= n <= 10_000:
        raise ValueError(f"n must be between 1 and 10000, got {n}")
    schedule = parse_schedule(expr, timezone)
    zone = load_timezone(timezone)
    t = datetime.now(UTC) if after is None else after
    if t.tzinfo is None:
        t = _wall_time(t, zone)
    out = []
    for _ in range(n):
        try:
            t = schedule.next_after(t)
            out.append(t.astimezone(zone))
        except OverflowError:  # past datetime.max
            break
    return out


def _wall_time(naive: datetime, zone: ZoneInfo) -> datetime:
    """``naive`` read in ``zone``: a repeated time is its first pass; one the clocks skip (02:30
    when they go from 02:00 to 03:00) is the last instant before the jump, so the slot at the
    jump's end that stands for the skipped times is after it (Python would read 02:30 as 03:30)."""
    t = naive.replace(tzinfo=zone)
    try:
        if t.astimezone(UTC).astimezone(zone).replace(tzinfo=None) == naive:
            return t
        lo, hi = naive.replace(tzinfo=zone, fold=1).astimezone(UTC), t.astimezone(UTC)
    except OverflowError:  # at the ends of Python's dates (no skipped times there): as it is
        return t
    offset = lo.astimezone(zone).utcoffset()
    while hi - lo > _TINY:  # the jump lies between the two readings: find its instant
        mid = lo + (hi - lo) // 2
        lo, hi = (mid, hi) if mid.astimezone(zone).utcoffset() == offset else (lo, mid)
    return lo


class ScheduleTrigger(BaseTrigger):
    """An APScheduler 3 trigger firing at a ``Schedule``'s slots. Two triggers are equal when
    their schedules are (``key``), so a reload can keep an unchanged job's next run time.

    ``skew()``: the server's time minus the host's wall clock (APScheduler's ``now``): the slots
    are the server's, so a host clock minutes off still fires at the server's 03:00."""

    __slots__ = ("schedule", "skew")

    def __init__(self, schedule: Schedule, skew: Callable[[], timedelta] | None = None) -> None:
        self.schedule = schedule
        self.skew = skew

    @property
    def key(self) -> tuple[str, str, str]:
        return self.schedule.key

    def get_next_fire_time(self, previous_fire_time: datetime | None, now: datetime) -> datetime:
        # Like CronTrigger: the first fire time may be ``now`` itself; later ones follow the
        # previous fire time, or ``now`` if the clock went back behind it.
        off = self.skew() if self.skew is not None else timedelta(0)
        if previous_fire_time is not None and previous_fire_time <= now:
            if not off:
                return self.schedule.next_after(previous_fire_time)
            # The slot fired, in server time, give or take the skew's jitter since: half a
            # second past it (slots are whole seconds, a second or more apart) is the next one.
            return self.schedule.next_after(previous_fire_time + off + _HALF) - off
        return self.schedule.next_after(now + off - _TINY) - off

    def __getstate__(self) -> dict:
        return {"version": 1, "text": self.schedule.text, "timezone": self.schedule.timezone}

    def __setstate__(self, state: dict) -> None:
        self.schedule = parse_schedule(state["text"], state["timezone"])
        self.skew = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ScheduleTrigger) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __str__(self) -> str:
        return f"schedule[{self.schedule.text}, {self.schedule.timezone}]"

    def __repr__(self) -> str:
        return f"<ScheduleTrigger {self.schedule.text!r} timezone={self.schedule.timezone!r}>"


def schedule_trigger(schedule: Schedule, skew: Callable[[], timedelta] | None = None) -> ScheduleTrigger:
    """An APScheduler 3 trigger that fires at ``schedule``'s slots (in the server's time, with
    ``skew``: see :class:`ScheduleTrigger`)."""
    return ScheduleTrigger(schedule, skew)
