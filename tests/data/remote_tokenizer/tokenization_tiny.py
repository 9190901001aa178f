"""A pure-Python tokenizer that loads as remote code, as Kimi-K2's tokenization_kimi.py does.

It has no Rust backend for eaglegen to use (``is_fast`` is false), so the producer must
tokenize through the tokenizer's own Python ``__call__``. Its tokens come from the bundled
tiny tokenizer's model, so the ids equal the fast tokenizer's.
"""

from __future__ import annotations

from typing import Any, ClassVar

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizer


class TinySlowTokenizer(PreTrainedTokenizer):  # type: ignore[misc]
    """The bundled tokenizer's vocabulary and merges behind the pure-Python interface."""

    vocab_files_names: ClassVar[dict[str, str]] = {"tokenizer_file": "tokenizer.json"}
    model_input_names: ClassVar[list[str]] = ["input_ids", "attention_mask"]

    def __init__(self, tokenizer_file: str, **kwargs: Any) -> None:
        self._core = Tokenizer.from_file(tokenizer_file)
        self._vocab: dict[str, int] = self._core.get_vocab(with_added_tokens=True)
        self._tokens = {i: t for t, i in self._vocab.items()}
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return int(self._core.get_vocab_size(with_added_tokens=False))

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return list(self._core.encode(text, add_special_tokens=False).tokens)

    def _convert_token_to_id(self, token: str) -> int:
        return self._vocab.get(token, self._vocab["[UNK]"])

    def _convert_id_to_token(self, index: int) -> str:
        return self._tokens.get(index, "[UNK]")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return str(self._core.decoder.decode(tokens))

    def save_vocabulary(
        self, save_directory: str, filename_prefix: str | None = None
    ) -> tuple[str, ...]:
        return ()
