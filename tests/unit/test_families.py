"""Each model family's anatomy on ids of its own test tokenizer: the bundled vocabulary with
the family's real special tokens and its published chat template (tests/data/templates).

Per family: hand-written generations in its layout (reasoning, one call, parallel calls, a
call cut by length, broken JSON, a plain answer), its detection, and a round trip through its
template: the calls the template writes for an assistant turn read back the same.
"""

# ruff: noqa: RUF001 (DeepSeek's tokens are spelled with U+FF5C, as they are)

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from core.anatomy import Anatomy, Markers, ToolCall, valid
from core.calls import read_deepseek_v3, read_glm, read_harmony, read_hermes
from core.families import (
    DEEPSEEK_V3,
    DEEPSEEK_V31,
    FAMILIES,
    GLM45,
    GPT_OSS,
    KIMI_K2,
    NAMES,
    QWEN3,
    UNKNOWN,
    Family,
    family_for,
    family_named,
)
from core.tokenizer import exact_decoder
from eaglegen.assets import TOKENIZER_DIR
from tests.helpers import family_template, family_tokenizer

Calls = Sequence[tuple[str, str]]
# How a family's model writes a generation: (reasoning, answer, calls as (name, JSON text),
# whether it ends with its stop token) -> the output text.
Write = Callable[[str | None, str, Calls, bool], str]

REASONING = "The user wants the weather."
ANSWER = "It is sunny in Oslo."
WEATHER = ("get_weather", '{"city": "Oslo", "days": 3}')
TIME = ("get_time", '{"zone": "CET"}')
BROKEN = ("get_weather", '{"city": "Oslo"')
DECLARED = {"get_weather", "get_time"}

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
DS_SEP, DS_END = "<｜tool▁sep｜>", "<｜end▁of▁sentence｜>"


def write_kimi(reasoning: str | None, answer: str, calls: Calls, stop: bool) -> str:
    text = ("" if reasoning is None else reasoning + "</think>") + answer
    if calls:
        text += "<|tool_calls_section_begin|>"
        for i, (name, arguments) in enumerate(calls):
            text += f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>"
            text += f"{arguments}<|tool_call_end|>"
        text += "<|tool_calls_section_end|>"
    return text + ("<|im_end|>" if stop else "")


def write_qwen3(reasoning: str | None, answer: str, calls: Calls, stop: bool) -> str:
    # Qwen3 hybrid: the prompt leaves <think> to the model.
    text = ("" if reasoning is None else f"<think>\n{reasoning}\n</think>\n\n") + answer
    bodies = [f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in calls]
    text += ("\n" if answer and calls else "") + "\n".join(bodies)
    return text + ("<|im_end|>" if stop else "")


def write_deepseek_v3(reasoning: str | None, answer: str, calls: Calls, stop: bool) -> str:
    # R1: the prompt opens reasoning (`<think>\n`).
    text = ("" if reasoning is None else f"{reasoning}\n</think>\n\n") + answer
    if calls:
        bodies = [
            f"{DS_CALL_BEGIN}function{DS_SEP}{n}\n```json\n{a}\n```{DS_CALL_END}" for n, a in calls
        ]
        text += DS_CALLS_BEGIN + "\n".join(bodies) + DS_CALLS_END
    return text + (DS_END if stop else "")


def write_deepseek_v31(reasoning: str | None, answer: str, calls: Calls, stop: bool) -> str:
    text = ("" if reasoning is None else f"{reasoning}</think>") + answer
    if calls:
        bodies = [f"{DS_CALL_BEGIN}{n}{DS_SEP}{a}{DS_CALL_END}" for n, a in calls]
        text += DS_CALLS_BEGIN + "".join(bodies) + DS_CALLS_END
    return text + (DS_END if stop else "")


def glm_pairs(arguments: str) -> str:
    try:
        values = json.loads(arguments)
    except ValueError:  # broken: a value left open
        return f"<arg_key>city</arg_key>\n<arg_value>{arguments}\n"
    return "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}"
        "</arg_value>\n"
        for k, v in values.items()
    )


def write_glm45(reasoning: str | None, answer: str, calls: Calls, stop: bool) -> str:
    # GLM-4.5: the prompt ends `<|assistant|>`; the model writes `\n<think>` itself.
    text = "" if reasoning is None else f"\n<think>{reasoning}</think>"
    text += f"\n{answer}" if answer else ""
    text += "".join(f"\n<tool_call>{n}\n{glm_pairs(a)}</tool_call>" for n, a in calls)
    return text + ("<|observation|>" if stop else "")


