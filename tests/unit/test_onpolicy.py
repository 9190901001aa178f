"""The next turn's prompt (core.onpolicy.next_turn) for two families' real chat templates:
Kimi-K2's, and Qwen3's, which drops the reasoning of answers before the last user turn.

The expected prompt is written by hand as the messages a deployed server would hold (the
model's answer in the row's answer's place, with its reasoning and content) and rendered by
transformers' own ``apply_chat_template``: no eaglegen code makes the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from core.dialogue import TOO_LONG, TOOL_DIVERGENCE, TRUNCATED
from core.onpolicy import Answer, next_turn
from core.tokenizer import RunTokenizer
from core.turns import Prompt
from eaglegen.assets import TOKENIZER_DIR
from tests.helpers import family_tokenizer

ROW = [
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "The dataset's answer."},
    {"role": "user", "content": "And of Italy?"},
]


WRITTEN_BACK = {
    "kimi_k2": ("\nThe user asks a capital.\n", "\n\nParis."),
    "qwen3": ("The user asks a capital.", "Paris."),
}


@pytest.fixture(params=["kimi_k2", "qwen3"], scope="module")
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "kimi_k2":
        return TOKENIZER_DIR
    return family_tokenizer(tmp_path_factory.mktemp("tok"), str(request.param), structure=True)


def answer_ids(
    hf: Any, tok: RunTokenizer, reasoning: str, content: str, *, opens: bool
) -> list[int]:
    """What the model wrote: its reasoning (opened by itself unless the prompt ``opens``
    it) closed by think-end, the answer, and the family's stop token."""
    think_start = tok.tokenizer.convert_tokens_to_ids("<think>")
    think_end = tok.tokenizer.convert_tokens_to_ids("</think>")
    stop = tok.family.stop_ids(tok.vocab)[0]
    return [
        *([] if opens else [think_start]),
        *hf.encode(reasoning, add_special_tokens=False),
        think_end,
        *hf.encode(content, add_special_tokens=False),
        stop,
    ]


def test_the_next_prompt_is_the_history_with_the_models_own_answer(folder: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tok = RunTokenizer(folder)
    stops = tok.family.stop_ids(tok.vocab)
    first = hf.encode(
        hf.apply_chat_template(ROW[:1], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    opens = tok.opens_reasoning(first)
    output = answer_ids(hf, tok, "\nThe user asks a capital.\n", "\n\nParis.", opens=opens)
    step = next_turn(
        tok,
        Prompt(ROW, None),
        [Answer(output, opens, "stop")],
        stops,
        points=2,
        max_new_tokens=64,
        max_context_len=None,
    )
    assert step.input_ids is not None and step.ended is None
    # The answer as its family's template takes an answer back: Kimi-K2's as written, white
    # space and all; Qwen3's without the new lines its template puts around it (its own
    # parsing of an answer strips them, as its server's reasoning parser does).
    reasoning, content = WRITTEN_BACK[tok.family.name]
    said = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    expected = hf.apply_chat_template(
        [ROW[0], said, ROW[2]], add_generation_prompt=True, tokenize=False
    )
    assert step.input_ids == hf.encode(expected, add_special_tokens=False)
    text = hf.decode(step.input_ids)
    assert "Paris." in text and "The dataset's answer." not in text
    if tok.family.name == "qwen3":  # its template drops reasoning before the last user turn
        assert "The user asks a capital." not in text
    else:  # Kimi-K2's keeps it: the next prompt extends the turn before, id for id
        assert step.input_ids[: len(first) + len(output)] == first + output


def test_a_cut_answer_a_diverging_call_and_a_long_prompt_end_the_conversation() -> None:
    tok = RunTokenizer(TOKENIZER_DIR)
    hf = tok.tokenizer
    output = hf.encode("Paris.", add_special_tokens=False)

    def step(row: list[dict[str, Any]], finish: str = "stop", context: int | None = None) -> Any:
        answer = Answer(output, False, finish)
        return next_turn(
            tok, Prompt(row, None), [answer], (), points=2, max_new_tokens=64,
            max_context_len=context,
        )  # fmt: skip

    assert step(ROW, "length").ended == TRUNCATED
    assert step(ROW, context=70).ended == TOO_LONG
    called = [
        ROW[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "42"},
        {"role": "user", "content": "Thanks."},
    ]
    # The row's tool result answers a call the model did not make: the conversation ends.
    assert step(called).ended == TOOL_DIVERGENCE
