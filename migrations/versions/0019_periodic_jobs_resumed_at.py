"""periodic_jobs.resumed_at: when a row was last enabled again (SPEC 7.10)

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-30

A paused row's slots are taken without a job by the leader, so that resumed it does not run them.
A row paused and resumed while no leader ran had none of its pause's slots taken, and nothing
told a resume from any other change (its args, say, which keeps a due slot): the leader coming
back ran the slots of the pause as missed. The trigger now stamps ``resumed_at`` (the writing
transaction's start, as ``updated_at``) when ``enabled`` goes from false to true; the leader
counts a row's missed slots from it when it is newer than the row's newest slot.
"""

import sqlalchemy as sa
from alembic import op

from maintd.db import quote_ident

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def _channel(schema: str) -> str:
    return "maintd_periodic" if schema == "maintd" else f"{schema}_maintd_periodic"


def _function(schema: str, stamp_resume: bool) -> str:
    resume = ("\n    IF NEW.enabled AND NOT OLD.enabled THEN\n      NEW.resumed_at := now();\n    END IF;"
              if stamp_resume else "")
    return f"""
CREATE OR REPLACE FUNCTION {quote_ident(schema)}.periodic_jobs_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'UPDATE' THEN
    IF (to_jsonb(NEW) - 'error' - 'updated_at') = (to_jsonb(OLD) - 'error' - 'updated_at') THEN
      RETURN NEW;  -- only the daemon's error note changed: no change to apply
    END IF;
    NEW.updated_at := now();{resume}
  END IF;
  PERFORM pg_notify('{_channel(schema)}', coalesce(NEW.id, OLD.id));
  RETURN coalesce(NEW, OLD);
END $$"""


def upgrade() -> None:
    schema = op.get_context().version_table_schema
    op.add_column("periodic_jobs", sa.Column("resumed_at", sa.DateTime(timezone=True)), schema=schema)
    op.execute(_function(schema, stamp_resume=True))


def downgrade() -> None:
    schema = op.get_context().version_table_schema
    op.execute(_function(schema, stamp_resume=False))
    op.drop_column("periodic_jobs", "resumed_at", schema=schema)
