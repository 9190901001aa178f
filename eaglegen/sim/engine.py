"""Pure logic of the simulator: deterministic outputs, the prefix cache and the KV scheduler."""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

# SGLang's SamplingParams default when a request leaves max_new_tokens out.
DEFAULT_MAX_NEW_TOKENS = 128
# Prefix cache granularity in tokens.
BLOCK_TOKENS = 16
# One prompt in two that declares tools gets an answer calling one, decided by its digest.
TOOL_CALL_ONE_IN = 2


@dataclass(frozen=True)
class Vocab:
    """The token ids the simulator emits: special markers and the ordinary range [lo, hi)."""

    think_end: int
    im_end: int
    tool_section_begin: int
    tool_section_end: int
    tool_call_begin: int
    tool_call_argument_begin: int
    tool_call_end: int
    vocab_size: int
    ordinary_lo: int
    ordinary_hi: int

    def __post_init__(self) -> None:
        """Reject an empty ordinary range."""
        if not 0 <= self.ordinary_lo < self.ordinary_hi <= self.vocab_size:
            raise ValueError(f"bad ordinary id range [{self.ordinary_lo}, {self.ordinary_hi})")


@dataclass(frozen=True)
class OutputShape:
    """Distribution of natural output lengths: log-normal with a mean and a hard bound."""

    mean_tokens: int = 300
    max_tokens: int = 4096
    # A wide spread gives both short answers and long reasoning chains.
    sigma: float = 0.9


@dataclass(frozen=True)
class Sampling:
    """The sampling parameters that change what the simulator generates."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    seed: int = 0


@dataclass(frozen=True)
class Finish:
    """Why a generation ended, serialised exactly like SGLang's finish_reason."""

    type: Literal["stop", "length", "abort"]
    matched: int | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None

    def to_json(self) -> dict[str, object]:
        """The finish_reason object of meta_info."""
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {
            "type": "abort",
            "message": self.message,
            "status_code": self.status_code,
            "err_type": None,
        }


@dataclass(frozen=True)
class Completion:
    """The full answer to one request: generated ids (stop token included) and the finish."""

    output_ids: list[int]
    finish: Finish
    # Whether output_ids hold (some of) a tool call whose arguments are not valid JSON.
    broken_tool_args: bool = False


@dataclass(frozen=True)
class ToolCallTokens:
    """One call of a tool-call section as token ids: its id (the template's
    `functions.NAME:INDEX`) and its arguments (JSON text, unless broken on purpose)."""

    head: tuple[int, ...]
    arguments: tuple[int, ...]
    broken: bool = False


# Writes the calls of one answer's tool-call section from the generation's seeded rng.
ToolCaller = Callable[[random.Random], Sequence[ToolCallTokens]]


@dataclass(frozen=True)
class _Plan:
    """The shape of a natural output: reasoning and answer lengths, then a tool-call section."""

    reasoning: int
    answer: int
    section: list[int] = field(default_factory=list)
    broken: bool = False

    @property
    def section_start(self) -> int:
        """Index of the section's first token in the output."""
        return self.reasoning + 1 + self.answer


def request_digest(input_ids: Sequence[int], seed: int) -> bytes:
    """A stable 16-byte digest of (seed, input_ids): the identity of a generation."""
    h = hashlib.blake2b(digest_size=16)
    h.update(seed.to_bytes(8, "little", signed=True))
    h.update(array("q", input_ids).tobytes())
    return h.digest()


def has_tool_call(input_ids: Sequence[int], seed: int) -> bool:
    """Whether this prompt's output calls a tool when the prompt declares any (one in two)."""
    return request_digest(input_ids, seed)[0] % TOOL_CALL_ONE_IN == 0


