"""Log lines an operator reads: the target each line is about (several targets per daemon), and
APScheduler's own lines in the daemon's format (a raw line breaks a JSON log pipeline)."""

from __future__ import annotations

import io
import json
import logging
import threading

import pytest

from maintd.logs import about_target, kv, setup_logging


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_lines_logged_about_a_target_name_it_first(restore_loggers):
    out = io.StringIO()
    setup_logging("info", "text", stream=out)
    log = logging.getLogger("maintd.rescuer")
    with about_target("tenant_007"):
        log.info("released stale running jobs", extra=kv(count=3))
        with about_target(None):  # a single-target daemon: no field
            log.info("became leader", extra=kv(epoch=2))
    log.info("http listening")
    first, single, plain = lines(out)
    assert first.endswith(" info    released stale running jobs target=tenant_007 count=3"), first
    assert single.endswith(" info    became leader epoch=2"), single
    assert plain.endswith(" info    http listening"), plain


def test_the_target_belongs_to_the_thread_that_set_it(restore_loggers):
    """Each target's election thread and each pass set their own; a pool thread reused by another
    target's pass must not carry the previous one."""
    out = io.StringIO()
    setup_logging("info", "json", stream=out)
    log = logging.getLogger("maintd.leader")
    barrier = threading.Barrier(2)

    def elector(name: str) -> None:
        with about_target(name):
            barrier.wait()
            log.info("became leader", extra=kv(epoch=1))
            barrier.wait()

    threads = [threading.Thread(target=elector, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.info("after")
    records = [json.loads(line) for line in lines(out)]
    assert sorted(r["target"] for r in records[:2]) == ["a", "b"]
    assert records[2]["msg"] == "after" and "target" not in records[2]


def test_an_explicit_target_field_is_kept(restore_loggers):
    out = io.StringIO()
    setup_logging("info", "text", stream=out)
    with about_target("a"):
        logging.getLogger("maintd.daemon").warning("target not started", extra=kv(target="b"))
    assert lines(out)[0].endswith("target not started target=b")


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_apscheduler_lines_are_in_the_daemon_s_format(restore_loggers, fmt):
    out = io.StringIO()
    setup_logging("info", fmt, stream=out)
    sched = logging.getLogger("apscheduler.executors.default")
    with about_target("tenant_001"):
        sched.warning('Run time of job "tenant_001:cleaner" was missed by 0:00:02')
    (line,) = lines(out)
    if fmt == "json":
        record = json.loads(line)  # a raw line would not parse
        assert record["level"] == "warning" and record["logger"] == "apscheduler.executors.default"
        assert record["target"] == "tenant_001" and "was missed" in record["msg"]
    else:
        assert line[:4].isdigit() and " warning " in line and line.endswith("target=tenant_001")


@pytest.mark.parametrize("level,shown", [("info", False), ("warning", False), ("debug", True)])
def test_a_pass_outlasting_its_interval_is_not_a_warning(restore_loggers, level, shown):
    """APScheduler says "skipped: maximum number of running instances reached" each time a pass
    is still running when the next one falls due (a 1 s periodic tick behind a slow pass): by
    design one pass at a time, the next coalesced, so it is chatter, kept only when debugging."""
    out = io.StringIO()
    setup_logging(level, "text", stream=out)
    logging.getLogger("apscheduler.scheduler").warning(
        'Execution of job "tenant_022:periodic (trigger: interval[0:00:01], next run at: '
        '2026-11-24 21:46:34 UTC)" skipped: maximum number of running instances reached (1)')
    logging.getLogger("apscheduler.scheduler").error("Error adding job")
    got = lines(out)
    assert any("maximum number of running instances" in line for line in got) is shown
    assert any(line.endswith("error   Error adding job") for line in got)


# -- hostile values (issue 26, scenario 6) -------------------------------------------------------

FORGED = "x\n2026-01-01T00:00:00.000Z info    became leader epoch=999 instance=attacker"
ANSI = "y\x1b[2J\x1b[31mRED\x1b[0m\x9b1m"  # clear screen, colours, a C1 CSI


@pytest.mark.parametrize("value,written", [
    (FORGED, r'"x\n2026-01-01T00:00:00.000Z info    became leader epoch=999 instance=attacker"'),
    (ANSI, r'"y\x1b[2J\x1b[31mRED\x1b[0m\x9b1m"'),
    ("a\rb\tc\x00d\x7f", r'"a\rb\tc\x00d\x7f"'),
    ("right\u202eto-left\u2028line", r'"right\u202eto-left\u2028line"'),  # bidi override, separator
    ('say "hi" \\ bye', r'"say \"hi\" \\ bye"'),
    ("k=v", '"k=v"'), ("", '""'), ("plain", "plain"), ("héllo", "héllo"),
])
def test_text_values_are_escaped(restore_loggers, value, written):
    """Every control character (C0, DEL, C1), bidi override and line separator is written as an
    escape, inside quotes; a value with a space, '=', a quote or a backslash is quoted too, so it
    stays one field."""
    out = io.StringIO()
    setup_logging("info", "text", stream=out)
    logging.getLogger("maintd.scheduler").info("scheduler pass", extra=kv(queue=value, n=1))
    (line,) = out.getvalue().split("\n")[:-1]  # one line, whatever the value holds
    assert line.endswith(f" info    scheduler pass queue={written} n=1"), line
    assert line.isprintable()


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_messages_cannot_forge_lines_and_long_values_are_cut_with_a_count(restore_loggers, fmt):
    out = io.StringIO()
    setup_logging("info", fmt, stream=out)
    log = logging.getLogger("maintd.daemon")
    log.warning("could not read " + FORGED + ANSI)  # data that slipped into a message
    log.info("promoted", extra=kv(queues=[f"q{i}" for i in range(100_000)], error="e" * 100_000))
    first, second = out.getvalue().split("\n")[:-1]
    assert "\x1b" not in out.getvalue() and "\x9b" not in out.getvalue()
    if fmt == "json":
        first, second = json.loads(first)["msg"], json.dumps(json.loads(second))
    assert r"\n2026-01-01" in first and r"\x1b[2J" in first or fmt == "json"
    assert len(second) < 2_500, len(second)
    assert "q19,... (+99980 more)" in second and "(+99000 characters)" in second


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_passwords_are_masked_and_the_line_stays_whole(restore_loggers, fmt):
    """Masking the finished line ate what followed a password: a JSON line lost its closing
    quote (no longer JSON), a text field its closing quote. Each value is masked before it is
    quoted or encoded."""
    stream = io.StringIO()
    log = setup_logging("info", fmt, stream)
    url = "postgresql://maintd@db/app?sslmode=require&password=TOPSECRET"
    log.warning(f"connect failed to {url}", extra=kv(error=f'could not reach "{url}"', dsn="host=db password=s3cr3t", n=1))
    [line] = lines(stream)
    assert "TOPSECRET" not in line and "s3cr3t" not in line
    if fmt == "json":
        out = json.loads(line)
        assert out["error"] == 'could not reach "postgresql://maintd@db/app?sslmode=require&password=***"'
        assert out["dsn"] == "host=db password=***" and out["n"] == 1
        assert out["msg"].endswith("password=***")
    else:
        assert 'error="could not reach \\"postgresql://maintd@db/app?sslmode=require&password=***\\""' in line
        assert line.endswith(' n=1') and 'dsn="host=db password=***"' in line


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_password_in_a_long_list_field_is_masked_before_the_list_is_cut(restore_loggers, fmt):
    """A list-valued field was joined and cut to MAX_VALUE characters, then masked: a URL the cut
    fell inside, before its '@', was no longer one, and the start of its password was written.
    Each item is masked first."""
    from maintd.logs import MAX_VALUE

    stream = io.StringIO()
    log = setup_logging("info", fmt, stream)
    password = "TOPSECRET" * 5
    hosts = ["x" * (MAX_VALUE - 40), f"postgresql://maintd:{password}@db/app"]
    before = len(",".join(hosts).split(password)[0])
    assert before < MAX_VALUE < before + len(password)  # the cut falls inside the password
    log.warning("could not reach", extra=kv(urls=hosts))
    [line] = lines(stream)
    assert "TOPSEC" not in line, line[-120:]


def test_a_traceback_written_when_debugging_cannot_forge_lines_or_drive_a_terminal(restore_loggers):
    """With level debug, a failed pass's traceback follows its line; the exception's text (a
    server's error quoting a row's value, a queue name) was written as it was: its newline began
    a line of its own (a forged 'became leader' line) and its ESC reached the terminal."""
    out = io.StringIO()
    setup_logging("debug", "text", stream=out)
    try:
        raise ValueError("bad row in queue " + FORGED + ANSI)
    except ValueError:
        logging.getLogger("maintd.cleaner").error("pass failed", exc_info=True, extra=kv(service="cleaner"))
    text = out.getvalue()
    first, *rest = text.rstrip("\n").split("\n")
    assert first.endswith("pass failed service=cleaner") and first.isprintable(), first
    assert rest and "Traceback (most recent call last):" in rest[0], rest
    assert all(line.isprintable() for line in rest), rest  # no ESC, no C1 CSI, no CR
    assert not any(line.startswith("2026-") for line in rest), rest  # nothing reads as a line of its own
    assert all(line.startswith(" ") for line in rest), rest  # the traceback is indented under its line


@pytest.mark.parametrize("fmt", ["text", "json"])
@pytest.mark.parametrize("logger", ["psycopg", "sqlalchemy.pool.impl.QueuePool"])
def test_the_drivers_warnings_are_in_the_daemon_s_format_masked_and_escaped(restore_loggers, fmt, logger):
    """psycopg ("error ignored in rollback on ...: <the server's error>", "query cancellation
    failed: ...") and SQLAlchemy's pool ("Exception during reset or similar", with a traceback)
    log on loggers of their own, which had no handler: Python's last-resort handler wrote them raw,
    without a time stamp, not as JSON, with no password masked and no control character escaped."""
    out = io.StringIO()
    setup_logging("info", fmt, stream=out)
    logging.getLogger(logger).warning("error ignored in rollback on %s: %s",
                                      "postgresql://u:HUNTER2@db/app", "bad value " + FORGED + ANSI)
    logging.getLogger(logger).debug("chatter")  # below warning: not written
    got = lines(out)
    assert len(got) == 1, got
    assert "HUNTER2" not in got[0] and "\x1b" not in got[0] and "\x9b" not in got[0]
    if fmt == "json":
        record = json.loads(got[0])
        assert record["level"] == "warning" and record["logger"] == logger
        assert record["msg"].startswith("error ignored in rollback on postgresql://u:***@db/app: bad value x\n")
    else:
        assert got[0][:4].isdigit() and " warning " in got[0] and "postgresql://u:***@db/app" in got[0]
