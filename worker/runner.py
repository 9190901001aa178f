"""One job attempt: claim, call the server, check, record. The Celery task wraps this."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from enum import Enum

from eaglegen.settings import Settings
from models.db import make_engine
from models.repository import Repository
from worker.retry import AttemptError, Disposition, backoff, decide
from worker.sglang import SGLangClient
from worker.validate import check_response

log = logging.getLogger(__name__)


class Outcome(Enum):
    """How an attempt ended, from this worker's point of view."""

    DONE = "done"
    NOT_CLAIMED = "not_claimed"  # another worker has it, or it is no longer queued
    RETRY = "retry"
    FAILED = "failed"
    LOST = "lost"  # our claim was taken away before we could record


@dataclass(frozen=True)
class Result:
    """The outcome and, for RETRY, the delay before the job is published again."""

    outcome: Outcome
    retry_in_s: float = 0.0


@dataclass
class WorkerContext:
    """Per-process state: built once, after the fork, shared by the pool's threads."""

    settings: Settings
    repo: Repository
    clients: list[SGLangClient]
    name: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")

    @classmethod
    def build(cls, settings: Settings) -> WorkerContext:
        """Engine, repository and one HTTP client per configured server."""
        if settings.database_url is None:
            raise ValueError("no database url: set EAGLEGEN_DATABASE_URL or pass --database-url")
        if not settings.servers:
            raise ValueError("no SGLang servers: set EAGLEGEN_SERVERS or pass --server URL")
        engine = make_engine(settings.database_url, pool_size=min(settings.worker_concurrency, 32))
        clients = [
            SGLangClient(
                s,
                timeout_s=settings.request_timeout_s,
                max_connections=s.max_inflight or settings.worker_concurrency,
            )
            for s in settings.servers
        ]
        return cls(settings=settings, repo=Repository(engine), clients=clients)

    def client_for(self, job_id: int) -> SGLangClient:
        """The server for this job (spread by id until routing by free slots lands)."""
        return self.clients[job_id % len(self.clients)]

    def close(self) -> None:
        """Release connections."""
        for client in self.clients:
            client.close()
        self.repo.engine.dispose()


def run_attempt(ctx: WorkerContext, job_id: int) -> Result:
    """Run one attempt of ``job_id``; every path leaves the job in a settled state."""
    claimed = ctx.repo.claim(job_id, ctx.name, ctx.settings.lease_seconds)
    if claimed is None:
        return Result(Outcome.NOT_CLAIMED)
    client = ctx.client_for(job_id)
    try:
        body = client.generate(claimed.input_ids, claimed.sampling_params, rid=str(job_id))
        record = check_response(body, claimed.input_ids, client.server.name)
    except AttemptError as error:
        return _settle_failure(ctx, job_id, claimed.attempts, error)
    if ctx.repo.record(job_id, ctx.name, record):
        return Result(Outcome.DONE)
    log.warning("job %s: claim lost before recording; result dropped", job_id)
    return Result(Outcome.LOST)


def _settle_failure(ctx: WorkerContext, job_id: int, attempts: int, error: AttemptError) -> Result:
    disposition = decide(error, attempts, ctx.settings.max_attempts)
    if disposition is Disposition.RETRY:
        ctx.repo.release(job_id, ctx.name, str(error))
        return Result(Outcome.RETRY, retry_in_s=backoff(attempts))
    ctx.repo.fail(job_id, ctx.name, str(error))
    log.warning("job %s failed after %s attempt(s): %s", job_id, attempts, error)
    return Result(Outcome.FAILED)
