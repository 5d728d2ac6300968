"""Configuration: a TOML file plus ``MAINTD_...`` environment overrides (``__`` for nesting).

Everything is validated once, at the edge. Errors name the key (``cleaner.batch_size``) and the
CLI turns them into exit code 2. The daemon's own sections (``[leader]``, ``[http]``, ...) are
here; each service's section is defined beside the service (``maintd/services/``) on the blocks
of :mod:`maintd.sections`, and :class:`Settings` assembles them.
"""

from __future__ import annotations

import getpass
import ipaddress
import json
import os
import re
import socket
import sys
import tomllib
import warnings
from contextvars import ContextVar
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, get_origin

from pydantic import BaseModel, Field, PrivateAttr, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from .durations import format_duration
from .db import libpq_dsn
from .identifiers import validate_identifier, validate_schema
from .logs import redact_dsn
from .queries import FINAL_STATES
from .sections import PositiveDuration, Section, ServerTimeout
from .services.cleaner import CleanerConfig, QueueRetention
from .services.partitioner import PartitionsConfig
from .services.periodic_config import CrontabJob, PeriodicJob
from .services.reindexer import ReindexerConfig
from .services.rescuer import RescuerConfig
from .services.scheduler import SchedulerConfig


class ConfigError(Exception):
    """Bad configuration. ``str(err)`` is one line per problem, each naming its key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


LEADER_FLOOR = timedelta(milliseconds=100)
# A key a model check's message begins with (``cleaner.batch_size: ...``), a periodic entry's id
# label included (``targets[0].periodic[1] (id='y').schedule: ...``).
_ID_LABEL = r""" \(id=(?:'[^']*'|"[^"]*")\)"""
KEY_RE = re.compile(rf"^([a-z_][a-z0-9_.\[\]]*(?:{_ID_LABEL}[a-z0-9_.\[\]]*)*): ")

# The directory of the config file being loaded (see load_settings): a relative ``crontab`` path,
# from the file or the environment, is read from there.
_CONFIG_DIR: ContextVar[Path | None] = ContextVar("maintd_config_dir", default=None)


class LeaderConfig(Section):
    lease: ServerTimeout = timedelta(seconds=10)
    renew_interval: PositiveDuration = timedelta(seconds=2)
    retry_interval: PositiveDuration = timedelta(seconds=1)

    @model_validator(mode="after")
    def _check(self) -> "LeaderConfig":
        if self.lease < timedelta(seconds=1):  # first: the others are judged against the lease
            raise ValueError("lease: must be at least 1s")
        if self.renew_interval * 3 > self.lease:  # a late renewal must not end the lease
            raise ValueError("renew_interval: must be at most a third of leader.lease")
        if self.retry_interval * 2 > self.lease:  # a follower's idle lock session outlives its waits
            raise ValueError("retry_interval: must be at most half of leader.lease")
        for key in ("renew_interval", "retry_interval"):  # '1ms' for '1m': a statement per millisecond
            if getattr(self, key) < LEADER_FLOOR:
                raise ValueError(f"{key}: must be at least {format_duration(LEADER_FLOOR)} (each is a statement "
                                 "on the lock session; a typo such as '1ms' for '1m' would send one a millisecond)")
        return self


INSTANCE_ID_MAX = 48  # `maintd:<id>:work` stays within PostgreSQL's 63-byte application_name


def default_instance_id() -> str:
    """``<hostname>-<pid>``, the host name cut to fit from its start (a long pod or host name
    must not make every command fail, and a pod name's unique part is its end, while a
    container's pid is often 1), and any character an id may not hold replaced with '-'."""
    pid = f"-{os.getpid()}"
    host = re.sub(r"[^A-Za-z0-9_.:-]", "-", socket.gethostname())[-(INSTANCE_ID_MAX - len(pid)):]
    return (host.lstrip("_.:-") or "maintd") + pid


def _address(text: str, kind: type) -> None:
    try:
        kind(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an {kind.__name__[:4]} address") from None


class HttpConfig(Section):
    enabled: bool = True
    listen: str = "127.0.0.1:9464"
    # Required by the dashboard and /status when set (Bearer header or ?token=); never printed.
    auth_token: SecretStr | None = None

    @field_validator("auth_token")
    @classmethod
    def _token(cls, v: SecretStr | None) -> SecretStr | None:
        raw = None if v is None else v.get_secret_value()
        if raw is not None and (len(raw) < 16 or not re.fullmatch(r"[\x21-\x7e]+", raw)):
            raise ValueError("use at least 16 printable ASCII characters without spaces, "
                             "e.g. the output of `openssl rand -hex 32`")
        return v

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if sep and host and port.isdigit() and int(port) > 65535:
            raise ValueError(f"port {port} is out of range 0-65535")
        if not sep or not port.isdigit() or not host:
            raise ValueError("expected HOST:PORT, e.g. 127.0.0.1:9464")
        if ":" in host or "[" in host or "]" in host:  # IPv6: only in brackets, as in a URL
            if not (host.startswith("[") and host.endswith("]")):
                raise ValueError("an IPv6 address goes in brackets, e.g. [::1]:9464")
            _address(host[1:-1], ipaddress.IPv6Address)
        elif re.fullmatch(r"[0-9.]+", host):
            _address(host, ipaddress.IPv4Address)
        return v

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])


class LogConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"

    @field_validator("level", "format", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v


class MetricsConfig(Section):
    # Per-queue series: the largest queues keep their name, the rest are summed as queue="_other".
    max_queues: int = Field(default=100, ge=1, le=100_000)
    # Per-periodic-entry series (schedules are rows: thousands are possible): the configured entries,
    # then the first ids seen, keep their name; the rest are counted as periodic_id="_other".
    max_periodic_ids: int = Field(default=100, ge=1, le=100_000)


class HealthConfig(Section):
    """``[health]`` (SPEC 8.2): the table-health read, once per database per ``interval``."""

    enabled: bool = True
    interval: PositiveDuration = timedelta(seconds=15)
    # A holder of the xmin horizon older than this gets one warning line (once per holder).
    xmin_warn_after: PositiveDuration = timedelta(minutes=5)
    # Show a holder's query text in /status, `maintd status` and the dashboard (it may carry
    # personal data; off by default).
    show_query: bool = False

    @field_validator("interval")
    @classmethod
    def _interval(cls, v: timedelta) -> timedelta:
        if v < timedelta(seconds=1):
            raise ValueError("must be at least 1s")
        return v


Layout = Literal["plain", "partitioned"]


# The sections a [[targets]] entry may override (merged over the top-level ones, key by key).
TARGET_SECTIONS = ("cleaner", "rescuer", "scheduler", "reindexer", "partitions")

# BaseModel has a deprecated ``schema()`` classmethod; the SPEC key is called ``schema`` anyway.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message='Field name "schema"')

    class TargetConfig(Section):
        """One ``[[targets]]`` entry (SPEC 7.9): a schema maintained by this daemon, with its own
        leadership, services and metrics. Service sections given here are merged over the
        top-level ones; ``periodic`` replaces the top-level list."""

        name: str | None = None  # defaults to the schema
        schema: str
        database_url: SecretStr | None = None  # defaults to the top-level one
        layout: Layout | None = None  # defaults to the top-level one
        cleaner: dict[str, Any] | None = None
        rescuer: dict[str, Any] | None = None
        scheduler: dict[str, Any] | None = None
        reindexer: dict[str, Any] | None = None
        partitions: dict[str, Any] | None = None
        periodic: list[dict[str, Any]] | None = None

        @field_validator("schema")
        @classmethod
        def _schema(cls, v: str) -> str:
            return validate_schema(v)

        @field_validator("database_url")
        @classmethod
        def _dsn(cls, v: SecretStr | None) -> SecretStr | None:
            return None if v is None else check_dsn(v)

        @field_validator("name")
        @classmethod
        def _name(cls, v: str | None) -> str | None:
            return None if v is None else validate_identifier(v, "target name")

        @property
        def target_name(self) -> str:
            return self.name or self.schema


with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message='Field name "schema"')

    class Settings(BaseSettings):
        """The effective configuration of one maintd process."""

        model_config = SettingsConfigDict(
            env_prefix="MAINTD_",
            env_nested_delimiter="__",
            extra="forbid",
            validate_assignment=True,
            case_sensitive=False,
        )

        database_url: SecretStr = SecretStr("postgresql://localhost/postgres")
        schema: str = "maintd"
        instance_id: str = Field(default_factory=lambda: default_instance_id(), max_length=INSTANCE_ID_MAX)
        statement_timeout: ServerTimeout = timedelta(seconds=30)
        # "plain" (one jobs table) or "partitioned" (SPEC 8.1): what `maintd migrate` builds for
        # a new schema, and whether the leader keeps the partitions (premade, strays, retention).
        layout: Layout = "plain"
        partitions: PartitionsConfig = Field(default_factory=PartitionsConfig)
        leader: LeaderConfig = Field(default_factory=LeaderConfig)
        http: HttpConfig = Field(default_factory=HttpConfig)
        log: LogConfig = Field(default_factory=LogConfig)
        metrics: MetricsConfig = Field(default_factory=MetricsConfig)
        health: HealthConfig = Field(default_factory=HealthConfig)
        cleaner: CleanerConfig = Field(default_factory=CleanerConfig)
        rescuer: RescuerConfig = Field(default_factory=RescuerConfig)
        scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
        reindexer: ReindexerConfig = Field(default_factory=ReindexerConfig)
        periodic: list[PeriodicJob] = Field(default_factory=list)
        # A graphile-worker-style crontab file (SPEC 7.8), relative to the config file.
        crontab: str | None = None
        # Several schemas (or databases) maintained by this process (SPEC 7.9); replaces `schema`.
        targets: list[TargetConfig] = Field(default_factory=list)
        _crontab_jobs: list[CrontabJob] = PrivateAttr(default_factory=list)
        _target_name: str | None = PrivateAttr(default=None)
        _targets: list["Settings"] = PrivateAttr(default_factory=list)

        @field_validator("schema")
        @classmethod
        def _schema(cls, v: str) -> str:
            return validate_schema(v)

        @field_validator("crontab")
        @classmethod
        def _crontab_path(cls, v: str | None) -> str | None:
            if v is not None and not v.strip():  # not the config's directory, nor "no crontab"
                raise ValueError("an empty path: leave the key out (and MAINTD_CRONTAB unset) for no crontab file")
            # Relative to the config file, whether the file or MAINTD_CRONTAB gives it.
            base = _CONFIG_DIR.get()
            return v if v is None or base is None else str(base / Path(v).expanduser())

        @field_validator("instance_id")
        @classmethod
        def _instance(cls, v: str) -> str:
            if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$", v):
                raise ValueError("instance_id may hold letters, digits, '_', '.', ':' and '-' only")
            return v

        @field_validator("database_url")
        @classmethod
        def _dsn(cls, v: SecretStr) -> SecretStr:
            return check_dsn(v)

        @model_validator(mode="after")
        def _periodic_ids(self) -> "Settings":
            if (twice := _given_twice(self.periodic)) is not None:
                raise ValueError(f"periodic: id {twice!r} is defined twice")
            if self.crontab:
                self._crontab_jobs = _load_crontab(self.crontab, {job.id for job in self.periodic})
            return self

        @model_validator(mode="after")
        def _check_targets(self) -> "Settings":
            self._targets = _target_settings(self) if self.targets else []
            return self

        @property
        def target_name(self) -> str:
            """This target's name (the ``target`` metric label): its schema unless named."""
            return self._target_name or self.schema

        def target_settings(self) -> list["Settings"]:
            """The settings of every target: one per ``[[targets]]`` entry (its schema, database
            and merged sections), or this one alone without ``[[targets]]``."""
            return list(self._targets) if self.targets else [self]

        @property
        def periodic_entries(self) -> list[PeriodicJob]:
            """The ``[[periodic]]`` entries, then the crontab's lines."""
            return [*self.periodic, *self._crontab_jobs]

        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            # Environment beats the file (passed in as init values); no .env or secrets dir magic.
            return env_settings, init_settings

        def redacted(self) -> dict[str, Any]:
            """The effective configuration as plain data, with the DSN password masked."""
            data = self.model_dump(mode="json")
            data["database_url"] = redact_dsn(self.database_url.get_secret_value())
            for queue in self.cleaner.queues:  # what applies: a state not named falls back
                data["cleaner"]["queues"][queue] = QueueRetention(**{
                    f"{state}_retention": self.cleaner.retention(state, queue)
                    for state in FINAL_STATES}).model_dump(mode="json")
            for table in ("queues", "kinds"):  # a key a section leaves out is [rescuer]'s
                for name in getattr(self.rescuer, table):
                    rule = self.rescuer.rule(**{table[:-1]: name})
                    data["rescuer"][table][name] = rule.model_dump(mode="json")
            for entry, t in zip(data.get("targets", []), self.targets):
                if t.database_url is not None:
                    entry["database_url"] = redact_dsn(t.database_url.get_secret_value())
            if self.crontab:
                data["crontab_entries"] = [{**j.model_dump(mode="json"), "line": j.line,
                                            "job_key_mode": j.job_key_mode} for j in self._crontab_jobs]
            return data


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _target_settings(top: "Settings") -> list["Settings"]:
    """One Settings per [[targets]] entry. Every problem of every entry (a duplicate name or
    schema, two schemas of one database whose leader locks collide, a bad override or periodic
    entry) is found: a ValueError of one line each, naming ``targets[i]`` and the key."""
    out: list[Settings] = []
    problems: list[str] = []
    seen: dict[str, dict] = {"schema": {}, "name": {}, "lock": {}}
    for i, t in enumerate(top.targets):
        dsn = t.database_url or top.database_url
        problems += _target_clashes(top, i, database_of(dsn.get_secret_value()), seen)
        update: dict[str, Any] = {"schema": t.schema, "database_url": dsn, "targets": [],
                                  "layout": t.layout or top.layout}
        found = [f"targets[{i}].{p} (target {t.target_name})" for p in _target_overrides(top, t, update)]
        if t.periodic is not None and not found and (clash := _id_clash(update["periodic"], top._crontab_jobs)):
            found.append(f"targets[{i}].periodic: {clash} (target {t.target_name})")
        problems += found
        if not problems:
            settings = top.model_copy(update=update)
            settings._target_name = t.target_name
            settings._targets = []
            out.append(settings)
    if problems:
        raise ValueError("\n".join(problems))
    return out


