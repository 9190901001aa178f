"""`eaglegen db`: the database schema."""

from __future__ import annotations

import typer

from eaglegen.cli.base import DatabaseUrl, DataDir, command, database, err, load_settings

app = typer.Typer(no_args_is_help=True, help="Database schema.")


@command(app, "upgrade")
def upgrade(database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Create or migrate the schema to the latest revision."""
    from models.db import upgrade as migrate

    settings = load_settings(database_url=database_url, data_dir=data_dir)
    migrate(database(settings, check_schema=False))
    err.print("database schema is at the latest revision")
