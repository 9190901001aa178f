"""Generations decoded with the run's tokenizer: conversation rows and the validity filter.

The thin I/O-bound step between the scan and the writers: each generation's ids are
unpacked, cut into their parts by the run's model family (``core.families``, with its
dataset's stored stop ids), decoded, filtered, re-templated for the round trip
(``exporter.roundtrip``) and encoded as one JSON Lines line.

An on-policy conversation is one row: its last turn's stored prompt (the row's messages with
every earlier answer the model's own, decoded from its exact ids by ``core.turns`` when the
turn after it was made, as here) and that turn decoded. Its round trip is the last turn's:
the whole conversation re-templated against that turn's recorded prompt + output ids, so
every earlier answer is checked as the template writes it into the history.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from core.anatomy import valid
from core.turns import Prompt, Turn, decode_turn
from exporter.conversations import conversation, document
from exporter.manifest import Options
from exporter.merge import ID_BYTES, plan
from exporter.roundtrip import Check, RoundTrips, check, failed, turn_end
from exporter.rows import NO_LOSS, NOT_EXACT, merged_id, removal, row_id
from exporter.tokenizer import RunTokenizer
from exporter.whole import Outcome, Written, turn_ids
from exporter.writers import Line, Row
from models.export import ExportedConversation, PromptedGeneration
from models.records import ExportedGeneration
from models.tokens import unpack

# Dataset name -> its stored stop ids (exporter.tokenizer.run_stop_ids).
Stops = Mapping[str, tuple[int, ...]]


class ValidityCheck:
    """``--only-valid`` for token rows: whether every invariant of a generation held."""

    def __init__(self, tokenizer: RunTokenizer, stops: Stops) -> None:
        self._tokenizer = tokenizer
        self._stops = stops

    def __call__(self, item: PromptedGeneration) -> bool:
        read = self._tokenizer.read(
            unpack(item.generation.output_packed),
            self._stops.get(item.generation.dataset, ()),
            opens_reasoning=item.opens_reasoning,
            declared=Prompt.of(item.messages).declared(),
        )
        return valid(read.anatomy, read.calls)


class ConversationShaper:
    """``--format conversations``: one generation in, its line (or its removal) out."""

    def __init__(
        self, options: Options, tokenizer: RunTokenizer, trips: RoundTrips, stops: Stops
    ) -> None:
        assert options.style is not None, "conversations have a style"
        self._options = options
        self._style = options.style
        self._tokenizer = tokenizer
        self._trips = trips
        self._stops = stops
        # What the run's template writes after a final assistant turn: probed once.
        self._turn_end = turn_end(tokenizer)

    def __call__(self, item: PromptedGeneration) -> tuple[ExportedGeneration, Row | str]:
        gen = item.generation
        turn = self._decode(item)
        removed = removal(gen, self._options.filters, lambda: turn.valid)
        if removed is not None:
            return gen, removed
        return gen, self._row(item, turn, row_id(gen), len(gen.prompt_packed) // ID_BYTES)

    def conversation(self, whole: ExportedConversation) -> Outcome:
        """A conversation in a final state: one row of its turns from the first, or one row
        per turn where a filter removed a turn that a kept one follows."""
        filters = self._options.filters
        turns = [self._decode(item) for item in whole.turns]
        removed = [
            removal(item.generation, filters, _validity(turn))
            for item, turn in zip(whole.turns, turns, strict=True)
        ]
        decided = plan(turn_ids(whole), [r is None for r in removed], prefix=False)
        outcome = Outcome(decided, removed=[(r, 1) for r in removed if r is not None])
        index = {item.generation.turn: i for i, item in enumerate(whole.turns)}
        if decided.merged:
            kept = [index[t.turn] for t in decided.merged]
            items = [whole.turns[i] for i in kept]
            gen = items[-1].generation
            assert gen.turn is not None
            extra = _conversation_metadata(whole, items, [turns[i] for i in kept])
            first_prompt = len(items[0].generation.prompt_packed) // ID_BYTES
            name = merged_id(gen)
            row = self._row(items[-1], turns[kept[-1]], name, first_prompt, extra)
            self._written(outcome, gen, row, len(kept))
        for apart in decided.apart:
            i = index[apart.turn]
            gen = whole.turns[i].generation
            prompt_len = len(gen.prompt_packed) // ID_BYTES
            self._written(
                outcome, gen, self._row(whole.turns[i], turns[i], row_id(gen), prompt_len), 1
            )
        return outcome

    def _written(
        self, outcome: Outcome, gen: ExportedGeneration, row: Row | str, turns: int
    ) -> None:
        if isinstance(row, str):
            outcome.removed.append((row, turns))
            return
        length = (len(gen.prompt_packed) + len(gen.output_packed)) // ID_BYTES
        max_len = self._options.filters.max_len
        outcome.rows.append(Written(row, turns, max_len is not None and length > max_len, length))

    def _decode(self, item: PromptedGeneration) -> Turn:
        """The assistant turn of ``item``, read from its exact output ids."""
        gen = item.generation
        tok = self._tokenizer
        _, turn = decode_turn(
            unpack(gen.output_packed),
            tok.markers(self._stops.get(gen.dataset, ())),
            tok.decode,
            opens_reasoning=item.opens_reasoning,
            declared=Prompt.of(item.messages).declared(),
            family=tok.family,
        )
        return turn

    def _row(
        self,
        item: PromptedGeneration,
        turn: Turn,
        name: str,
        trained_from: int,
        extra: dict[str, Any] | None = None,
    ) -> Row | str:
        """The line ``name`` of ``item``'s prompt and ``turn``, round-tripped, or the filter
        that removes it; ``trained_from``: where a trainer's loss begins (``--max-len``)."""
        gen = item.generation
        filters = self._options.filters
        if filters.max_len is not None and trained_from >= filters.max_len:
            return NO_LOSS  # a trainer's cut would leave only prompt
        prompt = Prompt.of(item.messages)
        prompt_ids, output = unpack(gen.prompt_packed), unpack(gen.output_packed)
        stops = self._stops.get(gen.dataset, ())
        result = self._round_trip(prompt, turn, prompt_ids + output, len(prompt_ids), stops)
        self._trips.add(gen.dataset, gen.job_id, result)
        if filters.require_exact and not result.exact:
            return NOT_EXACT
        metadata = _metadata(gen, len(prompt_ids), turn, result) | (extra or {})
        return Line(json_line(document(self._style, name, prompt, turn, metadata)))

    def _round_trip(
        self,
        prompt: Prompt,
        turn: Turn,
        recorded: list[int],
        prompt_len: int,
        stops: Sequence[int],
    ) -> Check:
        tok = self._tokenizer
        try:
            text = tok.render(conversation(prompt, turn), prompt.tools)
        except Exception as exc:  # jinja raises many types; any of them fails the round trip
            return failed(exc)
        return check(
            recorded,
            prompt_len,
            text,
            tok.encode,
            tok.decode,
            end_of_turn=self._turn_end,
            stops=frozenset(stops),
        )


