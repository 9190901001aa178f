"""SGLang's scheduler as pure logic: admission, the new-token ratio, retraction, the radix cache.

Taken from SGLang (python/sglang/srt):
- `managers/schedule_policy.py` `PrefillAdder`: a waiting request is admitted while
  `extend_input_len + min(max_new_tokens - generated, CLIP_MAX_NEW_TOKENS)` stays below
  `rem_total_tokens = available + evictable - offset`, where the offset charges every running
  request `min(max_new_tokens - generated, CLIP_MAX_NEW_TOKENS) * new_token_ratio` and every
  request admitted in the same batch its whole clipped remainder; at most `max_prefill_tokens`
  prompt tokens per batch (always at least one request), a request longer than
  `chunked_prefill_size` is prefilled in chunks; FCFS; `max_running_requests` caps the batch.
- `managers/scheduler_components/new_token_ratio_tracker.py` (`SGLANG_INIT_NEW_TOKEN_RATIO` 0.7,
  `SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR` 0.14, `SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS` 600): the ratio
  decays by `(init - min) / steps` per decode step without retraction, is set to
  `min(1, (decoded + RETRACT_DECODE_STEPS * n) / (max_new + 1))` over the survivors after a
  retraction, and is reset to init when the server goes idle.
- `managers/schedule_batch.py` `check_decode_mem` / `retract_decode` / `release_req`: a decode
  step needs one free slot per running request, evicting the radix cache first; short of that,
  requests are retracted one at a time, fewest output tokens then longest input first (sort by
  `(len(output_ids), -len(origin_input_ids))`, reversed, pop), at least one, until the next step
  fits; after each, up to `RETRACT_DECODE_STEPS` (20) slots per remaining request are evicted from
  the cache. A retracted request keeps its output, frees its KV without caching it
  (`is_insert=False`) and goes to the back of the waiting queue (`_add_request_to_queue(req,
  is_retracted=True)`); `eaglegen.sim.forward` says what it costs.
- `process_batch_result_prefill` (`cache_unfinished_req`) and `cache_finished_req`: after its
  prefill a request's prompt enters the tree so later requests match it; when it finishes its
  whole sequence does.

Time is not simulated here: `eaglegen.sim.forward` prices each forward pass, and callers pass a
clock for queue times and latencies, so tests drive the scheduler pass by pass on a clock of
their own (the engine's: the sum of the passes' costs).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from eaglegen.sim.engine import Completion
from eaglegen.sim.metrics import QUEUE_TIME_BUCKETS, Histogram
from eaglegen.sim.radix import Node, RadixCache

# SGLang's defaults (environ.py); see the module docstring.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
CLIP_MAX_NEW_TOKENS = 4096


@dataclass(frozen=True)
class SchedulerConfig:
    """What shapes admission and retraction (SGLang's server args and env knobs)."""

    kv_tokens: int
    max_running_requests: int = 1024
    max_prefill_tokens: int = 16_384
    # None: a long prompt is prefilled in one batch.
    chunked_prefill_size: int | None = None
    init_new_token_ratio: float = INIT_NEW_TOKEN_RATIO
    min_new_token_ratio: float = INIT_NEW_TOKEN_RATIO * MIN_NEW_TOKEN_RATIO_FACTOR
    new_token_ratio_decay_steps: int = NEW_TOKEN_RATIO_DECAY_STEPS
    clip_max_new_tokens: int = CLIP_MAX_NEW_TOKENS
    retract_decode_steps: int = RETRACT_DECODE_STEPS

    def __post_init__(self) -> None:
        """Reject knobs SGLang would not run with."""
        if self.kv_tokens < 2 or self.max_running_requests < 1 or self.max_prefill_tokens < 1:
            raise ValueError("kv_tokens, max_running_requests and max_prefill_tokens too small")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size must be >= 1")
        if not 0.0 < self.min_new_token_ratio <= self.init_new_token_ratio <= 1.0:
            raise ValueError("need 0 < min_new_token_ratio <= init_new_token_ratio <= 1")
        if self.new_token_ratio_decay_steps < 1 or self.clip_max_new_tokens < 1:
            raise ValueError("new_token_ratio_decay_steps and clip_max_new_tokens must be >= 1")
        if self.retract_decode_steps < 1:
            raise ValueError("retract_decode_steps must be >= 1")


class NewTokenRatio:
    """The fraction of a running request's remaining max_new_tokens that admission reserves."""

    def __init__(self, init: float, floor: float, decay_steps: int) -> None:
        """Start at init, decay to floor over decay_steps steps."""
        self.init = init
        self.min = floor
        self.decay = (init - floor) / decay_steps
        self.current = init

    def decay_step(self) -> None:
        """One decode step without retraction: admission grows bolder."""
        self.current = max(self.current - self.decay, self.min)

    def reset(self) -> None:
        """Back to init (the server went idle)."""
        self.current = self.init

    @staticmethod
    def after_retract(decoded: int, max_new: int, survivors: int, steps: int) -> float:
        """SGLang's estimate after a retraction, from the requests that stay."""
        return min(1.0, (decoded + steps * survivors) / (max_new + 1))


class RequestState(Enum):
    """Where a request is in the scheduler."""

    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    DONE = "done"
    ABORTED = "aborted"


@dataclass(eq=False)
class Job:
    """One request inside the scheduler; its output is known up front, time reveals it."""

    input_ids: Sequence[int]
    completion: Completion
    # The request's (clamped) max_new_tokens: what admission reserves against.
    max_new_tokens: int
    count_in_metrics: bool = True
    state: RequestState = RequestState.WAITING
    # Prompt tokens served from the cache at the first prefill (meta_info.cached_tokens).
    cached_tokens: int = 0
    retractions: int = 0
    key: int = 0
    # Output tokens generated before the current run (kept across a retraction).
    kept: int = 0
    # Output tokens of the tree path the job has locked (its KV beyond them is its own).
    in_tree: int = 0
    # Uncached tokens of the current (re)prefill, and those not computed yet (chunking).
    extend: int = 0
    prefill_left: int = 0
    # Prefix hit of the current admission.
    hit: int = 0
    # Decode step at which the current run started, and the step it ends at.
    start_step: int = 0
    finish_step: int = 0
    node: Node | None = None
    enqueued_at: float = 0.0
    # First submission and finish, on the scheduler's clock: the e2e latency spans every wait
    # in the queue (a retracted job waits again) and every prefill.
    arrived_at: float = 0.0
    finished_at: float | None = None

    @property
    def prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.input_ids)

    @property
    def output_tokens(self) -> int:
        """Length of the final output."""
        return len(self.completion.output_ids)

    def sequence(self, outputs: int) -> list[int]:
        """The prompt followed by the first `outputs` output tokens."""
        return [*self.input_ids, *self.completion.output_ids[:outputs]]

    @property
    def latency(self) -> float | None:
        """Seconds from submission to finish on the scheduler's clock; None until done."""
        return None if self.finished_at is None else self.finished_at - self.arrived_at