def generate(
    input_ids: Sequence[int],
    sampling: Sampling,
    vocab: Vocab,
    shape: OutputShape,
    tools: ToolCaller | None = None,
) -> Completion:
    """Generate the deterministic output for a prompt, applying SGLang's finish rules.

    tools writes the calls of a tool-call section; without it (the prompt declares no tools)
    the output never calls one, as a model is not offered any.
    """
    digest = request_digest(input_ids, sampling.seed)
    rng = random.Random(int.from_bytes(digest, "big"))
    stops = frozenset() if sampling.ignore_eos else sampling.stop_token_ids | {vocab.im_end}
    limit = sampling.max_new_tokens
    out: list[int] = []
    if limit <= 0:
        return Completion(out, Finish("length", length=limit))
    calls = tools if digest[0] % TOOL_CALL_ONE_IN == 0 else None
    plan = _plan(rng, vocab, shape, calls)
    for token in _token_stream(rng, vocab, plan):
        out.append(token)
        # SGLang checks the length limit before stop tokens, so a stop token landing exactly
        # on max_new_tokens still reports "length".
        if len(out) >= limit:
            finish = Finish("length", length=limit)
            break
        if token in stops:
            finish = Finish("stop", matched=token)
            break
    else:  # pragma: no cover - the stream is endless
        raise AssertionError("token stream ended")
    # A cut before the section leaves no broken call in the output.
    broken = plan.broken and len(out) > plan.section_start
    return Completion(out, finish, broken_tool_args=broken)


def _token_stream(rng: random.Random, vocab: Vocab, plan: _Plan) -> Iterator[int]:
    """The model's natural output, then ordinary tokens forever (what ignore_eos sees)."""
    yield from _ordinary(rng, vocab, plan.reasoning)
    yield vocab.think_end
    yield from _ordinary(rng, vocab, plan.answer)
    yield from plan.section
    yield vocab.im_end
    while True:
        yield from _ordinary(rng, vocab, 256)


def _plan(rng: random.Random, vocab: Vocab, shape: OutputShape, tools: ToolCaller | None) -> _Plan:
    """Write the tool calls (if any) first, then fit reasoning and answer around them."""
    calls = list(tools(rng)) if tools is not None else []
    section = _tool_section(vocab, calls) if calls else []
    if len(section) + 4 > shape.max_tokens:
        # A call longer than the longest output the model writes: it answers instead.
        calls, section = [], []
    reasoning, answer = _plan_lengths(rng, shape, 2 + len(section))
    return _Plan(reasoning, answer, section, broken=any(call.broken for call in calls))


def _tool_section(vocab: Vocab, calls: Sequence[ToolCallTokens]) -> list[int]:
    """Kimi-style section: begin, then per call: call begin, id, argument begin, arguments,
    call end; then end (what the chat template renders for an assistant's tool_calls)."""
    section = [vocab.tool_section_begin]
    for call in calls:
        section += [vocab.tool_call_begin, *call.head, vocab.tool_call_argument_begin]
        section += [*call.arguments, vocab.tool_call_end]
    section.append(vocab.tool_section_end)
    return section


def _plan_lengths(rng: random.Random, shape: OutputShape, overhead: int) -> tuple[int, int]:
    """Sample (reasoning, answer) lengths so that the total with overhead (the think-end and
    stop tokens, and any tool-call section) stays within max_tokens."""
    mu = math.log(shape.mean_tokens) - shape.sigma**2 / 2
    total = int(rng.lognormvariate(mu, shape.sigma))
    total = max(overhead + 2, min(total, shape.max_tokens))
    body = total - overhead
    reasoning = max(1, min(body - 1, round(body * rng.uniform(0.55, 0.9))))
    return reasoning, body - reasoning


def stream_due(tokens: int, interval: int) -> bool:
    """Whether an unfinished streamed request sends a chunk once it has this many tokens.

    SGLang's scheduler rule: every token with an interval of 1; with a larger one, the first
    token and then every interval-th after it (1, 1 + interval, ...). A finished request
    always sends its last chunk.
    """
    if tokens < 1:
        return False
    return tokens % interval == 1 if interval > 1 else True


def _ordinary(rng: random.Random, vocab: Vocab, n: int) -> list[int]:
    """n ordinary (non-special) token ids."""
    return rng.choices(range(vocab.ordinary_lo, vocab.ordinary_hi), k=n)


def validate_lengths(prompt_tokens: int, max_new_tokens: int, context_length: int) -> str | None:
    """SGLang's context-length check; the error message, or None when the request fits."""
    if prompt_tokens >= context_length:
        return (
            f"The input ({prompt_tokens} tokens) is longer than the model's context length "
            f"({context_length} tokens)."
        )
    total = prompt_tokens + max_new_tokens
    if total >= context_length:
        return (
            "Requested token count exceeds the model's maximum context length of "
            f"{context_length} tokens. You requested a total of {total} tokens: "
            f"{prompt_tokens} tokens from the input messages and {max_new_tokens} tokens for "
            "the completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit."
        )
    return None