def _target_clashes(top: "Settings", i: int, database: tuple, seen: dict[str, dict]) -> list[str]:
    """``targets[i]``'s name or schema taken by an earlier entry, or its leader lock key."""
    from .db import advisory_key

    t, problems = top.targets[i], []
    for what, key in (("schema", (database, t.schema)), ("name", t.target_name)):
        if (other := seen[what].setdefault(key, i)) != i and not (what == "name" and problems):  # (the schema's)
            shown = t.target_name if what == "name" else t.schema
            problems.append(f"targets[{i}].{what}: {shown!r} is also targets[{other}]'s {what}")
    lock = (database, advisory_key(t.schema))
    if (other := seen["lock"].setdefault(lock, i)) != i and top.targets[other].schema != t.schema:
        problems.append(f"targets[{i}].schema: {t.schema!r} has the leader lock key of targets[{other}]'s "
                        f"schema {top.targets[other].schema!r} (a hash of the name): rename one of them")
    return problems


def _target_overrides(top: "Settings", t: Any, update: dict[str, Any]) -> list[str]:
    """Validate an entry's sections and periodic list into ``update``; their problems, each
    ``key: message`` below the entry."""
    problems: list[str] = []
    for section in TARGET_SECTIONS:
        override = getattr(t, section)
        if override is not None:
            base = getattr(top, section)
            try:
                update[section] = type(base).model_validate(_merge(base.model_dump(exclude_unset=True), override))
            except ValidationError as exc:
                problems += _errors(section, exc)
    if t.periodic is not None:
        update["periodic"] = []
        for j, entry in enumerate(t.periodic):  # the entry at fault numbered and named, as at the top
            try:
                update["periodic"].append(PeriodicJob.model_validate(entry))
            except ValidationError as exc:
                problems += _errors(f"periodic[{j}]" + (f" (id={entry['id']!r})" if isinstance(entry.get("id"), str)
                                                        else ""), exc)
    return problems