@dataclass(frozen=True)
class PrefillBatch:
    """Jobs prefilled together: chunks[i] tokens of jobs[i] are computed; cached_tokens were
    matched in the cache; reprefill_tokens is work retracted jobs had done once already."""

    jobs: tuple[Job, ...]
    chunks: tuple[int, ...]
    cached_tokens: int
    reprefill_tokens: int = 0

    @property
    def extend_tokens(self) -> int:
        """Prompt tokens this batch computes."""
        return sum(self.chunks)


@dataclass
class Totals:
    """Cumulative counters behind /metrics and /sim/stats."""

    # Finished requests only, like SGLang's tokenizer-side counters.
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0
    # Retraction (SGLang's num_retracted_*_total) and the prefill work it costs again.
    retracted_requests: int = 0
    retracted_input_tokens: int = 0
    retracted_output_tokens: int = 0
    reprefill_tokens: int = 0


@dataclass(frozen=True)
class DecodePlan:
    """What prepare_decode decided: how many jobs decode next, and who was retracted."""

    batch: int
    retracted: tuple[Job, ...] = ()


@dataclass
class _Adder:
    """One admission pass (SGLang's PrefillAdder): charges and budgets left."""

    offset: float
    input: int
    chunk: int | None
    jobs: list[Job] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)


