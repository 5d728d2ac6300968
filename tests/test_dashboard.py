"""The dashboard as a person uses it: a real headless Chromium against an in-process daemon.

Browser tests need Debian's ``chromium`` and ``chromium-driver`` (CI installs them); without them
they are skipped with that reason. ``python -m tests.test_dashboard docs/dashboard.png [DSN]``
redraws the README screenshot from the same realistic workload the overview test uses.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from datetime import datetime, timedelta, timezone
from html import unescape
from typing import Any, Iterator

import pytest
from sqlalchemy import Engine, text

from maintd.config import Settings
from maintd.daemon import Daemon
from maintd.dashboard import ORDERS, Count, Dashboard, JobFilter, _count, _list_sql, per_queue_cap, queue_table
from maintd.db import make_engine
from maintd.queries import sql
from maintd.http import Request
from maintd.jobs import JobQueue

from .plans import at_page_costs, explain, seq_scans
from .procs import wait_for
from .tools import path as tool_path, require

CHROMIUM, CHROMEDRIVER = tool_path("chromium"), tool_path("chromedriver")
XSS = "<script>window.__xss=1;alert(1)</script>"
XSS_IMG = '<img src=x onerror="window.__xss=2">'
TOKEN = "s3cret-token-0123456789abcdef"



# -- a browser ----------------------------------------------------------------------------------


def make_browser(javascript: bool = True, width: int = 1280, height: int = 1000):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    require("chromium", "chromedriver")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="maintd-chromium-")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", f"--window-size={width},{height}",
                 "--force-device-scale-factor=1", "--hide-scrollbars"):
        opts.add_argument(flag)
    if not javascript:  # what a person with JavaScript turned off gets
        opts.add_experimental_option("prefs", {"profile.managed_default_content_settings.javascript": 2})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.maintd_profile = profile
    return driver


def close_browser(driver) -> None:
    driver.quit()
    shutil.rmtree(driver.maintd_profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = make_browser()
    yield driver
    close_browser(driver)


@pytest.fixture(scope="module")
def browser_nojs() -> Iterator[Any]:
    driver = make_browser(javascript=False)
    yield driver
    close_browser(driver)


def by_css(driver, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def one(driver, selector: str):
    found = by_css(driver, selector)
    assert len(found) == 1, f"{selector}: {len(found)} elements on {driver.current_url}"
    return found[0]


def follow(driver, element) -> None:
    """Click a link or button and wait until the next page has replaced this one."""
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    from selenium.common.exceptions import WebDriverException

    page = driver.find_element("css selector", "html")
    element.click()
    # While the old document is being torn down, chromedriver can answer the staleness probe with
    # "unhandled inspector error" (its execution context is gone) instead of a stale-element error:
    # keep polling until the old page is reported stale.
    WebDriverWait(driver, 15, ignored_exceptions=(WebDriverException,)).until(ec.staleness_of(page))


def assert_no_alert(driver) -> None:
    from selenium.common.exceptions import NoAlertPresentException

    try:
        alert = driver.switch_to.alert
    except NoAlertPresentException:
        return
    text_ = alert.text
    alert.dismiss()
    raise AssertionError(f"an alert opened: {text_!r}")


# -- PNG check (no imaging library needed) ------------------------------------------------------


def png_colors(data: bytes) -> tuple[int, int, dict[bytes, int]]:
    """(width, height, pixel colour -> count) of an 8-bit RGB/RGBA PNG, every 4th row and column."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBB", chunk[:10])
        elif kind == b"IDAT":
            idat += chunk
    width, height, depth, color = header
    assert depth == 8 and color in (2, 6), f"unexpected PNG format depth={depth} color={color}"
    bpp = 3 if color == 2 else 4
    raw, stride, prev = zlib.decompress(idat), width * bpp, bytearray(width * bpp)
    colors: dict[bytes, int] = {}
    for y in range(height):
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        _unfilter(raw[y * (stride + 1)], line, prev, bpp)
        if y % 4 == 0:
            for x in range(0, width, 4):
                px = bytes(line[x * bpp:x * bpp + 3])
                colors[px] = colors.get(px, 0) + 1
        prev = line
    return width, height, colors


def _unfilter(ftype: int, line: bytearray, prev: bytearray, bpp: int) -> None:
    if ftype == 0:
        return
    if ftype == 2:
        line[:] = bytes((a + b) & 0xFF for a, b in zip(line, prev))
        return
    for i in range(len(line)):
        left = line[i - bpp] if i >= bpp else 0
        up, corner = prev[i], (prev[i - bpp] if i >= bpp else 0)
        if ftype == 1:
            add = left
        elif ftype == 3:
            add = (left + up) >> 1
        else:  # Paeth
            p = left + up - corner
            pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
            add = left if pa <= pb and pa <= pc else (up if pb <= pc else corner)
        line[i] = (line[i] + add) & 0xFF


def assert_real_screenshot(png: bytes, min_width: int = 800) -> None:
    width, height, colors = png_colors(png)
    assert width >= min_width and height >= 400, (width, height)
    top = max(colors.values()) / sum(colors.values())
    # A blank or single-colour page has one colour; rendered text and tables have many shades.
    assert len(colors) >= 20 and top < 0.97, f"{len(colors)} colours, the commonest covers {top:.0%}"


# -- a daemon and a workload --------------------------------------------------------------------


def changed(settings: Settings, **updates: Any) -> Settings:
    """A validated copy (model_copy would leave ``periodic`` entries as plain dicts)."""
    return Settings(**{**dict(settings), **updates})


def start_daemon(settings: Settings, **updates: Any) -> Daemon:
    daemon = Daemon(changed(settings, **updates))
    daemon.start()
    try:
        wait_for(lambda: daemon.is_leader, 15, what="leadership")
        wait_for(lambda: {"cleaner", "rescuer", "scheduler"} <= set(daemon.targets[0].runner.last_runs), 15,
                 what="a pass of each service")
    except BaseException:
        daemon.stop()
        raise
    return daemon


