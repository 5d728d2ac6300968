"""Cron conformance: cases ported from other projects' test suites and manuals.

Every case names the file it comes from. maintd follows cronie (croniter where cronie says
nothing, SPEC 7.8); where a source expects something else, the case carries that source's
expectation in ``differs`` together with the reason maintd's answer is cronie's. Sources:

- pallets-eco/croniter ``src/croniter/tests/test_croniter.py`` and
  ``src/croniter/tests/test_croniter_dst_repetition.py``
- cronie-crond/cronie ``man/cron.8`` (section "Daylight Saving Time and other time changes"),
  ``man/crontab.5``, ``src/entry.c`` (parser) and ``src/cron.c`` (``find_jobs``, DST cases)
- robfig/cron ``spec_test.go``
- graphile/worker ``__tests__/cronMatcher.test.ts``, ``__tests__/cron-timing.test.ts``,
  ``__tests__/cron.test.ts``, ``__tests__/crontab.test.ts``
- cuu508/cronsim ``tests/test_cronsim.py`` (its Debian-cron DST cases)

Times written without an offset are wall-clock times in the case's time zone. ``check()`` works
with any module offering ``parse_schedule(expr, tz)``, so the same cases can be run against an
older implementation to count its disagreements.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Callable
from zoneinfo import ZoneInfo

import pytest

from maintd.schedules import parse_schedule

CRONITER = "pallets-eco/croniter src/croniter/tests/test_croniter.py"
CRONITER_DST = "pallets-eco/croniter src/croniter/tests/test_croniter_dst_repetition.py"
CRON8 = "cronie-crond/cronie man/cron.8 (Daylight Saving Time and other time changes)"
CRONTAB5 = "cronie-crond/cronie man/crontab.5"
ENTRY_C = "cronie-crond/cronie src/entry.c"
CRON_C = "cronie-crond/cronie src/cron.c"
ROBFIG = "robfig/cron spec_test.go"
G_MATCHER = "graphile/worker __tests__/cronMatcher.test.ts"
G_TIMING = "graphile/worker __tests__/cron-timing.test.ts"
G_CRON = "graphile/worker __tests__/cron.test.ts"
G_CRONTAB = "graphile/worker __tests__/crontab.test.ts"
CRONSIM = "cuu508/cronsim tests/test_cronsim.py"

DOM_STAR = ("cronie: a day field that starts with '*' counts as unrestricted (DOM_STAR/DOW_STAR in "
            "src/entry.c), so both day fields must match (find_jobs in src/cron.c)")
GAP = ("cronie runs a fixed-time job whose time falls in a skipped interval once, at its end "
       "(man/cron.8)")
REPEAT = "cronie runs a fixed-time job once when its local time repeats (man/cron.8)"
BACKWARDS = ("cronie selects nothing for a backwards range (get_range in src/entry.c), so the job "
             "could never fire; maintd rejects it")


@dataclass(frozen=True)
class Case:
    """One expectation about one expression."""

    source: str
    expr: str
    tz: str = "UTC"
    after: str | None = None  # next_after chain from here ...
    nexts: tuple[str, ...] = ()  # ... gives these slots
    before: str | None = None  # previous slots strictly before this time ...
    prevs: tuple[str, ...] = ()  # ... newest first
    at: str | None = None  # is this time a slot?
    fires: bool | None = None
    window: tuple[str, str] | None = None  # slots_between(start, end) ...
    slots: tuple[str, ...] | None = None  # ... is exactly this list
    invalid: bool = False  # parse_schedule must raise ValueError
    differs: str = ""  # the source's own expectation, where maintd follows cronie instead


def nxt(source, expr, after, *expected, tz="UTC", differs=""):
    return Case(source, expr, tz, after=after, nexts=expected, differs=differs)


def prv(source, expr, before, *expected, tz="UTC", differs=""):
    return Case(source, expr, tz, before=before, prevs=expected, differs=differs)


def fires(source, expr, at, expected, tz="UTC", differs=""):
    return Case(source, expr, tz, at=at, fires=expected, differs=differs)


def between(source, expr, start, end, *expected, tz="UTC", differs=""):
    return Case(source, expr, tz, window=(start, end), slots=expected, differs=differs)


def bad(source, expr, differs=""):
    return Case(source, expr, invalid=True, differs=differs)


CASES: list[Case] = [
    # ---- robfig/cron spec_test.go, TestActivation (local time read as UTC) ----
    fires(ROBFIG, "0/15 * * * *", "2012-07-09T15:00", True),
    fires(ROBFIG, "0/15 * * * *", "2012-07-09T15:45", True),
    fires(ROBFIG, "0/15 * * * *", "2012-07-09T15:40", False),
    fires(ROBFIG, "5/15 * * * *", "2012-07-09T15:05", True),
    fires(ROBFIG, "5/15 * * * *", "2012-07-09T15:20", True),
    fires(ROBFIG, "5/15 * * * *", "2012-07-09T15:50", True),
    fires(ROBFIG, "0/15 * * Jul *", "2012-07-15T15:00", True),
    fires(ROBFIG, "0/15 * * Jun *", "2012-07-15T15:00", False),
    fires(ROBFIG, "30 08 * Jul Sun", "2012-07-15T08:30", True, differs="source writes '?' for '*'"),
    fires(ROBFIG, "30 08 15 Jul *", "2012-07-15T08:30", True, differs="source writes '?' for '*'"),
    fires(ROBFIG, "30 08 * Jul Sun", "2012-07-16T08:30", False, differs="source writes '?' for '*'"),
    fires(ROBFIG, "30 08 15 Jul *", "2012-07-16T08:30", False, differs="source writes '?' for '*'"),
    bad(ROBFIG, "30 08 ? Jul Sun", differs="robfig accepts Quartz's '?'; cronie's parser does not"),
    fires(ROBFIG, "@hourly", "2012-07-09T15:00", True),
    fires(ROBFIG, "@hourly", "2012-07-09T15:04", False),
    fires(ROBFIG, "@daily", "2012-07-09T15:00", False),
    fires(ROBFIG, "@daily", "2012-07-09T00:00", True),
    fires(ROBFIG, "@weekly", "2012-07-09T00:00", False),
    fires(ROBFIG, "@weekly", "2012-07-08T00:00", True),
    fires(ROBFIG, "@weekly", "2012-07-08T01:00", False),
    fires(ROBFIG, "@monthly", "2012-07-08T00:00", False),
    fires(ROBFIG, "@monthly", "2012-07-01T00:00", True),
    fires(ROBFIG, "* * 1,15 * Sun", "2012-07-15T00:00", True),
    fires(ROBFIG, "* * 1,15 * Sun", "2012-06-15T00:00", True),
    fires(ROBFIG, "* * 1,15 * Sun", "2012-08-01T00:00", True),
    fires(ROBFIG, "* * */10 * Sun", "2012-07-15T00:00", False,
          differs=f"robfig expects true (OR rule for */10, its issue #70); {DOM_STAR}"),
    fires(ROBFIG, "* * * * Mon", "2012-07-15T00:00", False),
    fires(ROBFIG, "* * 1,15 * *", "2012-07-09T00:00", False),
    fires(ROBFIG, "* * 1,15 * *", "2012-07-15T00:00", True),
    fires(ROBFIG, "* * */2 * Sun", "2012-07-15T00:00", True),
    # ---- robfig/cron spec_test.go, TestNext (six fields; the seconds field 0 dropped) ----
    nxt(ROBFIG, "0/15 * * * *", "2012-07-09T14:45", "2012-07-09T15:00"),
    nxt(ROBFIG, "0/15 * * * *", "2012-07-09T14:59", "2012-07-09T15:00"),
    nxt(ROBFIG, "0/15 * * * *", "2012-07-09T14:59:59", "2012-07-09T15:00"),
    nxt(ROBFIG, "20-35/15 * * * *", "2012-07-09T15:45", "2012-07-09T16:20"),
    nxt(ROBFIG, "*/15 * * * *", "2012-07-09T23:46", "2012-07-10T00:00"),
    nxt(ROBFIG, "20-35/15 * * * *", "2012-07-09T23:45", "2012-07-10T00:20"),
    # ... the "15/35 20-35/15 ..." cases, their seconds field 15/35 dropped (robfig's :15 is :00)
    nxt(ROBFIG, "20-35/15 * * * *", "2012-07-09T23:35:51", "2012-07-10T00:20"),
    nxt(ROBFIG, "20-35/15 1/2 * * *", "2012-07-09T23:35:51", "2012-07-10T01:20"),
    nxt(ROBFIG, "20-35/15 10-12 * * *", "2012-07-09T23:35:51", "2012-07-10T10:20"),
    nxt(ROBFIG, "20-35/15 1/2 */2 * *", "2012-07-09T23:35:51", "2012-07-11T01:20"),
    nxt(ROBFIG, "20-35/15 * 9-20 * *", "2012-07-09T23:35:51", "2012-07-10T00:20"),
    nxt(ROBFIG, "20-35/15 * 9-20 Jul *", "2012-07-09T23:35:51", "2012-07-10T00:20"),
    nxt(ROBFIG, "0 0 9 Apr-Oct *", "2012-07-09T23:35", "2012-08-09T00:00"),
    nxt(ROBFIG, "0 0 */5 Apr,Aug,Oct Mon", "2012-07-09T23:35", "2012-08-06T00:00",
        differs=f"robfig expects 2012-08-01 (OR rule); {DOM_STAR}"),
    nxt(ROBFIG, "0 0 */5 Oct Mon", "2012-07-09T23:35", "2012-10-01T00:00"),
    nxt(ROBFIG, "0 0 * Feb Mon", "2012-07-09T23:35", "2013-02-04T00:00"),
    nxt(ROBFIG, "0 0 * Feb Mon/2", "2012-07-09T23:35", "2013-02-01T00:00"),
    nxt(ROBFIG, "* * * * *", "2012-12-31T23:59:45", "2013-01-01T00:00"),
    nxt(ROBFIG, "0 0 29 Feb *", "2012-07-09T23:35", "2016-02-29T00:00"),
    nxt(ROBFIG, "30 2 11 Mar *", "2012-03-11T00:00:00-05:00", "2012-03-11T03:00:00-04:00",
        tz="America/New_York", differs=f"robfig skips to 2013-03-11T02:30-04:00; {GAP}"),
    nxt(ROBFIG, "0 * * * *", "2012-03-11T00:00:00-05:00", "2012-03-11T01:00:00-05:00",
        "2012-03-11T03:00:00-04:00", "2012-03-11T04:00:00-04:00", "2012-03-11T05:00:00-04:00",
        tz="America/New_York"),
    nxt(ROBFIG, "0 1 * * *", "2012-03-11T00:00:00-05:00", "2012-03-11T01:00:00-05:00",
        "2012-03-12T01:00:00-04:00", tz="America/New_York"),
    nxt(ROBFIG, "0 2 * * *", "2012-03-11T00:00:00-05:00", "2012-03-11T03:00:00-04:00",
        "2012-03-12T02:00:00-04:00", tz="America/New_York",
        differs=f"robfig skips the day (2012-03-12T02:00-04:00 first); {GAP}"),
    nxt(ROBFIG, "30 2 4 Nov *", "2012-11-04T00:00:00-04:00", "2012-11-04T02:30:00-05:00",
        tz="America/New_York"),
    nxt(ROBFIG, "30 1 4 Nov *", "2012-11-04T01:45:00-04:00", "2013-11-04T01:30:00-05:00",
        tz="America/New_York", differs=f"robfig runs it again at 2012-11-04T01:30-05:00; {REPEAT}"),
    nxt(ROBFIG, "0 * * * *", "2012-11-04T00:00:00-04:00", "2012-11-04T01:00:00-04:00",
        "2012-11-04T01:00:00-05:00", "2012-11-04T02:00:00-05:00", tz="America/New_York"),
    nxt(ROBFIG, "0 1 * * *", "2012-11-04T00:00:00-04:00", "2012-11-04T01:00:00-04:00",
        "2012-11-05T01:00:00-05:00", tz="America/New_York",
        differs=f"robfig runs it twice (also 2012-11-04T01:00-05:00); {REPEAT}"),
    nxt(ROBFIG, "0 2 * * *", "2012-11-04T00:00:00-04:00", "2012-11-04T02:00:00-05:00",
        "2012-11-05T02:00:00-05:00", tz="America/New_York"),
    nxt(ROBFIG, "0 3 * * *", "2012-11-04T00:00:00-04:00", "2012-11-04T03:00:00-05:00",
        "2012-11-05T03:00:00-05:00", tz="America/New_York"),
    bad(ROBFIG, "0 0 30 Feb *"),
    bad(ROBFIG, "0 0 31 Apr *"),
    nxt(ROBFIG, "0 3 3 * *", "2012-11-04T00:00:00-04:00", "2012-12-03T03:00:00-05:00",
        tz="America/New_York"),
    nxt(ROBFIG, "0 9 10 * *", "2018-10-17T05:00:00-04:00", "2018-11-10T06:00:00-05:00",
        tz="America/Sao_Paulo"),
    nxt(ROBFIG, "0 9 22 * *", "2018-02-14T05:00:00-05:00", "2018-02-22T07:00:00-05:00",
        tz="America/Sao_Paulo"),
    bad(ROBFIG, "xyz"),
    bad(ROBFIG, "60 0 * * *"),
    bad(ROBFIG, "0 60 * * *"),
    bad(ROBFIG, "0 0 * * XYZ"),
    bad(ROBFIG, "15/0 * * * *"),  # TestSlash0NoHang
    nxt(ROBFIG, "14 14 * * *", "2016-01-03T13:09:03+05:30", "2016-01-03T14:14:00+05:30",
        tz="Asia/Kolkata"),  # TestNextWithTz
    nxt(ROBFIG, "14 14 * * *", "2016-01-03T04:09:03+05:30", "2016-01-03T14:14:00+05:30",
        tz="Asia/Kolkata"),
    nxt(ROBFIG, "14 14 * * *", "2016-01-03T14:09:03+05:30", "2016-01-03T14:14:00+05:30",
        tz="Asia/Kolkata"),
    # ---- croniter src/croniter/tests/test_croniter.py ----
    nxt(CRONITER, "*/1 * * * *", "2010-01-23T12:18", "2010-01-23T12:19"),  # test_minute
    nxt(CRONITER, "*/5 * * * *", "2010-01-23T12:18", "2010-01-23T12:20"),
    nxt(CRONITER, "0 */3 * * *", "2010-01-24T12:02", "2010-01-24T15:00", "2010-01-24T18:00",
        "2010-01-24T21:00", "2010-01-25T00:00"),  # test_hour
    nxt(CRONITER, "0 0 */3 * *", "2010-02-24T12:09", "2010-02-25T00:00", "2010-02-28T00:00",
        "2010-03-01T00:00"),  # test_day
    nxt(CRONITER, "0 0 * * *", "1996-02-27T00:00", "1996-02-28T00:00", "1996-02-29T00:00"),
    nxt(CRONITER, "0 0 * * *", "2000-02-27T00:00", "2000-02-28T00:00", "2000-02-29T00:00"),
    prv(CRONITER, "* * 29 2 *", "2024-02-28T00:00", "2020-02-29T23:59"),  # test_day2
    nxt(CRONITER, "0 0 * * sat", "2010-02-25T00:00", "2010-02-27T00:00", "2010-03-06T00:00"),
    nxt(CRONITER, "0 0 1 * wed", "2010-01-25T00:00", "2010-01-27T00:00", "2010-02-01T00:00",
        "2010-02-03T00:00"),  # test_weekday: day-of-month OR day-of-week
    nxt(CRONITER, "0 0 31 2 0", "2026-01-01T00:00", "2026-02-01T00:00", "2026-02-08T00:00",
        "2026-02-15T00:00"),  # test_weekday_day_or_with_impossible_day_of_month
    nxt(CRONITER, "0 0 30 2 0", "2026-01-01T00:00", "2026-02-01T00:00", "2026-02-08T00:00",
        "2026-02-15T00:00"),
    nxt(CRONITER, "0 0 31 4 0", "2026-01-01T00:00", "2026-04-05T00:00", "2026-04-12T00:00",
        "2026-04-19T00:00"),
    prv(CRONITER, "0 0 31 2 0", "2026-03-01T00:00", "2026-02-22T00:00", "2026-02-15T00:00",
        "2026-02-08T00:00"),
    bad(CRONITER, "0 0 31 2 *"),  # test_impossible_day_of_month_alone_still_raises
    bad(CRONITER, "0 0 30 2 *"),
    nxt(CRONITER, "0 16 */2 * sat", "2023-05-02T00:00", "2023-05-13T16:00", "2023-05-27T16:00",
        "2023-06-03T16:00", "2023-06-17T16:00",
        differs="croniter's default is the union (May 3, 5, 6, 7); this is its "
                f"implement_cron_bug=True result, cronie's rule: {DOM_STAR}"),  # test_dom_dow_vixie_cron_bug
    nxt(CRONITER, "0 0 1 * *", "2010-01-25T00:00", "2010-02-01T00:00", "2010-03-01T00:00"),
    bad(CRONITER, "* * * *"),  # test_error
    bad(CRONITER, "-90 * * * *"),
    bad(CRONITER, "a * * * *"),
    bad(CRONITER, "* * * janu-jun *"),
    bad(CRONITER, "1-1_0 * * * *"),
    bad(CRONITER, "0-10/error * * * *"),
    bad(CRONITER, "0-10/ * * * *"),
    bad(CRONITER, "0-1& * * * *"),
    bad(CRONITER, "* * 5-100 * *"),
    nxt(CRONITER, "30 22 * * sun-thu", "2010-08-25T15:56", "2010-08-25T22:30"),
    between(CRONITER, "59/15 * * * *", "2026-01-01T00:00", "2026-01-01T02:00",
            "2026-01-01T00:59", "2026-01-01T01:59"),  # test_step_from_field_max
    between(CRONITER, "44/15 * * * *", "2026-01-01T00:00", "2026-01-01T01:00",
            "2026-01-01T00:44", "2026-01-01T00:59"),
    between(CRONITER, "5/15 * * * *", "2026-01-01T00:00", "2026-01-01T01:00",
            "2026-01-01T00:05", "2026-01-01T00:20", "2026-01-01T00:35", "2026-01-01T00:50"),
    nxt(CRONITER, "0 0 * * SAT/2", "2026-01-01T00:00", "2026-01-03T00:00", "2026-01-10T00:00"),
    nxt(CRONITER, "0 0 * * 7/2", "2026-01-01T00:00", "2026-01-03T00:00", "2026-01-04T00:00",
        "2026-01-06T00:00"),  # 7/2 is 0/2: Sun, Tue, Thu, Sat
    between(CRONITER, "5-5 * * * *", "2026-01-01T00:00", "2026-01-01T01:00", "2026-01-01T00:05",
            differs="croniter reads an equal range as the whole cycle; cronie's get_range "
                    "(src/entry.c) sets the one value"),
    between(CRONITER, "59-59/15 * * * *", "2026-01-01T00:00", "2026-01-01T01:00", "2026-01-01T00:59",
            differs="croniter: every 15th minute of the field; cronie: 59 only"),
    nxt(CRONITER, "0 0 1 JAN-JAN *", "2026-01-01T00:00", "2027-01-01T00:00",
        differs="croniter reads JAN-JAN as every month; cronie as January"),
    prv(CRONITER, "*/1 * * * *", "2010-08-25T15:56", "2010-08-25T15:55"),  # test_prev_minute
    prv(CRONITER, "*/1 * * * *", "2010-08-25T15:00", "2010-08-25T14:59"),
    prv(CRONITER, "*/1 * * * *", "2010-08-25T00:00", "2010-08-24T23:59"),
    prv(CRONITER, "0 0 22 * *", "2012-03-15T00:00", "2012-02-22T00:00"),
    prv(CRONITER, "0 0 * * sat,sun", "2010-08-25T15:56", "2010-08-22T00:00", "2010-08-21T00:00",
        "2010-08-15T00:00"),  # test_prev_weekday
    prv(CRONITER, "10 0 * * 0", "2010-08-25T15:56", "2010-08-22T00:10"),
    nxt(CRONITER, "0 0 * * 6", "2010-02-25T00:00", "2010-02-27T00:00", "2010-03-06T00:00"),
    prv(CRONITER, "5 0 */2 * *", "2012-02-24T00:00", "2012-02-23T00:05"),  # test_bug1
    nxt(CRONITER, "0 * * 3 *", "2012-01-01T00:00", "2012-03-01T00:00", "2012-03-01T01:00",
        "2012-03-01T02:00"),  # test_bug2
    nxt(CRONITER, "00 03 16,30 * *", "2013-03-01T12:17:34.257877", "2013-03-16T03:00",
        "2013-03-30T03:00", "2013-04-16T03:00"),  # test_bug3
    prv(CRONITER, "00 03 16,30 * *", "2013-04-16T03:00", "2013-03-30T03:00", "2013-03-16T03:00",
        "2013-02-16T03:00"),
    nxt(CRONITER, "0 4/6 * * *", "2012-02-24T00:00", "2012-02-24T04:00"),  # test_bug57
    prv(CRONITER, "0 4/6 * * *", "2012-02-24T04:00", "2012-02-23T22:00"),
    nxt(CRONITER, "0 0/6 * * *", "2012-02-24T00:00", "2012-02-24T06:00"),
    prv(CRONITER, "0 0/6 * * *", "2012-02-24T06:00", "2012-02-24T00:00"),
    nxt(CRONITER, "0 0 1 3,6,9,12 *", "2016-03-01T00:00", "2016-06-01T00:00"),  # test_multiple_months
    nxt(CRONITER, "0 0 1 3,6,9,12 *", "2016-02-15T00:00", "2016-03-01T00:00"),
    nxt(CRONITER, "0 0 1 3,6,9,12 *", "2016-12-03T10:00", "2017-03-01T00:00"),
    prv(CRONITER, "0 0 1 3,6,9,12 *", "2016-03-01T00:00", "2015-12-01T00:00"),
    prv(CRONITER, "0 0 1,15,31 * *", "2016-02-01T00:00", "2016-01-31T00:00"),
    prv(CRONITER, "0 0 1 1,3,6,9,12 *", "2016-03-01T00:00", "2016-01-01T00:00"),
    nxt(CRONITER, "1-9/2 0 1 * *", "2013-03-04T00:00", "2013-04-01T00:01", "2013-04-01T00:03",
        "2013-04-01T00:05", "2013-04-01T00:07", "2013-04-01T00:09"),  # test_range_generator
    prv(CRONITER, "* 10 * * *", "2012-06-23T17:41", "2012-06-23T10:59"),  # test_previous_hour
    prv(CRONITER, "* * 26 * *", "2012-06-27T00:15", "2012-06-26T23:59"),
    prv(CRONITER, "* * * 5 *", "2012-06-18T00:15", "2012-05-31T23:59"),
    prv(CRONITER, "* * * * sat", "2012-05-13T18:48", "2012-05-12T23:59"),
    nxt(CRONITER, "0 0 */10 * *", "2025-02-22T00:00", "2025-03-01T00:00"),  # test_first_of_march
    nxt(CRONITER, "*/30 * * * *", "2013-10-27T02:00:00+03:00", "2013-10-27T02:30:00+03:00",
        "2013-10-27T03:00:00+03:00", "2013-10-27T03:30:00+03:00", "2013-10-27T03:00:00+02:00",
        "2013-10-27T03:30:00+02:00", "2013-10-27T04:00:00+02:00", "2013-10-27T04:30:00+02:00",
        tz="Europe/Athens"),  # test_timezone_winter_time
    prv(CRONITER, "*/30 * * * *", "2013-10-27T05:00:00+02:00", "2013-10-27T04:30:00+02:00",
        "2013-10-27T04:00:00+02:00", "2013-10-27T03:30:00+02:00", "2013-10-27T03:00:00+02:00",
        "2013-10-27T03:30:00+03:00", "2013-10-27T03:00:00+03:00", "2013-10-27T02:30:00+03:00",
        tz="Europe/Athens"),
    nxt(CRONITER, "*/30 * * * *", "2013-03-31T01:00:00+02:00", "2013-03-31T01:30:00+02:00",
        "2013-03-31T02:00:00+02:00", "2013-03-31T02:30:00+02:00", "2013-03-31T04:00:00+03:00",
        "2013-03-31T04:30:00+03:00", tz="Europe/Athens"),  # test_timezone_summer_time
    prv(CRONITER, "*/30 * * * *", "2013-03-31T05:00:00+03:00", "2013-03-31T04:30:00+03:00",
        "2013-03-31T04:00:00+03:00", "2013-03-31T02:30:00+02:00", "2013-03-31T02:00:00+02:00",
        "2013-03-31T01:30:00+02:00", tz="Europe/Athens"),
    nxt(CRONITER, "0 0 * * *", "2017-03-26T00:00:00+01:00", "2017-03-27T00:00:00+02:00",
        tz="Europe/Warsaw"),  # test_std_dst
    nxt(CRONITER, "0 * * * *", "2017-03-26T01:00:00+01:00", "2017-03-26T03:00:00+02:00",
        tz="Europe/Warsaw"),
    nxt(CRONITER, "0 0 * * *", "2017-10-29T00:00:00+02:00", "2017-10-30T00:00:00+01:00",
        tz="Europe/Warsaw"),
    nxt(CRONITER, "0 * * * *", "2017-10-29T01:59:00+02:00", "2017-10-29T02:00:00+02:00",
        "2017-10-29T02:00:00+01:00", "2017-10-29T03:00:00+01:00", "2017-10-29T04:00:00+01:00",
        tz="Europe/Warsaw"),
    nxt(CRONITER, "0 0 * * *", "2018-02-17T21:00:00-02:00", "2018-02-18T00:00:00-03:00",
        tz="America/Sao_Paulo"),  # test_std_dst2
    nxt(CRONITER, "0 0 * * *", "2018-02-17T23:00:00-02:00", "2018-02-18T00:00:00-03:00",
        tz="America/Sao_Paulo"),
    nxt(CRONITER, "0 0 * * *", "2018-02-17T23:05:00-03:00", "2018-02-18T00:00:00-03:00",
        tz="America/Sao_Paulo"),
    nxt(CRONITER, "0 0 * * *", "2018-02-18T00:05:00-03:00", "2018-02-19T00:00:00-03:00",
        tz="America/Sao_Paulo"),
    prv(CRONITER, "0 0 24 * *", "2020-04-15T00:00:00+09:30", "2020-03-24T00:00:00+10:30",
        tz="Australia/Adelaide"),  # test_std_dst3
    nxt(CRONITER, "0 0 24 * *", "2020-04-15T00:00:00+09:30", "2020-04-24T00:00:00+09:30",
        tz="Australia/Adelaide"),
    nxt(CRONITER, "7 0 * * *", "2025-03-30T00:00:00+00:00", "2025-03-30T00:07:00+00:00",
        "2025-03-31T00:07:00+01:00", "2025-04-01T00:07:00+01:00", tz="Europe/London"),  # test_dst_daily
    nxt(CRONITER, "7 * * * *", "2025-03-30T00:00:00+00:00", "2025-03-30T00:07:00+00:00",
        "2025-03-30T02:07:00+01:00", "2025-03-30T03:07:00+01:00", tz="Europe/London"),  # test_dst_hourly
    prv(CRONITER, "30 7,12,17 * * *", "2018-03-05T12:30:50", "2018-03-05T12:30",
        "2018-03-05T07:30"),  # test_exactly_the_same_minute
    prv(CRONITER, "0 10 * * *", "2018-01-02T10:00:00.000500", "2018-01-02T10:00"),  # test_milliseconds
    nxt(CRONITER, "0 10 * * *", "2018-01-02T10:00:00.000500", "2018-01-03T10:00"),
    prv(CRONITER, "0 10 * * *", "2018-01-02T09:59:59.999999", "2018-01-01T10:00"),
    nxt(CRONITER, "0 10 * * *", "2018-01-02T09:59:59.999999", "2018-01-02T10:00"),
    bad(CRONITER, "*/0 * * * *"),  # test_invalid_zerorepeat
    bad(CRONITER, "5-5/0 * * * *"),
    bad(CRONITER, "59-0/0 * * * *"),
    bad(CRONITER, "* * 31-1/0 * *"),
    bad(CRONITER, "* * * * 6-0/0"),
    nxt(CRONITER, "0 0 * * Wed-Sun", "2019-01-14T00:00", "2019-01-16T00:00", "2019-01-17T00:00",
        "2019-01-18T00:00", "2019-01-19T00:00", "2019-01-20T00:00", "2019-01-23T00:00"),  # test_issue_monsun_117
    fires(CRONITER, "0 0 10 * wed", "2020-06-10T00:00", True),  # test_match
    fires(CRONITER, "0 0 10 * fri", "2020-06-10T00:00", True),
    fires(CRONITER, "0 0 10 * fri", "2020-06-12T00:00", True),
    fires(CRONITER, "0 0 * * *", "2019-01-14T00:01", False),
    nxt(CRONITER, "1 2 * * *", "2020-03-29T01:59:55+01:00", "2020-03-29T03:00:00+02:00",
        "2020-03-30T02:01:00+02:00", "2020-03-31T02:01:00+02:00", tz="Europe/Paris"),  # test_dst_issue90_st31ny
    prv(CRONITER, "1 2 * * *", "2020-03-30T02:01:00+02:00", "2020-03-29T03:00:00+02:00",
        "2020-03-28T02:01:00+01:00", tz="Europe/Paris"),
    nxt(CRONITER, "0 0 * * *", "2022-03-25T00:00:00+02:00", "2022-03-26T00:00:00+02:00",
        "2022-03-27T01:00:00+03:00", "2022-03-28T00:00:00+03:00", tz="Asia/Hebron"),  # test_dst_iter
    prv(CRONITER, "0 6 30 3 *", "2021-03-30T04:00", "2020-03-30T06:00"),  # test_issue_47
    nxt(CRONITER, "* * * * *,0", "2019-01-14T11:00:59.999999", "2019-01-14T11:01"),  # test_issue156
    bad(CRONITER, "* * * * *,b"),
    bad(CRONITER, "0 0 0 0 0"),  # test_issue_k6
    bad(CRONITER, "0 0 0 1 0"),
    prv(CRONITER, "15 22 29 2 *", "2024-02-29T00:00", "2020-02-29T22:15"),  # test_bug_62_leap
    prv(CRONITER, "0 0 29 * *", "2024-03-02T00:00", "2024-02-29T00:00"),  # test_get_prev_leap_year_feb29
    prv(CRONITER, "0 0 29 * *", "2024-01-15T00:00", "2023-12-29T00:00"),
    nxt(CRONITER, "* * * * *", "2040-01-01T00:00", "2040-01-01T00:01"),  # test_issue_2038y
    nxt(CRONITER, "0 0 * * 1-7", "2026-01-03T00:00", "2026-01-04T00:00", "2026-01-05T00:00"),  # test_revert_issue_90
    nxt(CRONITER, "0 0 * * 7", "2026-01-01T00:00", "2026-01-04T00:00", "2026-01-11T00:00"),
    nxt(CRONITER, "0 0 * * Sun-Sun", "2024-01-01T00:00", "2024-01-07T00:00", "2024-01-14T00:00",
        differs="croniter fires every day (an equal range is the whole cycle); cronie: Sunday"),  # test_sunday_ranges_to
    nxt(CRONITER, "0 0 * * 0-0", "2024-01-01T00:00", "2024-01-07T00:00", "2024-01-14T00:00",
        differs="croniter fires every day; cronie: Sunday"),
    nxt(CRONITER, "0 0 * * 7-7", "2024-01-01T00:00", "2024-01-07T00:00", "2024-01-14T00:00",
        differs="croniter fires every day; cronie: Sunday"),
    nxt(CRONITER, "0 0 * * Mon-Sun", "2024-01-01T00:00", "2024-01-02T00:00", "2024-01-03T00:00",
        "2024-01-04T00:00", "2024-01-05T00:00", "2024-01-06T00:00", "2024-01-07T00:00"),
    nxt(CRONITER, "0 0 * * Tue-Sun", "2024-01-06T00:00", "2024-01-07T00:00", "2024-01-09T00:00"),
    nxt(CRONITER, "0 0 * * Sat-Sun", "2024-01-01T00:00", "2024-01-06T00:00", "2024-01-07T00:00",
        "2024-01-13T00:00"),
    nxt(CRONITER, "0 0 * * Sat-7", "2024-01-01T00:00", "2024-01-06T00:00", "2024-01-07T00:00",
        "2024-01-13T00:00"),
    nxt(CRONITER, "0 0 * * Sun-Mon", "2024-01-01T00:00", "2024-01-07T00:00", "2024-01-08T00:00",
        "2024-01-14T00:00"),  # test_sunday_ranges_from
    bad(CRONITER, "0 0 * * Thu-Tue/2", differs=f"croniter wraps around the week; {BACKWARDS}"),
    nxt(CRONITER, "0 0 1 Jan-Aug/2 *", "2024-01-01T00:00", "2024-03-01T00:00", "2024-05-01T00:00",
        "2024-07-01T00:00", "2025-01-01T00:00"),  # test_mth_ranges_from
    nxt(CRONITER, "0 0 1 Jan-Aug/4 *", "2024-01-01T00:00", "2024-05-01T00:00", "2025-01-01T00:00"),
    nxt(CRONITER, "0 0 1 Jan-Dec *", "2024-01-01T00:00", "2024-02-01T00:00", "2024-03-01T00:00"),
    bad(CRONITER, "0 0 1 Nov-Mar *", differs=f"croniter wraps around the year; {BACKWARDS}"),
    bad(CRONITER, "0 0 L * *", differs="croniter's L (last day) is a Quartz extension cronie rejects"),
    bad(CRONITER, "0 0 * * sat#1", differs="croniter's # (nth weekday) is an extension cronie rejects"),
    nxt(CRONITER_DST, "*/5 * * * *", "2024-01-25T04:46", "2024-01-25T04:50", "2024-01-25T04:55",
        "2024-01-25T05:00"),
    # ---- cronie man/cron.8, "Daylight Saving Time and other time changes" ----
    # "If time was adjusted one hour forward, those jobs that would have run in the interval
    # that has been skipped will be run immediately."
    nxt(CRON8, "30 2 * * *", "2026-03-28T12:00", "2026-03-29T03:00:00+02:00",
        "2026-03-30T02:30:00+02:00", tz="Europe/Berlin"),
    nxt(CRON8, "0 2 * * *", "2026-03-07T12:00", "2026-03-08T03:00:00-04:00",
        "2026-03-09T02:00:00-04:00", tz="America/New_York"),
    nxt(CRON8, "15 2 * * *", "2026-10-03T12:00", "2026-10-04T02:30:00+11:00",
        "2026-10-05T02:15:00+11:00", tz="Australia/Lord_Howe"),  # a 30-minute change
    nxt(CRON8, "1 2 * * *", "2026-03-29T00:00", "2026-03-29T03:00:00+02:00", tz="Europe/Paris"),
    nxt(CRON8, "0,30 2 * * *", "2026-03-29T00:00", "2026-03-29T03:00:00+02:00",
        "2026-03-30T02:00:00+02:00", tz="Europe/Paris"),  # all of the gap's slots run once, together
    # A fixed-time job outside the gap keeps its day (issue 14: midnight after the change).
    nxt(CRON8, "0 0 * * *", "2026-03-08T00:00", "2026-03-09T00:00:00-04:00", tz="America/New_York"),
    nxt(CRON8, "0 0 * * *", "2026-10-04T00:00", "2026-10-05T00:00:00+11:00", tz="Australia/Sydney"),
    nxt(CRON8, "30 0 * * *", "2026-03-29T00:30", "2026-03-30T00:30:00+02:00", tz="Europe/Berlin"),
    # "Conversely, if time was adjusted backward, running the same job twice is avoided."
    between(CRON8, "30 1 * * *", "2026-11-01T00:00-04:00", "2026-11-01T03:00-05:00",
            "2026-11-01T01:30:00-04:00", tz="America/New_York"),
    between(CRON8, "0 1 * * *", "2026-11-01T00:00-04:00", "2026-11-01T03:00-05:00",
            "2026-11-01T01:00:00-04:00", tz="America/New_York"),
    nxt(CRON8, "30 1 * * *", "2026-10-24T12:00", "2026-10-25T01:30:00+01:00",
        "2026-10-26T01:30:00+00:00", tz="Europe/London"),
    nxt(CRON8, "30 1 * * *", "2026-11-01T01:10:00-05:00", "2026-11-02T01:30:00-05:00",
        tz="America/New_York"),  # asked during the second pass: the first one already ran it
    prv(CRON8, "30 1 * * *", "2026-11-01T01:20:00-05:00", "2026-11-01T01:30:00-04:00",
        tz="America/New_York"),
    # "Jobs that run more frequently are scheduled normally."
    between(CRON8, "*/15 * * * *", "2026-11-01T01:00-04:00", "2026-11-01T02:00-05:00",
            "2026-11-01T01:15:00-04:00", "2026-11-01T01:30:00-04:00", "2026-11-01T01:45:00-04:00",
            "2026-11-01T01:00:00-05:00", "2026-11-01T01:15:00-05:00", "2026-11-01T01:30:00-05:00",
            "2026-11-01T01:45:00-05:00", "2026-11-01T02:00:00-05:00", tz="America/New_York"),
    nxt(CRON8, "0 * * * *", "2026-11-01T00:30-04:00", "2026-11-01T01:00:00-04:00",
        "2026-11-01T01:00:00-05:00", "2026-11-01T02:00:00-05:00", tz="America/New_York"),
    # ... also across Lord Howe's 30-minute changes, where a step of whole hours in real time
    # lands off the wall clock's hour (cronsim's iteration skipped these slots).
    between(CRON8, "0 */2 * * *", "2026-04-05T00:30+11:00", "2026-04-05T04:00+10:30",
            "2026-04-05T02:00:00+10:30", "2026-04-05T04:00:00+10:30", tz="Australia/Lord_Howe"),
    between(CRON8, "31 * * * *", "2026-04-05T01:00+11:00", "2026-04-05T02:40+10:30",
            "2026-04-05T01:31:00+11:00", "2026-04-05T01:31:00+10:30", "2026-04-05T02:31:00+10:30",
            tz="Australia/Lord_Howe"),  # both passes of the repeated half hour
    between(CRON8, "31 * * * *", "2025-10-05T01:00+10:30", "2025-10-05T03:40+11:00",
            "2025-10-05T01:31:00+10:30", "2025-10-05T02:31:00+11:00", "2025-10-05T03:31:00+11:00",
            tz="Australia/Lord_Howe"),  # 02:00 became 02:30: 02:31 still exists
    between(CRON8, "*/15 2 * * *", "2026-04-05T01:00+10:30", "2026-04-05T03:00+10:30",
            "2026-04-05T02:00:00+10:30", "2026-04-05T02:15:00+10:30", "2026-04-05T02:30:00+10:30",
            "2026-04-05T02:45:00+10:30", tz="Australia/Lord_Howe"),
    nxt(CRON8, "*/15 * * * *", "2026-03-08T01:30", "2026-03-08T01:45:00-05:00",
        "2026-03-08T03:00:00-04:00", "2026-03-08T03:15:00-04:00", tz="America/New_York"),
    # "Time changes of more than 3 hours are considered to be corrections to the clock or the
    # timezone, and the new time is used immediately." Samoa skipped 2011-12-30.
    nxt(CRON8, "0 12 * * *", "2011-12-29T00:00", "2011-12-29T12:00:00-10:00",
        "2011-12-31T12:00:00+14:00", tz="Pacific/Apia"),
    nxt(CRON8, "0 0 30 12 *", "2011-12-01T00:00", "2012-12-30T00:00:00+14:00", tz="Pacific/Apia"),
    nxt(CRON8, "0 * * * *", "2011-12-29T23:30", "2011-12-31T00:00:00+14:00", tz="Pacific/Apia"),
    # ---- cronie src/entry.c + src/cron.c: which jobs are "fixed-time" (no MIN_STAR/HR_STAR) ----
    between(CRON_C, "30 */1 * * *", "2026-11-01T00:00-04:00", "2026-11-01T03:00-05:00",
            "2026-11-01T00:30:00-04:00", "2026-11-01T01:30:00-04:00", "2026-11-01T01:30:00-05:00",
            "2026-11-01T02:30:00-05:00", tz="America/New_York"),
    between(CRON_C, "30 0-23 * * *", "2026-11-01T00:00-04:00", "2026-11-01T03:00-05:00",
            "2026-11-01T00:30:00-04:00", "2026-11-01T01:30:00-04:00", "2026-11-01T02:30:00-05:00",
            tz="America/New_York"),
    between(CRON_C, "*/30 1 * * *", "2026-11-01T00:00-04:00", "2026-11-01T03:00-05:00",
            "2026-11-01T01:00:00-04:00", "2026-11-01T01:30:00-04:00", "2026-11-01T01:00:00-05:00",
            "2026-11-01T01:30:00-05:00", tz="America/New_York"),
    nxt(CRON_C, "0 0 */2 * sat", "2023-05-02T00:00", "2023-05-13T00:00", "2023-05-27T00:00"),
    nxt(CRON_C, "0 0 1,15 * Sun", "2026-02-01T12:00", "2026-02-08T00:00", "2026-02-15T00:00",
        "2026-02-22T00:00", "2026-03-01T00:00"),  # find_jobs comment: 1st, 15th AND every Sunday
    nxt(ENTRY_C, "0 0 * * mon-0", "2026-01-03T00:00", "2026-01-04T00:00", "2026-01-05T00:00"),
    nxt(ENTRY_C, "0 0 * * 7-0", "2026-01-01T00:00", "2026-01-04T00:00", "2026-01-11T00:00"),
    between(ENTRY_C, "5-6/2 * * * *", "2026-01-01T00:00", "2026-01-01T01:00", "2026-01-01T00:05"),
    nxt(ENTRY_C, "0 0 * * 5-6/2", "2026-01-01T00:00", "2026-01-02T00:00", "2026-01-09T00:00"),
    bad(ENTRY_C, "0 0 1 jan/error *"),
    bad(ENTRY_C, "0 0 * * sunday"),  # names are exactly three letters
    bad(ENTRY_C, "6~15 * * * *",
        differs="cronie picks a random minute when it reads the file; replicas would disagree"),
    bad(ENTRY_C, "@reboot", differs="cronie runs it at boot; a daemon schedule has no boot"),
    bad(ENTRY_C, "0 5-1 * * *", differs=BACKWARDS),
    # ---- cronie man/crontab.5 ----
    nxt(CRONTAB5, "30 4 1,15 * 5", "2026-01-01T05:00", "2026-01-02T04:30", "2026-01-09T04:30",
        "2026-01-15T04:30", "2026-01-16T04:30"),  # "on the 1st and 15th of each month, plus every Friday"
    nxt(CRONTAB5, "0 */23 * * *", "2026-01-01T00:30", "2026-01-01T23:00", "2026-01-02T00:00",
        "2026-01-02T23:00"),  # "*/23" in hours: hour 0 and hour 23
    nxt(CRONTAB5, "*/35 * * * *", "2026-01-01T00:00", "2026-01-01T00:35", "2026-01-01T01:00",
        "2026-01-01T01:35"),  # "at 0 and 35 minutes past"
    nxt(CRONTAB5, "23 0-23/2 * * *", "2026-01-01T00:00", "2026-01-01T00:23", "2026-01-01T02:23",
        "2026-01-01T04:23"),
    nxt(CRONTAB5, "5 4 * * sun", "2026-01-01T00:00", "2026-01-04T04:05", "2026-01-11T04:05"),
    nxt(CRONTAB5, "0 22 * * 1-5", "2026-01-02T23:00", "2026-01-05T22:00"),
    nxt(CRONTAB5, "0 8-11 * * *", "2026-01-01T09:30", "2026-01-01T10:00", "2026-01-01T11:00",
        "2026-01-02T08:00"),
    nxt(CRONTAB5, "0 0 * * mon,wed,fri", "2026-01-01T00:00", "2026-01-02T00:00", "2026-01-05T00:00",
        "2026-01-07T00:00"),
    nxt(CRONTAB5, "0 0 1 jan-mar *", "2026-02-15T00:00", "2026-03-01T00:00", "2027-01-01T00:00"),
    between(CRONTAB5, "0-4,8-12/2 0 1 1 *", "2025-12-31T23:59", "2026-01-01T00:30",
            "2026-01-01T00:00", "2026-01-01T00:01", "2026-01-01T00:02", "2026-01-01T00:03",
            "2026-01-01T00:04", "2026-01-01T00:08", "2026-01-01T00:10", "2026-01-01T00:12"),
    fires(CRONTAB5, "@yearly", "2026-01-01T00:00", True),
    fires(CRONTAB5, "@annually", "2026-01-01T00:00", True),
    fires(CRONTAB5, "@midnight", "2026-06-01T00:00", True),
    # ---- graphile-worker __tests__/cronMatcher.test.ts (digests as concrete UTC dates) ----
    fires(G_MATCHER, "* * * * *", "2023-01-01T00:00", True),
    fires(G_MATCHER, "* * * * *", "2025-07-04T15:06", True),
    fires(G_MATCHER, "* * * * 5-6", "2023-01-01T00:00", False),  # Sunday
    fires(G_MATCHER, "* * * * 5-6", "2021-01-01T00:00", True),  # Friday
    fires(G_MATCHER, "* * * * 5-6", "2026-01-01T00:00", False),  # Thursday
    fires(G_MATCHER, "* * * * 5-6", "2018-07-01T15:00", False),
    fires(G_MATCHER, "* * * * 5-6", "2023-07-04T15:00", False),
    fires(G_MATCHER, "* * * * 5-6", "2025-07-04T15:00", True),
    fires(G_MATCHER, "* * * * 5-6", "2025-07-04T15:06", True),
    fires(G_MATCHER, "0-5 15 3-4 7 0-2", "2023-01-01T00:00", False),
    fires(G_MATCHER, "0-5 15 3-4 7 0-2", "2021-01-01T00:00", False),
    fires(G_MATCHER, "0-5 15 3-4 7 0-2", "2026-01-01T00:00", False),
    fires(G_MATCHER, "0-5 15 3-4 7 0-2", "2018-07-01T15:00", True),  # Sunday: the OR rule
    fires(G_MATCHER, "0-5 15 3-4 7 0-2", "2023-07-04T15:00", True),
    fires(G_MATCHER, "0-5 15 3-4 7 0-2", "2025-07-04T15:00", True),  # the 4th: the OR rule
    fires(G_MATCHER, "0-5 15 3-4 7 0-2", "2025-07-04T15:06", False),
    # ---- graphile-worker __tests__/cron-timing.test.ts ("0 */4 * * *", 2021-01-01 UTC) ----
    nxt(G_TIMING, "0 */4 * * *", "2021-01-01T01:00", "2021-01-01T04:00"),
    prv(G_TIMING, "0 */4 * * *", "2021-01-01T03:00:01", "2021-01-01T00:00"),
    between(G_TIMING, "0 */4 * * *", "2021-01-01T03:00:01", "2021-01-01T04:00:01", "2021-01-01T04:00"),
    between(G_TIMING, "0 */4 * * *", "2021-01-01T03:59:00", "2021-01-01T03:59:30"),  # clock skew
    between(G_TIMING, "0 */4 * * *", "2021-01-01T04:00:00", "2021-01-01T08:00:01", "2021-01-01T08:00"),
    # ---- graphile-worker __tests__/cron.test.ts, backfill windows of "0 */4 * * *" ----
    between(G_CRON, "0 */4 * * *", "2021-01-01T05:30", "2021-01-01T10:30", "2021-01-01T08:00"),  # 5h: 1-2 jobs
    between(G_CRON, "0 */4 * * *", "2020-12-31T09:30", "2021-01-01T10:30", "2020-12-31T12:00",
            "2020-12-31T16:00", "2020-12-31T20:00", "2021-01-01T00:00", "2021-01-01T04:00",
            "2021-01-01T08:00"),  # 25h: 6-7 jobs
    # ---- graphile-worker __tests__/crontab.test.ts ----
    between(G_CRONTAB, "*/10,7,56-59 1 1 1 1", "2025-12-31T23:00", "2026-01-01T02:00",
            *[f"2026-01-01T01:{m:02d}" for m in (0, 7, 10, 20, 30, 40, 50, 56, 57, 58, 59)]),
    nxt(G_CRONTAB, "0 4 * * 7", "2026-03-02T00:00", "2026-03-08T04:00"),
    bad(G_CRONTAB, "1,60 * * * *"),
    bad(G_CRONTAB, "*/0 * * * *"),
    # ---- cronsim tests/test_cronsim.py, TestDstTransitions (Europe/Riga, Debian cron rules) ----
    nxt(CRONSIM, "0 */2 * * *", "2021-10-31T01:30", "2021-10-31T02:00:00+03:00",
        "2021-10-31T04:00:00+02:00", "2021-10-31T06:00:00+02:00", tz="Europe/Riga"),
    nxt(CRONSIM, "0 */3 * * *", "2021-10-31T01:30", "2021-10-31T03:00:00+03:00",
        "2021-10-31T03:00:00+02:00", "2021-10-31T06:00:00+02:00", tz="Europe/Riga"),
    nxt(CRONSIM, "0 1,2,3,4,5 * * *", "2021-03-28T01:30", "2021-03-28T02:00:00+02:00",
        "2021-03-28T04:00:00+03:00", "2021-03-28T05:00:00+03:00", tz="Europe/Riga"),
    nxt(CRONSIM, "0 1-5 * * *", "2021-10-31T01:30", "2021-10-31T02:00:00+03:00",
        "2021-10-31T03:00:00+03:00", "2021-10-31T04:00:00+02:00", tz="Europe/Riga"),
    nxt(CRONSIM, "15 3 * * *", "2021-03-27T00:00", "2021-03-27T03:15:00+02:00",
        "2021-03-28T04:00:00+03:00", "2021-03-29T03:15:00+03:00", tz="Europe/Riga"),
    nxt(CRONSIM, "* 1-6 * * *", "2021-10-31T03:58:00+03:00", "2021-10-31T03:59:00+03:00",
        "2021-10-31T03:00:00+02:00", "2021-10-31T03:01:00+02:00", tz="Europe/Riga"),
]


def _time(text: str, tz: str) -> datetime:
    t = datetime.fromisoformat(text)
    return t if t.tzinfo else t.replace(tzinfo=ZoneInfo(tz))


def check(case: Case, parse: Callable[[str, str], object]) -> list[str]:
    """How ``parse(expr, tz)``'s schedule disagrees with ``case`` (empty when it agrees)."""
    try:
        schedule = parse(case.expr, case.tz)
    except ValueError as exc:
        return [] if case.invalid else [f"rejected: {exc}"]
    if case.invalid:
        return ["accepted"]
    try:
        return _check_schedule(case, schedule)
    except Exception as exc:  # noqa: BLE001 - any crash is a disagreement
        return [f"raised {type(exc).__name__}: {exc}"]


