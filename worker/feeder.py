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

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import redis

from core import heartbeat, wire
from core.broker import Publisher, store_feed_report
from models.feed import FeedDataset
from models.repository import Repository
from worker.shares import allocate, share_of

log = logging.getLogger(__name__)
# The window when none is set: this many times the cluster's in-flight capacity, so that
# a worker that finishes a request always finds its next message waiting.
WINDOW_FACTOR = 2
MIN_WINDOW = 64
# ...or, when more, this many seconds of the messages the workers take, so that a pass comes
# before the list runs dry however fast they take them (a worker whose server answers at
# once takes hundreds a second, and a pass waits for its turn at the worker's interpreter);
# the pace is the fastest seen lately, decaying by PACE_DECAY a pass, and the window at
# most MAX_WINDOW. A dataset enqueued meanwhile starts after the messages waiting, up to
# PACE_HORIZON_S later. A window sized to one pass's hold-up instead kept the list dry too
# often (BENCHMARKS.md, "The loop engine").
PACE_HORIZON_S = 1.0
PACE_DECAY = 0.9
MAX_WINDOW = 16384
# How long `status` trusts the feeder's last report (it is rewritten at every pass).
REPORT_TTL_S = 60
WINDOW_TTL_S = 5.0
# The shortest wait between passes while workers drain the list.
SOON_S = 0.05
# The feeder's log says what it did at most this often (and its changes of state at once).
SUMMARY_S = 600.0


@dataclass(frozen=True)
class FeedReport:
    """What one pass found and did."""

    window: int
    in_redis: int  # messages waiting in the queue list before the pass
    published: int
    skipped: int  # jobs of spent budgets skipped unpublished
    # Messages the workers took per second since the previous pass (0 on the first).
    taken_per_s: float = 0.0
    # The pass read Postgres (the list was down to half the window).
    queried: bool = False
    # ...and found nothing left to publish: no job without a message out in any dataset
    # whose budget is not spent.
    idle: bool = False

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
        self._pace = 0.0  # messages taken a second, the fastest seen lately
        # When the previous pass ended and how many messages it left in the list.
        self._last: tuple[float, int] | None = None
        # Spent datasets whose skipping the log has told (told again after a budget raise).
        self._told_spent: set[int] = set()

    def feed(self) -> FeedReport:
        """Once the queue list is down to half the window: skip spent datasets' jobs, then
        top it up to the window. Above half, a pass costs one LLEN and no query."""
        in_redis = int(self.client.llen(self.publisher.queue))
        now = time.monotonic()
        taken_per_s = self._taken_per_s(now, in_redis)
        self._pace = max(taken_per_s, PACE_DECAY * self._pace)
        window = self._window()
        if in_redis > window // 2:
            self._last = (now, in_redis)
            return self._report(FeedReport(window, in_redis, 0, 0, taken_per_s))
        datasets = self.repo.feed_datasets()
        self._told_spent.difference_update(d.dataset_id for d in datasets if not d.spent)
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
        idle = not published and not any(d.ready for d in datasets if not d.spent)
        return self._report(
            FeedReport(window, in_redis, published, skipped, taken_per_s, queried=True, idle=idle)
        )

    def _taken_per_s(self, now: float, in_redis: int) -> float:
        """Messages taken from the list per second since the previous pass left it."""
        if self._last is None or now <= self._last[0]:
            return 0.0
        when, left = self._last
        return max(0, left - in_redis) / (now - when)

    def _report(self, report: FeedReport) -> FeedReport:
        """Leave the pass's figures for `status`."""
        store_feed_report(self.client, self.publisher.queue, report.as_dict(), REPORT_TTL_S)
        return report

    def _window(self) -> int:
        """The window set, else the one the live workers' heartbeats give (re-read every
        WINDOW_TTL_S: the heartbeats change at the pace of workers starting and stopping)
        or PACE_HORIZON_S of their pace, whichever is more."""
        if self.window:
            return self.window
        now = time.monotonic()
        if self._auto is None or now >= self._auto[0]:
            self._auto = (now + WINDOW_TTL_S, auto_window(self.client))
        return paced_window(self._auto[1], self._pace)

    def _skip(self, dataset: FeedDataset) -> int:
        count, known = self.repo.skip_spent(dataset.dataset_id)
        if known and self.on_skipped is not None:
            self.on_skipped(known)
        if count and dataset.dataset_id not in self._told_spent:
            self._told_spent.add(dataset.dataset_id)
            log.info(
                "feeder: dataset %r of run %r spent its budget (%s of %s tokens): "
                "skipping its queued jobs (%d now)",
                dataset.dataset,
                dataset.run,
                f"{dataset.used_tokens:,}",
                f"{dataset.budget_tokens or 0:,}",
                count,
            )
        return count


