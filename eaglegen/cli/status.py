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
    from eaglegen.report.status import status_document, status_table

    settings = load_settings(database_url=database_url, data_dir=data_dir)
    with repository(database(settings)) as repo:
        counts = repo.counts(run)
    if json_out:
        emit_json(status_document(counts))
    else:
        Console().print(status_table(counts))
