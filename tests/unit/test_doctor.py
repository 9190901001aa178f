"""The doctor's verdicts on one /generate answer, from hand-made answers."""

from __future__ import annotations

from typing import Any

from eaglegen.doctor import Check, Probe, judge_generation, leaked_prompt

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
THINK_END = 99


def answer(ids: list[int], *, count: int | None = None, finish: str = "stop") -> dict[str, Any]:
    return {
        "output_ids": ids,
        "meta_info": {
            "id": "eaglegen-doctor",
            "prompt_tokens": len(PROMPT),
            "completion_tokens": len(ids) if count is None else count,
            "cached_tokens": 0,
            "e2e_latency": 0.1,
            "finish_reason": {"type": finish, "matched": 7} if finish == "stop"
            else {"type": finish, "length": len(ids)},
        },
    }  # fmt: skip


def verdicts(checks: list[Check]) -> dict[str, bool | None]:
    return {c.name: c.ok for c in checks}


def test_a_good_answer_passes_every_check() -> None:
    probe = Probe(PROMPT, think_end_id=THINK_END, vocab_size=200, max_new_tokens=64)
    checks = judge_generation(probe, answer([40, 41, THINK_END, 42, 7]))
    assert verdicts(checks) == {
        "generate": True, "completion count": True, "response contract": True,
        "special tokens": True,
    }  # fmt: skip


def test_a_leaked_prompt_is_named_with_its_length() -> None:
    probe = Probe(PROMPT, max_new_tokens=64)
    [_, leak, contract] = judge_generation(probe, answer([*PROMPT[-6:], 40, 7], count=2))
    assert (leak.name, leak.ok) == ("no prompt in output", False)
    assert "last 6 tokens" in leak.detail and "upgrade SGLang" in leak.detail
    assert contract.ok is False


def test_a_count_that_differs_from_the_ids_fails() -> None:
    checks = verdicts(judge_generation(Probe(PROMPT), answer([40, 41, 7], count=5)))
    assert checks["completion count"] is False


def test_a_stripped_think_end_fails_and_says_what_to_do() -> None:
    probe = Probe(PROMPT, think_end_id=THINK_END, max_new_tokens=64)
    think = judge_generation(probe, answer([40, 41, 42, 7]))[-1]
    assert think.ok is False and "strips special tokens" in think.detail


def test_an_answer_cut_before_think_end_cannot_tell() -> None:
    probe = Probe(PROMPT, think_end_id=THINK_END, max_new_tokens=4)
    think = judge_generation(probe, answer([40, 41, 42, 43], finish="length"))[-1]
    assert think.ok is None and "--max-new-tokens" in think.detail


def test_no_output_ids_is_the_openai_api() -> None:
    [check] = judge_generation(Probe(PROMPT), {"text": "42", "meta_info": {}})
    assert check.ok is False and "native API" in check.detail


def test_without_a_vocabulary_the_contract_says_it_was_not_checked() -> None:
    """Issue 27: output ids of 10^9 were "a worker would store it as it is" without a run
    file; the run's vocabulary, which a worker checks them against, was never known."""
    checks = judge_generation(Probe(PROMPT, max_new_tokens=64), answer([40, 10**9, 7]))
    [contract] = [c for c in checks if c.name == "response contract"]
    assert contract.ok is None and "would store it" not in contract.detail
    assert "vocabulary was not checked" in contract.detail and "1000000000" in contract.detail
    with_vocab = Probe(PROMPT, vocab_size=200, max_new_tokens=64)
    [refused] = [
        c
        for c in judge_generation(with_vocab, answer([40, 10**9, 7]))
        if c.name == "response contract"
    ]
    assert refused.ok is False and "would refuse" in refused.detail


def test_leaks_shorter_than_the_minimum_are_chance() -> None:
    assert leaked_prompt(PROMPT, [17, 18, 40]) == 0
    assert leaked_prompt(PROMPT, [15, 16, 17, 18, 40]) == 4
    assert leaked_prompt(PROMPT, PROMPT) == len(PROMPT)
