"""One redaction for every URL shown: the userinfo password and secret query parameters."""

from __future__ import annotations

import pytest
from kombu import Connection

from core.urls import normalize_database_url, password_in_userinfo, redact, scrub


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:hunter2@h:6379/0", "redis://:***@h:6379/0"),
        ("postgresql://u:hunter2@h/db", "postgresql://u:***@h/db"),
        ("redis://127.0.0.1:6399/0?password=RdS3cretPW", "redis://127.0.0.1:6399/0?password=***"),
        (
            "postgresql+psycopg://egpw@127.0.0.1:5440/nosuchdb?password=PgS3cretPW",
            "postgresql+psycopg://egpw@127.0.0.1:5440/nosuchdb?password=***",
        ),
        (
            "postgresql://u@h/db?sslkey=/k/client.key&sslpassword=kp&passwd=p2&host=/tmp/s",
            "postgresql://u@h/db?sslkey=/k/client.key&sslpassword=***&passwd=***&host=/tmp/s",
        ),
        (
            "redis://h/0?auth_token=t1&clientSecret=t2&db=1",
            "redis://h/0?auth_token=***&clientSecret=***&db=1",
        ),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("postgresql://u:p%40ss:w@h/db?password=", "postgresql://u:***@h/db?password="),
    ],
)
def test_redact_hides_every_secret_and_keeps_the_rest(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_a_url_that_cannot_be_taken_apart_is_hidden_whole() -> None:
    assert redact("redis://[::1/0?password=x") == "***"


def test_scrub_hides_secrets_echoed_in_a_message() -> None:
    url = "postgresql://u:p%40ss@h/db?password=Pg%2FS3cret"
    message = "auth failed: p@ss / p%40ss / Pg/S3cret / Pg%2FS3cret for user u"
    assert scrub(message, url) == "auth failed: *** / *** / *** / *** for user u"


def test_the_database_scheme_error_shows_no_password() -> None:
    with pytest.raises(ValueError, match="postgresql") as info:
        normalize_database_url("mysql://u:secret@h/db?password=other")
    assert "secret" not in str(info.value) and "other" not in str(info.value)


def test_a_query_password_moves_where_kombu_reads_it() -> None:
    url = "redis://127.0.0.1:6399/0?password=Rd%40S3&socket_timeout=5"
    moved = password_in_userinfo(url)
    assert moved == "redis://:Rd%40S3@127.0.0.1:6399/0?socket_timeout=5"
    connection = Connection(password_in_userinfo("redis://127.0.0.1:6399/0?password=Rd%40S3"))
    assert connection.password == "Rd@S3" and "Rd" not in connection.as_uri()
    # kombu cannot even parse the query form (it would crash the worker at start).
    with pytest.raises(TypeError):
        Connection("redis://127.0.0.1:6399/0?password=Rd%40S3")
    assert password_in_userinfo("redis://:a@h/0?password=b") == "redis://:a@h/0?password=b"
    assert password_in_userinfo("redis://h/0") == "redis://h/0"
