"""Many worker threads in two processes racing on small budgets, and a budget raised mid-run."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from core.broker import Publisher
from core.settings import Settings
from eaglegen.sim import SimConfig, SimServer
from models.budgets import BudgetRow
from models.repository import Repository
from tests.faults.conftest import FleetFactory
from tests.faults.harness import (
    Fleet,
    assert_exactly_once,
    report,
    seed_jobs,
    state_counts,
    wait_for,
    wait_settled,
)
from tests.workers import EACH_ENGINE

pytestmark = [pytest.mark.faults, EACH_ENGINE]

MAX_NEW = 64
# Natural lengths around 40 tokens: some answers stop early, some are cut at MAX_NEW.
SHORT_ANSWERS = SimConfig(
    seed=5, decode_step_ms=0.5, decode_ms_per_request=0.02, mean_output_tokens=40
)
BUDGETS = {"b1": 1_500, "b2": 2_345, "b3": 3_210}
JOBS_PER_DATASET = 150


@pytest.fixture
def short_fleet(
    fleet_factory: FleetFactory,
    fast_settings: Settings,
    make_sim: Callable[[SimConfig], SimServer],
) -> Fleet:
    """Workers on a simulator whose answers vary in length around MAX_NEW."""
    sim = make_sim(SHORT_ANSWERS)
    return fleet_factory(fast_settings, [f"sim={sim.url}"])


def test_racing_workers_never_overshoot_a_budget_by_a_reservation(
    fast_settings: Settings, repo: Repository, short_fleet: Fleet
) -> None:
    """used equals the recorded tokens exactly, nothing stays reserved, overshoot < MAX_NEW:
    the bound of worst-case reservations (the observed policy's is tests/integration's)."""
    for name, budget in BUDGETS.items():
        seed_jobs(
            fast_settings,
            JOBS_PER_DATASET,
            dataset=name,
            max_new_tokens=MAX_NEW,
            budget=budget,
            reserve="worst_case",
        )
    short_fleet.start()
    short_fleet.start()
    wait_settled(repo, short_fleet, timeout_s=120)
    overshoots = {row.dataset: _check_ledger(repo, row, short_fleet) for row in repo.budgets()}
    assert repo.audit(lease_grace_s=0) == [], short_fleet.tails()
    report(
        "budget race",
        workers="2 processes x 8 threads",
        budgets=BUDGETS,
        states=dict(state_counts(repo)),
        overshoot=overshoots,
        largest_overshoot=max(overshoots.values()),
    )


def _check_ledger(repo: Repository, row: BudgetRow, fleet: Fleet) -> int:
    """Assert one dataset's ledger against its generations; its overshoot."""
    [counts] = [c for c in repo.counts() if c.dataset == row.dataset]
    assert counts.states["done"] + counts.states["skipped_budget"] == JOBS_PER_DATASET
    assert row.skipped_jobs > 0, f"{row.dataset}: the budget never bound"
    assert row.used_tokens == counts.completion_tokens, (row, fleet.tails())
    assert row.reserved_tokens == 0, row
    assert row.budget_tokens is not None
    overshoot = row.used_tokens - row.budget_tokens
    assert 0 <= overshoot < MAX_NEW, (row, fleet.tails())
    return overshoot


def test_raising_a_budget_mid_run_resumes_the_skipped_jobs(
    fast_settings: Settings, repo: Repository, short_fleet: Fleet
) -> None:
    """As `eaglegen budget set` does: re-queue the skipped jobs, publish them; all end done."""
    total = len(seed_jobs(fast_settings, 300, dataset="grow", max_new_tokens=MAX_NEW, budget=1_000))
    short_fleet.start()
    short_fleet.start()
    wait_for(
        lambda: state_counts(repo)["skipped_budget"] >= 20, 90, "skipped jobs", short_fleet.tails
    )
    skipped_before = state_counts(repo)["skipped_budget"]
    requeued = repo.set_budget("run", "grow", None)
    assert len(requeued) >= skipped_before
    assert fast_settings.broker_url is not None
    publisher = Publisher(fast_settings.broker_url, fast_settings.queue)
    publisher.publish(requeued)
    publisher.close()
    wait_settled(repo, short_fleet, timeout_s=120)
    assert_exactly_once(repo, total, short_fleet)
    [row] = repo.budgets()
    assert (row.used_tokens, row.reserved_tokens) == (repo.counts()[0].completion_tokens, 0)
    report("budget raised", jobs=total, requeued=len(requeued), used_tokens=row.used_tokens)
