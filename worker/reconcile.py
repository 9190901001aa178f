"""The reconciler: Postgres is the truth, so rebuild in Redis whatever is missing.

It re-queues running jobs whose lease lapsed (their worker died) and publishes again the
queued jobs that have no message waiting in the Redis queue (Redis restarted empty, a
publish was lost, a dead worker's prefetched messages sit unacked). Messages delivered to a
live worker are not looked at: at worst a job gets a second message, which is harmless
because the claim decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from core import wire
from core.broker import Publisher, waiting_job_ids
from models.repository import Repository


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
    publisher: Publisher,
    *,
    max_attempts: int,
    republish_after_s: float,
) -> ReconcileReport:
    """One reconciliation pass; safe to run anywhere, any number of times."""
    expired = repo.expire_leases(max_attempts)
    publisher.publish(expired, _tags(repo, expired))
    # Read candidates before scanning Redis: a job published after the scan started was
    # also published after this read, so it is never mistaken for missing.
    candidates = repo.queued_job_ids(idle_seconds=republish_after_s)
    waiting = waiting_job_ids(client, publisher.queue)
    missing = sorted(set(candidates) - waiting - set(expired))
    publisher.publish(missing, _tags(repo, missing))
    return ReconcileReport(len(expired), len(missing), len(waiting))


def _tags(repo: Repository, job_ids: list[int]) -> dict[int, str]:
    """Each job's label tag (its dataset and run, as Flower shows them)."""
    if not job_ids:
        return {}
    return {j: wire.tag(d, r) for j, (r, d) in repo.job_datasets(job_ids).items()}
