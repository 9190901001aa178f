"""Issue 11: each worker process serves Prometheus metrics, and they count what the run did.

`eaglegen worker --metrics-port` is scraped during a real run against the simulator; the
counters must equal what Postgres recorded and what the simulator saw, exactly.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from core.settings import ServerSpec, Settings
from eaglegen.sim import SimConfig, SimServer
from eaglegen.stack import free_port
from tests.helpers import InspectRepository, enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.integration.test_worker import running_worker, tuned
from tests.integration.test_worker_processes import wait_for, worker_env, worker_process
from worker.retry import ErrorKind

# ~2 ms decode steps: requests stay open long enough for a scrape to see them in flight.
PACED = SimConfig(seed=2024, decode_step_ms=2.0, decode_ms_per_request=0.0)
# Names of this session's own: server names are held cluster-wide in Redis.
SERVER = f"sim{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    """This module's own simulator: its faults change per test."""
    with SimServer(PACED) as server:
        yield server


@pytest.fixture
def set_faults(sim: SimServer) -> Iterator[Any]:
    """Set the simulator's faults; all off after the test."""
    with httpx.Client(base_url=sim.url, timeout=10) as client:

        def apply(**knobs: Any) -> None:
            assert client.post("/sim/faults", json=knobs).status_code == 200

        yield apply
        apply()


def samples(exposition: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page: (name, sorted labels) → value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    }


def total(
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        value
        for (sample, have), value in found.items()
        if sample == name and set(labels.items()) <= set(have)
    )


def sim_stats(sim: SimServer) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{sim.url}/sim/stats", timeout=10).json()
    return body


def recorded(repo: InspectRepository) -> tuple[int, int, int]:
    """Generations, their completion tokens and prompt tokens, from Postgres."""
    with repo.engine.connect() as conn:
        row = conn.execute(
            text("SELECT count(*), sum(completion_tokens), sum(prompt_tokens) FROM generations")
        ).one()
    return int(row[0]), int(row[1]), int(row[2])


def test_a_scrape_during_a_run_counts_what_the_run_did(
    settings: Settings, repo: InspectRepository, sim: SimServer, tmp_path: Path, set_faults: Any
) -> None:
    set_faults(error_rates={"503": 0.3})
    before = sim_stats(sim)
    port = free_port()
    env = worker_env(settings, [{"name": SERVER, "url": sim.url}])
    env.update(EAGLEGEN_RETRY_BASE_S="0.02", EAGLEGEN_RETRY_CAP_S="0.1", EAGLEGEN_MAX_ATTEMPTS="50")
    log = tmp_path / "worker.log"
    url = f"http://127.0.0.1:{port}/metrics"
    with worker_process(env, log, "--concurrency", "8", "--metrics-port", str(port)):
        page = wait_for(lambda: _scrape(url), what="metrics served", log=log)
        assert total(samples(page), "eaglegen_worker_requests_in_flight", server=SERVER) == 0
        enqueue_file(
            settings, write_jsonl(tmp_path / "rows.jsonl", sample_rows(40)), max_new_tokens=24
        )
        peak = _PeakInFlight(url)
        peak.start()
        states = wait_settled(repo, timeout_s=120)
        peak.stop()
        found = samples(wait_for(lambda: _scrape(url), what="final scrape", log=log))
    assert states["done"] == 40, states
    after = sim_stats(sim)
    injected = after["injected"]["errors"].get("503", 0) - before["injected"]["errors"].get(
        "503", 0
    )
    generations, completion, prompt = recorded(repo)
    assert injected > 0 and generations == 40
    m = "eaglegen_worker_"
    assert total(found, m + "generated_tokens_total", server=SERVER) == completion
    assert total(found, m + "prompt_tokens_total", server=SERVER) == prompt
    assert total(found, m + "requests_total", server=SERVER, outcome="ok") == generations
    assert total(found, m + "requests_total", server=SERVER, outcome="error") == injected
    assert total(found, m + "request_errors_total", server=SERVER, kind="http_5xx") == injected
    assert total(found, m + "request_errors_total", server=SERVER) == injected
    assert total(found, m + "request_seconds_count", server=SERVER) == generations + injected
    assert total(found, m + "job_attempts_total", outcome="done") == 40
    assert total(found, m + "job_attempts_total", outcome="retry") == injected
    assert total(found, m + "job_attempts_total", outcome="failed") == 0
    assert total(found, m + "requests_in_flight", server=SERVER) == 0
    assert peak.highest >= 1, "no scrape saw a request in flight"
    assert total(found, "process_cpu_seconds_total") > 0  # the process's own figures too


@pytest.mark.parametrize(
    ("knobs", "kind", "fails"),
    [
        ({"error_rates": {"400": 1.0}}, ErrorKind.HTTP_4XX, True),
        ({"malformed_rate": 1.0}, ErrorKind.MALFORMED, False),
        ({"drop_rate": 1.0}, ErrorKind.CONNECTION, False),
    ],
)
def test_errors_are_counted_by_class(
    settings: Settings,
    repo: InspectRepository,
    sim: SimServer,
    tmp_path: Path,
    set_faults: Any,
    knobs: dict[str, Any],
    kind: ErrorKind,
    fails: bool,
) -> None:
    set_faults(**knobs)
    fast = tuned(settings, max_attempts=2, servers=[ServerSpec(name=SERVER, url=sim.url)])
    enqueue_file(fast, write_jsonl(tmp_path / "rows.jsonl", sample_rows(3)), max_new_tokens=16)
    with running_worker(fast) as ctx:
        states = wait_settled(repo, timeout_s=60)
        registry = ctx.metrics.registry

        def attempts_of(outcome: str) -> float | None:
            value = registry.get_sample_value(
                "eaglegen_worker_job_attempts_total", {"outcome": outcome}
            )
            return None if value is None else float(value)

        # An attempt is counted once its outcome is committed: the last ones may still be
        # on their way when Postgres shows every job settled.
        wait_for(lambda: attempts_of("failed") == 3.0, what="the last attempts counted")
        errors = registry.get_sample_value(
            "eaglegen_worker_request_errors_total", {"server": SERVER, "kind": kind.value}
        )
        attempts = {outcome: attempts_of(outcome) for outcome in ("failed", "retry", "done")}
    assert states["failed"] == 3
    # A permanent error fails at the first attempt; a retryable one after both.
    assert errors == (3 if fails else 6)
    assert attempts == {"failed": 3.0, "retry": None if fails else 3.0, "done": None}
    jobs = [repo.job(job_id) for job_id in repo.job_ids()]
    assert all(job is not None and job["state"] == "failed" for job in jobs)


def _scrape(url: str) -> str | None:
    try:
        response = httpx.get(url, timeout=5)
    except httpx.TransportError:
        return None
    return response.text if response.status_code == 200 else None


class _PeakInFlight(threading.Thread):
    """Scrapes while the run goes on: the most requests seen in flight at once."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.highest = 0.0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.02):
            page = _scrape(self.url)
            if page is not None:
                seen = total(samples(page), "eaglegen_worker_requests_in_flight", server=SERVER)
                self.highest = max(self.highest, seen)

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=10)
