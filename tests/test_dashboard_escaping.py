"""Every value the dashboard renders from the database, the config or the request is escaped: a
stored or reflected XSS payload in any of them shows up as text, never as markup (issue 29).

No browser (this runs in every run; the browser test in test_dashboard.py stays too): the pages
are rendered by :class:`maintd.dashboard.Dashboard` itself and their HTML source is parsed. The
fields are a table, :data:`FIELDS`: a payload is planted in each (``plant``), every page that
shows it is fetched, and for each field its payload must be rendered (its marker is on the
page), as text (``<script>...`` comes back out of the parser as data: the source had it
escaped), and whole inside any attribute holding it (a quote that ended the attribute early
would cut it off). No page may contain a ``<script`` or ``<img`` tag or an ``on*`` attribute at
all. Fields that the config refuses to hold such a value are listed in :data:`REFUSED`.

To add a field (the health holder of SPEC 8.2, partitions): one ``Field`` row planting it and
naming its pages.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any, Callable
from urllib.parse import quote_plus

import psycopg
import pytest
from pydantic import ValidationError

from maintd.config import Settings
from maintd.dashboard import Dashboard
from maintd.db import advisory_key
from maintd.http import Request
from maintd.queries import sql


def payload(tag: str) -> str:
    """Breaks out of a double- or single-quoted attribute and of text, with a script and an
    event handler. The part after the quotes has no quote of its own, so that it survives the
    JSON and repr() encodings some fields are shown in."""
    return f"{tag}\"'><script>alert({tag})</script><img src=x onerror=alert({tag})>"


def tail(tag: str) -> str:
    return f"<script>alert({tag})</script><img src=x onerror=alert({tag})>"


def tojson_tail(tag: str) -> str:
    """The tail as Jinja's ``tojson`` writes it (``<`` and ``>`` as \\u escapes)."""
    return tail(tag).replace("<", "\\u003c").replace(">", "\\u003e")


@dataclass
class Env:
    dsn: str
    engine: Any
    schema: str
    settings: dict[str, Any]  # Settings keyword arguments, filled in by the config fields
    job_id: int = 0
    holders: list[Any] = field(default_factory=list)  # connections kept open while the pages render
    health: dict[str, Any] | None = None  # the table health the daemon read last (SPEC 8.2)

    def execute(self, statement: str, **params: Any) -> Any:
        with self.engine.begin() as conn:
            return conn.execute(sql(statement, self.schema), params)


@dataclass(frozen=True)
class Field:
    tag: str  # the payload's marker, unique per field (F + two digits: no marker holds another)
    name: str
    pages: tuple[str, ...]  # "/", "/jobs", "/jobs/{job}", or any path with a query
    shown: Callable[[str], str] = tail  # how the payload's tail reads once the page is parsed


def job_fields(env: Env) -> None:
    """One discarded job carrying a payload in every column and error entry the pages show."""
    p = {f.name: payload(f.tag) for f in FIELDS}
    errors = [{"at": p["error at"], "attempt": p["error attempt"], "error": p["error"], "note": p["error extra"]}]
    env.job_id = env.execute(
        "INSERT INTO {schema}.jobs (kind, queue, args, metadata, errors, unique_key, attempted_by, state,"
        " attempt, max_attempts, attempted_at, finalized_at) VALUES (:kind, :queue, CAST(:args AS jsonb),"
        " CAST(:metadata AS jsonb), CAST(:errors AS jsonb), :unique_key, :by, 'discarded', 1, 1, now(), now())"
        " RETURNING id", kind=p["kind"], queue=p["queue"],
        args=json.dumps({"note": p["args value"], p["args key"]: 1}), metadata=json.dumps({"note": p["metadata"]}),
        errors=json.dumps(errors), unique_key=p["unique_key"], by=p["attempted_by"]).scalar_one()


