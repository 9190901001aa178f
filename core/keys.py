"""Every Redis key eaglegen writes besides Celery's own, built in one place."""

from __future__ import annotations

PREFIX = "eaglegen"


def slots(server: str) -> str:
    """Sorted set of in-flight request leases on one SGLang server (score = expiry)."""
    return f"{PREFIX}:slots:{server}"


def server_name(name: str) -> str:
    """The location of the server this name means, held while workers use the name."""
    return f"{PREFIX}:server-name:{name}"


def heartbeat(host: str, pid: int) -> str:
    """A worker process's heartbeat record (expires when the worker stops beating)."""
    return f"{PREFIX}:heartbeat:{host}:{pid}"


def heartbeat_pattern(host: str | None = None) -> str:
    """SCAN pattern for the heartbeats of one host, or of all hosts."""
    return f"{PREFIX}:heartbeat:{host or '*'}:*"


def reconciler_lock(queue: str) -> str:
    """Held by the one worker that runs the periodic reconciler of ``queue``'s jobs."""
    return f"{PREFIX}:reconciler:{queue}"


def feeder_lock(queue: str) -> str:
    """Held by the one worker that publishes ``queue``'s window (worker.feeder)."""
    return f"{PREFIX}:feeder:{queue}"


def advancer_lock(queue: str, run_id: int) -> str:
    """Held by the one worker that creates a run's conversations' next turns
    (worker.advancer)."""
    return f"{PREFIX}:advancer:{queue}:{run_id}"


def turn_server(queue: str, job_id: int) -> str:
    """The server a conversation turn's job should go to when it has room (the one that
    generated the turn before it); written by the advancer, read by the attempt; expires."""
    return f"{PREFIX}:prefer:{queue}:{job_id}"


def feeder_wake(queue: str) -> str:
    """A list of at most one element: pushed to wake the feeder (new jobs, a raised budget)."""
    return f"{PREFIX}:feeder-wake:{queue}"


def feeder_report(queue: str) -> str:
    """The feeder's last pass (window, messages in Redis), for `status`; expires."""
    return f"{PREFIX}:feeder-report:{queue}"


def controller_lock(server: str) -> str:
    """Held by the one worker process that sets ``server``'s in-flight limit."""
    return f"{PREFIX}:controller:{server}"


def limit(server: str) -> str:
    """The in-flight limit the controller set for ``server``, with its reason (JSON)."""
    return f"{PREFIX}:limit:{server}"
