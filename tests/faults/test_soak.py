"""A soak of the loop engine: for EAGLEGEN_TEST_SOAK_S seconds (a minute when unset, as in CI),
workers run a stream of jobs while, every few seconds, one is killed with SIGKILL or stopped
with SIGTERM (and replaced), or Redis is restarted empty, or Postgres restarted: each fault
in turn, in a random order.
Then every job must be done exactly once, every audit invariant hold, and no worker have
exited unasked.

The long run: ``EAGLEGEN_TEST_SOAK_S=1800 make test-faults`` (or this file alone with pytest -s,
whose report line says what happened)."""

from __future__ import annotations

import os
import random
import time
from collections import Counter

import pytest
import redis
from sqlalchemy.exc import DBAPIError

from core.settings import Settings
from models.repository import Repository
from tests.faults.conftest import OwnServicesRun
from tests.faults.harness import (
    Fleet,
    PrivatePostgres,
    PrivateRedis,
    assert_exactly_once,
    attempts_histogram,
    kill_a_holder,
    report,
    seed_jobs,
    state_counts,
    wait_settled,
)

pytestmark = pytest.mark.faults

SOAK_S = float(os.environ.get("EAGLEGEN_TEST_SOAK_S", "60"))
FAULT_EVERY_S = 5.0  # on average
DOWNTIME_S = 2.0
BATCH = 400  # jobs seeded whenever fewer than half a batch are left to run
WORKERS = 3
FAULTS = ["kill", "term", "redis", "postgres"]


@pytest.mark.timeout(SOAK_S + 600)  # the soak, then the settling's own wait and more
@pytest.mark.parametrize("worker_engine", ["loop"])
def test_a_soak_under_kills_stops_and_service_restarts_loses_and_duplicates_nothing(
    own_services_run: OwnServicesRun,
    private_postgres: PrivatePostgres,
    private_redis: PrivateRedis,
    worker_engine: str,
) -> None:
    settings, repo, fleet = own_services_run
    rng = random.Random(20_261_206)
    faults: Counter[str] = Counter()
    started = time.monotonic()
    seeded = [len(seed_jobs(settings, BATCH, dataset="d0"))]
    refused = 0  # top-ups a service just restarted refused
    for _ in range(WORKERS):
        fleet.start()
    order: list[str] = []
    while time.monotonic() - started < SOAK_S:
        time.sleep(FAULT_EVERY_S * rng.uniform(0.5, 1.5))
        refused += not _top_up(settings, repo, seeded)
        order = order or rng.sample(FAULTS, len(FAULTS))  # each in turn, in a random order
        fault = order.pop()
        faults[fault] += _inject(fault, fleet, repo, private_redis, private_postgres, rng)
        fleet.replace_crashed()
    wait_settled(repo, fleet, timeout_s=300, supervise=True)
    total = sum(seeded)
    assert_exactly_once(repo, total, fleet)
    assert faults["kill"] and faults["redis"] and faults["postgres"], faults
    report(
        "soak",
        engine=worker_engine,
        seconds=round(time.monotonic() - started, 1),
        jobs=total,
        faults=dict(faults),
        top_ups_refused=refused,
        attempts=attempts_histogram(repo),
        crashed_workers=fleet.crashed,
        **fleet.reconciler_totals(),
    )
    assert not fleet.crashed, f"{fleet.crashed} exited unasked\n{fleet.tails()}"


def _top_up(settings: Settings, repo: Repository, seeded: list[int]) -> bool:
    """A new dataset of BATCH jobs once fewer than half a batch are left to run; False when
    a service just restarted refused (tried again at the next fault)."""
    try:
        left = state_counts(repo)["queued"]
        if left < BATCH // 2:
            seeded.append(len(seed_jobs(settings, BATCH, dataset=f"d{len(seeded)}")))
    except (DBAPIError, redis.RedisError):
        return False
    return True


def _inject(
    fault: str,
    fleet: Fleet,
    repo: Repository,
    private_redis: PrivateRedis,
    private_postgres: PrivatePostgres,
    rng: random.Random,
) -> int:
    """One fault, and what puts the cluster back (a worker replaced, a service restarted);
    whether it happened (a kill needs a worker holding a job)."""
    if fault == "kill":
        if not kill_a_holder(fleet, repo):
            return 0
        fleet.start()
    elif fault == "term":
        worker = rng.choice(fleet.running())
        fleet.stop(worker)
        worker.process.wait(timeout=fleet.settings.shutdown_grace_s + 30)
        fleet.start()
    elif fault == "redis":
        private_redis.stop()
        time.sleep(DOWNTIME_S)
        private_redis.start()
    else:
        private_postgres.stop()
        time.sleep(DOWNTIME_S)
        private_postgres.start()
    return 1
