"""The Celery app of the worker process and its one task, ``generate``."""

from __future__ import annotations

import threading
from typing import Any

from celery import Celery, Task

from eaglegen.queue import TASK_GENERATE, make_celery
from eaglegen.settings import Settings
from worker.runner import Outcome, WorkerContext, run_attempt


class _LazyContext:
    """Builds the WorkerContext on first use, i.e. inside the process that runs tasks."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._ctx: WorkerContext | None = None

    def get(self) -> WorkerContext:
        with self._lock:
            if self._ctx is None:
                self._ctx = WorkerContext.build(self._settings)
            return self._ctx

    def close(self) -> None:
        with self._lock:
            if self._ctx is not None:
                self._ctx.close()
                self._ctx = None


def create_worker_app(settings: Settings) -> tuple[Celery, _LazyContext]:
    """A Celery app with the ``generate`` task bound to a lazily built context."""
    app = make_celery(settings)
    context = _LazyContext(settings)

    @app.task(name=TASK_GENERATE, bind=True, max_retries=None, acks_late=True, shared=False)  # type: ignore[untyped-decorator]
    def generate(self: Task, job_id: int) -> str:
        result = run_attempt(context.get(), int(job_id))
        if result.outcome is Outcome.RETRY:
            # The job is back in `queued`; this message comes back after the backoff.
            raise self.retry(countdown=result.retry_in_s)
        return str(result.outcome.value)

    return app, context


def worker_argv(
    settings: Settings, *, hostname: str | None = None, loglevel: str = "INFO"
) -> list[str]:
    """Arguments for ``app.worker_main``: threads pool, our queue, events for Flower."""
    argv = [
        "worker",
        "--pool=threads",
        f"--concurrency={settings.worker_concurrency}",
        f"--queues={settings.queue}",
        f"--loglevel={loglevel}",
        "--events",
        "--without-gossip",
        "--without-mingle",
    ]
    if hostname:
        argv.append(f"--hostname={hostname}")
    return argv


def start(settings: Settings, **kwargs: Any) -> None:
    """Run a worker in this process until it is stopped (SIGTERM/SIGINT)."""
    app, context = create_worker_app(settings)
    try:
        app.worker_main(worker_argv(settings, **kwargs))
    finally:
        context.close()
