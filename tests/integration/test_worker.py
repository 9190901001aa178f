"""Issue 4: an in-thread worker (with its health and heartbeat loops), each engine (Celery's
threads pool, and the event loop of worker.loop), against the simulator's fault knobs, real
Postgres and real Redis.

Every test ends with exact counts: jobs by state, attempts per job, generation rows, and the
/generate calls the simulator saw.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

import worker.retry
from core import heartbeat
from core.settings import ServerSpec, Settings
from eaglegen.sim import SimConfig, SimServer
from models.repository import Repository
from tests.helpers import enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.workers import EACH_ENGINE, in_thread_worker
from worker.runner import WorkerContext

pytestmark = EACH_ENGINE

FAST = SimConfig(seed=4321, decode_step_ms=0.5, decode_ms_per_request=0.01)
# Each retryable fault and the knobs that switch it on for every /generate call.
RETRYABLE: dict[str, dict[str, Any]] = {
    "503": {"error_rates": {"503": 1.0}},
    "429": {"error_rates": {"429": 1.0}},
    "502": {"error_rates": {"502": 1.0}},
    "504": {"error_rates": {"504": 1.0}},
    "500": {"error_rates": {"500": 1.0}},
    "drop": {"drop_rate": 1.0},
    "malformed": {"malformed_rate": 1.0},
}
Faults = Callable[..., None]


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    """This module's own simulator (overrides the session one): its faults change per test."""
    with SimServer(FAST) as server:
        yield server


@pytest.fixture
def faults(sim: SimServer) -> Iterator[Faults]:
    """Replace the simulator's faults; all are off again after the test."""
    with httpx.Client(base_url=sim.url, timeout=10) as client:

        def set_faults(**knobs: Any) -> None:
            response = client.post("/sim/faults", json=knobs)
            assert response.status_code == 200, response.text

        yield set_faults
        set_faults()


def tuned(settings: Settings, **overrides: Any) -> Settings:
    """Settings with fast retries, health checks and heartbeats (plus ``overrides``)."""
    fast = {
        "retry_base_s": 0.05,
        "retry_cap_s": 0.2,
        "health_interval_s": 0.2,
        "heartbeat_interval_s": 0.2,
        "slot_wait_s": 1.0,
    }
    return settings.model_copy(update={**fast, **overrides})


@contextmanager
def running_worker(settings: Settings) -> Iterator[WorkerContext]:
    """A worker as `eaglegen worker` runs it: Celery threads pool plus the side loops."""
    with in_thread_worker(settings) as (ctx, _name):
        yield ctx


def enqueue(settings: Settings, tmp_path: Path, n: int, max_new_tokens: int = 32) -> None:
    """Enqueue the first ``n`` sample prompts."""
    path = write_jsonl(tmp_path / f"rows-{n}.jsonl", sample_rows(n))
    assert enqueue_file(settings, path, max_new_tokens=max_new_tokens).accepted == n


def jobs(repo: Repository) -> list[dict[str, Any]]:
    """Every job row, in id order."""
    rows = [repo.job(job_id) for job_id in repo.job_ids()]
    return [row for row in rows if row is not None]


def sim_stats(sim: SimServer) -> dict[str, Any]:
    """The simulator's /sim/stats document."""
    body: dict[str, Any] = httpx.get(f"{sim.url}/sim/stats", timeout=10).json()
    return body


def injected_total(stats: dict[str, Any]) -> int:
    """Faults that replaced an answer (errors, drops, malformed bodies)."""
    injected = stats["injected"]
    return int(sum(injected["errors"].values()) + injected["dropped"] + injected["malformed"])


