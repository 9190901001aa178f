"""Pure logic of the simulator: deterministic outputs, finish rules and step timing."""

from __future__ import annotations

import hashlib
import math
import random
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

# SGLang's SamplingParams default when a request leaves max_new_tokens out.
DEFAULT_MAX_NEW_TOKENS = 128
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

    def special_ids(self) -> frozenset[int]:
        """The added special tokens the simulator may emit (the stop token among them)."""
        return frozenset(
            {
                self.think_end,
                self.im_end,
                self.tool_section_begin,
                self.tool_section_end,
                self.tool_call_begin,
                self.tool_call_argument_begin,
                self.tool_call_end,
            }
        )

    def ordinary(self) -> Sequence[int]:
        """The ids of plain text."""
        return range(self.ordinary_lo, self.ordinary_hi)

    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a generation by themselves."""
        return (self.im_end,)

    def frame(self, input_ids: Sequence[int], calls: Sequence[ToolCallTokens]) -> Frame:
        """Kimi-K2's shape whatever the prompt: reasoning, think-end, answer, the calls' section,
        im_end (what the bundled template's generation prompt, which opens the block, asks)."""
        section = tuple(_tool_section(self, calls)) if calls else ()
        broken = any(call.broken for call in calls)
        return Frame(close=(self.think_end,), section=section, stop=self.im_end, broken=broken)


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
    """One call as token ids: its head, between the family's call-begin and argument marker
    (Kimi's `functions.NAME:INDEX`; empty for a family without that marker), and the rest of
    its body (the arguments as JSON text, unless broken on purpose)."""

    head: tuple[int, ...]
    arguments: tuple[int, ...]
    broken: bool = False


# Writes the calls of one answer's tool-call section from the generation's seeded rng.
ToolCaller = Callable[[random.Random], Sequence[ToolCallTokens]]


@dataclass(frozen=True)
class Frame:
    """The structure ids a family writes around an output's two texts (reasoning, then
    answer), for one prompt and the calls it makes."""

    opening: tuple[int, ...] = ()  # before the reasoning: the model opening the block itself
    close: tuple[int, ...] | None = ()  # after the reasoning; None: the output has none
    section: tuple[int, ...] = ()  # after the answer: the calls
    stop: int | None = None  # ends the turn; None: only the request's stop ids can
    broken: bool = False  # a call written has arguments broken on purpose

    def overhead(self) -> int:
        """How many structure ids the output holds besides its texts."""
        close = len(self.close or ())
        return len(self.opening) + close + len(self.section) + (self.stop is not None)


class Layout(Protocol):
    """A family's way of writing an output in one vocabulary (`Vocab`: Kimi-K2's, the
    bundled tokenizer's; `eaglegen.sim.layouts` for every family)."""

    @property
    def vocab_size(self) -> int:
        """Every id below it is in the vocabulary; the simulator emits no other."""
        ...

    def ordinary(self) -> Sequence[int]:
        """The ids of plain text (no special or added token among them)."""
        ...

    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a generation by themselves, the family's own turn end first."""
        ...

    def special_ids(self) -> frozenset[int]:
        """The structure ids it writes (what the strip_special_tokens fault leaves out)."""
        ...

    def frame(self, input_ids: Sequence[int], calls: Sequence[ToolCallTokens]) -> Frame:
        """The structure of the output to this prompt, with these calls (maybe none)."""
        ...


@dataclass(frozen=True)
class _Plan:
    """The shape of a natural output: its frame and the lengths of its two texts."""

    frame: Frame
    reasoning: int
    answer: int

    @property
    def section_start(self) -> int:
        """Index of the section's first token in the output."""
        close = len(self.frame.close or ())
        return len(self.frame.opening) + self.reasoning + close + self.answer


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
    vocab: Layout,
    shape: OutputShape,
    tools: ToolCaller | None = None,
) -> Completion:
    """Generate the deterministic output for a prompt, applying SGLang's finish rules.

    vocab lays the output out in its family's structure; tools writes the calls of a
    tool-call section; without it (the prompt declares no tools) the output never calls one,
    as a model is not offered any.
    """
    digest = request_digest(input_ids, sampling.seed)
    rng = random.Random(int.from_bytes(digest, "big"))
    stops = frozenset() if sampling.ignore_eos else sampling.stop_token_ids | set(vocab.stop_ids())
    limit = sampling.max_new_tokens
    out: list[int] = []
    if limit <= 0:
        return Completion(out, Finish("length", length=limit))
    calls = tools if digest[0] % TOOL_CALL_ONE_IN == 0 else None
    plan = _plan(rng, vocab, input_ids, shape, calls)
    stop = final_stop(plan.frame.stop, vocab.stop_ids(), sampling)
    for token in _token_stream(rng, vocab, plan, stop):
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
    broken = plan.frame.broken and len(out) > plan.section_start
    return Completion(out, finish, broken_tool_args=broken)


def final_stop(natural: int | None, family: Sequence[int], sampling: Sampling) -> int | None:
    """The id that ends the turn: the family's own, unless the request names other stop ids
    (a run whose stop ids are not its family's, e.g. a test tokenizer's eos): then the first of
    the family's stop ids it names, else the smallest it names."""
    asked = sampling.stop_token_ids
    if sampling.ignore_eos or not asked or natural in asked:
        return natural
    return next((token for token in family if token in asked), min(asked))


def _token_stream(
    rng: random.Random, vocab: Layout, plan: _Plan, stop: int | None
) -> Iterator[int]:
    """The model's natural output, then ordinary tokens forever (what ignore_eos sees)."""
    frame = plan.frame
    yield from frame.opening
    yield from _ordinary(rng, vocab, plan.reasoning)
    yield from frame.close or ()
    yield from _ordinary(rng, vocab, plan.answer)
    yield from frame.section
    if stop is not None:
        yield stop
    while True:
        yield from _ordinary(rng, vocab, 256)


def _plan(
    rng: random.Random,
    vocab: Layout,
    input_ids: Sequence[int],
    shape: OutputShape,
    tools: ToolCaller | None,
) -> _Plan:
    """Write the tool calls (if any) first, then fit reasoning and answer around them."""
    calls = list(tools(rng)) if tools is not None else []
    frame = vocab.frame(input_ids, calls)
    if calls and frame.overhead() + 2 > shape.max_tokens:
        # A call longer than the longest output the model writes: it answers instead.
        frame = vocab.frame(input_ids, [])
    reasoning, answer = _plan_lengths(rng, shape, frame.overhead())
    if frame.close is None:  # no reasoning: its share is answer (the same draws either way)
        reasoning, answer = 0, reasoning + answer
    return _Plan(frame, reasoning, answer)


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


def _ordinary(rng: random.Random, vocab: Layout, n: int) -> list[int]:
    """n ordinary (non-special) token ids."""
    return rng.choices(vocab.ordinary(), k=n)


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


def prefill_seconds(tokens: int, tokens_per_ms: float, base_ms: float = 0.0) -> float:
    """Time of a prefill pass computing this many uncached tokens, with its fixed part."""
    return (base_ms + tokens / tokens_per_ms) / 1000.0


def decode_seconds(batch: int, base_ms: float, per_request_ms: float) -> float:
    """Time of one decode step for a running batch of this size."""
    return (base_ms + per_request_ms * batch) / 1000.0


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
