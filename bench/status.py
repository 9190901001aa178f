"""Status benchmark (issue 11): what `eaglegen status` costs on a large run.

A scratch database gets one run of N done jobs with N generations over 9 datasets, the
generations recorded evenly over the last ``--hours`` (a long run's spread; the status
windows read only their last minutes). Built in SQL (generate_series), the counters filled
as migration 0007 fills them. Then, side by side, each timed ``--repeat`` times:

- ``scan``: the repository's `counts()`, the jobs-by-state scan `status` ran before 0007
  (and `audit` still runs);
- ``status``: `Repository.status()`, everything `eaglegen status` reads from Postgres;
- ``cli``: the installed `eaglegen status --json` as a user runs it (Python start-up and
  imports included).

Usage: python -m bench.status [--jobs 1000000] [--hours 20] [--repeat 5]
       [--database-url postgresql://postgres@127.0.0.1:5432/postgres]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import psycopg

from bench.common import scratch_database
from core.urls import libpq_url
from models.db import make_engine
from models.records import DatasetSpec, RunSpec
from models.repository import Repository

PG = "postgresql://postgres@127.0.0.1:5432/postgres"
RUN = "bench-status"
DATASETS = 9

_JOBS = """
INSERT INTO jobs (dataset_id, row_index, prompt_sha256, input_ids, prompt_tokens, messages,
                  state, attempts, finished_at)
SELECT %(first)s + i %% %(n_datasets)s, i, sha256(int8send(i)), '\\x01000000', 1000, '{}',
       'done', 1, now()
FROM generate_series(1, %(jobs)s) AS i
"""
_GENERATIONS = """
INSERT INTO generations (job_id, dataset_id, output_ids, finish_type, prompt_tokens,
                         completion_tokens, cached_tokens, e2e_latency, server, meta_info,
                         created_at)
SELECT id, dataset_id, '\\x02000000', 'stop', 1000, 3000 + (id %% 1000), 0, 60.0,
       'gpu-' || (id %% 8), '{}',
       now() - make_interval(secs => (id %% %(jobs)s)::float8 * %(spread_s)s / %(jobs)s)
FROM jobs
"""


def populate(url: str, jobs: int, hours: float) -> None:
    """The run, its datasets, N done jobs and their generations; counters filled."""
    engine = make_engine(url, pool_size=1)
    repo = Repository(engine)
    run_id = repo.ensure_run(RunSpec(RUN, "/tok", "a" * 64, "b" * 64, "bench"))
    ids = [
        repo.ensure_dataset(run_id, DatasetSpec(f"d{i}", "x", {"max_new_tokens": 4096}))
        for i in range(DATASETS)
    ]
    engine.dispose()
    plain = libpq_url(url)
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        params = {"first": min(ids), "n_datasets": DATASETS, "jobs": jobs}
        conn.execute(_JOBS, params)
        conn.execute(_GENERATIONS, {"jobs": jobs, "spread_s": hours * 3600})
        # The counters exactly as migration 0007 fills those of an existing run.
        migration = importlib.import_module("models.migrations.versions.0007_status_counters")
        conn.execute(migration.FILL_COUNTERS)
        conn.execute("VACUUM ANALYZE")


def timed(action: Callable[[], Any], repeat: int) -> list[float]:
    """Seconds each of ``repeat`` calls took (one warm-up call first)."""
    action()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return times


def cli(url: str) -> None:
    """`eaglegen status --json` in a fresh process, as a user runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLEGEN_")}
    subprocess.run(
        [sys.executable, "-m", "eaglegen", "status", "--json"],
        env={**env, "EAGLEGEN_DATABASE_URL": url},
        check=True,
        capture_output=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--hours", type=float, default=20.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--database-url", default=PG)
    args = parser.parse_args()
    url = scratch_database(args.database_url, "eaglegen_bench_status")
    start = time.perf_counter()
    populate(url, args.jobs, args.hours)
    print(
        f"built {args.jobs:,} jobs + {args.jobs:,} generations"
        f" in {time.perf_counter() - start:.0f} s"
    )
    engine = make_engine(url, pool_size=2)
    repo = Repository(engine)
    snapshot = repo.status(RUN)
    recent = sum(d.windows[-1].completions for d in snapshot.datasets)
    print(f"generations in the last {snapshot.windows_s[-1]} s: {recent:,}")
    results = {
        "scan": timed(repo.counts, args.repeat),
        "status": timed(lambda: repo.status(), args.repeat),
        "cli": timed(lambda: cli(url), args.repeat),
    }
    engine.dispose()
    medians = {name: statistics.median(times) for name, times in results.items()}
    for name, times in results.items():
        print(f"{name:>7}: median {medians[name] * 1000:8.1f} ms  (runs: "
              + ", ".join(f"{t * 1000:.0f}" for t in times) + ")")  # fmt: skip
    print(f"scan / status: {medians['scan'] / medians['status']:.0f}x")


if __name__ == "__main__":
    main()
