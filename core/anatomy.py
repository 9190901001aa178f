"""The anatomy of one generation: reasoning, answer, tool calls and stop, read from its token ids.

A generation is stored as the exact ids the model produced, so its structure is read from the
special tokens of its model family (``core.families`` gives each family's ``Markers``). Every
family goes through the same types, cut by one of two layouts:

- **token sections** (Kimi-K2, DeepSeek V3/V3.1/R1, Qwen3/Hermes, GLM-4.5)::

      REASONING </think> ANSWER [SECTION_BEGIN]
          CALL_BEGIN HEADER [ARGUMENT_BEGIN] ARGUMENTS CALL_END ...
      [SECTION_END] STOP

  A family without section tokens (Qwen3, GLM) has each run of calls as a section of its
  own; one without an argument marker (Qwen3, GLM) has the whole call body as arguments.
- **harmony messages** (gpt-oss)::

      HEADER <|message|> BODY <|end|> <|start|> HEADER <|message|> BODY ... STOP

  The header's channel tells reasoning (``analysis``) from answer (``final``), and a
  recipient (``to=functions.NAME``) tells a call.

Reasoning opens where the prompt opened it (``opens_reasoning``), or where the model opens it
with the think-start token before anything but white space (Qwen3 hybrid, GLM-4.5 write it
themselves), and ends at the first think-end. A family of unknown call syntax (``syntax`` "")
reads reasoning and answer only, and says its calls were not checked.

Pure: ids in, spans out; decoding is the caller's function (``parse_calls`` decodes each call
with it, special tokens kept, and reads the text with ``core.calls``), so nothing here loads a
tokenizer. The export (conversations, the ``--only-valid`` filter) and ``eaglegen stats``
share it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from core.calls import FUNCTION_PREFIX, KIMI_K2, READERS, is_json, parse_header

THINK_START = "<think>"
THINK_END = "</think>"
SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

__all__ = [
    "ARGUMENT_BEGIN",
    "CALL_BEGIN",
    "CALL_END",
    "FUNCTION_PREFIX",
    "SECTION_BEGIN",
    "SECTION_END",
    "THINK_END",
    "THINK_START",
    "Anatomy",
    "CallSpan",
    "Channels",
    "Decode",
    "Markers",
    "ToolCall",
    "dissect",
    "is_json",
    "markers_from_vocab",
    "parse_calls",
    "parse_header",
    "valid",
]

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True, slots=True)
class Channels:
    """Harmony's message tokens (gpt-oss); None where the vocabulary lacks one."""

    start: int | None
    channel: int | None
    message: int | None
    end: int | None
    call: int | None
    ret: int | None  # <|return|>
    constrain: int | None

    @property
    def terminators(self) -> frozenset[int]:
        """The ids that end a message."""
        return frozenset(i for i in (self.end, self.call, self.ret) if i is not None)


@dataclass(frozen=True, slots=True)
class Markers:
    """Special token ids that structure a generation; None when the tokenizer lacks one.

    ``syntax`` names how a call's text reads (``core.calls.READERS``); "" when the family's
    calls cannot be read, so they are not checked. ``pieces`` is each id's vocabulary string:
    enough to tell white space and a harmony header's channel without decoding."""

    think_end: int | None
    section_begin: int | None
    section_end: int | None
    call_begin: int | None
    argument_begin: int | None
    call_end: int | None
    stops: frozenset[int]
    syntax: str = KIMI_K2
    think_start: int | None = None  # None: only the prompt opens reasoning
    channels: Channels | None = None  # set: the output is harmony messages
    pieces: Mapping[int, str] = field(default_factory=dict, repr=False, compare=False)

    @property
    def calls_checked(self) -> bool:
        """Whether the family's calls can be read (False: "not checked", never "none")."""
        return self.syntax in READERS

    @property
    def call_ids(self) -> frozenset[int]:
        """Ids whose presence shows that a generation may hold a call (to select the
        generations worth dissecting)."""
        ids = [self.section_begin, self.section_end, self.call_begin, self.call_end]
        if self.channels is not None:
            ids += [self.channels.call, self.channels.constrain]
        return frozenset(i for i in ids if i is not None) if self.calls_checked else frozenset()


def markers_from_vocab(vocab: Mapping[str, int], stops: Iterable[int] = ()) -> Markers:
    """Kimi-K2's markers of a tokenizer, from ``tokenizer.get_vocab()``; ``stops`` as the run
    stops. Kept for the callers that predate the registry: ``core.families.family_for(...)
    .markers(vocab, stops)`` gives any family's."""
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
    """One call's ids: ``header`` before the argument marker (Kimi's ``functions.NAME:INDEX``,
    DeepSeek's type or name, harmony's message header; empty when the family has no marker),
    then ``arguments``, the rest of the call body."""

    header: tuple[int, ...]
    arguments: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Anatomy:
    """A generation cut into its parts (see the module docstring)."""

    reasoning: tuple[int, ...] | None  # None when reasoning was not opened
    think_end_present: bool | None  # None when reasoning was not opened
    answer: tuple[int, ...]  # after think-end, outside tool calls, stop removed
    calls: tuple[CallSpan, ...]
    sections_balanced: bool  # every section, call and message opened and closed in order
    stop: int | None  # the trailing stop id, if the output ends with one
    # Ids inside a section but outside any call: no template renders them, so they are kept
    # apart rather than lost, and a round trip can tell they were there.
    stray: tuple[int, ...] = ()
    syntax: str = KIMI_K2  # how its calls read (core.calls); "" when they were not checked

    @property
    def calls_checked(self) -> bool:
        """False when the family's calls cannot be read: its calls are "not checked", and
        an empty ``calls`` then says nothing."""
        return self.syntax in READERS


