"""`eaglegen worker`: run workers that generate queued jobs, or check they live."""

from __future__ import annotations

from typing import Annotated

import typer

from eaglegen.cli.base import (
    BrokerUrl,
    DatabaseUrl,
    DataDir,
    command,
    err,
    load_settings,
    parse_servers,
    services,
)

app = typer.Typer()


@command(app, context_settings={"allow_extra_args": False})
def worker(
    server: Annotated[
        list[str],
        typer.Option(
            help="SGLang server URL or NAME=URL (repeat); default: EAGLEGEN_SERVERS, "
            'a JSON list of {"name", "url", "numa_node"}'
        ),
    ] = [],  # noqa: B006
    concurrency: Annotated[
        int | None,
        typer.Option(
            min=1,
            envvar="EAGLEGEN_WORKER_CONCURRENCY",
            # The rule of worker.intake.default_threads, written out: worker modules are
            # imported when a command runs, not for --help.
            help="The most requests in flight at once, the Celery engine's threads (default: "
            "the most its servers' in-flight limits can reach; a worker takes only the jobs "
            "its servers have room for)",
        ),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            envvar="EAGLEGEN_WORKER_ENGINE",
            help="loop (default): every request on one event loop, jobs claimed and recorded "
            "in batches (less CPU a job); celery: a task per message on Celery's threads. "
            "Flower shows either's jobs as tasks",
        ),
    ] = None,
    numa_node: Annotated[
        str | None, typer.Option(help="Pin to NUMA node N, a list 0,1, or auto (one per node)")
    ] = None,
    processes: Annotated[
        int,
        typer.Option(
            min=1,
            max=64,
            help="Worker processes to start (unpinned; they share the in-flight limits): "
            "more than one where one process's CPU is the limit, with hundreds of requests in "
            "flight or streamed answers; --concurrency is per process",
        ),
    ] = 1,
    check: Annotated[
        bool, typer.Option("--check", help="Exit 0 if this host's workers are alive, else 1")
    ] = False,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            envvar="EAGLEGEN_METRICS_PORT",
            help="Serve Prometheus metrics on this port (all interfaces); a process pinned "
            "to NUMA node K, or the K-th of --processes (from 0), uses this port + K",
        ),
    ] = None,
    database_url: DatabaseUrl = None,
    broker_url: BrokerUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Run a worker that generates queued jobs (every request on one event loop; with
    --engine celery, a Celery worker on a threads pool)."""
    import socket

    from core import heartbeat
    from worker.commands import run_worker

    settings = load_settings(
        database_url=database_url,
        broker_url=broker_url,
        data_dir=data_dir,
        worker_concurrency=concurrency,
        worker_engine=engine,
        servers=parse_servers(server) if server else None,
        metrics_port=metrics_port,
    )
    live = services(settings, check_database=not check)  # --check reads heartbeats only
    if check:
        host = socket.gethostname()
        alive = heartbeat.alive(live.broker_url, host, 3 * settings.heartbeat_interval_s)
        err.print(f"{len(alive)} live worker process(es) on {host}")
        raise typer.Exit(0 if alive else 1)
    if not settings.servers:
        raise ValueError("no SGLang servers: pass --server URL or set EAGLEGEN_SERVERS")
    passthrough = [f"--server={s}" for s in server]
    if concurrency is not None:
        passthrough.append(f"--concurrency={concurrency}")
    if engine is not None:
        passthrough.append(f"--engine={engine}")
    raise typer.Exit(run_worker(settings, live, numa_node, passthrough, processes))
