"""daemons.lock_pid: a replica is alive while *its* lock session is connected (SPEC 7.9's R)

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28

A daemon counted as alive while any session on the database was named ``maintd:<instance_id>``.
Two deployments on one database (other schemas) that use the same instance ids, as two
StatefulSets named alike in two namespaces do, kept each other's dead replicas alive: after a
replica was killed, the survivors still counted it, left its targets to lazy tries and handed
their excess over to it. The row now records its lock session's backend pid when it registers,
and readers match that pid too. A row without one (written by an older daemon during a rolling
upgrade) is matched by name alone, as before.
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema = op.get_context().version_table_schema
    op.add_column("daemons", sa.Column("lock_pid", sa.Integer), schema=schema)


def downgrade() -> None:
    schema = op.get_context().version_table_schema
    op.drop_column("daemons", "lock_pid", schema=schema)