class Scheduler:
    """Continuous batching over a KV pool shared with a radix cache, like SGLang's."""

    def __init__(
        self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """An idle scheduler."""
        self.config = config
        self.kv_tokens = config.kv_tokens
        self.cache = RadixCache()
        self.ratio = NewTokenRatio(
            config.init_new_token_ratio,
            config.min_new_token_ratio,
            config.new_token_ratio_decay_steps,
        )
        self.clock = clock
        self.step = 0
        self.tokens_generated = 0
        self.last_cache_hit_rate = 0.0
        # Size of the last retraction (SGLang's num_retracted_reqs gauge).
        self.last_retracted = 0
        self.totals = Totals()
        self.queue_time = Histogram(QUEUE_TIME_BUCKETS)
        # Pool slots held by requests outside the tree (prefill extends, decoded tokens).
        self.private_tokens = 0
        self._waiting: deque[Job] = deque()
        self._running: dict[int, Job] = {}
        self._decoding: dict[int, Job] = {}
        self._chunked: Job | None = None
        self._heap: list[tuple[int, int]] = []
        self._next_key = 0

    # --- state ------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Jobs in the waiting queue."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Jobs holding KV (prefilling or decoding)."""
        return len(self._running)

    @property
    def num_decoding(self) -> int:
        """Jobs that advance in the next decode step."""
        return len(self._decoding)

    @property
    def available_tokens(self) -> int:
        """Free pool slots (neither held by a request nor cached)."""
        return self.kv_tokens - self.private_tokens - self.cache.total_size

    @property
    def used_tokens(self) -> int:
        """SGLang's num_used_tokens: the pool minus what is free or evictable."""
        return self.private_tokens + self.cache.protected_size

    @property
    def token_usage(self) -> float:
        """SGLang's token_usage."""
        return self.used_tokens / self.kv_tokens

    def decoding_jobs(self) -> list[Job]:
        """The jobs of the running decode batch."""
        return list(self._decoding.values())

    def has_work(self) -> bool:
        """Whether anything waits or runs."""
        return bool(self._waiting or self._running)

    def generated(self, job: Job) -> int:
        """Tokens of a job's output generated so far (kept across retractions)."""
        if job.state is RequestState.DONE:
            return job.output_tokens
        if job.state is RequestState.RUNNING:
            return min(job.output_tokens, job.kept + self.step - job.start_step)
        return job.kept

    def remaining_new(self, job: Job) -> int:
        """SGLang's clipped estimate of what a request may still generate."""
        left = max(job.max_new_tokens - self.generated(job), 0)
        return min(left, self.config.clip_max_new_tokens)

    def _held(self, job: Job) -> int:
        """Pool slots a running job holds outside the tree."""
        if job.state is RequestState.PREFILL:
            return job.extend
        return self.generated(job) - job.in_tree

    # --- admission --------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue a job; it runs once it fits."""
        need = job.prompt_tokens + job.max_new_tokens
        if need > self.kv_tokens:
            raise ValueError(f"job needs {need} KV tokens, pool has {self.kv_tokens}")
        self._next_key += 1
        job.key = self._next_key
        self._enqueue(job)
        job.arrived_at = job.enqueued_at

    def _enqueue(self, job: Job) -> None:
        """Put a job at the back of the waiting queue (SGLang appends retracted ones too)."""
        job.state = RequestState.WAITING
        job.enqueued_at = self.clock()
        self._waiting.append(job)

    def admit(self) -> PrefillBatch | None:
        """Form the next prefill batch, or None when nothing may start."""
        if not self._waiting and self._chunked is None:
            return None
        running = sum(self.remaining_new(job) for job in self._decoding.values())
        cfg = self.config
        adder = _Adder(
            running * self.ratio.current, cfg.max_prefill_tokens, cfg.chunked_prefill_size
        )
        chunked, self._chunked = self._chunked, None
        if chunked is not None:
            self._add_chunk(adder, chunked)
        while self._waiting and self._chunked is None and self._may_add(adder):
            if not self._try_add(adder, self._waiting[0]):
                break
            self._waiting.popleft()
        return self._batch(adder) if adder.jobs else None

    def _rem_total(self, adder: _Adder) -> float:
        """PrefillAdder.rem_total_tokens: free plus evictable slots, minus what is promised."""
        return self.available_tokens + self.cache.evictable_size - adder.offset

    def _may_add(self, adder: _Adder) -> bool:
        """The running cap and the batch's prompt budgets (budget_state)."""
        if len(self._running) >= self.config.max_running_requests:
            return False
        return adder.input > 0 and (adder.chunk is None or adder.chunk > 0)

    def _try_add(self, adder: _Adder, job: Job) -> bool:
        """add_one_req: admit the queue's head if its prompt and clipped output fit."""
        fill = job.sequence(job.kept)
        matched, node = self.cache.match_prefix(fill)
        # At least one token is always computed, as in SGLang.
        hit = min(matched, len(fill) - 1)
        extend = len(fill) - hit
        # Locked during the check, so the job's own prefix is not counted as room.
        self.cache.lock(node)
        no_room = extend + self.remaining_new(job) >= self._rem_total(adder)
        too_long = adder.chunk is None and bool(adder.jobs) and extend > adder.input
        if no_room or too_long:
            self.cache.unlock(node)
            return False
        self._start(job, node, hit, extend)
        self._add_chunk(adder, job)
        return True

    def _start(self, job: Job, node: Node, hit: int, extend: int) -> None:
        """Move a job from the queue into the running set, its uncached part allocated."""
        if self.available_tokens < extend:
            self.cache.evict(extend - self.available_tokens)
        job.state = RequestState.PREFILL
        job.node, job.hit, job.in_tree = node, hit, job.kept
        job.extend = job.prefill_left = extend
        if job.retractions == 0:
            job.cached_tokens = hit
        self.private_tokens += extend
        self._running[job.key] = job
        self.queue_time.observe(max(0.0, self.clock() - job.enqueued_at))

    def _add_chunk(self, adder: _Adder, job: Job) -> None:
        """Give a job its share of the batch; one longer than the chunk budget goes on next
        time (SGLang's chunked request) and is charged its output only with its last chunk."""
        todo = job.prefill_left
        if adder.chunk is not None and todo > adder.chunk:
            todo = adder.chunk
            self._chunked = job
        else:
            adder.offset += self.remaining_new(job)
        adder.input -= todo
        if adder.chunk is not None:
            adder.chunk -= todo
        adder.jobs.append(job)
        adder.chunks.append(todo)

    def _batch(self, adder: _Adder) -> PrefillBatch:
        """The batch, its cache hit rate (SGLang's last-prefill cache_hit_rate)."""
        chunks = tuple(adder.chunks)
        fresh = [job for job in adder.jobs if job.prefill_left == job.extend]
        cached = sum(job.hit for job in fresh)
        computed = sum(chunks)
        self.last_cache_hit_rate = cached / (cached + computed) if cached + computed else 0.0
        redo = sum(c for job, c in zip(adder.jobs, chunks, strict=True) if job.retractions)
        self.totals.reprefill_tokens += redo
        return PrefillBatch(tuple(adder.jobs), chunks, cached, redo)

    # --- prefill ----------------------------------------------------------------------------

    def finish_prefill(self, batch: PrefillBatch) -> list[Job]:
        """A prefill batch ran: each fully prefilled job yields a token; returns those done."""
        done: list[Job] = []
        for job, chunk in zip(batch.jobs, batch.chunks, strict=True):
            if job.state is not RequestState.PREFILL:
                continue  # aborted meanwhile
            job.prefill_left -= chunk
            if job.prefill_left > 0:
                continue
            self._cache_prompt(job)
            if self._first_token(job):
                done.append(self._finish(job))
        return done

    def _cache_prompt(self, job: Job) -> None:
        """cache_unfinished_req: the prefilled sequence enters the tree for others to match."""
        _, last = self.cache.insert(job.sequence(job.kept))
        # Its slots now belong to the tree (or were duplicates of cached ones: freed).
        self.private_tokens -= job.extend
        job.extend = 0
        self.cache.lock(last)
        assert job.node is not None
        self.cache.unlock(job.node)
        job.node = last

    def _first_token(self, job: Job) -> bool:
        """The prefill's token; True if it ends the output, else the job starts decoding."""
        job.state = RequestState.RUNNING
        job.start_step = self.step
        # max_new_tokens=0 asks for no token at all.
        first = 1 if job.kept < job.output_tokens else 0
        job.kept += first
        self.private_tokens += first
        self.tokens_generated += first
        if job.kept >= job.output_tokens:
            return True
        job.finish_step = self.step + job.output_tokens - job.kept
        self._decoding[job.key] = job
        heapq.heappush(self._heap, (job.finish_step, job.key))
        return False

    # --- decode -----------------------------------------------------------------------------

    def prepare_decode(self) -> DecodePlan:
        """check_decode_mem, retracting if the next step does not fit; the batch to decode."""
        n = len(self._decoding)
        if n == 0 or self._fits(n):
            if n:
                self.ratio.decay_step()
            return DecodePlan(n)
        retracted = self._retract()
        return DecodePlan(len(self._decoding), tuple(retracted))

    def _fits(self, need: int) -> bool:
        """Whether `need` slots are free, evicting cached tokens to make them so."""
        if self.available_tokens < need:
            self.cache.evict(need - self.available_tokens)
        return self.available_tokens >= need

    def _retract(self) -> list[Job]:
        """retract_decode: free the jobs with the fewest outputs and longest prompts first, one
        at a time until the next step fits; release_req evicts, after each, up to
        retract_decode_steps slots per remaining job from the cache (usually the retracted
        job's own prompt, unlocked by its release), so the batch has room for a few steps."""
        order = sorted(
            self._decoding.values(),
            key=lambda j: (self.generated(j), -j.prompt_tokens),
            reverse=True,
        )
        steps = self.config.retract_decode_steps
        out: list[Job] = []
        while len(order) > 1 and (not out or not self._fits(len(order))):
            job = order.pop()
            self._release(job)
            out.append(job)
            self._fits(len(order) * steps)  # evict_from_tree_cache, whatever it reaches
        if not self._fits(len(order)):
            raise RuntimeError("out of KV even after retracting all other requests")
        decoded = sum(self.generated(j) for j in order)
        max_new = sum(j.max_new_tokens for j in order)
        self.ratio.current = NewTokenRatio.after_retract(decoded, max_new, len(order), steps)
        self.last_retracted = len(out)
        self.totals.retracted_requests += len(out)
        for job in out:
            self.totals.retracted_input_tokens += job.prompt_tokens
            self.totals.retracted_output_tokens += job.kept
            self._enqueue(job)
        return out

    def _release(self, job: Job) -> None:
        """Free a retracted job's KV without caching it; it keeps its output so far."""
        generated = self.generated(job)
        self._drop(job)
        job.kept = generated
        job.retractions += 1

    def _drop(self, job: Job) -> None:
        """Take a running job out of the batch, freeing what it holds outside the tree."""
        self.private_tokens -= self._held(job)
        if job.node is not None:
            self.cache.unlock(job.node)
            job.node = None
        del self._running[job.key]
        self._decoding.pop(job.key, None)
        if self._chunked is job:
            self._chunked = None

    def decode_step(self) -> list[Job]:
        """Advance every decoding job by one token; returns the jobs that finished."""
        self.step += 1
        self.private_tokens += len(self._decoding)
        self.tokens_generated += len(self._decoding)
        done: list[Job] = []
        while self._heap and self._heap[0][0] <= self.step:
            finish_step, key = heapq.heappop(self._heap)
            job = self._decoding.get(key)
            if job is not None and job.finish_step == finish_step:
                done.append(self._finish(job))
        return done

    def _finish(self, job: Job) -> Job:
        """cache_finished_req: the whole sequence enters the tree; count the request."""
        self.cache.insert(job.sequence(job.output_tokens))
        self._drop(job)
        job.state = RequestState.DONE
        job.finished_at = self.clock()
        if job.count_in_metrics:
            self.totals.prompt_tokens += job.prompt_tokens
            self.totals.generation_tokens += job.output_tokens
            self.totals.cached_tokens += job.cached_tokens
            self.totals.requests += 1
        self._maybe_idle()
        return job

    def abort(self, job: Job) -> None:
        """Drop a job wherever it is (its client went away), freeing its KV."""
        if job.state is RequestState.WAITING:
            self._waiting.remove(job)
        elif job.state in (RequestState.PREFILL, RequestState.RUNNING):
            self._drop(job)
        else:
            return
        job.state = RequestState.ABORTED
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        """An idle server starts its ratio over (SGLang's self-check during idle)."""
        if not self.has_work():
            self.ratio.reset()

    def flush_cache(self) -> bool:
        """POST /flush_cache: only while idle, like SGLang; whether it was flushed."""
        if self.has_work():
            return False
        self.cache.reset()
        return True
