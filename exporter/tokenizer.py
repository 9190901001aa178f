"""The run's tokenizer, for decoding output ids and re-applying the chat template.

Loaded from the path the run recorded (``runs.tokenizer_path``) by ``core.tokenizer``, as the
producer loads it. The producer's templating (``producer.template``) is not importable here
(the layers in pyproject.toml); the two must agree on how a rendered text becomes ids (the
Rust tokenizer, no special tokens added), or a round trip would differ where the data does
not.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from core.anatomy import Markers, markers_from_vocab
from core.tokenizer import exact_decoder, load_tokenizer
from models.records import ExportRun


class RunTokenizer:
    """Decode, render and encode as the run did."""

    def __init__(self, run: ExportRun, *, trust_remote_code: bool = False) -> None:
        path = Path(run.tokenizer_path)
        if not path.is_dir():
            raise ValueError(
                f"run {run.name!r}: its tokenizer {path} is not a folder on this machine "
                "(the export decodes with the run's own tokenizer)"
            )
        self.tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
        if not self.tokenizer.chat_template:
            raise ValueError(f"{path}: the tokenizer has no chat template")
        self.path = path
        self.template_kwargs = dict(run.chat_template_kwargs)
        self.template_matches_run = self.chat_template_sha256() == run.chat_template_sha256
        self.markers: Markers = markers_from_vocab(
            self.tokenizer.get_vocab(), stops=self._stop_ids()
        )
        self._backend: Any = getattr(self.tokenizer, "backend_tokenizer", None)
        self.decode = exact_decoder(self.tokenizer)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """The conversation as the run's template writes it (no generation prompt: the last
        turn is the assistant's), with the run's template kwargs."""
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=False,
            tokenize=False,
            **self.template_kwargs,
        )
        return str(text)

    def encode(self, text: str) -> list[int]:
        """``text``'s ids as the producer encodes a rendered prompt."""
        if self._backend is not None:
            # The fast variant skips the character offsets: the same ids for less work.
            encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
            return list(encode([text], add_special_tokens=False)[0].ids)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def chat_template_sha256(self) -> str:
        """The hash the run records of its template (``producer.template`` computes it so)."""
        template = self.tokenizer.chat_template
        text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
        return hashlib.sha256(str(text).encode()).hexdigest()

    def _stop_ids(self) -> list[int]:
        """The model's end-of-turn ids: generation_config.json's eos and the tokenizer's."""
        stops = [] if self.tokenizer.eos_token_id is None else [int(self.tokenizer.eos_token_id)]
        config = self.path / "generation_config.json"
        if config.is_file():
            eos = json.loads(config.read_text()).get("eos_token_id")
            stops += [
                int(i) for i in (eos if isinstance(eos, list) else [] if eos is None else [eos])
            ]
        return stops
