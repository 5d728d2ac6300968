"""Schedules: fire times against an independent cron library (croniter), intervals, shortcuts,
DST, validation messages, the cached latest slot, the APScheduler trigger and upcoming().

Ported outside cases live in test_cron_conformance.py."""

from __future__ import annotations

import pickle
import random
import threading
import time
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from apscheduler.schedulers.background import BackgroundScheduler
from croniter import croniter

from maintd.schedules import parse_cron_fields, parse_schedule, schedule_trigger, upcoming

UTC = timezone.utc


def random_field(rng: random.Random, lo: int, hi: int, names: list[str] | None = None) -> str:
    kind = rng.choice(["star", "value", "list", "range", "step", "range_step", "star_step", "name"])
    if kind == "star":
        return "*"
    if kind == "value":
        return str(rng.randint(lo, hi))
    if kind == "list":
        return ",".join(str(v) for v in sorted(rng.sample(range(lo, hi + 1), rng.randint(2, 4))))
    if kind == "range":
        a = rng.randint(lo, hi - 1)
        return f"{a}-{rng.randint(a + 1, hi)}"
    if kind == "step":
        return f"*/{rng.randint(2, 7)}"
    if kind == "range_step":
        a = rng.randint(lo, hi - 3)
        b = rng.randint(a + 3, hi)
        return f"{a}-{b}/{rng.randint(2, min(3, b - a))}"
    if kind == "star_step":
        return f"*/{rng.randint(2, 10)}"
    if names:
        return rng.choice(names)
    return str(rng.randint(lo, hi))


def random_cron(rng: random.Random) -> str:
    return " ".join([
        random_field(rng, 0, 59),
        random_field(rng, 0, 23),
        random_field(rng, 1, 28),
        random_field(rng, 1, 12, ["jan", "mar", "jun", "dec"]),
        random_field(rng, 0, 6, ["sun", "mon", "fri", "sat"]),
    ])


def test_next_fire_times_match_croniter_on_random_expressions():
    """croniter with implement_cron_bug=True applies cron's day rule (a day field starting with
    '*' makes both fields required), which is cronie's."""
    rng = random.Random(20261122)
    checked = 0
    for _ in range(300):
        expr = random_cron(rng)
        start = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=rng.randint(0, 400 * 24 * 60),
                                                              seconds=rng.randint(0, 59))
        ours = parse_schedule(expr)
        theirs = croniter(expr, start, implement_cron_bug=True)
        t = start
        for _ in range(5):
            expected = theirs.get_next(datetime)
            got = ours.next_after(t)
            assert got == expected, f"{expr!r} after {t}: {got} != {expected}"
            t = got
            checked += 1
    assert checked == 1500


@pytest.mark.parametrize("expr,after,expected", [
    # dom and dow both restricted: either matches (classic cron OR rule).
    ("0 0 13 * 5", "2026-02-01T00:00:00", "2026-02-06T00:00:00"),  # Friday 6th before the 13th
    ("0 0 1 * 1", "2026-06-02T00:00:00", "2026-06-08T00:00:00"),  # Monday
    # 0 and 7 are Sunday.
    ("30 9 * * 0", "2026-03-02T00:00:00", "2026-03-08T09:30:00"),
    ("30 9 * * 7", "2026-03-02T00:00:00", "2026-03-08T09:30:00"),
    ("0 12 * * 1-5", "2026-03-06T12:00:00", "2026-03-09T12:00:00"),  # Fri noon -> Mon noon
    ("@hourly", "2026-03-01T10:15:00", "2026-03-01T11:00:00"),
    ("@daily", "2026-03-01T10:15:00", "2026-03-02T00:00:00"),
    ("@weekly", "2026-03-02T10:15:00", "2026-03-08T00:00:00"),
    ("@monthly", "2026-03-02T10:15:00", "2026-04-01T00:00:00"),
    ("@yearly", "2026-03-02T10:15:00", "2027-01-01T00:00:00"),
])
def test_known_fire_times(expr, after, expected):
    got = parse_schedule(expr).next_after(datetime.fromisoformat(after).replace(tzinfo=UTC))
    assert got == datetime.fromisoformat(expected).replace(tzinfo=UTC)


