"""How each family writes one tool call, read back from the call's decoded text.

``core.anatomy`` cuts a call's ids into a header (before the family's argument marker, when it
has one) and a body; the caller decodes both with special tokens kept, and the reader of the
family's call syntax turns that text into a name, an index and the arguments as JSON text.
Each reader follows SGLang's detector for the layout
(``sgl-project/sglang: python/sglang/srt/function_call/``):

- ``kimi_k2`` (``kimik2_detector.py``): header ``functions.NAME:INDEX``, body the JSON.
- ``hermes`` (``qwen25_detector.py``, Qwen3's parser): no header; the body is
  ``{"name": NAME, "arguments": {...}}`` (``"parameters"`` taken first, as SGLang's
  ``parse_base_json`` does; missing arguments are ``{}``).
- ``deepseek_v3`` (``deepseekv3_detector.py``): header ``function`` (the type), body
  ``NAME\\n```json\\nARGS\\n````.
- ``deepseek_v31`` (``deepseekv31_detector.py``): header ``NAME``, body the JSON.
- ``glm45`` (``glm4_moe_detector.py``): no header; body ``NAME\\n<arg_key>K</arg_key>\\n
  <arg_value>V</arg_value>...``; each value is JSON when it parses, else a string, and the
  arguments become one JSON object.
- ``harmony`` (``gpt_oss_detector.py``): header holds ``to=functions.NAME``, body the JSON
  (an empty body is ``{}``).

Pure: text in, values out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KIMI_K2 = "kimi_k2"
HERMES = "hermes"
DEEPSEEK_V3 = "deepseek_v3"
DEEPSEEK_V31 = "deepseek_v31"
GLM45 = "glm45"
HARMONY = "harmony"
# The prefix Kimi-style headers and harmony recipients put before a called function's name.
FUNCTION_PREFIX = "functions."


@dataclass(frozen=True, slots=True)
class Read:
    """One call as its text reads: ``arguments_json`` False when the layout or JSON is broken."""

    name: str
    index: int | None
    arguments: str
    arguments_json: bool


Reader = Callable[[str, str], Read]


def is_json(text: str) -> bool:
    """Whether ``text`` is one JSON document (the arguments of an OpenAI-style call)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def parse_header(header: str) -> tuple[str, int | None]:
    """``functions.NAME:INDEX`` -> (NAME, INDEX); a header without an index keeps its name."""
    text = header.strip()
    if text.startswith(FUNCTION_PREFIX):
        text = text[len(FUNCTION_PREFIX) :]
    name, sep, tail = text.rpartition(":")
    if sep and tail.isascii() and tail.isdigit():
        return name, int(tail)
    return text, None


def read_kimi(header: str, body: str) -> Read:
    name, index = parse_header(header)
    return Read(name, index, body, is_json(body))


def read_hermes(header: str, body: str) -> Read:
    text = body.strip()
    try:
        call = json.loads(text)
    except ValueError:
        return Read(_guess_name(text), None, text, False)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return Read(_guess_name(text), None, text, False)
    key = "parameters" if call.get("parameters") else "arguments"
    if key not in call:
        return Read(call["name"], None, "{}", True)
    return Read(call["name"], None, _member_text(text, key, call[key]), True)


def _guess_name(text: str) -> str:
    """The ``"name"`` of a call whose JSON is broken, when it can still be read."""
    found = re.search(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")', text)
    if found is None:
        return ""
    name = json.loads(found.group(1))
    return name if isinstance(name, str) else ""


def _member_text(text: str, key: str, value: Any) -> str:
    """The text of ``key``'s value exactly as written (the template re-renders a string
    argument as is, so a round trip needs the model's own spacing), else re-serialised."""
    decoder = json.JSONDecoder()
    for found in re.finditer(rf'"{re.escape(key)}"\s*:\s*', text):
        try:
            parsed, end = decoder.raw_decode(text, found.end())
        except ValueError:
            continue
        if parsed == value:
            return text[found.end() : end]
    return json.dumps(value, ensure_ascii=False)


_V3_BODY = re.compile(r"(.*?)\n```json\n(.*)\n```", re.DOTALL)


def read_deepseek_v3(header: str, body: str) -> Read:
    found = _V3_BODY.fullmatch(body)
    if found is None:  # no JSON fence: SGLang reads no call from it
        name, _, rest = body.partition("\n")
        return Read(name.strip(), None, rest, False)
    arguments = found.group(2)
    return Read(found.group(1).strip(), None, arguments, is_json(arguments))


def read_deepseek_v31(header: str, body: str) -> Read:
    return Read(header.strip(), None, body, is_json(body))


# GLM-4.5 ends the name with a newline (a literal ``\n`` too, as SGLang accepts); GLM-4.7
# writes the first ``<arg_key>`` right after it.
_GLM_NAME_END = re.compile(r"\n|\\n|<arg_key>")
_GLM_PAIR = re.compile(
    r"<arg_key>(.*?)</arg_key>(?:\\n|\s)*<arg_value>(.*?)</arg_value>", re.DOTALL
)
_GLM_GAP = re.compile(r"(?:\\n|\s)+")


def read_glm(header: str, body: str) -> Read:
    cut = _GLM_NAME_END.search(body)
    name, rest = (body, "") if cut is None else (body[: cut.start()], body[cut.start() :])
    pairs = _GLM_PAIR.findall(rest)
    arguments = {key.strip(): _glm_value(value) for key, value in pairs}
    # Anything but white space between the pairs is a broken layout (a cut or unpaired tag).
    whole = not _GLM_GAP.sub("", _GLM_PAIR.sub("", rest))
    return Read(name.strip(), None, json.dumps(arguments, ensure_ascii=False), whole)


def _glm_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


_RECIPIENT = re.compile(r"to=([^\s<]+)")


def read_harmony(header: str, body: str) -> Read:
    found = _RECIPIENT.search(header)
    recipient = found.group(1) if found else ""
    name = recipient.removeprefix(FUNCTION_PREFIX)
    arguments = body if body.strip() else "{}"
    return Read(name, None, arguments, is_json(arguments))


READERS: dict[str, Reader] = {
    KIMI_K2: read_kimi,
    HERMES: read_hermes,
    DEEPSEEK_V3: read_deepseek_v3,
    DEEPSEEK_V31: read_deepseek_v31,
    GLM45: read_glm,
    HARMONY: read_harmony,
}
