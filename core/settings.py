"""The one validated settings object: environment (prefix ``EAGLEGEN_``) overridden by flags.

The service URLs are optional here (a command may need none of them); the command line
resolves them once into ``Services``, which is what everything below it is handed.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from core.urls import normalize_database_url, redact


class ServerSpec(BaseModel):
    """One SGLang server a worker may call.

    Its name keys the in-flight limit all workers share and is stored with each generation,
    so one name must mean one server in the whole cluster: a server given without a name
    is named by where it is (``host:port``, a loopback host by this machine's name).
    """

    name: str = ""
    url: str
    numa_node: int | None = None
    max_inflight: int | None = Field(default=None, ge=1)

    @field_validator("url")
    @classmethod
    def _strip_slash(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"server url must start with http:// or https://, got {value!r}")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _default_name(self) -> ServerSpec:
        if not self.name:
            self.name = server_location(self.url)
        return self

    @property
    def location(self) -> str:
        """Where this server is, the same string on every host that calls it."""
        return server_location(self.url)


_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0"})


def is_loopback(host: str) -> bool:
    """Whether a host name or address means this machine."""
    return host in _LOOPBACK or host.startswith("127.")


def server_location(url: str) -> str:
    """``host:port`` of a server URL, a loopback host replaced by this machine's name (the
    same ``localhost:30000`` on two hosts is two servers)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if is_loopback(host):
        host = socket.gethostname()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


ENV_PREFIX = "EAGLEGEN_"


