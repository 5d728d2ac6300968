"""The maintenance services, registered in one place: ``SERVICES`` (name, class, and where its
config section lives in the settings). Adding a service is:

* its module here: a :class:`~maintd.services.base.Service` with ``run_once(ctx)`` returning a typed
  :class:`~maintd.services.base.PassResult`, its metric families (:class:`maintd.metrics.Family`)
  listed in ``METRICS`` and recorded in ``observe()``, and, if an index probe can tell whether a
  pass would find work, ``probe()``/``after_probe()`` (then the database's probe drives it);
* in the same module, its config section: a :class:`maintd.sections.ServiceConfig` (every key
  validated, with the key named in errors), made a field of :class:`maintd.config.Settings` (and,
  if a ``[[targets]]`` entry may override it, of ``TargetConfig`` and ``TARGET_SECTIONS``) and
  shown in ``config.example.toml``;
* its SQL in ``maintd/queries/<table>.py`` (``:name`` parameters, rendered per target);
* one line in ``SERVICES``;
* optionally, how ``maintd status`` and the dashboard sum up its stored results
  (``maintd/pass_summary.py``, which also reads results an older version wrote); without it, a
  pass's whole numbers are listed.

The periodic enqueuer's entries are in ``periodic_config.py``, shared by its two sources of
entries (``periodic.py``: the config and crontab; ``periodic_rows.py``: the ``periodic_jobs`` rows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from ..metrics import Family
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
    "partitioner": ServiceSpec(Partitioner, PartitionerConfig.of),
}


def metric_families() -> list[Family]:
    """Every service's metric families, once each (the cleaner and the partitioner share one)."""
    return list(dict.fromkeys(f for spec in SERVICES.values() for f in spec.cls.METRICS))


def build_services(settings: "Settings") -> dict[str, Service]:
    """One instance of every service, each with its own config section."""
    return {name: spec.cls(spec.section(settings)) for name, spec in SERVICES.items()}


__all__ = ["SERVICES", "NotLeader", "PassContext", "PassResult", "Service", "build_services", "metric_families"]
