"""What every command shares: its options, its settings, its services and its errors.

A command module registers its functions with ``command``, which turns the project's
foreseeable errors (``ValueError``: bad input, an unusable service, a refused change, a
setting out of range; ``OSError``: a file; ``MissingExtraError``: the embedded services
not installed) into one line ``error: …`` and exit code 2.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console

from eaglegen.report.text import inline
from eaglegen.stack import FLOWER_AUTH_ENV, MissingExtraError, StackSearch, find_stack

# Imported by every command, its --help included: what only some commands use (the settings
# and pydantic, the models, SQLAlchemy, Redis) is imported where it is used.
if TYPE_CHECKING:
    from psycopg import Connection
    from sqlalchemy import Engine

    from core.settings import ServerSpec, Services, Settings
    from models.repository import Repository

# The width of a console writing to a file or a pipe (nohup, tee, a CI log): wider than any
# line, so that no table is cut to fit and no long value (a URL, a path) is wrapped.
UNWRAPPED_WIDTH = 1_000_000


def console(*, stderr: bool = False, **options: Any) -> Console:
    """A rich Console on stdout (``stderr``: on stderr), made here for every command.

    On a terminal it lays out for the terminal's width. On a file or a pipe it neither
    wraps nor cuts: a log holds whole lines and whole tables, whatever the width of the
    terminal it was started from. ``COLUMNS``, when set, is the width in both cases.
    """
    made = Console(stderr=stderr, **options)
    if not _isatty(made.file) and not os.environ.get("COLUMNS", "").strip().isdigit():
        made.width = UNWRAPPED_WIDTH
        made.soft_wrap = True
    return made


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no such method, or the stream is closed
        return False


err = console(stderr=True)

DatabaseUrl = Annotated[
    str | None, typer.Option(envvar="EAGLEGEN_DATABASE_URL", help="Postgres URL")
]
BrokerUrl = Annotated[str | None, typer.Option(envvar="EAGLEGEN_BROKER_URL", help="Redis URL")]
DataDir = Annotated[Path | None, typer.Option(envvar="EAGLEGEN_DATA_DIR", help="Data directory")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
FlowerLogin = Annotated[
    str | None,
    typer.Option(
        envvar=[FLOWER_AUTH_ENV, "FLOWER_BASIC_AUTH"],
        help="USER:PASSWORD (one; no comma: Flower splits there), required off loopback; prefer "
        "the environment variable, a flag is visible to every user of the host",
    ),
]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
# How long a command's statement waits for a row lock before it tries again, and for how
# long it tries (see with_lock_retries).
CONTROL_LOCK_MS = 2000
CONTROL_RETRY_S = 30.0
# pydantic's ValidationError and the project's InputError and ServiceError are ValueErrors.
FORESEEABLE = (ValueError, OSError, MissingExtraError)


def command(group: typer.Typer, name: str | None = None, **options: Any) -> Callable[[F], F]:
    """Register ``fn`` as a command of ``group`` whose foreseeable errors are one line."""

    def register(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except FORESEEABLE as exc:
                fail(one_line(exc))
            except Exception as exc:
                if not _lock_timeout(exc):
                    raise
                fail(
                    f"a row this command needs stayed locked for over {CONTROL_LOCK_MS} ms (a "
                    "stuck or frozen session holds it; see pg_stat_activity): its transaction "
                    "was rolled back; run it again"
                )

        group.command(name, **options)(run)
        return fn

    return register


def _lock_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a statement that waited out its session's lock_timeout."""
    from models.db import is_lock_timeout

    return is_lock_timeout(exc)


