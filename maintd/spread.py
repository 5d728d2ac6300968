"""Spreading the leaderships of several targets over the replicas (SPEC 7.9).

With T targets and R live replicas, a replica's *cap* is ceil(T/R) + 1 leaderships.

* Below its cap, a replica tries free locks as usual (every ``retry_interval``, at once on a
  hand-over NOTIFY). At its cap it still tries, but only every 1.5-2.5 retry intervals
  (``lazy``): a replica below its cap usually gets a free lock first, and no lock stays free when every replica is at
  its cap (a dead replica counted live a little longer, for example).
* Above its cap for ``settle`` seconds (hysteresis), it hands the extra leaderships over
  gracefully: release, NOTIFY, and a hold-off on those targets so that another replica takes them.
  After a hand-over it waits ``settle`` again before the next one.
* R is read every ``REFRESH`` seconds from a target's ``daemons`` table: the replicas whose lock
  session is connected now (``pg_stat_activity``), see
  :data:`maintd.queries.daemons.LIVE_REPLICAS`.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from typing import Callable, Protocol, Sequence

from .logs import kv

log = logging.getLogger("maintd.spread")

REFRESH = 1.0  # seconds between two reads of R
PENDING = 1.0  # a granted try counts as a leadership for this long (or until elected)


def cap(targets: int, replicas: int) -> int:
    """The most leaderships one replica keeps once stable: ceil(T/R) + 1."""
    return math.ceil(targets / max(1, replicas)) + 1


class Unit(Protocol):
    name: str

    @property
    def is_leader(self) -> bool: ...

    def hand_over(self, reason: str, hold_off: float) -> None: ...


class Spread:
    """The gate of each target's follower (:meth:`may_try`) and the hand-over decision
    (:meth:`balance`, from the daemon's main loop). ``count_replicas`` returns R or None when
    it cannot be read (R is kept)."""

    def __init__(self, units: Sequence[Unit], *, retry_interval: float, settle: float,
                 count_replicas: Callable[[], int | None]):
        self.units = list(units)
        self.retry = retry_interval
        self.settle = settle
        self.count_replicas = count_replicas
        self.replicas = 1
        self._read_at = float("-inf")
        self._pending: dict[str, float] = {}
        self._lazy_due: dict[str, float] = {}
        self._over_since: float | None = None
        self._handed_at = float("-inf")
        self._lock = threading.Lock()

    @property
    def cap(self) -> int:
        return cap(len(self.units), self.replicas)

    def leading(self) -> int:
        return sum(1 for u in self.units if u.is_leader)

    def may_try(self, name: str) -> bool:
        """Whether target ``name``'s follower tries the lock this round."""
        with self._lock:
            now = time.monotonic()
            pending = sum(1 for at in self._pending.values() if now - at < PENDING)
            if self.leading() + pending < self.cap:
                self._pending[name] = now
                return True
            due = self._lazy_due.setdefault(name, now + random.uniform(0.5, 1.5) * self.retry)
            if now < due:
                return False
            del self._lazy_due[name]
            return True

    def elected(self, name: str) -> None:
        with self._lock:
            self._pending.pop(name, None)

    def refresh(self) -> None:
        now = time.monotonic()
        if now - self._read_at < REFRESH:
            return
        self._read_at = now
        n = self.count_replicas()
        if n is not None and n != self.replicas:
            log.info("live replicas changed", extra=kv(replicas=n, was=self.replicas,
                                                       targets=len(self.units), cap=cap(len(self.units), n)))
            self.replicas = max(1, n)

    def balance(self) -> int:
        """Hand over the leaderships above the cap once it has lasted ``settle`` seconds; returns
        how many were handed over."""
        self.refresh()
        now = time.monotonic()
        leaders = [u for u in self.units if u.is_leader]
        excess = len(leaders) - self.cap
        if excess <= 0:
            self._over_since = None
            return 0
        if self._over_since is None:
            self._over_since = now
        if now - self._over_since < self.settle or now - self._handed_at < self.settle:
            return 0
        self._handed_at, self._over_since = now, None
        reason = f"spreading the targets: leading {len(leaders)}, cap {self.cap} with {self.replicas} replicas"
        log.info("handing leaderships over", extra=kv(count=excess, leading=len(leaders), cap=self.cap,
                                                      replicas=self.replicas))
        for unit in random.sample(leaders, excess):
            unit.hand_over(reason, hold_off=2 * self.settle)
        return excess
