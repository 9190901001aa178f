"""The loop engine (``EAGLEGEN_WORKER_ENGINE=loop``): every request of a worker process on one
asyncio event loop, its messages taken, its slots leased and its jobs claimed and recorded in
batches (docs/design.md §7, "What a job costs, and the loop engine").

The Celery engine runs each message as a task on a thread of its own, and pays per job for
the thread, the task's bookkeeping, and its own slot, claim and record round trips: where the
server answers at once, far below what SGLang's own client reaches (BENCHMARKS.md). Here
one loop does what those threads did, in four parts:

- the **intake** takes as many messages as its servers have slots free: due messages held
  back first, then the queue's oldest, several in one ``RPOP`` (a message with an ``eta`` is
  held until then, as Celery holds it); leases that many slots with one Redis call a
  server; claims the jobs with `models.attempt.claim_batch` (two round trips a batch); and
  starts an **attempt** for each job won, on the slot taken for it;
- an **attempt** sends the job (worker.aio_sglang), checks the answer as the Celery engine
  does (`worker.runner.checked_answer`), gives its slot back (with the other answers of
  the same turn of the loop, one Redis call) and hands the answer to the recorder. A failed
  attempt is settled as the runner settles it (`settle_failure`, in a thread: it may
  probe the server); so is a job whose model its slot's server does not serve (the
  runner's own path, in a thread);
- the **recorder** stores whatever answers arrived while its last batch was written
  (`models.attempt.record_batch`, one round trip and one commit), waiting out a Postgres
  outage of up to a lease period as the runner does;
- the side loops (heartbeat, health, leases, feeder, reconciler, controllers) are the
  Celery engine's own (worker.background), on their threads.

A message is taken off the queue with ``RPOP``, not through kombu's unacked index: one this
process took and never claimed (it was killed) is published again by the reconciler, as a
dead Celery worker's prefetched messages are. Those it holds when it stops are pushed back.

Flower sees it as it sees a Celery-engine worker: the same task and worker events, sent
by `worker.events.LoopEvents`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import itertools
import logging
import signal
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import redis
import redis.asyncio as aioredis

from core import keys, wire
from core.broker import eviction_warning
from core.settings import ServerSpec, Services, Settings
from models.attempt import claim_batch, record_batch
from models.pg import connect_async
from models.records import Claim, ClaimedJob, GenerationRecord
from worker import metrics
from worker.aio_sglang import AsyncSGLang
from worker.celeryconfig import make_celery
from worker.events import LoopEvents
from worker.numa import PinResult
from worker.outages import DATABASE_UNREACHABLE, REDIS_FULL, Outages, one_line
from worker.retry import AttemptError, backoff
from worker.runner import (
    CLAIM_LOST,
    DB_HOLD_LIMIT_MS,
    SLOTS_KEPT,
    Outcome,
    Result,
    WorkerContext,
    checked_answer,
    give_back,
    release_held,
    run_claimed,
    settle_failure,
    unclaimed,
    unexpected_error,
)
from worker.servers import MAX_POLL_S, Lease, Server

log = logging.getLogger(__name__)

# Most jobs one claim or record batch holds: past a few dozen, a batch only holds its
# datasets' rows longer.
BATCH = 64
# The Postgres connections of the claims and of the records (each used by one coroutine at a
# time), counted in EAGLEGEN_DB_POOL_SIZE.
BATCH_CONNECTIONS = 2
# How long the intake waits for a message when the queue is empty (BRPOP: whole seconds on
# older Redis servers), and for a slot when its servers are full: a slot this process gives
# back wakes it at once, another worker's is found within the pause, which doubles up to
# MAX_POLL_S.
EMPTY_WAIT_S = 1
FULL_POLL_S = 0.02
# Answers that end in one decode step reach the worker over a few turns of the loop. Woken
# by the first, the intake waits this share of a request's mean duration (at most
# GATHER_MAX_S) for the rest, so that their replacements reach the server together and
# share its prefill passes. Where answers come at once, the wait is nothing.
GATHER_SHARE = 0.01
GATHER_MAX_S = 0.005


@dataclass
class _Answer:
    """A checked answer waiting for the recorder."""

    job: ClaimedJob
    record: GenerationRecord
    server: Server


class _Postgres:
    """One asyncio connection, opened again after it broke, or after an outage began."""

    def __init__(self, url: str, outages: Outages) -> None:
        self._url = url
        self._outages = outages
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._outage = 0  # the database outages begun before it was opened

    async def conn(self) -> psycopg.AsyncConnection[Any]:
        """The connection; a new one after an outage. A Postgres restart breaks every
        connection of the process, and only the one in use finds out: each other one would
        fail once more when next used, and say the outage again."""
        began = self._outages.began[DATABASE_UNREACHABLE]
        if self._conn is not None and (
            began > self._outage or self._conn.closed or self._conn.broken
        ):
            await self._conn.close()
            self._conn = None
        if self._conn is None:
            self._conn = await connect_async(
                self._url, async_commit=True, hold_limit_ms=DB_HOLD_LIMIT_MS, connect_timeout_s=10
            )
            self._outage = began
        return self._conn

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()


class LoopWorker:
    """One worker process's requests on one event loop."""

    def __init__(self, ctx: WorkerContext, services: Services, hostname: str) -> None:
        self.ctx = ctx
        s: Settings = ctx.settings
        # Flower's view: the events a Celery worker of this name would send.
        self.events = LoopEvents(make_celery(s, services.broker_url), hostname, s.queue)
        self._clients = {
            server.name: AsyncSGLang(
                server.spec,
                timeout_s=s.request_timeout_s,
                max_response_bytes=s.max_response_bytes,
                stall_timeout_s=s.stall_timeout_s,
            )
            for server in ctx.router.servers
        }
        self._claims = _Postgres(services.database_url, ctx.outages)
        self._records = _Postgres(services.database_url, ctx.outages)
        self._redis = aioredis.Redis.from_url(services.broker_url)
        # Messages taken and not claimed yet: held until their eta, or due and waiting
        # for a slot (oldest first).
        self._held: list[tuple[float, int, wire.Message]] = []
        self._due: collections.deque[wire.Message] = collections.deque()
        self._due_since = 0.0  # when the first of them began to wait for a slot
        self._order = itertools.count()
        self._attempts: set[asyncio.Task[None]] = set()
        self._answers: asyncio.Queue[_Answer | None] = asyncio.Queue()
        self._freeing: dict[str, list[Lease]] = {}
        self._freed = asyncio.Event()
        self._request_s = 0.0  # a request's mean duration, recent ones weighing most
        self._stop = asyncio.Event()
        # Why the worker stopped itself, unasked (it then exits 1): None while it did not.
        self.unrecoverable: str | None = None
        # The grace period ended with requests in flight: their jobs were given back.
        self.abandoned = False

    # -- the run -------------------------------------------------------------------------

    async def run(self) -> None:
        """Take and run jobs until `stop`; then wait up to the grace period for the
        attempts in flight, and push back the messages taken and not claimed."""
        await asyncio.to_thread(self.events.start, self._events_failed)
        recorder = asyncio.create_task(self._recorder(), name="recorder")
        intake = asyncio.create_task(self._intake(), name="intake")
        try:
            await self._stop.wait()
            await _finish(intake)
            await self._drain(self.ctx.settings.shutdown_grace_s)
            self.abandoned = bool(self._attempts)
            await self._answers.put(None)
            await recorder
        finally:
            for task in (intake, recorder, *self._attempts):
                task.cancel()
            await asyncio.gather(intake, recorder, *self._attempts, return_exceptions=True)
            self._flush_slots()
            await asyncio.to_thread(self._push_back)
            for client in self._clients.values():
                client.close()
            await self._claims.close()
            await self._records.close()
            await self._redis.aclose()
            await asyncio.to_thread(self.events.close)  # what is still open went back

    def _events_failed(self, exc: Exception) -> None:
        self.ctx.outages.failed("flower events", exc)

    def stop(self) -> None:
        """Take no new job (the process is stopping); in the loop's thread."""
        self._stop.set()
        self._freed.set()

    def abandon(self) -> None:
        """End the grace period now: the attempts in flight are cancelled (their jobs are
        given back at exit, `worker.runner.release_held`)."""
        for task in list(self._attempts):
            task.cancel()

    async def _drain(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the attempts in flight and their records."""
        deadline = time.monotonic() + grace_s
        while self._attempts or not self._answers.empty():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._attempts:
                await asyncio.wait(set(self._attempts), timeout=left)
            else:
                await asyncio.sleep(min(left, 0.01))

    def _push_back(self, held: bool = True) -> None:
        """Publish again the messages taken and never claimed (those waiting for a slot,
        and with ``held`` those waiting for their eta), each at its own time."""
        now = time.time()
        messages = [*self._due, *((m for _due, _n, m in self._held) if held else ())]
        self._due.clear()
        if held:
            self._held.clear()
        try:
            for message in messages:
                countdown = 0.0 if message.eta is None else max(0.0, message.eta - now)
                self.ctx.publisher.publish_later(
                    message.job_id,
                    countdown=countdown,
                    retries=message.retries,
                    task_id=wire.job_task_id(self.ctx.settings.queue, message.job_id),
                    job_tag=wire.tag_of(message.job_id, message.argsrepr),
                )
        except redis.RedisError as exc:
            log.warning(
                "could not push back %d message(s) taken and not claimed (%s): the "
                "reconciler publishes their jobs again",
                len(messages),
                one_line(exc),
            )

    # -- intake: messages, slots, claims -------------------------------------------------

    async def _intake(self) -> None:
        """Take as many jobs as the servers have slots free, claim them, start them. A pass
        that fails (Redis or Postgres out of reach, anything unforeseen) is said once per
        outage, as a side loop's is (worker.background), and tried again."""
        pause = FULL_POLL_S
        while not self._stop.is_set():
            if (refusal := self.ctx.outages.reason(REDIS_FULL)) is not None:
                # Redis refuses writes (seen by this loop or a side loop): no slot can be
                # leased, no message published, and waiting will not empty it. Celery's
                # worker stops on this as unrecoverable; so does this one, exit 1.
                self.unrecoverable = f"OutOfMemoryError: {refusal}"
                self.stop()
                return
            try:
                full = await self._intake_once()
            except Exception as exc:
                self.ctx.outages.failed("intake", exc)
                await self._wait_freed(1.0)
                continue
            self.ctx.outages.passed("intake")
            if not full:
                pause = FULL_POLL_S
                continue
            # Servers full, down or unidentified: a slot this process frees wakes it.
            await self._wait_freed(pause)
            if self._freed.is_set():
                await asyncio.sleep(min(GATHER_MAX_S, GATHER_SHARE * self._request_s))
            pause = min(2 * pause, MAX_POLL_S)

    async def _intake_once(self) -> bool:
        """One batch taken, leased, claimed and started; whether the servers had no slot
        for it (True: wait for one)."""
        router = self.ctx.router
        ready = [s for s in router.servers if s.healthy and s.served is not None]
        # The slots free on its servers now, every worker's counted (one Redis call a
        # server: a worker sharing a server takes no message another worker's requests
        # leave no room for), within the process's own cap (its "threads",
        # EAGLEGEN_WORKER_CONCURRENCY: the most requests it has in flight at once).
        held = sum(len(s.held) for s in router.servers)
        free = sum(room.takes - room.held for room in router.rooms())
        room = min(free, self.ctx.threads - held)
        if room <= 0:
            await self._give_back_waiting()
            return True
        messages = await self._take(min(room, BATCH))
        if not messages:
            return False
        try:
            pairs = self._pair(ready, messages, await self._hints(messages))
        except BaseException:
            self._wait_for_slots(messages)
            raise
        taken = {id(message) for message, _lease in pairs}
        self._wait_for_slots([m for m in messages if id(m) not in taken])
        if not pairs:  # other workers took the free slots: these are first next time
            return True
        await self._claim(pairs)
        return False

    def _wait_for_slots(self, messages: list[wire.Message]) -> None:
        """Keep messages a slot was not found for, first in line for the next one."""
        if messages and not self._due:
            self._due_since = time.monotonic()
        self._due.extendleft(reversed(messages))

    async def _give_back_waiting(self) -> None:
        """Messages that waited longer than EAGLEGEN_SLOT_WAIT_S for a slot (its servers
        full, down or unidentified) go back to the queue for other workers, as the Celery
        engine sends back a message that found no slot."""
        if self._due and time.monotonic() - self._due_since > self.ctx.settings.slot_wait_s:
            waited = [message.job_id for message in self._due]
            await asyncio.to_thread(self._push_back, held=False)
            reason = "no free slot: this worker's servers are full, down or unidentified"
            for job in waited:
                self._ended(job, Result(Outcome.NO_SLOT, reason=reason))

    async def _wait_freed(self, timeout_s: float) -> None:
        self._freed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._freed.wait(), timeout_s)

    async def _take(self, most: int) -> list[wire.Message]:
        """Up to ``most`` due messages: those held back first, then the queue's oldest (the
        publisher pushes on the left); waits up to EMPTY_WAIT_S when there are none."""
        now = time.time()
        taken: list[wire.Message] = []
        while self._held and self._held[0][0] <= now and len(taken) < most:
            taken.append(heapq.heappop(self._held)[2])
        while self._due and len(taken) < most:
            taken.append(self._due.popleft())
        if len(taken) < most:
            raw = await self._redis.rpop(self.ctx.settings.queue, most - len(taken))
            if not raw and not taken:
                popped = await self._redis.brpop([self.ctx.settings.queue], EMPTY_WAIT_S)
                raw = [popped[1]] if popped else []
            for each in raw or []:
                self._read(each, now, taken)
        self.ctx.outages.redis_ok()
        return taken

    def _read(self, raw: Any, now: float, taken: list[wire.Message]) -> None:
        message = wire.read(raw)
        if message is None:
            log.warning(
                "dropped a message on queue %s: %s",
                self.ctx.settings.queue,
                wire.refusal(raw),
            )
        else:
            self.events.received(message)
            if message.eta is not None and message.eta > now:
                heapq.heappush(self._held, (message.eta, next(self._order), message))
            else:
                taken.append(message)

    async def _hints(self, messages: Sequence[wire.Message]) -> list[str | None]:
        """The server each message's job should go to, when the advancer named one (a
        conversation's turn: that server's prefix cache holds its history), in one Redis
        call; none when Redis does not answer (a hint only saves a prefill)."""
        s = self.ctx.settings
        if not s.turn_affinity or len(self.ctx.router.servers) < 2:
            return [None] * len(messages)
        try:
            found = await self._redis.mget([keys.turn_server(s.queue, m.job_id) for m in messages])
        except redis.RedisError:
            return [None] * len(messages)
        return [v.decode() if isinstance(v, bytes) else None for v in found]

    def _pair(
        self,
        ready: Sequence[Server],
        messages: Sequence[wire.Message],
        hints: Sequence[str | None],
    ) -> list[tuple[wire.Message, Lease]]:
        """A slot for as many messages as there are free: on its hinted server when that
        one has room, else on the least loaded; one Redis call a server."""
        by_name = {server.name: server for server in ready}
        wanted = collections.Counter(hint for hint in hints if hint in by_name)
        preferred: dict[str, list[Lease]] = {}
        leases: list[Lease] = []
        try:
            for name, n in wanted.items():
                preferred[name] = self.ctx.router.acquire_many(by_name[name], n)
            need = len(messages) - sum(len(got) for got in preferred.values())
            for server in sorted(ready, key=lambda s: len(s.held)):
                if len(leases) < need:
                    leases += self.ctx.router.acquire_many(server, need - len(leases))
        except BaseException:  # no slot leaks: the ones taken so far go back
            self._release([*leases, *(lease for got in preferred.values() for lease in got)])
            raise
        pairs, rest = [], []
        for message, hint in zip(messages, hints, strict=True):
            if hint is not None and preferred.get(hint):
                pairs.append((message, preferred[hint].pop()))
            else:
                rest.append(message)
        spare = [lease for left in preferred.values() for lease in left]
        return pairs + list(zip(rest, spare + leases, strict=False))

    async def _claim(self, pairs: list[tuple[wire.Message, Lease]]) -> None:
        """Claim the messages' jobs in one batch; start those won, each on its slot."""
        ctx = self.ctx
        messages = [message for message, _lease in pairs]
        leases = [lease for _message, lease in pairs]
        ids = [m.job_id for m in messages]
        noted = [job for job in ids if ctx.begin_claim(job)]
        if len(noted) < len(ids):  # it began to stop: nothing claimed
            for job in noted:
                ctx.end_claim(job, False)
            self._release(leases)
            self._wait_for_slots(messages)
            return
        try:
            claims = await claim_batch(
                await self._claims.conn(), ids, ctx.name, ctx.settings.lease_seconds
            )
        except BaseException as exc:
            self._unclaimed(messages, leases, exc)
            raise
        ctx.outages.database_ok()
        unused: list[Lease] = []
        deferred: list[tuple[int, Result]] = []
        for message, claim, lease in zip(messages, claims, leases, strict=True):
            ctx.end_claim(message.job_id, claim.job is not None)
            if claim.job is None:
                unused.append(lease)
                self._not_run(message.job_id, claim, deferred)
            else:
                self.events.started(message.job_id)
                self._start(self._attempt(claim.job, lease))
        self._release(unused)
        if deferred:
            await asyncio.to_thread(self._defer, deferred)

    def _not_run(self, job_id: int, claim: Claim, deferred: list[tuple[int, Result]]) -> None:
        result = unclaimed(claim.outcome, self.ctx.settings.budget_defer_s)
        if result.outcome is Outcome.DEFERRED:
            deferred.append((job_id, result))
        self._ended(job_id, result)

    def _defer(self, jobs: list[tuple[int, Result]]) -> None:
        """Budget deferrals: the feeder offers these jobs again after the wait."""
        for job, result in jobs:
            self.ctx.repo.defer(job, result.retry_in_s, result.reason)

    def _unclaimed(
        self, messages: list[wire.Message], leases: list[Lease], exc: BaseException
    ) -> None:
        """A claim batch that failed (Postgres out of reach): whether the claims committed
        is unknown, so the jobs are kept in doubt (for shutdown and the reconciler); the
        messages are held for a backoff, as the Celery engine sends them back (Flower: a
        retry, and the message received again)."""
        s = self.ctx.settings
        what = "database unavailable" if isinstance(exc, psycopg.Error) else "claim failed"
        reason = f"{what}: {one_line(exc)}"
        for message in messages:
            self.ctx.end_claim(message.job_id, None)
            countdown = backoff(message.retries + 1, s.retry_base_s, s.retry_cap_s)
            when = time.time() + countdown
            later = wire.Message(message.job_id, when, message.retries + 1, message.argsrepr)
            if isinstance(exc, Exception):  # not the stop's cancel: it gives them back
                self._ended(message.job_id, Result(Outcome.RETRY, countdown, reason=reason))
                self.events.received(later)
            heapq.heappush(self._held, (when, next(self._order), later))
        self._release(leases)

    # -- attempts ------------------------------------------------------------------------

    def _start(self, attempt: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(self._guarded(attempt))
        self._attempts.add(task)
        task.add_done_callback(self._attempts.discard)

    async def _guarded(self, work: Coroutine[Any, Any, None]) -> None:
        """Run an attempt, or a record batch, to its end. An error it did not settle
        itself (Postgres out of reach while a failure is settled, a bug) is said once per
        outage, as a side loop's; its jobs stay in doubt: given back at shutdown, else
        taken again once their leases lapse."""
        try:
            await work
        except Exception as exc:
            self.ctx.outages.failed("attempts", exc)

    async def _attempt(self, job: ClaimedJob, lease: Lease) -> None:
        """Send one claimed job on its slot; its answer to the recorder, or its failure
        settled."""
        server = lease.server
        if server.serves(job.run_model) is not None:  # another model: the runner's path
            await asyncio.to_thread(self._elsewhere, job, lease)
            return
        failure: AttemptError | None = None
        sent = time.monotonic()
        with self.ctx.metrics.request(server.name) as request:
            try:
                # Streamed as the threaded client would (EAGLEGEN_STREAM, else as the
                # server streams: worker.servers decides it when it identifies the server).
                body = await self._clients[server.name].generate(
                    job.input_ids, job.sampling_params, str(job.id), stream=server.client.streaming
                )
                record = checked_answer(body, job, server.name)
            except AttemptError as error:
                failure = error
            except Exception as exc:  # an answer nothing expected: this attempt ends now
                failure = unexpected_error(server, exc)
            if failure is not None:
                request.failed(failure.kind)
        if failure is not None:
            await asyncio.to_thread(self._settle, job, lease, failure)
            return
        self._free(lease)
        self._request_s += 0.05 * (time.monotonic() - sent - self._request_s)
        if changed := server.still_serves(job.run_model):  # another model answered
            await asyncio.to_thread(self._unserved, job, changed)
            return
        self._answers.put_nowait(_Answer(job, record, server))

    def _elsewhere(self, job: ClaimedJob, lease: Lease) -> None:
        """The runner's path for a job whose model is on another server (a slot there
        swapped in, or the job given back), in a thread."""
        held = [lease]
        settled = False
        try:
            result = run_claimed(self.ctx, job, held)
            settled = True
        finally:
            self.ctx.end_attempt(job.id, settled)
            for each in held:
                give_back(self.ctx, each)
        self._ended(job.id, result)

    def _settle(self, job: ClaimedJob, lease: Lease, failure: AttemptError) -> None:
        """A failed attempt settled as the runner settles it (the slot kept until then, so
        that no request goes to a server about to be marked down), in a thread."""
        settled = False
        try:
            result = settle_failure(self.ctx, lease.server, job, failure)
            settled = True
        finally:
            self.ctx.end_attempt(job.id, settled)
            give_back(self.ctx, lease)
        self._ended(job.id, result)

    def _unserved(self, job: ClaimedJob, why: str) -> None:
        """Another model answered: the job given back, refunded, for a server of its own."""
        wait = self.ctx.settings.health_interval_s
        settled = False
        try:
            self.ctx.repo.release(job.id, self.ctx.name, why, refund=True, retry_in_s=wait)
            settled = True
        finally:
            self.ctx.end_attempt(job.id, settled)
        self._ended(job.id, Result(Outcome.UNSERVED, wait, reason=why))

    def _ended(self, job_id: int, result: Result) -> None:
        self.ctx.metrics.attempt(result.outcome.value)
        self.ctx.ended(job_id, result.outcome)
        self.events.ended(job_id, result)

    # -- slots given back ----------------------------------------------------------------

    def _free(self, lease: Lease) -> None:
        """Give a slot back with the others freed in this turn of the loop (one call)."""
        if not self._freeing:
            asyncio.get_running_loop().call_soon(self._flush_slots)
        self._freeing.setdefault(lease.server.name, []).append(lease)

    def _flush_slots(self) -> None:
        freeing, self._freeing = self._freeing, {}
        for leases in freeing.values():
            self._release(leases)

    def _release(self, leases: Sequence[Lease]) -> None:
        """Give slots back now; Redis out of reach: they lapse by themselves."""
        by_server: dict[str, list[Lease]] = {}
        for lease in leases:
            by_server.setdefault(lease.server.name, []).append(lease)
        try:
            for server_leases in by_server.values():
                self.ctx.router.release_many(server_leases[0].server, server_leases)
        except redis.RedisError as exc:
            self.ctx.outages.down(
                SLOTS_KEPT,
                one_line(exc),
                then="their leases lapse by themselves",
                ended="slots given back again",
            )
        else:
            self.ctx.outages.up(SLOTS_KEPT)
        if leases:
            self._freed.set()

    # -- the recorder --------------------------------------------------------------------

    async def _recorder(self) -> None:
        """Store the answers that arrived while the last batch was written, as one batch."""
        ending = False
        while not ending:
            first = await self._answers.get()
            batch = [] if first is None else [first]
            ending = first is None
            while not ending and len(batch) < BATCH and not self._answers.empty():
                more = self._answers.get_nowait()
                ending = more is None
                batch += [] if more is None else [more]
            if batch:
                await self._guarded(self._record(batch))

    async def _record(self, batch: list[_Answer]) -> None:
        """One batch stored, waiting out a Postgres outage of up to one lease period (the
        outputs cost generations; the claim check keeps a late record from counting
        twice); a row Postgres refuses costs only its own job."""
        try:
            stored = await self._stored(batch)
        except psycopg.OperationalError as exc:
            reason = f"database unavailable: its answer not recorded ({one_line(exc)})"
            for answer in batch:  # given up: maybe ours still, kept in doubt
                self.ctx.end_attempt(answer.job.id, False)
                self._ended(answer.job.id, Result(Outcome.RETRY, reason=reason))
            return
        except Exception as exc:  # e.g. an id beyond int32, which Postgres cannot hold
            if len(batch) > 1:
                for answer in batch:
                    await self._record([answer])
                return
            answer = batch[0]
            failure = unexpected_error(answer.server, exc)
            await asyncio.to_thread(self._settle_recorded, answer, failure)
            return
        for answer, ok in zip(batch, stored, strict=True):
            self.ctx.end_attempt(answer.job.id, True)
            if ok:
                gen = answer.record
                self.ctx.metrics.recorded(
                    answer.server.name, gen.prompt_tokens, gen.completion_tokens
                )
                self._ended(answer.job.id, Result(Outcome.DONE, tokens=gen.completion_tokens))
            else:
                log.warning("job %s: %s", answer.job.id, CLAIM_LOST)
                self._ended(answer.job.id, Result(Outcome.LOST, reason=CLAIM_LOST))

    async def _stored(self, batch: list[_Answer]) -> list[bool]:
        s = self.ctx.settings
        deadline = time.monotonic() + s.lease_seconds
        attempt = 0
        done = [(answer.job, answer.record) for answer in batch]
        while True:
            try:
                stored = await record_batch(await self._records.conn(), self.ctx.name, done)
            except psycopg.OperationalError as exc:
                self.ctx.outages.service_down(exc)
                attempt += 1
                if time.monotonic() >= deadline or self._stop.is_set():
                    raise
                await asyncio.sleep(max(0.05, backoff(attempt, s.retry_base_s, 1.0)))
            else:
                self.ctx.outages.database_ok()
                return stored

    def _settle_recorded(self, answer: _Answer, failure: AttemptError) -> None:
        settled = False
        try:
            result = settle_failure(self.ctx, answer.server, answer.job, failure)
            settled = True
        finally:
            self.ctx.end_attempt(answer.job.id, settled)
        self._ended(answer.job.id, result)


async def _finish(task: asyncio.Task[None]) -> None:
    """Let a task that watches the stop event end by itself (within its current wait)."""
    try:
        await asyncio.wait_for(asyncio.shield(task), EMPTY_WAIT_S + 1)
    except TimeoutError:
        task.cancel()


def run(
    worker: LoopWorker, on_loop: Callable[[asyncio.AbstractEventLoop], None] | None = None
) -> None:
    """Run ``worker`` on a new event loop in this thread until it is stopped; ``on_loop``
    gets the loop first (to stop it from another thread, or to hook signals)."""

    async def main() -> None:
        if on_loop is not None:
            on_loop(asyncio.get_running_loop())
        await worker.run()

    asyncio.run(main())


def stop_on_signals(
    worker: LoopWorker, ctx: WorkerContext
) -> Callable[[asyncio.AbstractEventLoop], None]:
    """SIGTERM and SIGINT begin the stop (a second one ends the grace period at once)."""

    def hook(loop: asyncio.AbstractEventLoop) -> None:
        def received(name: str) -> None:
            if ctx.stopping.is_set():
                log.warning("%s again: giving back the jobs in flight now", name)
                worker.abandon()
                return
            drain = ctx.begin_stop()
            log.warning(
                "worker stopping (%s): taking no new jobs; waiting up to %g s for %d "
                "request(s) in flight, then giving their jobs back",
                name,
                ctx.settings.shutdown_grace_s,
                len(drain.waiting_for),
            )
            worker.stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, received, sig.name)

    return hook


