"""The ``maintd`` command line. Exit codes: 0 done, 1 runtime failure, 2 bad configuration or usage,
130 interrupted (Ctrl-C)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from datetime import timezone
from typing import TYPE_CHECKING, Callable, Sequence

from . import __version__
from .config import ConfigError, Settings, load_settings
from .services import SERVICES

if TYPE_CHECKING:
    from .migrate import Layout

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # as a shell reports SIGINT: `maintd migrate && deploy` must not go on

DESCRIPTION = """\
maintd keeps a Postgres jobs table healthy. Run two or three replicas: one wins an advisory-lock
leadership and runs the maintenance services (cleaner, rescuer, scheduler, periodic enqueuer,
reindexer, and the partitioner of the partitioned layout); the others wait to take over within
seconds.

Configuration comes from a TOML file (--config or MAINTD_CONFIG) and MAINTD_* environment
variables (MAINTD_CLEANER__ENABLED=false). See config.example.toml for every key.
"""

EPILOG = """\
examples:
  maintd demo                                 see it work on a throwaway PostgreSQL
  maintd --config /etc/maintd/maintd.toml migrate
  maintd --config /etc/maintd/maintd.toml     run the daemon
  maintd --config maintd.toml run-once cleaner --dry-run
  maintd --config maintd.toml status

exit codes: 0 done, 1 runtime failure, 2 bad configuration or usage (a malformed database_url,
  an unknown option, a job id out of range, ...), 130 interrupted by Ctrl-C (SIGINT) before done

