"""The metric families: the daemon's in maintd/metrics.py, each service's beside it (``METRICS``),
and which series of a target exist as its services are enabled and disabled (SPEC 7.4)."""

from __future__ import annotations

import pytest
from prometheus_client import Counter

from maintd.metrics import Family, Metrics
from maintd.queries import jobs, sql
from maintd.services import SERVICES, metric_families
from maintd.services.scheduler import JOBS_PROMOTED

from .plans import at_page_costs, explain, seq_scans

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


def test_a_scrape_during_a_refresh_of_the_job_gauges_sees_every_series_at_its_value():
    """The leader refreshes maintd_jobs and the oldest-age gauge while /metrics renders, under
    no shared lock. Before: the refresh removed every series and set them again, and 1,307 of
    2,000 renders lacked some of the 100 queues (a backlog alert saw its series vanish)."""
    import threading

    from maintd.metrics import JobGauges

    metrics = Metrics(target="t", max_queues=100)
    gauges = JobGauges(metrics)
    counts = [{"queue": f"q{i}", "state": "available", "count": 5} for i in range(100)]
    oldest = {f"q{i}": 10.0 for i in range(100)}
    gauges.take(counts, oldest, None, final=True)
    done = threading.Event()

    def refresh() -> None:
        while not done.is_set():
            gauges.take(counts, oldest, None, final=True)

    refresher = threading.Thread(target=refresh)
    refresher.start()
    wrong = []
    try:
        for _ in range(200):
            lines = metrics.render().decode().splitlines()
            jobs = [line for line in lines if line.startswith("maintd_jobs{")]
            ages = [line for line in lines if line.startswith("maintd_oldest_available_job_age_seconds{")]
            values = {line.rpartition(" ")[2] for line in jobs + ages}
            # 100 queues x 7 states (0 where a queue has none: no series comes and goes)
            if len(jobs) != 700 or len(ages) != 100 or values - {"5.0", "10.0", "0.0"}:
                wrong.append((len(jobs), len(ages), sorted(values)))
    finally:
        done.set()
        refresher.join()
    assert wrong == [], f"{len(wrong)} of 200 renders: {wrong[:5]}"


def test_label_values_from_the_database_reach_metrics_with_their_control_characters_escaped():
    """A queue a worker named with a terminal escape (OSC 0 retitles an xterm) reached /metrics
    byte for byte: the exposition format escapes only backslash, quote and newline, so an
    operator reading it with curl had the escape run in their terminal. Label values are escaped
    as in the logs; the series is kept across refreshes and removed once its queue is gone.
    Source: Prometheus, "Exposition formats", text format: a label value "can be any sequence of
    UTF-8 characters, but the backslash (\\), double-quote ("), and line feed (\\n) characters have
    to be escaped" (so ESC, BEL and U+202E pass through unless we escape them)."""
    from maintd.metrics import JobGauges

    metrics = Metrics(target="t")
    gauges = JobGauges(metrics)
    evil = "mail\x1b]0;owned\x07\u202e"
    for _ in range(2):
        gauges.take([{"queue": evil, "state": "available", "count": 3}], {evil: 10.0}, None, final=True)
        body = metrics.render().decode()
        assert not [c for c in body if (ord(c) < 0x20 and c != "\n") or c in "\x7f\u202e"]
        lines = [line for line in body.splitlines() if line.startswith(("maintd_jobs{", "maintd_oldest_available"))]
        assert len([line for line in lines if line.endswith(" 0.0")]) == 6  # its other states
        lines = [line for line in lines if not line.endswith(" 0.0")]
        assert lines == ['maintd_jobs{queue="mail\\\\x1b]0;owned\\\\x07\\\\u202e",state="available",target="t"} 3.0',
                         'maintd_oldest_available_job_age_seconds{queue="mail\\\\x1b]0;owned\\\\x07\\\\u202e",target="t"} 10.0'], lines
    gauges.take([], {}, None, final=True)
    assert "owned" not in metrics.render().decode()


@pytest.mark.both_layouts
def test_the_live_counts_read_the_live_states_indexes_not_the_final_rows(engine, schema, layout):
    """The job gauges count the live states every 15 s (and each history sample): with final
    jobs the bulk of the table (a day of completed ones), as ``state IN (four states)`` no
    partial index could serve them, and the plain layout's count read every final row (a Seq Scan
    of jobs whatever the page costs). Partitioned, only the live partition is read."""
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state, finalized_at) "
                         "SELECT 'k', 'q' || (g % 5), 'completed', now() - g * interval '1 second' "
                         "FROM generate_series(1, 100000) g", schema))
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state, scheduled_at, attempt, attempted_at) "
                         "SELECT 'k', 'q' || (g % 5), (ARRAY['available', 'scheduled', 'retryable', 'running'])[1 + g % 4]"
                         "::{schema}.job_state, now() + g * interval '1 second', g % 4 / 3, now() "
                         "FROM generate_series(1, 5000) g", schema))
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    with engine.connect() as conn:
        for page_cost in at_page_costs(conn):
            plan = explain(conn, jobs.COUNT_LIVE, schema, {})
            assert set(seq_scans(plan, layout)) <= ({"jobs_live"} if layout == "partitioned" else set()), (page_cost, plan)
            assert layout == "plain" or "completed" not in plan, (page_cost, plan)
        counts = {(r.queue, r.state): r.n for r in conn.execute(sql(jobs.COUNT_LIVE, schema))}
        conn.rollback()
    assert sum(counts.values()) == 5000 and len(counts) == 20


