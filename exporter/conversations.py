"""A generation as a conversation row: the prompt's messages and the assistant turn read
from its exact output ids (``core.turns``), in one of two shapes: SpecForge's ``{"id",
"conversations", "tools"?}`` and Model-Optimizer's ``{"conversation_id", "messages",
"tools"?}``. Pure.
"""

from __future__ import annotations

from typing import Any

from core.turns import Prompt, Turn

SPECFORGE = "specforge"
MODELOPT = "modelopt"
STYLES = (SPECFORGE, MODELOPT)


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