def test_every_is_anchored_at_the_epoch_so_replicas_agree():
    s = parse_schedule("@every 30s")
    t = datetime(2026, 3, 1, 12, 0, 7, 123456, tzinfo=UTC)
    assert s.next_after(t) == datetime(2026, 3, 1, 12, 0, 30, tzinfo=UTC)
    assert s.next_after(datetime(2026, 3, 1, 12, 0, 30, tzinfo=UTC)) == datetime(2026, 3, 1, 12, 1, tzinfo=UTC)
    assert s.latest_at_or_before(t) == datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    assert list(parse_schedule("@every 1m").slots_between(
        datetime(2026, 3, 1, 12, 0, tzinfo=UTC), datetime(2026, 3, 1, 12, 3, tzinfo=UTC))) == [
        datetime(2026, 3, 1, 12, m, tzinfo=UTC) for m in (1, 2, 3)]


def test_latest_at_or_before_for_sparse_schedules():
    s = parse_schedule("0 3 1 1 *")
    assert s.latest_at_or_before(datetime(2026, 6, 1, tzinfo=UTC)) == datetime(2026, 1, 1, 3, tzinfo=UTC)
    assert s.latest_at_or_before(datetime(2026, 1, 1, 3, tzinfo=UTC)) == datetime(2026, 1, 1, 3, tzinfo=UTC)


def test_latest_at_or_before_is_cheap_and_bounded_for_rare_schedules():
    """Called every second per entry: repeated calls hit the cached slot pair, and a leap-day
    schedule finds its slot years back without walking minute by minute."""
    leap = parse_schedule("0 0 29 2 *", "Europe/Berlin")
    t = datetime(2027, 7, 1, tzinfo=UTC)
    started = time.perf_counter()
    assert leap.latest_at_or_before(t) == datetime(2024, 2, 28, 23, tzinfo=UTC)
    assert leap.next_after(t) == datetime(2028, 2, 28, 23, tzinfo=UTC)
    assert time.perf_counter() - started < 0.5
    started = time.perf_counter()
    for i in range(20_000):
        assert leap.latest_at_or_before(t + timedelta(seconds=i)) == datetime(2024, 2, 28, 23, tzinfo=UTC)
    assert time.perf_counter() - started < 2.0  # about 3 us a call here


def test_latest_at_or_before_follows_a_clock_that_goes_back():
    """graphile-worker __tests__/cron-timing.test.ts "doesn't schedule tasks twice when system
    clock reverses": the cache must not answer for a time before the cached slot."""
    s = parse_schedule("0 */4 * * *")
    assert s.latest_at_or_before(datetime(2021, 1, 1, 4, 0, 1, tzinfo=UTC)) == datetime(2021, 1, 1, 4, tzinfo=UTC)
    assert s.latest_at_or_before(datetime(2021, 1, 1, 3, 0, 1, tzinfo=UTC)) == datetime(2021, 1, 1, 0, tzinfo=UTC)
    assert s.latest_at_or_before(datetime(2021, 1, 1, 8, tzinfo=UTC)) == datetime(2021, 1, 1, 8, tzinfo=UTC)


