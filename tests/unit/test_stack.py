"""Embedded-stack decisions that need no running service."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from eaglegen.cli.base import load_settings, no_stack, parse_servers
from eaglegen.stack import (
    FLOWER_AUTH_ENV,
    FLOWER_TASK_COLUMNS,
    check_flower_exposure,
    check_metrics_exposure,
    flower_launch,
    pointer_path,
    read_stack_file,
    secure_data_dir,
    socket_url,
    write_pointer,
    write_stack_file,
)
from worker.app import nodename


@pytest.mark.parametrize("address", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_flower_on_loopback_needs_no_auth(address: str) -> None:
    check_flower_exposure(address, None)


@pytest.mark.parametrize("address", ["0.0.0.0", "10.1.2.3", "::"])
def test_flower_off_loopback_requires_auth(address: str) -> None:
    with pytest.raises(ValueError, match="flower-basic-auth"):
        check_flower_exposure(address, None)
    check_flower_exposure(address, "admin:secret")
    check_flower_exposure(address, "admin:se:cret")  # the user ends at the first colon


@pytest.mark.parametrize(
    "login",
    [
        "ops:Pa,ss:word",  # Flower would let in ops:Pa and ss:word, not the intended one
        "admin:secret,ops:other",
        " : ",
        "admin: ",
        "\t:secret",
        "admin:sec\x1bret",
    ],
)
def test_a_login_flower_would_split_or_that_is_blank_is_refused(login: str) -> None:
    for address in ("127.0.0.1", "0.0.0.0"):
        with pytest.raises(ValueError, match="must be one USER:PASSWORD") as refused:
            check_flower_exposure(address, login)
        assert login not in str(refused.value)  # the login is never echoed


@pytest.mark.parametrize("login", [":", "admin:", ":secret", ",", "admin:secret,", "nocolon"])
def test_a_flower_login_without_user_or_password_is_refused(login: str) -> None:
    for address in ("127.0.0.1", "0.0.0.0"):
        with pytest.raises(ValueError, match="USER:PASSWORD"):
            check_flower_exposure(address, login)


@pytest.mark.parametrize("address", ["0.0.0.0", "10.1.2.3", "127.attacker.example"])
def test_metrics_beyond_loopback_need_public(address: str) -> None:
    check_metrics_exposure("127.0.0.1", public=False)
    with pytest.raises(ValueError, match="reachable from other hosts with no login"):
        check_metrics_exposure(address, public=False)
    check_metrics_exposure(address, public=True)


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


def test_flower_gets_its_login_and_broker_password_by_environment_only() -> None:
    launch = flower_launch(
        "redis://:broker-pw@10.0.0.9:6379/0", "0.0.0.0", 5601, "ops:flower-pw", flag="--basic-auth"
    )
    argv = " ".join(launch.argv)
    assert "broker-pw" not in argv and "flower-pw" not in argv
    assert "--address=0.0.0.0" in argv and "--port=5601" in argv
    assert f"--tasks_columns={FLOWER_TASK_COLUMNS}" in argv
    assert launch.env == {
        "CELERY_BROKER_URL": "redis://:broker-pw@10.0.0.9:6379/0",
        "FLOWER_BASIC_AUTH": "ops:flower-pw",
    }
    assert "flower-pw" not in repr(launch)  # a launch that gets logged shows no secret
    assert launch.url == "http://0.0.0.0:5601"
    assert flower_launch("redis://h:1/0", "::1", 5555).url == "http://[::1]:5555"


def test_flower_off_loopback_names_the_flag_and_env_var_of_its_command() -> None:
    with pytest.raises(ValueError, match=f"--basic-auth USER:PASSWORD or set {FLOWER_AUTH_ENV}"):
        flower_launch("redis://h:1/0", "0.0.0.0", 5555, None, flag="--basic-auth")
    assert "FLOWER_BASIC_AUTH" not in flower_launch("redis://h:1/0").env  # loopback, no login


def test_worker_node_names_say_servers_numa_node_pid_and_host() -> None:
    where = f"pid{os.getpid()}@{socket.gethostname()}"
    assert nodename(["gpu0", "gpu1"], 1) == f"gpu0+gpu1.numa1.{where}"
    assert nodename(["10.0.0.5:30000"]) == f"10.0.0.5:30000.{where}"
    assert nodename(["a b/c@d"]) == f"a-b-c-d.{where}"  # one @ only: Celery splits on it
    many = nodename([f"server-number-{i}" for i in range(8)], 0)
    assert many == f"server-number-0+server-number-1+6more.numa0.{where}"


def test_the_stack_file_replaces_a_link_planted_there_instead_of_writing_through_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    data_dir = tmp_path / "stack"
    data_dir.mkdir()
    (data_dir / "stack.json").symlink_to(victim)
    write_stack_file(data_dir, {"broker_url": "redis://h:1/0"})
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    pointer = pointer_path()
    assert pointer is not None
    pointer.parent.mkdir(parents=True)
    pointer.symlink_to(victim)
    write_pointer(data_dir)
    assert victim.read_text() == "precious"
    for written in (data_dir / "stack.json", pointer):
        assert not written.is_symlink()
        assert stat.S_IMODE(written.stat().st_mode) == 0o600
    assert read_stack_file(data_dir) == {"broker_url": "redis://h:1/0"}
    assert pointer.read_text() == f"{data_dir.resolve()}\n"


def test_the_pointer_lives_under_xdg_config_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert pointer_path() == tmp_path / "eaglegen" / "stack"
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative/dir")  # ignored, as the spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert pointer_path() == tmp_path / "home" / ".config" / "eaglegen" / "stack"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert pointer_path() == tmp_path / "home" / ".config" / "eaglegen" / "stack"


def test_commands_find_the_stack_here_else_through_the_pointer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    assert load_settings().broker_url is None
    where = f"looked in {tmp_path / '.eaglegen'} and for {pointer_path()}"
    assert no_stack(load_settings()).endswith(where)

    far = tmp_path / "far" / "stack"
    write_stack_file(far, {"database_url": "postgresql://far/db", "broker_url": "redis://far:1/0"})
    write_pointer(far)
    settings = load_settings()
    assert (settings.broker_url, settings.data_dir) == ("redis://far:1/0", far.resolve())

    # A stack of the folder's own comes first; a folder named explicitly is the only one.
    write_stack_file(tmp_path / ".eaglegen", {"broker_url": "redis://here:2/0"})
    assert load_settings().broker_url == "redis://here:2/0"
    monkeypatch.setenv("EAGLEGEN_DATA_DIR", str(tmp_path / "named"))
    assert load_settings().broker_url is None
    assert no_stack(load_settings()).endswith(f"looked in {tmp_path / 'named'}")

    # A pointer to a folder whose stack is gone finds nothing, and says where it looked.
    monkeypatch.delenv("EAGLEGEN_DATA_DIR")
    (tmp_path / ".eaglegen" / "stack.json").unlink()
    (far / "stack.json").unlink()
    assert load_settings().broker_url is None
    assert f"and {far.resolve()} (named by {pointer_path()})" in no_stack(load_settings())


def test_the_data_dir_is_private(tmp_path: Path) -> None:
    data_dir = tmp_path / "stack"
    data_dir.mkdir(mode=0o755)
    (data_dir / "postgres").mkdir()  # this user's cluster: its server runs as this user
    secure_data_dir(data_dir)
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700


@pytest.mark.needs("root")
def test_the_data_dir_lets_a_server_user_of_its_own_through(tmp_path: Path) -> None:
    # As pgserver leaves it when root runs it: the cluster is another user's, and its
    # server runs in the group of the process that started it.
    data_dir = tmp_path / "stack"
    data_dir.mkdir(mode=0o755)
    (data_dir / "postgres").mkdir()
    os.chown(data_dir / "postgres", 65534, 65534)
    secure_data_dir(data_dir)
    folder = data_dir.stat()
    assert (stat.S_IMODE(folder.st_mode), folder.st_gid) == (0o710, os.getegid())
