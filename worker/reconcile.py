"""The reconciler: Postgres is the truth, so rebuild in Redis whatever is missing.

It re-queues running jobs whose lease lapsed (their worker died), and gives back to the
feeder the jobs whose message went out but is no longer waiting in the Redis queue (Redis
restarted empty or evicted it, a dead worker's prefetched messages sit unacked): the feeder
publishes them again, in their order. Messages delivered to a live worker are not looked
at: at worst a job gets a second message, which is harmless because the claim decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from core.broker import waiting_job_ids
from models.repository import Repository


@dataclass(frozen=True)
class ReconcileReport:
    """What one pass did."""

    expired_leases: int
    republished: int  # jobs given back to the feeder: their message was lost
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
    queue: str,
    *,
    max_attempts: int,
    republish_after_s: float,
) -> ReconcileReport:
    """One reconciliation pass; safe to run anywhere, any number of times."""
    expired = repo.expire_leases(max_attempts)
    # Read candidates before scanning Redis: a job published after the scan started was
    # also published after this read, so it is never mistaken for missing.
    candidates = repo.published_job_ids(older_than_s=republish_after_s)
    waiting = waiting_job_ids(client, queue)
    missing = sorted(set(candidates) - waiting)
    lost = repo.unpublish(missing, older_than_s=republish_after_s)
    return ReconcileReport(len(expired), lost, len(waiting))
