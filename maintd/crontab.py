"""graphile-worker crontab files (SPEC 7.8).

One entry per line: ``MIN HOUR DOM MON DOW TASK [?OPTS] [{PAYLOAD}]``, ``#`` comment lines and
blank lines ignored. Times are UTC. OPTS is a query string with graphile's options ``id``,
``fill``, ``max``, ``queue``, ``priority``, ``jobKey`` and ``jobKeyMode``; PAYLOAD is a JSON5
object. Task names, ids, queue names, durations and numbers are checked with the regular
expressions of graphile-worker's ``src/cronConstants.ts``; the schedule with maintd's cron
parser (cronie's semantics, which accept graphile's syntax and also month and weekday names).

Every error is a ``ValueError`` naming the file and line: ``crontab:3: minute 61 out of range 0-59``.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable
from urllib.parse import parse_qsl

import json5

from .durations import MAX_SECONDS
from .schedules import parse_cron_fields

UTC = timezone.utc

# From graphile-worker src/cronConstants.ts (CRONTAB_COMMAND and CRONTAB_OPTIONS_*), except that
# the five time fields are any non-blank words here: the cron parser checks them.
_LINE = re.compile(r"^(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(.*)$")
_COMMAND = re.compile(r"^([_a-zA-Z][_a-zA-Z0-9:/_-]*)(?:\s+\?([^\s]+))?(?:\s+(\{.*\}))?$")
_TASK = re.compile(r"^[_a-zA-Z][_a-zA-Z0-9:/_-]*$")
_ID = re.compile(r"^[_a-zA-Z][-_a-zA-Z0-9]*$")
_FILL = re.compile(r"^(?:[0-9]+[smhdw])+$")
_FILL_PART = re.compile(r"([0-9]+)([smhdw])")
_MAX = re.compile(r"^[0-9]+$")
_QUEUE = re.compile(r"^[-a-zA-Z0-9_:]+$")
_PRIORITY = re.compile(r"^-?[0-9]+$")
_JSON5_PLACE = re.compile(r"^<string>:\d+ (.*) at column (\d+)$")  # json5's syntax errors
_JOB_KEY_MODES = ("replace", "preserve_run_at")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
OPTIONS = ("id", "fill", "max", "queue", "priority", "jobKey", "jobKeyMode")
# The limits of maintd's [[periodic]] entries (services.periodic_config.PeriodicJob).
_MAX_NAME = 128
_SMALLINT = (-32768, 32767)


@dataclass(frozen=True)
class CrontabEntry:
    """One crontab line, in the terms of a ``[[periodic]]`` entry."""

    id: str
    schedule: str  # the five cron fields, single-spaced
    kind: str  # the task
    timezone: str = "UTC"
    queue: str = "default"
    priority: int = 0
    max_attempts: int = 25
    backfill: timedelta | None = None  # fill=..., None when absent or zero
    job_key: str | None = None
    job_key_mode: str | None = None  # "replace" (default with a jobKey) or "preserve_run_at"
    payload: dict[str, Any] = field(default_factory=dict, hash=False)
    source: str = "crontab"
    line: int = 0


def parse_crontab(text: str, source: str = "crontab",
                  check: Callable[[CrontabEntry], None] | None = None) -> list[CrontabEntry]:
    """The entries of a crontab file's text; ``ValueError`` naming every bad line (one
    ``SOURCE:LINE: ...`` per line of its message), two lines with the same id included, and
    those ``check`` (the caller's own rules for an entry) raises ``ValueError`` for."""
    entries: list[CrontabEntry] = []
    errors: list[str] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(re.split(r"\r?\n", text), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            entry = _parse_line(line, source, number, len(raw) - len(raw.lstrip()))
        except ValueError as exc:
            errors.append(f"{source}:{number}: {exc}")
            continue
        if entry.id in first_line:
            errors.append(f"{source}:{number}: duplicate id {entry.id!r} (also on line "
                          f"{first_line[entry.id]}); give one of them ?id=...")
            continue
        first_line[entry.id] = number
        try:
            if check is not None:
                check(entry)
        except ValueError as exc:
            errors.append(f"{source}:{number}: {exc}")
            continue
        entries.append(entry)
    if errors:
        raise ValueError("\n".join(errors))
    return entries


def load_crontab(path: str | os.PathLike[str],
                 check: Callable[[CrontabEntry], None] | None = None) -> list[CrontabEntry]:
    """Read and parse the crontab file at ``path`` (see :func:`parse_crontab`); errors name the
    path as given."""
    source = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read().removeprefix(b"\xef\xbb\xbf")  # a byte-order mark (Windows editors) is no text
    except OSError as exc:
        raise ValueError(f"{source}: cannot read crontab: {exc.strerror}") from None
    try:
        text = _newlines(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        line, column = utf8_place(raw, exc.start)
        raise ValueError(f"{source}:{line}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {column})") from None
    return parse_crontab(text, source, check)


def utf8_place(raw: bytes, start: int) -> tuple[int, int]:
    """The line and column (from 1, as an editor counts them) of the byte at ``start``, the first
    that is not UTF-8 (what comes before it decodes)."""
    lines = _newlines(raw[:start].decode("utf-8")).split("\n")
    return len(lines), len(lines[-1]) + 1


def _newlines(text: str) -> str:
    """Python's universal newlines, as a file opened in text mode reads: CRLF and CR are LF."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _parse_line(line: str, source: str, number: int, indent: int = 0) -> CrontabEntry:
    """One stripped line; ``indent``: the blanks stripped before it, for the columns of errors."""
    m = _LINE.match(line)
    if not m:
        raise ValueError("expected 'MIN HOUR DOM MON DOW TASK [?OPTS] [{PAYLOAD}]'")
    schedule = " ".join(m.group(i) for i in range(1, 6))
    parse_cron_fields(schedule)
    task, opts, payload = _split_command(m.group(6))
    _check_length("task", task)
    options = _parse_options(opts or "")
    # The payload ends the line: its '{' is at this (0-based) column of the line as written.
    start = indent + len(line) - len(payload or "")
    return CrontabEntry(id=options.pop("id", task), schedule=schedule, kind=task,
                        payload=_parse_payload(payload, start), source=source, line=number, **options)


def _split_command(command: str) -> tuple[str, str | None, str | None]:
    """(TASK, OPTS, PAYLOAD) as graphile-worker's CRONTAB_COMMAND splits them; a payload that is
    not valid JSON5 is left for :func:`_parse_payload` to name (graphile says "invalid command")."""
    m = _COMMAND.match(command)
    if m:
        return m.group(1), m.group(2), m.group(3)
    task, _, rest = command.partition(" ")
    rest = rest.strip()
    if not _TASK.match(task):
        why = ("has a '.': crontab task names follow graphile-worker's rule ([_a-zA-Z][_a-zA-Z0-9:/_-]*, "
               "no dots; a [[periodic]] entry's kind may have them)" if "." in task and _TASK.match(
                   task.replace(".", "_")) else "must start with a letter or '_', then letters, digits, "
               "'_', ':', '/' or '-'")
        raise ValueError(f"invalid command {command!r}: task {task!r} {why}")
    opts = None
    if rest.startswith("?"):
        opts, _, rest = rest.partition(" ")
        opts, rest = opts[1:], rest.strip()
    if rest.startswith("{"):
        return task, opts, rest  # not an object that ends the line: _parse_payload says why
    raise ValueError(f"invalid command {command!r}: expected 'TASK [?OPTS] [{{PAYLOAD}}]' "
                     "(options after '?' without spaces, then a JSON5 object)")


def _parse_options(text: str) -> dict[str, Any]:
    """Graphile's ``?id=...&fill=...`` options as CrontabEntry keyword arguments."""
    pairs = parse_qsl(text, keep_blank_values=True) if text else []
    seen: set[str] = set()
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key not in OPTIONS:
            raise ValueError(f"unknown option {key!r} (supported: {', '.join(OPTIONS)})")
        if key in seen:
            raise ValueError(f"option {key!r} given more than once")
        seen.add(key)
        out.update(_option(key, value))
    if "job_key" in out:
        out.setdefault("job_key_mode", "replace")
    return out


def _option(key: str, value: str) -> dict[str, Any]:
    """One option as CrontabEntry fields; ``ValueError`` if graphile's pattern rejects it."""
    if key == "id":
        _check(_ID.match(value), key, value, "a letter or '_', then letters, digits, '_' or '-'")
        _check_length("id", value)
        return {"id": value}
    if key == "fill":
        _check(_FILL.match(value), key, value, "a duration like 1d, 4w3d2h1m (units s m h d w)")
        return {"backfill": _fill(value)}
    if key == "max":
        _check(_MAX.match(value), key, value, "a whole number")
        return {"max_attempts": _bounded(key, int(value), 1, _SMALLINT[1])}
    if key == "queue":
        _check(_QUEUE.match(value), key, value, "letters, digits, '_', ':' or '-'")
        _check_length("queue", value)
        return {"queue": value}
    if key == "priority":
        _check(_PRIORITY.match(value), key, value, "a whole number")
        return {"priority": _bounded(key, int(value), *_SMALLINT)}
    if key == "jobKey":
        _check(value != "", key, value, "a non-empty key")
        return {"job_key": value}
    _check(value in _JOB_KEY_MODES, key, value, " or ".join(_JOB_KEY_MODES))
    return {"job_key_mode": value}


def _check(ok: object, key: str, value: str, expected: str) -> None:
    if not ok:
        raise ValueError(f"option {key}={value!r} is invalid: expected {expected}")


def _check_length(what: str, value: str) -> None:
    if len(value) > _MAX_NAME:
        raise ValueError(f"{what} {value[:20]!r}... is longer than {_MAX_NAME} characters")


def _bounded(key: str, n: int, lo: int, hi: int) -> int:
    if not lo <= n <= hi:
        raise ValueError(f"option {key}={n} out of range {lo}-{hi}")
    return n


def _fill(value: str) -> timedelta | None:
    """graphile's time phrase (parseTimePhrase): the sum of its number-unit parts."""
    seconds = sum(int(n) * _UNITS[unit] for n, unit in _FILL_PART.findall(value))
    if seconds > MAX_SECONDS:
        raise ValueError(f"option fill={value!r} is longer than 100 years")
    return timedelta(seconds=seconds) if seconds else None


def _parse_payload(text: str | None, start: int = 0) -> dict[str, Any]:
    """The payload ``text``, whose '{' is at column ``start`` (0-based) of its line."""
    if text is None:
        return {}
    try:
        payload = json5.loads(text, parse_constant=_reject_constant, parse_float=_finite)
    except ValueError as exc:
        raise ValueError(f"invalid JSON5 payload: {_in_line(str(exc), start)}") from None
    except RecursionError:
        raise ValueError("invalid JSON5 payload: nested too deeply") from None
    if not isinstance(payload, dict):
        raise ValueError("the payload must be a JSON5 object")
    return payload


def _in_line(message: str, start: int) -> str:
    """json5's ``<string>:1 Unexpected " " at column 8``, which counts from the payload's '{',
    as ``Unexpected " " at column 29``, counted in the line as an editor shows it."""
    m = _JSON5_PLACE.match(message)
    return message if m is None else f"{m.group(1)} at column {start + int(m.group(2))}"


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} cannot be stored in a job's args")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is too large for a job's args")
    return value


def cron_args(payload: dict[str, Any], slot: datetime, backfilled: bool) -> dict[str, Any]:
    """A job's args for one slot: ``payload`` plus ``"_cron": {"ts", "backfilled"}``, with ``ts``
    in JavaScript's ``toISOString`` form (``2021-01-01T04:00:00.000Z``) as graphile-worker writes it."""
    utc = slot.astimezone(UTC)
    ts = utc.strftime("%Y-%m-%dT%H:%M:%S.") + f"{utc.microsecond // 1000:03d}Z"
    return {**payload, "_cron": {"ts": ts, "backfilled": bool(backfilled)}}
