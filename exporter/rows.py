"""A generation as a training row: prompt ids + output ids, and the loss mask over them.

The mask is 0 over the prompt and 1 over every generated token: the reasoning, the
think-end token, tool-call sections and the stop token are all the model's own output, and
a drafter that never learns to predict the stop token drafts past the end of every answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from models.records import ExportedGeneration
from models.tokens import unpack

ID_BYTES = 4  # packed little-endian int32, as stored (models.tokens)

# The names under which the manifest counts what each filter removed, in the order the
# filters apply (a row is counted under the first that removes it).
TRUNCATED = "exclude_truncated"
SHORT = "min_completion_tokens"
INVALID = "only_valid"
NO_LOSS = "max_len"
NOT_EXACT = "require_exact"  # conversations only: applied after the round trip
REMOVALS = (TRUNCATED, SHORT, INVALID, NO_LOSS, NOT_EXACT)


@dataclass(frozen=True)
class TokenRow:
    """One exported row; ``input_ids`` packed as stored, already cut to the maximum length."""

    id: int
    dataset: str
    row_index: int
    input_ids: bytes
    prompt_len: int
    finish_reason: str
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float
    server: str
    think_end_present: bool | None
    reasoning_tokens: int | None
    answer_tokens: int | None
    cut: bool = False

    @property
    def seq_len(self) -> int:
        """Length of ``input_ids`` (and of the loss mask)."""
        return len(self.input_ids) // ID_BYTES

    @property
    def loss_tokens(self) -> int:
        """Positions the mask trains on."""
        return max(self.seq_len - self.prompt_len, 0)

    def ids(self) -> list[int]:
        """``input_ids`` as a list."""
        return unpack(self.input_ids)

    def loss_mask(self) -> list[int]:
        """0 over the prompt, 1 over the generated tokens, as long as ``input_ids``."""
        return loss_mask(self.prompt_len, self.seq_len)


def loss_mask(prompt_len: int, seq_len: int) -> list[int]:
    """The mask of a row of ``seq_len`` positions whose first ``prompt_len`` are the prompt."""
    prompt = min(prompt_len, seq_len)
    return [0] * prompt + [1] * (seq_len - prompt)


@dataclass(frozen=True)
class Filters:
    """What an export leaves out (None or 0: nothing)."""

    datasets: tuple[str, ...] | None = None
    exclude_truncated: bool = False
    min_completion_tokens: int = 0
    max_len: int | None = None
    only_valid: bool = False
    require_exact: bool = False

    def __post_init__(self) -> None:
        if self.min_completion_tokens < 0:
            raise ValueError(
                f"--min-completion-tokens must be 0 or more, not {self.min_completion_tokens}"
            )
        if self.max_len is not None and self.max_len < 1:
            raise ValueError(f"--max-len must be 1 or more, not {self.max_len}")


def token_row(gen: ExportedGeneration, max_len: int | None = None) -> TokenRow:
    """The row of ``gen``: its prompt ids then its output ids, cut to ``max_len`` positions
    the way trainers cut (``input_ids[:max_len]``, the mask with it)."""
    packed = gen.prompt_packed + gen.output_packed  # packing is per id: bytes concatenate
    cut = max_len is not None and len(packed) > max_len * ID_BYTES
    if cut:
        assert max_len is not None
        packed = packed[: max_len * ID_BYTES]
    return TokenRow(
        id=gen.job_id,
        dataset=gen.dataset,
        row_index=gen.row_index,
        input_ids=packed,
        prompt_len=len(gen.prompt_packed) // ID_BYTES,
        finish_reason=gen.finish_type,
        completion_tokens=gen.completion_tokens,
        cached_tokens=gen.cached_tokens,
        e2e_latency=gen.e2e_latency,
        server=gen.server,
        think_end_present=gen.think_end_present,
        reasoning_tokens=gen.reasoning_tokens,
        answer_tokens=gen.answer_tokens,
        cut=cut,
    )


def removal(
    gen: ExportedGeneration, filters: Filters, valid: Callable[[], bool] | None = None
) -> str | None:
    """The name of the first filter that removes ``gen`` before it is shaped, or None.

    ``valid`` answers whether every invariant held (``core.anatomy.valid``); it is asked only
    under ``--only-valid``, since answering reads the tokenizer.
    """
    if filters.exclude_truncated and gen.finish_type == "length":
        return TRUNCATED
    if gen.completion_tokens < filters.min_completion_tokens:
        return SHORT
    if filters.only_valid and valid is not None and not valid():
        return INVALID
    return None


def select_row(
    gen: ExportedGeneration, filters: Filters, valid: Callable[[], bool] | None = None
) -> TokenRow | str:
    """The row of ``gen``, or the name of the filter that removes it (``REMOVALS``).

    ``--datasets`` is applied by the query (those rows are never read).
    """
    removed = removal(gen, filters, valid)
    if removed is not None:
        return removed
    row = token_row(gen, filters.max_len)
    if row.loss_tokens == 0:
        return NO_LOSS  # the cut left only prompt: nothing to train on
    return row