an unreachable database (refused, no route, unknown host, no answer within connect_timeout 5 s,
3 s for the reads of status, jobs list|show and periodic list):
  maintd run      waits for it: retries with backoff (0.2 s doubling to 5 s) while /readyz answers
                  503, and exits 1 only on what waiting cannot fix (a wrong password, a missing
                  database or schema) when no target starts (with [[targets]], a target that
                  fails so while another starts is retried in the background, named by /readyz);
                  once running it keeps retrying (a leader steps down)
  other commands  try once and exit 1 with the error (status, jobs, periodic, run-once, migrate,
                  grants --apply)
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="maintd", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", "-c", metavar="PATH",
                   help="TOML config file (default: $MAINTD_CONFIG; without either, defaults + env)")
    p.add_argument("--target", "-t", metavar="NAME",
                   help="with [[targets]]: act on this target only (migrate, status, grants and "
                        "check-config cover every target without it; run-once, jobs and periodic need it)")
    p.add_argument("--version", action="version", version=f"maintd {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    _add_daemon_parsers(sub)
    _add_setup_parsers(sub)
    _add_jobs_parser(sub)
    _add_periodic_parser(sub)
    _add_schedule_parser(sub)
    return p


def _add_daemon_parsers(sub) -> None:
    """run, run-once, status, demo."""
    sub.add_parser("run", help="run the daemon (the default command)",
                   description="Run the daemon: join the leader election, run the services while "
                               "leading, serve /metrics, /healthz, /readyz and /status. SIGTERM or "
                               "SIGINT stops it gracefully (releasing leadership at once); SIGHUP "
                               "reloads the config file. An unreachable database is waited for "
                               "(retries with backoff, 0.2 s doubling to 5 s, /readyz 503 "
                               "meanwhile); exit 1 only for what waiting cannot fix (a wrong "
                               "password, a missing database or schema, the HTTP port taken).")
    r = sub.add_parser("run-once", help="run one pass of a service and print what it did",
                       description="Run one pass of SERVICE under the leader lock and print its "
                                   "result as JSON: outcome, duration_seconds (the work, as "
                                   "maintd_service_run_seconds measures it), the result, its counts and "
                                   "a summary line. With --dry-run nothing is changed (and no lock "
                                   "is needed): it prints what the pass would do.")
    r.add_argument("service", metavar="SERVICE", choices=list(SERVICES),
                   help=", ".join(SERVICES))
    r.add_argument("--dry-run", action="store_true", help="report what would change, change nothing")
    r.add_argument("--wait", type=seconds, default=0.0, metavar="SECONDS",
                   help="wait up to SECONDS for the leader lock (default: fail at once if held)")
    s = sub.add_parser("status", help="who leads, each service's last run, jobs by queue and state",
                       description="Print, read from the database: the current leader (instance, "
                                   "host, pid, epoch, since) or none; the daemons alive (lock session "
                                   "connected) and gone (within the last hour); 'database: read-only "
                                   "(maintenance paused)' when the server takes no writes; the jobs "
                                   "table's layout (and its partitions); the last recorded pass of "
                                   "each service with its outcome and what it did; job counts by "
                                   "queue and state; the table health (what holds the xmin horizon, "
                                   "dead rows, size, last vacuum). With [[targets]]: every target, "
                                   "or --target's. Exit 1 when a target's database or schema cannot "
                                   "be read (its error is shown; the others still are).")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    d = sub.add_parser("demo", help="run everything on a throwaway PostgreSQL with a live workload",
                       description="Start an embedded PostgreSQL, migrate, run two daemons (demo-a, "
                                   "demo-b) with short intervals and a small workload of workers, "
                                   "failures, crashes, periodic and future jobs; print who leads, "
                                   "the jobs by state and what each service did every few seconds. "
                                   "After 30 s (or halfway through --duration) the leader is killed "
                                   "with SIGKILL and the other takes over; at 45 s (or a fifth of the "
                                   "way through --duration) a report holds a snapshot open for 20 s "
                                   "and the leader's warning names it. "
                                   "Ctrl-C or --duration ends it and removes everything (the "
                                   "database stays with --data-dir).")
    d.add_argument("--duration", type=seconds, metavar="SECONDS", help="stop after SECONDS")
    d.add_argument("--data-dir", metavar="DIR", help="keep the database in DIR (default: temp, removed)")
    d.add_argument("--listen", type=listen_address, default="127.0.0.1:9464",
                   metavar="HOST:PORT", help="the first daemon's HTTP address (/metrics, the dashboard, "
                        "/status; default 127.0.0.1:9464); the second listens on the next port (port 0: "
                        "any free ones)")


def _add_setup_parsers(sub) -> None:
    """migrate, grants, check-config."""
    m = sub.add_parser("migrate", help="create or upgrade the schema (safe from several replicas)",
                       description="Apply the Alembic migrations to the configured schema under an "
                                   "advisory lock, so replicas starting together migrate once.")
    m.add_argument("--sql", action="store_true",
                   help="print the SQL that would bring the schema from its revision now to --revision "
                        "(or down to --downgrade; a comment saying 'nothing to do' when it is there) "
                        "instead of applying it")
    m.add_argument("--from", dest="start", metavar="REVISION", type=revision,
                   help="with --sql: start from REVISION ('base' for a new schema) instead of reading "
                        "the schema's revision from the database (no connection)")
    m.add_argument("--revision", default="head", type=revision, help="target revision (default: head)")
    m.add_argument("--downgrade", metavar="REVISION", type=revision,
                   help="downgrade to REVISION ('base' removes every maintd table; below 0007 drops "
                        "health_history, below 0003 periodic_jobs with the schedules `maintd periodic add` "
                        "made: print it with --sql first)")
    m.add_argument("--convert", choices=["partitioned", "plain"],
                   help="partitioned: convert a live plain jobs table to the partitioned layout (SPEC "
                        "8.1): online, live jobs first, resumable; plain: abandon such a conversion "
                        "before its swap (its trigger and copy dropped, jobs untouched). Run as the owner role")

    g = sub.add_parser("grants", help="print the SQL granting a role what the daemon (or a worker) needs",
                       description="Print GRANT statements giving ROLE exactly the privileges the "
                                   "daemon needs on the configured schema (with --worker: what a "
                                   "worker running the README's SQL needs). Run them as the owner "
                                   "role that runs `maintd migrate`, or let --apply do it.")
    g.add_argument("role", metavar="ROLE", help="role to grant to (lower-case SQL identifier)")
    g.add_argument("--worker", action="store_true", help="a worker's privileges instead of the daemon's")
    g.add_argument("--apply", action="store_true",
                   help="run the grants through the configured connection (the owner role's)")

    sub.add_parser("check-config", help="validate the config and print it (password redacted)",
                   description="Load the config file and environment, validate every key and print "
                               "the effective configuration as JSON with the DSN password masked. "
                               "Exit 2 and one line per problem if it is invalid.")


def _add_schedule_parser(sub) -> None:
    sc = sub.add_parser("schedule", help="print the next fire times of a schedule expression",
                        description="Check a cron expression (or @hourly, '@every 30s') before "
                                    "deploying it: print its next N fire times, in its time zone "
                                    "and in UTC, with cron's DST rules (like systemd-analyze calendar).")
    sc.add_argument("expression", metavar="EXPR", help="e.g. '*/15 * * * *', '0 2 * * mon-fri', @daily")
    sc.add_argument("--timezone", "--tz", default="UTC", help="IANA time zone (default UTC)")
    sc.add_argument("--after", metavar="TIME", help="ISO 8601 start (default now); naive = in --timezone")
    sc.add_argument("-n", type=int, default=10, metavar="N", help="how many fire times (default 10)")


def _add_periodic_parser(sub) -> None:
    p = sub.add_parser("periodic", help="list and change periodic schedules kept as rows",
                       description="Periodic schedules in the periodic_jobs table, applied by the "
                                   "leader within seconds without a reload. `list` shows them with "
                                   "the [[periodic]] entries of the config (origin config or table), "
                                   "the last and next slot, and any error the daemon noted on a row.")
    actions = p.add_subparsers(dest="periodic_action", metavar="ACTION", required=True)
    ls = actions.add_parser("list", help="every schedule with its origin, last and next slot, error",
                            description="List every schedule: the config's [[periodic]] entries and "
                                        "crontab lines, then the rows of periodic_jobs, each with its "
                                        "origin (config, crontab or table), last and next slot, and any "
                                        "error the daemon noted on a row. Read-only.")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add = actions.add_parser("add", help="add a schedule (a row of periodic_jobs)",
                             description="Add a schedule as a row of periodic_jobs; the leader applies it "
                                         "within seconds, without a reload. An id of the config's "
                                         "[[periodic]] entries or crontab lines is refused; an existing "
                                         "row is kept unless --replace.")
    add.add_argument("id", help="the periodic id (letters, digits, _ . : / -; at most 128)")
    add.add_argument("--schedule", required=True, help="cron expression, @hourly, or '@every 30s'")
    add.add_argument("--kind", required=True, help="the job kind to enqueue")
    add.add_argument("--queue", default="default", help="the queue of the jobs it enqueues (default: default)")
    add.add_argument("--args", default="{}", metavar="JSON", help="the job's args (a JSON object)")
    add.add_argument("--timezone", default="UTC", help="time zone of a cron schedule (default UTC)")
    add.add_argument("--priority", type=int, default=0, metavar="N",
                     help="the jobs' priority, -32768 to 32767, lower runs first (default 0)")
    add.add_argument("--max-attempts", type=int, default=25, metavar="N",
                     help="the jobs' max attempts, 1 to 32767 (default 25)")
    add.add_argument("--backfill", metavar="DURATION", help="enqueue slots missed within this window")
    add.add_argument("--run-on-start", action="store_true", help="enqueue the current slot at once")
    add.add_argument("--unique", action="store_true", help="at most one live job of this schedule")
    add.add_argument("--replace", action="store_true", help="update the row if the id exists")
    for name, text, what in (
            ("remove", "delete a schedule (jobs it enqueued stay)",
             "Delete a row of periodic_jobs; the jobs it enqueued stay."),
            ("pause", "stop enqueueing (enabled = false)", "Stop a row of periodic_jobs enqueueing (enabled = false)."),
            ("resume", "enqueue again", "Let a paused row of periodic_jobs enqueue again (enabled = true).")):
        actions.add_parser(name, help=text, description=f"{what} The leader applies it within seconds. An "
                           "entry of the config or crontab is changed there instead. Exit 1 when there is "
                           "no such row.").add_argument("id", help="the periodic id (`maintd periodic list` shows them)")


def _add_jobs_parser(sub) -> None:
    """``maintd jobs ...`` (SPEC 7.5); the work is in maintd.admin."""
    jobs = sub.add_parser("jobs", help="list, show, retry, cancel, discard, delete or reschedule jobs",
                          description="Look at jobs and act on them through the schema's SQL admin "
                                      "functions. Running jobs (and rows a worker holds locked) are "
                                      "never touched: they are reported as skipped.")
    acts = jobs.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)

    def filters(p: argparse.ArgumentParser) -> None:
        p.add_argument("--state", help="available, scheduled, running, retryable, completed, "
                                       "cancelled or discarded")
        p.add_argument("--queue", help="jobs of this queue (its exact name)")
        p.add_argument("--kind", help="jobs of this kind (its exact name)")
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    lst = acts.add_parser("list", help="newest jobs first, optionally filtered",
                          description="List jobs, newest first, filtered by --state, --queue and --kind "
                                      "(combined with AND). Read-only.")
    filters(lst)
    lst.add_argument("--limit", type=int, default=50, metavar="N", help="at most N jobs (default 50)")
    show = acts.add_parser("show", help="one job with args, metadata and errors",
                           description="Show one job: its columns, args, metadata and errors. Read-only; "
                                       "exit 1 when there is no such job.")
    show.add_argument("id", type=job_id, metavar="ID", help="the job's id")
    show.add_argument("--json", action="store_true", help="print JSON")
    for name, text in (("retry", "make jobs available now (final ones too)"),
                       ("cancel", "cancel available/scheduled/retryable jobs"),
                       ("discard", "discard available/scheduled/retryable jobs"),
                       ("delete", "delete jobs in any state but running"),
                       ("reschedule", "change run time, priority, max attempts of waiting jobs")):
        how = ("by ids only (no filters), --batch-size ids per transaction" if name == "reschedule" else
               "by ids, or by filters (--state, --queue, --kind, combined with AND), --batch-size jobs per "
               "transaction")
        a = acts.add_parser(name, help=text, description=f"{text[0].upper()}{text[1:]}: {how}. Running "
                            "jobs and rows a worker holds locked are skipped and reported. Exit 1 when a "
                            "job id given does not exist.")
        a.add_argument("ids", type=job_id, nargs="+" if name == "reschedule" else "*", metavar="ID",
                       help="the jobs' ids" + ("" if name == "reschedule" else " (or filters instead)"))
        if name == "reschedule":
            a.add_argument("--at", required=True, metavar="TIME",
                           help="ISO 8601 time (UTC if no offset), 'now', or '+30m' from now")
            a.add_argument("--priority", type=int, metavar="N",
                           help="new priority, -32768 to 32767 (lower runs first; default: unchanged)")
            a.add_argument("--max-attempts", type=int, metavar="N",
                           help="new max attempts, 1 to 32767 (default: unchanged)")
            a.add_argument("--json", action="store_true", help="print JSON instead of a table")
        else:
            filters(a)
        if name == "discard":
            a.add_argument("--reason", help="recorded in the job's errors")
        a.add_argument("--dry-run", action="store_true", help="print what would change, change nothing")
        a.add_argument("--batch-size", type=int, default=1000, metavar="N",
                       help="jobs per transaction (default 1000)")


