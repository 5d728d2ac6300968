"""HTTP endpoints of an in-process daemon, ``maintd status`` facts, sd_notify, job gauges."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone

from maintd.config import Settings
from maintd.daemon import Daemon
from maintd.queries import sql
from maintd.leader import acquire_once
from maintd.metrics import Metrics
from maintd.sdnotify import SystemdNotifier
from maintd.metrics import JobGauges
from maintd.status import collect_status, format_status

from .procs import wait_for


def _get(port, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_http_endpoints_and_metrics(settings, schema):
    daemon = Daemon(settings)
    daemon.start()
    try:
        port = daemon.http_port
        wait_for(lambda: daemon.is_leader, 10, what="leadership")
        wait_for(lambda: "cleaner" in daemon.targets[0].runner.last_runs, 10, what="a cleaner pass")
        assert _get(port, "/healthz") == (200, "ok\n")
        assert _get(port, "/readyz")[0] == 200
        status, body = _get(port, "/metrics")
        assert status == 200
        t = f'target="{settings.schema}"'
        for name in (f"maintd_is_leader{{{t}}} 1.0", f"maintd_leadership_changes_total{{{t}}} 1.0",
                     f"maintd_database_up{{{t}}} 1.0",
                     f'maintd_service_runs_total{{outcome="success",service="cleaner",{t}}}',
                     f'maintd_service_run_seconds_bucket{{le="0.005",service="cleaner",{t}}}',
                     f'maintd_service_last_success_timestamp_seconds{{service="cleaner",{t}}}',
                     # known label sets exist from the start at 0 (SPEC 7.4)
                     f'maintd_jobs_deleted_total{{state="discarded",{t}}} 0.0',
                     f'maintd_jobs_rescued_total{{outcome="retried",{t}}} 0.0',
                     f'maintd_jobs_rescued_total{{outcome="exhausted",{t}}} 0.0',
                     f'maintd_service_runs_total{{outcome="error",service="rescuer",{t}}} 0.0'):
            assert name in body, name
        status, body = _get(port, "/status")
        data = json.loads(body)
        assert status == 200 and data["leader"]["instance_id"] == settings.instance_id
        assert data["this_instance"]["is_leader"] is True
        # leader.renewed_at is written when a term starts (renewals prove the lock, write nothing):
        # shown, it read as a renewal that never came. The lease this process knows is shown instead.
        assert "renewed_at" not in data["leader"], data["leader"]
        lease = settings.leader.lease.total_seconds()
        assert 0 < data["this_instance"]["lease_trusted_for_seconds"] <= lease, data["this_instance"]
        assert _get(port, "/nope")[0] == 404
        # Bound to loopback only.
        assert daemon.http.address[0] == "127.0.0.1"

        # An election loop that stops making progress (a hanging connection) is unhealthy.
        # (The election loop itself stamps last_progress on every turn and marks its waits, so
        # set both right before each request until one lands in between.)
        loop = daemon.loops[0]

        def stalled():
            loop.last_progress, loop.sleeping = time.monotonic() - 60, False
            return _get(port, "/healthz")

        status, body = wait_for(lambda: (lambda r: r if r[0] == 503 else None)(stalled()), 5,
                                what="a stalled /healthz")
        assert "stalled" in body
        loop.last_progress = time.monotonic()
        daemon.targets[0].db_ok = False  # what the loop reports while the database is unreachable
        # Liveness is the process and its loops; the database is readiness's business (a grant
        # problem or an outage must not make Kubernetes restart the pod).
        assert _get(port, "/healthz") == (200, "ok\n")
        assert _get(port, "/readyz")[0] == 503
        daemon.targets[0].db_ok = True
    finally:
        daemon.stop()
    assert not daemon.is_leader


def test_default_http_listen_is_loopback():
    assert Settings().http.host == "127.0.0.1"


def test_status_names_the_lock_holder_only(settings, engine, schema, queue):
    with engine.begin() as conn:
        queue.enqueue(conn, "k", queue="mail")
    assert collect_status(engine, settings.schema)["leader"] is None
    elector, fence = acquire_once(settings)
    try:
        st = collect_status(engine, settings.schema)
        lead = st["leader"]
        assert lead["instance_id"] == settings.instance_id and lead["epoch"] == fence.epoch
        assert lead["since"] and "renewed_at" not in lead  # the term's start again: no renewal time
        assert {"queue": "mail", "state": "available", "count": 1} in st["jobs"]
        text = format_status(st)
        assert f"leader: {settings.instance_id} (host " in text and f"epoch {fence.epoch}" in text
        assert "mail" in text and "(no pass recorded yet)" in text
        # A recorded term whose (live) session does not hold the lock is nobody's.
        with engine.begin() as conn:
            conn.execute(sql("UPDATE {schema}.leader SET backend_pid = pg_backend_pid()", schema))
        assert collect_status(engine, settings.schema)["leader"] is None
    finally:
        elector.stop()
    assert format_status(collect_status(engine, settings.schema)).splitlines()[1] == "leader: none"


def test_sd_notify_sends_ready_and_watchdog(tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2)
    try:
        n = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000"})
        assert n.address is not None and n.watchdog_interval == 2.0
        assert n.ready() and n.watchdog() and n.stopping()
        assert [sock.recv(100) for _ in range(3)] == [b"READY=1", b"WATCHDOG=1", b"STOPPING=1"]
    finally:
        sock.close()
    assert not SystemdNotifier({}).ready()


def test_sd_notify_never_blocks_on_a_full_socket(tmp_path):
    """Nobody reads the socket: its queue fills, and notify drops the message instead of hanging
    the main loop (which also handles SIGHUP and SIGTERM)."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    try:
        n = SystemdNotifier({"NOTIFY_SOCKET": path})
        sent: list[bool] = []
        sender = threading.Thread(target=lambda: sent.extend(n.watchdog() for _ in range(5000)),
                                  daemon=True)  # far beyond any datagram queue length
        sender.start()
        sender.join(10)
        assert not sender.is_alive(), "notify blocked on a full socket"
        assert sent[0] and not sent[-1]
        sock.recv(100)
        assert n.watchdog()  # room again
    finally:
        sock.close()


