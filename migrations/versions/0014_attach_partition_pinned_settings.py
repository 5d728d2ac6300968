"""attach_partition writes the bounds in ISO and UTC whatever the caller's settings (SPEC 8.1)

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-29

The partition bounds were printed into the ATTACH statement (``quote_literal`` of a timestamptz)
in the calling session's DateStyle and TimeZone and read back by the server. ``maintd migrate``
and ``maintd migrate --convert partitioned`` call ``start_partitions`` (and so this helper) in the
owner's own session: on PostgreSQL 15, a session in Asia/Kolkata with DateStyle SQL printed
"... IST", read back as Israel's time, so a new table's catch-alls met 3.5 hours in the future
(the completions until then strays in the low catch-all, every partition after half an hour off
the step). The helper now pins ``TimeZone`` and ``DateStyle`` for the call, as ``job_partitions``
does since 0009. Same signature.
"""

from alembic import op

from maintd import partitions

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for statement in partitions.replace_helper_ddl(op.get_context().version_table_schema, "attach_partition"):
        op.execute(statement)


def downgrade() -> None:
    pass  # the new body works with every earlier revision's tables