def seconds(text: str) -> float:
    """A number of seconds, 0 or more (argparse turns the error into exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text} seconds: expected 0 or more")
    return value


def listen_address(text: str) -> str:
    """HOST:PORT, checked as the config's ``http.listen`` is."""
    from .config import HttpConfig

    try:
        return HttpConfig(listen=text).listen
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT, e.g. 127.0.0.1:9464") from None


def revision(text: str) -> str:
    """A migration revision: an id, ``head``, ``base``, or relative (``-1``, ``head-1``)."""
    from . import migrate

    relative = migrate.RELATIVE.fullmatch(text)
    if migrate.known_revision(relative.group(1) or "head" if relative else text):
        return text
    known = ", ".join(["base", *migrate.revisions(), "head"])
    raise argparse.ArgumentTypeError(f"unknown revision {text!r} (known: {known})")


def job_id(text: str) -> int:
    """A job id argument: a bigint above 0 (argparse turns the error into exit 2)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"job id {text!r} is not a whole number") from None
    if not 1 <= n <= 2**63 - 1:
        raise argparse.ArgumentTypeError(f"job id {text} is out of range (1 to {2**63 - 1}, a bigint)")
    return n


def answer_bound(settings: Settings) -> float:
    """Seconds a command waits for any answer of the server before it gives up (exit 1): a frozen
    or cut-off server keeps acknowledging at the TCP level and never runs its statement_timeout.
    A statement gets its timeout plus a lease, as the daemon's passes do."""
    return (settings.statement_timeout + settings.leader.lease).total_seconds()