def start(
    settings: Settings,
    services: Services,
    servers: list[ServerSpec] | None = None,
    pinned: PinResult | None = None,
    loglevel: str = "INFO",
    metrics_port: int | None = None,
) -> int:
    """Run a loop-engine worker in this process until SIGTERM/SIGINT, then stop as the
    Celery engine does: the requests in flight get the grace period, the jobs still held
    then are given back; the exit code."""
    # Their Celery import only where a worker starts.
    from worker.app import nodename, quiet_request_logs
    from worker.background import Background

    if not logging.getLogger().handlers:  # as Celery's worker sets it up
        logging.basicConfig(
            level=loglevel.upper(),
            format="[%(asctime)s: %(levelname)s/%(processName)s] %(message)s",
        )
    quiet_request_logs(loglevel)
    ctx = WorkerContext.build(
        settings, services, settings.servers if servers is None else servers, BATCH_CONNECTIONS
    )
    conflicts = ctx.hold_server_names()
    if conflicts:
        ctx.close()
        raise ValueError(conflicts[0])
    if (eviction := eviction_warning(ctx.redis)) is not None:
        log.warning("%s", eviction)
    name = nodename([s.name for s in ctx.router.servers], None if pinned is None else pinned.node)
    pool = settings.db_pool_size
    log.warning(
        "worker %s (loop engine): at most %d Postgres connections (EAGLEGEN_DB_POOL_SIZE; %d "
        "for its claims and records, %d for the rest) and one for job leases; up to %d "
        "requests in flight (EAGLEGEN_WORKER_CONCURRENCY)",
        name,
        max(pool, BATCH_CONNECTIONS + 1),
        BATCH_CONNECTIONS,
        max(1, pool - BATCH_CONNECTIONS),
        ctx.threads,
    )
    exporter = None if metrics_port is None else metrics.serve(ctx.metrics, metrics_port)
    worker = LoopWorker(ctx, services, name)
    background = Background(ctx, None, name, pinned, flower=worker.events.app)
    background.start()
    log.info("%s ready.", name)
    try:
        run(worker, stop_on_signals(worker, ctx))
    finally:
        background.stop()
        if exporter is not None:
            exporter.shutdown()
        drain = ctx.begin_stop()
        held = release_held(ctx)
        drain.released(held)
        if worker.abandoned:  # as the Celery engine says it
            log.warning(
                "grace period over: released %s running job(s)%s; worker stopped: %s",
                len(held),
                f": {held}" if held else "",
                drain.summary,
            )
        else:
            kept = f"; released {len(held)} job(s) it still held: {held}" if held else ""
            log.warning("worker stopped: %s%s", drain.summary, kept)
        ctx.close()
    if worker.unrecoverable is not None:  # as the Celery engine says it
        log.error("worker stopped (exit 1): %s", worker.unrecoverable)
        return 1
    return 0
