"""Reading dataset rows and turning them into chat prompts. Pure apart from file reading."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLES = frozenset({"system", "user", "assistant", "tool"})


class RowError(ValueError):
    """A row that cannot become a prompt; ``reason`` is a short stable key for counting."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Prompt:
    """What the chat template receives."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class RawRow:
    """One row as read: its index, and either the parsed object or the parse error."""

    index: int
    value: Any = None
    error: RowError | None = None
    excerpt: str = ""


def read_jsonl(path: Path) -> Iterator[RawRow]:
    """Stream a JSONL file; blank lines are skipped, bad JSON becomes an error row."""
    with path.open("r", encoding="utf-8") as handle:
        for index, line in enumerate(handle):
            if not line.strip():
                continue
            try:
                yield RawRow(index, value=json.loads(line))
            except json.JSONDecodeError as exc:
                yield RawRow(
                    index,
                    error=RowError("invalid_json", f"line {index + 1}: {exc.msg}"),
                    excerpt=line[:200],
                )


def to_prompt(row: Any) -> Prompt:
    """Validate an OpenAI-style ``{"messages": [...]}`` row; drop trailing assistant turns."""
    if not isinstance(row, dict):
        raise RowError("not_an_object", f"row is a {type(row).__name__}")
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RowError("no_prompt_field", "no non-empty 'messages' list")
    clean = [_message(i, m) for i, m in enumerate(messages)]
    while clean and clean[-1]["role"] == "assistant":
        clean.pop()  # the answer we regenerate
    if not any(m["role"] == "user" for m in clean):
        raise RowError("no_user_turn", "no user message")
    tools = row.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise RowError("malformed_tools", "'tools' must be a list of objects")
    return Prompt(messages=clean, tools=tools or None)


def _message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise RowError("malformed_message", f"message {index} is not an object")
    role = message.get("role")
    if role not in ROLES:
        raise RowError("unknown_role", f"message {index} has role {role!r}")
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    if content is None and not message.get("tool_calls"):
        raise RowError("empty_prompt", f"message {index} has no content")
    out = dict(message)
    out["content"] = content if content is not None else ""
    return out
