"""Checks every SGLang response before it may be stored (docs/design.md §5). Pure, no I/O.

Nothing a server sends is trusted: a body that breaks any check is a failed attempt with
the reason, never data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from models.records import GenerationRecord
from worker.retry import AttemptError, ErrorKind

FINISH_TYPES = frozenset({"stop", "length", "abort"})


@dataclass(frozen=True)
class Request:
    """What the request sent implies about a correct answer to it."""

    input_ids: Sequence[int]
    rid: str
    max_new_tokens: int | None = None
    # The run's tokenizer size; None for runs stored before it was recorded.
    vocab_size: int | None = None
    # The stop_token_ids sent (``stop_ids``); None when the params hold none to check by.
    stop_token_ids: frozenset[int] | None = None


def stop_ids(sampling_params: Mapping[str, Any]) -> frozenset[int] | None:
    """The ``stop_token_ids`` a job sends, or None when it sends no list of them.

    SGLang also stops on the model's own eos ids (generation_config and tokenizer); the
    stored default is meant to hold them. Params without stop_token_ids at all (a run file
    that removed them, a database edited by hand) leave only the server's eos ids to stop
    at, which the worker does not know: a stop is then not checked against ids.
    """
    ids = sampling_params.get("stop_token_ids")
    if not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids):
        return None
    return frozenset(ids)


def _fail(reason: str) -> AttemptError:
    # Invariant violations are not retried: the same server would most likely repeat them.
    return AttemptError(
        f"invalid response: {reason}", retryable=False, kind=ErrorKind.INVALID_RESPONSE
    )


def _is_int(value: object) -> TypeGuard[int]:
    """An integer, not a boolean (JSON `true` is an int to Python)."""
    return type(value) is int


def _is_number(value: object) -> bool:
    """A finite int or float, not a boolean."""
    return type(value) in (int, float) and math.isfinite(value)  # type: ignore[arg-type]


def check_response(body: Any, sent: Request, server: str) -> GenerationRecord:
    """Turn a /generate response into a record, or raise AttemptError naming the violation."""
    if not isinstance(body, dict):
        raise _fail(f"expected a JSON object, got {type(body).__name__}")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise _fail("meta_info missing")
    if meta.get("id") != sent.rid:
        # Someone else's answer (a proxy or server mix-up), not a property of this job.
        raise AttemptError(
            f"response for request {meta.get('id')!r}, not for {sent.rid!r}",
            retryable=True,
            kind=ErrorKind.INVALID_RESPONSE,
        )
    output_ids = _output_ids(body.get("output_ids"), sent.vocab_size)
    finish = meta.get("finish_reason")
    finish_type = finish.get("type") if isinstance(finish, dict) else None
    if finish_type not in FINISH_TYPES:
        raise _fail(f"unknown finish_reason {finish!r}")
    assert isinstance(finish, dict)
    if finish_type == "abort":
        raise AttemptError(
            f"server aborted the request: {finish.get('message')}",
            retryable=True,
            kind=ErrorKind.ABORTED,
        )
    prompt, completion = _counts(meta, output_ids, sent)
    matched = finish.get("matched", finish.get("length"))
    if finish_type == "stop" and _is_int(matched):
        _check_stop_token(matched, output_ids, sent)
    return GenerationRecord(
        output_ids=output_ids,
        finish_type=finish_type,
        finish_matched=matched if _is_int(matched) else None,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=int(_non_negative(meta, "cached_tokens")),
        e2e_latency=_non_negative(meta, "e2e_latency"),
        server=server,
        meta_info=meta,
    )


def _check_stop_token(matched: int, output_ids: list[int], sent: Request) -> None:
    """A stop on a token: the last output id, and one of the ids the job stops at.

    SGLang reports a stop token id and an eos id alike (``{"type": "stop", "matched": id}``);
    a stop string or SGLang's own "NaN happened" has a str ``matched`` and is not checked.
    """
    if output_ids[-1:] != [matched]:
        raise _fail(f"finish matched token {matched} is not the last output id")
    if sent.stop_token_ids is not None and matched not in sent.stop_token_ids:
        # Retried, unlike the other invariants: a stop the run does not know says more about
        # the server than the job (started on another model or with other eos ids), and
        # another attempt, maybe on another server, can stop where the run stops.
        raise AttemptError(
            f"invalid response: finish matched token {matched}, which is not one of the "
            f"run's stop ids {sorted(sent.stop_token_ids)}",
            retryable=True,
            kind=ErrorKind.INVALID_RESPONSE,
        )


def _output_ids(value: object, vocab_size: int | None) -> list[int]:
    """The output ids, each an integer the run's tokenizer can decode."""
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise _fail("output_ids missing or not a list of integers")
    if value:
        low, high = min(value), max(value)
        if low < 0:
            raise _fail(f"output id {low} is negative")
        if vocab_size is not None and high >= vocab_size:
            raise _fail(f"output id {high} is beyond the tokenizer's {vocab_size} ids")
    return value


def _counts(meta: dict[str, Any], output_ids: list[int], sent: Request) -> tuple[int, int]:
    """prompt_tokens and completion_tokens, consistent with what was sent and received."""
    completion = meta.get("completion_tokens")
    prompt = meta.get("prompt_tokens")
    if not _is_int(completion) or completion != len(output_ids):
        raise _fail(f"len(output_ids)={len(output_ids)} != completion_tokens={completion!r}")
    if not _is_int(prompt) or prompt != len(sent.input_ids):
        raise _fail(f"prompt_tokens={prompt!r} != len(input_ids)={len(sent.input_ids)}")
    if sent.max_new_tokens is not None and completion > sent.max_new_tokens:
        raise _fail(f"completion_tokens={completion} > max_new_tokens={sent.max_new_tokens}")
    return prompt, completion


def _non_negative(meta: dict[str, Any], key: str) -> float:
    """A non-negative number SGLang may leave out (0 then)."""
    value = meta.get(key)
    if value is None:
        return 0.0
    if not _is_number(value) or value < 0:
        raise _fail(f"{key}={value!r} is not a non-negative number")
    return float(value)
