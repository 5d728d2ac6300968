"""The cleaner service (placeholder until its issue lands)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import PassContext, PassResult, Service


@dataclass
class CleanerResult(PassResult):
    pass


class Cleaner(Service):
    name = "cleaner"

    def run_once(self, ctx: PassContext) -> CleanerResult:
        raise NotImplementedError("cleaner is not implemented yet")
