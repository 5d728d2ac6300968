"""Logging: ``text`` (``ts level logger message key=value``) or ``json`` lines, password-safe.

Structured fields go through ``extra={"fields": {...}}`` and are rendered as ``key=value``.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone

from .config import redact_dsn

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def _fields(record: logging.LogRecord) -> dict:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


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
    """Configure the ``maintd`` logger (idempotent: replaces its handler)."""
    logger = logging.getLogger("maintd")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    for h in list(logger.handlers):
        logger.removeHandler(h)
    logger.addHandler(handler)
    logger.setLevel(_LEVELS.get(level, logging.INFO))
    logger.propagate = False
    # APScheduler's own chatter only when debugging.
    logging.getLogger("apscheduler").setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
    return logger


def kv(**fields: object) -> dict:
    """``log.info("released stale running jobs", extra=kv(count=3))``"""
    return {"fields": fields}
