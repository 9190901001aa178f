"""The functions a prompt declares, for any chat template: learnt once by rendering the
template with a probe tool, then read from each prompt's decoded text.

Templates write the declared tools in their own ways: Qwen3 and GLM-4.5 one JSON object a
line inside `<tools>`, Kimi-K2 a JSON list in its own block, gpt-oss a TypeScript-like line
per function (`type NAME = (_: PARAMETERS) => any;`), DeepSeek-R1 and V3.1 none at all. At
startup the template is rendered (as transformers renders it) with one probe function and one
user message, which shows

- whether it writes declarations at all: when not, every prompt may call the simulator's own
  made-up functions (`INVENTED`), one prompt in two as with declared tools;
- how: as JSON (every JSON function object of the text is read: `{"type": "function",
  "function": {...}}` or `{"name": ..., "parameters": ...}`), or else by the text either side
  of the name (gpt-oss's `type ` and ` = (_: `, its parameters read when they are JSON);
- where: before the first user turn (the text the template writes before the probe's user
  message, from its turn's special token), so that tools pasted into a message declare
  nothing. A template that will not render here is read as JSON over the whole prompt.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from eaglegen.sim.tools import Function

logger = logging.getLogger(__name__)

PROBE_NAME = "eaglegen_probe_function"
PROBE_USER = "eaglegen probe message"
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": PROBE_NAME,
            "description": "A probe.",
            "parameters": {
                "type": "object",
                "properties": {"probe": {"type": "string", "description": "A probe."}},
                "required": ["probe"],
            },
        },
    }
]
# Made-up functions for a template that writes no declarations.
INVENTED: tuple[Function, ...] = (
    Function(
        "get_weather",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    ),
    Function(
        "search",
        {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 10},
            },
            "required": ["query"],
        },
    ),
)
# Distinct declaration texts remembered (a run has few tool sets, each sent many times).
_CACHE_SIZE = 256
# The most text either side of a name that a non-JSON declaration is recognised by.
_CONTEXT_CHARS = 16
_OPENERS = re.compile(r"[\[{]")
_NAME = r"([A-Za-z_][\w.\-]*)"


class Declarations(Protocol):
    """Finds the functions a prompt declares (`tools.ToolDeclarations` for Kimi-K2's block)."""

    def functions(self, input_ids: Sequence[int]) -> tuple[Function, ...]:
        """The functions the prompt declares; empty when it declares none."""
        ...


@dataclass(frozen=True)
class Probe:
    """What rendering the template with the probe showed."""

    writes: bool  # the template writes declared tools
    header: str | None  # the user turn's header: declarations come before it (None: anywhere)
    pattern: re.Pattern[str] | None  # names by their context; None: declarations are JSON


def learn(template: str | None, tokens: Mapping[str, str], specials: Iterable[str]) -> Probe:
    """Render `template` with the probe (tokens: its bos_token, eos_token, ...; specials: the
    tokenizer's added token strings) and read how it declares tools."""
    if not template:
        return Probe(writes=False, header=None, pattern=None)
    try:
        text = render(
            template,
            messages=[{"role": "user", "content": PROBE_USER}],
            tools=_PROBE_TOOLS,
            add_generation_prompt=True,
            **tokens,
        )
    except (TemplateError, TypeError, ValueError, LookupError, AttributeError) as exc:
        logger.warning("the chat template does not render here (%s): tools read as JSON", exc)
        return Probe(writes=True, header=None, pattern=None)
    named, user = text.find(PROBE_NAME), text.find(PROBE_USER)
    if named < 0:
        return Probe(writes=False, header=None, pattern=None)
    header = turn_header(text[:user], specials) if 0 <= named < user else None
    if any(fn.name == PROBE_NAME for fn in json_functions(text)):
        return Probe(writes=True, header=header, pattern=None)
    pattern = name_pattern(text, named)
    return Probe(writes=pattern is not None, header=header, pattern=pattern)


def render(template: str, **context: Any) -> str:
    """The template rendered as transformers' apply_chat_template renders it."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return str(env.from_string(template).render(**context))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    raise TemplateError(message)


def turn_header(before: str, specials: Iterable[str]) -> str | None:
    """The header of the user turn that `before` ends with: its shortest ending that occurs
    nowhere earlier, widened to the special token it starts at or after (`<|im_start|>user\\n`,
    `<|start|>user<|message|>`); None without such a token."""
    size = 1
    while size < len(before) and before.find(before[-size:]) != len(before) - size:
        size += 1
    cut = len(before) - size
    starts = [before.rfind(token, 0, cut + len(token)) for token in specials if token]
    start = max(starts, default=-1)
    return before[start:] if start >= 0 else None


def name_pattern(text: str, at: int) -> re.Pattern[str] | None:
    """A pattern finding names where the template writes the probe's (at `at` in `text`): the
    text before it since its line began, and after it up to an opening brace or the line's
    end (or the line's end itself: DeepSeek-V3.1's `### NAME`); None when the text before it
    is blank or nothing follows it."""
    line = text.rfind("\n", 0, at) + 1
    before = text[max(line, at - _CONTEXT_CHARS) : at]
    rest = text[at + len(PROBE_NAME) : at + len(PROBE_NAME) + _CONTEXT_CHARS]
    after = re.split(r"[{\n]", rest, maxsplit=1)[0]
    if not after.strip() and rest.startswith("\n"):
        after = "\n"
    if not before.strip() or not after.strip("\t "):
        return None
    return re.compile(re.escape(before) + _NAME + re.escape(after))


def json_functions(text: str) -> tuple[Function, ...]:
    """Every function declaration written as JSON in `text`, in order, each name once."""
    decoder = json.JSONDecoder()
    found: dict[str, Function] = {}
    at = _OPENERS.search(text)
    while at is not None:
        try:
            value, end = decoder.raw_decode(text, at.start())
        except ValueError:
            at = _OPENERS.search(text, at.start() + 1)
            continue
        for fn in _functions_in(value):
            found.setdefault(fn.name, fn)
        at = _OPENERS.search(text, end)
    return tuple(found.values())


def _functions_in(value: Any) -> list[Function]:
    """The declarations in one JSON value: OpenAI `{"type", "function": {...}}` entries or bare
    `{"name", "parameters"}` ones, alone or in a list."""
    out = []
    for item in value if isinstance(value, list) else [value]:
        if not isinstance(item, dict):
            continue
        wrapped = isinstance(item.get("function"), dict)
        fn = item["function"] if wrapped else item
        name = fn.get("name")
        if isinstance(name, str) and name and (wrapped or "parameters" in fn):
            params = fn.get("parameters")
            out.append(Function(name, params if isinstance(params, dict) else {}))
    return out


def pattern_functions(text: str, pattern: re.Pattern[str]) -> tuple[Function, ...]:
    """The names `pattern` finds, each with its parameters when JSON follows the name."""
    decoder = json.JSONDecoder()
    found: dict[str, Function] = {}
    for match in pattern.finditer(text):
        params: Any = {}
        if text.startswith("{", match.end()):
            try:
                params = decoder.raw_decode(text, match.end())[0]
            except ValueError:
                params = {}
        name = match.group(1)
        found.setdefault(name, Function(name, params if isinstance(params, dict) else {}))
    return tuple(found.values())


class TemplateDeclarations:
    """Reads a prompt's declarations the way its template writes them (see `learn`)."""

    def __init__(self, probe: Probe, decode: Callable[[Sequence[int]], str]) -> None:
        self.probe = probe
        self._decode = decode
        self._cache: OrderedDict[str, tuple[Function, ...]] = OrderedDict()

    def functions(self, input_ids: Sequence[int]) -> tuple[Function, ...]:
        """The functions the prompt declares; the made-up ones when its template writes none."""
        if not self.probe.writes:
            return INVENTED
        text = self._decode(input_ids)
        if self.probe.header is not None:
            cut = text.find(self.probe.header)
            text = text if cut < 0 else text[:cut]
        if text not in self._cache:
            self._cache[text] = self._read(text)
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(text)
        return self._cache[text]

    def _read(self, text: str) -> tuple[Function, ...]:
        if self.probe.pattern is None:
            return json_functions(text)
        return pattern_functions(text, self.probe.pattern)
