"""One job attempt: take a slot, claim, call the server, check, record.

Every path leaves the job settled in Postgres (running only while this process works on
it) and the slot returned. The Celery task wraps this and turns the result into a message.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import redis
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as SQLTimeoutError

from core import keys
from core.broker import Publisher
from core.settings import ServerSpec, Services, Settings
from core.text import visible
from models.db import make_engine
from models.records import ClaimedJob, GenerationRecord, RunModel
from models.repository import Repository
from worker.controller import SharedLimits
from worker.intake import Intake, Room, default_threads
from worker.metrics import WorkerMetrics
from worker.names import ServerNames
from worker.outages import Outages, one_line
from worker.reasoning import split_reasoning
from worker.retry import AttemptError, Disposition, ErrorKind, backoff, decide
from worker.servers import Lease, Router, Server, probe
from worker.sglang import SGLangClient
from worker.slots import SlotPool
from worker.validate import Request, check_response, stop_ids

log = logging.getLogger(__name__)
# Postgres down or restarting, or every pooled connection busy for the pool's timeout: the
# attempt is retried, never failed, for either.
DATABASE_UNAVAILABLE = (OperationalError, SQLTimeoutError)
# A worker's transactions take milliseconds and never wait on the network: one that waits
# this long for a lock, or idles this long inside a transaction, is stuck or frozen, and
# Postgres ends it (a lock wait is then retried as above). See models.db.make_engine.
DB_HOLD_LIMIT_MS = 5000


def worker_engine(database_url: str, settings: Settings, held_apart: int = 0) -> Engine:
    """The engine of a worker process: a small pool threads wait on, asynchronous commits,
    and Postgres ending any session that holds a lock too long (DB_HOLD_LIMIT_MS). Its pool
    is EAGLEGEN_DB_POOL_SIZE less the ``held_apart`` connections the process opens beside
    it (the loop engine's two), at least one.

    No ping before each transaction: it was a round trip of every two a job makes. After a
    Postgres restart the first transaction on a stale connection fails like the outage
    itself (the attempt is retried, DATABASE_UNAVAILABLE) and the pool is renewed."""
    return make_engine(
        database_url,
        pool_size=max(1, settings.db_pool_size - held_apart),
        max_overflow=0,
        async_commit=True,
        hold_limit_ms=DB_HOLD_LIMIT_MS,
        pre_ping=False,
    )


def lease_engine(database_url: str) -> Engine:
    """The engine of a worker's job leases: their renewal, and the release at shutdown.
    One connection of its own, never the task threads' pool: in that pool, renewals waited
    behind busy tasks past the pool's timeout, and the leases of live jobs lapsed. Checked
    before each use (``pre_ping``, one round trip a pass), so it reconnects by itself after
    an outage. A shutdown release that meets a renewal waits for its one transaction."""
    return make_engine(
        database_url, pool_size=1, max_overflow=0, hold_limit_ms=DB_HOLD_LIMIT_MS, pre_ping=True
    )


# The Redis connections a worker process's own calls share (slots, heartbeat, names, the
# controller, the publisher; Celery's are kombu's). Each call takes well under a
# millisecond, so a few dozen serve hundreds of threads; a thread finding them all busy
# waits for one, up to REDIS_WAIT_S. redis-py's default pool instead fails the 101st at
# once (MaxConnectionsError), which stalled workers of many threads (BENCHMARKS.md,
# "Threads and the in-flight limit, end to end").
REDIS_CONNECTIONS = 32
REDIS_WAIT_S = 20.0


def worker_redis(broker_url: str) -> redis.Redis:
    """The worker's Redis client, on a pool that makes threads wait instead of failing."""
    pool = redis.BlockingConnectionPool.from_url(
        broker_url, max_connections=REDIS_CONNECTIONS, timeout=REDIS_WAIT_S
    )
    return redis.Redis.from_pool(pool)  # its close() closes the pool's connections too


def heartbeat_ttl(settings: Settings) -> int:
    """Seconds a heartbeat (and a held server name) lives unless renewed: three beats."""
    return max(1, int(3 * settings.heartbeat_interval_s))


class Outcome(Enum):
    """How an attempt ended, from this worker's point of view."""

    DONE = "done"
    NOT_CLAIMED = "not_claimed"  # another worker has it, or it is no longer queued
    RETRY = "retry"  # back in `queued`: the feeder publishes it again after a backoff
    FAILED = "failed"
    LOST = "lost"  # our claim was taken away before we could record
    NO_SLOT = "no_slot"  # none of our servers could take it: let another worker have it
    DEFERRED = "deferred"  # the budget is held by running jobs: the feeder offers it later
    SKIPPED = "skipped"  # the budget is spent
    # None of our servers serves its run's model: given back to the feeder, which offers it
    # again after a health interval (here or to another worker).
    UNSERVED = "unserved"


# Said while slots cannot be given back (Redis out of reach).
SLOTS_KEPT = "slots not given back"

# Outcomes after which the job waits in the queue to be run again.
SENT_BACK = frozenset({Outcome.RETRY, Outcome.DEFERRED, Outcome.NO_SLOT, Outcome.UNSERVED})


@dataclass(frozen=True)
class Result:
    """The outcome and, for RETRY/DEFERRED, the delay before the job is published again.

    ``tokens``: the completion tokens recorded (DONE); ``reason``: why it did not end done,
    in one line.
    """

    outcome: Outcome
    retry_in_s: float = 0.0
    tokens: int = 0
    reason: str = ""
    # Postgres was out of reach, so the job could not go back to the feeder: the task sends
    # its message back itself, as for NO_SLOT.
    resend: bool = False

    def shown(self) -> str:
        """The task's result in Flower when the job did not go back or fail: done and its
        tokens, or what turned the attempt away (a duplicate message, a lost claim)."""
        if self.outcome is Outcome.DONE:
            return f"done · {self.tokens:,} tokens"
        return f"{self.outcome.value}: {self.reason}"


# Said when a job's claim was taken away before its answer was recorded.
CLAIM_LOST = "claim lost before recording; result dropped"


def unclaimed(outcome: str, defer_s: float) -> Result:
    """What a claim that won no job means, by the claim's outcome (models.attempt): a
    budget deferral (the feeder offers the job again after ``defer_s``), a spent budget,
    or a job no longer queued."""
    if outcome == "deferred":
        reason = (
            "budget deferral: the rest of the budget is held by running jobs; "
            f"asked again in {defer_s:g} s"
        )
        return Result(Outcome.DEFERRED, retry_in_s=defer_s, reason=reason)
    if outcome == "skipped":
        return Result(Outcome.SKIPPED, reason="skipped_budget: the dataset's budget is spent")
    return Result(Outcome.NOT_CLAIMED, reason="no longer queued (done or taken elsewhere)")


@dataclass
class WorkerContext:
    """Per-process state: built once, after any fork, shared by the pool's threads."""

    settings: Settings
    repo: Repository
    # The job leases' own connection (see `lease_engine`).
    leases: Repository
    router: Router
    redis: redis.Redis
    publisher: Publisher
    names: ServerNames
    name: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    # The jobs this process runs (their leases renewed, released at shutdown).
    in_flight: set[int] = field(default_factory=set)
    # Jobs whose claim is under way, counted per thread (two messages of one job may be
    # claimed at once): the claim may commit before its thread hears of it.
    claiming: Counter[int] = field(default_factory=Counter)
    # Jobs a database error left in doubt (a claim, record or release whose answer never
    # came back): maybe ours in Postgres with no thread on them. Not renewed, so their
    # leases lapse for the reconciler, but given back at once at shutdown.
    doubtful: set[int] = field(default_factory=set)
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    # How many messages the process takes: what its servers have room for, within its
    # threads (worker.intake).
    intake: Intake = field(default_factory=lambda: Intake(1))
    stopping: threading.Event = field(default_factory=threading.Event)
    # Runs none of this worker's servers may generate, with why (logged once per reason).
    unserved: dict[str, str] = field(default_factory=dict)
    # Conditions that last (Postgres or Redis out of reach, a server down), said once each.
    outages: Outages = field(default_factory=Outages)
    # From SIGTERM on: the jobs it was running then, and how their attempts ended.
    drain: Drain | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def build(
        cls,
        settings: Settings,
        services: Services,
        servers: list[ServerSpec],
        held_apart: int = 0,
    ) -> WorkerContext:
        """Engine, repository, Redis and one HTTP client per attached server; ``held_apart``:
        the Postgres connections the process opens beside the engine's (`worker_engine`)."""
        if not servers:
            raise ValueError("no SGLang servers: set EAGLEGEN_SERVERS or pass --server URL")
        engine = worker_engine(services.database_url, settings, held_apart)
        client = worker_redis(services.broker_url)
        attached = [
            Server(
                spec=s,
                limit=s.max_inflight or settings.server_max_inflight,
                client=SGLangClient(
                    s,
                    timeout_s=settings.request_timeout_s,
                    max_response_bytes=settings.max_response_bytes,
                    stall_timeout_s=settings.stall_timeout_s,
                    stream=settings.stream,
                ),
            )
            for s in servers
        ]
        slots = SlotPool(client, lease_seconds=settings.slot_lease_seconds)
        # The adaptive limits the controllers set (worker.controller), else the configured.
        limits = SharedLimits(client).get if settings.adaptive_concurrency else None
        outages = Outages(settings.log_reminder_s)
        router = Router(attached, slots, limits=limits, outages=outages)
        metrics = WorkerMetrics()
        metrics.known_servers([s.name for s in attached])
        repo = Repository(engine)
        configured = [Room(0, server.limit, 0) for server in attached]
        return cls(
            settings=settings,
            repo=repo,
            leases=Repository(lease_engine(services.database_url)),
            router=router,
            redis=client,
            publisher=Publisher(client, settings.queue),
            names=ServerNames(client, ttl_s=heartbeat_ttl(settings)),
            metrics=metrics,
            intake=Intake(default_threads(settings, servers), configured),
            outages=outages,
        )

    @property
    def threads(self) -> int:
        """The process's Celery threads: the most requests it may hold at once."""
        return self.intake.threads

    def hold_server_names(self) -> list[str]:
        """Hold this worker's server names in the cluster; a line per name held elsewhere."""
        return self.names.hold([s.spec for s in self.router.servers])

    def begin_claim(self, job_id: int) -> bool:
        """Note a claim before it is made, so that shutdown gives its job back whatever
        becomes of it; False (nothing noted) once the worker is stopping: a claim made
        after shutdown's release would leave its job to wait out the lease."""
        with self._lock:
            if self.stopping.is_set():
                return False
            self.claiming[job_id] += 1
            return True

    def end_claim(self, job_id: int, won: bool | None) -> None:
        """How a claim went: won (the job runs here, its lease renewed), not won, or None
        when an error hid whether it committed (the job kept in doubt, for shutdown)."""
        with self._lock:
            self.claiming[job_id] -= 1
            if self.claiming[job_id] <= 0:
                del self.claiming[job_id]
            if won:
                self.in_flight.add(job_id)
                self.doubtful.discard(job_id)  # ours by a claim we know of
            elif won is None:
                self.doubtful.add(job_id)

    def end_attempt(self, job_id: int, settled: bool) -> None:
        """The attempt of a job running here ended: settled in Postgres, or (not
        ``settled``) cut by an error that may have left it ours (kept in doubt)."""
        with self._lock:
            self.in_flight.discard(job_id)
            if not settled:
                self.doubtful.add(job_id)

    def running_jobs(self) -> list[int]:
        """The jobs this process is running now."""
        with self._lock:
            return list(self.in_flight)

    def held_jobs(self) -> list[int]:
        """Every job this process may hold in Postgres: running, being claimed, or left in
        doubt by a database error (what shutdown gives back)."""
        with self._lock:
            return sorted(self.in_flight | self.doubtful | self.claiming.keys())

    def begin_stop(self) -> Drain:
        """Take no new job from now on; the jobs running now, whose ends `ended` counts."""
        with self._lock:
            if self.drain is None:
                self.drain = Drain(frozenset(self.in_flight))
            drain = self.drain
            self.stopping.set()  # under the lock: no claim is noted after it (begin_claim)
        return drain

    def ended(self, job_id: int, outcome: Outcome) -> None:
        """An attempt ended: counted if its job was running when the worker began to stop."""
        drain = self.drain
        if drain is not None:
            drain.count(job_id, outcome)

    def close(self) -> None:
        """Release connections."""
        for server in self.router.servers:
            server.client.close()
        self.repo.engine.dispose()
        self.leases.engine.dispose()
        self.redis.close()
        self.publisher.close()


@dataclass
class Drain:
    """A stopping worker's running jobs: those it waits for, and how their attempts ended."""

    waiting_for: frozenset[int]
    finished: int = 0  # ended here (done, failed, skipped, or not this worker's any more)
    sent_back: int = 0  # given back to the queue (Postgres or Redis), to run again
    _counted: set[int] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, job_id: int, outcome: Outcome) -> None:
        """Count one ending of a job waited for (once per job)."""
        with self._lock:
            if job_id not in self.waiting_for or job_id in self._counted:
                return
            self._counted.add(job_id)
            if outcome in SENT_BACK:
                self.sent_back += 1
            else:
                self.finished += 1

    def released(self, job_ids: list[int]) -> int:
        """Count the jobs given back at exit (still running then); how many were new."""
        with self._lock:
            new = [j for j in job_ids if j not in self._counted]
            self._counted.update(new)
            self.sent_back += len(new)
            return len(new)

    @property
    def summary(self) -> str:
        """How the requests it waited for ended, in words."""
        with self._lock:
            finished, sent_back = self.finished, self.sent_back
        waited = len(self.waiting_for)
        if not waited and not sent_back:
            return "no request was in flight when it began to stop"
        return (
            f"of the {waited} request(s) in flight when it began to stop, {finished} "
            f"finished and {sent_back} went back to the queue"
        )


