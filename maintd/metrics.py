"""The Prometheus metrics of SPEC section 6, on a registry owned by one daemon (no globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the HTTP server)

__all__ = ["CONTENT_TYPE_LATEST", "Metrics", "RUN_BUCKETS"]

RUN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.is_leader = Gauge("maintd_is_leader", "1 while this instance holds the leader lock.",
                               registry=r)
        self.leadership_changes = Counter("maintd_leadership_changes",
                                          "Times this instance gained or lost leadership.", registry=r)
        self.service_runs = Counter("maintd_service_runs", "Service passes by outcome "
                                    "(success, error, fenced, skipped).", ["service", "outcome"], registry=r)
        self.service_run_seconds = Histogram("maintd_service_run_seconds", "Duration of service passes.",
                                             ["service"], buckets=RUN_BUCKETS, registry=r)
        self.service_last_success = Gauge("maintd_service_last_success_timestamp_seconds",
                                          "Unix time of the last successful pass.", ["service"], registry=r)
        self.jobs_deleted = Counter("maintd_jobs_deleted", "Final jobs deleted by the cleaner.",
                                    ["state"], registry=r)
        self.jobs_rescued = Counter("maintd_jobs_rescued", "Stuck running jobs rescued "
                                    "(outcome: retried or discarded).", ["outcome"], registry=r)
        self.jobs_promoted = Counter("maintd_jobs_promoted", "Scheduled/retryable jobs made available.",
                                     ["queue"], registry=r)
        self.periodic_enqueued = Counter("maintd_periodic_enqueued", "Periodic jobs enqueued.",
                                         ["periodic_id"], registry=r)
        self.periodic_skipped = Counter("maintd_periodic_skipped", "Periodic slots not enqueued "
                                        "(reason: duplicate, disabled, outside_backfill).",
                                        ["periodic_id", "reason"], registry=r)
        self.reindex = Counter("maintd_reindex", "Reindex attempts by outcome.", ["index", "outcome"],
                               registry=r)
        self.reindex_seconds = Gauge("maintd_reindex_duration_seconds",
                                     "How long the last reindex of an index took.", ["index"], registry=r)
        self.jobs = Gauge("maintd_jobs", "Jobs by queue and state (refreshed by the leader).",
                          ["queue", "state"], registry=r)
        self.oldest_available_age = Gauge("maintd_oldest_available_job_age_seconds",
                                          "Age of the oldest available job per queue.", ["queue"],
                                          registry=r)
        self.up = Gauge("maintd_database_up", "1 while the daemon's database connection is healthy.",
                        registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
