"""A PostgreSQL 15 primary and its streaming standby, for failover tests (Debian's binaries).

    with StandbyPair() as pair:
        pair.primary.dsn, pair.standby.dsn
        pair.multi_host_dsn()        # host=127.0.0.1,127.0.0.1 port=P1,P2 target_session_attrs=read-write
        pair.primary.freeze()        # SIGSTOP the postmaster and every backend (thaw() = SIGCONT)
        pair.standby.promote()

Each server lives under a short ``/tmp`` path, listens on a free loopback port, runs as
``postgres`` (or ``nobody``) when we are root (initdb refuses root) and gets a parent-death
signal. The standby is ``pg_basebackup -R`` of the primary, streaming.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from maintd.embedded import _drop_privileges, _service_user, free_port

from .tools import path, require

PG15_BIN = Path(path("postgres-15")).parent

SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "full_page_writes": "off",
    "max_connections": "100",
    "shared_buffers": "32MB",
    "wal_level": "replica",
    "max_wal_senders": "5",
    "hot_standby": "on",
    "wal_receiver_timeout": "5s",
    "logging_collector": "off",
    "log_min_messages": "warning",
}


class PgNode:
    """One server of the pair: ``dsn``, ``start``, ``stop``, ``freeze``/``thaw``, ``kill``, ``promote``."""

    def __init__(self, base: Path, name: str):
        self.user = _service_user()
        self.name = name
        self.dir = base / name
        self.data = self.dir / "data"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.frozen = False

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres connect_timeout=3"

    def _run(self, *cmd: str) -> None:
        res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd="/",
                             preexec_fn=_drop_privileges(self.user, signal.SIGKILL))
        if res.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed: {res.stderr.strip() or res.stdout.strip()}")

    def _own(self, path: Path) -> None:
        if self.user is not None:
            os.chown(path, self.user.pw_uid, self.user.pw_gid)

    def prepare_dir(self) -> None:
        self.dir.mkdir(parents=True)
        os.chmod(self.dir, 0o755)
        self._own(self.dir)

    def initdb(self) -> None:
        self.prepare_dir()
        self._run(PG15_BIN / "initdb", "-D", self.data, "-U", "postgres", "--auth=trust",
                  "--locale=C", "-E", "UTF8", "--no-sync")

    def basebackup_of(self, primary: "PgNode") -> None:
        self.prepare_dir()
        self._run(PG15_BIN / "pg_basebackup", "-h", "127.0.0.1", "-p", primary.port, "-U", "postgres",
                  "-D", self.data, "-R", "-X", "stream", "-c", "fast", "--no-sync")

    def start(self, timeout: float = 30.0) -> "PgNode":
        log = open(self.dir / "postgres.log", "ab")
        self._own(self.dir / "postgres.log")
        cmd = [str(PG15_BIN / "postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.data)]
        for key, value in SETTINGS.items():
            cmd += ["-c", f"{key}={value}"]
        # setsid in _demote: the postmaster leads a process group holding all its backends.
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd="/",
                                     preexec_fn=_drop_privileges(self.user, signal.SIGQUIT))
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: postgres exited early:\n{self.log_tail()}")
            try:
                psycopg.connect(self.dsn).close()
                return self
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name}: postgres did not start:\n{self.log_tail()}")
                time.sleep(0.05)

    def processes(self) -> list[int]:
        """The postmaster and its children. (Each backend calls setsid() when forked, so the
        postmaster's process group holds the postmaster alone.)"""
        if self.proc is None or self.proc.poll() is not None:
            return []
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            children = []
        return [self.proc.pid, *map(int, children)]

    def _signal_all(self, sig: int, pids: list[int] | None = None) -> None:
        for pid in self.processes() if pids is None else pids:  # the postmaster first: stopped, it forks no more
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def freeze(self) -> None:
        """SIGSTOP the whole server, postmaster and every backend: sockets stay open and the
        kernel keeps acknowledging, nothing answers."""
        self._signal_all(signal.SIGSTOP)
        self._signal_all(signal.SIGSTOP)  # a child forked while the postmaster was being stopped
        self.frozen = True
        deadline = time.monotonic() + 5
        # The kernel stops them asynchronously; a child whose fork was under way when the
        # postmaster stopped shows up late (signalled again), and a backend that exited just before
        # stays a zombie the stopped postmaster cannot reap (it runs nothing: not waited for).
        while running := set(self.processes()) - set(self.stopped()) - set(self.zombies()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: not every process stopped: {sorted(running)}")
            self._signal_all(signal.SIGSTOP, sorted(running))
            time.sleep(0.01)

    def _in_state(self, states: tuple[str, ...]) -> list[int]:
        out = []
        for pid in self.processes():
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in states:
                    out.append(pid)
            except OSError:
                pass
        return out

    def stopped(self) -> list[int]:
        """The server's processes the kernel reports stopped (state T)."""
        return self._in_state(("T", "t"))

    def zombies(self) -> list[int]:
        """The server's children that exited and were not reaped (state Z)."""
        return self._in_state(("Z", "X"))

    def thaw(self) -> None:
        self._signal_all(signal.SIGCONT)
        self.frozen = False

    def kill(self) -> None:
        pids = self.processes()  # listed first: the children of a dead postmaster are not its children
        self._signal_all(signal.SIGKILL, pids)
        self._signal_all(signal.SIGCONT, pids)
        if self.proc is not None:
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.frozen:
            self.kill()
            return
        self.proc.send_signal(signal.SIGINT)  # fast shutdown
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()
        self.proc = None

    def promote(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            if not conn.execute("SELECT pg_promote(wait => true, wait_seconds => 30)").fetchone()[0]:
                raise RuntimeError(f"{self.name}: promotion did not finish")

    def in_recovery(self) -> bool:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return bool(conn.execute("SELECT pg_is_in_recovery()").fetchone()[0])

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join((self.dir / "postgres.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class StandbyPair:
    def __init__(self) -> None:
        require("postgres-15", "pg_basebackup-15")
        self.base = Path(tempfile.mkdtemp(prefix="msb", dir="/tmp"))
        os.chmod(self.base, 0o755)
        self.primary = PgNode(self.base, "p")
        self.standby = PgNode(self.base, "s")

    def start(self) -> "StandbyPair":
        self.primary.initdb()
        self.primary.start()
        self.standby.basebackup_of(self.primary)
        self.standby.start()
        return self

    def multi_host_dsn(self, target_session_attrs: str = "read-write") -> str:
        return (f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} user=postgres "
                f"dbname=postgres target_session_attrs={target_session_attrs}")

    def wait_replayed(self, timeout: float = 15.0) -> None:
        """Until the standby has replayed everything the primary has written so far."""
        with psycopg.connect(self.primary.dsn, autocommit=True) as conn:
            lsn = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.standby.dsn, autocommit=True) as conn:
            while not conn.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (str(lsn),)).fetchone()[0]:
                if time.monotonic() > deadline:
                    raise RuntimeError("the standby did not catch up")
                time.sleep(0.05)

    def cleanup(self) -> None:
        for node in (self.standby, self.primary):
            try:
                node.stop()
            except Exception:
                node.kill()
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> "StandbyPair":
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
