"""maintain_partitions returns once it has emptied expired partitions: the caller commits, then
calls it again to detach them (SPEC 8.1, issue 30)

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25

The commit that follows a TRUNCATE unlinks the old files and drops their buffers, which takes
time proportional to their size; PostgreSQL does it before it releases the transaction's locks.
The 0008 body emptied and detached in one transaction, so that time (tens of milliseconds for a
million rows) was spent holding ``jobs_<state>``'s ACCESS EXCLUSIVE lock, with every completion
waiting behind it. Now the emptying's transaction holds locks on the emptied partitions alone,
and the detach's transaction (the next call) has only empty files to deal with. Same signature:
``CREATE OR REPLACE`` keeps the EXECUTE that ``maintd grants`` gave.

Its helper ``drop_expired_partitions`` loses the ``p_counts`` argument, unused since 0008 (the rows
are counted when emptied, and the detached tables are empty), and ``job_partitions``, which a pass
calls several times, reads the bounds by position instead of with regular expressions (twice as
fast), and prints them in ISO and UTC whatever the caller's TimeZone and DateStyle (on PostgreSQL
15, a session in Asia/Kolkata with DateStyle SQL read its bounds 3.5 hours off: "IST" read back
as Israel's).
"""

from alembic import op

from maintd import partitions
from maintd.identifiers import quote_ident

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema = op.get_context().version_table_schema
    op.execute(f"DROP FUNCTION IF EXISTS {quote_ident(schema)}.drop_expired_partitions(text, timestamptz, jsonb)")
    for helper in ("drop_expired_partitions", "job_partitions"):
        for statement in partitions.replace_helper_ddl(schema, helper):
            op.execute(statement)
    op.execute(partitions.replace_function_ddl(schema, "maintain_partitions"))


def downgrade() -> None:
    pass  # the new body works with every earlier revision's tables
