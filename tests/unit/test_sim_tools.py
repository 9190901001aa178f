"""The simulator's tool calls: declarations read from templated prompts, calls in the template's
format whose arguments fit a declared schema, broken arguments at their rate, determinism."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from eaglegen.assets import SAMPLE_DATASET, TOKENIZER_DIR
from eaglegen.sim.engine import OutputShape, Sampling, Vocab, generate
from eaglegen.sim.tools import (
    Function,
    ToolCallWriter,
    ToolDeclarations,
    arguments_for,
    broken_arguments,
    parse_functions,
    value_for,
)
from eaglegen.sim.vocab import load_vocab

SHAPE = OutputShape()
SECTION = re.compile(
    r"<\|tool_calls_section_begin\|>(?P<calls>.*?)(?:<\|tool_calls_section_end\|>|$)", re.S
)
CALL = re.compile(
    r"<\|tool_call_begin\|>functions\.(?P<name>[^:<]+):(?P<index>\d+)"
    r"<\|tool_call_argument_begin\|>(?P<arguments>.*?)<\|tool_call_end\|>",
    re.S,
)
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {}},
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 2, "maxLength": 12},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 0.5},
            "exact": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 4},
            "when": {"type": "string", "format": "date"},
            "note": {"type": ["string", "null"]},
            "kind": {"const": "fixed"},
            "either": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
            "where": {
                "type": "object",
                "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["lat", "lon"],
            },
        },
        "required": ["city", "days", "where"],
    },
    # No type keyword: an object by its properties, an array by its items.
    {"properties": {"ids": {"items": {"type": "integer", "maximum": -5}}}, "required": ["ids"]},
    # Recursive in spirit: nesting stops at MAX_DEPTH.
    {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "object", "properties": {}}}}
        },
        "required": ["a"],
    },
]


@dataclass(frozen=True)
class ParsedCall:
    """One call read back from generated text."""

    name: str
    index: int
    arguments: str


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """The calls of the first tool-call section in text, in the template's format."""
    section = SECTION.search(text)
    if section is None:
        return []
    return [
        ParsedCall(m["name"], int(m["index"]), m["arguments"])
        for m in CALL.finditer(section["calls"])
    ]


def matches_schema(value: Any, schema: Mapping[str, Any]) -> bool:
    """Whether value fits the schema's common keywords (what the simulator fills)."""
    if "const" in schema:
        return bool(value == schema["const"])
    if "enum" in schema:
        return value in schema["enum"]
    if "anyOf" in schema:
        return any(matches_schema(value, option) for option in schema["anyOf"])
    kinds = schema.get("type")
    if kinds is None:
        kinds = "object" if "properties" in schema else "array" if "items" in schema else None
    kinds = kinds if isinstance(kinds, list) else [kinds] if kinds else []
    return not kinds or any(_fits(value, kind, schema) for kind in kinds)


def _fits(value: Any, kind: str, schema: Mapping[str, Any]) -> bool:
    """Whether value is of one JSON schema type, within that type's keywords."""
    if kind == "object":
        return isinstance(value, dict) and _object_fits(value, schema)
    if kind == "array":
        return (
            isinstance(value, list)
            and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value))
            and all(matches_schema(v, schema.get("items", {})) for v in value)
        )
    if kind == "string":
        return isinstance(value, str) and (
            schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value))
        )
    if kind in ("integer", "number"):
        ok = isinstance(value, int) if kind == "integer" else isinstance(value, int | float)
        return ok and not isinstance(value, bool) and _within(value, schema)
    if kind == "boolean":
        return isinstance(value, bool)
    return kind == "null" and value is None


def _object_fits(value: dict[str, Any], schema: Mapping[str, Any]) -> bool:
    """Required keys present, no undeclared ones, each property fitting its schema."""
    properties = schema.get("properties", {})
    return (
        set(schema.get("required", [])) <= set(value)
        and set(value) <= set(properties)
        and all(matches_schema(v, properties[k]) for k, v in value.items())
    )


def _within(value: float, schema: Mapping[str, Any]) -> bool:
    """Inside minimum/maximum and the exclusive bounds."""
    return (
        value >= schema.get("minimum", value)
        and value <= schema.get("maximum", value)
        and ("exclusiveMinimum" not in schema or value > schema["exclusiveMinimum"])
        and ("exclusiveMaximum" not in schema or value < schema["exclusiveMaximum"])
    )


def tool_rows() -> list[dict[str, Any]]:
    """The sample dataset's rows that declare tools."""
    with SAMPLE_DATASET.open() as handle:
        rows = [json.loads(line) for line in handle]
    return [row for row in rows if row.get("tools")]


@pytest.fixture(scope="module")
def hf() -> Any:
    """The bundled tokenizer with its chat template, as the producer renders prompts."""
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)


