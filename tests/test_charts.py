"""The dashboard's charts (SPEC 8.2): server-rendered SVG of the last hour and day, drawn from
``health_history``, looked at in a real Chromium (with JavaScript off: nothing needs it), whose
screenshot of the chart area must hold drawn lines and the holder's marks, not a blank box.

``python -m tests.test_charts docs/health-charts.png [DSN]`` redraws the README's picture.
"""

from __future__ import annotations

import json
import math
import struct
import time
import zlib
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, text

from maintd.charts import BOTTOM, HEIGHT, LEFT, RIGHT, TOP, WIDTH, Chart, Mark, Series, count, line_chart
from maintd.config import Settings
from maintd.daemon import Daemon
from maintd.queries import sql

from .procs import wait_for
from .test_dashboard import _unfilter, close_browser, make_browser, png_colors

HOLDER = {"kind": "snapshot", "pid": 48213, "user": "bi_reader", "application_name": "metabase",
          "client_addr": "10.20.0.14", "state": "idle in transaction", "name": None, "xmin": "9184451",
          "exact": True, "describe": "snapshot pid 48213 (metabase, user bi_reader, 10.20.0.14)"}


def history_rows(now: datetime) -> list[dict[str, Any]]:
    """A day of a busy queue's history: a sample a minute over the last hour, one every ten
    minutes before; 40 to 15 minutes ago a BI snapshot holds the horizon, dead rows and the table
    grow, and the backlog with them, until it ends and vacuum catches up."""
    out = []
    points = [now - timedelta(minutes=10 * i) for i in range(144, 6, -1)] + \
             [now - timedelta(minutes=i) for i in range(60, 0, -1)]
    size = 48e6
    for at in points:
        ago = (now - at).total_seconds() / 60
        held = 15 <= ago <= 40
        age = (40 - ago) * 60 if held else 0.4
        wave = math.sin(ago / 90 * math.pi)
        dead = 3_000 + (40 - ago) * 2_400 if held else 2_500 + 400 * wave
        size = size + (dead * 180 if held else 0)
        available = 350 + 120 * wave + (900 * (40 - ago) / 25 if held else 0)
        step = 60 if ago <= 60 else 600
        out.append({
            "at": at, "since": at - timedelta(seconds=step),
            "completed": int((2900 + 300 * wave - (600 if held else 0)) * step / 60),
            "discarded": int((14 + 6 * math.cos(ago / 20)) * step / 60),
            "depth": json.dumps({"available": int(available), "scheduled": int(220 + 40 * wave), "running": 64,
                                 "retryable": int(30 + 10 * wave)}),
            "queues": json.dumps({"default": int(available * 0.5), "mail": int(available * 0.3),
                                  "billing": int(available * 0.15), "webhooks": int(available * 0.05) + 64}),
            "jobs_bytes": int(size), "dead_tuples": int(dead), "live_tuples": 2_400_000,
            "horizon_age_seconds": age, "horizon_age_xids": int(age * 900),
            "holder": json.dumps({**HOLDER, "age_seconds": round(age)}) if held and age >= 60 else None})
    return out


def seed_history(engine: Engine, schema: str) -> datetime:
    with engine.begin() as conn:
        now = conn.execute(text("SELECT now()")).scalar_one()
        conn.execute(sql("""
            INSERT INTO {schema}.health_history (at, since, completed, discarded, depth, queues, jobs_bytes,
                                                 dead_tuples, live_tuples, horizon_age_seconds, horizon_age_xids,
                                                 holder)
            VALUES (:at, :since, :completed, :discarded, CAST(:depth AS jsonb), CAST(:queues AS jsonb), :jobs_bytes,
                    :dead_tuples, :live_tuples, :horizon_age_seconds, :horizon_age_xids, CAST(:holder AS jsonb))""",
                         schema), history_rows(now))
    return now


def colored(png: bytes) -> int:
    """Sampled pixels (every 4th row and column) of the charts' colours (saturated), not white,
    the grey grid or grey text."""
    _, _, colors = png_colors(png)
    return sum(n for px, n in colors.items() if max(px) - min(px) > 60)


