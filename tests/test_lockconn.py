"""The lock session of a database (maintd.lockconn, SPEC 8.3): the batched statements against what
PostgreSQL documents about advisory locks, and its reading of NOTIFYs between rounds."""

from __future__ import annotations

import os
import resource
import threading
import time

import psycopg
import pytest

from maintd.config import Settings
from maintd.db import HostOrder, advisory_key
from maintd.identifiers import quote_ident
from maintd.lockconn import LeaderSessionError, LockSession
from maintd.queries import leader as q
from maintd.queries import Statements, psycopg_sql

from .procs import wait_for
from .standby import StandbyPair
from .tools import unavailable

# https://www.postgresql.org/docs/current/functions-admin.html#FUNCTIONS-ADVISORY-LOCKS:
# "If a session already holds a given advisory lock, additional requests by it will always
# succeed ... the lock must be released as many times as it was acquired"; pg_advisory_unlock of a
# lock not held "returns false, and in addition, an SQL warning will be reported by the server".


def keys(tries=(), renewals=(), unlocks=(), marker="m", backend=0) -> dict:
    out = {"marker": marker, "backend": backend}
    for kind, names in (("try", tries), ("renew", renewals), ("unlock", unlocks)):
        pairs = [advisory_key(n) for n in names]
        out |= {f"{kind}_c": [p[0] for p in pairs], f"{kind}_o": [p[1] for p in pairs]}
    return out


def round_(conn, **kw) -> list[tuple]:
    """One ROUND on ``conn`` as the session checked on its own backend (unless ``backend`` says)."""
    return conn.execute(psycopg_sql(q.ROUND), keys(**{"backend": conn.info.backend_pid, **kw})).fetchall()


def test_one_round_tries_proves_and_unlocks_as_postgresql_documents(pg_dsn):
    notices: list[str] = []
    with psycopg.connect(pg_dsn, autocommit=True) as conn, psycopg.connect(pg_dsn, autocommit=True) as other:
        conn.add_notice_handler(lambda diag: notices.append(f"{diag.severity}: {diag.message_primary}"))
        conn.execute("SELECT set_config('maintd.session', 'm', false)")
        other.execute("SELECT set_config('maintd.session', 'o', false)")
        # The documented behaviour first, on the real server.
        c, o = advisory_key("lockconn_a")
        assert conn.execute("SELECT pg_advisory_unlock(%s, %s)", (c, o)).fetchone()[0] is False
        assert notices == ["WARNING: you don't own a lock of type ExclusiveLock"], notices
        notices.clear()
        pid = conn.info.backend_pid
        # Tries answered in order; another session's lock is not won.
        round_(other, tries=["lockconn_c"], marker="o")
        assert round_(conn, tries=["lockconn_a", "lockconn_b", "lockconn_c"]) == [
            (1, 1, True, True, True, pid), (1, 2, True, True, True, pid), (1, 3, False, True, True, pid)]
        # Proofs: held by this very backend; another session does not hold it, and is not ours.
        assert [r[:3] for r in round_(conn, renewals=["lockconn_a", "lockconn_c"])] == [(2, 1, True), (2, 2, False)]
        assert [r[2:4] for r in round_(other, renewals=["lockconn_a"])] == [(False, False)]
        # Unlocks only of what is held: no warning for c, which the other session holds.
        got = round_(conn, unlocks=["lockconn_a", "lockconn_c", "lockconn_b"])
        assert [r[2] for r in got] == [True, False, True] and notices == []
        # All three kinds in one statement, each answered in its place.
        got = round_(conn, tries=["lockconn_a"], renewals=["lockconn_b"], unlocks=["lockconn_d"])
        assert [r[:3] for r in got] == [(1, 1, True), (2, 1, False), (3, 1, False)]
        assert [r[2] for r in round_(other, tries=["lockconn_b", "lockconn_a"], marker="o")] == [True, False]