def test_every_slot_in_a_week_is_found_from_both_directions():
    """next_after, latest_at_or_before and slots_between agree slot by slot across both DST
    changes of a zone, for a fixed-time and a wildcard expression."""
    # Counted by hand: a fixed-time job runs twice a day, once on the day its 02:30 is skipped
    # (8 March) or its 01:30 repeats (1 November): 14; a wildcard one every 20 minutes of real
    # time, however the wall clock jumps: 7 x 24 x 3 = 504 (after the start, up to the end).
    for expr, count in (("30 1,2 * * *", 14), ("*/20 * * * *", 504)):
        s = parse_schedule(expr, "America/New_York")
        for start in (datetime(2026, 3, 5, tzinfo=UTC), datetime(2026, 10, 29, tzinfo=UTC)):
            slots = list(s.slots_between(start, start + timedelta(days=7)))
            assert len(slots) == count and slots == sorted(set(slots))
            assert s.next_after(slots[-1]) > start + timedelta(days=7)
            if expr.startswith("*/20"):
                assert {b - a for a, b in zip(slots, slots[1:])} == {timedelta(minutes=20)}
            for before, slot in zip([start] + slots, slots):
                assert s.next_after(before) == slot
                assert s.latest_at_or_before(slot) == slot
                assert s.latest_at_or_before(slot - timedelta(microseconds=1)) == (
                    before if before != start else s.latest_at_or_before(start))


def test_dst_fixed_time_jobs_run_once_wildcard_jobs_follow_the_clock():
    # Europe/Berlin: 2026-03-29 02:00 -> 03:00; 2026-10-25 03:00 -> 02:00.
    s = parse_schedule("30 2 * * *", "Europe/Berlin")
    spring = list(s.slots_between(datetime(2026, 3, 28, 12, tzinfo=UTC), datetime(2026, 3, 30, 12, tzinfo=UTC)))
    assert spring == [datetime(2026, 3, 29, 1, tzinfo=UTC),  # 03:00 CEST, the end of the gap
                      datetime(2026, 3, 30, 0, 30, tzinfo=UTC)]
    fall = list(s.slots_between(datetime(2026, 10, 24, 12, tzinfo=UTC), datetime(2026, 10, 26, 12, tzinfo=UTC)))
    assert fall == [datetime(2026, 10, 25, 0, 30, tzinfo=UTC),  # 02:30 CEST, first pass only
                    datetime(2026, 10, 26, 1, 30, tzinfo=UTC)]
    every = parse_schedule("30 * * * *", "Europe/Berlin")
    fall = list(every.slots_between(datetime(2026, 10, 24, 23, tzinfo=UTC), datetime(2026, 10, 25, 2, tzinfo=UTC)))
    assert [x.astimezone(ZoneInfo("Europe/Berlin")).strftime("%H:%M%z") for x in fall] == [
        "01:30+0200", "02:30+0200", "02:30+0100"]
    nine = parse_schedule("0 9 * * *", "America/New_York")
    slots = list(nine.slots_between(datetime(2026, 3, 7, tzinfo=UTC), datetime(2026, 3, 10, tzinfo=UTC)))
    assert [x.hour for x in slots] == [14, 13, 13]  # 09:00 local before and after the switch


def test_fixed_time_follows_cronie_star_flags():
    """cronie src/entry.c sets MIN_STAR/HR_STAR when the minute or hour field starts with '*'."""
    assert parse_cron_fields("30 2 * * *").fixed_time
    assert parse_cron_fields("0 0-23/2 * * *").fixed_time
    assert not parse_cron_fields("*/15 2 * * *").fixed_time
    assert not parse_cron_fields("0 */2 * * *").fixed_time
    assert not parse_cron_fields("0 * * * *").fixed_time


@pytest.mark.parametrize("bad", ["* * * *", "60 * * * *", "* 24 * * *", "* * 32 * *", "* * * 13 *",
                                 "* * * * 8", "@often", "@every", "@every 0s", "@every -5s", "",
                                 "a b c d e", "*/0 * * * *", "5-1 * * * *", "0 0 30 2 *",
                                 "0 0 31 4,6,9,11 *", "0 0 30,31 2 */2", "0 0 1 jan/error *",
                                 "0 0 * * sunday", "0 0 L * *", "0 0 * * 1#2", "0 0 ? * *",
                                 "@reboot", "* * * * * *", "1,,2 * * * *", "*-5 * * * *",
                                 "0 0 * * fri-mon", "0 0 1 nov-feb *", "٣ * * * *", "0 0 0 * *"])
