"""Producer benchmarks (issue 3).

rate: enqueue rate of N short chat prompts (read, validate, template, tokenize, insert into
      Postgres, publish to Redis) as a ratio to the bare batch-tokenizer rate on the same
      rendered prompts, measured in the same run (bare, enqueue, bare; mean of the bares).
rss:  peak memory of `eaglegen enqueue` (the command, as a subprocess) for N prompts, for
      several N: the main process's peak RSS, and the largest PSS of it and its helper
      processes together.
stages: CPU per prompt of each stage of the enqueue run alone, in this process, and of the
      Postgres and Redis servers for the insert and publish: the budget that bounds the
      ratio when every process shares the same cores.

Usage: python -m bench.enqueue rate [--prompts 200000] [--workers N ...] [--words MIN MAX]
       python -m bench.enqueue rss [--sizes 100000 1000000] [--workers N]
       python -m bench.enqueue stages [--prompts 50000]
--workers: template in N worker processes (0: in-process); several values are measured
interleaved in one run. Default: what `eaglegen enqueue` does (one per core, for long inputs).
Services: --database-url/--broker-url (default: this machine's Postgres and Redis).
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import psycopg
import redis

from bench.common import scratch_database, scratch_redis, write_short_prompts
from bench.procs import descendants, eaglegen_command
from core.broker import Publisher
from core.settings import Settings
from core.urls import libpq_url
from eaglegen.assets import TOKENIZER_DIR
from models.db import make_engine
from models.records import DatasetSpec, JobBatch, RunSpec
from models.repository import Repository
from producer.commands import run_enqueue
from producer.plan import DatasetPlan, RunPlan
from producer.prepare import Rendered, build_jobs
from producer.readers import iter_rows
from producer.rows import Prompt, RawRow, to_prompt
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
    report = run_enqueue(settings, settings.services(), plan, quiet=True, workers=workers)
    elapsed = time.perf_counter() - start
    assert report.datasets[0].accepted > 0
    return elapsed


def rate(
    prompts: int,
    admin_url: str,
    broker: str,
    workers: list[int | None],
    words: tuple[int, int] = (6, 24),
) -> None:
    """Print the enqueue/bare-tokenizer rate ratio of each worker setting.

    Each round runs bare, then one enqueue per setting, and the ratio of an enqueue is to the
    mean of the bares around it.
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = write_short_prompts(Path(tmp) / "prompts.jsonl", prompts, words=words)
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
    """Print the peak memory of `eaglegen enqueue` (the real command) for each size."""
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            path = write_short_prompts(Path(tmp) / "prompts.jsonl", n)
            env = {
                **os.environ,
                "EAGLEGEN_DATABASE_URL": scratch_database(admin_url, f"eaglegen_bench_rss_{n}"),
                "EAGLEGEN_BROKER_URL": scratch_redis(broker, 13),
                "EAGLEGEN_QUEUE": f"bench-rss-{n}",
            }
            command = [
                *eaglegen_command(),
                *("enqueue", "--json", "--run", f"rss{n}"),
                *("--dataset", "d", "--tokenizer", str(TOKENIZER_DIR), str(path)),
                *(() if workers is None else ("--workers", str(workers))),
            ]
            start = time.perf_counter()
            with subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL) as enqueue:
                peak = _watch(enqueue)
            seconds = time.perf_counter() - start
            if enqueue.returncode != 0:
                raise SystemExit(f"enqueue of {n} prompts failed ({enqueue.returncode})")
        print(
            f"{n:>9,} prompts: main process peak RSS {peak.main_rss_mb:.0f} MB;"
            f" with its {peak.helpers} helper processes, PSS together {peak.all_pss_mb:.0f} MB"
            f" (enqueue {seconds:.1f} s, {n / seconds:,.0f} prompts/s)"
        )


@dataclass
class _Peak:
    main_rss_mb: float = 0.0
    all_pss_mb: float = 0.0
    helpers: int = 0


def _watch(process: subprocess.Popen[bytes]) -> _Peak:
    """Sample a process tree's memory until the process ends (Linux /proc).

    The main process's RSS high-water mark comes from the kernel (VmHWM); the tree's total is
    the largest sum of PSS seen at one instant: PSS splits pages shared between processes (the
    workers share the pages of the process they forked from), so they count once.
    """
    peak = _Peak()
    while process.poll() is None:
        tree = [process.pid, *descendants(process.pid)]
        peak.helpers = max(peak.helpers, len(tree) - 1)
        peak.all_pss_mb = max(
            peak.all_pss_mb, sum(_proc_mb(pid, "smaps_rollup", "Pss") for pid in tree)
        )
        peak.main_rss_mb = max(peak.main_rss_mb, _proc_mb(process.pid, "status", "VmHWM"))
        time.sleep(0.05)
    return peak


def _proc_mb(pid: int, file: str, field: str) -> float:
    """A "Field: N kB" line of /proc/PID/FILE in MB (0 once the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/{file}").read_text()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def stages(prompts: int, admin_url: str, broker: str) -> None:
    """Print each stage's CPU per prompt (this process's, plus the servers' where they work)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_short_prompts(Path(tmp) / "prompts.jsonl", prompts)
        templater = Templater(TOKENIZER_DIR)
        database = scratch_database(admin_url, "eaglegen_bench_stages")
        redis_url = scratch_redis(broker, 14)
        costs = stage_costs(path, templater, database, redis_url)
    tokenizer = costs["tokenize (Rust, fast variant)"]
    total = sum(costs.values())
    print(f"{prompts:,} prompts; CPU per prompt of each stage, one stage at a time:")
    for name, micros in costs.items():
        print(f"  {name:<38} {micros:6.1f} us")
    print(f"  {'all stages':<38} {total:6.1f} us")
    print(
        f"tokenizer share of all CPU: {tokenizer / total:.2f}  (the enqueue/bare ratio cannot"
        " exceed it where all processes share the same cores)"
    )


