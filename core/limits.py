"""The adaptive in-flight limit as Redis stores it (``keys.limit(server)``): its record, and
reading it back.

Stored by the server's controller (``worker.controller``), read by every worker and by
``eaglegen status``, which must not import the controller's HTTP and Celery dependencies to
say why a limit is what it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis

from core import keys


@dataclass(frozen=True)
class LimitRecord:
    """What the controller stored: the limit, why, when (Redis clock) and by which process."""

    limit: int
    reason: str
    at: float
    by: str

    def to_json(self) -> str:
        """The stored form."""
        return json.dumps(
            {"limit": self.limit, "reason": self.reason, "at": self.at, "by": self.by}
        )

    @classmethod
    def from_json(cls, raw: bytes | str | None) -> LimitRecord | None:
        """The record, or None when absent or not one (a hand edit, an older version)."""
        if raw is None:
            return None
        try:
            body: Any = json.loads(raw)
            limit = body["limit"]
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
                return None
            return cls(limit, str(body.get("reason", "")), float(body["at"]), str(body["by"]))
        except (ValueError, TypeError, KeyError):
            return None


def read_limit(client: redis.Redis, server: str) -> LimitRecord | None:
    """The stored limit of ``server``, or None."""
    return LimitRecord.from_json(client.get(keys.limit(server)))
