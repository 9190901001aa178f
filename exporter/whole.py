"""A conversation read whole, in its final state, as rows: merged token rows
(``--merge-turns``), or its conversation row (``--format conversations``, in
``exporter.shaping``).

Each done turn is judged by the filters first (truncated, too short, invalid: a removed turn
is counted as any generation is); ``exporter.merge.plan`` then says whether the kept turns
make one row or stay one row per turn, and why. Only the conversation's done turns exist
here: one that ended early (a failed or skipped turn, a cut answer, a diverging tool call)
brings the turns it has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from exporter.merge import Plan, TurnIds, plan, spans
from exporter.rows import NO_LOSS, Filters, merged_row, removal, token_row, with_loss
from exporter.writers import Row
from models.export import ExportedConversation, PromptedGeneration


@dataclass(frozen=True)
class Written:
    """A row made of ``turns`` generations, ``length`` ids long (``cut`` to --max-len)."""

    row: Row
    turns: int
    cut: bool
    length: int


@dataclass
class Outcome:
    """What became of one conversation: its rows, the turns removed (reason, how many),
    and the plan that decided between one row and one row per turn."""

    plan: Plan
    rows: list[Written] = field(default_factory=list)
    removed: list[tuple[str, int]] = field(default_factory=list)


def turn_ids(conversation: ExportedConversation) -> list[TurnIds]:
    """Each turn's index and packed ids, as ``exporter.merge`` takes them."""
    out = []
    for item in conversation.turns:
        gen = item.generation
        assert gen.turn is not None, "a conversation's turn has its index"
        out.append(TurnIds(gen.turn, gen.prompt_packed, gen.output_packed))
    return out


class MergedTokens:
    """``--merge-turns``: a conversation in, its merged row or its turns' rows out.
    ``valid``: ``--only-valid``'s check of one turn (None when it is off)."""

    def __init__(
        self, filters: Filters, valid: Callable[[PromptedGeneration], bool] | None = None
    ) -> None:
        self._filters = filters
        self._valid = valid

    def __call__(self, conversation: ExportedConversation) -> Outcome:
        filters, valid = self._filters, self._valid
        removed = [
            removal(item.generation, filters, None if valid is None else _asking(valid, item))
            for item in conversation.turns
        ]
        decided = plan(turn_ids(conversation), [r is None for r in removed])
        outcome = Outcome(decided, removed=[(r, 1) for r in removed if r is not None])
        by_turn = {item.generation.turn: item.generation for item in conversation.turns}
        if decided.merged:
            gens = [by_turn[t.turn] for t in decided.merged]
            row = merged_row(gens, spans(decided.merged), filters.max_len)
            if row.loss_tokens == 0:
                outcome.removed.append((NO_LOSS, len(gens)))
            else:
                outcome.rows.append(Written(row, len(gens), row.cut, row.seq_len))
        for turn in decided.apart:
            kept = with_loss(token_row(by_turn[turn.turn], filters.max_len))
            if isinstance(kept, str):
                outcome.removed.append((kept, 1))
            else:
                outcome.rows.append(Written(kept, 1, kept.cut, kept.seq_len))
        return outcome


def _asking(
    valid: Callable[[PromptedGeneration], bool], item: PromptedGeneration
) -> Callable[[], bool]:
    return lambda: valid(item)
