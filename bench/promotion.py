"""Promotion lag (issue 28, SPEC 8.4): how long after its ``scheduled_at`` a job becomes
``available``, with the default scheduler (interval 5 s, precise timing), in one daemon. Not a
test: a person runs it and reads the table.

    python bench/promotion.py [--jobs 300] [--seconds 60]

Jobs are enqueued the way workers fail them: at random moments, each due a random 0.1-4 s later
(a retry with a short backoff), so most fall due before the scheduler's next tick and sooner than
anything its last pass saw. A trigger records the server's clock when each job becomes available.
Printed: the lag p50/p99/max, against the floor (0: promoted at its due time), for the jobs due
sooner than the due-time probe's period (1 s) and for the others.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from maintd import migrate  # noqa: E402
from maintd.config import Settings  # noqa: E402
from maintd.daemon import Daemon  # noqa: E402
from maintd.db import make_engine  # noqa: E402
from maintd.embedded import EmbeddedPostgres  # noqa: E402

AUDIT = """
CREATE TABLE maintd.promotions (id bigint PRIMARY KEY, at timestamptz NOT NULL);
CREATE FUNCTION maintd.record_promotion() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO maintd.promotions VALUES (NEW.id, clock_timestamp()); RETURN NULL; END $$;
CREATE TRIGGER promoted AFTER UPDATE OF state ON maintd.jobs FOR EACH ROW
  WHEN (NEW.state = 'available' AND OLD.state <> 'available') EXECUTE FUNCTION maintd.record_promotion();
"""


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=60.0, help="over how long the jobs are enqueued")
    args = ap.parse_args()
    with EmbeddedPostgres() as pg:
        engine = make_engine(pg.dsn, application_name="bench", pooled=False)
        with engine.connect() as conn:
            migrate.upgrade(conn, "maintd")
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute(AUDIT)
        daemon = Daemon(Settings(database_url=pg.dsn, instance_id="bench-promo", http={"enabled": False}))
        daemon.start()
        try:
            while not daemon.is_leader:
                time.sleep(0.1)
            delays = []
            rng = random.Random(28)
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                for _ in range(args.jobs):
                    time.sleep(rng.uniform(0, 2 * args.seconds / args.jobs))
                    delay = rng.uniform(0.1, 4.0)
                    delays.append(delay)
                    conn.execute("INSERT INTO maintd.jobs (kind, state, scheduled_at) VALUES "
                                 "('k', 'retryable', clock_timestamp() + make_interval(secs => %s))", (delay,))
                deadline = time.monotonic() + 30
                while conn.execute("SELECT count(*) FROM maintd.promotions").fetchone()[0] < args.jobs:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                rows = conn.execute("SELECT extract(epoch FROM p.at - j.scheduled_at) FROM maintd.jobs j "
                                    "JOIN maintd.promotions p USING (id) ORDER BY j.id").fetchall()
        finally:
            daemon.stop()
    lags = [float(r[0]) for r in rows]
    short = [lag for lag, d in zip(lags, delays) if d < 1.0]
    other = [lag for lag, d in zip(lags, delays) if d >= 1.0]
    print(f"{len(lags)} of {args.jobs} jobs promoted; scheduler interval 5 s, precise timing, due-time probe every 1 s")
    print(f"{'jobs':<34}{'n':>6}{'p50 s':>9}{'p99 s':>9}{'max s':>9}{'early':>7}")
    for label, values in (("due < 1 s after enqueued", short), ("due 1-4 s after enqueued", other), ("all", lags)):
        if values:
            print(f"{label:<34}{len(values):>6}{statistics.median(values):>9.3f}{pct(values, 0.99):>9.3f}"
                  f"{max(values):>9.3f}{sum(v < 0 for v in values):>7}")
    print("floor: 0 s (promoted at scheduled_at); a tick-bound scheduler: up to 5 s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