def fetch(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers


PERIODIC = [
    {"id": "nightly-report", "schedule": "30 2 * * *", "timezone": "Europe/Paris",
     "kind": "reports.nightly", "queue": "reports"},
    {"id": "refresh-rates", "schedule": "@every 10m", "kind": "billing.rates", "queue": "billing",
     "run_on_start": True},
    {"id": "purge-sessions", "schedule": "*/15 * * * *", "kind": "maintenance.purge_sessions",
     "enabled": False},
]
ERRORS = {
    "mail": "smtp: 421 4.7.0 connection refused by mx1.example.net",
    "billing": "stripe: card_declined (insufficient_funds) for customer cus_9Xa2",
    "webhooks": "POST https://hooks.example.com/orders: 504 Gateway Timeout after 30s",
}


def _away_from_a_slot(engine: Engine, schema: str, margin: float = 30.0) -> None:
    """Wait past the next slot of PERIODIC's '@every 10m' entry (queue billing) when it comes
    within ``margin`` seconds, until its job is enqueued: enqueued between the page's read and the
    test's own count, it made the counts differ by one (seen in CI at a ten-minute boundary)."""
    with engine.connect() as conn:
        now = conn.execute(text("SELECT now()")).scalar_one()
    left = 600 - (now.minute % 10 * 60 + now.second + now.microsecond / 1e6)
    if left >= margin:
        return
    time.sleep(left)
    slot = now + timedelta(seconds=left)

    def enqueued() -> bool:
        with engine.connect() as conn:
            return bool(conn.execute(sql("SELECT count(*) FROM {schema}.jobs WHERE kind = 'billing.rates' "
                                         "AND scheduled_at >= :slot - interval '1 second'", schema),
                                     {"slot": slot}).scalar())

    wait_for(enqueued, 20, what="the slot's periodic job")


def seed_workload(engine: Engine, schema: str) -> None:
    """A mixed workload through the worker helpers: every state, five queues, real errors."""
    q = JobQueue(schema)
    with engine.begin() as conn:
        for i in range(40):
            queue = ("default", "mail", "mail", "billing", "webhooks")[i % 5]
            q.enqueue(conn, f"{queue}.{('send', 'sync', 'deliver')[i % 3]}", {"order": 1000 + i},
                      queue=queue, priority=i % 2, max_attempts=1 if i % 4 == 0 else 5)
        for i in range(12):
            q.enqueue(conn, "reports.weekly", {"week": i}, queue="reports",
                      scheduled_at=datetime.now().astimezone() + timedelta(hours=i + 1))
        conn.execute(sql("UPDATE {schema}.jobs SET scheduled_at = scheduled_at - interval '95 seconds'"
                         " WHERE state = 'available'", schema))
    for queue in ("default", "mail", "billing", "webhooks"):
        with engine.begin() as conn:
            claimed = q.claim(conn, queue, f"worker-{queue}", limit=6)
        with engine.begin() as conn:
            for k, job in enumerate(claimed):
                if k < 3:
                    q.complete(conn, job)
                elif k < 5 and queue in ERRORS:
                    q.fail(conn, job, ERRORS[queue], discard=k == 4)
                elif k == 5 and queue == "default":
                    q.cancel(conn, job.id)
                # the rest stay running
    with engine.begin() as conn:  # retries due later, so the picture holds still while it is read
        conn.execute(sql("UPDATE {schema}.jobs SET scheduled_at = now() + interval '40 minutes'"
                         " WHERE state = 'retryable'", schema))


# -- the overview -------------------------------------------------------------------------------


def test_overview_shows_leader_services_queues_periodic_and_discarded(browser, settings, engine, schema):
    follower = None
    daemon = start_daemon(settings, periodic=PERIODIC)
    try:
        follower = Daemon(changed(settings, instance_id="test-2", periodic=PERIODIC))
        follower.start()
        wait_for(lambda: "periodic" in daemon.targets[0].runner.last_runs, 15, what="a periodic pass")
        wait_for(lambda: _replicas(engine, schema) == 2, 15, what="both replicas registered")
        _away_from_a_slot(engine, schema)
        seed_workload(engine, schema)
        browser.get(f"http://127.0.0.1:{daemon.http_port}/")
        assert_no_alert(browser)
        assert one(browser, "#leader-name").text == "test-1"
        replicas = {r.find_element("css selector", "td").text: r.text for r in by_css(browser, "#replicas tbody tr")}
        assert set(replicas) == {"test-1", "test-2"}
        assert "leader" in replicas["test-1"] and "follower" in replicas["test-2"]
        services = {r.get_attribute("data-service"): r.text for r in by_css(browser, "#services tbody tr")}
        assert {"cleaner", "rescuer", "scheduler", "periodic"} <= set(services)
        assert all("success" in services[s] and "test-1" in services[s] for s in services)

        # Jobs by queue and state, as counted by the database.
        with engine.connect() as conn:
            truth = {(r.queue, r.state): r.n for r in conn.execute(sql(
                "SELECT queue, state::text AS state, count(*) AS n FROM {schema}.jobs GROUP BY 1, 2", schema))}
            db_now = conn.execute(text("SELECT now()")).scalar_one()
        cells = {(r.get_attribute("data-queue"), c.get_attribute("data-state")): c.text
                 for r in by_css(browser, "#queues tbody tr[data-queue]")
                 for c in r.find_elements("css selector", "td[data-state]")}
        assert {q for q, _ in cells} == {q for q, _ in truth}
        for (queue, state), shown in cells.items():
            assert shown == str(truth.get((queue, state), 0)), (queue, state, shown)
        assert truth[("mail", "available")] > 0 and truth[("mail", "discarded")] >= 1
        oldest = one(browser, "#oldest-available .big").text
        assert re.fullmatch(r"\d+(\.\d)? (s|min)", oldest) and 90 <= _seconds(oldest) <= 400, oldest

        # Periodic entries: the last slot taken, the next one from the schedule at database time.
        rows = {r.get_attribute("data-periodic"): r for r in by_css(browser, "#periodic tbody tr")}
        nxt = db_now.replace(second=0, microsecond=0) + timedelta(minutes=10 - db_now.minute % 10)
        rates = rows["refresh-rates"]
        assert nxt.isoformat(sep=" ", timespec="seconds") in rates.find_element("css selector", ".next-slot").text
        assert "job " in rates.find_element("css selector", ".last-slot").text  # run_on_start enqueued one
        assert "disabled" in rows["purge-sessions"].text
        assert "Europe/Paris" in rows["nightly-report"].text

        # The latest discarded jobs with their last error, readable as a person reads it.
        discarded = one(browser, "#discarded").text
        for queue in ERRORS:
            assert ERRORS[queue] in discarded
        png = browser.get_screenshot_as_png()
        assert len(png) > 20_000
        assert_real_screenshot(png)
    finally:
        if follower is not None:
            follower.stop()
        daemon.stop()


def _replicas(engine: Engine, schema: str) -> int:
    with engine.connect() as conn:
        return conn.execute(sql("SELECT count(*) FROM {schema}.daemons", schema)).scalar_one()


def _seconds(shown: str) -> float:
    value, unit = shown.split()
    return float(value) * (60 if unit == "min" else 1)


# -- XSS ----------------------------------------------------------------------------------------


def test_xss_payload_in_error_args_kind_and_queue_is_shown_as_text(browser, settings, engine, schema):
    q = JobQueue(schema)
    with engine.begin() as conn:
        q.enqueue(conn, XSS_IMG, {"html": XSS, XSS: XSS_IMG}, queue=XSS, max_attempts=1,
                  metadata={"note": XSS})
    with engine.begin() as conn:
        job = q.claim(conn, XSS, "worker-1")[0]
        q.fail(conn, job, XSS)
    daemon = start_daemon(settings)
    try:
        base = f"http://127.0.0.1:{daemon.http_port}"
        from urllib.parse import quote

        for path in ("/", "/jobs?state=discarded", f"/jobs?queue={quote(XSS)}", f"/jobs/{job.id}"):
            browser.get(base + path)
            assert_no_alert(browser)
            assert browser.execute_script("return window.__xss === undefined"), path
            # Not one script or img element made it into the DOM (the page itself has none).
            assert by_css(browser, "script") == [] and by_css(browser, "img") == [], path
            body = one(browser, "body").text
            assert XSS in body, f"{path}: payload not shown as text"
        assert XSS_IMG in one(browser, "#job-kind").text
        assert one(browser, "#job-queue").text == XSS
        assert XSS in one(browser, "#job-args").text and XSS in one(browser, "#job-metadata").text
        assert XSS in one(browser, "#job-errors").text
        # A link built from the queue name stays a link to the jobs page.
        href = one(browser, "#job-queue a").get_attribute("href")
        assert href.startswith(base + "/jobs?queue=%3Cscript%3E")
    finally:
        daemon.stop()


# -- without JavaScript: links, paging, the filter form ------------------------------------------


def test_pages_work_with_javascript_disabled(browser_nojs, settings, engine, schema):
    drv = browser_nojs
    q = JobQueue(schema)
    with engine.begin() as conn:
        ids = [q.enqueue(conn, "export.csv", {"part": i}, queue="exports") for i in range(120)]
        conn.execute(sql("UPDATE {schema}.jobs SET state = 'completed', attempt = 1, attempted_at = now(),"
                         " finalized_at = now() - make_interval(secs => id) WHERE queue = 'exports'", schema))
    daemon = start_daemon(settings)
    try:
        drv.get(f"http://127.0.0.1:{daemon.http_port}/")
        drv.get("data:text/html,<title>x</title><script>document.title='js on'</script>")
        assert drv.title == "x"  # this browser really runs no page JavaScript
        drv.get(f"http://127.0.0.1:{daemon.http_port}/")
        assert one(drv, "#leader-name").text == "test-1"
        follow(drv, one(drv, '#queues tr[data-queue="exports"] td[data-state="completed"] a'))
        seen: list[int] = []
        for _ in range(5):
            seen += [int(r.get_attribute("data-job-id")) for r in by_css(drv, "#jobs tbody tr[data-job-id]")]
            nxt = by_css(drv, "#next-page")
            if not nxt:
                break
            follow(drv, nxt[0])
        assert seen == sorted(ids)  # newest finalized first: the smallest id was finalized last
        assert len(by_css(drv, "#first-page")) == 1
        # The filter form (a plain GET form).
        from selenium.webdriver.support.select import Select

        Select(one(drv, "select[name=state]")).select_by_value("completed")
        box = one(drv, "input[name=queue]")
        box.clear()
        box.send_keys("nope")
        follow(drv, one(drv, "form.filters button"))
        assert "state=completed" in drv.current_url and "queue=nope" in drv.current_url
        assert "no jobs" in one(drv, "#jobs").text
        drv.get(f"http://127.0.0.1:{daemon.http_port}/jobs/{ids[7]}")
        assert one(drv, "#job-state").text == "completed" and '"part": 7' in one(drv, "#job-args").text
    finally:
        daemon.stop()


# -- auth ---------------------------------------------------------------------------------------


def test_auth_token_guards_pages_and_status_but_not_probes(settings, schema):
    daemon = start_daemon(settings, http=settings.http.model_copy(update={"auth_token": TOKEN}))
    try:
        port = daemon.http_port
        for path in ("/", "/jobs", "/jobs/1", "/status", "/nope", "/?token=wrong-token-0123456789"):
            status, body, headers = fetch(port, path)
            assert status == 401 and "Bearer" in headers["WWW-Authenticate"], path
            assert TOKEN not in body
        assert fetch(port, "/status", {"Authorization": "Bearer " + TOKEN[:-1] + "X"})[0] == 401
        assert fetch(port, "/status", {"Authorization": "Basic " + TOKEN})[0] == 401
        for path in ("/metrics", "/healthz", "/readyz"):
            assert fetch(port, path)[0] == 200, path
        assert fetch(port, "/status", {"Authorization": "Bearer " + TOKEN})[0] == 200
        status, body, headers = fetch(port, "/", {"Authorization": "bearer " + TOKEN})
        assert status == 200 and "test-1" in body and "token=" not in body  # header: links stay clean
        assert "default-src 'none'" in headers["Content-Security-Policy"]
        assert headers["Referrer-Policy"] == "no-referrer"
        status, body, _ = fetch(port, "/?token=" + TOKEN)
        assert status == 200 and f"/jobs?state=discarded&amp;token={TOKEN}" in body
        # A reload changes the token without a restart.
        daemon.reload(daemon.settings.model_copy(update={"http": daemon.settings.http.model_copy(
            update={"auth_token": TOKEN + "-new"})}))
        assert fetch(port, "/?token=" + TOKEN)[0] == 401
        assert fetch(port, "/?token=" + TOKEN + "-new")[0] == 200
    finally:
        daemon.stop()


def test_a_flood_of_overview_requests_reads_the_database_at_most_twice_a_second(settings, schema):
    """Each overview read the database (20 statements a request here), a GET or a HEAD, from any
    client when no token is set: 100 requests cost 100 reads, as many as the two page threads
    could serve. Its figures are now read at most once per half second, however many ask; each
    page is still rendered for its own request (its links, its token, its refresh)."""
    from concurrent.futures import ThreadPoolExecutor

    from sqlalchemy import event

    daemon = start_daemon(settings)
    try:
        port = daemon.http_port
        engine = daemon.readers.engine(settings.database_url.get_secret_value())
        statements: list[str] = []
        event.listen(engine, "before_cursor_execute", lambda _c, _cur, stmt, *_a: statements.append(stmt))
        time.sleep(0.6)  # past any earlier answer's age
        assert fetch(port, "/")[0] == 200
        one = len(statements)  # the statements of one overview
        assert one > 0
        statements.clear()
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:  # as many as the page threads: none turned away
            answers = list(pool.map(lambda i: fetch(port, f"/?refresh={2 + i % 2}"), range(100)))
        took = time.monotonic() - started
        assert {status for status, _, _ in answers} == {200}
        assert all(f'content="{2 + i % 2}"' in body for i, (_, body, _) in enumerate(answers))
        reads = len(statements) / one
        assert reads <= took / 0.5 + 3, f"{reads:.0f} reads of the overview in {took:.1f} s"
    finally:
        daemon.stop()


def test_token_given_by_link_follows_the_person_through_the_pages(browser, settings, engine, schema):
    q = JobQueue(schema)
    with engine.begin() as conn:
        q.enqueue(conn, "mail.send", {"to": "ops@example.com"}, queue="mail", max_attempts=1)
    with engine.begin() as conn:
        q.fail(conn, q.claim(conn, "mail", "w1")[0], "smtp timeout")
    daemon = start_daemon(settings, http=settings.http.model_copy(update={"auth_token": TOKEN}))
    try:
        base = f"http://127.0.0.1:{daemon.http_port}"
        browser.get(base + "/")
        assert "unauthorized" in one(browser, "body").text
        browser.get(f"{base}/?token={TOKEN}")
        follow(browser, one(browser, "#discarded a"))  # the discarded job's page
        assert one(browser, "#job-kind").text == "mail.send"
        follow(browser, one(browser, "#job-queue a"))  # the queue's jobs
        assert [r.get_attribute("data-job-id") for r in by_css(browser, "#jobs tr[data-job-id]")] == ["1"]
        follow(browser, one(browser, "#home"))  # back to the overview
        assert one(browser, "#leader-name").text == "test-1"
    finally:
        daemon.stop()


# -- /jobs: paging, filters, errors -------------------------------------------------------------

STATES_SQL = """
INSERT INTO {schema}.jobs (kind, queue, state, priority, attempt, scheduled_at, attempted_at, heartbeat_at,
                           finalized_at)
SELECT 'k', (ARRAY['q1', 'q2', 'q3'])[1 + g % 3], CAST(s AS {schema}.job_state), (g % 3)::smallint,
       CASE WHEN s IN ('available', 'scheduled') THEN 0 ELSE 1 END,
       now() + CASE WHEN s IN ('scheduled', 'retryable') THEN make_interval(secs => g % 7)
                    ELSE -make_interval(secs => g % 7) END,
       -- running: ties, heartbeats, and a few with no sign of life at all (NULL, last in order)
       CASE WHEN s IN ('available', 'scheduled') OR (s = 'running' AND g % 5 = 0) THEN NULL
            ELSE now() - make_interval(secs => g % 4) END,
       CASE WHEN s = 'running' AND g % 3 = 0 THEN now() - make_interval(secs => g % 2) END,
       CASE WHEN s IN ('completed', 'cancelled', 'discarded') THEN now() - make_interval(secs => g % 5) END
  FROM generate_series(1, 23) g, unnest(CAST(:states AS text[])) s
"""
TRUTH_ORDER = {None: "id DESC", "available": "priority, scheduled_at, id",
               "scheduled": "scheduled_at, id", "retryable": "scheduled_at, id",
               "running": "coalesce(heartbeat_at, attempted_at), id",
               "completed": "finalized_at DESC, id DESC", "cancelled": "finalized_at DESC, id DESC",
               "discarded": "finalized_at DESC, id DESC"}


def _page_ids(dashboard: Dashboard, query: dict[str, list[str]]) -> tuple[list[int], str | None, str]:
    status, _, body, _ = dashboard.jobs(Request("/jobs", query))
    assert status == 200, unescape(body.decode())
    html = body.decode()
    ids = [int(i) for i in re.findall(r'data-job-id="(\d+)"', html)]
    nxt = re.search(r'id="next-page" href="/jobs\?([^"]+)"', html)
    return ids, (unescape(nxt.group(1)) if nxt else None), html


@pytest.mark.parametrize("state", [None, "available", "scheduled", "running", "retryable", "completed",
                                   "discarded"])
@pytest.mark.parametrize("queue", [None, "q2"])
def test_jobs_pages_list_each_job_once_in_index_order(settings, engine, schema, state, queue):
    from urllib.parse import parse_qs

    with engine.begin() as conn:
        conn.execute(sql(STATES_SQL, schema), {"states": ["available", "scheduled", "running", "retryable",
                                                          "completed", "cancelled", "discarded"]})
        where = " AND ".join(["TRUE"] + [f"state = '{state}'"] * bool(state) + ["queue = 'q2'"] * bool(queue))
        truth = [r[0] for r in conn.execute(sql(f"SELECT id FROM {{schema}}.jobs WHERE {where} "
                                                f"ORDER BY {TRUTH_ORDER[state]}", schema))]
    # Small pages and a small search window, so every path (next page, search further) is taken.
    dashboard = Dashboard(lambda: settings, page_size=4, scan_window=10)
    query = {k: [v] for k, v in (("state", state), ("queue", queue)) if v}
    seen, pages, searched = [], 0, False
    while True:
        ids, nxt, html = _page_ids(dashboard, query)
        seen += ids
        pages += 1
        searched |= 'id="searched"' in html
        if nxt is None:
            break
        query = parse_qs(nxt)
        assert pages < 200
    assert seen == truth
    # A bounded search window only where no index serves the filter (and then it shows).
    assert searched <= (bool(queue and state != "available") or state in ("scheduled", "retryable"))
    if queue and state in ("completed", "discarded"):
        assert searched


@pytest.mark.parametrize("state", ["scheduled", "completed", None])
def test_jobs_at_times_no_python_value_holds_are_listed_paged_and_shown(settings, engine, schema, state):
    """The README's enqueue takes scheduled_at = 'infinity', and SPEC 7.3 names such rows: a page of
    scheduled jobs holding one was a 503 ('timestamp too large'), so none of them could be seen, and
    so was the job's own page. They are listed as PostgreSQL writes them, in the index's order,
    each once across pages whose cursors hold them, and shown."""
    from urllib.parse import parse_qs

    column, kind = ("finalized_at", "completed") if state == "completed" else ("scheduled_at", "scheduled")
    odd = ["infinity", "-infinity", "0044-03-15 00:00:00+00 BC", "10000-01-01 00:00:00+00", "now()"]
    with engine.begin() as conn:
        for t in odd * 2:
            conn.execute(sql(f"INSERT INTO {{schema}}.jobs (kind, state, {column}) "
                             f"VALUES ('k', '{kind}', {t if t == 'now()' else repr(t)})", schema))
        truth = [r[0] for r in conn.execute(sql(f"SELECT id FROM {{schema}}.jobs ORDER BY {TRUTH_ORDER[state]}",
                                                schema))]
    dashboard = Dashboard(lambda: settings, page_size=3, scan_window=10)
    query, seen = ({"state": [state]} if state else {}), []
    for _ in range(10):
        ids, nxt, html = _page_ids(dashboard, query)
        seen += ids
        if nxt is None:
            break
        query = parse_qs(nxt)
    assert seen == truth
    for job_id, when in zip(sorted(truth), odd[:4]):  # inserted in the order of `odd`
        status, _, body, _ = dashboard.job(Request(f"/jobs/{job_id}", {}, params={"id": str(job_id)}))
        assert status == 200 and when in unescape(body.decode()), body


@pytest.mark.parametrize("odd", ["[" * 3000 + "]" * 3000, '{"error": "too big", "n": 1e5000}'])
def test_a_job_whose_errors_python_cannot_load_is_shown(settings, engine, schema, odd):
    """One entry of a job's errors nested past Python's recursion limit, or holding an integer of
    over 4,300 digits, made the job's page a 500 (RecursionError, ValueError from json.loads of
    the whole list). Each entry is loaded alone: that one is shown as its text, the others as usual."""
    errors = f'[{{"at": "2026-01-01T00:00:00Z", "attempt": 1, "error": "first failure"}}, {odd}]'
    with engine.begin() as conn:
        job_id = conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, errors) "
                                  "VALUES ('poison', 'retryable', CAST(:e AS jsonb)) RETURNING id", schema),
                              {"e": errors}).scalar()
    dashboard = Dashboard(lambda: settings)
    status, _, body, _ = dashboard.pages()["/jobs/{id}"](Request(f"/jobs/{job_id}", {}, params={"id": str(job_id)}))
    page = unescape(body.decode())
    assert status == 200 and "first failure" in page and ("[[[[" if "[" in odd[:1] else "1" + "0" * 100) in page, page[-500:]


