"""The feeder: keeps a bounded window of messages in Redis, topped up from Postgres.

Postgres holds every queued job; Redis carries only the next few (docs/design.md §7). One worker of
the cluster feeds (it holds ``keys.feeder_lock``, as the reconciler does): once the queue
list is down to half the window it tops it up, with the next jobs of each dataset in its seeded
order (models.order), the datasets interleaved so that each advances in proportion to its
work (worker.shares). It never publishes a job of a spent budget: those are skipped where
they lie. Jobs sent back after an attempt come back through the same order once their
backoff is over.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import redis

from core import heartbeat, keys, wire
from core.broker import Publisher
from models.feed import FeedDataset
from models.repository import Repository
from worker.shares import allocate, share_of

log = logging.getLogger(__name__)
# The window when none is set: this many times the cluster's in-flight capacity, so that
# a worker that finishes a request always finds its next message waiting.
WINDOW_FACTOR = 2
MIN_WINDOW = 64
# How long `status` trusts the feeder's last report (it is rewritten at every pass).
REPORT_TTL_S = 60
WINDOW_TTL_S = 5.0
# The shortest wait between passes while workers drain the list.
SOON_S = 0.05


@dataclass(frozen=True)
class FeedReport:
    """What one pass found and did."""

    window: int
    in_redis: int  # messages waiting in the queue list before the pass
    published: int
    skipped: int  # jobs of spent budgets skipped unpublished
    # Messages the workers took per second since the previous pass (0 on the first).
    taken_per_s: float = 0.0

    def next_pass_s(self, interval_s: float) -> float:
        """When to look again. Soon after a top-up (workers may take faster than one pass
        an interval gives), else halfway to when the workers' pace brings the list down to
        half the window, and never later than the interval: a fast worker empties a window
        well within a second, and an idle list must not wait for a pass to refill it."""
        if self.published and self.in_redis <= self.window // 2:
            return min(SOON_S, interval_s)
        if self.taken_per_s <= 0:
            return interval_s
        above_half = max(0, self.in_redis + self.published - self.window // 2)
        return min(interval_s, max(SOON_S, above_half / self.taken_per_s / 2))

    def as_dict(self) -> dict[str, int]:
        """The ``--json`` shape."""
        return {
            "window": self.window,
            "in_redis": self.in_redis,
            "published": self.published,
            "skipped": self.skipped,
        }


class Feeder:
    """One queue's feeder; ``feed`` is one pass (safe anywhere, any number of times)."""

    def __init__(
        self,
        repo: Repository,
        client: redis.Redis,
        publisher: Publisher,
        *,
        window: int | None = None,
        on_skipped: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.repo = repo
        self.client = client
        self.publisher = publisher
        self.window = window
        # Told the skipped jobs that had a message before (Flower shows their last state).
        self.on_skipped = on_skipped
        self._auto: tuple[float, int] | None = None  # (until, window) from the heartbeats
        # When the previous pass ended and how many messages it left in the list.
        self._last: tuple[float, int] | None = None

    def feed(self) -> FeedReport:
        """Once the queue list is down to half the window: skip spent datasets' jobs, then
        top it up to the window. Above half, a pass costs one LLEN and no query."""
        window = self._window()
        in_redis = int(self.client.llen(self.publisher.queue))
        now = time.monotonic()
        taken_per_s = self._pace(now, in_redis)
        if in_redis > window // 2:
            self._last = (now, in_redis)
            return self._report(FeedReport(window, in_redis, 0, 0, taken_per_s))
        datasets = self.repo.feed_datasets()
        skipped = sum(self._skip(d) for d in datasets if d.spent and d.ready)
        order = allocate([share_of(d) for d in datasets if not d.spent], window - in_redis)
        published = 0
        if order:
            tags = {d.dataset_id: wire.tag(d.dataset, d.run) for d in datasets}

            def publish(taken: dict[int, list[int]]) -> None:
                nonlocal published
                ids = interleave(order, taken)
                labels = {job: tags[d] for d, jobs in taken.items() for job in jobs}
                published = self.publisher.publish(ids, labels)

            self.repo.take_next(Counter(order), publish)
        self._last = (now, in_redis + published)
        return self._report(FeedReport(window, in_redis, published, skipped, taken_per_s))

    def _pace(self, now: float, in_redis: int) -> float:
        """Messages taken from the list per second since the previous pass left it."""
        if self._last is None or now <= self._last[0]:
            return 0.0
        when, left = self._last
        return max(0, left - in_redis) / (now - when)

    def _report(self, report: FeedReport) -> FeedReport:
        """Leave the pass's figures for `status`."""
        key = keys.feeder_report(self.publisher.queue)
        self.client.set(key, json.dumps(report.as_dict()), ex=REPORT_TTL_S)
        return report

    def _window(self) -> int:
        """The window set, else the one the live workers' heartbeats give (re-read every
        WINDOW_TTL_S: the heartbeats change at the pace of workers starting and stopping)."""
        if self.window:
            return self.window
        now = time.monotonic()
        if self._auto is None or now >= self._auto[0]:
            self._auto = (now + WINDOW_TTL_S, auto_window(self.client))
        return self._auto[1]

    def _skip(self, dataset: FeedDataset) -> int:
        count, known = self.repo.skip_spent(dataset.dataset_id)
        if known and self.on_skipped is not None:
            self.on_skipped(known)
        return count


def interleave(order: list[int], taken: dict[int, list[int]]) -> list[int]:
    """The jobs taken per dataset, laid out in the allocation's order of datasets (a
    dataset that yielded fewer jobs than asked for leaves its later places out)."""
    queues = {d: iter(jobs) for d, jobs in taken.items()}
    return [job for d in order if (job := next(queues.get(d, iter(())), None)) is not None]


def auto_window(client: redis.Redis) -> int:
    """``WINDOW_FACTOR`` times what the live workers can run at once: the lesser of their
    threads and their servers' in-flight limits (each server counted once)."""
    threads, limits = 0, {}
    for beat in heartbeat.read_all(client):
        threads += beat.threads
        for name, server in beat.servers.items():
            limits[name] = server.limit
    capacity = min(threads, sum(limits.values())) if limits else threads
    return max(MIN_WINDOW, WINDOW_FACTOR * capacity)