def wait_for(condition: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition") -> Any:
    """Poll ``condition`` until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s} s")
        time.sleep(0.05)
    return value


def ledger_reserved(repo: Repository) -> int:
    """Tokens still reserved in the budget ledger (0 once nothing runs)."""
    with repo.engine.connect() as conn:
        return int(conn.scalar(text("SELECT coalesce(sum(reserved_tokens), 0) FROM datasets")))


def generations_by_server(repo: Repository) -> dict[str, int]:
    """Generation rows per server name."""
    with repo.engine.connect() as conn:
        rows = conn.execute(text("SELECT server, count(*) FROM generations GROUP BY server"))
        return {str(server): int(n) for server, n in rows}


def direct_outputs(sim: SimServer, repo: Repository, rows: list[dict[str, Any]]) -> list[Any]:
    """The simulator's answer for each job's prompt, asked again in one batch call."""
    params = repo.sampling_params(rows[0]["dataset_id"])
    body = {"input_ids": [row["input_ids"] for row in rows], "sampling_params": params}
    answer = httpx.post(f"{sim.url}/generate", json=body, timeout=60).json()
    return [item["output_ids"] for item in answer]


@pytest.mark.parametrize("fault", list(RETRYABLE))
def test_a_retryable_fault_is_retried_until_it_is_switched_off(
    fault: str,
    settings: Settings,
    repo: Repository,
    sim: SimServer,
    faults: Faults,
    tmp_path: Path,
) -> None:
    settings = tuned(settings, max_attempts=1000)
    faults(**RETRYABLE[fault])
    before = sim_stats(sim)
    enqueue(settings, tmp_path, 6)
    with running_worker(settings):
        # Every job has been tried and refused at least twice, none given up.
        wait_for(lambda: all(j["attempts"] >= 3 for j in jobs(repo)), what="3 attempts each")
        faults()
        states = wait_settled(repo, timeout_s=30)
    assert states["done"] == 6 and sum(states.values()) == 6
    assert repo.generation_count() == 6
    rows = jobs(repo)
    assert all(row["attempts"] >= 3 and row["last_error"] is None for row in rows)
    assert ledger_reserved(repo) == 0
    after = sim_stats(sim)
    attempts = sum(row["attempts"] for row in rows)
    # One /generate call per attempt; every attempt but the last of each job got this fault.
    assert attempts == after["generate_requests"] - before["generate_requests"]
    assert fault_count(after, fault) - fault_count(before, fault) == attempts - 6


def fault_count(stats: dict[str, Any], fault: str) -> int:
    """How many faults of one kind ("drop", "malformed" or a status) the sim injected."""
    injected = stats["injected"]
    if fault == "drop":
        return int(injected["dropped"])
    if fault == "malformed":
        return int(injected["malformed"])
    return int(injected["errors"].get(fault, 0))


def test_faults_at_a_partial_rate_end_done_with_one_call_per_attempt(
    settings: Settings,
    repo: Repository,
    sim: SimServer,
    faults: Faults,
    tmp_path: Path,
) -> None:
    settings = tuned(settings, max_attempts=12)
    # 0.3 in all, one tenth each for drops and malformed bodies: a job needs all 12 attempts
    # to fail with probability 0.3**12 (5e-7).
    rates = {str(s): 0.02 for s in (429, 500, 502, 503, 504)}
    faults(error_rates=rates, drop_rate=0.1, malformed_rate=0.1, seed=7)
    before = sim_stats(sim)
    enqueue(settings, tmp_path, 40)
    with running_worker(settings):
        states = wait_settled(repo, timeout_s=60)
    faults()
    assert states["done"] == 40 and sum(states.values()) == 40
    rows = jobs(repo)
    after = sim_stats(sim)
    attempts = sum(row["attempts"] for row in rows)
    # Each attempt is exactly one /generate call, and each failed one a fault the sim injected.
    assert attempts == after["generate_requests"] - before["generate_requests"]
    assert attempts - 40 == injected_total(after) - injected_total(before) > 0
    assert max(row["attempts"] for row in rows) <= 12
    # Retries change nothing in what is recorded: the server's exact ids for each prompt.
    for row, expected in zip(rows, direct_outputs(sim, repo, rows), strict=True):
        generation = repo.generation(row["id"])
        assert generation is not None and generation["output_ids"] == expected


def test_400_fails_at_once_keeping_the_servers_message(
    settings: Settings,
    repo: Repository,
    sim: SimServer,
    faults: Faults,
    tmp_path: Path,
) -> None:
    settings = tuned(settings)
    faults(error_rates={"400": 1.0})
    before = sim_stats(sim)["injected"]["errors"].get("400", 0)
    enqueue(settings, tmp_path, 5)
    with running_worker(settings):
        states = wait_settled(repo, timeout_s=30)
    assert states["failed"] == 5 and sum(states.values()) == 5
    for row in jobs(repo):
        assert row["attempts"] == 1
        assert "HTTP 400" in row["last_error"]
        assert "The simulator injected a 400 fault" in row["last_error"]
    assert repo.generation_count() == 0 and ledger_reserved(repo) == 0
    assert sim_stats(sim)["injected"]["errors"]["400"] - before == 5  # never retried


def test_503_on_every_call_fails_after_exactly_max_attempts_with_backoff(
    settings: Settings,
    repo: Repository,
    sim: SimServer,
    faults: Faults,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = tuned(settings, max_attempts=3)
    delays: list[tuple[int, float]] = []
    real_backoff = worker.retry.backoff

    def recording_backoff(attempt: int, base_s: float, cap_s: float) -> float:
        delay = real_backoff(attempt, base_s, cap_s)
        delays.append((attempt, delay))
        return delay

    monkeypatch.setattr("worker.runner.backoff", recording_backoff)
    faults(error_rates={"503": 1.0})
    before = sim_stats(sim)["injected"]["errors"].get("503", 0)
    enqueue(settings, tmp_path, 4)
    with running_worker(settings):
        states = wait_settled(repo, timeout_s=30)
    assert states["failed"] == 4 and sum(states.values()) == 4
    for row in jobs(repo):
        assert row["attempts"] == 3
        assert row["last_error"] == "sim: HTTP 503: The request queue is full."
    assert sim_stats(sim)["injected"]["errors"]["503"] - before == 12
    # Attempts 1 and 2 of each job were followed by a backoff within its full-jitter ceiling.
    assert sorted(attempt for attempt, _ in delays) == [1] * 4 + [2] * 4
    assert all(0 <= delay <= min(0.2, 0.05 * 2 ** (a - 1)) for a, delay in delays)
    assert repo.generation_count() == 0 and ledger_reserved(repo) == 0


def test_leaked_prompt_tokens_fail_as_an_invalid_response_and_store_nothing(
    settings: Settings,
    repo: Repository,
    sim: SimServer,
    faults: Faults,
    tmp_path: Path,
) -> None:
    settings = tuned(settings)
    faults(leak_prompt_tokens=True)
    leaked_before = sim_stats(sim)["injected"]["leaked"]
    enqueue(settings, tmp_path, 5)
    with running_worker(settings):
        states = wait_settled(repo, timeout_s=30)
    assert states["failed"] == 5 and sum(states.values()) == 5
    for row in jobs(repo):
        assert row["attempts"] == 1
        assert row["last_error"].startswith("invalid response: len(output_ids)=")
    assert repo.generation_count() == 0 and ledger_reserved(repo) == 0
    assert sim_stats(sim)["injected"]["leaked"] - leaked_before == 5


def heartbeat_says_down(settings: Settings, server: str) -> bool:
    """Whether this process's worker heartbeat reports ``server`` unhealthy."""
    assert settings.broker_url is not None
    beats = heartbeat.alive(settings.broker_url, socket.gethostname(), max_age_s=5)
    return any(not b.servers[server].healthy and b.servers[server].reason for b in beats)


def take_down(server: SimServer, how: str) -> None:
    """Make a simulator go away: through its fault knobs, or by stopping it."""
    if how == "faults":
        knobs = {"unhealthy": True, "drop_rate": 1.0}
        assert httpx.post(f"{server.url}/sim/faults", json=knobs, timeout=10).status_code == 200
    else:
        server.__exit__(None, None, None)


@pytest.mark.parametrize("how", ["faults", "stop"])
def test_when_one_of_two_servers_goes_down_every_job_finishes_on_the_other(
    how: str,
    settings: Settings,
    repo: Repository,
    sim: SimServer,
    tmp_path: Path,
) -> None:
    # b decodes slower, so it still has work in flight when it goes down.
    slow = SimConfig(seed=4321, decode_step_ms=2.0, decode_ms_per_request=0.05)
    with SimServer(slow) as other:
        servers = [
            ServerSpec(name="a", url=sim.url, max_inflight=4),
            ServerSpec(name="b", url=other.url, max_inflight=4),
        ]
        settings = tuned(settings, servers=servers, max_attempts=5)
        enqueue(settings, tmp_path, 80, max_new_tokens=64)
        with running_worker(settings):
            wait_for(lambda: generations_by_server(repo).get("b", 0) >= 3, what="b at work")
            take_down(other, how)
            # From here b answers nothing new: only requests holding one of its 4 slots (sent,
            # or answered and not yet recorded) may still add a row for b.
            b_before = generations_by_server(repo)["b"]
            wait_for(lambda: heartbeat_says_down(settings, "b"), what="b marked down")
            states = wait_settled(repo, timeout_s=60)
        injected = sim_stats(other)["injected"] if how == "faults" else None
        refused = None if injected is None else injected["unhealthy_health_checks"]
    assert states["done"] == 80 and sum(states.values()) == 80
    by_server = generations_by_server(repo)
    assert sum(by_server.values()) == 80
    assert b_before <= by_server["b"] <= b_before + 4
    assert by_server["a"] >= 80 - b_before - 4
    retried = [row for row in jobs(repo) if row["attempts"] > 1]
    for row in retried:
        generation = repo.generation(row["id"])
        assert generation is not None and generation["server"] == "a"
    if refused is not None:
        assert refused >= 1  # the worker's health probe saw b refuse
