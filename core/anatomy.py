"""The anatomy of one generation: reasoning, answer and tool calls, read from its token ids.

A generation is stored as the exact ids the model produced, so its structure is read from the
special tokens the chat template uses (Kimi-style, see ``eaglegen/sim/tools.py``)::

    REASONING </think> ANSWER <|tool_calls_section_begin|>
        <|tool_call_begin|> HEADER <|tool_call_argument_begin|> ARGUMENTS <|tool_call_end|> ...
    <|tool_calls_section_end|> STOP

Pure: ids in, spans out; decoding is the caller's function, so nothing here loads a tokenizer.
The export (conversations, the ``--only-valid`` filter) and ``eaglegen stats`` share it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

THINK_END = "</think>"
SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
# The prefix Kimi-style templates put before a called function's name.
FUNCTION_PREFIX = "functions."


@dataclass(frozen=True, slots=True)
class Markers:
    """Special token ids that structure a generation; None when the tokenizer lacks one."""

    think_end: int | None
    section_begin: int | None
    section_end: int | None
    call_begin: int | None
    argument_begin: int | None
    call_end: int | None
    stops: frozenset[int]


def markers_from_vocab(vocab: Mapping[str, int], stops: Iterable[int] = ()) -> Markers:
    """The markers of a tokenizer, from ``tokenizer.get_vocab()``; ``stops`` as the run stops."""
    return Markers(
        think_end=vocab.get(THINK_END),
        section_begin=vocab.get(SECTION_BEGIN),
        section_end=vocab.get(SECTION_END),
        call_begin=vocab.get(CALL_BEGIN),
        argument_begin=vocab.get(ARGUMENT_BEGIN),
        call_end=vocab.get(CALL_END),
        stops=frozenset(int(i) for i in stops),
    )


@dataclass(frozen=True, slots=True)
class CallSpan:
    """One call's ids: ``header`` between call-begin and argument-begin, then ``arguments``."""

    header: tuple[int, ...]
    arguments: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Anatomy:
    """A generation cut into its parts (see the module docstring)."""

    reasoning: tuple[int, ...] | None  # None when the prompt did not open reasoning
    think_end_present: bool | None  # None when the prompt did not open reasoning
    answer: tuple[int, ...]  # after think-end, outside tool-call sections, stop removed
    calls: tuple[CallSpan, ...]
    sections_balanced: bool  # every section and call opened and closed in order
    stop: int | None  # the trailing stop id, if the output ends with one
    # Ids inside a section but outside any call: no template renders them, so they are kept
    # apart rather than lost, and a round trip can tell they were there.
    stray: tuple[int, ...] = ()


class _Scanner:
    """The state machine over the ids after think-end: outside, in a section, in a call."""

    def __init__(self, markers: Markers) -> None:
        self.m = markers
        self.answer: list[int] = []
        self.stray: list[int] = []
        self.calls: list[CallSpan] = []
        self.balanced = True
        self.in_section = False
        self.header: list[int] | None = None  # the open call's header
        self.arguments: list[int] | None = None  # its arguments, once argument-begin came

    def feed(self, token: int) -> None:
        m = self.m
        if not self.in_section:
            if token == m.section_begin:
                self.in_section = True
                return
            if token in (m.section_end, m.call_begin, m.argument_begin, m.call_end):
                self.balanced = False  # a marker out of place is kept as answer text
            self.answer.append(token)
            return
        if token == m.section_end:
            self._close_call(complete=False)
            self.in_section = False
        elif token == m.call_begin:
            self._close_call(complete=False)
            self.header = []
        elif token == m.argument_begin and self.header is not None and self.arguments is None:
            self.arguments = []
        elif token == m.call_end and self.header is not None:
            self._close_call(complete=self.arguments is not None)
        elif token in (m.section_begin, m.argument_begin, m.call_end):
            self.balanced = False
            self._append(token)
        else:
            self._append(token)

    def _append(self, token: int) -> None:
        if self.arguments is not None:
            self.arguments.append(token)
        elif self.header is not None:
            self.header.append(token)
        else:
            self.stray.append(token)

    def _close_call(self, *, complete: bool) -> None:
        """End the open call, if any; a call not ended by its own markers is unbalanced."""
        if self.header is None:
            return
        self.calls.append(CallSpan(tuple(self.header), tuple(self.arguments or ())))
        self.balanced = self.balanced and complete
        self.header = self.arguments = None

    def finish(self) -> None:
        if self.in_section:
            self._close_call(complete=False)
            self.balanced = False


def dissect(output_ids: Sequence[int], markers: Markers, *, opens_reasoning: bool) -> Anatomy:
    """Cut ``output_ids`` into reasoning, answer and calls; splits at the first think-end."""
    ids = list(output_ids)
    stop = ids[-1] if ids and ids[-1] in markers.stops else None
    body = ids[:-1] if stop is not None else ids
    reasoning: tuple[int, ...] | None = None
    present: bool | None = None
    rest = body
    if opens_reasoning:
        cut = _first(body, markers.think_end)
        present = cut is not None
        # Without a think-end the model never left its reasoning: all of it is reasoning.
        reasoning = tuple(body if cut is None else body[:cut])
        rest = [] if cut is None else body[cut + 1 :]
    scanner = _Scanner(markers)
    for token in rest:
        scanner.feed(token)
    scanner.finish()
    return Anatomy(
        reasoning=reasoning,
        think_end_present=present,
        answer=tuple(scanner.answer),
        calls=tuple(scanner.calls),
        sections_balanced=scanner.balanced,
        stop=stop,
        stray=tuple(scanner.stray),
    )


def _first(ids: Sequence[int], token: int | None) -> int | None:
    if token is None:
        return None
    try:
        return ids.index(token)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call; ``declared`` is None when the prompt declared no tools."""

    name: str
    index: int | None
    arguments: str
    arguments_json: bool
    declared: bool | None


def parse_calls(
    anatomy: Anatomy,
    decode: Callable[[Sequence[int]], str],
    declared: Collection[str] | None,
) -> list[ToolCall]:
    """Decode each call's header (``functions.NAME:INDEX``) and arguments."""
    return [_parse_call(span, decode, declared) for span in anatomy.calls]


def _parse_call(
    span: CallSpan, decode: Callable[[Sequence[int]], str], declared: Collection[str] | None
) -> ToolCall:
    name, index = parse_header(decode(span.header))
    arguments = decode(span.arguments)
    return ToolCall(
        name=name,
        index=index,
        arguments=arguments,
        arguments_json=is_json(arguments),
        declared=None if declared is None else name in declared,
    )


def parse_header(header: str) -> tuple[str, int | None]:
    """``functions.NAME:INDEX`` -> (NAME, INDEX); a header without an index keeps its name."""
    text = header.strip()
    if text.startswith(FUNCTION_PREFIX):
        text = text[len(FUNCTION_PREFIX) :]
    name, sep, tail = text.rpartition(":")
    if sep and tail.isascii() and tail.isdigit():
        return name, int(tail)
    return text, None


def is_json(text: str) -> bool:
    """Whether ``text`` is one JSON document (the arguments of an OpenAI-style call)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def valid(anatomy: Anatomy, calls: Sequence[ToolCall]) -> bool:
    """Every invariant held: think-end where reasoning was opened, sections balanced, JSON args."""
    return (
        anatomy.think_end_present is not False
        and anatomy.sections_balanced
        and all(call.arguments_json for call in calls)
    )
