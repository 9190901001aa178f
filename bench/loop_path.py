"""The job's path driven from one event loop, its claims and records in batches: what the
batched worker of docs/design.md §7 could reach at best (issue 32, goal 3).

`bench.job_path` showed that no consumer in front of today's job path reaches goal 3: each
job's slot, claim, call, check and record in a thread of its own cost the one interpreter
too much (BENCHMARKS.md, "The job's own path with no Celery"). This process measures the
other design before anyone builds it into the worker:

- one asyncio loop drives every request, each of ``--concurrency`` lanes on a keep-alive
  connection of the loop engine's client (worker.aio_sglang);
- a claimer keeps up to ``--ahead`` jobs claimed ahead (default one a lane: a whole wave's
  replacements), taken in batches by `models.attempt.claim_batch`
  (two round trips a batch). With ``--broker-url``, their ids come as a worker's do: from
  the queue's messages, which the feeder (`worker.feeder`, in a thread of this process, its
  window as a worker's heartbeat would make it, or ``--window``) tops up from Postgres; the
  claimer pops up to a batch of them at once (one RPOP, each message taken at most once: one
  never claimed, the process having died, is published again by the reconciler, as a dead
  worker's prefetched messages are). Without it, from a list in memory;
- a recorder stores the checked answers in batches by `models.attempt.record_batch` (one
  round trip and one commit a batch): whatever has arrived while the last batch was written;
- each answer is checked as the worker checks it (`worker.runner.checked_answer`).

So an answer's lane sends its next request at once, with a job already claimed, and the
Postgres round trips are shared by the jobs of a batch. What it leaves out, as
`bench.job_path` does, and what a worker would add: messages held for a later time (the ETA
of a job sent back), slots in Redis (here each lane is one), the retries of a failed attempt
(here a failure is counted, its job given back queued with no attempt spent, and the process
exits non-zero), a stop that gives back the jobs claimed and not yet sent, the worker's side
loops (heartbeat, controller, health checks, reconciler), and the fault tests of a kill in
the middle of a batch.

It is one side of `bench.serving --side loop`, run against bench_serving in alternating
rounds as the pipeline is. Alone:

    python -m bench.loop_path --database-url URL --server URL --run NAME --concurrency N
        [--ahead N] [--batch N] [--broker-url URL --queue NAME [--window N]]

It prints the jobs' outcomes and exits non-zero unless every job ended done.
"""

from __future__ import annotations

import _thread
import argparse
import asyncio
import collections
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg
import redis
import redis.asyncio as aioredis

from bench.job_path import queued_jobs
from core import wire
from core.broker import Publisher
from core.settings import ServerSpec, Settings
from models.attempt import claim_batch, record_batch
from models.db import make_engine
from models.pg import connect_async
from models.records import ClaimedJob, GenerationRecord
from models.repository import Repository
from worker.aio_sglang import AsyncSGLang
from worker.feeder import WINDOW_FACTOR, Feeder
from worker.retry import AttemptError
from worker.runner import checked_answer

WORKER = f"loop-path@{socket.gethostname()}"
# The worker's defaults: its lease, its bound on an answer and how long it waits for one,
# its feeder's interval.
_DEFAULTS = Settings.model_fields
LEASE_S: int = _DEFAULTS["lease_seconds"].default
BODY_BYTES: int = _DEFAULTS["max_response_bytes"].default
TIMEOUT_S: float = _DEFAULTS["request_timeout_s"].default
STALL_S: float = _DEFAULTS["stall_timeout_s"].default
FEED_INTERVAL_S: float = _DEFAULTS["feed_interval_s"].default
QUEUE = "bench-loop-path"
QUEUE_POLL_S = 0.005  # an empty queue is asked again this soon: the feeder tops it up


class Source(Protocol):
    """Where the claimer finds the ids of the jobs to claim."""

    async def take(self, most: int) -> list[int]:
        """Up to ``most`` ids (none for now: soon again)."""

    def exhausted(self, ended: collections.Counter[str]) -> bool:
        """No more to take, given how the jobs ended so far."""