def test_an_idle_service_counts_a_successful_pass_every_interval(configured):
    """At idle the probes count the cleaner's, rescuer's and scheduler's passes without running
    them, once per interval (maintd_service_runs_total{outcome="success"} and the last success,
    which MaintdServiceStalled reads). The probe looks every interval on a 1 s tick, a few ms
    early or late; an early look was under the interval and the count waited for the next one:
    about half the counts were lost, and an idle cleaner (30 s) read its last success up to a
    minute old. Before: 12-14 passes in 20 s at 1 s intervals."""
    import time

    from maintd.daemon import Daemon

    from .procs import wait_for

    fast = {"interval": "1s"}
    daemon = Daemon(configured(instance_id="idle-count-1", http={"enabled": False}, cleaner=fast, rescuer=fast,
                               scheduler=fast, leader={"lease": "3s", "renew_interval": "0.5s"}))
    services = ("cleaner", "rescuer", "scheduler")

    def successes() -> dict[str, float]:
        return {s: daemon.metrics.registry.get_sample_value("maintd_service_runs_total", {
            "target": daemon.settings.schema, "service": s, "outcome": "success"}) or 0 for s in services}

    daemon.start()
    try:
        wait_for(lambda: daemon.is_leader and all(n >= 2 for n in successes().values()), 15, what="idle passes")
        before, window = successes(), 20.0
        time.sleep(window)
        ran = {s: n - before[s] for s, n in successes().items()}
    finally:
        daemon.stop()
    assert all(n >= 0.85 * window for n in ran.values()), f"idle passes counted in {window:.0f} s at 1 s intervals: {ran}"


def test_the_exported_families_are_the_readmes_and_carry_no_created_series():
    """/metrics exports what the README lists and nothing else: prometheus_client added a
    ``*_created`` gauge family beside every counter and histogram (maintd_service_runs_created,
    one series per queue of maintd_jobs_promoted_created...), names no README or alert knows, and
    Prometheus ingests them as series of their own (the counters' cardinality doubled)."""
    import re
    from pathlib import Path

    metrics = Metrics(target="t")
    metrics.known_series(list(FAMILIES), FAMILIES)
    metrics[JOBS_PROMOTED].labels("q").inc()
    body = metrics.render().decode()
    assert "_created" not in body
    readme = set(re.findall(r"maintd_[a-z_]+", (Path(__file__).parent.parent / "README.md").read_text()))
    exported = set(re.findall(r"^# TYPE (\S+) ", body, re.M))
    assert exported <= readme, exported - readme


def test_the_reindex_counters_help_names_what_it_counts():
    """maintd_reindex_total counts every index a pass looked at, by outcome: ``skipped`` (below
    bloat_threshold), ``missing`` and ``not_permitted`` were never attempted, yet its HELP said
    "Reindex attempts by outcome.", and a rate of it read as rebuilds."""
    from maintd.services.reindexer import REINDEX

    for outcome in ("reindexed", "skipped", "missing", "not_permitted", "timeout", "cancelled", "error"):
        assert outcome in REINDEX.doc, outcome
    assert not REINDEX.doc.startswith("Reindex attempts")


def test_a_term_ended_as_a_count_of_final_states_is_taken_counts_them_again_next_term():
    """JobGauges.take noted when the final states were last counted after letting go of the lock
    the demotion's clear() takes: a demotion landing in between was undone, and the next term
    showed no finished jobs for 5 minutes (FINAL_INTERVAL). Here the demotion comes exactly as
    the lock is let go."""
    import threading

    from maintd.metrics import JobGauges, Metrics

    gauges = JobGauges(Metrics(target="t"))

    class DemotedOnRelease:
        def __init__(self):
            self.lock = threading.Lock()

        def __enter__(self):
            self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()
            with self.lock:
                gauges.clear()

    gauges.take([{"queue": "q", "state": "completed", "count": 3}], {}, None, final=True, lock=DemotedOnRelease())
    assert gauges.counts is None
    assert gauges.final_due(), "the next term waits 5 minutes for its first count of finished jobs"


def test_status_gives_the_oldest_available_age_the_gauge_and_the_dashboard_give(engine, schema):
    """An available job due in an hour (a worker may insert one so: "not before this") is not
    waiting yet: the gauge says 0 and the dashboard 0 ms, but /status and `maintd status --json`
    passed the database's difference on as it was: oldest_available_age_seconds -3600."""
    from maintd.metrics import JobGauges, oldest_available
    from maintd.status import collect_status, leader_figures

    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, scheduled_at) VALUES ('k', 'later', now() + interval '1 hour')", schema))
    with engine.connect() as conn:
        oldest = oldest_available(conn, schema)
    metrics = Metrics(target="t")
    gauges = JobGauges(metrics)
    gauges.take([{"queue": "later", "state": "available", "count": 1}], oldest, None, final=True)
    assert metrics.registry.get_sample_value("maintd_oldest_available_job_age_seconds",
                                             {"target": "t", "queue": "later"}) == 0
    assert leader_figures(gauges.counts, leading=True)["oldest_available_age_seconds"] == {"later": 0}
    assert collect_status(engine, schema)["oldest_available_age_seconds"] == {"later": 0}


