"""Run inside the trainers' venv: Model-Optimizer 0.47.0 loads a split as its EAGLE-3
example's online mode does (examples/speculative_decoding/eagle_utils.py,
``make_speculative_data_module``): ``ShardedDataset("json", data_files=DATA_PATH)`` (a file,
or a folder it reads as ``data_dir``) and ``LanguageDataCollator(tokenizer, train_len,
return_labels=True, answer_only_loss=..., chat_template=...)``, both from
``modelopt.torch.utils.plugins.transformers_dataset``.

    python modelopt_load.py DATA_PATH TOKENIZER_DIR RESULT --train-len N
        [--answer-only-loss] [--chat-template FILE]

Each row is collated alone (the collator pads every batch to train_len); RESULT gets its
ids up to the padding, the targets its shifted labels train (label[i] = input[i+1]; -100
where not trained) and its ``assistant_masks`` when answer_only_loss asked for them. A
collator that refuses to be built writes ``{"error": ...}``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from modelopt.torch.utils.plugins.transformers_dataset import (
    IGNORE_TOKEN_ID,
    LanguageDataCollator,
    ShardedDataset,
)
from transformers import AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data_path")
    parser.add_argument("tokenizer")
    parser.add_argument("result")
    parser.add_argument("--train-len", type=int, required=True)
    parser.add_argument("--answer-only-loss", action="store_true")
    parser.add_argument("--chat-template", default=None)
    args = parser.parse_args()

    dataset = ShardedDataset("json", data_files=args.data_path)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    template = None
    if args.chat_template:
        with open(args.chat_template) as handle:
            template = handle.read()
    try:
        collator = LanguageDataCollator(
            tokenizer=tokenizer,
            train_len=args.train_len,
            return_labels=True,
            answer_only_loss=args.answer_only_loss,
            chat_template=template,
        )
    except ValueError as error:
        with open(args.result, "w") as handle:
            json.dump({"error": str(error)}, handle)
        return

    rows: list[dict[str, Any]] = []
    for index in range(len(dataset)):
        sample = dataset[index]
        batch = collator([sample])
        length = int(batch["attention_mask"][0].sum())
        ids = batch["input_ids"][0][:length].tolist()
        labels = batch["labels"][0][:length].tolist()
        row: dict[str, Any] = {
            "sample_keys": sorted(sample),
            "conversation_id": sample.get("conversation_id"),
            "metadata": sample.get("metadata"),
            "has_tools": bool(sample.get("tools")),
            "input_ids": ids,
            # Position i+1 is trained when label[i] is not IGNORE (shifted labels).
            "trained": [0] + [int(label != IGNORE_TOKEN_ID) for label in labels[:-1]],
        }
        if "assistant_masks" in batch:
            row["assistant_masks"] = batch["assistant_masks"][0][:length].tolist()
        rows.append(row)
    with open(args.result, "w") as handle:
        json.dump({"rows": rows}, handle)


if __name__ == "__main__":
    main()
