"""Tool calls for prompts that declare tools, in the layout of the model's family.

The bundled chat template (Kimi-style, `eaglegen/assets/chat_template.jinja`) renders the
declared tools as `<|im_system|>tool_declare<|im_middle|>[...tools as JSON...]<|im_end|>`, read
back here by `ToolDeclarations`; other templates are read by `eaglegen.sim.declarations`.
A call is written as its family writes it (`CallFormat`, one per `core.calls` syntax: Kimi's
`functions.NAME:INDEX` head and JSON arguments, Qwen3's `{"name": ..., "arguments": ...}`,
DeepSeek's fenced JSON, GLM's `<arg_key>`/`<arg_value>` pairs, harmony's recipient), and the
family's tokens around it are laid out by `eaglegen.sim.layouts`. Arguments are JSON filling a
declared function's parameters schema, from the generation's seeded rng, so the same prompt and
seed always call the same function the same way.
"""

from __future__ import annotations

import json
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from core import calls as syntax
from eaglegen.sim.engine import ToolCallTokens

# The role the template gives the block that declares the tools.
DECLARE_ROLE = "tool_declare"
# Nested objects and arrays deeper than this are left empty: a schema may be recursive.
MAX_DEPTH = 4
# One answer in four that calls a tool calls two.
TWO_CALLS_ONE_IN = 4
# Distinct declaration blocks remembered (a run has few tool sets, each sent many times).
_CACHE_SIZE = 256
# How many system blocks to look at for the declarations (the template renders them first).
_SYSTEM_BLOCKS = 4
_WORDS = (
    "Cairo", "Oslo", "Hanoi", "Nairobi", "Lima", "tardigrades", "weather", "quarterly",
    "report", "latest", "river", "market", "quantum", "garden", "invoice", "python",
    "blue", "north", "summary", "2024", "draft", "kitchen", "orbit", "harbor",
)  # fmt: skip


@dataclass(frozen=True)
class Function:
    """One declared function: its name and the JSON schema of its arguments."""

    name: str
    parameters: Mapping[str, Any]


class ToolDeclarations:
    """Finds the functions a prompt declares, from the token ids the chat template rendered."""

    def __init__(self, tokenizer: Tokenizer, im_end: int) -> None:
        """Look up the template's block markers; a tokenizer without them declares nothing."""
        self._tokenizer = tokenizer
        self._system = tokenizer.token_to_id("<|im_system|>")
        self._middle = tokenizer.token_to_id("<|im_middle|>")
        self._end = im_end
        self._cache: OrderedDict[tuple[int, ...], tuple[Function, ...]] = OrderedDict()

    def functions(self, input_ids: Sequence[int]) -> tuple[Function, ...]:
        """The functions declared in the prompt; empty when it declares none."""
        span = self._declaration(list(input_ids))
        if span is None:
            return ()
        key = tuple(span)
        if key not in self._cache:
            text = self._tokenizer.decode(span, skip_special_tokens=False)
            self._cache[key] = parse_functions(text)
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return self._cache[key]

    def _declaration(self, ids: list[int]) -> list[int] | None:
        """The ids between `<|im_system|>tool_declare<|im_middle|>` and the next im_end."""
        if self._system is None or self._middle is None:
            return None
        start = 0
        for _ in range(_SYSTEM_BLOCKS):
            try:
                system = ids.index(self._system, start)
                middle = ids.index(self._middle, system)
                end = ids.index(self._end, middle)
            except ValueError:
                return None
            role = self._tokenizer.decode(ids[system + 1 : middle], skip_special_tokens=False)
            if role == DECLARE_ROLE:
                return ids[middle + 1 : end]
            start = end
        return None


def parse_functions(text: str) -> tuple[Function, ...]:
    """The functions of a rendered tools list (OpenAI `{"type", "function": {...}}` entries or
    bare `{"name", "parameters"}` ones); anything unreadable declares nothing."""
    try:
        tools = json.loads(text)
    except ValueError:
        return ()
    if not isinstance(tools, list):
        return ()
    found = []
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
            params = fn.get("parameters")
            found.append(Function(fn["name"], params if isinstance(params, dict) else {}))
    return tuple(found)


# How a call's text is written: (name, index in its section, arguments, the mistake when its
# arguments are broken on purpose, else None) -> (head, body), the text either side of the
# family's argument marker (all of it is body for a family without one).
Args = Mapping[str, Any]
CallWriter = Callable[[str, int, Args, int | None], tuple[str, str]]


@dataclass(frozen=True)
class CallFormat:
    """How one family writes its calls' text (`core.calls` reads it back)."""

    write: CallWriter
    lead: str = ""  # text between the answer and the first call
    between: str = ""  # text between two calls
    single: bool = False  # one call per turn (harmony ends the turn at the call)
    # The token ending a turn that calls tools, when not the family's usual stop.
    turn_end: str | None = None


def _json_arguments(arguments: Args, mistake: int | None) -> str:
    text = json.dumps(arguments, ensure_ascii=False)
    return text if mistake is None else broken_arguments(text, mistake)


