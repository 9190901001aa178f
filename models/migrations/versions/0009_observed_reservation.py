"""A dataset's reservation policy and its observed estimate

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02

Every job reserved its worst case (max_new_tokens), so near its budget a dataset ran only
room / max_new_tokens jobs at once. A dataset now chooses (`reserve`): "observed" reserves a
high quantile of its completion lengths once enough are recorded, "worst_case" keeps the old
rule. Existing datasets take the default, "observed", too: the policy only decides what the
next claims reserve (a running job keeps what it holds and settles it exactly), and their
estimate starts empty, so they reserve the worst case until their next refresh
(docs/design.md §4, "Budget ledger").
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "datasets",
        sa.Column("reserve", sa.String(16), server_default="observed", nullable=False),
    )
    op.add_column("datasets", sa.Column("observed_reserve_tokens", sa.Integer(), nullable=True))
    op.create_check_constraint("reserve_known", "datasets", "reserve IN ('observed', 'worst_case')")


def downgrade() -> None:
    op.drop_constraint("reserve_known", "datasets", type_="check")
    op.drop_column("datasets", "observed_reserve_tokens")
    op.drop_column("datasets", "reserve")
