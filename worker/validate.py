"""Checks every SGLang response before it may be stored (DESIGN §5). Pure, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from models.records import GenerationRecord
from worker.retry import AttemptError

FINISH_TYPES = frozenset({"stop", "length", "abort"})


def _fail(reason: str) -> AttemptError:
    # Invariant violations are not retried: the same server would most likely repeat them.
    return AttemptError(f"invalid response: {reason}", retryable=False)


def check_response(body: Any, input_ids: Sequence[int], server: str) -> GenerationRecord:
    """Turn a /generate response into a record, or raise AttemptError naming the violation."""
    if not isinstance(body, dict):
        raise _fail(f"expected a JSON object, got {type(body).__name__}")
    output_ids = body.get("output_ids")
    meta = body.get("meta_info")
    if not isinstance(output_ids, list) or not all(isinstance(t, int) for t in output_ids):
        raise _fail("output_ids missing or not a list of ints")
    if not isinstance(meta, dict):
        raise _fail("meta_info missing")
    finish = meta.get("finish_reason")
    finish_type = finish.get("type") if isinstance(finish, dict) else None
    if finish_type not in FINISH_TYPES:
        raise _fail(f"unknown finish_reason {finish!r}")
    assert isinstance(finish, dict)
    if finish_type == "abort":
        raise AttemptError(f"server aborted the request: {finish.get('message')}", retryable=True)
    completion = meta.get("completion_tokens")
    prompt = meta.get("prompt_tokens")
    if completion != len(output_ids):
        raise _fail(f"len(output_ids)={len(output_ids)} != completion_tokens={completion}")
    if prompt != len(input_ids):
        raise _fail(f"prompt_tokens={prompt} != len(input_ids)={len(input_ids)}")
    if (
        finish_type == "stop"
        and isinstance(finish.get("matched"), int)
        and (not output_ids or output_ids[-1] != finish["matched"])
    ):
        raise _fail(f"finish matched token {finish['matched']} is not the last output id")
    return GenerationRecord(
        output_ids=output_ids,
        finish_type=finish_type,
        finish_matched=finish.get("matched", finish.get("length")),
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=int(meta.get("cached_tokens") or 0),
        e2e_latency=float(meta.get("e2e_latency") or 0.0),
        server=server,
        meta_info=meta,
    )