_RUN = ("INSERT INTO {{schema}}.service_runs (service, instance_id, started_at, finished_at, outcome, result) "
        "VALUES ('cleaner', 'i', {started}, {finished}, 'success', CAST({result} AS jsonb))")
_SAMPLE = ("INSERT INTO {{schema}}.health_history (at, since, depth, queues, holder) VALUES "
           "({at}, {since}, CAST({depth} AS jsonb), '{{}}', CAST({holder} AS jsonb))")
_NOW = "now() - interval '5 minutes'"
ODD_OWN_ROWS = {  # one row of maintd's own tables, written by hand or by a restore
    **{f"service run {c} at {t}": _RUN.format(started=t if c == "started" else "now()",
                                              finished=t if c == "finished" else "now()", result="'{}'")
       for c in ("started", "finished") for t in ("'-infinity'", "'infinity'", "'0044-03-15 BC'")},
    "service run result nested 3000 deep": _RUN.format(started="now()", finished="now()",
                                                       result="'" + "[" * 3000 + "]" * 3000 + "'"),
    **{f"history sample {c} at {t}": _SAMPLE.format(at=t if c == "at" else _NOW, since=t if c == "since" else _NOW,
                                                    depth="'{}'", holder="NULL")
       for c in ("at", "since") for t in ("'infinity'", "'10000-01-01 00:00:00+00'", "'-infinity'")},
    **{f"history sample depth {d}": _SAMPLE.format(at=_NOW, since=_NOW, depth=f"'{d}'", holder="NULL")
       for d in ('"text"', "42", "null", '{"available": "many"}', '{"n": 1e5000}')},
    **{f"history sample holder {h}": _SAMPLE.format(at=_NOW, since=_NOW, depth="'{}'", holder=f"'{h}'")
       for h in ('"text"', "42", '{"pid": 1}')},
    **{f"history sample horizon age {v}": "INSERT INTO {schema}.health_history (at, since, horizon_age_seconds) "
                                          f"VALUES ({_NOW}, {_NOW}, '{v}')" for v in ("NaN", "Infinity")},
}


