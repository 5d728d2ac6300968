r"""Real maintd daemons as subprocesses, for leadership, failover and fault tests.

    d = DaemonProc(dsn, schema, "d1", {"cleaner": {"interval": "1s"}}).start()
    d.wait_log(r"became leader epoch=(\d+)")
    d.is_leader_from_db()          # the database's view: its lock session holds the lock
    d.http_get("/healthz")         # (status, body) from its HTTP server (port 0 -> from the log)
    d.kill()                       # SIGKILL (or d.kill(signal.SIGSTOP) ...); d.stop() = SIGTERM, wait
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import psycopg

SIGKILL = signal.SIGKILL  # (DaemonProc.signal shadows the module in the class body)
FAST_LEADER = {"lease": "3s", "renew_interval": "1s", "retry_interval": "0.2s"}
# Seconds a ``maintd run`` process may take from Popen to its first lines (connected, leading):
# about 1.2 s on an idle 2-core machine, 4-5 s with two busy cores, 10 s seen with four (its
# imports alone). No test measures a start-up; waits that include one allow this.
START = 45


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(v)


def to_toml(config: dict[str, Any]) -> str:
    """A small TOML writer: scalars first, then tables, then arrays of tables."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in config.items()
             if not isinstance(v, dict) and not (isinstance(v, list) and v and isinstance(v[0], dict))]
    for k, v in config.items():
        if isinstance(v, dict):
            lines.append(f"[{k}]")
            lines += [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items()]
    for k, v in config.items():
        if isinstance(v, list) and v and isinstance(v[0], dict):
            for item in v:
                lines.append(f"[[{k}]]")
                lines += [f"{kk} = {_toml_value(vv)}" for kk, vv in item.items()]
    return "\n".join(lines) + "\n"


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class DaemonProc:
    """One ``maintd run`` process with its own config file and log."""

    def __init__(self, dsn: str, schema: str, instance_id: str, extra_config: dict | None = None,
                 workdir: str | None = None, env: dict[str, str] | None = None,
                 prefix: list[str] | None = None):
        """``prefix``: a command the daemon runs under, e.g. ``["prlimit", "--nofile=1024:1024", "--"]``."""
        self.dsn, self.schema, self.instance_id = dsn, schema, instance_id
        self.prefix = list(prefix or [])
        self.extra_env = env or {}
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="maintd-d-"))
        config = merge({
            "database_url": dsn, "schema": schema, "instance_id": instance_id,
            "http": {"listen": "127.0.0.1:0"}, "leader": dict(FAST_LEADER), "log": {"level": "info"},
        }, extra_config or {})
        self.config_path = self.dir / f"{instance_id}.toml"
        self.write_config(config)
        self.log_path = self.dir / f"{instance_id}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def write_config(self, config: dict) -> None:
        self.config = config
        self.config_path.write_text(to_toml(config))

    def start(self, gated_log: bool = False) -> "DaemonProc":
        """``gated_log``: the output goes through a pipe copied to the log file by a thread, so
        that :meth:`block_log` can make the daemon's next log write block (a stalled log sink)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MAINTD_", "NOTIFY_SOCKET", "WATCHDOG_"))}
        env.update(self.extra_env)
        self._log = open(self.log_path, "ab")
        out = self._log
        if gated_log:
            self._gate = LogGate(self._log)
            out = self._gate.write_fd
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "maintd", "--config", str(self.config_path), "run"],
            stdout=out, stderr=subprocess.STDOUT, env=env)
        return self

    def block_log(self) -> None:
        """From now on the daemon blocks at its next log line (only with ``start(gated_log=True)``)."""
        self._gate.block()

    def unblock_log(self) -> None:
        if getattr(self, "_gate", None) is not None:
            self._gate.unblock()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self, sig: int = SIGKILL) -> None:
        """Send ``sig``; for SIGKILL also reap the process."""
        self.signal(sig)
        if sig == SIGKILL:
            self.proc.wait(10)

    def main_thread_stalled(self, seconds: float = 0.5) -> bool:
        """Whether the daemon's main thread (which wakes every 0.2 s) stayed asleep for
        ``seconds``: its context-switch counts in /proc did not move."""
        def switches() -> str:
            with open(f"/proc/{self.pid}/task/{self.pid}/status") as f:
                return "".join(line for line in f if "ctxt_switches" in line)

        before = switches()
        time.sleep(seconds)
        return switches() == before

    def work_backends(self) -> list[str]:
        """The states (pg_stat_activity) of this daemon's maintenance connections; instance ids
        must be unique on the server for this (tests running at once share it)."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return [r[0] for r in conn.execute("SELECT state FROM pg_stat_activity WHERE application_name = %s",
                                               (f"maintd:{self.instance_id}:work",))]

    def is_leader_from_db(self) -> bool:
        """Whether the database sees this instance's lock session holding the leader lock."""
        return f"maintd:{self.instance_id}" in lock_holders(self.dsn, self.schema)

    @property
    def http_port(self) -> int:
        """The bound HTTP port (the config's port 0 picks a free one; the log names it)."""
        return int(self.wait_log(r"http listening address=[^\s]+:(\d+)").group(1))

    def http_get(self, path: str, timeout: float = 5) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def stop(self, timeout: float = 15) -> int:
        if self.proc is None:
            return 0
        self.unblock_log()
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.send_signal(signal.SIGTERM)
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_log(self, pattern: str, timeout: float = START, after: int = 0) -> re.Match[str]:
        """Wait until the log (from character offset ``after``) matches ``pattern``. The default
        allows a start-up on a loaded machine (:data:`START`); a bound that is the product's
        promise is passed explicitly."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            m = rx.search(self.log(), after)
            if m:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.instance_id}: no {pattern!r} in {timeout}s; log:\n{self.log()[-3000:]}")
            time.sleep(0.05)


class LogGate:
    """A pipe between a daemon's output and its log file. :meth:`block` stops copying and fills
    the pipe with NUL bytes (dropped when copying resumes): the daemon's next write blocks."""

    def __init__(self, log_file):
        self._log = log_file
        self._read_fd, self.write_fd = os.pipe()
        self._copying = threading.Event()
        self._copying.set()
        self._idle = threading.Event()
        threading.Thread(target=self._copy, daemon=True).start()

    def _copy(self) -> None:
        while True:
            if not self._copying.is_set():
                self._idle.set()
                self._copying.wait()
                self._idle.clear()
            ready, _, _ = select.select([self._read_fd], [], [], 0.02)
            if not ready:
                continue
            data = os.read(self._read_fd, 65536)
            if not data:
                return
            self._log.write(data.replace(b"\0", b""))
            self._log.flush()

    def block(self) -> None:
        self._copying.clear()
        self._idle.wait(5)
        # A file description of our own: O_NONBLOCK on the shared one would make the daemon's
        # writes fail instead of block.
        fd = os.open(f"/proc/self/fd/{self.write_fd}", os.O_WRONLY | os.O_NONBLOCK)
        try:
            for chunk in (4096, 1):
                try:
                    while True:
                        os.write(fd, b"\0" * chunk)
                except BlockingIOError:
                    pass
        finally:
            os.close(fd)

    def unblock(self) -> None:
        self._copying.set()


