"""`eaglegen status`: jobs by state per dataset."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from core.names import check_name
from eaglegen.cli.base import (
    BrokerUrl,
    DatabaseUrl,
    DataDir,
    JsonFlag,
    command,
    database,
    emit_json,
    err,
    load_settings,
    repository,
)

app = typer.Typer()


@command(app)
def status(
    run: Annotated[str | None, typer.Option(help="Only this run")] = None,
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    broker_url: BrokerUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Jobs by state per dataset."""
    from eaglegen.report.status import connections_warning, status_document, status_table

    settings = load_settings(database_url=database_url, broker_url=broker_url, data_dir=data_dir)
    with repository(database(settings)) as repo:
        counts = repo.counts(None if run is None else check_name("run", run))
        in_use, limit = repo.postgres_connections()
    if json_out:
        document = status_document(counts)
        document["postgres_connections"] = {"in_use": in_use, "max": limit}
        emit_json(document)
    else:
        Console().print(status_table(counts))
    warnings = [connections_warning(in_use, limit), broker_warning(settings.broker_url)]
    for warning in filter(None, warnings):
        err.print(f"[yellow]warning:[/] {warning}", highlight=False)


def broker_warning(broker_url: str | None) -> str | None:
    """Redis's eviction policy, when a broker is configured and answers (status reads
    Postgres only; an unreachable Redis is not this command's business)."""
    import redis

    from core.broker import eviction_warning

    if broker_url is None:
        return None
    client = redis.Redis.from_url(broker_url, socket_connect_timeout=2, socket_timeout=2)
    try:
        return eviction_warning(client)
    except redis.RedisError:
        return None
    finally:
        client.close()
