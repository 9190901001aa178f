"""jobs.opens_reasoning: whether a job's prompt opens a reasoning block, decided per job

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

Until 0004 a run decided it once, from a probe prompt whose last token had to be the
think-start token, and recorded `runs.think_end_id` only then. Jobs of such runs opened the
block; the upgrade marks them so. From now on `runs.think_end_id` is the tokenizer's
think-end id whenever it has a think pair, and each job says whether to expect it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "jobs",
        sa.Column("opens_reasoning", sa.Boolean(), server_default=sa.false(), nullable=False),
    )
    op.execute(
        "UPDATE jobs SET opens_reasoning = true FROM datasets, runs"
        " WHERE jobs.dataset_id = datasets.id AND datasets.run_id = runs.id"
        " AND runs.think_end_id IS NOT NULL"
    )


def downgrade() -> None:
    op.drop_column("jobs", "opens_reasoning")
