"""Three daemons, `@every 1s`, the leader SIGKILLed again and again: every slot exactly once."""

from __future__ import annotations

import random
import time

import psycopg
import pytest

from .procs import START, DaemonProc, leader_row, wait_for, wait_new_leader

pytestmark = pytest.mark.slow


def test_every_slot_exactly_once_across_sigkills(pg_dsn, schema, tmp_path):
    extra = {
        "cleaner": {"enabled": False}, "rescuer": {"enabled": False}, "scheduler": {"enabled": False},
        "periodic": [{"id": "beat", "schedule": "@every 1s", "kind": "beat", "backfill": "30s"}],
    }
    procs = {f"p{i}": DaemonProc(pg_dsn, schema, f"p{i}", extra, workdir=str(tmp_path)).start()
             for i in range(3)}
    rng = random.Random(7)
    kills = 0
    try:
        wait_for(lambda: leader_row(pg_dsn, schema)[1], START, what="a leader")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(1.5, 3.0))
            epoch, inst = leader_row(pg_dsn, schema)
            if inst is None:
                continue
            procs[inst].kill()
            kills += 1
            wait_new_leader(pg_dsn, schema, epoch, timeout=10)
            procs[inst] = DaemonProc(pg_dsn, schema, inst, extra, workdir=str(tmp_path)).start()
        time.sleep(2.5)  # let the last leader catch up
    finally:
        for p in procs.values():
            p.stop()
    assert kills >= 5
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            f'SELECT (metadata->>\'slot\')::timestamptz, count(*) FROM "{schema}".jobs '
            "GROUP BY 1 ORDER BY 1").fetchall()
        slot_rows = conn.execute(
            f'SELECT slot, job_id FROM "{schema}".periodic_slots ORDER BY slot').fetchall()
    slots = [r[0] for r in rows]
    assert all(n == 1 for _, n in rows), "a slot was enqueued twice"
    # No gap: consecutive seconds from the first enqueued slot to the last.
    gaps = [(a, b) for a, b in zip(slots, slots[1:]) if (b - a).total_seconds() != 1]
    assert gaps == [], f"missing slots between {gaps}"
    assert len(slots) >= 18
    # The durable guard agrees with the jobs: one row per slot, each linked to its job.
    assert [s for s, job in slot_rows if job is not None] == slots