@dataclass
class InMemory:
    """The run's queued jobs, read once, in publishing order."""

    jobs: collections.deque[int]

    async def take(self, most: int) -> list[int]:
        return [self.jobs.popleft() for _ in range(min(most, len(self.jobs)))]

    def exhausted(self, ended: collections.Counter[str]) -> bool:
        return not self.jobs


@dataclass
class FromQueue:
    """The queue's messages, as the feeder publishes them, until ``expected`` jobs are
    done (or one failed: a strict bench, where a job sent back would be published again)."""

    client: aioredis.Redis
    queue: str
    expected: int

    async def take(self, most: int) -> list[int]:
        # The oldest first, as workers take them (the publisher pushes on the left).
        raw = await self.client.rpop(self.queue, most)
        if not raw:
            await asyncio.sleep(QUEUE_POLL_S)
            return []
        assert isinstance(raw, list), "RPOP with a count answers a list"
        return [job for message in raw if (job := wire.job_id_of(message)) is not None]

    def exhausted(self, ended: collections.Counter[str]) -> bool:
        failed = any(outcome.startswith("failed") for outcome in ended)
        return failed or ended["done"] >= self.expected


def feeding(repo: Repository, broker_url: str, queue: str, window: int) -> Callable[[], None]:
    """Run the feeder over ``queue`` in a thread; the function returned stops it and waits
    for its pass to end (so that its database connection is back in the pool before the
    engine is disposed of)."""
    stop = threading.Event()

    def feed() -> None:
        client = redis.Redis.from_url(broker_url)
        try:
            feeder = Feeder(repo, client, Publisher(client, queue), window=window)
            while not stop.is_set():
                stop.wait(feeder.feed().next_pass_s(FEED_INTERVAL_S))
        except BaseException:
            _thread.interrupt_main()  # else the loop waits for messages for ever
            raise
        finally:
            client.close()

    thread = threading.Thread(target=feed, name="feeder", daemon=True)
    thread.start()

    def stopped() -> None:
        stop.set()
        thread.join()

    return stopped


