"""Token packing, settings and sampling: pure logic."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from core.sampling import DEFAULTS, complete
from core.settings import ServerSpec, Settings, from_environment
from core.urls import libpq_url, normalize_database_url, redact
from models.tokens import pack, unpack


def test_pack_round_trips_the_full_int32_range() -> None:
    ids = [0, 1, 163606, 163607, 2**31 - 1, 5]
    assert unpack(pack(ids)) == ids
    assert len(pack(ids)) == 4 * len(ids)


def test_database_urls_are_normalized_to_psycopg() -> None:
    assert normalize_database_url("postgresql://u@h/db") == "postgresql+psycopg://u@h/db"
    assert normalize_database_url("postgres://u@h/db") == "postgresql+psycopg://u@h/db"
    with pytest.raises(ValueError, match="postgresql"):
        normalize_database_url("mysql://u:secret@h/db")


def test_database_urls_for_libpq_keep_everything_but_the_driver() -> None:
    embedded = "postgresql+psycopg://postgres@/postgres?host=/tmp/a%20b"
    assert libpq_url(embedded) == "postgresql://postgres@/postgres?host=/tmp/a%20b"
    assert libpq_url("postgres://u:p%40ss@h:5433/db?sslmode=require") == (
        "postgresql://u:p%40ss@h:5433/db?sslmode=require"
    )
    with pytest.raises(ValueError, match="postgresql"):
        libpq_url("mysql://u:secret@h/db")


def test_redact_hides_passwords() -> None:
    assert redact("redis://:hunter2@h:6379/0") == "redis://:***@h:6379/0"
    assert "hunter2" not in redact("postgresql://u:hunter2@h/db")
    assert redact("redis://h:6379/0") == "redis://h:6379/0"


def test_settings_reject_non_redis_broker_without_leaking_the_password() -> None:
    with pytest.raises(ValidationError) as info:
        Settings(broker_url="amqp://guest:topsecret@h//")
    assert "topsecret" not in str(info.value)


def test_settings_come_from_eaglegen_variables_in_any_case_lists_as_json() -> None:
    servers = [{"name": "gpu0", "url": "http://10.0.0.7:30000/", "max_inflight": 64}]
    environ = {
        "EAGLEGEN_QUEUE": "q",
        "eaglegen_db_pool_size": "3",
        "EAGLEGEN_SERVERS": json.dumps(servers),
        "EAGLEGEN_NOT_A_SETTING": "x",
        "QUEUE": "other",
    }
    assert from_environment(environ) == {"queue": "q", "db_pool_size": "3", "servers": servers}


def test_settings_given_override_the_environment_and_both_count_as_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EAGLEGEN_QUEUE", "from-env")
    monkeypatch.setenv("EAGLEGEN_STREAM", "true")
    monkeypatch.setenv("EAGLEGEN_SERVERS", '[{"url": "http://h:30000/"}]')
    settings = Settings(queue="from-flag")
    assert settings.queue == "from-flag"
    assert settings.stream is True
    assert settings.servers == [ServerSpec(url="http://h:30000")]
    assert settings.servers[0].name == "h:30000"
    assert {"queue", "stream", "servers"} <= settings.model_fields_set
    assert "data_dir" not in settings.model_fields_set


def test_a_setting_that_is_not_json_or_not_valid_is_named_without_its_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EAGLEGEN_SERVERS", '[{"url": "http://u:topsecret@h/"')
    with pytest.raises(ValueError, match="EAGLEGEN_SERVERS is not JSON") as not_json:
        Settings()
    assert "topsecret" not in str(not_json.value)
    monkeypatch.delenv("EAGLEGEN_SERVERS")
    monkeypatch.setenv("EAGLEGEN_WORKER_CONCURRENCY", "topsecret")
    with pytest.raises(ValidationError, match="worker_concurrency") as invalid:
        Settings()
    assert "topsecret" not in str(invalid.value)


def test_sampling_params_are_all_explicit() -> None:
    params = complete({"max_new_tokens": 128}, stop_token_ids=[4])
    assert params["max_new_tokens"] == 128
    assert params["stop_token_ids"] == [4]
    assert set(DEFAULTS) <= set(params)
    with pytest.raises(ValueError, match="unknown sampling"):
        complete({"temprature": 0.5}, stop_token_ids=[4])
