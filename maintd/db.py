"""Connections: raw psycopg sessions and SQLAlchemy engines with keepalives and timeouts, the
leader lock's key, the NOTIFY channel, and password-free error lines. (The SQL itself lives in
:mod:`maintd.queries`.)"""

from __future__ import annotations

import json
import re
import select
import shlex
import threading
import time
import zlib
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.types.json import set_json_loads
from psycopg.types.datetime import TimestamptzLoader
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.pool import NullPool, QueuePool

from . import faults
from .logs import redact_dsn
from .identifiers import quote_ident  # noqa: F401  (the migrations import it from here)
from .queries import catalog, psycopg_sql

KEEPALIVES = {  # defaults: a parameter the URL sets itself (``?keepalives_idle=30``) wins
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "connect_timeout": 5,
}
# What maintd sets on its sessions whatever the URL says: the name that tells its sessions apart
# in pg_stat_activity, and the bounds of the election's timings (derived from leader.lease).
OWN = {
    "application_name": "maintd's session names (maintd:<instance> for the lock session, :work, :read, ...)",
    "connect_timeout": "leader.lease for the lock session, 3 s for the dashboard's reads",
    "tcp_user_timeout": "leader.lease for the lock session and the passes",
}


def replaced_params(dsn: str) -> dict[str, str]:
    """The libpq parameters of ``dsn`` that maintd replaces with its own (see :data:`OWN`), each
    with what it uses instead: said once at start, not silently dropped."""
    given = conninfo_to_dict(libpq_dsn(dsn))
    return {name: f"{given[name]} (maintd uses {OWN[name]})" for name in OWN if name in given}


def _params(conninfo: str, params: dict[str, Any]) -> dict[str, Any]:
    """libpq parameters for a connect: :data:`KEEPALIVES` where the URL sets none, then ``params``."""
    given = conninfo_to_dict(conninfo)
    return {**{k: v for k, v in KEEPALIVES.items() if k not in given}, **params}


def libpq_dsn(dsn: str) -> str:
    """Accept ``postgresql+psycopg://`` (SQLAlchemy style) as well as plain libpq strings."""
    return re.sub(r"^postgres(ql)?\+psycopg2?://", "postgresql://", dsn)


def ms(td: timedelta) -> int:
    """Milliseconds for a server timeout: at least 1 (0 is none), at most the server's longest."""
    return min(2**31 - 1, max(1, int(td.total_seconds() * 1000)))


class BoundedConnection(psycopg.Connection):
    """A psycopg connection whose every wait for the server (a statement, a fetch, a commit) ends
    after ``answer_timeout`` seconds (None: no bound): the connection is closed and
    :class:`NoAnswer` raised. TCP cannot tell a frozen server (SIGSTOP, a hung VM) from a slow
    one: its kernel keeps acknowledging, so keepalives and ``tcp_user_timeout`` never fire, and
    the server-side timeouts need a running server. Set the bound above the statement timeout."""

    answer_timeout: float | None = None

    def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        bound = self.answer_timeout if timeout is None else timeout
        try:
            return super().wait(gen, interval=interval, timeout=bound)
        except psycopg.errors._WaitTimeout:
            if timeout is not None:
                raise  # the caller's own timeout (notifies()): the caller handles it
            where = f"{self.info.host}:{self.info.port}"
            self.pgconn.finish()  # mid-protocol: unusable (and SQLAlchemy sees a disconnect)
            raise NoAnswer(f"no answer from the server at {where} within {bound:g}s "
                           "(frozen or cut off?): connection closed") from None


class NoAnswer(psycopg.OperationalError):
    """The server did not answer within a connection's ``answer_timeout``."""


# Every session of maintd reads times and durations in the styles psycopg 3 parses, whatever the
# database's or role's defaults (``ALTER DATABASE ... SET DateStyle = 'SQL, DMY'``): it loads
# timestamps only in the ISO DateStyle and intervals only in the postgres IntervalStyle. And it
# resolves names in the system catalog only: every object of maintd is schema-qualified, and a
# function planted in a schema on the role's search_path (``public``, writable by every role before
# PostgreSQL 15) would otherwise win over a built-in it matches more exactly (``format(text, text,
# smallint, smallint)`` over the variadic ``format``) and run as maintd's role (CVE-2018-1058).
PINNED = {"DateStyle": "ISO, MDY", "IntervalStyle": "postgres", "search_path": "pg_catalog, pg_temp"}


