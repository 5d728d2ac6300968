"""Configuration: durations, TOML + env, validation errors naming the key, exit code 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from maintd.cli import main
from maintd.config import ConfigError, Settings, load_settings, redact_dsn
from maintd.durations import format_duration, parse_duration

from .conftest import example_lines

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in list(__import__("os").environ):
        if key.startswith("MAINTD_") and key != "MAINTD_TEST_DATABASE_URL":
            monkeypatch.delenv(key)


def write(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "maintd.toml"
    p.write_text(body)
    return p


@pytest.mark.parametrize("text,seconds", [
    ("30s", 30), ("5m", 300), ("1h", 3600), ("7d", 7 * 86400), ("2w", 14 * 86400),
    ("4w3d2h1m", 4 * 604800 + 3 * 86400 + 7200 + 60), ("500ms", 0.5), ("1.5h", 5400),
    ("90", 90), (45, 45), (2.5, 2.5), ("0", 0), (" 10s ", 10), ("1H30m", 5400), ("1D2H", 93600),
    ("500MS", 0.5), ("2W", 14 * 86400),
])
def test_parse_duration(text, seconds):
    assert parse_duration(text).total_seconds() == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "s", "10x", "-5s", -1, "1h1h", "h1", "10 s", "1e400", True,
                                 None, [], "10s5", "nan", "inf", "1000000w"])
def test_parse_duration_rejects(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


# Go's time.ParseDuration cases (go/src/time/time_test.go: parseDurationTests and
# parseDurationErrorTests), the grammar most duration strings in operators' configs follow
# (Prometheus, Kubernetes, systemd-ish tools), as (text, seconds) or (text, None) for an error. Where
# maintd reads a case differently on purpose, the case says why.
GO_DURATIONS = [
    ("0", 0), ("5s", 5), ("30s", 30), ("1478s", 1478),
    ("+5s", 5), ("+0", 0), ("-0", 0),
    ("5.0s", 5), ("5.6s", 5.6), ("5.s", 5), (".5s", 0.5), ("1.0s", 1), ("1.00s", 1), ("1.004s", 1.004),
    ("1.0040s", 1.004), ("100.00100s", 100.001),
    ("13ms", 0.013), ("14s", 14), ("15m", 900), ("16h", 57600),
    ("3h30m", 12600), ("10.5s4m", 250.5), ("39h9m14.425s", 39 * 3600 + 9 * 60 + 14.425),
    ("0.3333333333333333333h", 1200), ("0.100000000000000000000h", 360),
    ("0.830103483285477580700h", 2988.372540),  # 49m48.372539827s, to the microsecond
    ("", None), ("-", None), ("s", None), (".", None), ("-.", None), (".s", None), ("+.s", None),
    ("\x85\x85", None), ("\xffff", None), ("hello \xffff world", None), ("\ufffd", None),
    ("\ufffd hello \ufffd world", None),
    ("3000000h", None),  # Go: past int64 nanoseconds; here: past 100 years
    # Different on purpose:
    ("3", 3),  # Go wants a unit; a bare number is seconds here (TOML's 30 and "30" alike)
    ("1d", 86400),  # days and weeks are units here: retentions are written in them
    ("-5s", None), ("-2m3.4s", None),  # no negative durations: -1 alone means "forever" where allowed
    ("10ns", None), ("11us", None), ("12\u00b5s", None), ("12\u03bcs", None),  # finer than 1 ms: nothing
    # in the config means it, and rounding it to 0 would turn an interval into a busy loop
]


@pytest.mark.parametrize("text,seconds", GO_DURATIONS)
def test_durations_as_go_reads_them(text, seconds):
    if seconds is None:
        with pytest.raises(ValueError):
            parse_duration(text)
    else:
        assert parse_duration(text).total_seconds() == pytest.approx(seconds, abs=1e-6)


@pytest.mark.parametrize("text", ["1M", "1H30M", "6M", "1.5M", "2w1M"])
def test_a_capital_m_is_refused_not_read_as_minutes(text):
    """"1M" was read as a minute (the phrase was lower-cased). Rust's humantime reads "1M" as a
    month (docs.rs/humantime, parse_duration: "months, month, M"), and ISO 8601's P1M is one too:
    a retention written "1M" for a month deleted after a minute. Refused, naming both readings."""
    with pytest.raises(ValueError, match="'M' reads as a month in some tools and a minute"):
        parse_duration(text)


@given(st.integers(min_value=0, max_value=10 * 365 * 86400))
def test_duration_round_trip(seconds):
    td = timedelta(seconds=seconds)
    assert parse_duration(format_duration(td)) == td


@given(st.integers(min_value=1, max_value=10 * 365 * 86400 * 10**6))
def test_a_duration_with_a_fraction_of_a_second_round_trips_to_the_microsecond(micros):
    """0.4 ms was shown as '0ms' (a rescuer or partitioner message naming 0ms < 0ms); every
    fraction is shown in milliseconds, with decimals where it has them."""
    td = timedelta(microseconds=micros)
    assert parse_duration(format_duration(td)) == td, format_duration(td)


@pytest.mark.parametrize("micros,shown", [(400, "0.4ms"), (1, "0.001ms"), (1_500_000, "1500ms"),
                                          (2_000_000, "2s"), (90_061_000_000, "1d1h1m1s")])
def test_format_duration_shows_what_it_holds(micros, shown):
    assert format_duration(timedelta(microseconds=micros)) == shown


def test_defaults_match_spec():
    s = Settings()
    assert s.schema == "maintd"
    assert (s.leader.lease, s.leader.renew_interval, s.leader.retry_interval) == (
        timedelta(seconds=10), timedelta(seconds=2), timedelta(seconds=1))
    assert s.http.listen == "127.0.0.1:9464"
    assert s.cleaner.enabled and s.cleaner.interval == timedelta(seconds=30)
    assert s.cleaner.retention("completed") == timedelta(hours=24)
    assert s.cleaner.retention("cancelled") == timedelta(hours=24)
    assert s.cleaner.retention("discarded") == timedelta(days=7)
    assert s.rescuer.enabled and s.rescuer.rescue_stuck_jobs_after == timedelta(hours=1)
    assert s.scheduler.interval == timedelta(seconds=5)
    assert not s.reindexer.enabled and s.reindexer.schedule == "0 0 * * *"
    assert s.reindexer.timeout == timedelta(minutes=1)
    assert s.periodic == []


def test_each_service_section_is_defined_beside_its_service():
    """Issue 25: a service's config section lives in its own module, and config.py holds only the
    daemon's sections (a section added there instead fails this)."""
    import maintd.config
    from maintd.sections import Section
    from maintd.services import SERVICES

    settings = Settings(periodic=[{"id": "p", "kind": "k", "schedule": "@hourly"}])
    for name, spec in SERVICES.items():
        section = spec.section(settings)
        model = type(section[0]) if isinstance(section, list) else type(section)
        assert model.__module__.startswith("maintd.services."), (name, model)
        assert model.__module__ == spec.cls.__module__ or name == "periodic", (name, model)
    assert type(settings.partitions).__module__ == "maintd.services.partitioner"
    own = {cls.__name__ for cls in vars(maintd.config).values()
           if isinstance(cls, type) and issubclass(cls, Section) and cls.__module__ == "maintd.config"}
    assert own == {"LeaderConfig", "HttpConfig", "LogConfig", "MetricsConfig", "HealthConfig", "TargetConfig"}


def test_example_config_is_valid_and_documents_every_key():
    settings = load_settings(ROOT / "config.example.toml")
    assert settings.schema == "maintd"
    text = (ROOT / "config.example.toml").read_text()
    # Every key of every section appears in the example (set or commented out), in that section.
    keys_in: dict[str, set[str]] = {}
    for section, key, _, _ in example_lines():
        keys_in.setdefault(section, set()).add(key)
    sections = {"": Settings, "leader": None, "http": None, "log": None, "cleaner": None,
                "rescuer": None, "scheduler": None, "reindexer": None, "periodic": None, "metrics": None,
                    "health": None, "partitions": None}
    from maintd.config import PeriodicJob
    for name in sections:
        model = Settings if name == "" else (
            PeriodicJob if name == "periodic" else type(getattr(Settings(), name)))
        for field in model.model_fields:
            if field in sections:
                continue
            if (name, field) in {("cleaner", "queues"), ("rescuer", "queues"), ("rescuer", "kinds")}:
                assert f"[{name}.{field}." in text
                continue
            assert field in keys_in.get(name, set()), f"{name}.{field} is not documented in [{name}]"


