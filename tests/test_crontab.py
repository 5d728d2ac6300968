"""Crontab files in graphile-worker's format (SPEC 7.8).

Most cases are ported from graphile-worker: ``__tests__/crontab.test.ts`` ("parses crontab file
correctly" and "gives error on syntax error"), the option patterns of ``src/cronConstants.ts``,
and the ``_cron`` payload of ``src/cron.ts`` / ``__tests__/cron-timing.test.ts``
(github.com/graphile/worker).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from maintd.crontab import CrontabEntry, cron_args, load_crontab, parse_crontab
from maintd.schedules import parse_schedule

UTC = timezone.utc

# graphile-worker __tests__/crontab.test.ts, "parses crontab file correctly" (verbatim lines).
GRAPHILE_EXAMPLE = """\
# ┌───────────── UTC minute (0 - 59)
# │ ┌───────────── UTC hour (0 - 23)
# │ │ ┌───────────── UTC day of the month (1 - 31)
# │ │ │ ┌───────────── UTC month (1 - 12)
# │ │ │ │ ┌───────────── UTC day of the week (0 - 6) (Sunday to Saturday)
# │ │ │ │ │ ┌───────────── task (identifier) to schedule
# │ │ │ │ │ │    ┌────────── optional scheduling options
# │ │ │ │ │ │    │     ┌────── optional payload to merge
# │ │ │ │ │ │    │     │
# │ │ │ │ │ │    │     │
# * * * * * task ?opts {payload}

* * * * * simple
0 4 * * * every_day_at_4_am
0 4 * * 0 every_sunday_at_4_am
0 4 * * 7 every_sunday_at_4_am ?id=sunday_7




0 4 * * 2 every_tuesday_at_4_am {isTuesday: true}
*/10,7,56-59 1 1 1 1 one ?id=stuff&fill=4w3d2h1m&max=3&queue=my_queue&priority=3 {myExtraPayload:{stuff:"here with # hash char"}}
    *     *      *       *       *      lots_of_spaces     