@pytest.fixture(scope="module")
def loaded() -> tuple[Vocab, Tokenizer]:
    """The simulator's view of the bundled tokenizer."""
    return load_vocab(TOKENIZER_DIR)


def render_ids(hf: Any, row: dict[str, Any]) -> list[int]:
    """A row's prompt token ids, rendered by the chat template with its tools."""
    text = hf.apply_chat_template(
        row["messages"], tools=row.get("tools"), tokenize=False, add_generation_prompt=True
    )
    return list(hf.encode(text, add_special_tokens=False))


def writer(loaded: tuple[Vocab, Tokenizer], functions: Any, rate: float) -> ToolCallWriter:
    """A ToolCallWriter encoding with the bundled tokenizer."""
    tokenizer = loaded[1]
    return ToolCallWriter(
        functions, lambda text: tokenizer.encode(text, add_special_tokens=False).ids, rate
    )


def generations(
    hf: Any, loaded: tuple[Vocab, Tokenizer], rate: float, seeds: int
) -> Iterator[tuple[dict[str, Any], str]]:
    """(row, generated text) for every tool row and sampling seed."""
    vocab, tokenizer = loaded
    declarations = ToolDeclarations(tokenizer, vocab.im_end)
    for row in tool_rows():
        ids = render_ids(hf, row)
        tools = writer(loaded, declarations.functions(ids), rate)
        for seed in range(seeds):
            out = generate(ids, Sampling(max_new_tokens=100_000, seed=seed), vocab, SHAPE, tools)
            yield row, tokenizer.decode(out.output_ids, skip_special_tokens=False)


