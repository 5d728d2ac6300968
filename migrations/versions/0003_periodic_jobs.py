"""periodic_jobs: periodic schedules as rows, applied by the leader without a reload (SPEC 7.10)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23

Applications add, change, pause and remove schedules with plain SQL. A trigger keeps
``updated_at`` and sends ``NOTIFY <channel>, '<id>'`` (``maintd_periodic``, or
``<schema>_maintd_periodic`` when the schema is not ``maintd``) on every change except the
daemon's own write of ``error``, so the leader applies a change at once; its periodic re-read
covers a missed notification.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from maintd.db import quote_ident

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _channel(schema: str) -> str:
    return "maintd_periodic" if schema == "maintd" else f"{schema}_maintd_periodic"


def upgrade() -> None:
    schema = op.get_context().version_table_schema
    q = quote_ident(schema)
    op.create_table(
        "periodic_jobs",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("schedule", sa.Text, nullable=False),
        sa.Column("timezone", sa.Text, nullable=False, server_default=sa.text("'UTC'")),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("queue", sa.Text, nullable=False, server_default=sa.text("'default'")),
        sa.Column("args", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("priority", sa.SmallInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("max_attempts", sa.SmallInteger, nullable=False, server_default=sa.text("25")),
        sa.Column("unique_key", sa.Boolean, nullable=False, server_default=sa.text("false")),
        sa.Column("backfill", postgresql.INTERVAL),
        sa.Column("run_on_start", sa.Boolean, nullable=False, server_default=sa.text("false")),
        sa.Column("enabled", sa.Boolean, nullable=False, server_default=sa.text("true")),
        sa.Column("error", sa.Text),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        schema=schema,
    )
    op.execute(f"""
CREATE FUNCTION {q}.periodic_jobs_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'UPDATE' THEN
    IF (to_jsonb(NEW) - 'error' - 'updated_at') = (to_jsonb(OLD) - 'error' - 'updated_at') THEN
      RETURN NEW;  -- only the daemon's error note changed: no change to apply
    END IF;
    NEW.updated_at := now();
  END IF;
  PERFORM pg_notify('{_channel(schema)}', coalesce(NEW.id, OLD.id));
  RETURN coalesce(NEW, OLD);
END $$""")
    op.execute(f"CREATE TRIGGER periodic_jobs_changed BEFORE INSERT OR UPDATE OR DELETE ON {q}.periodic_jobs "
               f"FOR EACH ROW EXECUTE FUNCTION {q}.periodic_jobs_changed()")


def downgrade() -> None:
    schema = op.get_context().version_table_schema
    q = quote_ident(schema)
    op.drop_table("periodic_jobs", schema=schema)
    op.execute(f"DROP FUNCTION {q}.periodic_jobs_changed()")
