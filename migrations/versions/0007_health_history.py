"""health_history and the jobs table's autovacuum settings (SPEC 8.2, issue 27)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25

``health_history``: what the dashboard's charts draw (jobs by state and queue, finished jobs per
minute, the jobs table's size and dead rows, the xmin horizon's age and its holder), one row per
sample. The leader writes one only when something changed (at most one a minute) or every ten
minutes when idle; the cleaner deletes rows older than two days.

The jobs table gets autovacuum settings that suit a queue (``maintd.migrate.JOBS_AUTOVACUUM``);
on the partitioned layout they go on the live jobs' leaf partitions.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from maintd.migrate import jobs_autovacuum_sql

revision = "0007"
down_revision = "0006"  # 0006_partition_functions
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema = op.get_context().version_table_schema
    op.create_table(
        "health_history",
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        # The window [since, at) in which `completed` and `discarded` jobs were finished.
        sa.Column("since", sa.DateTime(timezone=True), nullable=False),
        sa.Column("completed", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("discarded", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        # {"available": n, ...}: waiting and running jobs by state; {"queue": n}: by queue (the
        # largest ten, the rest as "_other").
        sa.Column("depth", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("queues", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("jobs_bytes", sa.BigInteger),
        sa.Column("dead_tuples", sa.BigInteger),
        sa.Column("live_tuples", sa.BigInteger),
        sa.Column("horizon_age_seconds", sa.Float),
        sa.Column("horizon_age_xids", sa.BigInteger),
        # The holder of the horizon when held over a minute: kind, pid, user, application_name, ...
        sa.Column("holder", postgresql.JSONB),
        sa.PrimaryKeyConstraint("at", name="health_history_pkey"),
        schema=schema,
    )
    op.execute(jobs_autovacuum_sql(schema))


def downgrade() -> None:
    schema = op.get_context().version_table_schema
    op.execute(jobs_autovacuum_sql(schema, reset=True))
    op.drop_table("health_history", schema=schema)
