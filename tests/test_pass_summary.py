"""What each pass did, as ``maintd status`` (text and JSON), ``/status`` and the dashboard show it
(SPEC 8.4, issue 28 row 3): counts (deleted, rescued, promoted, enqueued) and a readable line,
never a raw float such as ``slept 18.557157819999986``."""

from __future__ import annotations

import json
import re

from maintd.clock import ServerClock
from maintd.config import Settings
from maintd.dashboard import Dashboard
from maintd.http import Request
from maintd.pass_summary import counts, describe
from maintd.passes import execute_pass, record_pass
from maintd.queries import sql
from maintd.services import SERVICES
from maintd.services.base import PassContext
from maintd.status import collect_status, format_status

RAW_FLOAT = re.compile(r"\d\.\d{4,}")


def test_each_service_says_what_it_did_in_words_and_counts():
    cases = {
        "cleaner": ({"deleted": {"completed": 1200, "cancelled": 0, "discarded": 3}, "batches": 2,
                     "batch_size": 1000, "timeouts": 0, "overflows": 0, "dry_run": False, "skipped": {}},
                    {"deleted": 1203}, "deleted 1,203 (completed 1,200, discarded 3) in 2 batches"),
        "rescuer": ({"retried": 2, "discarded": 1, "exhausted": 0, "batches": 1,
                     "next_pass_at": "2026-03-01T12:00:01.250193+00:00", "dry_run": False},
                    {"rescued": 3}, "rescued 3 (discarded 1, retried 2); next pass at 12:00:01.250"),
        "scheduler": ({"promoted": {"mail": 2, "default": 5}, "batches": 1, "next_pass_at": None,
                       "dry_run": True}, {"promoted": 7}, "would promote 7 (default 5, mail 2)"),
        "periodic": ({"enqueued": [{"periodic_id": "nightly"}, {"periodic_id": "hourly"}],
                      "skipped": {"hourly": {"backfill": 3}}, "baselined": [], "errors": {},
                      "invalid_rows": {}, "dry_run": False},
                     {"enqueued": 2}, "enqueued 2 (hourly, nightly), skipped 3"),
        "reindexer": ({"indexes": [{"index": "jobs_pkey", "outcome": "reindexed", "seconds": 1.23456},
                                   {"index": "jobs_fetch_idx", "outcome": "skipped", "seconds": 0.0}],
                       "dry_run": False}, {"reindexed": 1},
                      "jobs_pkey reindexed in 1.2 s, jobs_fetch_idx skipped"),
        # Retention by dropping partitions (SPEC 8.1): the rows go as deleted, said when estimated.
        "partitioner": ({"layout": "partitioned", "made": 2, "closed": 0, "moved": 0, "emptied": 1, "detached": 1,
                         "dropped": 1, "deleted": {"completed": 1200, "cancelled": 0, "discarded": 0},
                         "estimated": True, "busy": ["cancelled"], "partitions": 75, "stray_rows": 3,
                         "waited_seconds": 0.0, "dry_run": False}, {"deleted": 1200},
                        "deleted 1,200 (completed 1,200) (estimated); emptied 1, detached 1, dropped 1, made 2; "
                        "partitions 75, stray rows 3; busy: cancelled"),
    }
    for service, (result, expected_counts, line) in cases.items():
        assert counts(service, result) == expected_counts, service
        assert describe(service, result) == line, service
    # Rows a pass passed over or handled specially (maintd_rows_skipped_total) are said too.
    assert describe("rescuer", {"retried": 0, "discarded": 0, "exhausted": 0, "dated": 3}) == \
        "rescued 0, dated now 3 (sign of life in the future)"
    assert describe("periodic", {"enqueued": [], "invalid_rows": {"b": "schedule: bad", "a": "kind: empty"}}) == \
        "enqueued 0, rows not used (error set) a, b"
    # A failed pass has no result; an older record missing keys still reads.
    assert counts("cleaner", None) == {} and describe("cleaner", None) == ""
    assert describe("scheduler", {"promoted": {}}) == "promoted 0"
    assert describe("partitioner", {"layout": "plain"}) == "the jobs table is plain: nothing to do"
    # The stored result itself is rounded (service_runs.result, /status, run-once).
    from maintd.services.reindexer import IndexReport, ReindexerResult

    index = IndexReport(index="i", outcome="reindexed", seconds=18.557157819999986)
    assert ReindexerResult(indexes=[index]).as_dict()["indexes"][0]["seconds"] == 18.557


