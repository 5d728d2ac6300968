"""One target's election as data (SPEC 8.3): a state and a pure :func:`step` function.

A target is *following* (trying for the lock when allowed; once won, bumping the epoch), *leading*
(with its :class:`Term`, proving the lock every ``renew_interval``) or *releasing* (giving the lock
back: a graceful release also ends the term in ``leader`` and wakes the followers). The database
loop (:class:`maintd.leader.ElectionLoop`) feeds each target's state what happened (:class:`Round`:
its turn to send; an answer; a request; the session lost) and carries out what :func:`step` returns:
at most one statement to send (only on a :class:`Round`) and at most one effect (elected, demoted).
Time is a parameter (``now``, monotonic seconds): the table of cases in ``tests/test_election.py``
runs without a database or a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple, Union

INF = math.inf


@dataclass(frozen=True)
class Term:
    epoch: int
    lock_pid: int  # pg_backend_pid() of the lock session: the server's pid, not a pooler's key
    instance_id: str
    trusted_until: float  # monotonic time after which the lease may have run out

    def trusted(self, now: float | None = None) -> bool:
        import time

        return (time.monotonic() if now is None else now) < self.trusted_until


@dataclass(frozen=True)
class Timing:
    renew: float  # renew_interval
    trust: float  # lease - renew_interval: how long a proof is trusted after it was sent
    bump_deadline: float  # how long a won lock may wait for its epoch bump before it is given up
    retry: float  # retry_interval: the hold-off after a failed bump


@dataclass(frozen=True)
class Following:
    not_before: float = 0.0  # no try before this (a hold-off after stepping down, or stopped)
    retry_at: float = 0.0  # after a lost try, retry_interval later (a hand-over NOTIFY ends the wait)
    won_at: float | None = None  # the lock is won, the epoch bump not through yet (since then)


@dataclass(frozen=True)
class Leading:
    term: Term
    renew_at: float  # when the next proof is due


@dataclass(frozen=True)
class Releasing:
    term: Term | None  # None: a lock won whose epoch bump was given up
    reason: str
    graceful: bool  # end the term in `leader` and NOTIFY the followers, or only unlock
    not_before: float  # the following state's hold-off once released


State = Union[Following, Leading, Releasing]


# -- what happened ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Round:
    gate_open: bool = True  # a follower may try now (the spread's gate)
    renew_by: float = -INF  # a leader whose proof is due by then sends it now (renewals go together)


@dataclass(frozen=True)
class Tried:
    won: bool


@dataclass(frozen=True)
class Bumped:
    epoch: int
    lock_pid: int
    sent: float  # when the successful bump was sent


@dataclass(frozen=True)
class BumpBlocked:
    """The bump met an old leader's in-flight fenced transaction (its short lock_timeout)."""


@dataclass(frozen=True)
class BumpFailed:
    """The bump failed for another reason (e.g. the schema is gone): the lock is given back."""

    reason: str


@dataclass(frozen=True)
class Renewed:
    held: bool  # this session still holds the lock (on a primary)
    sent: float


@dataclass(frozen=True)
class Released:
    """The unlock (or graceful release) went through."""


@dataclass(frozen=True)
class Notified:
    """A hand-over NOTIFY: the leader let go, try again without waiting for retry_interval."""


@dataclass(frozen=True)
class Lost:
    reason: str  # the session is gone, and every lock with it


@dataclass(frozen=True)
class Request:
    kind: Literal["fenced", "stalled", "handover", "stop"]
    reason: str
    epoch: int | None = None  # only that term (a late report about an old term is ignored)
    hold_off: float = 0.0  # no try for this long once released


Event = Union[Round, Tried, Bumped, BumpBlocked, BumpFailed, Renewed, Released, Notified, Lost, Request]
Send = Literal["try", "bump", "renew", "release", "unlock"]


@dataclass(frozen=True)
class Elected:
    term: Term


@dataclass(frozen=True)
class Demoted:
    reason: str


class Step(NamedTuple):
    state: State
    send: Send | None = None
    effect: Elected | Demoted | None = None


