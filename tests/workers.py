"""A worker in the test's own process, as `eaglegen worker` runs it: the Celery threads pool,
or the loop engine's event loop (``settings.worker_engine``), plus the side loops
(heartbeat, health, leases, and the feeder and reconciler that publish the jobs: without
them nothing stored reaches Redis)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
from celery.contrib.testing.worker import start_worker

from core.settings import Settings
from worker.app import create_worker_app
from worker.background import Background
from worker.loop import BATCH_CONNECTIONS, LoopWorker, run
from worker.runner import WorkerContext, release_held

# A module's tests run against each worker engine (the conftest's `worker_engine`).
EACH_ENGINE = pytest.mark.parametrize("worker_engine", ["celery", "loop"])
# A test about the Celery engine's own parts (its threads pool, its intake, kombu's acks).
CELERY_ONLY = pytest.mark.parametrize("worker_engine", ["celery"])
# How long the tasks still running when a test's worker stops may take to end.
TASKS_EXIT_S = 30.0


@contextmanager
def in_thread_worker(
    settings: Settings, hostname: str | None = None
) -> Iterator[tuple[WorkerContext, str]]:
    """Run a worker until the block ends; its context and node name."""
    if settings.worker_engine == "loop":
        with in_thread_loop_worker(settings, hostname) as running:
            yield running
        return
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
        ) as controller:
            try:
                yield ctx, name
            finally:
                ctx.stopping.set()  # as on SIGTERM: a task waiting out an outage gives up
        _join_tasks(controller.pool.executor, TASKS_EXIT_S)
    finally:
        background.stop()
        holder.close()


@contextmanager
def in_thread_loop_worker(
    settings: Settings, hostname: str | None = None
) -> Iterator[tuple[WorkerContext, str]]:
    """The loop engine's worker (worker.loop) on a thread of its own until the block ends,
    then stopped as SIGTERM stops it: the grace period, then the jobs still held given back."""
    ctx = WorkerContext.build(settings, settings.services(), settings.servers, BATCH_CONNECTIONS)
    name = hostname or f"eaglegen-test-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
    worker = LoopWorker(ctx, settings.services(), name)
    background = Background(ctx, None, name, flower=worker.events.app)
    background.start()
    loops: list[asyncio.AbstractEventLoop] = []
    thread = threading.Thread(target=run, args=(worker, loops.append), name="loop-worker")
    thread.start()
    try:
        yield ctx, name
    finally:
        ctx.begin_stop()
        while thread.is_alive() and not loops:
            time.sleep(0.01)
        if loops:
            loops[0].call_soon_threadsafe(worker.stop)
        thread.join(TASKS_EXIT_S + settings.shutdown_grace_s)
        background.stop()
        release_held(ctx)
        ctx.close()
        if thread.is_alive():
            raise RuntimeError(f"the loop worker still runs {TASKS_EXIT_S:g} s after its stop")


def _join_tasks(executor: ThreadPoolExecutor, timeout_s: float) -> None:
    """Wait for the tasks still running in the threads pool. start_worker ends the worker
    with a cold shutdown, which does not wait for them (`eaglegen worker` stops warm, which
    does): a task left running would outlive its closed context into the next test, taking
    connections from a disposed pool and calling what that test patches."""
    waiter = threading.Thread(
        target=executor.shutdown, kwargs={"wait": True, "cancel_futures": True}, daemon=True
    )
    waiter.start()
    waiter.join(timeout_s)
    if waiter.is_alive():
        raise RuntimeError(f"tasks still running {timeout_s:g} s after the worker stopped")
