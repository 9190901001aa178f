"""A worker in the test's own process, as `eaglegen worker` runs it: the Celery threads pool
plus the side loops (heartbeat, health, leases, and the feeder and reconciler that publish
the jobs: without them nothing stored reaches Redis)."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from celery.contrib.testing.worker import start_worker

from core.settings import Settings
from worker.app import create_worker_app
from worker.background import Background
from worker.runner import WorkerContext


@contextmanager
def in_thread_worker(
    settings: Settings, hostname: str | None = None
) -> Iterator[tuple[WorkerContext, str]]:
    """Run a worker until the block ends; its context and Celery node name."""
    app, holder = create_worker_app(settings, settings.services())
    ctx = holder.get()
    name = hostname or f"eaglegen-test-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
    background = Background(ctx, app, name)
    background.start()
    try:
        with start_worker(
            app,
            pool="threads",
            concurrency=settings.worker_concurrency,
            perform_ping_check=False,
            queues=[settings.queue],
            shutdown_timeout=30,
            hostname=name,
        ):
            yield ctx, name
    finally:
        background.stop()
        holder.close()