def test_every_commented_example_of_the_example_config_uncommented_together_is_valid(tmp_path, monkeypatch):
    """A newcomer uncomments the examples they want (job_timeout, a queue's rescue rule, a
    target): whichever they take, the file must stay valid, so all of them at once must be."""
    for name in [k for k in os.environ if k.startswith("MAINTD_")]:
        monkeypatch.delenv(name)
    lines, uncommented = [], 0
    for raw in (ROOT / "config.example.toml").read_text().splitlines():
        m = re.match(r"^# (\[\[?[a-z][a-z_.\"]*\]\]?\s*(#.*)?|[a-z_]+ = .*)$", raw)
        # auth_token's "..." and the crontab file name are placeholders for values of one's own.
        if m and not re.match(r"^# (auth_token|crontab|targets) =", raw):
            lines.append(m.group(1))
            uncommented += 1
        else:
            lines.append(raw)
    assert uncommented >= 30
    path = tmp_path / "maintd.toml"
    path.write_text("\n".join(lines) + "\n")
    settings = load_settings(path)
    assert settings.rescuer.job_timeout is not None and settings.targets


def test_toml_and_env_override(tmp_path, monkeypatch):
    p = write(tmp_path, """
schema = "jobs_a"
[cleaner]
batch_size = 100
completed_retention = "2h"
[cleaner.queues.billing]
completed_retention = "30d"
discarded_retention = -1
[[periodic]]
id = "tick"
schedule = "@every 30s"
kind = "tick"
""")
    monkeypatch.setenv("MAINTD_CLEANER__BATCH_SIZE", "250")
    monkeypatch.setenv("MAINTD_LEADER__LEASE", "20s")
    s = load_settings(p)
    assert s.schema == "jobs_a"
    assert s.cleaner.batch_size == 250  # env wins over the file
    assert s.leader.lease == timedelta(seconds=20)
    assert s.cleaner.retention("completed", "billing") == timedelta(days=30)
    assert s.cleaner.retention("discarded", "billing") is None
    # Not overridden for billing: falls back to the global value.
    assert s.cleaner.retention("cancelled", "billing") == timedelta(hours=24)
    assert s.cleaner.retention("completed", "other") == timedelta(hours=2)
    assert s.periodic[0].id == "tick"


def test_config_path_from_env(tmp_path, monkeypatch):
    p = write(tmp_path, 'schema = "from_env"\n')
    monkeypatch.setenv("MAINTD_CONFIG", str(p))
    assert load_settings().schema == "from_env"


@pytest.mark.parametrize("body,key", [
    ("bogus = 1", "bogus: unknown key"),
    ("[cleaner]\nbatchsize = 5", "cleaner.batchsize: unknown key"),
    ("[cleaner]\ninterval = 'soon'", "cleaner.interval"),
    ("[cleaner]\ncompleted_retention = '-5s'", "cleaner.completed_retention"),
    ("[cleaner]\ncompleted_retention = '1M'", "cleaner.completed_retention: invalid duration '1M': 'M' reads as a month"),
    ("[rescuer]\nrescue_stuck_jobs_after = '10m'\njob_timeout = '10m'",
     "rescuer.rescue_stuck_jobs_after: must be greater than rescuer.job_timeout"),
    ("[rescuer]\nrescue_stuck_jobs_after = '0s'", "rescuer.rescue_stuck_jobs_after"),
    ("schema = 'Bad-Name'", "schema: invalid schema name"),
    # said "use 1-63 lower-case letters ...": a name of 48 to 63 was then refused again
    ("schema = 'Bad'", "schema: invalid schema name 'Bad': use 1-47 lower-case letters"),
    ("schema = 'x\"; DROP TABLE jobs; --'", "schema: invalid schema name"),
    ("schema = 'pg_catalog'", "schema: invalid schema name"),
    # 48 characters: its channel '<schema>_maintd_periodic' is 64 (PostgreSQL's NOTIFY takes 63):
    # migrate passed, then every run failed, and an application's insert into periodic_jobs
    ("schema = '" + "s" * 48 + "'", "schema: invalid schema name '" + "s" * 48 + "': at most 47 characters"),
    ("[[targets]]\nschema = '" + "t" * 60 + "'", "targets[0].schema: invalid schema name"),
    ("[reindexer]\nindexes = ['jobs_pkey; DROP TABLE x']", "reindexer.indexes"),
    # a name twice was rebuilt (and counted) twice a pass
    ("[reindexer]\nindexes = ['jobs_pkey', 'jobs_scheduled_idx', 'jobs_pkey']",
     "reindexer.indexes: index 'jobs_pkey' is listed twice"),
    ("[reindexer]\nschedule = '61 * * * *'", "reindexer.schedule"),
    ("[[periodic]]\nid = 'p1'\nschedule = '* * * *'\nkind = 'k'",
     "periodic[0] (id='p1').schedule"),
    ("[[periodic]]\nid = 'p1'\nschedule = '@every nope'\nkind = 'k'", "periodic[0] (id='p1').schedule"),
    ("[[periodic]]\nid = 'p1'\nschedule = '0 0 * * 8'\nkind = 'k'", "periodic[0] (id='p1').schedule"),
    ("[[periodic]]\nid = 'bad id!'\nschedule = '@hourly'\nkind = 'k'", "periodic[0]"),
    ("[[periodic]]\nid = 'a'\nschedule = '@hourly'\nkind = 'k'\n[[periodic]]\nid = 'a'\n"
     "schedule = '@daily'\nkind = 'k'", "periodic: id 'a' is defined twice"),
    ("[[periodic]]\nid = 'a'\nschedule = '@hourly'\nkind = 'k'\ntimezone = 'Mars/Base'",
     "periodic[0] (id='a').timezone"),
    ("[cleaner]\nbatch_size = 99999999999999999999", "cleaner.batch_size"),
    ("[cleaner]\nbatch_size = -3", "cleaner.batch_size"),
    ("[cleaner]\nbatch_pause = '11s'", "cleaner.batch_pause: must be at most 10s"),
    ("[cleaner]\nbatch_pause = '-1s'", "cleaner.batch_pause"),
    ("[cleaner.queues.\"\"]\ncompleted_retention = '1h'", "cleaner.queues: invalid queue name ''"),
    ("[cleaner.queues.\"a\\u0001b\"]\ncompleted_retention = '1h'", "cleaner.queues: invalid queue name 'a\\x01b'"),
    ("[leader]\nlease = '2s'\nrenew_interval = '2s'", "leader.renew_interval"),
    # A lease under the floor alone blamed renew_interval (its default, 2s, over a third of it),
    # a key the file did not set: the key at fault is the lease.
    ("[leader]\nlease = '500ms'", "leader.lease: must be at least 1s"),
    ("[leader]\nrenew_interval = '1ms'", "leader.renew_interval: must be at least 100ms"),
    ("[leader]\nretry_interval = '0.05'", "leader.retry_interval: must be at least 100ms"),
    # '1ms' for '1m' ran a pass a millisecond; the floor is the leader keys'.
    ("[scheduler]\ninterval = '1ms'", "scheduler.interval: must be at least 100ms"),
    ("[cleaner]\ninterval = '0.01s'", "cleaner.interval: must be at least 100ms"),
    ("[[targets]]\nschema = 'a'\nrescuer = { interval = '5ms' }", "targets[0].rescuer.interval: must be at least 100ms"),
    ("[http]\nlisten = 'nope'", "http.listen"),
    # An IPv6 address goes in brackets, as in a URL (RFC 3986 section 3.2.2); '[::1:9464' listened on ::1.
    ("[http]\nlisten = '[::1:9464'", "http.listen: an IPv6 address goes in brackets"),
    ("[http]\nlisten = '::1:9464'", "http.listen: an IPv6 address goes in brackets"),
    ("[http]\nlisten = '[localhost]:80'", "http.listen: 'localhost' is not an IPv6 address"),
    # Dotted-decimal IPv4 with four parts of 0-255 (Python's ipaddress, stricter than inet_aton).
    ("[http]\nlisten = '256.1.1.1:80'", "http.listen: '256.1.1.1' is not an IPv4 address"),
    ("[log]\nformat = 'xml'", "log.format"),
    ("database_url = 'mysql://x@y/z'", "database_url"),
    ("schema = ", "invalid TOML"),
    ("layout = 'sharded'", "layout: Input should be 'plain' or 'partitioned'"),
    ("[partitions]\ninterval = '30s'", "partitions.interval: must be at least 1m"),
    ("[partitions]\ninterval = '90.5s'", "partitions.interval: must be a whole number of seconds"),
    ("[partitions]\npremake = 0", "partitions.premake"),
    # Matched in any case, 'Schema' stood beside 'schema' and won over it without a word.
    ("schema = 'a'\nSchema = 'b'", "Schema: unknown key (keys are lower case: schema)"),
    # Made ahead past year 9999: every partitioner pass failed with Python's OverflowError.
    ("[partitions]\ninterval = '520w'\npremake = 1000", "partitions.premake: 1000 partitions of 520w"),
    ("[partitions]\nsteps = 3", "partitions.steps: unknown key"),
    ("[[targets]]\nschema = 'a'\nlayout = 'heap'", "targets[0].layout: Input should be 'plain' or 'partitioned'"),
    ("[[targets]]\nschema = 'a'\npartitions = { interval = '10s' }",
     "targets[0].partitions.interval: must be at least 1m"),
    # A target's own periodic list: an id twice enqueued one of them only (the other was
    # 'skipped: duplicate' at every shared slot), as the top-level list's check says.
    ("[[targets]]\nschema = 'a'\n[[targets.periodic]]\nid = 'x'\nschedule = '@hourly'\nkind = 'k1'\n"
     "[[targets.periodic]]\nid = 'x'\nschedule = '@hourly'\nkind = 'k2'",
     "targets[0].periodic: id 'x' is defined twice (target a)"),
    # A bad entry of a target's own periodic list: which one, as the top-level list's errors say
    # (it said 'targets[0].periodic: schedule: ...', the entry neither numbered nor named).
    ("[[targets]]\nschema = 'a'\n[[targets.periodic]]\nid = 'x'\nschedule = '@hourly'\nkind = 'k1'\n"
     "[[targets.periodic]]\nid = 'y'\nschedule = 'bad'\nkind = 'k2'",
     "targets[0].periodic[1] (id='y').schedule: a cron expression has 5 fields"),
    ("[[targets]]\nschema = 'a'\n[[targets.periodic]]\nid = 'x'\nschedule = '@hourly'\n",
     "targets[0].periodic[0] (id='x').kind: Field required"),
    # The same schema of one database, the URL spelled two ways (libpq's default port filled in).
    ("[[targets]]\nschema = 'a'\ndatabase_url = 'postgresql://u@db.internal:5432/app'\n"
     "[[targets]]\nname = 'b'\nschema = 'a'\ndatabase_url = 'postgresql://u@db.internal/app'",
     "targets[1].schema: 'a' is also targets[0]'s schema"),
    ("[[targets]]\nschema = 'a'\ndatabase_url = 'host=db.internal dbname=app user=u'\n"
     "[[targets]]\nname = 'b'\nschema = 'a'\ndatabase_url = 'postgresql://u@db.internal:5432/app?sslmode=require'",
     "targets[1].schema: 'a' is also targets[0]'s schema"),
    # Two schemas whose leader locks collide (32 bits of CRC-32 of the name, found by search):
    # one daemon took both locks (advisory locks are re-entrant in a session) and proved the
    # wrong schema's; two daemons left one schema without a leader for good.
    ("[[targets]]\nschema = 't29685295'\n[[targets]]\nschema = 't32060020'",
     "targets[1].schema: 't32060020' has the leader lock key of targets[0]'s schema 't29685295'"),
    # Option values libpq checks only when it connects: `maintd run` retried them for ever.
    ("database_url = 'postgresql://u@h/app?sslmode=bogus'",
     "database_url: sslmode must be one of disable, allow, prefer, require, verify-ca, verify-full"),
    ("database_url = 'host=h dbname=app target_session_attrs=primry'", "database_url: target_session_attrs must be"),
    ("database_url = 'postgresql://u:pw@h/app?bogus_opt=1'", "an unknown connection option in the URL's query"),
    # Boundaries a mutation sweep found unpinned here (each message as an operator reads it).
    ("[leader]\nretry_interval = '6s'", "leader.retry_interval: must be at most half of leader.lease"),
    ("[health]\ninterval = '999ms'", "health.interval: must be at least 1s"),
    ("database_url = 'postgressql://u:pw@h/db'", "database_url: must be a postgresql:// URL or a libpq key=value string"),
    ("[http]\nlisten = '127.0.0.1:65536'", "http.listen: port 65536 is out of range 0-65535"),
    ("[http]\nauth_token = '0123456789abcde'", "http.auth_token: use at least 16 printable ASCII characters"),
    ("statement_timeout = 3153600001", "statement_timeout: duration 3153600001 is too large (at most 100 years)"),
    ('schema = "abc\\n"', "schema: invalid schema name 'abc\\n'"),  # a TOML newline: '$' let it through
    (f"[[periodic]]\nid = '{'p' * 129}'\nschedule = '@hourly'\nkind = 'k'", "periodic[0] (id='pppp"),
])
def test_bad_config_names_the_key(tmp_path, body, key):
    p = write(tmp_path, body)
    with pytest.raises(ConfigError) as err:
        load_settings(p)
    assert key in str(err.value)


