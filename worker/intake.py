"""How many messages a worker process holds: as many as its servers have room for (issue 32).

Celery's threads pool is a fixed ``ThreadPoolExecutor`` of ``--concurrency`` threads
(``celery.concurrency.thread``: it can neither grow nor shrink, and ``--autoscale`` does not
work with it), and with late acks and a prefetch multiplier of 1 a worker takes one message
per thread. The thread count used to be the worker's in-flight capacity: below the in-flight
limit it capped it (the controller grows a limit only while the workers fill it, so the
limit never grew past the threads); above it, each surplus thread held a message that
waited for a slot, out of other workers' reach, asking Redis for one, and went back to the
queue after ``EAGLEGEN_SLOT_WAIT_S`` when none came (BENCHMARKS.md, "Threads and the
in-flight limit").

So here the threads are only a ceiling, and the messages a worker takes follow the limits.
Its task consumer takes a message only while the process holds fewer requests (Celery's own
count of requests received and not yet finished) than its **intake**::

    intake = sum, over its servers that are up and identified, of
                 (the slots it holds + the slots free on the server now)
             + spare

capped at its threads. One worker alone on its servers takes the sum of their limits plus
the spare; several on the same server share its free slots. The spare threads (`spare`: as
many as the headroom the controller keeps queued at a server, a tenth of the limits, at
least 2) wait for a slot, so that one given back is taken at once (`Router.release` wakes
one), not after a message's round trip through Redis. The intake is worked out again every
`INTERVAL_S`, so it follows a limit the controller moved within about a second, and a limit
that grows finds the messages to fill it: the controller sees the workers filling it.
The gate wraps the consumer channel's ``can_consume``, as Celery's own
``worker_disable_prefetch`` does, and compares Celery's process-wide count: one worker per
process, as `eaglegen worker` runs it.

The default thread count (`default_threads`) is the most the limits of its servers can reach:
``ThreadPoolExecutor`` starts a thread only when no idle one is left, so threads the
limits never call for are never started.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from core.settings import ServerSpec, Settings

# How often the intake is worked out again (worker.background).
INTERVAL_S = 1.0
# The spare: waiting threads, as the controller's headroom (worker.concurrency.Tuning).
SPARE_FLOOR = 2
SPARE_SHARE = 0.1
# The most threads a default gives a worker process (EAGLEGEN_WORKER_CONCURRENCY's bound).
MAX_THREADS = 4096


@dataclass(frozen=True)
class Room:
    """One server as a worker's intake sees it."""

    held: int  # slots this process holds on it
    limit: int  # its in-flight limit now
    in_flight: int  # slots every worker holds on it

    @property
    def takes(self) -> int:
        """Requests this process may have on it: those it holds plus the free slots."""
        return self.held + max(0, self.limit - self.in_flight)


def spare(limits: int) -> int:
    """Threads kept waiting for a slot beside those that hold one."""
    return max(SPARE_FLOOR, math.ceil(SPARE_SHARE * limits))


def intake(rooms: Sequence[Room], threads: int) -> int:
    """The requests a worker may hold: what its servers have room for, plus the spare,
    within its threads (at least one)."""
    limits = sum(r.limit for r in rooms)
    return max(1, min(threads, sum(r.takes for r in rooms) + spare(limits)))


def server_ceiling(spec: ServerSpec, settings: Settings) -> int:
    """The highest in-flight limit a server can have: its fixed one, else the controller's
    ceiling (adaptive) or the configured limit."""
    if spec.max_inflight is not None:
        return spec.max_inflight
    if settings.adaptive_concurrency:
        return max(settings.concurrency_min, settings.concurrency_max)
    return settings.server_max_inflight


def default_threads(settings: Settings, servers: Sequence[ServerSpec]) -> int:
    """The threads of a worker calling ``servers``: EAGLEGEN_WORKER_CONCURRENCY when set,
    else the most their in-flight limits can reach together (at most MAX_THREADS)."""
    if settings.worker_concurrency is not None:
        return settings.worker_concurrency
    ceiling = sum(server_ceiling(spec, settings) for spec in servers)
    return max(1, min(MAX_THREADS, ceiling))


class Intake:
    """A worker process's intake: worked out by `update`, enforced by `gate`."""

    def __init__(self, threads: int, first: Sequence[Room] = ()) -> None:
        """Until the first update: what the configured limits have room for."""
        self.threads = threads
        self.value = intake(first, threads) if first else threads

    def update(self, rooms: Sequence[Room]) -> int:
        """Work the intake out again from the servers' rooms now."""
        self.value = intake(rooms, self.threads)
        return self.value

    def room(self) -> bool:
        """Whether the process may take another message: it holds fewer requests than its
        intake (Celery's count: requests received, an ETA's once due, and not finished)."""
        return self.room_left() > 0

    def room_left(self) -> int:
        """How many more messages the process may take now."""
        # Imported here: this module's Room is read by `status`, which must not load Celery.
        from celery.worker import state as worker_state

        return max(self.value - len(worker_state.reserved_requests), 0)

    def gate(self, qos: Any) -> None:
        """Make a task consumer's channel take messages only while there is room, as Celery's
        own ``worker_disable_prefetch`` does with the pool's size: kombu's Redis transport
        sends its next BRPOP only while ``qos.can_consume()``, and asks again at each turn
        of the event loop (each event it handles, and its timers: Celery's worker
        heartbeat, sent for Flower, comes every 2 s). The estimate of how many it may take
        at once (``qos.can_consume_max_estimate()``, read by worker.transport to take
        several in one round trip) is held to the room as well."""
        allowed: Callable[[], bool] = qos.can_consume
        estimate: Callable[[], int | None] = qos.can_consume_max_estimate

        def can_consume() -> bool:
            return self.room() and allowed()

        def can_consume_max_estimate() -> int:
            room, most = self.room_left(), estimate()
            return room if most is None else min(room, most)

        qos.can_consume = can_consume
        qos.can_consume_max_estimate = can_consume_max_estimate
