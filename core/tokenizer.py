"""A run's tokenizer: the one module that loads and applies it, for every package.

``RunTokenizer`` is what a run's tokenization is: the tokenizer loaded from this machine's
files only (a run never downloads another tokenizer than it templated with), its chat template
rendered with the run's template kwargs, rendered text encoded exactly as enqueue encodes a
prompt (the Rust tokenizer, no special tokens added), ids decoded exactly (every special token
written out: they are what the data is about), the hashes a run records of its tokenizer and
template, its think pair, the model family whose layout its generations have
(``core.families``), and the stop ids.

Stop ids follow one rule: a run's stop ids are those each dataset stored in its sampling
params (``stored_stop_ids``), which the worker sends and every reader cuts at. What enqueue
stores by default (``RunTokenizer.default_stop_ids``) is what SGLang itself stops at without
being told: the model's ``eos_token_id`` of ``config.json`` and of ``generation_config.json``
(an int or a list) and the tokenizer's eos, all of them (SGLang's
``ModelConfig._get_hf_eos_token_id`` unions the two configs, and ``Req`` checks the
tokenizer's eos besides). A run file's ``stop_token_ids`` is stored as given.

The producer templates with it (``producer.template`` adds its batch rendering), the exporter
and `eaglegen stats` decode and read with it. transformers is imported only when a tokenizer
is loaded: it is heavy.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from core.anatomy import Anatomy, Markers, ToolCall
from core.families import Family, family_for

# The files a tokenizer is made of (by name prefix or suffix): a folder with none of them
# is not a tokenizer folder.
_TOKENIZER_PREFIXES = ("tokenizer", "tokenization", "vocab", "merges", "special_tokens_map")
_TOKENIZER_SUFFIXES = (".tiktoken", ".model")
# Files that define tokenization, hashed into the run's tokenizer_sha256 (remote code
# included: every .py file, since the tokenization_*.py module may import helpers beside it);
# weights and configs are not hashed.
_HASHED_PREFIXES = (*_TOKENIZER_PREFIXES, "added_tokens", "chat_template")
_HASHED_SUFFIXES = (*_TOKENIZER_SUFFIXES, ".py")
# The model configs whose eos_token_id SGLang stops at, besides the tokenizer's eos.
_EOS_CONFIGS = ("generation_config.json", "config.json")

Decode = Callable[[Sequence[int]], str]


def load_tokenizer(path: Path | str, *, trust_remote_code: bool = False) -> Any:
    """The tokenizer saved at ``path``; ValueError with what to do when it does not load."""
    # "PyTorch was not found" is advice for model users; only the tokenizer is needed.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            str(path), trust_remote_code=trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError) as exc:
        if not trust_remote_code and "trust_remote_code" in str(exc):
            raise ValueError(
                f"{path}: this tokenizer loads with its own Python code (its "
                "tokenization_*.py); if you trust it, pass --trust-remote-code (in a run "
                "file: trust_remote_code = true)"
            ) from exc
        # transformers' words name the Hub, a connection, a repo id's form: a misspelt
        # folder deserves ours.
        raise ValueError(not_found(path) or f"{path}: the tokenizer does not load ({exc})") from exc


def not_found(path: Path | str) -> str | None:
    """Why ``path`` holds no tokenizer, in one line; None when it is a folder of tokenizer
    files (which may still fail to load, for reasons of their own)."""
    folder = Path(path)
    if folder.is_dir():
        if any(
            (f.name.startswith(_TOKENIZER_PREFIXES) or f.suffix in _TOKENIZER_SUFFIXES)
            and f.is_file()
            for f in folder.iterdir()
        ):
            return None
        return (
            f"tokenizer {str(path)!r} not found: the folder holds no tokenizer files "
            "(tokenizer_config.json, tokenizer.json, ...); give the folder of the model's "
            "tokenizer"
        )
    if folder.exists():
        return (
            f"tokenizer {str(path)!r} not found: it is a file; give the folder that holds "
            "the model's tokenizer files"
        )
    return (
        f"tokenizer {str(path)!r} not found: not a folder with tokenizer files, nor a model "
        "in this machine's Hugging Face cache (eaglegen never downloads one): check the "
        "name, or download the model's tokenizer and give its folder"
    )


def exact_decoder(tokenizer: Any) -> Decode:
    """``ids`` → their text exactly: special tokens kept, no clean-up of spaces. The Rust
    decoder when there is one: transformers' wrapper checks each id's type, which costs as
    much as the decoding."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: str(backend.decode(list(ids), skip_special_tokens=False))
    return lambda ids: str(
        tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    )