def connect(dsn: str, *, application_name: str, autocommit: bool = True,
            settings: dict[str, Any] | None = None, answer_timeout: float | None = None,
            **params: Any) -> psycopg.Connection:
    """A raw psycopg connection with TCP keepalives and the given session settings; ``params``
    are extra libpq parameters (e.g. ``tcp_user_timeout``); ``answer_timeout``: see
    :class:`BoundedConnection`."""
    conninfo = libpq_dsn(dsn)
    params = _params(conninfo, params)
    try:
        conn = BoundedConnection.connect(conninfo, autocommit=True, application_name=application_name[:63], **params)
    except psycopg.errors.ConnectionTimeout as exc:
        # psycopg's first line names no server (its lines after it, with several hosts, do: the
        # operator reads the first); a refused connect's names it.
        first, *rest = str(exc.args[0] if exc.args else "connection timeout expired").split("\n")
        where = f"no answer from {_servers(conninfo)} within connect_timeout {_connect_timeout(conninfo, params)} s"
        exc.args = ("\n".join([f"{first}: {where}", *rest]),)
        faults.diagnose(exc, make_conninfo(conninfo, **params))  # (another host of the URL may have answered)
        raise
    except psycopg.OperationalError as exc:
        faults.diagnose(exc, make_conninfo(conninfo, **params))
        raise
    conn.answer_timeout = answer_timeout
    set_json_loads(load_json, conn)
    pinned = {**PINNED, **(settings or {})}
    try:
        conn.execute(psycopg_sql(catalog.SET_SESSIONS), {"names": list(pinned), "values": [str(v) for v in pinned.values()]})
        conn.autocommit = autocommit
    except BaseException:
        conn.close()
        raise
    return conn


def _servers(conninfo: str) -> str:
    """The servers a DSN tries, as ``host:port`` (no user, no password), for a connect error."""
    params = conninfo_to_dict(conninfo)
    hosts = str(params.get("host") or params.get("hostaddr") or "the local socket").split(",")
    ports = str(params.get("port") or "5432").split(",")
    ports = ports * len(hosts) if len(ports) == 1 else ports
    return ", ".join(f"{h}:{p or 5432}" for h, p in zip(hosts, ports))


def _connect_timeout(conninfo: str, params: dict[str, Any]) -> Any:
    """The connect timeout (seconds, per host) a connect used: maintd's own, the URL's, libpq's."""
    return params.get("connect_timeout") or conninfo_to_dict(conninfo).get("connect_timeout") or "none"


def session_attrs(params: dict, attrs: str) -> dict[str, str]:
    """``target_session_attrs = attrs`` for a multi-host URL (``params``, parsed) that sets none
    (libpq would stop at the first host that answers), else nothing."""
    multi = "," in str(params.get("host") or params.get("hostaddr") or "")
    return {"target_session_attrs": attrs} if multi and "target_session_attrs" not in params else {}


