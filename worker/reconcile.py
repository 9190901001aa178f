"""The reconciler: Postgres is the truth, so rebuild in Redis whatever is missing.

It re-queues running jobs whose lease lapsed (their worker died) and publishes again the
queued jobs that have no message waiting in the Redis queue (Redis restarted empty, a
publish was lost, a dead worker's prefetched messages sit unacked). Messages delivered to a
live worker are not looked at: at worst a job gets a second message, which is harmless
because the claim decides.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis

from eaglegen.queue import BulkPublisher
from models.repository import Repository

SCAN_CHUNK = 5000


@dataclass(frozen=True)
class ReconcileReport:
    """What one pass did."""

    expired_leases: int
    republished: int
    messages_in_redis: int

    def as_dict(self) -> dict[str, int]:
        """The ``--json`` shape."""
        return {
            "expired_leases": self.expired_leases,
            "republished": self.republished,
            "messages_in_redis": self.messages_in_redis,
        }


def reconcile(
    repo: Repository,
    client: redis.Redis,
    publisher: BulkPublisher,
    *,
    max_attempts: int,
    republish_after_s: float,
) -> ReconcileReport:
    """One reconciliation pass; safe to run anywhere, any number of times."""
    expired = repo.expire_leases(max_attempts)
    publisher.publish(expired)
    # Read candidates before scanning Redis: a job published after the scan started was
    # also published after this read, so it is never mistaken for missing.
    candidates = repo.queued_job_ids(idle_seconds=republish_after_s)
    waiting = job_ids_in_queue(client, publisher.queue)
    missing = sorted(set(candidates) - waiting - set(expired))
    publisher.publish(missing)
    return ReconcileReport(len(expired), len(missing), len(waiting))


def job_ids_in_queue(client: redis.Redis, queue: str) -> set[int]:
    """Job ids of every message waiting in ``queue``."""
    return {
        job_id for raw in _queue_messages(client, queue) if (job_id := _job_id(raw)) is not None
    }


def _queue_messages(client: redis.Redis, queue: str) -> Iterator[Any]:
    start = 0
    while chunk := client.lrange(queue, start, start + SCAN_CHUNK - 1):
        yield from chunk
        start += SCAN_CHUNK


def _job_id(raw: Any) -> int | None:
    """The job id inside one kombu envelope, or None for anything else."""
    try:
        envelope = json.loads(raw)
        body = base64.b64decode(envelope["body"])
        _args, kwargs, _embed = json.loads(body)
        return int(kwargs["job_id"])
    except (ValueError, KeyError, TypeError):
        return None
