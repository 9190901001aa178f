"""`eaglegen up`, `down` and `demo`: the embedded stack, and the whole pipeline on it."""

from __future__ import annotations

from typing import Annotated

import typer

from eaglegen.cli.base import (
    BrokerUrl,
    DatabaseUrl,
    DataDir,
    FlowerLogin,
    JsonFlag,
    command,
    emit_json,
    err,
    load_settings,
)

app = typer.Typer()


@command(app)
def demo(
    json_out: JsonFlag = False,
    data_dir: DataDir = None,
    concurrency: Annotated[int, typer.Option(min=1)] = 64,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 1024,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds")] = 600.0,
) -> None:
    """Start everything embedded, generate a bundled sample dataset, summarize, stop."""
    from eaglegen.demo import DemoOptions, run_demo

    settings = load_settings(data_dir=data_dir)
    summary = run_demo(
        settings,
        DemoOptions(concurrency=concurrency, max_new_tokens=max_new_tokens, timeout_s=timeout),
    )
    if json_out:
        emit_json(summary)
    else:
        err.print(summary["summary_line"], highlight=False, soft_wrap=True)
    if summary["jobs"]["done"] != summary["jobs"]["total"]:
        raise typer.Exit(1)


@command(app)
def up(
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    broker_url: BrokerUrl = None,
    flower_address: Annotated[str, typer.Option(help="Flower bind address")] = "127.0.0.1",
    flower_port: Annotated[int, typer.Option(help="Flower port")] = 5555,
    flower_basic_auth: FlowerLogin = None,
    json_out: JsonFlag = False,
) -> None:
    """Start embedded Postgres and Redis (unless configured) and Flower; migrate the schema."""
    from core.urls import redact
    from eaglegen import stack
    from models.db import upgrade

    settings = load_settings(database_url=database_url, broker_url=broker_url, data_dir=data_dir)
    info = stack.up(
        settings.data_dir,
        database_url=settings.database_url,
        broker_url=settings.broker_url,
        flower_address=flower_address,
        flower_port=flower_port,
        flower_basic_auth=flower_basic_auth,
    )
    upgrade(info["database_url"])
    shown = {
        **info,
        "database_url": redact(info["database_url"]),
        "broker_url": redact(info["broker_url"]),
    }
    if json_out:
        emit_json(shown)
    else:
        for key in ("database_url", "broker_url", "flower_url", "data_dir"):
            err.print(f"{key}: {shown[key]}", highlight=False)


@command(app)
def down(data_dir: DataDir = None) -> None:
    """Stop what `eaglegen up` started."""
    from eaglegen import stack

    settings = load_settings(data_dir=data_dir)
    stopped = stack.down(settings.data_dir)
    err.print(f"stopped: {', '.join(stopped) or 'nothing was up'}")
