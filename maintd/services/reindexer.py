"""The reindexer service (placeholder until its issue lands)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import PassContext, PassResult, Service


@dataclass
class ReindexerResult(PassResult):
    pass


class Reindexer(Service):
    name = "reindexer"

    def run_once(self, ctx: PassContext) -> ReindexerResult:
        raise NotImplementedError("reindexer is not implemented yet")
