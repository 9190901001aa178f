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
    stack_search,
    stack_settings,
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
    from core.settings import Settings
    from eaglegen.demo import DemoOptions, run_demo

    # Only the demo's own folder (given, else ./.eaglegen) may hold a stack it runs on: one
    # found through the user's pointer is another run's, whose workers must not get its jobs.
    settings = load_settings(data_dir=data_dir or Settings().data_dir)
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
    flower_address: Annotated[
        str | None, typer.Option(help="Flower bind address [default: recorded, else 127.0.0.1]")
    ] = None,
    flower_port: Annotated[
        int | None,
        typer.Option(help="Flower port [default: recorded, else 5555]", min=1, max=65535),
    ] = None,
    flower_basic_auth: FlowerLogin = None,
    json_out: JsonFlag = False,
) -> None:
    """Start embedded Postgres and Redis (unless configured) and Flower; migrate the schema.
    On a stack that is up already, start again what died and keep what runs."""
    from core.urls import redact
    from eaglegen import stack
    from models.db import upgrade

    settings = stack_settings(database_url=database_url, broker_url=broker_url, data_dir=data_dir)
    result = stack.up(
        settings.data_dir,
        database_url=settings.database_url,
        broker_url=settings.broker_url,
        flower_address=flower_address,
        flower_port=flower_port,
        flower_basic_auth=flower_basic_auth,
    )
    info = result.info
    upgrade(info["database_url"])
    shown = {
        **info,
        "database_url": redact(info["database_url"]),
        "broker_url": redact(info["broker_url"]),
        "started": result.started,
        "kept": result.kept,
        "notes": result.notes,
    }
    for note in result.notes:
        err.print(f"note: {note}", highlight=False, soft_wrap=True)
    if json_out:
        emit_json(shown)
        return
    for key in ("database_url", "broker_url", "flower_url", "data_dir"):
        err.print(f"{key}: {shown[key]}", highlight=False)
    if result.kept:
        done = f"started: {', '.join(result.started) or 'nothing'}"
        err.print(f"{done}; kept running: {', '.join(result.kept)}", highlight=False)


@command(app)
def down(data_dir: DataDir = None) -> None:
    """Stop what `eaglegen up` started."""
    from eaglegen import stack

    search = stack_search(stack_settings(data_dir=data_dir))
    if search.info is None:
        err.print(f"stopped: nothing was up ({search.looked})", highlight=False, soft_wrap=True)
        return
    stopped = stack.down(search.data_dir)
    done = ", ".join(stopped) or "nothing was running"
    err.print(f"stopped: {done} (the stack under {search.data_dir.resolve()})", highlight=False)
