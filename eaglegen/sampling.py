"""Sampling params sent to SGLang: all explicit, since server defaults come from the model."""

from __future__ import annotations

from typing import Any

DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 4096,
    "temperature": 1.0,
    "top_p": 0.95,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "ignore_eos": False,
    "skip_special_tokens": False,
}


def complete(overrides: dict[str, Any], stop_token_ids: list[int]) -> dict[str, Any]:
    """Defaults, then the stop ids of the tokenizer, then the user's values."""
    unknown = set(overrides) - set(DEFAULTS) - {"stop_token_ids"}
    if unknown:
        raise ValueError(f"unknown sampling params: {sorted(unknown)}")
    return {**DEFAULTS, "stop_token_ids": list(stop_token_ids), **overrides}
