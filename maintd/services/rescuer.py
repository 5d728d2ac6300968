"""The rescuer service (placeholder until its issue lands)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import PassContext, PassResult, Service


@dataclass
class RescuerResult(PassResult):
    pass


class Rescuer(Service):
    name = "rescuer"

    def run_once(self, ctx: PassContext) -> RescuerResult:
        raise NotImplementedError("rescuer is not implemented yet")