def _id_clash(periodic: list[PeriodicJob], crontab: list[CrontabJob]) -> str | None:
    """A target's own ``periodic`` list: an id twice, or also a crontab line's (the top-level
    list is checked by ``Settings._periodic_ids``): one of them would never be enqueued."""
    if (twice := _given_twice(periodic)) is not None:
        return f"id {twice!r} is defined twice"
    ids = {job.id for job in periodic}
    taken = next((j for j in crontab if j.id in ids), None)
    return None if taken is None else f"id {taken.id!r} is also a crontab line's ({taken.line})"


def _given_twice(periodic: list[PeriodicJob]) -> str | None:
    """An id that two entries share (one of them would never be enqueued), if any."""
    seen: set[str] = set()
    for job in periodic:
        if job.id in seen:
            return job.id
        seen.add(job.id)
    return None


def database_of(dsn: str) -> tuple:
    """The server(s) and database a DSN reaches, spelled one way: libpq's defaults (and PG*
    variables) filled in, so ``host:5432/db`` and ``host/db`` are one database. Never one
    database for two DSNs that may reach two."""
    import psycopg.conninfo

    params = psycopg.conninfo.conninfo_to_dict(libpq_dsn(dsn))
    env = os.environ
    hosts = str(params.get("host") or params.get("hostaddr") or env.get("PGHOST") or "/var/run/postgresql").split(",")
    ports = str(params.get("port") or env.get("PGPORT") or "5432").split(",")
    ports = [p or "5432" for p in (ports * len(hosts) if len(ports) == 1 else ports)]
    user = params.get("user") or env.get("PGUSER") or getpass.getuser()
    # A service file (pg_service.conf) or a hostaddr may lead elsewhere: only what is spelled alike
    # is taken as one database.
    unknown = (params.get("service") or env.get("PGSERVICE"), params.get("hostaddr"))
    return tuple(zip(hosts, ports)), params.get("dbname") or env.get("PGDATABASE") or user, unknown


