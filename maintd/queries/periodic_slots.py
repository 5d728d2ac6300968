"""Statements on ``{schema}.periodic_slots``: the exactly-once guard of periodic jobs."""

HIGH_WATER = """
SELECT periodic_id, max(slot) AS hwm FROM {schema}.periodic_slots
 WHERE periodic_id = ANY(CAST(:ids AS text[])) GROUP BY periodic_id
"""

TAKE = """
INSERT INTO {schema}.periodic_slots (periodic_id, slot, backfilled, instance_id)
VALUES (:periodic_id, :slot, :backfilled, :instance)
ON CONFLICT (periodic_id, slot) DO NOTHING
RETURNING slot
"""

LINK_JOB = """
UPDATE {schema}.periodic_slots SET job_id = :job_id WHERE periodic_id = :periodic_id AND slot = :slot
"""

# Old slot rows are only history; the newest per id (the high-water mark) always stays.
PRUNE = """
DELETE FROM {schema}.periodic_slots s
 WHERE s.slot < :before
   AND s.slot < (SELECT max(slot) FROM {schema}.periodic_slots m WHERE m.periodic_id = s.periodic_id)
"""
