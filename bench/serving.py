"""Pipeline against SGLang's own benchmark client, bench_serving (issue 14, benchmark 2).

What is measured: completion tokens per second of two clients of the same `eaglegen sim`
process, with the same prompts and the same request concurrency, in alternating rounds
(bench_serving, pipeline, bench_serving, pipeline, ...), and their ratio pipeline ÷
bench_serving per pair of rounds. Goal: >= 1.0.

- bench_serving: `sglang.benchmark.serving` from the PyPI package `sglang` (pinned below;
  `python -m sglang.bench_serving` is that module's deprecated alias), run in its own venv as
  `--backend sglang --tokenize-prompt --max-concurrency N --flush-cache --disable-tqdm`,
  with `--disable-stream` in the plain mode and streaming in the stream mode. Its figure is
  its own "Output token throughput": completion tokens (meta_info.completion_tokens) over its
  benchmark duration, from before the first request is sent to after the last one finished.
  It sends `sampling_params = {"temperature": 0.0, "max_new_tokens": N, "ignore_eos": true}`.
- pipeline: one `eaglegen worker` process (threads pool, `--concurrency N`, the shared
  in-flight limit N, adaptive concurrency off; `--workers K`: K of them sharing
  that limit, N/K threads each, as `--numa-node auto` runs one a NUMA node), as
  `bench.worker_throughput` runs it, fed by `eaglegen enqueue` of the same prompts file. Its
  figure: completion tokens over the same kind of span, from the first request's arrival at
  the simulator (the earliest generations.created_at minus that generation's e2e_latency) to
  the last generation recorded in Postgres. The run's sampling mirrors bench_serving's:
  max_new_tokens N, ignore_eos true, temperature 0.0, top_p 1.0 (the worker also sends its
  other defaults, which change nothing here). Streams in the stream mode
  (`EAGLEGEN_STREAM=true`).

Same prompts, same tokens: the prompts are short single-turn chat rows
(`bench.common.write_short_prompts`) templated and tokenized by `eaglegen enqueue`; their
input_ids, read back from Postgres, are what bench_serving sends, one per request, and each
pipeline round checks that its jobs hold the same input_ids. The simulator's output is a
function of (input_ids, seed), neither side sends a seed, and with ignore_eos both generate
exactly max_new_tokens per request: every round must produce the same token count, which is
checked, as are zero failed requests on both sides. With `--natural-lengths` neither side sends
ignore_eos (bench_serving's `--disable-ignore-eos`): each answer ends where the simulator's model
ends it (log-normal lengths: mean 300 tokens by default, 3,000 with the kimi-k2 preset; capped
at max_new_tokens), as a real dataset's answers do, instead of every request of a wave ending
in the same decode step; the two sides' token counts must still be equal, round for round.
Both sides send the prompts in one order (which matters once lengths differ: where the long
answers start decides the tail): every pipeline run has the same order seed, and
bench_serving's file lists the prompts in that run's publishing order. The simulator's
prefix cache is flushed before every round. A round during which the broker's Redis db was
emptied by another process (the test suite's broker fixture cycles through dbs 1-15 and
flushes each) is marked DISTURBED: a sentinel key set before the round is gone after it. In
flight = running + queued requests on the simulator's /metrics every 0.2 s: its peak, and its
mean from the first to the last sample that saw a request (the same mean on both sides means
the same load was offered; a lower one, slots left empty).

`--side job-path` puts the job's own path in the pipeline's place: `bench.job_path` runs
`worker.runner.run_attempt` (slot, claim, call, check, record) over the run's jobs in as many
threads as the limit, with no Celery, broker or feeder around it; `--side claim-ahead` runs it
with twice the threads, each claiming its job before its slot. Both are upper bounds of what
another consumer, or another order of the same work, could reach (issue 32), measured the
same way as the pipeline. `--side loop` runs `bench.loop_path`: the same work driven from one
event loop, its claims and records in batches, its jobs from the queue's messages as a
feeder of its own publishes them (the batched worker of docs/design.md §7, measured before
it was built); `--side loop-list`, from a list in memory. `--engine loop` runs the
pipeline's workers on the loop engine that design became (`EAGLEGEN_WORKER_ENGINE=loop`).

What is changed in bench_serving, at run time only, by a driver script written to a temp
directory (nothing is installed into or edited in the sglang package):
- stubs for two GPU-side imports it does not use here: `sglang.srt.utils` becomes a bare
  package (its `__init__` star-imports `sglang.srt.utils.common`, which needs torch; the
  submodules bench_serving needs, `network` and `hf_transformers_patches`, load from the
  real files), and `sglang.srt.disaggregation.utils` (torch, torch.distributed) is replaced
  by a module holding the one name bench_serving takes from it, FAKE_BOOTSTRAP_HOST (used
  by `--fake-prefill` only);
- its dataset loader: `get_dataset` returns the rows of `--dataset-path` (one JSON object a
  line: input_ids, output_len), since none of its datasets reads token ids from a file
  (`custom` re-tokenizes text and refuses `--tokenize-prompt`; `random-ids` makes its own);
- request fields the simulator refuses as unknown (a probe finds them; with sglang 0.5.23
  that is `return_routed_experts`, which SGLang's GenerateReqInput has and the simulator
  does not list) are left out of each body, and only where bench_serving sends them at
  False/None, SGLang's default. With a simulator that accepts them nothing is left out.
Its request function, concurrency semaphore, timing and metrics are its own, unchanged.

What is left out: the enqueue (tokenizing, inserting, publishing) is outside the pipeline's
span, as bench_serving's dataset loading and start-up are outside its own. bench_serving
opens one connection per request (a new aiohttp session each); the worker keeps its
connections alive. All processes (simulator, worker, Postgres, Redis, bench_serving) share
this machine's cores: a busy machine slows both sides, and the client's CPU reported for
bench_serving is its whole process, start-up included. Each round's CPU line names the
processes: the worker(s), the simulator, and Postgres (its backends, all databases) and
Redis when they run on this machine; `machine` is every core's busy time. A real SGLang
server's costs per connection and per chunk are not the simulator's.

Setup (once; a separate venv, the project's .venv is left alone; pip's warnings that sglang's
other requirements, torch among them, are missing are expected):
    .venv/bin/python -m bench.serving --setup [--venv /tmp/sglang-bench-venv]
Run:
    .venv/bin/python -m bench.serving [--requests 2000] [--concurrency 64,256]
        [--modes plain,stream] [--rounds 3] [--max-new-tokens 192] [--incremental]
        [--workers 1] [--side pipeline|job-path|claim-ahead|loop|loop-list]
        [--engine celery|loop] [--feed-window N] [--loop-ahead N]
        [--preset kimi-k2 --time-scale 0.2 | --decode-step-ms 0 --decode-ms-per-request 0]
The simulator is a big KV pool with the decode timing given (default 10 ms a step + 0.05 ms
a running request; 0 and 0 for a server that costs nothing, where the clients' own costs are
all there is), or with --preset, that preset's server at --time-scale.
Services: --database-url/--broker-url (default: this machine's Postgres and Redis; a scratch
database eaglegen_bench_serving and Redis db 11, flushed).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import redis
from sqlalchemy import select, text

from bench.common import scratch_database, scratch_redis, wait_run_done, write_short_prompts
from bench.procs import machine_busy_s, service_pids, tree_cpu_seconds
from bench.worker_throughput import (
    InFlightSampler,
    sim_process,
    take_prompts,
    worker_process,
)
from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR
from models.db import make_engine
from models.repository import Repository
from models.schema import Dataset, Job, Run
from producer.commands import run_enqueue
from producer.plan import DatasetPlan, RunPlan

PG = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS = "redis://127.0.0.1:6379/0"
DATABASE = "eaglegen_bench_serving"
REDIS_DB = 11
QUEUE = "bench-serving"
VENV = Path(tempfile.gettempdir()) / "sglang-bench-venv"
SGLANG = "sglang==0.5.23"
# What bench_serving imports that `pip install --no-deps sglang` leaves out, and no torch.
# transformers and tokenizers at the versions sglang 0.5.23 pins.
BENCH_DEPS = (
    "aiohttp",
    "datasets",
    "ipython",
    "msgspec",
    "numpy",
    "orjson",
    "pillow",
    "psutil",
    "pybase64",
    "pyzmq",
    "requests",
    "tqdm",
    "tokenizers==0.23.2",
    "transformers==5.19.0",
)
DROP_ENV = "BENCH_SERVING_DROP_FIELDS"
# Set before each round and looked for after it: gone means the Redis db was flushed meanwhile.
SENTINEL = "eaglegen-bench-serving:sentinel"
# Every run of the bench publishes its jobs in one order, and bench_serving's file lists them
# in it: with answers of natural lengths, where the long ones start decides the tail.
ORDER_SEED = 20261204
ROUND_TIMEOUT_S = 1800.0
_WINDOW = text("""
SELECT count(*), coalesce(sum(g.completion_tokens), 0),
       coalesce(min(g.completion_tokens), 0), coalesce(max(g.completion_tokens), 0),
       extract(epoch FROM min(g.created_at - make_interval(secs => g.e2e_latency))),
       extract(epoch FROM max(g.created_at))
