"""The job's own path with no Celery around it: what a consumer of eaglegen's own could reach
at best (issue 32, goal 3).

A worker spends about half its CPU per job in Celery's and kombu's handling of the message
(BENCHMARKS.md, "Where a worker's time goes now"); the other half is the job's own path,
`worker.runner.run_attempt`: a slot in Redis, the claim in Postgres, the call to the server,
the check, the record, the slot given back. This process runs only that path, in as many
threads as the in-flight limit, over the queued jobs of one run taken in publishing order
from a list in memory: no message, no broker read, no task events, no acks, no feeder. A
consumer of our own would still pay some of those, so this is an upper bound, not a design.

`--claim-ahead`: twice as many threads as the limit, each claiming its job before it waits
for a slot (the worker takes the slot first), and waiting again while a server is up. So
when a wave of answers frees the slots, a claimed job waits for each, and its request goes
out after a Redis call, not after the claim's Postgres round trips too: what a design that
claims ahead of the slots could gain where the server binds. A job the plain path could
not start (no slot) goes back to the end of the list while a server is up.

It is one side of `bench.serving --side job-path`, which runs it against bench_serving in
alternating rounds as it runs the pipeline (the same prompts, simulator and figures). Alone:

    python -m bench.job_path --database-url URL --broker-url URL --server URL --run NAME
        --concurrency N [--claim-ahead]

It prints the attempts' outcomes and exits non-zero unless every job ended done.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading

from sqlalchemy import Engine, select

from core.settings import ServerSpec, Settings
from models.schema import Dataset, Job, Run
from models.states import JobState

# The runner's own steps after the claim (run_claimed, give_back), for --claim-ahead's other
# order of the same work.
from worker.runner import Outcome, Result, WorkerContext, give_back, run_attempt, run_claimed

QUEUE = "bench-job-path"  # nothing consumes it: the jobs are taken from memory


def queued_jobs(engine: Engine, run: str) -> list[int]:
    """The queued jobs of ``run``, in the order the feeder would publish them."""
    with engine.connect() as conn:
        found = conn.scalars(
            select(Job.id)
            .join(Dataset, Dataset.id == Job.dataset_id)
            .join(Run, Run.id == Dataset.run_id)
            .where(Run.name == run, Job.state == JobState.QUEUED)
            .order_by(Job.sort_key, Job.id)
        )
        return list(found)


def claimed_ahead(ctx: WorkerContext, job_id: int) -> Result:
    """An attempt in the other order: the claim, then a slot (waited for until one comes),
    then the call and the record as the runner makes them."""
    ctx.router.identified(5.0, 5.0)  # the model the servers serve, before the first claim
    ctx.begin_claim(job_id)
    won: bool | None = None
    try:
        claim = ctx.repo.claim(job_id, ctx.name, ctx.settings.lease_seconds)
        won = claim.job is not None
    finally:
        ctx.end_claim(job_id, won)
    if claim.job is None:
        return Result(Outcome.NOT_CLAIMED, reason=claim.outcome)
    lease = None
    while lease is None and _up(ctx):
        lease = ctx.router.acquire(ctx.settings.slot_wait_s)
    settled = False  # as the runner: an error leaves the job in doubt
    try:
        if lease is None:  # every server went down: the job goes back, no attempt spent
            ctx.repo.release(job_id, ctx.name, "no server up", refund=True)
            settled = True
            return Result(Outcome.NO_SLOT, reason="no server up")
        held = [lease]
        try:
            result = run_claimed(ctx, claim.job, held)
        finally:
            for each in held:
                give_back(ctx, each)
        settled = True
        return result
    finally:
        ctx.end_attempt(job_id, settled)


def run_jobs(
    ctx: WorkerContext, jobs: list[int], threads: int, ahead: bool = False
) -> collections.Counter[str]:
    """Run every job's attempt from ``threads`` threads (``ahead``: claimed before the
    slot); how the attempts ended."""
    attempt = claimed_ahead if ahead else run_attempt
    todo = collections.deque(jobs)
    ended: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def take_and_run() -> None:
        while True:
            try:
                job = todo.popleft()  # atomic: one thread gets each job
            except IndexError:
                return
            outcome = attempt(ctx, job).outcome
            if outcome is Outcome.NO_SLOT and _up(ctx):  # full: as a message comes back
                todo.append(job)
                continue
            with lock:
                ended[outcome.value] += 1

    pool = [threading.Thread(target=take_and_run) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return ended


def _up(ctx: WorkerContext) -> bool:
    """Whether a server may take a job (up, its model known): else a job without a slot
    would come back for ever."""
    return any(s.healthy and s.served is not None for s in ctx.router.servers)


def main(argv: list[str] | None = None) -> int:
    """Run the queued jobs of one run; 0 when each ended done."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--broker-url", required=True)
    parser.add_argument("--server", required=True, help="the simulator's URL")
    parser.add_argument("--run", required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--claim-ahead", action="store_true", help="claim before the slot")
    args = parser.parse_args(argv)
    settings = Settings(
        database_url=args.database_url,
        broker_url=args.broker_url,
        queue=QUEUE,
        server_max_inflight=args.concurrency,
        adaptive_concurrency=False,
    )
    ctx = WorkerContext.build(
        settings, settings.services(), [ServerSpec(name="sim", url=args.server)]
    )
    try:
        jobs = queued_jobs(ctx.repo.engine, args.run)
        threads = 2 * args.concurrency if args.claim_ahead else args.concurrency
        ended = run_jobs(ctx, jobs, threads, args.claim_ahead)
    finally:
        ctx.close()
    print(f"{len(jobs)} jobs: {dict(ended)}", flush=True)
    return 0 if ended[Outcome.DONE.value] == len(jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
