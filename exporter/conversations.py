"""A generation as a conversation: the prompt's messages and the decoded assistant turn.

The assistant turn is read from the exact output ids (``core.anatomy``): ``reasoning_content``
is what came before the think-end token (only when the prompt opened reasoning), ``content``
the answer after it, ``tool_calls`` the calls of the tool-call sections in OpenAI's shape.
Two shapes of row: SpecForge's ``{"id", "conversations", "tools"?}`` and Model-Optimizer's
``{"conversation_id", "messages", "tools"?}``. Pure: decoding is the caller's function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from core.anatomy import Anatomy, Markers, ToolCall, dissect, parse_calls, valid

SPECFORGE = "specforge"
MODELOPT = "modelopt"
STYLES = (SPECFORGE, MODELOPT)
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


@dataclass(frozen=True)
class Turn:
    """The decoded assistant turn of one generation, and whether its invariants held."""

    reasoning: str | None
    content: str
    calls: list[ToolCall]
    call_ids: list[str]
    valid: bool

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
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call, call_id in zip(self.calls, self.call_ids, strict=True)
            ]
        return message


def decode_turn(
    output_ids: Sequence[int],
    markers: Markers,
    decode: Decode,
    *,
    opens_reasoning: bool,
    declared: set[str] | None,
) -> tuple[Anatomy, Turn]:
    """Cut ``output_ids`` (``core.anatomy.dissect``) and decode each part."""
    anatomy = dissect(output_ids, markers, opens_reasoning=opens_reasoning)
    calls = parse_calls(anatomy, decode, declared)
    # Kimi-style templates name a call by its header (``functions.NAME:INDEX``): the id an
    # OpenAI tool message answers with.
    call_ids = [decode(span.header).strip() for span in anatomy.calls]
    turn = Turn(
        reasoning=None if anatomy.reasoning is None else decode(anatomy.reasoning),
        content=decode(anatomy.answer),
        calls=calls,
        call_ids=call_ids,
        valid=valid(anatomy, calls),
    )
    return anatomy, turn


def conversation(prompt: Prompt, turn: Turn) -> list[dict[str, Any]]:
    """The prompt's messages then the assistant turn."""
    return [*prompt.messages, turn.message()]


def document(
    style: str,
    row_id: str,
    prompt: Prompt,
    turn: Turn,
    metadata: dict[str, Any],
) -> dict[str, Any]:
    """One exported row in ``style``'s shape; ``tools`` only when the row declared some."""
    messages = conversation(prompt, turn)
    doc: dict[str, Any] = (
        {"id": row_id, "conversations": messages}
        if style == SPECFORGE
        else {"conversation_id": row_id, "messages": messages}
    )
    if prompt.tools is not None:
        doc["tools"] = prompt.tools
    doc["metadata"] = metadata
    return doc
