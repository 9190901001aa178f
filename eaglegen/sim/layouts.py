"""Each family's output laid out in ids: reasoning, answer, tool calls and stop.

`SectionLayout` writes the families whose calls sit between tokens (Kimi-K2, Qwen3/Hermes,
DeepSeek V3/R1 and V3.1, GLM-4.5) and a tokenizer of no known family (no calls);
`HarmonyLayout` writes gpt-oss's harmony messages. Both are built by `layout_for` from
`core.families`' token strings, so that `Family.dissect` and `Family.parse_calls` read back
what the simulator wrote. Pure: ids in, ids out (the text pieces are encoded when built).

Reasoning follows the prompt: a prompt whose last token but white space is think-start
opened the block (reasoning, think-end, answer); one ending with think-end closed it (answer
only); any other leaves it to the model, which opens it itself (`<think>\\n`, as Qwen3 hybrid
and GLM-4.5 do). Kimi-K2 keeps the simulator's first shape, reasoning then think-end whatever
the prompt (its bundled template opens the block in every generation prompt).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from core.anatomy import blank_piece
from core.families import KIMI_K2, Family
from eaglegen.sim.engine import Frame, ToolCallTokens
from eaglegen.sim.tools import CallFormat

Encode = Callable[[str], list[int]]


def blank_ids(vocab: Mapping[str, int]) -> frozenset[int]:
    """The ids whose vocabulary string is white space only."""
    return frozenset(i for piece, i in vocab.items() if blank_piece(piece))


class Opened(Enum):
    """Where a prompt left the reasoning block."""

    OPEN = "open"  # the template opened it: the output starts inside
    CLOSED = "closed"  # the template closed it (thinking off): no reasoning
    MODEL = "model"  # neither: the model opens it itself


@dataclass(frozen=True)
class Reasoning:
    """A family's think pair and how its outputs open the block."""

    start: int
    end: int
    opening: tuple[int, ...]  # what the model writes to open the block itself
    blank: frozenset[int]  # white-space ids, skipped when reading the prompt's end
    follow_prompt: bool = True  # False: always reasoning, as if the prompt opened it

    def opened(self, input_ids: Sequence[int]) -> Opened:
        """Where the prompt left the block (by its last id that is not white space)."""
        for token in reversed(input_ids):
            if token not in self.blank:
                if token == self.start:
                    return Opened.OPEN
                return Opened.CLOSED if token == self.end else Opened.MODEL
        return Opened.MODEL

    def around(self, input_ids: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """(opening, close) of the reasoning text; close None: the output has no reasoning."""
        opened = self.opened(input_ids) if self.follow_prompt else Opened.OPEN
        if opened is Opened.CLOSED:
            return (), None
        return (self.opening if opened is Opened.MODEL else ()), (self.end,)


@dataclass(frozen=True)
class CallIds:
    """A family's call tokens: section pair (when it has one), call pair, argument marker
    (when it has one) and the encoded text before the first call and between two."""

    section: tuple[int, int] | None
    call: tuple[int, int]
    argument: int | None
    lead: tuple[int, ...]
    between: tuple[int, ...]

    def section_ids(self, calls: Sequence[ToolCallTokens]) -> tuple[int, ...]:
        """The calls as the family's template writes an assistant's tool_calls."""
        out = list(self.lead)
        if self.section is not None:
            out.append(self.section[0])
        for n, call in enumerate(calls):
            out += [*(self.between if n else ()), self.call[0], *call.head]
            out += [*(() if self.argument is None else (self.argument,)), *call.arguments]
            out.append(self.call[1])
        if self.section is not None:
            out.append(self.section[1])
        return tuple(out)

    def ids(self) -> frozenset[int]:
        """Its token ids."""
        marks = (*(self.section or ()), *self.call, self.argument)
        return frozenset(i for i in marks if i is not None)


@dataclass(frozen=True)
class SectionLayout:
    """A family writing reasoning between a think pair and calls between tokens (an engine
    Layout); without `calls` it writes none, without `reasoning` no reasoning."""

    vocab_size: int
    ordinary_ids: range
    stops: tuple[int, ...]  # what ends a generation, the family's own first
    stop: int | None  # what ends a turn
    call_stop: int | None  # what ends a turn that calls tools (GLM-4.5: <|observation|>)
    reasoning: Reasoning | None
    calls: CallIds | None
    marks: frozenset[int] = frozenset()  # the family's other structure ids

    def ordinary(self) -> Sequence[int]:
        """The ids of plain text."""
        return self.ordinary_ids

    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a generation by themselves."""
        return self.stops

    def special_ids(self) -> frozenset[int]:
        """Think pair, call tokens, stops and the family's other structure ids."""
        pair = () if self.reasoning is None else (self.reasoning.start, self.reasoning.end)
        calls = frozenset() if self.calls is None else self.calls.ids()
        return frozenset({*pair, *self.stops}) | calls | self.marks

    def frame(self, input_ids: Sequence[int], calls: Sequence[ToolCallTokens]) -> Frame:
        """Reasoning as the prompt left it, then the calls' section and the turn's stop."""
        opening: tuple[int, ...] = ()
        close: tuple[int, ...] | None = None
        if self.reasoning is not None:
            opening, close = self.reasoning.around(input_ids)
        written = calls if self.calls is not None else ()
        section = self.calls.section_ids(written) if self.calls is not None and written else ()
        stop = self.call_stop if section else self.stop
        broken = bool(section) and any(call.broken for call in written)
        return Frame(opening, close, section, stop, broken)


@dataclass(frozen=True)
class HarmonyLayout:
    """gpt-oss's harmony messages (an engine Layout): the output continues the prompt's
    `<|start|>assistant` with an analysis message (the reasoning), then the answer as a final
    message ended by `<|return|>`, or as a commentary preamble followed by one call's message
    ended by `<|call|>` (harmony ends the turn at its call)."""

    vocab_size: int
    ordinary_ids: range
    stops: tuple[int, ...]
    analysis: tuple[int, ...]  # <|channel|>analysis<|message|>
    final: tuple[int, ...]  # <|end|><|start|>assistant<|channel|>final<|message|>
    preamble: tuple[int, ...]  # <|end|><|start|>assistant<|channel|>commentary<|message|>
    end: int
    start: int
    message: int
    ret: int
    call: int
    marks: frozenset[int]

    def ordinary(self) -> Sequence[int]:
        """The ids of plain text."""
        return self.ordinary_ids

    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a generation by themselves."""
        return self.stops

    def special_ids(self) -> frozenset[int]:
        """Harmony's message tokens."""
        return self.marks

    def frame(self, input_ids: Sequence[int], calls: Sequence[ToolCallTokens]) -> Frame:
        """Analysis, then the final answer, or a preamble and the first call."""
        if not calls:
            return Frame(self.analysis, self.final, (), self.ret)
        call = calls[0]
        section = (self.end, self.start, *call.head, self.message, *call.arguments)
        return Frame(self.analysis, self.preamble, section, self.call, call.broken)


@dataclass(frozen=True)
class Spelling:
    """What a layout is built from: a vocabulary and its tokenizer's encoder."""

    vocab: Mapping[str, int]
    encode: Encode
    size: int
    ordinary: range
    stops: tuple[int, ...]  # the family's stop ids, then the tokenizer's eos ids
    natural_stop: int | None  # what ends a turn of the family (else the first eos)


def layout_for(
    family: Family, spelling: Spelling, call_format: CallFormat | None
) -> SectionLayout | HarmonyLayout:
    """The family's layout in this vocabulary; `call_format` None writes no calls."""
    if family.channels is not None and call_format is not None:
        return _harmony(family, spelling)
    vocab = spelling.vocab
    reasoning = _reasoning(family, spelling)
    calls = None if call_format is None else _call_ids(family, spelling, call_format)
    turn_end = None if call_format is None else call_format.turn_end
    return SectionLayout(
        vocab_size=spelling.size,
        ordinary_ids=spelling.ordinary,
        stops=spelling.stops,
        stop=spelling.natural_stop,
        call_stop=vocab.get(turn_end, spelling.natural_stop) if turn_end else spelling.natural_stop,
        reasoning=reasoning,
        calls=calls,
        marks=frozenset(vocab[t] for t in family.tokens() if t in vocab),
    )


def _reasoning(family: Family, spelling: Spelling) -> Reasoning | None:
    if family.think is None or any(t not in spelling.vocab for t in family.think):
        return None
    start, end = (spelling.vocab[t] for t in family.think)
    return Reasoning(
        start=start,
        end=end,
        opening=(start, *spelling.encode("\n")),
        blank=blank_ids(spelling.vocab),
        follow_prompt=family is not KIMI_K2,
    )


def _call_ids(family: Family, spelling: Spelling, call_format: CallFormat) -> CallIds | None:
    vocab = spelling.vocab
    if family.call is None or any(t not in vocab for t in family.structure()):
        return None
    section = family.section
    return CallIds(
        section=None if section is None else (vocab[section[0]], vocab[section[1]]),
        call=(vocab[family.call[0]], vocab[family.call[1]]),
        argument=None if family.argument is None else vocab[family.argument],
        lead=tuple(spelling.encode(call_format.lead)),
        between=tuple(spelling.encode(call_format.between)),
    )


def _harmony(family: Family, spelling: Spelling) -> HarmonyLayout:
    assert family.channels is not None
    start, channel, message, end, call, ret, _ = (spelling.vocab[t] for t in family.channels)
    encode = spelling.encode
    return HarmonyLayout(
        vocab_size=spelling.size,
        ordinary_ids=spelling.ordinary,
        stops=spelling.stops,
        analysis=(channel, *encode("analysis"), message),
        final=(end, start, *encode("assistant"), channel, *encode("final"), message),
        preamble=(end, start, *encode("assistant"), channel, *encode("commentary"), message),
        end=end,
        start=start,
        message=message,
        ret=ret,
        call=call,
        marks=frozenset(spelling.vocab[t] for t in family.tokens() if t in spelling.vocab),
    )
