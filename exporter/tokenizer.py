"""The run's tokenizer for an export: ``core.tokenizer.RunTokenizer`` loaded as the run
recorded it (its path, template kwargs, model family and template hash)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core import tokenizer
from core.tokenizer import stored_stop_ids
from models.records import ExportRun

__all__ = ["RunTokenizer", "for_run", "run_stop_ids"]


class RunTokenizer(tokenizer.RunTokenizer):
    """The run's tokenizer, rendering whole conversations as a round trip compares them
    (``exporter.roundtrip.Templater``)."""

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """The conversation as the run's template writes it, no generation prompt: the last
        turn is the assistant's."""
        return self.render_chat(messages, tools, add_generation_prompt=False)


def for_run(run: ExportRun, *, trust_remote_code: bool = False) -> RunTokenizer:
    """``run``'s tokenizer, from the folder it recorded; a ValueError when it is not here."""
    path = Path(run.tokenizer_path)
    if not path.is_dir():
        raise ValueError(
            f"run {run.name!r}: its tokenizer {path} is not a folder on this machine "
            "(the export decodes with the run's own tokenizer)"
        )
    return RunTokenizer(
        path,
        trust_remote_code=trust_remote_code,
        template_kwargs=run.chat_template_kwargs,
        family=run.family,
        recorded_template_sha256=run.chat_template_sha256,
    )


def run_stop_ids(run: ExportRun) -> Mapping[str, tuple[int, ...]]:
    """Each dataset's stored stop ids: where its generations are cut, as the worker sent."""
    return {name: stored_stop_ids(params) for name, params in run.sampling.items()}
