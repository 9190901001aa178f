"""Embedded-stack decisions that need no running service."""

from __future__ import annotations

from pathlib import Path

import pytest

from eaglegen.cli.base import load_settings, parse_servers
from eaglegen.stack import check_flower_exposure, socket_url, write_stack_file


@pytest.mark.parametrize("address", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_flower_on_loopback_needs_no_auth(address: str) -> None:
    check_flower_exposure(address, None)


@pytest.mark.parametrize("address", ["0.0.0.0", "10.1.2.3", "::"])
def test_flower_off_loopback_requires_auth(address: str) -> None:
    with pytest.raises(ValueError, match="flower-basic-auth"):
        check_flower_exposure(address, None)
    check_flower_exposure(address, "admin:secret")
    check_flower_exposure(address, "admin:secret,ops:other")


@pytest.mark.parametrize("login", [":", "admin:", ":secret", ",", "admin:secret,", "nocolon"])
def test_a_flower_login_without_user_or_password_is_refused(login: str) -> None:
    for address in ("127.0.0.1", "0.0.0.0"):
        with pytest.raises(ValueError, match="USER:PASSWORD"):
            check_flower_exposure(address, login)


@pytest.mark.parametrize("address", ["127.attacker.example", "localhost.attacker.example"])
def test_a_name_that_only_looks_like_loopback_is_not(address: str) -> None:
    with pytest.raises(ValueError, match="reachable from other hosts"):
        check_flower_exposure(address, None)


def test_pgserver_uri_becomes_a_psycopg_socket_url() -> None:
    url = socket_url("postgresql://postgres:@/postgres?host=/tmp/x y/postgres")
    assert url == "postgresql+psycopg://postgres@/postgres?host=/tmp/x%20y/postgres"


def test_flags_override_env_and_env_overrides_the_stack_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_stack_file(
        tmp_path, {"database_url": "postgresql://stack/db", "broker_url": "redis://stack:1/0"}
    )
    monkeypatch.setenv("EAGLEGEN_DATA_DIR", str(tmp_path))
    assert load_settings().broker_url == "redis://stack:1/0"
    monkeypatch.setenv("EAGLEGEN_BROKER_URL", "redis://env:2/0")
    assert load_settings().broker_url == "redis://env:2/0"
    assert load_settings(broker_url="redis://flag:3/0").broker_url == "redis://flag:3/0"
    assert load_settings().database_url == "postgresql+psycopg://stack/db"


def test_server_flags_accept_names() -> None:
    servers = parse_servers(["http://a:1/", "gpu1=http://b:2", "http://c:3/?x=y"])
    assert [(s.name, s.url) for s in servers] == [
        ("a:1", "http://a:1"),  # unnamed: by where it is, the same on every host
        ("gpu1", "http://b:2"),
        ("c:3", "http://c:3/?x=y"),
    ]