def write_gpt_oss(reasoning: str | None, answer: str, calls: Calls, stop: bool) -> str:
    # Harmony: the prompt ends `<|start|>assistant`; each message ends with its own token.
    messages = [] if reasoning is None else [("<|channel|>analysis", reasoning, "<|end|>")]
    messages += [("<|channel|>final", answer, "<|return|>")] if answer else []
    messages += [
        (f"<|channel|>commentary to=functions.{n} <|constrain|>json", a, "<|call|>")
        for n, a in calls
    ]
    texts = [f"{header}<|message|>{body}{end}" for header, body, end in messages]
    text = "<|start|>assistant".join(texts)
    # The last end token is the run's stop (<|return|>, <|call|>); a cut output lacks it.
    return text if stop else text.removesuffix(messages[-1][2])


@dataclass(frozen=True)
class Layout:
    """One family under test: its test tokenizer, how it writes, whether prompts open
    reasoning for it."""

    tokenizer: str  # tests/helpers.py family_tokenizer name
    family: Family
    write: Write
    opens_reasoning: bool


LAYOUTS = {
    "kimi_k2": Layout("kimi_k2", KIMI_K2, write_kimi, True),
    "qwen3": Layout("qwen3", QWEN3, write_qwen3, False),
    "deepseek_v3": Layout("deepseek_v3", DEEPSEEK_V3, write_deepseek_v3, True),
    "deepseek_v31": Layout("deepseek_v31", DEEPSEEK_V31, write_deepseek_v31, True),
    "glm45": Layout("glm45", GLM45, write_glm45, False),
    "gpt_oss": Layout("gpt_oss", GPT_OSS, write_gpt_oss, False),
}


class Tok:
    """A loaded test tokenizer and its family's markers."""

    def __init__(self, tokenizer: Any, family: Family) -> None:
        self.tokenizer = tokenizer
        self.family = family
        self.vocab: dict[str, int] = dict(tokenizer.get_vocab())
        self._decode = exact_decoder(tokenizer)
        self._markers = family.markers(self.vocab, family.stop_ids(self.vocab))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode(ids)

    def markers(self) -> Markers:
        return self._markers

    def read(self, text: str, *, opens_reasoning: bool) -> tuple[Anatomy, list[ToolCall]]:
        anatomy = self.family.dissect(
            self.encode(text), self.markers(), opens_reasoning=opens_reasoning
        )
        return anatomy, self.family.parse_calls(anatomy, self.decode, DECLARED)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    """Each test tokenizer, built once for the module (on first use)."""
    from transformers import AutoTokenizer

    folder: Path = tmp_path_factory.mktemp("families")
    built: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in built:
            path = family_tokenizer(folder, name, structure=True)
            built[name] = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return built[name]

    return get


@pytest.fixture(params=sorted(LAYOUTS))
def layout(request: pytest.FixtureRequest) -> Layout:
    return LAYOUTS[request.param]


@pytest.fixture
def tok(layout: Layout, tokenizers: Callable[[str], Any]) -> Tok:
    return Tok(tokenizers(layout.tokenizer), layout.family)


def arguments(calls: Sequence[ToolCall]) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def expected(calls: Calls) -> list[tuple[str, Any]]:
    return [(name, json.loads(text)) for name, text in calls]


# --- hand-written generations --------------------------------------------------------------


def test_reasoning_answer_and_stop(layout: Layout, tok: Tok) -> None:
    text = layout.write(REASONING, ANSWER, [], True)
    anatomy, calls = tok.read(text, opens_reasoning=layout.opens_reasoning)
    assert anatomy.reasoning is not None and tok.decode(anatomy.reasoning).strip() == REASONING
    assert anatomy.think_end_present is True
    assert tok.decode(anatomy.answer).strip() == ANSWER
    assert (anatomy.calls, calls, anatomy.calls_checked) == ((), [], True)
    assert anatomy.stop is not None and anatomy.stop in tok.markers().stops
    assert valid(anatomy, calls)


def test_reasoning_cut_by_length(layout: Layout, tok: Tok) -> None:
    text = layout.write(REASONING, "", [], False)
    anatomy, _ = tok.read(text[: text.index(REASONING) + 8], opens_reasoning=layout.opens_reasoning)
    assert anatomy.reasoning is not None and tok.decode(anatomy.reasoning).strip() == "The user"
    assert anatomy.think_end_present is False
    assert not valid(anatomy, [])


