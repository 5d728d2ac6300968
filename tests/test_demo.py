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


def test_demo_runs_and_every_service_acts():
    proc = subprocess.Popen([sys.executable, "-m", "maintd", "demo", "--duration", "15",
                             "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout))
    reader.start()
    port = None
    deadline = time.monotonic() + 30
    while port is None and time.monotonic() < deadline:
        m = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", "".join(lines))
        port = int(m.group(1)) if m else None
        time.sleep(0.1)
    assert port, "".join(lines)

    def leading() -> bool:  # the URL is printed as soon as the daemon starts, before it leads
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return b'maintd_is_leader{target="maintd"} 1.0' in r.read()

    wait_for(leading, 15, what="the demo daemon to lead")
    assert proc.wait(90) == 0
    reader.join()
    out = "".join(lines)
    last = out.strip().splitlines()[-3:]
    stats = dict(re.findall(r"(cleaner deleted|rescuer rescued|scheduler promoted|periodic enqueued)=(\d+)",
                            " ".join(last)))
    assert int(stats["cleaner deleted"]) > 0 and int(stats["rescuer rescued"]) > 0, out[-800:]
    assert int(stats["scheduler promoted"]) > 0 and int(stats["periodic enqueued"]) > 0, out[-800:]
    assert "maintd demo: done" in out and "Traceback" not in out
