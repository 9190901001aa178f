"""Token packing, settings and sampling: pure logic."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from core.sampling import DEFAULTS, complete
from core.settings import Settings, environment
from core.urls import normalize_database_url, redact
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


def test_redact_hides_passwords() -> None:
    assert redact("redis://:hunter2@h:6379/0") == "redis://:***@h:6379/0"
    assert "hunter2" not in redact("postgresql://u:hunter2@h/db")
    assert redact("redis://h:6379/0") == "redis://h:6379/0"


def test_settings_reject_non_redis_broker_without_leaking_the_password() -> None:
    with pytest.raises(ValidationError) as info:
        Settings(broker_url="amqp://guest:topsecret@h//")
    assert "topsecret" not in str(info.value)


def test_settings_come_from_the_environment_under_the_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    servers = [{"name": "a", "url": "http://h:30000/", "max_inflight": 8}]
    monkeypatch.setenv("EAGLEGEN_SERVERS", json.dumps(servers))
    monkeypatch.setenv("eaglegen_queue", "from-env")  # any case, as before
    monkeypatch.setenv("EAGLEGEN_STREAM", "false")
    monkeypatch.setenv("EAGLEGEN_DB_POOL_SIZE", "3")
    monkeypatch.setenv("EAGLEGEN_NOT_A_SETTING", "x")
    settings = Settings(queue="flag")
    assert settings.queue == "flag"
    assert settings.stream is False and settings.db_pool_size == 3
    assert [(s.name, s.url, s.max_inflight) for s in settings.servers] == [
        ("a", "http://h:30000", 8)
    ]
    # What the environment gave counts as given (the stack search asks of data_dir).
    assert settings.model_fields_set == {"queue", "stream", "db_pool_size", "servers"}
    monkeypatch.setenv("EAGLEGEN_DB_POOL_SIZE", "0")
    with pytest.raises(ValidationError, match="db_pool_size"):
        Settings()


def test_a_setting_that_is_not_json_is_named_without_its_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EAGLEGEN_SERVERS", '[{"url": "http://u:topsecret@h:1"')
    with pytest.raises(ValidationError) as info:
        Settings()
    assert "EAGLEGEN_SERVERS is not JSON" in str(info.value)
    assert "topsecret" not in str(info.value)


def test_the_structured_settings_are_the_list_and_object_fields() -> None:
    # Read as JSON from the environment; every other field is one plain value.
    structured = {
        name
        for name, field in Settings.model_fields.items()
        if not isinstance(field.annotation, type) or field.annotation is list
    }
    plain = {"database_url", "broker_url", "worker_concurrency", "stream", "window",
             "metrics_port"}  # fmt: skip
    assert structured - plain == {"servers"}
    assert environment(["servers"], ["servers"], {"EAGLEGEN_SERVERS": "[]"}) == {"servers": []}
    assert environment(["queue"], [], {"EAGLEGEN_QUEUE": "[]"}) == {"queue": "[]"}


def test_sampling_params_are_all_explicit() -> None:
    params = complete({"max_new_tokens": 128}, stop_token_ids=[4])
    assert params["max_new_tokens"] == 128
    assert params["stop_token_ids"] == [4]
    assert set(DEFAULTS) <= set(params)
    with pytest.raises(ValueError, match="unknown sampling"):
        complete({"temprature": 0.5}, stop_token_ids=[4])