def _load(args: argparse.Namespace) -> Settings:
    """The settings of one target: ``--target``'s, or the only one."""
    targets = _targets(args)
    if len(targets) > 1:
        names = ", ".join(t.target_name for t in targets[:5]) + (", ..." if len(targets) > 5 else "")
        raise ConfigError([f"targets: {len(targets)} targets are configured; choose one with "
                           f"--target NAME ({names})"])
    return targets[0]


def _targets(args: argparse.Namespace) -> list[Settings]:
    """Every target's settings, or ``--target``'s alone."""
    return _select(load_settings(args.config), getattr(args, "target", None))


def _select(settings: Settings, name: str | None) -> list[Settings]:
    targets = settings.target_settings()
    if name is None:
        return targets
    chosen = [t for t in targets if t.target_name == name]
    if not chosen:
        raise ConfigError([f"--target: no target named {name!r} (configured: "
                           f"{', '.join(t.target_name for t in targets)})"])
    return chosen


def cmd_check_config(args: argparse.Namespace) -> int:
    """The effective config (the whole file is validated): the one target's, or with several
    ``{"targets": [...]}``, each with its sections merged and its name."""
    from .services.partitioner import PartitionerConfig

    targets = _targets(args)
    shown = [{"target": t.target_name, **t.redacted()} if len(targets) > 1 else t.redacted() for t in targets]
    for entry, t in zip(shown, targets):
        if advice := PartitionerConfig.of(t).advice():
            entry["advice"] = advice  # not an error: what the config will cost
    print(json.dumps(shown[0] if len(shown) == 1 else {"targets": shown}, indent=2))
    return EXIT_OK


def cmd_migrate(args: argparse.Namespace) -> int:
    """Every target (or ``--target``'s); one that fails does not stop the others (exit 1)."""
    from . import migrate

    targets = _targets(args)
    try:
        return _migrate_targets(targets, args)
    except migrate.BadRevision as exc:  # a relative revision leading nowhere: usage, exit 2
        flag = {"revision": "--revision", "downgrade": "--downgrade", "start": "--from"}[exc.option]
        raise ConfigError([f"{flag} {exc.revision}: {exc}"]) from None


def _migrate_targets(targets: list[Settings], args: argparse.Namespace) -> int:
    from . import migrate
    from .db import describe_db_error

    if args.downgrade and args.revision != "head":
        raise ConfigError(["--revision: does not go with --downgrade, which names the revision to go down to"])
    if args.sql:
        if args.convert:
            raise ConfigError(["--convert: does not go with --sql (the conversion runs online, in steps)"])
        for settings in targets:
            start, layout = (args.start, migrate.Layout.of(settings)) if args.start is not None else \
                _schema_revision(settings)
            sys.stdout.write(migrate.offline_sql(settings.schema, args.downgrade or args.revision, start,
                                                 layout, down=bool(args.downgrade)))
        return EXIT_OK
    if args.convert and args.downgrade:
        raise ConfigError(["--convert: does not go with --downgrade"])
    if args.start is not None:
        raise ConfigError(["--from: only with --sql (the schema's revision is read from the database)"])
    failed = 0
    for settings in targets:
        try:
            _migrate_one(settings, args)
        except migrate.BadRevision:
            raise
        except Exception as exc:
            if len(targets) == 1:
                raise
            failed += 1
            _stderr(f"maintd: error: target {settings.target_name}: {describe_db_error(exc)}")
    return EXIT_FAILURE if failed else EXIT_OK


