"""`eaglegen status`: jobs by state per dataset."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from eaglegen.cli.base import (
    DatabaseUrl,
    DataDir,
    JsonFlag,
    command,
    database,
    emit_json,
    err,
    load_settings,
    repository,
)

app = typer.Typer()


@command(app)
def status(
    run: Annotated[str | None, typer.Option(help="Only this run")] = None,
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Jobs by state per dataset."""
    from eaglegen.report.status import connections_warning, status_document, status_table

    settings = load_settings(database_url=database_url, data_dir=data_dir)
    with repository(database(settings)) as repo:
        counts = repo.counts(run)
        in_use, limit = repo.postgres_connections()
    if json_out:
        document = status_document(counts)
        document["postgres_connections"] = {"in_use": in_use, "max": limit}
        emit_json(document)
    else:
        Console().print(status_table(counts))
    if (warning := connections_warning(in_use, limit)) is not None:
        err.print(f"[yellow]warning:[/] {warning}", highlight=False)
