"""jobs.prompt_sha256 as the 32-byte digest, jobs.messages as json

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29

Both make the producer's insert cheaper (BENCHMARKS.md, "Insert"): the
unique index (dataset_id, prompt_sha256) compares 32 bytes instead of 64 characters under
the database's collation, and json is stored as written where jsonb parses and converts.
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "ALTER TABLE jobs ALTER COLUMN prompt_sha256 TYPE bytea USING decode(prompt_sha256, 'hex')"
    )
    op.execute("ALTER TABLE jobs ALTER COLUMN messages TYPE json USING messages::json")


def downgrade() -> None:
    # A message holding a NUL character (json can, jsonb cannot) makes this fail.
    op.execute("ALTER TABLE jobs ALTER COLUMN messages TYPE jsonb USING messages::jsonb")
    op.execute(
        "ALTER TABLE jobs ALTER COLUMN prompt_sha256 TYPE varchar(64)"
        " USING encode(prompt_sha256, 'hex')"
    )
