"""`eaglegen export`: a run's done generations as training-ready token rows."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from core.names import check_name
from eaglegen.cli.base import (
    DatabaseUrl,
    DataDir,
    JsonFlag,
    command,
    database,
    emit_json,
    err,
    load_settings,
)
from eaglegen.report.text import inline

if TYPE_CHECKING:
    from exporter.export import ExportRequest, ExportResult
    from exporter.manifest import Previous
    from models.records import ExportRun
    from models.repository import Repository

app = typer.Typer()


class ExportFormat(StrEnum):
    """What a row holds (`tokens`: the exact ids with their loss mask)."""

    tokens = "tokens"


@command(app)
def export(
    run: Annotated[str, typer.Argument(help="Run to export")],
    out: Annotated[Path, typer.Argument(help="Folder for the shards and manifest.json")],
    format_: Annotated[
        ExportFormat, typer.Option("--format", help="Row format")
    ] = ExportFormat.tokens,
    jsonl: Annotated[
        bool, typer.Option("--jsonl", help="JSON Lines shards (SpecForge/speculators rows)")
    ] = False,
    hf_dataset: Annotated[
        bool, typer.Option("--hf-dataset", help="`datasets` save_to_disk folders as shards")
    ] = False,
    datasets: Annotated[
        str | None, typer.Option(help="Only these datasets (comma-separated)")
    ] = None,
    exclude_truncated: Annotated[
        bool, typer.Option(help="Leave out generations cut at max_new_tokens")
    ] = False,
    min_completion_tokens: Annotated[
        int, typer.Option(help="Leave out generations with fewer tokens")
    ] = 0,
    max_len: Annotated[
        int | None,
        typer.Option(help="Cut rows to N ids as trainers do; drop those left without loss"),
    ] = None,
    val_fraction: Annotated[
        float, typer.Option(help="Share of rows in the val split (by a hash of seed and id)")
    ] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of the split")] = 0,
    shard_mb: Annotated[float, typer.Option(help="Size of a shard on disk, MB")] = 256.0,
    incremental: Annotated[
        bool, typer.Option(help="Add the rows the folder's export lacks, as new shards")
    ] = False,
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Write the run's done generations as shards (Parquet by default) and a manifest."""
    from exporter.export import ExportRequest, prepare
    from exporter.manifest import Options
    from exporter.rows import Filters
    from exporter.split import check_fraction
    from exporter.writers import HF_DATASET, JSONL, PARQUET

    if jsonl and hf_dataset:
        raise ValueError("--jsonl and --hf-dataset exclude each other: pick one writer")
    wanted = None if datasets is None else _dataset_names(datasets)
    options = Options(
        writer=JSONL if jsonl else HF_DATASET if hf_dataset else PARQUET,
        filters=Filters(wanted, exclude_truncated, min_completion_tokens, max_len),
        val_fraction=check_fraction(val_fraction),
        seed=seed,
    )
    request = ExportRequest(
        run=check_name("run", run),
        out=out,
        options=options,
        shard_bytes=int(shard_mb * 1e6),
        incremental=incremental,
    )
    settings = load_settings(database_url=database_url, data_dir=data_dir)
    with _export_repository(database(settings)) as repo:
        found, previous, total = prepare(repo, request)
        result = _run(repo, request, found, previous, total, quiet=json_out)
    _report(result, request, json_out)


def _dataset_names(value: str) -> tuple[str, ...]:
    names = tuple(check_name("dataset", n.strip()) for n in value.split(",") if n.strip())
    if not names:
        raise ValueError("--datasets names no dataset: give names separated by commas")
    return names


@contextmanager
def _export_repository(database_url: str) -> Iterator[Repository]:
    """A repository on an engine of its own, disposed of afterwards. Not `repository()`
    of the other commands: its sessions are ended after CONTROL_LOCK_MS idle inside a
    transaction, and the export's streaming read stays in one while it finishes a shard."""
    from models.db import make_engine
    from models.repository import Repository

    engine = make_engine(database_url, pool_size=1)
    try:
        yield Repository(engine)
    finally:
        engine.dispose()


def _run(
    repo: Repository,
    request: ExportRequest,
    run: ExportRun,
    previous: Previous | None,
    total: int,
    *,
    quiet: bool,
) -> ExportResult:
    """The export, with a progress bar on stderr unless ``quiet``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    from exporter.export import run_export

    columns = (
        "{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True, disable=quiet) as bar:
        task = bar.add_task(f"export {inline(run.name)}", total=total or None)
        return run_export(repo, request, run, previous, lambda n: bar.advance(task, n))


def _report(result: ExportResult, request: ExportRequest, json_out: bool) -> None:
    if json_out:
        emit_json(
            {
                "out": str(request.out),
                "manifest": str(request.out / "manifest.json"),
                "rows": result.tally.rows,
                "new_shards": [s.document() for s in result.shards],
                "counts": result.tally.document(),
                "total_rows": result.manifest["rows"],
            }
        )
        return
    splits: dict[str, int] = {}
    for shard in result.shards:
        splits[shard.split] = splits.get(shard.split, 0) + shard.rows
    by_split = ", ".join(f"{k} {v}" for k, v in sorted(splits.items())) or "no rows"
    removed = sum(sum(c.removed.values()) for c in result.tally.datasets.values())
    err.print(
        f"exported {result.tally.rows} row(s) ({by_split}) in {len(result.shards)} new "
        f"shard(s) to {inline(str(request.out))}; {removed} removed by filters; "
        f"manifest {inline(str(request.out / 'manifest.json'))}",
        highlight=False,
    )
