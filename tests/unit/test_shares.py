"""The feeder's pure logic: which datasets the next messages go to (worker.shares), and the
seeded order within a dataset (models.order)."""

from __future__ import annotations

import hashlib
from collections import Counter

from models.feed import FeedDataset
from models.order import sort_key
from worker.feeder import interleave
from worker.shares import Share, allocate, job_cost, share_of


def dataset(
    dataset_id: int,
    *,
    queued: int,
    published: int = 0,
    taken: int = 0,
    done: int = 0,
    budget: int | None = None,
    used: int = 0,
    reserved: int = 0,
    max_new: int = 100,
) -> FeedDataset:
    return FeedDataset(
        dataset_id=dataset_id,
        run="r",
        dataset=f"d{dataset_id}",
        budget_tokens=budget,
        used_tokens=used,
        reserved_tokens=reserved,
        queued=queued,
        published=published,
        taken=taken,
        done=done,
        max_new_tokens=max_new,
    )


def test_datasets_get_messages_in_proportion_to_their_work() -> None:
    # 9,000 jobs and 1,000 jobs, nothing done: nine messages of the first for one of the
    # second, in every stretch of the order, not the first dataset's 9,000 first.
    shares = [share_of(dataset(1, queued=9000)), share_of(dataset(2, queued=1000))]
    order = allocate(shares, 100)
    assert Counter(order) == {1: 90, 2: 10}
    assert Counter(order[:10]) == {1: 9, 2: 1}


def test_a_dataset_enqueued_later_catches_up_before_sharing() -> None:
    # The first dataset is a tenth done; the second just arrived: it gets every message
    # until it is as far along, then they share.
    first = share_of(dataset(1, queued=900, taken=100))
    second = share_of(dataset(2, queued=1000))
    order = allocate([first, second], 150)
    assert order[:100] == [2] * 100
    assert Counter(order[100:]) == {1: 25, 2: 25}


def test_a_budget_counts_the_work_in_tokens_up_to_what_the_file_holds() -> None:
    # Dataset 1: 10,000 jobs but a budget for about 110 of them (1,000 tokens a job so far);
    # dataset 2: 110 unlimited jobs. Both are 10 jobs into 110 jobs of work: they share
    # evenly, although the first has 100 times as many jobs.
    capped = dataset(1, queued=9990, done=10, taken=10, budget=110_000, used=10_000)
    assert job_cost(capped) == 1000
    unlimited = dataset(2, queued=100, done=10, taken=10)
    order = allocate([share_of(capped), share_of(unlimited)], 60)
    counts = Counter(order)
    assert abs(counts[1] - counts[2]) <= 2


def test_a_budget_caps_what_is_published_to_what_its_room_can_run() -> None:
    # 5,000 tokens left at 1,000 a job: five may be out at once; two are already.
    d = dataset(1, queued=500, published=2, done=5, taken=5, budget=10_000, used=5_000)
    assert share_of(d).cap == 3
    assert allocate([share_of(d)], 50) == [1, 1, 1]
    # Room held by running jobs: nothing more now (it would only be deferred).
    held = dataset(1, queued=500, done=5, taken=7, budget=10_000, used=5_000, reserved=5_000)
    assert share_of(held).cap == 0
    # Nothing held and less room than a job: one runs anyway (the ledger's rule).
    last = dataset(1, queued=500, done=9, taken=9, budget=10_000, used=9_900)
    assert share_of(last).cap == 1


def test_before_any_job_is_done_a_job_costs_its_worst_case() -> None:
    d = dataset(1, queued=50, budget=1000, max_new=300)
    assert job_cost(d) == 300
    assert share_of(d).cap == 4  # ceil(1000 / 300)


def test_spent_and_empty_datasets_get_nothing() -> None:
    spent = dataset(1, queued=10, budget=100, used=100, done=1, taken=1)
    assert spent.spent
    assert allocate([share_of(spent)], 10) == []
    all_out = dataset(2, queued=3, published=3)
    assert allocate([share_of(all_out)], 10) == []
    assert allocate([Share(3, 0.0, 0.0, 1.0, 5)], 10) == []


def test_interleave_lays_the_jobs_out_in_the_allocations_order() -> None:
    order = [1, 2, 1, 1, 2, 3]
    # Dataset 1 yielded only two of its three (one was held by another transaction).
    taken = {1: [10, 11], 2: [20, 21], 3: [30]}
    assert interleave(order, taken) == [10, 20, 11, 21, 30]


def digest(i: int) -> bytes:
    return hashlib.sha256(f"prompt {i}".encode()).digest()


def test_the_order_is_seeded_and_has_nothing_to_do_with_the_files() -> None:
    keys = [sort_key(7, digest(i)) for i in range(2000)]
    assert keys == [sort_key(7, digest(i)) for i in range(2000)]  # reproducible
    assert keys != [sort_key(8, digest(i)) for i in range(2000)]  # another seed, another
    assert all(0 <= k < 1 << 60 for k in keys)
    ranked = sorted(range(2000), key=keys.__getitem__)
    # The first tenth of the order is spread over the whole file: each fifth of the file
    # holds about a fifth of it (200 rows: 40 each; a file-order prefix holds 200, 0, ...).
    fifths = Counter(row * 5 // 2000 for row in ranked[:200])
    assert all(25 <= fifths[f] <= 55 for f in range(5)), fifths
