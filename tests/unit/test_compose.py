"""docker-compose.yml, checked without Docker: every eaglegen command and flag is real,
every EAGLEGEN_* variable is a setting or a flag's variable, every long-running service
has a health check, and nothing internal is published."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

# Typer carries its own copy of click: its commands' errors are that copy's classes.
from typer._click.exceptions import UsageError
from typer.core import TyperGroup

from core.settings import Settings
from eaglegen.cli import app

ROOT = Path(__file__).resolve().parents[2]
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
# ${NAME}, ${NAME:-default}, ${NAME:?message}; $$ is a literal dollar.
REFERENCE = re.compile(r"(?<!\$)\$\{([A-Z0-9_]+)(?::?([-?])([^}]*))?\}")
ENV_EXAMPLE = dict(
    line.split("=", 1)
    for line in (ROOT / ".env.example").read_text().splitlines()
    if line and not line.startswith("#")
)


def substitute(value: str) -> str:
    """``value`` with each ${NAME} as .env.example sets it (or its default)."""

    def one(match: re.Match[str]) -> str:
        name, kind, default = match.groups()
        if name in ENV_EXAMPLE:
            return ENV_EXAMPLE[name]
        assert kind == "-", f"${{{name}}} is neither in .env.example nor defaulted"
        return default

    return REFERENCE.sub(one, value)


def eaglegen_commands() -> list[tuple[str, list[str]]]:
    """(service, argv) of every eaglegen invocation: commands and health checks."""
    found = []
    for name, service in SERVICES.items():
        for argv in (service.get("command"), (service.get("healthcheck") or {}).get("test")):
            if isinstance(argv, list):
                argv = argv[1:] if argv[0] == "CMD" else argv
                if argv and argv[0] == "eaglegen":
                    found.append((name, [substitute(a) for a in argv[1:]]))
    return found


def parse(argv: list[str]) -> None:
    """Parse ``argv`` as `eaglegen` would, down to the command, without running it."""
    command: Any = typer.main.get_command(app)
    ctx = command.make_context("eaglegen", list(argv), resilient_parsing=False)
    while isinstance(command, TyperGroup):
        args = [*ctx._protected_args, *ctx.args]
        name, sub, rest = command.resolve_command(ctx, args)
        assert sub is not None and name is not None
        command, ctx = sub, sub.make_context(name, rest, parent=ctx)


def cli_envvars() -> set[str]:
    """Every environment variable an eaglegen flag reads."""
    names: set[str] = set()

    def walk(command: Any) -> None:
        for param in command.params:
            envvar = getattr(param, "envvar", None)
            names.update([envvar] if isinstance(envvar, str) else envvar or [])
        for sub in getattr(command, "commands", {}).values():
            walk(sub)

    walk(typer.main.get_command(app))
    return names


@pytest.mark.parametrize(("service", "argv"), eaglegen_commands(), ids=lambda v: str(v))
def test_each_eaglegen_command_and_flag_exists(service: str, argv: list[str]) -> None:
    parse(argv)  # raises UsageError on an unknown command, flag or value


def test_a_wrong_flag_would_be_caught() -> None:
    with pytest.raises(UsageError):
        parse(["worker", "--numa-nodes", "0"])
    with pytest.raises(UsageError):
        parse(["db", "upgrad"])
    with pytest.raises(UsageError):
        parse(["metrics", "--port", "0"])


def test_every_eaglegen_variable_is_a_setting_or_a_flags() -> None:
    settings = {f"EAGLEGEN_{name.upper()}" for name in Settings.model_fields}
    known = settings | cli_envvars()
    used = {
        key
        for service in SERVICES.values()
        for key in (service.get("environment") or {})
        if key.startswith("EAGLEGEN_")
    }
    used |= {key for key in ENV_EXAMPLE if key.startswith("EAGLEGEN_")}
    assert used and used <= known, sorted(used - known)


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_the_settings_each_service_gets_are_valid(
    service: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in [k for k in os.environ if k.startswith("EAGLEGEN_")]:
        monkeypatch.delenv(key)
    for key, value in (SERVICES[service].get("environment") or {}).items():
        if key.startswith("EAGLEGEN_"):
            monkeypatch.setenv(key, substitute(str(value)))
    Settings()  # raises on a value it cannot parse or out of range (e.g. servers' JSON)


def test_every_long_running_service_has_a_health_check() -> None:
    for name, service in SERVICES.items():
        if service.get("restart") == "no":
            # A one-shot job: what follows waits for its exit code instead.
            waiting = [
                other
                for other, s in SERVICES.items()
                if (s.get("depends_on") or {}).get(name, {}).get("condition")
                == "service_completed_successfully"
            ]
            assert waiting, f"{name} is one-shot but nothing waits for it to complete"
            continue
        test = (service.get("healthcheck") or {}).get("test")
        assert test and test != ["CMD", "true"], f"{name} has no real health check"


def test_nothing_internal_is_published() -> None:
    assert COMPOSE["networks"]["internal"]["internal"] is True
    for name in ("redis", "postgres"):
        assert SERVICES[name]["networks"] == ["internal"]
        assert "ports" not in SERVICES[name]
    for name, service in SERVICES.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def test_redis_keeps_every_message_and_wants_a_password() -> None:
    redis = " ".join(SERVICES["redis"]["entrypoint"])
    assert "--appendonly yes" in redis and "--maxmemory-policy noeviction" in redis
    assert "requirepass" in redis and "$$REDIS_PASSWORD" in redis
    flower = SERVICES["flower"]["environment"]
    assert flower["EAGLEGEN_FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:?")


def test_no_password_is_written_into_a_command_line() -> None:
    secrets = {ENV_EXAMPLE[k] for k in ("POSTGRES_PASSWORD", "REDIS_PASSWORD")}
    for name, service in SERVICES.items():
        argv = " ".join(
            str(a) for key in ("command", "entrypoint") for a in (service.get(key) or [])
        )
        assert "PASSWORD}" not in argv.replace("$$REDIS_PASSWORD", ""), name
        assert not any(secret in substitute(argv) for secret in secrets), name


def test_gpu_and_sim_servers_are_profiles() -> None:
    assert SERVICES["sglang"]["profiles"] == ["gpu"]
    assert SERVICES["sim"]["profiles"] == ["sim"]
    launch = ROOT / "ops/sglang/launch.sh"
    assert SERVICES["sglang"]["entrypoint"] == ["/ops/sglang/launch.sh"] and launch.exists()
