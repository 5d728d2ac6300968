"""HTTP clients hammering a daemon, in a process of their own (so that the test's own probes are
not slowed by the clients' threads):

    python -m tests.flood PORT SECONDS CLIENTS PATH [PATH ...]

Each client requests the paths in turn until SECONDS have passed; prints one JSON line:
``{"calls": n, "by_status": {"200": n, "503": n, "-1": n}, "p50": s, "max": s, "ok_by_quarter":
[n, n, n, n]}`` (-1: the request failed: refused, reset or timed out after 30 s; the 200s answered
in each quarter of the run)."""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request


def main(port: int, seconds: float, clients: int, paths: list[str]) -> dict:
    results: list[tuple[int, float, float]] = []  # (status, seconds, when it ended, from the start)
    start = time.monotonic()
    end = start + seconds

    def client(i: int) -> None:
        k = i
        while time.monotonic() < end:
            started = time.monotonic()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{paths[k % len(paths)]}", timeout=30) as r:
                    r.read()
                    status = r.status
            except urllib.error.HTTPError as e:
                e.read()
                status = e.code
            except OSError:
                status = -1
            results.append((status, time.monotonic() - started, time.monotonic() - start))
            k += 1
            if status in (503, -1):
                time.sleep(0.05)  # as a browser or a script would: not a busy loop

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 35)
    by_status: dict[str, int] = {}
    for status, _, _ in results:
        by_status[str(status)] = by_status.get(str(status), 0) + 1
    seconds_ok = [s for status, s, _ in results if status == 200] or [0.0]
    quarters = [sum(1 for status, _, at in results if status == 200 and q * seconds / 4 <= at < (q + 1) * seconds / 4)
                for q in range(4)]
    return {"calls": len(results), "by_status": by_status, "p50": statistics.median(seconds_ok),
            "max": max(seconds_ok), "ok_by_quarter": quarters}


if __name__ == "__main__":
    port, seconds, clients, *paths = sys.argv[1:]
    print(json.dumps(main(int(port), float(seconds), int(clients), paths)), flush=True)
