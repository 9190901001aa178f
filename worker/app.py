"""The Celery app of the worker process, its one task ``generate``, and process start-up."""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
from collections.abc import Sequence
from typing import Any

from celery import Celery, Task, bootsteps
from celery.exceptions import Ignore, Retry
from celery.signals import worker_shutdown, worker_shutting_down
from celery.worker import worker as celery_worker
from celery.worker.consumer.tasks import Tasks

from core import wire
from core.broker import eviction_warning
from core.settings import ServerSpec, Services, Settings
from core.wire import TASK_GENERATE
from worker import metrics
from worker.background import Background
from worker.celeryconfig import make_celery
from worker.events import GIVEN_BACK, EventBatches, OpenTasks, announce_exit, sent_back
from worker.intake import default_threads
from worker.numa import PinResult
from worker.outages import one_line
from worker.retry import backoff
from worker.runner import (
    DATABASE_UNAVAILABLE,
    SENT_BACK,
    Drain,
    Outcome,
    Result,
    WorkerContext,
    release_held,
    run_attempt,
)

log = logging.getLogger(__name__)


class JobFailed(Exception):
    """The job ended failed: the task fails with this one line (FAILURE in Flower)."""


class SentBack(Retry):  # type: ignore[misc]
    """The job was sent back to the queue (a retryable error, a budget deferral, no free
    slot): the task ends as RETRY, as with Celery's own ``Task.retry``, with the reason."""

    def __repr__(self) -> str:
        return sent_back(self.message)