def test_whether_the_database_takes_writes_is_not_exported_before_it_was_read():
    """maintd_database_writable was 1 from the start: a daemon that never reached its database
    (a closed port, a wrong host) said the database took writes. Unknown is no series (Prometheus'
    way: the HELP stays, so the family is seen); the first read sets it, 1 or 0."""
    metrics = Metrics(target="t")
    body = metrics.render().decode()
    assert "# HELP maintd_database_writable" in body
    assert 'maintd_database_writable{target="t"}' not in body
    metrics.writable.set(0)
    assert 'maintd_database_writable{target="t"} 0.0' in metrics.render().decode()


def test_a_queue_drained_reads_0_in_maintd_jobs_not_no_series():
    """Prometheus' instrumentation practices, "Avoid missing metrics": a series that comes and goes
    breaks graphs and rate() and reads as no data. maintd_jobs had a series only for a (queue,
    state) with jobs: once a queue's backlog drained, maintd_jobs{state="available"} vanished
    instead of reading 0. Every queue shown has every live state, and every final state once
    the final states were counted this term (before that their counts are unknown, not 0)."""
    from maintd.metrics import JobGauges
    from maintd.queries import FINAL_STATES, JOB_STATES

    metrics = Metrics(target="t")
    gauges = JobGauges(metrics)

    def series() -> dict[str, float]:
        return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
                for line in metrics.render().decode().splitlines() if line.startswith("maintd_jobs{")}

    gauges.take([{"queue": "mail", "state": "available", "count": 3}], {"mail": 1.0}, None, final=False)
    live = [s for s in JOB_STATES if s not in FINAL_STATES]
    assert series() == {f'maintd_jobs{{queue="mail",state="{s}",target="t"}}': 3.0 if s == "available" else 0.0
                        for s in live}
    gauges.take([{"queue": "mail", "state": "completed", "count": 3}], {}, None, final=True)  # drained
    assert series() == {f'maintd_jobs{{queue="mail",state="{s}",target="t"}}': 3.0 if s == "completed" else 0.0
                        for s in JOB_STATES}
    gauges.take([], {}, None, final=True)  # the queue is gone: its series go with it
    assert series() == {}


def test_no_queue_name_gets_the_overflow_label_or_another_queues_label(settings, engine, schema):
    """With more than metrics.max_queues queues, a real queue named ``_other`` was exported under
    the overflow's label, ``queue="_other"``, and its jobs summed with the overflow's; a queue
    named ``a\\nb`` (a backslash) and one named a, newline, b had the same label (the escape
    ``\\n``). A name a label is made of is kept as is when it is plain (printable, no backslash,
    not ``_other``); any other is escaped with its backslashes doubled (and ``_other`` as
    ``\\_other``): no two names, nor a name and the overflow, share a label."""
    from prometheus_client.parser import text_string_to_metric_families

    from maintd.metrics import JobGauges

    from .test_http_status import promoted_under_three_queue_labels

    sizes = {"_other": 6, "a\\nb": 5, "a\nb": 4, "q2": 2, "q1": 1}
    metrics = promoted_under_three_queue_labels(settings, engine, schema, sizes)  # all 18 promoted
    gauges = JobGauges(metrics)
    gauges.refresh(engine, schema, final=True)

    def scrape() -> dict[str, dict[str, float]]:
        samples: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(metrics.render().decode()):
            for s in family.samples:
                if "queue" in s.labels:
                    by_queue = samples.setdefault(s.name, {})
                    by_queue[s.labels["queue"]] = by_queue.get(s.labels["queue"], 0) + s.value
        return samples

    samples = scrape()
    # (as parsed: \_other is the queue _other, a\\nb the queue a\nb, a\nb the one with a newline)
    assert samples["maintd_jobs"] == {"\\_other": 6, "a\\\\nb": 5, "a\\nb": 4, "_other": 3}, samples["maintd_jobs"]
    assert set(samples["maintd_oldest_available_job_age_seconds"]) == {"\\_other", "a\\\\nb", "a\\nb", "_other"}
    promoted = samples["maintd_jobs_promoted_total"]
    assert len(promoted) == 4 and sum(promoted.values()) == 18, promoted
    by_label = {"\\_other": 6, "a\\\\nb": 5, "a\\nb": 4, "q2": 2, "q1": 1}  # each queue's, by its label
    assert all(n == by_label[q] for q, n in promoted.items() if q != "_other"), promoted
    # A refresh that drops a queue removes its series, the overflow's and the escaped ones' too.
    gauges.take([{"queue": "_other", "state": "available", "count": 1}], {"_other": 1.0}, None, final=True)
    assert scrape()["maintd_jobs"] == {"\\_other": 1}
