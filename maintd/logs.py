r"""Logging: ``text`` (``ts level logger message key=value``) or ``json`` lines, password-safe.

Structured fields go through ``extra={"fields": {...}}`` and are rendered as ``key=value``.
Messages are fixed text; data (a queue name, an error from the server) goes in fields. In text
format every value is escaped: a control character (newline, ESC, a C1 code such as CSI, a line
separator) is written as ``\n`` or ``\x1b``, a value with a space, ``=``, ``"`` or ``\`` is
quoted, so no value can forge a line or drive a terminal; messages get the same escapes (without
the quotes). Long values are cut (:data:`MAX_VALUE` characters, lists :data:`MAX_ITEMS` items)
with a count of what was left out, in both formats.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any
from urllib.parse import unquote
from datetime import datetime, timezone

MAX_VALUE = 1000  # characters of one field value (or a message) written
MAX_ITEMS = 20  # items of a list (tuple, set) field written

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def redact_dsn(dsn: str) -> str:
    """Mask every password in a text: a URL's ``user:password@`` (up to the last ``@`` before a
    space: a password may hold one, or a ``/``), a URL's query parameter ``password=...`` (up to
    ``&`` or ``#``) and a key=value DSN's ``password=...`` (quoted, or up to the next space
    not escaped by a backslash, as libpq reads it); ``sslpassword`` (a client key's passphrase)
    too: any key that ends in ``password``."""
    dsn = re.sub(r"(://[^:/@?#\s]*:)\S*@", r"\1***@", dsn)
    # A query parameter's value runs to '&', '#' or a blank; a quote just before one of them (or
    # the end) closes the text the URL is quoted in, and any other quote is the password's.
    # libpq percent-decodes a query's keys too: ?pass%77ord=... is a password.
    dsn = re.sub(r"([?&]((?:\w|%[0-9a-f]{2})*)=)([^&#\s]*?)(?=[\"']?(?:[&#\s]|$))",
                 lambda m: m[1] + "***" if unquote(m[2]).lower().endswith("password") else m[0], dsn, flags=re.I)
    return re.sub(r"((?<![?&\w])\w*password\s*=\s*)('(?:[^'\\]|\\.)*'|(?:\\.|\S)+)", r"\1***", dsn, flags=re.I)


# The target a line is about, in a daemon with several targets: set by each target's election
# thread and around each pass (see :func:`about_target`), shown as the line's first field.
_TARGET: ContextVar[str | None] = ContextVar("maintd_log_target", default=None)


@contextmanager
def about_target(name: str | None) -> Iterator[None]:
    """Lines logged inside (on this thread) carry ``target=<name>``; None: no field."""
    token = _TARGET.set(name)
    try:
        yield
    finally:
        _TARGET.reset(token)


def _fields(record: logging.LogRecord) -> dict:
    fields = getattr(record, "fields", None)
    fields = fields if isinstance(fields, dict) else {}
    target = getattr(record, "target", None)
    if target is None or "target" in fields:
        return fields
    return {"target": target, **fields}


class _TargetFilter(logging.Filter):
    """Stamps each record with the target of its thread's context (see :func:`about_target`);
    drops APScheduler's "skipped: maximum number of running instances reached" (a pass that
    outlasts its interval: by design one at a time, the next one coalesced) unless debugging."""

    def __init__(self, debug: bool):
        super().__init__()
        self.debug = debug

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "target"):
            record.target = _TARGET.get()
        if record.name.startswith("apscheduler") and not self.debug and record.levelno < logging.ERROR:
            return "maximum number of running instances reached" not in record.getMessage()
        return True


def _escape_char(c: str) -> str:
    if c in "\\\"":
        return "\\" + c
    if c in "\n\r\t":
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}[c]
    if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp"):  # controls, bidi overrides, separators
        return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
    return c


def escape(s: str) -> str:
    """``s`` with every control or format character escaped (for a message: quotes and
    backslashes stay as they are)."""
    if s.isprintable():
        return s
    return "".join(c if c in "\\\"" else _escape_char(c) for c in s)


def escape_all(s: str) -> str:
    """``s`` with every control or format character escaped, and backslashes and quotes too:
    read back unambiguously (for a label value, :func:`maintd.metrics.label_value`)."""
    return "".join(_escape_char(c) for c in s)


def escaped(value: Any) -> Any:
    """``value`` with every string in it (in dicts, lists and tuples too) passed through
    :func:`escape`: for text output made of what the database holds (a queue name, a schedule,
    an error), where a newline or a terminal escape written by a worker would forge or hide lines."""
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, dict):
        return {k: escaped(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(escaped(v) for v in value)
    return value


def clip(v: object) -> object:
    """A value cut to :data:`MAX_VALUE` characters or :data:`MAX_ITEMS` items, saying how much
    was left out (a list of 100,000 queues must not make a megabyte line)."""
    if isinstance(v, (list, tuple, set, frozenset)):
        items = sorted(v, key=str) if isinstance(v, (set, frozenset)) else list(v)
        shown = ",".join(str(x) for x in items[:MAX_ITEMS])
        v = shown + (f",... (+{len(items) - MAX_ITEMS} more)" if len(items) > MAX_ITEMS else "")
    if isinstance(v, str) and len(v) > MAX_VALUE:
        return v[:MAX_VALUE] + f"... (+{len(v) - MAX_VALUE} characters)"
    return v


def _fmt_value(v: object) -> str:
    s = str(v)  # clipped already (see _redacted)
    if s and s.isprintable() and not any(c in s for c in ' ="\\'):
        return s
    return '"' + "".join(_escape_char(c) if c != " " else c for c in s) + '"'


def _redacted(v: object) -> object:
    """A field's value with any password masked, before it is quoted or JSON-encoded (masking
    the finished line could eat a closing quote)."""
    if isinstance(v, (int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple, set, frozenset)):  # each item masked before the list is cut:
        items = sorted(v, key=str) if isinstance(v, (set, frozenset)) else v  # a cut inside a URL,
        return clip([redact_dsn(str(x)) for x in items])  # before its '@', would hide it
    return clip(redact_dsn(v if isinstance(v, str) else str(v)))


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        ts = ts[:-4] + "Z"
        msg = escape(str(_redacted(record.getMessage())))
        extra = " ".join(f"{escape(str(k))}={_fmt_value(_redacted(v))}" for k, v in _fields(record).items())
        line = f"{ts} {record.levelname.lower():<7} {msg}" + (f" {extra}" if extra else "")
        if record.exc_info and record.levelno >= logging.ERROR and logging.getLogger("maintd").isEnabledFor(logging.DEBUG):
            line += "\n" + _traceback_lines(self.formatException(record.exc_info))
        return line


def _traceback_lines(text: str) -> str:
    """A traceback under its line: each of its lines escaped (an exception's text may quote what
    the database holds) and indented, so that a newline in that text cannot begin a line of its own."""
    return "\n".join("  " + escape(line) for line in redact_dsn(text).split("\n"))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": _redacted(record.getMessage()),
        }
        for k, v in _fields(record).items():
            out.setdefault(k, _redacted(v))
        if record.exc_info and logging.getLogger("maintd").isEnabledFor(logging.DEBUG):
            out["exception"] = redact_dsn(self.formatException(record.exc_info))
        return json.dumps(out, default=str)


def setup_logging(level: str = "info", fmt: str = "text", stream=None) -> logging.Logger:
    """Configure the ``maintd``, ``apscheduler``, ``psycopg`` and ``sqlalchemy`` loggers
    (idempotent: replaces their handler). The others' lines go through the same handler, so that
    they have a time stamp, are masked and escaped and, with ``json``, are JSON too; APScheduler's
    own chatter only when debugging, the drivers' warnings and errors only."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_TargetFilter(debug=level == "debug"))
    levels = {"maintd": _LEVELS.get(level, logging.INFO),
              "apscheduler": logging.DEBUG if level == "debug" else logging.WARNING,
              # The drivers' own warnings (psycopg: "error ignored in rollback on ...", SQLAlchemy's
              # pool: "Exception during reset or similar"): else Python's last resort wrote them raw.
              "psycopg": logging.WARNING, "sqlalchemy": logging.WARNING}
    for name, lvl in levels.items():
        logger = logging.getLogger(name)
        for h in list(logger.handlers):
            logger.removeHandler(h)
        logger.addHandler(handler)
        logger.setLevel(lvl)
        logger.propagate = False
    return logging.getLogger("maintd")


def kv(**fields: object) -> dict:
    """``log.info("released stale running jobs", extra=kv(count=3))``"""
    return {"fields": fields}
