"""A per-server in-flight limit shared by every worker on every host, kept in Redis.

Each in-flight request holds a lease: a member of a sorted set scored by its expiry. A
worker that dies stops renewing, so its leases lapse and the slots come back by themselves.
"""

from __future__ import annotations

import time
import uuid

import redis

from core import keys

# Drop lapsed leases, then take a slot if fewer than the limit are held. Atomic in Redis.
_ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
  return 1
end
return 0
"""


class SlotPool:
    """Leases on the in-flight slots of SGLang servers."""

    def __init__(self, client: redis.Redis, lease_seconds: float) -> None:
        self._client = client
        self._lease = lease_seconds
        self._acquire = client.register_script(_ACQUIRE)

    def try_acquire(self, server: str, limit: int) -> str | None:
        """A lease token when ``server`` has a free slot under ``limit``, else None."""
        token = uuid.uuid4().hex
        now = time.time()
        won = self._acquire(keys=[keys.slots(server)], args=[now, limit, now + self._lease, token])
        return token if won == 1 else None

    def renew(self, server: str, tokens: list[str]) -> None:
        """Push the expiry of held leases forward (only those still present)."""
        if tokens:
            expiry = time.time() + self._lease
            self._client.zadd(keys.slots(server), dict.fromkeys(tokens, expiry), xx=True)

    def release(self, server: str, token: str) -> None:
        """Give the slot back."""
        self._client.zrem(keys.slots(server), token)

    def in_flight(self, server: str) -> int:
        """Live leases on ``server`` right now (all workers)."""
        key = keys.slots(server)
        return int(self._client.zcount(key, time.time(), "+inf"))
