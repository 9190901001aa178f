"""Export benchmark (issue 12): rows/s and peak memory of `eaglegen export` for N rows.

For each size, a scratch database gets one run of N done jobs with synthetic generations
(random ids; prompt and output lengths uniform in the given ranges), inserted straight:
jobs through the repository's COPY, generations by COPY. Then the installed `eaglegen
export` runs as a subprocess, as users run it, while its peak RSS (the kernel's high-water
mark, VmHWM) is sampled. Two sizes in one run show whether memory stays flat.

With ``--format conversations`` (or ``--only-valid``) the rows must decode: the run points at
the bundled tokenizer, ids are drawn from its ordinary range, each output is reasoning, the
think-end token, an answer and the stop token, and each job stores a one-turn prompt. The
round trip then re-templates every row (its ids are random, so it differs in the prompt).

Usage: python -m bench.export [--sizes 100000 1000000] [--prompt-tokens 64 256]
       [--output-tokens 128 1024] [--writer parquet|jsonl|hf-dataset] [--shard-mb 256]
       [--format tokens|conversations] [--only-valid]
       [--recorded-minutes-ago 60] [--database-url postgresql://postgres@127.0.0.1:5432/postgres]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import psycopg
from psycopg.types.json import Jsonb

from bench.common import scratch_database
from bench.procs import eaglegen_command, peak_rss_samples
from core.urls import libpq_url
from eaglegen.assets import TOKENIZER_DIR, special_ids
from models.db import make_engine
from models.records import DatasetSpec, JobBatch, RunSpec, prompt_sha256
from models.repository import Repository

PG = "postgresql://postgres@127.0.0.1:5432/postgres"
RUN = "bench-export"
_BATCH = 10_000
_COPY_GENERATIONS = (
    "COPY generations (job_id, dataset_id, output_ids, finish_type, prompt_tokens,"
    " completion_tokens, cached_tokens, e2e_latency, server, meta_info) FROM STDIN (FORMAT BINARY)"
)
_TYPES = (
    "bigint",
    "bigint",
    "bytea",
    "text",
    "integer",
    "integer",
    "integer",
    "float8",
    "text",
    "jsonb",
)
_PROMPT = json.dumps(
    {"messages": [{"role": "user", "content": "Explain the tides."}], "tools": None}
)


class Ids:
    """Random ids: any below 150,000 (tokens only), or the bundled tokenizer's ordinary ones
    shaped as a reasoning generation (decodable, for conversations)."""

    def __init__(self, rng: np.random.Generator, *, decodable: bool) -> None:
        self.rng = rng
        self.special = special_ids() if decodable else None
        self.lo = 16 if decodable else 0  # the bundled tokenizer's specials are 0..15
        self.hi = self.special.vocab_size if self.special is not None else 150_000

    def prompt(self, lengths: tuple[int, int]) -> bytes:
        return self._random(lengths).tobytes()

    def output(self, lengths: tuple[int, int]) -> bytes:
        ids = self._random(lengths)
        if self.special is not None and len(ids) >= 3:
            ids[len(ids) * 3 // 4] = self.special.think_end
            ids[-1] = self.special.stop
        return ids.tobytes()

    def _random(self, lengths: tuple[int, int]) -> np.ndarray:
        length = int(self.rng.integers(lengths[0], lengths[1] + 1))
        return self.rng.integers(self.lo, self.hi, length, dtype="<i4")


def populate(
    url: str,
    n: int,
    prompt: tuple[int, int],
    output: tuple[int, int],
    minutes_ago: float,
    *,
    decodable: bool = False,
) -> int:
    """N done jobs with generations in the database at ``url``, recorded ``minutes_ago``;
    the total token count."""
    engine = make_engine(url, pool_size=1)
    repo = Repository(engine)
    rng = Ids(np.random.default_rng(0), decodable=decodable)
    tokens = 0
    tokenizer = str(TOKENIZER_DIR) if decodable else "/tok"
    try:
        run_id = repo.ensure_run(RunSpec(RUN, tokenizer, "a" * 64, "b" * 64, "bench"))
        dataset_id = repo.ensure_dataset(run_id, DatasetSpec("d", "x", {"max_new_tokens": 1024}))
        plain = libpq_url(url)
        with psycopg.connect(plain) as conn:
            for start in range(0, n, _BATCH):
                count = min(_BATCH, n - start)
                batch = JobBatch()
                for i in range(start, start + count):
                    packed = rng.prompt(prompt)
                    messages = _PROMPT if decodable else "[]"
                    batch.add(
                        i, prompt_sha256(packed), packed, len(packed) // 4, messages, decodable
                    )
                ids = repo.insert_jobs(dataset_id, batch, expect_new=True)
                tokens += sum(batch.prompt_tokens) + _copy_generations(
                    conn, rng, dataset_id, ids, output
                )
                conn.commit()
            conn.execute("UPDATE jobs SET state = 'done', finished_at = now()")
            # Rows recorded within the export's resume margin are remembered one by one in
            # its manifest (exporter.export); a run exported after it ended has none.
            conn.execute(
                "UPDATE generations SET created_at = now() - make_interval(secs => %s)",
                (minutes_ago * 60,),
            )
            conn.commit()
    finally:
        engine.dispose()
    return tokens


def _copy_generations(
    conn: psycopg.Connection[tuple[object, ...]],
    rng: Ids,
    dataset_id: int,
    job_ids: list[int],
    output: tuple[int, int],
) -> int:
    tokens = 0
    with conn.cursor() as cursor, cursor.copy(_COPY_GENERATIONS) as copy:
        copy.set_types(_TYPES)
        for job_id in job_ids:
            packed = rng.output(output)
            n = len(packed) // 4
            tokens += n
            copy.write_row((job_id, dataset_id, packed, "stop", 0, n, 0, 1.0, "bench", Jsonb({})))
    return tokens


def measure(
    url: str, out: Path, writer: str, shard_mb: float, extra: list[str]
) -> tuple[float, float, int]:
    """Run `eaglegen export`: (seconds, peak RSS MB, rows exported)."""
    flags = {"parquet": [], "jsonl": ["--jsonl"], "hf-dataset": ["--hf-dataset"]}[writer]
    flags = [*flags, *extra]
    command = [
        *eaglegen_command(),
        *("export", RUN, str(out), "--json", "--shard-mb", str(shard_mb), *flags),
    ]
    env = {**os.environ, "EAGLEGEN_DATABASE_URL": url}
    report = out.with_name("report.json")  # a file: a pipe left unread would block it
    start = time.perf_counter()
    with report.open("wb") as stdout, subprocess.Popen(command, env=env, stdout=stdout) as process:
        peak = max(peak_rss_samples(process), default=0.0)
    seconds = time.perf_counter() - start
    if process.returncode != 0:
        raise SystemExit(f"eaglegen export failed ({process.returncode})")
    return seconds, peak, int(json.loads(report.read_bytes())["rows"])


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[64, 256])
    parser.add_argument("--output-tokens", type=int, nargs=2, default=[128, 1024])
    parser.add_argument("--writer", choices=["parquet", "jsonl", "hf-dataset"], default="parquet")
    parser.add_argument("--shard-mb", type=float, default=256.0)
    parser.add_argument("--format", choices=["tokens", "conversations"], default="tokens")
    parser.add_argument("--only-valid", action="store_true")
    parser.add_argument("--recorded-minutes-ago", type=float, default=60.0)
    parser.add_argument("--database-url", default=PG)
    ns = parser.parse_args()
    decodable = ns.format == "conversations" or ns.only_valid
    extra = ["--format", ns.format] + (["--only-valid"] if ns.only_valid else [])
    writer = "jsonl" if ns.format == "conversations" else ns.writer
    for n in ns.sizes:
        url = scratch_database(ns.database_url, f"eaglegen_bench_export_{n}")
        start = time.perf_counter()
        tokens = populate(
            url,
            n,
            tuple(ns.prompt_tokens),
            tuple(ns.output_tokens),
            ns.recorded_minutes_ago,
            decodable=decodable,
        )
        setup = time.perf_counter() - start
        with tempfile.TemporaryDirectory() as tmp:
            seconds, peak, rows = measure(url, Path(tmp) / "out", writer, ns.shard_mb, extra)
            written = sum(f.stat().st_size for f in (Path(tmp) / "out").rglob("*"))
        if rows != n:
            raise SystemExit(f"exported {rows} rows of {n}")
        print(
            f"{n:>9,} rows ({tokens / n:,.0f} tokens/row, inserted in {setup:.0f} s): "
            f"export {seconds:.1f} s, {n / seconds:,.0f} rows/s, "
            f"{tokens / seconds / 1e6:.1f} M tokens/s, peak RSS {peak:.0f} MB, "
            f"{written / 1e6:,.0f} MB written ({ns.format}, {writer}"
            f"{', --only-valid' if ns.only_valid else ''})"
        )


if __name__ == "__main__":
    main()
