"""The Prometheus metrics (SPEC sections 6 and 7.4), on a registry owned by one daemon (no
globals), and the job gauges the leader refreshes from the jobs table."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the HTTP server)
from sqlalchemy import Engine, text

from .db import describe_db_error
from .logs import escape_all, kv
from .queries import FINAL_STATES, JOB_STATES, catalog, jobs, sql

__all__ = ["CONTENT_TYPE_LATEST", "Family", "JobCounts", "JobGauges", "Metrics", "RUN_BUCKETS", "job_counts"]

log = logging.getLogger("maintd.metrics")

# No ``*_created`` series: in the text format Prometheus ingests them as gauges of their own, one
# beside every counter and histogram series (the counters' cardinality doubled, under names the
# README and the alerts never mention). Set before any family is made (it is read per metric).
disable_created_metrics()

RUN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Bound:
    """One metric with its ``target`` label bound: the usual ``labels``/``set``/``inc``/
    ``observe``/``remove``/``clear`` calls, minus the target. Label values are names (a queue, a
    periodic id) made into labels by :func:`label_value`, and None is the overflow, ``_other``
    (past ``max_queues``, ``max_periodic_ids``): no name shares a label with another or with it."""

    def __init__(self, metric: Any, target: str):
        self.metric, self.target = metric, target

    def labels(self, *values: str | None) -> Any:
        return self.metric.labels(self.target, *map(label_value, values))

    def remove(self, *values: str | None) -> None:
        self.remove_series(*map(label_value, values))

    def remove_series(self, *labels: str) -> None:
        """Remove the series of these label values (as :meth:`children` gives them: made already)."""
        try:
            self.metric.remove(self.target, *labels)
        except KeyError:
            pass

    def children(self) -> list[tuple[str, ...]]:
        """The label values (after the target) of this target's series."""
        return [k[1:] for k in list(self.metric._metrics) if k[0] == self.target]

    def clear(self) -> None:
        for values in self.children():
            self.remove_series(*values)

    def __getattr__(self, name: str) -> Any:  # set, inc, observe on an unlabelled metric
        return getattr(self.metric.labels(self.target), name)


class Family(NamedTuple):
    """One metric family: its type, name and help, its labels after ``target``, and the label values
    whose series exist at 0 from the start (``known``; for a service's family, while a service
    declaring it is enabled). A service declares its own in ``METRICS``, beside its code."""

    kind: Any  # Counter, Gauge or Histogram
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    known: tuple[tuple[str, ...], ...] = ()
    buckets: tuple[float, ...] | None = None


# The daemon's own families; the services' are in their modules (``Service.METRICS``).
IS_LEADER = Family(Gauge, "maintd_is_leader", "1 while this instance holds the leader lock.")
LEADERSHIP_CHANGES = Family(Counter, "maintd_leadership_changes", "Times this instance gained or lost leadership.")
SERVICE_RUNS = Family(Counter, "maintd_service_runs", "Service passes by outcome (success, error, fenced, stopped).",
                      ("service", "outcome"))
SERVICE_RUN_SECONDS = Family(Histogram, "maintd_service_run_seconds", "Duration of the work of service passes "
                             "(not their waits).", ("service",), buckets=RUN_BUCKETS)
SERVICE_LAST_SUCCESS = Family(Gauge, "maintd_service_last_success_timestamp_seconds",
                              "Unix time (database server clock) of the last successful pass.", ("service",))
ROWS_SKIPPED = Family(Counter, "maintd_rows_skipped", "Rows a service passed over or handled specially "
                      "(with a logged reason).", ("service", "reason"))
JOBS = Family(Gauge, "maintd_jobs", "Jobs by queue and state (refreshed by the leader; queues past "
              "metrics.max_queues summed as _other).", ("queue", "state"))
OLDEST_AVAILABLE_AGE = Family(Gauge, "maintd_oldest_available_job_age_seconds",
                              "Age of the oldest available job per queue.", ("queue",))
UP = Family(Gauge, "maintd_database_up", "1 while the daemon's database connection is healthy.")
WRITABLE = Family(Gauge, "maintd_database_writable", "1 while the database takes writes (0: a standby, or a "
                  "primary set read-only; maintenance is paused).")
