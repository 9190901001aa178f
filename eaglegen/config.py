"""Building the Settings a command runs with: flags over environment over `eaglegen up`."""

from __future__ import annotations

from typing import Any

from eaglegen.settings import ServerSpec, Settings
from eaglegen.stack import read_stack_file


def load_settings(**flags: Any) -> Settings:
    """Settings from the environment with every flag that was given (not None) on top."""
    given = {k: v for k, v in flags.items() if v is not None and v != []}
    settings = Settings(**given)
    stack = read_stack_file(settings.data_dir) or {}
    updates: dict[str, Any] = {}
    if settings.database_url is None and stack.get("database_url"):
        updates["database_url"] = stack["database_url"]
    if settings.broker_url is None and stack.get("broker_url"):
        updates["broker_url"] = stack["broker_url"]
    return Settings(**{**given, **updates}) if updates else settings


def parse_servers(values: list[str]) -> list[ServerSpec]:
    """``--server URL`` or ``--server NAME=URL`` flags as server specs."""
    servers = []
    for index, value in enumerate(values):
        name, sep, url = value.partition("=")
        if not sep:
            name, url = f"server{index}", value
        servers.append(ServerSpec(name=name, url=url))
    return servers


def require_services(settings: Settings) -> tuple[str, str]:
    """The database and broker URLs, or a clear error saying how to provide them."""
    if settings.database_url is None or settings.broker_url is None:
        raise ValueError(
            "no database/broker configured: run `eaglegen up` first, or set "
            "EAGLEGEN_DATABASE_URL and EAGLEGEN_BROKER_URL (or pass --database-url/--broker-url)"
        )
    return settings.database_url, settings.broker_url
