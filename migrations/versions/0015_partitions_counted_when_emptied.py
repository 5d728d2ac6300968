"""maintain_partitions counts an emptied partition's rows up to 100,000, beyond that takes the
live rows the statistics follow (SPEC 8.1, 8.4)

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-29

An expired partition's rows were the planner's estimate (``pg_class.reltuples``) once it had been
analyzed. The cleaner deletes rows of such partitions (the low catch-all's strays, queues with a
shorter retention) and counts them as deleted; the estimate of the last analyze still held them,
so the drop counted them a second time (``maintd_jobs_deleted_total``, the pass's ``deleted``).
Same signature: ``CREATE OR REPLACE`` keeps the EXECUTE that ``maintd grants`` gave.
"""

from alembic import op

from maintd import partitions

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema = op.get_context().version_table_schema
    op.execute(partitions.replace_function_ddl(schema, "maintain_partitions"))


def downgrade() -> None:
    pass  # the new body works with every earlier revision's tables
