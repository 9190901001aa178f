"""Which turns of a conversation make one row, and where that row trains. Pure.

An on-policy conversation's turn ``t + 1`` was prompted with the model's own answers so far,
rendered by the run's template. Where the template writes history as it was generated, the
turn's prompt ids start with turn ``t``'s prompt + output ids exactly: the conversation is
*prefix-consistent*, and its last turn's prompt + output holds every earlier turn's prompt
and output in place. It can then be one training row, its loss mask 1 over every turn's
output (each a span of the last turn's prompt) and 0 over everything else (the prompts, the
template's own ids between turns): what every turn's own row trains, in one pass over the
shared prefix. Where it does not (a template that drops earlier reasoning, an answer the
tokenizer encodes back otherwise than the model sampled it), merging would train on ids the
model never generated after those prompts: such a conversation stays one row per turn.

The turns considered are those a filter keeps; a row holds turns 0 to ``k`` only, since a
turn a filter removed in the middle would sit in the row's ids untrained but still
conditioning every later turn.

Ids stay packed (``models.tokens``: 4 bytes each), so the check is a byte comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ID_BYTES = 4

# Why a conversation's turns stay one row per turn (the manifest counts their turns by it).
PREFIX_DIFFERS = "prefix_differs"  # a turn's prompt does not extend the one before it
FILTERED = "filtered"  # a filter removed a turn that a later kept turn follows
NOT_FROM_FIRST = "not_from_first"  # the done turns do not run 0, 1, 2, ... (never expected)
UNMERGED = (PREFIX_DIFFERS, FILTERED, NOT_FROM_FIRST)

Span = tuple[int, int]


@dataclass(frozen=True)
class TurnIds:
    """One turn: its index in the conversation and its packed prompt and output ids."""

    turn: int
    prompt: bytes
    output: bytes


def extends(before: TurnIds, after: TurnIds) -> bool:
    """Whether ``after``'s prompt starts with ``before``'s prompt + output ids exactly: the
    rule of ``core.onpolicy.departure`` (what `stats` reports), on packed ids."""
    n = len(before.prompt)
    return after.prompt.startswith(before.prompt) and after.prompt.startswith(before.output, n)


def first_break(turns: Sequence[TurnIds]) -> int | None:
    """The index (in ``turns``) of the first turn whose prompt does not extend the turn
    before it, or None when every one does."""
    for i in range(1, len(turns)):
        if not extends(turns[i - 1], turns[i]):
            return i
    return None


def spans(turns: Sequence[TurnIds]) -> list[Span]:
    """Where each turn's output lies in the last turn's prompt + output ids (positions,
    end excluded): the row's loss spans. ``turns`` must be prefix-consistent."""
    found = []
    for turn in turns:
        start = len(turn.prompt) // ID_BYTES
        found.append((start, start + len(turn.output) // ID_BYTES))
    return found


def mask(row_spans: Sequence[Span], length: int) -> list[int]:
    """The loss mask of a row of ``length`` ids: 1 inside the spans (cut at ``length``)."""
    out = [0] * length
    for start, end in row_spans:
        for i in range(start, min(end, length)):
            out[i] = 1
    return out


@dataclass(frozen=True)
class Plan:
    """What becomes of a conversation's done turns: one row of ``merged`` (its turns in
    order, from turn 0), or one row per turn of ``apart`` (the kept turns) because of
    ``reason`` (one of :data:`UNMERGED`)."""

    merged: tuple[TurnIds, ...] = ()
    apart: tuple[TurnIds, ...] = ()
    reason: str | None = None


def plan(turns: Sequence[TurnIds], kept: Sequence[bool], *, prefix: bool = True) -> Plan:
    """How to write ``turns`` (the conversation's done turns in order) of which ``kept``
    says which the filters keep. ``prefix``: merging needs prefix consistency (token rows;
    a conversation of messages is templated again by its trainer, so it needs none)."""
    chosen = tuple(t for t, keep in zip(turns, kept, strict=True) if keep)
    if not chosen:
        return Plan()
    if [t.turn for t in chosen] != list(range(len(chosen))):
        from_first = [t.turn for t in turns] == list(range(len(turns)))
        return Plan(apart=chosen, reason=FILTERED if from_first else NOT_FROM_FIRST)
    if prefix and first_break(chosen) is not None:
        return Plan(apart=chosen, reason=PREFIX_DIFFERS)
    return Plan(merged=chosen)