def test_one_call(layout: Layout, tok: Tok) -> None:
    anatomy, calls = tok.read(
        layout.write(REASONING, "", [WEATHER], True), opens_reasoning=layout.opens_reasoning
    )
    assert anatomy.reasoning is not None and tok.decode(anatomy.reasoning).strip() == REASONING
    assert arguments(calls) == expected([WEATHER])
    assert all(c.arguments_json and c.declared for c in calls)
    assert anatomy.sections_balanced and anatomy.stop is not None
    assert valid(anatomy, calls)


def test_parallel_calls(layout: Layout, tok: Tok) -> None:
    anatomy, calls = tok.read(
        layout.write(REASONING, "", [WEATHER, TIME], True), opens_reasoning=layout.opens_reasoning
    )
    assert arguments(calls) == expected([WEATHER, TIME])
    assert anatomy.sections_balanced and valid(anatomy, calls)
    assert not tok.decode(anatomy.answer).strip()  # only the template's glue, if any


def test_a_call_cut_by_length_is_unbalanced(layout: Layout, tok: Tok) -> None:
    text = layout.write(REASONING, "", [WEATHER], False)
    anatomy, calls = tok.read(
        text[: text.index("Oslo") + 2], opens_reasoning=layout.opens_reasoning
    )
    assert anatomy.stop is None
    assert len(anatomy.calls) == 1 and not anatomy.sections_balanced
    assert calls[0].name == "get_weather"
    assert not valid(anatomy, calls)


def test_broken_json_arguments_are_invalid(layout: Layout, tok: Tok) -> None:
    anatomy, calls = tok.read(
        layout.write(REASONING, "", [BROKEN], True), opens_reasoning=layout.opens_reasoning
    )
    assert anatomy.sections_balanced
    [call] = calls
    assert call.name == "get_weather" and not call.arguments_json
    assert not valid(anatomy, calls)


def test_plain_answer(layout: Layout, tok: Tok) -> None:
    anatomy, calls = tok.read(layout.write(None, ANSWER, [], True), opens_reasoning=False)
    assert (anatomy.reasoning, anatomy.think_end_present) == (None, None)
    assert tok.decode(anatomy.answer).strip() == ANSWER
    assert (anatomy.calls, calls) == ((), [])
    assert anatomy.calls_checked and valid(anatomy, calls)


def test_an_undeclared_call_is_told(layout: Layout, tok: Tok) -> None:
    anatomy = tok.family.dissect(
        tok.encode(layout.write(REASONING, "", [WEATHER], True)),
        tok.markers(),
        opens_reasoning=layout.opens_reasoning,
    )
    [call] = tok.family.parse_calls(anatomy, tok.decode, {"other"})
    assert call.declared is False
    [unknown] = tok.family.parse_calls(anatomy, tok.decode, None)
    assert unknown.declared is None


# --- the unknown family --------------------------------------------------------------------


def without(vocab: dict[str, int], tokens: Sequence[str]) -> dict[str, int]:
    return {k: v for k, v in vocab.items() if k not in tokens}


def test_a_tokenizer_of_no_known_family_reads_reasoning_and_leaves_calls_unchecked(
    tokenizers: Callable[[str], Any],
) -> None:
    tok = Tok(tokenizers("kimi_k2"), UNKNOWN)
    # The bundled vocabulary without Kimi's call tokens: a family no rule knows.
    vocab = without(tok.vocab, KIMI_K2.structure())
    family = family_for(vocab, "{{ messages }}")
    assert family is UNKNOWN
    markers = family.markers(vocab, [vocab["<|im_end|>"]])
    ids = tok.encode(write_kimi(REASONING, ANSWER, [WEATHER], True))
    anatomy = family.dissect(ids, markers, opens_reasoning=True)
    assert tok.decode(anatomy.reasoning or ()) == REASONING
    assert anatomy.think_end_present is True and anatomy.stop == vocab["<|im_end|>"]
    assert not anatomy.calls_checked and anatomy.calls == ()
    assert family.parse_calls(anatomy, tok.decode, DECLARED) == []
    assert valid(anatomy, [])  # judged on its reasoning: calls not checked, not "0 invalid"


def test_a_family_whose_call_tokens_are_missing_leaves_calls_unchecked() -> None:
    markers = QWEN3.markers({"<think>": 1, "</think>": 2, "<|im_end|>": 3}, [3])
    assert not markers.calls_checked and markers.call_ids == frozenset()
    assert (markers.think_start, markers.think_end, markers.call_begin) == (1, 2, None)