def test_invalid_schedules(bad):
    with pytest.raises(ValueError):
        parse_schedule(bad)


@pytest.mark.parametrize("expr,message", [
    ("61 * * * *", "minute 61 out of range 0-59"),
    ("0 24 * * *", "hour 24 out of range 0-23"),
    ("0 0 * * 8", "day-of-week 8 out of range 0-7"),
    ("0 0 1 jan/error *", "month step 'error' must be a whole number of at least 1"),
    ("0 0 1 janu *", "month 'janu' is not a number or a name (jan, feb"),
    ("0 0 * * fri-mon", "day-of-week range 'fri-mon' runs backwards"),
    ("0 0 30 2 *", "never fires: day-of-month 30 does not occur in month 2"),
    ("0 0 31 4,6 *", "never fires: day-of-month 31 does not occur in month 4,6"),
    ("* * * *", "a cron expression has 5 fields"),
    ("@reboot", "unknown schedule shortcut '@reboot'"),
    # '@every' with no duration said "invalid duration 'missing'", as if the config held that word.
    ("@every", "'@every' needs a duration, e.g. '@every 30s'"),
    ("@every   ", "'@every' needs a duration, e.g. '@every 30s'"),
])
def test_error_messages_name_the_field(expr, message):
    with pytest.raises(ValueError) as err:
        parse_schedule(expr)
    assert message in str(err.value)


@pytest.mark.parametrize("expr,after,expected", [
    ("0 0 30 2 1", "2026-01-01T00:00:00", "2026-02-02T00:00:00"),  # OR rule: Mondays in February
    ("0 0 29 2 *", "2026-01-01T00:00:00", "2028-02-29T00:00:00"),  # leap day only
    ("0 0 * * mon-sun", "2026-01-01T00:00:00", "2026-01-02T00:00:00"),
    ("0 0 * * 7-7", "2026-01-01T00:00:00", "2026-01-04T00:00:00"),  # Sunday
    ("0 0 1 Jan-Aug/2 *", "2026-01-02T00:00:00", "2026-03-01T00:00:00"),
    ("5-6/2 * * * *", "2026-01-01T00:05:00", "2026-01-01T01:05:00"),
    ("0 0 1 jan/5 *", "2026-01-02T00:00:00", "2026-06-01T00:00:00"),  # croniter's a/n: jan-dec/5
    ("0 0 * * mon/2", "2026-01-05T00:00:00", "2026-01-07T00:00:00"),  # mon-sat/2: Mon Wed Fri
])
def test_cron_extensions_and_sunday_ranges(expr, after, expected):
    got = parse_schedule(expr).next_after(datetime.fromisoformat(after).replace(tzinfo=UTC))
    assert got == datetime.fromisoformat(expected).replace(tzinfo=UTC)


def test_invalid_timezone():
    with pytest.raises(ValueError, match="time zone"):
        parse_schedule("0 0 * * *", "Nowhere/City")
    with pytest.raises(ValueError, match="time zone"):
        parse_schedule("@every 10s", "Nowhere/City")


def test_naive_datetimes_are_refused():
    s = parse_schedule("0 0 * * *")
    for call in (s.next_after, s.latest_at_or_before):
        with pytest.raises(ValueError, match="aware"):
            call(datetime(2026, 1, 1))


def test_interval_slots_are_exact_multiples_since_the_epoch():
    s = parse_schedule("@every 1.5s")
    t = datetime(2026, 1, 1, 0, 0, 0, 700000, tzinfo=UTC)  # 1767225600.7 s after the epoch
    assert s.next_after(t) == datetime(2026, 1, 1, 0, 0, 1, 500000, tzinfo=UTC)
    assert s.latest_at_or_before(t) == datetime(2026, 1, 1, 0, 0, 0, tzinfo=UTC)
    assert parse_schedule("@every 5h").next_after(datetime(2026, 1, 1, tzinfo=UTC)) == \
        datetime(2026, 1, 1, 4, tzinfo=UTC)  # 1767225600 s = 98179 * 5 h + 1 h


