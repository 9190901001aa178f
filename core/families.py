"""The model families whose generations eaglegen can read: their structure tokens, how to
detect them, and how their ids cut (``core.anatomy``) and their calls read (``core.calls``).

A family is data: the strings of its think pair, tool-call tokens (or harmony's message
tokens) and stop tokens, the syntax of its calls, and what its vocabulary and chat template
show. ``family_for(vocab, template, override)`` names a run's family: the override when one
is given, else the family whose tokens the vocabulary holds and whose template shows its
layout, else ``unknown`` (reasoning by a think pair if there is one; calls not checked).

Detection scores each family: 0 when the vocabulary lacks a token its calls need or the
template writes another family's layout; else 1, plus 1 when the template shows the family's
chat markers, or 2 when it writes the family's tool-call layout. The highest wins; a tie
goes to the earlier family of ``FAMILIES`` (the more specific vocabulary first).

Pure: vocabulary and template strings in, no tokenizer loaded.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from core import calls
from core.anatomy import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
    THINK_END,
    THINK_START,
    Anatomy,
    Channels,
    Decode,
    Markers,
    ToolCall,
    dissect,
    parse_calls,
)

# A template's verdict on a family: it writes another family's layout (-1), says nothing
# (0), shows the family's chat markers (1), or writes the family's tool-call layout (2).
TemplateRule = Callable[[str], int]
AGAINST, SILENT, CHAT, LAYOUT = -1, 0, 1, 2


def _marks(layout: str, chat: str, against: Sequence[str] = ()) -> TemplateRule:
    """A rule from marker strings: ``against`` (another layout) wins over the others."""

    def rule(template: str) -> int:
        if any(mark in template for mark in against):
            return AGAINST
        if layout in template:
            return LAYOUT
        return CHAT if chat in template else SILENT

    return rule


def _silent(template: str) -> int:
    return SILENT


@dataclass(frozen=True)
class Family:
    """One layout of a generation (see the module docstring)."""

    name: str
    syntax: str  # core.calls.READERS key; "" for calls that cannot be read
    think: tuple[str, str] | None = (THINK_START, THINK_END)
    section: tuple[str, str] | None = None  # around all the calls of a turn
    call: tuple[str, str] | None = None  # around one call
    argument: str | None = None  # between a call's header and its arguments
    # Harmony's (start, channel, message, end, call, return, constrain).
    channels: tuple[str, str, str, str, str, str, str] | None = None
    stops: tuple[str, ...] = ()  # the tokens that end its turns
    vocab_marks: tuple[str, ...] = ()  # more tokens only its vocabulary has
    template_rule: TemplateRule = field(default=_silent, compare=False, repr=False)

    def structure(self) -> tuple[str, ...]:
        """The tokens its calls need as single ids."""
        pairs = (self.section or ()) + (self.call or ()) + (self.channels or ())
        return pairs + ((self.argument,) if self.argument else ())

    def tokens(self) -> tuple[str, ...]:
        """Every special token string it names."""
        return (self.think or ()) + self.structure() + self.stops + self.vocab_marks

    def detect(self, vocab: Mapping[str, int], template: str | None) -> int:
        """How well the tokenizer fits (0: not at all; see the module docstring)."""
        if not self.syntax or not self.structure():
            return 0
        if any(token not in vocab for token in self.structure() + self.vocab_marks):
            return 0
        shown = self.template_rule(template) if template else SILENT
        return 0 if shown == AGAINST else 1 + shown

    def markers(self, vocab: Mapping[str, int], stops: Iterable[int] = ()) -> Markers:
        """Its markers in ``vocab`` (absent ones None); ``stops`` are the run's stop ids. A
        vocabulary lacking a token its calls need has its calls not checked."""
        readable = bool(self.syntax) and all(t in vocab for t in self.structure())
        think_start, think_end = _pair(vocab, self.think)
        section_begin, section_end = _pair(vocab, self.section if readable else None)
        call_begin, call_end = _pair(vocab, self.call if readable else None)
        channels = self.channels if readable else None
        return Markers(
            think_end=think_end,
            section_begin=section_begin,
            section_end=section_end,
            call_begin=call_begin,
            argument_begin=vocab.get(self.argument) if readable and self.argument else None,
            call_end=call_end,
            stops=frozenset(int(i) for i in stops),
            syntax=self.syntax if readable else "",
            think_start=think_start,
            channels=None if channels is None else Channels(*(vocab.get(t) for t in channels)),
            pieces={int(i): piece for piece, i in vocab.items()},
        )

    def stop_ids(self, vocab: Mapping[str, int]) -> list[int]:
        """The ids of its stop tokens that ``vocab`` holds."""
        return [vocab[token] for token in self.stops if token in vocab]

    def dissect(
        self, output_ids: Sequence[int], markers: Markers, *, opens_reasoning: bool
    ) -> Anatomy:
        """``core.anatomy.dissect`` with this family's ``markers``."""
        return dissect(output_ids, markers, opens_reasoning=opens_reasoning)

    def parse_calls(
        self, anatomy: Anatomy, decode: Decode, declared: Collection[str] | None
    ) -> list[ToolCall]:
        """``core.anatomy.parse_calls``: the anatomy's calls read in its family's syntax."""
        return parse_calls(anatomy, decode, declared)


def _pair(vocab: Mapping[str, int], pair: tuple[str, str] | None) -> tuple[int | None, int | None]:
    if pair is None:
        return None, None
    return vocab.get(pair[0]), vocab.get(pair[1])