def plotted(png: bytes) -> int:
    """Pixels of a chart's colours inside its plot area (below the title and legend, right of
    the axis labels): the lines and marks drawn, every pixel counted."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(png):
        length, kind = struct.unpack(">I4s", png[pos:pos + 8])
        if kind == b"IHDR":
            header = struct.unpack(">IIBB", png[pos + 8:pos + 18])
        elif kind == b"IDAT":
            idat += png[pos + 8:pos + 8 + length]
        pos += 12 + length
    width, height, _, color = header
    bpp = 3 if color == 2 else 4
    raw, stride, prev, n = zlib.decompress(idat), width * bpp, bytearray(width * bpp), 0
    for y in range(height):
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        _unfilter(raw[y * (stride + 1)], line, prev, bpp)
        if TOP <= y <= HEIGHT - BOTTOM:
            for x in range(LEFT, min(width, WIDTH - RIGHT)):
                px = line[x * bpp:x * bpp + 3]
                n += max(px) - min(px) > 60
        prev = line
    return n


# -- the SVG itself ------------------------------------------------------------------------------

def test_a_chart_escapes_its_texts_and_scales_to_a_round_maximum():
    chart = Chart("x", "<b>depth</b>", (Series('queue "<script>"', ((0.0, 10.0), (60.0, 730.0))),), count,
                  (Mark(30.0, 400.0, "held by <img src=x onerror=alert(1)>"),))
    svg = str(line_chart(chart, 0.0, 60.0))
    assert "<script>" not in svg and "<img" not in svg and "<b>" not in svg
    assert "&lt;b&gt;depth&lt;/b&gt;" in svg and "held by &lt;img" in svg
    assert ">1,000</text>" in svg and ">500</text>" in svg  # 730 -> an axis to 1,000
    assert svg.count("<polyline") == 1 and svg.count('class="mark"') == 1


# -- in Chromium -----------------------------------------------------------------------------------

def test_the_dashboard_draws_the_last_hour_and_day_with_the_holder_marked(settings, engine, schema):
    seed_history(engine, schema)
    daemon = Daemon(Settings(**{**dict(settings), "health": {"interval": "1s"}}))
    daemon.start()
    driver = make_browser(javascript=False, width=1280, height=1200)
    try:
        wait_for(lambda: daemon.is_leader, 15, what="leadership")
        driver.get(f"http://127.0.0.1:{daemon.http_port}/?refresh=0")
        charts = driver.find_elements("css selector", "#charts svg.chart")
        keys = [c.get_attribute("data-chart") for c in charts]
        assert keys == [k for k in ("depth-state", "depth-queue", "finished", "size", "dead", "horizon")
                        for _ in range(2)], keys  # each chart for the last hour and the last day
        ranges = [c.find_element("xpath", "..").get_attribute("data-range") for c in charts]
        assert ranges == ["last hour", "last day"] * 6
        horizon = [c for c in charts if c.get_attribute("data-chart") == "horizon"]
        for chart in horizon:
            marks = chart.find_elements("css selector", "circle.mark")
            assert marks, "the holder is not marked"
        titles = " ".join(m.get_attribute("textContent") for m in horizon[0].find_elements("css selector", "title"))
        assert "held by snapshot pid 48213 (metabase, user bi_reader, 10.20.0.14)" in titles
        driver.execute_script("arguments[0].scrollIntoView()", charts[0])
        for chart in charts:  # every chart has drawn data in its plot area, not only a frame
            drawn = plotted(chart.screenshot_as_png)
            assert drawn >= 150, (chart.get_attribute("data-chart"), drawn)
        area = driver.find_element("css selector", "#charts").screenshot_as_png
        width, height, _ = png_colors(area)
        assert width >= 700 and height >= 900 and colored(area) >= 500, (width, height, colored(area))
    finally:
        close_browser(driver)
        daemon.stop()


def write_charts_screenshot(path: str, dsn: str) -> None:
    """The overview's table health (a real snapshot holding the horizon, the tables) and its charts
    (a day of seeded history) as ``path``."""
    import base64

    import psycopg

    from maintd.db import quote_ident

    from .conftest import screenshot_schema

    schema, engine = screenshot_schema(dsn)
    seed_history(engine, schema)
    daemon = Daemon(Settings(database_url=dsn, schema=schema, instance_id="maintd-a",
                             http={"listen": "127.0.0.1:0"}, health={"interval": "1s"}))
    for monitor in daemon.health:  # the seeded history stays as it is
        for writer in monitor.writers.values():
            writer.step = lambda ctx, report: None
    holder = psycopg.connect(dsn, application_name="metabase")
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    holder.execute(f"SELECT count(*) FROM {quote_ident(schema)}.jobs")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT txid_current()")
    daemon.start()
    driver = make_browser(javascript=True, width=1000, height=3000)
    try:
        wait_for(lambda: (daemon.health_status(schema) or {}).get("horizon", {}).get("holder"), 20,
                 what="the holder named")
        time.sleep(2)
        driver.get(f"http://127.0.0.1:{daemon.http_port}/?refresh=0")
        box = driver.execute_script("""
            const top = document.querySelector('#health').previousElementSibling.getBoundingClientRect();
            const end = document.querySelector('#charts').getBoundingClientRect();
            return [top.left, top.top + window.scrollY, 830, end.bottom - top.top];""")
        shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True,
            "clip": {"x": box[0] - 8, "y": box[1] - 4, "width": box[2], "height": box[3] + 8, "scale": 1}})
        png = base64.b64decode(shot["data"])
        assert colored(png) >= 500
        with open(path, "wb") as fh:
            fh.write(png)
        print(f"wrote {path} ({len(png):,} bytes)")
    finally:
        holder.close()
        close_browser(driver)
        daemon.stop()
        with engine.connect() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {quote_ident(schema)} CASCADE"))
            conn.commit()
        engine.dispose()


if __name__ == "__main__":  # python -m tests.test_charts docs/health-charts.png [DSN]
    import sys

    write_charts_screenshot(sys.argv[1], sys.argv[2] if len(sys.argv) > 2
                            else "postgresql://postgres@127.0.0.1:5432/test")
