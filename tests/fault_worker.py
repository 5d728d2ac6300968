"""A worker process for the fault tests: enqueues, claims, completes, fails, crashes mid-job.

Every enqueued id goes to fault_enqueued and every acknowledged completion to fault_completed (in
the completing transaction), so the test can check from the database that nothing was lost and no
completion was overwritten. Survives database restarts.
"""

from __future__ import annotations

import random
import sys
import time

from sqlalchemy.exc import DBAPIError

from maintd.db import make_engine
from maintd.queries import sql
from maintd.jobs import JobQueue


def main(dsn: str, schema: str, name: str, seconds: float) -> int:
    engine = make_engine(dsn, application_name=f"fault-worker:{name}", pool_size=2)
    q = JobQueue(schema)
    rng = random.Random(name)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with engine.begin() as conn:
                for _ in range(3):
                    jid = q.enqueue(conn, "fault", {"by": name}, max_attempts=3)
                    conn.execute(sql("INSERT INTO {schema}.fault_enqueued (id) VALUES (:id)", schema), {"id": jid})
            with engine.begin() as conn:
                jobs = q.claim(conn, "default", name, 3)
            for job in jobs:
                roll = rng.random()
                if roll < 0.05:
                    continue  # crash: never finish; the rescuer must give it back
                time.sleep(rng.uniform(0, 0.02))
                with engine.begin() as conn:
                    if roll < 0.15:
                        q.fail(conn, job, "fault-worker failure")
                    elif q.complete(conn, job):
                        conn.execute(sql("INSERT INTO {schema}.fault_completed (id) VALUES (:id)", schema),
                                     {"id": job.id})
        except DBAPIError:
            time.sleep(0.2)  # the database is restarting or our session was killed
    engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))