class GenerateTask(Task):  # type: ignore[misc]
    """The ``generate`` task's class: its planned endings carry no stack trace.

    A failed job (``JobFailed``, expected: Celery logs it in one line at INFO) and a job
    sent back (``SentBack``) are decisions, not crashes; a trace of this module would only
    hide the reason in Flower's task page and the log.
    """

    throws = (JobFailed,)

    def on_retry(self, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        """Ship the reason as the retry's trace (Celery sends a trace with every retry)."""
        einfo.traceback = str(getattr(einfo.exception, "exc", exc))

    def on_failure(self, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        """No trace for a job that failed by decision; an unforeseen error keeps its own."""
        if isinstance(exc, JobFailed):
            einfo.traceback = None


class ContextHolder:
    """Builds the WorkerContext on first use, i.e. inside the process that runs tasks."""

    def __init__(self, settings: Settings, services: Services, servers: list[ServerSpec]) -> None:
        self._settings = settings
        self._services = services
        self._servers = servers
        self._lock = threading.Lock()
        self._ctx: WorkerContext | None = None

    def get(self) -> WorkerContext:
        """The process's context, built once."""
        with self._lock:
            if self._ctx is None:
                self._ctx = WorkerContext.build(self._settings, self._services, self._servers)
            return self._ctx

    def close(self) -> None:
        """Release connections."""
        with self._lock:
            if self._ctx is not None:
                self._ctx.close()
                self._ctx = None


def create_worker_app(
    settings: Settings, services: Services, servers: list[ServerSpec] | None = None
) -> tuple[Celery, ContextHolder]:
    """A Celery app with the ``generate`` task bound to a lazily built context.

    ``servers``: the SGLang servers this worker calls (default: every configured one).
    """
    attached = settings.servers if servers is None else servers
    app = make_celery(settings, services.broker_url)
    # The pool's threads, also when a worker is started without --concurrency (the tests).
    app.conf.worker_concurrency = default_threads(settings, attached)
    holder = ContextHolder(settings, services, attached)
    app.steps["consumer"].add(_intake_gate(holder))
    app.steps["consumer"].add(EventBatches)

    @app.task(  # type: ignore[untyped-decorator]
        name=TASK_GENERATE,
        base=GenerateTask,
        bind=True,
        max_retries=None,
        acks_late=True,
        shared=False,
    )
    def generate(self: Task, job_id: int) -> str:
        ctx = holder.get()
        job_id = int(job_id)
        try:
            result = run_attempt(ctx, job_id)
        except DATABASE_UNAVAILABLE as exc:
            # Postgres unreachable (restart, failover) or the pool exhausted: keep this job's
            # message instead of acking it away with a failure, and ask again after a backoff.
            # The log says so once per outage (worker.outages), not once per job.
            ctx.outages.service_down(exc)
            s = ctx.settings
            delay = backoff(self.request.retries + 1, s.retry_base_s, s.retry_cap_s)
            reason = f"database unavailable: {one_line(exc)}"
            # Postgres cannot take the job back to the feeder: the message goes back itself.
            result = Result(Outcome.RETRY, delay, reason=reason, resend=True)
        ctx.metrics.attempt(result.outcome.value)
        ctx.ended(job_id, result.outcome)
        return _ending(ctx, self, job_id, result)

    return app, holder


def _intake_gate(holder: ContextHolder) -> type[bootsteps.StartStopStep]:
    """A consumer step that gates the task consumer by the worker's intake (worker.intake),
    started after Celery's own (which creates the consumer), again after each reconnect."""

    class IntakeGate(bootsteps.StartStopStep):  # type: ignore[misc]
        requires = (Tasks,)

        def start(self, c: Any) -> None:
            holder.get().intake.gate(c.task_consumer.channel.qos)

    return IntakeGate


def _ending(ctx: WorkerContext, task: Task, job_id: int, result: Result) -> str:
    """End the task as what happened to the job: its result string (done and the
    duplicates), or SentBack (RETRY), JobFailed (FAILURE), the SKIPPED event."""
    if result.outcome in SENT_BACK:
        if result.outcome is Outcome.NO_SLOT or result.resend:  # ours is acked: send it again
            ctx.publisher.publish_later(
                job_id,
                countdown=result.retry_in_s,
                retries=task.request.retries + 1,
                task_id=task.request.id,  # one task in Flower through its retries
                job_tag=wire.tag_of(job_id, task.request.argsrepr),
            )
        raise SentBack(result.reason, when=round(result.retry_in_s, 3))
    if result.outcome is Outcome.FAILED:
        raise JobFailed(result.reason)
    if result.outcome is Outcome.SKIPPED:
        _tell_skipped(ctx, task)
        raise Ignore()  # no task-succeeded after it: the task stays SKIPPED
    return result.shown()


def _tell_skipped(ctx: WorkerContext, task: Task) -> None:
    """Flower's SKIPPED for a job whose skip Postgres holds already: Redis out of reach
    costs Flower's view of it (said once per outage), never the outcome."""
    try:
        task.send_event(wire.SKIPPED_EVENT, result=wire.SKIPPED_RESULT)
    except Exception as exc:
        if not ctx.outages.service_down(exc):
            raise


def nodename(servers: Sequence[str], numa_node: int | None = None) -> str:
    """A Celery node name that says where this process works, e.g.
    ``gpu0+gpu1.numa0.pid4242@host``: its servers, its NUMA node, and its pid, which keeps
    it unique (several workers may share a host, even the same servers)."""
    names = [re.sub(r"[^\w.:+-]", "-", name) for name in servers]
    shown = "+".join(names)
    if len(shown) > 60:
        shown = "+".join(names[:2]) + f"+{len(names) - 2}more"
    node = "" if numa_node is None else f".numa{numa_node}"
    return f"{shown or 'eaglegen'}{node}.pid{os.getpid()}@{socket.gethostname()}"


def worker_argv(
    settings: Settings, *, threads: int, hostname: str, loglevel: str = "INFO"
) -> list[str]:
    """Arguments for ``app.worker_main``: threads pool, our queue, events for Flower."""
    return [
        "worker",
        "--pool=threads",
        f"--concurrency={threads}",
        f"--queues={settings.queue}",
        f"--loglevel={loglevel}",
        "--events",
        "--without-gossip",
        "--without-mingle",
        f"--hostname={hostname}",
    ]


def start(
    settings: Settings,
    services: Services,
    servers: list[ServerSpec] | None = None,
    pinned: PinResult | None = None,
    loglevel: str = "INFO",
    metrics_port: int | None = None,
) -> int:
    """Run a worker in this process until SIGTERM/SIGINT, then shut down with a grace period;
    the exit code (non-zero when Celery stopped on an unrecoverable error).

    ``metrics_port``: serve this process's Prometheus metrics there.
    """
    quiet_request_logs(loglevel)
    app, holder = create_worker_app(settings, services, servers)
    ctx = holder.get()
    conflicts = ctx.hold_server_names()
    if conflicts:
        holder.close()
        raise ValueError(conflicts[0])
    if (eviction := eviction_warning(ctx.redis)) is not None:
        log.warning("%s", eviction)
    log.warning(
        "worker %s: at most %d Postgres connections (EAGLEGEN_DB_POOL_SIZE) and one for job "
        "leases; up to %d threads (EAGLEGEN_WORKER_CONCURRENCY), started as its servers' "
        "in-flight limits call for them",
        ctx.name,
        settings.db_pool_size,
        ctx.threads,
    )
    name = nodename([s.name for s in ctx.router.servers], None if pinned is None else pinned.node)
    exporter = None if metrics_port is None else metrics.serve(ctx.metrics, metrics_port)
    if exporter is not None:
        log.warning("worker %s: Prometheus metrics on port %d", name, metrics_port)
    background = Background(ctx, app, name, pinned)
    background.start()
    opened = OpenTasks(app)
    _on_shutdown(ctx, app, name, opened)
    ending = _Ending()
    celery_worker.logger.addFilter(ending)  # the logger of its "Unrecoverable error"
    worker_shutting_down.connect(ending.shutting_down, weak=False)
    worker_shutdown.connect(ending.shutdown, weak=False)
    try:
        app.worker_main(
            worker_argv(settings, threads=ctx.threads, hostname=name, loglevel=loglevel)
        )
    finally:
        background.stop()
        if exporter is not None:
            exporter.shutdown()
        drain = ctx.begin_stop()  # the one SIGTERM began, or (stopped otherwise) a new one
        held = release_held(ctx)
        drain.released(held)
        _announce_exit(app, name, opened)
        log.warning("worker stopped: %s%s", drain.summary, _released(held))
        holder.close()
    # worker_main drops Celery's exit code: a worker stopped by an unrecoverable error
    # (Redis refusing writes, say) would exit 0, and a supervisor that restarts on failure
    # would leave it down. Celery's code for Ctrl-C is a failure too; here it is the stop
    # asked for, as SIGTERM's is (the line above says how it went).
    if ending.interrupted:
        return 0
    if ending.exitcode:
        log.error("worker stopped (exit %d): %s", ending.exitcode, ending.cause or "see above")
    return ending.exitcode


def quiet_request_logs(loglevel: str) -> None:
    """No line per request or task below DEBUG. httpx logs every request, and Celery every
    task received and ended, at INFO: lines for each job, hundreds a second from a busy
    worker, and a share of its one core's CPU (BENCHMARKS.md, "Orchestration ceiling"). A
    failed job, a server down and the worker's other decisions have lines of their own;
    Flower shows every task."""
    quiet = logging.getLevelName(loglevel.upper()) != logging.DEBUG
    for name in ("httpx", "celery.worker.strategy", "celery.app.trace"):
        logging.getLogger(name).setLevel(logging.WARNING if quiet else logging.DEBUG)


class _Ending(logging.Filter):
    """How Celery's worker ended: its exit code (from the worker_shutdown signal, whose
    sender is the worker), the last CRITICAL line it logged (its "Unrecoverable error") and
    whether a Ctrl-C stopped it."""

    def __init__(self) -> None:
        super().__init__()
        self.exitcode = 0
        self.cause = ""
        self.interrupted = False

    def shutting_down(self, sig: str = "", **_: Any) -> None:
        """worker_shutting_down receiver: whether the stop came from a Ctrl-C."""
        self.interrupted = self.interrupted or sig == "SIGINT"

    def shutdown(self, sender: Any = None, **_: Any) -> None:
        """worker_shutdown receiver."""
        self.exitcode = int(getattr(sender, "exitcode", 0) or 0)

    def filter(self, record: logging.LogRecord) -> bool:
        """Remember, never drop."""
        if record.levelno >= logging.CRITICAL:
            error = record.exc_info[1] if record.exc_info else None
            text = f"{type(error).__name__}: {error}" if error else record.getMessage()
            self.cause = " ".join(text.split())[:500]
        return True


def _on_shutdown(ctx: WorkerContext, app: Celery, nodename: str, opened: OpenTasks) -> None:
    """On SIGTERM (or SIGINT): take no new jobs, let running ones finish for the grace
    period, then give their claims back (without spending an attempt) and exit."""

    def abandon(drain: Drain) -> None:
        released = release_held(ctx)
        drain.released(released)
        _announce_exit(app, nodename, opened)
        log.warning(
            "grace period over: released %s running job(s)%s; worker stopped: %s",
            len(released),
            f": {released}" if released else "",
            drain.summary,
        )
        # Celery's cold shutdown would still join the pool's threads, which wait on their
        # requests: leave now. Our messages stay unacked; Redis redelivers them later and
        # the claim turns those duplicates away.
        logging.shutdown()
        os._exit(0)

    @worker_shutting_down.connect(weak=False)  # type: ignore[untyped-decorator]
    def shutting_down(sig: str = "", **_: Any) -> None:
        drain = ctx.begin_stop()
        grace = ctx.settings.shutdown_grace_s
        log.warning(
            "worker stopping (%s): taking no new jobs; waiting up to %g s for %d request(s) "
            "in flight, then giving their jobs back",
            sig or "signal",
            grace,
            len(drain.waiting_for),
        )
        timer = threading.Timer(grace, abandon, args=(drain,))
        timer.daemon = True
        timer.start()


def _released(held: list[int]) -> str:
    return f"; released {len(held)} job(s) it still held: {held}" if held else ""


def _announce_exit(app: Celery, nodename: str, opened: OpenTasks) -> None:
    """Close in Flower the tasks this worker gives back, and its active count."""
    try:
        announce_exit(app, nodename, opened.ids(), GIVEN_BACK)
    except Exception as exc:  # Redis gone: Flower keeps its last view, nothing else does
        log.warning("could not tell Flower which tasks went back (%s)", one_line(exc))