def run_attempt(ctx: WorkerContext, job_id: int) -> Result:
    """Run one attempt of ``job_id``. The slot is taken before the claim, so a worker whose
    servers are full or down never holds a job it cannot start; the claim says which model
    the job's run wants, and a job no server of this worker serves is given back at once."""
    if ctx.stopping.is_set():
        return Result(Outcome.NO_SLOT, reason="worker stopping")
    interval = ctx.settings.health_interval_s
    known = ctx.router.identified(min(interval, 5.0), interval)
    if not known:
        # Nothing claimed: the message goes back, for a server to answer meanwhile.
        reasons = "; ".join(why for s in ctx.router.servers if (why := s.unknown_reason()))
        return Result(Outcome.NO_SLOT, interval, reason=f"no server's model is known: {reasons}")
    lease = ctx.router.acquire(
        ctx.settings.slot_wait_s, among=known, prefer=_turn_server(ctx, job_id)
    )
    if lease is None:
        # Servers full: another worker may take it now. All down: not before the next probe.
        down = not any(s.healthy for s in known)
        return Result(
            Outcome.NO_SLOT,
            interval if down else 0.0,
            reason=f"no free slot: this worker's servers are {'down' if down else 'full'}",
        )
    held = [lease]  # the slot this attempt holds; another if the job's model is elsewhere
    try:
        return _claimed_attempt(ctx, job_id, held)
    finally:
        for each in held:
            give_back(ctx, each)


