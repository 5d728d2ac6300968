"""jobs_exhausted_idx: waiting jobs with no attempt left, for the rescuer (issue 13)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23

The workers' claim passes over an ``available`` job with ``attempt >= max_attempts`` (its
``attempt + 1`` would overflow the smallint at 32767 and fail the whole claim statement); the
rescuer discards such waiting jobs with the reason in ``errors``. This partial index holds exactly
them, so finding them is one probe of a normally empty index.

Built ``CONCURRENTLY`` like 0004 (workers keep writing while it builds); a build interrupted
half-way leaves an invalid index, which the next ``migrate`` drops and builds again.
"""

from alembic import op

from maintd.migrate import build_index_concurrently, drop_index_concurrently

revision = "0005"
down_revision = "0004"  # 0004_finalized_queue_index
branch_labels = None
depends_on = None

INDEX = "jobs_exhausted_idx"
WHERE = "state IN ('available', 'scheduled', 'retryable') AND attempt >= max_attempts"


def upgrade() -> None:
    build_index_concurrently(op, INDEX, f"(id) WHERE {WHERE}")


def downgrade() -> None:
    drop_index_concurrently(op, INDEX)
