"""jobs table, job_state enum, leader/daemons/service_runs/periodic_slots bookkeeping

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import postgresql

from maintd import partitions
from maintd.db import quote_ident

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

STATES = ("available", "scheduled", "running", "retryable", "completed", "cancelled", "discarded")
FINAL = "('completed', 'cancelled', 'discarded')"


def _ts(name: str, **kw):
    return sa.Column(name, sa.DateTime(timezone=True), **kw)


def upgrade() -> None:
    schema = op.get_context().version_table_schema
    q = quote_ident(schema)
    op.execute(f"CREATE TYPE {q}.job_state AS ENUM ({', '.join(repr(s) for s in STATES)})")
    state = postgresql.ENUM(*STATES, name="job_state", schema=schema, create_type=False)

    if context.config.attributes.get("layout", "plain") == "partitioned":
        _partitioned_jobs(schema, state)
    else:
        _plain_jobs(schema, state)

    op.create_table(
        "leader",
        sa.Column("name", sa.Text, nullable=False, server_default=sa.text("'leader'")),
        sa.Column("epoch", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("instance_id", sa.Text),
        sa.Column("host", sa.Text),
        sa.Column("pid", sa.Integer),
        sa.Column("backend_pid", sa.Integer),
        _ts("elected_at"),
        _ts("renewed_at"),
        _ts("released_at"),
        sa.PrimaryKeyConstraint("name", name="leader_pkey"),
        sa.CheckConstraint("name = 'leader'", name="leader_single_row_check"),
        schema=schema,
    )
    op.execute(f"INSERT INTO {q}.leader (name, epoch) VALUES ('leader', 0)")

    op.create_table(
        "daemons",
        sa.Column("instance_id", sa.Text, nullable=False),
        sa.Column("host", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("version", sa.Text, nullable=False),
        _ts("started_at", nullable=False, server_default=sa.text("now()")),
        _ts("last_seen_at", nullable=False, server_default=sa.text("now()")),
        sa.PrimaryKeyConstraint("instance_id", name="daemons_pkey"),
        schema=schema,
    )
    op.create_table(
        "service_runs",
        sa.Column("service", sa.Text, nullable=False),
        sa.Column("instance_id", sa.Text, nullable=False),
        _ts("started_at", nullable=False),
        _ts("finished_at", nullable=False),
        sa.Column("outcome", sa.Text, nullable=False),
        sa.Column("result", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("error", sa.Text),
        _ts("last_success_at"),
        sa.PrimaryKeyConstraint("service", name="service_runs_pkey"),
        schema=schema,
    )
    op.create_table(
        "periodic_slots",
        sa.Column("periodic_id", sa.Text, nullable=False),
        _ts("slot", nullable=False),
        sa.Column("job_id", sa.BigInteger),
        sa.Column("backfilled", sa.Boolean, nullable=False, server_default=sa.text("false")),
        _ts("enqueued_at", nullable=False, server_default=sa.text("now()")),
        sa.Column("instance_id", sa.Text),
        sa.PrimaryKeyConstraint("periodic_id", "slot", name="periodic_slots_pkey"),
        schema=schema,
    )


def _columns(state) -> list:
    return [
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("queue", sa.Text, nullable=False, server_default=sa.text("'default'")),
        sa.Column("args", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("state", state, nullable=False, server_default=sa.text("'available'")),
        sa.Column("priority", sa.SmallInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("attempt", sa.SmallInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("max_attempts", sa.SmallInteger, nullable=False, server_default=sa.text("25")),
        _ts("scheduled_at", nullable=False, server_default=sa.text("now()")),
        _ts("created_at", nullable=False, server_default=sa.text("now()")),
        _ts("attempted_at"),
        sa.Column("attempted_by", sa.Text),
        _ts("heartbeat_at"),
        _ts("finalized_at"),
        sa.Column("errors", postgresql.JSONB, nullable=False, server_default=sa.text("'[]'::jsonb")),
        sa.Column("unique_key", sa.Text),
        sa.Column("metadata", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.CheckConstraint("char_length(kind) BETWEEN 1 AND 128", name="jobs_kind_length_check"),
        sa.CheckConstraint("char_length(queue) BETWEEN 1 AND 128", name="jobs_queue_length_check"),
        sa.CheckConstraint("max_attempts > 0", name="jobs_max_attempts_positive_check"),
        sa.CheckConstraint("attempt >= 0", name="jobs_attempt_not_negative_check"),
        sa.CheckConstraint(f"(finalized_at IS NOT NULL) = (state IN {FINAL})",
                           name="jobs_finalized_at_iff_final_check"),
        sa.CheckConstraint("jsonb_typeof(errors) = 'array'", name="jobs_errors_is_array_check"),
    ]


def _plain_jobs(schema: str, state) -> None:
    op.create_table("jobs", *_columns(state), sa.PrimaryKeyConstraint("id", name="jobs_pkey"), schema=schema)
    op.create_index("jobs_fetch_idx", "jobs", ["queue", "priority", "scheduled_at", "id"],
                    schema=schema, postgresql_where=sa.text("state = 'available'"))
    op.create_index("jobs_scheduled_idx", "jobs", ["scheduled_at", "id"], schema=schema,
                    postgresql_where=sa.text("state IN ('scheduled', 'retryable')"))
    op.create_index("jobs_finalized_idx", "jobs", ["state", "finalized_at", "id"], schema=schema,
                    postgresql_where=sa.text("finalized_at IS NOT NULL"))
    op.create_index("jobs_running_idx", "jobs", [sa.text("coalesce(heartbeat_at, attempted_at)"), "id"],
                    schema=schema, postgresql_where=sa.text("state = 'running'"))
    op.create_index("jobs_unique_key_idx", "jobs", ["unique_key"], unique=True, schema=schema,
                    postgresql_where=sa.text(f"unique_key IS NOT NULL AND state NOT IN {FINAL}"))


def _partitioned_jobs(schema: str, state) -> None:
    """SPEC 8.1's layout (maintd/partitions.py): no primary key on jobs itself (PostgreSQL's would
    have to hold the partition keys); each partition has its own on id, which the identity fills.
    The final states' first partitions are made by migration 0006, with the functions that make
    them."""
    op.create_table("jobs", *_columns(state), schema=schema, postgresql_partition_by="LIST (state)")
    for statement in partitions.partitions_ddl(schema):
        op.execute(statement)


def downgrade() -> None:
    schema = op.get_context().version_table_schema
    for table in ("periodic_slots", "service_runs", "daemons", "leader", "jobs"):
        op.drop_table(table, schema=schema)
    op.execute(f"DROP TYPE {quote_ident(schema)}.job_state")