# https://www.pgbouncer.org/features.html: in transaction pooling "a server connection is assigned
# to a client only during a transaction"; its SQL feature map lists SET/RESET and session-level
# advisory locks as not supported there (the state stays on the server connection, for the next
# client). The two tests below play that next client's part on a real server.


def test_a_session_it_did_not_set_up_takes_and_frees_no_lock(pg_dsn):
    """Through a transaction pooler the round may reach a backend that another client uses next:
    a lock won there would stay with that client, and an unlock would free that client's lock."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn, psycopg.connect(pg_dsn, autocommit=True) as foreign:
        conn.execute("SELECT set_config('maintd.session', 'm', false)")
        foreign.execute("SELECT pg_advisory_lock(%s, %s)", advisory_key("lockconn_f"))
        got = round_(foreign, tries=["lockconn_e"], unlocks=["lockconn_f"])
        assert [r[:4] for r in got] == [(1, 1, False, False), (3, 1, False, False)]
        held = foreign.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()").fetchone()[0]
        assert held == 1, "the foreign backend won a lock, or lost its own"
        assert [r[2] for r in round_(conn, tries=["lockconn_e"])] == [True]  # free for the real session


def test_a_backend_that_carries_the_marker_but_was_not_checked_takes_no_lock(pg_dsn):
    """Under transaction pooling the marker's SET at connect can run on one pooled backend and the
    check (LockSession._verify) on another; the marker then sits on a backend another client gets
    next. A round there is not ours: the backend must be the checked one too."""
    with psycopg.connect(pg_dsn, autocommit=True) as pooled, psycopg.connect(pg_dsn, autocommit=True) as checked:
        pooled.execute("SELECT set_config('maintd.session', 'm', false)")
        got = round_(pooled, tries=["lockconn_g"], backend=checked.info.backend_pid)
        assert [r[:4] for r in got] == [(1, 1, False, False)]
        held = pooled.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()").fetchone()[0]
        assert held == 0, "a lock was taken on a backend the session was not checked on"
        assert [r[2:4] for r in round_(pooled, tries=["lockconn_g"])] == [(True, True)]  # the checked one: ours


def test_a_frozen_sessions_idle_timeout_stays_armed_after_a_round(pg_dsn):
    """SPEC 3: the server ends a frozen leader's session within the lease (idle_session_timeout,
    PostgreSQL 14+). A round must leave that timer armed: it did not after a psycopg pipeline."""
    settings = Settings(database_url=pg_dsn, instance_id=f"idle-{os.getpid()}",
                        leader={"lease": "1s", "renew_interval": "0.3s", "retry_interval": "0.2s"})
    session = LockSession(settings, HostOrder(pg_dsn), lambda channel: None)
    conn = session.connect([])
    if conn.info.server_version < 140000:
        session.close()
        unavailable("idle_session_timeout needs PostgreSQL 14+")
    try:
        session.round_trip([advisory_key("idle_a")], [], [])
        session.round_trip([], [advisory_key("idle_a")], [])
        pid = conn.info.backend_pid
        with psycopg.connect(pg_dsn, autocommit=True) as watcher:
            wait_for(lambda: not watcher.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchall(),
                     5, what="the idle session ended by the server")
    finally:
        session.close()


def test_a_waiting_loop_reads_notifies_with_descriptors_above_fd_setsize(pg_dsn):
    """Between rounds the loop waits in poll() on its session's socket and reads what arrives (a
    hand-over NOTIFY that wakes a follower, a periodic_jobs change). A process of many targets
    holds many descriptors: with the socket above FD_SETSIZE (1024), select() would raise
    ValueError (select(2): "select() can monitor only file descriptors numbers that are less than
    FD_SETSIZE"). The test raises its own soft limit to get there."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1300:
        unavailable(f"needs 1300 descriptors, the hard limit is {hard}")
    if soft < 1300:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    heard = threading.Event()
    settings = Settings(database_url=pg_dsn, instance_id=f"fd-{os.getpid()}")
    session = LockSession(settings, HostOrder(pg_dsn), lambda channel: channel == "maintd_fd_test" and heard.set())
    try:
        conn = session.connect(["maintd_fd_test"])
        assert conn.fileno() > 1024
        import select

        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)
        with psycopg.connect(pg_dsn, autocommit=True) as other:
            other.execute("NOTIFY maintd_fd_test")
        wait_for(lambda: poller.poll(100) and (session.drain() or heard.is_set()), 5, what="the NOTIFY")
    finally:
        session.close()
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_won_lock_is_bumped_only_on_the_session_that_was_set_up_and_holds_it(pg_dsn, schema):
    """SPEC 3: a term starts (the epoch bumped) only from the session holding the lock just won.
    The bump proves it first, on the very backend the bump will run on: held there, and the
    session's own (its marker and checked backend; a pooler switched to transaction mode between
    the try and the bump routes the statement to another client's backend, which may even hold
    the lock, as PgBouncer hands a locked backend on). Either missing: no bump, no term."""
    settings = Settings(database_url=pg_dsn, schema=schema, instance_id=f"bump-{os.getpid()}")
    session = LockSession(settings, HostOrder(pg_dsn), lambda channel: None)
    conn = session.connect([])
    key, psql = advisory_key(schema), Statements(schema).psql
    params = {"instance": settings.instance_id, "host": "h", "pid": os.getpid()}

    def epochs() -> list[int]:
        with psycopg.connect(pg_dsn, autocommit=True) as other:
            return [r[0] for r in other.execute(f"SELECT epoch FROM {quote_ident(schema)}.leader")]

    try:
        before = epochs()
        with pytest.raises(LeaderSessionError, match="not visible in this backend"):
            session.bump(key, psql, params, 100)  # not won: not held here
        assert session.round_trip([key], [], [])[0] == [True]
        marker, session.marker = session.marker, "another client's"  # held here, but not ours
        with pytest.raises(LeaderSessionError, match="not visible in this backend"):
            session.bump(key, psql, params, 100)
        assert epochs() == before, "a term was started from a session not set up"
        session.marker = marker
        epoch, pid, _ = session.bump(key, psql, params, 100)
        assert pid == conn.info.backend_pid and epochs() == [epoch] and epoch == max(before, default=0) + 1
    finally:
        session.close()


