"""The budget ledger and leases against real Postgres: reserve, settle, release, expire."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from models.db import make_engine
from models.ledger import BudgetBasis
from models.records import DatasetSpec, GenerationRecord, NewJob, RunSpec
from models.repository import Repository
from models.states import JobState
from tests.helpers import InspectRepository


@pytest.fixture
def repo(database_url: str) -> Iterator[Repository]:
    engine = make_engine(database_url, pool_size=20)
    yield InspectRepository(engine)
    engine.dispose()


def dataset(
    repo: Repository,
    n: int,
    *,
    budget: int | None,
    max_new: int = 100,
    basis: BudgetBasis = BudgetBasis.COMPLETION,
) -> tuple[int, list[int]]:
    run_id = repo.ensure_run(RunSpec("r", "/tok", "a" * 64, "b" * 64, "tiny"))
    dataset_id = repo.ensure_dataset(
        run_id,
        DatasetSpec(
            "d",
            "d.jsonl",
            {"max_new_tokens": max_new},
            budget_tokens=budget,
            budget_basis=basis.value,
        ),
    )
    ids = repo.insert_jobs(dataset_id, [NewJob(i, [7] * 10 + [i], {}) for i in range(n)])
    return dataset_id, ids


def gen(completion: int) -> GenerationRecord:
    return GenerationRecord(
        output_ids=list(range(completion)),
        finish_type="length",
        finish_matched=completion,
        prompt_tokens=11,
        completion_tokens=completion,
        cached_tokens=0,
        e2e_latency=0.1,
        server="sim",
    )


def ledger(repo: Repository, dataset_id: int) -> tuple[int, int]:
    [row] = [b for b in repo.budgets() if b.dataset_id == dataset_id]
    return row.used_tokens, row.reserved_tokens


def test_reserve_then_settle_to_the_real_count(repo: Repository) -> None:
    dataset_id, ids = dataset(repo, 2, budget=None)
    claim = repo.claim(ids[0], "w", 60)
    assert claim.job is not None and claim.job.reserved_tokens == 100
    assert ledger(repo, dataset_id) == (0, 100)
    assert repo.record(ids[0], "w", gen(37))
    assert ledger(repo, dataset_id) == (37, 0)


def test_total_basis_counts_the_prompt(repo: Repository) -> None:
    dataset_id, ids = dataset(repo, 1, budget=None, basis=BudgetBasis.TOTAL)
    claim = repo.claim(ids[0], "w", 60)
    assert claim.job is not None and claim.job.reserved_tokens == 100 + 11
    repo.record(ids[0], "w", gen(37))
    assert ledger(repo, dataset_id) == (37 + 11, 0)


def test_release_and_fail_return_the_reservation(repo: Repository) -> None:
    dataset_id, ids = dataset(repo, 2, budget=None)
    repo.claim(ids[0], "w", 60)
    repo.claim(ids[1], "w", 60)
    assert ledger(repo, dataset_id) == (0, 200)
    assert repo.release(ids[0], "w", "503", refund=True)
    assert repo.fail(ids[1], "w", "400: too long")
    assert ledger(repo, dataset_id) == (0, 0)
    job = repo.job(ids[0])
    assert job is not None and (job["state"], job["attempts"]) == ("queued", 0)


def test_jobs_defer_while_budget_is_held_and_skip_once_it_is_spent(repo: Repository) -> None:
    dataset_id, ids = dataset(repo, 4, budget=250)
    assert repo.claim(ids[0], "w", 60).outcome == "claimed"  # holds 100
    assert repo.claim(ids[1], "w", 60).outcome == "claimed"  # holds 200
    assert repo.claim(ids[2], "w", 60).outcome == "deferred"  # 300 > 250 while 200 held
    job = repo.job(ids[2])
    assert job is not None and (job["state"], job["attempts"]) == ("queued", 0)
    repo.record(ids[0], "w", gen(100))
    repo.record(ids[1], "w", gen(100))
    # used 200 < 250 and nothing held: one more job may run and overshoot.
    assert repo.claim(ids[2], "w", 60).outcome == "claimed"
    repo.record(ids[2], "w", gen(100))
    assert repo.claim(ids[3], "w", 60).outcome == "skipped"
    assert ledger(repo, dataset_id) == (300, 0)
    assert repo.job_ids(state=JobState.SKIPPED_BUDGET) == [ids[3]]


def test_raising_a_budget_requeues_skipped_jobs(repo: Repository) -> None:
    _, ids = dataset(repo, 3, budget=100)
    repo.claim(ids[0], "w", 60)
    repo.record(ids[0], "w", gen(100))
    assert [repo.claim(i, "w", 60).outcome for i in ids[1:]] == ["skipped", "skipped"]
    assert repo.set_budget("r", "d", 100) == []  # not raised above what is used
    assert repo.set_budget("r", "d", 150) == ids[1:]
    assert repo.job_ids(state=JobState.QUEUED) == ids[1:]


def test_lowering_a_budget_requeues_nothing(repo: Repository) -> None:
    _, ids = dataset(repo, 2, budget=100)
    repo.claim(ids[0], "w", 60)
    repo.record(ids[0], "w", gen(100))
    assert repo.claim(ids[1], "w", 60).outcome == "skipped"
    assert repo.set_budget("r", "d", 50) == []
    assert repo.job_ids(state=JobState.SKIPPED_BUDGET) == [ids[1]]


def test_expired_leases_requeue_jobs_and_release_their_budget(repo: Repository) -> None:
    dataset_id, ids = dataset(repo, 2, budget=None)
    repo.claim(ids[0], "dead-worker", lease_seconds=1)
    repo.claim(ids[1], "live-worker", lease_seconds=60)
    time.sleep(1.2)
    assert repo.extend_leases([ids[1]], "live-worker", 60) == 1
    assert repo.expire_leases(max_attempts=5) == [ids[0]]
    assert ledger(repo, dataset_id) == (0, 100)
    job = repo.job(ids[0])
    assert job is not None and job["state"] == "queued" and "lease expired" in job["last_error"]
    assert not repo.record(ids[0], "dead-worker", gen(5))  # the dead worker's late answer


def test_expired_lease_on_the_last_attempt_fails_the_job(repo: Repository) -> None:
    _, ids = dataset(repo, 1, budget=None)
    repo.claim(ids[0], "w", lease_seconds=1)
    time.sleep(1.2)
    assert repo.expire_leases(max_attempts=1) == []
    job = repo.job(ids[0])
    assert job is not None and job["state"] == "failed"


@pytest.mark.embedded
def test_many_workers_racing_on_a_small_budget(repo: Repository) -> None:
    budget, max_new = 2_000, 100
    dataset_id, ids = dataset(repo, 200, budget=budget, max_new=max_new)
    recorded: list[int] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        import random

        rng = random.Random(name)
        for job_id in ids:
            claim = repo.claim(job_id, name, 60)
            if claim.job is not None:
                completion = rng.randint(1, max_new)
                if repo.record(job_id, name, gen(completion)):
                    with lock:
                        recorded.append(completion)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Deferred jobs are still queued: drain them serially, as the re-published messages would.
    for job_id in repo.job_ids(state=JobState.QUEUED):
        if repo.claim(job_id, "drain", 60).job is not None:
            repo.record(job_id, "drain", gen(max_new))
            recorded.append(max_new)
    used, reserved = ledger(repo, dataset_id)
    assert used == sum(recorded) and reserved == 0
    assert budget <= used < budget + max_new
    assert repo.generation_count() == len(recorded)