@pytest.mark.parametrize("a,b", [
    ("service=ordersdb", "service=billingdb"),  # pg_service.conf: two databases, one schema name each
    ("postgresql:///?service=ordersdb", "postgresql:///?service=billingdb"),
    ("host=db.internal hostaddr=10.0.0.1 dbname=app", "host=db.internal hostaddr=10.0.0.2 dbname=app"),
    ("postgresql://u@db-a/app", "postgresql://u@db-b/app"),
])
def test_the_same_schema_on_two_databases_is_two_targets(tmp_path, a, b):
    """The duplicate-schema check compares the databases URLs reach; DSNs that may reach two
    databases are two, however alike their defaults look (a review found service= URLs refused)."""
    s = load_settings(write(tmp_path, f"[[targets]]\nname = 'a'\nschema = 'maintd'\ndatabase_url = '{a}'\n"
                                      f"[[targets]]\nname = 'b'\nschema = 'maintd'\ndatabase_url = '{b}'\n"))
    assert [t.target_name for t in s.target_settings()] == ["a", "b"]


def test_layout_top_level_and_per_target(tmp_path):
    s = load_settings(write(tmp_path, """
layout = "partitioned"
[partitions]
interval = "15m"
[[targets]]
schema = "a"
[[targets]]
schema = "b"
layout = "plain"
partitions = { premake = 4 }
"""))
    a, b = s.target_settings()
    assert (a.layout, a.partitions.interval, a.partitions.premake) == ("partitioned", timedelta(minutes=15), 24)
    assert (b.layout, b.partitions.interval, b.partitions.premake) == ("plain", timedelta(minutes=15), 4)
    assert Settings().layout == "plain" and Settings().partitions.interval == timedelta(hours=1)


def test_unknown_env_setting_is_an_error(monkeypatch):
    monkeypatch.setenv("MAINTD_CLEANR__ENABLED", "false")
    with pytest.raises(ConfigError, match="MAINTD_CLEANR__ENABLED: unknown environment setting"):
        load_settings()


def test_bad_env_value_names_the_key(monkeypatch):
    monkeypatch.setenv("MAINTD_SCHEDULER__INTERVAL", "fast")
    with pytest.raises(ConfigError, match=r"scheduler\.interval"):
        load_settings()


