"""Adaptive concurrency against fixed levels, per simulator preset and workload shape.

    .venv/bin/python -m bench.adaptive [--presets fast,kimi-k2,kv-rich]
        [--workloads short-chat,long-reasoning,mixed-tools] [--levels 8,16,...]
        [--starts 8,1024] [--interval 5] [--round-trip-ms 50]

What it measures: decoded tokens per simulated second of the simulator's own SGLang scheduler
(`eaglegen.sim.scheduler`, the code behind `eaglegen sim`), driven in-process on a virtual
clock: each forward pass, picked and priced as the simulator's own (`eaglegen.sim.forward`,
the preset's step costs), advances the clock by its cost, so hours of server time take seconds
and the figures do not depend on the host. Requests come in the workload's shapes (prompt
length, a log-normal natural output length as the simulator draws it, max_new_tokens; prompts
share a system prompt per shape, for the radix cache). A closed-loop client keeps LIMIT
requests in flight; a finished request's slot is refilled after a round trip (`--round-trip-ms`,
the worker's response handling and next claim), so a server without a queue of its own idles
for that long. The limit is either fixed (the sweep, plus the real run's 150 and speculators'
default 64) or set every `--interval` simulated seconds by
`worker.concurrency.ConcurrencyController` from the same /metrics values the worker's
controller reads (running, queued, token usage, the retraction counter), started once low and
once high (`--starts`). Throughput is counted after the same warm-up for every policy, over the
same span. Prints a Markdown table: each adaptive start's tok/s and its ratio over the best
fixed level, fixed 150 and fixed 64.

What it leaves out: HTTP and the workers' own costs (bench.worker_throughput measures those),
and the time the workers take to see a new limit (a second or two against samples seconds
apart).
"""

from __future__ import annotations

import argparse
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from eaglegen.sim import preset
from eaglegen.sim.config import SimConfig
from eaglegen.sim.engine import Completion, Finish
from eaglegen.sim.forward import begin_pass, end_pass
from eaglegen.sim.scheduler import Job, Scheduler
from worker.concurrency import ConcurrencyController, Decision, Sample, Tuning


@dataclass(frozen=True)
class Shape:
    """One kind of request: prompt length, natural output lengths, max_new_tokens."""

    prompt_tokens: int
    mean_output: int
    sigma: float
    max_new_tokens: int
    weight: float = 1.0
    # Tokens of the prompt shared by every request of this shape (a system prompt).
    shared: int = 100


# Short chat (~200 prompt / ~300 output), long reasoning (~1k / ~3.5k, as in the real run) and
# tool calls: long tool schemas with short calls, some follow-ups, a few long reasoning turns.
WORKLOADS: dict[str, tuple[Shape, ...]] = {
    "short-chat": (Shape(200, 300, 0.6, 1024),),
    "long-reasoning": (Shape(1000, 3500, 0.5, 16_384, shared=300),),
    "mixed-tools": (
        Shape(1500, 150, 0.6, 1024, 0.5, shared=1200),
        Shape(600, 800, 0.7, 4096, 0.3, shared=400),
        Shape(1000, 3000, 0.6, 16_384, 0.2, shared=300),
    ),
}


@dataclass(frozen=True)
class Plan:
    """Simulated seconds: warm-up, measured span, and the controller's sampling interval."""

    warm_s: float
    span_s: float
    interval_s: float = 5.0


PLANS: dict[str, Plan] = {
    "fast": Plan(120.0, 600.0),
    "kimi-k2": Plan(900.0, 1800.0),
    "kv-rich": Plan(900.0, 1800.0),
}


@dataclass
class Result:
    """What one run measured."""

    tok_s: float
    retractions: int
    mean_running: float
    limits: list[int] = field(default_factory=list)

    @property
    def settled(self) -> int:
        """The limit at the end of the run."""
        return self.limits[-1]


# A policy sees each sample and returns the limit to enforce next.
Policy = Callable[[Sample], int]


def fixed(limit: int) -> Policy:
    """A limit that never changes."""
    return lambda _sample: limit


def adaptive(controller: ConcurrencyController) -> Policy:
    """The controller's limit after each sample."""

    def policy(sample: Sample) -> int:
        decision: Decision = controller.update(sample)
        return decision.limit

    return policy


