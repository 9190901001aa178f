"""The model's own chat template, applied with transformers; hashes for reproducibility."""

from __future__ import annotations

import hashlib
import json
from collections import ChainMap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.tokenizer import load_tokenizer
from producer.rows import Prompt, RowError

# The reasoning markers of Kimi-K2, DeepSeek-R1 and Qwen3 alike.
THINK_START, THINK_END = "<think>", "</think>"

# Files that define tokenization (remote code included: every .py file, since the
# tokenization_*.py module may import helpers beside it); weights and configs are not hashed.
_TOKENIZER_FILES = (
    "tokenization",
    "tokenizer",
    "special_tokens_map",
    "added_tokens",
    "vocab",
    "merges",
    "chat_template",
)
_TOKENIZER_SUFFIXES = (".tiktoken", ".model", ".py")


class Templater:
    """Renders prompts to ``input_ids`` exactly as ``apply_chat_template`` does."""

    def __init__(
        self,
        tokenizer_path: Path,
        *,
        trust_remote_code: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.path = tokenizer_path
        self.trust_remote_code = trust_remote_code
        self.tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code)
        if not self.tokenizer.chat_template:
            raise ValueError(f"{tokenizer_path}: the tokenizer has no chat template")
        self.template_kwargs = dict(template_kwargs or {})
        _flatten_template_globals(self.tokenizer.chat_template)
        self._direct = _DirectRenderer.of(self.tokenizer, self.template_kwargs)
        if self._direct is not None and not self._direct_render_agrees():
            self._direct = None
        # Slow (pure-Python or remote-code) tokenizers have no Rust backend.
        self._backend: Any = getattr(self.tokenizer, "backend_tokenizer", None)
        self._think_pair = self._find_think_pair()
        self._blank: dict[int, bool] = {}

    @property
    def renders_directly(self) -> bool:
        """Whether prompts without tools skip apply_chat_template (see `_DirectRenderer`)."""
        return self._direct is not None

    @property
    def is_fast(self) -> bool:
        """Whether the Rust tokenizer encodes: it releases the GIL while it works."""
        return self._backend is not None

    def render(self, prompt: Prompt) -> str:
        """The prompt text the template produces, ending with the generation prompt."""
        tools: Any = prompt.tools
        try:
            text = self.tokenizer.apply_chat_template(
                prompt.messages,
                tools=tools,
                add_generation_prompt=True,
                tokenize=False,
                **self.template_kwargs,
            )
        except Exception as exc:  # jinja raises many types; any of them rejects the row
            raise RowError("template_error", f"{type(exc).__name__}: {exc}") from exc
        return str(text)

    def render_many(self, prompts: Sequence[Prompt]) -> list[str | RowError]:
        """Render prompts; those without tools in one call, as transformers batches them."""
        out: list[str | RowError] = [""] * len(prompts)
        plain = [i for i, p in enumerate(prompts) if p.tools is None]
        try:
            texts = self._render_plain([prompts[i].messages for i in plain]) if plain else []
        except Exception:  # one bad row fails the batch: render one by one to find it
            texts, plain = [], []
        for i, text in zip(plain, texts, strict=True):
            out[i] = str(text)
        for i in sorted(set(range(len(prompts))) - set(plain)):
            out[i] = self._render_or_error(prompts[i])
        return out

    def _render_plain(self, conversations: list[list[dict[str, Any]]]) -> list[str]:
        """Render conversations without tools as apply_chat_template(tokenize=False) does."""
        if self._direct is not None:
            return self._direct(conversations)
        texts = self.tokenizer.apply_chat_template(
            conversations, add_generation_prompt=True, tokenize=False, **self.template_kwargs
        )
        return [str(text) for text in texts]

    def _direct_render_agrees(self) -> bool:
        """Whether `_DirectRenderer` renders these probes as apply_chat_template does."""
        probes: list[list[dict[str, Any]]] = [
            [{"role": "user", "content": "hi"}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello", "reasoning_content": "greet"},
                {"role": "user", "content": "bye"},
            ],
            [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "type": "function",
                            "function": {"name": "weather", "arguments": {"city": "Paris"}},
                        }
                    ],
                },
                {"role": "tool", "content": "sunny"},
            ],
        ]
        try:
            direct = self._render_plain(probes)
        except Exception:  # e.g. a template that needs what only apply_chat_template passes
            return False
        saved, self._direct = self._direct, None
        try:
            return direct == self._render_plain(probes)
        except Exception:
            return False
        finally:
            self._direct = saved

    def _render_or_error(self, prompt: Prompt) -> str | RowError:
        try:
            return self.render(prompt)
        except RowError as err:
            return err

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Tokenize rendered prompts exactly as apply_chat_template(tokenize=True) does."""
        if not texts:
            return []
        if self._backend is not None:
            # The Rust tokenizer directly: transformers' per-encoding conversion to
            # Python dicts cost as much as the tokenization. The fast variant skips the
            # character offsets (same ids, less CPU); older tokenizers lack it.
            encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
            return [e.ids for e in encode(list(texts), add_special_tokens=False)]
        encoded = self.tokenizer(list(texts), add_special_tokens=False)
        return [list(ids) for ids in encoded["input_ids"]]

    def vocab_size(self) -> int:
        """How many ids the tokenizer decodes, added tokens included: every output id a
        worker stores must be below it."""
        return len(self.tokenizer)

    def think_end_id(self) -> int | None:
        """The think-end id of the tokenizer's think pair (None without one): what the
        worker looks for in the output of a job whose prompt opens a reasoning block."""
        return None if self._think_pair is None else self._think_pair[1]

    def opens_reasoning(self, input_ids: Sequence[int]) -> bool:
        """Whether this prompt leaves the model inside a reasoning block.

        True when its last token other than white space is the think-start token: the
        template opened the block (``<think>`` or ``<think>\n``), so the model never
        generates that token and must emit think-end before its answer. A prompt whose
        template closed the block again (``<think></think>``, thinking off) or opened none
        (e.g. after a tool turn) is not expected to.
        """
        if self._think_pair is None:
            return False
        for token in reversed(input_ids):
            if not self._is_blank(token):
                return token == self._think_pair[0]
        return False

    def _find_think_pair(self) -> tuple[int, int] | None:
        """The ids of think-start and think-end, when each is one token of the vocabulary."""
        start, end = (self._single_token(text) for text in (THINK_START, THINK_END))
        return None if start is None or end is None else (start, end)

    def _single_token(self, text: str) -> int | None:
        ids = self.encode_batch([text])[0]
        return ids[0] if len(ids) == 1 else None

    def _is_blank(self, token: int) -> bool:
        """Whether ``token`` decodes to white space only (cached: few distinct ids)."""
        blank = self._blank.get(token)
        if blank is None:
            text = str(self.tokenizer.decode([token], skip_special_tokens=False))
            blank = self._blank[token] = text.strip() == ""
        return blank

    def stop_token_ids(self) -> list[int]:
        """The model's end-of-turn ids: generation_config.json's eos, else the tokenizer's."""
        config = self.path / "generation_config.json"
        if config.is_file():
            eos = json.loads(config.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(i) for i in (eos if isinstance(eos, list) else [eos])]
        if self.tokenizer.eos_token_id is None:
            raise ValueError(f"{self.path}: no eos token to stop generation at")
        return [int(self.tokenizer.eos_token_id)]

    def tokenizer_sha256(self) -> str:
        """Hash of the files that define tokenization."""
        digest = hashlib.sha256()
        for file in sorted(self.path.iterdir()):
            if file.is_file() and (
                file.name.startswith(_TOKENIZER_FILES) or file.suffix in _TOKENIZER_SUFFIXES
            ):
                digest.update(file.name.encode() + b"\0" + file.read_bytes())
        return digest.hexdigest()

    def chat_template_sha256(self) -> str:
        """Hash of the chat template text (all named templates when there are several)."""
        template = self.tokenizer.chat_template
        text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


