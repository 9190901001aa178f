"""The budget ledger and leases against real Postgres: reserve, settle, release, expire."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator

import pytest

from core.settings import Settings
from models.db import make_engine
from models.ledger import (
    OBSERVED_MIN_SAMPLES,
    OBSERVED_REFRESH_EVERY,
    BudgetBasis,
    ReservePolicy,
    observed_completion,
    overshoot_bound,
)
from models.records import DatasetSpec, GenerationRecord, NewJob, RunSpec
from models.repository import Repository
from models.states import JobState
from tests.e2e.test_cli import eaglegen, service_env
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
    name: str = "d",
    reserve: ReservePolicy | None = None,
) -> tuple[int, list[int]]:
    run_id = repo.ensure_run(RunSpec("r", "/tok", "a" * 64, "b" * 64, "tiny"))
    dataset_id = repo.ensure_dataset(
        run_id,
        DatasetSpec(
            name,
            f"{name}.jsonl",
            {"max_new_tokens": max_new},
            budget_tokens=budget,
            budget_basis=basis.value,
            reserve=None if reserve is None else reserve.value,
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


def answer_length(rng: random.Random, max_new: int) -> int:
    """Mostly short answers, and one in 200 cut at max_new: their 99th percentile is short,
    and some jobs still outgrow an observed reservation."""
    return max_new if rng.random() < 0.005 else rng.randint(1, 30)


@pytest.mark.embedded
@pytest.mark.parametrize("reserve", list(ReservePolicy))
def test_many_workers_racing_on_a_small_budget(repo: Repository, reserve: ReservePolicy) -> None:
    budget, max_new, threads = 8_000, 100, 8
    dataset_id, ids = dataset(repo, 700, budget=budget, max_new=max_new, reserve=reserve)
    recorded: list[int] = []
    reserved_at_claims: list[int] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        rng = random.Random(name)
        for job_id in ids:
            claim = repo.claim(job_id, name, 60)
            if claim.job is not None:
                completion = answer_length(rng, max_new)
                with lock:
                    reserved_at_claims.append(claim.job.reserved_tokens)
                if repo.record(job_id, name, gen(completion)):
                    with lock:
                        recorded.append(completion)

    workers = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    # Deferred jobs are still queued: drain them serially, as the re-published messages would,
    # each answer as long as it may be.
    for job_id in repo.job_ids(state=JobState.QUEUED):
        claim = repo.claim(job_id, "drain", 60)
        if claim.job is not None:
            reserved_at_claims.append(claim.job.reserved_tokens)
            repo.record(job_id, "drain", gen(max_new))
            recorded.append(max_new)
    used, reserved = ledger(repo, dataset_id)
    assert used == sum(recorded) and reserved == 0
    assert repo.generation_count() == len(recorded)
    assert repo.audit(lease_grace_s=0) == []
    if reserve is ReservePolicy.WORST_CASE:
        assert set(reserved_at_claims) == {max_new}
        assert budget <= used < budget + max_new
        return
    # The reservation fell to the observed percentile once enough answers were recorded, and
    # the overshoot stays within the documented bound: at most `threads` jobs are in flight
    # after the last claim, none holding less than the smallest reservation.
    smallest = min(reserved_at_claims)
    assert smallest <= 30 < max_new, sorted(set(reserved_at_claims))
    assert budget <= used <= budget + overshoot_bound(max_new, [smallest] * threads)


def test_lowering_a_budget_below_what_is_in_flight_says_how_far_it_may_go_over(
    repo: Repository, settings: Settings
) -> None:
    # Requests in flight are never cancelled: `budget set` says what they may still add.
    _, ids = dataset(repo, 5, budget=1000)
    for job_id in ids[:4]:
        assert repo.claim(job_id, "w", 60).outcome == "claimed"
    repo.record(ids[0], "w", gen(100))  # used 100; three jobs hold 100 each
    env = service_env(settings)
    lowered = eaglegen("budget", "set", "d", "150", env=env)
    assert lowered.returncode == 0, lowered.stderr
    first, warning = lowered.stderr.strip().splitlines()
    assert first == "d: budget 150; 0 skipped job(s) queued again"
    assert warning == (
        "warning: 3 job(s) are running holding 300 tokens; they will finish and may take d "
        "over the new budget by up to 250 tokens"
    )
    document = json.loads(eaglegen("budget", "set", "d", "200", "--json", env=env).stdout)
    assert (document["running_jobs"], document["may_exceed_by"]) == (3, 200)
    raised = eaglegen("budget", "set", "d", "400", env=env)  # room for all three: no warning
    assert raised.returncode == 0 and "warning" not in raised.stderr, raised.stderr


def test_the_reservation_switches_to_the_observed_percentile_after_enough_answers(
    repo: Repository,
) -> None:
    max_new = 100
    dataset_id, ids = dataset(repo, OBSERVED_MIN_SAMPLES + 2, budget=10**9, max_new=max_new)
    _, fixed = dataset(repo, 1, budget=10**9, name="fixed", reserve=ReservePolicy.WORST_CASE)
    lengths = [1 + i % 40 for i in range(OBSERVED_MIN_SAMPLES)]  # 99th percentile: 40
    for job_id, length in zip(ids, lengths, strict=False):
        claim = repo.claim(job_id, "w", 60)
        # Until the record that makes OBSERVED_MIN_SAMPLES answers, the worst case.
        assert claim.job is not None and claim.job.reserved_tokens == max_new
        assert repo.record(job_id, "w", gen(length))
    expected = observed_completion(lengths, max_new)
    assert expected == 40
    claim = repo.claim(ids[-2], "w", 60)
    assert claim.job is not None and claim.job.reserved_tokens == expected
    assert ledger(repo, dataset_id) == (sum(lengths), expected)
    # One answer outgrows its reservation: settled exactly, and nothing stays held.
    assert repo.record(ids[-2], "w", gen(max_new))
    assert ledger(repo, dataset_id) == (sum(lengths) + max_new, 0)
    # A dataset that chose the worst case keeps it.
    claim = repo.claim(fixed[0], "w", 60)
    assert claim.job is not None and claim.job.reserved_tokens == max_new
    assert repo.audit(lease_grace_s=60) == []


def test_the_estimate_is_refreshed_every_few_answers(repo: Repository) -> None:
    n = OBSERVED_MIN_SAMPLES + OBSERVED_REFRESH_EVERY
    _, ids = dataset(repo, n + 1, budget=10**9, max_new=100)
    held = []
    for i, job_id in enumerate(ids[:n]):
        claim = repo.claim(job_id, "w", 60)
        assert claim.job is not None
        held.append(claim.job.reserved_tokens)
        # Short answers first, then longer ones.
        assert repo.record(job_id, "w", gen(10 if i < OBSERVED_MIN_SAMPLES else 70))
    # Worst case, then the first estimate until the next refresh, which sees the long ones.
    assert held == [100] * OBSERVED_MIN_SAMPLES + [10] * OBSERVED_REFRESH_EVERY
    claim = repo.claim(ids[n], "w", 60)
    assert claim.job is not None and claim.job.reserved_tokens == 70


def test_naming_a_reserve_policy_again_applies_it_and_leaving_it_out_keeps_it(
    repo: Repository,
) -> None:
    _, ids = dataset(repo, OBSERVED_MIN_SAMPLES + 1, budget=10**9, max_new=100)
    for job_id in ids[:-1]:
        repo.claim(job_id, "w", 60)
        repo.record(job_id, "w", gen(5))
    dataset(repo, 0, budget=10**9, reserve=ReservePolicy.WORST_CASE)  # enqueued again
    dataset(repo, 0, budget=10**9)  # and again, naming no policy
    claim = repo.claim(ids[-1], "w", 60)
    assert claim.job is not None and claim.job.reserved_tokens == 100
    assert repo.release(ids[-1], "w", "503", refund=True)
    dataset(repo, 0, budget=10**9, reserve=ReservePolicy.OBSERVED)
    claim = repo.claim(ids[-1], "w", 60)
    assert claim.job is not None and claim.job.reserved_tokens == 5
