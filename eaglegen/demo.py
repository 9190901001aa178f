"""`eaglegen demo`: the whole pipeline on one machine with nothing but pip-installed parts."""

from __future__ import annotations

import contextlib
import shlex
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from core.settings import Services, Settings
from core.urls import redact
from eaglegen.assets import SAMPLE_DATASET, TOKENIZER_DIR
from eaglegen.report.status import totals
from eaglegen.sim import SimConfig, SimServer
from eaglegen.stack import (
    Child,
    EmbeddedPostgres,
    EmbeddedRedis,
    flower_argv,
    flower_env,
    free_port,
    spawn,
)
from models.db import make_engine, upgrade
from models.repository import Repository
from producer.commands import run_enqueue
from producer.plan import DatasetPlan, RunPlan


@dataclass(frozen=True)
class DemoOptions:
    """Knobs of the demo."""

    concurrency: int = 64
    max_new_tokens: int = 1024
    timeout_s: float = 600.0


@contextlib.contextmanager
def embedded_services(settings: Settings) -> Iterator[Services]:
    """The user's services when configured, embedded ones (stopped afterwards) otherwise."""
    with contextlib.ExitStack() as stack:
        database_url, broker_url = settings.database_url, settings.broker_url
        if database_url is None:
            postgres = EmbeddedPostgres(settings.data_dir)
            database_url = postgres.start()
            stack.callback(postgres.stop)
        if broker_url is None:
            redis_server = EmbeddedRedis(settings.data_dir)
            broker_url = redis_server.start()
            stack.callback(redis_server.stop)
        yield Services(database_url, broker_url)


def _children(settings: Settings, live: Services, sim_url: str, concurrency: int) -> list[Child]:
    env = {
        "EAGLEGEN_DATABASE_URL": live.database_url,
        "EAGLEGEN_BROKER_URL": live.broker_url,
        "EAGLEGEN_DATA_DIR": str(settings.data_dir),
    }
    logs = settings.data_dir / "logs"
    worker = spawn(
        "worker",
        [
            sys.executable,
            "-m",
            "eaglegen",
            "worker",
            "--server",
            f"sim={sim_url}",
            "--concurrency",
            str(concurrency),
        ],
        env,
        logs / "worker.log",
    )
    flower = spawn(
        "flower",
        flower_argv("127.0.0.1", free_port()),
        flower_env(live.broker_url),
        logs / "flower.log",
    )
    return [worker, flower]


def run_demo(settings: Settings, options: DemoOptions) -> dict[str, Any]:
    """Run the demo end to end and return its summary document."""
    console = Console(stderr=True)
    run = "demo-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S-%f")
    with embedded_services(settings) as live, SimServer(SimConfig(seed=0)) as sim:
        upgrade(live.database_url)
        children = _children(settings, live, sim.url, options.concurrency)
        engine = make_engine(live.database_url, pool_size=1)
        try:
            started = time.monotonic()
            plan = RunPlan(
                run=run,
                tokenizer=TOKENIZER_DIR,
                datasets=[
                    DatasetPlan(
                        "chat", SAMPLE_DATASET, sampling={"max_new_tokens": options.max_new_tokens}
                    )
                ],
            )
            run_enqueue(settings, live, plan, quiet=True)
            jobs = _wait(Repository(engine), run, options.timeout_s, console, children[0])
            elapsed = time.monotonic() - started
            counts = Repository(engine).counts(run)
            conversations: Counter[str] = Counter()
            for dataset in Repository(engine).status(run).datasets:
                conversations.update(dataset.conversations)
        finally:
            for child in children:
                child.stop()
            engine.dispose()
    # The database the demo started itself is stopped by now: its URL would lead nowhere.
    database = redact(live.database_url) if settings.database_url is not None else None
    return _summary(settings, database, run, counts, jobs, elapsed, dict(conversations))


def _wait(
    repo: Repository, run: str, timeout_s: float, console: Console, worker: Child
) -> dict[str, int]:
    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    deadline = time.monotonic() + timeout_s
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("jobs", total=None)
        while True:
            jobs = totals(repo.counts(run))
            bar.update(task, total=jobs["total"], completed=jobs["done"] + jobs["failed"])
            # A conversation between two turns has no job open: its next one is coming.
            if jobs["queued"] + jobs["running"] == 0 and not repo.conversations_under_way(run):
                return jobs
            if worker.process.poll() is not None:
                console.print("[red]the worker exited; see its log under the data dir[/]")
                return jobs
            if time.monotonic() > deadline:
                console.print(f"[red]timed out after {timeout_s:.0f} s[/]")
                return jobs
            time.sleep(0.25)


def _summary(
    settings: Settings,
    database: str | None,
    run: str,
    counts: Any,
    jobs: dict[str, int],
    elapsed: float,
    conversations: dict[str, int],
) -> dict[str, Any]:
    prompt = sum(c.prompt_tokens for c in counts)
    completion = sum(c.completion_tokens for c in counts)
    rate = completion / elapsed if elapsed > 0 else 0.0
    if database is not None:
        where = f"run {run!r} in {database} (data dir {settings.data_dir})"
    else:
        again = f"eaglegen up --data-dir {shlex.quote(str(settings.data_dir))}"
        where = (
            f"run {run!r} kept in {settings.data_dir}, its embedded services stopped "
            f"(`{again}` serves it again)"
        )
    # Its multi-turn rows are answered turn by turn (turns = "all"): how they ended.
    ended = ", ".join(
        f"{k.removeprefix('ended: ')} {n}"
        for k, n in sorted(conversations.items())
        if k.startswith("ended")
    )
    talks = (
        f" ({conversations.get('done', 0)} conversations answered to the end"
        + (f"; ended early: {ended}" if ended else "")
        + ")"
        if conversations
        else ""
    )
    line = (
        f"demo: {jobs['done']}/{jobs['total']} jobs done{talks}, {jobs['failed']} failed; "
        f"{prompt:,} prompt + {completion:,} completion tokens in {elapsed:.1f} s "
        f"({rate:,.0f} tok/s); {where}"
    )
    return {
        "run": run,
        "jobs": jobs,
        "conversations": conversations,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(rate, 1),
        "database": database,
        "data_dir": str(settings.data_dir.resolve()),
        "summary_line": line,
    }
