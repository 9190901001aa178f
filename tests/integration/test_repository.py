"""The claim, the record and the counts against real Postgres."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import pytest
from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError

from models.db import is_lock_timeout, make_engine
from models.records import DatasetSpec, GenerationRecord, JobBatch, NewJob, RunSpec
from models.repository import DatasetMismatchError, Repository, RunMismatchError
from models.schema import Dataset, Job, Run
from models.states import JobState
from tests.helpers import InspectRepository


@pytest.fixture
def repo(database_url: str) -> Iterator[Repository]:
    engine = make_engine(database_url, pool_size=20)
    yield InspectRepository(engine)
    engine.dispose()


def make_dataset(repo: Repository, n_jobs: int) -> tuple[int, list[int]]:
    run_id = repo.ensure_run(RunSpec("r", "/tok", "a" * 64, "b" * 64, "tiny"))
    dataset_id = repo.ensure_dataset(run_id, DatasetSpec("d", "d.jsonl", {"max_new_tokens": 8}))
    jobs = [NewJob(i, [1, 2, i], {"messages": []}) for i in range(n_jobs)]
    return dataset_id, repo.insert_jobs(dataset_id, jobs)


def generation(n: int = 3) -> GenerationRecord:
    return GenerationRecord(
        output_ids=list(range(100, 100 + n)),
        finish_type="length",
        finish_matched=n,
        prompt_tokens=3,
        completion_tokens=n,
        cached_tokens=0,
        e2e_latency=0.1,
        server="sim",
    )


@pytest.mark.embedded
def test_claim_is_won_exactly_once_under_concurrent_claimers(repo: Repository) -> None:
    _, ids = make_dataset(repo, 200)
    wins: Counter[int] = Counter()
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def claimer(name: str) -> None:
        barrier.wait()
        for job_id in ids:
            if repo.claim(job_id, name, lease_seconds=60).job is not None:
                with lock:
                    wins[job_id] += 1

    threads = [threading.Thread(target=claimer, args=(f"w{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(wins) == sorted(ids)
    assert set(wins.values()) == {1}
    assert repo.job_ids(state=JobState.RUNNING) == sorted(ids)


def test_claim_returns_ids_and_sampling_params(repo: Repository) -> None:
    _, ids = make_dataset(repo, 1)
    claimed = repo.claim(ids[0], "w", lease_seconds=60).job
    assert claimed is not None
    assert claimed.input_ids == [1, 2, 0]
    assert claimed.sampling_params == {"max_new_tokens": 8}
    assert claimed.attempts == 1
    assert claimed.reserved_tokens == 8  # completion basis: max_new_tokens
    assert repo.claim(ids[0], "other", lease_seconds=60).outcome == "not_queued"


def test_a_job_recorded_twice_stays_one_row(repo: Repository) -> None:
    _, ids = make_dataset(repo, 1)
    assert repo.claim(ids[0], "w", lease_seconds=60).job is not None
    assert repo.record(ids[0], "w", generation()) is True
    assert repo.record(ids[0], "w", generation(5)) is False
    assert repo.generation_count(ids[0]) == 1
    stored = repo.generation(ids[0])
    assert stored is not None and stored["output_ids"] == [100, 101, 102]
    job = repo.job(ids[0])
    assert job is not None and job["state"] == "done"


def test_a_record_that_meets_a_stored_generation_changes_nothing(repo: Repository) -> None:
    # Never while a claim holds; here the job is set running again by hand after its record.
    # The record is one statement: its failed insert undoes the job's and the ledger's
    # updates with it.
    dataset_id, ids = make_dataset(repo, 1)
    assert repo.claim(ids[0], "w", lease_seconds=60).job is not None
    assert repo.record(ids[0], "w", generation()) is True
    with repo.engine.begin() as conn:
        conn.execute(
            update(Job)
            .where(Job.id == ids[0])
            .values(state="running", worker="w", reserved_tokens=8)
        )
        conn.execute(update(Dataset).where(Dataset.id == dataset_id).values(reserved_tokens=8))
    before = [b for b in repo.budgets() if b.dataset_id == dataset_id]
    assert repo.record(ids[0], "w", generation(5)) is False
    job = repo.job(ids[0])
    assert job is not None and (job["state"], job["worker"]) == ("running", "w")
    assert [b for b in repo.budgets() if b.dataset_id == dataset_id] == before
    stored = repo.generation(ids[0])
    assert stored is not None and stored["output_ids"] == [100, 101, 102]


def test_open_jobs_follows_the_counters_through_claim_and_record(repo: Repository) -> None:
    _, ids = make_dataset(repo, 3)
    assert repo.open_jobs("r") == 3
    repo.claim(ids[0], "w", lease_seconds=60)
    assert repo.open_jobs("r") == 3  # running is open
    repo.record(ids[0], "w", generation())
    repo.claim(ids[1], "w", lease_seconds=60)
    repo.fail(ids[1], "w", "HTTP 400")
    assert repo.open_jobs("r") == 1
    [counts] = repo.counts("r")
    assert counts.states["queued"] + counts.states["running"] == 1
    assert repo.open_jobs("no such run") == 0


def test_a_worker_that_lost_its_claim_cannot_record(repo: Repository) -> None:
    _, ids = make_dataset(repo, 1)
    assert repo.claim(ids[0], "w1", lease_seconds=60).job is not None
    assert repo.release(ids[0], "w1", "503") is True
    assert repo.claim(ids[0], "w2", lease_seconds=60).job is not None
    assert repo.record(ids[0], "w1", generation()) is False  # stale worker
    assert repo.record(ids[0], "w2", generation()) is True
    assert repo.generation_count() == 1
    job = repo.job(ids[0])
    assert job is not None and job["attempts"] == 2 and job["worker"] == "w2"


def test_fail_keeps_the_last_error(repo: Repository) -> None:
    _, ids = make_dataset(repo, 1)
    repo.claim(ids[0], "w", lease_seconds=60)
    assert repo.fail(ids[0], "w", "HTTP 400: too long") is True
    job = repo.job(ids[0])
    assert job is not None
    assert (job["state"], job["last_error"]) == ("failed", "HTTP 400: too long")


def test_insert_is_idempotent_and_counts_by_state(repo: Repository) -> None:
    dataset_id, ids = make_dataset(repo, 5)
    again = repo.insert_jobs(dataset_id, [NewJob(0, [1, 2, 0], {})])  # same ids as job 0
    assert again == []
    repo.claim(ids[0], "w", lease_seconds=60)
    repo.record(ids[0], "w", generation(4))
    [counts] = repo.counts()
    assert counts.states["done"] == 1 and counts.states["queued"] == 4
    assert counts.total == 5
    assert counts.completion_tokens == 4
    assert counts.prompt_tokens == 15


# expect_new: the jobs are copied straight into `jobs` (they are all new here).
@pytest.mark.parametrize("expect_new", [False, True])
def test_insert_returns_new_ids_in_row_order_and_stores_each_column(
    repo: Repository, expect_new: bool
) -> None:
    dataset_id, first = make_dataset(repo, 0)
    jobs = [
        NewJob(i, [9, i, 70_000 + i], {"messages": [{"role": "user", "content": f"é{i}"}]})
        for i in (4, 1, 3)
    ]
    ids = repo.insert_jobs(dataset_id, JobBatch.of(jobs), expect_new=expect_new)
    assert first == [] and len(ids) == 3 and ids == sorted(ids)
    stored = [repo.job(job_id) for job_id in ids]
    assert [(j["row_index"], j["input_ids"], j["prompt_tokens"]) for j in stored if j] == [
        (1, [9, 1, 70_001], 3),
        (3, [9, 3, 70_003], 3),
        (4, [9, 4, 70_004], 3),
    ]
    assert [j["messages"] for j in stored if j] == [
        jobs[1].messages,
        jobs[2].messages,
        jobs[0].messages,
    ]
    # A batch mixing old and new prompts gets ids for the new ones only.
    more = repo.insert_jobs(dataset_id, [jobs[0], NewJob(5, [9, 5], {})])
    assert len(more) == 1 and repo.job(more[0])["row_index"] == 5  # type: ignore[index]


def test_jobs_expected_new_that_exist_are_skipped_all_the_same(repo: Repository) -> None:
    dataset_id, old = make_dataset(repo, 3)  # rows 0-2
    batch = [NewJob(i, [1, 2, i], {"messages": []}) for i in (4, 1, 5, 2)]  # 1, 2 exist
    new = repo.insert_jobs(dataset_id, batch, expect_new=True)
    assert [repo.job(i)["row_index"] for i in new] == [4, 5]  # type: ignore[index]
    assert min(new) > max(old)
    assert sorted(repo.job_ids()) == sorted(old + new)  # the failed COPY left nothing


def test_run_and_dataset_identity_is_enforced(repo: Repository) -> None:
    run_id = repo.ensure_run(RunSpec("r", "/tok", "a" * 64, "b" * 64, "tiny"))
    assert repo.ensure_run(RunSpec("r", "/tok", "a" * 64, "b" * 64, "tiny")) == run_id
    with pytest.raises(RunMismatchError, match="new run"):
        repo.ensure_run(RunSpec("r", "/tok", "c" * 64, "b" * 64, "tiny"))
    repo.ensure_dataset(run_id, DatasetSpec("d", "x", {"max_new_tokens": 8}))
    with pytest.raises(DatasetMismatchError, match="new run"):
        repo.ensure_dataset(run_id, DatasetSpec("d", "x", {"max_new_tokens": 9}))


def test_concurrent_inserts_of_overlapping_jobs_store_each_prompt_once(repo: Repository) -> None:
    # Two enqueues of the same dataset at once, both expecting new jobs: one COPY waits on
    # the other's rows in the unique index, fails once it commits, and takes the staging path.
    dataset_id, _ = make_dataset(repo, 0)
    batches = [
        [NewJob(i, [3, i], {"messages": []}) for i in range(0, 600)],
        [NewJob(i, [3, i], {"messages": []}) for i in range(300, 900)],
    ]
    start = threading.Barrier(len(batches))
    results: list[list[int]] = [[] for _ in batches]

    def insert(k: int) -> None:
        start.wait()
        for i in range(0, len(batches[k]), 100):
            results[k] += repo.insert_jobs(dataset_id, batches[k][i : i + 100], expect_new=True)

    threads = [threading.Thread(target=insert, args=(k,)) for k in range(len(batches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stored = repo.job_ids()
    assert sorted(results[0] + results[1]) == sorted(stored)  # every new id reported once
    assert sorted(repo.job(i)["row_index"] for i in stored) == list(range(900))  # type: ignore[index]


def test_a_run_without_a_recorded_think_end_gets_it_from_the_same_tokenizer(
    repo: Repository,
) -> None:
    # Runs created before 0005 recorded it only when the probe prompt ended in `<think>`.
    run_id = repo.ensure_run(RunSpec("r", "/tok", "a" * 64, "b" * 64, "tiny"))
    other = RunSpec("r", "/tok", "c" * 64, "b" * 64, "tiny", think_end_id=10)
    with pytest.raises(RunMismatchError):
        repo.ensure_run(other)

    def stored() -> int | None:
        with repo.engine.connect() as conn:
            return conn.scalar(select(Run.think_end_id).where(Run.id == run_id))

    assert stored() is None  # another tokenizer says nothing about this run's
    assert repo.ensure_run(RunSpec("r", "/tok", "a" * 64, "b" * 64, "tiny", think_end_id=10))
    assert stored() == 10


def test_a_run_records_its_vocabulary_and_a_claim_carries_it(repo: Repository) -> None:
    # Runs created before 0006 have none: the same tokenizer fills it in, another does not.
    run_id = repo.ensure_run(RunSpec("r", "/tok", "a" * 64, "b" * 64, "tiny"))
    with pytest.raises(RunMismatchError):
        repo.ensure_run(RunSpec("r", "/tok", "c" * 64, "b" * 64, "tiny", vocab_size=99))
    repo.ensure_run(RunSpec("r", "/tok", "a" * 64, "b" * 64, "tiny", vocab_size=4100))
    with repo.engine.connect() as conn:
        assert conn.scalar(select(Run.vocab_size).where(Run.id == run_id)) == 4100
    dataset = repo.ensure_dataset(run_id, DatasetSpec("d", "d.jsonl", {"max_new_tokens": 8}))
    [job_id] = repo.insert_jobs(dataset, [NewJob(0, [1, 2, 3], None)])
    claim = repo.claim(job_id, "w", lease_seconds=60)
    assert claim.job is not None and claim.job.vocab_size == 4100


def test_a_driver_error_on_the_hot_path_is_raised_as_sqlalchemys(database_url: str) -> None:
    # models.attempt runs on psycopg directly; the worker tells a lost or locked database
    # (retry) from anything else by SQLAlchemy's classes, as for every other query.
    engine = make_engine(database_url, hold_limit_ms=200)  # a worker's: lock_timeout 200 ms
    other = make_engine(database_url)
    repo = Repository(engine)
    _, ids = make_dataset(repo, 1)
    try:
        with other.begin() as holder:
            # Hold the job's row: the claim's UPDATE waits for it until its lock_timeout.
            holder.execute(select(Job.id).where(Job.id == ids[0]).with_for_update())
            with pytest.raises(OperationalError) as caught:
                repo.claim(ids[0], "w", lease_seconds=60)
        assert is_lock_timeout(caught.value)
        assert repo.claim(ids[0], "w", lease_seconds=60).outcome == "claimed"  # unharmed
    finally:
        engine.dispose()
        other.dispose()
