"""The model's own chat template, applied with transformers; hashes for reproducibility."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from producer.rows import Prompt, RowError

# Files that define tokenization; weights and configs beside them are not hashed.
_TOKENIZER_FILES = (
    "tokenizer",
    "special_tokens_map",
    "added_tokens",
    "vocab",
    "merges",
    "chat_template",
)
_TOKENIZER_SUFFIXES = (".tiktoken", ".model")


class Templater:
    """Renders prompts to ``input_ids`` exactly as ``apply_chat_template`` does."""

    def __init__(
        self,
        tokenizer_path: Path,
        *,
        trust_remote_code: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        # "PyTorch was not found" is advice for model users; we only need the tokenizer.
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        from transformers import AutoTokenizer  # heavy: import only where templating happens

        self.path = tokenizer_path
        self.tokenizer = AutoTokenizer.from_pretrained(
            str(tokenizer_path), trust_remote_code=trust_remote_code, local_files_only=True
        )
        if not self.tokenizer.chat_template:
            raise ValueError(f"{tokenizer_path}: the tokenizer has no chat template")
        self.template_kwargs = dict(template_kwargs or {})

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

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Tokenize rendered prompts with the fast tokenizer, as apply_chat_template does."""
        if not texts:
            return []
        encoded = self.tokenizer(list(texts), add_special_tokens=False)
        return [list(ids) for ids in encoded["input_ids"]]

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


def prompt_sha256(input_ids: Sequence[int]) -> str:
    """Identity of a prompt: the exact ids the model sees."""
    return hashlib.sha256(",".join(map(str, input_ids)).encode()).hexdigest()