FROM generations g JOIN jobs j ON j.id = g.job_id
JOIN datasets d ON d.id = j.dataset_id JOIN runs r ON r.id = d.run_id
WHERE r.name = :run
""")

DRIVER = '''\
"""bench_serving (sglang.benchmark.serving) with two GPU-side imports stubbed, its dataset
loader reading token ids from --dataset-path, and refused default-valued request fields left
out; written at run time by the eaglegen repository's bench/serving.py (see its docstring)."""

import importlib.util
import json
import os
import sys
import types
from pathlib import Path

_ROOT = Path(importlib.util.find_spec("sglang").origin).parent
_utils = types.ModuleType("sglang.srt.utils")
_utils.__path__ = [str(_ROOT / "srt" / "utils")]  # submodules load, __init__ does not
sys.modules["sglang.srt.utils"] = _utils
_disagg = types.ModuleType("sglang.srt.disaggregation.utils")
_disagg.FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # its value in sglang.srt.disaggregation.utils
sys.modules["sglang.srt.disaggregation.utils"] = _disagg

import sglang.benchmark.serving as serving  # noqa: E402
from sglang.benchmark.datasets import DatasetRow  # noqa: E402


def _rows(args, tokenizer, model_id=None):
    with open(args.dataset_path) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    if len(rows) != args.num_prompts:
        sys.exit(f"{args.dataset_path}: {len(rows)} rows, --num-prompts {args.num_prompts}")
    return [
        DatasetRow(prompt=ids, prompt_len=len(ids), output_len=r["output_len"])
        for r in rows
        for ids in [r["input_ids"]]
    ]


