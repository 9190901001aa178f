"""Settings of the SGLang simulator: capacity, timing, output shape and faults."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from eaglegen.assets import TOKENIZER_DIR
from eaglegen.sim.forward import StepCosts
from eaglegen.sim.scheduler import (
    CLIP_MAX_NEW_TOKENS,
    NEW_TOKEN_RATIO_DECAY_STEPS,
    RETRACT_DECODE_STEPS,
    SchedulerConfig,
)

# Statuses an injected error may carry: client and server errors only.
_ERROR_STATUSES = range(400, 600)
_FAULT_FIELDS = (
    "error_rates",
    "added_latency_ms",
    "drop_rate",
    "malformed_rate",
    "leak_prompt_tokens",
    "strip_special_tokens",
    "stall_rate",
    "stall_after_chunks",
    "drip_rate",
    "drip_interval_ms",
    "drip_bytes",
    "broken_tool_args_rate",
    "seed",
    "unhealthy",
)


@dataclass(frozen=True)
class FaultConfig:
    """Fault knobs, all off by default; replaceable at runtime through POST /sim/faults."""

    # Probability per /generate call of answering with each status instead, e.g. ((503, 0.05),).
    error_rates: tuple[tuple[int, float], ...] = ()
    # Extra latency added to every /generate answer.
    added_latency_ms: float = 0.0
    # Probability of closing the connection without an answer.
    drop_rate: float = 0.0
    # Probability of answering 200 with a body that is not valid JSON.
    malformed_rate: float = 0.0
    # output_ids begin with the last N prompt tokens, as some SGLang versions sent them;
    # completion_tokens still counts only the generated ones. True (the older form) means 1.
    leak_prompt_tokens: int = 0
    # The added special tokens (think-end, tool-call markers; not the final stop token) are
    # left out of output_ids and completion_tokens, as a server skipping special tokens sends.
    strip_special_tokens: bool = False
    # Probability that a streamed answer stops after stall_after_chunks data chunks and holds
    # the connection open, silent, until the client goes away (a hung server or proxy).
    stall_rate: float = 0.0
    stall_after_chunks: int = 1
    # Probability that a non-streamed answer's body trickles out drip_bytes at a time, one
    # piece every drip_interval_ms (a congested link or a slow proxy).
    drip_rate: float = 0.0
    drip_interval_ms: float = 50.0
    drip_bytes: int = 16
    # Probability that a tool call's arguments are not valid JSON (decided per prompt and seed).
    broken_tool_args_rate: float = 0.0
    # Seeds the per-request fault draws, so a run's faults are reproducible.
    seed: int = 0
    # /health and /health_generate answer 503, as a server going down would.
    unhealthy: bool = False

    def __post_init__(self) -> None:
        """Reject impossible knobs; keep error_rates sorted so equal configs compare equal."""
        rates = tuple(sorted((int(s), float(p)) for s, p in self.error_rates))
        object.__setattr__(self, "error_rates", rates)
        object.__setattr__(self, "leak_prompt_tokens", int(self.leak_prompt_tokens))
        _require(self.leak_prompt_tokens >= 0, "leak_prompt_tokens must be >= 0")
        statuses = [status for status, _ in rates]
        _require(len(set(statuses)) == len(statuses), "error_rates: one rate per status")
        for status, rate in rates:
            _require(status in _ERROR_STATUSES, f"error_rates: {status} is not a 4xx/5xx status")
            _require(0.0 <= rate <= 1.0, f"error_rates: {status} rate must be in [0, 1]")
        _require(0.0 <= self.drop_rate <= 1.0, "drop_rate must be in [0, 1]")
        for name in ("malformed_rate", "stall_rate", "drip_rate", "broken_tool_args_rate"):
            _require(0.0 <= getattr(self, name) <= 1.0, f"{name} must be in [0, 1]")
        # One draw per request picks at most one fault, so the rates share the unit interval.
        _require(self.total_rate() <= 1.0 + 1e-9, "fault rates must add up to at most 1")
        _require(self.added_latency_ms >= 0.0, "added_latency_ms must be >= 0")
        _require(self.stall_after_chunks >= 0, "stall_after_chunks must be >= 0")
        _require(self.drip_interval_ms >= 0.0, "drip_interval_ms must be >= 0")
        _require(self.drip_bytes >= 1, "drip_bytes must be >= 1")

    def total_rate(self) -> float:
        """Largest probability that a /generate call gets a fault instead of a normal answer."""
        # A stall only hits streamed calls and a drip only the others: they share one slice.
        shared = self.drop_rate + self.malformed_rate + sum(rate for _, rate in self.error_rates)
        return shared + max(self.stall_rate, self.drip_rate)

    def any_enabled(self) -> bool:
        """True when at least one fault knob is set (the seed alone changes nothing)."""
        return replace(self, seed=0) != FaultConfig()

    def to_json(self) -> dict[str, Any]:
        """The JSON form served by GET /sim/faults (error_rates as {"503": 0.2})."""
        body = asdict(self)
        body["error_rates"] = {str(status): rate for status, rate in self.error_rates}
        return body

    @classmethod
    def from_json(cls, body: object) -> FaultConfig:
        """Build from the JSON form; absent fields take their defaults; ValueError if invalid."""
        if not isinstance(body, dict):
            raise ValueError("faults must be a JSON object")
        unknown = sorted(set(body) - set(_FAULT_FIELDS))
        _require(not unknown, f"unknown fault field(s): {unknown}")
        return cls(
            error_rates=_json_error_rates(body.get("error_rates", {})),
            added_latency_ms=_json_number(body, "added_latency_ms"),
            drop_rate=_json_number(body, "drop_rate"),
            malformed_rate=_json_number(body, "malformed_rate"),
            leak_prompt_tokens=_json_count(body, "leak_prompt_tokens"),
            strip_special_tokens=_json_bool(body, "strip_special_tokens"),
            stall_rate=_json_number(body, "stall_rate"),
            stall_after_chunks=_json_int(body, "stall_after_chunks", 1),
            drip_rate=_json_number(body, "drip_rate"),
            drip_interval_ms=_json_number(body, "drip_interval_ms", 50.0),
            drip_bytes=_json_int(body, "drip_bytes", 16),
            broken_tool_args_rate=_json_number(body, "broken_tool_args_rate"),
            seed=_json_int(body, "seed"),
            unhealthy=_json_bool(body, "unhealthy"),
        )


def parse_error_rate(text: str) -> tuple[int, float]:
    """One `STATUS=P` command-line value, e.g. "503=0.2"."""
    status, sep, rate = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(status), float(rate)
    except ValueError:
        raise ValueError(f"error rate {text!r} is not STATUS=PROBABILITY, e.g. 503=0.2") from None


def _json_error_rates(value: object) -> tuple[tuple[int, float], ...]:
    """error_rates from {"503": 0.2, ...}."""
    if not isinstance(value, dict):
        raise ValueError('error_rates must be an object like {"503": 0.2}')
    rates = []
    for status, rate in value.items():
        _require(str(status).isdigit(), f"error_rates: {status!r} is not a status code")
        _require(_is_number(rate), f"error_rates: the rate of {status} must be a number")
        rates.append((int(status), float(rate)))
    return tuple(rates)


def _json_number(body: dict[str, Any], key: str, default: float = 0.0) -> float:
    """An optional numeric field, the default when absent."""
    value = body.get(key, default)
    _require(_is_number(value), f"{key} must be a number")
    return float(value)


def _json_int(body: dict[str, Any], key: str, default: int = 0) -> int:
    """An optional integer field, the default when absent."""
    value = body.get(key, default)
    _require(isinstance(value, int) and not isinstance(value, bool), f"{key} must be an integer")
    return int(value)


def _json_count(body: dict[str, Any], key: str) -> int:
    """A count that an older client may still send as true/false (true meaning 1)."""
    value = body.get(key, 0)
    if isinstance(value, bool):
        return int(value)
    return _json_int(body, key)


def _json_bool(body: dict[str, Any], key: str) -> bool:
    """An optional boolean field, false when absent."""
    value = body.get(key, False)
    _require(isinstance(value, bool), f"{key} must be true or false")
    return bool(value)


def _is_number(value: object) -> bool:
    """A finite JSON number (bool is not one)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SimConfig:
    """Everything that shapes one simulator instance.

    The defaults are the "fast" preset (eaglegen.sim.presets): a small fast server whose
    admission reserves every running request's whole remaining output (a new-token ratio fixed
    at 1), so the suite's loads never see a retraction; the other presets turn on SGLang's
    decaying ratio and its retractions.
    """

    # Name of the preset these values came from (reported by /get_server_info).
    preset: str = "fast"

    host: str = "127.0.0.1"
    # 0 picks a free port when the server binds.
    port: int = 0
    # KV pool size in tokens (the real run's 159K GPU tokens).
    kv_tokens: int = 159_000
    context_length: int = 32_768
    max_running_requests: int = 1024
    # None = unbounded waiting queue, like SGLang without --max-queued-requests.
    max_queued_requests: int | None = None
    # Largest number of uncached prompt tokens prefilled in one batch (SGLang's max_prefill_tokens).
    max_prefill_tokens: int = 16_384
    # SGLang's --chunked-prefill-size; None prefills a long prompt in one batch.
    chunked_prefill_size: int | None = None
    # SGLang's new_token_ratio: starts at init, decays to min over the steps, see scheduler.py.
    init_new_token_ratio: float = 1.0
    min_new_token_ratio: float = 1.0
    new_token_ratio_decay_steps: int = NEW_TOKEN_RATIO_DECAY_STEPS
    clip_max_new_tokens: int = CLIP_MAX_NEW_TOKENS
    retract_decode_steps: int = RETRACT_DECODE_STEPS
    # Multiplies every simulated step's duration: 0.05 runs a preset 20 times faster with the
    # same shape (latencies and rates seen by clients are then in scaled wall time).
    time_scale: float = 1.0
    seed: int = 0
    # Directory holding tokenizer.json; None means the packaged tiny tokenizer.
    tokenizer_dir: Path | None = TOKENIZER_DIR
    # The model family whose layout the outputs take (core.families' names); None detects
    # it from the tokenizer's tokens and chat template.
    family: str | None = None
    model_path: str = "eaglegen/sim-reasoner"
    # Decode step = base + per_request * running batch; with 64 running that is ~14 ms.
    decode_step_ms: float = 4.0
    decode_ms_per_request: float = 0.15
    # Prefill pass = prefill_step_ms + tokens / prefill_tokens_per_ms (eaglegen.sim.forward).
    prefill_tokens_per_ms: float = 50.0
    prefill_step_ms: float = 0.0
    # Natural output length (before any max_new_tokens cut): log-normal mean, hard upper bound.
    mean_output_tokens: int = 300
    max_output_tokens: int = 4096
    # Spread (log-normal sigma) of natural output lengths: long answers stay in the batch
    # longest, so the spread decides how many requests a pool holds at once.
    output_length_sigma: float = 0.9
    # SGLang's --stream-interval: a streamed request gets a chunk every this many tokens.
    stream_interval: int = 1
    # SGLang's --incremental-streaming-output (formerly --stream-output): chunks carry only the
    # new text and output_ids instead of everything so far.
    incremental_streaming_output: bool = False
    log_level: str = "warning"
    faults: FaultConfig = field(default_factory=FaultConfig)

    def __post_init__(self) -> None:
        """Reject values that would make the simulator meaningless."""
        if self.tokenizer_dir is None:
            object.__setattr__(self, "tokenizer_dir", TOKENIZER_DIR)
        _require(0 <= self.port <= 65_535, "port must be in [0, 65535]")
        _require(self.kv_tokens > 1, "kv_tokens must be > 1")
        _require(self.context_length > 1, "context_length must be > 1")
        _require(self.max_running_requests >= 1, "max_running_requests must be >= 1")
        _require(
            self.max_queued_requests is None or self.max_queued_requests >= 0,
            "max_queued_requests must be >= 0",
        )
        _require(self.max_prefill_tokens >= 1, "max_prefill_tokens must be >= 1")
        _require(self.decode_step_ms >= 0 and self.decode_ms_per_request >= 0, "timing >= 0")
        _require(self.prefill_tokens_per_ms > 0, "prefill_tokens_per_ms must be > 0")
        _require(self.prefill_step_ms >= 0, "prefill_step_ms must be >= 0")
        _require(self.mean_output_tokens >= 1, "mean_output_tokens must be >= 1")
        _require(self.max_output_tokens >= 16, "max_output_tokens must be >= 16")
        _require(0.0 < self.output_length_sigma <= 3.0, "output_length_sigma must be in (0, 3]")
        _require(self.stream_interval >= 1, "stream_interval must be >= 1")
        _require(self.time_scale > 0, "time_scale must be > 0")
        self.scheduler_config()  # validates the scheduler's knobs

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's share of the settings."""
        return SchedulerConfig(
            kv_tokens=self.kv_tokens,
            max_running_requests=self.max_running_requests,
            max_prefill_tokens=self.max_prefill_tokens,
            chunked_prefill_size=self.chunked_prefill_size,
            init_new_token_ratio=self.init_new_token_ratio,
            min_new_token_ratio=self.min_new_token_ratio,
            new_token_ratio_decay_steps=self.new_token_ratio_decay_steps,
            clip_max_new_tokens=self.clip_max_new_tokens,
            retract_decode_steps=self.retract_decode_steps,
        )

    def step_costs(self) -> StepCosts:
        """What each forward pass costs on the engine's clock."""
        return StepCosts(
            decode_step_ms=self.decode_step_ms,
            decode_ms_per_request=self.decode_ms_per_request,
            prefill_tokens_per_ms=self.prefill_tokens_per_ms,
            prefill_step_ms=self.prefill_step_ms,
        )

    @property
    def tokenizer_path(self) -> Path:
        """The tokenizer directory, never None."""
        return Path(self.tokenizer_dir or TOKENIZER_DIR)


def _require(ok: bool, message: str) -> None:
    """Raise ValueError with message unless ok."""
    if not ok:
        raise ValueError(message)
