"""A simulator failing at high rates, then leaking prompt tokens into output_ids."""

from __future__ import annotations

import http.client
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from core.settings import Settings
from eaglegen.sim import FaultConfig, SimConfig, SimServer
from models.repository import Repository
from tests.faults.conftest import FleetFactory
from tests.faults.harness import Fleet, report, seed_jobs, state_counts, wait_settled
from tests.workers import EACH_ENGINE

pytestmark = [pytest.mark.faults, EACH_ENGINE]

JOBS = 300
LEAK_JOBS = 60
FAULTS = FaultConfig(
    error_rates=((500, 0.05), (503, 0.3)), drop_rate=0.1, malformed_rate=0.1, seed=11
)


def _subclass_names(cls: type[Exception]) -> set[str]:
    return {cls.__name__}.union(*(_subclass_names(sub) for sub in cls.__subclasses__()))


# What a dropped connection may surface as: the socket's and http.client's errors, which
# the worker's SGLang client reports as transport errors.
TRANSPORT_ERRORS = _subclass_names(OSError) | _subclass_names(http.client.HTTPException)
# What the last error of a job failed by each injected fault says.
REASONS = (
    "HTTP 503",
    "HTTP 500",
    "malformed JSON",
    *(f": {name}: " for name in sorted(TRANSPORT_ERRORS)),
)


def test_high_fault_rates_end_every_job_done_or_failed_with_a_reason(
    fast_settings: Settings,
    repo: Repository,
    fleet_factory: FleetFactory,
    make_sim: Callable[[SimConfig], SimServer],
) -> None:
    """Retryable faults retry up to max_attempts; leaked prompts fail and are never stored."""
    sim = make_sim(SimConfig(seed=3, decode_step_ms=0.5, decode_ms_per_request=0.02))
    fleet = fleet_factory(fast_settings, [f"sim={sim.url}"])
    _set_faults(sim, FAULTS.to_json())
    seed_jobs(fast_settings, JOBS, dataset="faulty")
    fleet.start()
    fleet.start()
    states = wait_settled(repo, fleet, timeout_s=150)
    faulty = _jobs(repo, "faulty")
    _assert_done_or_failed_with_reason(repo, faulty, fast_settings.max_attempts, fleet)
    injected = httpx.get(f"{sim.url}/sim/stats").json()["injected"]
    _set_faults(sim, {"leak_prompt_tokens": True})
    seed_jobs(fast_settings, LEAK_JOBS, dataset="leaky")
    wait_settled(repo, fleet, timeout_s=60)
    _assert_leaks_failed_unstored(repo, _jobs(repo, "leaky"), fleet)
    assert repo.audit(lease_grace_s=0) == [], fleet.tails()
    report(
        "simulator faults",
        jobs=JOBS,
        states=dict(states),
        attempts=dict(Counter(job["attempts"] for job in faulty)),
        injected=injected,
        leak_jobs=LEAK_JOBS,
    )


def _set_faults(sim: SimServer, faults: dict[str, Any]) -> None:
    response = httpx.post(f"{sim.url}/sim/faults", json=faults)
    assert response.status_code == 200, response.text


def _jobs(repo: Repository, dataset: str) -> list[dict[str, Any]]:
    """Every job row of one dataset."""
    [dataset_id] = [b.dataset_id for b in repo.budgets() if b.dataset == dataset]
    jobs = [repo.job(job_id) for job_id in repo.job_ids(dataset_id=dataset_id)]
    return [job for job in jobs if job is not None]


def _assert_done_or_failed_with_reason(
    repo: Repository, jobs: list[dict[str, Any]], max_attempts: int, fleet: Fleet
) -> None:
    """Done jobs have their one generation; failed ones exhausted retries and say why."""
    assert len(jobs) == JOBS
    for job in jobs:
        assert 1 <= job["attempts"] <= max_attempts, (job, fleet.tails())
        stored = repo.generation(job["id"]) is not None
        if job["state"] == "done":
            assert stored, job
            continue
        assert job["state"] == "failed" and not stored, (job, fleet.tails())
        assert job["attempts"] == max_attempts, job
        assert any(reason in job["last_error"] for reason in REASONS), job["last_error"]
    done = sum(job["state"] == "done" for job in jobs)
    assert state_counts(repo)["done"] == done == repo.generation_count()


def _assert_leaks_failed_unstored(
    repo: Repository, jobs: list[dict[str, Any]], fleet: Fleet
) -> None:
    """A leaked prompt is an invariant violation: failed at once, nothing stored."""
    assert len(jobs) == LEAK_JOBS
    for job in jobs:
        assert job["state"] == "failed" and job["attempts"] == 1, (job, fleet.tails())
        assert job["last_error"].startswith("invalid response: len(output_ids)="), job
        assert repo.generation(job["id"]) is None