def _schema_revision(settings: Settings) -> tuple[str, Layout]:
    """The schema's revision now ('base' when it has none) and its jobs table's layout, read from
    the catalog, for ``migrate --sql``: it prints what is left to do, not the DDL from base, and
    for the table as it is, as ``migrate`` does."""
    from . import migrate
    from .db import make_engine

    engine = make_engine(settings.database_url.get_secret_value(),
                         application_name=f"maintd:{settings.instance_id}:migrate", pooled=False,
                         answer_timeout=answer_bound(settings))
    try:
        with engine.connect() as conn:
            revision = migrate.revision_for_sql(conn, settings.schema)
            return revision, migrate.layout_for_sql(conn, settings.schema, migrate.Layout.of(settings))
    finally:
        engine.dispose()


def _migrate_one(settings: Settings, args: argparse.Namespace) -> None:
    from . import migrate
    from .db import make_engine

    engine = make_engine(settings.database_url.get_secret_value(),
                         application_name=f"maintd:{settings.instance_id}:migrate", pooled=False)
    stays_plain = False  # layout = "partitioned" on a table migrate had made plain: said after
    layout = migrate.Layout.of(settings)
    try:
        with engine.connect() as conn:
            if args.downgrade:
                before, after = migrate.downgrade(conn, settings.schema, args.downgrade, waiting=_waiting)
            elif args.convert:
                return _convert_one(conn, settings, args.convert)
            else:
                before, after = migrate.upgrade(conn, settings.schema, args.revision, layout, waiting=_waiting)
                stays_plain = settings.layout == "partitioned" and after is not None and \
                    migrate.layout_for_sql(conn, settings.schema, layout).name == "plain"
    finally:
        engine.dispose()
    if before == after:
        print(f"schema {settings.schema} is at revision {after or 'base'}; nothing to do")
    else:
        print(f"schema {settings.schema} migrated from {before or 'base'} to {after or 'base'}")
    if stays_plain:
        print(f"schema {settings.schema}: the jobs table is plain, though the config says layout = \"partitioned\" "
              "(migrate builds that layout for a new schema only): convert it with "
              "`maintd migrate --convert partitioned`")


def _waiting(line: str) -> None:
    """A migrate that waits for another's lock says so (on stderr), once."""
    _stderr(f"maintd: {line}")


def _convert_one(conn, settings: Settings, to: str) -> None:
    """``migrate --convert partitioned`` (or ``plain``: abandon one) of one schema, under the
    schema's migrate lock."""
    from . import convert, migrate

    current = migrate.current_revision(conn, settings.schema)
    conn.commit()
    if current != migrate.head_revision():
        raise convert.ConvertError(f"schema {settings.schema} is at revision {current or 'base'}, not "
                                   f"{migrate.head_revision()}: run `maintd migrate` first")
    key = migrate.lock_key(settings.schema)
    migrate.take_lock(conn, key, waiting=lambda holder: _waiting(f"schema {settings.schema}: waiting for {holder}"))
    def say(line: str) -> None:
        print(line, flush=True)

    try:
        if to == "plain":
            convert.abandon(conn, settings.schema, say=say)
        elif convert.convert(conn, settings.schema, migrate.Layout.of(settings), say=say) == "stopped":
            raise convert.ConvertError(f"schema {settings.schema}: the conversion stopped; jobs is still plain")
    except KeyboardInterrupt:  # exit 130 (main): the table is plain still, the trigger on it
        _stderr(f"maintd: schema {settings.schema}: interrupted before --convert {to} finished; run the same "
              "command again (a conversion resumes where it stopped)")
        raise
    finally:
        conn.rollback()
        migrate.release_lock(conn, key)


def cmd_run(args: argparse.Namespace) -> int:
    from .daemon import Daemon, DuplicateInstance, HttpListenError, SchemaNotReady
    from .leader import LeaderSessionError
    from .logs import setup_logging

    settings = load_settings(args.config)  # every target
    setup_logging(settings.log.level, settings.log.format)
    daemon = Daemon(settings, config_path=args.config or os.environ.get("MAINTD_CONFIG"))
    try:
        return daemon.run_forever()
    except DuplicateInstance as exc:
        _stderr(f"maintd: config error: {exc}")
        return EXIT_USAGE
    except (SchemaNotReady, HttpListenError, LeaderSessionError) as exc:
        _stderr(f"maintd: error: {exc}")
        return EXIT_FAILURE


