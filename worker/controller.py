"""The adaptive in-flight limit's I/O: a controller per server, cluster-wide, and the read side.

Each worker process runs `LimitControllers.step` on a side loop. For each attached server whose
limit the user did not fix (``ServerSpec.max_inflight``), the process that holds the server's
Redis lock reads the server's ``/metrics``, lets `worker.concurrency.ConcurrencyController`
pick the next limit and stores it in Redis with the reason; the others do nothing until the
lock lapses. A process that takes the lock over continues from the stored limit. Every worker
reads the stored limit through `SharedLimits` (cached a second or two per process) when it
takes a slot, and uses the server's configured limit until it has seen one stored.

While the server is down or its ``/metrics`` cannot be read (an error, a stalled or oversized
answer: core.bounded), the controller keeps the limit where it is, says so once, and keeps
storing it: a limit that lapsed would send every worker back to the configured one (256 by
default) against a server that may be struggling.

Redis keys: ``keys.controller_lock(server)``, the controlling process's lock (worker.leader);
``keys.limit(server)``: JSON ``{"limit", "reason", "at", "by"}`` (``core.limits.LimitRecord``),
expiring when no controller has refreshed it for a while, so a stopped cluster leaves no stale
limit behind.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import httpx
import redis

from core import keys
from core.bounded import AnswerRefused
from core.limits import LimitRecord, read_limit
from core.settings import Settings
from worker.concurrency import ConcurrencyController, Decision, Sample, Tuning
from worker.leader import Leadership
from worker.outages import REMINDER_S, Outages
from worker.servers import Server
from worker.slots import SlotPool

log = logging.getLogger(__name__)

# --- /metrics ------------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, list[float]]:
    """Prometheus text: each metric name (labels dropped) with the values of its series."""
    series: dict[str, list[float]] = defaultdict(list)
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{")
        if rest:  # labels: the value follows the closing brace
            _, _, rest = rest.rpartition("}")
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        try:
            value = float(fields[0])
        except (IndexError, ValueError):
            continue  # a line this parser does not understand says nothing about load
        if math.isfinite(value):  # NaN or Inf says nothing about load either
            series[name.strip()].append(value)
    return dict(series)


# Per metric, how the series of several data-parallel ranks combine.
_SUMMED = {
    "running": "sglang:num_running_reqs",
    "queued": "sglang:num_queue_reqs",
    "max_total_tokens": "sglang:max_total_num_tokens",
    "retracted_total": "sglang:num_retracted_requests_total",
    "gen_throughput": "sglang:gen_throughput",
}
_USAGE = "sglang:token_usage"


def sample_from_metrics(text: str, in_flight: int | None = None) -> Sample | None:
    """A controller sample from a /metrics body; None without SGLang's scheduler gauges (a
    server started without --enable-metrics). The busiest rank's KV usage counts: the
    limit is shared by all ranks, and the fullest one retracts first."""
    metrics = parse_metrics(text)
    if _SUMMED["running"] not in metrics or _USAGE not in metrics:
        return None
    total = {key: sum(metrics.get(name, [0.0])) for key, name in _SUMMED.items()}
    return Sample(
        running=int(total["running"]),
        queued=int(total["queued"]),
        token_usage=max(metrics[_USAGE]),
        max_total_tokens=int(total["max_total_tokens"]),
        # Servers without the counter (older SGLang) never show a retraction.
        retracted_total=int(total["retracted_total"]),
        gen_throughput=total["gen_throughput"],
        in_flight=in_flight,
    )


# --- the stored limit ----------------------------------------------------------------------


class SharedLimits:
    """The in-flight limit of each server for slot acquisition: the stored one, cached for
    ``ttl_s`` per process; while none is stored, the last one seen, else the server's
    configured one (always, when fixed)."""

    def __init__(
        self,
        client: redis.Redis,
        ttl_s: float = 1.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Nothing cached yet."""
        self._client = client
        self._ttl = ttl_s
        self._clock = clock
        self._cache: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def get(self, server: Server) -> int:
        """The limit to enforce on ``server`` now."""
        if server.spec.max_inflight is not None:
            return server.limit
        with self._lock:  # one thread reads Redis, the others wait for its answer
            now = self._clock()
            cached = self._cache.get(server.name)
            if cached is not None and now < cached[0]:
                return cached[1]
            limit = self._read(server, cached[1] if cached else server.limit)
            self._cache[server.name] = (now + self._ttl, limit)
            return limit

    def _read(self, server: Server, last: int) -> int:
        """The stored limit; the last one known while Redis does not answer or none is
        stored: a record that lapsed (its controller's process died, and the next has not
        stored one yet) must not open the server to the configured limit meanwhile."""
        try:
            record = read_limit(self._client, server.name)
        except redis.RedisError:
            return last
        return last if record is None else record.limit


