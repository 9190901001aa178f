"""The heartbeat: one record per worker process in Redis, what every reader sees of it.

Written by each worker every few seconds (``worker.background``), expiring after three
missed beats; read by the feeder (the window's size), ``status`` (servers, in flight, runs
no worker serves) and ``worker --check``. Its JSON document is documented in
docs/design.md §7; this module is the only place that writes or parses it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from core import keys
from core.broker import redis_now


@dataclass(frozen=True)
class ServerBeat:
    """One attached server as the worker sees it."""

    healthy: bool
    reason: str | None  # why it is down, or None
    held: int  # slots this process holds on it: its requests in flight there
    limit: int  # the in-flight limit it obeys (fixed, or the controller's)
    adaptive: bool  # the limit is set by a concurrency controller
    model: str | None  # what /get_model_info said it serves; None until it answered
    # The model it served before this process saw its model change (another server answered
    # on its URL), and when that was seen, on Redis's clock; None while it never changed.
    previous_model: str | None = None
    model_changed_at: float | None = None


@dataclass(frozen=True)
class Heartbeat:
    """A worker process's heartbeat."""

    worker: str  # the worker's cluster-unique name (worker.names)
    nodename: str  # Celery's node name (what Flower shows)
    host: str
    pid: int
    ts: float  # Redis's clock when written: the one clock every host shares
    in_flight: int  # jobs running in this process
    threads: int
    consuming: bool  # False while none of its servers is up
    db_pool: int
    servers: dict[str, ServerBeat] = field(default_factory=dict)
    unserved_runs: dict[str, str] = field(default_factory=dict)  # run -> why no server serves it
    # Where `--numa-node` pinned the process (worker.numa.PinResult); None when unpinned.
    numa_node: int | None = None
    cpus: str | None = None
    membind: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Heartbeat | None:
        """The record, or None for one that is not a heartbeat's JSON (left out by readers)."""
        try:
            data = json.loads(raw)
            return cls._from_dict(data)
        except (ValueError, TypeError, KeyError, AttributeError):
            return None

    @classmethod
    def _from_dict(cls, data: Mapping[str, Any]) -> Heartbeat:
        servers = {
            str(name): ServerBeat(
                healthy=bool(s["healthy"]),
                reason=None if s.get("reason") is None else str(s["reason"]),
                held=int(s["held"]),
                limit=int(s["limit"]),
                adaptive=bool(s["adaptive"]),
                model=_text(s.get("model")),
                previous_model=_text(s.get("previous_model")),
                model_changed_at=_number(s.get("model_changed_at")),
            )
            for name, s in (data.get("servers") or {}).items()
        }
        node = data.get("numa_node")
        return cls(
            worker=str(data["worker"]),
            nodename=str(data["nodename"]),
            host=str(data["host"]),
            pid=int(data["pid"]),
            ts=float(data["ts"]),
            in_flight=int(data["in_flight"]),
            threads=int(data["threads"]),
            consuming=bool(data["consuming"]),
            db_pool=int(data["db_pool"]),
            servers=servers,
            unserved_runs={str(k): str(v) for k, v in (data.get("unserved_runs") or {}).items()},
            numa_node=None if node is None else int(node),
            cpus=None if data.get("cpus") is None else str(data["cpus"]),
            membind=None if data.get("membind") is None else str(data["membind"]),
        )


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def write(client: redis.Redis, beat: Heartbeat, ttl_s: int) -> None:
    """Store ``beat`` under its host and pid, expiring after ``ttl_s`` unless renewed."""
    client.set(keys.heartbeat(beat.host, beat.pid), beat.to_json(), ex=ttl_s)


def remove(client: redis.Redis, host: str, pid: int) -> None:
    """Remove a stopping worker's heartbeat."""
    client.delete(keys.heartbeat(host, pid))


def read_all(client: redis.Redis, host: str | None = None) -> list[Heartbeat]:
    """Every heartbeat in Redis (of ``host``'s workers when given), however old; a record
    that does not parse is left out."""
    beats = []
    for key in client.scan_iter(keys.heartbeat_pattern(host)):
        raw = client.get(key)
        if raw is not None and (beat := Heartbeat.from_json(raw)) is not None:
            beats.append(beat)
    return beats


def alive(broker_url: str, host: str | None, max_age_s: float) -> list[Heartbeat]:
    """Heartbeats of workers on ``host`` (all hosts when None) younger than ``max_age_s``."""
    with redis.Redis.from_url(broker_url, socket_connect_timeout=5, socket_timeout=5) as client:
        return alive_on(client, host, max_age_s)


def alive_on(client: redis.Redis, host: str | None, max_age_s: float) -> list[Heartbeat]:
    """``alive`` on a client the caller holds."""
    now = redis_now(client)
    return [b for b in read_all(client, host) if now - b.ts <= max_age_s]
