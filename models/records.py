"""Plain values passed in and out of the repository (no SQLAlchemy objects leak out)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from core.samples import sample_identity
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
    vocab_size: int | None = None
    # The publishing order's seed (models.order); None: a new run draws one.
    order_seed: int | None = None
    # Its model family (core.families); ``family_named``: the run file named it (a run
    # recorded with another is then refused), else it was detected (the recorded one stays).
    family: str | None = None
    family_named: bool = False
    # The enqueue trusted the tokenizer's own code (recorded: the advancer loads it too).
    trust_remote_code: bool = False


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset inside a run and the sampling params every one of its jobs uses."""

    name: str
    source: str
    sampling_params: dict[str, Any]
    budget_tokens: int | None = None
    budget_basis: str = "completion"
    # What its claims reserve (models.ledger.ReservePolicy); None: a new dataset takes the
    # default, one that exists keeps its own.
    reserve: str | None = None
    # The stop ids are the tokenizer's default, not the run file's: a dataset that exists
    # keeps the ones it stored (the default's rule may have changed since).
    stops_defaulted: bool = False
    # 'all' or 'last' (datasets.turns); None: a new dataset takes 'all', one that exists
    # keeps its own.
    turns: str | None = None
    # Generations of each prompt (datasets.samples): None keeps a dataset's own (1 for a
    # new one); more raises it, fewer is refused.
    samples: int | None = None
    # Its variants as stored (core.samples.Variant.as_json); None keeps a dataset's own.
    variants: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class NewJob:
    """One templated prompt, ready to insert; ``packed`` is its ids as stored."""

    row_index: int
    input_ids: list[int]
    messages: Any
    opens_reasoning: bool = False
    packed: bytes = field(init=False, repr=False)
    prompt_sha256: bytes = field(init=False)

    def __post_init__(self) -> None:
        # Computed once here: the hash and the insert both need the packed bytes.
        packed = pack(self.input_ids)
        object.__setattr__(self, "packed", packed)
        object.__setattr__(self, "prompt_sha256", prompt_sha256(packed))


@dataclass(frozen=True, slots=True)
class NewConversation:
    """A multi-turn row of a ``turns = 'all'`` dataset and its first turn, templated.

    ``source``: the row's messages and tools as JSON text (``{"messages", "tools"}``), its
    identity hashed (``digest``); ``points``: its answer points (core.dialogue), at least
    two; ``first``: the first turn's prompt as a job's columns (``messages``: that prompt's).
    """

    row_index: int
    source: str
    points: int
    packed_ids: bytes
    prompt_tokens: int
    messages: str
    opens_reasoning: bool
    # Which sample of the row it is (core.samples), its variant and sampling seed.
    sample: int = 0
    variant: str | None = None
    sampling_seed: int | None = None

    @property
    def row_digest(self) -> bytes:
        """The row's identity in its dataset (its sample 0's)."""
        return hashlib.sha256(self.source.encode()).digest()

    @property
    def digest(self) -> bytes:
        """The conversation's identity in its dataset: its row's, and its sample's."""
        return sample_identity(self.row_digest, self.sample)


def turn_sha256(conversation_digest: bytes, turn: int) -> bytes:
    """A conversation turn's job identity (jobs.prompt_sha256): its prompt ids depend on the
    model's earlier answers, so the turn is known by its conversation and index."""
    return hashlib.sha256(b"turn" + conversation_digest + turn.to_bytes(4, "big")).digest()


def prompt_sha256(packed: bytes) -> bytes:
    """A prompt's identity: the hash (32 bytes) of exactly the ids the model sees (packed)."""
    return hashlib.sha256(packed).digest()


@dataclass(frozen=True, slots=True)
class SampleColumns:
    """A job's place among its prompt's samples (core.samples)."""

    sample: int
    variant: str | None
    sampling_seed: int | None
    # The identity of its prompt's sample 0 (None: it is sample 0), and that of the job
    # holding its prompt ids and messages (None: it holds them itself).
    first: bytes | None = None
    holder: bytes | None = None


