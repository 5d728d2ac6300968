"""The maintenance services. A new service is one module here plus one line in ``SERVICES``:
its name, its class, and where its config section lives in the settings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from .base import NotLeader, PassContext, PassResult, Service
from .cleaner import Cleaner
from .partitioner import Partitioner, PartitionerConfig
from .periodic import PeriodicEnqueuer
from .reindexer import Reindexer
from .rescuer import Rescuer
from .scheduler import Scheduler

if TYPE_CHECKING:
    from ..config import Settings


class ServiceSpec(NamedTuple):
    cls: type[Service]
    section: Callable[["Settings"], Any]


SERVICES: dict[str, ServiceSpec] = {
    "cleaner": ServiceSpec(Cleaner, lambda s: s.cleaner),
    "rescuer": ServiceSpec(Rescuer, lambda s: s.rescuer),
    "scheduler": ServiceSpec(Scheduler, lambda s: s.scheduler),
    "periodic": ServiceSpec(PeriodicEnqueuer, lambda s: s.periodic_entries),
    "reindexer": ServiceSpec(Reindexer, lambda s: s.reindexer),
    "partitioner": ServiceSpec(Partitioner, lambda s: PartitionerConfig(s.layout, s.partitions, s.cleaner)),
}


def build_services(settings: "Settings") -> dict[str, Service]:
    """One instance of every service, each with its own config section."""
    return {name: spec.cls(spec.section(settings)) for name, spec in SERVICES.items()}


__all__ = ["SERVICES", "NotLeader", "PassContext", "PassResult", "Service", "build_services"]
