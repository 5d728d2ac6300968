"""Debian's PgBouncer (``/usr/sbin/pgbouncer``) in front of a test PostgreSQL.

    with PgBouncer(pg_dsn, pool_mode="transaction") as bouncer:
        bouncer.dsn                  # pg_dsn, through the pooler
        bouncer.show("POOLS")        # rows of the admin console's SHOW POOLS

It listens on a free loopback port (no Unix socket), with ``auth_type = trust`` (the test servers
trust every local connection, so the pooler only needs to know the user name) and its own temp
dir. PgBouncer refuses to run as root: as root it runs as ``postgres`` (or ``nobody``) with a
parent-death signal, as :mod:`maintd.embedded` runs PostgreSQL, so it never outlives the tests.
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
import psycopg.conninfo

from maintd.embedded import _drop_privileges, _service_user, free_port

from .tools import path, require

PGBOUNCER = path("pgbouncer")


class PgBouncer:
    def __init__(self, server_dsn: str, *, pool_mode: str = "session", pool_size: int = 20,
                 settings: dict[str, str] | None = None):
        require("pgbouncer")
        self.server = psycopg.conninfo.conninfo_to_dict(server_dsn)
        self.user = _service_user()
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="mpgb", dir="/tmp"))
        self.pool_mode = pool_mode
        self.settings = {
            "listen_addr": "127.0.0.1",
            "listen_port": str(self.port),
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": str(self.dir / "userlist.txt"),
            "admin_users": self.server.get("user") or "postgres",
            "pool_mode": pool_mode,
            "default_pool_size": str(pool_size),
            "max_client_conn": "500",
            "ignore_startup_parameters": "extra_float_digits,options",
            "server_login_retry": "1",
            "logfile": str(self.dir / "pgbouncer.log"),
            **(settings or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def dsn(self) -> str:
        """The server's DSN with the pooler's address (TLS off: the pooler has no certificate)."""
        info = dict(self.server)
        info.update(host="127.0.0.1", port=str(self.port), sslmode="disable")
        return psycopg.conninfo.make_conninfo(**info)

    def _write_config(self) -> Path:
        host = self.server.get("host") or "127.0.0.1"
        upstream = f"host={host} port={self.server.get('port') or 5432}"
        user = self.server.get("user") or "postgres"
        (self.dir / "userlist.txt").write_text(f'"{user}" ""\n')
        lines = ["[databases]", f"* = {upstream}", "", "[pgbouncer]"]
        lines += [f"{k} = {v}" for k, v in self.settings.items()]
        ini = self.dir / "pgbouncer.ini"
        ini.write_text("\n".join(lines) + "\n")
        if self.user is not None:
            for p in (self.dir, *self.dir.iterdir()):
                os.chown(p, self.user.pw_uid, self.user.pw_gid)
        return ini

    def start(self, timeout: float = 15.0) -> "PgBouncer":
        ini = self._write_config()
        out = open(self.dir / "stdout.log", "ab")
        self.proc = subprocess.Popen([PGBOUNCER, str(ini)], stdout=out, stderr=out, cwd="/",
                                     preexec_fn=_drop_privileges(self.user, signal.SIGKILL))
        out.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                psycopg.connect(self.dsn, connect_timeout=2).close()
                return self
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pgbouncer did not answer in {timeout}s:\n{self.log_tail()}")
                time.sleep(0.05)

    def admin(self, command: str) -> list[dict]:
        """One command on the admin console (``SHOW POOLS``, ``KILL db``, ``RESUME``), rows as dicts."""
        info = psycopg.conninfo.conninfo_to_dict(self.dsn)
        info["dbname"] = "pgbouncer"
        with psycopg.connect(psycopg.conninfo.make_conninfo(**info), autocommit=True,
                             prepare_threshold=None) as conn:
            cur = conn.execute(command)
            if cur.description is None:
                return []
            names = [c.name for c in cur.description]
            return [dict(zip(names, row)) for row in cur.fetchall()]

    def show(self, what: str) -> list[dict]:
        return self.admin(f"SHOW {what}")

    def kill_clients(self) -> None:
        """Drop every client and server connection of the database (``KILL``), then ``RESUME``."""
        db = self.server.get("dbname") or "postgres"
        self.admin(f"KILL {db}")
        self.admin(f"RESUME {db}")

    def log_tail(self, n: int = 30) -> str:
        text = ""
        for name in ("pgbouncer.log", "stdout.log"):
            try:
                text += (self.dir / name).read_text(errors="replace")
            except OSError:
                pass
        return "\n".join(text.splitlines()[-n:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # 1.18: immediate shutdown
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "PgBouncer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
