"""The scheduler service (placeholder until its issue lands)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import PassContext, PassResult, Service


@dataclass
class SchedulerResult(PassResult):
    pass


class Scheduler(Service):
    name = "scheduler"

    def run_once(self, ctx: PassContext) -> SchedulerResult:
        raise NotImplementedError("scheduler is not implemented yet")
