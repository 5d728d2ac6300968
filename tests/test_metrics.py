"""The metric families: the daemon's in maintd/metrics.py, each service's beside it (``METRICS``),
and which series of a target exist as its services are enabled and disabled (SPEC 7.4)."""

from __future__ import annotations

import pytest
from prometheus_client import Counter

from maintd.metrics import Family, Metrics
from maintd.services import SERVICES, metric_families
from maintd.services.scheduler import JOBS_PROMOTED

FAMILIES = {name: spec.cls.METRICS for name, spec in SERVICES.items()}


def test_known_series_follow_the_enabled_services_and_spare_other_targets():
    a = Metrics(target="a")
    b = Metrics(target="b", shared=a)
    value = a.registry.get_sample_value
    for m in (a, b):
        m.known_series(["cleaner", "rescuer", "scheduler"], FAMILIES)
    assert value("maintd_jobs_deleted_total", {"target": "a", "state": "discarded"}) == 0
    assert value("maintd_jobs_rescued_total", {"target": "a", "outcome": "exhausted"}) == 0
    assert value("maintd_partition_stray_rows", {"target": "a"}) is None  # partitioner not enabled
    a[JOBS_PROMOTED].labels("q").inc(3)
    b[JOBS_PROMOTED].labels("q").inc(2)

    a.known_series(["partitioner"], FAMILIES)  # the cleaner, rescuer and scheduler disabled on a
    assert value("maintd_jobs_deleted_total", {"target": "a", "state": "discarded"}) == 0  # the partitioner's too
    assert value("maintd_jobs_rescued_total", {"target": "a", "outcome": "exhausted"}) is None
    assert value("maintd_jobs_promoted_total", {"target": "a", "queue": "q"}) is None
    assert value("maintd_partition_stray_rows", {"target": "a"}) == 0
    assert value("maintd_service_runs_total", {"target": "a", "service": "cleaner", "outcome": "success"}) is None
    assert value("maintd_jobs_promoted_total", {"target": "b", "queue": "q"}) == 2
    assert value("maintd_jobs_rescued_total", {"target": "b", "outcome": "exhausted"}) == 0


def test_every_family_is_declared_once_and_the_daemon_exports_them_all_from_the_start():
    names = [f.name for f in metric_families()]
    assert len(names) == len(set(names))
    body = Metrics(target="t").render().decode()
    for family in metric_families():
        assert f"# HELP {family.name}" in body  # before any pass: an operator can see what exists
    with pytest.raises(ValueError, match="maintd_jobs_promoted is declared twice"):
        Metrics(target="t")[Family(Counter, "maintd_jobs_promoted", "other help")]
