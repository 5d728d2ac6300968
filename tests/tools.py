"""The outside programs the tests start, at the exact paths where ``.ci/run`` installs them
(Debian packages), and the one way a test says it cannot run without one.

``.ci/run`` asks this module which packages are missing (``python3 tests/tools.py missing``)
and checks afterwards that every path is there (``python3 tests/tools.py check``), so the suite
and CI look for the same files: a binary found elsewhere on ``PATH`` does not count.

Under ``CI=true`` (``.ci/run`` exports it) a missing tool or server fails the test instead of
skipping it (:func:`unavailable`); every skip of the suite goes through that function
(``tests/test_ci.py`` checks it). Stdlib only at import: ``.ci/run`` runs it before the venv.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Tool:
    name: str
    path: str  # the file the tests use
    package: str  # the Debian package that installs it


TOOLS: dict[str, Tool] = {t.name: t for t in (
    Tool("pgbouncer", "/usr/sbin/pgbouncer", "pgbouncer"),
    Tool("chromium", "/usr/bin/chromium", "chromium"),
    Tool("chromedriver", "/usr/bin/chromedriver", "chromium-driver"),
    Tool("promtool", "/usr/bin/promtool", "prometheus"),
    Tool("libfaketime", "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1", "faketime"),
    Tool("systemd-analyze", "/usr/bin/systemd-analyze", "systemd"),
    # A streaming standby and private servers of the PG 15 run (tests/standby.py, private_pg).
    Tool("postgres-15", "/usr/lib/postgresql/15/bin/postgres", "postgresql-15"),
    Tool("pg_basebackup-15", "/usr/lib/postgresql/15/bin/pg_basebackup", "postgresql-client-15"),
)}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def path(name: str) -> str:
    return TOOLS[name].path


def missing(names: list[str] | None = None) -> list[Tool]:
    return [t for n, t in TOOLS.items() if (names is None or n in names) and not os.path.exists(t.path)]


def unavailable(message: str) -> None:
    """This test cannot run here: a skip with the reason, or under CI a failure (CI installs
    every tool and starts every server, so a missing one is a broken CI, not a reason to pass)."""
    import pytest

    if in_ci():
        pytest.fail(f"{message} (CI=true: a missing tool or server fails the run)", pytrace=False)
    pytest.skip(message)


def require(*names: str) -> str:
    """The path of the first tool named (after checking all of them), or :func:`unavailable`."""
    for tool in missing(list(names)):
        unavailable(f"needs {tool.path} (Debian package {tool.package}; .ci/run installs it)")
    return path(names[0])


def main(argv: list[str]) -> int:
    command = argv[1] if len(argv) > 1 else "check"
    gone = missing()
    if command == "missing":  # the Debian packages to install, one line, space-separated
        print(" ".join(dict.fromkeys(t.package for t in gone)))
        return 0
    if command == "check":
        for t in gone:
            print(f"missing {t.path} (Debian package {t.package})", file=sys.stderr)
        return 1 if gone else 0
    print(f"usage: {argv[0]} missing|check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
