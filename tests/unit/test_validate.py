"""The response checks of DESIGN §5: a violation is an error, never stored data."""

from __future__ import annotations

from typing import Any

import pytest

from worker.retry import AttemptError
from worker.validate import check_response

STOP = 4
PROMPT = [7, 8, 9]


def body(output_ids: list[int], **meta: Any) -> dict[str, Any]:
    info: dict[str, Any] = {
        "id": "1",
        "finish_reason": {"type": "stop", "matched": STOP},
        "prompt_tokens": len(PROMPT),
        "completion_tokens": len(output_ids),
        "cached_tokens": 2,
        "e2e_latency": 0.5,
    }
    info.update(meta)
    return {"text": "x", "output_ids": output_ids, "meta_info": info}


def test_valid_stop_response_becomes_a_record() -> None:
    record = check_response(body([100, 101, STOP]), PROMPT, "sim")
    assert record.output_ids == [100, 101, STOP]
    assert (record.finish_type, record.finish_matched) == ("stop", STOP)
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (3, 3, 2)
    assert record.server == "sim"


def test_length_finish_records_the_length() -> None:
    record = check_response(
        body([100, 101], finish_reason={"type": "length", "length": 2}), PROMPT, "sim"
    )
    assert (record.finish_type, record.finish_matched) == ("length", 2)


@pytest.mark.parametrize(
    ("response", "needle"),
    [
        (body([100, STOP], completion_tokens=5), "completion_tokens=5"),
        (body([100, STOP], prompt_tokens=5), "prompt_tokens=5"),
        (body([100, STOP], finish_reason={"type": "weird"}), "unknown finish_reason"),
        (body([100, 101]), "not the last output id"),
        ({"text": "no ids"}, "output_ids missing"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_violations_fail_without_retry(response: Any, needle: str) -> None:
    with pytest.raises(AttemptError) as info:
        check_response(response, PROMPT, "sim")
    assert needle in str(info.value)
    assert info.value.retryable is False


def test_leaked_prompt_tokens_are_caught() -> None:
    # Some SGLang versions prepended the prompt to output_ids and counted it.
    leaked = [*PROMPT, 100, STOP]
    with pytest.raises(AttemptError, match="completion_tokens"):
        check_response(body(leaked, completion_tokens=2), PROMPT, "sim")


def test_abort_is_retryable() -> None:
    with pytest.raises(AttemptError) as info:
        check_response(
            body([100], finish_reason={"type": "abort", "message": "oom"}), PROMPT, "sim"
        )
    assert info.value.retryable is True
