"""The shared lock session: its turn-taking (maintd.lockconn.FairLock: arrival order, reentrancy,
how long the holder has held it, so the watchdog severs a session whose statement hangs, not one
whose queue is long), and giving one target's lock up on it (PostgreSQL's advisory-lock rules)."""

from __future__ import annotations

import threading
import time

import pytest

from maintd.lockconn import FairLock

from .procs import wait_for
from .tools import unavailable


def test_turns_are_granted_in_arrival_order():
    lock = FairLock()
    order: list[int] = []
    lock.acquire()
    threads = []
    for i in range(8):
        t = threading.Thread(target=lambda i=i: (lock.acquire(), order.append(i), lock.release()))
        t.start()
        threads.append(t)
        wait_for(lambda i=i: len(lock._queue) == i + 1, 5, 0.001, what=f"waiter {i} queued")
    lock.release()
    for t in threads:
        t.join(5)
    assert order == list(range(8))
    assert lock.acquire(blocking=False)  # free again
    lock.release()


def test_reentrant_and_non_blocking_try():
    lock = FairLock()
    with lock:
        with lock:  # the same thread again (a view's close() runs statements inside the lock)
            pass
        other: list[bool] = []
        t = threading.Thread(target=lambda: other.append(lock.acquire(blocking=False)))
        t.start()
        t.join(5)
        assert other == [False]  # still held by us after the inner release
    t = threading.Thread(target=lambda: other.append(lock.acquire(blocking=False)) or lock.release())
    t.start()
    t.join(5)
    assert other == [False, True]


def test_held_for_counts_from_each_owner_s_turn():
    lock = FairLock()
    assert lock.held_for() == 0.0
    lock.acquire()
    time.sleep(0.3)
    waiter = threading.Thread(target=lambda: (lock.acquire(), time.sleep(0.2), lock.release()))
    waiter.start()
    wait_for(lambda: len(lock._queue) == 1, 5, 0.001, what="the waiter queued")
    assert lock.held_for() >= 0.3
    lock.release()
    wait_for(lambda: not lock._queue, 5, 0.001, what="the waiter's turn")
    assert lock.held_for() < 0.2  # the new owner's time, not the queue's
    waiter.join(5)
    assert lock.held_for() == 0.0


# -- giving one target's lock up on a shared session, as PostgreSQL documents advisory locks ------
# https://www.postgresql.org/docs/current/functions-admin.html#FUNCTIONS-ADVISORY-LOCKS:
# "If a session already holds a given advisory lock, additional requests by it will always
# succeed ... the lock must be released as many times as it was acquired"; pg_advisory_unlock of a
# lock not held "returns false, and in addition, an SQL warning will be reported by the server".


def test_unlock_held_releases_each_level_and_never_draws_the_warning(pg_dsn):
    import psycopg

    from maintd.db import advisory_key
    from maintd.queries import leader as q
    from maintd.queries import psycopg_sql

    classid, objid = advisory_key("lockconn_doc_case")
    key = {"classid": classid, "objid": objid}
    notices: list[str] = []
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.add_notice_handler(lambda diag: notices.append(f"{diag.severity}: {diag.message_primary}"))
        # The documented behaviour first, on the real server.
        assert conn.execute(psycopg_sql(q.UNLOCK), key).fetchone()[0] is False
        assert notices == ["WARNING: you don't own a lock of type ExclusiveLock"], notices
        notices.clear()
        # Taken twice (stacked), UNLOCK_HELD releases one level per call, then says false quietly.
        for _ in range(2):
            assert conn.execute(psycopg_sql(q.TRY_LOCK), key).fetchone()[0] is True
        got = [conn.execute(psycopg_sql(q.UNLOCK_HELD), key).fetchone()[0] for _ in range(3)]
        assert got == [True, True, False]
        assert notices == []
        with psycopg.connect(pg_dsn, autocommit=True) as other:  # really free now
            assert other.execute(psycopg_sql(q.TRY_LOCK), key).fetchone()[0] is True


def test_an_idle_session_hands_on_notifies_with_descriptors_above_fd_setsize(pg_dsn, tmp_path):
    """The listener thread reads what an idle lock session receives (a hand-over NOTIFY that
    wakes a follower, a periodic_jobs change). A process of many targets holds many
    descriptors: with its socket above FD_SETSIZE (1024), select() raised ValueError, the
    listener stopped, and NOTIFYs waited for the session's next statement (up to a third of the
    lease). It also no longer polls every 5 ms while a statement is in flight. Reference: the
    select(2) man page, "select() can monitor only file descriptors numbers that are less than
    FD_SETSIZE (1024)", and Python's select.select raising ValueError for such a descriptor."""
    import os
    import resource

    import psycopg

    from maintd.config import Settings
    from maintd.lockconn import LockConnection

    # The common default soft limit is 1,024: raise it for this test (up to the hard limit, which
    # an unprivileged process may do; the shipped units raise it too), and put it back after.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1200
    if hard != resource.RLIM_INFINITY and hard < wanted:
        unavailable(f"needs {wanted} descriptors, the hard limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    filler: list[int] = []
    lock_conn = None
    try:
        filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
        heard = threading.Event()
        lock_conn = LockConnection(Settings(database_url=pg_dsn, instance_id=f"fd-{os.getpid()}"))
        conn, _ = lock_conn.attach({"maintd_fd_test": heard.set})
        assert conn.fileno() > 1024
        time.sleep(0.3)  # the listener is waiting in poll()
        with psycopg.connect(pg_dsn, autocommit=True) as other:
            other.execute("NOTIFY maintd_fd_test")
        assert heard.wait(5), "the NOTIFY was not handed on"
    finally:
        if lock_conn is not None:
            lock_conn.close()
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