@pytest.mark.parametrize("row", ODD_OWN_ROWS)
def test_one_odd_row_of_maintds_own_tables_never_makes_the_overview_a_500(settings, engine, schema, row):
    """A service_runs row at a time no datetime holds (a reader loads it as text) made the overview
    a 500 (TypeError computing its duration), and so did one health_history sample the charts
    could not draw: a time past year 9999 or a BC 'since', counts that are not an object of
    numbers, a holder that is not one. The run is listed without a duration; such a sample is
    left out of the charts; the rest of the overview is shown."""
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue) VALUES ('k', 'still-shown')", schema))
        conn.execute(sql(ODD_OWN_ROWS[row], schema))
    dashboard = Dashboard(lambda: settings)
    status, _, body, _ = dashboard.pages()["/"](Request("/", {}))
    page = unescape(body.decode())
    assert status == 200 and "still-shown" in page and "Jobs by state" in page, page[-600:]
    if row.startswith("service run"):
        assert "cleaner" in page


ODD_ROWS = {  # (state, finalized_at, scheduled_at, created_at): one row the overview reads
    "discarded at infinity": ("discarded", "'infinity'", "now()", "now()"),
    "discarded BC": ("discarded", "'0044-03-15 00:00:00+00 BC'", "now()", "now()"),
    "available due -infinity": ("available", "NULL", "'-infinity'", "now() - interval '1 hour'"),
    "available due -infinity, made -infinity": ("available", "NULL", "'-infinity'", "'-infinity'"),
    "available due infinity": ("available", "NULL", "'infinity'", "now()"),
    "available due past year 9999": ("available", "NULL", "'10000-01-01 00:00:00+00'", "now()"),
}


@pytest.mark.parametrize("row", ODD_ROWS)
def test_one_row_at_an_odd_time_never_makes_the_overview_a_503(settings, engine, schema, row):
    """SPEC 7.3's odd rows (Go's zero time, 'infinity', an import's BC date): one discarded or
    available job at such a time made the whole overview of its target 'Cannot read this target:
    timestamp too small' (a 503). The discarded job is listed with its time as PostgreSQL writes
    it; an available job due before year 1 waits since it was made, one due past year 9999 (which
    no claim takes) is not waiting, as the oldest-available gauge says."""
    state, finalized, scheduled, created = ODD_ROWS[row]
    with engine.begin() as conn:
        conn.execute(sql(f"INSERT INTO {{schema}}.jobs (kind, queue, state, finalized_at, scheduled_at, created_at) "
                         f"VALUES ('k', 'odd', '{state}', {finalized}, {scheduled}, {created})", schema))
    dashboard = Dashboard(lambda: settings)
    status, _, body, _ = dashboard._guard(dashboard.index)(Request("/", {}))
    page = unescape(body.decode())
    assert status == 200 and "Cannot read" not in page, re.findall(r"Cannot read[^<]*", page)
    with engine.connect() as conn:
        now = conn.execute(text("SELECT now()")).scalar()
        age = queue_table(conn, schema, now)["oldest_age"]
    if row == "available due -infinity":
        assert 3500 < age < 3700, age
    elif state == "available":
        assert age is None, age
    else:
        assert ("infinity" if "infinity" in row else "BC") in page


@pytest.mark.both_layouts
def test_running_pages_walk_the_running_index_not_every_older_job(engine, schema, layout):
    """Running jobs sit above every finished one in id order (claims take the oldest waiting jobs):
    paged by id, the running page walked jobs_pkey past all of them (95 ms a page per million
    finished jobs, plain layout). In jobs_running_idx's order (the longest without a sign of life
    first), every page, after a cursor with a time or with none, reads that index, whatever the
    page costs."""
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, finalized_at) "
                         "SELECT 'k', 'completed', now() FROM generate_series(1, 100000)", schema))
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, state, attempt, attempted_at) "
                         "SELECT 'k', 'running', 1, now() - g * interval '1 second' FROM generate_series(1, 3000) g",
                         schema))
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    order = ORDERS["running"]
    with engine.begin() as conn:
        for cursor in (None, "2026-01-01T00:00:00+00:00,5", "null,5"):
            keys = order.parse(cursor) if cursor else None
            query, _, _ = _list_sql(JobFilter(state="running", after=cursor), order, keys)
            params = {"limit": 51, "scan": 51, **(keys or {})}
            for page_cost in at_page_costs(conn):
                plan = explain(conn, query, schema, params)
                assert "jobs_running_idx" in plan and "jobs_pkey" not in plan, (cursor, page_cost, plan)
                assert not seq_scans(plan, layout), (cursor, page_cost, plan)