def stage_costs(path: Path, templater: Templater, database: str, broker: str) -> dict[str, float]:
    """CPU microseconds per prompt of each enqueue stage, each run alone over all prompts."""
    clock = _StageClock()
    lines = clock.run("read lines", lambda: list(iter_rows(path, decode=False)))
    n = len(lines)
    rows = clock.run("decode JSON", lambda: [r.decoded() for r in lines])
    chats = clock.run("validate rows", lambda: [to_prompt(r.value) for r in rows])
    rendered = clock.run(
        "render (apply_chat_template)", lambda: _batched(templater.render_many, chats)
    )
    texts = [str(text) for text in rendered]  # all render: these rows are valid
    ids = clock.run(
        "tokenize (Rust, fast variant)", lambda: _batched(templater.encode_batch, texts)
    )
    jobs = clock.run(
        "build jobs (pack, sha256, JSON)",
        lambda: _job_batches(templater, rows, chats, texts, ids),
    )
    engine = make_engine(database)
    repo = Repository(engine)
    run_id = repo.ensure_run(RunSpec("stages", "t", "t", "c", "m"))
    dataset_id = repo.ensure_dataset(run_id, DatasetSpec("d", "s", {}))
    with _server_cpu(database, broker) as servers:
        new = clock.run(
            "insert (COPY, client)",
            lambda: [repo.insert_jobs(dataset_id, b, expect_new=True) for b in jobs],
        )
        clock.costs["insert (Postgres server)"] = servers.postgres()
        publisher = Publisher(broker, "bench-stages")
        clock.run("publish (envelopes, LPUSH)", lambda: [publisher.publish(ids) for ids in new])
        clock.costs["publish (Redis server)"] = servers.redis()
    publisher.close()
    engine.dispose()
    return {name: seconds / n * 1e6 for name, seconds in clock.costs.items()}


class _StageClock:
    """Runs stages and keeps the CPU seconds (all threads of this process) each took."""

    def __init__(self) -> None:
        self.costs: dict[str, float] = {}

    def run(self, name: str, stage: Callable[[], T]) -> T:
        # The collector off: here every stage's output stays alive, and full collections
        # over it would be charged to the stage; the enqueue frees each batch as it goes.
        gc.disable()
        try:
            start = time.process_time()
            result = stage()
            self.costs[name] = time.process_time() - start
        finally:
            gc.enable()
        return result


T = TypeVar("T")
U = TypeVar("U")


def _batched(fn: Callable[[Sequence[T]], list[U]], items: list[T]) -> list[U]:
    return [out for i in range(0, len(items), BATCH) for out in fn(items[i : i + BATCH])]


def _job_batches(
    templater: Templater,
    rows: list[RawRow],
    chats: list[Prompt],
    texts: list[str],
    ids: list[list[int]],
) -> list[JobBatch]:
    """The jobs as the producer builds them, batch by batch."""
    rendered = [(row, chat, text, None) for row, chat, text in zip(rows, chats, texts, strict=True)]
    opens = templater.opens_reasoning
    return [
        build_jobs(Rendered(rendered[i : i + BATCH], []), ids[i : i + BATCH], None, 0, opens).jobs
        for i in range(0, len(rendered), BATCH)
    ]


class _ServerClock:
    """CPU seconds the Postgres backend and the Redis server spent since the last reading."""

    def __init__(self, database: str, broker: str) -> None:
        self._redis = redis.Redis.from_url(broker)
        self._pg = psycopg.connect(libpq_url(database))
        self._last_pg = self._backends_cpu()
        self._last_redis = self._redis_cpu()

    def postgres(self) -> float:
        now = self._backends_cpu()
        spent, self._last_pg = now - self._last_pg, now
        return spent

    def redis(self) -> float:
        now = self._redis_cpu()
        spent, self._last_redis = now - self._last_redis, now
        return spent

    def close(self) -> None:
        self._pg.close()
        self._redis.close()

    def _backends_cpu(self) -> float:
        """CPU of the server processes of this database (Linux /proc), excluding this probe."""
        pids = self._pg.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid()"
        ).fetchall()
        return sum(_process_cpu(pid) for (pid,) in pids)

    def _redis_cpu(self) -> float:
        info = self._redis.info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


@contextmanager
def _server_cpu(database: str, broker: str) -> Iterator[_ServerClock]:
    clock = _ServerClock(database, broker)
    try:
        yield clock
    finally:
        clock.close()


def _process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=["rate", "rss", "stages"])
    parser.add_argument("--prompts", type=int, default=200_000)
    parser.add_argument("--words", type=int, nargs=2, default=[6, 24], metavar=("MIN", "MAX"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--workers", type=_workers, nargs="+", default=[None])
    parser.add_argument("--database-url", default=PG)
    parser.add_argument("--broker-url", default=REDIS)
    ns = parser.parse_args()
    if ns.mode == "rate":
        rate(ns.prompts, ns.database_url, ns.broker_url, ns.workers, tuple(ns.words))
    elif ns.mode == "stages":
        stages(ns.prompts, ns.database_url, ns.broker_url)
    else:
        rss(ns.sizes, ns.database_url, ns.broker_url, ns.workers[0])


def _workers(value: str) -> int | None:
    """A worker count, or "default" for what `eaglegen enqueue` picks."""
    return None if value in ("default", "None") else int(value)


if __name__ == "__main__":
    main()