def _kimi(name: str, index: int, arguments: Args, mistake: int | None) -> tuple[str, str]:
    return f"functions.{name}:{index}", _json_arguments(arguments, mistake)


def _hermes(name: str, index: int, arguments: Args, mistake: int | None) -> tuple[str, str]:
    # As Qwen3's template writes a call; broken arguments break the whole JSON body.
    body = f'{{"name": "{name}", "arguments": {_json_arguments(arguments, mistake)}}}'
    return "", f"\n{body}\n"


def _deepseek_v3(name: str, index: int, arguments: Args, mistake: int | None) -> tuple[str, str]:
    return "function", f"{name}\n```json\n{_json_arguments(arguments, mistake)}\n```"


def _deepseek_v31(name: str, index: int, arguments: Args, mistake: int | None) -> tuple[str, str]:
    return name, _json_arguments(arguments, mistake)


def _glm(name: str, index: int, arguments: Args, mistake: int | None) -> tuple[str, str]:
    # GLM-4.5's template: a string value as is, any other as JSON.
    pairs = [
        f"<arg_key>{key}</arg_key>\n<arg_value>"
        f"{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}"
        "</arg_value>\n"
        for key, value in arguments.items()
    ]
    if mistake is not None:
        pairs = _broken_pairs(pairs, mistake)
    return "", f"{name}\n{''.join(pairs)}"


def _broken_pairs(pairs: list[str], mistake: int) -> list[str]:
    """GLM's layout got wrong: a value never closed, or a key without its value."""
    if mistake % 2 == 0 and pairs:
        return [*pairs[:-1], pairs[-1].replace("</arg_value>", "", 1)]
    return [*pairs, "<arg_key>extra</arg_key>\n"]


def _harmony(name: str, index: int, arguments: Args, mistake: int | None) -> tuple[str, str]:
    # The message header after <|start|>, as gpt-oss's template writes a call.
    head = f"assistant to=functions.{name}<|channel|>commentary json"
    return head, _json_arguments(arguments, mistake)


FORMATS: dict[str, CallFormat] = {
    syntax.KIMI_K2: CallFormat(_kimi),
    syntax.HERMES: CallFormat(_hermes, lead="\n", between="\n"),
    syntax.DEEPSEEK_V3: CallFormat(_deepseek_v3, between="\n"),
    syntax.DEEPSEEK_V31: CallFormat(_deepseek_v31),
    syntax.GLM45: CallFormat(_glm, lead="\n", between="\n", turn_end="<|observation|>"),
    syntax.HARMONY: CallFormat(_harmony, single=True),
}
KIMI_FORMAT = FORMATS[syntax.KIMI_K2]


class ToolCallWriter:
    """Writes the calls of one answer's tool-call section (an engine ToolCaller)."""

    def __init__(
        self,
        functions: Sequence[Function],
        encode: Callable[[str], list[int]],
        broken_rate: float,
        call_format: CallFormat = KIMI_FORMAT,
    ) -> None:
        """Call among these functions; broken_rate of the calls get arguments that are not JSON
        (or, for GLM, a broken layout); each call written in call_format."""
        if not functions:
            raise ValueError("a tool call needs at least one declared function")
        self._functions = tuple(functions)
        self._encode = encode
        self._broken_rate = broken_rate
        self._format = call_format

    def __call__(self, rng: random.Random) -> list[ToolCallTokens]:
        """One call, sometimes two, each of a declared function with arguments for its schema."""
        count = 2 if rng.randrange(TWO_CALLS_ONE_IN) == 0 else 1
        if self._format.single:  # drawn anyway: the rest of the output stays the same
            count = 1
        return [self._call(rng, index) for index in range(count)]

    def _call(self, rng: random.Random, index: int) -> ToolCallTokens:
        """The call at this index of the section."""
        fn = rng.choice(self._functions)
        arguments = arguments_for(fn.parameters, rng)
        # Both draws happen whatever the rate, so changing the rate changes only the calls
        # that break, never the rest of an output.
        broken = rng.random() < self._broken_rate
        kind = rng.randrange(4)
        head, body = self._format.write(fn.name, index, arguments, kind if broken else None)
        return ToolCallTokens(tuple(self._encode(head)), tuple(self._encode(body)), broken)


def broken_arguments(arguments: str, kind: int) -> str:
    """Arguments a model got wrong, never valid JSON; kind (0-3) picks the mistake."""
    if kind == 0:
        broken = arguments[:-1]  # the closing brace never came
    elif kind == 1:
        broken = arguments.replace('"', "'")  # a Python dict, not JSON
    elif kind == 2:
        broken = arguments[:-1] + ", }"  # a trailing comma
    else:
        broken = arguments.replace('": ', '" ', 1)  # a missing colon
    try:
        json.loads(broken)
    except ValueError:
        return broken
    return arguments[:-1]  # "{}" survives some mistakes; "{" does not parse


def arguments_for(schema: Mapping[str, Any], rng: random.Random) -> dict[str, Any]:
    """Arguments for a function's parameters schema: always a JSON object."""
    value = value_for(schema, rng, 0) if _type_of(schema) == "object" else {}
    return value if isinstance(value, dict) else {}


