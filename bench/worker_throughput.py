"""Worker throughput benchmark (issue 4).

One `eaglegen worker` process (threads pool) against one `eaglegen sim` process, compared in
the same run with a bare asyncio httpx client sending the same input_ids with the same
sampling params at the same concurrency to the same simulator. Rounds alternate bare,
pipeline, bare, pipeline (--rounds 2); medians are reported.

tok/s = completion tokens / wall time from the first to the last finished request (pipeline:
generations.created_at in Postgres; bare: response times). The simulator's output is
deterministic per prompt, so both sides generate the same tokens. Peak in flight = the
largest num_running_reqs + num_queue_reqs seen on the simulator's /metrics every 0.2 s.
The bare client sends a request again after a transport error (the server closing a
keep-alive connection as it is reused) and says how often it did.

With --ceiling (issue 14, the orchestration ceiling): 4,000 jobs of 4 new tokens at 64 in
flight on a simulator with no decode time, so that neither side waits on the server: the
ratio is what one worker process can orchestrate against what a bare client can send
(goal >= 0.6; the goal of the realistic default shape is >= 0.97). Each round reports the
worker's CPU seconds; divided by the jobs, its CPU per job.

Usage: python -m bench.worker_throughput [--jobs 3000] [--concurrency 600] [--ceiling]
Services: --database-url/--broker-url (default: this machine's Postgres and Redis; a scratch
database eaglegen_bench_worker and Redis db 10, flushed).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import httpx
from sqlalchemy import select, text

from bench.common import scratch_database, scratch_redis, wait_run_done, write_short_prompts
from bench.procs import cpu_seconds, machine_busy_s
from core import heartbeat
from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR
from eaglegen.sim.metrics import parse
from models.db import make_engine
from models.repository import Repository
from models.schema import Dataset, Job
from producer.commands import run_enqueue
from producer.plan import DatasetPlan, RunPlan

PG = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS = "redis://127.0.0.1:6379/0"
DATABASE = "eaglegen_bench_worker"
REDIS_DB = 10
QUEUE = "bench-worker"
_GENERATED = text("""
SELECT count(*), coalesce(sum(g.completion_tokens), 0),
       extract(epoch FROM min(g.created_at)), extract(epoch FROM max(g.created_at))
FROM generations g JOIN jobs j ON j.id = g.job_id
JOIN datasets d ON d.id = j.dataset_id JOIN runs r ON r.id = d.run_id
WHERE r.name = :run
""")


@dataclass(frozen=True)
class Measurement:
    """One round: requests finished, tokens, first-to-last seconds, span and peak in flight."""

    kind: str
    requests: int
    tokens: int
    seconds: float  # first to last finished request
    span_s: float  # from the start of the round to the last finished request
    peak_in_flight: int
    cpu_s: dict[str, float]

    @property
    def tok_s(self) -> float:
        """Completion tokens per second, first to last finished request."""
        return self.tokens / self.seconds

    def line(self) -> str:
        """A one-line summary."""
        cpu = ", ".join(f"{k} {v:.1f}" for k, v in self.cpu_s.items())
        cores = os.cpu_count() or 1
        return (
            f"{self.kind:8} {self.requests:,} requests, {self.tokens:,} tokens, "
            f"{self.tok_s:,.0f} tok/s ({self.seconds:.2f} s first->last, "
            f"{self.tokens / self.span_s:,.0f} tok/s over {self.span_s:.2f} s from start), "
            f"peak in flight {self.peak_in_flight}; cpu s: {cpu} "
            f"(machine {self.cpu_s.get('machine', 0) / self.span_s / cores:.0%} of {cores} cores)"
        )


class InFlightSampler:
    """Samples the simulator's running + waiting requests every 0.2 s on a thread."""

    def __init__(self, sim_url: str, interval_s: float = 0.2) -> None:
        self.samples: list[int] = []
        self._url = f"{sim_url}/metrics"
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(self._interval):
                self.samples.append(in_flight(client.get(self._url).text))

    @property
    def peak(self) -> int:
        """The largest sample."""
        return max(self.samples, default=0)