def max_request_tokens(context_length: int, kv_tokens: int) -> int:
    """SGLang's max_req_len: the most prompt + output tokens one request may hold."""
    return min(context_length - 1, kv_tokens - 1)


def prefill_seconds(tokens: int, tokens_per_ms: float) -> float:
    """Time to prefill this many uncached prompt tokens."""
    return tokens / tokens_per_ms / 1000.0


def decode_seconds(batch: int, base_ms: float, per_request_ms: float) -> float:
    """Time of one decode step for a running batch of this size."""
    return (base_ms + per_request_ms * batch) / 1000.0


class PrefixCache:
    """Prompt prefixes as chained hashes of 16-token blocks, LRU-bounded like a radix cache."""

    def __init__(self, capacity_tokens: int) -> None:
        """An empty cache holding at most capacity_tokens tokens."""
        self._capacity = max(1, capacity_tokens // BLOCK_TOKENS)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    @staticmethod
    def block_hashes(input_ids: Sequence[int]) -> list[int]:
        """One hash per full block, each covering the whole prefix up to its end."""
        hashes: list[int] = []
        prev = 0
        for end in range(BLOCK_TOKENS, len(input_ids) + 1, BLOCK_TOKENS):
            prev = hash((prev, tuple(input_ids[end - BLOCK_TOKENS : end])))
            hashes.append(prev)
        return hashes

    def match(self, hashes: Sequence[int]) -> int:
        """Length in tokens of the longest cached prefix, refreshing it in the LRU."""
        hit = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            hit += 1
        return hit * BLOCK_TOKENS

    def insert(self, hashes: Sequence[int]) -> None:
        """Remember a prompt's blocks, evicting the least recently used beyond capacity."""
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        """Forget everything (POST /flush_cache)."""
        self._blocks.clear()

    @property
    def cached_tokens(self) -> int:
        """Tokens currently held."""
        return len(self._blocks) * BLOCK_TOKENS


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
    # KV the request may need at most: SGLang admits on prompt + max_new_tokens.
    reserve: int
    count_in_metrics: bool = True
    state: RequestState = RequestState.WAITING
    cached_tokens: int = 0
    admit_step: int = -1
    key: int = 0

    @property
    def prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.input_ids)

    @property
    def output_tokens(self) -> int:
        """Length of the final output."""
        return len(self.completion.output_ids)


@dataclass(frozen=True)
class PrefillBatch:
    """Jobs admitted together; extend_tokens is the uncached prompt work to prefill."""

    jobs: tuple[Job, ...]
    extend_tokens: int
    cached_tokens: int