# --- the controller ------------------------------------------------------------------------

# The stored reason of a limit refreshed while nothing could be read (`eaglegen status`).
KEPT = "kept while "


@dataclass(frozen=True)
class ControllerSettings:
    """How often the controllers run and within which bounds (see `from_settings`)."""

    interval_s: float = 5.0
    tuning: Tuning = field(default_factory=Tuning)
    # The limit a controller starts from when none is stored; None: the server's own.
    start: int | None = None
    # How often an unreadable /metrics is said again while it lasts (worker.outages).
    remind_s: float = REMINDER_S

    @property
    def read_timeout_s(self) -> float:
        """The whole /metrics read's deadline: within a step, so the lock (three steps)
        never lapses behind a stalled read."""
        return min(self.interval_s, 10.0)

    @classmethod
    def from_settings(cls, settings: Settings) -> ControllerSettings:
        """From the worker's settings (it starts from each server's configured limit)."""
        tuning = Tuning(
            min_limit=settings.concurrency_min,
            max_limit=max(settings.concurrency_min, settings.concurrency_max),
            kv_target=settings.concurrency_kv_target,
        )
        return cls(settings.concurrency_interval_s, tuning, remind_s=settings.log_reminder_s)


class LimitController:
    """Sets one server's shared in-flight limit while this process holds its lock."""

    def __init__(
        self,
        server: Server,
        client: redis.Redis,
        owner: str,
        slots: SlotPool | None = None,
        config: ControllerSettings | None = None,
    ) -> None:
        """Not leading yet: the first step tries to take the lock."""
        self.server = server
        self._client = client
        self.owner = owner
        self._slots = slots
        self.config = config or ControllerSettings()
        self._leadership = Leadership(client, owner)
        self.core: ConcurrencyController | None = None
        self._reason = ""  # why the limit is what it is (kept while it does not change)
        self._outages = Outages(self.config.remind_s, logger=log)
        self._unreadable = f"server {server.name}: /metrics unreadable"  # its condition

    @property
    def enabled(self) -> bool:
        """Off when the user fixed the server's limit."""
        return self.server.spec.max_inflight is None

    @property
    def leading(self) -> bool:
        """Whether this process controlled the limit at its last step."""
        return self.core is not None

    def step(self) -> Decision | None:
        """One control step: the decision when this process leads and the server answered."""
        if not self.enabled or not self._take_lock():
            self.core = None
            return None
        core = self.core or self._start()
        if not self.server.healthy:
            # A down server's metrics say nothing about its capacity (Router.mark says it
            # is down); the limit stays stored for when it is back.
            self._store(core.limit, f"{KEPT}the server is down")
            return None
        sample = self._sample()
        if sample is None:
            self._store(core.limit, f"{KEPT}/metrics is unreadable")
            return None
        decision = core.update(sample)
        self._publish(decision)
        return decision

    def _take_lock(self) -> bool:
        """Take or keep the lock, which lapses after three missed steps."""
        key = keys.controller_lock(self.server.name)
        return self._leadership.hold(key, 3 * self.config.interval_s)

    def _start(self) -> ConcurrencyController:
        """Lead from the stored limit, so that a change of leader changes nothing."""
        record = read_limit(self._client, self.server.name)
        start = self.config.start or self.server.limit
        self.core = ConcurrencyController(record.limit if record else start, self.config.tuning)
        self._reason = "the controller's start"
        if record is not None:
            # A limit kept by a stalled leader says why it was kept, not why it is what it is.
            kept = record.reason.startswith(KEPT)
            self._reason = "the stored limit of the previous controller" if kept else record.reason
        log.info(
            "server %s: this process sets the in-flight limit (from %d)",
            self.server.name,
            self.core.limit,
        )
        return self.core

    def _sample(self) -> Sample | None:
        """The server's metrics with the slots held on it; None if unreadable, said when it
        starts and when it ends (worker.outages), with reminders while it lasts."""
        try:
            response = self.server.client.get("/metrics", self.config.read_timeout_s)
            response.raise_for_status()
            held = None if self._slots is None else self._slots.in_flight(self.server.name)
            sample = sample_from_metrics(response.text, held)
        except AnswerRefused as exc:  # already one line naming /metrics
            self._unread(str(exc))
            return None
        except httpx.HTTPError as exc:
            self._unread(f"/metrics: {type(exc).__name__}: {exc}")
            return None
        if sample is None:
            self._unread(
                "/metrics has no sglang scheduler gauges (started without --enable-metrics?)"
            )
        else:
            self._outages.up(self._unreadable)
        return sample

    def _unread(self, reason: str) -> None:
        """The limit stays as it is; say so once per outage."""
        limit = self.core.limit if self.core else self.server.limit
        self._outages.down(
            self._unreadable,
            reason,
            then=f"in-flight limit kept at {limit}",
            ended=f"server {self.server.name}: /metrics read again",
        )

    def _publish(self, decision: Decision) -> None:
        """Store the limit (refreshing its expiry even when unchanged); log a change once."""
        name = self.server.name
        self._reason = decision.reason or self._reason
        self._store(decision.limit, self._reason)
        if decision.changed:
            level = logging.WARNING if decision.limit < decision.previous else logging.INFO
            log.log(
                level,
                "server %s: in-flight limit %d -> %d: %s",
                name,
                decision.previous,
                decision.limit,
                decision.reason,
            )

    def _store(self, limit: int, reason: str) -> None:
        """Store ``limit``, expiring after twenty steps without another store."""
        seconds, micros = self._client.time()
        record = LimitRecord(limit, reason, seconds + micros / 1e6, self.owner)
        ttl_s = max(60, math.ceil(self.config.interval_s * 20))
        self._client.set(keys.limit(self.server.name), record.to_json(), ex=ttl_s)


class LimitControllers:
    """The controllers of one worker process's servers; `step` is its side loop's body."""

    def __init__(self, controllers: Iterable[LimitController]) -> None:
        """One controller per server."""
        self.controllers = list(controllers)

    @classmethod
    def for_worker(
        cls,
        servers: Sequence[Server],
        client: redis.Redis,
        owner: str,
        slots: SlotPool | None,
        settings: Settings,
    ) -> LimitControllers:
        """A controller for each server whose limit the user did not fix; none at all when
        the settings turn adaptive concurrency off."""
        if not settings.adaptive_concurrency:
            return cls([])
        config = ControllerSettings.from_settings(settings)
        return cls(
            LimitController(server, client, owner, slots, config)
            for server in servers
            if server.spec.max_inflight is None
        )

    def step(self) -> None:
        """One step of every controller; one server's failure does not stop the others."""
        for controller in self.controllers:
            try:
                controller.step()
            except redis.RedisError as exc:
                log.warning("server %s: limit controller: %s", controller.server.name, exc)
