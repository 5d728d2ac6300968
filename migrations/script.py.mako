"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""
from alembic import op
import sqlalchemy as sa
${imports if imports else ""}

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def upgrade() -> None:
    schema = op.get_context().version_table_schema
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    schema = op.get_context().version_table_schema
    ${downgrades if downgrades else "pass"}
