"""runs.vocab_size: the run's tokenizer size, the bound every stored output id is checked in

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

A worker refuses an output id outside [0, vocab_size): an id the tokenizer cannot decode is
not the model's text. Runs created before this revision have none, and their output ids
are checked only for being non-negative integers until an enqueue records it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("vocab_size", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "vocab_size")
