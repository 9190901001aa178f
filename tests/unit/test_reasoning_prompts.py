"""Whether a prompt opens a reasoning block, decided per prompt for real template families."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from eaglegen.assets import TOKENIZER_DIR
from producer.rows import to_prompt
from producer.template import Templater
from tests.helpers import family_tokenizer

USER = {"messages": [{"role": "user", "content": "What is 2 + 2?"}]}
AFTER_REASONING = {
    "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
        {"role": "user", "content": "and now?"},
    ]
}
AFTER_TOOL = {
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look."},
        {"role": "tool", "content": "sunny"},
    ]
}


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


def opens(tokenizer: Path, row: dict[str, Any], **kwargs: Any) -> tuple[bool, str]:
    templater = Templater(tokenizer, template_kwargs=kwargs)
    text = templater.render(to_prompt(row))
    return templater.opens_reasoning(templater.encode_batch([text])[0]), text


@pytest.mark.parametrize(
    ("family", "row", "kwargs", "expected", "tail"),
    [
        # The generation prompt ends with the think-start token and a newline.
        ("qwen3_thinking", USER, {}, True, "<think>\n"),
        ("qwen3_thinking", AFTER_REASONING, {}, True, "<think>\n"),
        ("deepseek_r1", USER, {}, True, "<think>\n"),
        # Thinking switched off: the template closes the block itself.
        ("qwen3_hybrid", USER, {"enable_thinking": False}, False, "</think>\n\n"),
        # Thinking on: this template leaves `<think>` for the model to write.
        ("qwen3_hybrid", USER, {}, False, "assistant\n"),
        ("deepseek_v31", USER, {"thinking": True}, True, "<｜Assistant｜><think>"),
        ("deepseek_v31", USER, {"thinking": False}, False, "<｜Assistant｜></think>"),
        # After a tool turn R1's template adds no generation prompt at all.
        ("deepseek_r1", AFTER_TOOL, {}, False, "<｜tool▁outputs▁end｜>"),
    ],
)
def test_each_family_opens_a_block_exactly_where_its_template_does(
    families: Path,
    family: str,
    row: dict[str, Any],
    kwargs: dict[str, Any],
    expected: bool,
    tail: str,
) -> None:
    tokenizer = families / family
    if not tokenizer.exists():
        family_tokenizer(families, family)
    result, text = opens(tokenizer, row, **kwargs)
    assert text.endswith(tail), text[-40:]
    assert result is expected


def test_the_think_pair_is_found_in_the_vocabulary() -> None:
    templater = Templater(TOKENIZER_DIR)
    think_start, think_end = (
        templater.encode_batch(["<think>"])[0],
        templater.encode_batch(["</think>"])[0],
    )
    assert templater.think_end_id() == think_end[0]
    ids = templater.encode_batch([templater.render(to_prompt(USER))])[0]
    assert ids[-1] == think_start[0] and templater.opens_reasoning(ids)
    # Only white space may follow the think-start token; a closed block does not count.
    newline = templater.encode_batch(["\n \n"])[0]
    assert templater.opens_reasoning(ids + newline)
    assert not templater.opens_reasoning(ids + think_end)
    assert not templater.opens_reasoning(ids[:-1])
    assert not templater.opens_reasoning([])
