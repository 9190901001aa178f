"""Engine construction and migrations; built once per process, after any fork."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import namedtuple_row
from sqlalchemy import Connection, Engine, create_engine
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from core.urls import normalize_database_url
from models.pg import MIGRATIONS, session_options

# Alembic is imported to migrate only: the schema check before every command reads the
# migration files and the database's revision itself (models.pg).
if TYPE_CHECKING:
    from alembic.config import Config


def make_engine(
    url: str,
    *,
    pool_size: int = 5,
    max_overflow: int | None = None,
    async_commit: bool = False,
    hold_limit_ms: int | None = None,
    pre_ping: bool = True,
    connect_timeout_s: int | None = None,
) -> Engine:
    """A pooled engine whose connections are checked before use (Postgres may restart;
    ``pre_ping`` False: they are not, and the first use of a stale one fails, after which
    SQLAlchemy renews the whole pool). ``connect_timeout_s``: how long a connection attempt
    may wait for an unreachable host (libpq's default: for ever).

    At most ``pool_size`` + ``max_overflow`` (default: as many again) connections; a thread
    that finds none free waits for one (SQLAlchemy's TimeoutError after 30 s).
    ``async_commit`` turns off the wait for the WAL flush at commit. Workers may: a commit
    lost in a Postgres crash leaves the job running under a lease, the reconciler queues it
    again, and it is generated again; nothing is recorded twice or half.
    ``hold_limit_ms`` bounds how long a session may wait for a row lock and sit idle inside
    a transaction (Postgres ends it then, which releases its locks): a process frozen
    mid-transaction (SIGSTOP, a VM pause, a swap storm) must not hold a dataset's ledger
    row, which every claim and record of that dataset updates, for as long as it is frozen.
    """
    options: dict[str, Any] = {}
    if session := session_options(async_commit=async_commit, hold_limit_ms=hold_limit_ms):
        options["options"] = session
    if connect_timeout_s is not None:
        options["connect_timeout"] = connect_timeout_s
    return create_engine(
        normalize_database_url(url),
        pool_size=pool_size,
        max_overflow=pool_size if max_overflow is None else max_overflow,
        pool_pre_ping=pre_ping,
        connect_args=options,
    )


def driver_connection(conn: Connection) -> psycopg.Connection[Any]:
    """The psycopg connection under a checked-out SQLAlchemy connection."""
    driver = conn.connection.driver_connection
    assert driver is not None, "a checked-out connection has its driver connection"
    return driver  # type: ignore[no-any-return]


@contextmanager
def driver_cursor(conn: Connection) -> Iterator[psycopg.Cursor[Any]]:
    """A psycopg cursor (rows as named tuples) on ``conn``'s connection, inside its
    transaction: for the statements SQLAlchemy cannot run (COPY) or that skip its execution
    layer (models.attempt). A driver error comes out as the SQLAlchemy error any other
    query raises (OperationalError for a lost server or a lock timeout)."""
    try:
        with driver_connection(conn).cursor(row_factory=namedtuple_row) as cursor:
            yield cursor
    except psycopg.Error as exc:
        raise DBAPIError.instance(None, None, exc, psycopg.Error) from exc


@contextmanager
def autocommit_cursor(engine: Engine) -> Iterator[psycopg.Cursor[Any]]:
    """A psycopg cursor, as `driver_cursor`, on a pooled connection in autocommit: each
    statement is its own transaction, committed as it ends, with no BEGIN or COMMIT round
    trip. For statements that are atomic alone (models.attempt): their row locks end with
    the statement, never held while the client, busy or waiting for the GIL, sends the
    next one."""
    with (
        engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn,
        driver_cursor(conn) as cursor,
    ):
        yield cursor


@contextmanager
def snapshot(engine: Engine) -> Iterator[Connection]:
    """A connection whose statements all read one snapshot of the database and write
    nothing (a REPEATABLE READ, read-only transaction, rolled back at the end): for reports
    that compare what separate statements read while workers commit transitions."""
    with (
        engine.connect().execution_options(
            isolation_level="REPEATABLE READ", postgresql_readonly=True
        ) as conn,
        conn.begin() as transaction,
    ):
        yield conn
        transaction.rollback()


def is_lock_timeout(error: BaseException) -> bool:
    """Whether a statement failed because it waited longer than lock_timeout for a lock."""
    return isinstance(error, DBAPIError) and isinstance(error.orig, pg_errors.LockNotAvailable)


def lost_database(error: BaseException) -> str | None:
    """Why Postgres could not be used, when ``error`` says it is gone (down, restarting,
    unreachable, or the server ended the session): the driver's first line. None for any
    other error (a lock wait that timed out included)."""
    if not isinstance(
        error, OperationalError | InterfaceError | psycopg.OperationalError | psycopg.InterfaceError
    ) or is_lock_timeout(error):
        return None
    cause = error.orig if isinstance(error, DBAPIError) and error.orig is not None else error
    lines = str(cause).strip().splitlines()
    return lines[0].strip().rstrip(".") if lines else type(cause).__name__


def alembic_config(url: str) -> Config:
    """An Alembic config pointing at this package's migrations and ``url``."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # ConfigParser interpolation would eat '%' in passwords.
    config.set_main_option("sqlalchemy.url", normalize_database_url(url).replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at ``url`` to ``revision``."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)
