"""The ``maintd`` command line. Exit codes: 0 done, 1 runtime failure, 2 bad configuration or usage."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence

from . import __version__
from .config import ConfigError, Settings, load_settings

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

DESCRIPTION = """\
maintd keeps a Postgres jobs table healthy. Run two or three replicas: one wins an advisory-lock
leadership and runs the maintenance services (cleaner, rescuer, scheduler, periodic enqueuer,
reindexer); the others wait to take over within seconds.

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

exit codes: 0 done, 1 runtime failure (database unreachable, ...), 2 bad configuration or usage
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="maintd", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", "-c", metavar="PATH",
                   help="TOML config file (default: $MAINTD_CONFIG; without either, defaults + env)")
    p.add_argument("--version", action="version", version=f"maintd {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    sub.add_parser("run", help="run the daemon (the default command)",
                   description="Run the daemon: join the leader election, run the services while "
                               "leading, serve /metrics, /healthz, /readyz and /status. SIGTERM or "
                               "SIGINT stops it gracefully (releasing leadership at once); SIGHUP "
                               "reloads the config file.")

    m = sub.add_parser("migrate", help="create or upgrade the schema (safe from several replicas)",
                       description="Apply the Alembic migrations to the configured schema under an "
                                   "advisory lock, so replicas starting together migrate once.")
    m.add_argument("--sql", action="store_true", help="print the SQL instead of applying it")
    m.add_argument("--revision", default="head", help="target revision (default: head)")
    m.add_argument("--downgrade", metavar="REVISION",
                   help="downgrade to REVISION ('base' removes every maintd table)")

    sub.add_parser("check-config", help="validate the config and print it (password redacted)",
                   description="Load the config file and environment, validate every key and print "
                               "the effective configuration as JSON with the DSN password masked. "
                               "Exit 2 and one line per problem if it is invalid.")

    r = sub.add_parser("run-once", help="run one pass of a service and print what it did",
                       description="Run one pass of SERVICE under the leader lock and print its "
                                   "result as JSON. With --dry-run nothing is changed (and no lock "
                                   "is needed): it prints what the pass would do.")
    r.add_argument("service", metavar="SERVICE",
                   choices=["cleaner", "rescuer", "scheduler", "periodic", "reindexer"],
                   help="cleaner, rescuer, scheduler, periodic or reindexer")
    r.add_argument("--dry-run", action="store_true", help="report what would change, change nothing")
    r.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to SECONDS for the leader lock (default: fail at once if held)")

    s = sub.add_parser("status", help="who leads, each service's last run, jobs by queue and state",
                       description="Print the current leader (instance, host, pid, since), the "
                                   "last run and outcome of each service, and job counts by queue "
                                   "and state, read from the database.")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")

    d = sub.add_parser("demo", help="run everything on a throwaway PostgreSQL with a live workload",
                       description="Start an embedded PostgreSQL, migrate, run the daemon with "
                                   "short intervals and a small workload of workers, failures, "
                                   "crashes, periodic and future jobs; print a summary every few "
                                   "seconds. Ctrl-C or --duration ends it.")
    d.add_argument("--duration", type=float, metavar="SECONDS", help="stop after SECONDS")
    d.add_argument("--data-dir", metavar="DIR", help="keep the database in DIR (default: temp, removed)")
    d.add_argument("--listen", default="127.0.0.1:9464", help="HTTP listen address for /metrics")
    return p


def _load(args: argparse.Namespace) -> Settings:
    return load_settings(args.config)


def cmd_check_config(args: argparse.Namespace) -> int:
    settings = _load(args)
    print(json.dumps(settings.redacted(), indent=2))
    return EXIT_OK


def cmd_migrate(args: argparse.Namespace) -> int:
    from . import migrate
    from .db import make_engine

    settings = _load(args)
    if args.sql:
        sys.stdout.write(migrate.offline_sql(settings.schema, args.revision))
        return EXIT_OK
    engine = make_engine(settings.database_url.get_secret_value(),
                         application_name=f"maintd:{settings.instance_id}:migrate", pooled=False)
    try:
        with engine.connect() as conn:
            if args.downgrade:
                before, after = migrate.downgrade(conn, settings.schema, args.downgrade)
            else:
                before, after = migrate.upgrade(conn, settings.schema, args.revision)
    finally:
        engine.dispose()
    if before == after:
        print(f"schema {settings.schema} is at revision {after or 'base'}; nothing to do")
    else:
        print(f"schema {settings.schema} migrated from {before or 'base'} to {after or 'base'}")
    return EXIT_OK


def _lazy(module: str, func: str) -> Callable[[argparse.Namespace], int]:
    def call(args: argparse.Namespace) -> int:
        import importlib

        mod = importlib.import_module(f"maintd.{module}")
        return getattr(mod, func)(args)

    return call


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": _lazy("daemon", "cli_run"),
    "migrate": cmd_migrate,
    "check-config": cmd_check_config,
    "run-once": _lazy("runner", "cli_run_once"),
    "status": _lazy("status", "cli_status"),
    "demo": _lazy("demo", "cli_demo"),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command or "run"
    try:
        return COMMANDS[command](args)
    except ConfigError as exc:
        for line in exc.problems:
            print(f"maintd: config error: {line}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK
    except Exception as exc:  # one clear line, never a stack trace or a password
        from .db import describe_db_error

        print(f"maintd: error: {describe_db_error(exc)}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
