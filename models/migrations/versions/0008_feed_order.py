"""The feeder's order: a seed per run, a sort key, published_at and not_before per job

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01

Redis used to carry one message per queued job, in file order. Now one feeder publishes a
bounded window in each dataset's seeded order (worker.feeder, models.order). Existing runs
get seed 0 and their jobs the keys that seed gives (the same formula, in SQL). Their queued
jobs were all published by the code before this revision, so they count as published: the
reconciler publishes again any whose message is missing from Redis.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from models.order import SORT_KEY_SQL

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

FILL_KEYS = (
    "UPDATE jobs j SET sort_key = "
    + SORT_KEY_SQL.format(seed="r.order_seed", digest="j.prompt_sha256")
    + " FROM datasets d JOIN runs r ON r.id = d.run_id WHERE d.id = j.dataset_id"
)


def upgrade() -> None:
    op.add_column(
        "runs", sa.Column("order_seed", sa.BigInteger(), server_default="0", nullable=False)
    )
    op.add_column(
        "jobs", sa.Column("sort_key", sa.BigInteger(), server_default="0", nullable=False)
    )
    op.add_column("jobs", sa.Column("published_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("jobs", sa.Column("not_before", sa.DateTime(timezone=True), nullable=True))
    op.execute(FILL_KEYS)
    op.execute("UPDATE jobs SET published_at = now() WHERE state = 'queued'")
    op.create_index(
        "ix_jobs_feed_order",
        "jobs",
        ["dataset_id", "sort_key"],
        postgresql_where=sa.text("state = 'queued' AND published_at IS NULL"),
    )
    op.create_index(
        "ix_jobs_feed_published",
        "jobs",
        ["dataset_id"],
        postgresql_where=sa.text("state = 'queued' AND published_at IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_feed_published", "jobs")
    op.drop_index("ix_jobs_feed_order", "jobs")
    for name in ("not_before", "published_at", "sort_key"):
        op.drop_column("jobs", name)
    op.drop_column("runs", "order_seed")
