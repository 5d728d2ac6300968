"""The maintenance services. A new service is one module here plus one line in ``SERVICES``."""

from __future__ import annotations

from .base import NotLeader, PassContext, PassResult, Service
from .cleaner import Cleaner
from .periodic import PeriodicEnqueuer
from .reindexer import Reindexer
from .rescuer import Rescuer
from .scheduler import Scheduler

SERVICES: dict[str, type[Service]] = {
    cls.name: cls for cls in (Cleaner, Rescuer, Scheduler, PeriodicEnqueuer, Reindexer)
}

__all__ = ["SERVICES", "NotLeader", "PassContext", "PassResult", "Service"]
