"""Adaptive concurrency against fixed levels, end to end (issue 32): real `eaglegen worker`
processes against `eaglegen sim --preset P --time-scale S` over HTTP, default settings.

    .venv/bin/python -m bench.adaptive_e2e [--presets fast,kimi-k2,kv-rich] [--rounds 1]
        [--jobs-factor 1.0] [--time-scale PRESET=SCALE ...] [--knee PRESET=LEVEL ...]
        [--adaptive-only] [--engine celery|loop]

What `bench.adaptive` measures on a virtual clock in-process, measured as a user runs it.
Per preset (its plan in `PLANS`: jobs, max_new_tokens, time scale, and the knee of
BENCHMARKS.md, "Simulator: the knee, per preset"), each run enqueues the same short chat
prompts as a new run with the same order seed (the same jobs, published in the same order,
get the same answers: the simulator's answer is a function of the prompt) and waits until
none is queued or running. The runs of a preset:

- fixed LEVEL, for knee/2, knee, 2 x knee and 4 x knee: the worker with
  ``EAGLEGEN_ADAPTIVE_CONCURRENCY=false`` and the server's ``max_inflight`` = LEVEL in
  ``EAGLEGEN_SERVERS`` (so LEVEL threads);
- adaptive: the worker with default settings (no ``--concurrency``; adaptive concurrency on,
  starting at ``server_max_inflight``, the controller's default interval).

Each run starts a fresh simulator and a fresh worker on an emptied Redis db, so every run
starts from the same state: an empty server, no stored limit. Rounds alternate the order of
the runs (adaptive first, then the levels up; then the levels down, then adaptive).

Per run:

- tok/s: completion tokens / wall, wall from the first request sent (the earliest
  ``created_at - e2e_latency`` of the run's generations) to the last finished (the latest
  ``created_at``);
- in flight: the mean of the simulator's running + waiting requests over that span (its
  /metrics read every 0.5 s);
- limit (adaptive): the stored limit (``core.limits``) sampled every 0.5 s: its value at the
  end, its lowest and highest; settle: seconds from the first request to the first sample
  after which it stays within 10% of its value at the end;
- pace: the simulator's engine seconds x time scale / the wall (1.0: the host kept up with
  the scaled clock; below: the simulator itself was CPU-bound, or idle within the span);
- retractions: the simulator's own count.

With ``--adaptive-only``, the adaptive runs alone: what the limit did and its time to settle,
for work on the controller (no ratio: nothing fixed ran beside it; the worker logs in the
logs folder say why the limit moved).

Prints a line per run, then a Markdown table per preset: each level's tok/s (the knee: the
smallest level within 3% of the best), adaptive's, adaptive ÷ best fixed (goal >= 0.95) and
the settle time.

Services: --database-url/--broker-url (default: this machine's Postgres and Redis; a scratch
database eaglegen_bench_adaptive_e2e and Redis db 13, flushed before each run). The test
suite flushes dbs 1-15 of the Redis it is given: while tests run against the same Redis,
give this one a Redis of its own (``redis-server --port 6413``, then ``--broker-url
redis://127.0.0.1:6413/0``). A run whose db was flushed meanwhile is marked (its sentinel
key is gone) and the figures are declared not valid.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis
from sqlalchemy import text

from bench.common import scratch_database, scratch_redis, wait_run_done, write_short_prompts
from bench.worker_stalls import _SPAN, SERVER, Reading, Sampler, sim_process
from bench.worker_throughput import eaglegen_worker, enqueue
from core.settings import Settings
from models.db import make_engine
from models.repository import Repository

PG = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS = "redis://127.0.0.1:6379/0"
DATABASE = "eaglegen_bench_adaptive_e2e"
REDIS_DB = 13
QUEUE = "bench-adaptive-e2e"
SENTINEL = "bench-adaptive-e2e:sentinel"
GOAL = 0.95
# The knee: the smallest fixed level within this share of the best tok/s (bench.sim_curve's).
KNEE = 0.97
# Settled: the limit within this share of its value at the end, from then on.
SETTLE_BAND = 0.10
SAMPLE_S = 0.5
ORDER_SEED = 0
_TOKENS = text("""
SELECT coalesce(sum(g.completion_tokens), 0)
FROM generations g JOIN jobs j ON j.id = g.job_id
JOIN datasets d ON d.id = j.dataset_id JOIN runs r ON r.id = d.run_id
WHERE r.name = :run
""")


@dataclass(frozen=True)
class Plan:
    """One preset's runs: its knee (BENCHMARKS.md), jobs, max_new_tokens, time scale."""

    knee: int
    jobs: int
    max_new_tokens: int
    time_scale: float

    @property
    def levels(self) -> list[int]:
        """The fixed sweep around the knee."""
        return [self.knee // 2, self.knee, 2 * self.knee, 4 * self.knee]


# max_new_tokens 4,096: the Kimi presets' answers (their mean_output_tokens) fill the KV pool
# as in the real run, and `fast` reserves the whole max_new_tokens at admission. The prompts are
# tens of tokens, not sim_curve's 1,000, so a knee may sit a level to the right of the one
# given here: the sweep shows where. Jobs and time scale make each run a few minutes of wall
# time and the whole bench under an hour (BENCHMARKS.md has the figures).
PLANS: dict[str, Plan] = {
    "fast": Plan(knee=32, jobs=3000, max_new_tokens=4096, time_scale=0.5),
    "kimi-k2": Plan(knee=64, jobs=650, max_new_tokens=4096, time_scale=0.1),
    "kv-rich": Plan(knee=256, jobs=900, max_new_tokens=4096, time_scale=0.1),
}


@dataclass
class Run:
    """What one run measured."""

    preset: str
    mode: str  # "adaptive" or the fixed level
    round: int
    jobs: int
    done: int
    tokens: int
    wall_s: float
    mean_in_flight: float
    pace: float
    retractions: int
    limit_end: int | None
    limit_low: int | None
    limit_high: int | None
    settle_s: float | None
    flushed: bool  # the Redis db was flushed by another process meanwhile
    finished: bool

    @property
    def tok_s(self) -> float:
        """Completion tokens per second of wall, first request to last."""
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def line(self) -> str:
        """One line per run, as it ends."""
        limit = (
            ""
            if self.limit_end is None
            else f", limit {self.limit_end} ({self.limit_low}-{self.limit_high}), settled "
            f"after {self.settle_s:.1f} s"
        )
        return (
            f"round {self.round} {self.preset:8} {self.mode:>8}: {self.done}/{self.jobs} done"
            f"{'' if self.finished else ' (TIMED OUT)'}"
            f"{' (REDIS FLUSHED BY ANOTHER PROCESS)' if self.flushed else ''}, "
            f"{self.tokens:,} tokens in {self.wall_s:.1f} s: {self.tok_s:,.0f} tok/s, mean in "
            f"flight {self.mean_in_flight:.0f}, pace {self.pace:.2f}, "
            f"retractions {self.retractions}{limit}"
        )


def settle_time(limits: Sequence[tuple[float, int]], start: float) -> float | None:
    """Seconds from ``start`` to the first sample after which the limit stays within
    ``SETTLE_BAND`` of its last value; None without samples."""
    if not limits:
        return None
    final = limits[-1][1]
    settled_at = limits[-1][0]
    for at, limit in reversed(limits):
        if abs(limit - final) > SETTLE_BAND * final:
            break
        settled_at = at
    return max(0.0, settled_at - start)


@contextmanager
def worker_process(
    settings: Settings, sim_url: str, level: int | None, log: Path, engine: str | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`eaglegen worker` with default settings but the services and the simulator; with a
    ``level``, adaptive concurrency off and the server's ``max_inflight`` at it."""
    server: dict[str, object] = {"name": SERVER, "url": sim_url}
    env = {} if engine is None else {"EAGLEGEN_WORKER_ENGINE": engine}
    if level is not None:
        server["max_inflight"] = level
        env["EAGLEGEN_ADAPTIVE_CONCURRENCY"] = "false"
    with eaglegen_worker(settings, [server], log, env) as process:
        yield process


def one_run(
    args: argparse.Namespace,
    database: str,
    preset: str,
    plan: Plan,
    level: int | None,
    prompts: Path,
    logs: Path,
    round_: int,
    index: int,
) -> Run:
    """A fresh simulator and worker, a new run enqueued and waited for; what was measured."""
    settings = Settings(
        database_url=database,
        broker_url=scratch_redis(args.broker_url, REDIS_DB),
        queue=QUEUE,
        data_dir=logs,
    )
    assert settings.broker_url
    mode = "adaptive" if level is None else str(level)
    run = f"r{index}-{preset}-{mode}"
    client = redis.Redis.from_url(settings.broker_url)
    client.set(SENTINEL, run)
    repo = Repository(make_engine(database, pool_size=2))
    sim_args = ["--preset", preset, "--time-scale", str(plan.time_scale)]
    worker_log = logs / f"worker-{run}.log"
    with sim_process(sim_args, logs / f"sim-{run}.log") as url:
        with (
            worker_process(settings, url, level, worker_log, args.engine) as worker,
            Sampler(url, settings.broker_url, [worker.pid], SAMPLE_S) as sampler,
        ):
            enqueue(settings, prompts, run, plan.max_new_tokens, ORDER_SEED)
            finished = wait_run_done(repo, run, args.timeout_s, every_s=0.5)
        stats = httpx.get(f"{url}/sim/stats", timeout=10).json()["scheduler"]
    flushed = client.get(SENTINEL) is None
    client.close()
    with repo.engine.connect() as conn:
        done, first, last = conn.execute(_SPAN, {"run": run}).one()
        tokens = int(conn.scalar(_TOKENS, {"run": run}) or 0)
    repo.engine.dispose()
    first, last = (float(first), float(last)) if done else (0.0, 0.0)
    return measured(
        preset,
        mode,
        round_,
        plan,
        args,
        sampler.readings,
        stats,
        flushed,
        finished,
        done=int(done),
        tokens=tokens,
        first=first,
        last=last,
    )


def measured(
    preset: str,
    mode: str,
    round_: int,
    plan: Plan,
    args: argparse.Namespace,
    readings: Sequence[Reading],
    stats: dict[str, float],
    flushed: bool,
    finished: bool,
    *,
    done: int,
    tokens: int,
    first: float,
    last: float,
) -> Run:
    """The run's figures from its readings, the simulator's counters and its span."""
    within = [r for r in readings if first <= r.at <= last]
    wall = last - first
    default = Settings().server_max_inflight  # what workers enforce while none is stored
    limits = [(r.at, default if r.limit is None else r.limit) for r in within]
    adaptive = mode == "adaptive"
    return Run(
        preset=preset,
        mode=mode,
        round=round_,
        jobs=plan_jobs(plan, args),
        done=done,
        tokens=tokens,
        wall_s=wall,
        mean_in_flight=sum(r.in_flight for r in within) / max(1, len(within)),
        pace=float(stats["sim_seconds"]) * plan.time_scale / (last - first)
        if last > first
        else 0.0,
        retractions=int(stats["retracted_requests"]),
        limit_end=limits[-1][1] if adaptive and limits else None,
        limit_low=min(v for _, v in limits) if adaptive and limits else None,
        limit_high=max(v for _, v in limits) if adaptive and limits else None,
        settle_s=settle_time(limits, first) if adaptive else None,
        flushed=flushed,
        finished=finished,
    )


def fellows(runs: Sequence[Run], adaptive: Run) -> list[Run]:
    """The fixed runs of an adaptive run's preset and round."""
    return [
        r
        for r in runs
        if r.preset == adaptive.preset and r.round == adaptive.round and r.mode != "adaptive"
    ]


def _ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.3f}" if denominator else "-"


def report(runs: Sequence[Run], plans: dict[str, Plan]) -> None:
    """Per preset: tok/s per level and adaptive's (summed over rounds: tokens ÷ wall), the
    knee, adaptive ÷ best fixed (overall and per round), the limit and its settle time."""
    levels = max(len(plan.levels) for plan in plans.values())
    print(
        "| preset (time scale, jobs) | "
        + " | ".join(f"fixed {chr(65 + i)}" for i in range(levels))
        + " | adaptive | adaptive ÷ best fixed | limit at end (range) | settle s |"
    )
    print("|---|" + "---:|" * levels + "---:|---:|---|---:|")
    for preset, plan in plans.items():
        mine = [r for r in runs if r.preset == preset]
        if not mine:
            continue
        tok_s = {
            mode: sum(r.tokens for r in of) / sum(r.wall_s for r in of)
            for mode in [*map(str, plan.levels), "adaptive"]
            if (of := [r for r in mine if r.mode == mode])
        }
        fixed = {int(m): v for m, v in tok_s.items() if m != "adaptive"}
        best = max(fixed.values(), default=0.0)
        knee = min((lv for lv, v in fixed.items() if v >= KNEE * best), default=0)
        adaptive = [r for r in mine if r.mode == "adaptive"]
        per_round = [
            _ratio(a.tok_s, max((r.tok_s for r in fellows(mine, a)), default=0.0)) for a in adaptive
        ]
        cells = [
            f"{lv}: {fixed[lv]:,.0f}{' (knee)' if lv == knee else ''}" if lv in fixed else "-"
            for lv in plan.levels
        ]
        limit = ", ".join(f"{a.limit_end} ({a.limit_low}-{a.limit_high})" for a in adaptive)
        settle = ", ".join("-" if a.settle_s is None else f"{a.settle_s:.0f}" for a in adaptive)
        print(
            f"| {preset} ({plan.time_scale:g}, {mine[0].jobs:,}) | "
            + " | ".join(cells)
            + f" | {tok_s.get('adaptive', 0):,.0f} | {_ratio(tok_s.get('adaptive', 0), best)}"
            + (f" (rounds: {', '.join(per_round)})" if len(per_round) > 1 else "")
            + f" | {limit} | {settle} |"
        )
    ratios = [
        a.tok_s / max(r.tok_s for r in beside)
        for a in runs
        if a.mode == "adaptive" and (beside := fellows(runs, a))
    ]
    if ratios:
        print(f"lowest adaptive ÷ best fixed of a round: {min(ratios):.3f} (goal >= {GOAL})")
    if any(r.flushed or not r.finished for r in runs):
        print("NOT VALID: a run timed out or had its Redis db flushed by another process")


def benchmark(args: argparse.Namespace, plans: dict[str, Plan]) -> list[Run]:
    """Each round, each preset, its runs in the round's order."""
    database = scratch_database(args.database_url, DATABASE)
    logs = Path(tempfile.mkdtemp(prefix="eaglegen-bench-adaptive-e2e-"))
    print(f"logs in {logs}", flush=True)
    runs: list[Run] = []
    index = 0
    for round_ in range(args.rounds):
        for preset, plan in plans.items():
            prompts = write_short_prompts(logs / f"prompts-{preset}.jsonl", plan_jobs(plan, args))
            order: list[int | None] = [None] if args.adaptive_only else [None, *plan.levels]
            for level in order if round_ % 2 == 0 else order[::-1]:
                index += 1
                run = one_run(args, database, preset, plan, level, prompts, logs, round_, index)
                print(run.line(), flush=True)
                runs.append(run)
    return runs


def plan_jobs(plan: Plan, args: argparse.Namespace) -> int:
    """The preset's job count, scaled by --jobs-factor."""
    return max(1, int(plan.jobs * args.jobs_factor))


def _per_preset(values: Sequence[str]) -> dict[str, str]:
    return dict(v.split("=", 1) for v in values)


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", default=",".join(PLANS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--jobs-factor", type=float, default=1.0, help="scale every preset's job count"
    )
    parser.add_argument("--time-scale", action="append", default=[], help="PRESET=SCALE (repeat)")
    parser.add_argument(
        "--knee", action="append", default=[], help="PRESET=LEVEL: sweep around it (repeat)"
    )
    parser.add_argument(
        "--adaptive-only", action="store_true", help="no fixed levels: the limit's path alone"
    )
    parser.add_argument(
        "--engine",
        choices=["celery", "loop"],
        help="the workers' engine (EAGLEGEN_WORKER_ENGINE; default: the worker's default)",
    )
    parser.add_argument("--timeout-s", type=float, default=1200.0)
    parser.add_argument("--database-url", default=PG)
    parser.add_argument("--broker-url", default=REDIS)
    args = parser.parse_args()
    plans = {name: PLANS[name] for name in args.presets.split(",")}
    for name, scale in _per_preset(args.time_scale).items():
        plans[name] = Plan(**{**plans[name].__dict__, "time_scale": float(scale)})
    for name, knee in _per_preset(args.knee).items():
        plans[name] = Plan(**{**plans[name].__dict__, "knee": int(knee)})
    for name, plan in plans.items():
        print(
            f"{name}: {plan_jobs(plan, args):,} jobs of at most {plan.max_new_tokens:,} new "
            f"tokens, time scale {plan.time_scale:g}, "
            + (
                "adaptive only"
                if args.adaptive_only
                else f"fixed {', '.join(map(str, plan.levels))} and adaptive"
            ),
            flush=True,
        )
    started = time.monotonic()
    runs = benchmark(args, plans)
    report(runs, plans)
    print(f"bench wall time: {(time.monotonic() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