def _turn_server(ctx: WorkerContext, job_id: int) -> str | None:
    """The server a conversation's turn should go to, when the advancer named one (the
    server whose prefix cache holds its history); None for any other job, or when Redis
    does not answer (the hint only saves a prefill)."""
    if not ctx.settings.turn_affinity or len(ctx.router.servers) < 2:
        return None
    try:
        found = ctx.redis.get(keys.turn_server(ctx.settings.queue, job_id))
    except redis.RedisError:
        return None
    return found.decode() if isinstance(found, bytes) else None


def give_back(ctx: WorkerContext, lease: Lease) -> None:
    """Return a slot. Redis out of reach changes nothing of how the attempt ended (its job
    may be recorded already): the slot, no longer renewed, lapses by itself."""
    try:
        ctx.router.release(lease)
    except redis.RedisError as exc:
        ctx.outages.down(
            SLOTS_KEPT,
            one_line(exc),
            then="their leases lapse by themselves",
            ended="slots given back again",
        )
    else:
        ctx.outages.up(SLOTS_KEPT)


def _claimed_attempt(ctx: WorkerContext, job_id: int, held: list[Lease]) -> Result:
    if not ctx.begin_claim(job_id):  # it began to stop while this one waited for the slot
        return Result(Outcome.NO_SLOT, reason="worker stopping")
    won: bool | None = None  # unknown until the claim answers
    try:
        claim = ctx.repo.claim(job_id, ctx.name, ctx.settings.lease_seconds)
        won = claim.job is not None
    finally:
        ctx.end_claim(job_id, won)
    ctx.outages.database_ok()
    if claim.job is None:
        result = unclaimed(claim.outcome, ctx.settings.budget_defer_s)
        if result.outcome is Outcome.DEFERRED:  # the feeder offers it again after the wait
            ctx.repo.defer(job_id, result.retry_in_s, result.reason)
        return result
    settled = False  # until the attempt ends settled; an error leaves the job in doubt
    try:
        result = run_claimed(ctx, claim.job, held)
        settled = True
        return result
    finally:
        ctx.end_attempt(job_id, settled)