serving.get_dataset = _rows

_DROP = frozenset(f for f in os.environ.get("__DROP_ENV__", "").split(",") if f)
if _DROP:
    import aiohttp

    _post = aiohttp.ClientSession.post

    def _post_without(self, url, **kwargs):
        body = kwargs.get("json")
        if isinstance(body, dict):
            kwargs["json"] = {
                k: v for k, v in body.items() if not (k in _DROP and v in (False, None))
            }
        return _post(self, url, **kwargs)

    aiohttp.ClientSession.post = _post_without
    print(f"left out of each request body at False/None: {sorted(_DROP)}", flush=True)

if __name__ == "__main__":
    serving.cli_main()
'''.replace("__DROP_ENV__", DROP_ENV)


@dataclass(frozen=True)
class Mode:
    """One configuration compared: a concurrency, streamed or not."""

    concurrency: int
    stream: bool

    def __str__(self) -> str:
        return f"{'stream' if self.stream else 'plain'} c={self.concurrency}"


@dataclass(frozen=True)
class Round:
    """One round of one side: requests, tokens, its span, peak in flight, CPU seconds."""

    side: str
    requests: int
    tokens: int
    seconds: float  # first request sent (or received) to last finished
    peak_in_flight: int
    mean_in_flight: float
    cpu_s: dict[str, float]
    flushed: bool  # the broker's Redis db was emptied by someone else during the round
    # The simulator's own clock over the round (GET /sim/stats): decode steps taken (the same
    # tokens in fewer steps is fuller batches) and seconds of prefill passes, which stall
    # every running request (arrivals spread out cost more passes than arrivals together).
    decode_steps: int
    prefill_s: float
    prefill_passes: int

    @property
    def tok_s(self) -> float:
        """Completion tokens per second over the span."""
        return self.tokens / self.seconds

    def line(self) -> str:
        """A one-line summary."""
        cpu = ", ".join(f"{k} {v:.1f}" for k, v in self.cpu_s.items())
        return (
            f"  {self.side:13} {self.requests:,} requests, {self.tokens:,} tokens in "
            f"{self.seconds:.2f} s: {self.tok_s:,.0f} tok/s; in flight mean "
            f"{self.mean_in_flight:.1f}, peak {self.peak_in_flight}; server: "
            f"{self.decode_steps:,} decode steps, {self.prefill_s:.1f} s prefill in "
            f"{self.prefill_passes:,} passes; cpu s: {cpu}"
            + ("; DISTURBED: Redis db flushed during the round" if self.flushed else "")
        )


class Occupancy(InFlightSampler):
    """The in-flight samples (bench.worker_throughput), and their mean over the busy span."""

    @property
    def mean(self) -> float:
        """The mean of the samples from the first to the last that saw a request."""
        busy = [i for i, n in enumerate(self.samples) if n]
        return statistics.fmean(self.samples[busy[0] : busy[-1] + 1]) if busy else 0.0


@dataclass
class Bench:
    """What every round of a run shares."""

    args: argparse.Namespace
    logs: Path
    sim_url: str
    sim_pid: int
    settings: Settings
    repo: Repository
    chat_rows: Path  # the prompts as chat rows, for `eaglegen enqueue`
    id_rows: Path  # the same prompts as input_ids, for bench_serving
    inputs: list[list[int]]
    driver: Path
    drop: list[str]
    # Postgres's and Redis's pids when they run here: their CPU is the pipeline's too.
    services: dict[str, int]

    @property
    def sampling(self) -> dict[str, Any]:
        """The pipeline's sampling: bench_serving's, in the run file's terms."""
        n = self.args.max_new_tokens
        ignore_eos = not self.args.natural_lengths
        return {"max_new_tokens": n, "ignore_eos": ignore_eos, "temperature": 0.0, "top_p": 1.0}


def venv_python(venv: Path) -> Path:
    """The interpreter of the bench_serving venv."""
    return venv / "bin" / "python"


def setup(venv: Path, logs: Path) -> None:
    """Create the bench_serving venv, install sglang without its dependencies plus the few
    bench_serving imports, and check that the driver starts (its --help)."""
    if not venv_python(venv).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv_python(venv)), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "--no-deps", SGLANG], check=True)
    subprocess.run([*pip, *BENCH_DEPS], check=True)
    driver = write_driver(logs)
    subprocess.run(
        [str(venv_python(venv)), str(driver), "--help"],
        env=driver_env(()),
        stdout=subprocess.DEVNULL,
        check=True,
    )
    print(f"bench_serving ready in {venv} ({sglang_version(venv)})")


def write_driver(directory: Path) -> Path:
    """The bench_serving driver script, written into ``directory``."""
    path = directory / "bench_serving_driver.py"
    path.write_text(DRIVER)
    return path


def driver_env(drop: Sequence[str]) -> dict[str, str]:
    """The environment bench_serving runs in: no hub downloads, nothing of this venv."""
    skip = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "SGLANG_IS_IN_CI")
    env = {k: v for k, v in os.environ.items() if k not in skip}
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env[DROP_ENV] = ",".join(drop)
    return env


def sglang_version(venv: Path) -> str:
    """The sglang version installed in the venv."""
    probe = "import importlib.metadata as m; print(m.version('sglang'))"
    done = subprocess.run(
        [str(venv_python(venv)), "-c", probe], capture_output=True, text=True, check=True
    )
    return f"sglang {done.stdout.strip()}"


def refused_fields(sim_url: str) -> list[str]:
    """Top-level fields of bench_serving's /generate body (sglang 0.5.23, at its defaults)
    that the server refuses as unknown with a 400."""
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True},
        "stream": False,
        "lora_path": None,
        "return_logprob": False,
        "return_routed_experts": False,
        "logprob_start_len": -1,
    }
    response = httpx.post(f"{sim_url}/generate", json=body, timeout=30)
    if response.status_code == 200:
        return []
    found = re.search(r"Unknown field\(s\) in the request: \[(.*?)\]", response.text)
    if response.status_code != 400 or found is None:
        raise RuntimeError(f"probe refused: HTTP {response.status_code}: {response.text[:500]}")
    return re.findall(r"'([^']+)'", found.group(1))


def enqueue_sampled(settings: Settings, path: Path, run: str, sampling: dict[str, Any]) -> None:
    """Enqueue every prompt of ``path`` as run ``run`` with ``sampling``, in ORDER_SEED's
    publishing order."""
    dataset = DatasetPlan("d", path, sampling=sampling)
    plan = RunPlan(run=run, tokenizer=TOKENIZER_DIR, datasets=[dataset], order_seed=ORDER_SEED)
    run_enqueue(settings, settings.services(), plan, quiet=True)


def measured(
    side: str,
    run: Callable[[], tuple[int, int, float]],
    bench: Bench,
    pids: dict[str, int],
) -> Round:
    """Flush the simulator's cache, then run one round with the occupancy sampler and CPU
    accounting (these processes, the children this one waited for, the machine) around it."""
    httpx.post(f"{bench.sim_url}/flush_cache", timeout=10).raise_for_status()
    assert bench.settings.broker_url is not None
    broker = redis.Redis.from_url(bench.settings.broker_url)
    broker.set(SENTINEL, "1")
    before = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
    children = _children_cpu_s()
    busy = machine_busy_s()
    server = sim_stats(bench.sim_url)
    with Occupancy(bench.sim_url) as sampler:
        n, tokens, seconds = run()
    server_after = sim_stats(bench.sim_url)
    steps = int(server_after["decode_steps"] - server["decode_steps"])
    prefill_s = float(server_after["prefill_seconds"] - server["prefill_seconds"])
    passes = int(server_after["prefill_passes"] - server["prefill_passes"])
    cpu = {name: tree_cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    if side != "pipeline":  # a child process this one waited for
        cpu[side] = _children_cpu_s() - children
    cpu["machine"] = machine_busy_s() - busy
    flushed = not broker.exists(SENTINEL)
    broker.close()
    return Round(
        side, n, tokens, seconds, sampler.peak, sampler.mean, cpu, flushed, steps, prefill_s, passes
    )


def sim_stats(sim_url: str) -> dict[str, Any]:
    """The simulator's own counters of its scheduler."""
    response = httpx.get(f"{sim_url}/sim/stats", timeout=10)
    response.raise_for_status()
    return dict(response.json()["scheduler"])


def _children_cpu_s() -> float:
    """User + system CPU seconds of the child processes waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bench_serving_round(bench: Bench, mode: Mode, name: str) -> tuple[int, int, float]:
    """Run bench_serving once over every prompt; (completed, tokens, its duration)."""
    args = bench.args
    out = bench.logs / f"{name}.jsonl"
    command = [
        *(str(venv_python(args.venv)), str(bench.driver)),
        *("--backend", "sglang", "--base-url", bench.sim_url, "--ready-check-timeout-sec", "0"),
        *("--model", str(TOKENIZER_DIR), "--tokenizer", str(TOKENIZER_DIR)),
        *("--dataset-name", "custom", "--dataset-path", str(bench.id_rows), "--tokenize-prompt"),
        *("--num-prompts", str(len(bench.inputs)), "--max-concurrency", str(mode.concurrency)),
        *("--flush-cache", "--disable-tqdm", "--output-file", str(out), "--output-details"),
        *(() if mode.stream else ("--disable-stream",)),
        *(("--disable-ignore-eos",) if args.natural_lengths else ()),
    ]
    with (bench.logs / f"{name}.log").open("wb") as log:
        subprocess.run(
            command,
            env=driver_env(bench.drop),
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
            timeout=ROUND_TIMEOUT_S,
        )
    result = json.loads(out.read_text().splitlines()[-1])
    errors = [e for e in result["errors"] if e]
    assert not errors, f"{name}: {len(errors)} failed requests, first: {errors[0][:500]}"
    short = sum(n < args.max_new_tokens for n in result["output_lens"])
    if short and not args.natural_lengths:
        # Its stream parser takes completion_tokens only from chunks with text: when the last
        # chunk of an incremental stream has none, it counts that request short.
        print(f"  bench_serving counted {short} of its requests short of max_new_tokens")
    return int(result["completed"]), int(result["total_output_tokens"]), float(result["duration"])


def pipeline_round(bench: Bench, name: str) -> tuple[int, int, float]:
    """Enqueue the prompts as a new run and wait until all of it is done;
    (generations, tokens, first request received to last generation recorded)."""
    enqueue_sampled(bench.settings, bench.chat_rows, name, bench.sampling)
    if not wait_run_done(bench.repo, name, ROUND_TIMEOUT_S):
        [counts] = bench.repo.counts(name)
        raise RuntimeError(f"{name}: not done after {ROUND_TIMEOUT_S:.0f} s: {counts.states}")
    return generated(bench, name)


def job_path_round(bench: Bench, mode: Mode, name: str) -> tuple[int, int, float]:
    """The job's own path without Celery (`bench.job_path`, or `bench.loop_path` for the
    loop sides: a process of its own, run to its end) over the prompts enqueued as a new
    run; the same figures as a pipeline round."""
    enqueue_sampled(bench.settings, bench.chat_rows, name, bench.sampling)
    database, broker = bench.settings.database_url, bench.settings.broker_url
    assert database is not None and broker is not None
    side = bench.args.side
    command = [
        *(sys.executable, "-m", "bench.loop_path" if "loop" in side else "bench.job_path"),
        *("--run", name, "--database-url", database),
        *("--server", bench.sim_url, "--concurrency", str(mode.concurrency)),
        *(("--claim-ahead",) if side == "claim-ahead" else ()),
        *(() if side == "loop-list" else ("--broker-url", broker)),
    ]
    if "loop" in side and bench.args.loop_ahead:
        command += ["--ahead", str(bench.args.loop_ahead)]
    if side == "loop":  # from the queue's messages, which its feeder publishes
        command += ["--queue", bench.settings.queue]
        command += ["--window", str(bench.args.feed_window)] if bench.args.feed_window else []
    with (bench.logs / f"{name}.log").open("wb") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    return generated(bench, name)


def generated(bench: Bench, name: str) -> tuple[int, int, float]:
    """A done run's generations checked against bench_serving's prompts; (generations,
    tokens, first request received to last generation recorded)."""
    with bench.repo.engine.connect() as conn:
        n, tokens, shortest, longest, first, last = conn.execute(_WINDOW, {"run": name}).one()
        ids = conn.scalars(
            select(Job.input_ids)
            .join(Dataset, Dataset.id == Job.dataset_id)
            .join(Run, Run.id == Dataset.run_id)
            .where(Run.name == name)
        )
        same = collections.Counter(tuple(i or ()) for i in ids) == collections.Counter(
            map(tuple, bench.inputs)
        )
    expected = len(bench.inputs)
    assert same, f"{name}: the jobs' input_ids are not bench_serving's prompts"
    if n != expected:
        [counts] = bench.repo.counts(name)
        raise AssertionError(f"{name}: {n} of {expected} generations ({counts.states})")
    wanted = bench.args.max_new_tokens
    if not bench.args.natural_lengths:  # else compare() checks the tokens against bench_serving's
        assert shortest == longest == wanted, f"{name}: {shortest}..{longest} tokens, not {wanted}"
    return int(n), int(tokens), float(last) - float(first)


def start_workers(
    stack: contextlib.ExitStack, bench: Bench, mode: Mode, log: Path
) -> dict[str, int]:
    """The pipeline's worker processes, stopped with ``stack``: one, or --workers
    sharing the in-flight limit with its threads split among them; their pids by name."""
    k = bench.args.workers
    pids = {}
    for i in range(k):
        worker = worker_process(
            bench.settings,
            bench.sim_url,
            mode.concurrency,
            log if k == 1 else log.with_suffix(f".{i + 1}.log"),
            mode.stream,
            threads=math.ceil(mode.concurrency / k),
            engine=bench.args.engine,
        )
        pids["worker" if k == 1 else f"worker{i + 1}"] = stack.enter_context(worker).pid
    return pids


def compare(bench: Bench, mode: Mode) -> list[tuple[Round, Round]]:
    """Start a worker for ``mode``, then alternate bench_serving and pipeline rounds."""
    label = f"{'stream' if mode.stream else 'plain'}-{mode.concurrency}"
    log = bench.logs / f"worker-{label}.log"
    pairs = []
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    side = bench.args.side + (
        f", {bench.args.engine} engine" if bench.args.side == "pipeline" else ""
    )
    print(f"{mode} ({side}): load average before {load}", flush=True)
    job_path = bench.args.side != "pipeline"
    with contextlib.ExitStack() as stack:
        workers = {} if job_path else start_workers(stack, bench, mode, log)
        pids = {**workers, "sim": bench.sim_pid, **bench.services}
        for i in range(bench.args.rounds):
            client_run = functools.partial(
                bench_serving_round, bench, mode, f"bench-serving-{label}-{i}"
            )
            client = measured("bench_serving", client_run, bench, pids)
            print(client.line(), flush=True)
            if job_path:
                pipe_run = functools.partial(
                    job_path_round, bench, mode, f"{bench.args.side}-{label}-{i}"
                )
            else:
                pipe_run = functools.partial(pipeline_round, bench, f"pipeline-{label}-{i}")
            pipe = measured(bench.args.side, pipe_run, bench, pids)
            print(pipe.line(), flush=True)
            # Same prompts, outputs a function of them: a difference is a defect of the bench
            # (streamed, bench_serving may count a request short: see bench_serving_round).
            same = pipe.tokens == client.tokens
            assert same or mode.stream, f"tokens {pipe.tokens:,} vs {client.tokens:,}"
            print(f"  ratio {pipe.tok_s / client.tok_s:.3f}", flush=True)
            pairs.append((client, pipe))
    return pairs


def report(results: dict[Mode, list[tuple[Round, Round]]]) -> None:
    """Per mode: each side's tok/s per round, the ratio per pair, its median and range."""
    side = f"{next(iter(results.values()))[0][1].side} tok/s"
    print(f"\nmode            bench_serving tok/s     {side:23} ratio per pair")
    for mode, pairs in results.items():
        ratios = [p.tok_s / c.tok_s for c, p in pairs]
        clients = " ".join(f"{c.tok_s:,.0f}" for c, _ in pairs)
        pipes = " ".join(f"{p.tok_s:,.0f}" for _, p in pairs)
        each = " ".join(f"{p.tok_s / c.tok_s:.3f}{'*' if p.flushed else ''}" for c, p in pairs)
        print(f"{mode!s:15} {clients:23} {pipes:23} {each}")
        clean = [p.tok_s / c.tok_s for c, p in pairs if not p.flushed]
        if len(clean) < len(ratios):
            median = f"{statistics.median(clean):.3f}" if clean else "none"
            print(f"{'':15} * Redis db flushed during the round; median of the others {median}")
        client_mean = statistics.median(c.mean_in_flight for c, _ in pairs)
        pipe_mean = statistics.median(p.mean_in_flight for _, p in pairs)
        print(
            f"{'':15} median ratio {statistics.median(ratios):.3f} "
            f"(range {min(ratios):.3f}-{max(ratios):.3f}, goal >= 1.0); in flight, median of "
            f"the rounds' means {client_mean:.1f} / {pipe_mean:.1f}, peak "
            f"{max(c.peak_in_flight for c, _ in pairs)} / {max(p.peak_in_flight for _, p in pairs)}"
        )
    every = [pair for pairs in results.values() for pair in pairs]
    for i in range(2):
        side = every[0][i].side
        tokens = sorted({pair[i].tokens for pair in every})
        same = "identical" if len(tokens) == 1 else "DIFFERENT"
        print(f"{side} tokens per round, as it counts them: {tokens} ({same})")


def benchmark(args: argparse.Namespace) -> dict[Mode, list[tuple[Round, Round]]]:
    """Start the simulator, prepare the prompts both sides send, then compare each mode."""
    if not venv_python(args.venv).exists():
        raise SystemExit(f"no bench_serving venv at {args.venv}: run with --setup first")
    database = scratch_database(args.database_url, DATABASE)
    broker_url = scratch_redis(args.broker_url, REDIS_DB)
    settings = Settings(database_url=database, broker_url=broker_url, queue=QUEUE)
    repo = Repository(make_engine(database, pool_size=2))
    logs = Path(tempfile.mkdtemp(prefix="eaglegen-bench-serving-"))
    print(f"logs, prompts and the bench_serving driver in {logs}", flush=True)
    results: dict[Mode, list[tuple[Round, Round]]] = {}
    preset = (
        None
        if args.preset is None
        else ("--preset", args.preset, "--time-scale", str(args.time_scale))
    )
    with sim_process(args, logs / "sim.log", preset) as (sim, url):
        chat_rows = write_short_prompts(logs / "prompts.jsonl", args.requests)
        # bench_serving's prompts: the same file through the same producer, never consumed.
        unconsumed = settings.model_copy(update={"queue": "bench-unconsumed"})
        enqueue_sampled(unconsumed, chat_rows, "ids", {"max_new_tokens": args.max_new_tokens})
        inputs, _ = take_prompts(repo)
        id_rows = logs / "input_ids.jsonl"
        with id_rows.open("w") as handle:
            for ids in inputs:
                handle.write(json.dumps({"input_ids": ids, "output_len": args.max_new_tokens}))
                handle.write("\n")
        drop = refused_fields(url)
        bench = Bench(
            args=args,
            logs=logs,
            sim_url=url,
            sim_pid=sim.pid,
            settings=settings,
            repo=repo,
            chat_rows=chat_rows,
            id_rows=id_rows,
            inputs=inputs,
            driver=write_driver(logs),
            drop=drop,
            services=service_pids(database, broker_url),
        )
        mean = sum(map(len, inputs)) / len(inputs)
        print(
            f"{len(inputs):,} prompts (mean {mean:.1f} tokens), max_new_tokens "
            f"{args.max_new_tokens}, {lengths_line(args)}; {sglang_version(args.venv)}; simulator "
            f"{server_line(args)}; "
            f"fields the simulator refuses, left out by bench_serving's driver: {drop or 'none'}",
            flush=True,
        )
        for stream in args.modes:
            for concurrency in args.concurrency:
                mode = Mode(concurrency, stream)
                results[mode] = compare(bench, mode)
    repo.engine.dispose()
    return results


def lengths_line(args: argparse.Namespace) -> str:
    """How long the answers are, as the report's header says it."""
    if args.natural_lengths:
        return "natural lengths (the simulator's own, capped at max_new_tokens)"
    return "ignore_eos"


def server_line(args: argparse.Namespace) -> str:
    """The simulator's settings, as the report's header says them."""
    if args.preset is not None:
        return f"preset {args.preset} at time scale {args.time_scale}"
    return f"decode {args.decode_step_ms} ms + {args.decode_ms_per_request} ms/request"


def _ints(value: str) -> list[int]:
    return [int(v) for v in value.split(",")]


def _modes(value: str) -> list[bool]:
    known = {"plain": False, "stream": True}
    try:
        return [known[v] for v in value.split(",")]
    except KeyError as exc:
        raise argparse.ArgumentTypeError(f"modes are plain and stream, got {value!r}") from exc


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--setup", action="store_true", help="create the bench_serving venv")
    parser.add_argument("--venv", type=Path, default=VENV, help="the bench_serving venv")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=_ints, default=[64, 256], help="e.g. 64,256")
    parser.add_argument(
        "--modes", type=_modes, default=[False, True], help="plain (non-streamed), stream"
    )
    parser.add_argument("--rounds", type=int, default=3, help="bench_serving+pipeline pairs")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes (as bench.worker_stalls): they share the in-flight limit, "
        "its threads split among them, as `--numa-node auto` runs one a NUMA node",
    )
    parser.add_argument(
        "--side",
        choices=["pipeline", "job-path", "claim-ahead", "loop", "loop-list"],
        default="pipeline",
        help="what runs against bench_serving: the pipeline (Celery workers), or only the "
        "job's own path in threads with no Celery (bench.job_path: an upper bound), or that "
        "path claiming each job before its slot (bench.job_path --claim-ahead), or the "
        "same work from one event loop with batched claims and records (bench.loop_path), "
        "its jobs from the queue's messages (loop) or from a list (loop-list)",
    )
    parser.add_argument(
        "--engine",
        choices=["celery", "loop"],
        default=Settings.model_fields["worker_engine"].default,
        help="with --side pipeline: the workers' engine (EAGLEGEN_WORKER_ENGINE; default: "
        "the worker's default)",
    )
    parser.add_argument(
        "--feed-window",
        type=int,
        help="with --side loop: the feeder's window (default: as a worker's heartbeat makes it)",
    )
    parser.add_argument(
        "--loop-ahead",
        type=int,
        help="with --side loop or loop-list: the jobs claimed ahead (default: one a lane)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument(
        "--natural-lengths",
        action="store_true",
        help="answers end where the simulator's model ends them (no ignore_eos on either side)",
    )
    parser.add_argument(
        "--stream-interval", type=int, default=1, help="the simulator's, as SGLang's"
    )
    parser.add_argument(
        "--incremental",
        action="store_true",
        help="the simulator streams only new ids (SGLang's --incremental-streaming-output)",
    )
    parser.add_argument(
        "--preset",
        default=None,
        help="a simulator preset (kimi-k2: where the server binds) instead of the timing below",
    )
    parser.add_argument("--time-scale", type=float, default=1.0, help="with --preset")
    parser.add_argument("--kv-tokens", type=int, default=2_000_000)
    parser.add_argument("--decode-step-ms", type=float, default=10.0)
    parser.add_argument("--decode-ms-per-request", type=float, default=0.05)
    parser.add_argument("--database-url", default=PG)
    parser.add_argument("--broker-url", default=REDIS)
    args = parser.parse_args()
    if args.setup:
        setup(args.venv, Path(tempfile.mkdtemp(prefix="eaglegen-bench-serving-setup-")))
        return
    started = datetime.now(UTC).isoformat(timespec="seconds")
    print(f"{started}, {os.cpu_count()} cores, python {sys.version.split()[0]}", flush=True)
    report(benchmark(args))


if __name__ == "__main__":
    main()