class Workload:
    """Requests of a workload's shapes, in a seeded order, with distinct prompts and outputs."""

    def __init__(self, shapes: Sequence[Shape], seed: int) -> None:
        """Draw shapes by weight, and output lengths, from one seeded generator."""
        self.shapes = list(shapes)
        self._weights = [s.weight for s in shapes]
        self._rng = random.Random(seed)
        self._count = 0

    def job(self) -> Job:
        """The next request, its output known up front (the scheduler reveals it)."""
        shape = self._rng.choices(self.shapes, self._weights)[0]
        self._count += 1
        i = self._count
        head = [16 + (k * 13 + shape.shared) % 4000 for k in range(shape.shared)]
        own = [16 + (i * 7919 + k * 31) % 31_000 for k in range(shape.prompt_tokens - shape.shared)]
        n = self._output_length(shape)
        # Only lengths and distinctness matter to the scheduler (its cache matches ids).
        output = [16 + (i * 104_729 + k * 37) % 31_000 for k in range(n)]
        finish = Finish("length", length=n) if n == shape.max_new_tokens else Finish("stop")
        return Job([*head, *own], Completion(output, finish), shape.max_new_tokens)

    def _output_length(self, shape: Shape) -> int:
        """A natural output length, log-normal as the simulator draws it, cut at max_new."""
        mu = math.log(shape.mean_output) - shape.sigma**2 / 2
        natural = int(self._rng.lognormvariate(mu, shape.sigma))
        return max(2, min(natural, shape.max_new_tokens))


class VirtualServer:
    """A preset's scheduler on a virtual clock, kept at a limit by a closed-loop client."""

    def __init__(self, config: SimConfig, workload: Workload, round_trip_s: float) -> None:
        """An idle server and a client holding nothing."""
        self.config = config
        self.costs = config.step_costs()
        self.now = 0.0
        self.scheduler = Scheduler(config.scheduler_config(), clock=lambda: self.now)
        self.workload = workload
        self.round_trip_s = round_trip_s
        self.limit = 0
        # Requests holding a slot: in the scheduler, or on their way to it (due times).
        self.held = 0
        self._arrivals: deque[float] = deque()

    def set_limit(self, limit: int) -> None:
        """Enforce a new limit: more slots are taken at once, fewer as requests finish."""
        self.limit = limit
        self._top_up()

    def _top_up(self) -> None:
        """Take every free slot; the new requests reach the server a round trip later."""
        while self.held < self.limit:
            self.held += 1
            self._arrivals.append(self.now + self.round_trip_s)

    def run_until(self, end: float) -> None:
        """Advance the clock to ``end``, one forward pass at a time."""
        while self.now < end:
            self._deliver()
            if not self.scheduler.has_work():
                self.now = min(end, self._arrivals[0] if self._arrivals else end)
                continue
            self.now += self._one_round()

    def _deliver(self) -> None:
        """Submit the requests that have arrived."""
        while self._arrivals and self._arrivals[0] <= self.now:
            self._arrivals.popleft()
            self.scheduler.submit(self.workload.job())

    def _one_round(self) -> float:
        """One forward pass, picked and priced as the simulator's loop does
        (`eaglegen.sim.forward`); its duration."""
        forward = begin_pass(self.scheduler, self.costs)
        if forward.prefill is None and not forward.decoded:
            # Retractions only: their re-prefill comes next. Else nothing can move: as the
            # service, never spin.
            return 0.0 if forward.retracted else 0.001
        self._finished(len(end_pass(self.scheduler, forward)))
        return forward.seconds

    def _finished(self, n: int) -> None:
        """Finished requests give their slots back; the client refills them."""
        self.held -= n
        self._top_up()

    def sample(self, tokens_before: int, interval_s: float) -> Sample:
        """What /metrics says now, with the client's in-flight count."""
        s = self.scheduler
        return Sample(
            running=s.num_running,
            queued=s.num_waiting,
            token_usage=s.token_usage,
            max_total_tokens=s.kv_tokens,
            retracted_total=s.totals.retracted_requests,
            gen_throughput=(s.tokens_generated - tokens_before) / interval_s,
            in_flight=self.held,
        )