# --- detection -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokenizer", "family"),
    [
        ("kimi_k2", "kimi_k2"),
        ("qwen3", "qwen3"),
        ("qwen3_hybrid", "qwen3"),
        ("qwen3_thinking", "qwen3"),
        ("deepseek_v3", "deepseek_v3"),
        ("deepseek_r1", "deepseek_v3"),  # R1 writes V3's layout
        ("deepseek_v31", "deepseek_v31"),
        ("glm45", "glm45"),
        ("gpt_oss", "gpt_oss"),
    ],
)
def test_each_family_is_detected_from_its_tokenizer_and_template(
    tokenizers: Callable[[str], Any], tokenizer: str, family: str
) -> None:
    loaded = tokenizers(tokenizer)
    assert family_for(loaded.get_vocab(), loaded.chat_template).name == family


def test_the_bundled_tokenizer_is_kimi() -> None:
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    assert family_for(loaded.get_vocab(), loaded.chat_template) is KIMI_K2


def vocab_of(*tokens: str) -> dict[str, int]:
    return {token: i for i, token in enumerate(["a", "<think>", "</think>", *tokens])}


QWEN3_TOKENS = ("<tool_call>", "</tool_call>", "<|im_start|>")
GLM45_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)
DEEPSEEK_TOKENS = (DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP)
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>")


@pytest.mark.parametrize(
    ("tokens", "family"),
    [
        (QWEN3_TOKENS, "qwen3"),
        (GLM45_TOKENS, "glm45"),
        (DEEPSEEK_TOKENS, "deepseek_v3"),
        ((*HARMONY_TOKENS, "<|constrain|>"), "gpt_oss"),
        (("<|im_start|>", "<|im_end|>"), "unknown"),
        (HARMONY_TOKENS, "unknown"),  # without <|constrain|>: not all of harmony's tokens
    ],
)
def test_detection_from_the_vocabulary_alone(tokens: tuple[str, ...], family: str) -> None:
    assert family_for(vocab_of(*tokens), None).name == family


def test_the_template_tells_deepseek_v31_from_v3() -> None:
    vocab = vocab_of(*DEEPSEEK_TOKENS)
    v31 = "{{'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>'}}"
    v3 = "{{'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name']}}"
    assert family_for(vocab, v31) is DEEPSEEK_V31
    assert family_for(vocab, v3) is DEEPSEEK_V3


def test_a_template_of_another_layout_rules_a_family_out() -> None:
    # Qwen3-Coder's XML calls sit inside <tool_call> too: not Hermes JSON.
    coder = "<tool_call>\n<function={{ name }}>\n<parameter=x>"
    assert family_for(vocab_of(*QWEN3_TOKENS), coder) is UNKNOWN
    # DeepSeek-V3.2 keeps the old tokens but writes its calls in DSML.
    dsml = "<｜Assistant｜>{{ '<｜DSML｜function_calls>' }}"
    assert family_for(vocab_of(*DEEPSEEK_TOKENS), dsml) is UNKNOWN


def test_the_override_wins_and_unknown_names_are_refused() -> None:
    vocab = vocab_of(*QWEN3_TOKENS)
    assert family_for(vocab, None, "glm45") is GLM45
    assert family_for(vocab, None, "deepseek_r1") is DEEPSEEK_V3
    assert family_for(vocab, None, "unknown") is UNKNOWN
    assert family_named("harmony") is GPT_OSS and family_named("hermes") is QWEN3
    with pytest.raises(ValueError, match="unknown model family 'llama'") as refused:
        family_for(vocab, None, "llama")
    assert all(name in str(refused.value) for name in NAMES)


def test_every_family_has_a_distinct_name() -> None:
    assert len({f.name for f in FAMILIES}) == len(FAMILIES) == len(NAMES) - 1


# --- round trip through each family's template ---------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name.removeprefix('get_')} of a place.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    for name in ("get_weather", "get_time")
]


def assistant(layout: Layout, content: str, calls: Calls) -> dict[str, Any]:
    """An assistant turn as each template takes it: DeepSeek's templates concatenate the
    arguments as a string, the others write them with tojson; gpt-oss reads ``thinking``."""
    strings = layout.tokenizer.startswith("deepseek")
    message: dict[str, Any] = {"role": "assistant", "content": content}
    message["thinking" if layout.tokenizer == "gpt_oss" else "reasoning_content"] = REASONING
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": text if strings else json.loads(text),
                },
            }
            for i, (name, text) in enumerate(calls)
        ]
    return message


