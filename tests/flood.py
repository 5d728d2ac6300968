"""HTTP clients hammering a daemon, in a process of their own (so that the test's own probes are
not slowed by the clients' threads):

    python -m tests.flood PORT SECONDS CLIENTS PATH [PATH ...]
    python -m tests.flood --pipeline PORT SECONDS CLIENTS PATH

Each client requests the paths in turn until SECONDS have passed; prints one JSON line:
``{"calls": n, "by_status": {"200": n, "503": n, "-1": n}, "p50": s, "max": s, "ok_by_quarter":
[n, n, n, n]}`` (-1: the request failed: refused, reset or timed out after 30 s; the 200s answered
in each quarter of the run).

With ``--pipeline``, each client keeps one connection and sends 20 requests at a time before it
reads their answers (as a scraper gone wrong might): ``{"calls": n, "by_status": {...}}``."""

from __future__ import annotations

import asyncio
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


async def pipelined(port: int, seconds: float, clients: int, path: str, batch: int = 20) -> dict:
    by_status: dict[str, int] = {}
    end = time.monotonic() + seconds
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode() * batch

    async def client() -> None:
        while time.monotonic() < end:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                by_status["-1"] = by_status.get("-1", 0) + 1
                await asyncio.sleep(0.05)
                continue
            try:
                while time.monotonic() < end and await _answers(reader, writer, request, batch, by_status):
                    pass
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
                by_status["-1"] = by_status.get("-1", 0) + 1
            writer.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return {"calls": sum(by_status.values()), "by_status": by_status}


async def _answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes, batch: int,
                   by_status: dict[str, int]) -> bool:
    """Send a batch of requests, read their answers; whether the connection stays open."""
    writer.write(request)
    await writer.drain()
    for _ in range(batch):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next(int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:"))
        await reader.readexactly(length)
        by_status[lines[0][9:12]] = by_status.get(lines[0][9:12], 0) + 1
        if "Connection: close" in lines:
            return False
    return True


if __name__ == "__main__":
    if sys.argv[1] == "--pipeline":
        port, seconds, clients, path = sys.argv[2:]
        result = asyncio.run(pipelined(int(port), float(seconds), int(clients), path))
    else:
        port, seconds, clients, *paths = sys.argv[1:]
        result = main(int(port), float(seconds), int(clients), paths)
    print(json.dumps(result), flush=True)
