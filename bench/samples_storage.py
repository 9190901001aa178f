"""Storage of several samples per prompt (issue 31): what the jobs of k = 4 take in Postgres
against k = 1, and against four copies of the dataset (what four runs, the way before
`samples`, stored), side by side in one database.

    .venv/bin/python -m bench.samples_storage [--rows 2000] [--words 300 1500]

The same prompts (single-turn chats of ``--words`` words, the bundled tokenizer) are
enqueued three ways: ``k=1`` (one sample each), ``k=4`` (``samples = 4``: sample 0 holds the
prompt's ids and messages, the three others name it) and ``4 copies`` (four datasets of one
sample each, every job with its own ids). Per way: the growth of the `jobs` table (heap,
TOAST and indexes: ``pg_total_relation_size``), and the bytes of the prompt columns
(``pg_column_size`` of ``input_ids`` and ``messages``, as stored, compressed or not).

Services: --database-url/--broker-url (default: this machine's Postgres and Redis; a scratch
database eaglegen_bench_samples and Redis db 13).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from sqlalchemy import text

from bench.common import scratch_database, scratch_redis, write_short_prompts
from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR
from models.db import make_engine
from producer.commands import run_enqueue
from producer.plan import DatasetPlan, RunPlan

PG = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS = "redis://127.0.0.1:6379/0"
DATABASE = "eaglegen_bench_samples"
REDIS_DB = 13

_TABLE = "SELECT pg_total_relation_size('jobs')"
_COLUMNS = """
    SELECT count(*) AS jobs, count(j.input_ids) AS holding,
           coalesce(sum(pg_column_size(j.input_ids)), 0) AS ids,
           coalesce(sum(pg_column_size(j.messages)), 0) AS messages
    FROM jobs j JOIN datasets d ON d.id = j.dataset_id JOIN runs r ON r.id = d.run_id
    WHERE r.name = :run
"""
# Label -> (run name, samples, datasets).
WAYS = {"k=1": ("k1", 1, 1), "k=4": ("k4", 4, 1), "4 copies": ("copies", 1, 4)}


def enqueue(settings: Settings, path: Path, run: str, samples: int, datasets: int) -> None:
    plan = RunPlan(
        run=run,
        tokenizer=TOKENIZER_DIR,
        datasets=[
            DatasetPlan(f"d{i}", path, sampling={"max_new_tokens": 4096}, samples=samples)
            for i in range(datasets)
        ],
    )
    run_enqueue(settings, settings.services(), plan, quiet=True, workers=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--words", type=int, nargs=2, default=(300, 1500))
    parser.add_argument("--database-url", default=PG)
    parser.add_argument("--broker-url", default=REDIS)
    args = parser.parse_args()
    url = scratch_database(args.database_url, DATABASE)
    settings = Settings(database_url=url, broker_url=scratch_redis(args.broker_url, REDIS_DB))
    engine = make_engine(url)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_short_prompts(Path(tmp) / "p.jsonl", args.rows, words=tuple(args.words))
        found = {}
        for label, (run, samples, datasets) in WAYS.items():
            with engine.connect() as conn:
                before = int(conn.scalar(text(_TABLE)) or 0)
            enqueue(settings, path, run, samples, datasets)
            with engine.connect() as conn:
                grown = int(conn.scalar(text(_TABLE)) or 0) - before
                found[label] = (conn.execute(text(_COLUMNS), {"run": run}).one(), grown)
    engine.dispose()
    _, base_grown = found["k=1"]
    print(f"{args.rows:,} prompts of {args.words[0]}-{args.words[1]} words (bundled tokenizer)")
    print("| | jobs | jobs holding ids | ids + messages | jobs table growth | ÷ k=1 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for run, (row, grown) in found.items():
        prompt_mb = (row.ids + row.messages) / 1e6
        print(
            f"| {run} | {row.jobs:,} | {row.holding:,} | {prompt_mb:.1f} MB "
            f"| {grown / 1e6:.1f} MB | {grown / base_grown:.2f} |"
        )


if __name__ == "__main__":
    main()