@dataclass
class Loop:
    """The jobs of one run, their claims ahead, the lanes and the recorder."""

    repo: Repository
    server_url: str
    source: Source
    lanes: int
    ahead: int
    batch: int
    ended: collections.Counter[str] = field(default_factory=collections.Counter)

    async def run(self) -> None:
        """Every job claimed, generated, checked and recorded; the claimer, the lanes and
        the recorder end in that order."""
        claimed: asyncio.Queue[ClaimedJob | None] = asyncio.Queue()
        answered: asyncio.Queue[tuple[ClaimedJob, GenerationRecord] | None] = asyncio.Queue()
        taken = asyncio.Event()  # a lane took a claimed job: claim more
        client = AsyncSGLang(
            ServerSpec(name="sim", url=self.server_url),
            timeout_s=TIMEOUT_S,
            max_response_bytes=BODY_BYTES,
            stall_timeout_s=STALL_S,
        )
        async with (
            await self._connect() as claims_conn,
            await self._connect() as records_conn,
        ):
            recorder = asyncio.create_task(self._recorder(records_conn, answered))
            driving = [
                asyncio.create_task(self._lane(client, claimed, taken, answered))
                for _ in range(self.lanes)
            ]
            await self._claimer(claims_conn, claimed, taken)
            await asyncio.gather(*driving)
            await answered.put(None)
            await recorder
        client.close()

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        return await connect_async(self.repo.engine.url.render_as_string(hide_password=False))

    async def _claimer(
        self,
        conn: psycopg.AsyncConnection[Any],
        claimed: asyncio.Queue[ClaimedJob | None],
        taken: asyncio.Event,
    ) -> None:
        """Keep up to ``ahead`` jobs claimed and waiting for a lane, in batches."""
        while not self.source.exhausted(self.ended):
            room = min(self.ahead - claimed.qsize(), self.batch)
            if room <= 0:
                taken.clear()
                await taken.wait()
                continue
            ids = await self.source.take(room)
            for claim in await claim_batch(conn, ids, WORKER, LEASE_S):
                if claim.job is None:
                    self.ended[claim.outcome] += 1
                else:
                    claimed.put_nowait(claim.job)
        for _ in range(self.lanes):
            claimed.put_nowait(None)

    async def _lane(
        self,
        client: AsyncSGLang,
        claimed: asyncio.Queue[ClaimedJob | None],
        taken: asyncio.Event,
        answered: asyncio.Queue[tuple[ClaimedJob, GenerationRecord] | None],
    ) -> None:
        """Send each claimed job this lane takes (on a kept connection of the worker's own
        client, worker.aio_sglang); its checked answer to the recorder."""
        while (job := await claimed.get()) is not None:
            taken.set()
            try:
                body = await client.generate(job.input_ids, job.sampling_params, str(job.id))
                record = checked_answer(body, job, "sim")
            except AttemptError as exc:
                self.ended[f"failed: {exc.kind}"] += 1
                why = f"loop path: {exc}"
                await asyncio.to_thread(self.repo.release, job.id, WORKER, why, refund=True)
                continue
            answered.put_nowait((job, record))

    async def _recorder(
        self,
        conn: psycopg.AsyncConnection[Any],
        answered: asyncio.Queue[tuple[ClaimedJob, GenerationRecord] | None],
    ) -> None:
        """Store whatever answers arrived while the last batch was written, as one batch."""
        ending = False
        while not ending:
            first = await answered.get()
            batch = [] if first is None else [first]
            ending = first is None
            while not ending and len(batch) < self.batch and not answered.empty():
                more = answered.get_nowait()
                ending = more is None
                batch += [] if more is None else [more]
            if batch:
                for stored in await record_batch(conn, WORKER, batch):
                    self.ended["done" if stored else "lost"] += 1


async def drive(
    repo: Repository, args: argparse.Namespace, jobs: list[int]
) -> collections.Counter[str]:
    """Run ``jobs`` from a list, or from the queue's messages with a feeder; how they ended."""
    source: Source = InMemory(collections.deque(jobs))
    stop: Callable[[], None] | None = None
    client: aioredis.Redis | None = None
    if args.broker_url is not None:
        window = args.window or WINDOW_FACTOR * args.concurrency
        stop = feeding(repo, args.broker_url, args.queue, window)
        client = aioredis.Redis.from_url(args.broker_url)
        source = FromQueue(client, args.queue, len(jobs))
    loop = Loop(
        repo,
        args.server,
        source,
        lanes=args.concurrency,
        ahead=args.ahead or args.concurrency,
        batch=args.batch,
    )
    try:
        await loop.run()
    finally:
        if stop is not None:
            stop()
        if client is not None:
            await client.aclose()
    return loop.ended


def main(argv: list[str] | None = None) -> int:
    """Run the queued jobs of one run; 0 when each ended done."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--server", required=True, help="the simulator's URL")
    parser.add_argument("--run", required=True)
    parser.add_argument("--concurrency", type=int, required=True, help="lanes")
    parser.add_argument("--ahead", type=int, help="jobs claimed ahead (default: the lanes)")
    parser.add_argument("--batch", type=int, default=64, help="most jobs a claim or record")
    parser.add_argument("--broker-url", help="take the jobs from the queue's messages")
    parser.add_argument("--queue", default=QUEUE, help="the queue (with --broker-url)")
    parser.add_argument("--window", type=int, help="the feeder's window (default: twice the lanes)")
    args = parser.parse_args(argv)
    engine = make_engine(args.database_url, pool_size=2)
    try:
        repo = Repository(engine)
        jobs = queued_jobs(engine, args.run)
        ended = asyncio.run(drive(repo, args, jobs))
    finally:
        engine.dispose()
    print(f"{len(jobs)} jobs: {dict(ended)}", flush=True)
    return 0 if ended["done"] == len(jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
