"""Spreading the leaderships of several targets over the replicas (SPEC 7.9): with T targets and R
live replicas, a replica's *cap* is ceil(T/R) + 1 leaderships once stable.

* **Assignment** (:func:`assign`): every replica computes the same owner of each target from the
  target names and the live replicas' ids (rendezvous hashing with bounded loads: at most
  ceil(T/R) each; a replica that comes or goes moves few targets besides its own).
* **Gate** (:meth:`Spread.gate`, asked by the election loop before a follower tries): own targets
  at once (a replica owns at most ceil(T/R), below the cap by themselves; after a lost try, back
  off 1, 2, 4 retry intervals, at most a third of the lease, until a hand-over NOTIFY or a change
  of R); other replicas' lazily, every 2-4 retry intervals (at the cap, every lease or so), so a
  target its owner cannot lead is led.
* **Hand-over** (:meth:`Spread.balance`): above the cap for ``settle`` s, the extra leaderships
  are released gracefully, other replicas' targets only (its own stay below the cap by themselves). A target handed over that this replica
  wins back (its owner did not take it: its schema not ready there, its database unreachable from
  there) *stays*: it is not handed over again for ``STAY`` settles, or until R changes.
* **Start**: no tries for ``JOIN`` s after the targets are started, so replicas started together
  see each other. R is what the election loops read every second: the replicas with a lock
  session connected (a SIGKILLed replica's ends at once, a frozen one's within the lease).
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import threading
import time
from typing import Any, Callable, Sequence

from .logs import kv

log = logging.getLogger("maintd.spread")

REFRESH = 1.0  # seconds between two reads of the live replicas
JOIN = 2 * REFRESH  # no tries for this long after start: replicas started together see each other
PENDING = 30.0  # a granted try counts as a leadership until it is over (or, at worst, this long)
LAZY = (2.0, 4.0)  # retry intervals between two tries of a target this replica does not own
STAY = 30  # settles a target won back after a hand-over is kept before it is handed over again


def cap(targets: int, replicas: int) -> int:
    """The most leaderships one replica keeps once stable: ceil(T/R) + 1."""
    return math.ceil(targets / max(1, replicas)) + 1


def _rank(target: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{target}\0{replica}".encode(), digest_size=8).digest(), "big")


def assign(targets: Sequence[str], replicas: Sequence[str]) -> dict[str, str]:
    """target -> the replica that should lead it: each target, in name order, goes to its
    highest-ranked replica (a hash of both names) that has fewer than ceil(T/R) targets yet.
    Deterministic, so every replica that sees the same live replicas computes the same."""
    live = sorted(set(replicas))
    if not live:
        return {}
    room = math.ceil(len(targets) / len(live))
    load = dict.fromkeys(live, 0)
    out: dict[str, str] = {}
    for target in sorted(targets):
        for replica in sorted(live, key=lambda r: _rank(target, r), reverse=True):
            if load[replica] < room:
                load[replica] += 1
                out[target] = replica
                break
    return out


class Spread:
    """``units``: the targets (``name``, ``is_leader``, ``hand_over()``, ``wake()``);
    ``live_replicas()``: the live replicas' ids, or None when unknown (the last ones are kept)."""

    def __init__(self, units: Sequence[Any], *, me: str, retry_interval: float, settle: float,
                 lease: float, live_replicas: Callable[[], Sequence[str] | None], join: float = JOIN):
        self.units, self.me, self.retry, self.settle = list(units), me, retry_interval, settle
        self.lazy_max = max(retry_interval, lease / 3)  # longest lazy wait below the cap
        self.live_replicas = live_replicas
        self.live: tuple[str, ...] = (me,)
        self.owner: dict[str, str] = assign([u.name for u in self.units], self.live)
        self._read_at = float("-inf")
        self._pending: dict[str, float] = {}
        self._lazy_due: dict[str, tuple[float, bool]] = {}  # name: (when, set below the cap)
        self._lost: dict[str, tuple[int, float]] = {}  # own targets: (tries lost in a row, next try)
        self._over_since: float | None = None
        self._handed: dict[str, float] = {}  # handed over, until then counted as won back if won
        self._stays: dict[str, float] = {}  # won back after a hand-over: kept until then
        self.join = join if len(self.units) > 1 else 0.0  # one target: nothing to spread
        self._join_until = time.monotonic() + self.join
        self._lock = threading.Lock()

    def hold(self) -> None:
        """No tries until :meth:`started`: the targets started first must not try before the
        others are, and before the replicas started with this one are seen."""
        with self._lock:
            self._join_until = float("inf")

    def started(self) -> None:
        """Every target is started: the join wait counts from now."""
        with self._lock:
            self._join_until = time.monotonic() + self.join
        for unit in self.units:
            unit.wake()

    @property
    def replicas(self) -> int:
        return len(self.live)

    @property
    def cap(self) -> int:
        return cap(len(self.units), self.replicas)

    def leading(self) -> int:
        return sum(1 for u in self.units if u.is_leader)

    def owns(self, name: str) -> bool:
        return self.owner.get(name, self.me) == self.me

    def gate(self, name: str, notified: bool = False) -> float:
        """0: target ``name``'s follower tries the lock now; else the seconds to wait before asking
        again (``notified``: a hand-over NOTIFY arrived). No database I/O (the loop's thread)."""
        with self._lock:
            now = time.monotonic()
            if now < self._join_until:
                return self._join_until - now
            if notified:
                self._lost.pop(name, None)
            # Own targets are at most ceil(T/R), below the cap by themselves: leaderships of other
            # replicas' targets taken lazily are what is handed over above it (see balance), so
            # an owner never waits for its own target behind them.
            if self.owns(name):
                backoff = self._lost.get(name, (0, now))[1] - now
                if backoff > 0:
                    return backoff
                self._pending[name] = now
                self._lazy_due.pop(name, None)
                return 0.0
            pending = sum(1 for at in self._pending.values() if now - at < PENDING)
            room = sum(1 for u in self.units if u.is_leader) + pending < self.cap
            due, below = self._lazy_due.get(name) or (None, room)
            if due is None or (below and not room and now >= due):
                # (Re)set; one due below the cap waits the at-cap interval if the cap was reached
                # meanwhile (a dead replica's targets fall due together: not all past the cap).
                due = self._on_grid(now, self._lazy_interval(room), room)
                self._lazy_due[name] = (due, room)
            if now < due:
                return due - now
            del self._lazy_due[name]
            if room:
                self._pending[name] = now
            return 0.0

    def _lazy_interval(self, room: bool) -> float:
        """Below the cap, 2-4 retry intervals (at most a third of the lease); at the cap, a lease
        or so (a safety net, handed over a ``settle`` later)."""
        seconds = random.uniform(*LAZY) * self.retry
        return min(self.lazy_max, seconds) if room else max(3 * self.lazy_max, seconds)

    def _on_grid(self, now: float, wait: float, room: bool) -> float:
        """``now + wait`` moved onto a grid of half retry intervals, so the lazy tries of many
        targets fall due on few instants (one round of the election loop each, not one per
        target). Below the cap: down while that stays at least 2 retry intervals away (or half
        a step below the longest wait, when a short lease makes that shorter), else up, never
        past the longest; at the cap always up (it waits longer, never less)."""
        step, at = self.retry / 2, now + wait
        down, up = math.floor(at / step) * step, math.ceil(at / step) * step
        if not room:
            return up
        longest = min(LAZY[1] * self.retry, self.lazy_max)
        return down if down >= now + min(LAZY[0] * self.retry, longest - step) else up

    def tried(self, name: str, won: bool = False) -> None:
        """Target ``name``'s try is over (lost: an own target's next try backs off)."""
        with self._lock:
            self._pending.pop(name, None)
            if won and self._handed.pop(name, -math.inf) > time.monotonic():
                log.info("kept a target handed over and found unled: its owner does not lead it",
                         extra=kv(target=name, owner=self.owner.get(name)))
                self._stays[name] = time.monotonic() + STAY * self.settle
            if won or not self.owns(name):
                self._lost.pop(name, None)
                return
            lost = self._lost.get(name, (0, 0.0))[0] + 1
            self._lost[name] = (lost, time.monotonic() + min(self.lazy_max, self.retry * 2 ** (lost - 1)))

    def forget(self, names: Sequence[str]) -> None:
        """The lock session was lost: tries granted to ``names`` got no answer and count no more."""
        with self._lock:
            for name in names:
                self._pending.pop(name, None)

    def refresh(self, at_once: bool = False) -> None:
        """Take the live replicas in (at most every ``REFRESH`` s, unless ``at_once``: an election
        loop read a change); the targets this replica owns now are tried at once."""
        with self._lock:
            now = time.monotonic()
            if now - self._read_at < REFRESH and not at_once:
                return
            self._read_at = now
        found = self.live_replicas()
        if found is None:
            return
        live = tuple(sorted(set(found) | {self.me}))
        with self._lock:
            if live == self.live:
                return
            log.info("live replicas changed", extra=kv(replicas=len(live), was=len(self.live),
                                                       targets=len(self.units), cap=cap(len(self.units), len(live))))
            self.live = live
            self.owner = assign([u.name for u in self.units], live)
            self._lazy_due.clear()
            self._lost.clear()  # a holder may have died
            self._handed.clear()
            self._stays.clear()  # new owners: spread again
        for unit in self.units:
            if self.owns(unit.name) and not unit.is_leader:
                unit.wake()

    def balance(self) -> int:
        """Hand over the leaderships above the cap once it has lasted ``settle`` seconds: targets
        owned by another replica (never one that stays); returns how many were handed over."""
        self.refresh()
        now = time.monotonic()
        leaders = [u for u in self.units if u.is_leader]
        # Only other replicas' targets go (an owner's own stay within the cap by themselves), and
        # of those, not one that stays.
        movable = [u for u in leaders if not self.owns(u.name) and self._stays.get(u.name, -math.inf) <= now]
        excess = min(len(leaders) - self.cap, len(movable))
        if excess <= 0:
            self._over_since = None
            return 0
        if self._over_since is None:
            self._over_since = now
        if now - self._over_since < self.settle:  # (reset by a hand-over: one per settle at most)
            return 0
        self._over_since = None
        reason = f"spreading the targets: leading {len(leaders)}, cap {self.cap} with {self.replicas} replicas"
        log.info("handing leaderships over", extra=kv(count=excess, leading=len(leaders), cap=self.cap,
                                                      replicas=self.replicas))
        random.shuffle(movable)
        hold_off = LAZY[1] * self.retry
        for unit in movable[:excess]:
            with self._lock:  # won again by then, it was unled: the lazy try at the cap comes
                # after the hold-off and about three lazy intervals
                self._handed[unit.name] = now + hold_off + 2 * 3 * self.lazy_max
            unit.hand_over(reason, hold_off=hold_off)
        return excess
