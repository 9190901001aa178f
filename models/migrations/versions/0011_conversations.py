"""conversations: rows regenerated on-policy, turn by turn

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03

A dataset with ``turns = 'all'`` (the default of datasets created from this revision on;
those before it keep 'last', what they did) answers every answer point of a multi-turn row
(core.dialogue), in order. Its row is a `conversations` row holding the row's messages and
tools as normalised; each turn is a job (`jobs.conversation_id`, `jobs.turn`), the next one
created once the one before it is settled (worker.advancer), at most once per turn (the
unique key).

The trigger tells the advancer which conversations to look at: when the state of a
conversation's latest turn changes, the conversation becomes 'waiting' (the turn is settled:
done, failed or skipped) or 'active' (the turn is queued or running again, e.g. retried).
Every path that moves a job (record, fail, lease expiry, budget skip, a requeue command)
goes through it, in the transaction that moves the job. Plain jobs never reach its body:
the WHEN clause is checked first.

`runs.trust_remote_code`: the enqueue's consent to the tokenizer's own code, which the
advancer needs to load the same tokenizer (its files' hash checked against the run's).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import BYTEA, JSON

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_TRIGGER_FUNCTION = """
CREATE FUNCTION conversation_turn_moved() RETURNS trigger AS $$
BEGIN
  UPDATE conversations
  SET state = CASE WHEN NEW.state IN ('done', 'failed', 'skipped_budget')
                   THEN 'waiting' ELSE 'active' END,
      ended_reason = NULL, updated_at = now()
  WHERE id = NEW.conversation_id AND turns = NEW.turn + 1;
  RETURN NULL;
END
$$ LANGUAGE plpgsql
"""
_TRIGGER = """
CREATE TRIGGER conversation_turn_moved AFTER UPDATE OF state ON jobs
FOR EACH ROW
WHEN (NEW.conversation_id IS NOT NULL AND OLD.state IS DISTINCT FROM NEW.state)
EXECUTE FUNCTION conversation_turn_moved()
"""


def upgrade() -> None:
    op.add_column(
        "datasets", sa.Column("turns", sa.String(8), server_default="last", nullable=False)
    )
    op.create_check_constraint("turns_known", "datasets", "turns IN ('all', 'last')")
    op.alter_column("datasets", "turns", server_default="all")
    op.add_column(
        "runs",
        sa.Column("trust_remote_code", sa.Boolean, server_default=sa.false(), nullable=False),
    )
    op.create_table(
        "conversations",
        sa.Column("id", sa.BigInteger, primary_key=True),
        sa.Column(
            "dataset_id",
            sa.BigInteger,
            sa.ForeignKey("datasets.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("row_index", sa.Integer, nullable=False),
        sa.Column("digest", BYTEA, nullable=False),
        sa.Column("source", JSON, nullable=False),
        sa.Column("points", sa.Integer, nullable=False),
        sa.Column("turns", sa.Integer, server_default="1", nullable=False),
        sa.Column("state", sa.String(16), server_default="active", nullable=False),
        sa.Column("ended_reason", sa.String(32), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now()),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now()),
        sa.UniqueConstraint("dataset_id", "digest"),
        sa.CheckConstraint(
            "state IN ('active', 'waiting', 'ended', 'done')", name="conversation_state_known"
        ),
    )
    op.create_index(
        "ix_conversations_waiting",
        "conversations",
        ["id"],
        postgresql_where=sa.text("state = 'waiting'"),
    )
    op.add_column(
        "jobs",
        sa.Column(
            "conversation_id",
            sa.BigInteger,
            sa.ForeignKey("conversations.id", ondelete="CASCADE"),
            nullable=True,
        ),
    )
    op.add_column("jobs", sa.Column("turn", sa.Integer, nullable=True))
    op.create_index(
        "ix_jobs_conversation_turn",
        "jobs",
        ["conversation_id", "turn"],
        unique=True,
        postgresql_where=sa.text("conversation_id IS NOT NULL"),
    )
    op.execute(_TRIGGER_FUNCTION)
    op.execute(_TRIGGER)


def downgrade() -> None:
    op.execute("DROP TRIGGER conversation_turn_moved ON jobs")
    op.execute("DROP FUNCTION conversation_turn_moved()")
    op.drop_index("ix_jobs_conversation_turn", table_name="jobs")
    op.drop_column("jobs", "turn")
    op.drop_column("jobs", "conversation_id")
    op.drop_index("ix_conversations_waiting", table_name="conversations")
    op.drop_table("conversations")
    op.drop_column("runs", "trust_remote_code")
    op.drop_constraint("turns_known", "datasets")
    op.drop_column("datasets", "turns")
