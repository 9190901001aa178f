"""How a worker's Celery events reach Flower: task events sent in batches, and the events
it sends besides Celery's own, so that Flower ends true; and the same events sent by hand
for the loop engine, which has no Celery worker (`LoopEvents`).

Celery buffers a worker's task events (received, started, succeeded, ...) and asks its event
loop to flush the buffer at its next turn, so a busy worker publishes them nearly one by
one: a kombu publish to Redis each (a message built, a pipeline for the fanout), a large
share of the worker's CPU when jobs are short (BENCHMARKS.md, "Task events in batches, acks
with the next delivery").
`EventBatches` flushes them on a timer instead, every `FLUSH_S`: one publish carries every
event of that span, which Flower's receiver takes as a list, as it takes Celery's own
batches. Flower sees a task's change up to `FLUSH_S` later.

Celery closes a task in Flower with the event of how it ended (``task-succeeded``,
``task-failed``, ``task-retried``). A worker that stops sends none for the messages it gives
back: those it was running when its grace period ran out (their jobs go back to Postgres)
and those it held unstarted (an ETA not reached: kombu puts them back in Redis). Flower
would show them ``STARTED`` or ``RECEIVED`` for good, and the worker's last ``active`` count
(sent with its ``worker-offline`` event while it still ran them) as active for good.
`OpenTasks` keeps track of the messages received and not yet run to their end, and
`announce_exit` ends each as ``task-retried`` (RETRY in Flower, as for every job sent back,
with the reason) and says the worker left with nothing active.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from celery import Celery, bootsteps
from celery.signals import task_postrun, task_received
from celery.utils.saferepr import saferepr
from celery.utils.sysinfo import load_average
from celery.worker import state as worker_state
from celery.worker.consumer.events import Events

from core import wire
from core.wire import TASK_GENERATE
from worker.runner import SENT_BACK, Outcome, Result

# How long a task event may wait in the buffer before it is published with the others.
FLUSH_S = 0.1
# Celery flushes at once from the sending thread when a buffer holds this many (its
# default, 24, would flush a busy worker's buffer several times in each FLUSH_S).
BATCH_LIMIT = 1000
# Celery's heartbeat interval, which Flower reads with each worker event.
HEARTBEAT_S = 2.0
# What Flower shows for the messages a stopping worker gives back.
GIVEN_BACK = "worker stopped: its message went back to the queue"


def sent_back(reason: str) -> str:
    """How a task-retried event names a job sent back (worker.app.SentBack's repr)."""
    return f"SentBack({reason!r})"


class EventBatches(bootsteps.StartStopStep):  # type: ignore[misc]
    """A consumer step that makes the event dispatcher Celery's Events step starts (again
    after each reconnect) publish its buffered task events every FLUSH_S, not at each turn
    of the event loop; on stop, what is buffered goes out and Celery's own flushing is
    restored, for the events of the tasks that end while the worker drains."""

    requires = (Events,)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self._timer: Any = None

    def start(self, c: Any) -> None:
        dispatcher = c.event_dispatcher
        if c.hub is None or dispatcher is None:
            return  # no event loop: Celery buffers nothing
        dispatcher.on_send_buffered = None
        dispatcher.buffer_limit = BATCH_LIMIT
        self._timer = c.hub.call_repeatedly(FLUSH_S, dispatcher.flush)

    def stop(self, c: Any) -> None:
        if self._timer is None:
            return
        self._timer.cancel()
        self._timer = None
        dispatcher = c.event_dispatcher
        if dispatcher is not None:
            dispatcher.on_send_buffered = c.on_send_event_buffered
            dispatcher.flush()

    def shutdown(self, c: Any) -> None:
        self.stop(c)


class OpenTasks:
    """Task ids this process received a message of and has not run to its end (a count
    per id: a duplicate message of one job carries the job's task id too)."""

    def __init__(self, app: Celery) -> None:
        self._app = app
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()
        task_received.connect(self._received, weak=False)
        task_postrun.connect(self._ended, weak=False)

    def close(self) -> None:
        """Stop counting."""
        task_received.disconnect(self._received)
        task_postrun.disconnect(self._ended)

    def ids(self) -> list[str]:
        """The task ids still open, in no particular order."""
        with self._lock:
            return [task_id for task_id, n in self._open.items() if n > 0]

    def _received(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        if request is None or getattr(sender, "app", None) is not self._app:
            return
        if getattr(request, "name", None) != TASK_GENERATE:
            return
        with self._lock:
            self._open[str(request.id)] += 1

    def _ended(self, sender: Any = None, task_id: str | None = None, **_: Any) -> None:
        if task_id is None or getattr(sender, "app", None) is not self._app:
            return
        with self._lock:
            if self._open[task_id] > 1:
                self._open[task_id] -= 1
            else:
                del self._open[task_id]


def announce_exit(app: Celery, nodename: str, task_ids: list[str], reason: str) -> None:
    """End ``task_ids`` as sent back (RETRY, ``reason`` as the retry's only trace), then say
    the worker is offline with no task active. Best effort: Flower only shows it."""
    with app.events.default_dispatcher(hostname=nodename) as dispatcher:
        for task_id in task_ids:
            dispatcher.send(
                "task-retried", uuid=task_id, **ending(Result(Outcome.RETRY, reason=reason))[1]
            )
        dispatcher.send("worker-offline", **worker_fields(0, worker_state.all_total_count[0]))


def worker_fields(active: int, processed: int) -> dict[str, Any]:
    """A worker event's fields, as Celery's heartbeat sends them."""
    return {
        "freq": HEARTBEAT_S,
        "active": active,
        "processed": processed,
        "loadavg": load_average(),
        **worker_state.SOFTWARE_INFO,
    }


def ending(result: Result) -> tuple[str, dict[str, Any]]:
    """The event that ends a task in Flower, and its fields, as the Celery engine's task
    ends it (worker.app): sent back (RETRY, the reason as its only trace), failed (FAILURE,
    no trace), skipped (SKIPPED), else succeeded with the result ``Result.shown`` says."""
    if result.outcome in SENT_BACK:
        return "task-retried", {"exception": sent_back(result.reason), "traceback": result.reason}
    if result.outcome is Outcome.FAILED:
        return "task-failed", {"exception": f"JobFailed({result.reason!r})", "traceback": None}
    if result.outcome is Outcome.SKIPPED:
        return wire.SKIPPED_EVENT, {"result": wire.SKIPPED_RESULT}
    return "task-succeeded", {"result": saferepr(result.shown())}


class LoopEvents:
    """What a loop-engine worker (worker.loop) tells Flower, where Celery's worker would:
    its online, heartbeat (every HEARTBEAT_S, with its active and processed counts) and
    offline events, and each task's received, started and ending events, buffered and
    published every FLUSH_S as `EventBatches` has Celery publish them. At its close, the
    tasks received and not ended go back as the Celery engine's `announce_exit` says.

    Thread-safe: the loop and the threads it settles failures in both end tasks. While
    Redis is out of reach, Celery's dispatcher keeps what it could not publish and sends
    it with the next flush that can.
    """

    def __init__(self, app: Celery, hostname: str, queue: str) -> None:
        self.app = app
        self.hostname = hostname
        self._queue = queue
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()  # task id -> its messages received, not ended
        self._started: dict[str, float] = {}  # task id -> when its attempt began
        self._processed = 0
        self._connection: Any = None
        self._dispatcher: Any = None  # from `start`
        self._on_error: Callable[[Exception], None] = lambda _exc: None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flushing, name="flower-events", daemon=True)

    def start(self, on_error: Callable[[Exception], None]) -> None:
        """Say the worker is online and publish from now on; ``on_error`` is told what a
        flush could not do (Redis out of reach; the events wait for the next)."""
        self._connection = self.app.connection_for_write()
        self._dispatcher = self.app.events.Dispatcher(
            self._connection,
            hostname=self.hostname,
            buffer_group=["task"],
            buffer_limit=BATCH_LIMIT,
        )
        self._on_error = on_error
        self._dispatcher.send("worker-online", **worker_fields(0, 0))
        self._thread.start()

    def received(self, message: wire.Message) -> None:
        """A message taken off the queue (run now or held for its eta)."""
        task_id = wire.job_task_id(self._queue, message.job_id)
        with self._lock:
            self._open[task_id] += 1
        eta = None if message.eta is None else datetime.fromtimestamp(message.eta, UTC)
        self._send(
            "task-received",
            uuid=task_id,
            name=TASK_GENERATE,
            args=message.argsrepr,
            kwargs=wire.kwargsrepr(message.job_id),
            root_id=task_id,
            parent_id=None,
            retries=message.retries,
            eta=None if eta is None else eta.isoformat(),
            expires=None,
        )

    def started(self, job_id: int) -> None:
        """Its job claimed: the attempt begins."""
        task_id = wire.job_task_id(self._queue, job_id)
        with self._lock:
            self._started[task_id] = time.monotonic()
        self._send("task-started", uuid=task_id)

    def ended(self, job_id: int, result: Result) -> None:
        """How the task of ``job_id`` ended."""
        task_id = wire.job_task_id(self._queue, job_id)
        kind, fields = ending(result)
        with self._lock:
            began = self._started.pop(task_id, None)
            if self._open[task_id] > 1:
                self._open[task_id] -= 1
            else:
                del self._open[task_id]
            self._processed += 1
        if kind == "task-succeeded":
            fields["runtime"] = None if began is None else time.monotonic() - began
        self._send(kind, uuid=task_id, **fields)

    def close(self) -> None:
        """End the tasks still open as given back, say the worker is offline with none
        active, publish what is left and stop."""
        if self._dispatcher is None:
            return
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=5)
        with self._lock:
            given_back = list(self._open)
            self._open.clear()
        try:
            for task_id in given_back:
                self._send(
                    "task-retried",
                    uuid=task_id,
                    **ending(Result(Outcome.RETRY, reason=GIVEN_BACK))[1],
                )
            self._dispatcher.flush()
            self._dispatcher.send("worker-offline", **worker_fields(0, self._processed))
            self._dispatcher.close()
            self._connection.release()
        except Exception as exc:  # Redis out of reach: Flower keeps its last view
            self._on_error(exc)

    def _send(self, kind: str, **fields: Any) -> None:
        if self._dispatcher is not None:
            self._dispatcher.send(kind, **fields)

    def _flushing(self) -> None:
        beat = time.monotonic() + HEARTBEAT_S
        while not self._stop.wait(FLUSH_S):
            try:
                self._dispatcher.flush()
                if time.monotonic() >= beat:
                    beat = time.monotonic() + HEARTBEAT_S
                    with self._lock:  # active: running, as Celery counts it
                        counts = (len(self._started), self._processed)
                    self._dispatcher.send("worker-heartbeat", **worker_fields(*counts))
            except Exception as exc:
                self._on_error(exc)
