"""Engine construction and migrations; built once per process, after any fork."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine

from eaglegen.settings import normalize_database_url

MIGRATIONS = Path(__file__).parent / "migrations"


def make_engine(url: str, *, pool_size: int = 5) -> Engine:
    """A pooled engine whose connections are checked before use (Postgres may restart)."""
    return create_engine(
        normalize_database_url(url),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        future=True,
    )


def alembic_config(url: str) -> Config:
    """An Alembic config pointing at this package's migrations and ``url``."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # ConfigParser interpolation would eat '%' in passwords.
    config.set_main_option("sqlalchemy.url", normalize_database_url(url).replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at ``url`` to ``revision``."""
    command.upgrade(alembic_config(url), revision)
