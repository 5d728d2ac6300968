"""`maintd demo` on a fresh embedded PostgreSQL: every service visibly acts, /metrics answers."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
import urllib.request

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