class HostOrder:
    """The order in which the hosts of a multi-host URL (``host=a,b target_session_attrs=
    read-write``) are tried. libpq tries them in the written order and spends a whole connect
    timeout on a frozen one before the next, for every new connection; so the host the lock
    session last reached goes first (the work pool follows it) and a host that stopped answering
    goes last. One object per daemon, shared by its lock session and its engine; thread-safe.

    Without ``target_session_attrs``, libpq stops at the first host that answers, a standby or a
    read-only primary included, and maintd would keep failing there ("cannot execute LISTEN during
    recovery") however often it retried: maintd's writers ask for ``read-write`` themselves."""

    def __init__(self, dsn: str):
        self._dsn = libpq_dsn(dsn)
        params = conninfo_to_dict(self._dsn)
        if attrs := session_attrs(params, "read-write"):
            params |= attrs
            self._dsn = make_conninfo("", **params)
        hosts = str(params.get("host") or "").split(",")
        ports = str(params.get("port") or "").split(",")
        if len(ports) == 1:
            ports = ports * len(hosts)
        self._params = params
        self._servers = list(zip(hosts, ports)) if len(hosts) > 1 and len(ports) == len(hosts) \
            and "hostaddr" not in params else []
        self._lock = threading.Lock()

    @property
    def multi_host(self) -> bool:
        return bool(self._servers)

    @property
    def count(self) -> int:
        """How many hosts a connect may try (each for up to its connect timeout)."""
        return max(1, len(str(self._params.get("host") or "").split(",")))

    def dsn(self) -> str:
        with self._lock:
            if not self._servers:
                return self._dsn
            hosts, ports = zip(*self._servers)
        return make_conninfo("", **{**self._params, "host": ",".join(hosts), "port": ",".join(ports)})

    def _move(self, host: str | None, port: int | str | None, first: bool) -> None:
        with self._lock:
            # a host written without a port is on the default one, which the session reports by number
            key = next((s for s in self._servers if s in ((str(host), str(port)), (str(host), ""))), None)
            if key is not None:
                self._servers.remove(key)
                self._servers.insert(0 if first else len(self._servers), key)

    def reached(self, host: str | None, port: int | str | None) -> None:
        self._move(host, port, first=True)

    def silent(self, host: str | None, port: int | str | None) -> None:
        self._move(host, port, first=False)


def sever(conn: psycopg.Connection | None) -> None:
    """Shut the connection's socket down from another thread: a call blocked on a silent peer (a
    frozen server whose kernel still acknowledges, a partition) fails at once instead of waiting
    for a server that may never answer. The connection is unusable afterwards."""
    import os
    import socket

    try:
        fd = conn.pgconn.socket if conn is not None and not conn.closed else -1
    except Exception:  # pragma: no cover - already gone
        return
    if fd < 0:
        return
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def session_settings(statement_timeout: timedelta, *, lock_timeout: timedelta | None = None,
                     idle_in_transaction: timedelta | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"statement_timeout": ms(statement_timeout)}
    if lock_timeout is not None:
        out["lock_timeout"] = ms(lock_timeout)
    if idle_in_transaction is not None:
        out["idle_in_transaction_session_timeout"] = ms(idle_in_transaction)
    return out


def make_engine(dsn: str, *, application_name: str, session: dict[str, Any] | None = None,
                pool_size: int = 4, pooled: bool = True, hosts: HostOrder | None = None,
                max_overflow: int = 2, pool_timeout: float = 30.0, **params: Any) -> Engine:
    """A SQLAlchemy engine over psycopg 3 whose connections carry ``session`` settings (and extra
    libpq ``params``, e.g. ``tcp_user_timeout``); with ``hosts``, new connections try a multi-host
    URL's hosts in that order."""

    def creator() -> psycopg.Connection:
        return connect(hosts.dsn() if hosts is not None else dsn, application_name=application_name,
                       autocommit=False, settings=session, **params)

    kwargs: dict[str, Any] = {"creator": creator}
    if pooled:  # LIFO: the connection used last is reused, so it is rarely idle long enough to ping
        kwargs.update(poolclass=QueuePool, pool_size=pool_size, max_overflow=max_overflow, pool_recycle=1800,
                      pool_use_lifo=True, pool_timeout=pool_timeout)
    else:
        kwargs.update(poolclass=NullPool)
    engine = create_engine("postgresql+psycopg://", **kwargs)
    _check_on_checkout(engine)

    @event.listens_for(engine, "handle_error")
    def _hide_password(ctx: Any) -> None:  # pragma: no cover - defensive
        exc = ctx.original_exception
        if exc is not None and exc.args and isinstance(exc.args[0], str):
            exc.args = (redact_dsn(exc.args[0]),) + tuple(exc.args[1:])
        if ctx.sqlalchemy_exception is not None and ctx.connection is not None:
            try:  # for describe_db_error: "not migrated" names where it looked, a grant the role
                ctx.sqlalchemy_exception.maintd_where = connected_to(ctx.connection)
                ctx.sqlalchemy_exception.maintd_role = ctx.connection.connection.dbapi_connection.info.user
            except Exception:  # a connection gone with the error: nothing to name
                pass

    return engine