def leader_fields(env: Env) -> None:
    """A leader row whose session holds the lock (the overview shows only such a leader)."""
    holder = psycopg.connect(env.dsn, autocommit=True)
    env.holders.append(holder)
    classid, objid = advisory_key(env.schema)
    pid = holder.execute("SELECT pg_backend_pid(), pg_advisory_lock(%s, %s)", (classid, objid)).fetchone()[0]
    env.execute("UPDATE {schema}.leader SET epoch = 1, instance_id = :instance, host = :host, pid = 1,"
                " backend_pid = :pid, elected_at = now(), renewed_at = now(), released_at = NULL",
                instance=payload(by_name["leader instance_id"].tag), host=payload(by_name["leader host"].tag), pid=pid)


def daemon_fields(env: Env) -> None:
    env.execute("INSERT INTO {schema}.daemons (instance_id, host, pid, version, started_at, last_seen_at)"
                " VALUES (:instance, :host, 2, :version, now(), now())",
                instance=payload(by_name["replica instance_id"].tag), host=payload(by_name["replica host"].tag),
                version=payload(by_name["replica version"].tag))


def service_run_fields(env: Env) -> None:
    p = {f.name: payload(f.tag) for f in FIELDS}
    insert = ("INSERT INTO {schema}.service_runs (service, instance_id, started_at, finished_at, outcome,"
              " result, error) VALUES (:service, :instance, now(), now(), :outcome, CAST(:result AS jsonb), :error)")
    env.execute(insert, service=p["service"], instance=p["service run instance_id"], outcome=p["service outcome"],
                result="{}", error=p["service error"])
    # What a pass did is shown in words (maintd.pass_summary): the data in a result is what a
    # row holds, the queue names a scheduler promoted and the ids a periodic pass enqueued.
    env.execute(insert, service="scheduler", instance="i", outcome="success", error=None,
                result=json.dumps({"promoted": {p["service result key"]: 1}}))
    env.execute(insert, service="periodic", instance="i", outcome="success", error=None,
                result=json.dumps({"enqueued": [{"periodic_id": p["service result value"]}]}))


def periodic_row_fields(env: Env) -> None:
    p = {f.name: payload(f.tag) for f in FIELDS}
    env.execute("INSERT INTO {schema}.periodic_jobs (id, schedule, timezone, kind, queue, error)"
                " VALUES (:id, :schedule, :timezone, :kind, :queue, :error)",
                id=p["periodic row id"], schedule=p["periodic row schedule"], timezone=p["periodic row timezone"],
                kind=p["periodic row kind"], queue=p["periodic row queue"], error=p["periodic row error"])


def config_fields(env: Env) -> None:
    """What [[periodic]] lets through as free text: kind and queue."""
    env.settings["periodic"] = [{"id": "configured", "schedule": "@hourly",
                                 "kind": payload(by_name["periodic config kind"].tag),
                                 "queue": payload(by_name["periodic config queue"].tag)}]


def health_fields(env: Env) -> None:
    """The holders of the xmin horizon as the leader read them (any role may set its
    application_name; a role name may hold anything quoted), and the charts' history: a queue's
    name in a legend, a holder's name on a mark."""
    p = {f.name: payload(f.tag) for f in FIELDS}
    holder = {"kind": "snapshot", "scope": "data", "pid": 7, "user": p["holder user"],
              "application_name": p["holder application_name"], "client_addr": "10.0.0.1",
              "state": p["holder state"], "xmin": "5", "age_xids": 3, "age_seconds": 400.0, "exact": True,
              "since": None, "name": p["holder name"], "detail": "client backend", "query": p["holder query"]}
    env.health = {"at": "2026-01-01T00:00:00+00:00", "tables": [],
                  "horizon": {"age_seconds": 400.0, "age_xids": 3, "holder": holder, "holders": [holder, holder],
                              "more_holders": 0, "catalog_holders": []}}
    env.execute("INSERT INTO {schema}.health_history (at, since, queues, holder, horizon_age_seconds)"
                " VALUES (now() - interval '5 minutes', now() - interval '6 minutes', CAST(:queues AS jsonb),"
                " CAST(:holder AS jsonb), 90)", queues=json.dumps({p["history queue"]: 3}),
                holder=json.dumps({"kind": "snapshot", "describe": p["history holder"]}))