def _errors(section: str, exc: ValidationError) -> list[str]:
    """Every error of a section validated on its own, as ``section.key: message``."""
    out = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in (section, *err.get("loc", ())))
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if KEY_RE.match(msg):  # a model check naming the precise key
            (loc, _), msg = _keyed(loc, [], msg)
        out.append(f"{loc}: {'unknown key' if err.get('type') == 'extra_forbidden' else msg}")
    return out


def _load_crontab(path: str, taken: set[str]) -> list[CrontabJob]:
    """The crontab's lines as periodic entries; ids are shared with ``[[periodic]]``. Every bad
    line is reported, whether its syntax or its entry (a NUL in its payload) is at fault."""
    from .crontab import load_crontab

    jobs: list[CrontabJob] = []

    def to_job(e: Any) -> None:
        if e.id in taken:
            raise ValueError(f"id {e.id!r} is also a [[periodic]] entry's")
        try:
            jobs.append(CrontabJob.from_entry(e))
        except ValidationError as exc:
            err = exc.errors()[0]
            field = CRONTAB_TERMS.get(str((*err.get("loc", ()), "")[0]), "")
            msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
            raise ValueError(f"{field + ': ' if field else ''}{msg}") from None

    try:
        load_crontab(path, to_job)
    except ValueError as exc:
        raise ValueError(f"crontab: {exc}") from None
    return jobs


# A periodic entry's fields in a crontab line's words, for its errors.
CRONTAB_TERMS = {"args": "payload", "unique_key": "jobKey", "kind": "task", "queue": "queue", "id": "id"}


# What libpq's parse errors mean, in words of ours: its messages quote the text at fault, which
# may be (part of) the password.
DSN_PROBLEMS = (  # the first whose key is in libpq's message
    ("forbidden value %00", "a %00 in the URL"),
    ("unexpected spaces", "a space in the URL: write it as %20"),
    ("invalid URI query parameter", "an unknown connection option in the URL's query"),
    ("query parameter", "a query parameter that is not key=value: write '&' in a password as %26"),
    ("percent-encoded", "a '%' not followed by two hex digits: write '%' in a password as %25"),
    ('missing "="', "a word that is not key=value: quote a value that holds a space, as in password='a b'"),
    ("unterminated quoted string", "a quoted value without its closing quote"),
    ("invalid connection option", "an unknown connection option"),
)


# Connection options whose values libpq checks only when it connects (the daemon would retry a
# bad one for ever, as if the server were down): PostgreSQL's libpq-connect.html.
CHOICES = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "target_session_attrs": ("any", "read-write", "read-only", "primary", "standby", "prefer-standby"),
    "load_balance_hosts": ("disable", "random"),
    "sslcertmode": ("disable", "allow", "require"),
    "sslnegotiation": ("postgres", "direct"),
}


# More values libpq checks only when it connects: its integers (strtol's syntax, a C int) with,
# for the keepalives, the bounds of Linux's setsockopt; the protocol versions it names.
INTEGERS = {"connect_timeout": None, "keepalives": None, "tcp_user_timeout": None,
            "keepalives_idle": 32767, "keepalives_interval": 32767, "keepalives_count": 127}
VERSIONS = {"ssl_min_protocol_version": ("", "tlsv1", "tlsv1.1", "tlsv1.2", "tlsv1.3"),
            "ssl_max_protocol_version": ("", "tlsv1", "tlsv1.1", "tlsv1.2", "tlsv1.3"),
            "min_protocol_version": ("", "3.0", "3.2", "latest"),
            "max_protocol_version": ("", "3.0", "3.2", "latest")}
AUTH_METHODS = ("password", "md5", "gss", "sspi", "scram-sha-256", "oauth", "none")


