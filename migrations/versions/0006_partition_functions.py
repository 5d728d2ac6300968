"""Partition functions for the partitioned layout (SPEC 8.1), and a new partitioned table's first
partitions

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24

``maintain_partitions`` and ``drop_detached_partitions`` (maintd/partitions.py), with the helpers
they call, in every schema whatever its layout: ``maintd migrate --convert partitioned`` and the
leader use them. They run as their owner (this migration's role, the schema's owner), with
``search_path`` pinned, so that the daemon's role does partition DDL without DDL rights; EXECUTE is
revoked from PUBLIC and granted by ``maintd grants``.

When migration 0001 built jobs partitioned (``layout = "partitioned"``), each final state gets its
two catch-alls and ``[partitions] premake`` steps of partitions ahead.
"""

from alembic import context, op

from maintd import partitions
from maintd.migrate import jobs_partitioned

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema = op.get_context().version_table_schema
    for statement in partitions.functions_ddl(schema):
        op.execute(statement)
    if jobs_partitioned(op):
        layout = context.config.attributes["partitions"]
        for statement in partitions.start_sql(schema, layout.step):
            op.execute(statement)
        for statement in partitions.premake_sql(schema, layout.step, layout.premake):
            op.execute(statement)


def downgrade() -> None:
    for statement in partitions.drop_functions_ddl(op.get_context().version_table_schema):
        op.execute(statement)