JOB = "/jobs/{job}"
FIELDS: list[Field] = [
    # jobs (workers write them: anything goes)
    Field("F01", "kind", ("/", "/jobs", JOB)),
    Field("F02", "queue", ("/", "/jobs", JOB)),
    Field("F03", "args value", ("/jobs", JOB)),
    Field("F04", "args key", ("/jobs", JOB)),
    Field("F05", "metadata", (JOB,)),
    Field("F06", "error", ("/", "/jobs", JOB)),
    Field("F07", "error at", (JOB,)),
    Field("F08", "error attempt", (JOB,)),
    Field("F09", "error extra", (JOB,), shown=tojson_tail),
    Field("F10", "unique_key", (JOB,)),
    Field("F11", "attempted_by", (JOB,)),
    # leadership and replicas (hosts and instance ids as stored)
    Field("F12", "leader instance_id", ("/",)),
    Field("F13", "leader host", ("/",)),
    Field("F14", "replica instance_id", ("/",)),
    Field("F15", "replica host", ("/",)),
    Field("F16", "replica version", ("/",)),
    # service runs
    Field("F17", "service", ("/",)),
    Field("F18", "service run instance_id", ("/",)),
    Field("F19", "service outcome", ("/",)),
    Field("F20", "service error", ("/",)),
    Field("F21", "service result key", ("/",)),
    Field("F22", "service result value", ("/",)),
    # periodic schedules kept as rows (anyone with INSERT on periodic_jobs writes them)
    Field("F23", "periodic row id", ("/",)),
    Field("F24", "periodic row schedule", ("/",)),
    Field("F25", "periodic row timezone", ("/",)),
    Field("F26", "periodic row kind", ("/",)),
    Field("F27", "periodic row queue", ("/",)),
    Field("F28", "periodic row error", ("/",)),
    # the config
    Field("F29", "periodic config kind", ("/",)),
    Field("F30", "periodic config queue", ("/",)),
    # the request (reflected)
    Field("F31", "queue filter", (f"/jobs?queue={quote_plus(payload('F31'))}",)),
    Field("F32", "token", (f"/jobs?token={quote_plus(payload('F32'))}", f"/?token={quote_plus(payload('F32'))}")),
    Field("F33", "unknown state (error page)", (f"/jobs?state={quote_plus(payload('F33'))}",)),
    Field("F34", "unknown target (error page)", (f"/jobs?target={quote_plus(payload('F34'))}",)),
    # the table health (SPEC 8.2): the holder of the xmin horizon, the charts' history
    Field("F35", "holder application_name", ("/",)),
    Field("F36", "holder user", ("/",)),
    Field("F37", "holder state", ("/",)),
    Field("F38", "holder query", ("/",)),
    Field("F39", "holder name", ("/",)),
    Field("F40", "history queue", ("/",)),
    Field("F41", "history holder", ("/",)),
    # Add at merge: the partitions' names.
]
by_name = {f.name: f for f in FIELDS}
PLANTS = [job_fields, leader_fields, daemon_fields, service_run_fields, periodic_row_fields, config_fields,
          health_fields]

# Config values the config refuses to hold such a payload (so they cannot reach a page).
REFUSED: dict[str, dict[str, Any]] = {
    "instance_id (the pages' 'served by')": {"instance_id": payload("R1")},
    "target name": {"targets": [{"schema": "s1", "name": payload("R2")}]},
    "schema": {"schema": payload("R3")},
    "periodic id": {"periodic": [{"id": payload("R4"), "schedule": "@hourly", "kind": "k"}]},
    "periodic schedule": {"periodic": [{"id": "p", "schedule": payload("R5"), "kind": "k"}]},
    "periodic timezone": {"periodic": [{"id": "p", "schedule": "@hourly", "timezone": payload("R6"), "kind": "k"}]},
}


