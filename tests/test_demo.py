"""`maintd demo` on a fresh embedded PostgreSQL: every service visibly acts, /metrics answers."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import psycopg
import pytest

from .procs import wait_for

pytestmark = pytest.mark.slow


def test_demo_runs_two_daemons_fails_over_and_every_service_acts():
    """Two `maintd run` processes; midway the leader is SIGKILLed and the other one leads; every
    final state is reached (completed, cancelled, discarded); the last summary is printed once."""
    proc = subprocess.Popen([sys.executable, "-m", "maintd", "demo", "--duration", "36",
                             "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout))
    reader.start()
    ports: list[int] = []
    deadline = time.monotonic() + 60
    while len(ports) < 2 and time.monotonic() < deadline:
        ports = [int(p) for p in re.findall(r"http://127\.0\.0\.1:(\d+)/metrics", "".join(lines))]
        time.sleep(0.1)
    assert len(ports) == 2, "".join(lines)
    # Its PostgreSQL asks a password of every TCP connection: with trust, any local user could be
    # its superuser while the demo ran (and run programs as its user, COPY ... TO PROGRAM).
    port = re.search(r"PostgreSQL postgresql://postgres:[^@\s]+@127\.0\.0\.1:(\d+)/", "".join(lines))
    assert port, "".join(lines)
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(f"postgresql://postgres@127.0.0.1:{port.group(1)}/postgres", connect_timeout=5).close()

    def leaders() -> int:  # the URLs are printed as soon as the daemons listen, before one leads
        n = 0
        for port in ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                n += b'maintd_is_leader{target="maintd"} 1.0' in r.read()
        return n == 1

    wait_for(leaders, 20, what="exactly one demo daemon to lead")
    assert proc.wait(120) == 0
    reader.join()
    out = "".join(lines)
    assert "Traceback" not in out and out.rstrip().endswith("maintd demo: done"), out[-1500:]
    killed = re.search(r"killed the leader (demo-[ab]) \(pid \d+\) with SIGKILL", out)
    assert killed, out[-1500:]
    before, after = out[:killed.start()], out[killed.end():]
    other = {"demo-a": "demo-b", "demo-b": "demo-a"}[killed.group(1)]
    assert f"leader={killed.group(1)} " in before, before[-1500:]
    assert f"leader={other} " in after, after  # the survivor took over
    summaries = re.findall(r"^\[ *\d+s\] leader=.*\n.*$", out, re.M)
    assert len(summaries) >= 8 and len(set(summaries)) == len(summaries), out  # none printed twice
    last = summaries[-1]
    stats = {k: int(v) for k, v in re.findall(r"(cleaner deleted|rescuer rescued|scheduler promoted|periodic enqueued"
                                              r"|completed|cancelled|discarded)=(\d+)", last.split("| workers")[1])}
    totals = {k: int(v) for k, v in re.findall(r"(cleaner deleted|rescuer rescued|scheduler promoted"
                                               r"|periodic enqueued)=(\d+)", last)}
    assert all(n > 0 for n in totals.values()) and len(totals) == 4, last
    assert stats["completed"] > 0 and stats["cancelled"] > 0 and stats["discarded"] > 0, last
    # A report held a snapshot 20 s midway; a daemon's guardian named it (issue 27).
    report = re.search(r"a report \(pid (\d+), application demo-report\) holds a snapshot", out)
    assert report, out[-2000:]
    guardian = re.findall(r"^maintd demo: guardian of demo-[ab]: vacuum is held back.*$", out, re.M)
    assert guardian and all(f"pid={report.group(1)}" in g and "application_name=demo-report" in g
                            and "kind=snapshot" in g for g in guardian), out[-2000:]


# -- no process left behind, from any directory (issue 28 rows 5 and 6) --------------------------

MAINTD = str(Path(sys.executable).parent / "maintd")  # the console script a user runs


def marked_env() -> tuple[dict[str, str], str]:
    """The environment with a mark that every process the demo starts inherits (its daemons and
    its PostgreSQL), so that any left behind can be found in /proc, orphaned or not."""
    mark = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAINTD_")}
    return {**env, "DEMO_TEST_MARK": mark}, mark


def marked(mark: str) -> list[str]:
    """``pid cmdline`` of the live processes carrying ``mark`` (zombies have no environment)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if f"DEMO_TEST_MARK={mark}".encode() in (d / "environ").read_bytes():
                cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{d.name} {cmdline}")
        except OSError:
            continue
    return found


