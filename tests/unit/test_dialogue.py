"""The next prompt of a conversation regenerated on-policy (core.dialogue), and what two
families' real chat templates make of it: one keeps the model's earlier reasoning in the
history, one drops it (so its next prompt does not extend the previous prompt + answer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.dialogue import TOOL_DIVERGENCE, Point, answer_points, next_prompt
from core.tokenizer import RunTokenizer
from tests.helpers import family_tokenizer

SYSTEM = {"role": "system", "content": "Be brief."}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str, calls: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text, **extra}
    if calls:
        message["tool_calls"] = calls
    return message


def call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


THREE_TURNS = [
    SYSTEM,
    user("Name a planet."),
    assistant("Mars."),
    user("Another?"),
    assistant("Venus."),
    user("And one more?"),
    assistant("Jupiter."),
]
OURS = [
    assistant("Saturn.", reasoning_content="Any will do."),
    assistant("Earth.", reasoning_content="Not Saturn again."),
    assistant("Uranus.", reasoning_content="A third."),
]


def test_each_assistant_turn_after_a_user_or_tool_message_is_an_answer_point() -> None:
    assert answer_points(THREE_TURNS) == [Point(2, 3), Point(4, 5), Point(6, 7)]
    # A row ending with a user turn: the model answers it too.
    assert answer_points([user("a"), assistant("b"), user("c")]) == [Point(1, 2), Point(3, 3)]
    # Two user messages in a row, two assistant messages in a row: one point each.
    row = [user("a"), user("b"), assistant("c"), assistant("d"), user("e"), assistant("f")]
    assert answer_points(row) == [Point(2, 4), Point(5, 6)]
    # After tool results the model speaks again: a point.
    row = [user("a"), assistant("", [call("x", "f", "{}")]), tool("x", "1"), assistant("b")]
    assert answer_points(row) == [Point(1, 2), Point(3, 4)]


def test_every_earlier_answer_is_the_model_s_own() -> None:
    assert next_prompt(THREE_TURNS, []).messages == [SYSTEM, user("Name a planet.")]
    assert next_prompt(THREE_TURNS, OURS[:1]).messages == [
        SYSTEM, user("Name a planet."), OURS[0], user("Another?")
    ]  # fmt: skip
    assert next_prompt(THREE_TURNS, OURS[:2]).messages == [
        SYSTEM, user("Name a planet."), OURS[0], user("Another?"), OURS[1], user("And one more?")
    ]  # fmt: skip
    done = next_prompt(THREE_TURNS, OURS)
    assert done.done and done.ended is None and done.messages == []
    with pytest.raises(ValueError, match="4 answers to a row of 3 answer points"):
        next_prompt(THREE_TURNS, [*OURS, OURS[0]])


TOOL_ROW = [
    user("Weather in Paris and Oslo?"),
    assistant(
        "",
        [
            call("row-1", "get_weather", '{"city": "Paris"}'),
            call("row-2", "get_weather", {"city": "Oslo"}),
        ],
    ),
    tool("row-1", "12 C"),
    tool("row-2", "3 C"),
    assistant("Paris 12 C, Oslo 3 C."),
    user("Thanks!"),
    assistant("You're welcome."),
]


def test_the_same_calls_take_the_row_s_results_renamed_to_the_model_s_ids() -> None:
    ours = assistant(
        "",
        [
            # The same arguments as JSON, written otherwise.
            call("functions.get_weather:0", "get_weather", '{ "city":"Paris" }'),
            call("functions.get_weather:1", "get_weather", '{"city": "Oslo"}'),
        ],
    )
    after = next_prompt(TOOL_ROW, [ours])
    assert after.ended is None
    assert after.messages == [
        user("Weather in Paris and Oslo?"),
        ours,
        tool("functions.get_weather:0", "12 C"),
        tool("functions.get_weather:1", "3 C"),
    ]
    final = next_prompt(TOOL_ROW, [ours, assistant("Paris is milder.")])
    assert final.messages[-2:] == [assistant("Paris is milder."), user("Thanks!")]


PARIS, OSLO = '{"city": "Paris"}', '{"city": "Oslo"}'


@pytest.mark.parametrize(
    "calls",
    [
        [call("a", "get_weather", '{"city": "Paris"}')],  # one call of two
        [call("a", "get_time", '{"city": "Paris"}'), call("b", "get_weather", '{"city": "Oslo"}')],
        [
            call("a", "get_weather", '{"city": "Oslo"}'),
            call("b", "get_weather", '{"city": "Paris"}'),
        ],
        [
            call("a", "get_weather", '{"city": "Paris"'),
            call("b", "get_weather", '{"city": "Oslo"}'),
        ],
        None,  # an answer without the calls
    ],
)
def test_other_calls_end_the_conversation_with_tool_divergence(
    calls: list[dict[str, Any]] | None,
) -> None:
    ended = next_prompt(TOOL_ROW, [assistant("Let me check.", calls)])
    assert ended.ended == TOOL_DIVERGENCE and ended.messages == []


def test_a_call_the_row_has_no_result_for_ends_the_conversation_unless_it_was_the_last() -> None:
    ours = assistant("", [call("a", "search", "{}")])
    assert next_prompt(THREE_TURNS, [ours]).ended == TOOL_DIVERGENCE
    assert next_prompt(THREE_TURNS[:3], [ours]).done


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


@pytest.mark.parametrize(("family", "extends"), [("deepseek_v3", True), ("qwen3", False)])
def test_a_template_that_drops_earlier_reasoning_does_not_extend_the_previous_prompt(
    families: Path, family: str, extends: bool
) -> None:
    tok = RunTokenizer(family_tokenizer(families, family))
    first = next_prompt(THREE_TURNS, []).messages
    prompt = tok.render_chat(first, add_generation_prompt=True)
    answer = assistant("Saturn.") if family == "deepseek_v3" else OURS[0]
    whole = tok.render_chat([*first, answer], add_generation_prompt=False)
    second = tok.render_chat(
        next_prompt(THREE_TURNS, [answer]).messages, add_generation_prompt=True
    )
    assert whole.startswith(prompt)
    assert second.startswith(whole) is extends
    if not extends:  # Qwen3 writes earlier turns without their reasoning
        assert "Any will do." in whole and "Any will do." not in second


def test_a_multi_turn_row_starts_at_its_first_answer_point_and_a_single_turn_row_is_a_job() -> None:
    from producer.prepare import first_turn
    from producer.rows import to_prompt

    row = to_prompt(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Bye!"},  # the answer regenerated: dropped
            ]
        }
    )
    prompt, whole = first_turn(row)
    assert [m["content"] for m in prompt.messages] == ["Be brief.", "Hi"]
    assert whole is row and len(whole.messages) == 4
    single = to_prompt({"messages": [{"role": "user", "content": "Hi"}]})
    assert first_turn(single) == (single, None)


def test_departure_names_the_part_of_the_turn_before_where_a_prompt_departs() -> None:
    from core.onpolicy import ANSWER, BEYOND, PROMPT, departure

    assert departure([1, 2, 3, 4, 9], [1, 2], [3, 4]) == (BEYOND, 0)
    assert departure([1, 2, 4, 9], [1, 2], [3, 4]) == (ANSWER, 0)  # reasoning dropped
    assert departure([1, 2, 3, 5], [1, 2], [3, 4]) == (ANSWER, 1)
    assert departure([1, 7, 3, 4], [1, 2], [3, 4]) == (PROMPT, 1)
    assert departure([1, 2, 3], [1, 2], [3, 4]) == (ANSWER, 1)  # shorter: ends inside
