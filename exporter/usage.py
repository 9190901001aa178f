"""What an export says about loading it: the lines `eaglegen export` prints and writes to
``how-to-load.txt`` beside the manifest, per consumer (``exporter.layouts``). Pure."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from exporter.conversations import MODELOPT, SPECFORGE
from exporter.layouts import (
    HF,
    HF_DATASET,
    JSONL,
    SPECULATORS,
    TOKENS,
)
from exporter.manifest import Options
from exporter.split import TRAIN, VAL

_EXACT = (
    "input_ids are the prompt ids then the output ids exactly as generated; loss_mask is 0 "
    "over the prompt and 1 over every generated token, the stop token included"
)


def how_to_load(out: Path, options: Options, shards: Sequence[dict[str, Any]]) -> str:
    """The text for an export of ``options`` into ``out`` listing ``shards``."""
    splits = [s for s in (TRAIN, VAL) if any(d["split"] == s for d in shards)]
    folder = out.resolve()
    lines = _LINES[options.consumer](folder, options, splits or [TRAIN])
    return "\n".join(lines) + "\n"


def _specforge(out: Path, options: Options, splits: list[str]) -> list[str]:
    files = {s: out / s / f"{s}.jsonl" for s in splits}
    lines = [
        "SpecForge reads one file per split as data.prompts_path "
        "(specforge.data.prompt_builder.prepare_prompt_tasks):",
        "",
        "data:",
        f"  prompts_path: {files[TRAIN]}",
    ]
    if VAL in files:
        lines.append(f"  eval_prompts_path: {files[VAL]}")
    if options.format == TOKENS:
        return [*lines, "", f"The rows are pre-tokenized: {_EXACT}."]
    return [
        *lines,
        "",
        "The rows are conversations: SpecForge templates them again with its own chat "
        "template (build_eagle3_dataset), so its ids and loss mask are its own, not the "
        "recorded ones (it trains the <think> the prompt opened; without "
        "train_only_last_turn it also trains earlier assistant turns). For the exact ids, "
        "export --for specforge --format tokens.",
    ]


def _speculators(out: Path, options: Options, splits: list[str]) -> list[str]:
    lines = [
        "speculators reads each split folder as a Dataset (datasets.load_from_disk, torch "
        "format: input_ids, loss_mask, seq_len):",
        "",
        f"  speculators train --data-path {out / TRAIN} ...",
    ]
    if VAL in splits:
        lines.append(f"  (validation: {out / VAL})")
    return [*lines, "", f"{_EXACT}."]


def _modelopt(out: Path, options: Options, splits: list[str]) -> list[str]:
    lines = [
        "Model-Optimizer reads conversation files (its `messages` shape) with its "
        "ShardedDataset and templates them with LanguageDataCollator:",
        "",
    ]
    lines += [f"  {s}: {out / s / f'{s}.jsonl'}" for s in splits]
    return [
        *lines,
        "",
        "Its collator templates the messages again with the tokenizer's chat template: it "
        "drops the rows' tools, and its answer_only_loss needs {% generation %} tags the "
        "run's template does not have, so its ids and loss mask are not the recorded ones. "
        "For the exact ids, export --for specforge or --for speculators (tokens).",
    ]


def _hf(out: Path, options: Options, splits: list[str]) -> list[str]:
    kind = "json" if options.writer == JSONL else "parquet"
    if options.writer == HF_DATASET:
        return [
            "Each shard is a datasets save_to_disk folder:",
            "",
            "  from datasets import concatenate_datasets, load_from_disk",
            f"  train = concatenate_datasets([load_from_disk(str(p)) for p in "
            f"sorted(Path({str(out / TRAIN)!r}).glob('{TRAIN}-*'))])",
        ]
    lines = ["Load with datasets:", "", "  from datasets import load_dataset"]
    lines += [
        f"  {s} = load_dataset({kind!r}, data_dir={str(out / s)!r}, split='train')" for s in splits
    ]
    if options.format == TOKENS:
        lines += ["", f"{_EXACT}."]
    return lines


_LINES = {HF: _hf, SPECFORGE: _specforge, SPECULATORS: _speculators, MODELOPT: _modelopt}
