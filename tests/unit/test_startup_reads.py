"""What the CLI reads at start-up without the heavy machinery, checked against it: the
commands of each module (eaglegen.cli.COMMANDS, without importing every module), the
revisions of the migrations (models.pg.migrations, without Alembic). The columns `status`
reads are in its SQL (models.status), which tests/integration/test_status.py runs against
the migrated schema."""

from __future__ import annotations

import pkgutil
from importlib import import_module

import typer
from alembic.script import ScriptDirectory

import eaglegen.cli
from eaglegen.cli import COMMANDS, module_commands
from models.db import alembic_config
from models.pg import migrations

# Added to the root by name, as groups of their own.
GROUPS = {"db", "budget"}


def test_every_command_is_listed_with_its_module() -> None:
    defined = {}
    for info in pkgutil.iter_modules(eaglegen.cli.__path__):
        app = getattr(import_module(f"eaglegen.cli.{info.name}"), "app", None)
        if app is not None and info.name not in GROUPS:
            defined |= {name: info.name for name in typer.main.get_group(app).commands}
    assert defined == COMMANDS
    for name, module in COMMANDS.items():
        assert name in module_commands(module)


def test_the_root_lists_the_commands_then_the_groups() -> None:
    root = typer.main.get_group(eaglegen.cli.app)
    assert list(root.commands) == [*COMMANDS, "db", "budget"]
    assert root.commands["status"].callback.__module__ == "eaglegen.cli.status"


def test_the_migrations_read_are_alembics() -> None:
    script = ScriptDirectory.from_config(alembic_config("postgresql://unused/db"))
    known, heads = migrations()
    assert known == {revision.revision for revision in script.walk_revisions()}
    assert heads == set(script.get_heads())