def step(state: State, event: Event, now: float, timing: Timing, instance_id: str) -> Step:
    """The next state of one target, what to send (on a :class:`Round` only), and the effect."""
    if isinstance(event, Lost):
        return _lost(state, event, now)
    if isinstance(event, Request):
        return _request(state, event, now)
    if isinstance(state, Following):
        return _following(state, event, now, timing, instance_id)
    if isinstance(state, Leading):
        return _leading(state, event, now, timing)
    if isinstance(event, Round):
        return Step(state, "release" if state.graceful and state.term is not None else "unlock")
    if isinstance(event, Released):
        return Step(Following(not_before=state.not_before))
    return Step(state)


def _following(state: Following, event: Event, now: float, timing: Timing, instance_id: str) -> Step:
    if isinstance(event, Round):
        if state.won_at is not None:
            if now - state.won_at > timing.bump_deadline:
                return Step(Releasing(None, "the epoch bump stayed blocked", False, now), "unlock")
            return Step(state, "bump")
        ready = event.gate_open and now >= max(state.not_before, state.retry_at)
        return Step(state, "try" if ready else None)
    if isinstance(event, Tried) and state.won_at is None:
        return Step(replace(state, won_at=now) if event.won else replace(state, retry_at=now + timing.retry))
    if isinstance(event, Notified):
        return Step(replace(state, retry_at=0.0))
    if isinstance(event, Bumped) and state.won_at is not None:
        term = Term(event.epoch, event.lock_pid, instance_id, event.sent + timing.trust)
        return Step(Leading(term, event.sent + timing.renew), effect=Elected(term))
    if isinstance(event, BumpFailed) and state.won_at is not None:
        return Step(Releasing(None, event.reason, False, now + timing.retry))
    return Step(state)


def _leading(state: Leading, event: Event, now: float, timing: Timing) -> Step:
    if isinstance(event, Round):
        if not state.term.trusted(now):
            reason = "lease expired before it could be renewed"
            return Step(Releasing(state.term, reason, False, now), "unlock", Demoted(reason))
        return Step(state, "renew" if max(now, event.renew_by) >= state.renew_at else None)
    if isinstance(event, Renewed):
        if event.held:
            term = replace(state.term, trusted_until=event.sent + timing.trust)
            return Step(Leading(term, event.sent + timing.renew))
        reason = "advisory lock no longer held (or the server is not a primary)"
        return Step(Releasing(state.term, reason, False, now), effect=Demoted(reason))
    return Step(state)


def _request(state: State, req: Request, now: float) -> Step:
    stop = req.kind == "stop"
    if isinstance(state, Leading) and (stop or req.epoch in (None, state.term.epoch)):
        graceful = req.kind in ("handover", "stop")
        until = INF if stop else now + req.hold_off
        return Step(Releasing(state.term, req.reason, graceful, until), effect=Demoted(req.reason))
    releasing = isinstance(state, Releasing)
    if not stop:
        if releasing:  # the term being released keeps the longest hold-off asked for it
            holds = state.term is not None and req.epoch in (None, state.term.epoch)
        else:  # so does a follower whose term ended another way meanwhile (lost, lease run out)
            holds = isinstance(state, Following) and req.hold_off > 0
        return Step(replace(state, not_before=max(state.not_before, now + req.hold_off)) if holds else state)
    if releasing:
        return Step(replace(state, not_before=INF))
    if state.won_at is not None:
        return Step(Releasing(None, req.reason, False, INF))
    return Step(Following(not_before=INF))


def _lost(state: State, event: Lost, now: float) -> Step:
    if isinstance(state, Leading):
        return Step(Following(not_before=now), effect=Demoted(event.reason))
    return Step(Following(not_before=state.not_before, retry_at=getattr(state, "retry_at", 0.0)))


def due(state: State) -> float:
    """When the state next needs a round (monotonic; -inf: now; inf: never by itself)."""
    if isinstance(state, Leading):
        return min(state.renew_at, state.term.trusted_until)
    if isinstance(state, Releasing) or state.won_at is not None:
        return -INF
    return max(state.not_before, state.retry_at)


def leading_term(state: State) -> Term | None:
    """The term a fence may rely on: a leader's, never one being released."""
    return state.term if isinstance(state, Leading) else None