class FeedLog:
    """What the feeder says in the log: its changes of state at once (it takes the queue
    over or hands it on, starts or stops publishing, its window changes) and what it did
    at most every ``summary_s``; never a line per pass (several a second while workers
    drain the window)."""

    def __init__(
        self,
        queue: str,
        summary_s: float = SUMMARY_S,
        logger: logging.Logger = log,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.queue = queue
        self.summary_s = summary_s
        self._log = logger
        self._clock = clock
        self.leader = False
        self.publishing = False
        self.window: int | None = None
        self._since = clock()  # the start of the summary's period
        self._published = 0  # in the period
        self._skipped = 0
        self._spell = 0  # published since it last started publishing

    def leading(self, leader: bool) -> None:
        """Whether this worker holds the feeder's lock now."""
        if leader == self.leader:
            return
        self.leader = leader
        if leader:
            self._log.info("feeder: this worker feeds queue %s now", self.queue)
        else:
            self._log.info("feeder: another worker feeds queue %s now", self.queue)
            self.publishing = False

    def passed(self, report: FeedReport) -> None:
        """One pass's report."""
        # Said when it halves or doubles: the window follows the workers' pace, pass by pass.
        said = self.window
        if said is None or not said / 2 < report.window < 2 * said:
            if said is not None:
                self._log.info("feeder: window now %d message(s) (was %d)", report.window, said)
            self.window = report.window
        self._published += report.published
        self._skipped += report.skipped
        self._spell += report.published
        if report.published and not self.publishing:
            self.publishing = True
            self._spell = report.published
            self._log.info(
                "feeder: publishing queue %s (window %d message(s))", self.queue, report.window
            )
        elif report.idle and self.publishing:
            self.publishing = False
            self._log.info(
                "feeder: nothing left to publish on queue %s (%s message(s) published)",
                self.queue,
                f"{self._spell:,}",
            )
        now = self._clock()
        if now - self._since >= self.summary_s:
            if self._published or self._skipped:
                self._log.info(
                    "feeder: in the last %.0f min: %s message(s) published, %s job(s) of spent "
                    "budgets skipped; window %d, %d waiting in Redis",
                    (now - self._since) / 60,
                    f"{self._published:,}",
                    f"{self._skipped:,}",
                    report.window,
                    report.in_redis + report.published,
                )
            self._since, self._published, self._skipped = now, 0, 0


def interleave(order: list[int], taken: dict[int, list[int]]) -> list[int]:
    """The jobs taken per dataset, laid out in the allocation's order of datasets (a
    dataset that yielded fewer jobs than asked for leaves its later places out)."""
    queues = {d: iter(jobs) for d, jobs in taken.items()}
    return [job for d in order if (job := next(queues.get(d, iter(())), None)) is not None]


def paced_window(window: int, pace: float) -> int:
    """``window``, or PACE_HORIZON_S of ``pace`` (messages taken a second) when more, within
    MAX_WINDOW."""
    return max(window, min(MAX_WINDOW, math.ceil(pace * PACE_HORIZON_S)))


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