def _seed(engine, schema) -> None:
    with engine.begin() as conn:
        conn.execute(sql("""
            INSERT INTO {schema}.jobs (kind, queue, state, attempt, attempted_at, attempted_by, finalized_at,
                                       scheduled_at)
            VALUES ('k', 'default', 'completed', 1, now() - interval '3 days', 'w', now() - interval '3 days', now()),
                   ('k', 'default', 'completed', 1, now() - interval '3 days', 'w', now() - interval '3 days', now()),
                   ('k', 'mail', 'running', 1, now() - interval '2 hours', 'w', NULL, now()),
                   ('k', 'mail', 'scheduled', 0, NULL, NULL, NULL, now() - interval '1 minute'),
                   ('k', 'default', 'scheduled', 0, NULL, NULL, NULL, now() - interval '1 minute'),
                   ('k', 'default', 'retryable', 1, NULL, NULL, NULL, now() - interval '1 minute')""", schema))


def test_status_text_json_and_dashboard_show_what_each_pass_did(pg_dsn, schema, engine):
    settings = Settings(database_url=pg_dsn, schema=schema, instance_id="test-1",
                        scheduler={"precise_timing": False}, rescuer={"precise_timing": False},
                        periodic=[{"id": "nightly", "schedule": "0 3 * * *", "kind": "report",
                                   "run_on_start": True}])
    _seed(engine, schema)
    ctx = PassContext.for_settings(settings, engine, ServerClock())
    live = {}
    for name in ("cleaner", "rescuer", "scheduler", "periodic"):
        spec = SERVICES[name]
        record = execute_pass(name, spec.cls(spec.section(settings)), ctx)
        assert record.outcome.value == "success", record.error
        assert record_pass(ctx, record)
        live[name] = record.as_dict()  # what /status's this_instance.last_runs holds
    assert {n: r["counts"] for n, r in live.items()} == {
        "cleaner": {"deleted": 2}, "rescuer": {"rescued": 1}, "scheduler": {"promoted": 3},
        "periodic": {"enqueued": 1}}

    st = collect_status(engine, schema)
    by = {r["service"]: r for r in st["services"]}
    assert {n: by[n]["counts"] for n in live} == {n: r["counts"] for n, r in live.items()}
    assert by["scheduler"]["summary"] == "promoted 3 (default 2, mail 1)"
    json.dumps(st, default=str)  # what --json prints

    text = format_status(st)
    for line in ("deleted 2 (completed 2) in 1 batch", "rescued 1 (retried 1)", "promoted 3 (default 2, mail 1)",
                 "enqueued 1 (nightly)"):
        assert line in text, text
    assert not RAW_FLOAT.search(text), text

    status, _, body, _ = Dashboard(lambda: settings).index(Request("/", {}))
    html = body.decode()
    assert status == 200
    services = dict(re.findall(r'<tr data-service="(\w+)">(.*?)</tr>', html, re.S))
    assert "deleted 2 (completed 2) in 1 batch" in services["cleaner"]
    assert "rescued 1 (retried 1)" in services["rescuer"]
    assert "promoted 3 (default 2, mail 1)" in services["scheduler"]
    assert "enqueued 1 (nightly)" in services["periodic"]
    assert not any(RAW_FLOAT.search(re.sub(r'title="[^"]*"', "", row)) for row in services.values())


def test_the_next_pass_is_shown_in_utc_whatever_form_its_time_was_stored_in():
    """A due time on a whole second (a periodic slot: most of them) is stored without a fraction;
    a server whose TimeZone is not UTC hands the time back with its own offset. Before, the line
    cut the stored text at fixed positions: "next pass at 12:00:00+00:" and the server's local
    time shown as UTC."""
    def line(at: object) -> str:
        return describe("scheduler", {"promoted": {"default": 1}, "next_pass_at": at, "dry_run": False})

    assert line("2026-03-01T12:00:00+00:00").endswith("; next pass at 12:00:00.000"), line("2026-03-01T12:00:00+00:00")
    assert line("2026-03-01 12:00:00+00:00").endswith("; next pass at 12:00:00.000")  # json default=str
    assert line("2026-03-01T13:00:01.250193+01:00").endswith("; next pass at 12:00:01.250"), \
        line("2026-03-01T13:00:01.250193+01:00")
    assert line("2026-03-01T12:00:01.250193+00:00").endswith("; next pass at 12:00:01.250")
    assert line("not a time") == "promoted 1 (default 1)"