class Settings(BaseModel):
    """Everything a process needs to find its services; flags override the environment."""

    model_config = ConfigDict(extra="ignore", hide_input_in_errors=True)

    def __init__(self, **values: Any) -> None:
        """The values given, over the fields' ``EAGLEGEN_*`` environment variables (what
        was set either way is in ``model_fields_set``)."""
        super().__init__(**{**from_environment(os.environ), **values})

    database_url: str | None = None
    broker_url: str | None = None
    data_dir: Path = Path(".eaglegen")
    servers: list[ServerSpec] = Field(default_factory=list)
    # A worker process's threads: the most requests it holds at once. None: the most its
    # servers' in-flight limits can reach together (each server's max_inflight, else
    # concurrency_max with adaptive concurrency, else server_max_inflight; at most 4,096).
    # Either way it takes only as many messages as its servers have room for, and starts a
    # thread only when it needs one (worker.intake).
    worker_concurrency: int | None = Field(default=None, ge=1, le=4096)
    # Postgres connections one worker process opens at most, whatever its concurrency: its
    # transactions take milliseconds, so threads wait for one instead of each holding one
    # (workers x this must stay below the server's max_connections; docs/reference/worker.md,
    # "Many workers").
    db_pool_size: int = Field(default=8, ge=1, le=256)
    # How a worker process runs its requests: "loop" (the default), every request on one
    # asyncio event loop, messages taken and jobs claimed and recorded in batches
    # (worker.loop; less CPU a job, so one process keeps a fast server busy); "celery", a
    # task per message on Celery's threads pool. Flower shows either's jobs as tasks.
    # docs/reference/worker.md, "Engines".
    worker_engine: Literal["celery", "loop"] = "loop"
    max_attempts: int = Field(default=5, ge=1)
    request_timeout_s: float = Field(default=3600.0, gt=0)
    # Longest a request may go without progress once the server answered (see
    # worker.sglang): a stuck or dripping server fails the attempt after this, not after
    # request_timeout_s.
    stall_timeout_s: float = Field(default=300.0, gt=0)
    # Ask for streamed answers, so that a request that stops making progress fails after
    # stall_timeout_s of silence. None: from servers whose /get_server_info says they stream
    # incrementally (each chunk only its new ids: linear cost; SGLang's default repeats every
    # id so far in each chunk). docs/reference/worker.md, "Streaming".
    stream: bool | None = None
    # A /generate body larger than this fails the attempt unread: far above any legal
    # answer (the ids and text of a whole context window).
    max_response_bytes: int = Field(default=64 << 20, ge=1 << 16)
    lease_seconds: int = Field(default=600, ge=2)
    queue: str = "eaglegen"
    # In-flight limit per server when its spec sets none (all workers and hosts together):
    # where the adaptive controller starts, and the limit while it has set none.
    server_max_inflight: int = Field(default=256, ge=1)
    # A controller per server (worker.controller) moves the limit of every server whose spec
    # fixes none, within [concurrency_min, concurrency_max], every concurrency_interval_s,
    # keeping KV usage under concurrency_kv_target; off: the limit stays as configured.
    adaptive_concurrency: bool = True
    concurrency_interval_s: float = Field(default=5.0, gt=0)
    concurrency_min: int = Field(default=4, ge=1)
    concurrency_max: int = Field(default=1024, ge=1)
    concurrency_kv_target: float = Field(default=0.9, gt=0, le=1)
    slot_lease_seconds: float = Field(default=60.0, gt=0)
    slot_wait_s: float = Field(default=10.0, ge=0)
    # A conversation's next turn goes to the server that generated the turn before it when
    # that server has room: its prefix cache holds the history (worker.advancer).
    turn_affinity: bool = True
    health_interval_s: float = Field(default=10.0, gt=0)
    # Each server is asked /get_model_info again this often (and whenever it comes back
    # from down): another model swapped in behind its URL between two health probes is found
    # within this interval. The call is far cheaper than a /health_generate probe.
    reidentify_interval_s: float = Field(default=10.0, gt=0)
    heartbeat_interval_s: float = Field(default=5.0, gt=0)
    reconcile_interval_s: float = Field(default=60.0, gt=0)
    # A queued job published this long ago whose message is missing from Redis is published
    # again (by the feeder, in its order).
    republish_after_s: float = Field(default=30.0, ge=0)
    # Messages the feeder keeps waiting in Redis (worker.feeder); None: twice what the live
    # workers can run at once.
    window: int | None = Field(default=None, ge=1)
    # The feeder's pass interval when nothing wakes it (an enqueue or a budget raise does).
    feed_interval_s: float = Field(default=1.0, gt=0)
    budget_defer_s: float = Field(default=5.0, ge=0)
    retry_base_s: float = Field(default=1.0, ge=0)
    retry_cap_s: float = Field(default=60.0, ge=0)
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    # A condition that lasts (Postgres or Redis out of reach, a server down, a side loop
    # failing) is logged when it starts and when it ends, and reminded of at most this often.
    log_reminder_s: float = Field(default=60.0, gt=0)
    # A worker serves its Prometheus metrics on this port (plus its NUMA node's id when
    # pinned, so that the processes of one host differ); None: not served.
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    # A JSON Lines row longer than this is rejected as too_long without being read whole.
    max_row_bytes: int = Field(default=8 << 20, ge=1024)

    def services(self) -> Services:
        """The database and broker, or a ValueError saying how to provide them."""
        if self.database_url is None or self.broker_url is None:
            raise ValueError(
                "no database/broker configured: run `eaglegen up` first, or set "
                "EAGLEGEN_DATABASE_URL and EAGLEGEN_BROKER_URL "
                "(or pass --database-url/--broker-url)"
            )
        return Services(self.database_url, self.broker_url)

    @field_validator("servers")
    @classmethod
    def _one_server_per_name(cls, value: list[ServerSpec]) -> list[ServerSpec]:
        seen: dict[str, str] = {}
        for spec in value:
            other = seen.setdefault(spec.name, spec.url)
            if other != spec.url:
                raise ValueError(f"server name {spec.name!r} given for {other} and {spec.url}")
        return value

    @field_validator("database_url")
    @classmethod
    def _database_scheme(cls, value: str | None) -> str | None:
        return None if value is None else normalize_database_url(value)

    @field_validator("broker_url")
    @classmethod
    def _broker_scheme(cls, value: str | None) -> str | None:
        if value is not None and urlsplit(value).scheme not in ("redis", "rediss", "redis+socket"):
            raise ValueError(f"broker url must be a redis:// url, got scheme of {redact(value)}")
        return value


def from_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings that ``environ`` sets: ``EAGLEGEN_<FIELD>`` in any case, a list's or a
    model's value as JSON, any other as its text for the field's validation: what
    pydantic-settings did with these fields. Read here, its import stays out of every
    command's start-up (BENCHMARKS.md, "CLI start-up")."""
    names = {ENV_PREFIX.lower() + name: name for name in Settings.model_fields}
    found: dict[str, Any] = {}
    for key, text in environ.items():
        name = names.get(key.lower())
        if name is None:
            continue
        if not _takes_json(Settings.model_fields[name].annotation):
            found[name] = text
            continue
        try:
            found[name] = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{key} is not JSON: {exc}") from None
    return found


def _takes_json(annotation: Any) -> bool:
    """Whether a field of this type is set from JSON text (a list, a dict or a model)."""
    if get_origin(annotation) in (list, dict):
        return True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_takes_json(arg) for arg in get_args(annotation) if arg is not type(None))


@dataclass(frozen=True)
class Services:
    """The Postgres and Redis a command works with, both known: resolved once, at the edge."""

    database_url: str
    broker_url: str