def test_bad_parameters_get_400_and_an_unknown_job_404(settings, schema):
    daemon = start_daemon(settings)
    try:
        port = daemon.http_port
        cases = {
            "/jobs?state=bogus": "unknown state 'bogus'",
            "/jobs?state=completed&after=zzz": "invalid 'after' cursor",
            "/jobs?state=available&after=1,2": "invalid 'after' cursor",
            # out of the columns' range: the database's error made them a 503
            "/jobs?state=available&after=99999,2024-01-01T00:00:00,1": "invalid 'after' cursor",
            "/jobs?after=99999999999999999999": "invalid 'after' cursor",
            "/jobs?after=-9223372036854775809": "invalid 'after' cursor",
            "/jobs?stat=completed": "unknown parameter 'stat'",
            "/jobs?state=completed&state=running": "parameter 'state' is given 2 times",
            "/jobs?queue=" + "x" * 129: "queue must be at most 128 characters",
            "/jobs/abc": "job id must be a positive integer",
            "/jobs/0": "job id must be a positive integer",
            "/jobs/99999999999999999999": "job id must be a positive integer",
            "/jobs?target=other": "unknown target 'other'",
            "/?refresh=1": "refresh must be 0 (off) or 2 to 3600 seconds",
            # str.isdigit() takes these; int() refused them (a 500 and a warning line each)
            "/jobs/%C2%B2": "job id must be a positive integer",
            "/jobs/" + "9" * 5000: "job id must be a positive integer",
            "/?refresh=%C2%B2": "refresh must be 0 (off) or 2 to 3600 seconds",
            "/jobs/%D9%A1%D9%A2": "job id must be a positive integer",  # not job 12
            # PostgreSQL text holds no NUL: a 400 before the database (a 503 before, issue 26)
            "/jobs?queue=a%00b": "parameter 'queue' holds a NUL byte",
            "/jobs?state=completed&queue=%00": "parameter 'queue' holds a NUL byte",
        }
        for path, message in cases.items():
            status, body, headers = fetch(port, path)
            expected = 404 if "target" in path else 400
            assert status == expected and message in unescape(body), (path, status, body[-300:])
            assert headers["Content-Type"].startswith("text/html")
        status, body, _ = fetch(port, "/jobs/123456789")
        assert status == 404 and "no job 123456789" in body
        assert fetch(port, "/?refresh=0")[0] == 200 and 'http-equiv="refresh"' not in fetch(port, "/?refresh=0")[1]
        assert 'content="10"' in fetch(port, "/")[1]
    finally:
        daemon.stop()


def test_refresh_works_on_every_page_and_is_kept_from_page_to_page(settings, engine, schema):
    """Issue 28 row 10: the README's ?refresh=0 answered 400 on /jobs and /jobs/ID."""
    with engine.begin() as conn:
        job_id = JobQueue(schema).enqueue(conn, "k", queue="mail")
    pages = Dashboard(lambda: settings).pages()
    for path, page, params in (("/", "/", {}), ("/jobs", "/jobs", {}),
                               (f"/jobs/{job_id}", "/jobs/{id}", {"id": str(job_id)})):
        status, _, body, _ = pages[page](Request(path, {"refresh": ["0"]}, params=params))
        html = unescape(body.decode())
        assert status == 200 and 'http-equiv="refresh"' not in html, (path, html[-300:])
        links = re.findall(r'href="(/[^"]*)"', html)
        assert links and all("refresh=0" in link for link in links), (path, links)  # stays off
        status, _, body, _ = pages[page](Request(path, {"refresh": ["30"]}, params=params))
        assert status == 200 and '<meta http-equiv="refresh" content="30">' in body.decode()
        status, _, body, _ = pages[page](Request(path, {"refresh": ["1"]}, params=params))
        assert status == 400 and "refresh must be 0 (off) or 2 to 3600 seconds" in unescape(body.decode())
        # The error page's links dropped the bad value (they led to the same 400 again).
        links = re.findall(r'href="(/[^"]*)"', unescape(body.decode()))
        assert links and not any("refresh=1" in link for link in links), (path, links)
    # Defaults: the overview refreshes every 10 s, a job page does not.
    assert 'content="10"' in pages["/"](Request("/", {}))[2].decode()
    assert 'http-equiv="refresh"' not in pages["/jobs"](Request("/jobs", {}))[2].decode()


def test_an_unreachable_database_is_a_503_page_without_the_password(schema):
    settings = Settings(database_url="postgresql://maintd:hunter2secret@127.0.0.1:1/app", schema=schema,
                        instance_id="test-1")
    dashboard = Dashboard(lambda: settings)
    for req in (Request("/", {}), Request("/jobs", {}), Request("/jobs/1", {}, params={"id": "1"})):
        status, _, body, _ = dashboard.pages()[{"/": "/", "/jobs": "/jobs"}.get(req.path, "/jobs/{id}")](req)
        html = body.decode()
        assert status == 503 and "127.0.0.1" in html and "hunter2secret" not in html, html[-500:]


# -- bounded counts -----------------------------------------------------------------------------


def test_counts_stop_at_the_cap_and_say_so(engine, schema):
    q = JobQueue(schema)
    later = datetime.now(timezone.utc) + timedelta(days=1)
    with engine.begin() as conn:
        for i in range(12):
            q.enqueue(conn, "k", queue="big")
            q.enqueue(conn, "k", queue="big", scheduled_at=later)
        for i in range(3):
            q.enqueue(conn, "k", queue="small")
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state, attempt, attempted_at, finalized_at)"
                         " SELECT 'k', q, 'completed', 1, now(), now()"
                         " FROM unnest(ARRAY['done', 'small']) q, generate_series(1, CASE q WHEN 'done' THEN 12 ELSE 3 END)",
                         schema))
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    with engine.connect() as conn:
        now = conn.execute(text("SELECT now()")).scalar_one()
        table = queue_table(conn, schema, now, cap=10)  # 10 per counted cell, a window of 10 for the others
    rows = {r["queue"]: r["counts"] for r in table["rows"]}
    cell = {(q, s): (c.value, c.kind) for q, counts in rows.items() for s, c in counts.items()}
    # available and finished jobs: per queue through an index that leads with it, up to the cap
    assert cell[("big", "available")] == (10, "atleast") and cell[("small", "available")] == (3, "exact")
    assert cell[("done", "completed")] == (10, "atleast") and cell[("small", "completed")] == (3, "exact")
    assert cell[("big", "completed")] == (0, "exact")  # counted: none (not "?")
    # scheduled: a window of its index; a queue that has none in a full window is not counted
    assert cell[("big", "scheduled")] == (10, "atleast") and cell[("small", "scheduled")] == (0, "unknown")
    assert [_count(Count(*cell[k])) for k in (("big", "scheduled"), ("small", "scheduled"), ("big", "completed"))] \
        == ["≥ 10", "?", "0"]
    # Totals past the cap come from the statistics (ANALYZE saw 15 available, 15 completed, 12 scheduled).
    assert (table["totals"]["available"].value, table["totals"]["available"].kind) == (15, "estimate")
    assert (table["totals"]["completed"].value, table["totals"]["completed"].kind) == (15, "estimate")
    assert (table["totals"]["scheduled"].value, table["totals"]["scheduled"].kind) == (12, "estimate")
    assert (table["totals"]["running"].value, table["totals"]["running"].kind) == (0, "exact")
    # With many queues the per-queue counts share out their budget (10 x cap entries in all).
    assert per_queue_cap(10_000, 5) == 10_000 and per_queue_cap(10_000, 1_000) == 100


def test_a_count_of_exactly_the_cap_is_exact_not_at_least(engine, schema):
    """A count reads at most ``cap`` index entries: it found ``cap`` whether the queue held ``cap``
    jobs or a million, and said "≥ 10,000" for a queue of exactly 10,000. One entry more is read,
    so exactly the cap is exact and only more is "at least" (shown at the cap: "≥ 10")."""
    q = JobQueue(schema)
    later = datetime.now(timezone.utc) + timedelta(days=1)
    with engine.begin() as conn:
        for i in range(10):
            q.enqueue(conn, "k", queue="even")
            q.enqueue(conn, "k", queue="even", scheduled_at=later)
        for i in range(11):
            q.enqueue(conn, "k", queue="over")
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state, attempt, attempted_at, finalized_at)"
                         " SELECT 'k', q, 'completed', 1, now(), now()"
                         " FROM unnest(ARRAY['even', 'over']) q, generate_series(1, CASE q WHEN 'even' THEN 10 ELSE 11 END)",
                         schema))
    with engine.connect() as conn:
        now = conn.execute(text("SELECT now()")).scalar_one()
        table = queue_table(conn, schema, now, cap=10)
    cell = {(r["queue"], s): (c.value, c.kind) for r in table["rows"] for s, c in r["counts"].items()}
    assert cell[("even", "available")] == (10, "exact") and cell[("over", "available")] == (10, "atleast")
    assert cell[("even", "completed")] == (10, "exact") and cell[("over", "completed")] == (10, "atleast")
    assert cell[("even", "scheduled")] == (10, "exact")  # a window of 10 holding all 10: not full
    assert (table["totals"]["scheduled"].value, table["totals"]["scheduled"].kind) == (10, "exact")
    assert _count(Count(*cell[("over", "available")])) == "≥ 10"


