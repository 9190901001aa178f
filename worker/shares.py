"""Which datasets the next messages go to: pure logic of the feeder (worker.feeder).

Each dataset advances in proportion to its work, so that all of them progress side by side
and, if the run stops early, each has the same share of its work done. A dataset's work is
counted in its own unit: tokens of its budget when it has one (the budget, or everything
its jobs would take when that is less), jobs when it has none; what is compared is the
fraction taken, which has no unit. Each next message goes to the least advanced dataset
(ties: the lower id), which then advances by one job's cost. The state is read afresh from
Postgres at every pass, so the allocation corrects itself and needs no memory.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from models.feed import FeedDataset


@dataclass(frozen=True)
class Share:
    """One dataset's progress as the allocation sees it."""

    key: int
    taken: float  # work taken so far (done, running, failed, published), in its unit
    total: float  # all its work, in its unit
    cost: float  # what one more job takes, in its unit
    cap: int  # at most this many more messages now


def share_of(d: FeedDataset) -> Share:
    """The share of a dataset with queued jobs (cap 0 when it must not be published now)."""
    if d.budget_tokens is None:
        jobs = d.taken + d.published
        return Share(d.dataset_id, jobs, jobs + d.ready, 1.0, d.ready)
    cost = job_cost(d)
    taken = d.used_tokens + d.reserved_tokens + d.published * cost
    total = min(float(d.budget_tokens), taken + d.ready * cost)
    room = d.budget_tokens - d.used_tokens - d.reserved_tokens
    # Publish no more than the room left can run: the rest would be taken, deferred and
    # sent back (retries in Flower). With nothing held, one runs even if larger than the
    # room (the ledger's rule, docs/design.md §4).
    fits = 0 if room <= 0 else max(1, math.ceil(room / cost))
    return Share(d.dataset_id, taken, total, cost, max(0, min(d.ready, fits - d.published)))


def job_cost(d: FeedDataset) -> float:
    """Budget tokens one job of the dataset takes: the mean of its done jobs, or before
    any is done its worst case (the ledger's reservation, without the prompt)."""
    if d.done > 0 and d.used_tokens > 0:
        return d.used_tokens / d.done
    return float(max(1, d.max_new_tokens))


def allocate(shares: list[Share], n: int) -> list[int]:
    """The datasets (keys) of the next ``n`` messages, in publishing order: each time the
    least advanced one that may still be published."""
    heap = [(s.taken / s.total, s.key, s) for s in shares if s.cap > 0 and s.total > 0]
    heapq.heapify(heap)
    given: dict[int, int] = {}
    order: list[int] = []
    while heap and len(order) < n:
        _fraction, key, share = heapq.heappop(heap)
        order.append(key)
        given[key] = count = given.get(key, 0) + 1
        if count < share.cap:
            advanced = (share.taken + count * share.cost) / share.total
            heapq.heappush(heap, (advanced, key, share))
    return order
