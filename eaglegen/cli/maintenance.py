"""`eaglegen reconcile` and `eaglegen audit`: repair Redis from Postgres, check invariants."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from eaglegen.cli.base import (
    BrokerUrl,
    DatabaseUrl,
    DataDir,
    JsonFlag,
    checked_repository,
    command,
    emit_json,
    err,
    load_settings,
    repository,
    services,
    with_lock_retries,
)

if TYPE_CHECKING:
    from worker.feeder import FeedReport
    from worker.reconcile import ReconcileReport

app = typer.Typer()


@command(app)
def reconcile(
    republish_after: Annotated[
        float | None,
        typer.Option(
            help="Publish again queued jobs whose message went out this many seconds ago and "
            "is missing from Redis (default EAGLEGEN_REPUBLISH_AFTER_S)"
        ),
    ] = None,
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    broker_url: BrokerUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Re-queue jobs of dead workers, find lost messages, and top the Redis window up."""
    import redis

    from core.broker import Publisher
    from worker.feeder import Feeder
    from worker.reconcile import reconcile as run_reconcile

    settings = load_settings(
        database_url=database_url,
        broker_url=broker_url,
        data_dir=data_dir,
        republish_after_s=republish_after,
    )
    live = services(settings)
    with (
        repository(live.database_url) as repo,
        redis.Redis.from_url(live.broker_url) as client,
        Publisher(live.broker_url, settings.queue) as publisher,
    ):

        def one_pass() -> tuple[ReconcileReport, FeedReport]:
            found = run_reconcile(
                repo,
                client,
                settings.queue,
                max_attempts=settings.max_attempts,
                republish_after_s=settings.republish_after_s,
            )
            return found, Feeder(repo, client, publisher, window=settings.window).feed()

        report, fed = with_lock_retries(one_pass, "a job or dataset row")
    if json_out:
        emit_json({**report.as_dict(), "feed": fed.as_dict()})
    else:
        err.print(
            f"re-queued {report.expired_leases} job(s) with expired leases, found "
            f"{report.republished} lost message(s); published {fed.published} "
            f"(window {fed.window}, {fed.in_redis} were waiting)"
        )


@command(app)
def audit(
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Check the invariants on a live database; exit 1 naming any violation."""
    from eaglegen.report.audit import audit_document, audit_lines

    settings = load_settings(database_url=database_url, data_dir=data_dir)
    with checked_repository(settings) as repo:
        # A lease may lapse for up to one reconciler interval before it is noticed.
        problems = repo.audit(lease_grace_s=2 * settings.reconcile_interval_s)
        overshoot = repo.max_overshoot()
    if json_out:
        emit_json(audit_document(problems, overshoot))
    else:
        for line in audit_lines(problems, overshoot):
            err.print(line, highlight=False)
    if problems:
        raise typer.Exit(1)