def test_many_discarded_jobs_are_counted_to_ten_thousand_and_other_queues_exactly(settings, engine, schema):
    """Issue 28 row 9: with 200 k discarded jobs the overview said "Discarded ≥ 2,000" (the README
    says 10,000) and "?" for the queues that had none. 25,000 discarded in one queue, before and
    after the statistics know them."""
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state, attempt, attempted_at, finalized_at)"
                         " SELECT 'k', 'imports', 'discarded', 1, now(), now() - make_interval(secs => g)"
                         " FROM generate_series(1, 25000) g", schema))
        for queue in ("mail", "pdf"):
            JobQueue(schema).enqueue(conn, "k", queue=queue)
    dashboard = Dashboard(lambda: settings)

    def overview() -> tuple[str, dict[tuple[str, str], str]]:
        status, _, body, _ = dashboard.index(Request("/", {}))
        html = unescape(body.decode())
        assert status == 200
        card = re.search(r'Discarded</div>\s*<div class="big">([^<]*)<', html).group(1)
        cells = {(q, s): v for q, row in re.findall(r'<tr data-queue="([^"]+)">(.*?)</tr>', html, re.S)
                 for s, v in re.findall(r'data-state="(\w+)">(?:<a [^>]*>)?([^<]*)<', row)}
        return card, cells

    card, cells = overview()  # before ANALYZE (autovacuum may have run meanwhile)
    assert card in ("≥ 10,000", "≈ 25,000"), card  # the bound the README states, or the statistics
    assert cells[("imports", "discarded")] == "≥ 10,000"
    assert cells[("mail", "discarded")] == "0" and cells[("pdf", "discarded")] == "0"  # counted, not "?"
    assert "?" not in cells.values()
    with engine.begin() as conn:
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    card, cells = overview()
    assert card == "≈ 25,000", card


# -- a large table ------------------------------------------------------------------------------

BIG = """
INSERT INTO {schema}.jobs (kind, queue, state, priority, attempt, scheduled_at, attempted_at,
                           finalized_at, errors)
SELECT 'kind.' || (g % 13), (ARRAY['default', 'mail', 'billing', 'reports', 'webhooks'])[1 + g % 5],
       CAST(s AS {schema}.job_state), (g % 3)::smallint,
       CASE WHEN s IN ('available', 'scheduled') THEN 0 ELSE 1 END,
       now() - make_interval(secs => g % 86400)
             + CASE WHEN s IN ('scheduled', 'retryable') THEN interval '2 days' ELSE interval '0' END,
       CASE WHEN s IN ('available', 'scheduled') THEN NULL ELSE now() END,
       CASE WHEN s IN ('completed', 'cancelled', 'discarded') THEN now() - make_interval(secs => g % 86400) END,
       CASE WHEN s = 'discarded' THEN jsonb_build_array(jsonb_build_object('error', 'boom ' || g))
            ELSE '[]'::jsonb END
  FROM generate_series(1, :n) g,
       LATERAL (SELECT CASE WHEN g % 100 < 60 THEN 'completed' WHEN g % 100 < 63 THEN 'discarded'
                            WHEN g % 100 < 85 THEN 'available' WHEN g % 100 < 97 THEN 'scheduled'
                            WHEN g % 100 < 99 THEN 'retryable' ELSE 'cancelled' END) AS x(s)
"""


@pytest.mark.slow
def test_pages_stay_fast_on_a_large_table(settings, schema, pg_dsn):
    """MAINTD_BENCH_ROWS jobs (default 1,000,000; measured with 10,000,000 for the README)."""
    n = int(os.environ.get("MAINTD_BENCH_ROWS", "1000000"))
    eng = make_engine(pg_dsn, application_name="maintd-test-big", pooled=False)
    with eng.connect() as conn:
        conn.exec_driver_sql("SET statement_timeout = 0")
        conn.execute(sql(BIG, schema), {"n": n})
        conn.commit()
        conn.connection.driver_connection.autocommit = True
        conn.exec_driver_sql(f'VACUUM (ANALYZE) "{schema}".jobs')
    eng.dispose()
    dashboard = Dashboard(lambda: settings)
    timings = {}
    for path, query in (("/", {}), ("/jobs", {}), ("/jobs", {"state": ["available"]}),
                        ("/jobs", {"state": ["discarded"], "queue": ["mail"]}),
                        ("/jobs", {"state": ["completed"], "queue": ["nope"]})):
        page = dashboard.pages()[path]
        page(Request(path, query))  # warm the cache once, as a refreshing page does
        started = time.perf_counter()
        status, _, body, _ = page(Request(path, query))
        timings[f"{path}?{query}"] = time.perf_counter() - started
        assert status == 200, body[-400:]
    print(f"page times on {n:,} jobs: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in timings.items()))
    assert max(timings.values()) < 3.0, timings


# -- the README screenshot ----------------------------------------------------------------------


def write_readme_screenshot(path: str, dsn: str) -> None:
    """Two replicas, a seeded workload, the overview in Chromium, saved as ``path``."""
    from maintd.db import quote_ident

    from .conftest import screenshot_schema

    schema, engine = screenshot_schema(dsn)
    base = Settings(database_url=dsn, schema=schema, instance_id="maintd-a", http={"listen": "127.0.0.1:0"},
                    periodic=PERIODIC)
    daemon = start_daemon(base)
    follower = Daemon(changed(base, instance_id="maintd-b"))
    follower.start()
    driver = make_browser()
    try:
        wait_for(lambda: "periodic" in daemon.targets[0].runner.last_runs, 15, what="a periodic pass")
        seed_workload(engine, schema)
        wait_for(lambda: _replicas(engine, schema) == 2, 15, what="both replicas registered")
        driver.get(f"http://127.0.0.1:{daemon.http_port}/?refresh=0")
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": 1280, "height": height, "deviceScaleFactor": 1, "mobile": False})
        png = driver.get_screenshot_as_png()
        assert_real_screenshot(png)
        with open(path, "wb") as fh:
            fh.write(png)
        print(f"wrote {path} ({len(png):,} bytes)")
    finally:
        close_browser(driver)
        follower.stop()
        daemon.stop()
        with engine.connect() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {quote_ident(schema)} CASCADE"))
            conn.commit()
        engine.dispose()


if __name__ == "__main__":  # python -m tests.test_dashboard docs/dashboard.png [DSN]
    import sys

    write_readme_screenshot(sys.argv[1], sys.argv[2] if len(sys.argv) > 2
                            else "postgresql://postgres@127.0.0.1:5432/test")


def test_with_several_targets_the_home_link_of_every_page_opens_the_overview(pg_dsn, schema, engine):
    """The home link carried the page's target, which the overview refuses (it shows them all):
    "maintd" on every /jobs and /jobs/ID page of a target answered 400."""
    from urllib.parse import parse_qs, urlsplit

    from maintd import migrate

    from .conftest import new_schema_name

    other = new_schema_name()
    with engine.connect() as conn:
        migrate.upgrade(conn, other)
    try:
        with engine.begin() as conn:
            job = JobQueue(other).enqueue(conn, "k")
        settings = Settings(database_url=pg_dsn, instance_id="reader",
                            targets=[{"name": "one", "schema": schema}, {"name": "two", "schema": other}])
        dashboard = Dashboard(lambda: settings)
        for page, path, params in ((dashboard.jobs, "/jobs", {}), (dashboard.job, f"/jobs/{job}", {"id": str(job)})):
            status, _, body, _ = page(Request(path, {"target": ["two"]}, params=params))
            assert status == 200, body
            home = unescape(re.search(r'id="home" href="([^"]*)"', body.decode()).group(1))
            url = urlsplit(home)
            assert url.path == "/"
            status, _, body, _ = dashboard.index(Request("/", parse_qs(url.query)))
            assert status == 200, body[:300]
            jobs_link = unescape(re.search(r'href="(/jobs\?[^"]*)"', body.decode()).group(1))
            assert "target=" in jobs_link  # the overview's links to a target's pages keep it
    finally:
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{other}" CASCADE'))


def test_a_holder_in_another_database_is_named_with_its_database(settings):
    """A transaction of another database holds this one's horizon too (SPEC 8.2). `maintd status`
    said `in database NAME`; the dashboard showed its pid alone, which an operator then looked
    for in vain among this database's sessions (an independent review)."""
    holder = {"kind": "transaction", "scope": "data", "pid": 4242, "user": "app", "application_name": "report",
              "client_addr": None, "state": "idle in transaction", "xmin": "5", "age_xids": 9,
              "age_seconds": 400.0, "exact": True, "since": None, "name": None,
              "detail": "in database billing", "query": None}
    local = {**holder, "pid": 77, "detail": "client backend", "application_name": "worker"}
    health = {"at": "2026-01-01T00:00:00+00:00", "tables": [],
              "horizon": {"age_seconds": 400.0, "age_xids": 9, "holder": holder, "holders": [holder, local],
                          "more_holders": 0, "catalog_holders": []}}
    status, _, body, _ = Dashboard(lambda: settings, health=lambda name: health).index(Request("/", {}))
    html = body.decode()
    assert status == 200
    card = re.search(r'<div class="card" id="holder">(.*?)</div>\s*</div>', html, re.S).group(1)
    assert "pid 4242" in card and "in database billing" in card
    rows = re.findall(r"<tr><td>transaction.*?</tr>", re.search(r'<table id="holders">(.*?)</table>', html, re.S).group(1), re.S)
    assert "in database billing" in rows[0] and "4242" in rows[0]
    assert "client backend" not in html  # only another database is worth naming


@pytest.mark.both_layouts
def test_final_counts_read_each_queue_s_entries_of_the_queue_index(engine, schema, layout):
    """The overview counts each queue's final jobs of a state, at most ``cap`` entries of
    jobs_finalized_queue_idx each. Without an order, the planner weighed the first ``cap`` rows of
    a queue by a Seq Scan against the index and took the scan from random_page_cost 4 on (generic
    plan, PostgreSQL 15 and 18): a whole-table read per queue, as many times as there are queues."""
    from maintd.queries.dashboard import FINAL_COUNTS

    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state, finalized_at) "
                         "SELECT 'k', 'q' || (g % 10), 'completed', now() - g * interval '1.7 second' "
                         "FROM generate_series(1, 100000) g", schema))
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state) "
                         "SELECT 'k', 'q' || (g % 10), 'available' FROM generate_series(1, 50000) g", schema))
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    params = {"state": "completed", "queues": [f"q{i}" for i in range(10)], "cap": 1000}
    with engine.connect() as conn:
        for page_cost in at_page_costs(conn, ("1.1", "4", "6", "10")):
            for generic in (False, True):
                plan = explain(conn, FINAL_COUNTS, schema, params, generic=generic)
                assert "finalized_queue_idx" in plan and not seq_scans(plan, layout), (page_cost, generic, plan)
        conn.rollback()