def cmd_run_once(args: argparse.Namespace) -> int:
    import threading

    from .clock import ServerClock
    from .leader import acquire_once
    from .logs import setup_logging
    from .pass_summary import annotate
    from .passes import Outcome, execute_pass, maintenance_engine
    from .services.base import Fence, NoFence, PassContext

    settings = _load(args)
    setup_logging(settings.log.level, settings.log.format)
    spec = SERVICES[args.service]
    engine = maintenance_engine(settings, pool_size=2)
    stop_event = threading.Event()
    held = None
    try:
        fence: Fence = NoFence()
        if not args.dry_run:  # the lock is renewed in a thread meanwhile; losing it stops the pass
            held = acquire_once(settings, wait=args.wait, on_demoted=lambda reason: stop_event.set())
            if held is None:
                advice = (f"still held after waiting {args.wait:g} s: stop it, or run with --dry-run" if args.wait
                          else "stop it, use --wait, or run with --dry-run")
                _stderr(f"maintd: error: another instance holds the leader lock ({_current_leader(engine, settings)});"
                        f" {advice}")
                return EXIT_FAILURE
            fence = held[1]
        if not _schema_ready(engine, settings, args):  # (after the lock: its errors say what they said)
            return EXIT_FAILURE
        ctx = PassContext.for_settings(settings, engine, ServerClock(), fence=fence, dry_run=args.dry_run,
                                       stop_event=stop_event)
        record = execute_pass(args.service, spec.cls(spec.section(settings)), ctx)
        out = {"service": args.service, "dry_run": args.dry_run, "outcome": record.outcome.value,
               # the work, as maintd_service_run_seconds measures it (the scheduler's waits left out)
               "duration_seconds": round(record.seconds, 3),
               "result": record.result.as_dict() if record.result is not None else None,
               **annotate(args.service, record.result.as_dict() if record.result is not None else None)}
        if record.error:
            out["error"] = record.error
        print(json.dumps(out, indent=2, default=str))
        return EXIT_OK if record.outcome is Outcome.SUCCESS else EXIT_FAILURE
    finally:
        if held is not None:
            held[0].stop()
        engine.dispose()


def _schema_ready(engine, settings: Settings, args: argparse.Namespace) -> bool:
    """As `run` does, run-once refuses a schema behind (or ahead of) this maintd, which it ran a
    pass on; a server that does not answer is the pass's error (one wait for it, not two)."""
    from sqlalchemy.exc import DBAPIError

    from .db import describe_db_error
    from .migrate import SchemaNotReady, check_ready

    try:
        check_ready(engine, settings.schema)
        return True
    except SchemaNotReady as exc:
        _stderr(f"maintd: error: {exc}")
    except DBAPIError as exc:
        print(json.dumps({"service": args.service, "dry_run": args.dry_run, "outcome": "error",
                          "result": None, "error": describe_db_error(exc)}, indent=2))
    return False


def _current_leader(engine, settings: Settings) -> str:
    from .status import collect_status

    try:
        lead = collect_status(engine, settings.schema, jobs={})["leader"]  # jobs={}: none counted
    except Exception as exc:
        from .db import describe_db_error

        return f"unknown: {describe_db_error(exc)}"
    if lead is None:
        return "unknown"
    return f"instance={lead['instance_id']} host={lead['host']} pid={lead['pid']} epoch={lead['epoch']}"


def cmd_status(args: argparse.Namespace) -> int:
    """Every target (or ``--target``'s); without [[targets]] the output is the one schema's."""
    top = load_settings(args.config)
    targets = _select(top, getattr(args, "target", None))
    if not top.targets:
        st, error = _status_one(targets[0])
        if st is not None:  # with an error: a schema behind this maintd, read as far as it can be
            print(json.dumps(st, indent=2, default=str) if args.json else format_status_text(st))
        if error:
            _stderr(f"maintd: error: {error}")
            return EXIT_FAILURE
        return EXIT_OK
    results = [(t, *_status_one(t)) for t in targets]
    if args.json:
        print(json.dumps({"targets": [{"target": t.target_name, **(st or {}), **({"schema": t.schema, "error": err}
                                                                                 if err else {})}
                                      for t, st, err in results]}, indent=2, default=str))
    else:
        for t, st, err in results:
            print(f"== target {t.target_name}")
            print(format_status_text(st) if st is not None else f"schema: {t.schema}\nerror: {err}")
    return EXIT_FAILURE if any(err for _, _, err in results) else EXIT_OK


def format_status_text(st: dict) -> str:
    from .status import format_status

    return format_status(st)


def _status_one(settings: Settings) -> tuple[dict | None, str | None]:
    """(status, None), or (None, the problem) for a schema or database that cannot be read, or
    (what could be read, the problem) for a schema behind this maintd."""
    from .db import describe_db_error
    from .readers import reader_engine
    from .status import SchemaMissing, collect_status

    engine = reader_engine(settings.database_url.get_secret_value(), settings.instance_id, kept=1, most=1)
    try:
        st = collect_status(engine, settings.schema, max_queues=settings.metrics.max_queues,
                            health=settings.health.enabled, show_query=settings.health.show_query,
                            configured_layout=settings.layout)
        return st, st.get("schema_behind")
    except SchemaMissing as exc:
        return None, str(exc)
    except Exception as exc:  # one target's outage does not hide the others
        return None, describe_db_error(exc)
    finally:
        engine.dispose()


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(duration=args.duration, data_dir=args.data_dir, listen=args.listen)


