"""Claims and records in batches (models.attempt.claim_batch, record_batch: the statements
of the single claim and record, many to a pipeline) against real Postgres: the same outcomes
and the same ledger as one at a time, one bad row costing only itself, and batches racing
each other and single claims on a small budget."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from psycopg.rows import namedtuple_row
from sqlalchemy import text

from core.urls import libpq_url
from models.attempt import claim_batch, record_batch
from models.db import make_engine
from models.records import ClaimedJob
from models.repository import Repository
from tests.helpers import InspectRepository
from tests.integration.test_ledger import answer_length, dataset, gen, ledger

DEADLOCKS = "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"


@pytest.fixture
def repo(database_url: str) -> Iterator[Repository]:
    engine = make_engine(database_url, pool_size=20)
    yield InspectRepository(engine)
    engine.dispose()


async def connect(database_url: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(
        libpq_url(database_url), autocommit=True, row_factory=namedtuple_row
    )


def claims(database_url: str, ids: list[int], worker: str = "w") -> list[Any]:
    async def run() -> list[Any]:
        async with await connect(database_url) as conn:
            return await claim_batch(conn, ids, worker, 60)

    return asyncio.run(run())


def records(database_url: str, done: list[tuple[ClaimedJob, int]], worker: str = "w") -> list[bool]:
    async def run() -> list[bool]:
        async with await connect(database_url) as conn:
            return await record_batch(conn, worker, [(job, gen(n)) for job, n in done])

    return asyncio.run(run())


def test_a_batch_keeps_the_ledger_rule_job_by_job(repo: Repository, database_url: str) -> None:
    # As test_ledger's single claims: two fit in 250, the next two are deferred.
    dataset_id, ids = dataset(repo, 4, budget=250)
    first = claims(database_url, ids)
    assert [c.outcome for c in first] == ["claimed", "claimed", "deferred", "deferred"]
    assert [c.job.id for c in first[:2]] == ids[:2]
    assert first[0].job.input_ids == [7] * 10 + [0]
    assert first[0].job.sampling_params["max_new_tokens"] == 100
    assert ledger(repo, dataset_id) == (0, 200)
    assert records(database_url, [(first[0].job, 100), (first[1].job, 100)]) == [True, True]
    assert ledger(repo, dataset_id) == (200, 0)
    # Nothing held and the budget not spent: one more runs (and may overshoot), the one after
    # it waits for that one; once it is recorded the budget is spent, and the last is skipped.
    second = claims(database_url, ids[2:])
    assert [c.outcome for c in second] == ["claimed", "deferred"]
    assert records(database_url, [(second[0].job, 100)]) == [True]
    assert [c.outcome for c in claims(database_url, ids[3:])] == ["skipped"]
    assert ledger(repo, dataset_id) == (300, 0)
    assert repo.audit(lease_grace_s=60) == []


def test_answers_come_back_in_the_order_asked_across_datasets(
    repo: Repository, database_url: str
) -> None:
    _, a = dataset(repo, 3, budget=None, name="a")
    _, b = dataset(repo, 3, budget=None, name="b")
    assert repo.claim(a[1], "other", 60).job is not None  # taken by another worker
    # One not queued, one not a job, one asked twice (two messages of it in one batch).
    asked = [b[2], a[0], a[1], b[0], 10**9, a[2], b[1], a[0]]
    got = claims(database_url, asked)
    taken, absent, again = got[2], got[4], got[7]
    assert (taken.outcome, absent.outcome, again.outcome) == ("not_queued",) * 3
    assert all(c.outcome == "claimed" for c in got[:2] + got[3:4] + got[5:7])
    assert [c.job.id for c in got if c.job is not None] == [b[2], a[0], b[0], a[2], b[1]]
    assert {c.job.dataset for c in got if c.job is not None} == {"a", "b"}
    with repo.engine.connect() as conn:
        rows = conn.execute(text("SELECT worker, count(*) FROM jobs GROUP BY worker")).all()
    assert dict(rows) == {"w": 5, "other": 1}


def test_a_record_that_fails_costs_only_itself(repo: Repository, database_url: str) -> None:
    dataset_id, ids = dataset(repo, 4, budget=None)
    held = [c.job for c in claims(database_url, ids)]
    assert all(job is not None for job in held)
    # Job 0 already has a generation (a defect: never while its claim holds): its insert
    # fails, which aborts the whole batch; job 1's claim is lost (the reconciler took it).
    with repo.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO generations (job_id, dataset_id, output_ids, finish_type, "
                "prompt_tokens, completion_tokens, cached_tokens, e2e_latency, server, "
                "meta_info) VALUES (:job, :dataset, '', 'length', 11, 0, 0, 0.1, 'sim', '{}')"
            ),
            {"job": ids[0], "dataset": dataset_id},
        )
    assert repo.release(ids[1], "w", "lease expired", refund=True)
    done = records(database_url, [(job, 10) for job in held])
    assert done == [False, False, True, True]
    assert ledger(repo, dataset_id) == (20, 100)  # job 0 still holds its reservation
    states = {i: (repo.job(i) or {})["state"] for i in ids}
    assert states == {ids[0]: "running", ids[1]: "queued", ids[2]: "done", ids[3]: "done"}


def test_batches_racing_each_other_and_single_claims_on_a_small_budget(
    repo: Repository, database_url: str
) -> None:
    budget, max_new, batchers, singles = 6_000, 100, 3, 3
    dataset_id, ids = dataset(repo, 600, budget=budget, max_new=max_new)
    recorded: list[int] = []
    lock = threading.Lock()

    async def batcher(name: str) -> None:
        rng = random.Random(name)
        order = ids[:]
        rng.shuffle(order)  # the batches overlap in any order
        async with await connect(database_url) as conn:
            for start in range(0, len(order), 16):
                won = [c.job for c in await claim_batch(conn, order[start : start + 16], name, 60)]
                done = [(job, gen(answer_length(rng, max_new))) for job in won if job is not None]
                stored = await record_batch(conn, name, done)
                with lock:
                    recorded.extend(
                        g.completion_tokens for (_, g), ok in zip(done, stored, strict=True) if ok
                    )

    def single(name: str) -> None:
        rng = random.Random(name)
        for job_id in ids:
            claim = repo.claim(job_id, name, 60)
            if claim.job is not None:
                completion = answer_length(rng, max_new)
                if repo.record(job_id, name, gen(completion)):
                    with lock:
                        recorded.append(completion)

    async def batches() -> None:
        await asyncio.gather(*(batcher(f"b{i}") for i in range(batchers)))

    with ThreadPoolExecutor(singles + 1) as pool:
        running = [pool.submit(single, f"s{i}") for i in range(singles)]
        running.append(pool.submit(asyncio.run, batches()))
        for each in running:
            each.result()  # a claim or record that failed (a deadlock, say) fails the test
    used, reserved = ledger(repo, dataset_id)
    assert used == sum(recorded) and reserved == 0
    assert repo.generation_count() == len(recorded)
    assert repo.audit(lease_grace_s=0) == []
    with repo.engine.connect() as conn:
        deadlocks = conn.execute(text(DEADLOCKS)).scalar_one()
    assert deadlocks == 0  # the batches lock in the single statements' order
    # Worst-case reservations: only a job claimed with nothing held may go past the budget.
    assert budget <= used < budget + max_new