# Table health (SPEC 8.2), set by the leader from maintd.health's read of its database.
XMIN_AGE_SECONDS = Family(Gauge, "maintd_xmin_horizon_age_seconds", "Age of the oldest holder of the xmin "
                          "horizon of the jobs table's database (a transaction, snapshot, prepared transaction, "
                          "replication slot or standby): dead rows newer than it cannot be vacuumed.")
XMIN_AGE_XIDS = Family(Gauge, "maintd_xmin_horizon_age_xids", "Transaction ids assigned since the xmin horizon "
                       "of the jobs table's database.")
DEAD_TUPLES = Family(Gauge, "maintd_table_dead_tuples", "Dead rows of a maintd table (partitions summed; the "
                     "statistics' estimate).", ("table",))
LIVE_TUPLES = Family(Gauge, "maintd_table_live_tuples", "Live rows of a maintd table (partitions summed; the "
                     "statistics' estimate).", ("table",))
TABLE_BYTES = Family(Gauge, "maintd_table_bytes", "Size of a maintd table with its indexes and TOAST "
                     "(partitions summed).", ("table",))
HEALTH_READ = Family(Gauge, "maintd_health_read_timestamp_seconds", "Unix time (the server's) of the last "
                     "table-health read that succeeded: the health gauges are as of then.")
LAST_VACUUM = Family(Gauge, "maintd_table_last_vacuum_timestamp_seconds", "Unix time of the last vacuum (auto "
                     "or manual) of a maintd table; for a partitioned one, of its least recently vacuumed "
                     "partition that owes one (dead rows past autovacuum's threshold), else the latest; 0: never.", ("table",))


class Metrics:
    """Every series carries ``target`` (SPEC 7.4): the target's name, by default its schema.
    Series with a known label set exist from the start at 0 (:meth:`known_series`)."""

    def __init__(self, registry: CollectorRegistry | None = None, target: str = "maintd",
                 max_queues: int = 100, *, max_periodic_ids: int = 100, shared: "Metrics | None" = None):
        """``shared``: another target's Metrics whose registry and series families this one
        uses too (several targets in one process, one /metrics). Every family exists from the
        start, the services' too (:func:`maintd.services.metric_families`). ``max_queues``,
        ``max_periodic_ids``: the bounds of the per-queue and per-periodic-entry series."""
        from .services import metric_families  # here: the services import this module
        self.registry = shared.registry if shared else (registry or CollectorRegistry(auto_describe=True))
        self.target = target
        self.max_queues = max_queues
        self.max_periodic_ids = max_periodic_ids
        self._queues_seen: set[str] = set()
        self._families: dict[str, tuple[Family, Any]] = shared._families if shared else {}
        self.is_leader, self.leadership_changes = self[IS_LEADER], self[LEADERSHIP_CHANGES]
        self.service_runs, self.service_run_seconds = self[SERVICE_RUNS], self[SERVICE_RUN_SECONDS]
        self.service_last_success, self.rows_skipped = self[SERVICE_LAST_SUCCESS], self[ROWS_SKIPPED]
        self.jobs, self.oldest_available_age = self[JOBS], self[OLDEST_AVAILABLE_AGE]
        self.up, self.writable = self[UP], self[WRITABLE]
        self.xmin_horizon_age_seconds, self.xmin_horizon_age_xids = self[XMIN_AGE_SECONDS], self[XMIN_AGE_XIDS]
        self.table_dead_tuples, self.table_live_tuples = self[DEAD_TUPLES], self[LIVE_TUPLES]
        self.table_bytes, self.table_last_vacuum = self[TABLE_BYTES], self[LAST_VACUUM]
        self.health_read = self[HEALTH_READ]
        for family in [] if shared else metric_families():
            self[family]
        # this target's series exist from the start; maintd_database_writable once it was read
        # (1 from the start said a database never reached took writes)
        for family in (IS_LEADER, LEADERSHIP_CHANGES, UP):
            self[family].labels()

    def __getitem__(self, family: Family) -> Bound:
        """This target's view of ``family``, registered on first use."""
        if family.name not in self._families:
            extra = {} if family.buckets is None else {"buckets": family.buckets}
            metric = family.kind(family.name, family.doc, ["target", *family.labels], registry=self.registry, **extra)
            self._families[family.name] = (family, metric)
        declared, metric = self._families[family.name]
        if declared != family:
            raise ValueError(f"metric family {family.name} is declared twice, differently")
        return Bound(metric, self.target)

    def known_series(self, services: list[str], families: Mapping[str, Iterable[Family]]) -> None:
        """Create the series with a known label set at 0, and drop those of services that are no
        longer enabled (a disabled service has no series: no stale alert). ``services``: the
        enabled ones; ``families``: every service's families, by service."""
        live = {f for name in services for f in families.get(name, ())}
        for family in {f for fs in families.values() for f in fs} - live:
            self[family].clear()
        for family in live:
            for values in family.known:
                self[family].labels(*values)
        for metric in (self.service_runs, self.service_run_seconds, self.service_last_success):
            for values in metric.children():
                if values[0] not in services:
                    metric.remove_series(*values)
        for service in services:
            for outcome in ("success", "error", "fenced", "stopped"):
                self.service_runs.labels(service, outcome)
            self.service_run_seconds.labels(service)

    def clear_gauges(self, families: Iterable[Family]) -> None:
        """Remove this target's series of the gauges among ``families`` (counters keep theirs:
        rate() and increase() need them to go on)."""
        for family in set(families):
            if family.kind is Gauge:
                self[family].clear()

    def health_series(self) -> list[Bound]:
        """The table-health gauges (cleared together when this replica stops leading)."""
        return [self.xmin_horizon_age_seconds, self.xmin_horizon_age_xids, self.table_dead_tuples,
                self.table_live_tuples, self.table_bytes, self.table_last_vacuum, self.health_read]

    def queue_label(self, queue: str) -> str | None:
        """A queue's label on a per-queue counter: the first ``max_queues`` queues seen keep their
        name, later ones count under the overflow, None (``_other``: bounded cardinality)."""
        seen = self._queues_seen
        if queue in seen or len(seen) < self.max_queues:
            seen.add(queue)
            return queue
        return None

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