def run_claimed(ctx: WorkerContext, job: ClaimedJob, held: list[Lease]) -> Result:
    """The rest of an attempt once its job is claimed: a slot on a server of the job's model
    (swapped into ``held`` if need be), the call, the check and the record, every failure
    settled. The caller gives back the slots ``held`` still holds."""
    lease = _slot_of_its_model(ctx, job, held)
    if isinstance(lease, Result):
        return lease
    return _generated(ctx, job, lease, held)


def _slot_of_its_model(ctx: WorkerContext, job: ClaimedJob, held: list[Lease]) -> Lease | Result:
    """A slot on a server of the job's model: the one held, or one taken in its place; else
    the job given back (not an attempt of its own) and why."""
    wanted = job.run_model
    if held[0].server.serves(wanted) is None:
        ctx.unserved.pop(wanted.run, None)  # served: the heartbeat stops naming the run
        return held[0]
    serving = [s for s in ctx.router.servers if s.serves(wanted) is None]
    if not serving:
        reason = _unserved(ctx, wanted)
        wait = ctx.settings.health_interval_s
        ctx.repo.release(job.id, ctx.name, reason, refund=True, retry_in_s=wait)
        return Result(Outcome.UNSERVED, wait, reason=reason)
    ctx.unserved.pop(wanted.run, None)
    other = ctx.router.acquire(ctx.settings.slot_wait_s, among=serving)
    if other is None:
        reason = f"no free slot on a server of model {wanted.model!r}"
        ctx.repo.release(job.id, ctx.name, reason, refund=True)
        return Result(Outcome.RETRY, reason=reason)
    give_back(ctx, held.pop())
    held.append(other)
    return other


