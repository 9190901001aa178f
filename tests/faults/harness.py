"""Worker subprocesses, private services and exact end-of-run checks for the fault tests."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import redis
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError

from core import heartbeat
from core.broker import Publisher
from core.heartbeat import Heartbeat
from core.sampling import complete
from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR, special_ids
from eaglegen.sim import SimConfig
from eaglegen.stack import EmbeddedPostgres, EmbeddedRedis, free_port
from models.db import make_engine
from models.records import DatasetSpec, NewJob, RunSpec
from models.repository import Repository
from models.schema import Job
from models.states import JobState
from tests.helpers import InspectRepository, settled_states

T = TypeVar("T")

# Short intervals so that a lost worker, message or connection is noticed within seconds.
FAST_KNOBS: dict[str, Any] = {
    "lease_seconds": 4,
    "reconcile_interval_s": 1.0,
    "republish_after_s": 1.5,
    "heartbeat_interval_s": 0.5,
    "health_interval_s": 0.5,
    "slot_lease_seconds": 6.0,
    "slot_wait_s": 1.0,
    "retry_base_s": 0.05,
    "retry_cap_s": 0.5,
    "budget_defer_s": 0.1,
    "shutdown_grace_s": 1.0,
    "request_timeout_s": 30.0,
    "max_attempts": 5,
}
# What a worker subprocess reads from EAGLEGEN_<NAME> (the servers come as --server flags).
_ENV_KNOBS = ("database_url", "broker_url", "queue", "data_dir", "worker_engine", *FAST_KNOBS)
_EXPIRED = re.compile(r"'expired_leases': (\d+)")
_REPUBLISHED = re.compile(r"'republished': (\d+)")
IDS = special_ids(TOKENIZER_DIR)


def prompt_ids(i: int, salt: int) -> list[int]:
    """A distinct templated-looking prompt: BOS, 12 to 31 ordinary ids, then <think>."""
    body = [100 + (i * 7919 + k * 31 + salt) % 3900 for k in range(12 + i % 20)]
    return [IDS.bos, *body, IDS.think_start]


def seed_jobs(
    settings: Settings,
    n: int,
    *,
    dataset: str = "d",
    max_new_tokens: int = 16,
    budget: int | None = None,
    reserve: str | None = None,
) -> list[int]:
    """Insert ``n`` jobs and wake the feeder: what `eaglegen enqueue` does, untemplated
    (``reserve``: the dataset's reserve policy, None: the default)."""
    assert settings.broker_url is not None
    repo = make_repo(settings)
    try:
        run_id = repo.ensure_run(
            RunSpec(
                "run",
                str(TOKENIZER_DIR),
                "a" * 64,
                "b" * 64,
                SimConfig().model_path,  # what the simulators serve
                think_end_id=IDS.think_end,
            )
        )
        sampling = complete({"max_new_tokens": max_new_tokens}, [IDS.im_end])
        spec = DatasetSpec(
            dataset, f"{dataset}.jsonl", sampling, budget_tokens=budget, reserve=reserve
        )
        dataset_id = repo.ensure_dataset(run_id, spec)
        salt = zlib.crc32(dataset.encode())
        jobs = [
            NewJob(i, prompt_ids(i, salt), [{"role": "user", "content": f"q{i}"}], True)
            for i in range(n)
        ]
        ids = repo.insert_jobs(dataset_id, jobs)
    finally:
        repo.engine.dispose()
    assert len(ids) == n, f"{len(ids)} of {n} prompts were new"
    with Publisher(settings.broker_url, settings.queue) as publisher:
        publisher.wake_feeder()  # the workers' feeder publishes them
    return ids


def make_repo(settings: Settings) -> Repository:
    """A small pooled repository for polling from the test thread."""
    assert settings.database_url is not None
    return InspectRepository(make_engine(settings.database_url, pool_size=2))


def fault_settings(
    database_url: str, broker_url: str, tmp_path: Path, worker_engine: str
) -> Settings:
    """Settings of one fault test: its services, its own queue, its workers' engine and the
    fast knobs."""
    return Settings(
        worker_engine=worker_engine,
        database_url=database_url,
        broker_url=broker_url,
        data_dir=tmp_path / "data",
        queue="eaglegen-faults",
        worker_concurrency=8,
        **FAST_KNOBS,
    )


def worker_env(settings: Settings) -> dict[str, str]:
    """The environment of a worker subprocess: the parent's, minus EAGLEGEN_*, plus knobs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLEGEN_")}
    env["PYTHONUNBUFFERED"] = "1"
    for name in _ENV_KNOBS:
        env[f"EAGLEGEN_{name.upper()}"] = str(getattr(settings, name))
    return env


@dataclass
class WorkerProcess:
    """One ``python -m eaglegen worker`` subprocess and its log file."""

    label: str
    process: subprocess.Popen[bytes]
    log_path: Path
    servers: list[str]

    @property
    def pid(self) -> int:
        """The process id."""
        return self.process.pid

    def running(self) -> bool:
        """Whether the process has not exited."""
        return self.process.poll() is None

    def send(self, signum: signal.Signals) -> None:
        """Send a signal if the process still runs."""
        if self.running():
            self.process.send_signal(signum)

    def log(self) -> str:
        """Everything it wrote."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, lines: int = 30) -> str:
        """The last lines of its log, after its CRITICAL lines (why it stopped, if it did)."""
        text = self.log().splitlines()
        critical = [line for line in text if "CRITICAL" in line][:5]
        return "\n".join([*critical, "...", *text[-lines:]])


@dataclass
class Fleet:
    """The worker subprocesses of one test; whatever still runs is killed at teardown."""

    settings: Settings
    servers: list[str]
    log_dir: Path
    workers: list[WorkerProcess] = field(default_factory=list)
    # Workers that exited on their own and were replaced, as a supervisor would.
    crashed: list[str] = field(default_factory=list)
    _ended: set[str] = field(default_factory=set)

    @property
    def concurrency(self) -> int:
        """Threads per worker process."""
        return self.settings.worker_concurrency

    def start(self, *, servers: list[str] | None = None) -> WorkerProcess:
        """Start one worker and return once its heartbeat is in Redis."""
        label = f"w{len(self.workers)}"
        log_path = self.log_dir / f"{label}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        servers = servers or self.servers
        flags = [f"--server={s}" for s in servers]
        argv = [sys.executable, "-m", "eaglegen", "worker", *flags]
        argv.append(f"--concurrency={self.concurrency}")
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                argv,
                env=worker_env(self.settings),
                cwd=self.log_dir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        worker = WorkerProcess(label, process, log_path, servers)
        self.workers.append(worker)
        self.wait_alive(worker)
        return worker

    def wait_alive(self, worker: WorkerProcess, timeout_s: float = 60.0) -> None:
        """Block until ``worker`` writes a heartbeat (fail at once if it exits)."""

        def beating() -> bool:
            assert worker.running(), f"worker {worker.label} exited\n{worker.tail()}"
            return self.heartbeat(worker) is not None

        wait_for(beating, timeout_s, f"heartbeat of {worker.label}", self.tails)

    def heartbeat(self, worker: WorkerProcess) -> Heartbeat | None:
        """The worker's latest heartbeat record, or None."""
        assert self.settings.broker_url is not None
        beats = heartbeat.alive(self.settings.broker_url, None, 5.0)
        return next((b for b in beats if b.pid == worker.pid), None)

    def kill(self, worker: WorkerProcess) -> None:
        """SIGKILL ``worker`` and reap it."""
        self._ended.add(worker.label)
        worker.send(signal.SIGKILL)
        worker.process.wait(timeout=30)

    def stop(self, worker: WorkerProcess) -> None:
        """SIGTERM ``worker``: it shuts down on its own."""
        self._ended.add(worker.label)
        worker.send(signal.SIGTERM)

    def replace_crashed(self) -> None:
        """Start a replacement for every worker that exited unasked, as systemd would."""
        for worker in self.workers:
            if worker.label not in self._ended and not worker.running():
                self._ended.add(worker.label)
                self.crashed.append(f"{worker.label} (exit {worker.process.returncode})")
                self.start(servers=worker.servers)

    def running(self) -> list[WorkerProcess]:
        """The workers that have not exited."""
        return [w for w in self.workers if w.running()]

    def close(self) -> None:
        """Kill and reap every worker still running."""
        for worker in self.workers:
            self.kill(worker)

    def tails(self) -> str:
        """The tail of every worker's log, for assertion messages."""
        return "\n".join(
            f"--- {w.label} (pid {w.pid}, exit {w.process.poll()}) ---\n{w.tail()}"
            for w in self.workers
        )

    def log_count(self, text: str) -> int:
        """How many times ``text`` occurs in the worker logs."""
        return sum(w.log().count(text) for w in self.workers)

    def log_total(self, pattern: re.Pattern[str]) -> int:
        """Sum of the first group of ``pattern`` over every worker log."""
        return sum(int(n) for w in self.workers for n in pattern.findall(w.log()))

    def reconciler_totals(self) -> dict[str, int]:
        """Leases expired and messages republished by the reconcilers, from the logs."""
        return {
            "expired_leases": self.log_total(_EXPIRED),
            "republished": self.log_total(_REPUBLISHED),
        }


def wait_for(
    check: Callable[[], T | None],
    timeout_s: float,
    what: str,
    diagnostics: Callable[[], str],
    every_s: float = 0.1,
) -> T:
    """Poll ``check`` every ``every_s`` until it returns something truthy; outages of a
    service are retried."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        try:
            value = check()
            if value:
                return value
        except (DBAPIError, redis.RedisError) as exc:  # a service may be down on purpose
            last_error = exc
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout_s:.0f} s waiting for {what} "
                f"(last service error: {last_error})\n{diagnostics()}"
            )
        time.sleep(every_s)


def state_counts(repo: Repository) -> Counter[str]:
    """Jobs by state over every dataset, states with no job left out."""
    counts: Counter[str] = Counter()
    for dataset in repo.counts():
        counts.update({state: n for state, n in dataset.states.items() if n})
    return counts


def running_by_pid(repo: Repository) -> dict[int, list[int]]:
    """Ids of the jobs in state running, by the pid of the worker holding them (one query)."""
    stmt = select(Job.id, Job.worker).where(Job.state == JobState.RUNNING.value)
    held: dict[int, list[int]] = {}
    with repo.engine.connect() as conn:
        for job_id, worker in conn.execute(stmt):
            pid = str(worker).rsplit(":", 1)[-1]
            if pid.isdigit():
                held.setdefault(int(pid), []).append(int(job_id))
    return held


def running_on(repo: Repository, worker: WorkerProcess) -> list[int]:
    """Ids of the jobs that ``worker`` holds in state running."""
    return running_by_pid(repo).get(worker.pid, [])


def busiest(repo: Repository, workers: list[WorkerProcess]) -> WorkerProcess | None:
    """Of ``workers``, the one holding the most running jobs, if any holds one. Jobs of a few
    milliseconds leave a worker picked blindly holding none at times, and a kill that catches
    nothing tests nothing."""
    held = running_by_pid(repo)
    counts = [(len(held.get(w.pid, [])), w) for w in workers]
    n, worker = max(counts, key=lambda c: c[0], default=(0, None))
    return worker if n else None


def kill_a_holder(fleet: Fleet, repo: Repository) -> list[int]:
    """SIGKILL the ``busiest`` worker, once one holds a job; the jobs it left running, which
    only their lease expiring frees. None is killed (no job: []) if the run settles first: a
    worker's restart can outlast the rest of a short run."""

    def ready() -> WorkerProcess | bool:
        return busiest(repo, fleet.running()) or settled_states(repo) is not None

    # Looked for often: a short job is running only now and then.
    found = wait_for(ready, 60, "a worker holding a running job", fleet.tails, 0.01)
    if isinstance(found, bool):
        return []
    fleet.kill(found)
    return running_on(repo, found)


def attempts_histogram(repo: Repository) -> dict[int, int]:
    """How many jobs took each number of attempts."""
    jobs = [repo.job(job_id) for job_id in repo.job_ids()]
    return dict(Counter(job["attempts"] for job in jobs if job is not None))


def wait_settled(
    repo: Repository, fleet: Fleet, timeout_s: float, *, supervise: bool = False
) -> Counter[str]:
    """Wait until the runs are settled, ``tests.helpers.settled_states``: no job queued or
    running and no conversation under way (``supervise``: replacing crashed workers)."""

    def settled() -> Counter[str] | None:
        if supervise:
            fleet.replace_crashed()
        states = settled_states(repo)
        return None if states is None else Counter({s: n for s, n in states.items() if n})

    return wait_for(
        settled, timeout_s, "every job and conversation to settle", lambda: _progress(repo, fleet)
    )


def _progress(repo: Repository, fleet: Fleet) -> str:
    try:
        states = str(dict(state_counts(repo)))
    except DBAPIError as exc:
        states = f"unknown ({exc})"
    return f"states: {states}\n{fleet.tails()}"


def assert_exactly_once(repo: Repository, total: int, fleet: Fleet) -> Counter[str]:
    """Every job done, each with exactly one generation, and every audit invariant holds."""
    states = state_counts(repo)
    generations = repo.generation_count()
    problems = repo.audit(lease_grace_s=0)
    assert states == Counter(done=total), f"{dict(states)} of {total}\n{fleet.tails()}"
    assert generations == total, f"{generations} generations for {total} jobs\n{fleet.tails()}"
    assert problems == [], f"{problems}\n{fleet.tails()}"
    return states


def report(name: str, **facts: Any) -> None:
    """Print one line of facts about a run (shown with ``pytest -rP`` or ``-s``)."""
    print(f"[faults] {name}: {json.dumps(facts, sort_keys=True, default=str)}")


class PrivateRedis:
    """A Redis of one test's own, on a fixed port, that can be restarted empty."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self._server: EmbeddedRedis | None = None

    @property
    def url(self) -> str:
        """The broker URL (the same across restarts)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> str:
        """Start a new, empty redis-server on the port."""
        self._server = EmbeddedRedis(self.root, port=self.port)
        return self._server.start()

    def stop(self) -> None:
        """Stop the server; everything it held is gone."""
        if self._server is not None:
            self._server.stop()
            self._server = None


class PrivatePostgres:
    """A Postgres cluster of one test's own (pgserver) that can be stopped and started."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = ""
        self._server: EmbeddedPostgres | None = None

    def start(self) -> str:
        """Start the cluster on its data directory; its URL (the same across restarts)."""
        self._server = EmbeddedPostgres(self.root)
        url = self._server.start()
        assert self.url in ("", url), f"the cluster came back at {url}, not {self.url}"
        self.url = url
        return url

    def stop(self) -> None:
        """Stop the cluster (pg_ctl's fast mode: every session is cut)."""
        if self._server is not None:
            self._server.stop()
            self._server = None
