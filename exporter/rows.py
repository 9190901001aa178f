"""A generation as a training row: prompt ids + output ids, and the loss mask over them.

The mask is 0 over the prompt and 1 over every generated token: the reasoning, the
think-end token, tool-call sections and the stop token are all the model's own output, and
a drafter that never learns to predict the stop token drafts past the end of every answer.

A row's ``id`` names what it holds: a plain job's id (``"1234"``), a conversation's turn
(``"<conversation>_turn<t>"``), or a conversation's turns 0 to ``t`` merged into one row
(``"<conversation>_turn0-<t>"``, ``exporter.merge``), whose mask is 1 over every turn's
output and 0 over everything else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from exporter.merge import ID_BYTES, Span, mask
from models.records import ExportedGeneration
from models.tokens import unpack

# The names under which the manifest counts what each filter removed, in the order the
# filters apply (a row is counted under the first that removes it).
TRUNCATED = "exclude_truncated"
SHORT = "min_completion_tokens"
INVALID = "only_valid"
NO_LOSS = "max_len"
NOT_EXACT = "require_exact"  # conversations only: applied after the round trip
EXTRA_SAMPLE = "samples_per_prompt"
REMOVALS = (TRUNCATED, SHORT, INVALID, NO_LOSS, NOT_EXACT, EXTRA_SAMPLE)


def stem(gen: ExportedGeneration) -> str:
    """What ``gen``'s row ids begin with: its job, or its conversation; in a dataset of
    several samples or variants, its prompt's (its sample 0's) and its sample's:
    ``<prompt>_gen<k>``."""
    return f"{gen.prompt_key}_gen{gen.sample}" if gen.sampled else str(gen.prompt_key)


def row_id(gen: ExportedGeneration) -> str:
    """The id of ``gen``'s own row: its job's, or its conversation's and turn's."""
    if gen.conversation_id is None:
        return stem(gen)
    return f"{stem(gen)}_turn{gen.turn}"


def merged_id(last: ExportedGeneration) -> str:
    """The id of the row holding a conversation's turns 0 to ``last``'s."""
    if last.turn == 0:
        return f"{stem(last)}_turn0"
    return f"{stem(last)}_turn0-{last.turn}"


@dataclass(frozen=True)
class TokenRow:
    """One exported row; ``input_ids`` packed as stored, already cut to the maximum length.
    ``spans``: where the mask is 1 (positions, end excluded; cut with the row); empty for a
    row of one generation, whose mask is 1 from ``prompt_len`` on."""

    id: str
    job_id: int  # the job whose prompt + output ids the row is (a merged row: its last turn)
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
    conversation_id: int | None = None
    # Its prompt's sample and variant (core.samples).
    sample: int = 0
    variant: str | None = None
    turn: int | None = None  # a merged row: its last turn
    turns: int = 1  # the turns whose output the row trains
    spans: tuple[Span, ...] = ()

    @property
    def seq_len(self) -> int:
        """Length of ``input_ids`` (and of the loss mask)."""
        return len(self.input_ids) // ID_BYTES

    def loss_spans(self) -> tuple[Span, ...]:
        """Where the mask is 1, each span within the row."""
        if not self.spans:
            return ((min(self.prompt_len, self.seq_len), self.seq_len),)
        n = self.seq_len
        return tuple((min(a, n), min(b, n)) for a, b in self.spans)

    @property
    def loss_tokens(self) -> int:
        """Positions the mask trains on."""
        return sum(b - a for a, b in self.loss_spans())

    def ids(self) -> list[int]:
        """``input_ids`` as a list."""
        return unpack(self.input_ids)

    def loss_mask(self) -> list[int]:
        """1 over the generated tokens, 0 elsewhere, as long as ``input_ids``."""
        return mask(self.loss_spans(), self.seq_len)


@dataclass(frozen=True)
class Filters:
    """What an export leaves out (None or 0: nothing)."""

    datasets: tuple[str, ...] | None = None
    exclude_truncated: bool = False
    min_completion_tokens: int = 0
    max_len: int | None = None
    only_valid: bool = False
    require_exact: bool = False
    # Keep samples 0 to N - 1 of each prompt (core.samples); None: every one.
    samples_per_prompt: int | None = None

    def __post_init__(self) -> None:
        if self.samples_per_prompt is not None and self.samples_per_prompt < 1:
            raise ValueError(
                f"--samples-per-prompt must be 1 or more, not {self.samples_per_prompt}"
            )
        if self.min_completion_tokens < 0:
            raise ValueError(
                f"--min-completion-tokens must be 0 or more, not {self.min_completion_tokens}"
            )
        if self.max_len is not None and self.max_len < 1:
            raise ValueError(f"--max-len must be 1 or more, not {self.max_len}")


def _cut(packed: bytes, max_len: int | None) -> tuple[bytes, bool]:
    """``packed`` cut to ``max_len`` ids the way trainers cut (``input_ids[:max_len]``)."""
    if max_len is None or len(packed) <= max_len * ID_BYTES:
        return packed, False
    return packed[: max_len * ID_BYTES], True


def token_row(gen: ExportedGeneration, max_len: int | None = None) -> TokenRow:
    """The row of ``gen``: its prompt ids then its output ids, cut to ``max_len`` positions
    the way trainers cut (``input_ids[:max_len]``, the mask with it)."""
    # Packing is per id: bytes concatenate.
    packed, cut = _cut(gen.prompt_packed + gen.output_packed, max_len)
    return TokenRow(
        id=row_id(gen),
        job_id=gen.job_id,
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
        conversation_id=gen.conversation_id,
        sample=gen.sample,
        variant=gen.variant,
        turn=gen.turn,
    )


def merged_row(
    turns: Sequence[ExportedGeneration], spans: Sequence[Span], max_len: int | None = None
) -> TokenRow:
    """The one row of a prefix-consistent conversation's ``turns`` (0 to ``t``, in order):
    the last turn's prompt + output ids, trained over ``spans`` (each turn's output,
    ``exporter.merge.spans``). Its counts are the turns' sums; its finish reason, server
    and think-end presence the last turn's; ``prompt_len`` the first turn's prompt (the mask
    is 0 before it)."""
    last = turns[-1]
    assert last.conversation_id is not None and last.turn is not None, "a conversation's turns"
    packed, cut = _cut(last.prompt_packed + last.output_packed, max_len)
    return TokenRow(
        id=merged_id(last),
        job_id=last.job_id,
        dataset=last.dataset,
        row_index=last.row_index,
        input_ids=packed,
        prompt_len=len(turns[0].prompt_packed) // ID_BYTES,
        finish_reason=last.finish_type,
        completion_tokens=sum(t.completion_tokens for t in turns),
        cached_tokens=sum(t.cached_tokens for t in turns),
        e2e_latency=sum(t.e2e_latency for t in turns),
        server=last.server,
        think_end_present=last.think_end_present,
        reasoning_tokens=_sum(t.reasoning_tokens for t in turns),
        answer_tokens=_sum(t.answer_tokens for t in turns),
        cut=cut,
        conversation_id=last.conversation_id,
        sample=last.sample,
        variant=last.variant,
        turn=last.turn,
        turns=len(turns),
        spans=tuple(spans),
    )


def _sum(values: Iterable[int | None]) -> int | None:
    """The sum, or None when any is unknown (an answer not read by a family)."""
    total = 0
    for value in values:
        if value is None:
            return None
        total += value
    return total


def removal(
    gen: ExportedGeneration, filters: Filters, valid: Callable[[], bool] | None = None
) -> str | None:
    """The name of the first filter that removes ``gen`` before it is shaped, or None.

    ``valid`` answers whether every invariant held (``core.anatomy.valid``); it is asked only
    under ``--only-valid``, since answering reads the tokenizer.
    """
    if filters.samples_per_prompt is not None and gen.sample >= filters.samples_per_prompt:
        return EXTRA_SAMPLE
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
    return with_loss(token_row(gen, filters.max_len))


def with_loss(row: TokenRow) -> TokenRow | str:
    """``row``, or ``NO_LOSS`` when the cut left it nothing to train on."""
    return NO_LOSS if row.loss_tokens == 0 else row