def _check_schedule(case: Case, s) -> list[str]:
    problems = []
    if case.after is not None:
        t = _time(case.after, case.tz)
        for want in case.nexts:
            t = s.next_after(t)
            if t != _time(want, case.tz):
                problems.append(f"next {t.isoformat()} != {want}")
                break
    if case.before is not None:
        t = _time(case.before, case.tz)
        for want in case.prevs:
            t = s.latest_at_or_before(t - timedelta(microseconds=1))
            if t != _time(want, case.tz):
                problems.append(f"previous {t.isoformat()} != {want}")
                break
    if case.at is not None:
        t = _time(case.at, case.tz)
        if (s.next_after(t - timedelta(seconds=1)) == t) != case.fires:
            problems.append(f"fires at {case.at}: expected {case.fires}")
    if case.window is not None:
        start, end = (_time(x, case.tz) for x in case.window)
        got = list(s.slots_between(start, end))
        if got != [_time(x, case.tz) for x in case.slots]:
            problems.append(f"slots {[g.isoformat() for g in got]}")
    return problems


def _case_id(case: Case) -> str:
    return f"{case.source.split()[0].split('/')[-1]}:{case.tz}:{case.expr}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_case(case):
    assert check(case, parse_schedule) == [], f"source: {case.source}"


def test_every_case_names_its_source_and_checks_something():
    assert len(CASES) >= 80
    for case in CASES:
        assert case.source.split()[0] in {"pallets-eco/croniter", "cronie-crond/cronie",
                                          "robfig/cron", "graphile/worker", "cuu508/cronsim"}
        assert case.invalid or case.nexts or case.prevs or case.fires is not None \
            or case.slots is not None, case