class Page(HTMLParser):
    """The tags, attributes and text of a page as a browser's parser sees them."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.attributes: list[tuple[str, str]] = []
        self.svgs: list[dict[str, str]] = []  # the attributes of each <svg> (the charts)
        self.in_svg: list[str] = []  # the elements inside them
        self._depth = 0
        self.text: list[str] = []
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attributes += [(name, value or "") for name, value in attrs]
        if self._depth:
            self.in_svg.append(tag)
        if tag == "svg":
            self.svgs.append({name: value or "" for name, value in attrs})
            self._depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg" and self._depth:
            self._depth -= 1

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attributes += [(name, value or "") for name, value in attrs]
        if self._depth:
            self.in_svg.append(tag)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def fetch(dashboard: Dashboard, path: str, job_id: int) -> tuple[int, str]:
    from urllib.parse import parse_qs

    route, _, qs = path.partition("?")
    route = route.replace("{job}", str(job_id))
    params = {"id": str(job_id)} if route.startswith("/jobs/") else {}
    page = dashboard.pages()["/jobs/{id}" if params else route]
    status, _, body, _ = page(Request(route, parse_qs(qs, keep_blank_values=True), params=params))
    return status, body.decode()


def problems_of(html: str, fields: list[Field]) -> list[str]:
    page = Page(html)
    problems = [f"a <{t}> element" for t in page.tags
                if t in ("script", "img", "iframe", "object", "embed", "foreignobject", "animate", "set", "use")]
    # Inline SVG only as maintd's own charts (maintd.charts: lines, circles, rects, texts, titles).
    problems += [f"an <svg> that is not a chart: {a}" for a in page.svgs if a.get("class") != "chart"]
    charted = {"text", "line", "polyline", "circle", "rect", "title"}
    problems += [f"a <{t}> element in a chart" for t in page.in_svg if t not in charted]
    problems += [f"an event handler attribute {n}=" for n, _ in page.attributes if n.startswith("on")]
    if re.search(r"<\s*(script|img)\b", html, re.I):
        problems.append("a raw <script or <img in the source")
    text = "".join(page.text)
    values = [v for _, v in page.attributes]
    for f in fields:
        shown = f.shown(f.tag)
        if f.tag not in text and not any(f.tag in v for v in values):
            problems.append(f"{f.name}: not rendered (its marker {f.tag} is not on the page)")
            continue
        if shown not in text and not any(shown in v or quote_plus(tail(f.tag)) in v for v in values):
            problems.append(f"{f.name}: its payload is not shown as text")
        for v in values:
            if f.tag in v and shown not in v and quote_plus(tail(f.tag)) not in v:
                problems.append(f"{f.name}: an attribute holding it was cut short: {v!r}")
    return problems


def test_every_rendered_field_is_escaped_on_every_page(pg_dsn, schema, engine):
    env = Env(pg_dsn, engine, schema, {"database_url": pg_dsn, "schema": schema, "instance_id": "xss-test"})
    try:
        for plant in PLANTS:
            plant(env)
        settings = Settings(**env.settings)
        dashboard = Dashboard(lambda: settings, health=lambda name: env.health)
        pages: dict[str, list[Field]] = {}
        for f in FIELDS:
            for path in f.pages:
                pages.setdefault(path, []).append(f)
        problems = []
        for path, fields in pages.items():
            status, html = fetch(dashboard, path, env.job_id)
            expected = 400 if "state=" in path else 404 if "target=" in path else 200
            if status != expected:
                problems.append(f"{path}: status {status}, not {expected}")
            problems += [f"{path}: {p}" for p in problems_of(html, fields)]
        assert problems == []
    finally:
        for holder in env.holders:
            holder.close()


@pytest.mark.parametrize("what", list(REFUSED))
def test_config_values_that_reach_the_pages_refuse_markup(what):
    with pytest.raises((ValidationError, ValueError)):
        Settings(database_url="postgresql://localhost/x", **REFUSED[what])


def test_the_check_itself_finds_unescaped_values():
    """problems_of must fail on what it is there to catch: markup, a cut attribute, a missing field."""
    f = Field("F99", "x", ("/",))
    assert problems_of(f"<p>{payload('F99')}</p>", [f])  # raw: a script and an img element
    assert problems_of('<svg onload="x"><text>F99</text></svg>', [f])  # not a chart, and a handler
    assert problems_of(f'<p data-x="{payload("F99")}">ok</p>', [f])  # quote breaks out of the attribute
    assert problems_of("<p>nothing</p>", [f]) == ["x: not rendered (its marker F99 is not on the page)"]
    from markupsafe import escape

    assert problems_of(f'<p data-x="{escape(payload("F99"))}">{escape(payload("F99"))}</p>', [f]) == []