@dataclass
class Totals:
    """Cumulative counters behind /metrics (finished requests only, like SGLang)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0


class Scheduler:
    """Continuous batching over a KV pool: FCFS admission, one token per running job per step."""

    def __init__(
        self, kv_tokens: int, max_running: int, max_prefill_tokens: int, cache: PrefixCache
    ) -> None:
        """An idle scheduler."""
        self.kv_tokens = kv_tokens
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.cache = cache
        self.step = 0
        self.used_tokens = 0
        self.reserved_tokens = 0
        self.tokens_generated = 0
        self.last_cache_hit_rate = 0.0
        self.totals = Totals()
        self._waiting: deque[Job] = deque()
        self._running: dict[int, Job] = {}
        self._decoding = 0
        self._heap: list[tuple[int, int]] = []
        self._next_key = 0

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
        return self._decoding

    def has_work(self) -> bool:
        """Whether anything waits or runs."""
        return bool(self._waiting or self._running)

    def submit(self, job: Job) -> None:
        """Queue a job; it runs once it fits."""
        if job.reserve > self.kv_tokens:
            raise ValueError(f"job needs {job.reserve} KV tokens, pool has {self.kv_tokens}")
        self._next_key += 1
        job.key = self._next_key
        job.state = RequestState.WAITING
        self._waiting.append(job)

    def admit(self) -> PrefillBatch | None:
        """Move waiting jobs that fit (FCFS, stopping at the first that does not) to prefill."""
        jobs: list[Job] = []
        extend = cached = 0
        while self._waiting and self._fits(self._waiting[0]):
            job = self._waiting[0]
            hashes = self.cache.block_hashes(job.input_ids)
            # At least one prompt token is always computed, as in SGLang.
            hit = min(self.cache.match(hashes), job.prompt_tokens - 1)
            if jobs and extend + job.prompt_tokens - hit > self.max_prefill_tokens:
                break
            self._waiting.popleft()
            self.cache.insert(hashes)
            self._start_prefill(job, hit)
            jobs.append(job)
            extend += job.prompt_tokens - hit
            cached += hit
        if not jobs:
            return None
        total = extend + cached
        self.last_cache_hit_rate = cached / total if total else 0.0
        return PrefillBatch(tuple(jobs), extend, cached)

    def _fits(self, job: Job) -> bool:
        """Whether a job may start now: a running slot and its worst-case KV are free."""
        return (
            len(self._running) < self.max_running
            and self.reserved_tokens + job.reserve <= self.kv_tokens
        )

    def _start_prefill(self, job: Job, cached_tokens: int) -> None:
        """Allocate a job's prompt KV and reservation."""
        job.state = RequestState.PREFILL
        job.cached_tokens = cached_tokens
        self._running[job.key] = job
        self.reserved_tokens += job.reserve
        self.used_tokens += job.prompt_tokens

    def finish_prefill(self, batch: PrefillBatch) -> list[Job]:
        """Prefill yields each job's first token; returns the jobs that are already done."""
        done: list[Job] = []
        for job in batch.jobs:
            if job.state is not RequestState.PREFILL:
                continue
            first = min(1, job.output_tokens)
            self.used_tokens += first
            self.tokens_generated += first
            if job.output_tokens <= 1:
                done.append(self._finish(job))
                continue
            job.state = RequestState.RUNNING
            job.admit_step = self.step
            self._decoding += 1
            heapq.heappush(self._heap, (self.step + job.output_tokens - 1, job.key))
        return done

    def decode_step(self) -> list[Job]:
        """Advance every decoding job by one token; returns the jobs that finished."""
        self.step += 1
        self.used_tokens += self._decoding
        self.tokens_generated += self._decoding
        done: list[Job] = []
        while self._heap and self._heap[0][0] <= self.step:
            _, key = heapq.heappop(self._heap)
            job = self._running.get(key)
            if job is not None and job.state is RequestState.RUNNING:
                self._decoding -= 1
                done.append(self._finish(job))
        return done

    def _finish(self, job: Job) -> Job:
        """Release a completed job's KV and count it."""
        del self._running[job.key]
        self.used_tokens -= job.prompt_tokens + job.output_tokens
        self.reserved_tokens -= job.reserve
        job.state = RequestState.DONE
        if job.count_in_metrics:
            self.totals.prompt_tokens += job.prompt_tokens
            self.totals.generation_tokens += job.output_tokens
            self.totals.cached_tokens += job.cached_tokens
            self.totals.requests += 1
        return job

    def abort(self, job: Job) -> None:
        """Drop a job wherever it is (its client went away), freeing its KV."""
        if job.state is RequestState.WAITING:
            self._waiting.remove(job)
        elif job.state in (RequestState.PREFILL, RequestState.RUNNING):
            del self._running[job.key]
            self.used_tokens -= job.prompt_tokens + self.generated(job)
            self.reserved_tokens -= job.reserve
            if job.state is RequestState.RUNNING:
                self._decoding -= 1
        else:
            return
        job.state = RequestState.ABORTED

    def generated(self, job: Job) -> int:
        """Tokens of a job's output generated so far (what it holds in KV beyond its prompt)."""
        if job.state is RequestState.DONE:
            return job.output_tokens
        if job.state is RequestState.RUNNING:
            return min(job.output_tokens, 1 + self.step - job.admit_step)
        return 0


class ThroughputMeter:
    """Generated tokens per second over a sliding window of wall time."""

    def __init__(self, window_s: float = 2.0) -> None:
        """An empty meter."""
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def record(self, now: float, total_tokens: int) -> None:
        """Note the cumulative generated-token count at time now."""
        self._samples.append((now, total_tokens))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def rate(self, now: float) -> float:
        """Tokens per second over the window; 0 when nothing was generated lately."""
        if len(self._samples) < 2 or now - self._samples[-1][0] > self.window_s:
            return 0.0
        (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
