"""`eaglegen status`: progress, rates and ETA per dataset, server and run; `eaglegen
metrics`: the same figures for Prometheus."""

from __future__ import annotations

import functools
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

import typer
from rich.console import Console, Group, RenderableType
from rich.text import Text

from core.names import check_name
from core.urls import redact, scrub
from eaglegen.cli.base import (
    BrokerUrl,
    DatabaseUrl,
    DataDir,
    JsonFlag,
    checked_reader,
    checked_repository,
    command,
    console,
    emit_json,
    err,
    load_settings,
    open_reader,
)
from eaglegen.report.text import inline

# Redis's client, and what reads Redis, are imported once a broker is configured: without
# one, status reads Postgres only.
if TYPE_CHECKING:
    from core.heartbeat import Heartbeat
    from core.settings import Settings
    from models.snapshot import StatusSnapshot

app = typer.Typer()
# A heartbeat older than this is a worker gone (heartbeats are renewed every few seconds).
BEAT_MAX_AGE_S = 60.0


@command(app)
def status(
    run: Annotated[str | None, typer.Option(help="Only this run")] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh the view until Ctrl-C.")] = False,
    interval: Annotated[
        float, typer.Option(min=0.5, help="Seconds between refreshes with --watch.")
    ] = 5.0,
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    broker_url: BrokerUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Jobs by state, tokens, budgets, rates and ETA per dataset; servers; the run's ETA."""
    from eaglegen.report.status import connections_warning, status_document, status_view
    from models.status import postgres_connections, read_status

    settings = load_settings(database_url=database_url, broker_url=broker_url, data_dir=data_dir)
    name = None if run is None else check_name("run", run)
    with checked_reader(settings) as (url, conn):
        if watch and not json_out:
            out = console()
            refresh = Refresh(
                lambda: _view(settings, _read(url, name)), url, interval, keep=out.is_terminal
            )
            _watch(refresh, interval, out)
            return
        try:
            snapshot = read_status(conn, name)
            in_use, limit = postgres_connections(conn)
        except Exception as exc:
            from models.db import lost_database

            reason = lost_database(exc)
            if reason is None:
                raise
            raise ValueError(f"lost Postgres at {redact(url)}: {scrub(reason, url)}") from exc
    beats, state, eviction = _read_redis(settings)
    if json_out:
        document = status_document(snapshot, beats, state)
        document["postgres_connections"] = {"in_use": in_use, "max": limit}
        emit_json(document)
    else:
        console().print(status_view(snapshot, beats, state))
    warnings = [
        connections_warning(in_use, limit),
        eviction,
        *_unserved(beats),
        *_model_changes(beats),
    ]
    for warning in filter(None, warnings):
        err.print(f"[yellow]warning:[/] {inline(warning)}", highlight=False)


@command(app)
def metrics(
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to serve /metrics on")] = 9464,
    host: Annotated[str, typer.Option(help="Address to bind")] = "127.0.0.1",
    public: Annotated[
        bool, typer.Option(help="Serve beyond loopback (the figures have no login)")
    ] = False,
    run: Annotated[str | None, typer.Option(help="Only this run")] = None,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Serve the figures of `status` on /metrics for Prometheus until Ctrl-C or SIGTERM (one
    per cluster: it reads Postgres, the same for every worker)."""
    from prometheus_client import start_http_server
    from prometheus_client.core import CollectorRegistry

    from eaglegen.report.prometheus import StatusCollector
    from eaglegen.stack import check_metrics_exposure

    check_metrics_exposure(host, public)
    settings = load_settings(database_url=database_url, data_dir=data_dir)
    name = None if run is None else check_name("run", run)
    with checked_repository(settings) as repo:
        registry = CollectorRegistry()
        registry.register(StatusCollector(lambda: repo.status(name)))
        server, thread = start_http_server(port, addr=host, registry=registry)
        err.print(f"serving eaglegen metrics on http://{inline(host)}:{port}/metrics")
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
        finally:
            server.shutdown()
            thread.join(timeout=5)


# `exporter` was this command's name until it was confused with `export`: kept, unlisted.
@command(app, name="exporter", hidden=True)
@functools.wraps(metrics)
def _exporter(*args: Any, **kwargs: Any) -> None:
    err.print(
        "[yellow]warning:[/] `eaglegen exporter` is now `eaglegen metrics`; "
        "the old name will be removed",
        highlight=False,
    )
    metrics(*args, **kwargs)


def _read(url: str, run: str | None) -> StatusSnapshot:
    """A snapshot read on a connection of its own: each refresh of `status --watch` connects
    again, so one that follows a lost Postgres needs nothing reset."""
    from models.status import read_status

    with open_reader(url) as conn:
        return read_status(conn, run)


def _view(settings: Settings, snapshot: StatusSnapshot) -> Group:
    """The terminal view of a snapshot with what Redis says now."""
    from eaglegen.report.status import status_view

    beats, state, _ = _read_redis(settings)
    return status_view(snapshot, beats, state)


class Refresh:
    """What `status --watch` shows at each refresh: the view, with the time it was read.
    While Postgres cannot be reached, a line saying so and since when instead (each refresh
    tries again), above the last view read when ``keep`` (a terminal redraws in place; a
    log gets the line alone)."""

    def __init__(
        self, view: Callable[[], RenderableType], url: str, interval: float, *, keep: bool
    ) -> None:
        self.view = view
        self.url = url
        self.interval = interval
        self.keep = keep
        self.lost_since: datetime | None = None
        self.last: RenderableType | None = None

    def __call__(self) -> RenderableType:
        from models.db import lost_database

        now = datetime.now().astimezone()
        try:
            view = self.view()
        except Exception as exc:
            reason = lost_database(exc)
            if reason is None:
                raise
            return self._lost(now, scrub(reason, self.url))
        self.lost_since = None
        self.last = Group(Text(f"status at {_clock(now)}", style="dim"), view)
        return self.last

    def _lost(self, now: datetime, reason: str) -> RenderableType:
        if self.lost_since is None:
            self.lost_since = now
        line = Text.assemble(
            (f"{_clock(now)} Postgres at {redact(self.url)} unreachable", "bold red"),
            f" since {_clock(self.lost_since)} ({reason}); retrying every "
            f"{self.interval:g} s until it answers or Ctrl-C",
        )
        if self.keep and self.last is not None:
            return Group(line, self.last)
        return line


def _clock(at: datetime) -> str:
    return at.isoformat(sep=" ", timespec="seconds")


def _watch(view: Callable[[], RenderableType], interval: float, out: Console) -> None:
    """Show ``view()`` every ``interval`` seconds until Ctrl-C (which ends it cleanly):
    redrawn in place on a terminal, one after the other on a file or a pipe (a log)."""
    from rich.live import Live

    try:
        if not out.is_terminal:
            while True:
                out.print(view())
                out.print()
                time.sleep(interval)
        with Live(view(), console=out, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(interval)
                live.update(view(), refresh=True)
    except KeyboardInterrupt:
        return


class RedisView(NamedTuple):
    """What status shows from Redis: None each without a broker or when it does not answer."""

    beats: list[Heartbeat] | None = None
    # Messages waiting in the queue list, the feeder's bound (from its last pass) and why
    # each adaptive limit is what it is.
    state: dict[str, Any] | None = None
    eviction: str | None = None  # what to do about Redis's eviction policy, if anything


def _read_redis(settings: Settings) -> RedisView:
    """What status shows from Redis, on one client (status reads Postgres first; the live
    workers and the queue are a bonus)."""
    if settings.broker_url is None:
        return RedisView()
    import redis

    from core.broker import eviction_warning, feed_bound
    from core.heartbeat import alive_on
    from core.limits import read_limit

    try:
        with redis.Redis.from_url(
            settings.broker_url, socket_connect_timeout=5, socket_timeout=5
        ) as client:
            beats = alive_on(client, None, BEAT_MAX_AGE_S)
            servers = sorted({name for beat in beats for name in beat.servers})
            waiting = int(client.llen(settings.queue))
            bound = feed_bound(client, settings.queue)
            records = {name: read_limit(client, name) for name in servers}
            eviction = eviction_warning(client)
    except redis.RedisError:
        return RedisView()
    state = {
        "in_redis": waiting,
        "bound": bound,
        "limit_reasons": {name: r.reason for name, r in records.items() if r is not None},
    }
    return RedisView(beats, state, eviction)


def _unserved(beats: list[Heartbeat] | None) -> list[str]:
    """Why jobs of a run wait: runs some live worker has no server for, with its reason."""
    reasons: dict[str, str] = {}
    for beat in beats or []:
        for run, reason in beat.unserved_runs.items():
            reasons.setdefault(run, f"worker {beat.worker}: {reason}")
    return [f"run {run}: {reason}" for run, reason in sorted(reasons.items())]


def _model_changes(beats: list[Heartbeat] | None) -> list[str]:
    """Servers some live worker saw start serving another model behind the same URL."""
    changes: dict[tuple[str, str | None, str], str] = {}
    for beat in beats or []:
        for name, server in beat.servers.items():
            if server.previous_model is not None:
                key = (name, server.model, server.previous_model)
                changes.setdefault(key, beat.worker)
    return [
        f"server {name} serves {model or 'a model not known yet'} (changed from {previous}, "
        f"seen by worker {worker}): runs for {previous} are no longer generated there"
        for (name, model, previous), worker in sorted(changes.items(), key=lambda c: str(c[0]))
    ]