@dataclass
class JobBatch:
    """New jobs as parallel columns: what the insert copies, and cheap to pickle.

    The producer builds these in worker processes; one list per column pickles in a few
    calls where a list of objects pickles object by object.
    """

    row_index: list[int] = field(default_factory=list)
    prompt_sha256: list[bytes] = field(default_factory=list)
    packed_ids: list[bytes] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    messages_json: list[str] = field(default_factory=list)
    opens_reasoning: list[bool] = field(default_factory=list)
    # Set for the jobs of a dataset with several samples or variants (`add`'s ``sample``):
    # which sample, its variant, its seed, its sample 0's identity (None: it is sample 0)
    # and the identity of the job that holds its prompt ids (None: it holds them).
    samples: list[SampleColumns] = field(default_factory=list)

    @property
    def sampled(self) -> bool:
        """Whether its jobs carry sample columns (then every one does)."""
        return bool(self.samples)

    @classmethod
    def of(cls, jobs: Iterable[NewJob]) -> JobBatch:
        """The columns of ``jobs``, in order."""
        batch = cls()
        for job in jobs:
            batch.add(
                job.row_index,
                job.prompt_sha256,
                job.packed,
                len(job.input_ids),
                json.dumps(job.messages, ensure_ascii=False),
                job.opens_reasoning,
            )
        return batch

    def add(
        self,
        row_index: int,
        sha256: bytes,
        packed: bytes,
        tokens: int,
        messages: str,
        opens_reasoning: bool,
        sample: SampleColumns | None = None,
    ) -> None:
        """Append one job (one sample of a prompt, with its ``sample`` columns: then every
        job of the batch has them)."""
        if sample is not None:
            self.samples.append(sample)
        self.row_index.append(row_index)
        self.prompt_sha256.append(sha256)
        self.packed_ids.append(packed)
        self.prompt_tokens.append(tokens)
        self.messages_json.append(messages)
        self.opens_reasoning.append(opens_reasoning)

    def __len__(self) -> int:
        return len(self.row_index)

    def rows(self) -> Iterator[tuple[int, bytes, bytes, int, str, bool]]:
        """One tuple per job, in column order."""
        return zip(
            self.row_index,
            self.prompt_sha256,
            self.packed_ids,
            self.prompt_tokens,
            self.messages_json,
            self.opens_reasoning,
            strict=True,
        )


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
    # The think-end id its output must hold: set when its prompt opens a reasoning block.
    think_end_id: int | None = None
    # Output ids must be below it (the run's tokenizer size; None for runs before 0006).
    vocab_size: int | None = None
    # Its run's and dataset's names, for the messages that send it back.
    run: str = ""
    dataset: str = ""
    # What its run was templated for: only a server of that model may generate it.
    model: str = ""
    tokenizer_path: str = ""

    @property
    def run_model(self) -> RunModel:
        """The model its run wants."""
        return RunModel(self.run, self.model, self.tokenizer_path)


@dataclass(frozen=True)
class RunModel:
    """The model a job's run was templated for: only a server of it may generate the job.

    ``model``: the run's model name (the run file's ``model``, else the tokenizer folder's
    name); ``tokenizer_path``: the tokenizer folder the run was templated with.
    """

    run: str
    model: str
    tokenizer_path: str


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
class ExportRun:
    """What an export's manifest says about its run: identity, tokenization, sampling."""

    id: int
    name: str
    model_name: str
    tokenizer_path: str
    tokenizer_sha256: str
    chat_template_sha256: str
    chat_template_kwargs: dict[str, Any]
    think_end_id: int | None
    # Dataset name -> its sampling params, for every dataset of the run.
    sampling: dict[str, dict[str, Any]]
    # Its model family (core.families); None: not recorded, detected from the tokenizer.
    family: str | None = None


@dataclass(frozen=True)
class ExportedGeneration:
    """One done job's generation as stored: ids stay packed (``models.tokens``)."""

    job_id: int
    dataset: str
    row_index: int
    prompt_packed: bytes
    output_packed: bytes
    finish_type: str
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float
    server: str
    think_end_present: bool | None
    reasoning_tokens: int | None
    answer_tokens: int | None
    created_at: datetime
    # A turn of an on-policy conversation: which, and its index from 0 (None: a plain job).
    conversation_id: int | None = None
    turn: int | None = None
    # Its prompt's sample (core.samples) and variant; ``first``: the job (a conversation's
    # turn: the conversation) of its prompt's sample 0 (None: its own); ``sampled``: its
    # dataset asks several samples or has variants (its ids say the sample).
    sample: int = 0
    variant: str | None = None
    first: int | None = None
    sampled: bool = False

    @property
    def prompt_key(self) -> int:
        """The job (a conversation's turn: the conversation) of its prompt's sample 0."""
        if self.first is not None:
            return self.first
        return self.job_id if self.conversation_id is None else self.conversation_id


@dataclass(frozen=True)
class ExportCursor:
    """Where an incremental export starts: every generation recorded at or after
    ``since`` whose job is not in ``seen`` (those an earlier export already read); and,
    for an export of whole conversations, every conversation that reached its final state
    at or after ``since`` and is not in ``conversations``."""

    since: datetime
    seen: frozenset[int] = frozenset()
    conversations: frozenset[int] = frozenset()