def label_value(name: str | None) -> str:
    """A name's label value; None (the overflow): ``_other``. A plain name (printable, without a
    backslash, not ``_other``) is its own label. Any other has its backslashes and quotes escaped
    (``\\\\``, ``\\"``) and its control and format characters escaped as in the logs (a terminal escape written by a
    worker must not reach an operator's terminal: the exposition format escapes only backslash,
    quote and newline), and the queue ``_other`` is ``\\_other``: such a label holds a backslash,
    which no plain name does, and is read back unambiguously, so no two names (nor a name and
    the overflow) share one."""
    if name is None:
        return OTHER
    if name.isprintable() and "\\" not in name and name != OTHER:
        return name
    if name == OTHER:
        return "\\" + OTHER
    return escape_all(name)


RESULT_KEYS = 100  # entries of a per-queue count kept in a recorded pass result (service_runs)


def top_with_other(counts: dict[str, Any], keep: int) -> dict[str, Any]:
    """The ``keep`` largest entries of ``counts`` and, when there were more, the rest summed
    under ``_other``: bounded size for 100,000 queues, the total unchanged. Beside the overflow
    each name is keyed as its label (:func:`label_value`), so a queue named ``_other`` is not
    summed into it."""
    if len(counts) <= keep:
        return dict(counts)
    ranked = sorted(counts, key=lambda k: (-counts[k], k))
    out = {label_value(k): counts[k] for k in ranked[:keep]}
    out[OTHER] = sum(counts[k] for k in ranked[keep:])
    return out