def _deepseek(name: str) -> str:
    """A DeepSeek special token: its words joined by U+2581 inside U+FF5C bars."""
    return "<\uff5c" + name.replace(" ", "\u2581") + "\uff5c>"


DS_CALLS_BEGIN, DS_CALLS_END = _deepseek("tool calls begin"), _deepseek("tool calls end")
DS_CALL_BEGIN, DS_CALL_END = _deepseek("tool call begin"), _deepseek("tool call end")
DS_SEP, DS_END = _deepseek("tool sep"), _deepseek("end of sentence")
DS_ASSISTANT = _deepseek("Assistant")
# What DeepSeek's template writes between call-begin and the separator: V3 and R1 the type
# (``tool['type']``), then the name after it; V3.1 the name (``tool['function']['name']``).
_DS_HEAD = re.compile(re.escape(DS_CALL_BEGIN) + r"(.{0,200}?)" + re.escape(DS_SEP), re.DOTALL)


def deepseek_layout(template: str) -> str | None:
    """``"v31"`` or ``"v3"`` by the template's tool-call layout; None when it writes none."""
    for found in _DS_HEAD.finditer(template):
        if "name" in found.group(1):
            return "v31"
        if "type" in found.group(1) or "function" in found.group(1):
            return "v3"
    return None


def _deepseek_rule(version: str) -> TemplateRule:
    def rule(template: str) -> int:
        if "DSML" in template:  # V3.2 writes its calls in another markup
            return AGAINST
        layout = deepseek_layout(template)
        if layout is not None:
            return LAYOUT if layout == version else AGAINST
        return CHAT if DS_ASSISTANT in template else SILENT

    return rule


KIMI_K2 = Family(
    name="kimi_k2",
    syntax=calls.KIMI_K2,
    section=(SECTION_BEGIN, SECTION_END),
    call=(CALL_BEGIN, CALL_END),
    argument=ARGUMENT_BEGIN,
    stops=("<|im_end|>",),
    template_rule=_marks(layout=SECTION_BEGIN, chat="<|im_middle|>"),
)
QWEN3 = Family(
    name="qwen3",
    syntax=calls.HERMES,
    call=("<tool_call>", "</tool_call>"),
    stops=("<|im_end|>", "<|endoftext|>"),
    vocab_marks=("<|im_start|>",),
    # GLM's <arg_key> and Qwen3-Coder's <function=...> also sit inside <tool_call>.
    template_rule=_marks(
        layout="<tool_call>", chat="<|im_start|>", against=("<arg_key>", "<function=")
    ),
)
DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    syntax=calls.DEEPSEEK_V3,
    section=(DS_CALLS_BEGIN, DS_CALLS_END),
    call=(DS_CALL_BEGIN, DS_CALL_END),
    argument=DS_SEP,
    stops=(DS_END,),
    template_rule=_deepseek_rule("v3"),
)
DEEPSEEK_V31 = Family(
    name="deepseek_v31",
    syntax=calls.DEEPSEEK_V31,
    section=(DS_CALLS_BEGIN, DS_CALLS_END),
    call=(DS_CALL_BEGIN, DS_CALL_END),
    argument=DS_SEP,
    stops=(DS_END,),
    template_rule=_deepseek_rule("v31"),
)
GLM45 = Family(
    name="glm45",
    syntax=calls.GLM45,
    call=("<tool_call>", "</tool_call>"),
    stops=("<|user|>", "<|observation|>", "<|endoftext|>"),
    vocab_marks=("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    template_rule=_marks(layout="<arg_key>", chat="<|observation|>"),
)
GPT_OSS = Family(
    name="gpt_oss",
    syntax=calls.HARMONY,
    think=None,  # reasoning is the analysis channel
    channels=(
        "<|start|>",
        "<|channel|>",
        "<|message|>",
        "<|end|>",
        "<|call|>",
        "<|return|>",
        "<|constrain|>",
    ),
    stops=("<|return|>", "<|call|>"),
    template_rule=_marks(layout="<|call|>", chat="<|channel|>"),
)
UNKNOWN = Family(name="unknown", syntax="")

# In detection's order of preference on a tie (the more specific vocabulary first).
FAMILIES: tuple[Family, ...] = (GPT_OSS, GLM45, KIMI_K2, DEEPSEEK_V3, DEEPSEEK_V31, QWEN3)
NAMES: tuple[str, ...] = (*(f.name for f in FAMILIES), UNKNOWN.name)
# Other names a run file may use: R1 writes V3's layout; Qwen3's is Hermes'.
ALIASES: dict[str, str] = {
    "deepseek_r1": DEEPSEEK_V3.name,
    "hermes": QWEN3.name,
    "harmony": GPT_OSS.name,
    "kimi": KIMI_K2.name,
}
_BY_NAME = {f.name: f for f in (*FAMILIES, UNKNOWN)}


def family_named(name: str) -> Family:
    """The family called ``name`` (or an alias of it); ValueError names the known ones."""
    found = _BY_NAME.get(ALIASES.get(name, name))
    if found is None:
        known = ", ".join([*NAMES, *ALIASES])
        raise ValueError(f"unknown model family {name!r} (known: {known})")
    return found


def family_for(
    vocab: Mapping[str, int], template: str | None = None, override: str | None = None
) -> Family:
    """The run's family: ``override`` when given, else the best detected, else ``UNKNOWN``."""
    if override is not None:
        return family_named(override)
    best, score = UNKNOWN, 0
    for family in FAMILIES:
        found = family.detect(vocab, template)
        if found > score:
            best, score = family, found
    return best