def dissect(output_ids: Sequence[int], markers: Markers, *, opens_reasoning: bool) -> Anatomy:
    """Cut ``output_ids`` into reasoning, answer, calls and stop (see the module docstring);
    ``opens_reasoning``: the prompt opened a reasoning block (harmony ignores it)."""
    ids = list(output_ids)
    stop = ids[-1] if ids and ids[-1] in markers.stops else None
    body = ids[:-1] if stop is not None else ids
    if markers.channels is not None and markers.calls_checked:
        return _harmony(body, markers, stop)
    reasoning, present, rest = _split_reasoning(body, markers, opens_reasoning)
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
        syntax=markers.syntax,
    )


def _split_reasoning(
    body: list[int], markers: Markers, opens_reasoning: bool
) -> tuple[tuple[int, ...] | None, bool | None, list[int]]:
    """(reasoning, think-end present, the rest); splits at the first think-end."""
    start = 0 if opens_reasoning else _opened_by_model(body, markers)
    if start is None:
        return None, None, body
    inner = body[start:]
    cut = _first(inner, markers.think_end)
    if cut is None:  # the model never left its reasoning: all of it is reasoning
        return tuple(inner), False, []
    return tuple(inner[:cut]), True, inner[cut + 1 :]


def _opened_by_model(body: Sequence[int], markers: Markers) -> int | None:
    """Where the reasoning starts when the output opens it itself: after a think-start that
    only white space precedes."""
    if markers.think_start is None:
        return None
    for i, token in enumerate(body):
        if token == markers.think_start:
            return i + 1
        if not blank_piece(markers.pieces.get(token)):
            return None
    return None


# How byte-level BPE (GPT-2 style) and SentencePiece vocabularies spell white space.
_SPACES = str.maketrans(
    {"\u0120": " ", "\u010a": "\n", "\u0109": "\t", "\u010d": "\r", "\u2581": " "}
)
_BYTE_SPACES = frozenset({"<0x09>", "<0x0A>", "<0x0D>", "<0x20>"})


def blank_piece(piece: str | None) -> bool:
    """Whether a vocabulary string spells white space only (in any of the spellings above)."""
    if not piece:
        return False
    return piece in _BYTE_SPACES or not piece.translate(_SPACES).strip()


def _spell(ids: Iterable[int], pieces: Mapping[int, str]) -> str:
    """The ids' vocabulary strings, white space as white space (ASCII survives as itself)."""
    return "".join(pieces.get(i, "") for i in ids).translate(_SPACES)


def _first(ids: Sequence[int], token: int | None) -> int | None:
    if token is None:
        return None
    try:
        return ids.index(token)
    except ValueError:
        return None


class _Scanner:
    """The state machine over the ids after reasoning: outside, in a section, in a call.

    Without section tokens a call opens a section of its own, which lasts while calls
    follow: the ids between two calls are stray, those after the last are answer."""

    def __init__(self, markers: Markers) -> None:
        self.m = markers
        self.answer: list[int] = []
        self.stray: list[int] = []
        self.calls: list[CallSpan] = []
        self.balanced = True
        self.in_section = False
        self.implicit = markers.section_begin is None
        self.between: list[int] = []  # implicit sections: the ids after the last call
        self.header: list[int] | None = None  # the open call's header
        self.arguments: list[int] | None = None  # its arguments, once argument-begin came

    def feed(self, token: int) -> None:
        if not self.in_section:
            self._outside(token)
        elif self.implicit and self.header is None:
            self._between(token)
        else:
            self._inside(token)

    def _outside(self, token: int) -> None:
        m = self.m
        if token == m.section_begin:
            self.in_section = True
            return
        if self.implicit and token == m.call_begin:
            self.in_section = True
            self._open_call()
            return
        if token in (m.section_end, m.call_begin, m.argument_begin, m.call_end):
            self.balanced = False  # a marker out of place is kept as answer text
        self.answer.append(token)

    def _between(self, token: int) -> None:
        if token == self.m.call_begin:
            self.stray += self.between
            self.between = []
            self._open_call()
        elif token in (self.m.argument_begin, self.m.call_end):
            self._leave_implicit()
            self._outside(token)
        else:
            self.between.append(token)

    def _inside(self, token: int) -> None:
        m = self.m
        if token == m.section_end:
            self._close_call(complete=False)
            self.in_section = False
        elif token == m.call_begin:
            self._close_call(complete=False)
            self._open_call()
        elif token == m.argument_begin and self.header is not None and self.arguments is None:
            self.arguments = []
        elif token == m.call_end and self.header is not None:
            self._close_call(complete=self.arguments is not None)
        elif token in (m.section_begin, m.argument_begin, m.call_end):
            self.balanced = False
            self._append(token)
        else:
            self._append(token)

    def _open_call(self) -> None:
        self.header = []
        # Without an argument marker the whole call body is its arguments.
        self.arguments = [] if self.m.argument_begin is None else None

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

    def _leave_implicit(self) -> None:
        self.answer += self.between
        self.between = []
        self.in_section = False

    def finish(self) -> None:
        if not self.in_section:
            return
        self._close_call(complete=False)  # a call still open was cut
        if self.implicit:
            self._leave_implicit()
        else:
            self.in_section = False
            self.balanced = False