def one_line(exc: BaseException) -> str:
    """An error's message on one line (pydantic lists each invalid setting on its own)."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
    return " ".join(str(exc).split("\n")).strip() or type(exc).__name__


def fail(message: str) -> NoReturn:
    """Print an error naming what went wrong and exit 2."""
    err.print(f"[bold red]error:[/] {inline(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def emit_json(document: Any) -> None:
    """One JSON document on stdout."""
    sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")


def load_settings(**flags: Any) -> Settings:
    """Settings from the environment with every flag that was given (not None) on top, and
    the services of `eaglegen up` where neither names one (its stack as stack_search finds
    it; its folder becomes the data directory)."""
    from core.settings import Settings

    given = {k: v for k, v in flags.items() if v is not None and v != []}
    settings = Settings(**given)
    found = stack_search(settings)
    stack = found.info or {}
    updates: dict[str, Any] = {}
    if found.info is not None and found.data_dir != settings.data_dir:
        updates["data_dir"] = found.data_dir
    if settings.database_url is None and stack.get("database_url"):
        updates["database_url"] = stack["database_url"]
    if settings.broker_url is None and stack.get("broker_url"):
        updates["broker_url"] = stack["broker_url"]
    return Settings(**{**given, **updates}) if updates else settings


def stack_settings(**flags: Any) -> Settings:
    """Settings of `up` and `down`: the data directory is the stack's folder as every
    command finds it, the services are only what the environment and flags name (not what
    the stack recorded: `up` decides what to keep)."""
    from core.settings import Settings

    given = {k: v for k, v in flags.items() if v is not None and v != []}
    settings = Settings(**given)
    found = stack_search(settings)
    if found.info is not None and found.data_dir != settings.data_dir:
        return Settings(**{**given, "data_dir": found.data_dir})
    return settings


def stack_search(settings: Settings) -> StackSearch:
    """The stack of `eaglegen up`: in the data directory when one was given (flag or
    EAGLEGEN_DATA_DIR), else in ``./.eaglegen``, else where the user's pointer
    (``~/.config/eaglegen/stack``, written by `up`) says."""
    return find_stack(settings.data_dir, explicit="data_dir" in settings.model_fields_set)


def no_stack(settings: Settings) -> str:
    """Where the commands looked for a stack, for an error saying none was found."""
    return f"no stack of `eaglegen up` found: {stack_search(settings).looked}"


def parse_servers(values: list[str]) -> list[ServerSpec]:
    """``--server URL`` or ``--server NAME=URL`` flags as server specs (an unnamed server
    is named by its location, see ServerSpec)."""
    from core.settings import ServerSpec

    servers = []
    for value in values:
        name, sep, url = value.partition("=")
        if not sep or "://" in name:
            name, url = "", value
        servers.append(ServerSpec(name=name, url=url))
    return servers


def services(settings: Settings, *, check_database: bool = True) -> Services:
    """Postgres and Redis, once both proved usable (ValueError saying what to do if not)."""
    from eaglegen import preflight

    if settings.database_url is None or settings.broker_url is None:
        raise ValueError(
            "no database/broker configured: run `eaglegen up` first, or set "
            "EAGLEGEN_DATABASE_URL and EAGLEGEN_BROKER_URL (or pass --database-url/"
            f"--broker-url); {no_stack(settings)}"
        )
    resolved = settings.services()
    if check_database:
        preflight.check_database(resolved.database_url)
    preflight.check_broker(resolved.broker_url)
    return resolved


def database(settings: Settings, *, check_schema: bool = True) -> str:
    """The Postgres URL of a command that needs no Redis, once it proved usable.

    ``check_schema``: that its schema is this eaglegen's too (not for `db upgrade`).
    """
    from eaglegen import preflight

    url = named_database(settings)
    preflight.check_database(url, schema=check_schema)
    return url


def named_database(settings: Settings) -> str:
    """The Postgres URL the settings name, or a ValueError saying how to give one."""
    if settings.database_url is None:
        raise ValueError(
            "no database: set EAGLEGEN_DATABASE_URL, pass --database-url or run `eaglegen up` "
            f"({no_stack(settings)})"
        )
    return settings.database_url


@contextmanager
def checked_connection(settings: Settings) -> Iterator[tuple[str, Engine]]:
    """`database` and `one_connection` in one, (URL, engine): the check runs on the
    connection the command then uses, not on one of its own (a connection fewer)."""
    from eaglegen import preflight

    url = named_database(settings)
    with one_connection(url) as engine:
        preflight.check_engine(engine, url)
        yield url, engine


@contextmanager
def checked_reader(settings: Settings) -> Iterator[tuple[str, Connection[Any]]]:
    """`database` on the connection the command then uses, (URL, connection): a plain
    psycopg connection (`open_reader`), for a command that reads through psycopg alone and
    so starts without importing SQLAlchemy (`status`)."""
    import psycopg

    from eaglegen import preflight

    url = named_database(settings)
    try:
        conn = open_reader(url)
    except psycopg.Error as exc:
        raise preflight.unusable(url, exc) from exc
    with conn:
        preflight.check_connection(conn, url)
        yield url, conn


def open_reader(database_url: str) -> Connection[Any]:
    """A plain psycopg connection (models.pg) with a command's session settings (see
    `one_connection`); psycopg's OperationalError when Postgres cannot be reached."""
    from eaglegen.preflight import CONNECT_TIMEOUT_S
    from models.pg import connect

    return connect(database_url, hold_limit_ms=CONTROL_LOCK_MS, connect_timeout_s=CONNECT_TIMEOUT_S)


@contextmanager
def checked_repository(settings: Settings) -> Iterator[Repository]:
    """A repository on `checked_connection`."""
    from models.repository import Repository

    with checked_connection(settings) as (_, engine):
        yield Repository(engine)


def with_lock_retries(action: Callable[[], T], what: str) -> T:
    """Run ``action``, again while it fails on a lock held by others, for CONTROL_RETRY_S;
    then a ValueError saying nothing was changed. Under load the workers hold a dataset's
    row for milliseconds at a time, so one of the tries gets in between."""
    deadline = time.monotonic() + CONTROL_RETRY_S
    told = False
    while True:
        try:
            return action()
        except Exception as exc:
            if not _lock_timeout(exc):
                raise
            if time.monotonic() > deadline:
                raise ValueError(
                    f"{what} stayed locked for {CONTROL_RETRY_S:g} s (a stuck or frozen session "
                    "holds it; see pg_stat_activity): nothing was changed; run it again"
                ) from exc
            if not told:
                err.print(f"{inline(what)} is busy; retrying for up to {CONTROL_RETRY_S:g} s")
                told = True


@contextmanager
def repository(database_url: str) -> Iterator[Repository]:
    """A repository on one pooled connection, disposed of afterwards."""
    from models.repository import Repository

    with one_connection(database_url) as engine:
        yield Repository(engine)


@contextmanager
def one_connection(database_url: str) -> Iterator[Engine]:
    """An engine of one pooled connection, disposed of afterwards: a repository's."""
    from eaglegen import preflight
    from models.db import make_engine

    # A command waits at most CONTROL_LOCK_MS for a row lock, then retries (with_lock_retries):
    # a server session left waiting by a client that went away (Ctrl-C) ends by itself.
    engine = make_engine(
        database_url,
        pool_size=1,
        hold_limit_ms=CONTROL_LOCK_MS,
        connect_timeout_s=preflight.CONNECT_TIMEOUT_S,
    )
    try:
        yield engine
    finally:
        engine.dispose()
