"""samples: several generations of each prompt, and named sampling variants

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04

A dataset asks ``samples`` generations of each prompt (of each conversation, each sample its
own conversation) and may name ``variants``: sampling params and chat-template kwargs, each
with a weight (core.samples). Each job records its sample index, its variant and the
``sampling_seed`` it is sent with.

A prompt's ids are stored once: a job whose prompt ids another job of its dataset already
holds (a lower sample of the same row, templated the same way) stores none and names that
job (``prompt_of``); readers take the ids and messages from it. ``prompt_job`` names the
job of the prompt's sample 0 (NULL: the job is that one, or a job of a single-sample
dataset): the export's ids and its train/val split go by it. Conversations get the same
columns, ``first_sample`` naming the conversation of sample 0.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def _sample_columns(table: str) -> None:
    op.add_column(table, sa.Column("sample", sa.Integer, server_default="0", nullable=False))
    op.add_column(table, sa.Column("variant", sa.String(64), nullable=True))
    op.add_column(table, sa.Column("sampling_seed", sa.BigInteger, nullable=True))


def upgrade() -> None:
    op.add_column("datasets", sa.Column("samples", sa.Integer, server_default="1", nullable=False))
    op.create_check_constraint("samples_positive", "datasets", "samples >= 1")
    op.add_column(
        "datasets",
        sa.Column("variants", JSONB, server_default=sa.text("'[]'::jsonb"), nullable=False),
    )
    _sample_columns("jobs")
    op.add_column(
        "jobs",
        sa.Column("prompt_job", sa.BigInteger, sa.ForeignKey("jobs.id", ondelete="CASCADE")),
    )
    op.add_column(
        "jobs",
        sa.Column("prompt_of", sa.BigInteger, sa.ForeignKey("jobs.id", ondelete="CASCADE")),
    )
    op.alter_column("jobs", "input_ids", nullable=True)
    op.alter_column("jobs", "messages", nullable=True)
    op.create_check_constraint(
        "prompt_stored_once", "jobs", "(prompt_of IS NULL) = (input_ids IS NOT NULL)"
    )
    _sample_columns("conversations")
    op.add_column(
        "conversations",
        sa.Column(
            "first_sample",
            sa.BigInteger,
            sa.ForeignKey("conversations.id", ondelete="CASCADE"),
            nullable=True,
        ),
    )


def downgrade() -> None:
    for column in ("first_sample", "sampling_seed", "variant", "sample"):
        op.drop_column("conversations", column)
    op.drop_constraint("prompt_stored_once", "jobs")
    op.alter_column("jobs", "messages", nullable=False)
    op.alter_column("jobs", "input_ids", nullable=False)
    for column in ("prompt_of", "prompt_job", "sampling_seed", "variant", "sample"):
        op.drop_column("jobs", column)
    op.drop_column("datasets", "variants")
    op.drop_constraint("samples_positive", "datasets")
    op.drop_column("datasets", "samples")