def connect_option_problem(params: dict[str, Any]) -> str | None:
    """What libpq would refuse at every connect among ``params`` (the daemon would retry it for
    ever, as if the server were down), naming the option, never quoting its value."""
    hosts = str(params.get("host") or os.environ.get("PGHOST") or "").split(",")
    tcp = bool(params.get("hostaddr")) or any(h and not h.startswith(("/", "@")) for h in hosts)
    keepalives_on = tcp and not re.fullmatch(r"\s*[+-]?0+\s*", str(params.get("keepalives", "1")))
    for key, most in INTEGERS.items():
        if key not in params:
            continue
        text = str(params[key])
        if not re.fullmatch(r"\s*[+-]?\d+\s*", text) or not -2**31 <= int(text) < 2**31:
            return f"{key} must be a whole number"
        if most and keepalives_on and sys.platform == "linux" and not 1 <= int(text) <= most:  # TCP only
            return f"{key} must be from 1 to {most}"
    for key, allowed in VERSIONS.items():
        if key in params and str(params[key]).lower() not in allowed:
            return f"{key} must be one of {', '.join(a for a in allowed if a)}"
    methods = str(params["require_auth"]).split(",") if params.get("require_auth") else []
    if any(m.lstrip("!") not in AUTH_METHODS or m.count("!") > 1 for m in methods) \
            or len({m.startswith("!") for m in methods}) > 1 or len(set(methods)) < len(methods):
        return (f"require_auth must be a list of {', '.join(AUTH_METHODS)}, each once, "
                "all of them or none of them negated with '!'")
    return None


def check_dsn(v: SecretStr) -> SecretStr:
    """A database_url libpq can parse (``postgresql://`` URL or ``key=value`` string) with numeric
    ports and hosts without '@'. The problem never quotes the URL or libpq's message (both may
    hold the password, or part of it)."""
    import psycopg.conninfo

    raw = v.get_secret_value()
    if not raw.strip():
        raise ValueError("database_url is empty")
    if "://" in raw and not re.match(r"^postgres(ql)?(\+psycopg2?)?://", raw):
        raise ValueError("must be a postgresql:// URL or a libpq key=value string")
    try:
        params = psycopg.conninfo.conninfo_to_dict(libpq_dsn(raw))
    except psycopg.ProgrammingError as exc:
        reason = next((why for key, why in DSN_PROBLEMS if key in str(exc)), "libpq cannot parse it")
        raise ValueError(f"not a postgresql:// URL or libpq key=value string ({reason})") from None
    for key, allowed in CHOICES.items():  # libpq checks these only when it connects
        if key in params and str(params[key]) not in allowed:
            raise ValueError(f"{key} must be one of {', '.join(allowed)}")
    problem = connect_option_problem(params)
    if problem:
        raise ValueError(problem)
    if any("@" in host for host in str(params.get("host") or "").split(",")):
        raise ValueError("a host name with '@': write '@' in a user name or password as %40")
    secret = "@" in raw or "password" in raw.lower()
    for port in str(params.get("port") or "").split(","):
        if port and not (port.isdigit() and 1 <= int(port) <= 65535):
            shown = "a port" if secret else f"port {port!r}"  # from a password cut at a '/'?
            raise ValueError(f"{shown} is not a number from 1 to 65535"
                             + (" (write '/', '?' or '#' in a password as %2F, %3F, %23)" if secret else ""))
    return v


def periodic_counts(settings: "Settings") -> dict[str, int]:
    """The periodic entries a config defines, over every target, for the start and reload log
    lines: ``periodic`` (all), ``periodic_config`` ([[periodic]]) and ``crontab`` (its lines).
    Rows of periodic_jobs are not config: the leader reads them as they change."""
    targets = settings.target_settings()
    crontab = sum(sum(1 for e in t.periodic_entries if e.cron_args) for t in targets)
    total = sum(len(t.periodic_entries) for t in targets)
    return {"periodic": total, "periodic_config": total - crontab, "crontab": crontab}


def _format_errors(exc: ValidationError, data: dict[str, Any], environ: Any) -> list[str]:
    problems = []
    given = _given_periodic(data, environ)
    for err in exc.errors():
        loc = list(err.get("loc", ()))
        parts: list[str] = []
        for i, item in enumerate(loc):
            if isinstance(item, int):
                label = f"[{item}]"
                if loc[:i] == ["periodic"]:
                    try:
                        label += f" (id={given[item]['id']!r})"
                    except (KeyError, IndexError, TypeError):
                        pass
                parts.append(label)
            else:
                parts.append(("." if parts else "") + str(item))
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = "unknown key"
        base = where = ("".join(parts) or "config", loc)
        for line in msg.splitlines():  # one problem per line, under its own key or the line's before
            if line.strip():
                where, line = _keyed(*base, line) if KEY_RE.match(line) else (where, line)
                source = _env_source(where[1][:-1] if err.get("type") == "missing" else where[1], environ)
                problems.append(f"{where[0]}: {line}" + (f" (from {source})" if source else ""))
    return problems