def declared(row: dict[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Function name -> parameters schema of a row's tools."""
    return {t["function"]["name"]: t["function"]["parameters"] for t in row["tools"]}


# --- declarations ---------------------------------------------------------------------------


def test_declarations_are_read_from_a_templated_prompt(
    hf: Any, loaded: tuple[Vocab, Tokenizer]
) -> None:
    vocab, tokenizer = loaded
    declarations = ToolDeclarations(tokenizer, vocab.im_end)
    rows = tool_rows()
    assert len(rows) >= 10
    for row in rows:
        functions = declarations.functions(render_ids(hf, row))
        assert {f.name: dict(f.parameters) for f in functions} == declared(row)
    plain = {"messages": [{"role": "user", "content": "Hello there"}]}
    assert declarations.functions(render_ids(hf, plain)) == ()
    assert declarations.functions([1, 2, 3]) == ()


def test_only_the_tool_declare_block_declares_tools(
    hf: Any, loaded: tuple[Vocab, Tokenizer]
) -> None:
    vocab, tokenizer = loaded
    # A user pasting tool JSON into a message declares nothing.
    row = {"messages": [{"role": "user", "content": json.dumps(tool_rows()[0]["tools"])}]}
    assert ToolDeclarations(tokenizer, vocab.im_end).functions(render_ids(hf, row)) == ()


def test_unreadable_declarations_declare_nothing() -> None:
    assert parse_functions("not json") == ()
    assert parse_functions('{"name": "x"}') == ()
    assert parse_functions('[1, {"function": {"name": ""}}, {"name": 3}]') == ()
    bare = parse_functions('[{"name": "f", "parameters": 5}, {"name": "g"}]')
    assert bare == (Function("f", {}), Function("g", {}))


# --- arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize("schema", SCHEMAS)
def test_arguments_fit_their_schema(schema: dict[str, Any]) -> None:
    rng = random.Random(7)
    seen_optional = False
    for _ in range(300):
        arguments = arguments_for(schema, rng)
        assert isinstance(arguments, dict)
        assert matches_schema(json.loads(json.dumps(arguments)), schema), arguments
        seen_optional |= len(arguments) > len(schema.get("required", []))
    assert seen_optional or len(schema.get("properties", {})) == len(schema.get("required", []))


def test_the_schema_checker_rejects_misfits() -> None:
    schema = SCHEMAS[1]
    good = {"city": "Oslo", "days": 3, "where": {"lat": 1.0, "lon": 2.0}}
    assert matches_schema(good, schema)
    for bad in (
        {**good, "city": 5},
        {**good, "days": 9},
        {**good, "days": True},
        {**good, "unit": "kelvin"},
        {**good, "ratio": 0},
        {**good, "tags": ["one"]},
        {**good, "extra": 1},
        {"city": "Oslo", "days": 3},
    ):
        assert not matches_schema(bad, schema), bad


def test_values_honour_enum_const_and_formats() -> None:
    rng = random.Random(1)
    assert {value_for({"enum": ["a", "b"]}, rng, 0) for _ in range(50)} == {"a", "b"}
    assert value_for({"const": 3}, rng, 0) == 3
    assert re.fullmatch(r"2024-\d\d-\d\d", value_for({"type": "string", "format": "date"}, rng, 0))
    email = value_for({"type": "string", "format": "email"}, rng, 0)
    assert email.endswith("@example.org")
    assert value_for({"type": "null"}, rng, 0) is None
    assert arguments_for({}, rng) == {}


def test_broken_arguments_are_never_json() -> None:
    rng = random.Random(3)
    for schema in SCHEMAS:
        for kind in range(4):
            text = json.dumps(arguments_for(schema, rng))
            with pytest.raises(ValueError):
                json.loads(broken_arguments(text, kind))


# --- calls in generated outputs -------------------------------------------------------------


def test_generated_calls_name_a_declared_function_with_fitting_json(
    hf: Any, loaded: tuple[Vocab, Tokenizer]
) -> None:
    calls = 0
    for row, text in generations(hf, loaded, rate=0.0, seeds=8):
        functions = declared(row)
        parsed = parse_tool_calls(text)
        assert len(parsed) == text.count("<|tool_call_begin|>")
        assert [call.index for call in parsed] == list(range(len(parsed)))
        for call in parsed:
            assert matches_schema(json.loads(call.arguments), functions[call.name])
        calls += len(parsed)
        if parsed:
            assert text.endswith("<|tool_calls_section_end|><|im_end|>")
    assert calls >= 60  # about one output in two calls a tool, sometimes two


def test_generated_calls_read_back_through_the_chat_template(
    hf: Any, loaded: tuple[Vocab, Tokenizer]
) -> None:
    # The output is what the template renders for the same assistant turn in history.
    checked = 0
    for row, text in generations(hf, loaded, rate=0.0, seeds=4):
        parsed = parse_tool_calls(text)
        if not parsed:
            continue
        reasoning, _, rest = text.partition("</think>")
        content = rest[: rest.index("<|tool_calls_section_begin|>")]
        calls = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed
        ]
        turn = {
            "role": "assistant",
            "reasoning_content": reasoning,
            "content": content,
            "tool_calls": calls,
        }
        kwargs = {"tools": row["tools"], "tokenize": False}
        prompt = hf.apply_chat_template(row["messages"], add_generation_prompt=True, **kwargs)
        history = hf.apply_chat_template([*row["messages"], turn], **kwargs)
        assert history == prompt + text
        checked += 1
    assert checked >= 10


def test_broken_arguments_come_at_about_their_rate(
    hf: Any, loaded: tuple[Vocab, Tokenizer]
) -> None:
    broken = total = 0
    for _, text in generations(hf, loaded, rate=0.3, seeds=20):
        for call in parse_tool_calls(text):
            total += 1
            try:
                json.loads(call.arguments)
            except ValueError:
                broken += 1
    assert total >= 200
    assert 0.2 <= broken / total <= 0.4


def test_calls_are_deterministic_and_the_rate_changes_only_broken_ones(
    hf: Any, loaded: tuple[Vocab, Tokenizer]
) -> None:
    clean = list(generations(hf, loaded, rate=0.0, seeds=3))
    assert clean == list(generations(hf, loaded, rate=0.0, seeds=3))
    faulty = list(generations(hf, loaded, rate=0.5, seeds=3))
    for (_, a), (_, b) in zip(clean, faulty, strict=True):
        calls_a, calls_b = parse_tool_calls(a), parse_tool_calls(b)
        assert [c.name for c in calls_a] == [c.name for c in calls_b]
        for x, y in zip(calls_a, calls_b, strict=True):
            assert x.arguments == y.arguments or broken_json(y.arguments)


def broken_json(text: str) -> bool:
    """Whether text is not valid JSON."""
    try:
        json.loads(text)
    except ValueError:
        return True
    return False


def test_a_call_cut_by_max_new_tokens_is_truncated(
    hf: Any, loaded: tuple[Vocab, Tokenizer]
) -> None:
    vocab, tokenizer = loaded
    declarations = ToolDeclarations(tokenizer, vocab.im_end)
    for row in tool_rows():
        ids = render_ids(hf, row)
        tools = writer(loaded, declarations.functions(ids), 0.0)
        full = generate(ids, Sampling(max_new_tokens=100_000), vocab, SHAPE, tools).output_ids
        if vocab.tool_call_argument_begin in full:
            break
    else:
        pytest.fail("no sample row called a tool with sampling seed 0")
    cut_at = full.index(vocab.tool_call_argument_begin) + 3
    cut = generate(ids, Sampling(max_new_tokens=cut_at), vocab, SHAPE, tools)
    assert cut.output_ids == full[:cut_at]
    assert cut.finish.to_json() == {"type": "length", "length": cut_at}
