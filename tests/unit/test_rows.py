"""Row validation of OpenAI-style chat rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from producer.rows import RowError, read_jsonl, to_prompt


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
    assert [m["role"] for m in prompt.messages] == ["user", "assistant", "user"]


def test_text_parts_are_joined() -> None:
    prompt = to_prompt(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ]
        }
    )
    assert prompt.messages[0]["content"] == "ab"


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ([1, 2], "not_an_object"),
        ({"prompt_text": "x"}, "no_prompt_field"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown_role"),
        ({"messages": [{"role": "system", "content": "x"}]}, "no_user_turn"),
        ({"messages": [{"role": "user", "content": None}]}, "empty_prompt"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": "nope"}, "malformed_tools"),
    ],
)
def test_bad_rows_name_their_reason(row: Any, reason: str) -> None:
    with pytest.raises(RowError) as info:
        to_prompt(row)
    assert info.value.reason == reason


def test_jsonl_reader_skips_blank_lines_and_reports_bad_json(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"messages": []}\n\n{not json\n[1]\n')
    rows = list(read_jsonl(path))
    assert [r.index for r in rows] == [0, 2, 3]
    assert rows[1].error is not None and rows[1].error.reason == "invalid_json"
    assert "line 3" in rows[1].error.detail
    assert rows[2].value == [1]