def bounded_jobs(figures: dict[str, Any], keep: int) -> dict[str, Any]:
    """The rows of the ``keep`` queues with the most jobs, the others summed under ``_other``
    (per state; their oldest age is the oldest of theirs); beside it each kept queue is named by
    its label (:func:`label_value`: a queue named ``_other`` is ``\\_other``)."""
    rows, oldest = figures["jobs"], figures.get("oldest_available_age_seconds", {})
    totals: dict[str, int] = {q: 0 for q in oldest}
    for r in rows:
        totals[r["queue"]] = totals.get(r["queue"], 0) + r["count"]
    if len(totals) <= keep:
        return figures
    kept = set(sorted(totals, key=lambda q: (-totals[q], q))[:keep])
    summed: dict[tuple[str, str], int] = {}
    for r in rows:
        key = (label_value(r["queue"]) if r["queue"] in kept else OTHER, r["state"])
        summed[key] = summed.get(key, 0) + r["count"]
    ages: dict[str, float] = {}
    for q, age in oldest.items():
        name = label_value(q) if q in kept else OTHER
        ages[name] = age if ages.get(name) is None else max(ages[name], age if age is not None else 0.0)
    note = f"{len(totals)} queues: the {keep} with the most jobs shown, the other {len(totals) - keep} as {OTHER}"
    ordered = sorted(summed.items(), key=lambda kv: (kv[0][0], JOB_STATES.index(kv[0][1])))
    return {**figures, "jobs": [{"queue": q, "state": s, "count": n} for (q, s), n in ordered],
            "oldest_available_age_seconds": ages,
            "jobs_note": "; ".join(filter(None, (figures.get("jobs_note"), note)))}


def bounded_result(result: Any, keep: int = RESULT_KEYS) -> Any:
    """A pass result (``as_dict``) whose per-key counts (``promoted`` by queue) hold at most
    ``keep`` entries plus ``_other``, for ``service_runs`` and ``/status``."""
    if not isinstance(result, dict):
        return result
    return {k: top_with_other(v, keep) if isinstance(v, dict) and len(v) > keep
            and all(isinstance(n, (int, float)) for n in v.values()) else v for k, v in result.items()}


def finite_age(age: float | None) -> float:
    """An age for a gauge: a job with an infinite scheduled_at must not make it NaN or infinite."""
    if age is None or age != age or age in (float("inf"), float("-inf")):
        return 0.0
    return max(0.0, age)


@dataclass(frozen=True)
class JobCounts:
    """What the leader counted last, for ``/status``: jobs by queue and state (live states as of
    ``live_at``, final ones as of ``final_at``, database times) and the oldest available job's
    age per queue."""

    rows: list[dict[str, Any]]
    oldest: dict[str, float]
    live_at: Any
    final_at: Any = None
    note: str | None = None  # how many queues were summed as _other


