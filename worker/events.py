"""How a worker's Celery events reach Flower: task events sent in batches, and the events
it sends besides Celery's own, so that Flower ends true.

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
from collections import Counter
from typing import Any

from celery import Celery, bootsteps
from celery.signals import task_postrun, task_received
from celery.utils.sysinfo import load_average
from celery.worker import state as worker_state
from celery.worker.consumer.events import Events

from core.wire import TASK_GENERATE

# How long a task event may wait in the buffer before it is published with the others.
FLUSH_S = 0.1
# Celery flushes at once from the sending thread when a buffer holds this many (its
# default, 24, would flush a busy worker's buffer several times in each FLUSH_S).
BATCH_LIMIT = 1000


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
    exception = f"SentBack({reason!r})"
    with app.events.default_dispatcher(hostname=nodename) as dispatcher:
        for task_id in task_ids:
            dispatcher.send("task-retried", uuid=task_id, exception=exception, traceback=reason)
        dispatcher.send(
            "worker-offline",
            freq=2.0,  # Celery's heartbeat interval, which Flower reads with it
            active=0,
            processed=worker_state.all_total_count[0],
            loadavg=load_average(),
            **worker_state.SOFTWARE_INFO,
        )
