"""runs.family: the model family whose layout a run's generations have

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03

Readers (stats, show, sample, export) cut a generation into reasoning, answer and tool calls
by its model family's special tokens (core.families). The family is detected at enqueue from
the tokenizer's special tokens and chat template, or named by the run file, and recorded
here, so that every reader reads a run the one way its enqueue decided. Runs created before
this revision have none (NULL): readers detect it again from the run's tokenizer, and the
next enqueue into the run records it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("family", sa.String(32), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "family")
