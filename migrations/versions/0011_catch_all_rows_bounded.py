"""catch_all_rows counts each catch-all up to 100,000 rows, then takes the planner's estimate
(SPEC 8.1, 8.5)

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-28

A conversion (``maintd migrate --convert partitioned``) leaves the finished jobs of a whole
retention in the low catch-all: with ten million of them, each exact count read them all (about
0.4 s), on every partitioner pass (every 30 s), every ``maintd status`` and every dashboard page.
Same signature: ``CREATE OR REPLACE`` keeps the EXECUTE that ``maintd grants`` gave.
"""

from alembic import op

from maintd import partitions

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema = op.get_context().version_table_schema
    for statement in partitions.replace_helper_ddl(schema, "catch_all_rows"):
        op.execute(statement)


def downgrade() -> None:
    pass  # the new body works with every earlier revision's tables
