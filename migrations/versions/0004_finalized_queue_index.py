"""jobs_finalized_queue_idx: final jobs by (state, queue, finalized_at, id), for exact cleaner passes

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23

The cleaner used to resume each pass where the previous one ended, so that rows kept by a longer
per-queue retention were not walked again every pass; a row finalized further back than that
(imported, back-dated, finished by a long transaction) then waited up to an hour. With this index
every pass starts at the first expired row of the queues it covers (a loose index scan, one probe
per distinct queue), and a per-queue retention walks only its own queue's rows. The dashboard's
"finished jobs of a queue, newest first" reads it too.

Built ``CONCURRENTLY`` (outside a transaction), so workers keep writing while it builds on a large
table; a build interrupted half-way leaves an invalid index, which the next ``migrate`` drops and
builds again.
"""

from alembic import op

from maintd.migrate import build_index_concurrently, drop_index_concurrently

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

INDEX = "jobs_finalized_queue_idx"


def upgrade() -> None:
    build_index_concurrently(op, INDEX, "(state, queue, finalized_at, id) WHERE finalized_at IS NOT NULL")


def downgrade() -> None:
    drop_index_concurrently(op, INDEX)