def in_flight(metrics: str) -> int:
    """Running plus waiting requests in a /metrics text (whatever the labels)."""
    names = ("sglang:num_running_reqs{", "sglang:num_queue_reqs{")
    return int(sum(v for k, v in parse(metrics).items() if k.startswith(names)))


@contextmanager
def sim_process(
    args: argparse.Namespace, log: Path, server: Sequence[str] | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`eaglegen sim` on a free port, logging to ``log``; (process, url) once it listens.
    ``server``: the simulator's server flags, by default a big KV pool with ``args``' decode
    timing."""
    if server is None:
        server = (
            *("--kv-tokens", str(args.kv_tokens), "--max-running-requests", "4096"),
            *("--decode-step-ms", str(args.decode_step_ms)),
            *("--decode-ms-per-request", str(args.decode_ms_per_request)),
        )
    command = [
        *(sys.executable, "-m", "eaglegen", "sim", "--port", "0"),
        *server,
        *("--stream-interval", str(args.stream_interval)),
        *(("--incremental-streaming-output",) if args.incremental else ()),
    ]
    env = {**os.environ, "COLUMNS": "200"}  # one line per message in the log
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            yield process, _announced_url(process, log)
        finally:
            _stop(process)


def _announced_url(process: subprocess.Popen[bytes], log: Path) -> str:
    """The URL from the simulator's "listening on" line."""
    deadline = time.monotonic() + 60
    while process.poll() is None and time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if "listening on" in line:
                return line.rsplit(" ", 1)[1].strip()
        time.sleep(0.1)
    raise RuntimeError(f"simulator did not start: {log.read_text()[-2000:]}")


@contextmanager
def eaglegen_worker(
    settings: Settings,
    servers: list[dict[str, Any]],
    log: Path,
    env: dict[str, str] | None = None,
    args: Sequence[str] = (),
    code: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """`eaglegen worker ARGS` with no EAGLEGEN_ setting of this process's, only the services,
    ``servers`` (EAGLEGEN_SERVERS) and ``env``, logging to ``log``; from the checkout
    ``code`` (default: this one); stopped (SIGTERM) when the block ends."""
    assert settings.database_url and settings.broker_url
    environ = {k: v for k, v in os.environ.items() if not k.startswith("EAGLEGEN_")}
    environ |= {
        "COLUMNS": "200",
        "EAGLEGEN_DATABASE_URL": settings.database_url,
        "EAGLEGEN_BROKER_URL": settings.broker_url,
        "EAGLEGEN_QUEUE": settings.queue,
        "EAGLEGEN_SERVERS": json.dumps(servers),
        "EAGLEGEN_DATA_DIR": str(log.parent),
        **(env or {}),
    }
    if code is not None:
        environ["PYTHONPATH"] = str(code.resolve())
    command = [sys.executable, "-m", "eaglegen", "worker", *args]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, env=environ, stdout=out, stderr=subprocess.STDOUT, cwd=code
        )
        try:
            _wait_heartbeat(settings.broker_url, process)
            yield process
        finally:
            _stop(process)


@contextmanager
def worker_process(
    settings: Settings,
    sim_url: str,
    concurrency: int,
    log: Path,
    stream: bool = False,
    threads: int | None = None,
    engine: str = Settings.model_fields["worker_engine"].default,
) -> Iterator[subprocess.Popen[bytes]]:
    """`eaglegen worker --concurrency N` with an in-flight limit of N on the simulator
    (asking for streamed answers with ``stream``); ``threads``: fewer threads than N, for
    one of several processes sharing the limit; ``engine``: EAGLEGEN_WORKER_ENGINE, set
    whatever the caller's environment says."""
    env = {
        "EAGLEGEN_WORKER_ENGINE": engine,
        "EAGLEGEN_SERVER_MAX_INFLIGHT": str(concurrency),
        # The same concurrency as the bare client, held: this compares the pipeline's cost.
        "EAGLEGEN_ADAPTIVE_CONCURRENCY": "false",
        "EAGLEGEN_STREAM": "true" if stream else "false",
    }
    servers = [{"name": "sim", "url": sim_url}]
    argv = ["--concurrency", str(threads or concurrency)]
    with eaglegen_worker(settings, servers, log, env, argv) as w:
        yield w


def _wait_heartbeat(broker_url: str, process: subprocess.Popen[bytes]) -> None:
    """Block until the worker process has written its heartbeat."""
    deadline = time.monotonic() + 60
    while not any(b.pid == process.pid for b in heartbeat.alive(broker_url, None, 30)):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("worker did not start; see its log")
        time.sleep(0.1)


def _stop(process: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def enqueue(
    settings: Settings,
    path: Path,
    run: str,
    max_new_tokens: int,
    order_seed: int | None = None,
) -> None:
    """Enqueue every prompt of ``path`` as run ``run`` (in the order ``order_seed`` gives,
    the same every time; default: a new run draws one)."""
    plan = RunPlan(
        run=run,
        tokenizer=TOKENIZER_DIR,
        datasets=[DatasetPlan("d", path, sampling={"max_new_tokens": max_new_tokens})],
        order_seed=order_seed,
    )
    run_enqueue(settings, settings.services(), plan, quiet=True)


def take_prompts(repo: Repository) -> tuple[list[list[int]], dict[str, Any]]:
    """The input_ids of every job (of the one run enqueued so far), in the order the feeder
    publishes them, and their sampling params; then that run deleted, so that no reconciler
    ever publishes it to the worker."""
    with repo.engine.begin() as conn:
        # Single-sample datasets: every job holds its own ids.
        order = select(Job.input_ids).order_by(Job.sort_key, Job.id)
        prompts = [list(ids or ()) for ids in conn.scalars(order)]
        params = conn.scalar(select(Dataset.sampling_params).limit(1))
        conn.execute(text("DELETE FROM runs"))
    return prompts, dict(params or {})


def pipeline_round(
    settings: Settings, repo: Repository, path: Path, run: str, args: argparse.Namespace
) -> tuple[int, int, float]:
    """Enqueue ``path`` as a new run and wait until all of it is done; (n, tokens, seconds)."""
    enqueue(settings, path, run, args.max_new_tokens)
    wait_run_done(repo, run, timeout_s=float("inf"))
    with repo.engine.connect() as conn:
        n, tokens, first, last = conn.execute(_GENERATED, {"run": run}).one()
    assert n == args.jobs, f"{run}: {n} of {args.jobs} generations"
    return int(n), int(tokens), float(last) - float(first)


async def bare_round(
    url: str, inputs: list[list[int]], params: dict[str, Any], concurrency: int
) -> tuple[int, int, float]:
    """Send every prompt with at most ``concurrency`` in flight; (n, tokens, seconds)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    pending = list(enumerate(inputs))
    done: list[tuple[float, int]] = []
    errors: list[str] = []
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=3600) as client:

        async def lane() -> None:
            while pending:
                i, ids = pending.pop()
                body = {"input_ids": ids, "sampling_params": params, "rid": f"bare-{i}"}
                tokens = await _generate(client, body, errors)
                done.append((time.time(), tokens))

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    if errors:
        print(f"bare client: {len(errors)} transport error(s) retried: {errors[:3]}", flush=True)
    times = [t for t, _ in done]
    return len(done), sum(n for _, n in done), max(times) - min(times)


async def _generate(client: httpx.AsyncClient, body: dict[str, Any], errors: list[str]) -> int:
    """POST /generate, again at once after a transport error (a keep-alive race); tokens."""
    while True:
        try:
            response = await client.post("/generate", json=body)
        except httpx.TransportError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        response.raise_for_status()
        return int(response.json()["meta_info"]["completion_tokens"])


def measure(
    kind: str, run: Callable[[], tuple[int, int, float]], sim_url: str, pids: dict[str, int]
) -> Measurement:
    """Run one round with the in-flight sampler and CPU accounting around it."""
    flushed = httpx.post(f"{sim_url}/flush_cache", timeout=10)  # cold prefix cache each round
    flushed.raise_for_status()
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    cpu_before["machine"] = machine_busy_s()
    start = time.time()
    with InFlightSampler(sim_url) as sampler:
        n, tokens, seconds = run()
    span = time.time() - start
    cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
    cpu["machine"] = machine_busy_s() - cpu_before["machine"]
    return Measurement(kind, n, tokens, seconds, span, sampler.peak, cpu)


def benchmark(args: argparse.Namespace) -> list[Measurement]:
    """Start the simulator and the worker, then alternate bare and pipeline rounds."""
    database = scratch_database(args.database_url, DATABASE)
    settings = Settings(
        database_url=database, broker_url=scratch_redis(args.broker_url, REDIS_DB), queue=QUEUE
    )
    repo = Repository(make_engine(database, pool_size=2))
    results: list[Measurement] = []
    logs = Path(tempfile.mkdtemp(prefix="eaglegen-bench-worker-"))
    print(f"logs in {logs}", flush=True)
    with sim_process(args, logs / "sim.log") as (sim, url):
        path = write_short_prompts(logs / "prompts.jsonl", args.jobs)
        # The bare client's prompts: the same file through the same producer, never consumed.
        enqueue(settings.model_copy(update={"queue": "bench-unconsumed"}), path, "ids", 1)
        inputs, params = take_prompts(repo)
        params["max_new_tokens"] = args.max_new_tokens
        log = logs / "worker.log"
        with worker_process(settings, url, args.concurrency, log, args.stream) as worker:
            pids = {"worker": worker.pid, "sim": sim.pid, "bench": os.getpid()}
            for i in range(args.rounds):
                bare = measure(
                    "bare",
                    lambda: asyncio.run(bare_round(url, inputs, params, args.concurrency)),
                    url,
                    pids,
                )
                print(bare.line(), flush=True)
                run = functools.partial(pipeline_round, settings, repo, path, f"pipeline-{i}", args)
                pipe = measure("pipeline", run, url, pids)
                print(pipe.line(), flush=True)
                results += [bare, pipe]
    repo.engine.dispose()
    return results


def report(results: list[Measurement], goal: float) -> None:
    """Medians of each side and the ratio pipeline/bare, with each round's for the spread."""
    medians = {}
    for kind in ("bare", "pipeline"):
        rounds = [m for m in results if m.kind == kind]
        medians[kind] = statistics.median(m.tok_s for m in rounds)
        peak = max(m.peak_in_flight for m in rounds)
        print(f"{kind:8} median {medians[kind]:,.0f} tok/s, peak in flight {peak}")
    same = sorted({m.tokens for m in results})
    print(f"tokens per round: {same} ({'identical' if len(same) == 1 else 'DIFFERENT'})")
    pairs = zip(results[::2], results[1::2], strict=True)
    per_round = ", ".join(f"{pipe.tok_s / bare.tok_s:.3f}" for bare, pipe in pairs)
    ratio = medians["pipeline"] / medians["bare"]
    print(f"ratio pipeline/bare = {ratio:.3f} (goal >= {goal}); per round: {per_round}")


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=600)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=2, help="bare+pipeline pairs")
    parser.add_argument(
        "--stream", action="store_true", help="the worker asks for streamed answers"
    )
    parser.add_argument(
        "--stream-interval", type=int, default=1, help="the simulator's, as SGLang's"
    )
    parser.add_argument(
        "--incremental",
        action="store_true",
        help="the simulator streams only new ids (SGLang's --incremental-streaming-output)",
    )
    parser.add_argument("--kv-tokens", type=int, default=2_000_000)
    parser.add_argument("--decode-step-ms", type=float, default=10.0)
    parser.add_argument("--decode-ms-per-request", type=float, default=0.05)
    parser.add_argument("--database-url", default=PG)
    parser.add_argument("--broker-url", default=REDIS)
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="the orchestration ceiling: 4,000 jobs, 64 in flight, 4 new tokens, no decode time",
    )
    args = parser.parse_args()
    if args.ceiling:
        args.jobs, args.concurrency, args.max_new_tokens = 4000, 64, 4
        args.decode_step_ms = args.decode_ms_per_request = 0.0
    print(
        f"{args.jobs:,} jobs, concurrency {args.concurrency}, max_new_tokens "
        f"{args.max_new_tokens}, decode {args.decode_step_ms} ms + "
        f"{args.decode_ms_per_request} ms/request",
        flush=True,
    )
    report(benchmark(args), goal=0.6 if args.ceiling else 0.97)


if __name__ == "__main__":
    main()
