"""SIGKILL worker processes again and again during a run of thousands of jobs."""

from __future__ import annotations

import random
import time

import pytest

from core.settings import Settings
from models.repository import Repository
from tests.faults.harness import (
    Fleet,
    assert_exactly_once,
    attempts_histogram,
    kill_a_holder,
    report,
    seed_jobs,
    state_counts,
    wait_for,
    wait_settled,
)
from tests.workers import EACH_ENGINE

pytestmark = [pytest.mark.faults, EACH_ENGINE]

JOBS = 2000
KILLS = 6


def test_kill_9_workers_mid_run_loses_and_duplicates_nothing(
    fast_settings: Settings, repo: Repository, fleet: Fleet
) -> None:
    """Each kill leaves claimed jobs running and messages unacked; all end done once."""
    started = time.monotonic()
    total = len(seed_jobs(fast_settings, JOBS))
    fleet.start()
    fleet.start()
    rng = random.Random(20_240_605)
    marks = sorted(rng.uniform(0.05, 0.8) for _ in range(KILLS))
    orphaned = [_kill_one_at(fleet, repo, int(mark * total)) for mark in marks]
    wait_settled(repo, fleet, timeout_s=180)
    assert_exactly_once(repo, total, fleet)
    _assert_orphans_were_redone(repo, [job_id for ids in orphaned for job_id in ids])
    attempts = attempts_histogram(repo)
    report(
        "kill -9",
        jobs=total,
        kills=KILLS,
        running_at_kills=[len(ids) for ids in orphaned],
        jobs_with_retries=sum(n for a, n in attempts.items() if a > 1),
        seconds=round(time.monotonic() - started, 1),
        **fleet.reconciler_totals(),
    )


def _kill_one_at(fleet: Fleet, repo: Repository, done: int) -> list[int]:
    """Once ``done`` jobs are done, SIGKILL a worker holding running jobs and start a
    replacement; the jobs the victim left running (only their lease expiring frees them)."""
    wait_for(lambda: state_counts(repo)["done"] >= done, 120, f"{done} done jobs", fleet.tails)
    orphans = kill_a_holder(fleet, repo)
    fleet.start()
    return orphans


def _assert_orphans_were_redone(repo: Repository, orphans: list[int]) -> None:
    """The kills hit jobs in flight, and each of those was taken again after its lease."""
    assert orphans, "no kill caught a job running: the test exercised nothing"
    for job_id in orphans:
        job = repo.job(job_id)
        assert job is not None and job["state"] == "done" and job["attempts"] >= 2, job
