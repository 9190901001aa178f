"""`eaglegen rejected`: the rows of a run that never became jobs, and why."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from core.names import check_name
from eaglegen.cli.base import (
    DatabaseUrl,
    DataDir,
    JsonFlag,
    checked_repository,
    command,
    console,
    emit_json,
    load_settings,
)
from eaglegen.report.text import inline, shown

if TYPE_CHECKING:
    from models.rejected import RejectedListing

app = typer.Typer()
DEFAULT_LIMIT = 100


@command(app)
def rejected(
    run: Annotated[str, typer.Argument(help="Run name")],
    dataset: Annotated[str | None, typer.Option(help="Only this dataset")] = None,
    reason: Annotated[
        str | None, typer.Option(help="Only this reason (invalid_json, too_long, ...)")
    ] = None,
    limit: Annotated[
        int, typer.Option(min=0, help="List at most N rows (0: all); the counts cover all")
    ] = DEFAULT_LIMIT,
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """List the rows enqueue rejected: dataset, row index, reason and the row's start,
    then how many there are by reason."""
    check_name("run", run)
    if dataset is not None:
        check_name("dataset", dataset)
    settings = load_settings(database_url=database_url, data_dir=data_dir)
    with checked_repository(settings) as repo:
        listing = repo.rejected(run, dataset=dataset, reason=reason, limit=limit or None)
    if json_out:
        emit_json(
            {
                "run": listing.run,
                "total": listing.total,
                "by_reason": listing.by_reason,
                "rows": [asdict(row) for row in listing.rows],
            }
        )
        return
    out = console(highlight=False)
    if listing.rows:
        out.print(_table(listing))
    out.print(_summary(listing, dataset, reason))


def _table(listing: RejectedListing) -> Table:
    table = Table(title=f"rejected rows of {inline(listing.run)}")
    table.add_column("dataset")
    table.add_column("row", justify="right")
    table.add_column("reason")
    table.add_column("excerpt", overflow="fold")
    for row in listing.rows:
        # Excerpts are the rows' own text: any control character in them is shown escaped.
        table.add_row(
            shown(row.dataset), f"{row.row_index:,}", shown(row.reason), shown(row.excerpt)
        )
    return table


def _summary(listing: RejectedListing, dataset: str | None, reason: str | None) -> str:
    """The count by reason, and how many of the rows the table showed."""
    scope = " ".join(
        part
        for part in (
            f"of dataset {inline(dataset)}" if dataset is not None else "",
            f"with reason {inline(reason)}" if reason is not None else "",
        )
        if part
    )
    if not listing.total:
        return f"no rejected rows in run {inline(listing.run)}{' ' + scope if scope else ''}"
    counts = ", ".join(f"{inline(r)} {n:,}" for r, n in listing.by_reason.items())
    line = f"{listing.total:,} rejected row(s){' ' + scope if scope else ''}: {counts}"
    if len(listing.rows) < listing.total:
        line += f" (the first {len(listing.rows):,} listed; --limit 0 lists all)"
    return line
