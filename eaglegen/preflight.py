"""Before a command touches the services: can they be reached, is the schema this eaglegen's?

Each failure becomes one sentence naming the service (its URL, password redacted) and what to
do, instead of a driver traceback in the middle of a command.
"""

from __future__ import annotations

from sqlalchemy import Engine, create_engine
from sqlalchemy.exc import SQLAlchemyError

from core.urls import normalize_database_url, redact, scrub
from models.db import migrations, schema_revisions

CONNECT_TIMEOUT_S = 5


class ServiceError(ValueError):
    """A service that cannot be used as it is; the message says what to do."""


def check_database(url: str, *, schema: bool = True) -> None:
    """`check_engine` on a connection of its own."""
    engine = create_engine(
        normalize_database_url(url), connect_args={"connect_timeout": CONNECT_TIMEOUT_S}
    )
    try:
        check_engine(engine, url, schema=schema)
    finally:
        engine.dispose()


def check_engine(engine: Engine, url: str, *, schema: bool = True) -> None:
    """Raise ServiceError unless Postgres at ``url`` answers on ``engine`` and (``schema``)
    its schema is at this eaglegen's head."""
    known, heads = migrations()
    try:
        with engine.connect() as conn:
            current = schema_revisions(conn)
    except SQLAlchemyError as exc:
        reason = scrub(_first_line(exc), url)
        raise ServiceError(f"cannot use Postgres at {redact(url)}: {reason}") from exc
    problem = schema_problem(current, heads, known) if schema else None
    if problem is not None:
        raise ServiceError(f"Postgres at {redact(url)}: {problem}")


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


def _first_line(exc: SQLAlchemyError) -> str:
    """The driver's own message, without SQLAlchemy's statement dump and background link."""
    original = getattr(exc, "orig", None) or exc
    return str(original).strip().splitlines()[0]