def _unserved(ctx: WorkerContext, wanted: RunModel) -> str:
    """Why none of this worker's servers may generate the run (said once in the log and
    kept for the heartbeat, so that `status` shows it)."""
    reasons = "; ".join(why for s in ctx.router.servers if (why := s.serves(wanted)))
    reason = f"waiting for a server of model {wanted.model!r}: {reasons}"
    if ctx.unserved.get(wanted.run) != reason:
        ctx.unserved[wanted.run] = reason
        log.warning("run %s: none of this worker's servers may generate it: %s", wanted.run, reason)
    return reason


def _generated(ctx: WorkerContext, job: ClaimedJob, lease: Lease, held: list[Lease]) -> Result:
    """Call the server, check, record; every failure settled. An answer frees its slot
    before the record: the server is done with the request, and a thread waiting for a slot
    sends its own while this one writes to Postgres (a failure keeps the slot until it is
    settled, so that no request goes to a server about to be marked down)."""
    server = lease.server
    with ctx.metrics.request(server.name) as request:
        try:
            record = _generate(server, job)
        except AttemptError as error:
            request.failed(error.kind)
            failure: AttemptError | None = error
        except Exception as exc:  # a response nothing expected: this attempt ends now
            failure = unexpected_error(server, exc)
            request.failed(failure.kind)
        else:
            failure = None
    if failure is not None:
        return settle_failure(ctx, server, job, failure)
    held.remove(lease)
    give_back(ctx, lease)
    if changed := server.still_serves(job.run_model):  # another model answered: not the run's
        wait = ctx.settings.health_interval_s
        ctx.repo.release(job.id, ctx.name, changed, refund=True, retry_in_s=wait)
        return Result(Outcome.UNSERVED, wait, reason=changed)
    try:
        recorded = _record(ctx, job.id, record)
    except DATABASE_UNAVAILABLE:
        raise  # the task sends the job back; the lease covers it meanwhile
    except Exception as exc:  # e.g. an id beyond int32, which Postgres cannot hold
        return settle_failure(ctx, server, job, unexpected_error(server, exc))
    if recorded:
        ctx.metrics.recorded(server.name, record.prompt_tokens, record.completion_tokens)
        return Result(Outcome.DONE, tokens=record.completion_tokens)
    log.warning("job %s: %s", job.id, CLAIM_LOST)
    return Result(Outcome.LOST, reason=CLAIM_LOST)


