"""Schedules: fire times against an independent cron library (croniter), intervals, shortcuts, DST."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pytest
from croniter import croniter

from maintd.schedules import parse_schedule

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
    rng = random.Random(20261122)
    checked = 0
    for _ in range(300):
        expr = random_cron(rng)
        start = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=rng.randint(0, 400 * 24 * 60),
                                                              seconds=rng.randint(0, 59))
        ours = parse_schedule(expr)
        theirs = croniter(expr, start)
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


def test_dst_spring_forward_and_fall_back_fire_once():
    # Europe/Berlin: 2026-03-29 02:00 -> 03:00; 2026-10-25 03:00 -> 02:00.
    s = parse_schedule("30 2 * * *", "Europe/Berlin")
    spring = list(s.slots_between(datetime(2026, 3, 28, 12, tzinfo=UTC), datetime(2026, 3, 30, 12, tzinfo=UTC)))
    fall = list(s.slots_between(datetime(2026, 10, 24, 12, tzinfo=UTC), datetime(2026, 10, 26, 12, tzinfo=UTC)))
    assert len(fall) == 2 and len(set(fall)) == 2  # one per day, the repeated hour fires once
    assert fall[0] == datetime(2026, 10, 25, 0, 30, tzinfo=UTC)  # 02:30 CEST, first occurrence only
    # The nonexistent 02:30 on the spring-forward day does not double anything.
    assert len(spring) <= 2 and len(set(spring)) == len(spring)
    nine = parse_schedule("0 9 * * *", "America/New_York")
    slots = list(nine.slots_between(datetime(2026, 3, 7, tzinfo=UTC), datetime(2026, 3, 10, tzinfo=UTC)))
    assert [x.hour for x in slots] == [14, 13, 13]  # 09:00 local before and after the switch


@pytest.mark.parametrize("bad", ["* * * *", "60 * * * *", "* 24 * * *", "* * 32 * *", "* * * 13 *",
                                 "* * * * 8", "@often", "@every", "@every 0s", "@every -5s", "",
                                 "a b c d e", "*/0 * * * *", "5-1 * * * *"])
def test_invalid_schedules(bad):
    with pytest.raises(ValueError):
        parse_schedule(bad)


def test_invalid_timezone():
    with pytest.raises(ValueError, match="time zone"):
        parse_schedule("0 0 * * *", "Nowhere/City")
