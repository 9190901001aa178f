"""runs: chat template kwargs, context length and package versions

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "runs",
        sa.Column("chat_template_kwargs", postgresql.JSONB(), server_default="{}", nullable=False),
    )
    op.add_column("runs", sa.Column("max_context_len", sa.Integer(), nullable=True))
    op.add_column(
        "runs",
        sa.Column("package_versions", postgresql.JSONB(), server_default="{}", nullable=False),
    )


def downgrade() -> None:
    op.drop_column("runs", "package_versions")
    op.drop_column("runs", "max_context_len")
    op.drop_column("runs", "chat_template_kwargs")
