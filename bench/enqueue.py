"""Producer benchmarks (issue 3).

rate: enqueue rate of N short chat prompts (read, validate, template, tokenize, insert into
      Postgres, publish to Redis) as a ratio to the bare batch-tokenizer rate on the same
      rendered prompts, measured in the same run (bare, enqueue, bare; mean of the bares).
rss:  peak RSS of a process enqueueing N prompts, for several N, each in a fresh process;
      with worker processes, also the largest worker's peak and the sum of all peaks.

Usage: python -m bench.enqueue rate [--prompts 200000] [--workers N ...]
       python -m bench.enqueue rss [--sizes 100000 1000000] [--workers N]
--workers: template in N worker processes (0: in-process); several values are measured
interleaved in one run. Default: what `eaglegen enqueue` does (one per core, for long inputs).
Services: --database-url/--broker-url (default: this machine's Postgres and Redis).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import scratch_database, scratch_redis, write_short_prompts
from eaglegen.assets import TOKENIZER_DIR
from eaglegen.settings import Settings
from producer.commands import run_enqueue
from producer.plan import DatasetPlan, RunPlan
from producer.readers import iter_rows
from producer.rows import to_prompt
from producer.template import Templater

PG = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS = "redis://127.0.0.1:6379/0"
BATCH = 1024


def bare_tokenizer_seconds(templater: Templater, texts: list[str]) -> float:
    """Seconds for the fast tokenizer to encode ``texts`` in batches: the lower bound."""
    start = time.perf_counter()
    for i in range(0, len(texts), BATCH):
        templater.encode_batch(texts[i : i + BATCH])
    return time.perf_counter() - start


def enqueue_seconds(
    path: Path, database_url: str, broker_url: str, run: str, workers: int | None = None
) -> float:
    """Seconds for a full enqueue of ``path`` into real Postgres and Redis."""
    settings = Settings(database_url=database_url, broker_url=broker_url, queue=f"bench-{run}")
    plan = RunPlan(
        run=run,
        tokenizer=TOKENIZER_DIR,
        datasets=[DatasetPlan("d", path, sampling={"max_new_tokens": 1024})],
    )
    start = time.perf_counter()
    report = run_enqueue(settings, plan, quiet=True, workers=workers)
    elapsed = time.perf_counter() - start
    assert report.datasets[0].accepted > 0
    return elapsed


def rate(prompts: int, admin_url: str, broker: str, workers: list[int | None]) -> None:
    """Print the enqueue/bare-tokenizer rate ratio of each worker setting.

    Each round runs bare, then one enqueue per setting, and the ratio of an enqueue is to the
    mean of the bares around it.
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = write_short_prompts(Path(tmp) / "prompts.jsonl", prompts)
        templater = Templater(TOKENIZER_DIR)
        texts = [templater.render(to_prompt(r.value)) for r in iter_rows(path)]
        print(f"{prompts:,} prompts, mean {sum(map(len, texts)) / len(texts):.0f} chars rendered")
        bare_before = bare_tokenizer_seconds(templater, texts)
        for w in workers:
            database = scratch_database(admin_url, "eaglegen_bench_enqueue")
            full = enqueue_seconds(path, database, scratch_redis(broker, 14), "rate", w)
            bare_after = bare_tokenizer_seconds(templater, texts)
            bare = (bare_before + bare_after) / 2
            print(
                f"bare batch tokenizer: {prompts / bare:,.0f} prompts/s"
                f" ({bare_before:.2f} s, {bare_after:.2f} s)"
            )
            print(f"eaglegen enqueue:     {prompts / full:,.0f} prompts/s ({full:.2f} s)")
            print(f"ratio enqueue/bare = {bare / full:.2f}  (workers: {_label(w)})")
            bare_before = bare_after


def _label(workers: int | None) -> str:
    return "default" if workers is None else str(workers)


def rss(sizes: list[int], admin_url: str, broker: str, workers: int | None) -> None:
    """Print the peak RSS of an enqueue of each size, each in its own process."""
    for n in sizes:
        out = subprocess.run(
            [
                sys.executable,
                *("-m", "bench.enqueue", "rss-child", str(n), admin_url, broker),
                *("--workers", str(workers)),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        result = json.loads(out.strip().splitlines()[-1])
        helpers = result["helper_rss_mb"]
        print(
            f"{n:>9,} prompts: peak RSS {result['max_rss_mb']:.0f} MB"
            + (
                f" (+ {len(helpers)} helper processes, largest {max(helpers):.0f} MB,"
                f" all peaks together {result['max_rss_mb'] + sum(helpers):.0f} MB)"
                if helpers
                else ""
            )
            + f", enqueue {result['seconds']:.1f} s ({n / result['seconds']:,.0f} prompts/s)"
        )


def rss_child(n: int, admin_url: str, broker: str, workers: int | None) -> None:
    """Enqueue ``n`` prompts in this process and print its peak RSS (and its helpers') as JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_short_prompts(Path(tmp) / "prompts.jsonl", n)
        database = scratch_database(admin_url, f"eaglegen_bench_rss_{n}")
        peaks: dict[int, float] = {}
        stop = threading.Event()
        watcher = threading.Thread(target=_watch_descendants, args=(peaks, stop), daemon=True)
        watcher.start()
        try:
            seconds = enqueue_seconds(path, database, scratch_redis(broker, 13), f"rss{n}", workers)
        finally:
            stop.set()
            watcher.join()
    max_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    doc = {"n": n, "max_rss_mb": max_rss_mb, "helper_rss_mb": list(peaks.values())}
    print(json.dumps({**doc, "seconds": seconds}))


def _watch_descendants(peaks: dict[int, float], stop: threading.Event) -> None:
    """Record the peak RSS (MB) of every process below this one until ``stop`` (Linux)."""
    while not stop.wait(0.5):
        for pid in _descendants(os.getpid()):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    peaks[pid] = max(peaks.get(pid, 0.0), int(line.split()[1]) / 1024)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=["rate", "rss", "rss-child"])
    parser.add_argument("args", nargs="*")
    parser.add_argument("--prompts", type=int, default=200_000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--workers", type=_workers, nargs="+", default=[None])
    parser.add_argument("--database-url", default=PG)
    parser.add_argument("--broker-url", default=REDIS)
    ns = parser.parse_args()
    if ns.mode == "rate":
        rate(ns.prompts, ns.database_url, ns.broker_url, ns.workers)
    elif ns.mode == "rss":
        rss(ns.sizes, ns.database_url, ns.broker_url, ns.workers[0])
    else:
        rss_child(int(ns.args[0]), ns.args[1], ns.args[2], ns.workers[0])


def _workers(value: str) -> int | None:
    """A worker count, or "default" for what `eaglegen enqueue` picks."""
    return None if value in ("default", "None") else int(value)


if __name__ == "__main__":
    main()
