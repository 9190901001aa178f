"""The anatomy of a generation, on hand-built id sequences, well formed and malformed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from core.anatomy import (
    Anatomy,
    CallSpan,
    Channels,
    Markers,
    dissect,
    markers_from_vocab,
    parse_calls,
    parse_header,
    valid,
)

END, SB, SE, CB, AB, CE, STOP = 10, 11, 12, 13, 14, 15, 2
M = Markers(
    think_end=END,
    section_begin=SB,
    section_end=SE,
    call_begin=CB,
    argument_begin=AB,
    call_end=CE,
    stops=frozenset({STOP}),
)
# A toy decoder: ids 100.. are characters, so a test can spell a header or arguments.
ALPHABET = 'functions.get_weather:0{"city": "Oslo"}x '


def spell(text: str) -> list[int]:
    return [100 + ALPHABET.index(c) for c in text]


def decode(ids: Sequence[int]) -> str:
    return "".join(ALPHABET[i - 100] if i >= 100 else f"<{i}>" for i in ids)


CALL = [CB, *spell("functions.get_weather:0"), AB, *spell('{"city": "Oslo"}'), CE]


def test_markers_from_a_vocab_without_tool_tokens() -> None:
    markers = markers_from_vocab({"</think>": 5, "<|im_end|>": 2, "a": 9}, stops=[2])
    assert markers.think_end == 5
    assert (markers.section_begin, markers.call_end) == (None, None)
    assert markers.stops == frozenset({2})


def test_reasoning_answer_and_stop() -> None:
    anatomy = dissect([20, 21, END, 30, 31, STOP], M, opens_reasoning=True)
    assert anatomy == Anatomy(
        reasoning=(20, 21),
        think_end_present=True,
        answer=(30, 31),
        calls=(),
        sections_balanced=True,
        stop=STOP,
    )


def test_splits_at_the_first_think_end() -> None:
    anatomy = dissect([20, END, 30, END, 31], M, opens_reasoning=True)
    assert (anatomy.reasoning, anatomy.answer) == ((20,), (30, END, 31))


def test_think_end_missing_means_all_reasoning() -> None:
    anatomy = dissect([20, 21, SB, STOP], M, opens_reasoning=True)
    assert anatomy.think_end_present is False
    assert anatomy.reasoning == (20, 21, SB)
    assert (anatomy.answer, anatomy.calls, anatomy.stop) == ((), (), STOP)
    assert not valid(anatomy, [])


def test_a_prompt_without_reasoning_has_no_reasoning_part() -> None:
    anatomy = dissect([30, END, 31, STOP], M, opens_reasoning=False)
    assert (anatomy.reasoning, anatomy.think_end_present) == (None, None)
    assert anatomy.answer == (30, END, 31)


def test_stop_missing_keeps_the_last_id() -> None:
    anatomy = dissect([END, 30, 31], M, opens_reasoning=True)
    assert (anatomy.stop, anatomy.answer) == (None, (30, 31))


def test_a_stop_inside_the_answer_stays_there() -> None:
    anatomy = dissect([END, STOP, 30, STOP], M, opens_reasoning=True)
    assert (anatomy.answer, anatomy.stop) == ((STOP, 30), STOP)


def test_empty_output() -> None:
    anatomy = dissect([], M, opens_reasoning=True)
    assert (anatomy.reasoning, anatomy.think_end_present, anatomy.stop) == ((), False, None)


def test_two_calls_in_one_section() -> None:
    ids = [20, END, 30, SB, *CALL, CB, 140, AB, 141, CE, SE, STOP]
    anatomy = dissect(ids, M, opens_reasoning=True)
    assert anatomy.sections_balanced
    assert anatomy.answer == (30,)
    assert anatomy.calls[1] == CallSpan((140,), (141,))
    assert anatomy.calls[0].header == tuple(spell("functions.get_weather:0"))


def test_unclosed_section_keeps_the_open_call() -> None:
    anatomy = dissect([END, SB, CB, 140, AB, 141], M, opens_reasoning=True)
    assert not anatomy.sections_balanced
    assert anatomy.calls == (CallSpan((140,), (141,)),)


def test_call_without_argument_begin() -> None:
    anatomy = dissect([END, SB, CB, 140, 141, CE, SE, STOP], M, opens_reasoning=True)
    assert not anatomy.sections_balanced
    assert anatomy.calls == (CallSpan((140, 141), ()),)


def test_call_not_ended_before_the_next() -> None:
    anatomy = dissect([END, SB, CB, 140, AB, 141, CB, 142, AB, CE, SE], M, opens_reasoning=True)
    assert not anatomy.sections_balanced
    assert [c.header for c in anatomy.calls] == [(140,), (142,)]


def test_markers_out_of_place_are_unbalanced_and_kept() -> None:
    anatomy = dissect([END, 30, CE, SE, 31, STOP], M, opens_reasoning=True)
    assert not anatomy.sections_balanced
    assert anatomy.answer == (30, CE, SE, 31)


def test_ids_between_calls_are_stray() -> None:
    anatomy = dissect([END, SB, 150, *CALL, SE, 31], M, opens_reasoning=True)
    assert anatomy.sections_balanced
    assert (anatomy.stray, anatomy.answer) == ((150,), (31,))


def test_a_tokenizer_without_tool_markers_sees_only_answer() -> None:
    plain = Markers(END, None, None, None, None, None, frozenset({STOP}))
    anatomy = dissect([END, SB, 30, STOP], plain, opens_reasoning=True)
    assert (anatomy.answer, anatomy.calls, anatomy.sections_balanced) == ((SB, 30), (), True)


def test_parse_calls_name_index_and_json() -> None:
    anatomy = dissect([END, SB, *CALL, SE, STOP], M, opens_reasoning=True)
    [call] = parse_calls(anatomy, decode, declared={"get_weather"})
    assert (call.name, call.index, call.arguments) == ("get_weather", 0, '{"city": "Oslo"}')
    assert call.arguments_json and call.declared is True
    assert valid(anatomy, [call])


def test_parse_calls_undeclared_and_bad_json() -> None:
    ids = [END, SB, CB, *spell("x"), AB, *spell('{"city"'), CE, SE]
    anatomy = dissect(ids, M, opens_reasoning=True)
    [call] = parse_calls(anatomy, decode, declared={"get_weather"})
    assert (call.name, call.index, call.declared, call.arguments_json) == ("x", None, False, False)
    assert not valid(anatomy, [call])
    [undeclared] = parse_calls(anatomy, decode, declared=None)
    assert undeclared.declared is None


@pytest.mark.parametrize(
    ("header", "parsed"),
    [
        ("functions.get_weather:0", ("get_weather", 0)),
        (" functions.a:b:12 ", ("a:b", 12)),
        ("search", ("search", None)),
        ("functions.f:x", ("f:x", None)),
        ("f:\u0661", ("f:\u0661", None)),  # a non-ASCII digit is no index
    ],
)
def test_parse_header(header: str, parsed: tuple[str, int | None]) -> None:
    assert parse_header(header) == parsed


# --- the layouts of other families, on hand-built ids ---------------------------------------

CALL_OPEN, CALL_CLOSE, THINK, NL, SP = 20, 21, 9, 50, 51
# Qwen3 / GLM-style: calls stand alone (no section tokens), no argument marker.
BARE = Markers(END, None, None, CALL_OPEN, None, CALL_CLOSE, frozenset({STOP}), syntax="hermes")
PIECES = {NL: "\u010a", SP: "\u0120", THINK: "<think>", END: "</think>", 30: "Hello"}


def test_calls_without_sections_take_their_whole_body_as_arguments() -> None:
    ids = [END, 30, NL, CALL_OPEN, 140, CALL_CLOSE, NL, CALL_OPEN, 141, CALL_CLOSE, 31, STOP]
    anatomy = dissect(ids, BARE, opens_reasoning=True)
    assert anatomy.calls == (CallSpan((), (140,)), CallSpan((), (141,)))
    assert anatomy.sections_balanced
    # The glue between two calls is stray; what follows the last is answer again.
    assert (anatomy.answer, anatomy.stray) == ((30, NL, 31), (NL,))


def test_a_bare_call_cut_or_out_of_place_is_unbalanced() -> None:
    cut = dissect([END, CALL_OPEN, 140], BARE, opens_reasoning=True)
    assert cut.calls == (CallSpan((), (140,)),) and not cut.sections_balanced
    stray_end = dissect(
        [END, CALL_OPEN, 140, CALL_CLOSE, NL, CALL_CLOSE], BARE, opens_reasoning=True
    )
    assert not stray_end.sections_balanced
    assert stray_end.answer == (NL, CALL_CLOSE)


def test_the_model_may_open_reasoning_itself_after_white_space() -> None:
    markers = replace(BARE, think_start=THINK, pieces=PIECES)
    for ids in ([THINK, 60, END, 30], [NL, SP, THINK, 60, END, 30]):
        anatomy = dissect([*ids, STOP], markers, opens_reasoning=False)
        assert (anatomy.reasoning, anatomy.think_end_present, anatomy.answer) == (
            (60,),
            True,
            (30,),
        )
    opened_late = dissect([30, THINK, 60, END], markers, opens_reasoning=False)
    assert (opened_late.reasoning, opened_late.answer) == (None, (30, THINK, 60, END))
    never_closed = dissect([THINK, 60, 61], markers, opens_reasoning=False)
    assert (never_closed.reasoning, never_closed.think_end_present) == ((60, 61), False)


def test_without_a_think_start_only_the_prompt_opens_reasoning() -> None:
    anatomy = dissect([THINK, 60, END, 30], replace(M, pieces=PIECES), opens_reasoning=False)
    assert anatomy.reasoning is None and anatomy.answer == (THINK, 60, END, 30)


def test_calls_of_an_unknown_syntax_are_not_checked() -> None:
    plain = Markers(END, None, None, None, None, None, frozenset({STOP}), syntax="")
    anatomy = dissect([20, END, 30, STOP], plain, opens_reasoning=True)
    assert not plain.calls_checked and not anatomy.calls_checked
    assert parse_calls(anatomy, decode, None) == [] and valid(anatomy, [])
    assert M.calls_checked and M.call_ids == frozenset({SB, SE, CB, CE})


# Harmony (gpt-oss): <|start|> <|channel|> <|message|> <|end|> <|call|> <|return|> <|constrain|>
H_START, H_CHANNEL, H_MESSAGE, H_END, H_CALL, H_RETURN, H_CONSTRAIN = range(200, 207)
ANALYSIS, FINAL, COMMENTARY, TO_F, JSON_, ASSISTANT = range(210, 216)
HARMONY = Markers(
    None,
    None,
    None,
    None,
    None,
    None,
    frozenset({H_RETURN, H_CALL}),
    syntax="harmony",
    channels=Channels(H_START, H_CHANNEL, H_MESSAGE, H_END, H_CALL, H_RETURN, H_CONSTRAIN),
    pieces={
        H_CHANNEL: "<|channel|>",
        ANALYSIS: "analysis",
        FINAL: "final",
        COMMENTARY: "commentary",
        TO_F: "\u0120to=functions.f",
        JSON_: "json",
        ASSISTANT: "assistant",
    },
)
REASONED = [H_CHANNEL, ANALYSIS, H_MESSAGE, 60, 61, H_END, H_START, ASSISTANT]
CALL_HEADER = [H_CHANNEL, COMMENTARY, TO_F, H_CONSTRAIN, JSON_]


def test_harmony_channels_are_reasoning_answer_and_calls() -> None:
    final = dissect(
        [*REASONED, H_CHANNEL, FINAL, H_MESSAGE, 30, H_RETURN], HARMONY, opens_reasoning=False
    )
    assert (final.reasoning, final.think_end_present, final.answer) == ((60, 61), True, (30,))
    assert (final.stop, final.calls, final.sections_balanced) == (H_RETURN, (), True)
    call = dissect(
        [*REASONED, *CALL_HEADER, H_MESSAGE, 140, H_CALL], HARMONY, opens_reasoning=False
    )
    assert call.calls == (CallSpan((ASSISTANT, *CALL_HEADER), (140,)),)
    assert call.sections_balanced and call.answer == () and call.stop == H_CALL


def test_harmony_cut_reasoning_cut_call_and_a_message_left_open() -> None:
    cut_reasoning = dissect([H_CHANNEL, ANALYSIS, H_MESSAGE, 60], HARMONY, opens_reasoning=False)
    assert (cut_reasoning.reasoning, cut_reasoning.think_end_present) == ((60,), False)
    assert cut_reasoning.sections_balanced
    cut_call = dissect([*REASONED, *CALL_HEADER, H_MESSAGE, 140], HARMONY, opens_reasoning=False)
    assert not cut_call.sections_balanced and len(cut_call.calls) == 1
    left_open = [H_CHANNEL, ANALYSIS, H_MESSAGE, 60, H_START, H_CHANNEL, FINAL, H_MESSAGE, 30]
    anatomy = dissect([*left_open, H_RETURN], HARMONY, opens_reasoning=False)
    assert not anatomy.sections_balanced and anatomy.think_end_present is False


def test_harmony_output_may_open_its_first_message_itself() -> None:
    ids = [H_START, ASSISTANT, H_CHANNEL, FINAL, H_MESSAGE, 30, H_RETURN]
    anatomy = dissect(ids, HARMONY, opens_reasoning=False)
    assert (anatomy.answer, anatomy.sections_balanced, anatomy.stray) == ((30,), True, ())


def test_harmony_ids_between_messages_are_stray() -> None:
    ids = [H_CHANNEL, FINAL, H_MESSAGE, 30, H_END, 70, H_START, H_CHANNEL, FINAL, H_MESSAGE, 31]
    anatomy = dissect([*ids, H_RETURN], HARMONY, opens_reasoning=False)
    assert (anatomy.answer, anatomy.stray, anatomy.reasoning) == ((30, 31), (70,), None)
