"""Conversation rows and their round trip: the pure logic, on hand-built ids."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

from core.anatomy import Markers
from core.turns import Prompt, decode_turn
from exporter.conversations import MODELOPT, SPECFORGE, document
from exporter.roundtrip import (
    OUTPUT,
    PROBE,
    PROMPT,
    Check,
    DatasetRoundTrip,
    RoundTrips,
    check,
    failed,
    first_difference,
    turn_end,
)
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


# What a ChatML template writes after an assistant message: its stop token, then a newline
# (NL: ord("\n") is END in the toy vocabulary).
NL = 16
NAMES[NL] = "\n"
CHATML_END = (STOP, NL)


def test_a_template_s_turn_suffix_after_the_stop_token_is_exact_up_to_it() -> None:
    recorded = encode("P>ok<E>")
    rendered = "P>ok<E>\n"
    assert check(recorded, 2, rendered, encode, decode, end_of_turn=CHATML_END) == Check(
        exact=True, turn_suffix="\n"
    )
    # Without the template's end of turn (a bare encoder renders no probe): it differs after
    # the recorded output, as before.
    plain = check(recorded, 2, rendered, encode, decode)
    assert (plain.exact, plain.position, plain.part) == (False, len(recorded), OUTPUT)


@pytest.mark.parametrize(
    ("recorded", "rendered"),
    [
        ("P>ok", "P>ok<E>\n"),  # no stop token: the template ends a turn the model did not
        ("P>ok<E>", "P>ok<E>\n\n"),  # more than the template's suffix
        ("P>ok<E>", "P>ok<E>x"),  # other than it
        ("P>", "P><E>\n"),  # nothing generated: the whole turn is the template's
    ],
)
def test_only_the_template_s_own_suffix_after_a_stop_is_let_through(
    recorded: str, rendered: str
) -> None:
    result = check(encode(recorded), 2, rendered, encode, decode, end_of_turn=CHATML_END)
    assert (result.exact, result.turn_suffix) == (False, None)
    assert result.position == first_difference(encode(recorded), encode(rendered))


class Templater:
    """A tokenizer rendering as ChatML does: each message then ``<E>`` and a newline."""

    def __init__(self, end: str = "<E>\n", fail: bool = False) -> None:
        self.end, self.fail, self.probes = end, fail, 0

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        self.probes += messages == PROBE
        if self.fail:
            raise ValueError("this template wants a system message")
        return "".join(f"<{m['role']}>{m['content']}{self.end}" for m in messages)

    def encode(self, text: str) -> list[int]:
        return encode(text)


def test_the_end_of_turn_is_probed_from_the_template() -> None:
    chatml, kimi = Templater(), Templater(end="<E>")
    assert turn_end(chatml) == CHATML_END and turn_end(kimi) == (STOP,)
    assert chatml.probes == 1
    assert turn_end(Templater(fail=True)) == ()
    recorded = encode("<user>hi<E>\n<assistant>ok<E>")
    rendered = decode(recorded) + "\n"
    assert check(recorded, 6, rendered, encode, decode, end_of_turn=CHATML_END).turn_suffix == "\n"
    # A template that writes nothing after the stop: exact only when the ids are.
    assert not check(recorded, 6, rendered, encode, decode, end_of_turn=(STOP,)).exact
    assert check(recorded, 6, decode(recorded), encode, decode, end_of_turn=(STOP,)) == Check(
        exact=True
    )


def test_a_stop_the_template_does_not_write_is_exact_but_for_it() -> None:
    # GLM-4.5: the model ends its turn with the next turn's token, the template writes none.
    recorded = encode("P>ok<E>")
    result = check(recorded, 2, "P>ok", encode, decode, stops={STOP})
    assert result == Check(exact=True, unrendered_stop="<E>")
    # Not one of the run's stops, or more than one id missing: a difference as before.
    assert not check(recorded, 2, "P>ok", encode, decode, stops={NL}).exact
    assert not check(recorded, 2, "P>o", encode, decode, stops={STOP}).exact
    trips = RoundTrips()
    trips.add("g", 1, result)
    doc = trips.document()["g"]
    assert (doc["exact"], doc["exact_but_unrendered_stop"], doc["unrendered_stop"]) == (
        1,
        1,
        "<E>",
    )


def test_suffix_exact_rows_are_counted_apart_and_merged_with_older_manifests() -> None:
    trips = RoundTrips()
    trips.add("q", 1, Check(exact=True, turn_suffix="\n"))
    trips.add("q", 2, Check(exact=True))
    trips.add("q", 3, Check(exact=False, text_equal=False, position=9, part=OUTPUT))
    doc = trips.document()["q"]
    assert (doc["checked"], doc["exact"], doc["exact_up_to_turn_suffix"]) == (3, 2, 1)
    assert doc["turn_suffix"] == "\n" and doc["exact_rate"] == round(2 / 3, 4)
    older = {k: v for k, v in doc.items() if k not in ("exact_up_to_turn_suffix", "turn_suffix")}
    merged = RoundTrips.from_document({"q": older}).merged(trips).document()["q"]
    assert (merged["checked"], merged["exact"], merged["exact_up_to_turn_suffix"]) == (6, 4, 1)
    assert DatasetRoundTrip.from_document(doc).document() == doc


def test_a_line_keeps_integers_beyond_64_bits_and_lone_surrogates_exactly() -> None:
    for doc in (
        {"ticket": 2**70, "neg": -(2**64), "text": "é"},
        {"ticket": 2**70, "text": "a\ud800b"},  # no UTF-8 for it: written as its escape
        {"plain": [1, 2.5, None, "ü"]},
    ):
        line = json_line(doc)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert json.loads(line) == doc