def _given_periodic(data: dict[str, Any], environ: Any) -> Any:
    """The ``periodic`` list as given (to label its entries' errors by id): the file's, else the
    JSON of MAINTD_PERIODIC, else None."""
    if "periodic" in data:
        return data["periodic"]
    var = next((k for k in environ if k.upper() == "MAINTD_PERIODIC"), None)
    try:
        return None if var is None else json.loads(environ[var])
    except (ValueError, RecursionError):
        return None


def _keyed(key: str, loc: list[Any], msg: str) -> tuple[tuple[str, list[Any]], str]:
    """A message that begins with a key (a model check's): that key, below ``key`` (and its path
    below ``loc``), and the rest of the message."""
    sub = KEY_RE.match(msg)
    named = re.sub(_ID_LABEL, "", sub.group(1))
    path = loc + [int(n) if n.isdigit() else w for w, n in re.findall(r"([^.\[\]]+)|\[(\d+)\]", named)]
    return (sub.group(1) if key == "config" else f"{key}.{sub.group(1)}", path), msg[sub.end():]


def _env_source(path: list[Any], environ: Any) -> str | None:
    """The variable that set the value at ``path`` (``["cleaner", "foo"]``), if one did: the file
    does not have it, and the error names it. ``MAINTD_CLEANER__FOO`` itself, or a variable of a
    table or list (``MAINTD_LEADER``, ``MAINTD_PERIODIC``) whose JSON holds it."""
    names = {k.upper(): k for k in environ if k.upper().startswith("MAINTD_")}
    for n in range(len(path), 0, -1):
        head = path[:n]
        if any(not isinstance(part, str) for part in head):  # a variable indexes no list
            continue
        var = names.get("MAINTD_" + "__".join(head).upper())
        if var is None:
            continue
        if n == len(path):
            return var
        try:
            value = json.loads(environ[var])
        except (ValueError, RecursionError):
            return None
        for part in path[n:]:
            if isinstance(value, dict) and isinstance(part, str):
                found = next((k for k in value if k.lower() == part.lower()), None)
                if found is None:
                    return None
                value = value[found]
            elif isinstance(value, list) and isinstance(part, int) and part < len(value):
                value = value[part]
            else:
                return None
        return var
    return None


