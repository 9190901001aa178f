"""Adaptive in-flight limit for one SGLang server: pure logic, no I/O.

What the clients we read do, and what is taken from each:

- Envoy's gradient controller and Netflix's Gradient2/Vegas infer queueing from latency
  (``minRTT / sampleRTT``) because a generic server does not say how long its queue is. An LLM
  request's latency is mostly its own output length (seconds to many minutes) and a decode step
  slows as the batch grows even without any queue, so a latency gradient is noise here. SGLang
  reports the queue itself (``num_queue_reqs``), so the Vegas idea is kept with the queue read
  directly: hold a small queue at the server, grow when it is shorter, trim when it is longer.
- prime-rl's controller (an AIMD gated on vLLM's KV usage with a multiplicative cut on new
  preemptions) supplies the rest: grow only while the KV pool is below a target and the limit
  binds (the workers really fill it), with the growth tapered as KV usage nears the target; cut
  multiplicatively on new retractions (SGLang's preemption), then ignore the retractions of
  requests already admitted until the in-flight count has drained under the new limit.
- TCP Reno's two phases give the damping: growth is multiplicative (slow start) until the first
  congestion signal (a long queue or a retraction), additive afterwards near the knee; every
  change is followed by a hold of one sample, so each decision sees the effect of the previous
  one. Unlike Reno, growth after a cut turns multiplicative again while the server shows room
  (below), since a cut can be far below the knee: a stalled server cut to the floor came back
  from 4 to 200 at +1 per step, in 16 minutes. The first descent is not Reno's either: a
  queue longer than the whole running batch, at a batch that has stopped growing, goes to
  the knee (capacity + headroom) in one step, not by 20% a step (256 to a knee near 60 took
  six trims, a minute at 5 s a sample): the batch is known then, and the rest only waits.

The result keeps the limit at the knee, where the server's running batch stops growing (KV
full, admission's reservations full, or ``max_running_requests``): ``running + headroom``,
the headroom being a short queue that the server admits from the moment a request finishes,
so it never waits for a worker's round trip. No cut goes below what the server runs at that
moment, and nothing in flight is ever cancelled: a lower limit only stops new admissions.
``gen_throughput`` is reported with the decisions but does not steer them: it lags, and in a
batch whose step cost grows with its size it keeps creeping up past the knee.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """One reading of a server's /metrics, with the in-flight count the workers hold."""

    running: int
    queued: int
    token_usage: float
    max_total_tokens: int
    # sglang:num_retracted_requests_total: a counter, so a drop means the server restarted.
    retracted_total: int
    gen_throughput: float = 0.0
    # Requests the workers have in flight on this server; None: taken as running + queued.
    in_flight: int | None = None

    @property
    def held(self) -> int:
        """Requests in flight on the server."""
        return self.running + self.queued if self.in_flight is None else self.in_flight


@dataclass(frozen=True)
class Tuning:
    """The controller's knobs; the defaults need no tuning per server or workload."""

    min_limit: int = 4
    max_limit: int = 1024
    # Growth stops at this KV usage: SGLang's own admission fills the pool beyond it.
    kv_target: float = 0.9
    # The queue kept at the server: at least queue_floor, or queue_share of the running batch.
    queue_floor: int = 2
    queue_share: float = 0.1
    # Slow start: at most this fraction more per step with an empty pool, less as KV fills.
    growth: float = 0.5
    # KV usage lags admission (a request's KV grows until it finishes), so growth is gated on
    # the usage projected this many samples ahead at its current rate of rise.
    lookahead: float = 4.0
    # Multiplicative decrease on retractions and on a queue far above the headroom.
    backoff: float = 0.8
    # The limit binds when the workers hold at least this share of it.
    binding: float = 0.9
    # Samples skipped after a change, so the next decision sees its effect.
    hold: int = 1
    # The server's capacity is its peak running batch, decaying by this factor per sample:
    # SGLang's batch dips while long requests hold the pool, and a trim to a dip would leave
    # the server short once the dip is over.
    capacity_decay: float = 0.98

    def __post_init__(self) -> None:
        """Reject knobs that cannot control anything."""
        if not 1 <= self.min_limit <= self.max_limit:
            raise ValueError("need 1 <= min_limit <= max_limit")
        if not 0.0 < self.kv_target <= 1.0 or not 0.0 < self.backoff < 1.0:
            raise ValueError("need 0 < kv_target <= 1 and 0 < backoff < 1")
        if self.growth <= 0 or self.lookahead < 0 or self.hold < 0:
            raise ValueError("need growth > 0, lookahead >= 0, hold >= 0")
        if self.queue_floor < 1 or self.queue_share < 0:
            raise ValueError("need queue_floor >= 1, queue_share >= 0")
        if not 0.0 < self.capacity_decay <= 1.0:
            raise ValueError("need 0 < capacity_decay <= 1")

    def clamp(self, limit: int) -> int:
        """The limit within its bounds."""
        return min(max(limit, self.min_limit), self.max_limit)

    def headroom(self, running: int) -> int:
        """The queue to keep at a server running this many requests."""
        return max(self.queue_floor, math.ceil(self.queue_share * running))


@dataclass(frozen=True)
class Decision:
    """The limit after a sample, and why it changed (empty when it did not)."""

    limit: int
    previous: int
    reason: str = ""

    @property
    def changed(self) -> bool:
        """Whether this sample moved the limit."""
        return self.limit != self.previous


