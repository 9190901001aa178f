"""Postgres without SQLAlchemy: a plain psycopg connection with the session settings every
engine's connections get (models.db builds its engines with the same ``session_options``),
and the schema's revisions against the migrations' (read from the files, without Alembic).

For what must start fast: `eaglegen status` reads through psycopg alone (models.status), so
it imports neither SQLAlchemy nor Alembic (BENCHMARKS.md, "CLI start-up").
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import namedtuple_row

from core.urls import libpq_url

MIGRATIONS = Path(__file__).parent / "migrations"


def session_options(*, async_commit: bool = False, hold_limit_ms: int | None = None) -> str:
    """libpq's ``options`` for a session (empty: none): see models.db.make_engine for what
    each setting is for."""
    settings = []
    if async_commit:
        settings.append("synchronous_commit=off")
    if hold_limit_ms is not None:
        settings += [
            f"lock_timeout={hold_limit_ms}",
            f"idle_in_transaction_session_timeout={hold_limit_ms}",
        ]
    return " ".join(f"-c {s}" for s in settings)


def connect(
    url: str, *, hold_limit_ms: int | None = None, connect_timeout_s: int | None = None
) -> psycopg.Connection[Any]:
    """A psycopg connection to ``url`` (any form models.db takes) in autocommit mode: each
    statement is its own transaction unless a block of them runs in ``conn.transaction()``."""
    options: dict[str, Any] = {}
    if connect_timeout_s is not None:
        options["connect_timeout"] = connect_timeout_s
    if session := session_options(hold_limit_ms=hold_limit_ms):
        options["options"] = session
    return psycopg.connect(libpq_url(url), autocommit=True, **options)


def schema_revisions(cursor: psycopg.Cursor[Any]) -> set[str]:
    """The revisions the database's schema is at (Alembic's version table); none without
    that table."""
    row = cursor.execute("SELECT to_regclass('alembic_version')").fetchone()
    if row is None or row[0] is None:
        return set()
    return {r[0] for r in cursor.execute("SELECT version_num FROM alembic_version")}


def migrations() -> tuple[set[str], set[str]]:
    """Every revision of this package's migrations, and the heads (those no other revises):
    what Alembic finds, read from each file's ``revision`` and ``down_revision`` without
    running the file."""
    revises: dict[str, set[str]] = {}
    for path in sorted((MIGRATIONS / "versions").glob("*.py")):
        names = _assignments(path, ("revision", "down_revision"))
        if isinstance(names.get("revision"), str):
            down = names.get("down_revision")
            revises[names["revision"]] = {down} if isinstance(down, str) else set(down or ())
    known = set(revises)
    return known, known - set[str]().union(*revises.values())


def _assignments(path: Path, names: tuple[str, ...]) -> dict[str, Any]:
    """The literal values a module assigns to ``names`` at its top level."""
    found: dict[str, Any] = {}
    for node in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id in names:
            found[target.id] = ast.literal_eval(value)
    return found


async def connect_async(
    url: str,
    *,
    async_commit: bool = False,
    hold_limit_ms: int | None = None,
    connect_timeout_s: int | None = None,
) -> psycopg.AsyncConnection[Any]:
    """An asyncio psycopg connection to ``url`` in autocommit mode, its rows as named tuples:
    what `models.attempt`'s batch functions run on."""
    options: dict[str, Any] = {}
    if connect_timeout_s is not None:
        options["connect_timeout"] = connect_timeout_s
    if session := session_options(async_commit=async_commit, hold_limit_ms=hold_limit_ms):
        options["options"] = session
    return await psycopg.AsyncConnection.connect(
        libpq_url(url), autocommit=True, row_factory=namedtuple_row, **options
    )
