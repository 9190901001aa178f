"""The `eaglegen` command line: one module per command group, each a thin layer over the
packages below; ``base`` holds what they share. A new command is one line in COMMANDS.

A command's module is imported when the command runs: `eaglegen status` neither imports nor
builds the other commands (only `eaglegen --help`, which lists them all, does).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import cache
from importlib import import_module
from typing import Any

import typer
from typer.core import TyperGroup

from eaglegen.cli import budget, db

# Each top-level command and its module (eaglegen.cli.<module>), in the order of `eaglegen
# --help`; the groups `db` and `budget` follow them (tests/unit/test_startup_reads.py checks
# the list against the modules).
COMMANDS = {
    "enqueue": "enqueue",
    "worker": "worker",
    "status": "status",
    "metrics": "status",
    "exporter": "status",
    "demo": "stack",
    "up": "stack",
    "down": "stack",
    "sim": "sim",
    "reconcile": "maintenance",
    "audit": "maintenance",
    "rejected": "rejected",
    "export": "export",
    "stats": "stats",
    "show": "stats",
    "sample": "stats",
    "flower": "flower",
    "doctor": "doctor",
    "plan": "plan",
}


@cache
def module_commands(module: str) -> Mapping[str, Any]:
    """The commands module ``module`` defines, as Click commands."""
    return typer.main.get_group(import_module(f"eaglegen.cli.{module}").app).commands


class Commands(Mapping[str, Any]):
    """COMMANDS, each built from its module on first use; then ``groups``."""

    def __init__(self, groups: Mapping[str, Any]) -> None:
        self.groups = dict(groups)

    def __getitem__(self, name: str) -> Any:
        if name in COMMANDS:
            return module_commands(COMMANDS[name])[name]
        return self.groups[name]

    def __iter__(self) -> Iterator[str]:
        yield from COMMANDS
        yield from self.groups

    def __len__(self) -> int:
        return len(COMMANDS) + len(self.groups)


class LazyGroup(TyperGroup):
    """The root group, whose commands are Commands."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.commands = Commands(self.commands)  # type: ignore[assignment]  # read-only


app = typer.Typer(
    cls=LazyGroup,
    no_args_is_help=True,
    add_completion=False,
    help="Regenerate EAGLE-3 training data with the target model's exact tokens.",
)
app.add_typer(db.app, name="db")
app.add_typer(budget.app, name="budget")


def main() -> None:
    """Console-script entry point."""
    app()
