"""Row normalisation: OpenAI, ShareGPT and bare-prompt rows, and every rejection reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from producer.readers import iter_rows
from producer.rows import RowError, decode_line, to_prompt

WEATHER_CALL = {"type": "function", "function": {"name": "weather", "arguments": '{"city": "X"}'}}
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}},
}


def user(text: Any) -> dict[str, Any]:
    return {"role": "user", "content": text}


def test_trailing_assistant_turn_is_dropped_and_history_kept() -> None:
    prompt = to_prompt(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "more"},
                {"role": "assistant", "content": "the answer we regenerate"},
            ]
        }
    )
    assert prompt.messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
    ]
    assert prompt.tools is None


def test_text_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert to_prompt({"messages": [user(parts)]}).messages[0]["content"] == "ab"


def test_openai_tools_and_tool_call_history_are_kept_exactly() -> None:
    call_with_object = {"id": "c2", "function": {"name": "weather", "arguments": {"city": "Y"}}}
    row = {
        "messages": [
            {"role": "system", "content": "be brief"},
            user("weather in X and Y?"),
            {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL, call_with_object]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
            {"role": "tool", "content": "", "tool_call_id": "c2"},
            {"role": "assistant", "content": "Sunny in X."},
        ],
        "tools": [WEATHER_TOOL],
    }
    prompt = to_prompt(row)
    assert prompt.tools == [WEATHER_TOOL]
    assert [m["role"] for m in prompt.messages] == ["system", "user", "assistant", "tool", "tool"]
    assert prompt.messages[2] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [WEATHER_CALL, call_with_object],
    }
    assert prompt.messages[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


def test_flat_tool_calls_and_tools_are_wrapped_in_the_openai_form() -> None:
    flat_call = {"id": "c1", "name": "weather", "arguments": '{"city": "X"}'}
    flat_tool = {"name": "weather", "parameters": {"type": "object", "properties": {}}}
    row = {
        "messages": [user("q"), {"role": "assistant", "tool_calls": [flat_call]}, user("and?")],
        "tools": [flat_tool],
    }
    prompt = to_prompt(row)
    assert prompt.messages[1]["tool_calls"] == [{"id": "c1", **WEATHER_CALL}]
    assert prompt.tools == [WEATHER_TOOL]


def test_tools_stored_as_json_text_are_parsed() -> None:
    prompt = to_prompt({"messages": [user("q")], "tools": '[{"name": "weather"}]'})
    assert prompt.tools == [{"type": "function", "function": {"name": "weather"}}]


def test_turns_stored_as_json_text_are_parsed() -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert to_prompt({"messages": json.dumps(messages)}) == to_prompt({"messages": messages})
    turns = [{"from": "human", "value": "q"}]
    assert to_prompt({"conversations": json.dumps(turns)}).messages == [
        {"role": "user", "content": "q"}
    ]
    with pytest.raises(RowError, match="'messages' is a string but not JSON"):
        to_prompt({"messages": "[{oops"})


def test_empty_tools_list_means_no_tools() -> None:
    assert to_prompt({"messages": [user("q")], "tools": []}).tools is None


@pytest.mark.parametrize(
    ("speaker", "role"),
    [
        ("human", "user"),
        ("user", "user"),
        ("Human", "user"),
        ("gpt", "assistant"),
        ("assistant", "assistant"),
        ("chatgpt", "assistant"),
        ("bing", "assistant"),
        ("bard", "assistant"),
        ("model", "assistant"),
        ("system", "system"),
        ("tool", "tool"),
        ("function", "tool"),
        ("observation", "tool"),
        ("function_response", "tool"),
    ],
)
def test_sharegpt_speakers_map_to_roles(speaker: str, role: str) -> None:
    turns = [{"from": "human", "value": "q"}, {"from": speaker, "value": "x"}]
    prompt = to_prompt({"conversations": [*turns, {"from": "human", "value": "again"}]})
    assert prompt.messages[1] == {"role": role, "content": "x"}


def test_sharegpt_conversation_drops_the_final_answer() -> None:
    row = {
        "conversations": [
            {"from": "system", "value": "sys"},
            {"from": "human", "value": "q1"},
            {"from": "gpt", "value": "a1"},
            {"from": "human", "value": "q2"},
            {"from": "gpt", "value": "a2", "weight": 1},
        ]
    }
    assert to_prompt(row).messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]


def test_sharegpt_function_call_becomes_a_tool_call() -> None:
    row = {
        "conversations": [
            {"from": "human", "value": "weather in X?"},
            {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "X"}}'},
            {"from": "observation", "value": "sunny"},
            {"from": "gpt", "value": "Sunny."},
        ],
        "tools": '[{"name": "weather", "description": "d"}]',
    }
    prompt = to_prompt(row)
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "X"}}}
    assert prompt.messages == [
        {"role": "user", "content": "weather in X?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
    ]
    assert prompt.tools == [
        {"type": "function", "function": {"name": "weather", "description": "d"}}
    ]


def test_sharegpt_turns_written_as_openai_messages_are_accepted() -> None:
    row = {"conversations": [{"role": "user", "content": "q"}, {"from": "gpt", "value": "a"}]}
    assert to_prompt(row).messages == [{"role": "user", "content": "q"}]


def test_system_field_is_prepended() -> None:
    row = {"system": "sys", "conversations": [{"from": "human", "value": "q"}]}
    assert to_prompt(row).messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
    ]


def test_bare_prompt_with_and_without_system() -> None:
    assert to_prompt({"prompt": "q"}).messages == [{"role": "user", "content": "q"}]
    assert to_prompt({"prompt": "q", "system": "sys"}).messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
    ]
    # Columnar datasets spell "no system prompt" as an empty string.
    assert to_prompt({"prompt": "q", "system": ""}).messages == [user("q")]


@pytest.mark.parametrize(
    "row",
    [
        {"prompt": "q", "system": ""},
        {"prompt": "q", "system": " \n"},
        {"messages": [{"role": "system", "content": ""}, user("q")]},
        {"messages": [{"role": "system", "content": [{"type": "text", "text": " "}]}, user("q")]},
        {"conversations": [{"from": "system", "value": ""}, {"from": "human", "value": "q"}]},
        # An empty system turn is no system prompt, so it does not clash with the field.
        {"system": "", "messages": [{"role": "system", "content": ""}, user("q")]},
    ],
)
def test_an_empty_system_prompt_is_dropped_in_every_spelling(row: dict[str, Any]) -> None:
    assert to_prompt(row).messages == [user("q")]


def test_a_system_field_and_an_empty_system_turn_keep_the_field() -> None:
    row = {"system": "sys", "messages": [{"role": "system", "content": ""}, user("q")]}
    assert to_prompt(row).messages == [{"role": "system", "content": "sys"}, user("q")]


def test_nulls_count_as_absent_fields() -> None:
    row = {
        "messages": None,
        "conversations": None,
        "prompt": "q",
        "system": None,
        "tools": None,
    }
    assert to_prompt(row).messages == [user("q")]
    message = {"role": "user", "content": "q", "name": None, "tool_calls": None}
    assert to_prompt({"messages": [message], "prompt": None}).messages == [user("q")]


def test_messages_win_over_a_prompt_field() -> None:
    row = {"prompt": "ignored", "messages": [user("q"), {"role": "assistant", "content": "a"}]}
    assert to_prompt(row).messages == [user("q")]


def test_dropped_final_answer_is_not_validated() -> None:
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    row = {"messages": [user("q"), {"role": "assistant", "content": image}]}
    assert to_prompt(row).messages == [user("q")]


def test_dropped_final_function_call_is_not_validated() -> None:
    turns = [{"from": "human", "value": "q"}, {"from": "function_call", "value": "f(x)"}]
    assert to_prompt({"conversations": turns}).messages == [user("q")]


def test_history_assistant_may_have_empty_content() -> None:
    row = {"messages": [user("q"), {"role": "assistant", "content": ""}, user("again")]}
    assert to_prompt(row).messages[1] == {"role": "assistant", "content": ""}


IMAGE_PART = {"type": "image_url", "image_url": {"url": "http://x"}}
TEXT_PART = {"type": "text", "text": "look"}
ASK = {"role": "user", "content": "q"}


@pytest.mark.parametrize(
    ("row", "reason", "detail"),
    [
        ([1, 2], "not_an_object", "the row is a list"),
        ("text", "not_an_object", "the row is a string"),
        (None, "not_an_object", "the row is null"),
        ({"prompt_text": "x"}, "no_prompt_field", "(prompt_text)"),
        ({}, "no_prompt_field", "(none)"),
        ({"messages": None}, "no_prompt_field", "no 'messages'"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown_role", "messages[0]"),
        ({"messages": [ASK, {"role": 3, "content": "x"}]}, "unknown_role", "messages[1]"),
        ({"messages": [{"role": ["user"], "content": "x"}]}, "unknown_role", "role ['user']"),
        ({"conversations": [{"from": "narrator", "value": "x"}]}, "unknown_role", "'narrator'"),
        ({"conversations": [{"from": 1, "value": "x"}]}, "unknown_role", "conversations[0]"),
        ({"messages": [{"role": "system", "content": "x"}]}, "no_user_turn", "'messages'"),
        (
            {
                "messages": [
                    {"role": "system", "content": "x"},
                    {"role": "assistant", "content": "a"},
                ]
            },
            "no_user_turn",
            "no user turn",
        ),
        ({"conversations": [{"from": "system", "value": "s"}]}, "no_user_turn", "conversations"),
        ({"messages": [user(None)]}, "empty_prompt", "messages[0] (user) has empty content"),
        ({"messages": [user(" \n")]}, "empty_prompt", "messages[0] (user)"),
        ({"messages": [user([])]}, "empty_prompt", "messages[0] (user)"),
        ({"messages": []}, "empty_prompt", "'messages' is an empty list"),
        ({"conversations": []}, "empty_prompt", "'conversations' is an empty list"),
        (
            {"messages": [{"role": "assistant", "content": "a"}]},
            "empty_prompt",
            "before the final assistant turns",
        ),
        ({"prompt": "   "}, "empty_prompt", "prompt (user) has empty content"),
        ({"prompt": ""}, "empty_prompt", "prompt (user)"),
        ({"messages": "hi"}, "malformed_message", "'messages' is a string, not a list"),
        ({"conversations": {"a": 1}}, "malformed_message", "'conversations' is an object"),
        ({"messages": [ASK, "hi"]}, "malformed_message", "messages[1] is a string"),
        ({"messages": [{"content": "x"}]}, "malformed_message", "messages[0] has no 'role'"),
        ({"messages": [user(5)]}, "malformed_message", "messages[0].content is a number"),
        ({"messages": [user(["x"])]}, "malformed_message", "messages[0].content[0] is a string"),
        (
            {"messages": [user([{"type": "text"}])]},
            "malformed_message",
            "messages[0].content[0] has no 'text'",
        ),
        (
            {"conversations": [{"value": "x"}]},
            "malformed_message",
            "conversations[0] has no 'from'",
        ),
        ({"conversations": [7]}, "malformed_message", "conversations[0] is a number"),
        ({"prompt": 12}, "malformed_message", "'prompt' is a number"),
        ({"prompt": "q", "system": 1}, "malformed_message", "'system' is a number"),
        (
            {"system": "s", "messages": [{"role": "system", "content": "t"}, ASK]},
            "malformed_message",
            "both a 'system' field and a system turn in messages[0]",
        ),
        (
            {"messages": [ASK, {"role": "tool"}, ASK]},
            "malformed_message",
            "messages[1] (tool) has no content",
        ),
        (
            {"messages": [ASK, {"role": "assistant"}, ASK]},
            "malformed_message",
            "messages[1] (assistant) has no content",
        ),
        ({"messages": [ASK], "tools": "nope"}, "malformed_tools", "'tools' is a string but not"),
        ({"messages": [ASK], "tools": {"name": "f"}}, "malformed_tools", "'tools' is an object"),
        ({"messages": [ASK], "tools": [1]}, "malformed_tools", "tools[0] is a number"),
        ({"messages": [ASK], "tools": [{"function": {}}]}, "malformed_tools", "tools[0].function"),
        (
            {"messages": [ASK], "tools": [{"name": "f"}, {"description": "d"}]},
            "malformed_tools",
            "tools[1] has neither a 'function' nor a 'name'",
        ),
        (
            {"messages": [ASK, {"role": "assistant", "tool_calls": {"name": "f"}}, ASK]},
            "malformed_tools",
            "messages[1].tool_calls is an object",
        ),
        (
            {"messages": [ASK, {"role": "assistant", "tool_calls": [{"arguments": "{}"}]}, ASK]},
            "malformed_tools",
            "messages[1].tool_calls[0] has no function name",
        ),
        (
            {
                "messages": [
                    ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": 1}}],
                    },
                    ASK,
                ]
            },
            "malformed_tools",
            "messages[1].tool_calls[0] arguments",
        ),
        (
            {"messages": [ASK, {"role": "assistant", "tool_calls": [{"function": "f"}]}, ASK]},
            "malformed_tools",
            "messages[1].tool_calls[0] has no function name",
        ),
        (
            {
                "conversations": [
                    {"from": "human", "value": "q"},
                    {"from": "function_call", "value": "f(x)"},
                    {"from": "observation", "value": "r"},
                ]
            },
            "malformed_tools",
            "conversations[1] (function_call) is not a JSON object",
        ),
        (
            {
                "conversations": [
                    {"from": "human", "value": "q"},
                    {"from": "function_call", "value": '{"name": "f"}'},
                    {"from": "observation", "value": "r"},
                ]
            },
            "malformed_tools",
            "with 'name' and 'arguments'",
        ),
        (
            {"messages": [user([TEXT_PART, IMAGE_PART])]},
            "unsupported_content",
            "messages[0].content[1]",
        ),
        ({"messages": [user([{"type": "input_audio"}])]}, "unsupported_content", "'input_audio'"),
    ],
)
def test_bad_rows_name_their_reason(row: Any, reason: str, detail: str) -> None:
    with pytest.raises(RowError) as info:
        to_prompt(row)
    assert (info.value.reason, detail in info.value.detail) == (reason, True), info.value.detail


def test_jsonl_rows_keep_their_line_positions(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"messages": []}\n\n{not json\n[1]\n')
    rows = list(iter_rows(path))
    assert [r.index for r in rows] == [0, 2, 3]
    assert rows[1].error is not None and rows[1].error.reason == "invalid_json"
    assert "line 3" in rows[1].error.detail
    assert rows[2].value == [1]


@pytest.mark.parametrize(
    "line",
    [
        b'{"prompt": "hi", "x": NaN}',  # json accepts NaN, orjson does not
        b'{"prompt": "a \\ud800 lone surrogate"}',
        b'\xef\xbb\xbf{"prompt": "after a byte-order mark"}',
        b'{"prompt": "big", "n": 123456789012345678901234567890}',
        b'{"prompt": "plain", "f": 1.5e300, "k": [1, "two", null, true]}',
        b'{"prompt": "duplicate keys", "prompt": "the last wins"}',
    ],
)
def test_lines_decode_as_json_decodes_them(line: bytes) -> None:
    # orjson decodes first; what it refuses, json decides: the value is json's either way.
    row = decode_line(0, line)
    assert row.error is None
    assert repr(row.value) == repr(json.loads(line))
