"""What maintd tells operators is so (SPEC 8.4, issue 28). One test (or more) per row of the issue
that has no better home; row 1 is tests/test_readme_sql.py, row 3 tests/test_pass_summary.py."""

from __future__ import annotations

import re
import time
import uuid

import pytest

from maintd.config import Settings
from maintd.dashboard import Dashboard
from maintd.http import Request
from maintd.status import collect_status, format_status

from .procs import DaemonProc, wait_for


def unique(prefix: str) -> str:
    """Instance ids are unique on the shared server (tests run at once)."""
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


# -- row 4: a SIGKILLed replica is gone at once ----------------------------------------------------


def _overview_html(settings: Settings) -> str:
    status, _, body, _ = Dashboard(lambda: settings).index(Request("/", {"refresh": ["0"]}))
    assert status == 200
    return body.decode()


@pytest.mark.slow
def test_a_killed_replica_is_shown_gone_as_soon_as_its_session_is(pg_dsn, schema, engine):
    """The issue saw it counted alive, as a follower, for up to a minute."""
    settings = Settings(database_url=pg_dsn, schema=schema, instance_id="reader")
    a, b = unique("a"), unique("b")
    leader = DaemonProc(pg_dsn, schema, a).start()
    follower = None
    try:
        leader.wait_log(r"became leader", timeout=20)
        follower = DaemonProc(pg_dsn, schema, b).start()
        wait_for(lambda: {d["instance_id"] for d in collect_status(engine, schema)["daemons"]} == {a, b},
                 20, what="both replicas alive")
        html = _overview_html(settings)
        assert re.search(r'id="replicas-alive">2<', html)
        follower.kill()  # SIGKILL: its lock session ends with it
        killed = time.monotonic()
        st = wait_for(lambda: (lambda s: s if [d["instance_id"] for d in s["gone"]] == [b] else None)(
            collect_status(engine, schema)), 10, interval=0.05, what="the killed replica shown gone")
        took = time.monotonic() - killed
        assert took < 3, took  # the session's end, not a minute
        assert [d["instance_id"] for d in st["daemons"]] == [a]
        assert re.search(rf"{b}\s.*gone \(no lock session\)", format_status(st))
        html = _overview_html(settings)
        assert re.search(r'id="replicas-alive">1<', html)
        row = re.search(rf'<tr data-instance="{b}">(.*?)</tr>', html, re.S).group(1)
        assert "gone" in row and "follower" not in row
    finally:
        if follower is not None:
            follower.stop()
        leader.stop()
