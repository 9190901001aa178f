"""One holder cluster-wide for a job that must run in one place: an expiring Redis lock.

The feeder, the reconciler and each server's concurrency controller run in every worker
process, and each acts only while it holds its lock. A holder renews its lock at every
step; one that stops (killed, partitioned) loses it after ``ttl_s`` and another takes over.
Correctness never depends on there being exactly one: the claim and the generations'
primary key make two feeders or reconcilers harmless, and two controllers only write the
same key. The lock only keeps the work from being done N times.
"""

from __future__ import annotations

import math

import redis

# Take the lock when free, keep it when ours, in one step (a GET then a SET would let two
# processes both take a lock that lapsed in between).
_HOLD = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
# Give the lock up, only if ours.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Leadership:
    """The locks one process may hold, under one owner name."""

    def __init__(self, client: redis.Redis, owner: str) -> None:
        self.owner = owner
        self._hold = client.register_script(_HOLD)
        self._release = client.register_script(_RELEASE)

    def hold(self, key: str, ttl_s: float) -> bool:
        """Take or keep the lock ``key`` for ``ttl_s`` more seconds; whether we hold it."""
        ttl_ms = max(1, math.ceil(ttl_s * 1000))
        return int(self._hold(keys=[key], args=[self.owner, ttl_ms])) == 1

    def release(self, key: str) -> None:
        """Give the lock up now (when ours), so another process takes over at once."""
        self._release(keys=[key], args=[self.owner])
