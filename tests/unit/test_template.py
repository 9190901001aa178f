"""The Templater renders and tokenizes exactly as transformers does, for every sample row."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from eaglegen.assets import TOKENIZER_DIR
from producer.rows import to_prompt
from producer.template import Templater
from tests.helpers import sample_rows

# transformers alone, in a process that never built a Templater: the reference rendering.
REFERENCE = textwrap.dedent("""
    import json, sys
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
    kwargs = json.loads(sys.argv[2])
    out = []
    for line in sys.stdin:
        prompt = json.loads(line)
        text = tokenizer.apply_chat_template(
            prompt["messages"], tools=prompt["tools"], add_generation_prompt=True,
            tokenize=False, **kwargs,
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append({"text": text, "ids": ids})
    print(json.dumps(out))
""")


def reference(prompts: list[dict[str, Any]], kwargs: dict[str, Any], tmp_path: Path) -> Any:
    script = tmp_path / "reference.py"
    script.write_text(REFERENCE)
    result = subprocess.run(
        [sys.executable, str(script), str(TOKENIZER_DIR), json.dumps(kwargs)],
        input="".join(json.dumps(p) + "\n" for p in prompts),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout)


def with_reasoning_history(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Multi-turn rows whose earlier assistant turns carry their reasoning, under each of
    the names transformers copies into the others."""
    out = []
    names = ["reasoning_content", "thinking", "reasoning"]
    for row in rows:
        turns = row.get("messages") or []
        roles = [turn.get("role") for turn in turns]
        if "assistant" not in roles[:-1] or roles[-1] == "assistant":
            continue  # no assistant turn that stays in the prompt
        name = names[len(out) % 3]
        history = [
            {**turn, name: f"I think ({i})"} if turn.get("role") == "assistant" else turn
            for i, turn in enumerate(turns)
        ]
        out.append({**row, "messages": history})
    assert len(out) >= 3
    return out[:9]


@pytest.mark.parametrize("kwargs", [{}, {"thinking": False}])
def test_render_and_encode_equal_a_fresh_transformers(
    kwargs: dict[str, Any], tmp_path: Path
) -> None:
    rows = sample_rows(300)
    prompts = [to_prompt(row) for row in rows + with_reasoning_history(rows)]
    assert any(p.tools for p in prompts) and any(len(p.messages) > 3 for p in prompts)
    templater = Templater(TOKENIZER_DIR, template_kwargs=kwargs)
    assert templater.renders_directly  # the fast path is what must equal transformers here
    texts = templater.render_many(prompts)
    ids = templater.encode_batch([str(t) for t in texts])
    expected = reference(
        [{"messages": p.messages, "tools": p.tools} for p in prompts], kwargs, tmp_path
    )
    assert texts == [e["text"] for e in expected]
    assert ids == [e["ids"] for e in expected]


def test_a_direct_render_that_disagrees_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    from producer import template

    def render_otherwise(self: Any, messages: list[dict[str, Any]]) -> str:
        return f"not the template {len(messages)}"

    monkeypatch.setattr(template._DirectRenderer, "_render", render_otherwise)
    templater = Templater(TOKENIZER_DIR)
    assert not templater.renders_directly
    prompts = [to_prompt(row) for row in sample_rows(20)]
    expected = [
        templater.tokenizer.apply_chat_template(
            p.messages, tools=p.tools, add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    assert templater.render_many(prompts) == expected
