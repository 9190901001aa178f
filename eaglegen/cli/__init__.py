"""The `eaglegen` command line: one module per command group, each a thin layer over the
packages below; ``base`` holds what they share. A new command group is one new module,
added to the list here."""

from __future__ import annotations

import typer

from eaglegen.cli import (
    budget,
    db,
    doctor,
    enqueue,
    export,
    flower,
    maintenance,
    plan,
    rejected,
    sim,
    stack,
    stats,
    status,
    worker,
)

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Regenerate EAGLE-3 training data with the target model's exact tokens.",
)
for module in (
    enqueue,
    worker,
    status,
    stack,
    sim,
    maintenance,
    rejected,
    export,
    stats,
    flower,
    doctor,
):
    app.add_typer(module.app)  # no name: its commands are top-level ones
app.add_typer(plan.app)
app.add_typer(db.app, name="db")
app.add_typer(budget.app, name="budget")


def main() -> None:
    """Console-script entry point."""
    app()
