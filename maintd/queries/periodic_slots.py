"""Statements on ``{schema}.periodic_slots``: the exactly-once guard of periodic jobs."""

from . import PYTHON_TIMES

# The slots that count for an entry's high-water mark (SPEC 7.3): those a Python datetime holds.
# One row at '-infinity', 'infinity', a BC date or past year 9999 (by hand, an import) failed every
# pass of the enqueuer, every entry stopped. It is history only: the enqueuer, `maintd periodic
# list`, the dashboard and the prune (which keeps each entry's newest slot) all go by these
# (PYTHON_TIMES).

# Each entry's newest slot taken that counts: one entry of the primary key (periodic_id, slot) per
# id (a max() grouped by id read every slot of the history, 62 days of an '@every 1s' entry: 5
# million rows, on every pass), with what it was taken under (``schedule``: NULL before 0013).
HIGH_WATER = """
SELECT i.periodic_id, h.slot AS hwm, h.schedule AS taken_under
  FROM unnest(CAST(:ids AS text[])) AS i(periodic_id)
 CROSS JOIN LATERAL (SELECT s.slot, s.schedule FROM {schema}.periodic_slots AS s
                      WHERE s.periodic_id = i.periodic_id
                        AND s.slot BETWEEN """ + PYTHON_TIMES + """
                      ORDER BY s.slot DESC LIMIT 1) AS h
"""

# Each listed entry's newest slot that counts and the job it enqueued (NULL: none taken), as
# HIGH_WATER: one entry of the primary key per id.
LATEST = """
SELECT p.id, s.slot, s.job_id
  FROM unnest(CAST(:ids AS text[])) AS p(id)
  LEFT JOIN LATERAL (SELECT slot, job_id FROM {schema}.periodic_slots
                      WHERE periodic_id = p.id AND slot BETWEEN """ + PYTHON_TIMES + """
                      ORDER BY slot DESC LIMIT 1) s ON true
"""

TAKE = """
INSERT INTO {schema}.periodic_slots (periodic_id, slot, backfilled, instance_id, schedule)
VALUES (:periodic_id, :slot, :backfilled, :instance, :schedule)
ON CONFLICT (periodic_id, slot) DO NOTHING
RETURNING slot
"""

# The newest slot of an entry whose schedule changed, when the new schedule has no slot after it
# yet: it now says the new schedule (the next slot is taken under it).
RESTAMP = """
UPDATE {schema}.periodic_slots SET schedule = :schedule
 WHERE periodic_id = :periodic_id AND slot = :slot AND schedule IS DISTINCT FROM :schedule
"""

# A disabled entry's slot, taken without a job (so that the entry enabled again does not enqueue
# it), and the one this daemon took for it before forgotten: a paused entry keeps one row or two,
# not one per slot. Only the newest row of an id counts (the high-water mark), and it stays.
TAKE_DISABLED = """
WITH taken AS (
  INSERT INTO {schema}.periodic_slots (periodic_id, slot, backfilled, instance_id, schedule)
  VALUES (:periodic_id, :slot, false, :instance, :schedule)
  ON CONFLICT (periodic_id, slot) DO NOTHING
  RETURNING slot
), forgotten AS (
  DELETE FROM {schema}.periodic_slots
   WHERE periodic_id = :periodic_id AND slot = CAST(:previous AS timestamptz) AND job_id IS NULL
     AND EXISTS (SELECT 1 FROM taken)
)
SELECT slot FROM taken
"""

# The newest slot of each id no longer configured (an entry removed by a reload, a row deleted or
# refused): taken under no schedule now, so the entry added again runs from its next slot, not
# backfilling its absence (a leader ran meanwhile). One index entry per id, as HIGH_WATER.
REMOVED = "(removed)"
MARK_REMOVED = """
UPDATE {schema}.periodic_slots AS s SET schedule = '""" + REMOVED + """'
  FROM unnest(CAST(:ids AS text[])) AS i(periodic_id)
 CROSS JOIN LATERAL (SELECT h.slot FROM {schema}.periodic_slots AS h
                      WHERE h.periodic_id = i.periodic_id AND h.slot BETWEEN """ + PYTHON_TIMES + """
                      ORDER BY h.slot DESC LIMIT 1) AS n
 WHERE s.periodic_id = i.periodic_id AND s.slot = n.slot AND s.schedule IS DISTINCT FROM '""" + REMOVED + """'
"""

LINK_JOB = """
UPDATE {schema}.periodic_slots SET job_id = :job_id WHERE periodic_id = :periodic_id AND slot = :slot
"""

# Old slot rows are only history; the newest per id (the high-water mark) always stays. At most
# :limit rows a statement (an `@every 1s` entry leaves 86,400 rows a day: the first prune after a
# leader outage of weeks had that many weeks to delete in one statement), found through the primary
# key: the ids by a loose scan, then each id's oldest slots in order, deleted by their ctids. In
# keyset batches from (:from_id, :from_slot) on (in the Index Cond; the slot as text, as it may be
# '-infinity'): each starts at the last one's last candidate (next_id and next_slot, the same on
# every row returned), so that a prune reads each entry once: the deleted slots' entries stay in
# the index until a vacuum, and while a transaction older than the delete is open anywhere (a
# report, a pg_dump) a scan cannot mark them dead, so a batch that started at each id's oldest slot
# read them all again. The loose scan starts at :from_id itself ('' at first, then an id).
PRUNE = """
WITH RECURSIVE ids AS (
  SELECT CAST(:from_id AS text) AS periodic_id  -- (not the first id from it on: that read its deleted slots' entries)
  UNION ALL
  SELECT (SELECT n.periodic_id FROM {schema}.periodic_slots n
           WHERE n.periodic_id > ids.periodic_id ORDER BY n.periodic_id LIMIT 1)
    FROM ids WHERE ids.periodic_id IS NOT NULL
), old AS MATERIALIZED (
  SELECT o.ctid, o.periodic_id, o.slot
    FROM ids CROSS JOIN LATERAL (
         SELECT s.ctid, s.periodic_id, s.slot FROM {schema}.periodic_slots s
          WHERE s.periodic_id = ids.periodic_id AND s.slot < CAST(:before AS timestamptz)
            AND (s.periodic_id, s.slot) >= (CAST(:from_id AS text), CAST(:from_slot AS timestamptz))
            AND s.slot < (SELECT max(m.slot) FROM {schema}.periodic_slots m
                           WHERE m.periodic_id = ids.periodic_id AND m.slot BETWEEN """ + PYTHON_TIMES + """)
          ORDER BY s.slot LIMIT :limit) o
   LIMIT :limit
)
DELETE FROM {schema}.periodic_slots d
 WHERE d.ctid = ANY(ARRAY(SELECT ctid FROM old)) AND d.slot < CAST(:before AS timestamptz)
RETURNING (SELECT periodic_id FROM old ORDER BY periodic_id DESC, slot DESC LIMIT 1) AS next_id,
          (SELECT CAST(slot AS text) FROM old ORDER BY periodic_id DESC, slot DESC LIMIT 1) AS next_slot
"""
