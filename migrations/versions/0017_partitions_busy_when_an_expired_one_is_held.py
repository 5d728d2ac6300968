"""maintain_partitions says 'busy' when an expired partition is held and nothing is to be made
(SPEC 8.1)

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-29

A reader holding an expired partition (a long report) kept it from being emptied and detached,
rightly; but when no partition was to be made the call returned no row, so the partitioner's pass
reported nothing (no ``busy`` in its summary, log or status) while the partition stayed, pass after
pass. It returns a ``busy`` row then, as when jobs_<state>'s lock is held.

Same signature: ``CREATE OR REPLACE`` keeps the EXECUTE that ``maintd grants`` gave.
"""

from alembic import op

from maintd import partitions

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema = op.get_context().version_table_schema
    op.execute(partitions.replace_function_ddl(schema, "maintain_partitions"))


def downgrade() -> None:
    pass  # the new body works with every earlier revision's tables
