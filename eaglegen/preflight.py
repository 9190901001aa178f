"""Before a command touches the services: can they be reached, is the schema this eaglegen's?

Each failure becomes one sentence naming the service (its URL, password redacted) and what to
do, instead of a driver traceback in the middle of a command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psycopg

from core.urls import redact, scrub
from models.pg import connect, migrations, schema_revisions

# SQLAlchemy is imported by the commands that use an engine, not by this check: `status`
# reads through psycopg alone (models.pg).
if TYPE_CHECKING:
    from sqlalchemy import Engine

CONNECT_TIMEOUT_S = 5


class ServiceError(ValueError):
    """A service that cannot be used as it is; the message says what to do."""


def check_database(url: str, *, schema: bool = True) -> None:
    """`check_connection` on a connection of its own."""
    try:
        conn = connect(url, connect_timeout_s=CONNECT_TIMEOUT_S)
    except psycopg.Error as exc:
        raise unusable(url, exc) from exc
    with conn:
        check_connection(conn, url, schema=schema)


def check_connection(conn: psycopg.Connection[Any], url: str, *, schema: bool = True) -> None:
    """Raise ServiceError unless Postgres at ``url`` answers on ``conn`` and (``schema``)
    its schema is at this eaglegen's head."""
    try:
        with conn.cursor() as cursor:
            current = schema_revisions(cursor)
    except psycopg.Error as exc:
        raise unusable(url, exc) from exc
    _check_schema(current, url, schema)


def check_engine(engine: Engine, url: str, *, schema: bool = True) -> None:
    """`check_connection` on a connection of ``engine``'s (the one a command then uses)."""
    from sqlalchemy.exc import SQLAlchemyError

    from models.db import driver_cursor

    try:
        with engine.connect() as conn, driver_cursor(conn) as cursor:
            current = schema_revisions(cursor)
    except SQLAlchemyError as exc:
        raise unusable(url, getattr(exc, "orig", None) or exc) from exc
    _check_schema(current, url, schema)


def _check_schema(current: set[str], url: str, schema: bool) -> None:
    known, heads = migrations()
    problem = schema_problem(current, heads, known) if schema else None
    if problem is not None:
        raise ServiceError(f"Postgres at {redact(url)}: {problem}")


def unusable(url: str, error: BaseException) -> ServiceError:
    """Postgres could not be reached or read: the driver's own first line."""
    lines = str(error).strip().splitlines()
    reason = lines[0] if lines else type(error).__name__
    return ServiceError(f"cannot use Postgres at {redact(url)}: {scrub(reason, url)}")


def schema_problem(current: set[str], heads: set[str], known: set[str]) -> str | None:
    """What is wrong with a schema at ``current`` for migrations ending at ``heads``, if any.

    ``known``: every revision of this eaglegen's migrations.
    """
    if current == heads:
        return None
    if not current:
        return "no eaglegen schema in this database; run `eaglegen db upgrade`"
    if current <= known:
        wanted = ", ".join(sorted(heads))
        return (
            f"schema at revision {', '.join(sorted(current))}, this eaglegen needs {wanted};"
            " run `eaglegen db upgrade`"
        )
    return (
        f"schema at revision {', '.join(sorted(current))}, which this eaglegen does not know"
        " (a newer eaglegen migrated it); upgrade eaglegen"
    )


def check_broker(url: str) -> None:
    """Raise ServiceError unless Redis answers a PING."""
    import redis  # here: a command that reads Postgres only does not load the client

    client = redis.Redis.from_url(
        url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=CONNECT_TIMEOUT_S
    )
    try:
        client.ping()
    except redis.RedisError as exc:
        raise ServiceError(f"cannot use Redis at {redact(url)}: {scrub(str(exc), url)}") from exc
    finally:
        client.close()