def unexpected_error(server: Server, exc: Exception) -> AttemptError:
    """An error no check foresaw, as a retryable failure of the attempt that keeps its cause
    (instead of the job waiting out its lease with "lease expired" as its only trace)."""
    detail = " ".join(str(exc).split())[:500]
    return AttemptError(
        f"{server.name}: {type(exc).__name__}: {detail}", retryable=True, kind=ErrorKind.UNEXPECTED
    )


def _record(ctx: WorkerContext, job_id: int, record: GenerationRecord) -> bool:
    """Store a generation, waiting out a database outage of up to one lease period: the
    output cost a generation, and the claim check keeps a late record from counting twice."""
    deadline = time.monotonic() + ctx.settings.lease_seconds
    attempt = 0
    while True:
        try:
            recorded = ctx.repo.record(job_id, ctx.name, record)
        except DATABASE_UNAVAILABLE as exc:
            ctx.outages.service_down(exc)
            attempt += 1
            if time.monotonic() >= deadline or ctx.stopping.is_set():
                raise
            time.sleep(max(0.05, backoff(attempt, ctx.settings.retry_base_s, 1.0)))
        else:
            ctx.outages.database_ok()
            return recorded


def _generate(server: Server, job: ClaimedJob) -> GenerationRecord:
    body = server.client.generate(job.input_ids, job.sampling_params, rid=str(job.id))
    return checked_answer(body, job, server.name)


