"""One server per name in the whole cluster.

A server's name keys the in-flight limit every worker shares and is stored with each
generation: two different servers under one name would share one limit and their outputs
could not be told apart. Workers hold each name they use in Redis with the server's
location (renewed with the heartbeat, expiring when no worker uses it any more); a worker
whose name is held for another location refuses to start.
"""

from __future__ import annotations

import redis

from core import keys
from core.settings import ServerSpec

# Hold the name for this location unless it is held for another; the other, if so.
_HOLD = """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then
  return held
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return false
"""


class ServerNames:
    """The cluster's name → server location map, as this worker holds its part of it."""

    def __init__(self, client: redis.Redis, ttl_s: int) -> None:
        self._hold = client.register_script(_HOLD)
        self._ttl = ttl_s

    def hold(self, servers: list[ServerSpec]) -> list[str]:
        """Hold (or renew) every server's name; one line per name held for another server."""
        conflicts = []
        for spec in servers:
            held = self._hold(keys=[keys.server_name(spec.name)], args=[spec.location, self._ttl])
            if held is not None:
                other = held.decode() if isinstance(held, bytes) else str(held)
                conflicts.append(
                    f"server name {spec.name!r} is in use for {other} by another worker, "
                    f"not {spec.location} ({spec.url}): give each server its own name "
                    "(--server NAME=URL)"
                )
        return conflicts
