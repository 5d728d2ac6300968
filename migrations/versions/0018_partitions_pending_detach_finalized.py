"""drop_expired_partitions finishes a detach an interrupted DETACH ... CONCURRENTLY left pending
(SPEC 8.1)

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-30

An operator's ``DETACH PARTITION ... CONCURRENTLY`` of a final-state partition, cancelled or cut
off while it waited, leaves the partition pending detach (``pg_inherits.inhdetachpending``).
PostgreSQL refuses a plain DETACH of it (SQLSTATE 55000), so once it was past the retention every
partitioner pass failed: nothing of that state was dropped or made ahead again. It is detached
with ``FINALIZE`` now, as PostgreSQL requires. Same signature.
"""

from alembic import op

from maintd import partitions

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for statement in partitions.replace_helper_ddl(op.get_context().version_table_schema, "drop_expired_partitions"):
        op.execute(statement)


def downgrade() -> None:
    pass  # the new body works with every earlier revision's tables