def test_a_multi_host_url_without_ports_still_puts_a_silent_host_last():
    """``postgresql://u@a,b/db`` (every host on the default port): the session reports the port
    it reached (5432), which the URL never wrote; the frozen host must still go last (and the host
    reached first), or every reconnect spends a whole connect timeout on it first."""
    order = HostOrder("postgresql://u@a,b/db")
    hosts = lambda: psycopg.conninfo.conninfo_to_dict(order.dsn())["host"]
    order.silent("a", 5432)
    assert hosts() == "b,a"
    order.reached("a", 5432)
    assert hosts() == "a,b"


def test_the_lock_session_prepares_no_statement_a_pooler_could_hand_to_another_backend(pg_dsn):
    """psycopg prepares a statement server-side after its fifth run (``prepare_threshold``), and a
    prepared statement lives in one backend. Behind a pooler switched to transaction mode, the lock
    session's next round reaches another client's backend: a prepared ROUND then fails with
    "prepared statement ... does not exist" or "... already exists" (the work pool prepared the same
    name there) before the round can see the marker and say that the session is not ours. CI met
    the second as "lost leadership reason=database error: prepared statement "_pg3_2" already
    exists". So the lock session prepares nothing: every round reaches the marker check."""
    settings = Settings(database_url=pg_dsn, instance_id=f"prep-{os.getpid()}")
    session = LockSession(settings, HostOrder(pg_dsn), lambda channel: None)
    conn = session.connect(["maintd_prep_test"])
    try:
        for _ in range(10):
            session.round_trip([advisory_key("prep_a")], [advisory_key("prep_a")], [])
        assert conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()[0] == 0
    finally:
        session.close()