def checked_answer(body: Any, job: ClaimedJob, server: str) -> GenerationRecord:
    """A server's parsed answer to ``job`` (sent with the job's id as its rid) checked
    against the request, as a record to store (reasoning split where the run's prompts
    open it); AttemptError if it does not fit."""
    max_new = job.sampling_params.get("max_new_tokens")
    sent = Request(
        job.input_ids,
        str(job.id),
        max_new_tokens=max_new if type(max_new) is int else None,
        vocab_size=job.vocab_size,
        stop_token_ids=stop_ids(job.sampling_params),
    )
    record = check_response(body, sent, server)
    if job.think_end_id is None:
        return record
    split = split_reasoning(record.output_ids, job.think_end_id)
    return replace(
        record,
        think_end_present=split.think_end_present,
        reasoning_tokens=split.reasoning_tokens,
        answer_tokens=split.answer_tokens,
    )


def settle_failure(
    ctx: WorkerContext, server: Server, job: ClaimedJob, error: AttemptError
) -> Result:
    # A server's own words may be in it (an error body): stored, logged and shown in Flower
    # without the control characters that would rewrite the terminal reading them.
    said = visible(str(error))
    if ctx.stopping.is_set():
        # Cut short by shutdown, not by the job: give it back without spending an attempt
        # (nor counting it as the server's failure).
        ctx.repo.release(job.id, ctx.name, f"worker shutting down: {said}", refund=True)
        return Result(Outcome.RETRY, reason=f"worker stopping ({error.kind}: {said})")
    if error.transport:
        # One lost connection says little (a keep-alive race, a proxy reset): stop sending to
        # the server only when its health check fails too; the health loop brings it back.
        down = probe(server, timeout_s=min(ctx.settings.health_interval_s, 5.0))
        if down is not None:
            ctx.router.mark(server, healthy=False, reason=f"{said}; {visible(down)}")
    if decide(error, job.attempts, ctx.settings.max_attempts) is Disposition.RETRY:
        wait = backoff(job.attempts, ctx.settings.retry_base_s, ctx.settings.retry_cap_s)
        ctx.repo.release(
            job.id, ctx.name, said, server=server.name, kind=error.kind, retry_in_s=wait
        )
        return Result(
            Outcome.RETRY,
            retry_in_s=wait,
            reason=f"attempt {job.attempts} failed ({error.kind}): {said}; again in {wait:.3g} s",
        )
    ctx.repo.fail(job.id, ctx.name, said, server=server.name, kind=error.kind)
    log.warning("job %s failed after %s attempt(s): %s", job.id, job.attempts, said)
    return Result(Outcome.FAILED, reason=f"after {job.attempts} attempt(s) ({error.kind}): {said}")


def release_held(ctx: WorkerContext) -> list[int]:
    """Give back every job this process still holds, in any phase (being claimed, running,
    or left in doubt by a database error), without spending an attempt, and its slots; the
    released ids (the feeder publishes them again).

    A job noted here that is not ours in Postgres (a claim that never committed, a job
    another worker took since) is left as it is: the release matches only this worker's
    running jobs. It goes through the leases' own connection: the task threads may hold
    every pooled one when the grace period ends."""
    held, released = ctx.held_jobs(), []
    try:
        for job in held:
            if ctx.leases.release(
                job, ctx.name, "worker stopped before the request finished", refund=True
            ):
                released.append(job)
    except DATABASE_UNAVAILABLE as exc:  # they stay running until their leases lapse
        log.warning(
            "could not give back %d held job(s) (%s): the reconciler re-queues those still "
            "running once their leases lapse (EAGLEGEN_LEASE_SECONDS)",
            len(held) - len(released),
            one_line(exc),
        )
    try:
        ctx.router.release_all()  # else other workers lose these slots for slot_lease_seconds
        if released:
            ctx.publisher.wake_feeder()
    except redis.RedisError as exc:
        log.warning("slots not given back (%s): their leases lapse by themselves", exc)
    return released
