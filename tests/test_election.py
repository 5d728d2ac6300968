"""The election state machine (maintd.election, SPEC 8.3) as a table of cases, without a database
or a clock: each row is (state, what happened, now) -> (next state, what to send, the effect).

The rows walk every edge of SPEC 3 and 7.2: a follower tries only when its gate and hold-off allow;
a won lock becomes a term only once the epoch bump is through, and is given back if the bump stays
blocked; a leader proves the lock every renew_interval, trusts each proof for lease - renew, and
steps down at once when the lease could have run out, the lock is gone, a pass was fenced or
stalled, it hands over, stops, or its session is lost; a released lock is followed by the hold-off.
"""

from __future__ import annotations

import math
import time

import pytest

from maintd.election import (BumpBlocked, BumpFailed, Bumped, Demoted, Elected, Following, Leading, Lost,
                             Notified, Released, Releasing, Renewed, Request, Round, Step, Term, Timing, Tried,
                             due, leading_term, step)

T = Timing(renew=2.0, trust=8.0, bump_deadline=30.0, retry=1.0)  # lease 10 s, renew 2 s
ME = "me"
TERM = Term(epoch=7, lock_pid=4242, instance_id=ME, trusted_until=108.0)  # proof sent at 100
LEAD = Leading(TERM, renew_at=102.0)
INF = math.inf

