"""`eaglegen stats`, `eaglegen show` and `eaglegen sample`: the data-quality report of a
run, and its generations decoded with their special tokens visible."""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
    console,
    database,
    emit_json,
    err,
    load_settings,
)
from eaglegen.report.text import inline

if TYPE_CHECKING:
    from core.tokenizer import RunTokenizer
    from eaglegen.report.quality import Report
    from eaglegen.report.samples import SampleView
    from models.stats import Detail, StatsQueries, StatsRun

app = typer.Typer()

RunArg = Annotated[
    str | None, typer.Argument(help="Run to report on (default: the only run there is)")
]
TokenizerPath = Annotated[
    Path | None,
    typer.Option("--tokenizer", help="The run's tokenizer, when not at its recorded path"),
]
TrustRemoteCode = Annotated[
    bool, typer.Option(help="Let the tokenizer run its own Python code (tokenization_*.py)")
]
Seed = Annotated[int, typer.Option(help="Seed of the sample")]
PromptTail = Annotated[int, typer.Option(min=0, help="Prompt ids shown before the output")]


class Where(StrEnum):
    """Which generations `sample` picks from."""

    truncated = "truncated"
    no_think_end = "no-think-end"
    tool_calls = "tool-calls"


@command(app)
def stats(
    run: RunArg = None,
    dataset: Annotated[
        list[str] | None, typer.Option("--dataset", help="Only this dataset (repeatable)")
    ] = None,
    html: Annotated[Path | None, typer.Option(help="Write the report as one HTML page")] = None,
    plots: Annotated[Path | None, typer.Option(help="Write the plots as PNGs here")] = None,
    sample: Annotated[
        int | None,
        typer.Option(min=1, help="Check tool calls in a seeded sample of N (default: all)"),
    ] = None,
    seed: Seed = 0,
    tokenizer: TokenizerPath = None,
    trust_remote_code: TrustRemoteCode = False,
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """The data-quality report of a run, per dataset and in all: lengths, truncation,
    reasoning, tool calls, empty answers, cache hits, latency."""
    from eaglegen.report.stats import Scope, collect, run_tokenizer, terminal, warning_lines

    settings = load_settings(database_url=database_url, data_dir=data_dir)
    with _queries(database(settings)) as queries:
        found = _run(queries, run)
        scope = Scope(_datasets(found, dataset or []), sample, seed)
        tok = run_tokenizer(found, tokenizer, trust_remote_code=trust_remote_code)
        with _progress(quiet=json_out) as advance:
            report = collect(queries, found, scope, tok, advance)
    for line in warning_lines(report):
        err.print(line, highlight=False, soft_wrap=True)
    if json_out:
        emit_json(report.document())
    else:
        console().print(terminal(report))
    _write_files(report, html, plots)


@command(app)
def show(
    job_id: Annotated[int, typer.Argument(help="The job to show")],
    prompt_tail: PromptTail = 48,
    tokenizer: TokenizerPath = None,
    trust_remote_code: TrustRemoteCode = False,
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """One job's generation decoded: prompt tail, reasoning, answer, tool calls, stop; a
    conversation's turn shows its whole conversation, turn by turn."""
    from eaglegen.report.stats import run_tokenizer

    settings = load_settings(database_url=database_url, data_dir=data_dir)
    with _queries(database(settings)) as queries:
        detail = queries.detail(job_id)
        if detail is None:
            raise ValueError(f"no job {job_id}")
        turns = [queries.detail(i) for i in queries.conversation_job_ids(job_id)]
        found = _run(queries, detail.run)
        tok = run_tokenizer(found, tokenizer, trust_remote_code=trust_remote_code)
    details = [d for d in turns if d is not None] if detail.turn is not None else [detail]
    _print_views(found, tok, details, prompt_tail, json_out, single=len(details) == 1)


@command(app)
def sample(
    run: RunArg = None,
    dataset: Annotated[str, typer.Option("--dataset", help="Dataset to sample from")] = "",
    n: Annotated[int, typer.Option("-n", min=1, help="How many generations")] = 5,
    where: Annotated[Where | None, typer.Option(help="Only generations of this kind")] = None,
    seed: Seed = 0,
    prompt_tail: PromptTail = 48,
    tokenizer: TokenizerPath = None,
    trust_remote_code: TrustRemoteCode = False,
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """A seeded sample of a dataset's generations, decoded as `eaglegen show` does."""
    from eaglegen.report.stats import run_tokenizer

    if not dataset:
        raise ValueError("--dataset is required: name the dataset to sample from")
    settings = load_settings(database_url=database_url, data_dir=data_dir)
    with _queries(database(settings)) as queries:
        found = _run(queries, run)
        [name] = _datasets(found, [dataset])
        tok = run_tokenizer(found, tokenizer, trust_remote_code=trust_remote_code)
        markers = sorted(tok.markers().call_ids)
        if where == Where.tool_calls and not markers:
            raise ValueError(
                f"run {found.name!r} is of model family {tok.family.name}, whose tool calls "
                "are not read: --where tool-calls has nothing to pick"
            )
        kind = None if where is None else where.value
        ids = queries.sample_ids(found.id, name, n, seed, kind, markers)
        details = [d for d in map(queries.detail, ids) if d is not None]
    if not details:
        what = "" if where is None else f" {where.value}"
        err.print(f"no{inline(what)} generation in dataset {inline(name)}", highlight=False)
    _print_views(found, tok, details, prompt_tail, json_out, single=False)


def _print_views(
    run: StatsRun,
    tok: RunTokenizer,
    details: list[Detail],
    tail: int,
    json_out: bool,
    *,
    single: bool,
) -> None:
    from core.anatomy import THINK_END
    from eaglegen.report.samples import render, view

    views: list[SampleView] = [
        view(d, tok.decode, tok.markers(d.stop_token_ids), tail, family=tok.family) for d in details
    ]
    if json_out:
        documents = [v.document() for v in views]
        emit_json(documents[0] if single else {"run": run.name, "samples": documents})
        return
    out = console()
    think_end = tok.token(run.think_end_id, THINK_END)
    for v in views:
        out.print(render(v, think_end), highlight=False)


@contextmanager
def _queries(database_url: str) -> Iterator[StatsQueries]:
    """The report's queries on an engine of their own: not `repository()`'s, whose sessions
    end after CONTROL_LOCK_MS idle in a transaction, and the streamed read of the token
    checks sits idle in one while the client decodes a batch."""
    from models.db import make_engine
    from models.stats import StatsQueries

    engine = make_engine(database_url, pool_size=1)
    try:
        yield StatsQueries(engine)
    finally:
        engine.dispose()


def _run(queries: StatsQueries, name: str | None) -> StatsRun:
    """The run named ``name``, or the only one there is."""
    if name is None:
        names = queries.run_names()
        if not names:
            raise ValueError("the database holds no run yet: `eaglegen enqueue` makes one")
        if len(names) > 1:
            listed = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
            raise ValueError(f"the database holds {len(names)} runs: name one ({listed})")
        name = names[0]
    found = queries.stats_run(check_name("run", name))
    if found is None:
        raise ValueError(f"run {name!r} not found")
    return found


def _datasets(run: StatsRun, wanted: list[str]) -> tuple[str, ...]:
    """The named datasets of the run (all of them when none is named)."""
    have = [d.name for d in run.datasets]
    for name in wanted:
        if name not in have:
            raise ValueError(
                f"run {run.name!r} has no dataset {name!r} (it has: {', '.join(have) or 'none'})"
            )
    return tuple(dict.fromkeys(wanted)) if wanted else tuple(have)


@contextmanager
def _progress(*, quiet: bool) -> Iterator[Callable[[int], None]]:
    """A counter on stderr of the generations the token-level checks dissect."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description} {task.completed:,}"))
    bar_console = console(stderr=True)
    # Off when stderr is no terminal: a live display there leaves an empty line behind.
    off = quiet or not bar_console.is_terminal
    with Progress(
        *columns, TimeElapsedColumn(), console=bar_console, transient=True, disable=off
    ) as bar:
        task = bar.add_task("tool-call checks: generations dissected", total=None)
        yield lambda n: bar.advance(task, n)


def _write_files(report: Report, html: Path | None, plots: Path | None) -> None:
    """The HTML page and the PNGs, when asked for."""
    if html is None and plots is None:
        return
    from eaglegen.report.html import page
    from eaglegen.report.plots import plots as draw

    pngs = draw(report)
    if plots is not None:
        plots.mkdir(parents=True, exist_ok=True)
        for name, png in pngs.items():
            (plots / name).write_bytes(png)
        err.print(f"wrote {len(pngs)} plot(s) to {inline(str(plots))}", highlight=False)
    if html is not None:
        html.write_text(page(report, pngs), encoding="utf-8")
        err.print(f"wrote {inline(str(html))}", highlight=False)
