"""`eaglegen flower`: Celery's dashboard for the configured broker, in the foreground."""

from __future__ import annotations

from typing import Annotated

import typer

from eaglegen.cli.base import (
    BrokerUrl,
    DataDir,
    FlowerLogin,
    command,
    err,
    load_settings,
    no_stack,
)

app = typer.Typer()


@command(app)
def flower(
    address: Annotated[
        str, typer.Option(help="Bind address; beyond loopback it needs --basic-auth")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port")] = 5555,
    basic_auth: FlowerLogin = None,
    broker_url: BrokerUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Run Flower for the broker the workers use (its /metrics serves Prometheus)."""
    from core.urls import redact
    from eaglegen import preflight, stack

    settings = load_settings(broker_url=broker_url, data_dir=data_dir)
    if settings.broker_url is None:
        raise ValueError(
            "no broker: set EAGLEGEN_BROKER_URL, pass --broker-url or run `eaglegen up` "
            f"({no_stack(settings)})"
        )
    launch = stack.flower_launch(
        settings.broker_url, address, port, basic_auth, flag="--basic-auth"
    )
    preflight.check_broker(settings.broker_url)
    login = "basic auth" if basic_auth else "no login (loopback only)"
    err.print(
        f"Flower on {launch.url} ({login}) for {redact(settings.broker_url)}", highlight=False
    )
    stack.exec_flower(launch)