CASES = [
    # -- following -----------------------------------------------------------------------------
    ("a follower tries when its gate is open", Following(), Round(True), 100.0, Step(Following(), "try")),
    ("a closed gate: no try", Following(), Round(False), 100.0, Step(Following())),
    ("a hold-off: no try before it ends", Following(not_before=105.0), Round(True), 104.9,
     Step(Following(not_before=105.0))),
    ("the hold-off is over", Following(not_before=105.0), Round(True), 105.0,
     Step(Following(not_before=105.0), "try")),
    ("a stopped follower never tries", Following(not_before=INF), Round(True), 1e9, Step(Following(not_before=INF))),
    ("a lost try: the next one retry_interval later", Following(), Tried(False), 100.0,
     Step(Following(retry_at=101.0))),
    ("no try before retry_interval", Following(retry_at=101.0), Round(True), 100.9, Step(Following(retry_at=101.0))),
    ("a hand-over NOTIFY ends the retry wait", Following(retry_at=101.0), Notified(), 100.2, Step(Following())),
    ("a NOTIFY does not end a hold-off", Following(not_before=105.0), Notified(), 100.2,
     Step(Following(not_before=105.0))),
    ("a won try: the epoch bump next", Following(), Tried(True), 100.0, Step(Following(won_at=100.0))),
    ("the bump is sent at the next round", Following(won_at=100.0), Round(False), 100.1,
     Step(Following(won_at=100.0), "bump")),
    ("a blocked bump is retried next round, not waited for", Following(won_at=100.0), BumpBlocked(), 100.2,
     Step(Following(won_at=100.0))),
    # the bump deadline's edge: a bump exactly bump_deadline after the win is still sent, not given up
    ("a bump at its deadline is still sent", Following(won_at=100.0), Round(True), 130.0,
     Step(Following(won_at=100.0), "bump")),
    ("a bump blocked past its deadline gives the lock back", Following(won_at=100.0), Round(True), 130.1,
     Step(Releasing(None, "the epoch bump stayed blocked", False, 130.1), "unlock")),
    ("a failed bump gives the lock back, retried after retry_interval", Following(won_at=100.0),
     BumpFailed("relation missing"), 100.5, Step(Releasing(None, "relation missing", False, 101.5))),
    ("the bump through: a term trusted lease - renew from when it was sent", Following(won_at=99.0),
     Bumped(epoch=7, lock_pid=4242, sent=100.0), 100.3, Step(LEAD, effect=Elected(TERM))),
    ("a late bump answer without a won lock is ignored", Following(), Bumped(7, 4242, 100.0), 100.3,
     Step(Following())),
    # answers that do not belong to the state change nothing (the loop never sends a try with a lock
    # won, nor a bump without one): a second win would restart the bump deadline, a failure unlock
    ("a try answer with the lock already won is ignored", Following(won_at=99.0), Tried(True), 100.0,
     Step(Following(won_at=99.0))),
    ("a bump failure without a won lock is ignored", Following(retry_at=101.0), BumpFailed("x"), 100.3,
     Step(Following(retry_at=101.0))),
    ("requests about a term do not concern a follower", Following(), Request("fenced", "x", 7), 100.0,
     Step(Following())),
    ("stop: a follower stops trying", Following(not_before=3.0), Request("stop", "shutdown"), 100.0,
     Step(Following(not_before=INF))),
    ("stop with a won lock: unlocked", Following(won_at=99.0), Request("stop", "shutdown"), 100.0,
     Step(Releasing(None, "shutdown", False, INF))),
    ("connection lost while following: the waits stay", Following(not_before=104.0, retry_at=100.5), Lost("gone"),
     100.0, Step(Following(not_before=104.0, retry_at=100.5))),
    ("connection lost with a won lock: the session end freed it", Following(won_at=99.0), Lost("gone"), 100.0,
     Step(Following())),
    # -- leading -------------------------------------------------------------------------------
    ("no renewal before renew_interval", LEAD, Round(), 101.9, Step(LEAD)),
    ("renewal due", LEAD, Round(), 102.0, Step(LEAD, "renew")),
    ("a renewal late but the lease still trusted: renew", LEAD, Round(), 107.9, Step(LEAD, "renew")),
    ("another target's renewal is due: this one, due within the window, goes with it", LEAD,
     Round(True, renew_by=102.5), 101.5, Step(LEAD, "renew")),
    ("but not one due after the window", LEAD, Round(True, renew_by=101.9), 101.5, Step(LEAD)),
    ("renewal too late: the lease could have run out, step down at once", LEAD, Round(), 108.0,
     Step(Releasing(TERM, "lease expired before it could be renewed", False, 108.0), "unlock",
          Demoted("lease expired before it could be renewed"))),
    ("a proof extends the trust from when it was sent", LEAD, Renewed(True, sent=102.5), 102.6,
     Step(Leading(Term(7, 4242, ME, 110.5), renew_at=104.5))),
    ("lock lost (or the server became a standby): step down", LEAD, Renewed(False, 102.5), 102.6,
     Step(Releasing(TERM, "advisory lock no longer held (or the server is not a primary)", False, 102.6),
          effect=Demoted("advisory lock no longer held (or the server is not a primary)"))),
    ("a fenced pass of this term: step down, unlock, try again at once", LEAD,
     Request("fenced", "epoch 7 is no longer the leader's", 7), 103.0,
     Step(Releasing(TERM, "epoch 7 is no longer the leader's", False, 103.0),
          effect=Demoted("epoch 7 is no longer the leader's"))),
    ("a late report about an older term is ignored", LEAD, Request("fenced", "old", 6), 103.0, Step(LEAD)),
    ("a stalled pass: step down and let a healthier replica go first", LEAD,
     Request("stalled", "maintenance connections hang", 7, hold_off=30.0), 103.0,
     Step(Releasing(TERM, "maintenance connections hang", False, 133.0),
          effect=Demoted("maintenance connections hang"))),
    ("a hand-over: released gracefully (followers woken), then a hold-off", LEAD,
     Request("handover", "spreading the targets", 7, hold_off=4.0), 103.0,
     Step(Releasing(TERM, "spreading the targets", True, 107.0), effect=Demoted("spreading the targets"))),
    ("stop: released gracefully, never tried again", LEAD, Request("stop", "shutdown"), 103.0,
     Step(Releasing(TERM, "shutdown", True, INF), effect=Demoted("shutdown"))),
    ("stop concerns any term", LEAD, Request("stop", "shutdown", epoch=3), 103.0,
     Step(Releasing(TERM, "shutdown", True, INF), effect=Demoted("shutdown"))),
    ("connection lost: demoted, the session end freed the lock", LEAD, Lost("database error: x"), 103.0,
     Step(Following(not_before=103.0), effect=Demoted("database error: x"))),
    ("a try answer while leading is ignored", LEAD, Tried(True), 103.0, Step(LEAD)),
    # -- releasing -----------------------------------------------------------------------------
    ("a graceful release is sent as such", Releasing(TERM, "r", True, 107.0), Round(False), 103.1,
     Step(Releasing(TERM, "r", True, 107.0), "release")),
    ("otherwise a plain unlock", Releasing(TERM, "r", False, 103.0), Round(True), 103.1,
     Step(Releasing(TERM, "r", False, 103.0), "unlock")),
    ("a lock without a term is only unlocked", Releasing(None, "r", True, 103.0), Round(), 103.1,
     Step(Releasing(None, "r", True, 103.0), "unlock")),
    ("released: following, with the hold-off", Releasing(TERM, "r", True, 107.0), Released(), 103.2,
     Step(Following(not_before=107.0))),
    ("stop while releasing: never tried again", Releasing(TERM, "r", True, 107.0), Request("stop", "s"), 103.2,
     Step(Releasing(TERM, "r", True, INF))),
    ("connection lost while releasing: released by the session end", Releasing(TERM, "r", False, 105.0),
     Lost("gone"), 103.2, Step(Following(not_before=105.0))),
    ("other requests while releasing change nothing", Releasing(TERM, "r", False, 105.0),
     Request("handover", "x", 7), 103.2, Step(Releasing(TERM, "r", False, 105.0))),
    # a pass fenced and the passes found hung, both reported before the loop's next round: the
    # second's hold-off (a replica whose connections work goes first) must not be lost
    ("a later request's longer hold-off for the term being released holds", Releasing(TERM, "fenced", False, 103.0),
     Request("stalled", "maintenance connections hang", 7, 30.0), 103.2, Step(Releasing(TERM, "fenced", False, 133.2))),
    # the passes found hung just as the term ended another way (its lease ran out, the session
    # was lost): the hold-off still holds, or this replica, its connections hanging, tries at once
    ("a stalled report after the term ended: the follower still holds off", Following(not_before=103.0),
     Request("stalled", "maintenance connections hang", 7, 30.0), 103.2, Step(Following(not_before=133.2))),
    ("a fenced report after the term ended holds nothing off", Following(retry_at=104.0),
     Request("fenced", "epoch 7 is no longer the leader's", 7), 103.2, Step(Following(retry_at=104.0))),
    ("a request about another term changes no hold-off", Releasing(TERM, "r", False, 103.0),
     Request("stalled", "hang", 6, 30.0), 103.2, Step(Releasing(TERM, "r", False, 103.0))),
    # a proof sent before stepping down, answered after: the term stays given up, the unlock still due
    ("a late renewal answer does not bring the term back", Releasing(TERM, "r", False, 103.0),
     Renewed(True, sent=102.5), 103.1, Step(Releasing(TERM, "r", False, 103.0))),
    # a bump answered after its deadline gave the lock back: no term, no Elected, the unlock still due
    ("a bump through after its deadline elects nobody", Releasing(None, "bump blocked", False, 130.1),
     Bumped(8, 4242, 130.0), 130.2, Step(Releasing(None, "bump blocked", False, 130.1))),
]


