"""No stall with many threads (issue 32): real `eaglegen worker` processes against
`eaglegen sim` over HTTP, default settings, at several thread counts, adaptive and fixed.

    .venv/bin/python -m bench.worker_stalls [--threads 64,256,512,1024,default]
        [--limits adaptive,fixed] [--rounds 1] [--jobs 3000] [--max-new-tokens 128]
        [--sim-arg=--preset --sim-arg=fast ...] [--code before=DIR,after=.] [--workers 1]
        [--engine celery|loop]

Each run starts `--workers` `eaglegen worker` processes (`--concurrency N`, or no flag for
`default`) with only the services and the simulator set, adaptive concurrency on
(`adaptive`) or off (`fixed`: the default limit of 256), on an emptied Redis db, then
enqueues the jobs of a new run and waits until none is queued or running. Runs alternate
the code trees, then adaptive and fixed, for each thread count, thread counts in order,
round after round, against one simulator (its prefix cache flushed before each run).

Per run:

- wall: seconds from the first request sent (the earliest ``created_at - e2e_latency`` of
  the run's generations) to the last finished (the latest ``created_at``);
- idle: the longest interval with the simulator at 0 running and 0 waiting requests while
  jobs are open (from the end of the enqueue to the moment none is queued or running), its
  /metrics read every 0.2 s; the goal is under 10 s;
- redis errors: records of the worker's log naming a Redis connection failure;
- sent back: messages the worker gave back for lack of a free slot (its own
  ``eaglegen_worker_job_attempts_total{outcome="no_slot"}``), and duplicates turned away
  (``not_claimed``);
- held: the most messages the workers held unacked (kombu's ``unacked`` hash in Redis);
- in flight: the most requests at the simulator (running + waiting);
- threads: the most threads their processes had (/proc);
- limit: the in-flight limit stored at the end and the highest seen (adaptive);
- cpu/job: the workers' CPU milliseconds per job;
- smallest share (several workers): the share of the jobs done by the one that did fewest.

``--code NAME=DIR,...`` runs the workers from each checkout in turn (``.``: this one; e.g.
another from ``git archive``) against the same simulator, producer and database: a
before/after comparison side by side in one run.

Services: --database-url/--broker-url (default: this machine's Postgres and Redis; a scratch
database eaglegen_bench_stalls and Redis db 11, flushed before each run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx
import redis
from sqlalchemy import text

from bench.common import scratch_database, scratch_redis, wait_run_done, write_short_prompts
from bench.procs import cpu_seconds
from bench.worker_throughput import _announced_url, _stop, eaglegen_worker, enqueue
from core import keys
from core.settings import Settings
from eaglegen.sim.metrics import parse
from eaglegen.stack import free_port
from models.db import make_engine
from models.repository import Repository
from worker.metrics import PREFIX

PG = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS = "redis://127.0.0.1:6379/0"
DATABASE = "eaglegen_bench_stalls"
REDIS_DB = 11
QUEUE = "bench-stalls"
SERVER = "sim"
IDLE_GOAL_S = 10.0
# What a worker's log says when a Redis command fails on its connection.
REDIS_ERROR = re.compile(
    r"MaxConnectionsError|Too many connections|Redis unreachable|redis\.exceptions\."
    r"|Error \d+ connecting to|Connection reset by peer|Connection closed by server"
)
_SPAN = text("""
SELECT count(*),
       extract(epoch FROM min(g.created_at - make_interval(secs => g.e2e_latency))),
       extract(epoch FROM max(g.created_at))
FROM generations g JOIN jobs j ON j.id = g.job_id
JOIN datasets d ON d.id = j.dataset_id JOIN runs r ON r.id = d.run_id
WHERE r.name = :run
""")
# Jobs done by each worker process of a run.
_SHARES = text("""
SELECT count(*) FROM jobs j JOIN datasets d ON d.id = j.dataset_id JOIN runs r ON r.id = d.run_id
WHERE r.name = :run AND j.state = 'done' GROUP BY j.worker
""")


@dataclass
class Reading:
    """One sample: time (epoch seconds), the server's load and what the worker holds."""

    at: float
    in_flight: int
    unacked: int
    limit: int | None
    threads: int


