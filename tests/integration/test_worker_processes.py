"""Issue 4: `eaglegen worker` as separate processes: the shared in-flight limit, `--check`
and NUMA pinning, against real Postgres, Redis and the simulator."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import text

from core import heartbeat, keys
from core.settings import Settings
from eaglegen.sim import FaultConfig, SimConfig, SimServer
from eaglegen.sim.metrics import parse
from models.repository import Repository
from tests.helpers import enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.workers import EACH_ENGINE
from worker import numa

pytestmark = EACH_ENGINE

LIMIT = 8
# ~20 ms decode steps: a 24-token answer holds its request (and its slot) for ~0.5 s.
SLOW = SimConfig(seed=99, decode_step_ms=20.0, decode_ms_per_request=0.0)


def worker_env(settings: Settings, servers: list[dict[str, Any]]) -> dict[str, str]:
    """The environment of an `eaglegen worker` process for this test's services."""
    assert settings.database_url and settings.broker_url
    base = {k: v for k, v in os.environ.items() if not k.startswith("EAGLEGEN_")}
    return {
        **base,
        "COLUMNS": "200",  # rich wraps stderr at 80 columns otherwise
        "EAGLEGEN_DATABASE_URL": settings.database_url,
        "EAGLEGEN_BROKER_URL": settings.broker_url,
        "EAGLEGEN_DATA_DIR": str(settings.data_dir),
        "EAGLEGEN_QUEUE": settings.queue,
        "EAGLEGEN_SERVERS": json.dumps(servers),
        "EAGLEGEN_HEARTBEAT_INTERVAL_S": "0.5",
        "EAGLEGEN_HEALTH_INTERVAL_S": "0.5",
        "EAGLEGEN_SHUTDOWN_GRACE_S": "2",
        "EAGLEGEN_WORKER_ENGINE": settings.worker_engine,
    }


