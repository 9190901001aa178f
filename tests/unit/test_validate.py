"""The response checks of docs/design.md §5: a violation is an error, never stored data."""

from __future__ import annotations

from typing import Any

import pytest

from worker.retry import AttemptError, ErrorKind
from worker.validate import Request, check_response, stop_ids

STOP = 4
PROMPT = [7, 8, 9]
SENT = Request(PROMPT, rid="1", max_new_tokens=16, vocab_size=1000)


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
    record = check_response(body([100, 101, STOP]), SENT, "sim")
    assert record.output_ids == [100, 101, STOP]
    assert (record.finish_type, record.finish_matched) == ("stop", STOP)
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (3, 3, 2)
    assert record.server == "sim"


def test_length_finish_records_the_length() -> None:
    record = check_response(
        body([100, 101], finish_reason={"type": "length", "length": 2}), SENT, "sim"
    )
    assert (record.finish_type, record.finish_matched) == ("length", 2)


@pytest.mark.parametrize(
    ("response", "needle"),
    [
        (body([100, STOP], completion_tokens=5), "completion_tokens=5"),
        (body([100, STOP], prompt_tokens=5), "prompt_tokens=5"),
        (body([100, STOP], finish_reason={"type": "weird"}), "unknown finish_reason"),
        (body([100, 101]), "not the last output id"),
        ({"text": "no ids", "meta_info": {"id": "1"}}, "output_ids missing"),
        ([1, 2], "expected a JSON object"),
        # JSON booleans are ints to Python: `true` must not pass as token id 1.
        (body([100, True, STOP]), "not a list of integers"),
        (body([100, 1.0, STOP]), "not a list of integers"),
        (body([100, -3, STOP]), "output id -3 is negative"),
        (body([100, 1000, STOP]), "output id 1000 is beyond the tokenizer's 1000 ids"),
        (body([100] * 16 + [STOP]), "completion_tokens=17 > max_new_tokens=16"),
        (body([100, STOP], completion_tokens=True), "completion_tokens=True"),
        (body([100, STOP], prompt_tokens=3.0), "prompt_tokens=3.0"),
        (body([100, STOP], cached_tokens=-1), "cached_tokens=-1"),
        (body([100, STOP], e2e_latency="fast"), "e2e_latency='fast'"),
        (body([100, STOP], e2e_latency=float("nan")), "e2e_latency=nan"),
    ],
)
def test_violations_fail_without_retry(response: Any, needle: str) -> None:
    with pytest.raises(AttemptError) as info:
        check_response(response, SENT, "sim")
    assert needle in str(info.value)
    assert info.value.retryable is False


def test_leaked_prompt_tokens_are_caught() -> None:
    # Some SGLang versions prepended the prompt to output_ids and counted it.
    leaked = [*PROMPT, 100, STOP]
    with pytest.raises(AttemptError, match="completion_tokens"):
        check_response(body(leaked, completion_tokens=2), SENT, "sim")


def test_abort_is_retryable() -> None:
    with pytest.raises(AttemptError) as info:
        check_response(body([100], finish_reason={"type": "abort", "message": "oom"}), SENT, "sim")
    assert info.value.retryable is True


def test_an_answer_to_another_request_is_refused_and_retried() -> None:
    # A correct-looking answer for rid 2 (a proxy mix-up) is not this job's data; the job
    # itself is fine, so it is tried again.
    with pytest.raises(AttemptError, match="response for request '2', not for '1'") as info:
        check_response(body([100, STOP], id="2"), SENT, "sim")
    assert info.value.retryable is True
    with pytest.raises(AttemptError, match="response for request None"):
        check_response(body([100, STOP], id=None), SENT, "sim")


def test_a_run_without_a_recorded_vocabulary_still_refuses_negative_ids() -> None:
    older = Request(PROMPT, rid="1")
    assert check_response(body([10**6, STOP]), older, "sim").output_ids == [10**6, STOP]
    with pytest.raises(AttemptError, match="negative"):
        check_response(body([-1, STOP]), older, "sim")


EOS = 5  # a second stop id, as a model's generation_config may list
STOPPING = Request(PROMPT, rid="1", max_new_tokens=16, stop_token_ids=frozenset({STOP, EOS}))


def test_a_stop_on_one_of_the_run_s_stop_ids_is_stored() -> None:
    for stop in (STOP, EOS):
        finish = {"type": "stop", "matched": stop}
        record = check_response(body([100, stop], finish_reason=finish), STOPPING, "sim")
        assert record.finish_matched == stop


def test_a_stop_on_a_token_the_run_does_not_stop_at_is_refused_and_retried() -> None:
    # The last id, as a stop must be, but not one the job sent nor the run's eos.
    finish = {"type": "stop", "matched": 101}
    with pytest.raises(AttemptError) as info:
        check_response(body([100, 101], finish_reason=finish), STOPPING, "sim")
    assert "finish matched token 101, which is not one of the run's stop ids [4, 5]" in str(
        info.value
    )
    assert (info.value.retryable, info.value.kind) == (True, ErrorKind.INVALID_RESPONSE)


@pytest.mark.parametrize("matched", ["</answer>", "NaN happened", None])
def test_a_stop_string_or_no_match_is_not_checked_against_ids(matched: object) -> None:
    finish = {"type": "stop", "matched": matched}
    record = check_response(body([100, 101], finish_reason=finish), STOPPING, "sim")
    assert (record.finish_type, record.finish_matched) == ("stop", None)


def test_the_stop_ids_come_from_the_params_sent_and_are_not_checked_without_them() -> None:
    assert stop_ids({"stop_token_ids": [4, 5], "max_new_tokens": 8}) == {4, 5}
    # No list to check by: the server stops at its model's eos ids, which the job never named.
    for params in (
        {},
        {"stop_token_ids": []},
        {"stop_token_ids": None},
        {"stop_token_ids": [True]},
    ):
        assert stop_ids(params) is None
    unchecked = Request(PROMPT, rid="1", stop_token_ids=stop_ids({}))
    finish = {"type": "stop", "matched": 101}
    assert (
        check_response(body([100, 101], finish_reason=finish), unchecked, "sim").finish_matched
        == 101
    )
