"""maintain_partitions empties expired partitions first (TRUNCATE under a lock on each alone), then
detaches them: no completion waits for the prune (SPEC 8.1, issue 30)

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25

Detaching takes an ACCESS EXCLUSIVE lock on ``jobs_<state>``, which every completion also locks:
the old body held it while detaching the expired partitions, and its last try queued in the lock
queue, with completions behind it (4 workers ran at 0.61x their idle rate during a prune). The new
body first empties each expired partition under a lock on that partition alone, then detaches the
empty tables, queuing for ``jobs_<state>`` only when partitions must be made. Same signature:
``CREATE OR REPLACE`` keeps the EXECUTE that ``maintd grants`` gave.
"""

from alembic import op

from maintd import partitions

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(partitions.replace_function_ddl(op.get_context().version_table_schema, "maintain_partitions"))


def downgrade() -> None:
    pass  # the new body works with every earlier revision's tables
