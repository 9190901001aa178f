"""Read the tokenizer folder the simulator speaks: its vocabulary, chat template and eos ids.

Only the files are read (tokenizer.json with the `tokenizers` library, the JSON configs, the
template), no transformers: what cannot be read is a `ValueError` (or `FileNotFoundError`)
whose message is one line starting with the folder.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from eaglegen.assets import special_ids
from eaglegen.sim.engine import Vocab

# The model configs whose eos_token_id SGLang stops at, besides the tokenizer's eos.
_EOS_CONFIGS = ("generation_config.json", "config.json")


def load_vocab(tokenizer_dir: Path) -> tuple[Vocab, Tokenizer]:
    """The bundled tokenizer's Kimi-K2 ids and the tokenizer; ordinary ids avoid every added
    token. (The server reads any folder with `eaglegen.sim.voice.load_voice`.)"""
    ids = special_ids(tokenizer_dir)
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    size = min(ids.vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
    reserved = set(tokenizer.get_added_tokens_decoder()) | {
        ids.bos,
        ids.pad,
        ids.im_end,
        ids.think_start,
        ids.think_end,
        ids.tool_calls_section_begin,
        ids.tool_calls_section_end,
        ids.tool_call_begin,
        ids.tool_call_argument_begin,
        ids.tool_call_end,
    }
    lo, hi = longest_free_run(reserved, size)
    vocab = Vocab(
        think_end=ids.think_end,
        im_end=ids.im_end,
        tool_section_begin=ids.tool_calls_section_begin,
        tool_section_end=ids.tool_calls_section_end,
        tool_call_begin=ids.tool_call_begin,
        tool_call_argument_begin=ids.tool_call_argument_begin,
        tool_call_end=ids.tool_call_end,
        vocab_size=size,
        ordinary_lo=lo,
        ordinary_hi=hi,
    )
    return vocab, tokenizer


def longest_free_run(reserved: Iterable[int], size: int) -> tuple[int, int]:
    """The longest [lo, hi) inside [0, size) that contains no reserved id."""
    best = (0, 0)
    start = 0
    for rid in [*sorted({r for r in reserved if 0 <= r < size}), size]:
        if rid - start > best[1] - best[0]:
            best = (start, rid)
        start = rid + 1
    if best[1] <= best[0]:
        raise ValueError("the tokenizer has no ordinary token ids")
    return best


@dataclass(frozen=True)
class TokenizerFolder:
    """A tokenizer folder as the simulator reads it."""

    path: Path
    tokenizer: Tokenizer
    vocab: dict[str, int]  # every token string, the added ones included
    size: int  # one past the highest id: every id below it is accepted
    added: frozenset[int]  # the added tokens' ids (special or not)
    added_strings: tuple[str, ...]
    template: str | None  # the chat template
    eos: tuple[int, ...]  # the tokenizer's eos, then the model configs' eos_token_id
    tokens: dict[str, str]  # bos_token, eos_token, ...: what a template may use

    def encode(self, text: str) -> list[int]:
        """Token ids of text, added tokens in it read as themselves."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        """The ids' text exactly: special tokens kept."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def ordinary(self, reserved: Iterable[int]) -> range:
        """The longest run of ids that are neither added nor reserved: plain text."""
        try:
            lo, hi = longest_free_run({*self.added, *reserved}, self.size)
        except ValueError as exc:
            raise ValueError(f"{self.path}: {exc}") from None
        return range(lo, hi)


def read_folder(path: Path) -> TokenizerFolder:
    """Read `path`; FileNotFoundError or ValueError, one line naming it, when it cannot be."""
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a folder (give a tokenizer's folder)")
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{path}: no tokenizer.json (the simulator reads a fast tokenizer's tokenizer.json)"
        )
    try:
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as exc:  # the Rust library raises plain Exceptions
        raise ValueError(f"{path}: tokenizer.json does not load ({_first_line(exc)})") from None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if not vocab:
        raise ValueError(f"{path}: the tokenizer's vocabulary is empty")
    added = tokenizer.get_added_tokens_decoder()
    config = _json(path / "tokenizer_config.json")
    tokens = {
        key: text
        for key, value in config.items()
        if key.endswith("_token") and (text := _content(value)) is not None
    }
    return TokenizerFolder(
        path=path,
        tokenizer=tokenizer,
        vocab=vocab,
        size=max(vocab.values()) + 1,
        added=frozenset(added),
        added_strings=tuple(token.content for token in added.values()),
        template=_template(path, config),
        eos=_eos(path, vocab, tokens.get("eos_token")),
        tokens=tokens,
    )


def _json(path: Path) -> dict[str, Any]:
    """A JSON object file; empty when absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not JSON ({_first_line(exc)})") from None
    return data if isinstance(data, dict) else {}


def _content(value: object) -> str | None:
    """A token setting's string: as is, or an AddedToken's content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template(path: Path, config: dict[str, Any]) -> str | None:
    """The chat template: chat_template.jinja (newer transformers), else the config's (the
    "default" one of a list of named templates, or the first)."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    found = config.get("chat_template")
    if isinstance(found, list):
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        found = named.get("default", next(iter(named.values()), None))
    return found if isinstance(found, str) else None


def _eos(path: Path, vocab: dict[str, int], eos_token: str | None) -> tuple[int, ...]:
    """The tokenizer's eos id, then the model configs' eos_token_id (an int or a list)."""
    found = [vocab[eos_token]] if eos_token is not None and eos_token in vocab else []
    for name in _EOS_CONFIGS:
        value = _json(path / name).get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and not isinstance(token, bool) and token not in found:
                found.append(token)
    return tuple(found)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
