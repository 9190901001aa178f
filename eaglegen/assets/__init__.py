"""Bundled assets: the tiny tokenizer, its chat template and the sample dataset."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ASSETS_DIR: Path = Path(__file__).resolve().parent
TOKENIZER_DIR: Path = ASSETS_DIR / "tokenizer"
CHAT_TEMPLATE: Path = ASSETS_DIR / "chat_template.jinja"
SAMPLE_DATASET: Path = ASSETS_DIR / "sample" / "chat.jsonl"

__all__ = [
    "ASSETS_DIR",
    "CHAT_TEMPLATE",
    "SAMPLE_DATASET",
    "TOKENIZER_DIR",
    "SpecialIds",
    "special_ids",
]


@dataclass(frozen=True)
class SpecialIds:
    """Token ids the simulator and worker need to build and check generations."""

    bos: int
    pad: int
    im_end: int
    think_start: int
    think_end: int
    tool_calls_section_begin: int
    tool_calls_section_end: int
    tool_call_begin: int
    tool_call_argument_begin: int
    tool_call_end: int
    vocab_size: int

    @property
    def stop(self) -> int:
        """The end-of-turn token a generation stops on."""
        return self.im_end


def special_ids(tokenizer_dir: Path = TOKENIZER_DIR) -> SpecialIds:
    """Read the special-token ids from tokenizer.json (json only, no transformers import)."""
    path = tokenizer_dir / "tokenizer.json"
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    added = {t["content"]: int(t["id"]) for t in data.get("added_tokens", [])}
    vocab: dict[str, int] = data["model"]["vocab"]

    def find(token: str) -> int:
        if token in added:
            return added[token]
        raise ValueError(f"{path}: special token {token!r} is missing")

    # Added tokens may sit outside the model vocab, so the size is the highest id plus one.
    vocab_size = max([*vocab.values(), *added.values()]) + 1
    return SpecialIds(
        bos=find("[BOS]"),
        pad=find("[PAD]"),
        im_end=find("<|im_end|>"),
        think_start=find("<think>"),
        think_end=find("</think>"),
        tool_calls_section_begin=find("<|tool_calls_section_begin|>"),
        tool_calls_section_end=find("<|tool_calls_section_end|>"),
        tool_call_begin=find("<|tool_call_begin|>"),
        tool_call_argument_begin=find("<|tool_call_argument_begin|>"),
        tool_call_end=find("<|tool_call_end|>"),
        vocab_size=vocab_size,
    )
