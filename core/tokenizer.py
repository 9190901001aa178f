"""A run's tokenizer, loaded and decoded the one way every package does it.

The producer templates with it, the exporter and `eaglegen stats` decode with it: all from
this machine's files only (a run never downloads another tokenizer than it templated
with), and decoding writes every special token out (they are what the data is about).
transformers is imported only when a tokenizer is loaded: it is heavy.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def load_tokenizer(path: Path | str, *, trust_remote_code: bool = False) -> Any:
    """The tokenizer saved at ``path``; ValueError with what to do when it does not load."""
    # "PyTorch was not found" is advice for model users; only the tokenizer is needed.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            str(path), trust_remote_code=trust_remote_code, local_files_only=True
        )
    except ValueError as exc:
        if trust_remote_code or "trust_remote_code" not in str(exc):
            raise ValueError(f"{path}: the tokenizer does not load ({exc})") from exc
        raise ValueError(
            f"{path}: this tokenizer loads with its own Python code (its tokenization_*.py); "
            "if you trust it, pass --trust-remote-code (in a run file: trust_remote_code = "
            "true)"
        ) from exc
    except OSError as exc:
        raise ValueError(f"{path}: the tokenizer does not load ({exc})") from exc


def exact_decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """``ids`` → their text exactly: special tokens kept, no clean-up of spaces. The Rust
    decoder when there is one: transformers' wrapper checks each id's type, which costs as
    much as the decoding."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: str(backend.decode(list(ids), skip_special_tokens=False))
    return lambda ids: str(
        tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    )
