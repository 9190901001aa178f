"""The Celery app of the worker process, its one task ``generate``, and process start-up."""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

from celery import Celery, Task
from celery.signals import worker_shutting_down
from sqlalchemy.exc import OperationalError

from eaglegen.queue import TASK_GENERATE, BulkPublisher, make_celery
from eaglegen.settings import ServerSpec, Settings
from worker.background import Background
from worker.retry import backoff
from worker.runner import Outcome, WorkerContext, run_attempt

log = logging.getLogger(__name__)
# Outcomes after which this message's job needs another message: after a backoff, or at
# once so that a worker with a free slot takes it.
_REQUEUE = frozenset({Outcome.RETRY, Outcome.DEFERRED, Outcome.NO_SLOT})


class ContextHolder:
    """Builds the WorkerContext on first use, i.e. inside the process that runs tasks."""

    def __init__(self, settings: Settings, servers: list[ServerSpec] | None = None) -> None:
        self._settings = settings
        self._servers = servers
        self._lock = threading.Lock()
        self._ctx: WorkerContext | None = None

    def get(self) -> WorkerContext:
        """The process's context, built once."""
        with self._lock:
            if self._ctx is None:
                self._ctx = WorkerContext.build(self._settings, self._servers)
            return self._ctx

    def close(self) -> None:
        """Release connections."""
        with self._lock:
            if self._ctx is not None:
                self._ctx.close()
                self._ctx = None


def create_worker_app(
    settings: Settings, servers: list[ServerSpec] | None = None
) -> tuple[Celery, ContextHolder]:
    """A Celery app with the ``generate`` task bound to a lazily built context."""
    app = make_celery(settings)
    holder = ContextHolder(settings, servers)

    @app.task(name=TASK_GENERATE, bind=True, max_retries=None, acks_late=True, shared=False)  # type: ignore[untyped-decorator]
    def generate(self: Task, job_id: int) -> str:
        ctx = holder.get()
        try:
            result = run_attempt(ctx, int(job_id))
        except OperationalError as exc:
            # Postgres unreachable (restart, failover): keep this job's message instead of
            # acking it away with a failure, and ask again after a backoff.
            log.warning("job %s: database unavailable (%s); retrying", job_id, exc.orig)
            s = ctx.settings
            delay = backoff(self.request.retries + 1, s.retry_base_s, s.retry_cap_s)
            raise self.retry(countdown=delay) from None
        if result.outcome in _REQUEUE:
            # The job is `queued` in Postgres; this publishes its next message and acks ours.
            raise self.retry(countdown=result.retry_in_s)
        return str(result.outcome.value)

    return app, holder


def nodename() -> str:
    """A Celery node name unique to this process (several workers may share a host)."""
    return f"eaglegen-{os.getpid()}@{socket.gethostname()}"


def worker_argv(settings: Settings, *, hostname: str, loglevel: str = "INFO") -> list[str]:
    """Arguments for ``app.worker_main``: threads pool, our queue, events for Flower."""
    return [
        "worker",
        "--pool=threads",
        f"--concurrency={settings.worker_concurrency}",
        f"--queues={settings.queue}",
        f"--loglevel={loglevel}",
        "--events",
        "--without-gossip",
        "--without-mingle",
        f"--hostname={hostname}",
    ]


def start(
    settings: Settings,
    servers: list[ServerSpec] | None = None,
    info: dict[str, Any] | None = None,
    loglevel: str = "INFO",
) -> None:
    """Run a worker in this process until SIGTERM/SIGINT, then shut down with a grace period."""
    app, holder = create_worker_app(settings, servers)
    ctx = holder.get()
    name = nodename()
    background = Background(ctx, app, name, info)
    background.start()
    _on_shutdown(ctx)
    try:
        app.worker_main(worker_argv(settings, hostname=name, loglevel=loglevel))
    finally:
        background.stop()
        holder.close()


def _on_shutdown(ctx: WorkerContext) -> None:
    """On SIGTERM: take no new jobs, let running ones finish for the grace period, then
    give their claims back (without spending an attempt) and exit."""

    def abandon() -> None:
        jobs = ctx.running_jobs()
        publisher = BulkPublisher(ctx.settings.broker_url or "", ctx.settings.queue)
        released = [
            j
            for j in jobs
            if ctx.repo.release(
                j, ctx.name, "worker stopped before the request finished", refund=True
            )
        ]
        publisher.publish(released)
        publisher.close()
        ctx.router.release_all()  # else other workers lose these slots for slot_lease_seconds
        log.warning("grace period over: released %s running job(s): %s", len(released), released)
        # Celery's cold shutdown would still join the pool's threads, which wait on their
        # requests: leave now. Our messages stay unacked; Redis redelivers them later and
        # the claim turns those duplicates away.
        logging.shutdown()
        os._exit(0)

    @worker_shutting_down.connect(weak=False)  # type: ignore[untyped-decorator]
    def shutting_down(**_: Any) -> None:
        ctx.stopping.set()
        timer = threading.Timer(ctx.settings.shutdown_grace_s, abandon)
        timer.daemon = True
        timer.start()