def test_a_release_of_an_older_term_does_not_end_the_newer_one(pg_dsn, schema):
    """RELEASE records the end of the term it names (epoch and instance), never of a newer one.
    The daemon sends it only while its session still holds the lock, so no newer term can exist
    then, and its ``epoch =`` could be deleted unnoticed (a mutation review). Here two sessions
    of the same instance id (a copied config, or one process's next session) each start a term
    on a real lock; the first's release, sent late, names its own, older term: the newer term
    is left running (released_at NULL), and its own release ends it."""
    settings = Settings(database_url=pg_dsn, schema=schema, instance_id=f"release-{os.getpid()}")
    key, psql = advisory_key(schema), Statements(schema).psql
    params = {"instance": settings.instance_id, "host": "h", "pid": os.getpid()}
    old, new = (LockSession(settings, HostOrder(pg_dsn), lambda channel: None) for _ in range(2))

    def released() -> list:
        with psycopg.connect(pg_dsn, autocommit=True) as other:
            return [r[0] for r in other.execute(f"SELECT released_at FROM {quote_ident(schema)}.leader")]

    try:
        old.connect([])
        new.connect([])
        assert old.round_trip([key], [], [])[0] == [True]
        old_epoch = old.bump(key, psql, params, 1000)[0]
        old.round_trip([], [], [key])  # the old term's lock given back
        assert new.round_trip([key], [], [])[0] == [True]
        new_epoch = new.bump(key, psql, params, 1000)[0]
        assert new_epoch == old_epoch + 1 and released() == [None]
        old.run(psql(q.RELEASE), {"epoch": old_epoch, "instance": settings.instance_id})
        assert released() == [None], "the old term's release ended the newer term"
        new.run(psql(q.RELEASE), {"epoch": new_epoch, "instance": settings.instance_id})
        assert released() != [None]
    finally:
        old.close()
        new.close()


@pytest.mark.slow
def test_a_lock_held_on_a_standby_proves_no_term(tmp_path):
    """A proof counts only on a primary: a standby takes advisory locks (they live in its memory)
    and answers for them, but a term there writes nothing, and a session that found itself on a
    standby (a demoted server, a URL listing it) must not go on believing it leads. The daemon's
    writes would fail there first (the fence's FOR KEY SHARE, the bump), so the proof's check of
    ``primary`` could be deleted unnoticed (a mutation review). Here the lock session is set up on
    a real streaming standby, wins its lock, and proves it held: not a term; on the primary the
    same round proves one."""
    key = advisory_key("standby_proof")
    with StandbyPair() as pair:
        for dsn, primary in ((pair.standby.dsn, False), (pair.primary.dsn, True)):
            settings = Settings(database_url=dsn, instance_id=f"standby-{os.getpid()}")
            session = LockSession(settings, HostOrder(dsn), lambda channel: None)
            try:
                session.connect([])  # no LISTEN: a standby refuses it
                assert session.round_trip([key], [], [])[0] == [True], "the lock was not won"
                assert session.round_trip([], [key], [])[1] == [primary], (
                    "a lock held on a standby was taken for a term" if not primary else "no term on the primary")
            finally:
                session.close()


def test_a_lock_session_frozen_inside_its_epoch_bump_ends_within_the_lease(pg_dsn, schema):
    """SPEC 3: the epoch bump is the lock session's one transaction, and it locks the leader row
    FOR UPDATE. A process frozen half-way through it (SIGSTOP, a VM paused) must not hold that
    row, and the lock, for ever: idle_session_timeout does not apply inside a transaction, so the
    session carries idle_in_transaction_session_timeout = lease, and the server ends it; the
    successor's bump then gets the row."""
    settings = Settings(database_url=pg_dsn, schema=schema, instance_id=f"frozen-bump-{os.getpid()}",
                        leader={"lease": "1s", "renew_interval": "0.3s", "retry_interval": "0.2s"})
    session = LockSession(settings, HostOrder(pg_dsn), lambda channel: None)
    conn = session.connect([])
    try:
        assert session.round_trip([advisory_key(schema)], [], [])[0] == [True]
        pid = conn.info.backend_pid
        conn.execute("BEGIN")  # the bump's transaction, frozen right after its row lock
        conn.execute(Statements(schema).psql(q.LOCK_ROW))
        with psycopg.connect(pg_dsn, autocommit=True) as watcher:
            wait_for(lambda: not watcher.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchall(),
                     8, what="the session frozen in its transaction ended by the server")
            watcher.execute("SET lock_timeout = '2s'")
            watcher.execute(Statements(schema).psql(q.LOCK_ROW))  # the row is free
            assert watcher.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s",
                                   (pid,)).fetchone()[0] == 0
    finally:
        session.close()


