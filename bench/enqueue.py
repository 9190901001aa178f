"""Producer benchmarks (issue 3).

rate: enqueue rate of N short chat prompts (read, validate, template, tokenize, insert into
      Postgres, publish to Redis) as a ratio to the bare batch-tokenizer rate on the same
      rendered prompts, measured in the same run (bare, enqueue, bare; mean of the bares).
rss:  peak RSS of a process enqueueing N prompts, for several N, each in a fresh process.

Usage: python -m bench.enqueue rate [--prompts 200000]
       python -m bench.enqueue rss [--sizes 100000 1000000]
Services: --database-url/--broker-url (default: this machine's Postgres and Redis).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
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


def enqueue_seconds(path: Path, database_url: str, broker_url: str, run: str) -> float:
    """Seconds for a full enqueue of ``path`` into real Postgres and Redis."""
    settings = Settings(database_url=database_url, broker_url=broker_url, queue=f"bench-{run}")
    plan = RunPlan(
        run=run,
        tokenizer=TOKENIZER_DIR,
        datasets=[DatasetPlan("d", path, sampling={"max_new_tokens": 1024})],
    )
    start = time.perf_counter()
    report = run_enqueue(settings, plan, quiet=True)
    elapsed = time.perf_counter() - start
    assert report.datasets[0].accepted > 0
    return elapsed


def rate(prompts: int, admin_url: str, broker: str) -> None:
    """Print the enqueue/bare-tokenizer rate ratio."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_short_prompts(Path(tmp) / "prompts.jsonl", prompts)
        templater = Templater(TOKENIZER_DIR)
        texts = [templater.render(to_prompt(r.value)) for r in iter_rows(path)]
        database = scratch_database(admin_url, "eaglegen_bench_enqueue")
        bare_a = bare_tokenizer_seconds(templater, texts)
        full = enqueue_seconds(path, database, scratch_redis(broker, 14), "rate")
        bare_b = bare_tokenizer_seconds(templater, texts)
    bare = (bare_a + bare_b) / 2
    print(f"{prompts:,} prompts, mean {sum(map(len, texts)) / len(texts):.0f} chars rendered")
    print(f"bare batch tokenizer: {prompts / bare:,.0f} prompts/s ({bare_a:.2f} s, {bare_b:.2f} s)")
    print(f"eaglegen enqueue:     {prompts / full:,.0f} prompts/s ({full:.2f} s)")
    print(f"ratio enqueue/bare = {bare / full:.2f}")


def rss(sizes: list[int], admin_url: str, broker: str) -> None:
    """Print the peak RSS of an enqueue of each size, each in its own process."""
    for n in sizes:
        out = subprocess.run(
            [sys.executable, "-m", "bench.enqueue", "rss-child", str(n), admin_url, broker],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        result = json.loads(out.strip().splitlines()[-1])
        print(
            f"{n:>9,} prompts: peak RSS {result['max_rss_mb']:.0f} MB, "
            f"enqueue {result['seconds']:.1f} s ({n / result['seconds']:,.0f} prompts/s)"
        )


def rss_child(n: int, admin_url: str, broker: str) -> None:
    """Enqueue ``n`` prompts in this process and print its peak RSS as JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_short_prompts(Path(tmp) / "prompts.jsonl", n)
        database = scratch_database(admin_url, f"eaglegen_bench_rss_{n}")
        seconds = enqueue_seconds(path, database, scratch_redis(broker, 13), f"rss{n}")
    max_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"n": n, "max_rss_mb": max_rss_mb, "seconds": seconds}))


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=["rate", "rss", "rss-child"])
    parser.add_argument("args", nargs="*")
    parser.add_argument("--prompts", type=int, default=200_000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--database-url", default=PG)
    parser.add_argument("--broker-url", default=REDIS)
    ns = parser.parse_args()
    if ns.mode == "rate":
        rate(ns.prompts, ns.database_url, ns.broker_url)
    elif ns.mode == "rss":
        rss(ns.sizes, ns.database_url, ns.broker_url)
    else:
        rss_child(int(ns.args[0]), ns.args[1], ns.args[2])


if __name__ == "__main__":
    main()