@pytest.mark.parametrize("state, event, now, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_transition(state, event, now, expected):
    assert step(state, event, now, T, ME) == expected


def test_the_table_covers_every_state_and_event():
    kinds = {(type(c[1]).__name__, type(c[2]).__name__) for c in CASES}
    for state in ("Following", "Leading", "Releasing"):
        for event in ("Round", "Lost", "Request"):
            assert (state, event) in kinds, (state, event)
    answers = {"Tried", "Bumped", "BumpBlocked", "BumpFailed", "Renewed", "Released", "Notified"}
    assert answers <= {e for _, e in kinds}


def test_only_a_leader_s_term_fences():
    assert leading_term(LEAD) == TERM
    assert leading_term(Releasing(TERM, "r", True, 0.0)) is None
    assert leading_term(Following()) is None


def test_without_a_time_a_term_is_trusted_by_the_monotonic_clock():
    # the fence and the passes ask without a time: a lease run out on the real clock is not trusted
    now = time.monotonic()
    assert Term(7, 4242, ME, trusted_until=now + 3600.0).trusted()
    assert not Term(7, 4242, ME, trusted_until=now - 1.0).trusted()


def test_when_each_state_next_needs_a_round():
    assert due(LEAD) == 102.0
    assert due(Leading(TERM, renew_at=200.0)) == 108.0  # the lease runs out before a late renewal
    assert due(Following(won_at=1.0)) == -INF and due(Releasing(None, "r", False, 5.0)) == -INF
    assert due(Following(not_before=5.0, retry_at=3.0)) == 5.0 and due(Following(not_before=INF)) == INF


def test_a_whole_term_from_try_to_hand_over():
    """A run of the machine as the loop drives it: win, bump blocked once, lead, renew twice,
    hand over, hold off, try again."""
    state, log = Following(), []

    def feed(event, now):
        nonlocal state
        state, send, effect = step(state, event, now, T, ME)
        log.append((send, type(effect).__name__ if effect else None))

    feed(Round(True), 0.0)
    feed(Tried(True), 0.01)
    feed(Round(True), 0.02)
    feed(BumpBlocked(), 0.12)
    feed(Round(True), 1.0)
    feed(Bumped(1, 9, 1.0), 1.01)
    for now in (2.0, 3.0):  # 3.0: renewal due (sent 1.0 + 2.0)
        feed(Round(), now)
    feed(Renewed(True, 3.0), 3.01)
    feed(Request("handover", "spread", 1, hold_off=4.0), 4.0)
    feed(Round(), 4.01)
    feed(Released(), 4.02)
    feed(Round(True), 7.9)
    feed(Round(True), 8.0)
    assert log == [("try", None), (None, None), ("bump", None), (None, None), ("bump", None), (None, "Elected"),
                   (None, None), ("renew", None), (None, None), (None, "Demoted"), ("release", None), (None, None),
                   (None, None), ("try", None)]
    assert state == Following(not_before=8.0)