def busy_port_pair() -> tuple[socket.socket, int]:
    """A socket holding port 9464 (the default) when it can, else some port P with P + 1 free."""
    for port in [9464] + list(range(20000, 20400, 2)):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
        except OSError:
            s.close()
            if port == 9464:
                return None, 9464  # already busy: that is the case at hand
            continue
        return s, port
    raise AssertionError("no free port")


def test_demo_with_its_port_busy_fails_clearly_and_leaves_no_process():
    """The issue: exit 1 and an orphan `maintd run` (demo-b) holding :9465, retrying for ever."""
    holder, port = busy_port_pair()
    env, mark = marked_env()
    try:
        res = subprocess.run([MAINTD, "demo", "--listen", f"127.0.0.1:{port}", "--duration", "30"],
                             capture_output=True, text=True, env=env, timeout=120)
    finally:
        if holder is not None:
            holder.close()
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"127.0.0.1:{port}" in res.stderr and "cannot listen" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    wait_for(lambda: not marked(mark), 10, what=f"no process left (left: {marked(mark)})")


def healthz(port: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_demo_from_a_folder_holding_maintd_killed_leaves_no_process(tmp_path):
    """A ``maintd/`` folder in the working directory (a checkout's parent, a project of that
    name) must not shadow the package in the daemons; and a SIGKILLed demo takes them (and its
    PostgreSQL) along."""
    (tmp_path / "maintd").mkdir()
    (tmp_path / "maintd" / "__init__.py").write_text("")  # no __version__: the ImportError
    env, mark = marked_env()
    proc = subprocess.Popen([MAINTD, "demo", "--listen", "127.0.0.1:0"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        ports = wait_for(lambda: re.findall(r"on http://127\.0\.0\.1:(\d+)/metrics", "".join(lines)) or
                         (proc.poll() is not None and pytest.fail("".join(lines))), 90, what="the daemons")
        assert len(ports) == 2
        for port in ports:  # (503 while a daemon still starts)
            wait_for(lambda: healthz(port) == 200, 30, what=f"/healthz 200 on :{port}")
        assert len(marked(mark)) >= 4  # the demo, two daemons, PostgreSQL (and its processes)
    finally:
        proc.kill()  # SIGKILL: no clean-up code runs in the demo
        proc.wait()
    wait_for(lambda: not marked(mark), 15, what=f"no process left (left: {marked(mark)})")
    assert "ImportError" not in "".join(lines)


def test_the_readme_names_the_daemon_whose_guardian_speaks_in_the_demo_it_shows():
    """"Try it" runs `maintd demo` (until Ctrl-C): the leader demo-a is killed at 30 s and the
    report holds its snapshot at 45 s, so the guardian line comes from demo-b, the leader by then
    (a 72 s run here: `maintd demo: guardian of demo-b: vacuum is held back ...`). The README
    showed `guardian of demo-a`, which only a `--duration` run prints (its report comes first)."""
    from maintd.demo import FIRST_KILL, HOLD_AT

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    start = readme.index("## Try it")
    shown = re.findall(r"`guardian of (demo-[ab]):", readme[start:readme.index("\n## ", start + 1)])
    leader = "demo-b" if HOLD_AT > FIRST_KILL else "demo-a"
    assert shown and shown[0] == leader, (shown, FIRST_KILL, HOLD_AT)