class _DirectRenderer:
    """Renders conversations without tools as apply_chat_template(tokenize=False), cheaper.

    What apply_chat_template does to such a conversation (transformers 4.49 and later):
    drop None-valued message keys, copy it into plain JSON types, copy reasoning fields
    under their other names, then render the compiled template with these arguments. Rows
    from `producer.rows` are plain JSON without None values, so for a conversation without
    reasoning fields the first three steps change nothing, and this renders the compiled
    template directly (BENCHMARKS.md, "Render"). One with reasoning fields
    goes through transformers' render_jinja_template. The Templater checks at load time
    that this renders as apply_chat_template does, and uses that where it does not.
    """

    def __init__(self, template: str, compiled: Any, render_jinja: Any, kwargs: Any) -> None:
        self._template = template
        self._compiled = compiled
        self._render_jinja = render_jinja
        self._kwargs = kwargs

    @classmethod
    def of(cls, tokenizer: Any, template_kwargs: dict[str, Any]) -> _DirectRenderer | None:
        """The renderer of this tokenizer's template, if this transformers has the parts."""
        try:
            from transformers.utils.chat_template_utils import (
                _compile_jinja_template,
                _plain_template_data,
                render_jinja_template,
            )
        except ImportError:
            return None
        template = tokenizer.get_chat_template(None, None)
        try:
            compiled = _compile_jinja_template(template)
        except Exception:  # a broken template: apply_chat_template says why, row by row
            return None
        kwargs = _plain_template_data({**tokenizer.special_tokens_map, **template_kwargs})
        return cls(template, compiled, render_jinja_template, kwargs)

    def __call__(self, conversations: list[list[dict[str, Any]]]) -> list[str]:
        return [self._render(messages) for messages in conversations]

    def _render(self, messages: list[dict[str, Any]]) -> str:
        if any(field in message for message in messages for field in _REASONING_FIELDS):
            rendered, _ = self._render_jinja(
                conversations=[messages],
                chat_template=self._template,
                add_generation_prompt=True,
                **self._kwargs,
            )
            return str(rendered[0])
        return str(
            self._compiled.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=True,
                **self._kwargs,
            )
        )


# The message fields transformers copies under each other's names before rendering.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _flatten_template_globals(chat_template: str | dict[str, str]) -> None:
    """Make the globals of each compiled chat template a plain dict.

    Jinja builds every render's context by copying the template's globals, a ChainMap over
    the environment's that it iterates in Python: a third of rendering a short prompt. A dict
    with the same entries looks up the same values and copies in C. transformers caches the
    compiled template, so its own apply_chat_template then renders with the flat globals;
    where its private cache is not there, rendering is only slower.
    """
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return
    texts = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    for text in texts:
        try:
            compiled = _compile_jinja_template(text)
        except Exception:  # a broken template: every row will say why (template_error)
            continue
        if isinstance(compiled.globals, ChainMap):
            compiled.globals = dict(compiled.globals)