def test_job_gauges_refresh_live_often_and_final_counts_when_asked(settings, engine, schema, queue):
    metrics = Metrics()
    gauges = JobGauges(metrics)
    with engine.begin() as conn:
        for _ in range(3):
            queue.enqueue(conn, "k", queue="mail")
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state, finalized_at) "
                         "VALUES ('k', 'mail', 'completed', now())", schema))
    gauges.refresh(engine, settings.schema, final=True)
    get = lambda name, labels=None: metrics.registry.get_sample_value(name, {"target": "maintd", **(labels or {})})
    assert get("maintd_jobs", {"queue": "mail", "state": "available"}) == 3
    assert get("maintd_jobs", {"queue": "mail", "state": "completed"}) == 1
    assert get("maintd_oldest_available_job_age_seconds", {"queue": "mail"}) >= 0
    with engine.begin() as conn:
        [job] = queue.claim(conn, "mail", "w")
        queue.complete(conn, job)
    gauges.refresh(engine, settings.schema, final=False)
    assert get("maintd_jobs", {"queue": "mail", "state": "available"}) == 2
    assert get("maintd_jobs", {"queue": "mail", "state": "completed"}) == 1  # not recounted yet
    gauges.refresh(engine, settings.schema, final=True)
    assert get("maintd_jobs", {"queue": "mail", "state": "completed"}) == 2


def promoted_under_three_queue_labels(settings, engine, schema: str, sizes: dict[str, int]) -> Metrics:
    """``sizes[q]`` scheduled jobs due a minute ago in each queue ``q``, all promoted by one
    scheduler pass observed into a registry of ``metrics.max_queues = 3``, which is returned."""
    from maintd.clock import FrozenClock
    from maintd.services.base import PassContext
    from maintd.services.scheduler import Scheduler

    with engine.begin() as conn:
        for name, n in sizes.items():
            conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state, scheduled_at) SELECT 'k', :q,"
                             " 'scheduled', now() - interval '1 minute' FROM generate_series(1, :n)", schema),
                         {"q": name, "n": n})
    metrics = Metrics(max_queues=Settings(metrics={"max_queues": 3}).metrics.max_queues)
    settings.scheduler.precise_timing = False
    scheduler = Scheduler(settings.scheduler)
    ctx = PassContext.for_settings(settings, engine, FrozenClock(datetime.now(timezone.utc)))
    scheduler.observe(metrics, scheduler.run_once(ctx))
    return metrics


def test_metrics_max_queues_keeps_that_many_queue_labels_and_sums_the_rest_as_other(settings, engine, schema):
    """metrics.max_queues = 3 with 5 queues: /metrics shows exactly 3 queues by name and the
    rest summed under queue="_other", for the job gauges (the largest queues keep their name)
    and for the per-queue promotion counter (the first queues seen keep theirs). One label too
    many per family is the unbounded cardinality the setting exists to prevent."""
    from prometheus_client.parser import text_string_to_metric_families

    sizes = {"q5": 5, "q4": 4, "q3": 3, "q2": 2, "q1": 1}
    metrics = promoted_under_three_queue_labels(settings, engine, schema, sizes)  # all 15 promoted
    JobGauges(metrics).refresh(engine, schema, final=True)

    samples: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if "queue" in s.labels and not s.name.endswith("_created"):  # (maintd_jobs: every state's)
                by_queue = samples.setdefault(s.name, {})
                by_queue[s.labels["queue"]] = by_queue.get(s.labels["queue"], 0) + s.value
    assert samples["maintd_jobs"] == {"q5": 5, "q4": 4, "q3": 3, "_other": 3}
    assert set(samples["maintd_oldest_available_job_age_seconds"]) == {"q5", "q4", "q3", "_other"}
    promoted = samples["maintd_jobs_promoted_total"]
    assert len(promoted) == 4 and "_other" in promoted and sum(promoted.values()) == 15
    assert promoted["_other"] == sum(sizes[q] for q in sizes if q not in promoted)