def rendered_output(tok: Tok, messages: list[dict[str, Any]]) -> tuple[list[int], bool]:
    """The ids the template writes for the last turn after the generation prompt, up to its
    stop (what follows is the template's turn suffix), and whether the prompt opened
    reasoning."""

    def render(part: list[dict[str, Any]], prompt: bool) -> list[int]:
        ids = tok.tokenizer.apply_chat_template(
            part, tools=TOOLS, add_generation_prompt=prompt, tokenize=True, return_dict=False
        )
        return list(ids)

    prompt, full = render(messages[:-1], True), render(messages, False)
    assert full[: len(prompt)] == prompt, "the template's turn extends its generation prompt"
    output = full[len(prompt) :]
    markers = tok.markers()
    stops = [i for i, token in enumerate(output) if token in markers.stops]
    output = output[: stops[-1] + 1] if stops else output
    tail = prompt[-3:]  # the generation prompt's end, white space after think-start aside
    while tail and not tok.decode(tail[-1:]).strip():
        tail.pop()
    return output, bool(tail) and tail[-1] == markers.think_start


def test_calls_written_by_the_template_read_back_the_same(layout: Layout, tok: Tok) -> None:
    # gpt-oss's template writes one call per assistant message.
    calls = [WEATHER] if layout.tokenizer == "gpt_oss" else [WEATHER, TIME]
    messages = [
        {"role": "user", "content": "Weather and time in Oslo?"},
        assistant(layout, "", calls),
    ]
    output, opens = rendered_output(tok, messages)
    anatomy = tok.family.dissect(output, tok.markers(), opens_reasoning=opens)
    read = tok.family.parse_calls(anatomy, tok.decode, DECLARED)
    assert arguments(read) == expected(calls)
    assert all(c.declared for c in read) and valid(anatomy, read)
    assert not tok.decode(anatomy.answer).strip() and not tok.decode(anatomy.stray).strip()


def test_an_answer_written_by_the_template_reads_back_the_same(layout: Layout, tok: Tok) -> None:
    messages = [{"role": "user", "content": "Weather in Oslo?"}, assistant(layout, ANSWER, [])]
    output, opens = rendered_output(tok, messages)
    anatomy = tok.family.dissect(output, tok.markers(), opens_reasoning=opens)
    assert tok.decode(anatomy.answer).strip() == ANSWER and valid(anatomy, [])
    # DeepSeek's templates drop the last turn's reasoning; the others keep it.
    kept = None if layout.tokenizer.startswith("deepseek") else REASONING
    reasoning = None if anatomy.reasoning is None else tok.decode(anatomy.reasoning).strip()
    assert reasoning == kept


def test_the_templates_are_the_ones_under_test() -> None:
    assert "<arg_key>" in family_template("glm45")
    assert "<|channel|>" in family_template("gpt_oss")


# --- reading each call syntax from text -----------------------------------------------------


def test_hermes_keeps_the_arguments_as_written() -> None:
    read = read_hermes("", '\n{"name": "f", "arguments": {"a":1,  "b": [2]}}\n')
    assert (read.name, read.arguments, read.arguments_json) == ("f", '{"a":1,  "b": [2]}', True)


def test_hermes_parameters_and_missing_arguments_as_sglang_reads_them() -> None:
    assert read_hermes("", '{"name": "f", "parameters": {"a": 1}}').arguments == '{"a": 1}'
    assert read_hermes("", '{"name": "f"}').arguments == "{}"
    assert read_hermes("", '{"name": "f", "arguments": {"a"').name == "f"
    assert not read_hermes("", '["f"]').arguments_json


def test_glm_values_are_json_when_they_parse_else_strings() -> None:
    pairs = [("n", "3"), ("s", "Oslo, NO"), ("l", "[1, 2]")]
    body = "f\n" + "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in pairs
    )
    read = read_glm("", body)
    assert read.name == "f" and read.arguments_json
    assert json.loads(read.arguments) == {"n": 3, "s": "Oslo, NO", "l": [1, 2]}
    assert read_glm("", "f\n").arguments == "{}"
    assert read_glm("", "f<arg_key>a</arg_key><arg_value>1</arg_value>").name == "f"  # GLM-4.7
    assert not read_glm("", "f\n<arg_key>a</arg_key>\nstray\n").arguments_json


def test_deepseek_v3_without_its_json_fence_is_broken() -> None:
    assert not read_deepseek_v3("function", 'f\n{"a": 1}').arguments_json
    assert read_deepseek_v3("function", 'f\n```json\n{"a": 1}\n```').arguments == '{"a": 1}'


def test_harmony_recipient_in_either_place_and_an_empty_body() -> None:
    assert read_harmony("<|channel|>commentary to=functions.f <|constrain|>json", "{}").name == "f"
    assert read_harmony("assistant to=functions.f<|channel|>commentary json", "").arguments == "{}"
    assert read_harmony("assistant to=browser.search<|channel|>commentary", "{}").name == (
        "browser.search"
    )
