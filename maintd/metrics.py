"""The Prometheus metrics (SPEC sections 6 and 7.4), on a registry owned by one daemon (no
globals), and the job gauges the leader refreshes from the jobs table."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the HTTP server)
from sqlalchemy import Engine

from .db import describe_db_error
from .logs import kv
from .queries import FINAL_STATES, JOB_STATES, jobs, sql

__all__ = ["CONTENT_TYPE_LATEST", "JobGauges", "Metrics", "RUN_BUCKETS", "job_counts"]

log = logging.getLogger("maintd.metrics")

RUN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Bound:
    """One metric with its ``target`` label bound: the usual ``labels``/``set``/``inc``/
    ``observe``/``remove``/``clear`` calls, minus the target."""

    def __init__(self, metric: Any, target: str):
        self.metric, self.target = metric, target

    def labels(self, *values: str) -> Any:
        return self.metric.labels(self.target, *values)

    def remove(self, *values: str) -> None:
        try:
            self.metric.remove(self.target, *values)
        except KeyError:
            pass

    def children(self) -> list[tuple[str, ...]]:
        """The label values (after the target) of this target's series."""
        return [k[1:] for k in list(self.metric._metrics) if k[0] == self.target]

    def clear(self) -> None:
        for values in self.children():
            self.remove(*values)

    def __getattr__(self, name: str) -> Any:  # set, inc, observe on an unlabelled metric
        return getattr(self.metric.labels(self.target), name)


class Metrics:
    """Every series carries ``target`` (SPEC 7.4): the target's name, by default its schema.
    Series with a known label set exist from the start at 0 (:meth:`known_series`)."""

    def __init__(self, registry: CollectorRegistry | None = None, target: str = "maintd",
                 max_queues: int = 100, *, shared: "Metrics | None" = None):
        """``shared``: another target's Metrics whose registry and series families this one
        uses too (several targets in one process, one /metrics)."""
        self.registry = shared.registry if shared else (registry or CollectorRegistry(auto_describe=True))
        self.target = target
        self.max_queues = max_queues
        self._queues_seen: set[str] = set()
        self._families: dict[str, Any] = shared._families if shared else {}
        r, t, families = self.registry, ["target"], self._families

        def bound(cls: Any, name: str, doc: str, labels: tuple[str, ...] = (), **kw: Any) -> Bound:
            if name not in families:
                families[name] = cls(name, doc, [*t, *labels], registry=r, **kw)
            return Bound(families[name], target)

        self.is_leader = bound(Gauge, "maintd_is_leader", "1 while this instance holds the leader lock.")
        self.leadership_changes = bound(Counter, "maintd_leadership_changes",
                                        "Times this instance gained or lost leadership.")
        self.service_runs = bound(Counter, "maintd_service_runs", "Service passes by outcome "
                                  "(success, error, fenced, stopped).", ("service", "outcome"))
        self.service_run_seconds = bound(Histogram, "maintd_service_run_seconds",
                                         "Duration of the work of service passes (not their waits).",
                                         ("service",), buckets=RUN_BUCKETS)
        self.service_last_success = bound(Gauge, "maintd_service_last_success_timestamp_seconds",
                                          "Unix time (database server clock) of the last successful pass.",
                                          ("service",))
        self.jobs_deleted = bound(Counter, "maintd_jobs_deleted", "Final jobs deleted by the cleaner.", ("state",))
        self.jobs_rescued = bound(Counter, "maintd_jobs_rescued", "Stuck running jobs rescued "
                                  "(outcome: retried or discarded), and waiting jobs with no attempt left "
                                  "discarded (outcome: exhausted).", ("outcome",))
        self.jobs_promoted = bound(Counter, "maintd_jobs_promoted", "Scheduled/retryable jobs made available.",
                                   ("queue",))
        self.periodic_enqueued = bound(Counter, "maintd_periodic_enqueued", "Periodic jobs enqueued.",
                                       ("periodic_id",))
        self.periodic_skipped = bound(Counter, "maintd_periodic_skipped", "Periodic slots not enqueued "
                                      "(reason: duplicate, disabled, outside_backfill, error).",
                                      ("periodic_id", "reason"))
        self.rows_skipped = bound(Counter, "maintd_rows_skipped", "Rows a service passed over or handled "
                                  "specially (with a logged reason).", ("service", "reason"))
        self.reindex = bound(Counter, "maintd_reindex", "Reindex attempts by outcome.", ("index", "outcome"))
        self.reindex_seconds = bound(Gauge, "maintd_reindex_duration_seconds",
                                     "How long the last reindex of an index took.", ("index",))
        self.jobs = bound(Gauge, "maintd_jobs", "Jobs by queue and state (refreshed by the leader; "
                          "queues past metrics.max_queues summed as _other).", ("queue", "state"))
        self.oldest_available_age = bound(Gauge, "maintd_oldest_available_job_age_seconds",
                                          "Age of the oldest available job per queue.", ("queue",))
        self.up = bound(Gauge, "maintd_database_up", "1 while the daemon's database connection is healthy.")
        self.partition_stray_rows = bound(Gauge, "maintd_partition_stray_rows",
                                          "Jobs in the partitioned layout's catch-all partitions (SPEC 8.1), "
                                          "read by the partitioner's last pass.")
        for gauge in (self.is_leader, self.leadership_changes, self.up):
            gauge.labels()  # unlabelled series of this target exist from the start

    def known_series(self, services: list[str]) -> None:
        """Create the series with a known label set at 0, and drop those of services that are no
        longer enabled (a disabled service has no series: no stale alert)."""
        for state in FINAL_STATES:
            self.jobs_deleted.labels(state)
        for outcome in ("retried", "discarded"):
            self.jobs_rescued.labels(outcome)
        for metric in (self.service_runs, self.service_run_seconds, self.service_last_success):
            for values in metric.children():
                if values[0] not in services:
                    metric.remove(*values)
        if "partitioner" in services:
            self.partition_stray_rows.labels()
        else:
            self.partition_stray_rows.remove()
        for service in services:
            for outcome in ("success", "error", "fenced", "stopped"):
                self.service_runs.labels(service, outcome)
            self.service_run_seconds.labels(service)

    def queue_label(self, queue: str) -> str:
        """A queue's label on a per-queue counter: the first ``max_queues`` queues seen keep their
        name, later ones count under ``_other`` (bounded cardinality)."""
        seen = self._queues_seen
        if queue in seen or len(seen) < self.max_queues:
            seen.add(queue)
            return queue
        return OTHER

    def render(self) -> bytes:
        return generate_latest(self.registry)


