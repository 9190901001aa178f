"""Dataset rows as read, and their normalisation into chat prompts. Pure: no I/O."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

# Characters of an undecodable line kept as its excerpt.
EXCERPT_CHARS = 200

ROLES = frozenset({"system", "user", "assistant", "tool"})

# ShareGPT speaker names found in the wild (compared lower-cased), mapped to chat roles.
SHAREGPT_ROLES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "function_response": "tool",
    "function_call": "assistant",
}


class RowError(ValueError):
    """A row that cannot become a prompt; ``reason`` is a short stable key for counting."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(slots=True)  # not frozen: a frozen one sets each field through object.__setattr__
class Prompt:
    """What the chat template receives."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


@dataclass(slots=True)  # not frozen, as Prompt; nothing changes a row once read
class RawRow:
    """One row as read: its index, and either the parsed object or the parse error.

    A JSON Lines row may still be its undecoded ``line``: decoding is CPU work that belongs
    where the row is prepared (a worker process), and bytes are cheaper to send there.
    """

    index: int
    value: Any = None
    error: RowError | None = None
    excerpt: str = ""
    line: bytes | None = None

    def decoded(self) -> RawRow:
        """This row with its line decoded (itself when there is no line)."""
        return self if self.line is None else decode_line(self.index, self.line)


_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_NINETEEN_DIGITS = b"0" * 19


def decode_line(index: int, line: bytes) -> RawRow:
    """A JSON Lines row parsed, or an ``invalid_json`` row carrying the line as its excerpt."""
    # orjson is half the CPU of json, but reads an integer beyond 64 bits as a float (json
    # keeps it exact): a line with a run of 19 digits is left to json. (Found by mapping
    # digits to "0": a fifth of the CPU of the regular expression \d{19}.)
    if _NINETEEN_DIGITS not in line.translate(_DIGITS_AS_ZERO):
        try:
            return RawRow(index, orjson.loads(line))
        except orjson.JSONDecodeError:
            pass  # json decides (below)
    try:
        # json accepts a few lines orjson refuses (NaN, a lone surrogate escape, a byte-order
        # mark), and its errors say where a line is broken.
        return RawRow(index, json.loads(line))
    except ValueError as exc:  # JSONDecodeError, or UnicodeDecodeError for non-UTF-8 bytes
        why = f"{exc.msg} (column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else exc
        error = RowError("invalid_json", f"line {index + 1}: {why}")
        return RawRow(index, error=error, excerpt=line.decode("utf-8", "replace")[:EXCERPT_CHARS])


@dataclass(slots=True)  # not frozen, as RawRow
class _Turn:
    """A source message whose role is known; its content is checked only if it is kept."""

    label: str
    role: str
    message: dict[str, Any]
    function_call: bool = False  # a ShareGPT function_call turn: its content is the call


def to_prompt(row: Any) -> Prompt:
    """Normalise an OpenAI, ShareGPT or bare-prompt row; drop trailing assistant turns."""
    # Fields holding null count as absent: columnar formats fill missing fields with nulls.
    if not isinstance(row, dict):
        raise RowError("not_an_object", f"the row is {_kind(row)}, not an object")
    field, turns = _turns(row)
    while turns and turns[-1].role == "assistant":
        turns.pop()  # the answer we regenerate
    if not turns:
        raise RowError("empty_prompt", f"'{field}' has no turn before the final assistant turns")
    if not any(turn.role == "user" for turn in turns):
        raise RowError("no_user_turn", f"'{field}' has no user turn")
    messages = [_checked(turn) for turn in turns]
    return Prompt(messages=messages, tools=_tools(row.get("tools")))


def _empty_system_turn(turn: _Turn) -> bool:
    if turn.role != "system":
        return False
    try:
        content = _text(turn.label, turn.message.get("content"))
    except RowError:
        return False  # malformed: `_checked` says how
    return not (content or "").strip()


def _turns(row: dict[str, Any]) -> tuple[str, list[_Turn]]:
    """The row's turns with resolved roles, and the name of the field they came from."""
    if row.get("messages") is not None:
        field, turns = "messages", _listed(row, "messages", _openai_turn)
    elif row.get("conversations") is not None:
        field, turns = "conversations", _listed(row, "conversations", _sharegpt_turn)
    elif row.get("prompt") is not None:
        field, turns = "prompt", [_bare_prompt(row["prompt"])]
    else:
        keys = ", ".join(sorted(map(str, row))[:10]) or "none"
        raise RowError("no_prompt_field", f"no 'messages', 'conversations' or 'prompt' ({keys})")
    # An empty system turn is "no system prompt", as an empty top-level `system` field is.
    turns = [turn for turn in turns if not _empty_system_turn(turn)]
    return field, _with_system_field(row, turns)