def eaglegen(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI to completion."""
    command = [sys.executable, "-m", "eaglegen", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)


@contextmanager
def worker_process(env: dict[str, str], log: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """`eaglegen worker ARGS` in a subprocess, stopped with SIGTERM (then SIGKILL) at exit."""
    with log.open("w") as out:
        command = [sys.executable, "-m", "eaglegen", "worker", *args]
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, text=True
        )
        try:
            yield process
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_for(
    condition: Callable[[], Any],
    timeout_s: float = 30.0,
    what: str = "condition",
    log: Path | None = None,
) -> Any:
    """Poll ``condition`` until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise TimeoutError(f"{what} not reached within {timeout_s} s\n{tail}")
        time.sleep(0.05)
    return value


def live_pids(settings: Settings) -> set[int]:
    """Pids of the workers whose heartbeat is in this test's Redis."""
    assert settings.broker_url is not None
    return {b.pid for b in heartbeat.alive(settings.broker_url, None, max_age_s=5)}


def summed(metrics: str, *names: str) -> int:
    """The metrics ``names`` of a /metrics text added up, whatever their labels."""
    prefixes = tuple(f"{name}{{" for name in names)
    return int(sum(v for k, v in parse(metrics).items() if k.startswith(prefixes)))


def in_flight(metrics: str) -> int:
    """Running plus waiting requests in a /metrics text."""
    return summed(metrics, "sglang:num_running_reqs", "sglang:num_queue_reqs")


class InFlightSampler:
    """Samples requests in flight at the simulator (/metrics), held slots and the messages
    the workers hold unacked (kombu's ``unacked`` hash) in Redis, on a thread until the
    block ends."""

    def __init__(self, sim_url: str, broker_url: str, server: str) -> None:
        self.server_counts: list[int] = []
        self.slot_counts: list[int] = []
        self.held_counts: list[int] = []
        self._stop = threading.Event()
        self._sim = httpx.Client(base_url=sim_url, timeout=5)
        self._redis = redis.Redis.from_url(broker_url)
        self._key = keys.slots(server)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> InFlightSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sim.close()
        self._redis.close()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.server_counts.append(in_flight(self._sim.get("/metrics").text))
            self.slot_counts.append(int(self._redis.zcard(self._key)))
            self.held_counts.append(int(self._redis.hlen("unacked")))


@pytest.mark.embedded
def test_two_worker_processes_share_one_in_flight_limit(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    with SimServer(SLOW) as sim, ExitStack() as stack:
        env = worker_env(settings, [{"name": "sim", "url": sim.url, "max_inflight": LIMIT}])
        logs = [tmp_path / "worker-1.log", tmp_path / "worker-2.log"]
        for log in logs:
            stack.enter_context(worker_process(env, log, "--concurrency", "16"))
        wait_for(lambda: len(live_pids(settings)) == 2, what="two live workers", log=logs[0])
        assert settings.broker_url is not None
        with InFlightSampler(sim.url, settings.broker_url, "sim") as sampler:
            path = write_jsonl(tmp_path / "rows.jsonl", sample_rows(64))
            enqueue_file(settings, path, max_new_tokens=24)
            states = wait_settled(repo, timeout_s=60)
    assert states["done"] == 64 and sum(states.values()) == 64
    # 32 threads want to run; the server never sees more than the limit, and reaches it.
    assert max(sampler.server_counts) == LIMIT, sampler.server_counts
    assert max(sampler.slot_counts) == LIMIT, sampler.slot_counts
    with repo.engine.connect() as conn:
        workers = conn.scalar(text("SELECT count(DISTINCT worker) FROM jobs"))
    assert workers == 2  # both processes took jobs


def test_check_exits_1_without_a_worker_and_0_while_one_runs(
    settings: Settings, sim: SimServer, tmp_path: Path
) -> None:
    env = worker_env(settings, [{"name": "sim", "url": sim.url}])
    alone = eaglegen(env, "worker", "--check")
    assert alone.returncode == 1, alone.stderr
    assert "0 live worker process(es)" in alone.stderr
    log = tmp_path / "worker.log"
    with worker_process(env, log, "--concurrency", "2") as process:
        wait_for(lambda: process.pid in live_pids(settings), what="heartbeat", log=log)
        running = eaglegen(env, "worker", "--check")
        assert running.returncode == 0, running.stderr
        assert "1 live worker process(es)" in running.stderr
    # A worker stopped with SIGTERM removes its heartbeat on the way out.
    assert process.returncode == 0, log.read_text()[-3000:]
    assert eaglegen(env, "worker", "--check").returncode == 1


def test_a_busy_worker_logs_no_line_per_request(
    settings: Settings, repo: Repository, sim: SimServer, tmp_path: Path
) -> None:
    env = worker_env(settings, [{"name": "sim", "url": sim.url}])
    log = tmp_path / "worker.log"
    with worker_process(env, log, "--concurrency", "8") as process:
        wait_for(lambda: process.pid in live_pids(settings), what="heartbeat", log=log)
        enqueue_file(settings, write_jsonl(tmp_path / "rows.jsonl", sample_rows(40)))
        assert wait_settled(repo, timeout_s=60)["done"] == 40
    text = log.read_text()
    assert " ready." in text  # INFO lines reach the log (Celery's own start-up line)
    assert "HTTP Request:" not in text, text[-2000:]  # httpx's per-request INFO line
    # Celery's per-task lines: "Task eaglegen.generate[...] received" / "succeeded in".
    assert "] received" not in text and "] succeeded in" not in text, text[-2000:]


def test_numa_node_0_worker_reports_its_node_and_cpus_in_its_heartbeat(
    settings: Settings, sim: SimServer, tmp_path: Path
) -> None:
    node = numa.find_node(numa.read_topology(), 0)
    expected = numa.format_cpulist(node.cpus & os.sched_getaffinity(0))
    env = worker_env(settings, [{"name": "sim", "url": sim.url}])
    log = tmp_path / "worker.log"
    with worker_process(env, log, "--numa-node", "0", "--concurrency", "2") as process:
        assert settings.broker_url is not None
        broker = settings.broker_url
        beats = wait_for(
            lambda: [b for b in heartbeat.alive(broker, None, 5) if b.pid == process.pid],
            what="heartbeat",
            log=log,
        )
    assert beats[0].numa_node == 0
    assert beats[0].cpus == expected and expected
    assert beats[0].membind in {"preferred", "unavailable", "failed"}


def test_a_numa_node_that_does_not_exist_exits_2_naming_the_available_nodes(
    settings: Settings, sim: SimServer
) -> None:
    nodes = numa.read_topology()
    available = ", ".join(f"{n.id}" if n.cpus else f"{n.id} (no CPUs)" for n in nodes)
    env = worker_env(settings, [{"name": "sim", "url": sim.url}])
    result = eaglegen(env, "worker", "--numa-node", "7")
    assert result.returncode == 2
    message = " ".join(result.stderr.split())
    assert f"NUMA node 7 does not exist; available: {available}" in message
    assert settings.broker_url is not None
    assert heartbeat.alive(settings.broker_url, None, 60) == []


# Requests of 2 s: a SIGTERM comes while they run.
LATE = SimConfig(seed=7, faults=FaultConfig(added_latency_ms=2000))
STOPPING = re.compile(r"worker stopping \(SIGTERM\): .* waiting up to 60 s for (\d+) request")
STOPPED = re.compile(
    r"worker stopped: of the (\d+) request\(s\) in flight when it began to stop, (\d+) "
    r"finished and (\d+) went back to the queue"
)


def test_a_stopping_worker_says_what_it_waits_for_and_how_that_ended(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    with SimServer(LATE) as late:
        env = {
            **worker_env(settings, [{"name": "late", "url": late.url}]),
            "EAGLEGEN_SHUTDOWN_GRACE_S": "60",  # time enough for them to finish
        }
        enqueue_file(settings, write_jsonl(tmp_path / "rows.jsonl", sample_rows(12)))
        with worker_process(env, log, "--concurrency", "4") as process:
            wait_for(lambda: _running(repo) == 4, 60, "four requests in flight", log)
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    text = log.read_text()
    assert process.returncode == 0, text[-3000:]
    stopping, stopped = STOPPING.search(text), STOPPED.search(text)
    assert stopping and stopped, text[-3000:]
    waited = int(stopping.group(1))
    assert waited == 4 and stopped.groups() == ("4", "4", "0"), text[-3000:]
    assert _running(repo) == 0
    assert sum(c.states["done"] for c in repo.counts()) >= 4


def _running(repo: Repository) -> int:
    return sum(c.states.get("running", 0) for c in repo.counts())


def test_processes_start_workers_that_share_the_limit_and_one_ctrl_c_stops_each_once(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    log = tmp_path / "workers.log"
    with SimServer(SLOW) as sim, log.open("w") as out:
        env = worker_env(settings, [{"name": "sim", "url": sim.url, "max_inflight": LIMIT}])
        command = [sys.executable, "-m", "eaglegen", "worker", "--processes", "2"]
        # In a session of its own, as a terminal's foreground job: a Ctrl-C signals the group.
        parent = subprocess.Popen(
            [*command, "--concurrency", "8"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        children: set[int] = set()
        try:

            def two_workers() -> set[int] | None:
                pids = live_pids(settings)
                return pids if len(pids) == 2 else None

            children = wait_for(two_workers, what="two live worker processes", log=log)
            assert settings.broker_url is not None
            with InFlightSampler(sim.url, settings.broker_url, "sim") as sampler:
                path = write_jsonl(tmp_path / "rows.jsonl", sample_rows(48))
                enqueue_file(settings, path, max_new_tokens=24)
                states = wait_settled(repo, timeout_s=60)
            os.killpg(parent.pid, signal.SIGINT)  # Ctrl-C
            parent.wait(timeout=60)
        finally:
            if parent.poll() is None:  # the test failed before its end
                for pid in {parent.pid, *children}:
                    with suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)  # each a session (and group) leader
                parent.wait()
    output = log.read_text()
    assert parent.pid not in children and parent.returncode == 0, output[-3000:]
    assert states["done"] == 48 and sum(states.values()) == 48
    # 16 threads want to run; the server never sees more than the limit the two share.
    assert max(sampler.server_counts) == LIMIT, sampler.server_counts
    with repo.engine.connect() as conn:
        workers = conn.scalar(text("SELECT count(DISTINCT worker) FROM jobs"))
    assert workers == 2  # both processes took jobs
    # Each child got the Ctrl-C once (a second would be Celery's cold shutdown), stopped as
    # a worker does and took its heartbeat with it.
    assert output.count("worker stopping (SIGINT)") == 2, output[-3000:]
    assert "Hitting Ctrl+C again will terminate" not in output  # Celery, at a second one
    assert output.count("worker stopped: ") == 2, output[-3000:]
    assert "(exit " not in output  # a Ctrl-C is the stop asked for: no error, exit 0
    assert live_pids(settings) == set()


def test_processes_and_numa_node_are_refused_together(settings: Settings, sim: SimServer) -> None:
    env = worker_env(settings, [{"name": "sim", "url": sim.url}])
    result = eaglegen(env, "worker", "--processes", "2", "--numa-node", "0")
    assert result.returncode == 2
    message = " ".join(result.stderr.split())
    assert "--processes starts unpinned worker processes and --numa-node pins them" in message
    assert settings.broker_url is not None
    assert heartbeat.alive(settings.broker_url, None, 60) == []