@pytest.mark.parametrize("env,problem", [
    ({"MAINTD_CLEANER__FOO": "1"}, "cleaner.foo: unknown key (from MAINTD_CLEANER__FOO)"),
    ({"maintd_leader__lease": "10x"}, "leader.lease: invalid duration '10x': use forms like '30s', '5m', '1h', "
     "'7d', '4w3d2h1m' or a number of seconds (from maintd_leader__lease)"),
    ({"MAINTD_LEADER": '{"renew_interval": "5s"}'},
     "leader.renew_interval: must be at most a third of leader.lease (from MAINTD_LEADER)"),
    ({"MAINTD_SCHEMA": "Bad"}, "schema: invalid schema name 'Bad': use 1-47 lower-case letters, digits and "
     "underscores, not starting with a digit (from MAINTD_SCHEMA)"),
    ({"MAINTD_PERIODIC": '[{"id": "a", "kind": "k", "schedule": "@hourly"}, {"id": "b", "kind": "k"}]'},
     # labelled by id, as an entry of the file is (it was 'periodic[1].schedule')
     "periodic[1] (id='b').schedule: Field required (from MAINTD_PERIODIC)"),
    ({"MAINTD_TARGETS": '[{"schema": "a", "cleaner": {"batch_size": 0}}]'},
     "targets[0].cleaner.batch_size: Input should be greater than or equal to 1 (target a) (from MAINTD_TARGETS)"),
    # The file's value at fault: a variable of the same section set to a good value is not blamed.
    ({"MAINTD_CLEANER__ENABLED": "false", "MAINTD_LEADER": '{"lease": "10s"}'},
     "cleaner.batch_size: Input should be greater than or equal to 1"),
    ({"MAINTD_LEADER": '{"lease": "10s"}'}, "leader.retry_interval: must be at least 100ms (each is a statement on "
     "the lock session; a typo such as '1ms' for '1m' would send one a millisecond)"),
])
def test_a_bad_value_from_the_environment_names_its_variable(tmp_path, monkeypatch, env, problem):
    """A value the environment set, at fault: the error named the key alone ('cleaner.foo: unknown
    key'), and an operator looked for it in the file, which did not have it."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    p = write(tmp_path, "[cleaner]\nbatch_size = 0\n" if "MAINTD_CLEANER__ENABLED" in env else
              "[leader]\nretry_interval = '1ms'\n" if env == {"MAINTD_LEADER": '{"lease": "10s"}'} else "")
    with pytest.raises(ConfigError) as err:
        load_settings(p)
    assert err.value.problems == [problem]


def test_every_problem_of_every_target_entry_is_reported_under_its_own_key(tmp_path):
    """A [[targets]] list stopped at its first problem: an operator fixed one key, restarted and
    met the next. Every problem of every entry is now reported, one line each, each under its own
    key (a periodic entry's line began 'config: targets[0].periodic[...]': its key, with the id
    label, was not recognised as one). A duplicate schema is not also reported as a duplicate
    name when the name is the schema's."""
    p = write(tmp_path, "[[targets]]\nschema = 'a'\n"
                        "cleaner = { batch_size = 0, completed_retention = '-5s' }\n"
                        "rescuer = { interval = '5ms' }\n"
                        "periodic = [{ id = 'x', schedule = '* *', kind = 'k' }, { id = \"it's\", kind = 'k' }]\n"
                        "[[targets]]\nschema = 'a'\n"
                        "[[targets]]\nschema = 'b'\nname = 'a'\nscheduler = { x = 1 }\n")
    with pytest.raises(ConfigError) as err:
        load_settings(p)
    keys = [problem.split(": ", 1)[0] for problem in err.value.problems]
    assert keys == ["targets[0].cleaner.batch_size", "targets[0].cleaner.completed_retention",
                    "targets[0].rescuer.interval", "targets[0].periodic[0] (id='x').schedule",
                    "targets[0].periodic[1] (id=\"it's\").schedule", "targets[0].periodic[1] (id=\"it's\").id",
                    "targets[1].schema", "targets[2].name",
                    "targets[2].scheduler.x"], err.value.problems
    assert all(problem.endswith(("(target a)", "targets[0]'s schema", "targets[0]'s name", "unknown key (target a)"))
               for problem in err.value.problems), err.value.problems


def test_every_problem_of_a_target_list_from_the_environment_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("MAINTD_TARGETS", '[{"schema": "a", "cleaner": {"batch_size": 0}, '
                                         '"periodic": [{"id": "x", "kind": "k", "schedule": "bad"}]}]')
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, ""))
    assert err.value.problems == [
        "targets[0].cleaner.batch_size: Input should be greater than or equal to 1 (target a) (from MAINTD_TARGETS)",
        "targets[0].periodic[0] (id='x').schedule: a cron expression has 5 fields (minute hour day-of-month month "
        "day-of-week), got 1 in 'bad' (target a) (from MAINTD_TARGETS)"]



@pytest.mark.parametrize("name", ["MAINTD_TARGETS__0__SCHEMA", "maintd_periodic__1__kind"])
def test_a_list_item_set_by_index_names_the_variable_and_the_json_form(monkeypatch, name):
    """pydantic-settings reads ``MAINTD_TARGETS__0__SCHEMA`` as a table keyed '0': the error was
    'targets: Input should be a valid list', naming no variable and no way out."""
    monkeypatch.setenv(name, "a")
    with pytest.raises(ConfigError) as err:
        load_settings()
    key = name.upper().split("__")[0]
    assert err.value.problems == [f"{name}: a list is not set item by item: give it whole, as JSON, in {key} "
                                  f"(as in MAINTD_TARGETS='[{{\"schema\": \"a\"}}]')"]
    monkeypatch.delenv(name)
    monkeypatch.setenv("MAINTD_TARGETS", '[{"schema": "a"}, {"schema": "b"}]')
    assert [t.schema for t in load_settings().targets] == ["a", "b"]


@pytest.mark.parametrize("name,key", [("MAINTD_SCHEMA__X", "schema"), ("MAINTD_STATEMENT_TIMEOUT__MS", "statement_timeout"),
                                      ("MAINTD_DATABASE_URL__HOST", "database_url")])
def test_a_sub_key_of_a_single_value_is_refused_not_ignored(monkeypatch, name, key):
    """``MAINTD_SCHEMA__X`` was dropped by the environment source without a word: the operator
    believed a setting the daemon never read (every other unread MAINTD_ variable is refused)."""
    monkeypatch.setenv(name, "a")
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert err.value.problems == [f"{name}: {key} is one value, not a table of keys: set MAINTD_{key.upper()}"]


