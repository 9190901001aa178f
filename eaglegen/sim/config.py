"""Settings of the SGLang simulator: capacity, timing and output shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from eaglegen.assets import TOKENIZER_DIR


@dataclass(frozen=True)
class FaultConfig:
    """Fault knobs, all off by default (reserved slot: the server rejects any that is set)."""

    # Probability per /generate call of answering with each status instead, e.g. ((503, 0.05),).
    error_rates: tuple[tuple[int, float], ...] = ()
    # Extra latency added to every /generate answer.
    added_latency_ms: float = 0.0
    # Probability of closing the connection without an answer.
    drop_rate: float = 0.0
    # Probability of answering 200 with a body that is not valid JSON.
    malformed_rate: float = 0.0
    # Prepend the prompt to output_ids, as some SGLang versions did.
    leak_prompt_tokens: bool = False

    def any_enabled(self) -> bool:
        """True when at least one fault knob is set."""
        return self != FaultConfig()


@dataclass(frozen=True)
class SimConfig:
    """Everything that shapes one simulator instance; the defaults mirror the real run."""

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
    seed: int = 0
    # Directory holding tokenizer.json; None means the packaged tiny tokenizer.
    tokenizer_dir: Path | None = TOKENIZER_DIR
    model_path: str = "eaglegen/sim-reasoner"
    # Decode step = base + per_request * running batch; with 64 running that is ~14 ms.
    decode_step_ms: float = 4.0
    decode_ms_per_request: float = 0.15
    prefill_tokens_per_ms: float = 50.0
    # Natural output length (before any max_new_tokens cut): log-normal mean, hard upper bound.
    mean_output_tokens: int = 300
    max_output_tokens: int = 4096
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
        _require(self.mean_output_tokens >= 1, "mean_output_tokens must be >= 1")
        _require(self.max_output_tokens >= 16, "max_output_tokens must be >= 16")

    @property
    def tokenizer_path(self) -> Path:
        """The tokenizer directory, never None."""
        return Path(self.tokenizer_dir or TOKENIZER_DIR)


def _require(ok: bool, message: str) -> None:
    """Raise ValueError with message unless ok."""
    if not ok:
        raise ValueError(message)
