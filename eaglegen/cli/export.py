"""`eaglegen export`: a run's done generations as training-ready token rows or conversations."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
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
    console,
    database,
    emit_json,
    err,
    load_settings,
)
from eaglegen.report.text import inline

if TYPE_CHECKING:
    from exporter.export import ExportRequest, ExportResult
    from exporter.manifest import Previous
    from exporter.tokenizer import RunTokenizer
    from models.records import ExportRun
    from models.repository import Repository

app = typer.Typer()


class ExportFormat(StrEnum):
    """What a row holds (`tokens`: the exact ids with their loss mask)."""

    tokens = "tokens"
    conversations = "conversations"


class Consumer(StrEnum):
    """The trainer the export's folder is laid out for (exporter.layouts)."""

    hf = "hf"
    specforge = "specforge"
    speculators = "speculators"
    modelopt = "modelopt"


@command(app)
def export(
    run: Annotated[str, typer.Argument(help="Run to export")],
    out: Annotated[Path, typer.Argument(help="Folder for the shards and manifest.json")],
    for_: Annotated[
        Consumer,
        typer.Option(
            "--for",
            help="The trainer that loads the folder: hf (`datasets` shards), specforge (one "
            "JSONL per split for data.prompts_path), speculators (a torch Dataset folder per "
            "split for --data-path), modelopt (its conversation files)",
        ),
    ] = Consumer.hf,
    format_: Annotated[
        ExportFormat | None,
        typer.Option(
            "--format",
            help="Row format [default: tokens; conversations for --for modelopt]",
            show_default=False,
        ),
    ] = None,
    jsonl: Annotated[
        bool, typer.Option("--jsonl", help="--for hf: JSON Lines shards instead of Parquet")
    ] = False,
    hf_dataset: Annotated[
        bool,
        typer.Option("--hf-dataset", help="--for hf: `datasets` save_to_disk folders as shards"),
    ] = False,
    datasets: Annotated[
        str | None, typer.Option(help="Only these datasets (comma-separated)")
    ] = None,
    exclude_truncated: Annotated[
        bool | None,
        typer.Option(
            "--exclude-truncated/--include-truncated",
            help="Leave out generations cut at max_new_tokens "
            "[default: on for conversations, off for tokens]",
            show_default=False,
        ),
    ] = None,
    only_valid: Annotated[
        bool,
        typer.Option(
            help="Only generations whose invariants held: think-end present where the prompt "
            "opened reasoning, tool-call sections balanced, call arguments JSON"
        ),
    ] = False,
    require_exact: Annotated[
        bool,
        typer.Option(help="Conversations: drop rows whose round trip is not the recorded ids"),
    ] = False,
    merge_turns: Annotated[
        bool,
        typer.Option(
            help="Tokens: a conversation whose every turn's prompt extends the turn before it "
            "as one row, trained over every turn's output (the others: one row per turn); "
            "only conversations done or ended"
        ),
    ] = False,
    trust_remote_code: Annotated[
        bool, typer.Option(help="Let the run's tokenizer run its own Python code to load")
    ] = False,
    min_completion_tokens: Annotated[
        int, typer.Option(help="Leave out generations with fewer tokens")
    ] = 0,
    max_len: Annotated[
        int | None,
        typer.Option(help="Cut rows to N ids as trainers do; drop those left without loss"),
    ] = None,
    samples_per_prompt: Annotated[
        int | None,
        typer.Option(help="Keep samples 0 to N-1 of each prompt (of a dataset with several)"),
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
    """Write the run's done generations in the layout a trainer loads (a folder per split,
    the manifest beside them) and say how to load it."""
    from exporter.export import ExportRequest, load_tokenizer, prepare
    from exporter.layouts import CONVERSATIONS, layout_for
    from exporter.manifest import Options
    from exporter.rows import Filters
    from exporter.split import check_fraction

    layout = layout_for(
        for_.value,
        None if format_ is None else format_.value,
        jsonl=jsonl,
        hf_dataset=hf_dataset,
    )
    conversations = layout.format == CONVERSATIONS
    if require_exact and not conversations:
        raise ValueError("--require-exact checks conversations: add --format conversations")
    wanted = None if datasets is None else _dataset_names(datasets)
    filters = Filters(
        wanted,
        conversations if exclude_truncated is None else exclude_truncated,
        min_completion_tokens,
        max_len,
        only_valid=only_valid,
        require_exact=require_exact,
        samples_per_prompt=samples_per_prompt,
    )
    options = Options(
        writer=layout.writer,
        consumer=layout.consumer,
        filters=filters,
        val_fraction=check_fraction(val_fraction),
        seed=seed,
        format=layout.format,
        style=layout.style,
        merge_turns=merge_turns,
    )
    request = ExportRequest(
        run=check_name("run", run),
        out=out,
        options=options,
        shard_bytes=int(shard_mb * 1e6),
        incremental=incremental,
        trust_remote_code=trust_remote_code,
    )
    settings = load_settings(database_url=database_url, data_dir=data_dir)
    url = database(settings)
    before = _entries(out)
    try:
        with _export_repository(url) as repo:
            found, previous, total = prepare(repo, request)
            tokenizer = load_tokenizer(found, request)
            if tokenizer is not None and not tokenizer.template_matches_run and not json_out:
                err.print(
                    f"warning: the chat template at {inline(found.tokenizer_path)} is not the "
                    "one the run recorded (its sha256 differs): the round trip compares with it",
                    highlight=False,
                )
            result = _run(repo, request, found, previous, total, tokenizer, quiet=json_out)
    except Exception as exc:
        from models.db import lost_database

        reason = lost_database(exc)
        if reason is None:
            raise
        raise ValueError(_lost(url, reason, request, _written(before, _entries(out)))) from exc
    _report(result, request, json_out)


def _entries(out: Path) -> dict[str, tuple[int, int]]:
    """The names in the export folder and in its split folders (none when it does not
    exist), temporary ones aside, each with what tells a file from one written later under
    its name (a re-run of a killed first export removes that export's shards and writes
    shards of the same names)."""
    from exporter.files import TMP_PREFIX
    from exporter.split import TRAIN, VAL

    if not out.is_dir():
        return {}
    found = {}
    paths = [p for p in out.iterdir() if not p.name.startswith(TMP_PREFIX)]
    for split in (TRAIN, VAL):
        folder = out / split
        if folder.is_dir() and not folder.is_symlink():
            with suppress(FileNotFoundError):
                paths += folder.iterdir()
    for path in paths:
        if path.name in (TRAIN, VAL) and path.parent == out:
            continue  # the folder: what is in it is listed
        with suppress(FileNotFoundError):  # removed since it was listed
            st = path.lstat()
            found[path.relative_to(out).as_posix()] = (st.st_ino, st.st_mtime_ns)
    return found


def _written(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """The names of ``after`` that are new or another file than in ``before``."""
    return sorted(name for name, ident in after.items() if before.get(name) != ident)


# Shards a lost-database error names; the rest are counted.
_NAMED_SHARDS = 5


def _lost(url: str, reason: str, request: ExportRequest, written: list[str]) -> str:
    """What a lost database leaves behind and what to do, in one sentence. ``written``:
    the complete shards this pass wrote before it (a shard cut short is removed)."""
    from core.urls import redact, scrub

    head = f"lost Postgres at {redact(url)} during the export: {scrub(reason, url)}"
    out = inline(str(request.out))
    if not written:
        return f"{head}. Nothing was written to {out}: run the export again"
    names = ", ".join(map(inline, written[:_NAMED_SHARDS]))
    if len(written) > _NAMED_SHARDS:
        names += f" and {len(written) - _NAMED_SHARDS} more"
    shards = f"{len(written)} complete shard(s) were written to {out} ({names})"
    if request.incremental:
        return (
            f"{head}. {shards}, but its manifest.json does not list them (the export there "
            "is as it was): remove them and run the export with --incremental again"
        )
    return (
        f"{head}. {shards}, but no manifest.json: they are no export yet; run the export "
        "again (it removes them first)"
    )


def _removed(names: list[str], request: ExportRequest) -> str:
    """What an earlier export had left in the folder and this one removed, in one line."""
    shown = ", ".join(map(inline, names[:_NAMED_SHARDS]))
    if len(names) > _NAMED_SHARDS:
        shown += f" and {len(names) - _NAMED_SHARDS} more"
    return (
        f"removed {len(names)} file(s) an unfinished export had left in "
        f"{inline(str(request.out))}: {shown}"
    )


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
    tokenizer: RunTokenizer | None,
    *,
    quiet: bool,
) -> ExportResult:
    """The export, with a progress bar on stderr unless ``quiet``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    from exporter.export import run_export

    columns = (
        "{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
    )
    stderr = console(stderr=True)
    # Off the terminal a transient bar leaves only a blank line behind.
    shown = not quiet and stderr.is_terminal
    with Progress(*columns, console=stderr, transient=True, disable=not shown) as bar:
        task = bar.add_task(f"export {inline(run.name)}", total=total or None)
        return run_export(
            repo, request, run, previous, lambda n: bar.advance(task, n), tokenizer=tokenizer
        )


def _report(result: ExportResult, request: ExportRequest, json_out: bool) -> None:
    from exporter.folder import USAGE

    if json_out:
        emit_json(
            {
                "out": str(request.out),
                "manifest": str(request.out / "manifest.json"),
                "rows": result.tally.rows,
                "new_shards": [s.document() for s in result.shards],
                "counts": result.tally.document(),
                "total_rows": result.manifest["rows"],
                "roundtrip": None if result.roundtrip is None else result.roundtrip.document(),
                "removed": result.removed,
                "how_to_load": str(request.out / USAGE),
            }
        )
        return
    if result.removed:
        err.print(_removed(result.removed, request), highlight=False, soft_wrap=True)
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
    _report_conversations(result)
    if result.roundtrip is not None:
        _report_round_trips(result)
    console().print(result.usage, end="", highlight=False, markup=False, soft_wrap=True)


def _report_conversations(result: ExportResult) -> None:
    """Per dataset read by conversation: how many became one row, why the others did not,
    and the done turns left for a later pass."""
    under_way: dict[str, int] = result.manifest.get("conversation_turns_under_way") or {}
    read = {
        n: c.conversations for n, c in result.tally.datasets.items() if c.conversations is not None
    }
    for name in sorted(set(read) | set(under_way)):
        line = f"conversations {inline(name)}:"
        conversations = read.get(name)
        if conversations is not None:
            line += (
                f" {conversations.merged}/{conversations.read} as one row "
                f"({conversations.merged_turns} turn(s))"
            )
            if conversations.unmerged_turns:
                why = ", ".join(f"{k} {v}" for k, v in sorted(conversations.unmerged_turns.items()))
                line += f"; turn(s) left one row per turn: {why}"
        if under_way.get(name):
            line += (
                f"{';' if conversations is not None else ''} {under_way[name]} done turn(s) "
                "of conversations still under way, left for a later --incremental export"
            )
        err.print(line, highlight=False, soft_wrap=True)


def _report_round_trips(result: ExportResult) -> None:
    """Per dataset: how many rows re-templated to the recorded ids, and the first
    difference of one that did not."""
    assert result.roundtrip is not None
    for name, trips in sorted(result.roundtrip.datasets.items()):
        line = f"round trip {inline(name)}: {trips.exact}/{trips.checked} exact"
        if trips.checked > trips.exact:
            line += (
                f" ({trips.text_equal} same text with other ids; differs in prompt "
                f"{trips.differs_in.get('prompt', 0)}, output {trips.differs_in.get('output', 0)}"
                f"; template errors {trips.template_errors})"
            )
        err.print(line, highlight=False, soft_wrap=True)
        if trips.examples:
            ex = trips.examples[0]
            where = ex["error"] or (
                f"at id {ex['position']} ({ex['part']}): recorded {ex['recorded']!r}, "
                f"re-templated {ex['rendered']!r}"
            )
            err.print(f"  e.g. row {ex['id']} {inline(where)}", highlight=False, soft_wrap=True)
