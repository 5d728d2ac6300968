"""The periodic service (placeholder until its issue lands)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import PassContext, PassResult, Service


@dataclass
class PeriodicEnqueuerResult(PassResult):
    pass


class PeriodicEnqueuer(Service):
    name = "periodic"

    def run_once(self, ctx: PassContext) -> PeriodicEnqueuerResult:
        raise NotImplementedError("periodic is not implemented yet")
