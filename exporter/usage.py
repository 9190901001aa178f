"""What an export says about loading it: the lines `eaglegen export` prints and writes to
``how-to-load.txt`` beside the manifest, per consumer (``exporter.layouts``). Pure."""

from __future__ import annotations

from dataclasses import dataclass
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


# SpecForge's chat template (its registry, specforge.data.template) for a run's family, by
# whether the run has a think pair. Only kimi_k2 and qwen3 are loaded by the trainers tier.
_SPECFORGE_TEMPLATES = {
    ("kimi_k2", True): "kimi-k2-thinking",
    ("kimi_k2", False): "kimi-k2-instruct",
    ("qwen3", True): "qwen3-thinking",
    ("qwen3", False): "qwen3-instruct",
    ("deepseek_r1", True): "deepseek-r1-distill",
    ("deepseek_v3", False): "deepseek-v3",
    ("gpt_oss", True): "gpt-oss",
    ("gpt_oss", False): "gpt-oss",
}
_TESTED = frozenset({"kimi_k2", "qwen3"})
# What SpecForge's template may add to a conversation the run's did not write (a system
# message where the row has none): room for it under max_length.
_TEMPLATE_ROOM = 256


@dataclass(frozen=True)
class _Export:
    """What the text says about: the folder, the options, and the manifest's facts."""

    out: Path
    options: Options
    splits: list[str]
    longest: int
    family: str | None
    reasoning: bool
    conversations: bool  # rows of on-policy conversations read whole


def how_to_load(out: Path, options: Options, manifest: dict[str, Any]) -> str:
    """The text for an export of ``options`` into ``out`` whose manifest is ``manifest``."""
    shards = manifest["shards"]
    splits = [s for s in (TRAIN, VAL) if any(d["split"] == s for d in shards)] or [TRAIN]
    counts = manifest["counts"].values()
    export = _Export(
        out.resolve(),
        options,
        splits,
        max((c.get("longest_row", 0) for c in counts), default=0),
        manifest["run"].get("family"),
        manifest["run"].get("think_end_id") is not None,
        any(c.get("conversations", {}).get("read") for c in counts),
    )
    return "\n".join(_LINES[options.consumer](export)) + "\n"


def _specforge(e: _Export) -> list[str]:
    train = e.out / TRAIN / f"{TRAIN}.jsonl"
    lines = ["SpecForge reads the train file from the data section of its config:", "", "data:"]
    if e.options.format == TOKENS:
        lines += [f"  prompts_path: {train}", f"  max_length: {max(e.longest, 1)}"]
    else:
        lines += [
            f"  train_data_path: {train}",
            f"  chat_template: {_specforge_template(e)}",
            "  train_only_last_turn: true",
            f"  max_length: {e.longest + _TEMPLATE_ROOM}",
        ]
    lines.append("")
    if VAL in e.splits:
        lines += [
            f"SpecForge 0.2.0 reads no validation file online: {e.out / VAL / f'{VAL}.jsonl'} "
            "is for your own evaluation.",
            "",
        ]
    if e.options.format == TOKENS:
        return [
            *lines,
            f"The rows are pre-tokenized: {_EXACT}. max_length is the longest row, so "
            "SpecForge cuts none.",
        ]
    lines.append(
        "The rows are conversations: SpecForge templates them again with its own chat "
        "template, so its ids and loss mask are its own, not the recorded ones (it trains "
        "the <think> the prompt opened, and adds a system message where the row has none). "
        "For the exact ids, export --for specforge --format tokens."
    )
    if e.conversations:
        lines += [
            "",
            "Rows of on-policy conversations (ids <conversation>_turn0-<t>) hold every "
            "assistant turn as the model's own answer: train_only_last_turn: false trains "
            "them all (and also the earlier assistant turns of any other row, which its "
            'dataset wrote: rows of turns = "last" datasets).',
        ]
    return lines


def _specforge_template(e: _Export) -> str:
    name = _SPECFORGE_TEMPLATES.get((e.family or "", e.reasoning))
    if name is None:
        return "CHOOSE  # SpecForge's template for this model: specforge.data.template"
    if e.family not in _TESTED:
        return f"{name}  # not loaded by eaglegen's tests: check it renders this model's turns"
    return name


def _speculators(e: _Export) -> list[str]:
    lines = [
        "speculators reads the train folder as a Dataset (load_from_disk, torch format: "
        "input_ids, loss_mask, seq_len):",
        "",
        f"  speculators train --data-path {e.out / TRAIN} ...",
        "",
        "It holds out the last rows of that folder itself (--train-data-ratio, 0.9 by "
        "default) for validation. Each export writes its rows in an order shuffled by the "
        "seed, so the held-out share of a first export is a sample of it; rows an "
        "--incremental export adds go after the old ones, which keep their places (and the "
        "hidden states speculators saved for them).",
    ]
    if VAL in e.splits:
        lines.append(f"{e.out / VAL} is not read by it: it is for your own evaluation.")
    return [*lines, "", f"{_EXACT}."]


def _modelopt(e: _Export) -> list[str]:
    lines = [
        "Model-Optimizer reads conversation files (its `messages` shape) with its "
        "ShardedDataset and templates them with LanguageDataCollator:",
        "",
    ]
    lines += [f"  {s}: {e.out / s / f'{s}.jsonl'}" for s in e.splits]
    return [
        *lines,
        "",
        "Its collator templates the messages again with the tokenizer's chat template: it "
        "drops the rows' tools and trains every token, the prompt's too (its "
        "answer_only_loss needs {% generation %} tags the run's template does not have), so "
        "its ids and loss mask are not the recorded ones. "
        "For the exact ids, export --for specforge or --for speculators (tokens).",
    ]


def _hf(e: _Export) -> list[str]:
    kind = "json" if e.options.writer == JSONL else "parquet"
    if e.options.writer == HF_DATASET:
        return [
            "Each shard is a datasets save_to_disk folder:",
            "",
            "  from pathlib import Path",
            "  from datasets import concatenate_datasets, load_from_disk",
            f"  train = concatenate_datasets([load_from_disk(str(p)) for p in "
            f"sorted(Path({str(e.out / TRAIN)!r}).glob('{TRAIN}-*'))])",
        ]
    lines = ["Load with datasets:", "", "  from datasets import load_dataset"]
    lines += [
        f"  {s} = load_dataset({kind!r}, data_dir={str(e.out / s)!r}, split='train')"
        for s in e.splits
    ]
    if e.options.format == TOKENS:
        lines += ["", f"{_EXACT}."]
    return lines


_LINES = {HF: _hf, SPECFORGE: _specforge, SPECULATORS: _speculators, MODELOPT: _modelopt}
