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

# A disabled entry's slot, taken without a job (so that the entry enabled again does not enqueue
# it), and the one this daemon took for it before forgotten: a paused entry keeps one row or two,
# not one per slot. Only the newest row of an id counts (the high-water mark), and it stays.
TAKE_DISABLED = """
WITH taken AS (
  INSERT INTO {schema}.periodic_slots (periodic_id, slot, backfilled, instance_id)
  VALUES (:periodic_id, :slot, false, :instance)
  ON CONFLICT (periodic_id, slot) DO NOTHING
  RETURNING slot
), forgotten AS (
  DELETE FROM {schema}.periodic_slots
   WHERE periodic_id = :periodic_id AND slot = CAST(:previous AS timestamptz) AND job_id IS NULL
     AND EXISTS (SELECT 1 FROM taken)
)
SELECT slot FROM taken
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