def load_settings(path: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
    """Load the TOML file (or ``MAINTD_CONFIG``), apply environment overrides, validate.

    Raises :class:`ConfigError` naming every bad key.
    """
    environ = os.environ
    if path is None:
        path = environ.get("MAINTD_CONFIG") or None
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            raw = p.read_bytes()
            data = tomllib.loads(raw.removeprefix(b"\xef\xbb\xbf").decode())  # a byte-order mark is no text
        except FileNotFoundError:
            raise ConfigError([f"config: file {str(p)!r} not found"]) from None
        except IsADirectoryError:
            raise ConfigError([f"config: {str(p)!r} is a directory"]) from None
        except PermissionError:
            raise ConfigError([f"config: no permission to read {str(p)!r}"]) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([f"config: {p}: invalid TOML: {exc}"]) from None
        except UnicodeDecodeError as exc:  # TOML is UTF-8: a file saved as Latin-1, say
            from .crontab import utf8_place

            line, column = utf8_place(exc.object, exc.start)
            raise ConfigError([f"config: {p}: invalid TOML: not UTF-8 (byte 0x{exc.object[exc.start]:02x} "
                               f"at line {line}, column {column})"]) from None
        except RecursionError:  # tomllib parses nested arrays and tables recursively
            raise ConfigError([f"config: {p}: invalid TOML: values nested too deeply"]) from None
    data.update(overrides)
    unknown_env = sorted(
        k for k in environ
        if k.upper().startswith("MAINTD_") and k.upper() not in _KNOWN_ENV and not _service_link(k, environ)
        and _top_key(k) not in _TOP_KEYS
    )
    problems = [f"{k}: unknown environment setting" for k in unknown_env] + _names_read_lower(environ)
    problems += [f"{k}: {_top_key(k)} is one value, not a table of keys: set MAINTD_{_top_key(k).upper()}"
                 for k in sorted(environ) if "__" in k and k.upper().startswith("MAINTD_") and _top_key(k) in _ONE_VALUE_KEYS]
    # MAINTD_TARGETS__0__SCHEMA reads as a table keyed '0' ('targets: Input should be a valid list')
    by_index = sorted(k for k in environ if re.fullmatch(r"MAINTD_(TARGETS|PERIODIC)__\d+(__.*)?", k.upper()))
    problems += [f"{k}: a list is not set item by item: give it whole, as JSON, in {k.upper().split('__')[0]} "
                 """(as in MAINTD_TARGETS='[{"schema": "a"}]')""" for k in by_index]
    if by_index:
        raise ConfigError(problems)
    # The settings match top-level keys in any case (for the environment's sake): in the file,
    # 'Schema' would stand beside 'schema' and silently win over it. Keys are lower case there.
    problems += [f"{k}: unknown key (keys are lower case: {k.lower()})" for k in data
                 if k not in _TOP_KEYS and k.lower() in _TOP_KEYS]
    token = _CONFIG_DIR.set(None if path is None else Path(path).parent)
    try:
        settings = Settings(**data)
    except ValidationError as exc:
        problems += _format_errors(exc, data, environ)
    except SettingsError as exc:  # a MAINTD_<SECTION>[__KEY] variable that is not JSON
        problems.append(_env_json_problem(str(exc), environ))
    finally:
        _CONFIG_DIR.reset(token)
    if problems:
        raise ConfigError(problems)
    return settings


# MAINTD_CLEANER__QUEUES__<NAME>[__<KEY>]: the per-queue (or per-kind) tables a variable may reach.
_NAMED_TABLE_ENV = re.compile(r"(MAINTD_(?:CLEANER__QUEUES|RESCUER__QUEUES|RESCUER__KINDS))__(.+?)(?:__|$)", re.I)


def _names_read_lower(environ: Any) -> list[str]:
    """Variables naming a queue or kind in mixed case: a variable's name is read in lower case,
    so ``..._QUEUES__Billing__...`` would set queue 'billing' and leave 'Billing' as it was (an
    upper-case name is the variables' convention for a lower-case queue, as in ``..._VIDEO__...``)."""
    problems = []
    for k in sorted(environ):
        found = _NAMED_TABLE_ENV.match(k)
        name = found.group(2) if found else ""
        if name != name.lower() and name != name.upper():
            problems.append(f"{k}: names are case-sensitive and a variable's name is read in lower case "
                            f"({name.lower()!r}): give the table whole, as JSON, in {found.group(1).upper()}="
                            f"'{{\"{name}\": {{...}}}}'")
    return problems


def _env_json_problem(error: str, environ: Any) -> str:
    """pydantic-settings' error names the field, not the variable: name the variables."""
    found = re.search(r'field "(\w+)"', error)
    prefix = f"MAINTD_{found.group(1).upper() if found else ''}"
    names = sorted(k for k in environ if k.upper() == prefix or k.upper().startswith(prefix + "__")) or [prefix]
    return (f"{' or '.join(names)}: not valid JSON (a section, table or list given in one variable is "
            "JSON, as in MAINTD_LEADER='{\"lease\": \"10s\"}'; one key is MAINTD_LEADER__LEASE=10s)")


_TOP_KEYS = frozenset(Settings.model_fields)  # what a MAINTD_<KEY>[__...] variable may name


def _top_key(name: str) -> str:
    """The setting a ``MAINTD_<KEY>[__...]`` variable names: ``schema`` for ``MAINTD_SCHEMA__X``."""
    return name.upper().split("__")[0][len("MAINTD_"):].lower()


# MAINTD_SCHEMA__X names a key of a value that has none: the environment source ignored it
_ONE_VALUE_KEYS = frozenset(k for k, f in Settings.model_fields.items()
                            if not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel))
                            and get_origin(f.annotation) is not list)
# Variables of the maintd environment that are not settings.
_KNOWN_ENV = {"MAINTD_CONFIG"}
# Kubernetes' service links: for a Service named maintd (or maintd-<x>), every pod of the
# namespace gets MAINTD_[<X>_]SERVICE_HOST, ..._SERVICE_PORT[_<NAME>], ..._PORT[_<N>_TCP[_ADDR...]].
_SERVICE_LINK_RE = re.compile(r"SERVICE_HOST|SERVICE_PORT(?:_\w+)?|PORT(?:_\d+_(?:TCP|UDP|SCTP)(?:_(?:PROTO|PORT|ADDR))?)?")


def _service_link(name: str, environ: Any) -> bool:
    """A variable of a Kubernetes service link: its group's ``..._SERVICE_HOST`` is set too."""
    prefixes = {k.upper().removesuffix("SERVICE_HOST") for k in environ if k.upper().endswith("_SERVICE_HOST")}
    return any(name.upper().startswith(p) and _SERVICE_LINK_RE.fullmatch(name.upper()[len(p):])
               for p in prefixes if p.startswith("MAINTD_"))
