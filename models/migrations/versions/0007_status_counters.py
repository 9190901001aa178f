"""Counters for status: jobs by state and done tokens per dataset, generations' dataset
and time index, and failed attempts by server and class

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

`eaglegen status` scanned every job and joined every generation, a cost that grows with
the run. The counters are moved in the transaction that moves a job (models.counters), and
the windowed rates read the last minutes by index. Existing datasets get their counters
from their jobs here, so a run created before this revision shows right.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

COUNTERS = (
    "jobs_queued",
    "jobs_running",
    "jobs_done",
    "jobs_failed",
    "jobs_skipped",
    "done_prompt_tokens",
    "done_completion_tokens",
)

FILL_COUNTERS = """
UPDATE datasets d SET
    jobs_queued = c.queued, jobs_running = c.running, jobs_done = c.done,
    jobs_failed = c.failed, jobs_skipped = c.skipped,
    done_prompt_tokens = c.prompt, done_completion_tokens = c.completion,
    first_done_at = c.first_at, last_done_at = c.last_at
FROM (
    SELECT j.dataset_id,
        count(*) FILTER (WHERE j.state = 'queued') AS queued,
        count(*) FILTER (WHERE j.state = 'running') AS running,
        count(*) FILTER (WHERE j.state = 'done') AS done,
        count(*) FILTER (WHERE j.state = 'failed') AS failed,
        count(*) FILTER (WHERE j.state = 'skipped_budget') AS skipped,
        coalesce(sum(g.prompt_tokens) FILTER (WHERE j.state = 'done'), 0) AS prompt,
        coalesce(sum(g.completion_tokens) FILTER (WHERE j.state = 'done'), 0) AS completion,
        min(g.created_at) FILTER (WHERE j.state = 'done') AS first_at,
        max(g.created_at) FILTER (WHERE j.state = 'done') AS last_at
    FROM jobs j LEFT JOIN generations g ON g.job_id = j.id
    GROUP BY j.dataset_id
) c
WHERE c.dataset_id = d.id
"""


def upgrade() -> None:
    for name in COUNTERS:
        op.add_column(
            "datasets", sa.Column(name, sa.BigInteger(), server_default="0", nullable=False)
        )
    for name in ("first_done_at", "last_done_at"):
        op.add_column("datasets", sa.Column(name, sa.DateTime(timezone=True), nullable=True))
    op.execute(FILL_COUNTERS)
    op.add_column("generations", sa.Column("dataset_id", sa.BigInteger(), nullable=True))
    op.execute(
        "UPDATE generations g SET dataset_id = j.dataset_id FROM jobs j WHERE j.id = g.job_id"
    )
    op.alter_column("generations", "dataset_id", nullable=False)
    op.create_index("ix_generations_created_at", "generations", ["created_at"])
    op.create_table(
        "failed_attempts",
        sa.Column("id", sa.BigInteger(), primary_key=True),
        sa.Column(
            "dataset_id",
            sa.BigInteger(),
            sa.ForeignKey("datasets.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("server", sa.Text(), nullable=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    )
    op.create_index("ix_failed_attempts_at", "failed_attempts", ["at"])


def downgrade() -> None:
    op.drop_table("failed_attempts")
    op.drop_index("ix_generations_created_at", "generations")
    op.drop_column("generations", "dataset_id")
    for name in (*COUNTERS, "first_done_at", "last_done_at"):
        op.drop_column("datasets", name)