def test_schedules_compare_by_text_and_zone():
    assert parse_schedule("0  0 * * *", "UTC") == parse_schedule("0 0 * * *")
    assert parse_schedule("0 0 * * *", "Europe/Berlin") != parse_schedule("0 0 * * *")
    assert len({parse_schedule("@daily"), parse_schedule("@daily")}) == 1


def test_trigger_fires_like_cron_trigger_and_has_a_stable_key():
    trigger = schedule_trigger(parse_schedule("0 3 * * *", "Europe/Berlin"))
    now = datetime(2026, 3, 1, 2, tzinfo=UTC)  # 03:00 CET exactly: the first fire may be now
    assert trigger.get_next_fire_time(None, now) == now
    assert trigger.get_next_fire_time(now, now) == datetime(2026, 3, 2, 2, tzinfo=UTC)
    # the clock went back behind the previous fire time: fire from now, like CronTrigger
    assert trigger.get_next_fire_time(datetime(2026, 3, 5, 2, tzinfo=UTC), now) == now
    again = schedule_trigger(parse_schedule("0  3 * * *", "Europe/Berlin"))
    assert again == trigger and again.key == trigger.key and repr(again) == repr(trigger)
    assert schedule_trigger(parse_schedule("0 3 * * *")) != trigger
    copy = pickle.loads(pickle.dumps(trigger))
    assert copy == trigger and copy.get_next_fire_time(None, now) == now


def test_trigger_fires_at_the_server_s_slots_when_the_host_clock_is_off():
    """skew = server - host. Host 5 min slow (skew +5 min): the server's 03:00 is the host's 02:55;
    host 2 min fast (skew -2 min): the host's 03:02. A skew that jitters by milliseconds between
    calls (each reading of the server's time differs a little) never fires one slot twice."""
    slow = schedule_trigger(parse_schedule("0 3 * * *"), skew=lambda: timedelta(minutes=5))
    host_now = datetime(2026, 3, 1, 2, 50, tzinfo=UTC)
    first = slow.get_next_fire_time(None, host_now)
    assert first == datetime(2026, 3, 1, 2, 55, tzinfo=UTC)
    assert slow.get_next_fire_time(first, first) == datetime(2026, 3, 2, 2, 55, tzinfo=UTC)
    fast = schedule_trigger(parse_schedule("0 3 * * *"), skew=lambda: timedelta(minutes=-2))
    assert fast.get_next_fire_time(None, host_now) == datetime(2026, 3, 1, 3, 2, tzinfo=UTC)
    for jitter_ms in (-3, 3):
        skews = iter([timedelta(minutes=5), timedelta(minutes=5, milliseconds=jitter_ms)])
        jittery = schedule_trigger(parse_schedule("@every 1s"), skew=lambda: next(skews))
        fired = jittery.get_next_fire_time(None, host_now)
        later = jittery.get_next_fire_time(fired, fired + timedelta(milliseconds=1))
        assert timedelta(milliseconds=996) <= later - fired <= timedelta(milliseconds=1004), (jitter_ms, later - fired)
    assert pickle.loads(pickle.dumps(slow)).skew is None  # the daemon sets it again (the runner)


def test_trigger_drives_a_real_apscheduler():
    fired: list[float] = []
    done = threading.Event()

    def tick():
        fired.append(time.time())
        if len(fired) >= 2:
            done.set()

    scheduler = BackgroundScheduler(timezone=UTC)
    job = scheduler.add_job(tick, trigger=schedule_trigger(parse_schedule("@every 1s")))
    scheduler.start()
    try:
        assert done.wait(10), f"fired {len(fired)} times in 10 s"
        next_run = scheduler.get_job(job.id).next_run_time
    finally:
        scheduler.shutdown(wait=False)
    assert next_run.microsecond == 0  # the schedule's slots, not "now + 1 s"


