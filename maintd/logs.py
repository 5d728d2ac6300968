"""Logging: ``text`` (``ts level logger message key=value``) or ``json`` lines, password-safe.

Structured fields go through ``extra={"fields": {...}}`` and are rendered as ``key=value``.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timezone

from .config import redact_dsn

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


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


def _fmt_value(v: object) -> str:
    s = str(v)
    return json.dumps(s) if (not s or any(c in s for c in ' ="')) else s


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        ts = ts[:-4] + "Z"
        msg = record.getMessage()
        extra = " ".join(f"{k}={_fmt_value(v)}" for k, v in _fields(record).items())
        line = f"{ts} {record.levelname.lower():<7} {msg}" + (f" {extra}" if extra else "")
        if record.exc_info and record.levelno >= logging.ERROR and logging.getLogger("maintd").isEnabledFor(logging.DEBUG):
            line += "\n" + self.formatException(record.exc_info)
        return redact_dsn(line)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in _fields(record).items():
            out.setdefault(k, v if isinstance(v, (int, float, bool)) or v is None else str(v))
        if record.exc_info and logging.getLogger("maintd").isEnabledFor(logging.DEBUG):
            out["exception"] = self.formatException(record.exc_info)
        return redact_dsn(json.dumps(out, default=str))


def setup_logging(level: str = "info", fmt: str = "text", stream=None) -> logging.Logger:
    """Configure the ``maintd`` and ``apscheduler`` loggers (idempotent: replaces their
    handler). APScheduler's lines go through the same handler, so that they have a time stamp
    and, with ``json``, are JSON too; its own chatter only when debugging."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_TargetFilter(debug=level == "debug"))
    levels = {"maintd": _LEVELS.get(level, logging.INFO),
              "apscheduler": logging.DEBUG if level == "debug" else logging.WARNING}
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
