"""Plain values passed in and out of the repository (no SQLAlchemy objects leak out)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from models.tokens import pack


@dataclass(frozen=True)
class RunSpec:
    """What identifies a run's tokenization; a run never mixes two of these."""

    name: str
    tokenizer_path: str
    tokenizer_sha256: str
    chat_template_sha256: str
    model_name: str
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_context_len: int | None = None
    package_versions: dict[str, str] = field(default_factory=dict)
    think_end_id: int | None = None


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset inside a run and the sampling params every one of its jobs uses."""

    name: str
    source: str
    sampling_params: dict[str, Any]
    budget_tokens: int | None = None
    budget_basis: str = "completion"


@dataclass(frozen=True)
class NewJob:
    """One templated prompt, ready to insert; ``packed`` is its ids as stored."""

    row_index: int
    input_ids: list[int]
    messages: Any
    packed: bytes = field(init=False, repr=False)
    prompt_sha256: str = field(init=False)

    def __post_init__(self) -> None:
        # Computed once here: the hash and the insert both need the packed bytes.
        packed = pack(self.input_ids)
        object.__setattr__(self, "packed", packed)
        object.__setattr__(self, "prompt_sha256", hashlib.sha256(packed).hexdigest())


@dataclass(frozen=True)
class Rejection:
    """A row that cannot become a job."""

    row_index: int
    reason: str
    excerpt: str


@dataclass(frozen=True)
class ClaimedJob:
    """A job this worker won, with everything needed to call the server."""

    id: int
    dataset_id: int
    input_ids: list[int]
    sampling_params: dict[str, Any]
    attempts: int
    reserved_tokens: int = 0
    think_end_id: int | None = None


@dataclass(frozen=True)
class Claim:
    """The answer to a claim: the job when won, else why not."""

    outcome: str  # "claimed" | "not_queued" | "deferred" | "skipped"
    job: ClaimedJob | None = None


@dataclass(frozen=True)
class GenerationRecord:
    """A checked server response, ready to store."""

    output_ids: list[int]
    finish_type: str
    finish_matched: Any
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float
    server: str
    meta_info: dict[str, Any] = field(default_factory=dict)
    think_end_present: bool | None = None
    reasoning_tokens: int | None = None
    answer_tokens: int | None = None


@dataclass(frozen=True)
class DatasetCounts:
    """Jobs by state and token totals of one dataset."""

    run: str
    dataset: str
    states: dict[str, int]
    prompt_tokens: int
    completion_tokens: int

    @property
    def total(self) -> int:
        """All jobs of the dataset, whatever their state."""
        return sum(self.states.values())
