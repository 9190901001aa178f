"""Generations decoded with the run's tokenizer: conversation rows and the validity filter.

The thin I/O-bound step between the scan and the writers: each generation's ids are
unpacked, cut into their parts by the run's model family (``core.families``, with its
dataset's stored stop ids), decoded, filtered, re-templated for the round trip
(``exporter.roundtrip``) and encoded as one JSON Lines line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from core.anatomy import valid
from core.turns import Prompt, Turn, decode_turn
from exporter.conversations import conversation, document
from exporter.manifest import Options
from exporter.roundtrip import Check, RoundTrips, check, failed, turn_end
from exporter.rows import NO_LOSS, NOT_EXACT, removal
from exporter.tokenizer import RunTokenizer
from exporter.writers import Line, Row
from models.export import PromptedGeneration
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
        filters = self._options.filters
        prompt = Prompt.of(item.messages)
        output = unpack(gen.output_packed)
        tok = self._tokenizer
        _, turn = decode_turn(
            output,
            tok.markers(self._stops.get(gen.dataset, ())),
            tok.decode,
            opens_reasoning=item.opens_reasoning,
            declared=prompt.declared(),
            family=tok.family,
        )
        removed = removal(gen, filters, lambda: turn.valid)
        if removed is not None:
            return gen, removed
        prompt_ids = unpack(gen.prompt_packed)
        if filters.max_len is not None and len(prompt_ids) >= filters.max_len:
            return gen, NO_LOSS  # a trainer's cut would leave only prompt
        stops = self._stops.get(gen.dataset, ())
        result = self._round_trip(prompt, turn, prompt_ids + output, len(prompt_ids), stops)
        self._trips.add(gen.dataset, gen.job_id, result)
        if filters.require_exact and not result.exact:
            return gen, NOT_EXACT
        metadata = _metadata(gen, len(prompt_ids), turn, result)
        doc = document(self._style, str(gen.job_id), prompt, turn, metadata)
        return gen, Line(json_line(doc))

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
