"""One sampling table: what the producer accepts is what the worker sends, and no more."""

from __future__ import annotations

from typing import Any

import pytest

from core import sampling
from core.settings import ServerSpec
from worker.retry import AttemptError
from worker.sglang import SGLangClient

# A value of the right type for each key a run file may set.
EXAMPLES: dict[str, Any] = {
    "max_new_tokens": 16,
    "temperature": 0.6,
    "top_p": 1,
    "top_k": 20,
    "min_p": 0.05,
    "frequency_penalty": 0.1,
    "presence_penalty": 0.1,
    "repetition_penalty": 1.05,
    "ignore_eos": True,
    "skip_special_tokens": False,
    "stop_token_ids": [3, 4],
    "min_new_tokens": 2,
    "stop": ["</answer>"],
    "spaces_between_special_tokens": False,
    "sampling_seed": 7,
    "no_stop_trim": True,
}


def client() -> SGLangClient:
    # Nothing listens there: a refusal must come before any request is made.
    return SGLangClient(ServerSpec(name="s", url="http://127.0.0.1:9"), timeout_s=1)


def test_every_settable_key_is_accepted_and_would_be_sent() -> None:
    settable = {p.name for p in sampling.PARAMS if p.settable}
    assert settable == set(EXAMPLES)
    params = sampling.complete(EXAMPLES, stop_token_ids=[9])
    assert params == {**sampling.DEFAULTS, **EXAMPLES}
    assert sampling.unsendable(params) == []


def test_defaults_are_sent_explicitly_with_the_tokenizers_stop_ids() -> None:
    params = sampling.complete({"max_new_tokens": 128}, stop_token_ids=[4])
    assert params == {**sampling.DEFAULTS, "max_new_tokens": 128, "stop_token_ids": [4]}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n": 2}, "'n' cannot be set: one job is one sample"),
        ({"temprature": 0.5}, "unknown sampling param 'temprature'"),
        ({"temperature": "hot"}, "'temperature' must be int or float"),
        ({"temperature": True}, "'temperature' must be int or float"),
        ({"max_new_tokens": 1.5}, "'max_new_tokens' must be int"),
    ],
)
def test_the_producer_refuses_what_the_table_refuses(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        sampling.complete(overrides, stop_token_ids=[4])


def test_the_worker_refuses_stored_params_outside_the_table() -> None:
    for stored in ({"n": 2}, {"max_new_tokens": 4, "best_of": 2}):
        with pytest.raises(AttemptError, match="must not get") as info:
            client().generate([1, 2], stored, rid="1")
        assert not info.value.retryable