def _bare_prompt(prompt: Any) -> _Turn:
    """A bare ``{"prompt": ...}`` row's user turn."""
    if not isinstance(prompt, str | list):
        raise RowError("malformed_message", f"'prompt' is {_kind(prompt)}, not a string")
    return _Turn("prompt", "user", {"content": prompt})


def _listed(row: dict[str, Any], field: str, turn: Callable[[str, Any], _Turn]) -> list[_Turn]:
    """The turns of a list field, each resolved by ``turn(label, item)``."""
    items = row[field]
    if isinstance(items, str) and items.lstrip().startswith("["):
        try:
            items = json.loads(items)  # CSV files store the list as JSON text
        except ValueError:
            raise RowError("malformed_message", f"'{field}' is a string but not JSON") from None
    if not isinstance(items, list):
        raise RowError("malformed_message", f"'{field}' is {_kind(items)}, not a list")
    if not items:
        raise RowError("empty_prompt", f"'{field}' is an empty list")
    return [turn(f"{field}[{i}]", item) for i, item in enumerate(items)]


def _openai_turn(label: str, message: Any) -> _Turn:
    """An OpenAI ``{"role", "content", ...}`` message."""
    if not isinstance(message, dict):
        raise RowError("malformed_message", f"{label} is {_kind(message)}, not an object")
    role = message.get("role")
    if role is None:
        raise RowError("malformed_message", f"{label} has no 'role'")
    if not isinstance(role, str) or role not in ROLES:
        raise RowError("unknown_role", f"{label} has role {role!r}; known: {_names(ROLES)}")
    return _Turn(label, role, {k: v for k, v in message.items() if v is not None})


def _sharegpt_turn(label: str, turn: Any) -> _Turn:
    """A ShareGPT ``{"from", "value"}`` turn; turns written as OpenAI messages are accepted."""
    if not isinstance(turn, dict):
        raise RowError("malformed_message", f"{label} is {_kind(turn)}, not an object")
    speaker = turn.get("from")
    if speaker is None:
        if turn.get("role") is not None:
            return _openai_turn(label, turn)
        raise RowError("malformed_message", f"{label} has no 'from'")
    role = SHAREGPT_ROLES.get(speaker.lower()) if isinstance(speaker, str) else None
    if role is None:
        known = _names(SHAREGPT_ROLES)
        raise RowError("unknown_role", f"{label} has 'from' {speaker!r}; known: {known}")
    calls = speaker.lower() == "function_call"
    return _Turn(label, role, {"content": turn.get("value")}, function_call=calls)


def _function_call(label: str, value: Any) -> dict[str, Any]:
    """A ShareGPT function_call value (JSON ``{name, arguments}``) as an OpenAI tool call."""
    try:
        call = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        call = None
    if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
        detail = f"{label} (function_call) is not a JSON object with 'name' and 'arguments'"
        raise RowError("malformed_tools", detail)
    return _tool_call(f"{label}.value", call)


def _with_system_field(row: dict[str, Any], turns: list[_Turn]) -> list[_Turn]:
    """Prepend a top-level ``system`` string (bare prompts, LLaMA-Factory ShareGPT)."""
    system = row.get("system")
    # An empty system field is how columnar datasets spell "no system prompt".
    if system is None or (isinstance(system, str) and not system.strip()):
        return turns
    if not isinstance(system, str):
        raise RowError("malformed_message", f"'system' is {_kind(system)}, not a string")
    if turns and turns[0].role == "system":
        raise RowError(
            "malformed_message", f"both a 'system' field and a system turn in {turns[0].label}"
        )
    return [_Turn("system", "system", {"content": system}), *turns]


