"""The shipped tiny tokenizer, its chat template and the sample dataset."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from eaglegen.assets import SAMPLE_DATASET, TOKENIZER_DIR, special_ids

ROOT = Path(__file__).resolve().parents[2]
SPECIAL_TOKENS = [
    "[BOS]",
    "[EOS]",
    "[PAD]",
    "[UNK]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]
ID = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
USER = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def tok() -> Any:
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def render(tok: Any, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[str, list[int]]:
    """Template to text and ids, checking both apply_chat_template paths agree."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    ids = tok.encode(text, add_special_tokens=False)
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    # transformers 5 returns a BatchEncoding (a Mapping) here, transformers 4 a plain list.
    direct = list(out["input_ids"]) if isinstance(out, Mapping) else list(out)
    assert direct == ids
    return text, ids


def test_loads_offline_as_fast_tokenizer(tok: Any) -> None:
    assert tok.is_fast
    assert len(tok) == 4096
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("[BOS]", "<|im_end|>", "[PAD]")
    assert tok.eos_token_id == ID["<|im_end|>"]
    assert tok.model_max_length == 8192
    assert tok.chat_template == (ROOT / "eaglegen/assets/chat_template.jinja").read_text()


@pytest.mark.parametrize("token", SPECIAL_TOKENS)
def test_special_token_is_one_fixed_id(tok: Any, token: str) -> None:
    assert tok.encode(token, add_special_tokens=False) == [ID[token]]
    assert tok.encode(f"a{token}b", add_special_tokens=False)[1:2] == [ID[token]]
    assert token in tok.all_special_tokens


def test_special_ids_reads_tokenizer_json(tok: Any) -> None:
    ids = special_ids(TOKENIZER_DIR)
    assert (ids.think_start, ids.think_end, ids.im_end, ids.stop) == (9, 10, 4, 4)
    assert (ids.tool_calls_section_begin, ids.tool_calls_section_end) == (11, 12)
    assert (ids.tool_call_begin, ids.tool_call_argument_begin, ids.tool_call_end) == (13, 14, 15)
    assert (ids.bos, ids.pad) == (0, 2)
    assert ids.vocab_size == len(tok) == 4096


def test_no_special_tokens_added_on_plain_encode(tok: Any) -> None:
    assert ID["[BOS]"] not in tok.encode("hello", add_special_tokens=True)


def test_generation_prompt_opens_thinking(tok: Any) -> None:
    text, ids = render(tok, USER)
    assert text == (
        "<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>"
        "<|im_user|>user<|im_middle|>What is 2 + 2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    assert ids[-1] == ID["<think>"]
    assert render(tok, USER, thinking=True)[1] == ids


def test_thinking_false_closes_thinking(tok: Any) -> None:
    text, ids = render(tok, USER, thinking=False)
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think></think>")
    assert ids[-3:] == [ID["<|im_middle|>"], ID["<think>"], ID["</think>"]]


def test_no_generation_prompt_ends_at_last_turn(tok: Any) -> None:
    text = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=False)
    assert text.endswith("What is 2 + 2?<|im_end|>")


def test_given_system_message_replaces_default(tok: Any) -> None:
    text, _ = render(tok, [{"role": "system", "content": "Be brief."}, *USER])
    assert text.startswith("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>")
    assert "helpful assistant" not in text


def test_tools_are_declared_first(tok: Any) -> None:
    text, ids = render(tok, USER, tools=[WEATHER_TOOL])
    head = "<|im_system|>tool_declare<|im_middle|>"
    assert text.startswith(head)
    declared = text[len(head) : text.index("<|im_end|>")]
    assert json.loads(declared) == [WEATHER_TOOL]
    assert text.index("tool_declare") < text.index("You are a helpful assistant.")
    assert ids[0] == ID["<|im_system|>"]


def test_list_of_parts_equals_string_content(tok: Any) -> None:
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 2?"}]
    assert render(tok, [{"role": "user", "content": parts}]) == render(tok, USER)


def test_assistant_history_and_tool_calls(tok: Any) -> None:
    call: dict[str, Any] = {
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"t": -3}'},
    ]
    text, ids = render(tok, messages, tools=[WEATHER_TOOL])
    assert (
        "<|im_assistant|>assistant<|im_middle|><think></think><|tool_calls_section_begin|>"
        "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    ) in text
    assert (
        '<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n{"t": -3}<|im_end|>'
        in text
    )
    for token in [
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "<|tool_calls_section_end|>",
    ]:
        assert ids.count(ID[token]) == 1
    # Arguments given as an object render like the equivalent JSON string.
    as_dict = {**call, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages[1] = {**messages[1], "tool_calls": [as_dict]}
    assert render(tok, messages, tools=[WEATHER_TOOL])[0] == text


def test_assistant_reasoning_is_kept_when_given(tok: Any) -> None:
    history = [
        *USER,
        {"role": "assistant", "content": "4", "reasoning_content": "2 + 2 = 4"},
        {"role": "user", "content": "And 3 + 3?"},
    ]
    text, _ = render(tok, history)
    assert "<|im_middle|><think>2 + 2 = 4</think>4<|im_end|>" in text
    history[1] = {"role": "assistant", "content": "4"}
    assert "<|im_middle|><think></think>4<|im_end|>" in render(tok, history)[0]


def random_text(rng: random.Random, length: int) -> str:
    """Random code points from several planes, skipping surrogates."""
    out = []
    for _ in range(length):
        hi = rng.choice([0x7F, 0x7FF, 0xFFFF, 0x10FFFF])
        cp = rng.randint(0, hi)
        out.append(chr(cp) if not 0xD800 <= cp <= 0xDFFF else " ")
    return "".join(out)


@pytest.mark.parametrize(
    "text",
    [
        "plain English, with punctuation!",
        "  leading spaces\ttabs\r\nand trailing  ",
        "café naïve Zürich — “quotes” ∑ x² ≤ ∞",
        "中文 日本語 한국어 العربية हिन्दी 🙂🚀👩‍💻",
        "e\u0301 combining, \u200b zero width, \x00 nul",
        "a literal <think> tag and <|im_end|> inside text",
        *[random_text(random.Random(seed), 200) for seed in range(5)],
    ],
)
def test_decode_encode_round_trip(tok: Any, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    decoded = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert decoded == text


def run_script(script: str, out: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )


def test_tokenizer_build_is_reproducible(tmp_path: Path) -> None:
    run_script("build_tokenizer.py", tmp_path)
    shipped = sorted(p.name for p in TOKENIZER_DIR.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == shipped
    for name in shipped:
        assert (tmp_path / name).read_bytes() == (TOKENIZER_DIR / name).read_bytes(), name


def test_sample_dataset_build_is_reproducible(tmp_path: Path) -> None:
    run_script("build_sample_dataset.py", tmp_path / "chat.jsonl")
    assert (tmp_path / "chat.jsonl").read_bytes() == SAMPLE_DATASET.read_bytes()


def test_sample_dataset_rows_are_distinct_and_template(tok: Any) -> None:
    lines = SAMPLE_DATASET.read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 300
    assert len(set(lines)) == 300
    firsts = [
        json.dumps(next(m["content"] for m in r["messages"] if m["role"] == "user")) for r in rows
    ]
    assert len(set(firsts)) == 300
    assert sum("tools" in r for r in rows) == 30
    assert any(m.get("tool_calls") for r in rows for m in r["messages"])
    for row in rows:
        _, ids = render(tok, row["messages"], tools=row.get("tools"))
        assert ids[-1] == ID["<think>"]
