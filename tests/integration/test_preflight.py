"""Preflight: unreachable services and foreign schemas are one sentence, before any work."""

from __future__ import annotations

import psycopg
import pytest
from alembic.script import ScriptDirectory

from core.urls import libpq_url
from eaglegen.preflight import ServiceError, check_broker, check_database
from eaglegen.stack import free_port
from models.db import alembic_config, make_engine
from models.pg import connect, schema_revisions

# The newest migration: what this eaglegen asks an older schema to be upgraded to.
HEAD = ScriptDirectory.from_config(alembic_config("postgresql://unused/db")).get_current_head()


def set_revision(database_url: str, revision: str | None) -> None:
    plain = libpq_url(database_url)
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute("DELETE FROM alembic_version")
        if revision is not None:
            conn.execute("INSERT INTO alembic_version VALUES (%s)", (revision,))


def test_a_migrated_database_and_a_live_redis_pass(database_url: str, broker_url: str) -> None:
    check_database(database_url)
    check_broker(broker_url)


@pytest.mark.parametrize(
    ("revision", "message"),
    [
        (None, "no eaglegen schema in this database; run `eaglegen db upgrade`"),
        ("0002", f"schema at revision 0002, this eaglegen needs {HEAD}; run `eaglegen db upgrade`"),
        ("9999", "schema at revision 9999, which this eaglegen does not know"),
    ],
)
def test_a_schema_that_is_not_this_eaglegens_is_named(
    database_url: str, revision: str | None, message: str
) -> None:
    set_revision(database_url, revision)
    with pytest.raises(ServiceError) as info:
        check_database(database_url)
    assert message in str(info.value)


def test_a_plain_connection_has_an_engines_session_settings(database_url: str) -> None:
    """`eaglegen status` reads on a psycopg connection of models.pg, not on an engine's:
    the same session settings, and the same revision as Alembic's."""
    shown = "SHOW lock_timeout; SHOW idle_in_transaction_session_timeout"
    engine = make_engine(database_url, pool_size=1, hold_limit_ms=1234)
    try:
        with engine.connect() as pooled:
            expected = [pooled.exec_driver_sql(q).scalar() for q in shown.split("; ")]
    finally:
        engine.dispose()
    with connect(database_url, hold_limit_ms=1234, connect_timeout_s=5) as conn:
        assert conn.autocommit
        assert [conn.execute(q).fetchone() for q in shown.split("; ")] == [
            (value,) for value in expected
        ]
        assert expected == ["1234ms", "1234ms"]
        with conn.cursor() as cursor:
            assert schema_revisions(cursor) == {HEAD}
            cursor.execute("DROP TABLE alembic_version")
            assert schema_revisions(cursor) == set()


def test_unreachable_services_are_named_without_their_passwords() -> None:
    port = free_port()  # nothing listens on it
    with pytest.raises(ServiceError) as db_error:
        check_database(f"postgresql://eaglegen:s3cret@127.0.0.1:{port}/db")
    with pytest.raises(ServiceError) as redis_error:
        check_broker(f"redis://:s3cret@127.0.0.1:{port}/0")
    for error, service in ((db_error, "Postgres"), (redis_error, "Redis")):
        text = str(error.value)
        assert text.startswith(f"cannot use {service} at ") and f":{port}" in text
        assert "s3cret" not in text and "***" in text
        assert "refused" in text.lower()