class JobGauges:
    """``maintd_jobs`` and the backlog age, refreshed by the leader every ``INTERVAL`` seconds.
    Live states are cheap (partial indexes); the per-queue counts of final states read the heap,
    so they are refreshed every ``FINAL_INTERVAL`` seconds only. The last counts stay in memory
    (:attr:`counts`) for ``/status``, which never counts itself (SPEC 8.5)."""

    INTERVAL = 15.0
    FINAL_INTERVAL = 300.0
    TIMEOUT_MS = 10_000

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self._final_counted_at = float("-inf")
        self.counts: JobCounts | None = None  # None: not leading, or not counted yet
        self._final_rows: dict[tuple[str, str], int] = {}
        self._final_known = False  # the final states were counted this term

    def clear(self) -> None:
        self.metrics.jobs.clear()
        self.metrics.oldest_available_age.clear()
        self._final_counted_at = float("-inf")
        self.counts, self._final_rows, self._final_known = None, {}, False

    def final_due(self) -> bool:
        """Whether the final states are due for a count (never counted in this term, or 5 min ago)."""
        return time.monotonic() - self._final_counted_at >= self.FINAL_INTERVAL

    def refresh(self, engine: Engine, schema: str, *, still_leading: Callable[[], bool] = lambda: True,
                lock: Any = None, final: bool | None = None) -> None:
        """Read one target's counts (final states too when due, or when ``final``) and set the
        gauges (the daemon counts every target of a database in one statement instead:
        :class:`maintd.probes.CountProbe`)."""
        final = self.final_due() if final is None else final
        try:
            with engine.connect() as conn:
                conn.execute(text(catalog.SET_LOCAL), {"name": "statement_timeout", "value": str(self.TIMEOUT_MS)})
                counts, oldest = job_counts(conn, schema, final=final), oldest_available(conn, schema)
                at = conn.execute(text(catalog.TRANSACTION_TIME)).scalar_one()
        except Exception as exc:
            log.debug("could not refresh job gauges", extra=kv(error=describe_db_error(exc)))
            return
        self.take(counts, oldest, at, final=final, still_leading=still_leading, lock=lock)

    def take(self, counts: list[dict[str, Any]], oldest: dict[str, float], at: Any, *, final: bool,
             still_leading: Callable[[], bool] = lambda: True, lock: Any = None, missed_final: bool = False) -> None:
        """Counts read (by :meth:`refresh` or a batched probe): the gauges and the figures kept.
        Without ``final``, the final states are those of the last count of them. ``missed_final``:
        their count was tried and passed its timeout: tried again after FINAL_INTERVAL, not at
        once (each try reads the heap for as long as the timeout)."""
        with lock or threading.Lock():
            if not still_leading():  # leadership ended meanwhile: followers export no job gauges
                return
            if final:  # until the next count of final states (compact: 100,000 queues may have rows)
                self._final_rows = {(r["queue"], r["state"]): r["count"] for r in counts
                                    if r["state"] in FINAL_STATES}
                self._final_known = True
            if final or missed_final:
                self._final_counted_at = time.monotonic()  # (under the lock a demotion's clear takes)
            rows = self._merged(counts)
            self.apply(rows, oldest)
            self._remember(rows, oldest, at, final)

    def _merged(self, counts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The live states of ``counts`` and the final states last counted, by queue and state."""
        live = [r for r in counts if r["state"] not in FINAL_STATES]
        finished = [{"queue": q, "state": s, "count": n} for (q, s), n in self._final_rows.items()]
        return sorted(live + finished, key=lambda r: (r["queue"], JOB_STATES.index(r["state"])))

    def _remember(self, rows: list[dict[str, Any]], oldest: dict[str, float], at: Any, final: bool) -> None:
        final_at = at if final else (self.counts.final_at if self.counts else None)
        # Kept as /status shows them: the max_queues largest queues and _other (bounded memory).
        shown = bounded_jobs({"jobs": rows, "oldest_available_age_seconds": oldest}, self.metrics.max_queues)
        self.counts = JobCounts(shown["jobs"], shown["oldest_available_age_seconds"], at, final_at,
                                shown.get("jobs_note"))

    def apply(self, rows: list[dict[str, Any]], oldest: dict[str, float]) -> None:
        """Set the gauges to ``rows`` (every state) and ``oldest``: the ``max_queues`` queues with
        the most jobs in all states keep their name, in every state, and the others are summed as
        ``_other``. One ranking for all states: ranked on the live states alone, a refresh gave
        the finished states' queues names of their own beside the live ones (past max_queues),
        and a count of final states moved the live queues into _other until the next refresh."""
        totals: dict[str, float] = {q: 0 for q in oldest}
        for row in rows:
            totals[row["queue"]] = totals.get(row["queue"], 0) + row["count"]
        kept = set(sorted(totals, key=lambda q: (-totals[q], q))[:self.metrics.max_queues])
        # Every state of every queue shown, 0 where it has no job ("avoid missing metrics": a
        # drained queue's series read 0, not no data); the final ones once counted this term.
        states = [s for s in JOB_STATES if self._final_known or s not in FINAL_STATES]
        summed: dict[tuple[str | None, ...], float] = {}
        for row in rows:
            queue = row["queue"] if row["queue"] in kept else None  # None: the overflow, _other
            for state in states:
                summed.setdefault((queue, state), 0)
            summed[(queue, row["state"])] = summed.get((queue, row["state"]), 0) + row["count"]
        ages: dict[tuple[str | None, ...], float] = {}
        for queue, age in oldest.items():
            name = (queue if queue in kept else None,)
            ages[name] = max(ages.get(name, 0.0), finite_age(age))
        _replace(self.metrics.jobs, summed)
        _replace(self.metrics.oldest_available_age, ages)


def _replace(gauge: Bound, values: dict[tuple[str | None, ...], float]) -> None:
    """Set ``gauge``'s series to ``values``: the new values first, then the series that are gone
    removed. A scrape meanwhile (it shares no lock with this) sees every series that stays, at
    its old value or its new one; removed first and set again, they were missing or at 0."""
    for labels, value in values.items():
        gauge.labels(*labels).set(value)
    shown = {tuple(map(label_value, labels)) for labels in values}  # as the series carry them
    for labels in gauge.children():
        if labels not in shown:
            gauge.remove_series(*labels)