def _checked(turn: _Turn) -> dict[str, Any]:
    """The message the template receives: text content, well-formed tool calls."""
    message = {"role": turn.role, **turn.message}
    if turn.function_call:
        call = _function_call(turn.label, message["content"])
        message.update(content="", tool_calls=[call])
    content = _text(turn.label, message.get("content"))
    if message.get("tool_calls") is not None:
        message["tool_calls"] = _tool_calls(turn.label, message["tool_calls"])
    if turn.role in ("user", "system") and not (content or "").strip():
        raise RowError("empty_prompt", f"{turn.label} ({turn.role}) has empty content")
    if content is None:
        if not message.get("tool_calls"):
            raise RowError("malformed_message", f"{turn.label} ({turn.role}) has no content")
        content = ""  # OpenAI allows null beside tool calls; templates expect a string
    message["content"] = content
    return message


def _text(label: str, content: Any) -> str | None:
    """Message content as one string; text parts are joined, other parts are refused."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        kind = _kind(content)
        raise RowError("malformed_message", f"{label}.content is {kind}, not a string or list")
    return "".join(_text_part(f"{label}.content[{i}]", part) for i, part in enumerate(content))


def _text_part(label: str, part: Any) -> str:
    """The text of one content part."""
    if not isinstance(part, dict):
        raise RowError("malformed_message", f"{label} is {_kind(part)}, not an object")
    kind = part.get("type", "text")
    if kind != "text":
        raise RowError("unsupported_content", f"{label} has type {kind!r}; only text is supported")
    text = part.get("text")
    if not isinstance(text, str):
        raise RowError("malformed_message", f"{label} has no 'text' string")
    return text


def _tool_calls(label: str, calls: Any) -> list[dict[str, Any]]:
    """Validated tool calls, each in the OpenAI ``{"type", "function": {...}}`` form."""
    if not isinstance(calls, list):
        raise RowError("malformed_tools", f"{label}.tool_calls is {_kind(calls)}, not a list")
    return [_tool_call(f"{label}.tool_calls[{i}]", call) for i, call in enumerate(calls)]


def _tool_call(label: str, call: Any) -> dict[str, Any]:
    """One tool call; the flat ``{"name", "arguments"}`` form is wrapped as OpenAI's."""
    if not isinstance(call, dict):
        raise RowError("malformed_tools", f"{label} is {_kind(call)}, not an object")
    nested = "function" in call
    function = call["function"] if nested else call
    if not isinstance(function, dict) or not _is_name(function.get("name")):
        raise RowError("malformed_tools", f"{label} has no function name")
    if not isinstance(function.get("arguments"), str | dict):
        raise RowError("malformed_tools", f"{label} arguments are not a JSON string or object")
    if nested:
        return call
    rest = {k: v for k, v in call.items() if k not in ("name", "arguments")}
    wrapped = {"name": call["name"], "arguments": call["arguments"]}
    return {"type": "function", **rest, "function": wrapped}


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """Validated tool definitions, flat ones wrapped as OpenAI function schemas."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)  # columnar datasets often store the list as JSON text
        except ValueError:
            raise RowError("malformed_tools", "'tools' is a string but not JSON") from None
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RowError("malformed_tools", f"'tools' is {_kind(tools)}, not a list")
    return [_tool(f"tools[{i}]", tool) for i, tool in enumerate(tools)] or None


def _tool(label: str, tool: Any) -> dict[str, Any]:
    """One tool definition: ``{"function": {"name", ...}}`` or a flat ``{"name", ...}``."""
    if not isinstance(tool, dict):
        raise RowError("malformed_tools", f"{label} is {_kind(tool)}, not an object")
    function = tool.get("function")
    if function is not None:
        if not isinstance(function, dict) or not _is_name(function.get("name")):
            raise RowError("malformed_tools", f"{label}.function has no 'name'")
        return tool
    if not _is_name(tool.get("name")):
        raise RowError("malformed_tools", f"{label} has neither a 'function' nor a 'name'")
    return {"type": "function", "function": tool}


def _is_name(value: Any) -> bool:
    """A usable function name: a non-empty string."""
    return isinstance(value, str) and bool(value.strip())


def _names(values: Any) -> str:
    """Sorted, comma-separated, for error details."""
    return ", ".join(sorted(values))


def _kind(value: Any) -> str:
    """The JSON kind of a value with its article ("an object", "a number"), for details."""
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return kinds.get(type(value), f"a {type(value).__name__}")