def value_for(schema: object, rng: random.Random, depth: int) -> Any:
    """A value that the JSON schema accepts (the common keywords; others are ignored)."""
    if not isinstance(schema, Mapping):
        return _words(rng)
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return rng.choice(enum)
    for key in ("anyOf", "oneOf"):
        options = [o for o in schema.get(key) or () if isinstance(o, Mapping)]
        if options:
            return value_for(rng.choice(options), rng, depth)
    maker = _MAKERS.get(_type_of(schema))
    return (maker or _string)(schema, rng, depth)


def _type_of(schema: Mapping[str, Any]) -> str:
    """The schema's type: the first non-null of a list, or guessed from its keywords."""
    kind = schema.get("type")
    if isinstance(kind, list):
        named = [k for k in kind if isinstance(k, str) and k != "null"]
        kind = named[0] if named else "null"
    if isinstance(kind, str):
        return kind
    if "properties" in schema:
        return "object"
    return "array" if "items" in schema else "string"


def _object(schema: Mapping[str, Any], rng: random.Random, depth: int) -> dict[str, Any]:
    """Every required property, and each optional one with probability 1/2."""
    properties = schema.get("properties")
    if not isinstance(properties, Mapping) or depth >= MAX_DEPTH:
        return {}
    required = set(schema.get("required") or ())
    out: dict[str, Any] = {}
    for name, sub in properties.items():
        if name in required or rng.random() < 0.5:
            out[str(name)] = value_for(sub, rng, depth + 1)
    return out


def _array(schema: Mapping[str, Any], rng: random.Random, depth: int) -> list[Any]:
    """One to three items (within minItems/maxItems) of the items schema."""
    if depth >= MAX_DEPTH:
        return []
    lo = _int_keyword(schema, "minItems", 1)
    hi = max(lo, _int_keyword(schema, "maxItems", max(lo, 3)))
    items = schema.get("items")
    return [value_for(items, rng, depth + 1) for _ in range(rng.randint(lo, min(hi, lo + 2)))]


def _string(schema: Mapping[str, Any], rng: random.Random, depth: int) -> str:
    """A few words, or a value of the declared format, within minLength/maxLength."""
    fmt = schema.get("format")
    if fmt in ("date", "date-time"):
        text = f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        if fmt == "date-time":
            text += f"T{rng.randint(0, 23):02d}:00:00Z"
    elif fmt == "email":
        text = f"{rng.choice(_WORDS).lower()}@example.org"
    elif fmt in ("uri", "url"):
        text = f"https://example.org/{rng.choice(_WORDS).lower()}"
    else:
        text = _words(rng)
    text = text.ljust(_int_keyword(schema, "minLength", 0), "x")
    longest = schema.get("maxLength")
    return text[:longest] if isinstance(longest, int) and longest >= 0 else text


def _integer(schema: Mapping[str, Any], rng: random.Random, depth: int) -> int:
    """An integer within the schema's bounds (0..100 when it has none)."""
    lo, hi = _bounds(schema, step=1.0)
    low = math.ceil(lo)
    return rng.randint(low, max(low, math.floor(hi)))


def _number(schema: Mapping[str, Any], rng: random.Random, depth: int) -> float:
    """A number with two decimals within the schema's bounds (0..100 when it has none)."""
    lo, hi = _bounds(schema, step=0.01)
    return min(hi, max(lo, round(rng.uniform(lo, hi), 2)))


def _boolean(schema: Mapping[str, Any], rng: random.Random, depth: int) -> bool:
    """True or false."""
    return rng.random() < 0.5


def _null(schema: Mapping[str, Any], rng: random.Random, depth: int) -> None:
    """JSON null."""
    return None


_MAKERS: dict[str, Callable[[Mapping[str, Any], random.Random, int], Any]] = {
    "object": _object,
    "array": _array,
    "string": _string,
    "integer": _integer,
    "number": _number,
    "boolean": _boolean,
    "null": _null,
}


def _bounds(schema: Mapping[str, Any], step: float) -> tuple[float, float]:
    """[lo, hi] from minimum/maximum (exclusive ones moved one step inside); 100 wide when
    a side is open."""
    lo = _number_keyword(schema, "minimum")
    hi = _number_keyword(schema, "maximum")
    low_ex = _number_keyword(schema, "exclusiveMinimum")
    high_ex = _number_keyword(schema, "exclusiveMaximum")
    if low_ex is not None:
        lo = max(lo, low_ex + step) if lo is not None else low_ex + step
    if high_ex is not None:
        hi = min(hi, high_ex - step) if hi is not None else high_ex - step
    if lo is None:
        lo = 0.0 if hi is None or hi >= 0 else hi - 100
    if hi is None or hi < lo:
        hi = lo + 100 if hi is None else lo
    return lo, hi


def _number_keyword(schema: Mapping[str, Any], key: str) -> float | None:
    """A numeric keyword, or None when absent or not a number."""
    value = schema.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _int_keyword(schema: Mapping[str, Any], key: str, default: int) -> int:
    """A non-negative integer keyword, or the default."""
    value = schema.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return default


def _words(rng: random.Random) -> str:
    """One to three words."""
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))