def job_counts(conn: Any, schema: str, *, final: bool = True) -> list[dict[str, Any]]:
    """Jobs by queue and state: live states always, final ones when ``final``."""
    rows = list(conn.execute(sql(jobs.COUNT_LIVE, schema)))
    if final:
        rows += list(conn.execute(sql(jobs.COUNT_FINAL, schema)))
    return sorted(({"queue": r.queue, "state": r.state, "count": r.n} for r in rows),
                  key=lambda r: (r["queue"], JOB_STATES.index(r["state"])))


def oldest_available(conn: Any, schema: str) -> dict[str, float]:
    return {r.queue: r.age for r in conn.execute(sql(jobs.OLDEST_AVAILABLE, schema))}


OTHER = "_other"  # the queues past metrics.max_queues, summed


def finite_age(age: float | None) -> float:
    """An age for a gauge: a job with an infinite scheduled_at must not make it NaN or infinite."""
    if age is None or age != age or age in (float("inf"), float("-inf")):
        return 0.0
    return max(0.0, age)


class JobGauges:
    """``maintd_jobs`` and the backlog age, refreshed by the leader every ``INTERVAL`` seconds.
    Live states are cheap (partial indexes); the per-queue counts of final states read the heap,
    so they are refreshed every ``FINAL_INTERVAL`` seconds only."""

    INTERVAL = 15.0
    FINAL_INTERVAL = 300.0
    TIMEOUT_MS = 10_000

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self._final_counted_at = float("-inf")

    def clear(self) -> None:
        self.metrics.jobs.clear()
        self.metrics.oldest_available_age.clear()
        self._final_counted_at = float("-inf")

    def refresh(self, engine: Engine, schema: str, *, still_leading: Callable[[], bool] = lambda: True,
                lock: Any = None, final: bool | None = None) -> None:
        """Read the counts (final states too when due, or when ``final``) and set the gauges."""
        now = time.monotonic()
        if final is None:
            final = now - self._final_counted_at >= self.FINAL_INTERVAL
        try:
            with engine.connect() as conn:
                conn.exec_driver_sql(f"SET LOCAL statement_timeout = {self.TIMEOUT_MS}")
                counts, oldest = job_counts(conn, schema, final=final), oldest_available(conn, schema)
        except Exception as exc:
            log.debug("could not refresh job gauges", extra=kv(error=describe_db_error(exc)))
            return
        with lock or threading.Lock():
            if not still_leading():  # leadership ended meanwhile: followers export no job gauges
                return
            self.apply(counts, oldest, final=final)
        if final:
            self._final_counted_at = now

    def apply(self, counts: list[dict[str, Any]], oldest: dict[str, float], *, final: bool) -> None:
        gauge = self.metrics.jobs
        for queue, state in gauge.children():
            if state not in FINAL_STATES or final:
                gauge.remove(queue, state)
        totals: dict[str, float] = {q: 0 for q in oldest}
        for row in counts:
            totals[row["queue"]] = totals.get(row["queue"], 0) + row["count"]
        kept = set(sorted(totals, key=lambda q: (-totals[q], q))[:self.metrics.max_queues])
        summed: dict[tuple[str, str], float] = {}
        for row in counts:
            key = (row["queue"] if row["queue"] in kept else OTHER, row["state"])
            summed[key] = summed.get(key, 0) + row["count"]
        for (queue, state), n in summed.items():
            gauge.labels(queue, state).set(n)
        self.metrics.oldest_available_age.clear()
        ages: dict[str, float] = {}
        for queue, age in oldest.items():
            name = queue if queue in kept else OTHER
            ages[name] = max(ages.get(name, 0.0), finite_age(age))
        for queue, age in ages.items():
            self.metrics.oldest_available_age.labels(queue).set(age)