def test_final_states_past_the_queue_bound_are_not_an_exact_total(engine, schema):
    """More queues holding completed jobs than the overview probes (MAX_HEADS): the total counted
    only the first MAX_HEADS queues and called it exact, and the queues past them vanished."""
    from maintd.dashboard import MAX_HEADS

    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state, attempt, attempted_at, finalized_at)"
                         " SELECT 'k', 'q' || lpad(g::text, 5, '0'), 'completed', 1, now(), now()"
                         " FROM generate_series(1, :n) g", schema), {"n": MAX_HEADS + 5})
        JobQueue(schema).enqueue(conn, "k", queue=f"q{MAX_HEADS + 5:05d}")  # past the bound, one completed
    with engine.connect() as conn:
        now = conn.execute(text("SELECT now()")).scalar_one()
        table = queue_table(conn, schema, now)
    last = next(r["counts"]["completed"] for r in table["rows"] if r["queue"] == f"q{MAX_HEADS + 5:05d}")
    assert last.kind == "unknown", f"a queue past the bound shows {_count(last)} completed (it has 1)"
    total = table["totals"]["completed"]
    assert (total.value, total.kind) != (MAX_HEADS, "exact"), \
        f"{MAX_HEADS + 5} completed jobs shown as exactly {_count(total)}"
    assert total.kind == "atleast" or (total.kind == "estimate" and total.value >= MAX_HEADS)
    assert table["cut"], "the queues past the bound are left out without the page saying so"
    assert table["totals"]["available"].kind == "exact"  # the available jobs are all counted


def test_the_oldest_available_age_past_the_queue_bound_is_a_lower_bound(engine, schema, settings):
    """More queues of available jobs than the overview probes: the oldest waiting job may sit in
    a queue past the bound, and the age of the oldest among the probed ones was shown as the
    oldest of all (too young, with no mark)."""
    from maintd.dashboard import MAX_HEADS

    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state, scheduled_at)"
                         " SELECT 'k', 'q' || lpad(g::text, 5, '0'), 'available', now() - interval '1 minute'"
                         " FROM generate_series(1, :n) g", schema), {"n": MAX_HEADS + 5})
        conn.execute(sql("UPDATE {schema}.jobs SET scheduled_at = now() - interval '3 hours'"
                         " WHERE queue = :q", schema), {"q": f"q{MAX_HEADS + 5:05d}"})
    with engine.connect() as conn:
        now = conn.execute(text("SELECT now()")).scalar_one()
        table = queue_table(conn, schema, now)
    assert table["cut"]
    assert table["oldest_age"] < 3600 and table["oldest_atleast"], table["oldest_age"]
    status, _, body, _ = Dashboard(lambda: settings).index(Request("/", {"refresh": ["0"]}))
    card = body.decode().split('id="oldest-available"', 1)[1].split("</div>\n  </div>", 1)[0]
    assert status == 200 and "at least" in card, card


def test_a_job_with_megabytes_of_args_and_errors_ships_only_what_its_page_shows(settings, engine, schema):
    """A job's page showed 64 k characters of its args, metadata and each error, but read all of
    them (50 errors of a few MB, args of hundreds of MB) into the daemon that holds the leader lock,
    then clipped them there. The statement now ships at most TEXT_LIMIT characters of each."""
    from maintd.dashboard import TEXT_LIMIT, job_detail
    from maintd.queries.dashboard import JOB

    big = 3 * TEXT_LIMIT
    with engine.begin() as conn:
        job_id = conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, state, args, metadata, errors) "
            "SELECT 'big', 'retryable', jsonb_build_object('blob', repeat('a', :n)), "
            "       jsonb_build_object('blob', repeat('m', :n)), "
            "       jsonb_build_array(jsonb_build_object('at', 't', 'attempt', 1, 'error', 'first'),"
            "                         jsonb_build_object('attempt', 2, 'error', repeat('e', :n)),"
            "                         jsonb_build_object('attempt', 3, 'error', 'x', 'trace', repeat('t', :n)),"
            "                         to_jsonb(repeat('s', :n))) RETURNING id", schema), {"n": big}).scalar()
    with engine.connect() as conn:
        row = conn.execute(sql(JOB, schema), {"id": job_id, "limit": TEXT_LIMIT}).mappings().one()
        shipped = {"args": len(row["args"]), "metadata": len(row["metadata"]),
                   "errors": max(len(e) for e in row["errors"])}
        assert max(shipped.values()) <= TEXT_LIMIT + 100, f"shipped {shipped} characters for a page of {TEXT_LIMIT}"
        job = job_detail(conn, schema, job_id)
        pretty = conn.execute(sql("SELECT length(jsonb_pretty(args)) FROM {schema}.jobs WHERE id = :id", schema),
                              {"id": job_id}).scalar()
    assert job["args"].startswith('{\n    "blob": "aaa') and len(job["args"]) < TEXT_LIMIT + 100
    assert job["args"].endswith(f"({pretty - TEXT_LIMIT} more characters)"), job["args"][-80:]
    errors = {e["attempt"]: e for e in job["errors"]}
    assert errors[1]["error"] == "first" and errors[1]["at"] == "t"
    assert errors[2]["error"].startswith("eee") and "more characters of this entry)" in errors[2]["error"]
    assert errors[3]["error"].startswith("x\n... (") and "more characters of this entry)" in errors[3]["error"]
    assert job["errors"][0]["error"].startswith('"sss') and "more characters" in job["errors"][0]["error"]
    assert "more characters)" in job["metadata"]


def test_the_running_list_says_the_order_it_is_in(settings, schema):
    """/jobs?state=running is in jobs_running_idx's order (the longest without a sign of life
    first), but the page said "By id."."""
    status, _, body, _ = Dashboard(lambda: settings).jobs(Request("/jobs", {"state": ["running"]}))
    page = unescape(body.decode())
    assert status == 200 and "By id." not in page, "the running list says 'By id.' but is ordered by heartbeat"
    assert "The longest without a heartbeat first" in page


