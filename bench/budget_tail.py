"""The tail of a budget: tokens/s and mean in flight over its last part, per reserve policy.

Near its budget a dataset whose jobs each reserve their worst case (max_new_tokens) runs only
room / max_new_tokens of them at once, while its answers are far shorter: the server idles.
Under `reserve = "observed"` a job reserves the 99th percentile of the dataset's answers
once it has enough of them (docs/design.md §4, "Budget ledger"). This benchmark runs a
budgeted dataset to its end under each policy, alternating rounds in one run, end to end as
a user runs it: one `eaglegen worker` process (default settings) and one `eaglegen sim`
process over HTTP, both started here, the dataset enqueued through the producer.

The shape is the real run's divided by ten in tokens: the `kimi-k2` simulator (its step
costs and admission; `--time-scale` shrinks every step alike), answers log-normal with mean
300 tokens and sigma 0.6 (the preset's; the real run's answers average about 3,000),
max_new_tokens 1,640 (16,384), 48 requests in flight (the server's `max_inflight`: the real
run's 48 on a 159k-token pool), a 1M-token budget (10M). So the worst case crawls over the
last 48 x 1,640 = 79k tokens, 8% of the budget, as the real run's over its last 786k. Every
round enqueues the same prompts as a new run with the same order seed: the same jobs, in the
same order, get the same answers (the simulator's answer is a function of the prompt).

What is measured, per round, from the generations in Postgres: the tail starts at the
generation whose settled tokens reach (1 - X) of the budget and ends at the last one; tok/s
= completion tokens recorded after its start / its span; mean in flight = the time the
answers spent at the server (each generation's [created_at - e2e_latency, created_at])
overlapping the span, divided by it. Also the whole round's tok/s, the overshoot (used -
budget) and the reservation in force at the end.

Usage: python -m bench.budget_tail [--budget 1000000] [--tail 0.1] [--rounds 2]
    [--time-scale 0.1] [--in-flight 48] [--mean-output 300] [--max-new-tokens 1640]
Services: --database-url/--broker-url (default: this machine's Postgres and Redis; a scratch
database eaglegen_bench_budget and Redis db 11, flushed). The test suite flushes Redis dbs 1-15
of the Redis it is given: a test run against the same Redis meanwhile loses this round's
messages, and the round waits for the reconciler (give this one a Redis of its own then).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from sqlalchemy import Engine, select

from bench.common import scratch_database, scratch_redis, write_short_prompts
from bench.procs import cpu_seconds, eaglegen_command
from bench.worker_throughput import _announced_url, _stop, eaglegen_worker
from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR
from models.db import make_engine
from models.ledger import ReservePolicy
from models.schema import Dataset, Generation, Run
from producer.commands import run_enqueue
from producer.plan import DatasetPlan, RunPlan

PG = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS = "redis://127.0.0.1:6379/0"
DATABASE = "eaglegen_bench_budget"
REDIS_DB = 11
QUEUE = "bench-budget"
ORDER_SEED = 1  # every round runs the same jobs in the same order


@dataclass(frozen=True)
class Round:
    """What one round measured."""

    policy: ReservePolicy
    tail_tok_s: float
    tail_in_flight: float
    tail_s: float
    round_tok_s: float
    round_in_flight: float
    generations: int
    overshoot: int
    reserve_at_end: int

    def line(self) -> str:
        """A one-line summary."""
        return (
            f"{self.policy.value:10} tail {self.tail_tok_s:,.0f} tok/s, "
            f"{self.tail_in_flight:.1f} in flight over {self.tail_s:.1f} s; round "
            f"{self.round_tok_s:,.0f} tok/s, {self.round_in_flight:.1f} in flight, "
            f"{self.generations:,} answers; overshoot {self.overshoot:,}; "
            f"reserving {self.reserve_at_end:,} at the end"
        )


@contextmanager
def sim_process(
    args: argparse.Namespace, log: Path
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`eaglegen sim --preset kimi-k2` scaled, on a free port; (process, url) once it listens."""
    command = [
        *eaglegen_command(),
        *("sim", "--preset", "kimi-k2", "--port", "0", "--time-scale", str(args.time_scale)),
        *("--mean-output-tokens", str(args.mean_output)),
        *("--max-output-tokens", str(args.max_new_tokens)),
    ]
    env = {**os.environ, "COLUMNS": "200"}
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            yield process, _announced_url(process, log)
        finally:
            _stop(process)