def leader_row(dsn: str, schema: str) -> tuple[int, str | None]:
    """(epoch, instance_id) of the current term, if its lock session is alive."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            f'SELECT epoch, instance_id, released_at IS NULL AND EXISTS '
            f'(SELECT 1 FROM pg_stat_activity a WHERE a.pid = l.backend_pid) FROM "{schema}".leader l').fetchone()
    return row[0], (row[1] if row[2] else None)


def lock_holders(dsn: str, schema: str) -> list[str]:
    """application_name of every session holding the schema's leader lock."""
    from maintd.db import advisory_key

    c, o = advisory_key(schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [r[0] for r in conn.execute(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.classid::bigint = %s AND l.objid::bigint = %s "
            "AND l.objsubid = 2 AND l.granted", (c & 0xFFFFFFFF, o & 0xFFFFFFFF))]


def target_locks(dsn: str, schemas: list[str]) -> dict[str, tuple[str, int]]:
    """schema -> (instance_id, backend pid) of the session holding its leader lock (the
    database's view), for daemons with several targets (SPEC 7.9)."""
    from maintd.db import advisory_key

    by_key = {advisory_key(s)[1] & 0xFFFFFFFF: s for s in schemas}
    classid = advisory_key(schemas[0])[0] & 0xFFFFFFFF
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT l.objid::bigint, a.application_name, l.pid FROM pg_locks l "
            "JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 AND l.classid::bigint = %s",
            (classid,)).fetchall()
    return {by_key[objid]: (app.removeprefix("maintd:"), pid) for objid, app, pid in rows if objid in by_key}


def target_leaders(dsn: str, schemas: list[str]) -> dict[str, str]:
    """schema -> instance_id of the session holding its leader lock (see target_locks)."""
    return {schema: instance for schema, (instance, _) in target_locks(dsn, schemas).items()}


