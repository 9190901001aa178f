"""A server slower than the shutdown grace period and the health probe's timeout."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import replace

import pytest

from core.settings import Settings
from eaglegen.sim import FaultConfig, SimConfig, SimServer
from models.repository import Repository
from tests.faults.conftest import FleetFactory
from tests.faults.harness import (
    Fleet,
    WorkerProcess,
    assert_exactly_once,
    report,
    running_on,
    seed_jobs,
    wait_for,
    wait_settled,
)
from tests.workers import EACH_ENGINE

pytestmark = [pytest.mark.faults, EACH_ENGINE]

FAST = SimConfig(seed=9, decode_step_ms=0.5, decode_ms_per_request=0.02)
SimFactory = Callable[[SimConfig], SimServer]


def slow(make_sim: SimFactory, latency_s: float) -> SimServer:
    """A simulator that answers every /generate call ``latency_s`` late."""
    return make_sim(replace(FAST, faults=FaultConfig(added_latency_ms=latency_s * 1000)))


def test_sigterm_releases_in_flight_jobs_after_the_grace_period(
    fast_settings: Settings, repo: Repository, fleet_factory: FleetFactory, make_sim: SimFactory
) -> None:
    """The stopping worker gives its claims back unspent, exits without waiting for its
    requests, and another worker finishes them."""
    slow_sim, fast_sim = slow(make_sim, 12.0), make_sim(FAST)  # 12 s >> the 1 s grace period
    fleet = fleet_factory(fast_settings, [])
    total = len(seed_jobs(fast_settings, 40))
    stopping = fleet.start(servers=[f"slow={slow_sim.url}"])
    held = _wait_holding(repo, fleet, stopping)
    fleet.start(servers=[f"fast={fast_sim.url}"])
    sent = time.monotonic()
    fleet.stop(stopping)
    code = _wait_exit(stopping, fast_settings.shutdown_grace_s + 7)  # well before 12 s
    exit_s = round(time.monotonic() - sent, 1)
    wait_settled(repo, fleet, timeout_s=60)
    assert_exactly_once(repo, total, fleet)
    _assert_released_and_redone(repo, held, fleet)
    assert f"released {len(held)} running job(s)" in stopping.log(), fleet.tails()
    report("sigterm", jobs=total, held_at_sigterm=len(held), exit_code=code, exit_s=exit_s)


def test_a_worker_busy_on_every_thread_keeps_its_server_healthy(
    fast_settings: Settings, repo: Repository, fleet_factory: FleetFactory, make_sim: SimFactory
) -> None:
    """Requests slower than the probe's timeout say nothing about the server's health."""
    settings = fast_settings.model_copy(update={"health_interval_s": 1.0})  # probes time out at 3 s
    slow_sim = slow(make_sim, 6.0)
    fleet = fleet_factory(settings, [f"slow={slow_sim.url}"])
    total = len(seed_jobs(settings, fleet.concurrency))
    worker = fleet.start()
    wait_settled(repo, fleet, timeout_s=60)
    assert_exactly_once(repo, total, fleet)
    assert "server slow is down" not in worker.log(), worker.tail()


def _wait_exit(worker: WorkerProcess, timeout_s: float) -> int:
    """Its exit code, once it exits; fail if it is still running after ``timeout_s``."""
    try:
        return worker.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{worker.label} still runs {timeout_s:.0f} s after SIGTERM\n{worker.tail()}")


def _wait_holding(repo: Repository, fleet: Fleet, worker: WorkerProcess) -> list[int]:
    """Wait until every thread of ``worker`` runs a job; their ids."""

    def held() -> list[int]:
        mine = running_on(repo, worker)
        return mine if len(mine) == fleet.concurrency else []

    return wait_for(held, 60, f"{fleet.concurrency} jobs running on {worker.label}", fleet.tails)


def _assert_released_and_redone(repo: Repository, held: list[int], fleet: Fleet) -> None:
    """Each held job was given back without spending an attempt and generated elsewhere."""
    for job_id in held:
        job, gen = repo.job(job_id), repo.generation(job_id)
        assert job is not None and gen is not None
        assert job["attempts"] == 1, (job, fleet.tails())
        assert gen["server"] == "fast", gen
