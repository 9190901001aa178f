"""The Celery events a worker sends besides Celery's own, so that Flower ends true.

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

from celery import Celery
from celery.signals import task_postrun, task_received
from celery.utils.sysinfo import load_average
from celery.worker import state as worker_state

from core.wire import TASK_GENERATE


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