def test_a_stored_result_of_another_shape_never_fails_the_line():
    """``service_runs.result`` is JSON another version (or a hand) may have written: a value of
    another type (the reindexer's ``seconds`` as text, ``indexes`` or ``enqueued`` a number) made
    the summary raise, and with it `maintd status` and the dashboard."""
    keys = ("deleted", "batches", "timeouts", "skipped", "retried", "discarded", "exhausted", "dated",
            "cleared", "promoted", "next_pass_at", "enqueued", "errors", "invalid_rows", "indexes",
            "layout", "estimated", "emptied", "busy", "partitions", "dry_run")
    odd = (5, 1.5, "x", True, None, [1], ["x"], {"a": "b"}, {"a": [1]},
           [{"index": "i", "outcome": "reindexed", "seconds": "slow"}],
           [{"index": "i", "outcome": "reindexed", "seconds": [1]}], [{"periodic_id": ["x"]}])
    for service in (*DESCRIBE_SERVICES, "unknown"):
        for key in keys:
            for value in odd:
                result = {key: value}
                assert isinstance(describe(service, result), str), (service, result)
                assert all(isinstance(v, int) for v in counts(service, result).values()), (service, result)


DESCRIBE_SERVICES = ("cleaner", "rescuer", "scheduler", "periodic", "reindexer", "partitioner")


def test_a_periodic_pass_over_thousands_of_rows_is_recorded_bounded_with_exact_totals():
    """A schedule per customer: a pass over 5,000 rows kept every job it enqueued and every id's
    skips, errors and unusable rows in the result that ``service_runs`` stores and ``/status``
    serves (1.0 MB here, each pass). The recorded result keeps RESULT_KEYS ids of each; the totals
    the status line and the counts give stay exact."""
    from maintd.metrics import OTHER, RESULT_KEYS
    from maintd.services.periodic import PeriodicResult

    r = PeriodicResult()
    for i in range(5000):
        pid = f"customer-{i:05}"
        r.enqueued.append({"periodic_id": pid, "slot": "2026-11-30T07:00:00+00:00", "job_id": i, "backfilled": False})
        r.skip(pid, "duplicate", 2)
        r.fail(pid, "args: not JSON")
        r.invalid_rows[f"row-{i}"] = "schedule: bad"
    d = json.loads(json.dumps(r.as_dict(), default=str))
    assert len(json.dumps(d)) < 60_000
    assert len(d["enqueued"]) == RESULT_KEYS and d["enqueued_count"] == 5000
    assert len(d["skipped"]) == RESULT_KEYS + 1 and d["skipped"][OTHER] == {"duplicate": 2 * (5000 - RESULT_KEYS)}
    assert len(d["errors"]) == len(d["invalid_rows"]) == RESULT_KEYS + 1
    assert counts("periodic", d) == {"enqueued": 5000}
    line = describe("periodic", d)
    assert line.startswith("enqueued 5,000 (customer-00000, ") and ", ...), skipped 10,000" in line, line
    assert counts("periodic", {"enqueued": [{"periodic_id": "a"}] * 3}) == {"enqueued": 3}  # recorded before


def test_an_idle_pass_a_probe_stands_for_has_the_counts_of_any_pass(settings, engine):
    """SPEC 8.4: each pass says what it did in `counts`. An idle pass that the database's probe
    stands for (no pass run) was shown in /status's `this_instance.last_runs` with `counts: {}`,
    so `counts["deleted"]` of the cleaner's last pass was missing exactly when it was 0."""
    from datetime import datetime, timezone

    from maintd.metrics import Metrics
    from maintd.runner import Runner
    from maintd.services.base import NoFence

    runner = Runner(settings, engine, Metrics())  # its timetable not started: no pass runs meanwhile
    try:
        runner.activate(NoFence())
        now = datetime.now(timezone.utc)
        for name in ("cleaner", "rescuer", "scheduler"):
            runner.idle(name, now)
        got = {name: runner.last_runs[name]["counts"] for name in ("cleaner", "rescuer", "scheduler")}
        assert got == {"cleaner": {"deleted": 0}, "rescuer": {"rescued": 0}, "scheduler": {"promoted": 0}}, got
    finally:
        runner.deactivate()


def test_a_periodic_id_named_other_beside_the_overflow_keeps_its_own_skips():
    """Past RESULT_KEYS ids the recorded result sums the other ids' skips under ``_other``; an
    entry whose id is ``_other`` (a valid periodic id) among those kept had its skips replaced by
    the overflow's. Beside the overflow it is keyed as its label, ``\\_other``."""
    from maintd.metrics import OTHER, RESULT_KEYS
    from maintd.services.periodic import PeriodicResult

    r = PeriodicResult()
    r.skip("_other", "disabled", 7)
    for i in range(RESULT_KEYS + 5):
        r.skip(f"x{i:04}", "duplicate", 1)
    d = r.as_dict()
    assert d["skipped"]["\\_other"] == {"disabled": 7}, d["skipped"].get("\\_other")
    assert d["skipped"][OTHER] == {"duplicate": 6}, d["skipped"][OTHER]
