"""Alembic environment: online migrations against the configured URL."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from models.schema import Base

target_metadata = Base.metadata


def run_migrations_online() -> None:
    """Run every pending migration in one transaction."""
    url = context.config.get_main_option("sqlalchemy.url")
    assert url is not None, "alembic_config() sets sqlalchemy.url"
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


run_migrations_online()
