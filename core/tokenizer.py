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

# The files a tokenizer is made of (by name prefix or suffix): a folder with none of them
# is not a tokenizer folder.
_TOKENIZER_PREFIXES = ("tokenizer", "tokenization", "vocab", "merges", "special_tokens_map")
_TOKENIZER_SUFFIXES = (".tiktoken", ".model")


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