def test_upcoming_lists_local_fire_times():
    got = upcoming("30 2 * * *", "Europe/Berlin", datetime(2026, 3, 28, 12), 3)
    assert [x.isoformat() for x in got] == [
        "2026-03-29T03:00:00+02:00", "2026-03-30T02:30:00+02:00", "2026-03-31T02:30:00+02:00"]
    assert upcoming("@every 1h", "UTC", datetime(2026, 1, 1, 0, 30, tzinfo=UTC), 1) == [
        datetime(2026, 1, 1, 1, tzinfo=UTC)]
    soon = upcoming("* * * * *", n=2)
    assert datetime.now(UTC) < soon[0] <= datetime.now(UTC) + timedelta(minutes=1)
    with pytest.raises(ValueError):
        upcoming("* * * * *", n=0)
    with pytest.raises(ValueError, match="never fires"):
        upcoming("0 0 31 2 *")


def test_upcoming_after_a_wall_time_the_clocks_skip_shows_the_slot_at_the_jump():
    """`maintd schedule '30 2 * * *' --tz Europe/Berlin --after 2026-03-29T02:00` is how an
    operator asks what the job does on the day clocks go from 02:00 to 03:00. Python reads a wall
    time that does not exist with the offset before the jump (02:00 = 03:00 CEST), so the 03:00
    run that stands for the skipped 02:30 (cronie man/cron.8) was left out as 'not after 03:00'."""
    got = upcoming("30 2 * * *", "Europe/Berlin", datetime(2026, 3, 29, 2, 0), 2)
    assert [x.isoformat() for x in got] == [
        "2026-03-29T03:00:00+02:00", "2026-03-30T02:30:00+02:00"], got
    got = upcoming("*/20 * * * *", "Europe/Berlin", datetime(2026, 3, 29, 2, 15), 2)
    assert [x.isoformat() for x in got] == [
        "2026-03-29T03:00:00+02:00", "2026-03-29T03:20:00+02:00"], got
    # Times that exist are unchanged; a repeated one is its first pass.
    got = upcoming("*/20 * * * *", "Europe/Berlin", datetime(2026, 10, 25, 2, 15), 4)
    assert [x.isoformat() for x in got] == [
        "2026-10-25T02:20:00+02:00", "2026-10-25T02:40:00+02:00",
        "2026-10-25T02:00:00+01:00", "2026-10-25T02:20:00+01:00"], got
    assert upcoming("0 0 * * *", "Asia/Tokyo", datetime(1, 1, 1), 1)[0].day == 2  # no OverflowError


@pytest.mark.parametrize("name", ["America", "Europe/" + "x" * 300, "Mars/Olympus", "../etc/passwd", ""])
def test_an_unknown_zone_is_a_value_error_whatever_zoneinfo_raises(name):
    """zoneinfo raises IsADirectoryError for a directory of the zone database ('America') and
    OSError for a name too long for a file: neither was a ValueError, so a config file said
    'error' (exit 1) instead of naming the key (exit 2), and a periodic_jobs row stopped the
    enqueuer."""
    from maintd.schedules import load_timezone

    with pytest.raises(ValueError, match="unknown time zone"):
        load_timezone(name)


@pytest.mark.parametrize("argv,shown,err", [
    # Python's datetime ends with year 9999: the fire times before it, then a note (exit 0)
    (["0 0 * * *", "--after", "9999-12-29T12:00:00", "-n", "5"], 2, "no later fire time before the year 10000"),
    # none at all: nothing to show for this --after (exit 2)
    (["@every 1h", "--after", "9999-12-31T23:30:00"], 0, "--after 9999-12-31T23:30:00: no fire time after it"),
    (["@daily", "--after", "yesterday"], 0, "--after 'yesterday': use an ISO 8601 time"),
])
def test_maintd_schedule_at_the_end_of_time_or_with_a_bad_after(argv, shown, err, capsys):
    """`maintd schedule '@every 1h' --after 9999-12-31T23:30:00` exited 1 with "maintd: error:
    date value out of range" (and a daily schedule near the end printed nothing at all); a bad
    --after was reported in Python's words without naming the option."""
    from maintd.cli import main

    assert main(["schedule", *argv]) == (0 if shown else 2)
    out, text = capsys.readouterr()
    assert len(out.splitlines()) == shown and err in text and "Traceback" not in text, (out, text)