@dataclass
class Run:
    """What one run measured."""

    code: str
    threads: str
    limits: str
    workers: int
    jobs: int
    done: int
    wall_s: float
    idle_s: float
    redis_errors: int
    no_slot: int
    not_claimed: int
    peak_unacked: int
    peak_threads: int
    last_limit: int | None
    peak_limit: int | None
    cpu_ms_per_job: float
    peak_in_flight: int
    smallest_share: float  # of the jobs, done by the worker that did the fewest
    finished: bool = True

    def line(self) -> str:
        """One line per run, as it ends."""
        limit = (
            "" if self.last_limit is None else f", limit {self.last_limit} (max {self.peak_limit})"
        )
        return (
            f"{self.code:>8} threads {self.threads:>7} {self.limits:8}: "
            f"{self.done}/{self.jobs} done"
            f"{'' if self.finished else ' (TIMED OUT)'}, wall {self.wall_s:.1f} s, longest idle "
            f"{self.idle_s:.1f} s, redis errors {self.redis_errors}, sent back {self.no_slot}, "
            f"not claimed {self.not_claimed}, held <= {self.peak_unacked}, threads <= "
            f"{self.peak_threads}, peak in flight {self.peak_in_flight}{limit}, "
            f"cpu {self.cpu_ms_per_job:.2f} ms/job"
            + (f", smallest share {self.smallest_share:.2f}" if self.workers > 1 else "")
        )


class Sampler:
    """Every 0.2 s on a thread: the simulator's running + waiting requests, the messages the
    worker holds unacked, the stored limit and the worker's thread count."""

    def __init__(
        self, sim_url: str, broker_url: str, pids: list[int], interval_s: float = 0.2
    ) -> None:
        self.readings: list[Reading] = []
        self._url = f"{sim_url}/metrics"
        self._redis = redis.Redis.from_url(broker_url)
        self._pids = pids
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._redis.close()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(self._interval):
                at = time.time()
                try:
                    load = in_flight(client.get(self._url).text)
                except httpx.HTTPError:  # the simulator too busy to answer: not a reading
                    continue
                raw = self._redis.get(keys.limit(SERVER))
                limit = None if raw is None else int(json.loads(raw)["limit"])
                unacked = int(self._redis.hlen("unacked"))
                threads = sum(threads_of(pid) for pid in self._pids)
                self.readings.append(Reading(at, load, unacked, limit, threads))


def in_flight(metrics: str) -> int:
    """Running plus waiting requests in a /metrics text (whatever the labels)."""
    names = ("sglang:num_running_reqs", "sglang:num_queue_reqs")
    return int(sum(v for k, v in parse(metrics).items() if k.split("{")[0] in names))


