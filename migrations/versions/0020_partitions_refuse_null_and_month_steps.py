"""maintain_partitions refuses a NULL state, step or make-until and a step with a month part
(SPEC 8.1)

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-30

Its guards were comparisons, which a NULL passes (NULL is not true): a NULL state failed deep in
a helper ('null values cannot be formatted as an SQL identifier'), a NULL step went as far as
detaching the catch-alls (undone only because re-attaching them then failed), a NULL make-until
made nothing past the ``1000 steps ahead`` guard. A step of '1 month' is not under a minute and
was taken: its partitions were calendar months (28 to 31 days), not the fixed steps from the
epoch the layout is made of. Each is now refused (SQLSTATE 22023, naming the argument) before
anything is touched. The daemon's own calls (a step in seconds, both set) are unchanged.

Same signature: ``CREATE OR REPLACE`` keeps the EXECUTE that ``maintd grants`` gave.
"""

from alembic import op

from maintd import partitions

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema = op.get_context().version_table_schema
    op.execute(partitions.replace_function_ddl(schema, "maintain_partitions"))


def downgrade() -> None:
    pass  # the new body works with every earlier revision's tables
