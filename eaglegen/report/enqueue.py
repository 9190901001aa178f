"""The summary of an enqueue (`eaglegen enqueue`) as a table: one row per dataset."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from eaglegen.report.text import inline, shown
from models.ledger import format_tokens
from producer.enqueue import RunReport


def enqueue_table(report: RunReport) -> Table:
    """The human summary of an enqueue: one row per dataset."""
    title = f"{'dry run of ' if report.dry_run else ''}enqueue into run {report.run!r}"
    if report.order_seed is not None:
        title += f" (order seed {report.order_seed})"
    table = Table(title=shown(title))
    for column in (
        "dataset",
        "rows",
        "accepted",
        "rejected",
        "duplicates",
        "turns",
        "prompt p50/p99/max",
        "worst case",
        "budget",
    ):
        table.add_column(column, justify="left" if column == "dataset" else "right")
    for stats in report.datasets:
        doc = stats.as_dict()
        pt = doc["prompt_tokens"]
        reasons = ", ".join(f"{k} {v}" for k, v in doc["rejected_by_reason"].items())
        table.add_row(
            shown(stats.dataset),
            f"{doc['rows']:,}",
            f"{doc['accepted']:,}" + _samples_note(doc),
            f"{doc['rejected']:,}" + (f" ({reasons})" if reasons else ""),
            f"{doc['duplicates']:,}",
            turns_cell(doc),
            f"{pt['p50']}/{pt['p99']}/{pt['max']}",
            format_tokens(doc["worst_case_tokens"]),
            format_tokens(doc["budget_tokens"]),
        )
    return table


def _samples_note(doc: dict[str, Any]) -> str:
    """How the accepted jobs are samples of prompts, when the dataset asks several or has
    variants."""
    if doc["samples"] <= 1 and not doc["variants"]:
        return ""
    variants = f", variants {', '.join(doc['variants'])}" if doc["variants"] else ""
    return inline(f" ({doc['samples']} per prompt{variants})")


def turns_cell(doc: dict[str, Any]) -> str:
    """What of a multi-turn row is answered; with "all", the new conversations, their turns
    per conversation (p50/p90/max) and the turns they hold in all."""
    conv = doc["conversations"]
    if doc["turns"] != "all" or not conv["new"]:
        return str(doc["turns"])
    per = conv["turns_per_conversation"]
    return (
        f"all: {conv['new']:,} conversations, {per['p50']}/{per['p90']}/{per['max']} "
        f"turns each, {conv['turns_to_come']:,} in all"
    )