* * * * * with_key ?jobKey=my_key
* * * * * with_key_and_mode ?jobKey=my_key&jobKeyMode=preserve_run_at
* * * * * nested/task ?jobKey=my_key&jobKeyMode=preserve_run_at
* * * * * nested/folder/task ?jobKey=my_key&jobKeyMode=preserve_run_at
"""


def by_id(entries: list[CrontabEntry]) -> dict[str, CrontabEntry]:
    return {e.id: e for e in entries}


def test_graphile_example_file_parses_like_graphile():
    entries = parse_crontab(GRAPHILE_EXAMPLE)
    assert [e.id for e in entries] == [
        "simple", "every_day_at_4_am", "every_sunday_at_4_am", "sunday_7", "every_tuesday_at_4_am",
        "stuff", "lots_of_spaces", "with_key", "with_key_and_mode", "nested/task", "nested/folder/task"]
    e = by_id(entries)
    assert e["simple"] == CrontabEntry(id="simple", schedule="* * * * *", kind="simple", line=13)
    assert (e["simple"].queue, e["simple"].priority, e["simple"].max_attempts) == ("default", 0, 25)
    assert e["simple"].backfill is None and e["simple"].payload == {} and e["simple"].timezone == "UTC"
    assert e["sunday_7"].kind == "every_sunday_at_4_am" and e["sunday_7"].schedule == "0 4 * * 7"
    assert e["every_tuesday_at_4_am"].payload == {"isTuesday": True}
    assert e["every_tuesday_at_4_am"].line == 21  # blank lines still count
    stuff = e["stuff"]
    assert (stuff.kind, stuff.schedule) == ("one", "*/10,7,56-59 1 1 1 1")
    assert stuff.backfill == timedelta(weeks=4, days=3, hours=2, minutes=1)
    assert (stuff.max_attempts, stuff.queue, stuff.priority) == (3, "my_queue", 3)
    assert stuff.payload == {"myExtraPayload": {"stuff": "here with # hash char"}}
    assert e["lots_of_spaces"].schedule == "* * * * *"
    assert (e["with_key"].job_key, e["with_key"].job_key_mode) == ("my_key", "replace")
    assert e["with_key_and_mode"].job_key_mode == "preserve_run_at"
    assert e["nested/folder/task"].kind == "nested/folder/task"


def test_graphile_example_schedules_fire_like_graphile():
    """The minutes graphile expects for line "*/10,7,56-59 1 1 1 1" and Sunday as 0 or 7."""
    e = by_id(parse_crontab(GRAPHILE_EXAMPLE))
    stuff = parse_schedule(e["stuff"].schedule, e["stuff"].timezone)
    # Jan 1st (day-of-month) or any Monday in January, at 01:xx UTC (cron's OR rule).
    slots = list(stuff.slots_between(datetime(2025, 12, 31, tzinfo=UTC), datetime(2026, 1, 1, 2, tzinfo=UTC)))
    assert [s.minute for s in slots] == [0, 7, 10, 20, 30, 40, 50, 56, 57, 58, 59]
    for sunday in ("every_sunday_at_4_am", "sunday_7"):
        s = parse_schedule(e[sunday].schedule)
        assert s.next_after(datetime(2026, 3, 2, tzinfo=UTC)) == datetime(2026, 3, 8, 4, tzinfo=UTC)


@pytest.mark.parametrize("text,message", [
    # graphile-worker __tests__/crontab.test.ts, "gives error on syntax error"
    ("* * * * too_few_parameters\n", "crontab:1: expected 'MIN HOUR DOM MON DOW TASK"),
    ("* * * * * two tasks\n", "crontab:1: invalid command 'two tasks'"),
    ("1,60 * * * * out_of_range\n", "crontab:1: minute 60 out of range 0-59"),
    ("*/0 * * * * division_by_zero\n", "crontab:1: minute step '0' must be a whole number of at least 1"),
    ("* * * * * invalid_options ?unknown=3\n", "crontab:1: unknown option 'unknown' (supported: id, fill"),
    ("* * * * * json_syntax_error {invalidJson=true}\n", "crontab:1: invalid JSON5 payload"),
    # the example: the line number counts comments and blank lines
    ("# hourly\n\n61 * * * * cleanup\n", "crontab:3: minute 61 out of range"),
    # graphile parseCrontab: duplicate identifiers
    ("* * * * * a\n0 * * * * a\n", "crontab:2: duplicate id 'a' (also on line 1)"),
    ("* * * * * a ?id=x\n* * * * * x\n", "crontab:2: duplicate id 'x'"),
    # option patterns of graphile-worker src/cronConstants.ts
    ("* * * * * t ?id=1abc\n", "option id='1abc' is invalid"),
    ("* * * * * t ?id=a/b\n", "option id='a/b' is invalid"),
    ("* * * * * t ?fill=1y\n", "option fill='1y' is invalid"),
    ("* * * * * t ?fill=1.5h\n", "option fill='1.5h' is invalid"),
    ("* * * * * t ?max=-1\n", "option max='-1' is invalid"),
    ("* * * * * t ?max=0\n", "option max=0 out of range 1-32767"),
    ("* * * * * t ?queue=a%20b\n", "option queue='a b' is invalid"),
    ("* * * * * t ?priority=high\n", "option priority='high' is invalid"),
    ("* * * * * t ?priority=40000\n", "option priority=40000 out of range -32768-32767"),
    ("* * * * * t ?jobKeyMode=merge\n", "option jobKeyMode='merge' is invalid"),
    ("* * * * * t ?jobKey=\n", "option jobKey='' is invalid"),
    # graphile's querystring gives an array for a repeated key: "did you specify it more than once?"
    ("* * * * * t ?id=a&id=b\n", "option 'id' given more than once"),
    ("* * * * * 9task\n", "invalid command '9task'"),
    ("* * * * * t [1, 2]\n", "invalid command"),
    ("* * * * * t {a: Infinity}\n", "Infinity cannot be stored"),
    ("* * * * * t {a: 1e999}\n", "too large"),
    ("0 0 30 2 * t\n", "crontab:1: never fires"),
    ("0 0 1 jan/error * t\n", "crontab:1: month step 'error'"),
    ("@daily t\n", "crontab:1: expected 'MIN HOUR DOM MON DOW TASK"),
    # issue 28: a payload that does not parse is a payload error, not "invalid command"
    ('* * * * * t {"a": 1\n', "crontab:1: invalid JSON5 payload"),
    ('* * * * * t ?id=x {"a": [1, }\n', "crontab:1: invalid JSON5 payload"),
    # issue 28: an empty token is named with the field as written, not as minute ''
    ("-90 * * * * t\n", "crontab:1: minute field '-90': nothing before '-'"),
    ("0-10/ * * * * t\n", "crontab:1: minute field '0-10/': nothing after '/'"),
    ("* 5- * * * t\n", "crontab:1: hour field '5-': nothing after '-'"),
    # graphile's task pattern has no dots: said so (the README says so too)
    ("* * * * * email.send\n", "task 'email.send' has a '.': crontab task names follow graphile-worker's rule"),
])
def test_errors_name_the_file_and_line(text, message):
    with pytest.raises(ValueError) as err:
        parse_crontab(text)
    assert message in str(err.value)


def test_every_bad_line_is_reported_not_just_the_first():
    text = ("# nightly jobs\n0 4 * * * ok\n61 * * * * a\n* * * * * b ?nope=1\n0 5 * * * fine\n"
            "* * * * * c {x: \n0 4 * * * ok\n")
    with pytest.raises(ValueError) as err:
        parse_crontab(text, "jobs.crontab")
    assert str(err.value).splitlines() == [
        "jobs.crontab:3: minute 61 out of range 0-59",
        "jobs.crontab:4: unknown option 'nope' (supported: id, fill, max, queue, priority, jobKey, jobKeyMode)",
        "jobs.crontab:6: invalid JSON5 payload: Unexpected end of input at column 16",
        "jobs.crontab:7: duplicate id 'ok' (also on line 2); give one of them ?id=...",
    ]


def test_task_identifiers_follow_graphile():
    """CRONTAB_COMMAND of graphile-worker src/cronConstants.ts: [_a-zA-Z][_a-zA-Z0-9:/_-]*."""
    text = "\n".join(f"* * * * * {task}" for task in
                     ["_private_id", "nested/task", "a:b", "kebab-case", "x"])
    assert [e.kind for e in parse_crontab(text)] == [
        "_private_id", "nested/task", "a:b", "kebab-case", "x"]
    assert [e.id for e in parse_crontab(text)] == [e.kind for e in parse_crontab(text)]
    assert parse_crontab("* * * * * t ?id=_private-id_2")[0].id == "_private-id_2"


def test_options_and_defaults():
    [e] = parse_crontab("0 */4 * * * do_it ?fill=1d&max=5&queue=q:1&priority=-3&jobKey=k%2F1")
    assert e.backfill == timedelta(days=1)
    assert (e.max_attempts, e.queue, e.priority) == (5, "q:1", -3)
    assert (e.job_key, e.job_key_mode) == ("k/1", "replace")  # jobKeyMode defaults to replace
    [e] = parse_crontab("* * * * * t ?fill=0s")
    assert e.backfill is None  # graphile's default backfillPeriod 0: no backfill
    [e] = parse_crontab("* * * * * t ?fill=1d1d")  # graphile sums repeated units
    assert e.backfill == timedelta(days=2)


def test_payload_is_json5_object():
    [e] = parse_crontab("* * * * * t {a: 0x10, 'b': .5, c: [1, 2,], /* comment */ d: null,}")
    assert e.payload == {"a": 16, "b": 0.5, "c": [1, 2], "d": None}


def test_names_and_cron_extensions_are_accepted():
    """maintd's cron parser is a superset of graphile's numeric syntax."""
    [e] = parse_crontab("30 9 * jan-mar mon-fri report")
    s = parse_schedule(e.schedule)
    assert s.next_after(datetime(2026, 3, 6, 10, tzinfo=UTC)) == datetime(2026, 3, 9, 9, 30, tzinfo=UTC)


def test_crlf_and_comment_lines():
    text = "# comment\r\n  # indented comment\r\n\r\n0 0 * * * a\r\n"
    [e] = parse_crontab(text, source="etc/maintd.crontab")
    assert (e.id, e.line, e.source) == ("a", 4, "etc/maintd.crontab")
    with pytest.raises(ValueError, match=r"^etc/maintd.crontab:2: "):
        parse_crontab("0 0 * * * a\r\n0 0 * * *\r\n", source="etc/maintd.crontab")


def test_load_crontab_names_the_path(tmp_path):
    path = tmp_path / "jobs.crontab"
    path.write_text("0 4 * * * nightly ?id=n {x: 1}\n")
    [e] = load_crontab(path)
    assert (e.id, e.kind, e.payload, e.source) == ("n", "nightly", {"x": 1}, str(path))
    path.write_text("0 4 * * * nightly\n0 4 * * 8 weekly\n")
    with pytest.raises(ValueError, match=rf"^{path}:2: day-of-week 8 out of range 0-7$"):
        load_crontab(path)
    with pytest.raises(ValueError, match="cannot read crontab"):
        load_crontab(tmp_path / "missing.crontab")


def test_cron_args_merge_payload_with_slot_like_graphile():
    """graphile-worker src/cron.ts makeJobForItem: {...payload, _cron: {ts, backfilled}}; the ts
    format is the one __tests__/cron-timing.test.ts expects ("2021-01-01T04:00:00.000Z")."""
    slot = datetime(2021, 1, 1, 4, tzinfo=UTC)
    assert cron_args({"a": 1, "_cron": "theirs"}, slot, False) == {
        "a": 1, "_cron": {"ts": "2021-01-01T04:00:00.000Z", "backfilled": False}}
    plus_one = timezone(timedelta(hours=1))
    args = cron_args({}, datetime(2021, 1, 1, 5, 0, 0, 123456, tzinfo=plus_one), True)
    assert args == {"_cron": {"ts": "2021-01-01T04:00:00.123Z", "backfilled": True}}


def test_entries_are_frozen_and_hashable():
    [e] = parse_crontab("* * * * * t {a: 1}")
    with pytest.raises(AttributeError):
        e.id = "other"  # type: ignore[misc]
    [again] = parse_crontab("* * * * * t {a: 1}")  # another object, equal and hashed alike
    assert again is not e and again == e and hash(again) == hash(e) and len({e, again}) == 1


def test_a_crontab_saved_with_a_byte_order_mark_is_read(tmp_path):
    """Editors on Windows save UTF-8 with a byte-order mark: line 1 was refused with "minute
    '\\ufeff0' is not a number". The mark is not part of the text (Unicode 15, section 23.8:
    U+FEFF at the start of a UTF-8 stream is a signature), so it is dropped, as Python's
    'utf-8-sig' codec does."""
    path = tmp_path / "jobs.crontab"
    path.write_bytes(b"\xef\xbb\xbf0 4 * * * nightly\n")
    [e] = load_crontab(path)
    assert (e.schedule, e.kind, e.line) == ("0 4 * * *", "nightly", 1)


@pytest.mark.parametrize("line, column, found", [
    ("0 4 * * * task ?id=x {a: 1,, }", 29, '" "'),
    ("  0 4 * * * task {a: [1, 2}", 28, "end of input"),
    ("0 4 * * * task {}}", 18, '"}"'),
])
def test_a_payload_error_names_its_column_in_the_line(line, column, found):
    """The JSON5 parser's column counts from the payload's '{', and its message began
    '<string>:1': "crontab:1: invalid JSON5 payload: <string>:1 Unexpected " " at column 8" for
    a fault in the line's 29th column. The column is now the line's, as an editor shows it."""
    with pytest.raises(ValueError) as err:
        parse_crontab("# header\n" + line + "\n")
    message = str(err.value)
    assert message.startswith("crontab:2: invalid JSON5 payload: "), message
    assert "<string>" not in message
    assert message.endswith(f"at column {column}"), message
    assert found in message


@pytest.mark.parametrize("line, cronie_days, graphile_days", [
    # graphile-worker src/cronMatcher.ts treats a day field as restricted by how many values it
    # holds; cronie (src/entry.c: DOM_STAR/DOW_STAR) by whether it starts with '*'. SPEC 7.8 says
    # cronie everywhere, crontab files included: the README says so, and these pin it.
    ("0 0 */2 * 1 task", "odd days that are Mondays", "odd days, or Mondays"),
    ("0 0 1 * 0-6 task", "every day (the 1st, or any weekday)", "the 1st only"),
    ("0 0 1-31 * 1 task", "every day (any day of the month, or a Monday)", "Mondays only"),
])
def test_the_day_fields_follow_cronie_not_graphile_workers_matcher(line, cronie_days, graphile_days):
    [entry] = parse_crontab(line)
    schedule = parse_schedule(entry.schedule, entry.timezone)
    days = [s.day for s in schedule.slots_between(datetime(2026, 5, 31, tzinfo=UTC), datetime(2026, 6, 30, 1, tzinfo=UTC))]
    mondays = [1, 8, 15, 22, 29]  # June 2026
    expected = {"odd days that are Mondays": [1, 15, 29],
                "every day (the 1st, or any weekday)": list(range(1, 31)),
                "every day (any day of the month, or a Monday)": list(range(1, 31))}[cronie_days]
    assert days == expected, (line, graphile_days, mondays)


def test_a_byte_that_is_not_utf8_is_named_with_its_line_and_column(tmp_path):
    """Errors name the file and line (README): a Latin-1 'é' in line 2's payload was reported as
    "cannot read crontab: 'utf-8' codec can't decode byte 0xe9 in position 32", a count of bytes
    from the start of the file."""
    path = tmp_path / "jobs.crontab"
    path.write_bytes(b'0 4 * * * a\n0 5 * * * b {x: "caf\xe9"}\n')
    with pytest.raises(ValueError) as err:
        load_crontab(path)
    assert str(err.value) == f"{path}:2: not UTF-8 (byte 0xe9 at column 21)", str(err.value)