@pytest.mark.parametrize("name,table,key,value", [
    ("MAINTD_CLEANER__QUEUES__Billing__COMPLETED_RETENTION", "MAINTD_CLEANER__QUEUES", "completed_retention", "1h"),
    ("MAINTD_RESCUER__KINDS__SendEmail__HEARTBEAT_TIMEOUT", "MAINTD_RESCUER__KINDS", "heartbeat_timeout", "1h"),
    ("MAINTD_CLEANER__QUEUES__Billing", "MAINTD_CLEANER__QUEUES", "completed_retention",
     '{"completed_retention": "1h"}'),
])
def test_a_mixed_case_queue_or_kind_in_a_variable_name_is_refused(monkeypatch, name, table, key, value):
    """A variable's name is read in lower case: MAINTD_CLEANER__QUEUES__Billing__... set the
    retention of a queue 'billing', and queue 'Billing' silently kept the default (a -1 meant to
    keep its jobs forever deleted them after 24h)."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert len(err.value.problems) == 1 and err.value.problems[0].startswith(f"{name}: ")
    assert table + "='{" in err.value.problems[0]
    monkeypatch.delenv(name)
    monkeypatch.setenv(table, json.dumps({"Billing": {key: "1h"}}))
    section, table_name = table.lower().removeprefix("maintd_").split("__")
    assert list(getattr(getattr(load_settings(), section), table_name)) == ["Billing"]


def test_an_upper_case_queue_in_a_variable_name_reads_lower_case(monkeypatch):
    monkeypatch.setenv("MAINTD_CLEANER__QUEUES__BILLING__COMPLETED_RETENTION", "1h")
    assert list(load_settings().cleaner.queues) == ["billing"]


@pytest.mark.parametrize("section,key", [
    (None, "statement_timeout"), ("reindexer", "timeout"), ("reindexer", "lock_timeout"), ("leader", "lease"),
])
def test_a_timeout_beyond_postgresqls_range_is_a_config_error(section, key):
    """These are sent to the server as milliseconds (statement_timeout, lock_timeout,
    idle_session_timeout), at most 2147483647: statement_timeout = "30d" passed check-config and
    then every pass and command failed with 'invalid value for parameter "statement_timeout"'."""
    def load(value):
        return load_settings(None, **({key: value} if section is None else {section: {key: value}}))
    with pytest.raises(ConfigError) as err:
        load("30d")
    name = key if section is None else f"{section}.{key}"
    assert err.value.problems == [f"{name}: must be at most 3w3d20h31m23s (PostgreSQL's longest timeout, "
                                  "2147483647 ms)"]
    assert load("3w3d20h31m23s") is not None


def test_a_config_error_cannot_forge_a_line_or_drive_the_terminal(tmp_path, capsys, monkeypatch):
    """Keys of the file (and names of queues) went to stderr, the journal under systemd, as they
    were: a quoted TOML key holding a newline wrote a line of its own, an ESC sequence reached
    the terminal (SPEC 8.5: control characters are escaped)."""
    p = write(tmp_path, '"evil\\nmaintd: config ok\\u001b[2J" = 1\n'
                        '[cleaner.queues."q\\u001b[31m"]\ncompleted_retention = "x"\n')
    monkeypatch.setenv("MAINTD_LEADER__LEASE", "1\x1b[2Jh")
    assert main(["--config", str(p), "check-config"]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and len(err.splitlines()) == 3, err
    assert all(line.startswith("maintd: config error: ") for line in err.splitlines()), err
    assert "evil\\nmaintd: config ok\\x1b[2J: unknown key" in err


def test_a_runtime_error_cannot_drive_the_terminal(pg_dsn, capsys, monkeypatch):
    """The one line a failed command prints holds what the server said, names included: a
    database named with an ESC sequence reached the terminal as it was."""
    from psycopg.conninfo import make_conninfo

    monkeypatch.setenv("MAINTD_DATABASE_URL", make_conninfo(pg_dsn, dbname="\x1b[31mnope"))
    assert main(["status"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("maintd: error: ") and "\\x1b[31mnope" in err, err
    assert "\x1b" not in err and len(err.splitlines()) == 1, err


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_settings(tmp_path / "nope.toml")
    assert err.value.problems == [f"config: file {str(tmp_path / 'nope.toml')!r} not found"]
    with pytest.raises(ConfigError) as err:
        load_settings(tmp_path)
    assert err.value.problems == [f"config: {str(tmp_path)!r} is a directory"]


def test_an_unreadable_file_is_a_config_error_naming_it(tmp_path, monkeypatch):
    """A file the daemon's user may not read: exit 2 naming the file, not exit 1 with Python's
    '[Errno 13] Permission denied' (a mode 0600 file owned by root, the daemon run as maintd)."""
    p = write(tmp_path, "schema = 'a'\n")
    p.chmod(0)
    if os.access(p, os.R_OK):  # root reads it anyway: the read fails as it would for another user
        real = Path.read_bytes

        def denied(self):
            if self == p:
                raise PermissionError(13, "Permission denied", str(self))
            return real(self)
        monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(ConfigError) as err:
        load_settings(p)
    assert err.value.problems == [f"config: no permission to read {str(p)!r}"]


def test_every_problem_is_reported_one_per_line(tmp_path, monkeypatch):
    """An unknown environment setting and bad values in the file: all of them, one line each."""
    monkeypatch.setenv("MAINTD_CLEANR__ENABLED", "false")
    p = write(tmp_path, 'statement_timeout = "0s"\n[scheduler]\ninterval = "fast"\n')
    with pytest.raises(ConfigError) as err:
        load_settings(p)
    lines = str(err.value).split("\n")
    assert lines == err.value.problems and len(lines) == 3, lines
    assert lines[0] == "MAINTD_CLEANR__ENABLED: unknown environment setting"
    assert lines[1].startswith("statement_timeout: ") and "greater than zero" in lines[1]
    assert lines[2].startswith("scheduler.interval: ")


@pytest.mark.parametrize("dsn,shown", [
    ("postgresql://maintd:s3cr3t@db:5432/app", "postgresql://maintd:***@db:5432/app"),
    ("postgresql://maintd@db/app", "postgresql://maintd@db/app"),
    ("host=db user=maintd password=s3cr3t dbname=app", "host=db user=maintd password=*** dbname=app"),
    ("host=db password='a b c' dbname=app", "host=db password=*** dbname=app"),
    # libpq takes connection parameters in a URI's query too (PostgreSQL docs, 34.1.1.2
    # "Connection URIs": postgresql:///mydb?host=localhost&port=5433 ... any keyword may be given).
    ("postgresql://maintd@db.internal/app?sslmode=require&password=TOPSECRET",
     "postgresql://maintd@db.internal/app?sslmode=require&password=***"),
    ("postgresql://db/app?password=s3cr3t&sslmode=require", "postgresql://db/app?password=***&sslmode=require"),
    ("postgresql://maintd:p%40ss@db/app?PASSWORD=x#frag", "postgresql://maintd:***@db/app?PASSWORD=***#frag"),
    # In a log line, beside other text.
    ('error="connection to postgresql://u:pw@h/d failed" dsn=host=h password=pw',
     'error="connection to postgresql://u:***@h/d failed" dsn=host=h password=***'),
    ("host=db passwordfile=none", "host=db passwordfile=none"),
    # Any key that ends in password: sslpassword is a client key's passphrase (libpq).
    ("postgresql://u:pw@h/app?sslpassword=KEYPASS&sslmode=require",
     "postgresql://u:***@h/app?sslpassword=***&sslmode=require"),
    ("host=h sslpassword='k e y' dbname=app", "host=h sslpassword=*** dbname=app"),
    # libpq's unquoted value: a backslash escapes the next character, a space too ("a\\ b" is "a b")
    ("host=db password=sec\\ r\\\\et dbname=app", "host=db password=*** dbname=app"),
    # A password with an '@' or a '/' not percent-encoded (refused by check_dsn, but masked wherever
    # such a URL shows up): up to the last '@' of the URL, not the first.
    ("postgresql://daemon:D4em@nPw@127.0.0.1:5432/app", "postgresql://daemon:***@127.0.0.1:5432/app"),
    ("dsn=postgresql://u:Pa/ss@h/db next", "dsn=postgresql://u:***@h/db next"),
])
def test_redact_dsn(dsn, shown):
    assert redact_dsn(dsn) == shown


def test_check_config_masks_a_password_with_an_escaped_space(tmp_path, capsys):
    """libpq reads ``password=sec\\ ret`` as the password "sec ret": check-config showed " ret"."""
    p = write(tmp_path, 'database_url = \'host=db password=hunter\\ two dbname=app\'\n')
    assert main(["--config", str(p), "check-config"]) == 0
    out = capsys.readouterr().out
    assert "two" not in out, out
    assert json.loads(out)["database_url"] == "host=db password=*** dbname=app"


@pytest.mark.parametrize("password", ["hunt'er2", 'hunt"er2'])
def test_check_config_masks_a_query_password_holding_a_quote(tmp_path, capsys, password):
    """libpq takes a quote in a URL query's password as it is: check-config showed the part
    after it (``?password=***'er2``)."""
    p = write(tmp_path, f"database_url = {json.dumps('postgresql://maintd@db/app?password=' + password + '&sslmode=require')}\n")
    assert main(["--config", str(p), "check-config"]) == 0
    out = capsys.readouterr().out
    assert "er2" not in out, out
    assert json.loads(out)["database_url"] == "postgresql://maintd@db/app?password=***&sslmode=require"


@pytest.mark.parametrize("key", ["pass%77ord", "%70assword", "sslpass%77ord", "PASS%57ORD"])
def test_check_config_masks_a_query_password_whose_key_is_percent_encoded(tmp_path, capsys, key):
    """libpq percent-decodes a URL query's keys as well as its values (``?pass%77ord=x`` sets
    the password): check-config printed such a password as it is."""
    import psycopg.conninfo

    url = f"postgresql://maintd@db/app?sslmode=require&{key}=HUNTER2&application_name=x"
    if key != "PASS%57ORD":  # libpq's keywords are lower case: an upper-case one is refused
        assert "HUNTER2" in psycopg.conninfo.conninfo_to_dict(url).values()
    p = write(tmp_path, f"database_url = {json.dumps(url)}\n")
    assert main(["--config", str(p), "check-config"]) in (0, 2)
    captured = capsys.readouterr()
    assert "HUNTER2" not in captured.out + captured.err, captured
    if key != "PASS%57ORD":
        shown = json.loads(captured.out)["database_url"]
        assert shown == f"postgresql://maintd@db/app?sslmode=require&{key}=***&application_name=x"


def test_check_config_prints_redacted(tmp_path, capsys):
    p = write(tmp_path, 'database_url = "postgresql://maintd:hunter2@db/app"\n')
    assert main(["--config", str(p), "check-config"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert "hunter2" not in out
    assert data["database_url"] == "postgresql://maintd:***@db/app"
    assert data["cleaner"]["completed_retention"] == "1d"
    assert data["cleaner"]["discarded_retention"] == "1w"


@pytest.mark.parametrize("body,advice", [
    ('layout = "plain"\n[partitions]\ninterval = "1m"\n', None),  # no partitions, no advice
    ('layout = "partitioned"\n', None),  # the defaults: 1h steps, 1w at most: 194 partitions
    # ceil(retention / step) + premake + 1 partitions of a state: 975 + 24 + 1 = 1000 is not "more than 1000"
    ('layout = "partitioned"\n[partitions]\ninterval = "1m"\n'
     '[cleaner]\ncompleted_retention = "975m"\ncancelled_retention = "1m"\ndiscarded_retention = "1m"\n', None),
    ('layout = "partitioned"\n[partitions]\ninterval = "1m"\n'
     '[cleaner]\ncompleted_retention = "976m"\ncancelled_retention = "1m"\ndiscarded_retention = "1m"\n',
     ["completed jobs keep about 1001 partitions (16h16m of retention in steps of 1m): raise partitions.interval"]),
    # the longest retention of the state counts (a queue's override), and kept forever grows for ever
    ('layout = "partitioned"\n[partitions]\ninterval = "1m"\n[cleaner]\ncompleted_retention = "1m"\n'
     'cancelled_retention = "1m"\ndiscarded_retention = "1m"\n[cleaner.queues.audit]\ncompleted_retention = "30d"\n'
     'discarded_retention = -1\n',
     ["completed jobs keep about 43225 partitions (4w2d of retention in steps of 1m): raise partitions.interval",
      "discarded jobs are kept forever: one more partition every 1m, without end"]),
], ids=["plain", "defaults", "1000", "1001", "longest-and-forever"])
def test_check_config_advises_when_a_state_keeps_more_than_1000_partitions(tmp_path, capsys, body, advice):
    """Every statement on jobs that names neither the state nor finalized_at (a job by id: status,
    admin functions) is planned over all the partitions: 1m steps with a week of discarded jobs are
    10,105 of them. Not an error: check-config says it (and the daemon logs it at start)."""
    assert main(["--config", str(write(tmp_path, body)), "check-config"]) == 0
    assert json.loads(capsys.readouterr().out).get("advice") == advice


def test_check_config_prints_the_retention_that_applies_to_each_queue(tmp_path, capsys):
    """A queue's override names some states; the others fall back to the state's retention.
    check-config printed those as -1 (keep forever), which, pasted back, keeps them forever."""
    p = write(tmp_path, '[cleaner]\ncompleted_retention = "2d"\n[cleaner.queues.short]\n'
                        'completed_retention = "1h"\n[cleaner.queues.keep]\ndiscarded_retention = -1\n')
    assert main(["--config", str(p), "check-config"]) == 0
    queues = json.loads(capsys.readouterr().out)["cleaner"]["queues"]
    assert queues == {
        "short": {"completed_retention": "1h", "cancelled_retention": "1d", "discarded_retention": "1w"},
        "keep": {"completed_retention": "2d", "cancelled_retention": "1d", "discarded_retention": "-1"}}
    again = load_settings(write(tmp_path, "[cleaner]\n" + "".join(
        f"[cleaner.queues.{q}]\n" + "".join(f'{k} = "{v}"\n' for k, v in keys.items()) for q, keys in queues.items())))
    assert {q: {st: again.cleaner.retention(st, q) for st in ("completed", "cancelled", "discarded")} for q in queues} == {
        "short": {"completed": timedelta(hours=1), "cancelled": timedelta(days=1), "discarded": timedelta(days=7)},
        "keep": {"completed": timedelta(days=2), "cancelled": timedelta(days=1), "discarded": None}}


def test_check_config_prints_the_stuck_rule_that_applies_to_each_queue_and_kind(tmp_path, capsys, monkeypatch):
    """A [rescuer.kinds.NAME] or [rescuer.queues.NAME] section takes the [rescuer] value of each
    key it does not set. check-config printed those keys as null: the config's own example
    (a 3h kind under a [rescuer] heartbeat_timeout of 2m) read as "no heartbeat rule" for the
    kind, whose jobs the 2m rule rescues; and pasted back as JSON, the null turned the rule off."""
    p = write(tmp_path, '[rescuer]\nrescue_stuck_jobs_after = "1h"\nheartbeat_timeout = "2m"\n'
                        'job_timeout = "30m"\n[rescuer.queues.api]\nrescue_stuck_jobs_after = "45m"\n'
                        '[rescuer.kinds."video.transcode"]\nrescue_stuck_jobs_after = "3h"\n')
    assert main(["--config", str(p), "check-config"]) == 0
    rescuer = json.loads(capsys.readouterr().out)["rescuer"]
    assert rescuer["kinds"] == {"video.transcode": {
        "rescue_stuck_jobs_after": "3h", "heartbeat_timeout": "2m", "job_timeout": "30m"}}
    assert rescuer["queues"] == {"api": {
        "rescue_stuck_jobs_after": "45m", "heartbeat_timeout": "2m", "job_timeout": "30m"}}
    monkeypatch.setenv("MAINTD_RESCUER__KINDS", json.dumps(rescuer["kinds"]))  # pasted back: the same rule
    again = load_settings(p)
    assert again.rescuer.rule(kind="video.transcode").heartbeat_timeout == timedelta(minutes=2)


@pytest.mark.parametrize("name,value", [("MAINTD_LEADER", "{bad"), ("MAINTD_TARGETS", "x"),
                                        ("MAINTD_CLEANER__QUEUES", "zz")])
def test_a_variable_that_is_not_json_exits_2_naming_it(monkeypatch, capsys, name, value):
    """A section, table or list given in one variable is JSON; pydantic-settings' error named the
    field, not the variable, and exited 1."""
    monkeypatch.setenv(name, value)
    assert main(["check-config"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"maintd: config error: {name}: not valid JSON")


def test_check_config_validates_and_prints_every_target_merged(tmp_path, capsys):
    """With [[targets]] and no --target, every target's effective config (sections merged over the
    top-level ones), password masked; --target prints that one alone, as for a single schema."""
    p = write(tmp_path, 'database_url = "postgresql://maintd:hunter2@db/app"\n[cleaner]\ncompleted_retention = "2h"\n'
                        '[[targets]]\nschema = "billing"\n[targets.cleaner]\ncompleted_retention = "5h"\n'
                        '[[targets]]\nschema = "mail"\nlayout = "partitioned"\n')
    assert main(["--config", str(p), "check-config"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert "hunter2" not in out
    assert [(t["target"], t["cleaner"]["completed_retention"], t["layout"]) for t in data["targets"]] == [
        ("billing", "5h", "plain"), ("mail", "2h", "partitioned")]
    assert main(["--config", str(p), "--target", "mail", "check-config"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["schema"] == "mail" and one["layout"] == "partitioned" and "target" not in one


def test_repr_hides_password():
    s = Settings(database_url="postgresql://maintd:hunter2@db/app")
    assert "hunter2" not in repr(s) and "hunter2" not in str(s)


def test_cli_bad_config_exits_2_naming_the_key(tmp_path):
    p = write(tmp_path, "[cleaner]\nbatch_size = 0\n")
    res = subprocess.run([sys.executable, "-m", "maintd", "--config", str(p), "check-config"],
                         capture_output=True, text=True)
    assert res.returncode == 2
    assert "cleaner.batch_size" in res.stderr
    assert "Traceback" not in res.stderr


# Option values libpq checks only once it connects (its integers, its protocol versions, its
# require_auth list): `maintd run` took each for an unreachable database and retried it for ever
# ("database unreachable, retrying ... invalid integer value"), /readyz 503, while check-config
# printed the URL as valid and exited 0.
@pytest.mark.parametrize("query,key", [
    ("keepalives_idle=abc", "keepalives_idle"),
    ("keepalives=x", "keepalives"),
    ("keepalives_interval=1.5", "keepalives_interval"),
    ("keepalives_count=99999999999", "keepalives_count"),
    ("connect_timeout=5s", "connect_timeout"),
    ("tcp_user_timeout=", "tcp_user_timeout"),
    ("ssl_min_protocol_version=TLSv9", "ssl_min_protocol_version"),
    ("max_protocol_version=3.1", "max_protocol_version"),
    ("require_auth=SCRAM-SHA-256", "require_auth"),
    ("require_auth=!password,md5", "require_auth"),
    ("keepalives_idle=0", "keepalives_idle"),  # Linux's setsockopt refuses it at every connect
    ("keepalives_count=200", "keepalives_count"),
])
def test_an_option_libpq_checks_only_at_connect_is_a_config_error(tmp_path, query, key):
    url = f"postgresql://u:S3cretPW@db.internal/app?{query}"
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, f"database_url = '{url}'\n"))
    assert f"database_url: {key} " in str(err.value) and "S3cret" not in str(err.value)
    name, value = query.split("=", 1)  # the key=value form is read alike
    kv = f"host=db.internal password=S3cretPW {name}='{value}'"
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, f"database_url = {json.dumps(kv)}\n"))
    assert f"database_url: {key} " in str(err.value) and "S3cret" not in str(err.value)


@pytest.mark.parametrize("query", [
    "keepalives_idle=%2B5", "keepalives_idle=%205%20", "keepalives=0", "connect_timeout=-3",
    "ssl_min_protocol_version=tlsv1.2", "ssl_max_protocol_version=", "max_protocol_version=latest",
    "min_protocol_version=3.0", "require_auth=none", "require_auth=!password,!md5",
    "require_auth=password,scram-sha-256", "require_auth=",
    "keepalives=00&keepalives_idle=0", "host=/var/run/postgresql&keepalives_idle=0",  # no keepalives set then
])
def test_option_values_libpq_takes_are_accepted(tmp_path, query):
    load_settings(write(tmp_path, f"database_url = 'postgresql://u:pw@db.internal/app?{query}'\n"))


def test_run_exits_2_on_an_option_value_libpq_refuses_instead_of_retrying(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MAINTD_")}
    env["MAINTD_DATABASE_URL"] = "postgresql://u:S3cretPW@127.0.0.1:1/app?keepalives_idle=abc"
    env["MAINTD_HTTP__ENABLED"] = "false"
    res = subprocess.run([sys.executable, "-m", "maintd", "run"], capture_output=True, text=True,
                         env=env, timeout=30)
    assert res.returncode == 2, res.stderr
    assert "database_url: keepalives_idle" in res.stderr and "S3cret" not in res.stderr


def test_cli_usage_errors_exit_2():
    res = subprocess.run([sys.executable, "-m", "maintd", "run-once", "vacuum"],
                         capture_output=True, text=True)
    assert res.returncode == 2
    res = subprocess.run([sys.executable, "-m", "maintd", "--nope"], capture_output=True, text=True)
    assert res.returncode == 2


def test_cli_version_and_help():
    from maintd import __version__

    res = subprocess.run([sys.executable, "-m", "maintd", "--version"], capture_output=True, text=True)
    assert res.returncode == 0 and __version__ in res.stdout
    res = subprocess.run([sys.executable, "-m", "maintd", "--help"], capture_output=True, text=True)
    assert res.returncode == 0
    for cmd in ("run", "migrate", "check-config", "run-once", "status", "demo"):
        assert cmd in res.stdout


def test_pyproject_declares_console_script():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["scripts"]["maintd"] == "maintd.cli:main"


@pytest.mark.parametrize("argv,named", [
    (["migrate", "--sql", "--from", "bogus"], "argument --from: unknown revision 'bogus' (known: base, 0001"),
    (["migrate", "--sql", "--from", "base", "--revision", "bogus"], "argument --revision: unknown revision"),
    (["migrate", "--downgrade", "nope"], "argument --downgrade: unknown revision 'nope'"),
    (["migrate", "--downgrade", "deadbeef-1"], "argument --downgrade: unknown revision 'deadbeef-1'"),
    (["demo", "--listen", "nonsense"], "argument --listen: 'nonsense': expected HOST:PORT"),
    (["demo", "--duration", "-5"], "argument --duration: -5 seconds: expected 0 or more"),
    (["run-once", "cleaner", "--wait", "-1"], "argument --wait: -1 seconds: expected 0 or more"),
    (["run-once", "cleaner", "--wait", "soon"], "argument --wait: 'soon' is not a number of seconds"),
])
def test_bad_arguments_exit_2_naming_the_argument(argv, named, capsys):
    """SPEC 8.4: exit 2 for any bad usage. These exited 1 with Alembic's or Python's words (an
    unknown revision, a listen address without a port), or were taken (a negative wait)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and named in capsys.readouterr().err


def test_migrate_from_without_sql_exits_2(capsys):
    """--from says where offline SQL starts; without --sql it was ignored ('nothing to do', 0)."""
    assert main(["migrate", "--from", "base"]) == 2
    assert "--from: only with --sql" in capsys.readouterr().err


def test_relative_and_known_revisions_are_taken():
    from maintd.cli import revision

    assert [revision(r) for r in ("head", "base", "heads", "0001", "-1", "head-1", "+2")] == [
        "head", "base", "heads", "0001", "-1", "head-1", "+2"]


def test_the_default_instance_id_fits_whatever_the_host_name(monkeypatch):
    """A host or pod name of 63 characters (a DNS label's most, RFC 1035 2.3.4) made the default
    `<hostname>-<pid>` fail its 48-character check, so every command exited 2 on that host."""
    import os
    import socket

    pid = str(os.getpid())
    pods = [f"maintd-{'x' * 44}-7d9f8c6b5d-{suffix}" for suffix in ("abcde", "fghij")]  # 63 each
    ids = []
    for pod in pods:
        monkeypatch.setattr(socket, "gethostname", lambda pod=pod: pod)
        ids.append(Settings().instance_id)
    assert all(len(i) == 48 and i.endswith(f"-{pid}") for i in ids), ids
    assert ids[0] != ids[1]  # the pods' unique ends are kept (a container's pid is often the same)
    monkeypatch.setattr(socket, "gethostname", lambda: "host with spaces\x1b")
    assert Settings().instance_id == f"host-with-spaces--{os.getpid()}"


def test_a_schema_of_47_characters_is_the_longest_and_its_channels_work(pg_dsn):
    """The limit is exact: a 47-character schema's longest channel is 63 bytes, which LISTEN and
    NOTIFY take (tests/test_config.py's cases refuse 48)."""
    import psycopg

    from maintd.db import events_channel, notify_channel, periodic_channel
    from maintd.leader import handover_channel

    schema = "s" * 47
    assert Settings(database_url="postgresql://u@h/d", schema=schema).schema == schema
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for channel in (handover_channel(schema), periodic_channel(schema), notify_channel(schema), events_channel(schema)):
            conn.execute(f'LISTEN "{channel}"')
            conn.execute("SELECT pg_notify(%s, 'x')", [channel])


@pytest.mark.parametrize("body,why", [
    (b'schema = "caf\xe9"\n', "not UTF-8"),  # a file saved as Latin-1
    (b"x = " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deeply"),
])
def test_a_config_file_toml_cannot_read_exits_2_naming_the_file(tmp_path, capsys, body, why):
    """A config file saved in Latin-1 exited 1 with Python's codec words ("'utf-8' codec can't
    decode byte 0xe9 in position 12"), naming neither the file nor the config; a deeply nested
    value exited 1 with "maximum recursion depth exceeded"."""
    p = tmp_path / "maintd.toml"
    p.write_bytes(body)
    with pytest.raises(ConfigError) as err:
        load_settings(p)
    [line] = err.value.problems
    assert line.startswith(f"config: {p}: invalid TOML: ") and why in line, line
    assert main(["--config", str(p), "check-config"]) == 2
    err_text = capsys.readouterr().err
    assert f"config error: config: {p}: invalid TOML" in err_text and "Traceback" not in err_text


@pytest.mark.parametrize("entry,problem", [
    ("args = { a = nan }", "periodic[0] (id='p').args: a is nan: PostgreSQL's jsonb has no NaN or Infinity"),
    ("args = { a = [1, -inf] }", "periodic[0] (id='p').args: a[1] is -inf (a number past a double's range, "
                                 "as 1e400, reads as infinite): PostgreSQL's jsonb"),
    ("args = { a = 1e400 }", "periodic[0] (id='p').args: a is inf (a number past a double's range, as 1e400, "
                             "reads as infinite): PostgreSQL's jsonb has no NaN or Infinity"),
    ('args = { a = { b = "x\\u0000y" } }', "periodic[0] (id='p').args: a.b holds a NUL character"),
    ('args = { "a\\u0000" = 1 }', "periodic[0] (id='p').args: key 'a\\x00' holds a NUL character"),
    ("args = { at = 1979-05-27T07:32:00Z }", "periodic[0] (id='p').args: at is a TOML date-time"),
    ("args = { d = [1979-05-27] }", "periodic[0] (id='p').args: d[0] is a TOML date"),
    ('kind = "k\\u0000"', "periodic[0] (id='p').kind: holds a NUL character"),
    ('queue = "q\\u0000"', "periodic[0] (id='p').queue: holds a NUL character"),
    ('unique_key = "u\\u0000"', "periodic[0] (id='p').unique_key: holds a NUL character"),
])
def test_a_periodic_entry_postgresql_cannot_store_is_a_config_error(tmp_path, entry, problem):
    """These passed check-config and `maintd run` started, then every slot of the entry failed
    ("invalid input syntax for type json", "unsupported Unicode escape sequence", "PostgreSQL text
    fields cannot contain NUL (0x00) bytes", "Object of type datetime is not JSON serializable"):
    jsonb holds no NaN, Infinity or \\u0000, text no NUL, and JSON no date."""
    lines = ["[[periodic]]", "id = 'p'", "schedule = '@hourly'"]
    lines += [entry] + (["kind = 'k'"] if not entry.startswith("kind") else [])
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, "\n".join(lines) + "\n"))
    assert problem in str(err.value), str(err.value)


@pytest.mark.parametrize("args", ['{"a": NaN}', '{"a": [Infinity]}', '{"a": "\\u0000"}'])
def test_periodic_add_with_args_jsonb_cannot_hold_exits_2(args, capsys, monkeypatch):
    """`maintd periodic add ... --args '{"a": NaN}'` (Python's json takes NaN) exited 1 with the
    server's "invalid input syntax for type json" after connecting (checked before connecting now:
    the URL leads nowhere)."""
    monkeypatch.setenv("MAINTD_DATABASE_URL", "postgresql://u@127.0.0.1:1/none?connect_timeout=1")
    assert main(["periodic", "add", "p", "--schedule", "@hourly", "--kind", "k", "--args", args]) == 2
    err = capsys.readouterr().err
    assert "maintd periodic: error: args: " in err and "Traceback" not in err


def test_periodic_add_with_args_nested_too_deeply_exits_2(capsys, monkeypatch):
    """It exited 1 with "maximum recursion depth exceeded while decoding a JSON array"."""
    monkeypatch.setenv("MAINTD_DATABASE_URL", "postgresql://u@127.0.0.1:1/none?connect_timeout=1")
    args = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert main(["periodic", "add", "p", "--schedule", "@hourly", "--kind", "k", "--args", args]) == 2
    assert "maintd periodic: error: args: not JSON: nested too deeply" in capsys.readouterr().err


def test_a_config_file_saved_with_a_byte_order_mark_is_read(tmp_path):
    """A config saved by a Windows editor (UTF-8 with a byte-order mark) was refused as 'invalid
    TOML: Invalid statement (at line 1, column 1)', which shows nothing wrong at that place. TOML
    1.0 asks for UTF-8; the mark is a signature, not text (Unicode 15, section 23.8)."""
    p = tmp_path / "maintd.toml"
    p.write_bytes(b'\xef\xbb\xbfschema = "acme"\n')
    assert load_settings(p).schema == "acme"


def test_an_environment_override_changes_the_top_level_and_a_targets_own_value_still_wins(tmp_path, monkeypatch):
    """Precedence, as the README's "several targets" section says: a target's own section is
    merged over the top level, and MAINTD_* overrides the top level of the file. So an
    environment override reaches every target that does not set that key itself, and a key a
    target sets in the file stays the target's (it is the more specific setting)."""
    p = write(tmp_path, """
schema = "jobs"
[cleaner]
completed_retention = "24h"
batch_size = 500
[[targets]]
schema = "tenant_a"
cleaner = { completed_retention = "1h" }
[[targets]]
schema = "tenant_b"
""")
    monkeypatch.setenv("MAINTD_CLEANER__COMPLETED_RETENTION", "2h")
    monkeypatch.setenv("MAINTD_CLEANER__BATCH_SIZE", "250")
    a, b = load_settings(p).target_settings()
    assert a.cleaner.retention("completed", "q") == timedelta(hours=1)  # the target's own
    assert b.cleaner.retention("completed", "q") == timedelta(hours=2)  # the environment's
    assert a.cleaner.batch_size == b.cleaner.batch_size == 250


def test_a_listen_port_out_of_range_says_so(tmp_path):
    """`http.listen = "127.0.0.1:70000"` said only "expected HOST:PORT", which it is: the
    operator was left to find that the port is past 65535 (found by the newcomer walk)."""
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, '[http]\nlisten = "127.0.0.1:70000"\n'))
    assert "http.listen" in str(err.value) and "port 70000 is out of range 0-65535" in str(err.value)


def test_a_config_byte_that_is_not_utf8_is_named_with_its_line_and_column(tmp_path):
    """tomllib's errors say "(at line 3, column 8)": a Latin-1 'é' on line 3 said "at offset 27",
    a count of bytes an operator cannot find in an editor."""
    p = tmp_path / "maintd.toml"
    p.write_bytes(b'schema = "a"\n\n[log]\nlevel = "caf\xe9"\n')
    with pytest.raises(ConfigError) as err:
        load_settings(p)
    assert err.value.problems == [f"config: {p}: invalid TOML: not UTF-8 (byte 0xe9 at line 4, column 13)"]


def _parsers(parser, path=()):
    """Every parser of the command line with its words (``("jobs", "list")``)."""
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if sub is not parser and (not path or name != path[-1]):
                    yield from _parsers(sub, (*path, name))


def test_every_commands_help_says_what_it_does_and_what_each_option_is():
    """`maintd jobs list --help`, `periodic add --help` (and the other actions of `jobs` and
    `periodic`) said nothing of what the action does, and showed options without a word
    (--queue, --priority, --max-attempts, the ids): every command's --help now says both."""
    import argparse

    from maintd.cli import build_parser

    missing = []
    for path, parser in _parsers(build_parser()):
        name = " ".join(("maintd", *path))
        if not parser.description:
            missing.append(f"{name}: no description")
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            if not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}: no help")
    assert missing == []


def test_the_boundaries_of_the_config_are_accepted(tmp_path):
    """The last good value of each boundary pinned in test_bad_config_names_the_key."""
    s = load_settings(write(tmp_path, "[leader]\nretry_interval = '5s'\n[health]\ninterval = '1s'\n[http]\n"
                            "listen = '127.0.0.1:65535'\nauth_token = '0123456789abcdef'\n[[periodic]]\n"
                            f"id = '{'p' * 128}'\nschedule = '@hourly'\nkind = 'k'\n"))
    assert (s.leader.retry_interval, s.health.interval, s.http.port, len(s.periodic[0].id)) == (
        timedelta(seconds=5), timedelta(seconds=1), 65535, 128)
    assert parse_duration(100 * 365 * 86400) == timedelta(days=36500)


def test_a_port_cut_from_a_password_is_not_shown(tmp_path):
    """'/' in a password ends the URL's host part: the port libpq reads ('se') is the password's
    start, so the error says 'a port', never its value."""
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, "database_url = 'postgresql://u:se/cret@h/db'\n"))
    assert err.value.problems == ["database_url: a port is not a number from 1 to 65535 (write '/', '?' or '#' in "
                                  "a password as %2F, %3F, %23)"]


@pytest.mark.parametrize("parse,text", [("seconds", "inf"), ("job_id", str(2**63))])
def test_an_argument_past_its_range_is_a_usage_error(parse, text):
    """--wait inf and a job id past a bigint: argparse's usage error (exit 2), not a wait for
    ever or the server's 'out of range'."""
    import argparse

    from maintd import cli

    with pytest.raises(argparse.ArgumentTypeError):
        getattr(cli, parse)(text)