def test_max_queues_holds_across_live_and_final_counts_and_no_queue_flips(settings, engine, schema):
    """metrics.max_queues = 3; queues A0-A2 hold 10 completed jobs each, B0-B2 5 available each.
    Before: the live refresh (every 15 s) ranked the queues on the live states alone, so
    maintd_jobs carried 6 queue names (A* completed, B* available), and each count of the final
    states (every 5 min) moved B0-B2 into _other until the next live refresh, which silenced
    MaintdBacklogAgeGrowing on them. Now every refresh shows the same 3 names and _other."""
    from prometheus_client.parser import text_string_to_metric_families

    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state, finalized_at) SELECT 'k', 'A' || (i % 3), "
                         "'completed', now() FROM generate_series(1, 30) i", schema))
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue) SELECT 'k', 'B' || (i % 3) "
                         "FROM generate_series(1, 15) i", schema))
    metrics = Metrics(max_queues=3)
    gauges = JobGauges(metrics)

    def labels() -> dict[str, set[str]]:
        seen: dict[str, set[str]] = {"maintd_jobs": set(), "maintd_oldest_available_job_age_seconds": set()}
        for family in text_string_to_metric_families(metrics.render().decode()):
            for sample in family.samples:
                if sample.name in seen:
                    seen[sample.name].add(sample.labels["queue"])
        return seen

    shown = []
    for final in (True, False, False, True, False):  # as the leader refreshes: final counts now and then
        gauges.refresh(engine, schema, final=final)
        shown.append(labels())
    assert shown[0]["maintd_jobs"] == {"A0", "A1", "A2", "_other"}, shown[0]
    assert shown[0]["maintd_oldest_available_job_age_seconds"] == {"_other"}, shown[0]
    assert all(s == shown[0] for s in shown), shown
    get = lambda queue, state: metrics.registry.get_sample_value(
        "maintd_jobs", {"target": "maintd", "queue": queue, "state": state})
    # (_other has no completed job: 0, a series that stays, not none)
    assert (get("A0", "completed"), get("_other", "available"), get("_other", "completed")) == (10, 15, 0)


def test_a_flood_of_status_requests_reads_the_database_at_most_twice_a_second(settings, schema):
    """Each /status read the database through the readers (14 statements a request here): 200
    requests, from a client without any token when none is set, cost 200 reads, as many as
    the two page threads could serve. It is now read at most once per half second, as
    /metrics is rendered, whoever asks."""
    from concurrent.futures import ThreadPoolExecutor

    from sqlalchemy import event

    daemon = Daemon(settings)
    daemon.start()
    try:
        port = daemon.http_port
        wait_for(lambda: daemon.is_leader, 10, what="leadership")
        engine = daemon.readers.engine(settings.database_url.get_secret_value())
        statements: list[str] = []
        event.listen(engine, "before_cursor_execute", lambda _c, _cur, stmt, *_a: statements.append(stmt))
        time.sleep(0.6)  # past any earlier answer's age
        assert _get(port, "/status")[0] == 200
        one = len(statements)  # the statements of one /status
        assert one > 0
        statements.clear()
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:  # as many as the page threads: none turned away
            answers = list(pool.map(lambda _: _get(port, "/status")[0], range(200)))
        took = time.monotonic() - started
        assert set(answers) == {200}, answers
        reads = len(statements) / one
        assert reads <= took / 0.5 + 3, f"{reads:.0f} reads of /status in {took:.1f} s"
    finally:
        daemon.stop()


def test_the_services_column_is_as_wide_as_the_longest_service_name():
    """'partitioner' (11 letters) ran into its outcome in a 10-wide column: its line was out of
    step with every other service's."""
    from maintd.status import _format_runs

    run = {"outcome": "success", "finished_at": "2026-03-01T12:00:05+00:00", "started_at": "2026-03-01T12:00:05+00:00",
           "instance_id": "a", "summary": "done"}
    lines = _format_runs([{**run, "service": s} for s in ("cleaner", "partitioner", "rescuer")])
    assert len({ln.index("success") for ln in lines}) == 1, lines
    assert lines[1].startswith("  partitioner success "), lines
    lines = _format_runs([{**run, "service": "cleaner"}])
    assert lines[0].startswith("  cleaner    success "), lines  # as the walkthrough shows it