def cmd_jobs(args: argparse.Namespace) -> int:
    """``maintd jobs ...``: exit 0 done (skipped jobs are reported, not errors), 1 runtime
    failure, 2 usage."""
    from datetime import timedelta

    from .admin import LOCK_TIMEOUT, AdminError, UsageError, plan_command
    from .db import hold_any_time
    from .db import make_engine, session_settings
    from .readers import reader_engine

    settings = _load(args)
    try:
        work = plan_command(args)
        dsn = settings.database_url.get_secret_value()
        if args.jobs_command in ("list", "show"):  # a reader (SPEC 8.5); a long listing streams
            engine = reader_engine(dsn, settings.instance_id, kept=1, most=1,
                                   statement_timeout=settings.statement_timeout)
        else:
            engine = make_engine(
                dsn, application_name=f"maintd:{settings.instance_id}:jobs", pooled=False,
                session=session_settings(settings.statement_timeout, lock_timeout=LOCK_TIMEOUT,
                                         idle_in_transaction=timedelta(minutes=1)),
                answer_timeout=answer_bound(settings))
        try:
            with engine.connect() as conn:
                hold_any_time(conn)  # the rows to fix are often those with odd times
                return work(conn, settings.schema)
        finally:
            engine.dispose()
    except UsageError as exc:
        _stderr(f"maintd jobs: error: {exc}")
        return EXIT_USAGE
    except AdminError as exc:
        _stderr(f"maintd jobs: error: {exc}")
        return EXIT_FAILURE


def cmd_schedule(args: argparse.Namespace) -> int:
    from datetime import datetime

    from .schedules import upcoming

    try:
        after = datetime.fromisoformat(args.after) if args.after else None
    except ValueError:
        _stderr(f"maintd schedule: error: --after {args.after!r}: use an ISO 8601 time (2026-03-01T12:00:00, "
              "naive = in --timezone)")
        return EXIT_USAGE
    try:
        times = upcoming(args.expression, args.timezone, after, args.n)
    except ValueError as exc:
        _stderr(f"maintd schedule: error: {exc}")
        return EXIT_USAGE
    if not times:
        _stderr(f"maintd schedule: error: --after {args.after}: no fire time after it within the years 1 to 9999")
        return EXIT_USAGE
    for t in times:
        utc = t.astimezone(timezone.utc)
        print(f"{t.isoformat()}  ({utc.strftime('%Y-%m-%d %H:%M:%S')} UTC)")
    if len(times) < args.n:
        _stderr("maintd schedule: no later fire time before the year 10000 (where Python's dates end)")
    return EXIT_OK


def cmd_periodic(args: argparse.Namespace) -> int:
    from . import periodic_table as table
    from .db import make_engine, session_settings
    from .readers import reader_engine

    settings = _load(args)
    configured = {e.id: e for e in settings.periodic_entries}
    if args.periodic_action != "list" and args.id in configured:
        _stderr(f"maintd periodic: error: {_configured_elsewhere(configured[args.id], args)}")
        return EXIT_USAGE
    if args.periodic_action == "add":
        try:
            job = table.validated(_periodic_values(args))
        except ValueError as exc:
            _stderr(f"maintd periodic: error: {exc}")
            return EXIT_USAGE
    dsn = settings.database_url.get_secret_value()
    if args.periodic_action == "list":  # a reader (SPEC 8.5)
        engine = reader_engine(dsn, settings.instance_id, kept=1, most=1)
    else:
        engine = make_engine(dsn, application_name=f"maintd:{settings.instance_id}:periodic", pooled=False,
                             session=session_settings(settings.statement_timeout),
                             answer_timeout=answer_bound(settings))
    try:
        if args.periodic_action == "list":
            entries, _ = table.list_entries(engine, settings)
            print(json.dumps(table.as_json(entries), indent=2, default=str) if args.json else table.format_entries(entries))
            return EXIT_OK
        if args.periodic_action in ("add", "remove"):
            try:
                if args.periodic_action == "add":
                    done = table.add(engine, settings.schema, job, replace=args.replace)
                    what = "exists (use --replace)" if not done else "saved"
                else:
                    done, what = table.remove(engine, settings.schema, args.id), "removed"
            except Exception as exc:
                if getattr(getattr(exc, "orig", None), "sqlstate", None) != "42501":
                    raise
                _stderr(f"maintd periodic: error: {_rows_role_hint(exc, settings.schema)}")
                return EXIT_FAILURE
        else:
            enabled = args.periodic_action == "resume"
            done = table.set_enabled(engine, settings.schema, args.id, enabled)
            what = "resumed" if enabled else "paused"
    finally:
        engine.dispose()
    if not done and args.periodic_action != "add":
        _stderr(f"maintd periodic: error: periodic {args.id}: not found (`maintd periodic list` shows the ids)")
        return EXIT_FAILURE
    print(f"periodic {args.id}: {what}")
    return EXIT_OK if done else EXIT_FAILURE


