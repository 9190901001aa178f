"""The run tokenizer (core/tokenizer.py): renders and encodes as transformers does for each
family's test tokenizer, stops where SGLang stops, and reads a generation in its family."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from core.tokenizer import RunTokenizer, stored_stop_ids
from eaglegen.assets import TOKENIZER_DIR
from producer.rows import to_prompt
from tests.helpers import family_tokenizer, sample_rows

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TURN = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Look it up.",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
            }
        ],
    },
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Each family's test tokenizer folder, built once for the module on first use."""
    root = tmp_path_factory.mktemp("run-tokenizers")

    def get(family: str) -> Path:
        if family == "kimi_k2":
            return TOKENIZER_DIR
        folder = root / family
        return folder if folder.exists() else family_tokenizer(root, family, structure=True)

    return get


def reference(folder: Path, messages: list[dict[str, Any]], tools: Any, prompt: bool) -> Any:
    """transformers' own rendering to ids, from a tokenizer loaded apart."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=prompt, tokenize=True, return_dict=False
    )
    return list(ids)


@pytest.mark.parametrize("family", ["kimi_k2", "qwen3", "glm45"])
def test_render_and_encode_equal_transformers_apply_chat_template(
    folders: Callable[[str], Path], family: str
) -> None:
    folder = folders(family)
    tok = RunTokenizer(folder)
    prompts = [to_prompt(row) for row in sample_rows(40)]
    assert any(p.tools for p in prompts)
    rendered = 0
    for p in prompts[:12]:
        try:
            expected = reference(folder, p.messages, p.tools, True)
        except Exception:  # the family's template refuses the row (GLM: string arguments)
            with pytest.raises(Exception):  # noqa: B017 (jinja raises many types)
                tok.render_chat(p.messages, p.tools, add_generation_prompt=True)
            continue
        text = tok.render_chat(p.messages, p.tools, add_generation_prompt=True)
        assert tok.encode(text) == expected
        rendered += 1
    assert rendered >= 6
    # A whole turn without the generation prompt (what a round trip renders).
    whole = tok.render_chat(TURN, TOOLS, add_generation_prompt=False)
    assert tok.encode(whole) == reference(folder, TURN, TOOLS, False)
    plain = [p.messages for p in prompts if p.tools is None][:5]
    texts = tok.render_chats(plain, add_generation_prompt=True)
    assert tok.encode_batch(texts) == [reference(folder, m, None, True) for m in plain]


@pytest.mark.parametrize(
    ("family", "detected"), [("kimi_k2", "kimi_k2"), ("qwen3", "qwen3"), ("glm45", "glm45")]
)
def test_the_family_is_detected_from_the_tokenizer_or_named(
    folders: Callable[[str], Path], family: str, detected: str
) -> None:
    tok = RunTokenizer(folders(family))
    assert (tok.family.name, tok.family_named) == (detected, False)
    assert tok.markers().calls_checked and tok.markers().call_ids
    named = RunTokenizer(folders(family), family="unknown")
    assert (named.family.name, named.family_named) == ("unknown", True)
    assert not named.markers().calls_checked and not named.markers().call_ids


def test_a_qwen3_generation_is_read_in_its_family(folders: Callable[[str], Path]) -> None:
    tok = RunTokenizer(folders("qwen3"))
    stop = tok.vocab["<|im_end|>"]
    text = (
        '<think>\nHm.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Oslo"}}\n</tool_call><|im_end|>'
    )
    read = tok.read(tok.encode(text), [stop], opens_reasoning=False, declared={"get_weather"})
    assert tok.decode(read.anatomy.reasoning or ()) == "\nHm.\n"
    [call] = read.calls
    assert (call.name, call.arguments, call.declared) == ("get_weather", '{"city": "Oslo"}', True)
    assert read.anatomy.stop == stop


def copy_of(folder: Path, tmp_path: Path, **configs: Any) -> Path:
    out = tmp_path / "tok"
    shutil.copytree(folder, out)
    for name, config in configs.items():
        (out / f"{name}.json").write_text(json.dumps(config))
    return out


def test_default_stop_ids_are_what_sglang_stops_at_each_once(tmp_path: Path) -> None:
    eos = RunTokenizer(TOKENIZER_DIR).tokenizer.eos_token_id
    assert RunTokenizer(TOKENIZER_DIR).default_stop_ids() == [eos]
    folder = copy_of(
        TOKENIZER_DIR,
        tmp_path,
        generation_config={"eos_token_id": [7, eos]},
        config={"eos_token_id": 9},
    )
    # generation_config.json's, then config.json's, then the tokenizer's: a union.
    assert RunTokenizer(folder).default_stop_ids() == [7, eos, 9]


def test_a_generation_config_with_one_eos_id_is_taken_with_the_tokenizer_s(
    tmp_path: Path,
) -> None:
    folder = copy_of(TOKENIZER_DIR, tmp_path, generation_config={"eos_token_id": 5})
    tok = RunTokenizer(folder)
    assert tok.default_stop_ids() == [5, tok.tokenizer.eos_token_id]


def test_a_broken_model_config_is_one_clear_error(tmp_path: Path) -> None:
    folder = copy_of(TOKENIZER_DIR, tmp_path)
    (folder / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"generation_config\.json: cannot read the model's eos"):
        RunTokenizer(folder).default_stop_ids()


def test_the_stored_stop_ids_are_the_integers_a_dataset_stored() -> None:
    assert stored_stop_ids({"stop_token_ids": [3, 4]}) == (3, 4)
    assert stored_stop_ids({"stop_token_ids": [3, "x", True]}) == (3,)
    assert stored_stop_ids({"max_new_tokens": 9}) == ()


def test_the_template_is_checked_against_the_one_the_run_recorded() -> None:
    tok = RunTokenizer(TOKENIZER_DIR)
    assert tok.template_matches_run  # none recorded: nothing to compare
    same = RunTokenizer(TOKENIZER_DIR, recorded_template_sha256=tok.chat_template_sha256())
    assert same.template_matches_run
    assert not RunTokenizer(TOKENIZER_DIR, recorded_template_sha256="b" * 64).template_matches_run


def test_harmony_has_no_think_pair(folders: Callable[[str], Path]) -> None:
    tok = RunTokenizer(folders("gpt_oss"))
    assert tok.family.name == "gpt_oss"
    assert tok.think_pair is None and tok.think_end_id() is None
    assert not tok.opens_reasoning(tok.encode("<|start|>assistant"))
