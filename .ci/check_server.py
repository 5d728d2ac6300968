"""``python .ci/check_server.py URL MAJOR``: exit 0 when the PostgreSQL server at ``URL`` answers
(3 s) and is of the major version ``MAJOR``; else print why and exit 1.

.ci/run's second pass is the suite on PostgreSQL 15: a server that only answered (a PostgreSQL 16
or 18 on the same port) would run it, and CI would say the suite passed on a version it never saw.
"""

from __future__ import annotations

import sys

import psycopg


def main(url: str, major: int) -> int:
    shown = url.split("@")[-1]  # the address and database, not the user
    try:
        with psycopg.connect(url, connect_timeout=3) as conn:
            version = conn.info.server_version // 10000
    except Exception as exc:
        print(f"PostgreSQL {major} on {shown} not reachable ({exc}): failing the CI run")
        return 1
    if version != major:
        print(f"the server on {shown} is PostgreSQL {version}, not {major}: failing the CI run")
        return 1
    print(f"PostgreSQL {version} on {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
