"""Conversation rows and their round trip: the pure logic, on hand-built ids."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from core.anatomy import Markers
from exporter.conversations import MODELOPT, SPECFORGE, Prompt, decode_turn, document
from exporter.roundtrip import OUTPUT, PROMPT, Check, RoundTrips, check, failed, first_difference
from exporter.shaping import json_line

END, SB, SE, CB, AB, CE, STOP = 10, 11, 12, 13, 14, 15, 2
M = Markers(END, SB, SE, CB, AB, CE, frozenset({STOP}))
NAMES = {END: "</think>", SB: "<S>", SE: "</S>", CB: "<C>", AB: "<A>", CE: "</C>", STOP: "<E>"}


def decode(ids: Sequence[int]) -> str:
    """A toy decoder: ids 32..126 are their ASCII characters, the markers their names."""
    return "".join(NAMES.get(i) or chr(i) for i in ids)


def encode(text: str) -> list[int]:
    """The toy decoder's inverse (markers only as whole names)."""
    ids: list[int] = []
    while text:
        name = next((i for i, n in NAMES.items() if text.startswith(n)), None)
        if name is None:
            ids.append(ord(text[0]))
            text = text[1:]
        else:
            ids.append(name)
            text = text[len(NAMES[name]) :]
    return ids


def spell(text: str) -> list[int]:
    return [ord(c) for c in text]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
PROMPT_DOC = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}


def test_a_turn_with_reasoning_and_a_call() -> None:
    ids = [*spell("hmm"), END, *spell("ok"), SB, CB, *spell("functions.get_weather:0"), AB]
    ids += [*spell('{"city":"Oslo"}'), CE, SE, STOP]
    prompt = Prompt.of(PROMPT_DOC)
    _, turn = decode_turn(ids, M, decode, opens_reasoning=True, declared=prompt.declared())
    assert turn.valid
    assert turn.message() == {
        "role": "assistant",
        "content": "ok",
        "reasoning_content": "hmm",
        "tool_calls": [
            {
                "id": "functions.get_weather:0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
            }
        ],
    }
    assert turn.calls[0].declared is True


def test_a_turn_without_reasoning_or_calls() -> None:
    _, turn = decode_turn([*spell("plain"), STOP], M, decode, opens_reasoning=False, declared=None)
    assert turn.message() == {"role": "assistant", "content": "plain"}
    assert turn.valid


def test_a_turn_whose_reasoning_never_ended_is_invalid_and_all_reasoning() -> None:
    _, turn = decode_turn(spell("thinking"), M, decode, opens_reasoning=True, declared=None)
    assert (turn.reasoning, turn.content, turn.valid) == ("thinking", "", False)


def test_the_two_styles_keep_the_tools_and_the_prompt() -> None:
    prompt = Prompt.of(PROMPT_DOC)
    _, turn = decode_turn([END, *spell("a"), STOP], M, decode, opens_reasoning=True, declared=None)
    specforge = document(SPECFORGE, "7", prompt, turn, {"k": 1})
    modelopt = document(MODELOPT, "7", prompt, turn, {"k": 1})
    assert specforge["id"] == modelopt["conversation_id"] == "7"
    assert specforge["conversations"] == modelopt["messages"]
    assert specforge["conversations"][0] == {"role": "user", "content": "hi"}
    assert specforge["tools"] == modelopt["tools"] == TOOLS
    plain = document(SPECFORGE, "8", Prompt.of({"messages": [], "tools": None}), turn, {})
    assert "tools" not in plain


def test_a_stored_prompt_without_messages_is_refused() -> None:
    with pytest.raises(ValueError, match="no 'messages'"):
        Prompt.of({"tools": None})
    assert Prompt.of({"messages": [], "tools": [{"name": "f"}]}).declared() == {"f"}


@pytest.mark.parametrize(
    ("a", "b", "at"),
    [([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 9, 3], 1), ([1, 2], [1, 2, 3], 2), ([], [4], 0)],
)
def test_first_difference(a: list[int], b: list[int], at: int | None) -> None:
    assert first_difference(a, b) == at


def test_a_round_trip_that_reproduces() -> None:
    recorded = encode("<u>hi</think>ok<E>")
    assert check(recorded, 4, decode(recorded), encode, decode) == Check(exact=True)


def test_a_template_that_strips_reasoning_differs_in_the_output() -> None:
    recorded = encode("P>hmm</think>ok<E>")
    result = check(recorded, 2, "P></think>ok<E>", encode, decode)
    assert (result.exact, result.text_equal, result.position, result.part) == (
        False,
        False,
        2,
        OUTPUT,
    )
    assert result.recorded.startswith("P>hmm") and result.rendered.startswith("P></think>")


def test_the_same_text_in_other_ids_is_told_apart() -> None:
    recorded = [*spell("ab"), STOP]
    merged = [300, STOP]  # an encoder that merges "ab" into one id

    def merging(text: str) -> list[int]:
        return merged if text == "ab<E>" else encode(text)

    def decoding(ids: Sequence[int]) -> str:
        return "".join("ab" if i == 300 else decode([i]) for i in ids)

    result = check(recorded, 0, "ab<E>", merging, decoding)
    assert (result.exact, result.text_equal, result.position) == (False, True, 0)


def test_the_tally_counts_per_dataset_and_keeps_few_examples() -> None:
    trips = RoundTrips()
    for i in range(5):
        trips.add("a", i, Check(exact=False, text_equal=False, position=3, part=PROMPT))
    trips.add("a", 9, Check(exact=True))
    trips.add("b", 1, failed(ValueError("boom")))
    doc = trips.document()
    assert doc["a"]["checked"] == 6 and doc["a"]["exact"] == 1
    assert doc["a"]["differs_in"] == {PROMPT: 5, OUTPUT: 0}
    assert [e["id"] for e in doc["a"]["examples"]] == [0, 1, 2]
    assert (
        doc["b"]["template_errors"] == 1 and doc["b"]["examples"][0]["error"] == "ValueError: boom"
    )
    merged = RoundTrips.from_document(doc).merged(trips).document()
    assert merged["a"]["checked"] == 12 and merged["a"]["exact_rate"] == round(2 / 12, 4)


def test_a_line_keeps_integers_beyond_64_bits_and_lone_surrogates_exactly() -> None:
    for doc in (
        {"ticket": 2**70, "neg": -(2**64), "text": "é"},
        {"ticket": 2**70, "text": "a\ud800b"},  # no UTF-8 for it: written as its escape
        {"plain": [1, 2.5, None, "ü"]},
    ):
        line = json_line(doc)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert json.loads(line) == doc