def all_led(dsn: str, schemas: list[str], replicas: list[str]) -> Any:
    """The leaderships per replica when every target is led by one of ``replicas``, else None."""
    from collections import Counter

    led = target_leaders(dsn, schemas)
    per = Counter(led.values())
    return per if len(led) == len(schemas) and set(per) <= set(replicas) else None


def spread_ok(dsn: str, schemas: list[str], replicas: list[str]) -> Any:
    """The leaderships per replica when every target is led by one of ``replicas`` and none leads
    more than ceil(T/R) + 1 (SPEC 7.9), else None."""
    import math

    per = all_led(dsn, schemas, replicas)
    limit = math.ceil(len(schemas) / len(replicas)) + 1
    return per if per and max(per.values()) <= limit else None


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_new_leader(dsn: str, schema: str, old_epoch: int, timeout: float) -> tuple[int, str]:
    def check():
        epoch, inst = leader_row(dsn, schema)
        return (epoch, inst) if epoch > old_epoch and inst else None

    return wait_for(check, timeout, what="a new leader")


# The COMMIT half of both write audits (this module's and tests/scenarios.AUDIT), for a
# ``{schema}.write_audit`` table with ``seq``, ``committed_at``, ``committed_epoch`` and
# ``committed_instance`` columns: each audit record, when its writer commits, gets the leader row
# as it is then (a deferred constraint trigger fires at COMMIT, after the fence's check).
AUDIT_AT_COMMIT = """
CREATE FUNCTION {schema}.write_audit_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  UPDATE {schema}.write_audit w
     SET committed_at = clock_timestamp(), committed_epoch = l.epoch, committed_instance = l.instance_id
    FROM {schema}.leader l WHERE l.name = 'leader' AND w.seq = NEW.seq;
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER write_audit_commit AFTER INSERT ON {schema}.write_audit
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {schema}.write_audit_commit();
"""


def install_write_audit(dsn: str, schema: str, tables: tuple[str, ...] = ("jobs", "service_runs")) -> None:
    """Record every committed write statement on ``tables`` (even one that changed no row): who
    (application_name, backend pid), which transaction, when, and the leader row (epoch,
    instance) as it was committed when the statement ran, and again at the writer's COMMIT
    (``committed_epoch``, ``committed_instance``: :data:`AUDIT_AT_COMMIT`)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f'CREATE TABLE "{schema}".write_audit (seq bigserial PRIMARY KEY, at timestamptz NOT NULL, '
            f"app text, backend_pid int, txid xid8, tbl text, op text, leader_epoch bigint, leader_instance text, "
            f"committed_at timestamptz, committed_epoch bigint, committed_instance text)")
        conn.execute(AUDIT_AT_COMMIT.replace("{schema}", f'"{schema}"'))
        conn.execute(
            f'CREATE FUNCTION "{schema}".audit_write() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN '
            f'INSERT INTO "{schema}".write_audit (at, app, backend_pid, txid, tbl, op, leader_epoch, leader_instance) '
            f"SELECT clock_timestamp(), current_setting('application_name'), pg_backend_pid(), "
            f"pg_current_xact_id(), TG_TABLE_NAME, TG_OP, l.epoch, l.instance_id "
            f"""FROM "{schema}".leader l WHERE l.name = 'leader'; RETURN NULL; END $$""")
        for table in tables:
            conn.execute(f'CREATE TRIGGER audit_write AFTER INSERT OR UPDATE OR DELETE ON "{schema}"."{table}" '
                         f'FOR EACH STATEMENT EXECUTE FUNCTION "{schema}".audit_write()')


def audited_writes(dsn: str, schema: str) -> list[dict]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(f'SELECT * FROM "{schema}".write_audit ORDER BY seq')
        names = [d.name for d in cur.description]
        return [dict(zip(names, row)) for row in cur.fetchall()]


@contextmanager
def jobs_locked(engine: Any, schema: str, ids: int | list[int]) -> Iterator[None]:
    """The jobs ``ids`` (one id or a list) locked FOR UPDATE by another session (a worker's
    transaction) while the block runs."""
    from maintd.queries import sql

    holder = engine.connect()
    try:
        holder.execute(sql("SELECT 1 FROM {schema}.jobs WHERE id = ANY(:ids) FOR UPDATE", schema),
                       {"ids": [ids] if isinstance(ids, int) else list(ids)})
        yield
    finally:
        holder.rollback()
        holder.close()