@pytest.mark.parametrize("expr, zone", [
    ("* * * * *", "UTC"), ("*/7 3-5 * * *", "Europe/Berlin"), ("30 2 * * *", "America/New_York"),
    ("0,30 * 29 2 *", "Australia/Lord_Howe"), ("15 1 1-7 * 1", "America/Santiago"), ("*/20 * * * 0", "Asia/Kolkata"),
])
def test_counting_a_long_outage_s_slots_is_exact_and_does_not_walk_them(expr, zone):
    """The slots missed over a long outage are counted (SPEC: the ones outside ``backfill`` are
    reported skipped). Walking them cost one step per slot: a year of '* * * * *' took 15 s in the
    first pass after the outage. Days whose offset does not change are counted from the fields;
    the count must equal the walk's, across every DST change (Lord Howe's 30-minute one,
    Santiago's at midnight, New York's skipped and repeated 02:30)."""
    schedule = parse_schedule(expr, zone)
    rng = random.Random(expr)
    for _ in range(6):
        start = datetime(2024, 1, 1, tzinfo=timezone.utc) + timedelta(minutes=rng.randrange(0, 60 * 24 * 300))
        end = start + timedelta(minutes=rng.randrange(1, 60 * 24 * 90))
        assert schedule.count_between(start, end) == sum(1 for _ in schedule.slots_between(start, end)), (start, end)
    if expr != "* * * * *":  # a whole year, every change of its zone (walked: 10,000 slots at most)
        a, b = datetime(2023, 12, 31, 23, 30, tzinfo=timezone.utc), datetime(2025, 1, 1, 0, 30, tzinfo=timezone.utc)
        assert schedule.count_between(a, b) == sum(1 for _ in schedule.slots_between(a, b))
    t0 = time.process_time()
    year = schedule.count_between(datetime(2023, 6, 1, 0, 0, 30, tzinfo=timezone.utc),
                                  datetime(2024, 6, 1, tzinfo=timezone.utc))
    assert time.process_time() - t0 < 2.0, "a year counted slot by slot"
    if expr == "* * * * *":
        assert year == 366 * 24 * 60  # 00:01 on 2023-06-01 to 00:00 on 2024-06-01, Feb 29 included


@pytest.mark.parametrize("expr, field, sign", [
    ("0 0 L * *", "day-of-month 'L'", "'L'"),
    ("0 0 15W * *", "day-of-month '15W'", "'W'"),
    ("0 0 LW * *", "day-of-month 'LW'", "'L'"),
    ("0 0 * * 5L", "day-of-week '5L'", "'L'"),
    ("0 0 * * fri#3", "day-of-week 'fri#3'", "'#'"),
    ("0 0 * * 1#2", "day-of-week '1#2'", "'#'"),
    ("0 0 ? * mon", "day-of-month '?'", "'?'"),
])
def test_quartz_extensions_are_named_as_not_supported(expr, field, sign):
    """croniter, Quartz and AWS write 'L', 'W', '#' and '?'; cronie has none of them. The error
    said "day-of-month 'L' is not a number", as for a typing mistake, leaving an operator who
    ported such a schedule to guess that the extension is what maintd lacks."""
    with pytest.raises(ValueError) as err:
        parse_schedule(expr)
    message = str(err.value)
    assert message.startswith(field), message
    assert sign in message and "not supported" in message, message
