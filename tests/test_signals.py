"""The daemon's signal handlers take no lock. Python runs a handler between two bytecodes of the
main thread; when that thread held the lock of the Event the handler set (inside
``Event.wait``, as the main loop is most of the time), the handler waited for itself forever: a
SIGTERM was logged and the daemon never stopped (seen once in CI, under load, in
test_clock_skew). Here the signal lands while the lock is held, every time.

Outside references: the ``signal`` module's documentation ("Synchronization primitives such as
threading.Lock should not be used within signal handlers. Doing so can lead to unexpected
deadlocks."); python/cpython#126434, the same deadlock with ``multiprocessing.Event.set()`` from
a SIGTERM handler; and bpo-24283, a reentrant write when a handler logs (the handler no longer
logs either: the main loop writes the line)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, signal
    from maintd.config import Settings
    from maintd.daemon import Daemon
    from maintd.logs import setup_logging

    setup_logging()
    d = Daemon(Settings(database_url="postgresql://nobody@127.0.0.1:1/none", http={"enabled": False}))

    def start():
        with d._stopping._cond:  # what the main thread holds inside _stopping.wait()
            os.kill(os.getpid(), signal.SIG%s)
            for _ in range(1000):  # bytecodes for the handler to run between
                pass
        d._started = True
        return True

    d.start = start
    print("exit", d.run_forever(), flush=True)
""")


def run(signame: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT % signame], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"SIG{signame} while the lock was held: the daemon did not stop\n{err}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_sigterm_and_sigint_stop_the_daemon_even_when_they_land_inside_a_wait():
    for signame in ("TERM", "INT"):
        done = run(signame)
        assert (done.returncode, done.stdout) == (0, "exit 0\n"), done.stderr
        assert f"stopping on a signal signal=SIG{signame}" in done.stderr
        assert "stopped during start-up" in done.stderr  # it came before the main loop's first turn