def run(
    preset_name: str,
    shapes: Sequence[Shape],
    policy: Policy,
    start: int,
    plan: Plan,
    seed: int = 0,
    round_trip_s: float = 0.05,
) -> Result:
    """One policy on a fresh server: tok/s over the plan's span after its warm-up."""
    server = VirtualServer(preset(preset_name), Workload(shapes, seed), round_trip_s)
    server.set_limit(start)
    limits, running = [start], []
    warm, total = round(plan.warm_s / plan.interval_s), round(plan.span_s / plan.interval_s)
    tokens = measured = retracted = 0
    for tick in range(1, warm + total + 1):
        server.run_until(tick * plan.interval_s)
        sample = server.sample(tokens, plan.interval_s)
        tokens = server.scheduler.tokens_generated
        if tick == warm:
            measured, retracted = tokens, server.scheduler.totals.retracted_requests
        elif tick > warm:
            running.append(sample.running)
        server.set_limit(policy(sample))
        limits.append(server.limit)
    totals = server.scheduler.totals
    return Result(
        tok_s=(server.scheduler.tokens_generated - measured) / plan.span_s,
        retractions=totals.retracted_requests - retracted,
        mean_running=sum(running) / max(1, len(running)),
        limits=limits,
    )


def run_adaptive(
    preset_name: str,
    shapes: Sequence[Shape],
    start: int,
    plan: Plan,
    seed: int = 0,
    round_trip_s: float = 0.05,
) -> Result:
    """The controller with its default tuning, from ``start``."""
    controller = ConcurrencyController(start, Tuning())
    policy = adaptive(controller)
    return run(preset_name, shapes, policy, controller.limit, plan, seed, round_trip_s)


def sweep(
    preset_name: str,
    shapes: Sequence[Shape],
    levels: Sequence[int],
    plan: Plan,
    round_trip_s: float = 0.05,
) -> dict[int, Result]:
    """Each fixed level on a fresh server."""
    return {
        level: run(preset_name, shapes, fixed(level), level, plan, 0, round_trip_s)
        for level in levels
    }


def _row(
    name: str, workload: str, label: str, result: Result, fixed_runs: dict[int, Result]
) -> str:
    """One table row: the adaptive run against the best fixed level, 150 and 64."""
    best_level = max(fixed_runs, key=lambda k: fixed_runs[k].tok_s)
    best = fixed_runs[best_level].tok_s
    return (
        f"| {name} | {workload} | {label} | {result.tok_s:,.0f} | {result.settled} | "
        f"{best:,.0f} @ {best_level} | {result.tok_s / best:.3f} | "
        f"{result.tok_s / fixed_runs[150].tok_s:.2f} | {result.tok_s / fixed_runs[64].tok_s:.2f} | "
        f"{result.retractions} / {fixed_runs[best_level].retractions} |"
    )


def main() -> None:
    """Run every preset and workload; print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--presets", default="fast,kimi-k2,kv-rich")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--levels", default="8,16,32,48,64,96,128,150,192,256,384,512,768,1024")
    parser.add_argument("--starts", default="8,1024")
    parser.add_argument("--interval", type=float, default=5.0, help="simulated s per sample")
    parser.add_argument("--round-trip-ms", type=float, default=50.0)
    args = parser.parse_args()
    trip = args.round_trip_ms / 1000
    levels = sorted({int(x) for x in args.levels.split(",")} | {64, 150})
    starts = [int(x) for x in args.starts.split(",")]
    print(
        "| preset | workload | adaptive from | tok/s | settled limit | best fixed (tok/s @ level) "
        "| ÷ best fixed | ÷ fixed 150 | ÷ fixed 64 | retractions (adaptive / best fixed) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.presets.split(","):
        for workload in args.workloads.split(","):
            shapes = WORKLOADS[workload]
            plan = replace(PLANS[name], interval_s=args.interval)
            fixed_runs = sweep(name, shapes, levels, plan, trip)
            for start in starts:
                result = run_adaptive(name, shapes, start, plan, 0, trip)
                print(_row(name, workload, str(start), result, fixed_runs), flush=True)


if __name__ == "__main__":
    main()
