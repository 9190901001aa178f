"""`eaglegen enqueue`: template a run's datasets and store one job per prompt."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from eaglegen.cli.base import (
    BrokerUrl,
    DatabaseUrl,
    DataDir,
    JsonFlag,
    command,
    emit_json,
    err,
    load_settings,
    services,
)
from eaglegen.report.text import inline

if TYPE_CHECKING:
    from core.settings import Services, Settings
    from producer.enqueue import RunReport
    from producer.plan import RunPlan

app = typer.Typer()


@command(app)
def enqueue(
    source: Annotated[Path, typer.Argument(help="A run file (RUN.toml) or one dataset file")],
    run: Annotated[str | None, typer.Option(help="Run name (without a run file)")] = None,
    dataset: Annotated[str | None, typer.Option(help="Dataset name (without a run file)")] = None,
    tokenizer: Annotated[Path | None, typer.Option(help="Tokenizer folder")] = None,
    fmt: Annotated[
        str | None, typer.Option("--format", help="jsonl, json, parquet or hf (default: detect)")
    ] = None,
    max_context_len: Annotated[int | None, typer.Option(min=2, help="Reject longer")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 4096,
    temperature: Annotated[float, typer.Option(min=0.0)] = 1.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 0.95,
    budget: Annotated[str | None, typer.Option(help="Token budget: 10M, 500k, unlimited")] = None,
    budget_basis: Annotated[str, typer.Option(help="completion or total")] = "completion",
    limit: Annotated[int | None, typer.Option(min=1, help="Take at most N rows")] = None,
    sample_seed: Annotated[int | None, typer.Option(help="With --limit: seeded sample")] = None,
    order_seed: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=(1 << 62) - 1,
            help="Seed of the order jobs run in (a budget keeps a uniform sample); "
            "default: a new run draws one, recorded with it",
        ),
    ] = None,
    template_kwarg: Annotated[
        list[str], typer.Option(help="Chat template kwarg NAME=JSON, e.g. thinking=true")
    ] = [],  # noqa: B006
    trust_remote_code: Annotated[bool, typer.Option(help="Allow tokenizer code")] = False,
    model: Annotated[str | None, typer.Option(help="Model name recorded on the run")] = None,
    family: Annotated[
        str | None,
        typer.Option(
            help="The model family whose layout the generations have (qwen3, kimi_k2, "
            "deepseek_v3, deepseek_v31, glm45, gpt_oss, unknown; default: detected from the "
            "tokenizer's special tokens and template)"
        ),
    ] = None,
    turns: Annotated[
        str | None,
        typer.Option(
            help="Of a multi-turn row: 'all' its turns, each answered by the model after its "
            "own earlier answers, or the 'last' only, after the row's (default: all for a "
            "new dataset; one that exists keeps its choice)"
        ),
    ] = None,
    samples: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=64,
            help="Generations of each prompt, each a job with its own sampling_seed "
            "(default: 1 for a new dataset; one that exists keeps its own; fewer is refused)",
        ),
    ] = None,
    dry_run: Annotated[bool, typer.Option(help="Read and template only; write nothing")] = False,
    workers: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Processes that template rows; 0: all in this one "
            "(default: one per core, for inputs long enough to repay starting them)",
        ),
    ] = None,
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    broker_url: BrokerUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Template every row with the model's chat template and enqueue one job per prompt.

    Exits 1 when a dataset has no row that is a job (an empty file, or every row rejected),
    2 on an error, 130 on Ctrl-C (saying what was stored: the same command goes on).
    """
    from eaglegen.report.enqueue import enqueue_table
    from producer.plan import plan_from_flags, plan_from_run_file
    from producer.readers import detect_format
    from producer.runfile import load_run_file

    settings = load_settings(database_url=database_url, broker_url=broker_url, data_dir=data_dir)
    if source.suffix == ".toml":
        if run or dataset or tokenizer or family or turns or samples:
            raise ValueError(
                f"{source}: a run file names the run, datasets, tokenizer, family, turns and "
                "samples; drop --run/--dataset/--tokenizer/--family/--turns/--samples"
            )
        plan = plan_from_run_file(load_run_file(source))
        if order_seed is not None:
            plan = dataclasses.replace(plan, order_seed=order_seed)
    else:
        plan = plan_from_flags(
            source,
            run=run,
            dataset=dataset,
            tokenizer=tokenizer,
            fmt=fmt,
            max_context_len=max_context_len,
            budget=budget,
            budget_basis=budget_basis,
            limit=limit,
            sample_seed=sample_seed,
            template_kwargs=template_kwarg,
            trust_remote_code=trust_remote_code,
            model=model,
            order_seed=order_seed,
            family=family,
            turns=turns,
            samples=samples,
            sampling={"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p},
        )
    for dataset_plan in plan.datasets:  # a bad input is the first thing to hear about
        detect_format(dataset_plan.path, dataset_plan.fmt)
    target = None if dry_run else services(settings)
    report = _enqueue_or_explain(settings, target, plan, workers)
    if json_out:
        emit_json(report.as_dict())
    else:
        err.print(enqueue_table(report))
        err.print(inline(family_line(report)), highlight=False, soft_wrap=True)
    for warning in report.warnings:
        err.print(f"[yellow]warning:[/] {inline(warning)}", highlight=False)
    if report.empty_datasets:  # an empty file, or one of which every row was rejected
        raise typer.Exit(1)


def family_line(report: RunReport) -> str:
    """The run's model family and the stop ids a dataset stores by default, in one line; an
    unknown family said plainly."""
    how = {
        "named": "named",
        "detected": "detected from the tokenizer",
        "recorded": "recorded with the run",
    }.get(report.family_source, report.family_source)
    stops = ", ".join(map(str, report.default_stop_ids)) or "none"
    if report.family == "unknown":
        family = f"family: unknown ({how}) — tool calls not checked"
    else:
        family = f"family: {report.family} ({how})"
    return f"{family}; default stop ids: {stops}"


def _enqueue_or_explain(
    settings: Settings, target: Services | None, plan: RunPlan, workers: int | None
) -> RunReport:
    """Run the enqueue; a service lost mid-run is one sentence saying how to finish the job."""
    from concurrent.futures.process import BrokenProcessPool

    from sqlalchemy.exc import OperationalError

    from core.urls import redact, scrub
    from producer.commands import run_enqueue
    from producer.enqueue import EnqueueInterrupted

    try:
        return run_enqueue(settings, target, plan, workers=workers)
    except EnqueueInterrupted as exc:  # Ctrl-C: what is stored stays, and the same command
        err.print(inline(str(exc)), highlight=False, soft_wrap=True)  # goes on from there
        raise typer.Exit(130) from exc
    except KeyboardInterrupt as exc:  # before the run was set up: loading the tokenizer
        err.print("interrupted before any job was stored", highlight=False)
        raise typer.Exit(130) from exc
    except BrokenProcessPool as exc:
        raise ValueError(
            "a template worker process died (killed, or out of memory?). What was stored "
            "stays; run the same enqueue again, with --workers 0 to template in one process"
        ) from exc
    except OperationalError as exc:
        assert target is not None  # a dry run touches no service
        url = target.database_url
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0].rstrip(".")
        raise ValueError(
            f"lost Postgres at {redact(url)} mid-run: {scrub(reason, url)}. What was stored "
            "stays (and is generated); run the same enqueue again to add the rest"
        ) from exc