@contextmanager
def worker_process(
    settings: Settings, sim_url: str, in_flight: int, log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """`eaglegen worker` with its default settings, the simulator as its one server, held
    at ``in_flight`` requests (the server's `max_inflight`, as a user sets it)."""
    servers = [{"name": "sim", "url": sim_url, "max_inflight": in_flight}]
    with eaglegen_worker(settings, servers, log) as process:
        yield process


def enqueue(
    settings: Settings, path: Path, run: str, policy: ReservePolicy, args: argparse.Namespace
) -> None:
    """Enqueue the prompts as run ``run``: one dataset with the budget and the policy."""
    dataset = DatasetPlan(
        "d",
        path,
        sampling={"max_new_tokens": args.max_new_tokens},
        budget_tokens=args.budget,
        reserve=policy,
    )
    plan = RunPlan(run=run, tokenizer=TOKENIZER_DIR, datasets=[dataset], order_seed=ORDER_SEED)
    run_enqueue(settings, settings.services(), plan, quiet=True)


def wait_finished(engine: Engine, run: str, timeout_s: float) -> int:
    """Wait until the run's dataset has nothing queued or running; its id."""
    stmt = (
        select(Dataset.id, Dataset.jobs_queued + Dataset.jobs_running)
        .join(Run, Run.id == Dataset.run_id)
        .where(Run.name == run)
    )
    deadline = time.monotonic() + timeout_s
    while True:
        with engine.connect() as conn:
            dataset_id, left = conn.execute(stmt).one()
        if left == 0:
            return int(dataset_id)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{run}: {left} jobs still queued or running after {timeout_s} s")
        time.sleep(0.5)


def measure(engine: Engine, dataset_id: int, policy: ReservePolicy, tail: float) -> Round:
    """The round's figures from its generations and its ledger."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(Generation.created_at, Generation.e2e_latency, Generation.completion_tokens)
            .where(Generation.dataset_id == dataset_id)
            .order_by(Generation.created_at)
        ).all()
        budget, used, reserve, max_new = conn.execute(
            select(
                Dataset.budget_tokens,
                Dataset.used_tokens,
                Dataset.observed_reserve_tokens,
                Dataset.sampling_params["max_new_tokens"].as_integer(),
            ).where(Dataset.id == dataset_id)
        ).one()
    answers = [(t.timestamp(), float(e2e), int(n)) for t, e2e, n in rows]
    start = _crossing(answers, (1 - tail) * budget)
    end = answers[-1][0]
    first = min(t - e2e for t, e2e, _ in answers)
    tail_tokens = sum(n for t, _, n in answers if t > start)
    held = policy is ReservePolicy.OBSERVED and reserve is not None
    return Round(
        policy=policy,
        tail_tok_s=tail_tokens / (end - start),
        tail_in_flight=_in_flight(answers, start, end),
        tail_s=end - start,
        round_tok_s=used / (end - first),
        round_in_flight=_in_flight(answers, first, end),
        generations=len(answers),
        overshoot=int(used) - int(budget),
        reserve_at_end=int(reserve) if held else int(max_new),
    )


def _crossing(answers: list[tuple[float, float, int]], tokens: float) -> float:
    """When the recorded tokens first reach ``tokens``."""
    total = 0
    for t, _, n in answers:
        total += n
        if total >= tokens:
            return t
    raise RuntimeError(f"the answers add up to {total}, never {tokens:.0f}")


def _in_flight(answers: list[tuple[float, float, int]], start: float, end: float) -> float:
    """Mean requests at the server over [start, end]: the answers' time there, overlapping."""
    busy = sum(max(0.0, min(t, end) - max(t - e2e, start)) for t, e2e, _ in answers)
    return busy / (end - start)


def benchmark(args: argparse.Namespace) -> list[Round]:
    """Start the simulator and the worker, then alternate the policies round by round."""
    database = scratch_database(args.database_url, DATABASE)
    settings = Settings(
        database_url=database, broker_url=scratch_redis(args.broker_url, REDIS_DB), queue=QUEUE
    )
    engine = make_engine(database, pool_size=2)
    logs = Path(tempfile.mkdtemp(prefix="eaglegen-bench-budget-"))
    print(f"logs in {logs}", flush=True)
    # Twice the prompts the budget takes at the mean answer: the budget binds, never the file.
    prompts = write_short_prompts(logs / "prompts.jsonl", 2 * args.budget // args.mean_output)
    results: list[Round] = []
    with (
        sim_process(args, logs / "sim.log") as (sim, url),
        worker_process(settings, url, args.in_flight, logs / "worker.log") as worker,
    ):
        for i in range(args.rounds):
            for policy in (ReservePolicy.WORST_CASE, ReservePolicy.OBSERVED):
                httpx.post(f"{url}/flush_cache", timeout=10).raise_for_status()
                run = f"{policy.value}-{i}"
                cpu = {"sim": cpu_seconds(sim.pid), "worker": cpu_seconds(worker.pid)}
                began = time.monotonic()
                enqueue(settings, prompts, run, policy, args)
                dataset_id = wait_finished(engine, run, args.timeout)
                results.append(measure(engine, dataset_id, policy, args.tail))
                took = time.monotonic() - began
                busy = {
                    k: (cpu_seconds(p.pid) - cpu[k]) / took
                    for k, p in (("sim", sim), ("worker", worker))
                }
                print(
                    f"{results[-1].line()} ({took:.0f} s; cpu: sim {busy['sim']:.0%}, "
                    f"worker {busy['worker']:.0%})",
                    flush=True,
                )
    engine.dispose()
    return results


def report(results: list[Round], tail: float) -> None:
    """Medians per policy and the ratios observed / worst case, with each pair's."""
    medians: dict[ReservePolicy, tuple[float, float]] = {}
    for policy in ReservePolicy:
        rounds = [r for r in results if r.policy is policy]
        medians[policy] = (
            statistics.median(r.tail_tok_s for r in rounds),
            statistics.median(r.tail_in_flight for r in rounds),
        )
        print(
            f"{policy.value:10} last {tail:.0%} of the budget: median {medians[policy][0]:,.0f} "
            f"tok/s, {medians[policy][1]:.1f} in flight; overshoots "
            f"{[r.overshoot for r in rounds]}"
        )
    worst, observed = medians[ReservePolicy.WORST_CASE], medians[ReservePolicy.OBSERVED]
    pairs = zip(results[::2], results[1::2], strict=True)
    per_round = ", ".join(f"{o.tail_tok_s / w.tail_tok_s:.2f}" for w, o in pairs)
    print(
        f"observed / worst_case over the last {tail:.0%}: tok/s {observed[0] / worst[0]:.2f} "
        f"(per pair: {per_round}), in flight {observed[1] / worst[1]:.2f}"
    )


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget", type=int, default=1_000_000)
    parser.add_argument("--tail", type=float, default=0.1, help="the last part measured")
    parser.add_argument("--rounds", type=int, default=2, help="worst_case+observed pairs")
    parser.add_argument("--time-scale", type=float, default=0.1, help="the simulator's")
    parser.add_argument("--in-flight", type=int, default=48, help="the server's max_inflight")
    parser.add_argument("--mean-output", type=int, default=300, help="mean answer, tokens")
    parser.add_argument("--max-new-tokens", type=int, default=1640)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per round")
    parser.add_argument("--database-url", default=PG)
    parser.add_argument("--broker-url", default=REDIS)
    args = parser.parse_args()
    print(
        f"budget {args.budget:,} tokens, max_new_tokens {args.max_new_tokens:,}, answers "
        f"~{args.mean_output} tokens, {args.in_flight} in flight, kimi-k2 x {args.time_scale}",
        flush=True,
    )
    report(benchmark(args), args.tail)


if __name__ == "__main__":
    main()
