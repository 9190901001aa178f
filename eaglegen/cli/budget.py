"""`eaglegen budget`: per-dataset token budgets, live."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

import typer

from core.names import check_name
from eaglegen.cli.base import (
    BrokerUrl,
    DatabaseUrl,
    DataDir,
    JsonFlag,
    checked_repository,
    command,
    console,
    emit_json,
    err,
    load_settings,
    repository,
    services,
    with_lock_retries,
)
from eaglegen.report.text import inline

app = typer.Typer(no_args_is_help=True, help="Per-dataset token budgets, live.")


@command(app, "show")
def show(
    run: Annotated[str | None, typer.Option(help="Only this run")] = None,
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Budget, used and reserved tokens, and skipped jobs per dataset."""
    from eaglegen.report.budgets import budget_table

    settings = load_settings(database_url=database_url, data_dir=data_dir)
    with checked_repository(settings) as repo:
        rows = repo.budgets(None if run is None else check_name("run", run))
    if json_out:
        emit_json({"datasets": [asdict(r) for r in rows]})
    else:
        console().print(budget_table(rows))


@command(app, "set")
def set_budget(
    dataset: Annotated[str, typer.Argument(help="Dataset name")],
    amount: Annotated[str, typer.Argument(help="10M, 500k, 1200000 or unlimited")],
    run: Annotated[str | None, typer.Option(help="Run (needed when names repeat)")] = None,
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    broker_url: BrokerUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Change a budget; raising it re-queues the jobs it had skipped (the feeder publishes
    them in their order)."""
    from core.broker import Publisher
    from models.ledger import format_tokens, parse_tokens

    settings = load_settings(database_url=database_url, broker_url=broker_url, data_dir=data_dir)
    budget = parse_tokens(amount)
    check_name("dataset", dataset)
    if run is not None:
        check_name("run", run)
    live = services(settings)
    with repository(live.database_url) as repo:
        change = with_lock_retries(
            lambda: repo.change_budget(run, dataset, budget), f"dataset {dataset!r}"
        )
    if change.requeued:
        with Publisher(live.broker_url, settings.queue) as publisher:
            publisher.wake_feeder()
    if json_out:
        emit_json(
            {
                "dataset": dataset,
                "budget_tokens": budget,
                "requeued": len(change.requeued),
                "running_jobs": change.running_jobs,
                "running_reserved_tokens": change.reserved_tokens,
                "may_exceed_by": change.may_exceed_by,
            }
        )
    else:
        err.print(
            f"{inline(dataset)}: budget {format_tokens(budget)}; {len(change.requeued)} skipped "
            "job(s) queued again"
        )
    if change.may_exceed_by:
        # Requests in flight are not cancelled: they finish and settle what they use.
        err.print(
            f"[yellow]warning:[/] {change.running_jobs:,} job(s) are running holding "
            f"{change.reserved_tokens:,} tokens; they will finish and may take "
            f"{inline(dataset)} over the new budget by up to {change.may_exceed_by:,} tokens",
            highlight=False,
            soft_wrap=True,
        )