def _rows_role_hint(exc: Exception, schema: str) -> str:
    """A role that may not write rows of periodic_jobs: not a grant `maintd grants` would give
    (the daemon's role only reads rows and writes their error note), so say who may, and all that
    `add` (an upsert with RETURNING) and `remove` (a DELETE with WHERE and RETURNING) need."""
    from .identifiers import quote_ident
    from .logs import redact_dsn

    line = redact_dsn(str(exc.orig).strip().splitlines()[0])  # type: ignore[attr-defined]
    return (f"{line} (`maintd periodic add` and `remove` write rows of periodic_jobs, which "
            "`maintd grants` leaves to the applications' roles: run them as the schema's owner, or "
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON {quote_ident(schema)}.periodic_jobs TO the role)")


def _configured_elsewhere(entry, args: argparse.Namespace) -> str:
    """Why ``periodic pause|resume|remove|add ID`` cannot act on an entry of the config or the
    crontab file (rows of periodic_jobs are what it changes; the files win over rows)."""
    action = args.periodic_action
    if entry.cron_args:
        where = f"a line of the crontab file ({entry.line})"
        how = {"pause": "comment the line out", "resume": "uncomment the line",
               "remove": "delete the line"}.get(action, "remove the line or choose another id")
    else:
        path = args.config or os.environ.get("MAINTD_CONFIG") or "the config file"
        where = f"a [[periodic]] entry of {path}"
        how = {"pause": "set enabled = false in it", "resume": "set enabled = true in it",
               "remove": "delete the entry"}.get(action, "remove the entry or choose another id")
    return (f"periodic {entry.id} is {where}, not a row of periodic_jobs: {how}, then reload the "
            "daemons (SIGHUP)")


def _periodic_values(args: argparse.Namespace) -> dict:
    try:
        job_args = json.loads(args.args)
    except json.JSONDecodeError as exc:
        raise ValueError(f"args: not JSON: {exc}") from None
    except RecursionError:
        raise ValueError("args: not JSON: nested too deeply") from None
    return {"id": args.id, "schedule": args.schedule, "timezone": args.timezone, "kind": args.kind,
            "queue": args.queue, "args": job_args, "priority": args.priority,
            "max_attempts": args.max_attempts, "backfill": args.backfill,
            "run_on_start": args.run_on_start, "unique_key": args.unique}


def _schemas_by_database(targets: list[Settings]) -> dict[str, list[str]]:
    """The targets' schemas (each once) by the database URL that reaches them."""
    out: dict[str, list[str]] = {}
    for t in targets:
        on_it = out.setdefault(t.database_url.get_secret_value(), [])
        if t.schema not in on_it:
            on_it.append(t.schema)
    return out


def cmd_grants(args: argparse.Namespace) -> int:
    from .grants import apply, render, validate_role
    from .logs import redact_dsn

    try:
        validate_role(args.role)
    except ValueError as exc:
        _stderr(f"maintd: error: {exc}")
        return EXIT_USAGE
    targets = _targets(args)  # every target's schema, or --target's
    schemas = list(dict.fromkeys(t.schema for t in targets))
    by_database = _schemas_by_database(targets)
    if not args.apply:
        for dsn, on_it in by_database.items():
            if len(by_database) > 1:  # each database's script is run there (psql's ON_ERROR_STOP)
                sys.stdout.write(f"-- database {redact_dsn(dsn)}: run the script below against it\n")
            sys.stdout.write(render(on_it, args.role, worker=args.worker,
                                    partitioned={t.schema for t in targets if t.layout == "partitioned"}))
        return EXIT_OK
    from .db import make_engine, session_settings

    n = 0
    for dsn, on_it in by_database.items():
        engine = make_engine(dsn, pooled=False, application_name=f"maintd:{targets[0].instance_id}:grants",
                             session=session_settings(targets[0].statement_timeout),
                             answer_timeout=answer_bound(targets[0]))
        try:
            with engine.connect() as conn:
                n += apply(conn, on_it, args.role, worker=args.worker)
        finally:
            engine.dispose()
    who = "a worker" if args.worker else "the daemon"
    print(f"granted role {args.role} what {who} needs on schema {', '.join(schemas)} ({n} statements)")
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run,
    "migrate": cmd_migrate,
    "check-config": cmd_check_config,
    "run-once": cmd_run_once,
    "status": cmd_status,
    "demo": cmd_demo,
    "jobs": cmd_jobs,
    "periodic": cmd_periodic,
    "schedule": cmd_schedule,
    "grants": cmd_grants,
}


def _stderr(line: str) -> None:
    """One line for the operator: names and values from the config, the server or the arguments
    in it with their control characters escaped (a newline would forge a line of its own)."""
    from .logs import escape

    print(escape(line), file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command or "run"
    try:
        return COMMANDS[command](args)
    except ConfigError as exc:
        for line in exc.problems:  # keys and values as the file or a variable wrote them
            _stderr(f"maintd: config error: {line}")
        return EXIT_USAGE
    except KeyboardInterrupt:  # cut off: not done (`maintd run` and `demo` stop on SIGINT themselves)
        _stderr("maintd: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `maintd jobs list | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:  # one clear line, never a stack trace or a password
        from .db import describe_db_error

        _stderr(f"maintd: error: {describe_db_error(exc)}")
        return EXIT_FAILURE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