@dataclass
class _Message:
    """One harmony message: its header ids, its body once ``<|message|>`` came."""

    header: list[int] = field(default_factory=list)
    body: list[int] | None = None
    ended: bool = False  # by its own end token, or by the run's stop


class _Messages:
    """The state machine over harmony's messages; the output continues the prompt's
    ``<|start|>assistant``, so it begins inside a header."""

    def __init__(self, channels: Channels) -> None:
        self.ch = channels
        self.open: _Message | None = _Message()
        self.done: list[_Message] = []
        self.stray: list[int] = []
        self.balanced = True

    def feed(self, token: int) -> None:
        ch, msg = self.ch, self.open
        if token == ch.start:
            if msg is not None and (msg.header or msg.body is not None):
                self.balanced = False  # a message left without its end token
                self._close()
            self.open = _Message()
        elif msg is None:
            self.stray.append(token)
        elif token in ch.terminators:
            self.balanced = self.balanced and msg.body is not None
            msg.ended = True
            self._close()
        elif token == ch.message and msg.body is None:
            msg.body = []
        elif msg.body is None:
            msg.header.append(token)
        else:
            msg.body.append(token)

    def _close(self) -> None:
        if self.open is not None:
            self.done.append(self.open)
        self.open = None

    def finish(self, *, stopped: bool) -> list[_Message]:
        """The messages; the last, still open, was ended by the run's stop if there was one."""
        if self.open is not None:
            self.open.ended = stopped and self.open.body is not None
            self._close()
        return self.done


_CHANNEL_NAME = re.compile(r"\s*([A-Za-z_]+)")


def _harmony(body: list[int], markers: Markers, stop: int | None) -> Anatomy:
    assert markers.channels is not None
    reader = _Messages(markers.channels)
    for token in body:
        reader.feed(token)
    reasoning: list[int] = []
    answer: list[int] = []
    calls: list[CallSpan] = []
    analysis: list[bool] = []  # whether each analysis message was ended
    balanced = reader.balanced
    for msg in reader.finish(stopped=stop is not None):
        channel, recipient = _header(msg.header, markers)
        content = msg.body or []
        if recipient:
            calls.append(CallSpan(tuple(msg.header), tuple(content)))
            balanced = balanced and msg.ended
        elif channel == "analysis":
            reasoning += content
            analysis.append(msg.ended)
        else:
            answer += content
    return Anatomy(
        reasoning=tuple(reasoning) if analysis else None,
        think_end_present=all(analysis) if analysis else None,
        answer=tuple(answer),
        calls=tuple(calls),
        sections_balanced=balanced,
        stop=stop,
        stray=tuple(reader.stray),
        syntax=markers.syntax,
    )


def _header(header: Sequence[int], markers: Markers) -> tuple[str, bool]:
    """(the channel's name, whether the message has a recipient), from the vocabulary."""
    assert markers.channels is not None
    text = _spell(header, markers.pieces)
    cut = _first(header, markers.channels.channel)
    found = None if cut is None else _CHANNEL_NAME.match(_spell(header[cut + 1 :], markers.pieces))
    return ("" if found is None else found.group(1)), "to=" in text


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call; ``declared`` is None when the prompt declared no tools."""

    name: str
    index: int | None
    arguments: str
    arguments_json: bool
    declared: bool | None


def parse_calls(
    anatomy: Anatomy, decode: Decode, declared: Collection[str] | None
) -> list[ToolCall]:
    """Decode each call's header and arguments and read them in the family's syntax; empty
    when the calls were not checked (``anatomy.calls_checked``)."""
    reader = READERS.get(anatomy.syntax)
    if reader is None:
        return []
    calls = []
    for span in anatomy.calls:
        read = reader(decode(span.header), decode(span.arguments))
        calls.append(
            ToolCall(
                name=read.name,
                index=read.index,
                arguments=read.arguments,
                arguments_json=read.arguments_json,
                declared=None if declared is None else read.name in declared,
            )
        )
    return calls


def valid(anatomy: Anatomy, calls: Sequence[ToolCall]) -> bool:
    """Every invariant held: think-end where reasoning was opened, sections balanced, JSON args.
    A family whose calls are not checked is judged on its reasoning alone."""
    return (
        anatomy.think_end_present is not False
        and anatomy.sections_balanced
        and all(call.arguments_json for call in calls)
    )
