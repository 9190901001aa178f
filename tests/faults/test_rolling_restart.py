"""The runbook's drain and rolling restart (ops/RUNBOOK.md): SIGTERM makes a worker take
no new job and finish its running ones, then exit 0; restarting every worker one after the
other mid-run loses, duplicates and wastes nothing."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from core.settings import Settings
from eaglegen.sim import FaultConfig, SimConfig, SimServer
from models.repository import Repository
from tests.faults.harness import (
    Fleet,
    WorkerProcess,
    assert_exactly_once,
    attempts_histogram,
    report,
    running_on,
    seed_jobs,
    state_counts,
    wait_for,
    wait_settled,
)
from tests.workers import EACH_ENGINE

pytestmark = [pytest.mark.faults, EACH_ENGINE]

# Each request takes this long, far inside the grace period a drain gives running jobs
# (a loaded CI machine must not turn finishing into giving back).
LATENCY_MS = 250.0
GRACE_S = 20.0
JOBS = 400


@pytest.fixture
def drain_settings(fast_settings: Settings) -> Settings:
    return fast_settings.model_copy(update={"shutdown_grace_s": GRACE_S})


@pytest.fixture
def paced_sim(make_sim: Callable[[SimConfig], SimServer]) -> SimServer:
    return make_sim(SimConfig(faults=FaultConfig(added_latency_ms=LATENCY_MS)))


def drain(fleet: Fleet, repo: Repository, worker: WorkerProcess) -> list[int]:
    """SIGTERM ``worker`` while it runs jobs, wait for it to exit 0; the jobs it held."""
    wait_for(lambda: bool(running_on(repo, worker)), 60, "jobs running on it", fleet.tails)
    held = running_on(repo, worker)
    fleet.stop(worker)
    worker.process.wait(timeout=60)
    assert worker.process.returncode == 0, worker.tail()
    return held


def test_a_drained_worker_finishes_its_running_jobs_and_exits_0(
    drain_settings: Settings, repo: Repository, fleet_factory: Callable[..., Fleet],
    paced_sim: SimServer,
) -> None:  # fmt: skip
    fleet = fleet_factory(drain_settings, [f"sim={paced_sim.url}"])
    total = len(seed_jobs(drain_settings, 60))
    draining = fleet.start()
    held = drain(fleet, repo, draining)
    for job_id in held:
        job = repo.job(job_id)
        # Finished by the draining worker itself, on its first attempt.
        assert job is not None and job["state"] == "done" and job["attempts"] == 1, job
        assert str(job["worker"]).endswith(f":{draining.pid}")
    assert state_counts(repo)["running"] == 0  # it took nothing new while stopping
    fleet.start()
    wait_settled(repo, fleet, timeout_s=120)
    assert_exactly_once(repo, total, fleet)


def test_a_rolling_restart_mid_run_loses_and_wastes_nothing(
    drain_settings: Settings, repo: Repository, fleet_factory: Callable[..., Fleet],
    paced_sim: SimServer,
) -> None:  # fmt: skip
    started = time.monotonic()
    fleet = fleet_factory(drain_settings, [f"sim={paced_sim.url}"])
    total = len(seed_jobs(drain_settings, JOBS))
    first = [fleet.start(), fleet.start()]
    drained = []
    for worker in first:  # one at a time, the other keeps the queue moving
        drained += drain(fleet, repo, worker)
        fleet.start()
    wait_settled(repo, fleet, timeout_s=180)
    assert_exactly_once(repo, total, fleet)
    attempts = attempts_histogram(repo)
    assert attempts == {1: total}, attempts  # no job lost an attempt to a restart
    report("rolling restart", jobs=total, held_at_drains=len(drained),
           seconds=round(time.monotonic() - started, 1))  # fmt: skip