def threads_of(pid: int) -> int:
    """The process's thread count now (Linux /proc; 0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next(
        (int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads:")), 0
    )


def longest_idle(readings: Sequence[Reading], opened: float, closed: float) -> float:
    """The longest stretch at 0 in flight between ``opened`` (the jobs just enqueued: the
    server idle) and ``closed``: from its first idle reading to the next busy one."""
    longest = 0.0
    since: float | None = opened
    for reading in readings:
        if not opened <= reading.at <= closed:
            continue
        if reading.in_flight == 0 and since is None:
            since = reading.at
        elif reading.in_flight > 0 and since is not None:
            longest, since = max(longest, reading.at - since), None
    return longest if since is None else max(longest, closed - since)


@contextmanager
def sim_process(sim_args: Sequence[str], log: Path) -> Iterator[str]:
    """`eaglegen sim` on a free port with ``sim_args``; its URL once it listens."""
    command = [sys.executable, "-m", "eaglegen", "sim", "--port", "0", *sim_args]
    env = {**os.environ, "COLUMNS": "200"}
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            yield _announced_url(process, log)
        finally:
            _stop(process)


@contextmanager
def worker_process(
    settings: Settings,
    sim_url: str,
    threads: str,
    adaptive: bool,
    log: Path,
    metrics_port: int,
    code: Path,
    engine: str | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """`eaglegen worker` with default settings but the services, the simulator and (for
    ``fixed``) adaptive concurrency off; ``--concurrency`` unless ``threads`` is default."""
    env = {"EAGLEGEN_METRICS_PORT": str(metrics_port)}
    if engine is not None:
        env["EAGLEGEN_WORKER_ENGINE"] = engine
    if not adaptive:
        env["EAGLEGEN_ADAPTIVE_CONCURRENCY"] = "false"
    args = [] if threads == "default" else ["--concurrency", threads]
    servers = [{"name": SERVER, "url": sim_url}]
    with eaglegen_worker(settings, servers, log, env, args, code) as process:
        yield process


def attempts(metrics_port: int) -> dict[str, int]:
    """The worker's ``eaglegen_worker_job_attempts`` by outcome."""
    body = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    found: dict[str, int] = {}
    for line in body.splitlines():
        if line.startswith(f"{PREFIX}_job_attempts_total{{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            found[outcome] = int(float(line.rsplit(" ", 1)[1]))
    return found


def one_run(
    args: argparse.Namespace,
    database: str,
    sim_url: str,
    path: Path,
    logs: Path,
    code: tuple[str, Path],
    threads: str,
    limits: str,
    index: int,
) -> Run:
    """Start the workers, enqueue a new run, wait until it is settled; what was measured."""
    settings = Settings(
        database_url=database,
        broker_url=scratch_redis(args.broker_url, REDIS_DB),
        queue=QUEUE,
        data_dir=logs,
    )
    assert settings.broker_url
    httpx.post(f"{sim_url}/flush_cache", timeout=10).raise_for_status()
    repo = Repository(make_engine(database, pool_size=2))
    run = f"r{index}-{code[0]}-{threads}-{limits}"
    logs_of = [logs / f"worker-{run}-{i}.log" for i in range(args.workers)]
    ports = [free_port() for _ in logs_of]
    adaptive = limits == "adaptive"
    with ExitStack() as stack:
        workers = [
            stack.enter_context(
                worker_process(
                    settings, sim_url, threads, adaptive, log, port, code[1], args.engine
                )
            )
            for log, port in zip(logs_of, ports, strict=True)
        ]
        pids = [w.pid for w in workers]
        with Sampler(sim_url, settings.broker_url, pids) as sampler:
            cpu_before = sum(cpu_seconds(pid) for pid in pids)
            enqueue(settings, path, run, args.max_new_tokens)
            opened = time.time()
            finished = wait_run_done(repo, run, args.timeout_s)
            closed = time.time()
            cpu = sum(cpu_seconds(pid) for pid in pids) - cpu_before
            time.sleep(0.3)  # one more reading past the end
        outcomes = [attempts(port) for port in ports]
    with repo.engine.connect() as conn:
        done, first, last = conn.execute(_SPAN, {"run": run}).one()
        shares = [int(n) for n in conn.scalars(_SHARES, {"run": run})]
    repo.engine.dispose()
    readings = sampler.readings
    within = [r for r in readings if opened <= r.at <= closed]
    limits_seen = [r.limit for r in within if r.limit is not None]
    errors = sum(
        1
        for log in logs_of
        for line in log.read_text(errors="replace").splitlines()
        if line.startswith("[") and REDIS_ERROR.search(line)  # log records, not trace lines
    )
    return Run(
        code=code[0],
        threads=threads,
        limits=limits,
        workers=args.workers,
        jobs=args.jobs,
        done=int(done),
        wall_s=float(last) - float(first) if done else float("nan"),
        idle_s=longest_idle(readings, opened, closed),
        redis_errors=errors,
        no_slot=sum(o.get("no_slot", 0) for o in outcomes),
        not_claimed=sum(o.get("not_claimed", 0) for o in outcomes),
        peak_unacked=max((r.unacked for r in within), default=0),
        peak_threads=max((r.threads for r in within), default=0),
        last_limit=limits_seen[-1] if adaptive and limits_seen else None,
        peak_limit=max(limits_seen) if adaptive and limits_seen else None,
        cpu_ms_per_job=1000 * cpu / max(1, int(done)),
        peak_in_flight=max((r.in_flight for r in within), default=0),
        smallest_share=min(shares, default=0) / max(1, int(done))
        if len(shares) == args.workers
        else 0.0,
        finished=finished,
    )


@dataclass
class Table:
    """The runs by (threads, limits, code), in the order first seen."""

    runs: dict[tuple[str, str, str], list[Run]] = field(default_factory=dict)

    def add(self, run: Run) -> None:
        self.runs.setdefault((run.threads, run.limits, run.code), []).append(run)

    def markdown(self) -> str:
        """A Markdown table; a range where rounds differ."""
        several = any(r.workers > 1 for runs in self.runs.values() for r in runs)
        lines = [
            "| Threads | Limit | Code | Wall s | Longest idle s (open jobs) | Redis errors | Sent "
            "back (no slot) | Held messages, max | In flight, max | Threads, max | Limit at end "
            "(max) | Worker CPU ms/job |" + (" Smallest share |" if several else ""),
            "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if several else ""),
        ]
        for (threads, limits, code), runs in self.runs.items():
            limit = (
                "-"
                if runs[0].last_limit is None
                else _span([r.last_limit or 0 for r in runs], "{:.0f}")
                + f" ({_span([r.peak_limit or 0 for r in runs], '{:.0f}')})"
            )
            cells = [
                threads,
                limits,
                code,
                _span([r.wall_s for r in runs], "{:.1f}"),
                _span([r.idle_s for r in runs], "{:.1f}"),
                _span([r.redis_errors for r in runs], "{:.0f}"),
                _span([r.no_slot for r in runs], "{:.0f}"),
                _span([r.peak_unacked for r in runs], "{:.0f}"),
                _span([r.peak_in_flight for r in runs], "{:.0f}"),
                _span([r.peak_threads for r in runs], "{:.0f}"),
                limit,
                _span([r.cpu_ms_per_job for r in runs], "{:.2f}"),
            ]
            if several:
                cells.append(_span([r.smallest_share for r in runs], "{:.2f}"))
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _span(values: Sequence[float], fmt: str) -> str:
    low, high = min(values), max(values)
    return fmt.format(low) if low == high else f"{fmt.format(low)}-{fmt.format(high)}"


def benchmark(args: argparse.Namespace) -> Table:
    """One simulator; each round, each thread count, each limit mode in turn."""
    database = scratch_database(args.database_url, DATABASE)
    logs = Path(tempfile.mkdtemp(prefix="eaglegen-bench-stalls-"))
    print(f"logs in {logs}", flush=True)
    table = Table()
    path = write_short_prompts(logs / "prompts.jsonl", args.jobs)
    index = 0
    with sim_process(args.sim_arg, logs / "sim.log") as url:
        for _ in range(args.rounds):
            for threads in args.threads:
                for limits in args.limits:
                    for code in args.code:
                        index += 1
                        run = one_run(args, database, url, path, logs, code, threads, limits, index)
                        print(run.line(), flush=True)
                        table.add(run)
    return table


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=lambda s: s.split(","), default="64,256,512,1024")
    parser.add_argument("--limits", type=lambda s: s.split(","), default="adaptive,fixed")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1, help="worker processes per run")
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--sim-arg", action="append", default=[], help="passed to `eaglegen sim` (repeat)"
    )
    parser.add_argument(
        "--code", default="this=.", help="NAME=DIR,...: run workers from each tree in turn"
    )
    parser.add_argument(
        "--engine",
        choices=["celery", "loop"],
        help="the workers' engine (EAGLEGEN_WORKER_ENGINE; default: the worker's default)",
    )
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--database-url", default=PG)
    parser.add_argument("--broker-url", default=REDIS)
    args = parser.parse_args()
    if isinstance(args.threads, str):
        args.threads = args.threads.split(",")
    if isinstance(args.limits, str):
        args.limits = args.limits.split(",")
    args.code = [
        (name, Path(tree)) for name, _, tree in (c.partition("=") for c in args.code.split(","))
    ]
    print(
        f"{args.jobs:,} jobs of at most {args.max_new_tokens} new tokens; threads "
        f"{','.join(args.threads)}; limits {','.join(args.limits)}; simulator "
        f"{' '.join(args.sim_arg) or '(defaults)'}; workers from "
        f"{', '.join(f'{name} ({tree})' for name, tree in args.code)}",
        flush=True,
    )
    table = benchmark(args)
    print(table.markdown())
    worst = max(r.idle_s for runs in table.runs.values() for r in runs)
    print(f"longest idle with open jobs, all runs: {worst:.1f} s (goal < {IDLE_GOAL_S:g} s)")


if __name__ == "__main__":
    main()
