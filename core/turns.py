"""An assistant turn read from its exact output ids, as chat templates take it back.

The turn is read by the run's model family (``core.families``): ``reasoning_content`` is
the reasoning (before the think-end token, or harmony's analysis channel), ``content`` the
answer, ``tool_calls`` the calls in OpenAI's shape. Each family's chat template writes a
turn back its own way (``TurnLayout``): the white space it puts around reasoning and answer
is taken off what the model wrote (the template adds it again, so a round trip still
holds), a call's id is its header where the template writes one there (Kimi-K2) and
``call_{i}`` where no template writes one (Qwen3, DeepSeek, GLM, gpt-oss), and the arguments
are a JSON string, or an object for a template that iterates them (GLM-4.5). The export
writes these turns (``exporter.conversations``); an on-policy conversation puts them in its
next prompt (``core.dialogue``). Pure: decoding is the caller's function.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.anatomy import Anatomy, Markers, ToolCall, valid
from core.families import GLM45, KIMI_K2, QWEN3, Family

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class Prompt:
    """What a job stores of its source row: the messages and tools the template received."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None

    @classmethod
    def of(cls, stored: Any) -> Prompt:
        """From ``jobs.messages`` (``{"messages": [...], "tools": [...] | null}``)."""
        if not isinstance(stored, dict) or not isinstance(stored.get("messages"), list):
            raise ValueError("the job's stored prompt has no 'messages' list")
        tools = stored.get("tools")
        return cls(list(stored["messages"]), list(tools) if tools else None)

    def declared(self) -> set[str] | None:
        """The names of the declared functions (None when no tools were declared)."""
        if self.tools is None:
            return None
        return {str(_function(tool).get("name")) for tool in self.tools}


def _function(entry: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI ``{"type": "function", "function": {...}}`` entry or a bare function."""
    inner = entry.get("function")
    return inner if isinstance(inner, dict) else entry


def _as_written(text: str, calls: bool = False) -> str:
    return text


def _qwen3_content(text: str, calls: bool) -> str:
    # The template writes content.lstrip('\n') after its think block, then '\n' before the
    # first call when there is content.
    content = text.lstrip("\n")
    return content.removesuffix("\n") if calls else content


def _glm_content(text: str, calls: bool) -> str:
    return text.strip()  # the template writes '\n' + content.strip()


@dataclass(frozen=True)
class TurnLayout:
    """How a family's chat template writes an assistant turn back (see the module docstring).

    ``reasoning`` and ``content`` take off the template's own white space (``content`` is
    told whether calls follow); ``header_ids``: a call's header is its id; ``object_arguments``:
    the template iterates the arguments, so they go as an object."""

    reasoning: Callable[[str], str] = field(default=_as_written)
    content: Callable[[str, bool], str] = field(default=_as_written)
    header_ids: bool = False
    object_arguments: bool = False


# Families whose template writes none of these differently: DeepSeek's write reasoning and
# content as given, gpt-oss's in messages of their own.
LAYOUTS: dict[str, TurnLayout] = {
    # Its template names a call by its header (``functions.NAME:INDEX``): the id an OpenAI
    # tool message answers with.
    KIMI_K2.name: TurnLayout(header_ids=True),
    # '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content ...
    QWEN3.name: TurnLayout(reasoning=lambda text: text.strip("\n"), content=_qwen3_content),
    # '\n<think>' + reasoning.strip() + '</think>' + '\n' + content.strip(); its arguments
    # are written key by key (``_args.items()``).
    GLM45.name: TurnLayout(reasoning=str.strip, content=_glm_content, object_arguments=True),
}


def layout_of(family: Family) -> TurnLayout:
    """How ``family``'s template writes a turn (as given, for the others)."""
    return LAYOUTS.get(family.name, TurnLayout())


@dataclass(frozen=True)
class Turn:
    """The decoded assistant turn of one generation, and whether its invariants held;
    ``calls_checked`` False: the family's calls are not read (left in ``content``)."""

    reasoning: str | None
    content: str
    calls: list[ToolCall]
    call_ids: list[str]
    valid: bool
    calls_checked: bool = True
    object_arguments: bool = False

    def message(self) -> dict[str, Any]:
        """As an OpenAI-style assistant message (what chat templates render)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            message["tool_calls"] = [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": self._arguments(call)},
                }
                for call, call_id in zip(self.calls, self.call_ids, strict=True)
            ]
        return message

    def _arguments(self, call: ToolCall) -> Any:
        if not self.object_arguments:
            return call.arguments
        try:
            return json.loads(call.arguments)
        except ValueError:  # broken: kept as written
            return call.arguments


def decode_turn(
    output_ids: Sequence[int],
    markers: Markers,
    decode: Decode,
    *,
    opens_reasoning: bool,
    declared: set[str] | None,
    family: Family = KIMI_K2,
) -> tuple[Anatomy, Turn]:
    """Cut ``output_ids`` by ``family``'s layout (``markers``: its tokens) and decode each
    part as its template writes it back (``layout_of``)."""
    anatomy = family.dissect(output_ids, markers, opens_reasoning=opens_reasoning)
    calls = family.parse_calls(anatomy, decode, declared)
    layout = layout_of(family)
    reasoning = None if anatomy.reasoning is None else layout.reasoning(decode(anatomy.reasoning))
    turn = Turn(
        reasoning=reasoning,
        content=layout.content(decode(anatomy.answer), bool(calls)),
        calls=calls,
        call_ids=_call_ids(anatomy, decode, layout),
        valid=valid(anatomy, calls),
        calls_checked=anatomy.calls_checked,
        object_arguments=layout.object_arguments,
    )
    return anatomy, turn


def _call_ids(anatomy: Anatomy, decode: Decode, layout: TurnLayout) -> list[str]:
    """Each call's id: its header where the template writes the id there, else ``call_{i}``
    (no template of those families writes an id into the ids)."""
    if layout.header_ids:
        return [decode(span.header).strip() for span in anatomy.calls]
    return [f"call_{i}" for i in range(len(anatomy.calls))]