class ConcurrencyController:
    """The next in-flight limit of one server from successive samples of its metrics."""

    def __init__(self, start: int, tuning: Tuning | None = None) -> None:
        """Start at ``start`` (clamped), in slow start."""
        self.tuning = tuning or Tuning()
        self.limit = self.tuning.clamp(start)
        self.slow_start = True
        self._retracted: int | None = None
        self._queued: int | None = None
        self._running: int | None = None
        self._usage: float | None = None
        self._hold = 0
        self._draining = False
        self.capacity = 0.0

    def update(self, sample: Sample) -> Decision:
        """Take one sample; the limit to enforce until the next one."""
        retracted, queue_rise, projected, running_rise = self._observe(sample)
        if retracted and not self._draining:
            return self._back_off(sample, retracted)  # an emergency brake is never held
        if self._hold > 0:
            self._hold -= 1
            return Decision(self.limit, self.limit)
        headroom = self.tuning.headroom(sample.running)
        if sample.queued > 2 * headroom or (sample.queued > headroom and queue_rise >= headroom):
            return self._trim(sample, headroom, running_rise)
        if self._may_grow(sample, headroom, projected):
            return self._grow(sample, projected)
        return Decision(self.limit, self.limit)

    def _observe(self, sample: Sample) -> tuple[int, int, float, int | None]:
        """Fold a sample into the state: new retractions, the queue's rise, projected KV,
        and the running batch's rise since the sample before (None: the first sample)."""
        retracted = self._new_retractions(sample.retracted_total)
        queue_rise = 0 if self._queued is None else sample.queued - self._queued
        running_rise = None if self._running is None else sample.running - self._running
        self._running = sample.running
        usage_rise = 0.0 if self._usage is None else sample.token_usage - self._usage
        self._queued, self._usage = sample.queued, sample.token_usage
        projected = sample.token_usage + self.tuning.lookahead * max(0.0, usage_rise)
        self.capacity = max(float(sample.running), self.capacity * self.tuning.capacity_decay)
        if self._draining and sample.held <= self.limit:
            self._draining = False  # what was admitted before the cut has drained
        return retracted, queue_rise, projected, running_rise

    def _new_retractions(self, total: int) -> int:
        """Retractions since the last sample; none on the first one or after a restart."""
        last, self._retracted = self._retracted, total
        return 0 if last is None or total < last else total - last

    def _back_off(self, sample: Sample, retracted: int) -> Decision:
        """Multiplicative cut, never below what the server runs (it has just shed the rest)."""
        t = self.tuning
        target = max(math.floor(t.backoff * self.limit), min(sample.running, self.limit - 1))
        self._draining = True
        why = f"{retracted} request(s) retracted, KV {sample.token_usage:.0%}: back off"
        return self._change(target, why, sample)

    def _trim(self, sample: Sample, headroom: int, running_rise: int | None) -> Decision:
        """A queue beyond the headroom: cut towards the server's recent capacity plus its
        headroom, by at most the backoff factor; straight to it when the server is past its
        knee beyond doubt: a queue longer than its whole batch, and a batch that stopped
        growing (still rising, it is filling up, and its capacity is not known yet)."""
        capacity = math.ceil(self.capacity)
        floor = capacity + self.tuning.headroom(capacity)
        past_knee = running_rise is not None and running_rise <= 0
        if past_knee and sample.queued > sample.running:
            target = floor
        else:
            target = max(floor, math.floor(self.tuning.backoff * self.limit))
        if target >= self.limit:
            return Decision(self.limit, self.limit)
        why = f"queue {sample.queued} > {headroom} at {sample.running} running: trim"
        return self._change(target, why, sample)

    def _may_grow(self, sample: Sample, headroom: int, projected: float) -> bool:
        """Room in the pool (now and a few samples ahead), a short queue, and workers that
        fill the current limit."""
        t = self.tuning
        binds = sample.held >= t.binding * self.limit
        return binds and sample.queued <= headroom and projected < t.kv_target

    def _grow(self, sample: Sample, projected: float) -> Decision:
        """Multiplicative, tapered as KV nears its target, in slow start and whenever the
        server shows room; additive otherwise (near the knee)."""
        t = self.tuning
        headroom = t.headroom(sample.running)
        additive = math.ceil(headroom / 2)
        # Room: the server admits nearly all it is sent (a queue under half the one kept at
        # the knee), so the knee may be far above the limit, and an additive climb there
        # takes a step per missing request or two; the slow-start factor takes a few
        # (BENCHMARKS.md, "Regrowth after a cut"). Its overshoot is bounded: KV's taper
        # slows it near a full pool, and past the knee a queue builds, which ends it and is
        # trimmed.
        multiplicative = round(self.limit * t.growth * (1.0 - projected / t.kv_target))
        if self.slow_start:
            step = multiplicative
        elif 2 * sample.queued < headroom:
            step = max(additive, multiplicative)
        else:
            step = additive
        why = f"KV {sample.token_usage:.0%} < {t.kv_target:.0%}, queue {sample.queued}: grow"
        return self._change(self.limit + max(1, step), why, sample)

    def _change(self, target: int, why: str, sample: Sample) -> Decision:
        """Move to ``target`` (clamped); a decrease ends slow start; then hold."""
        previous, self.limit = self.limit, self.tuning.clamp(target)
        if self.limit == previous:
            return Decision(previous, previous)
        if self.limit < previous:
            self.slow_start = False
        self._hold = self.tuning.hold
        why += f" ({sample.gen_throughput:,.0f} tok/s)"
        return Decision(self.limit, previous, why)