def test_a_job_with_megabytes_of_unique_key_and_attempted_by_ships_only_what_its_page_shows(settings, engine, schema):
    """The job page's statement shipped args, metadata and errors clipped to TEXT_LIMIT, but its
    unique_key and attempted_by whole (text of any length, no constraint on either; a final job's
    key is in no index), and clipped them in the daemon: one page view of such a job cost the
    process that holds the leader lock the whole values."""
    from maintd.dashboard import TEXT_LIMIT, job_detail
    from maintd.queries.dashboard import JOB

    big = 3 * TEXT_LIMIT
    with engine.begin() as conn:
        job_id = conn.execute(sql(
            "INSERT INTO {schema}.jobs (kind, state, finalized_at, unique_key, attempted_by) "
            "SELECT 'big', 'discarded', now(), repeat('k', :n), repeat('w', :n) RETURNING id", schema),
            {"n": big}).scalar()
    with engine.connect() as conn:
        row = conn.execute(sql(JOB, schema), {"id": job_id, "limit": TEXT_LIMIT}).mappings().one()
        shipped = {k: len(row[k]) for k in ("unique_key", "attempted_by")}
        assert max(shipped.values()) <= TEXT_LIMIT + 100, f"shipped {shipped} characters for a page of {TEXT_LIMIT}"
        job = job_detail(conn, schema, job_id)
    for key, letter in (("unique_key", "k"), ("attempted_by", "w")):
        assert job[key].startswith(letter * 100) and len(job[key]) < TEXT_LIMIT + 100, key
        assert job[key].endswith(f"({big - TEXT_LIMIT} more characters)"), job[key][-80:]


@pytest.mark.parametrize("after", ["300000-01-01 00:00:00+00,5", "2026-13-01 00:00:00+00,5",
                                   "2026-01-01 25:00:00+00,5", "0000-01-01 00:00:00+00 BC,5"])
def test_a_cursor_time_postgresql_refuses_is_a_400_not_a_database_error(settings, schema, after):
    """A cursor's time that no Python datetime holds is passed to the server as text (the page's
    own links carry 'infinity' or year 12345 so); one the server refuses too (a year past its
    range, month 13) failed the page's statement: a 503 saying "database error", for a client's
    bad cursor, as an out-of-range integer was before."""
    from maintd.dashboard import Dashboard
    page = Dashboard(lambda: settings).pages()["/jobs"]
    status, _, body, _ = page(Request("/jobs", {"state": ["completed"], "after": [after]}))
    page = unescape(body.decode())
    assert status == 400 and "invalid 'after' cursor" in page, (status, page[-400:])


@pytest.mark.both_layouts
def test_the_available_list_of_many_queues_reads_their_heads_not_a_page_of_each(settings, engine, schema):
    """/jobs?state=available (every queue) merged a whole page (51 jobs) of every queue, args and
    last error included, to keep 50: 5,000 queues of 60 jobs took 0.27 s a page here, growing with
    the queues, so about 100,000 (a count the metrics are built for) pass the readers' 5 s statement
    timeout and the list is a 503 (0.045 s for the 5,000 now). The
    page now reads each queue's first job, and whole pages only of the queues whose first job is
    among the page's first 51: rows read grow by about 2 per queue, not 51."""
    from maintd.dashboard import ORDERS, PAGE_SIZE, JobFilter, _list_sql

    queues, per_queue = 1000, 60
    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, priority, scheduled_at) "
                         "SELECT 'k', 'q' || (g % :queues), (g % 3)::smallint, now() - make_interval(secs => g % 97) "
                         "FROM generate_series(1, :n) g", schema), {"queues": queues, "n": queues * per_queue})
        conn.execute(sql("ANALYZE {schema}.jobs", schema))
    order = ORDERS["available"]
    with engine.connect() as conn:
        for cursor in (None, "1,2020-01-01T00:00:00+00:00,7"):
            keys = order.parse(cursor) if cursor else None
            query, _, _ = _list_sql(JobFilter(state="available", after=cursor), order, keys)
            plan = "\n".join(r[0] for r in conn.execute(text("EXPLAIN (ANALYZE, TIMING OFF) " + sql(query, schema).text),
                                                        {"limit": PAGE_SIZE + 1, **(keys or {})}))
            read = sum(int(rows) * int(loops) for rows, loops in
                       re.findall(r"Index (?:Only )?Scan[^\n]* on \S*jobs\S*[^\n]*actual rows=(\d+)\S* loops=(\d+)", plan))
            assert read <= 3 * queues + (PAGE_SIZE + 1) ** 2, f"{read} index entries read for one page:\n{plan}"


def test_exactly_max_heads_groups_of_available_jobs_are_all_counted_and_not_cut_off(engine, schema):
    """The overview probes at most MAX_HEADS (queue, priority) groups of available jobs and says
    the list is cut off when there are more. It read MAX_HEADS of them and called itself cut off
    when it found that many: with exactly MAX_HEADS groups, every one counted, the page said
    "the list is cut off", the oldest age "at least", and the available total was not exact."""
    from maintd.dashboard import MAX_HEADS

    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, state)"
                         " SELECT 'k', 'q' || lpad(g::text, 5, '0'), 'available'"
                         " FROM generate_series(1, :n) g", schema), {"n": MAX_HEADS})
    with engine.connect() as conn:
        now = conn.execute(text("SELECT now()")).scalar_one()
        table = queue_table(conn, schema, now)
    assert len(table["rows"]) == MAX_HEADS
    total = table["totals"]["available"]
    assert not table["cut"] and not table["oldest_atleast"], "every group was counted, yet 'cut off'"
    assert (total.value, total.kind) == (MAX_HEADS, "exact"), _count(total)


@pytest.mark.parametrize("due", ["'0001-01-01 00:00:00+00'", "'-infinity'"])
def test_the_oldest_available_age_sees_past_a_job_due_before_year_1_in_its_group(engine, schema, due):
    """A job due before year 1 (Go's zero time, '-infinity') waits since it was made, as the
    gauge says; but it sorts first in its (queue, priority) group, and the overview took that
    group's first job alone: a job made now at Go's zero time hid one due an hour ago in the same
    queue and priority, and the card read about 0 s while maintd_oldest_available_job_age_seconds
    (and the README's "as on the dashboard") said an hour."""
    from maintd.metrics import oldest_available

    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.jobs (kind, queue, scheduled_at, created_at) VALUES "
                         f"('k', 'go', {due}, now()), "
                         "('k', 'go', now() - interval '1 hour', now() - interval '1 hour')", schema))
    with engine.connect() as conn:
        now = conn.execute(text("SELECT now()")).scalar()
        table = queue_table(conn, schema, now)
        gauge = oldest_available(conn, schema)["go"]
    row = next(r for r in table["rows"] if r["queue"] == "go")
    assert 3500 < gauge < 3700, gauge
    assert table["oldest_age"] is not None and abs(table["oldest_age"] - gauge) < 5, (table["oldest_age"], gauge)
    assert row["oldest_age"] is not None and abs(row["oldest_age"] - gauge) < 5, (row["oldest_age"], gauge)


def test_thousands_of_periodic_rows_cost_the_overview_a_bounded_list(settings, engine, schema):
    """Schedules are rows (SPEC 7.10), and the README expects an application to make thousands:
    the overview read every row of periodic_jobs, with its last slot and next fire time each, on
    every render. With 20,000 rows a render took 7-10 s of the daemon's CPU and sent 6 MB, every
    10 s per open tab. It lists the configured entries and the first rows by id, and says where
    the rest are; a row that a configured entry shadows still shows its error there."""
    from maintd.dashboard import PERIODIC_SHOWN

    with engine.begin() as conn:
        conn.execute(sql("INSERT INTO {schema}.periodic_jobs (id, schedule, kind) SELECT 'tenant-' || "
                         "lpad(g::text, 5, '0'), (g % 60) || ' */2 * * 1-5', 'report' FROM generate_series(1, 20000) g", schema))
        conn.execute(sql("INSERT INTO {schema}.periodic_jobs (id, schedule, kind, error) VALUES "
                         "('zz-refresh-rates', '@every 10m', 'k', 'an entry of the config file has this id')", schema))
    entries = [{**PERIODIC[1], "id": "zz-refresh-rates"}]
    dashboard = Dashboard(lambda: changed(settings, periodic=entries))
    status, _, body, _ = dashboard.pages()["/"](Request("/", {}))
    page = unescape(body.decode())
    shown = re.findall(r'data-periodic="([^"]*)"', body.decode())
    assert status == 200 and len(body) < 500_000, len(body)
    assert shown[0] == "zz-refresh-rates" and "an entry of the config file has this id" in page
    assert shown[1:] == [f"tenant-{g:05d}" for g in range(1, PERIODIC_SHOWN + 1)], shown[:3]
    assert "maintd periodic list" in page