def test_the_lock_sessions_unacknowledged_sends_fail_within_the_lease(pg_dsn):
    """SPEC 3: a lock session whose sends nobody acknowledges (the network to the server cut:
    no RST, the packets dropped) fails within the lease, not after the kernel's ~15 minutes of
    retransmissions, so the daemon stops trusting, reconnects and tries the other hosts. That is
    the socket's TCP_USER_TIMEOUT (tcp(7)); a user-space proxy cannot drop the kernel's
    acknowledgements, so the option itself is read back from the socket."""
    import socket as socket_module

    settings = Settings(database_url=pg_dsn, instance_id=f"tcp-{os.getpid()}",
                        leader={"lease": "7s", "renew_interval": "2s", "retry_interval": "0.5s"})
    session = LockSession(settings, HostOrder(pg_dsn), lambda channel: None)
    conn = session.connect([])
    try:
        sock = socket_module.socket(fileno=os.dup(conn.fileno()))
        try:
            if sock.family == socket_module.AF_UNIX:
                unavailable("the test server is reached over a Unix socket")
            assert sock.getsockopt(socket_module.IPPROTO_TCP, socket_module.TCP_USER_TIMEOUT) == 7000
        finally:
            sock.close()
    finally:
        session.close()


def test_a_lock_session_severed_from_a_silent_host_reconnects_to_the_other_host_first(pg_dsn):
    """A multi-host URL (SPEC 3): when the lock session's server goes silent mid-statement (frozen,
    or the network to it cut), the daemon severs the call; the next connect must try the other
    hosts first, or it spends a whole connect timeout (the lease) on the silent one each time
    before it reaches the live one. Here the first host is a proxy to the server that is
    blackholed (every connection silent, new ones too) and the second the server itself."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    from .netproxy import NetProxy

    info = conninfo_to_dict(pg_dsn)
    host, port = info.get("host") or "127.0.0.1", int(info.get("port") or 5432)
    with NetProxy.for_dsn(pg_dsn) as proxy:
        url = make_conninfo(pg_dsn, host=f"127.0.0.1,{host}", port=f"{proxy.port},{port}",
                            sslmode="disable", gssencmode="disable")
        settings = Settings(database_url=url, instance_id=f"sever-{os.getpid()}",
                            leader={"lease": "20s", "renew_interval": "5s", "retry_interval": "1s"})
        session = LockSession(settings, HostOrder(url), lambda channel: None)
        try:
            session.connect([])
            assert session.server[1] == proxy.port
            proxy.blackhole()
            failed: list[BaseException] = []

            def stuck() -> None:
                try:
                    session.run("SELECT 1")
                except BaseException as exc:  # noqa: B036
                    failed.append(exc)

            caller = threading.Thread(target=stuck)
            caller.start()
            wait_for(lambda: session.stuck_for() > 0.5, 5, what="the statement stuck on the silent host")
            session.sever()  # what the daemon does once it has waited a lease
            caller.join(5)
            assert failed and not caller.is_alive()
            started = time.monotonic()
            session.connect([])
            assert session.server[1] == port, "the silent host was tried first again"
            assert time.monotonic() - started < 10  # not its 20 s connect timeout first
        finally:
            session.close()
