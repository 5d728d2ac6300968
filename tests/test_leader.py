"""Leader election in-process against a real PostgreSQL: fencing, the lease, take-over ordering,
reconnects, pooler detection, run-once's lock."""

from __future__ import annotations

import dataclasses
import math
import socket

import threading
import time
from contextlib import contextmanager
from typing import Iterator

import psycopg
import pytest
from pydantic import SecretStr

from maintd.config import Settings
from maintd.daemon import Daemon
from maintd.queries import sql
from maintd.db import HostOrder, advisory_key, make_engine, periodic_channel
from maintd.election import Request, Timing
from maintd.leader import ElectionLoop, LeaderFence, LeaderSessionError, acquire_once
from maintd.services.base import NotLeader, PassContext
from maintd.leader import Seat
from maintd.spread import Spread

from .procs import lock_holders, wait_for

FAST = {"lease": "3s", "renew_interval": "1s", "retry_interval": "0.2s"}


def with_leader(settings: Settings, instance_id: str | None = None, **leader) -> Settings:
    return settings.model_copy(update={
        "instance_id": instance_id or settings.instance_id,
        "leader": settings.leader.model_validate({**FAST, **leader}),
    })


def terminate(dsn: str, schema: str, instance_id: str) -> int:
    """End the lock session of this schema's leader (found by its pid: instance names such as
    "test-1" are shared by tests running at once on a shared server)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(f'SELECT count(pg_terminate_backend(backend_pid)) FROM "{schema}".leader '
                            "WHERE instance_id = %s", (instance_id,)).fetchone()[0]


def kinds(engine, schema):
    with engine.connect() as conn:
        return [r[0] for r in conn.execute(sql("SELECT kind FROM {schema}.jobs ORDER BY id", schema))]


class RecordingSeat(Seat):
    def __init__(self, settings: Settings, rec: "Recorder"):
        super().__init__(settings)
        self.rec = rec

    def on_elected(self, term):
        self.rec.elected(term)

    def on_demoted(self, reason):
        self.rec.demoted(reason)


class Elector:
    """One target's election on a loop of its own (a daemon's, minus its runner)."""

    def __init__(self, settings: Settings, rec: "Recorder", spread=None):
        self.seat = RecordingSeat(settings, rec)
        self.seat.started = True
        self.loop = ElectionLoop(settings, [self.seat], HostOrder(settings.database_url.get_secret_value()),
                                 spread=spread)
        self.session = self.loop.session

    is_leader = property(lambda self: self.seat.is_leader)
    term = property(lambda self: self.seat.term)

    def fence(self):
        return self.seat.fence()

    def start(self):
        self.loop.start()

    def stop(self):
        self.loop.stop()

    def request_demotion(self, reason, epoch=None, hold_off=0.0, graceful=False):
        self.seat.request(Request("handover" if graceful else "fenced", reason, epoch, hold_off))

    def wake(self):
        self.seat.wake()


class Recorder:
    def __init__(self):
        self.events: list[tuple[str, object]] = []

    def elected(self, token):
        self.events.append(("elected", token.epoch))

    def demoted(self, reason):
        self.events.append(("demoted", reason))

    def elector(self, settings: Settings, spread=None) -> Elector:
        return Elector(settings, self, spread)

    @contextmanager
    def leading(self, settings: Settings) -> Iterator[Elector]:
        """A started elector that has won the lock; stopped afterwards."""
        elector = self.elector(settings)
        elector.start()
        try:
            wait_for(lambda: elector.is_leader, 10, what="leadership")
            yield elector
        finally:
            elector.stop()


def test_an_idle_follower_keeps_its_lock_session_with_the_shortest_lease(settings, pg_version):
    """The lock session carries idle_session_timeout = lease (SPEC 3). A follower with nothing to
    try (here: not started; in a daemon, the spread's join wait or a target it does not own)
    sends only the loop's read of the replicas, which came every second: with the shortest
    lease allowed, 1 s, the server ended the session every time, and the replicas seen flapped
    (an independent review saw 'terminating connection due to idle-session timeout')."""
    assert pg_version >= 14, "every server the suite runs on has idle_session_timeout"
    settings = with_leader(settings, lease="1s", renew_interval="0.3s", retry_interval="0.2s")
    elector = Recorder().elector(settings)
    elector.seat.started = False
    elector.start()
    try:
        wait_for(lambda: elector.session.open, 10, what="the lock session")
        pid = elector.session.conn.info.backend_pid
        time.sleep(4)
        assert elector.session.open and elector.session.conn.info.backend_pid == pid
    finally:
        elector.stop()


def test_a_proof_is_trusted_for_the_lease_less_one_renew_interval(settings):
    """SPEC 3: the server ends a silent lock session ``lease`` after its last statement, and only
    then can a successor win; a proof is trusted for lease - renew_interval from when it was sent,
    so a leader stops trusting its term a whole interval before that (a clock that runs a little
    fast, a proof that took a while to arrive). A won lock waits up to three leases for its bump."""
    s = with_leader(settings, lease="3s", renew_interval="1s", retry_interval="0.2s")
    loop = ElectionLoop(s, [Seat(s)], HostOrder(s.database_url.get_secret_value()))
    assert loop.timing == Timing(renew=1.0, trust=2.0, bump_deadline=9.0, retry=0.2)


def test_fence_refuses_a_stale_epoch_and_writes_nothing(settings, engine, schema):
    held = acquire_once(settings)
    assert held is not None
    elector, fence = held
    try:
        ctx = PassContext.for_settings(settings, engine, None, fence=fence)  # type: ignore[arg-type]
        with ctx.transaction() as conn:  # the real term passes the fence
            conn.execute(sql("INSERT INTO {schema}.jobs (kind) VALUES ('ok')", schema))
        stale_term = dataclasses.replace(fence.term, epoch=fence.term.epoch - 1)
        stale = LeaderFence(schema, stale_term, lambda: stale_term)  # trusted by the client side
        ctx_stale = PassContext.for_settings(settings, engine, None, fence=stale)  # type: ignore[arg-type]
        with pytest.raises(NotLeader, match=f"^epoch {fence.term.epoch - 1} is no longer the leader's$"):
            with ctx_stale.transaction() as conn:
                conn.execute(sql("INSERT INTO {schema}.jobs (kind) VALUES ('stale')", schema))
        # Each part of the term is checked: the lock session, the instance.
        t = fence.term
        for wrong in [dataclasses.replace(t, lock_pid=1), dataclasses.replace(t, instance_id="someone-else")]:
            with pytest.raises(NotLeader, match=f"^epoch {t.epoch} is no longer the leader's$"), engine.connect() as conn:
                LeaderFence(schema, wrong, lambda w=wrong: w).check(conn)
        with engine.connect() as conn:  # while the right term still passes
            fence.check(conn)
        lapsed = dataclasses.replace(t, trusted_until=0.0)
        with pytest.raises(NotLeader, match="^leadership lease expired or lost$"), engine.connect() as conn:
            LeaderFence(schema, t, lambda: lapsed).check(conn)
        with pytest.raises(NotLeader, match="^leadership lease expired or lost$"), engine.connect() as conn:
            LeaderFence(schema, t, lambda: None).check(conn)
        # The elector moved on to another term (trusted) while the database still shows this one:
        # the client-side check alone refuses.
        newer = dataclasses.replace(t, epoch=t.epoch + 1)
        with pytest.raises(NotLeader, match="^leadership lease expired or lost$"), engine.connect() as conn:
            LeaderFence(schema, t, lambda: newer).check(conn)
    finally:
        elector.stop()
    # After release, the old term's fence refuses too.
    with pytest.raises(NotLeader):
        with engine.connect() as conn:
            fence.check(conn)
    assert kinds(engine, schema) == ["ok"]



def test_a_write_after_the_lock_session_lost_the_lock_is_refused_at_commit(pg_dsn, settings, engine, schema):
    """The commit fence checks the term's lock session still holds the lock, not only the epoch:
    once it is gone and another session holds the lock (a successor before its epoch bump), a
    write of the old term, still trusted on the client side, must not commit."""
    a, fence_a = acquire_once(settings)
    term = fence_a.term
    trusted = LeaderFence(schema, term, lambda: term)  # only the database's check can refuse
    ctx = PassContext.for_settings(settings, engine, None, fence=trusted)  # type: ignore[arg-type]
    other = psycopg.connect(pg_dsn, autocommit=True)
    try:
        assert terminate(pg_dsn, schema, settings.instance_id) == 1
        wait_for(lambda: lock_holders(pg_dsn, schema) == [], 10, what="the lock to be free")
        other.execute("SELECT pg_advisory_lock(%s, %s)", advisory_key(schema))
        with pytest.raises(NotLeader, match=f"^epoch {term.epoch} is no longer the leader's$"):
            with ctx.transaction() as conn:
                conn.execute(sql("INSERT INTO {schema}.jobs (kind) VALUES ('after-the-lock')", schema))
    finally:
        other.close()
        a.stop()
    assert kinds(engine, schema) == []


def test_a_fenced_write_holds_off_the_next_epoch_bump_until_it_commits(pg_dsn, settings, engine, schema):
    """The commit fence's check and the COMMIT are two steps: a successor that bumped the epoch
    between them would lead while the old term's write still commits. The check locks the leader
    row FOR KEY SHARE, so the bump's row lock (LOCK_ROW, FOR UPDATE) waits for the fenced
    transaction to end; only then may the next term start."""
    from maintd.queries import leader as q_leader
    from maintd.queries import psycopg_sql

    elector, fence = acquire_once(settings)
    successor = psycopg.connect(pg_dsn, autocommit=True)
    successor.execute("SET lock_timeout = '500ms'")
    try:
        with engine.begin() as conn:
            conn.execute(sql("INSERT INTO {schema}.jobs (kind) VALUES ('fenced')", schema))
            fence.check_writes(conn)  # the term's own: passes, COMMIT follows
            with pytest.raises(psycopg.errors.LockNotAvailable):
                successor.execute(psycopg_sql(q_leader.LOCK_ROW, schema))
        assert successor.execute(psycopg_sql(q_leader.LOCK_ROW, schema)).fetchone()[0] == fence.term.epoch
    finally:
        successor.close()
        elector.stop()
    assert kinds(engine, schema) == ["fenced"]


def test_the_commit_fence_checks_each_part_of_the_term(settings, engine, schema):
    """The commit fence (FENCE_WRITES) refuses a term that differs from the recorded one in any
    part, as the DDL proof (FENCE) does: its epoch, its lock session, its instance. The instance
    guards the edge where a successor's lock session got the dead leader's server pid and holds
    the lock before its epoch bump (epoch and lock session then both match the old term's)."""
    elector, fence = acquire_once(settings)
    t = fence.term
    try:
        for wrong in [dataclasses.replace(t, epoch=t.epoch - 1), dataclasses.replace(t, lock_pid=1),
                      dataclasses.replace(t, instance_id="someone-else")]:
            fence_w = LeaderFence(schema, wrong, lambda w=wrong: w)
            ctx = PassContext.for_settings(settings, engine, None, fence=fence_w)  # type: ignore[arg-type]
            with pytest.raises(NotLeader, match=f"^epoch {wrong.epoch} is no longer the leader's$"):
                with ctx.transaction() as conn:
                    conn.execute(sql("INSERT INTO {schema}.jobs (kind) VALUES ('wrong')", schema))
    finally:
        elector.stop()
    assert kinds(engine, schema) == []


def test_a_write_is_refused_at_commit_once_the_term_is_no_longer_trusted(settings, engine, schema):
    """The commit fence trusts a term only as the election does: a pass whose term lapsed on the
    client side (no proof for lease - renew: the loop stuck in a call to a silent server), or
    that the elector has left (a newer term, or none), must not commit, even while the database
    still shows the term and its lock held: that server may be one the others no longer reach."""
    elector, fence = acquire_once(settings)
    t = fence.term
    try:
        for current in [dataclasses.replace(t, trusted_until=0.0), dataclasses.replace(t, epoch=t.epoch + 1), None]:
            lapsed = LeaderFence(schema, t, lambda c=current: c)
            ctx = PassContext.for_settings(settings, engine, None, fence=lapsed)  # type: ignore[arg-type]
            with pytest.raises(NotLeader, match="^leadership lease expired or lost$"):
                with ctx.transaction() as conn:
                    conn.execute(sql("INSERT INTO {schema}.jobs (kind) VALUES ('untrusted')", schema))
        assert elector.is_leader  # the database's part of the fence would have let them commit
    finally:
        elector.stop()
    assert kinds(engine, schema) == []


def test_second_acquire_fails_while_held(settings):
    held = acquire_once(settings)
    try:
        assert acquire_once(settings.model_copy(update={"instance_id": "test-2"}), wait=0.3) is None
    finally:
        held[0].stop()
    again = acquire_once(settings)
    assert again is not None
    again[0].stop()


def test_takeover_waits_for_an_in_flight_fenced_transaction(pg_dsn, settings, engine, schema):
    """The ordering fencing relies on: a write's fence is checked right before its COMMIT (in the
    same transaction); a new term begins only after an old leader's transaction whose fence
    passed has ended, and from then on the old leader's writes are refused."""
    a, fence_a = acquire_once(settings)
    b_settings = settings.model_copy(update={"instance_id": "test-2"})
    b_held: list = []
    taker = threading.Thread(target=lambda: b_held.append(acquire_once(b_settings, wait=15)))
    ctx = PassContext.for_settings(settings, engine, None, fence=fence_a)  # type: ignore[arg-type]
    try:
        with engine.connect() as conn:  # what PassContext.transaction does, paused before COMMIT
            conn.execute(sql("INSERT INTO {schema}.jobs (kind) VALUES ('by-a')", schema))
            fence_a.check_writes(conn)  # A's fence passes
            assert terminate(pg_dsn, schema, settings.instance_id) == 1  # then A's lock session dies
            taker.start()
            wait_for(lambda: lock_holders(pg_dsn, schema) == ["maintd:test-2"], 10, what="B to get the lock")
            time.sleep(0.5)
            assert taker.is_alive(), "B's term began while A's fenced transaction was open"
            conn.commit()
        taker.join(15)
        [(b, fence_b)] = b_held
        try:
            assert fence_b.epoch == fence_a.epoch + 1
            with pytest.raises(NotLeader):
                with ctx.transaction() as conn:
                    conn.execute(sql("INSERT INTO {schema}.jobs (kind) VALUES ('late')", schema))
        finally:
            b.stop()
    finally:
        a.stop()
    assert kinds(engine, schema) == ["by-a"]


def test_write_made_before_a_takeover_is_refused_at_commit(pg_dsn, settings, engine, schema):
    """A write whose transaction was open (but not yet fenced) when another instance took over
    never commits: the fence before COMMIT sees the new term and rolls it back."""
    a, fence_a = acquire_once(settings)
    b_settings = settings.model_copy(update={"instance_id": "test-2"})
    ctx = PassContext.for_settings(settings, engine, None, fence=fence_a)  # type: ignore[arg-type]
    try:
        with pytest.raises(NotLeader):
            with ctx.transaction() as conn:
                conn.execute(sql("INSERT INTO {schema}.jobs (kind) VALUES ('stale')", schema))
                assert terminate(pg_dsn, schema, settings.instance_id) == 1
                held = acquire_once(b_settings, wait=15)  # not blocked: A holds no lock yet
                assert held is not None and held[1].epoch == fence_a.epoch + 1
        held[0].stop()
    finally:
        a.stop()
    assert kinds(engine, schema) == []


def test_slow_fenced_transaction_does_not_cost_the_leadership(settings, engine):
    """A maintenance transaction open longer than renew_interval must not block the renewal
    (it did with FOR SHARE: the leader demoted itself on its own lock_timeout)."""
    s = with_leader(settings)
    rec = Recorder()
    with rec.leading(s) as elector:
        ctx = PassContext.for_settings(s, engine, None, fence=elector.fence())  # type: ignore[arg-type]
        with ctx.transaction() as conn:
            conn.exec_driver_sql("SELECT 1")
            time.sleep(2.5)  # > renew_interval (1 s) + lock_timeout, < lease (3 s)
        assert elector.is_leader and rec.events == [("elected", 1)]


def test_killed_lock_session_demotes_then_reconnects_and_leads_again(pg_dsn, settings, maintd_log):
    s = with_leader(settings)
    rec = Recorder()
    with rec.leading(s) as elector:
        epoch = elector.term.epoch
        # A demotion request about an older term is ignored ...
        elector.request_demotion("late news about an old term", epoch - 1)
        time.sleep(1.5)
        assert elector.is_leader and elector.term.epoch == epoch
        t0 = time.monotonic()
        assert terminate(pg_dsn, s.schema, s.instance_id) == 1
        wait_for(lambda: any(e[0] == "demoted" for e in rec.events), 5, what="demotion")
        assert time.monotonic() - t0 < 2.0  # at the next renewal (1 s)
        wait_for(lambda: elector.is_leader, 10, what="re-election")
        assert elector.term.epoch == epoch + 1
        # ... one about the current term is not.
        elector.request_demotion("fenced", epoch + 1)
        # Nobody else holds the lock, so the elector may win again right after: look for the
        # demotion itself, not for it being the last event.
        wait_for(lambda: ("demoted", "fenced") in rec.events, 5, what="requested demotion")
    text = "\n".join(maintd_log)
    assert "database unreachable, retrying" in text and "reconnected to database" in text
    assert f"became leader epoch={epoch + 1}" in text and "lost leadership reason=fenced" in text
    demoted = [e[1] for e in rec.events if e[0] == "demoted"]
    assert demoted[0].startswith("database error") and demoted[1] == "fenced"


def test_lease_expiry_stops_passes_at_once_and_gives_up_the_term(settings):
    """If renewals stall (e.g. a hanging network call), the main loop stops the passes by itself."""
    daemon = Daemon(with_leader(settings))
    daemon.start()
    try:
        target = daemon.targets[0]
        wait_for(lambda: daemon.is_leader and target.runner._jobs(), 10, what="leadership")
        epoch = target.term.epoch
        state = target.state  # the lease could have run out:
        target.state = dataclasses.replace(state, term=dataclasses.replace(
            state.term, trusted_until=time.monotonic() - 1), renew_at=float("inf"))
        target.keep_trying = False  # no new term until the old one's jobs are seen gone
        daemon.tick()
        assert target.runner._fence is None  # at once: no pass starts any more
        wait_for(lambda: target.runner._jobs() == [], 2, what="the term's jobs removed")
        target.keep_trying = True
        target.start()
        wait_for(lambda: daemon.is_leader and target.term.epoch == epoch + 1, 10,
                 what="a fresh term")
    finally:
        daemon.stop()


def test_an_outage_is_waited_out_with_backoff_and_the_loop_stays_alive(settings, maintd_log):
    """Against a server that refuses every connect:

    * While the database is down, the main loop may have queued a request for the term the outage
      ended ("lease expired", every tick). Requests are only taken by a round, and no round runs
      while connecting fails: left in the queue, one cut every backoff sleep short, and the loop
      reconnected as fast as the server refused (2,750 tries in 3 s before the fix).
    * /healthz's "election loop stalled" means a call that hangs, not the backoff's sleeps: with
      lease 3 s (a threshold of 4 s) the capped 5 s backoff must not count as a stall."""
    with socket.socket() as closed:  # a port nothing listens on: every connect is refused at once
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    down = with_leader(settings.model_copy(update={"database_url": SecretStr(f"postgresql://nobody@127.0.0.1:{port}/none")}))
    elector = Recorder().elector(down)
    elector.request_demotion("lease expired", epoch=7)
    elector.start()
    stalled = 0.0
    try:
        deadline = time.monotonic() + 12.0
        while time.monotonic() < deadline:
            stalled = max(stalled, elector.loop.stalled_for())
            time.sleep(0.05)
    finally:
        elector.stop()
    tries = [line for line in maintd_log if "database unreachable, retrying" in line]
    # Backoff 0.2, 0.4, 0.8, 1.6, 3.2, 5 s (each +-30 %): about 6 tries in 12 s, never dozens.
    assert 3 <= len(tries) <= 12, (len(tries), tries[:3])
    assert stalled < 3.0, stalled  # 4 s would be /healthz's 503; a backoff sleep counted was 5.9 s


def test_a_connect_trying_silent_hosts_within_their_timeouts_is_not_a_stall(settings):
    """A multi-host URL whose hosts all accept TCP but never answer (a partition, frozen servers):
    each connect tries every host for its connect timeout (here 3 s each, 6 s in all), more than
    /healthz's stall threshold (lease + retry: 4 s here). Bounded by its own timeouts, that is
    not a stall; only what a call takes beyond them is."""
    silent = [socket.socket() for _ in range(2)]
    try:
        for s in silent:
            s.bind(("127.0.0.1", 0))
            s.listen(8)  # the kernel completes the handshakes; nothing ever answers
        hosts = ",".join(f"127.0.0.1:{s.getsockname()[1]}" for s in silent)
        down = with_leader(settings.model_copy(update={"database_url": SecretStr(f"postgresql://nobody@{hosts}/none")}))
        elector = Recorder().elector(down)
        assert elector.session.connect_bound() == 6
        elector.start()
        stalled, deadline = 0.0, time.monotonic() + 14.0
        try:
            while time.monotonic() < deadline:
                stalled = max(stalled, elector.loop.stalled_for())
                time.sleep(0.05)
        finally:
            elector.stop()
        assert stalled < 3.0, stalled
    finally:
        for s in silent:
            s.close()


def test_an_election_loop_held_past_its_timeouts_fails_healthz(settings, pg_dsn, schema):
    """/healthz, the liveness probe, says so when the election loop is held in a call longer than
    its own timeouts allow (lease + the longer of retry and renew: 4 s here): the lease is then
    not renewed and no follower tries, and only a restart helps. Here the loop's thread is held
    where a NOTIFY on the periodic channel hands it to the target."""
    daemon = Daemon(with_leader(settings))
    daemon.start()
    release = threading.Event()
    try:
        target = daemon.targets[0]
        wait_for(lambda: daemon.is_leader, 10, what="leadership")
        assert daemon.health_problem() is None
        target.poke = lambda: release.wait(30)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_notify(%s, '')", (periodic_channel(schema),))
        wait_for(lambda: daemon.health_problem() is not None, 10, what="/healthz failing")
        assert daemon.health_problem() == "leader election loop stalled (database connection hanging?)"
    finally:
        release.set()
        daemon.stop()


def test_run_once_lock_is_renewed_and_not_registered(settings, engine, schema):
    s = with_leader(settings)
    elector, fence = acquire_once(s)
    try:
        time.sleep(4)  # longer than the lease (3 s): a pass of run-once may take that long
        ctx = PassContext.for_settings(s, engine, None, fence=fence)  # type: ignore[arg-type]
        with ctx.transaction() as conn:
            conn.exec_driver_sql("SELECT 1")
        assert elector.is_leader
    finally:
        elector.stop()
    with engine.connect() as conn:
        assert conn.execute(sql("SELECT count(*) FROM {schema}.daemons", schema)).scalar() == 0


def test_a_session_it_did_not_set_up_is_refused(settings, pg_dsn, schema):
    """What transaction pooling looks like from the client: the statement reaches a backend
    without our session state. The elector refuses to lead from it and keeps no lock."""
    elector = Recorder().elector(settings)
    elector.loop.connect()
    elector.session.conn.execute("SELECT set_config('maintd.session', 'someone-else', false)")
    with pytest.raises(LeaderSessionError, match="PgBouncer"):
        elector.loop.round()
    assert not elector.session.open and lock_holders(pg_dsn, schema) == []


def test_graceful_hand_over_unlocks_notifies_and_keeps_the_session(pg_dsn, settings, engine, schema):
    """A spread hand-over (SPEC 7.9): the lock is released and the followers woken by NOTIFY on the
    same session (no reconnect), the old term's fence refuses writes, and the elector stays off
    the lock for its hold-off, then leads again with a new epoch on the same backend. Checked
    against what PostgreSQL documents: pg_advisory_unlock frees a session-level lock at once while
    the session lives on (docs, "Advisory Lock Functions"), and a NOTIFY outside a transaction
    is delivered to every listening session at once (docs, "NOTIFY")."""
    from maintd.leader import handover_channel

    s = with_leader(settings)
    rec = Recorder()
    with psycopg.connect(pg_dsn, autocommit=True) as listener, rec.leading(s) as elector:
        listener.execute(f'LISTEN "{handover_channel(schema)}"')
        term, pid = elector.term, elector.session.conn.info.backend_pid
        fence = elector.fence()
        elector.request_demotion("spreading the targets", term.epoch, hold_off=1.5, graceful=True)
        t0 = time.monotonic()
        notes = list(listener.notifies(timeout=3, stop_after=1))
        assert [n.payload for n in notes] == [s.instance_id] and time.monotonic() - t0 < 1.0
        wait_for(lambda: ("demoted", "spreading the targets") in rec.events, 2, what="the demotion")
        assert lock_holders(pg_dsn, schema) == []  # released, not held by anyone during the hold-off
        assert elector.session.open and elector.session.conn.info.backend_pid == pid
        with engine.begin() as conn, pytest.raises(NotLeader):
            fence.check(conn)
        wait_for(lambda: elector.is_leader, 5, what="leading again after the hold-off")
        assert time.monotonic() - t0 >= 1.4
        assert elector.term.epoch == term.epoch + 1 and elector.session.conn.info.backend_pid == pid


class NotingGate:
    """A spread whose gate notes each time it is asked (monotonic) and answers ``answer(asked)``."""

    def __init__(self, answer):
        self.asked: list[float] = []
        self.forgotten: list[str] = []
        self._answer = answer

    def gate(self, name, notified):
        self.asked.append(time.monotonic())
        return self._answer(self.asked)

    def tried(self, name, won):
        pass

    def forget(self, names):
        self.forgotten.extend(names)

    def refresh(self, at_once=False):
        pass


class NotifiedGate(NotingGate):
    """A gate that holds a follower back a minute unless a hand-over NOTIFY arrived."""

    def gate(self, name, notified):
        self.asked.append(time.monotonic())
        return 0.0 if notified else 60.0


def test_a_woken_follower_asks_its_gate_again_at_once(settings, schema):
    """The spread wakes a waiting follower when it becomes the target's owner (a replica died):
    the follower asks its gate again at once, not at its next half-second look. Each wake comes
    0.05 s after the follower went back to waiting, so a half-second poll would answer it 0.45 s
    late, every time; a bound of 0.25 s on the median of five wakes leaves 0.25 s for a noisy
    machine, and a stall of the test's own thread (a 2-core CI machine) on two of them."""
    s = with_leader(settings)
    gate = NotingGate(lambda asked: 60.0)  # never lets it try
    asked = gate.asked
    elector = Recorder().elector(s, spread=gate)
    elector.start()
    try:
        wait_for(lambda: asked, 10, what="the first look at the gate")
        delays = []
        for _ in range(5):
            time.sleep(0.05)
            n, t0 = len(asked), time.monotonic()
            elector.wake()
            wait_for(lambda: len(asked) > n, 2, 0.005, what="the gate asked again")
            delays.append(round(asked[n] - t0, 3))
        assert sorted(delays)[2] < 0.25, f"asked again {delays} s after the wakes"
        assert not elector.is_leader
    finally:
        elector.stop()


def test_a_wake_that_lands_while_the_gate_is_asked_is_not_lost(settings, schema):
    """At start the spread holds every try (its gate answers "inf") until all targets are
    started, then wakes them from the main thread. A wake landing while the loop's thread is
    asking the gate must not be overwritten by that answer: the follower would never ask again
    (one target, one replica: never led, with /healthz and /readyz fine). Here the wake comes
    from another thread inside the gate's first answer, every time."""
    s = with_leader(settings)
    elector = None

    def answer(asked: list[float]) -> float:
        if len(asked) == 1:  # the spread's started(), right between the answer and its store
            waker = threading.Thread(target=elector.wake)
            waker.start()
            waker.join()
            return math.inf
        return 60.0

    gate = NotingGate(answer)
    asked = gate.asked
    elector = Recorder().elector(s, spread=gate)
    elector.start()
    try:
        wait_for(lambda: len(asked) >= 2, 5, what="the gate asked again after the wake")
    finally:
        elector.stop()


def test_a_try_the_gate_granted_is_forgotten_when_the_round_fails(settings, pg_dsn, schema):
    """The gate counts a granted try as a leadership until ``tried``; a round that fails (the
    session ended right after the gate answered) never says so: the loop tells the spread to
    forget it, or it held a place under the cap for 30 s."""
    elector = None

    def answer(asked: list[float]) -> float:
        if len(asked) == 1:  # the session dies between the gate's answer and the try
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("SELECT pg_terminate_backend(%s)", (elector.session.backend,))
            time.sleep(0.2)
        return 0.0 if len(asked) == 1 else 60.0

    gate = NotingGate(answer)
    elector = Recorder().elector(with_leader(settings), spread=gate)
    elector.start()
    try:
        wait_for(lambda: gate.forgotten, 10, what="the granted try forgotten")
        assert gate.forgotten == [elector.seat.name] and not elector.is_leader
    finally:
        elector.stop()


@pytest.mark.parametrize("held_back", ["not started", "its gate says wait"])
def test_a_follower_with_nothing_to_try_sleeps_and_takes_no_lock(held_back, settings, pg_dsn, schema):
    """A follower that may not try (its target not started: its schema missing or behind; or the
    spread's gate holding it back: the join wait, another replica's target) takes no lock and
    leaves the loop asleep until its wait ends: a loop that went round at once spent a core,
    holding the interpreter the probes and the passes need."""
    gate = NotingGate(lambda asked: 60.0)
    elector = Recorder().elector(with_leader(settings), spread=gate if held_back != "not started" else None)
    elector.seat.started = held_back != "not started"
    elector.start()
    try:
        wait_for(lambda: elector.session.open and (gate.asked or held_back == "not started"), 10,
                 what="the lock session")
        cpu = time.process_time()
        time.sleep(3)
        cpu = time.process_time() - cpu
        assert lock_holders(pg_dsn, schema) == [] and not elector.is_leader
        assert len(gate.asked) <= 1, "the gate is asked again only when its wait ends (or a wake)"
        assert cpu < 0.5, f"{cpu:.2f}s of CPU in 3s: the loop did not sleep"
    finally:
        elector.stop()


def test_a_change_of_the_live_replicas_reaches_the_spread_at_the_loops_read(settings):
    """A replica comes (or dies): the election loop that reads it hands it to the spread at once
    (``Spread.refresh(at_once=True)``), not at the spread's own next read up to a second later, so a
    dead replica's targets move that much sooner. The spread's own reads are held off here: only
    the loop's hand-over can take ``b`` in."""
    a_settings, b_settings = with_leader(settings, "test-a"), with_leader(settings, "test-b")
    spread = Spread([], me="test-a", retry_interval=0.2, settle=3.0, lease=3.0,
                    live_replicas=lambda: a.loop.replicas)
    a = Recorder().elector(a_settings, spread=spread)
    a.start()
    b = None
    try:
        wait_for(lambda: a.loop.replicas == ("test-a",), 10, what="a's loop reading itself live")
        spread._read_at = math.inf
        b = Recorder().elector(b_settings)
        b.start()
        wait_for(lambda: spread.live == ("test-a", "test-b"), 5, what="b in the spread")
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_daemon_of_another_deployment_with_the_same_id_does_not_keep_a_dead_replica_alive(pg_dsn, schema):
    """SPEC 7.9's R counts the replicas whose lock session is connected. It was read from the
    session's name alone (``maintd:<instance_id>``), so a deployment on the same database with
    other schemas and the same instance ids (two StatefulSets named alike, or this suite's workers
    running at once) kept a killed replica alive: the survivors left its targets to lazy tries
    (a CI run measured 4.2 s instead of 0.9 s). A row now names its lock session's backend
    (migration 0010); an older daemon's row without one is matched by name, as before."""
    from maintd.queries import daemons as q_daemons
    from maintd.queries import psycopg_sql

    def live() -> list[str]:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            return [r[0] for r in conn.execute(psycopg_sql(q_daemons.LIVE_REPLICAS, schema))]

    def duplicate() -> object:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            return conn.execute(psycopg_sql(q_daemons.DUPLICATE, schema), {"instance": "twin"}).fetchone()

    params = {"instance": "twin", "host": "h", "pid": 1, "version": "t"}
    other = psycopg.connect(pg_dsn, autocommit=True, application_name="maintd:twin")  # the other deployment's
    try:
        with psycopg.connect(pg_dsn, autocommit=True, application_name="maintd:twin") as mine:
            mine.execute(psycopg_sql(q_daemons.REGISTER, schema), params)  # on its lock session
            assert live() == ["twin"] and duplicate() is not None
        wait_for(lambda: live() == [], 10, what="the replica gone with its lock session")
        assert duplicate() is None
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'UPDATE "{schema}".daemons SET lock_pid = NULL')  # written before 0010
        assert live() == ["twin"] and duplicate() is not None
    finally:
        other.close()


def test_run_once_blocked_by_the_previous_leaders_transaction_says_so(settings, engine, schema):
    """A run-once that won the lock but whose epoch bump waited, for all of --wait, on a
    transaction of the previous leader (its fence holds the leader row FOR KEY SHARE until it
    ends) was told "another instance holds the leader lock": no instance did. It now says
    what held it, and leaves no lock behind."""
    holder = engine.connect()
    holder.execute(sql("SELECT epoch FROM {schema}.leader FOR KEY SHARE", schema))
    try:
        with pytest.raises(RuntimeError, match="previous leader's transactions"):
            acquire_once(settings, wait=1.0)
    finally:
        holder.rollback()
        holder.close()
    again = acquire_once(settings)  # no lock was left behind
    assert again is not None
    again[0].stop()


def test_the_first_backoff_after_a_failure_is_not_cut_short_by_an_earlier_request(settings, caplog):
    """A request made before a connect failed was taken from the queue, but its wake-up byte was
    left in the loop's pipe: the first backoff sleep returned at once, and the loop tried again
    with no wait at all (two tries 1 ms apart)."""
    import logging

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    down = with_leader(settings.model_copy(update={"database_url": SecretStr(f"postgresql://nobody@127.0.0.1:{port}/none")}))
    elector = Recorder().elector(down)
    elector.request_demotion("lease expired", epoch=7)  # queued, and a byte in the wake pipe
    with caplog.at_level(logging.WARNING, logger="maintd.leader"):
        elector.start()
        try:
            wait_for(lambda: sum("database unreachable" in r.getMessage() for r in caplog.records) >= 2, 10,
                     what="two tries")
        finally:
            elector.stop()
    first, second = [r.created for r in caplog.records if "database unreachable" in r.getMessage()][:2]
    assert second - first >= 0.1, f"the first backoff (0.2 s +-30 %) lasted {second - first:.3f} s"


def test_a_won_lock_given_back_after_its_bump_stayed_blocked_says_so(settings, engine, schema, maintd_log):
    """A won lock whose epoch bump stays blocked past its deadline (3 leases: an old leader's
    fenced transaction, a long DDL say, holds the leader row) is given back. That was silent: the
    log said "waiting for the previous leader's transactions" once and then nothing, not when the
    lock was given back, nor when the next win waited again, while the target stayed unled."""
    quick = with_leader(settings, lease="1s", renew_interval="0.3s", retry_interval="0.2s")  # deadline 3 s
    holder = engine.connect()
    holder.execute(sql("SELECT epoch FROM {schema}.leader FOR KEY SHARE", schema))
    elector = Recorder().elector(quick)
    elector.start()
    try:
        gave_up = lambda: [line for line in maintd_log if "stayed blocked" in line]
        wait_for(lambda: gave_up(), 10, what="the give-up said")
        waits = lambda: sum("waiting for the previous leader's transactions" in line for line in maintd_log)
        wait_for(lambda: waits() >= 2, 10, what="the next win's wait said again")
        assert not elector.is_leader
    finally:
        holder.rollback()
        holder.close()
        elector.stop()


@contextmanager
def migrated_schemas(pg_dsn: str, n: int, trigger_sleep: float | None = None,
                     on: str = "INSERT") -> Iterator[list[str]]:
    """``n`` freshly migrated schemas (dropped afterwards); with ``trigger_sleep``, each one's
    leader row costs that long to write (a BEFORE ``on`` trigger): a slow epoch bump."""
    from sqlalchemy import text

    from maintd import migrate
    from maintd.identifiers import quote_ident

    from .conftest import new_schema_name

    schemas = [new_schema_name() for _ in range(n)]
    migrator = make_engine(pg_dsn, application_name="maintd-test-migrate", pooled=False)
    try:
        with migrator.connect() as conn:
            for name in schemas:
                migrate.upgrade(conn, name)
                if trigger_sleep is not None:
                    q = quote_ident(name)
                    conn.execute(text(f"CREATE FUNCTION {q}.slow() RETURNS trigger LANGUAGE plpgsql AS "
                                      f"$$ BEGIN PERFORM pg_sleep({trigger_sleep}); RETURN NEW; END $$"))
                    conn.execute(text(f"CREATE TRIGGER slow BEFORE {on} ON {q}.leader "
                                      f"FOR EACH ROW EXECUTE FUNCTION {q}.slow()"))
            conn.commit()
        yield schemas
    finally:
        with migrator.connect() as conn:
            conn.execute(text("SET lock_timeout = '20s'"))
            for name in schemas:
                conn.execute(text(f"DROP SCHEMA IF EXISTS {quote_ident(name)} CASCADE"))
            conn.commit()
        migrator.dispose()


@contextmanager
def one_loop(settings: Settings, schemas: list[str], rec: "Recorder",
             started: bool = True) -> Iterator[list[RecordingSeat]]:
    """One election loop running a recording seat per schema (started: trying at once)."""
    seats = [RecordingSeat(settings.model_copy(update={"schema": name}), rec) for name in schemas]
    for seat in seats:
        seat.started = started
    loop = ElectionLoop(settings, seats, HostOrder(settings.database_url.get_secret_value()))
    loop.start()
    try:
        yield seats
    finally:
        loop.stop()


def test_locks_on_several_targets_bookkeeping_tables_cost_no_leadership(settings, engine, pg_dsn):
    """The loop's bookkeeping statements (the read of the live replicas, which falls through to
    the next target while one's ``daemons`` table is locked, the registrations, the rows of left
    replicas) run one after another between two rounds, each waiting up to the lock session's
    lock_timeout. That was renew_interval: with k targets' tables locked at once (migrations or
    an admin's LOCK TABLE on several schemas), renewals were k intervals apart, and every term of
    the database ended once k intervals passed the trust (lease - renew). The bookkeeping waits
    at most 0.2 s a statement now."""
    quick = with_leader(settings, lease="6s")  # renew 1 s, trust 5 s: six 1 s waits are past it
    rec = Recorder()
    with migrated_schemas(pg_dsn, 6) as schemas, one_loop(quick, schemas, rec) as seats:
        wait_for(lambda: all(seat.is_leader for seat in seats), 20, what="every target led")
        with engine.connect() as locker:
            for name in schemas:
                locker.execute(sql("LOCK TABLE {schema}.daemons IN ACCESS EXCLUSIVE MODE", name))
            time.sleep(8.0)  # past a lease: several reads of the replicas, each meeting six locks
            locker.rollback()
        time.sleep(1.0)
        assert all(seat.is_leader for seat in seats)
        assert [e for e in rec.events if e[0] == "demoted"] == []


def test_a_bump_that_hits_the_statement_timeout_costs_no_other_target_its_term(settings, pg_dsn):
    """One target's epoch bump cancelled by the lock session's statement timeout (a slow write of
    its leader row: a trigger, an overloaded disk) is that target's failure, like its lock
    timeout. It was taken for a lost session: the session was closed, and every other target of
    the database lost its term with it."""
    quick = with_leader(settings, lease="3s")  # the session's statement timeout: 1.5 s
    rec = Recorder()
    with migrated_schemas(pg_dsn, 1) as [steady], \
            migrated_schemas(pg_dsn, 1, trigger_sleep=3, on="INSERT OR UPDATE") as [slow], \
            one_loop(quick, [steady, slow], rec, started=False) as seats:
        seats[0].started = True
        seats[0].wake()
        wait_for(lambda: seats[0].is_leader, 20, what="the steady target led")
        seats[1].started = True
        seats[1].wake()
        wait_for(lambda: seats[1].failure is not None, 20, what="the slow target's bump failed")
        time.sleep(1.0)
        assert seats[0].is_leader and not seats[1].is_leader
        assert [e for e in rec.events if e[0] == "demoted"] == []


def test_slow_epoch_bumps_of_many_won_locks_do_not_let_the_first_terms_expire(settings, pg_dsn):
    """The tries of every target go in one statement, so a daemon starting with many targets wins
    their locks at once, and each won lock's epoch bump is a transaction of its own. The loop ran
    all the bumps of a round one after another before the next round's renewals: 200 bumps on a
    server busy with the first passes of 200 targets took 13 s, and the terms begun first in the
    round expired unrenewed ("lease expired": 56 to 87 of 200 targets lost at every start of
    bench/targets.py). A round now stops bumping after half a renew interval: the renewals due go
    first, and the rest of the bumps follow. Here each bump costs 0.8 s (a trigger on the leader
    row) and five are won together; a term is trusted 2 s."""
    quick = with_leader(settings, lease="3s")  # renew 1 s, trust 2 s
    rec = Recorder()
    with migrated_schemas(pg_dsn, 5, trigger_sleep=0.8) as schemas, one_loop(quick, schemas, rec) as seats:
        wait_for(lambda: all(seat.is_leader for seat in seats), 20, what="every target led")
        time.sleep(2.0)
        assert [e for e in rec.events if e[0] == "demoted"] == []
        assert all(seat.is_leader for seat in seats)


def test_a_lock_on_a_bookkeeping_table_costs_no_leadership(settings, engine, schema):
    """The loop's reads and writes of one target's ``daemons`` table (the live replicas every
    second, the registration) meet a lock held there (a migration's ALTER TABLE, an admin's
    LOCK TABLE) as a lock_timeout: a statement error of that target, not a lost session. It closed
    the lock session: every target of the database lost its term, and no term lasted while the
    lock was held."""
    quick = with_leader(settings, lease="6s")  # renew 1 s, trust 5 s
    rec = Recorder()
    with rec.leading(quick) as elector:
        with engine.connect() as locker:
            locker.execute(sql("LOCK TABLE {schema}.daemons IN ACCESS EXCLUSIVE MODE", schema))
            time.sleep(4.0)  # several reads of the live replicas, each meeting the lock
            locker.rollback()
        time.sleep(1.0)
        assert elector.is_leader
        assert [e for e in rec.events if e[0] == "demoted"] == []


def test_the_renewals_of_targets_won_at_different_times_go_in_one_statement(settings, pg_dsn):
    """SPEC 8.3: the leases of many targets cost one statement a renew interval, not one each.
    Targets whose terms began at different times are due at different times; when one is due,
    those due within half an interval are proven with it (an early proof is sound), so their
    proofs fall into step at once and stay there. Here two targets' terms begin about 0.4 s
    apart (renew 1 s): after the first renewals, every statement that proves a lock proves
    both. Renewing each only when it is due sent a statement per target, 0.4 s apart."""
    quick = with_leader(settings, lease="3s")  # renew 1 s
    rec = Recorder()
    with migrated_schemas(pg_dsn, 2) as schemas, one_loop(quick, schemas, rec, started=False) as seats:
        session, proofs = seats[0].loop.session, []
        original = session.round_trip

        def noting(tries, renewals, unlocks):
            if renewals:
                proofs.append(len(renewals))
            return original(tries, renewals, unlocks)

        session.round_trip = noting
        seats[0].started = True
        seats[0].wake()
        wait_for(lambda: seats[0].is_leader, 20, what="the first target led")
        time.sleep(0.4)
        seats[1].started = True
        seats[1].wake()
        wait_for(lambda: seats[1].is_leader, 20, what="the second target led")
        time.sleep(1.5)  # the first renewals after the second term began bring them into step
        proofs.clear()
        time.sleep(3.0)
        assert all(seat.is_leader for seat in seats) and [e for e in rec.events if e[0] == "demoted"] == []
        assert len(proofs) >= 2 and set(proofs) == {2}, f"locks proven per statement: {proofs}"


def test_a_follower_held_back_by_its_gate_tries_at_once_on_a_hand_over_notify(settings, pg_dsn, schema):
    """A leader handing its target over (SPEC 7.9) sends a NOTIFY on the hand-over channel so that
    the followers try now, not at their gate's next look: the spread may hold a follower back
    for a long while (another replica's target, tried lazily), and it lets a notified one try
    at once. The NOTIFY makes the loop ask the gate again, saying it was notified; here the gate
    holds the follower back a minute unless notified, so only that can let it lead in time."""
    gate = NotifiedGate(None)
    a_rec, b_rec = Recorder(), Recorder()
    with a_rec.leading(with_leader(settings, "test-a")) as a:
        b = b_rec.elector(with_leader(settings, "test-b"), spread=gate)
        b.start()
        try:
            wait_for(lambda: b.session.open and gate.asked, 10, what="the follower's gate asked")
            time.sleep(0.5)
            assert not b.is_leader and len(gate.asked) == 1
            a.request_demotion("spreading the targets", a.term.epoch, hold_off=60.0, graceful=True)
            wait_for(lambda: b.is_leader, 10, what="the follower leading after the hand-over NOTIFY")
        finally:
            b.stop()


def test_a_bump_blocked_round_after_round_is_said_once(settings, engine, schema, maintd_log):
    """A won lock whose epoch bump meets the previous leader's fenced transaction is sent again
    every round (a 100 ms row-lock wait each) until that transaction ends: the log says
    "waiting for the previous leader's transactions" once for the wait, not once a round (about
    ten lines a second per target for as long as the transaction lasts), and the term begins
    once the row is free."""
    holder = engine.connect()
    holder.execute(sql("SELECT epoch FROM {schema}.leader FOR KEY SHARE", schema))
    elector = Recorder().elector(with_leader(settings))  # the bump's deadline: 9 s
    elector.start()
    waits = lambda: sum("waiting for the previous leader's transactions" in line for line in maintd_log)
    try:
        wait_for(lambda: waits() >= 1, 10, what="the wait said")
        time.sleep(2.5)  # many rounds, each bump blocked again
        assert waits() == 1 and not elector.is_leader
        holder.rollback()
        wait_for(lambda: elector.is_leader, 10, what="the term once the row is free")
        assert waits() == 1
    finally:
        holder.rollback()
        holder.close()
        elector.stop()


def test_a_replica_that_ran_for_hours_and_died_is_shown_gone_from_when_it_left(settings, pg_dsn, schema):
    """/status lists every daemon seen within the last hour, a dead one as gone (SPEC 7.9). A
    replica SIGKILLed after running for hours wrote no row as it died, and its row says when it
    connected: the live daemon whose loop sees it leave the live replicas writes when that was,
    so it is shown gone for an hour from its end, not dropped at once."""
    from maintd.queries import daemons as q_daemons
    from maintd.queries import psycopg_sql

    def registered() -> list[tuple[str, bool]]:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            return [(r[0], r[5]) for r in conn.execute(psycopg_sql(q_daemons.REGISTERED, schema))]

    a = Recorder().elector(with_leader(settings, "test-a"))
    twin = psycopg.connect(pg_dsn, autocommit=True, application_name="maintd:old-replica")  # its lock session
    try:
        twin.execute(psycopg_sql(q_daemons.REGISTER, schema), {"instance": "old-replica", "host": "h", "pid": 1, "version": "t"})
        twin.execute(f'UPDATE "{schema}".daemons SET last_seen_at = now() - interval \'3 hours\', '
                     "started_at = now() - interval '3 hours' WHERE instance_id = 'old-replica'")
        a.start()
        wait_for(lambda: a.loop.replicas == ("old-replica", "test-a"), 10, what="a's loop seeing the old replica live")
        twin.close()  # killed: its session ends, its row untouched
        wait_for(lambda: a.loop.replicas == ("test-a",), 10, what="a's loop seeing it leave")
        time.sleep(0.5)
        assert ("old-replica", False) in registered(), registered()
    finally:
        twin.close()
        a.stop()


def test_a_registration_that_met_a_locked_table_is_written_later(settings, engine, schema, monkeypatch):
    """A daemon writes its ``daemons`` row when its lock session connects; one that cannot be
    written then on a server that takes writes (the table locked by a migration, an admin's LOCK
    TABLE) is tried again every REGISTER_RETRY seconds: until it is written, `maintd status` and
    the other replicas' spread do not see this daemon alive. Here the retry is a second."""
    import maintd.leader as leader_module

    monkeypatch.setattr(leader_module, "REGISTER_RETRY", 1.0)

    def rows() -> list[str]:
        with engine.connect() as conn:
            return [r[0] for r in conn.execute(sql("SELECT instance_id FROM {schema}.daemons", schema))]

    elector = Recorder().elector(with_leader(settings))
    locker = engine.connect()
    try:
        locker.execute(sql("LOCK TABLE {schema}.daemons IN ACCESS EXCLUSIVE MODE", schema))
        elector.start()
        wait_for(lambda: elector.is_leader, 10, what="leadership")
        time.sleep(1.5)  # the connect's registration met the lock, and so did a retry
        assert elector.loop._unregistered == {elector.seat}
        locker.rollback()
        wait_for(lambda: rows() == [settings.instance_id], 10, what="the row written once the table is free")
        assert elector.loop.writable and elector.is_leader
    finally:
        locker.rollback()
        locker.close()
        elector.stop()


def test_a_lock_session_lost_during_an_epoch_bump_is_a_reconnect_not_the_targets_failure(settings, pg_dsn, maintd_log):
    """An epoch bump whose session ends under it (the server restarted, the backend killed)
    lost every lock of the session, not one target's bump: the loop says the database is
    unreachable, drops every term and reconnects. It does not log that this target "could not
    start a term" or keep that as the target's failure (which run-once reports as the reason),
    as it does for a bump refused on its own (a missing privilege, a read-only server). Here the
    leader row's trigger ends the bumping backend the first time only."""
    from sqlalchemy import text

    rec = Recorder()
    with migrated_schemas(pg_dsn, 1) as [name]:
        with make_engine(pg_dsn, application_name="maintd-test-trigger", pooled=False).connect() as conn:
            conn.execute(text(f'CREATE SEQUENCE "{name}".bumps'))  # (not rolled back with the bump)
            conn.execute(text(f'CREATE FUNCTION "{name}".kill() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN '
                              f'IF nextval(\'"{name}".bumps\') = 1 THEN '
                              f'PERFORM pg_terminate_backend(pg_backend_pid()); PERFORM pg_sleep(5); END IF; '
                              f'RETURN NEW; END $$'))
            conn.execute(text(f'CREATE TRIGGER kill BEFORE INSERT OR UPDATE ON "{name}".leader '
                              f'FOR EACH ROW EXECUTE FUNCTION "{name}".kill()'))
            conn.commit()
        with one_loop(with_leader(settings), [name], rec) as [seat]:
            wait_for(lambda: any("database unreachable, retrying" in line for line in maintd_log), 10,
                     what="the lost session said")
            wait_for(lambda: seat.is_leader, 15, what="a term after the reconnect")
            assert not any("could not start a term" in line for line in maintd_log), maintd_log


def test_a_term_on_a_multi_host_url_starts_with_fresh_pooled_connections(settings, pg_dsn):
    """SPEC 3: with a multi-host URL, the idle connections of the maintenance pool may lead to a
    server that has since gone silent (a frozen old primary) while the lock session reached
    another: a pass on one would hang for a lease and cost the new term. So a term begins by
    disposing of the pool: no connection made before it is used by it. Here both hosts are the
    same server; a connection pooled during one term is closed when the next term begins."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo
    from sqlalchemy import text

    info = conninfo_to_dict(pg_dsn)
    host, port = info.get("host") or "127.0.0.1", info.get("port") or "5432"
    url = make_conninfo(pg_dsn, host=f"{host},{host}", port=f"{port},{port}")
    daemon = Daemon(with_leader(settings.model_copy(update={"database_url": SecretStr(url)})))
    daemon.start()
    try:
        target = daemon.targets[0]
        assert target.loop.session.hosts.multi_host
        wait_for(lambda: daemon.is_leader, 10, what="leadership")
        epoch = target.term.epoch
        with target.engine.connect() as conn:  # pooled for this term
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar()
        target.request(Request("fenced", "a new term", epoch))
        wait_for(lambda: target.term is not None and target.term.epoch == epoch + 1, 10, what="the next term")
        with psycopg.connect(pg_dsn, autocommit=True) as watcher:
            wait_for(lambda: not watcher.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchall(),
                     10, what="the previous term's pooled connection closed")
    finally:
        daemon.stop()


def test_a_sleeping_follower_reads_a_hand_over_notify_as_it_arrives(settings, monkeypatch):
    """Between rounds the loop sleeps until something is due, and what the server sends wakes it:
    a hand-over NOTIFY is read as it arrives, not with the loop's next statement. With a long
    lease the loop's next statement can be many seconds away (its read of the replicas comes
    every lease / 2 at most, here 15 s with the once-a-second read held off), and a follower
    held back by its gate would leave the handed-over target unled that long."""
    import maintd.leader as leader_module

    monkeypatch.setattr(leader_module, "REFRESH", 60.0)

    slow = {"lease": "30s", "renew_interval": "10s", "retry_interval": "0.2s"}
    gate = NotifiedGate(None)
    with Recorder().leading(with_leader(settings, "test-a", **slow)) as a:
        b = Recorder().elector(with_leader(settings, "test-b", **slow), spread=gate)
        b.start()
        try:
            wait_for(lambda: b.session.open and gate.asked, 10, what="the follower's gate asked")
            time.sleep(0.5)
            a.request_demotion("spreading the targets", a.term.epoch, hold_off=60.0, graceful=True)
            wait_for(lambda: b.is_leader, 8, what="the follower leading after the hand-over NOTIFY")
        finally:
            b.stop()