def stored_stop_ids(sampling_params: Mapping[str, Any]) -> tuple[int, ...]:
    """The stop ids a dataset stored with its sampling params: the run's stop ids, which
    every reader cuts its generations at (see the module docstring)."""
    ids = sampling_params.get("stop_token_ids") or ()
    return tuple(i for i in ids if type(i) is int)


def template_text(chat_template: str | Mapping[str, str] | None) -> str:
    """The template's text; all named templates of a tokenizer that has several."""
    if chat_template is None or isinstance(chat_template, str):
        return chat_template or ""
    return "\n".join(str(text) for text in chat_template.values())


@dataclass(frozen=True, slots=True)
class Reading:
    """One generation read in the run's family: its parts, and its calls parsed."""

    anatomy: Anatomy
    calls: list[ToolCall]


class RunTokenizer:
    """A run's tokenizer, template and family, applied the one way (see the module docstring).

    ``family``: the run's family by name (the run file's, or the one the run recorded); None
    detects it from the vocabulary and template. ``recorded_template_sha256``: the template
    hash the run recorded, which ``template_matches_run`` compares with the one loaded.
    """

    def __init__(
        self,
        path: Path | str,
        *,
        trust_remote_code: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        family: str | None = None,
        recorded_template_sha256: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.trust_remote_code = trust_remote_code
        self.template_kwargs = dict(template_kwargs or {})
        self.tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
        if not self.tokenizer.chat_template:
            raise ValueError(f"{path}: the tokenizer has no chat template")
        self.named_family = family  # None: detected (``family``)
        self._recorded_template = recorded_template_sha256
        # Slow (pure-Python or remote-code) tokenizers have no Rust backend.
        self._backend: Any = getattr(self.tokenizer, "backend_tokenizer", None)
        self.decode: Decode = exact_decoder(self.tokenizer)
        self._blank: dict[int, bool] = {}
        self._markers: dict[frozenset[int], Markers] = {}

    def with_template_kwargs(self, extra: Mapping[str, Any]) -> RunTokenizer:
        """The same tokenizer rendering with ``extra`` template kwargs over its own (a
        variant's, core.samples): a shallow copy sharing the loaded tokenizer."""
        if not extra:
            return self
        other = copy.copy(self)
        other.template_kwargs = {**self.template_kwargs, **extra}
        return other

    # --- rendering and encoding ---------------------------------------------------------

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool,
    ) -> str:
        """The conversation as the run's template writes it, with the run's template kwargs:
        ending with the generation prompt (a prompt) or not (a whole turn, for a round trip)."""
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )
        return str(text)

    def render_chats(
        self, conversations: list[list[dict[str, Any]]], *, add_generation_prompt: bool
    ) -> list[str]:
        """Conversations without tools in one call, as transformers batches them."""
        texts = self.tokenizer.apply_chat_template(
            conversations,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )
        return [str(text) for text in texts]

    @property
    def is_fast(self) -> bool:
        """Whether the Rust tokenizer encodes: it releases the GIL while it works."""
        return self._backend is not None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Rendered texts' ids exactly as apply_chat_template(tokenize=True) makes them."""
        if not texts:
            return []
        if self._backend is not None:
            # The Rust tokenizer directly: transformers' per-encoding conversion to
            # Python dicts cost as much as the tokenization. The fast variant skips the
            # character offsets (same ids, less CPU); older tokenizers lack it.
            encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
            return [list(e.ids) for e in encode(list(texts), add_special_tokens=False)]
        encoded = self.tokenizer(list(texts), add_special_tokens=False)
        return [list(ids) for ids in encoded["input_ids"]]

    def encode(self, text: str) -> list[int]:
        """One rendered text's ids (``encode_batch``)."""
        return self.encode_batch([text])[0]

    def vocab_size(self) -> int:
        """How many ids the tokenizer decodes, added tokens included: every output id a
        worker stores must be below it."""
        return len(self.tokenizer)

    @cached_property
    def vocab(self) -> dict[str, int]:
        """Each token's id, added tokens included."""
        return {str(token): int(i) for token, i in self.tokenizer.get_vocab().items()}

    # --- identity -----------------------------------------------------------------------

    def tokenizer_sha256(self) -> str:
        """Hash of the files that define tokenization."""
        digest = hashlib.sha256()
        for file in sorted(self.path.iterdir()):
            if file.is_file() and (
                file.name.startswith(_HASHED_PREFIXES) or file.suffix in _HASHED_SUFFIXES
            ):
                digest.update(file.name.encode() + b"\0" + file.read_bytes())
        return digest.hexdigest()

    def chat_template_sha256(self) -> str:
        """Hash of the chat template text (all named templates when there are several)."""
        template = self.tokenizer.chat_template
        text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
        return hashlib.sha256(str(text).encode()).hexdigest()

    @property
    def template_matches_run(self) -> bool:
        """Whether the template loaded is the one the run recorded (True when none given)."""
        recorded = self._recorded_template
        return recorded is None or recorded == self.chat_template_sha256()

    # --- reasoning ----------------------------------------------------------------------

    @cached_property
    def think_pair(self) -> tuple[int, int] | None:
        """The ids of the family's think-start and think-end, when each is one token."""
        pair = self.family.think
        if pair is None:  # harmony: reasoning is a channel, not a block
            return None
        start, end = (self._single_token(text) for text in pair)
        return None if start is None or end is None else (start, end)

    def think_end_id(self) -> int | None:
        """The think-end id of the think pair (None without one): what the worker looks for
        in the output of a job whose prompt opens a reasoning block."""
        return None if self.think_pair is None else self.think_pair[1]

    def opens_reasoning(self, input_ids: Sequence[int]) -> bool:
        """Whether this prompt leaves the model inside a reasoning block.

        True when its last token other than white space is the think-start token: the
        template opened the block (``<think>`` or ``<think>\\n``), so the model never
        generates that token and must emit think-end before its answer. A prompt whose
        template closed the block again (``<think></think>``, thinking off) or opened none
        (e.g. after a tool turn) is not expected to.
        """
        if self.think_pair is None:
            return False
        for token in reversed(input_ids):
            if not self._is_blank(token):
                return token == self.think_pair[0]
        return False

    def _single_token(self, text: str) -> int | None:
        ids = self.encode(text)
        return ids[0] if len(ids) == 1 else None

    def _is_blank(self, token: int) -> bool:
        """Whether ``token`` decodes to white space only (cached: few distinct ids)."""
        blank = self._blank.get(token)
        if blank is None:
            blank = self._blank[token] = self.decode([token]).strip() == ""
        return blank

    # --- stop ids -----------------------------------------------------------------------

    def default_stop_ids(self) -> list[int]:
        """What SGLang stops at by itself: the configs' eos ids and the tokenizer's, each
        once, in that order (see the module docstring). What enqueue stores for a dataset
        whose run file names no ``stop_token_ids``."""
        ids = [i for name in _EOS_CONFIGS for i in _config_eos(self.path / name)]
        eos = self.tokenizer.eos_token_id
        ids += [] if eos is None else [int(eos)]
        if not ids:
            raise ValueError(f"{self.path}: no eos token to stop generation at")
        return list(dict.fromkeys(ids))

    # --- the family ---------------------------------------------------------------------

    @property
    def family_named(self) -> bool:
        """Whether the family was named (a run file's, a run's record) rather than detected."""
        return self.named_family is not None

    @cached_property
    def family(self) -> Family:
        """The run's family: the one named, else detected (``core.families.family_for``)."""
        template = template_text(self.tokenizer.chat_template)
        return family_for(self.vocab, template, self.named_family)

    def markers(self, stops: Iterable[int] = ()) -> Markers:
        """The family's structure tokens in this vocabulary, ``stops`` ending a generation
        (a dataset's ``stored_stop_ids``)."""
        key = frozenset(int(i) for i in stops)
        found = self._markers.get(key)
        if found is None:
            found = self._markers[key] = self.family.markers(self.vocab, key)
        return found

    def read(
        self,
        output_ids: Sequence[int],
        stops: Iterable[int],
        *,
        opens_reasoning: bool,
        declared: Collection[str] | None,
    ) -> Reading:
        """A generation cut by its family's layout, its calls parsed (``declared``: the
        function names the row declared, None when it declared none)."""
        family = self.family
        anatomy = family.dissect(output_ids, self.markers(stops), opens_reasoning=opens_reasoning)
        return Reading(anatomy, family.parse_calls(anatomy, self.decode, declared))

    def token(self, token_id: int | None, default: str) -> str:
        """How one id reads (``default`` for None)."""
        return default if token_id is None else self.decode([token_id])


def _config_eos(path: Path) -> list[int]:
    """A model config's ``eos_token_id`` (an int or a list); none when it has no file."""
    if not path.is_file():
        return []
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read the model's eos ids ({exc})") from exc
    eos = config.get("eos_token_id") if isinstance(config, dict) else None
    values = eos if isinstance(eos, list) else [eos]
    return [int(i) for i in values if type(i) is int]


__all__ = [
    "Decode",
    "Reading",
    "RunTokenizer",
    "exact_decoder",
    "load_tokenizer",
    "not_found",
    "stored_stop_ids",
    "template_text",
]
