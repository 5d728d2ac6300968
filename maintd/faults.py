"""Connection faults classified by SQLSTATE, never by message text (SPEC 8.5).

* A statement's error carries the server's SQLSTATE. A failed *connect* does not: libpq reports a
  FATAL rejection during start-up ("sorry, too many clients already", 53300; "the database system
  is starting up", 57P03; a bad password, 28P01) only as a message, translated by the server's
  ``lc_messages``. So when a connect fails with a message from the server, :func:`diagnose` asks
  once more with libpq's verbose error format, which puts the SQLSTATE in the message (``FATAL:
  53300: ...``), and records it on the exception.
* :func:`transient`: worth retrying with backoff (the server is full, starting, shutting down,
  restarting, or unreachable) vs. needing a human (authentication, no such database or schema,
  missing privilege).
"""

from __future__ import annotations

import ctypes
import functools
import re
import select
import time

import psycopg
from psycopg import pq

# 08: connection exceptions; 53: insufficient resources (53300 too many connections);
# 57P01 admin shutdown, 57P02 crash shutdown, 57P03 cannot connect now (starting up, recovery),
# 57P05 idle session timeout (this process was frozen).
TRANSIENT_CLASSES = ("08", "53")
TRANSIENT_CODES = ("57P01", "57P02", "57P03", "57P05", "57014")  # 57014: a statement timeout (a slow server)
_VERBOSE_CODE = re.compile(r":\s+(?=[A-Z]*\d)([0-9A-Z]{5}):\s")  # a code has a digit: not "FATAL:"
PQERRORS_VERBOSE = 2
QUERY_CANCELED = "57014"  # a statement timeout, or a cancel
LOCK_NOT_AVAILABLE = "55P03"  # a lock timeout, or NOWAIT


def sqlstate(exc: BaseException) -> str | None:
    """The server's SQLSTATE of an error (a statement's, or a connect's as :func:`diagnose` found)."""
    orig = getattr(exc, "orig", None) or exc
    return getattr(orig, "sqlstate", None) or getattr(orig, "maintd_sqlstate", None)


def transient(exc: BaseException) -> bool:
    """Whether waiting may fix it: a known transient SQLSTATE, or no answer from a server at all
    (refused, timed out, reset). Anything else the server said needs a human."""
    code = sqlstate(exc)
    if code is None:
        return isinstance(getattr(exc, "orig", None) or exc, (psycopg.OperationalError, OSError))
    return code.startswith(TRANSIENT_CLASSES) or code in TRANSIENT_CODES


def diagnose(exc: psycopg.OperationalError, conninfo: str, timeout: float = 5.0) -> None:
    """After a failed connect whose message came from a server: learn its SQLSTATE (see the
    module's docstring) and set ``exc.maintd_sqlstate``. Nothing when it cannot be learnt."""
    if "FATAL" not in str(exc) and "ERROR" not in str(exc):
        return  # refused, timed out, unknown host: nothing from a server
    try:
        message = _verbose_connect(conninfo, timeout)
    except Exception:  # pragma: no cover - the diagnosis is best effort
        return
    codes = _VERBOSE_CODE.findall(message or "")
    if codes:  # a transient code wins: another host (or another moment) may work
        transient_codes = [c for c in codes if c.startswith(TRANSIENT_CLASSES) or c in TRANSIENT_CODES]
        exc.maintd_sqlstate = (transient_codes or codes)[-1]  # type: ignore[attr-defined]


@functools.cache
def _libpq() -> ctypes.CDLL | None:
    """The libpq psycopg loaded (the wheel's own, or the system's): PQsetErrorVerbosity on its
    connections must come from the same library."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/libpq" in path and ".so" in path:
                lib = ctypes.CDLL(path)
                lib.PQsetErrorVerbosity.argtypes = [ctypes.c_void_p, ctypes.c_int]
                return lib
    return None


def _verbose_connect(conninfo: str, timeout: float) -> str | None:
    """Connect once with verbose errors; the error message, or None when it connected."""
    lib = _libpq()
    if lib is None:
        return None
    conn = pq.PGconn.connect_start(conninfo.encode())
    try:
        lib.PQsetErrorVerbosity(conn.pgconn_ptr, PQERRORS_VERBOSE)
        deadline = time.monotonic() + timeout
        while conn.status != pq.ConnStatus.BAD:
            status = conn.connect_poll()
            if status == pq.PollingStatus.OK:
                return None
            if status == pq.PollingStatus.FAILED or time.monotonic() > deadline:
                break
            poller = select.poll()
            poller.register(conn.socket, select.POLLIN if status == pq.PollingStatus.READING else select.POLLOUT)
            poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
        return conn.get_error_message()
    finally:
        conn.finish()