def _validity(turn: Turn) -> Callable[[], bool]:
    """``--only-valid``'s question about ``turn``, answered when asked."""
    return lambda: turn.valid


def json_line(document: dict[str, Any]) -> bytes:
    """``document`` as one JSON Lines line, every value kept exactly.

    orjson (a tenth of json's CPU) refuses integers beyond 64 bits, which JSON allows and the
    job stores as written: such a row, or one holding another value orjson refuses, is
    written by json instead (the same JSON; a lone surrogate comes out as its escape).
    """
    try:
        return orjson.dumps(document, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        pass
    text = json.dumps(document, ensure_ascii=False, separators=(",", ":")) + "\n"
    try:
        return text.encode()
    except UnicodeEncodeError:  # a lone surrogate: no UTF-8 for it, but an escape
        return (json.dumps(document, separators=(",", ":")) + "\n").encode()


def _metadata(
    gen: ExportedGeneration, prompt_len: int, turn: Turn, result: Check
) -> dict[str, Any]:
    return {
        "dataset": gen.dataset,
        "row_index": gen.row_index,
        "job_id": gen.job_id,
        "sample": gen.sample,
        "variant": gen.variant,
        "finish_reason": gen.finish_type,
        "prompt_len": prompt_len,
        "completion_tokens": gen.completion_tokens,
        "think_end_present": gen.think_end_present,
        # A family whose calls are not read says so, never "0 calls".
        "tool_calls": len(turn.calls) if turn.calls_checked else "not checked",
        "valid": turn.valid,
        "roundtrip_exact": result.exact,
        "roundtrip_position": result.position,
    }


def _conversation_metadata(
    whole: ExportedConversation, items: Sequence[PromptedGeneration], decoded: Sequence[Turn]
) -> dict[str, Any]:
    """What a conversation's row adds to its last turn's metadata: its turns, their jobs,
    sums over them, and how the conversation ended."""
    return {
        "conversation_id": whole.id,
        "turns": len(items),
        "job_ids": [item.generation.job_id for item in items],
        "conversation_completion_tokens": sum(i.generation.completion_tokens for i in items),
        "conversation_tool_calls": (
            sum(len(t.calls) for t in decoded)
            if all(t.calls_checked for t in decoded)
            else "not checked"
        ),
        "conversation_valid": all(t.valid for t in decoded),
        "conversation_state": whole.state,
        "ended_reason": whole.ended_reason,
    }
