"""What an export's folder looks like for the trainer that will read it (``--for``).

Every layout puts ``manifest.json`` at the top of OUT and each split in a folder of its own
(``train/``, ``val/``): a trainer pointed at a split reads that split and nothing else (a
reader that takes every ``*.json*`` under a folder would otherwise take the manifest, or
the val rows, as training data).

- ``hf``: shards for `datasets` (Parquet by default, JSON Lines or `save_to_disk` folders),
  ``train/train-00000.parquet`` and on; an incremental export adds shards.
- ``specforge``: one JSON Lines file per split, ``train/train.jsonl``, because SpecForge's
  ``prompts_path`` names one file; an incremental export writes the split's file again
  (the old rows copied, the new ones after them) and swaps it in.
- ``speculators``: the split folder *is* a `save_to_disk` Dataset in torch format, what
  ``speculators train --data-path`` loads; an incremental export rebuilds and swaps it.
- ``modelopt``: one conversation file per split, ``train/train.jsonl``, in
  Model-Optimizer's ``messages`` shape.

Pure: ``folder`` and ``writers`` do the writing.
"""

from __future__ import annotations

from dataclasses import dataclass

from exporter.conversations import MODELOPT, SPECFORGE

HF = "hf"
SPECULATORS = "speculators"
CONSUMERS = (HF, SPECFORGE, SPECULATORS, MODELOPT)

TOKENS = "tokens"
CONVERSATIONS = "conversations"

# Writers: sharded (``hf``) or one file or folder per split (the others).
PARQUET = "parquet"
JSONL = "jsonl"
HF_DATASET = "hf-dataset"
JSONL_FILE = "jsonl-file"
TORCH_DATASET = "torch-dataset"
WHOLE = (JSONL_FILE, TORCH_DATASET)
# The columns a torch-format Dataset gives as tensors (the rest stay Python values).
TORCH_COLUMNS = ("input_ids", "loss_mask", "seq_len")


@dataclass(frozen=True)
class Layout:
    """A consumer's layout: the row format, the writer, and the conversation style."""

    consumer: str
    format: str
    writer: str
    style: str | None  # conversations only: exporter.conversations.STYLES

    @property
    def whole(self) -> bool:
        """Whether each split is one file or folder, rewritten by an incremental export."""
        return self.writer in WHOLE


def layout_for(
    consumer: str, row_format: str | None, *, jsonl: bool = False, hf_dataset: bool = False
) -> Layout:
    """The layout ``--for consumer [--format F] [--jsonl|--hf-dataset]`` asks for, or a
    ValueError saying why that consumer cannot read it."""
    if consumer not in CONSUMERS:
        raise ValueError(f"--for takes one of {', '.join(CONSUMERS)}, not {consumer!r}")
    if (jsonl or hf_dataset) and consumer != HF:
        raise ValueError(
            f"--jsonl and --hf-dataset choose the shards of --for hf; --for {consumer} "
            "writes the one layout its trainer loads"
        )
    if consumer == HF:
        return _hf(row_format or TOKENS, jsonl=jsonl, hf_dataset=hf_dataset)
    if consumer == SPECFORGE:
        return Layout(SPECFORGE, row_format or TOKENS, JSONL_FILE, SPECFORGE)
    if consumer == SPECULATORS:
        if row_format == CONVERSATIONS:
            raise ValueError(
                "speculators reads conversations only through a vLLM /render server that "
                "templates them again: --for speculators writes the exact ids (tokens)"
            )
        return Layout(SPECULATORS, TOKENS, TORCH_DATASET, None)
    if row_format == TOKENS:
        raise ValueError(
            "Model-Optimizer's EAGLE-3 data is conversations, templated by its collator: "
            "--for modelopt writes conversations (for the exact ids, use --for specforge "
            "or --for speculators)"
        )
    return Layout(MODELOPT, CONVERSATIONS, JSONL_FILE, MODELOPT)


def _hf(row_format: str, *, jsonl: bool, hf_dataset: bool) -> Layout:
    if jsonl and hf_dataset:
        raise ValueError("--jsonl and --hf-dataset exclude each other: pick one writer")
    if row_format == CONVERSATIONS:
        if hf_dataset:
            raise ValueError(
                "conversations are written as JSON Lines (their tools and arguments have no "
                "one columnar type): drop --hf-dataset"
            )
        return Layout(HF, CONVERSATIONS, JSONL, SPECFORGE)
    return Layout(HF, TOKENS, JSONL if jsonl else HF_DATASET if hf_dataset else PARQUET, None)


def whole_name(writer: str, split: str) -> str:
    """The path, inside OUT, of a whole split's file or folder."""
    return f"{split}/{split}.jsonl" if writer == JSONL_FILE else split
