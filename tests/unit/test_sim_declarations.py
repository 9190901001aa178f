"""How the simulator finds declared tools in any family's prompt, and how a turn ends."""

from __future__ import annotations

import json
from typing import Any

import pytest

from eaglegen.sim.declarations import (
    INVENTED,
    Probe,
    TemplateDeclarations,
    json_functions,
    learn,
    render,
    turn_header,
)
from eaglegen.sim.engine import Sampling, final_stop
from eaglegen.sim.layouts import Opened, Reasoning
from eaglegen.sim.tools import FORMATS, Function
from tests.helpers import family_template
from tests.unit.test_sim_tools import tool_rows

TOOLS: list[dict[str, Any]] = tool_rows()[0]["tools"]
NAMES = {tool["function"]["name"] for tool in TOOLS}
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|user|>", "<|system|>", "<|start|>", "<|message|>"]
SPECIALS += ["<|end|>", "<|channel|>", "<|im_system|>", "<|im_user|>", "<|im_middle|>"]


def prompt_text(family: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """The family's template rendered as the producer renders a prompt."""
    return render(family_template(family), messages=messages, add_generation_prompt=True, **kwargs)


def read(family: str, text: str) -> tuple[Function, ...]:
    """The functions the simulator reads from a prompt of the family whose text is text."""
    probe = learn(family_template(family), {}, SPECIALS)
    return TemplateDeclarations(probe, lambda ids: text).functions([0])


def functions(family: str, messages: list[dict[str, Any]], **kwargs: Any) -> set[str]:
    """The names the simulator reads from the family's prompt."""
    return {fn.name for fn in read(family, prompt_text(family, messages, **kwargs))}


USER = [{"role": "user", "content": "Weather in Oslo?"}]
PASTED = [{"role": "user", "content": json.dumps(TOOLS)}]


@pytest.mark.parametrize("family", ["qwen3", "glm45", "gpt_oss", "kimi_k2"])
def test_declared_tools_are_read_and_pasted_ones_are_not(family: str) -> None:
    assert functions(family, USER, tools=TOOLS) == NAMES
    assert functions(family, PASTED) == set()  # tools in a message declare nothing
    assert functions(family, USER) == set()


@pytest.mark.parametrize("family", ["deepseek_r1", "deepseek_v31", "qwen3_thinking"])
def test_a_template_writing_no_declarations_calls_made_up_functions(family: str) -> None:
    assert not learn(family_template(family), {}, SPECIALS).writes
    assert functions(family, USER, tools=TOOLS) == {fn.name for fn in INVENTED}


def test_the_probe_learns_each_templates_way() -> None:
    qwen3 = learn(family_template("qwen3"), {}, SPECIALS)
    assert qwen3.header == "<|im_start|>user\n" and qwen3.pattern is None
    harmony = learn(family_template("gpt_oss"), {}, SPECIALS)
    assert harmony.header == "<|start|>user<|message|>" and harmony.pattern is not None
    # gpt-oss writes TypeScript-like lines: names by their context, JSON parameters kept.
    found = read("gpt_oss", prompt_text("gpt_oss", USER, tools=TOOLS))
    params = {fn.name: fn.parameters for fn in found}
    assert params == {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def test_a_template_that_does_not_render_is_read_as_json_anywhere() -> None:
    probe = learn("{% if %}", {}, SPECIALS)
    assert probe == Probe(writes=True, header=None, pattern=None)
    assert learn(None, {}, SPECIALS).writes is False


def test_json_declarations_in_any_wrapping() -> None:
    text = 'x [{"type": "function", "function": {"name": "a", "parameters": {"p": 1}}}] y '
    text += '{"name": "b", "parameters": {}} {"name": "not a tool"} {broken'
    assert json_functions(text) == (Function("a", {"p": 1}), Function("b", {}))


def test_turn_header_widens_to_its_special_token() -> None:
    before = "<|start|>system<|message|>x<|end|><|start|>user<|message|>"
    assert turn_header(before, SPECIALS) == "<|start|>user<|message|>"
    assert turn_header("plain text, no tokens", SPECIALS) is None


def test_reasoning_follows_where_the_prompt_left_it() -> None:
    think = Reasoning(start=9, end=10, opening=(9, 50), blank=frozenset({50}))
    assert think.opened([1, 9, 50]) is Opened.OPEN
    assert think.around([1, 9, 50]) == ((), (10,))
    assert think.around([1, 9, 50, 10, 50, 50]) == ((), None)
    assert think.around([1, 2]) == ((9, 50), (10,))
    kimi = Reasoning(start=9, end=10, opening=(9,), blank=frozenset(), follow_prompt=False)
    assert kimi.around([1, 9, 10]) == ((), (10,))


def test_the_turn_ends_with_the_familys_stop_unless_the_request_names_others() -> None:
    family = (7, 8)
    assert final_stop(7, family, Sampling()) == 7
    assert final_stop(7, family, Sampling(stop_token_ids=frozenset({7, 3}))) == 7
    assert final_stop(7, family, Sampling(stop_token_ids=frozenset({8, 3}))) == 8
    assert final_stop(7, family, Sampling(stop_token_ids=frozenset({5, 3}))) == 3
    assert final_stop(7, family, Sampling(stop_token_ids=frozenset({3}), ignore_eos=True)) == 7
    assert final_stop(None, (), Sampling()) is None


def test_glm_arguments_break_their_layout() -> None:
    write = FORMATS["glm45"].write
    assert write("f", 0, {"a": "x", "b": 2}, None) == (
        "",
        "f\n<arg_key>a</arg_key>\n<arg_value>x</arg_value>\n"
        "<arg_key>b</arg_key>\n<arg_value>2</arg_value>\n",
    )
    assert "</arg_value>" not in write("f", 0, {"a": "x"}, 0)[1]
    assert write("f", 0, {}, 0)[1].endswith("<arg_key>extra</arg_key>\n")
