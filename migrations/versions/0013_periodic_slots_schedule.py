"""periodic_slots.schedule: the schedule and time zone a slot was taken under (SPEC 2, 7.10)

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-28

An entry's slots since its newest taken one count as missed, to be enqueued (within backfill).
That was wrong when the entry's schedule had changed since: a config or crontab entry changed
from '0 3 * * *' (run at 03:00) to '0 5 * * *' at 10:00 enqueued a 05:00 job at once, a second
run that day, and with a backfill every slot of the new schedule since 03:00. A row had the
opposite fault: any change of it (its args, say) started it afresh from the change, losing a slot
due and not yet taken. The newest slot now records what it was taken under: a different schedule
or time zone starts the entry afresh from its next slot; any other change keeps its slots. NULL
(a slot taken before this revision): as before.
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema = op.get_context().version_table_schema
    op.add_column("periodic_slots", sa.Column("schedule", sa.Text), schema=schema)


def downgrade() -> None:
    schema = op.get_context().version_table_schema
    op.drop_column("periodic_slots", "schedule", schema=schema)
