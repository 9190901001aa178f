"""budget ledger per job, lease index, reasoning fidelity columns

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("think_end_id", sa.Integer(), nullable=True))
    op.add_column(
        "jobs", sa.Column("reserved_tokens", sa.Integer(), server_default="0", nullable=False)
    )
    op.create_check_constraint("reserved_nonnegative", "jobs", "reserved_tokens >= 0")
    op.create_check_constraint(
        "ledger_nonnegative", "datasets", "used_tokens >= 0 AND reserved_tokens >= 0"
    )
    op.create_index(
        "ix_jobs_running_lease",
        "jobs",
        ["lease_until"],
        postgresql_where=sa.text("state = 'running'"),
    )
    op.add_column("generations", sa.Column("think_end_present", sa.Boolean(), nullable=True))
    op.add_column("generations", sa.Column("reasoning_tokens", sa.Integer(), nullable=True))
    op.add_column("generations", sa.Column("answer_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("generations", "answer_tokens")
    op.drop_column("generations", "reasoning_tokens")
    op.drop_column("generations", "think_end_present")
    op.drop_index("ix_jobs_running_lease", table_name="jobs")
    op.drop_constraint("ledger_nonnegative", "datasets")
    op.drop_constraint("reserved_nonnegative", "jobs")
    op.drop_column("jobs", "reserved_tokens")
    op.drop_column("runs", "think_end_id")