PING_AFTER_IDLE = 30.0  # seconds in the pool after which a checked-out connection is pinged


def _check_on_checkout(engine: Engine) -> None:
    """SQLAlchemy's ``pool_pre_ping`` costs a round trip per checkout: a third of an idle
    scheduler tick. pgx's pool pings only a connection idle over a second (pgxpool ``ShouldPing``);
    that would still ping every 5 s scheduler tick. Here a checked-out connection is pinged only
    when its socket has something to read (the server's goodbye after a restart,
    ``pg_terminate_backend`` or a timeout: a FATAL message or end of file; a closed peer) or it sat
    in the pool over ``PING_AFTER_IDLE`` seconds; a failed ping discards it and the pool opens
    another. A server that vanished without a word (a host reboot answering with a reset) costs
    the pass that finds it; a silent one is bounded as before by the wait for an answer, which
    covered the ping too."""

    @event.listens_for(engine, "checkin")
    def _idle_since(dbapi_conn: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _check(dbapi_conn: Any, record: Any, proxy: Any) -> None:
        since = record.info.get("idle_since")  # None: a new connection
        if since is None or not (time.monotonic() - since > PING_AFTER_IDLE or _has_input(dbapi_conn)):
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except psycopg.Error as exc:
            raise DisconnectionError(f"pooled connection lost: {redact_dsn(str(exc))}") from exc


def _has_input(conn: psycopg.Connection) -> bool:
    """The connection is closed or its socket has bytes (or EOF) waiting: an idle session in a
    transaction-less pool gets nothing from the server but a goodbye."""
    return conn.closed or conn.broken or readable(conn.pgconn.socket)


def readable(fd: int, timeout: float = 0.0) -> bool:
    """Whether ``fd`` has bytes, end of file or an error to read, waiting up to ``timeout``
    seconds. ``poll``, not ``select``: a process of many targets may hold more than FD_SETSIZE
    descriptors."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(timeout * 1000))


def advisory_key(schema: str) -> tuple[int, int]:
    """The (classid, objid) pair of the leader lock of a schema: stable across processes."""
    classid = 0x6D61_696E - (1 << 32) if 0x6D61_696E >= (1 << 31) else 0x6D61_696E  # 'main'
    crc = zlib.crc32(f"maintd:{schema}".encode())
    objid = crc - (1 << 32) if crc >= (1 << 31) else crc
    return classid, objid


def notify_channel(schema: str) -> str:
    """SPEC: ``maintd_jobs``; prefixed with the schema when the schema is not ``maintd``."""
    return "maintd_jobs" if schema == "maintd" else f"{schema}_maintd_jobs"


def periodic_channel(schema: str) -> str:
    """Where the ``periodic_jobs`` trigger announces a change (as migration 0003 names it)."""
    return "maintd_periodic" if schema == "maintd" else f"{schema}_maintd_periodic"


def events_channel(schema: str) -> str:
    """``maintd_events`` (the rescuer's ``stalled`` events), prefixed like :func:`notify_channel`."""
    return "maintd_events" if schema == "maintd" else f"{schema}_maintd_events"


def connected_to(conn: Connection) -> str:
    """Where ``conn`` is, for an error that holds only there (``database 'app' on db1:5432 as
    'maintd_daemon'``): a schema missing in the wrong database (a shell without the unit's
    DSN) must not read as one to migrate. No password."""
    info = conn.connection.dbapi_connection.info
    return f"database {info.dbname!r} on {info.host}:{info.port} as {info.user!r}"


# What fixes an error: a missing grant ("permission denied", not "must be owner": a grant cannot
# give ownership), or a schema `maintd migrate` has not made (an error naming one of maintd's own
# objects; a missing index named in the reindexer's config is not that).
GRANT_HINT = ("a grant is missing: as the schema's owner, run `maintd grants ROLE --apply` (or the SQL "
              "`maintd grants ROLE` prints; `--worker` for a worker's role)")
MIGRATE_HINT = "the schema is not migrated: run `maintd migrate` first"
MAINTD_OBJECT = re.compile(
    r'(relation|type) "(?:[^"]*\.)?(jobs|leader|daemons|service_runs|periodic_slots|periodic_jobs|job_state'
    r'|health_history|alembic_version)"'
    r'|schema "[^"]*" does not exist'
    r'|function [^ ]*\b(complete_jobs|permanently_fail_jobs|retry_jobs|cancel_jobs|reschedule_jobs|remove_job'
    r'|delete_jobs)\('
    # the columns later migrations add (0010, 0013, 0019): the package upgraded before `migrate` ran
    r'|column "?(?:\w+\.)?(lock_pid|schedule|resumed_at)"? does not exist')


def _hint(sqlstate: str | None, line: str) -> str | None:
    if sqlstate == "42501" and line.startswith("permission denied"):
        return GRANT_HINT
    if sqlstate in ("42P01", "3F000", "42883", "42704", "42703") and MAINTD_OBJECT.search(line):
        return MIGRATE_HINT
    return None


def describe_db_error(exc: BaseException, role: str | None = None) -> str:
    """One line for an operator, without the password; an error that a grant or ``maintd
    migrate`` fixes says so (a grant for ``role``, or the role an engine's session had)."""
    orig = getattr(exc, "orig", None) or exc
    msg = str(orig).strip().splitlines()
    line = redact_dsn(msg[0] if msg else exc.__class__.__name__)
    hint = _hint(getattr(orig, "sqlstate", None), line)
    if hint == MIGRATE_HINT and getattr(exc, "maintd_where", None):
        hint = f"the schema is not migrated in {exc.maintd_where}: run `maintd migrate` first"
    if hint == GRANT_HINT and (role := role or getattr(exc, "maintd_role", None)):  # shell-quoted
        hint = GRANT_HINT.replace("ROLE", shlex.quote(role))
    return f"{line} ({hint})" if hint and hint not in line else line


class UnloadableJson(str):
    """The text of a ``json``/``jsonb`` value Python cannot load (nested deeper than its recursion
    limit, an integer of over 4,300 digits; PostgreSQL takes both); ``reason`` says which."""

    reason: str


def load_json(data: str | bytes) -> Any:
    """Every maintd session's JSON loader: such a value comes back as :class:`UnloadableJson`
    instead of failing the read of every row (a job's args, a periodic_jobs row's args)."""
    try:
        return json.loads(data)
    except (RecursionError, ValueError) as exc:
        out = UnloadableJson(data if isinstance(data, str) else bytes(data).decode())
        out.reason = ("nested too deep for Python" if isinstance(exc, RecursionError)
                      else f"not loadable by Python: {str(exc).split(':')[0]}")
        return out


class _AnyTimestamptz(TimestamptzLoader):
    """A ``timestamptz`` no Python datetime holds ('infinity', BC, past year 9999) loads as
    PostgreSQL's text of it: shown as is, and given back as a keyset value (``CAST(:k AS
    timestamptz)``), so a bad row is found, listed and fixed like any other."""

    def load(self, data: Any) -> Any:
        try:
            return super().load(data)
        except psycopg.DataError:
            return bytes(data).decode()


def load_any_time(dbapi_conn: psycopg.Connection) -> None:
    """Make a psycopg connection load every ``timestamptz`` (see :class:`_AnyTimestamptz`): every
    reader session (:func:`maintd.readers.reader_engine`: ``maintd status``, ``/status``, the
    dashboard, ``maintd jobs list|show``, ``maintd periodic list``), which show rows as they are."""
    dbapi_conn.adapters.register_loader("timestamptz", _AnyTimestamptz)


def hold_any_time(conn: Connection) -> None:
    """:func:`load_any_time` on a session that is not a reader's (``maintd jobs`` actions, which
    report the rows they changed)."""
    load_any_time(conn.connection.dbapi_connection)
