"""Run inside the trainers' venv: speculators 0.9.0 reads a Dataset folder.

    python speculators_load.py train DATA_PATH RESULT [--train-data-ratio R]
    python speculators_load.py disk FOLDER RESULT

``train``: what ``speculators train --data-path DATA_PATH`` builds before its (GPU-only)
Trainer: ``speculators.train.dataloader.create_train_val_loaders``, which opens the folder
twice as ``speculators.train.data.ArrowDataset`` (``datasets.load_from_disk``) and splits it
by ``--train-data-ratio`` into a train and a val part. The hidden states a training run reads
per row (``DATA_PATH/hidden_states/hs_<index>.safetensors``, written by
``speculators generate-offline-data`` from vLLM) are written here as small random tensors
with each row's own ids as ``token_ids``, so that ``ArrowDataset.__getitem__`` runs whole:
it checks those ids against the row's ``input_ids`` with ``torch.equal`` and returns the
row's ``loss_mask``. RESULT gets, per part, what ``__getitem__`` returned and the raw row.

``disk``: ``datasets.load_from_disk`` of a folder ``speculators prepare-data`` wrote.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from datasets import load_from_disk


def _tolist(value: Any) -> Any:
    return value.tolist() if isinstance(value, torch.Tensor) else value


def train(data_path: str, ratio: float) -> dict[str, Any]:
    from safetensors.torch import save_file
    from speculators.train.dataloader import create_train_val_loaders

    folder = load_from_disk(data_path)
    hidden = Path(data_path) / "hidden_states"
    hidden.mkdir(exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    for index in range(len(folder)):
        ids = torch.as_tensor(folder[index]["input_ids"], dtype=torch.long)
        states = torch.randn(len(ids), 4, 8, generator=generator, dtype=torch.float32)
        save_file({"hidden_states": states, "token_ids": ids}, hidden / f"hs_{index}.safetensors")

    train_loader, val_loader = create_train_val_loaders(
        data_path=data_path,
        total_seq_len=8192,
        hidden_states_dtype=torch.float32,
        transfer=None,  # the file backend under DATA_PATH/hidden_states, as the CLI's default
        vllm_endpoint="http://127.0.0.1:9/v1",  # never asked: every row's states are there
        on_missing="raise",
        verifier_name_or_path="unused",
        request_timeout=1.0,
        max_retries=0,
        generation_validation_retries=0,
        max_consecutive_generation_failures=1,
        hidden_size=8,
        num_target_layers=3,
        num_workers=0,
        prefetch_factor=0,
        preprocess=None,
        train_data_ratio=ratio,
    )
    parts: dict[str, Any] = {}
    for name, loader in (("train", train_loader), ("val", val_loader)):
        dataset = loader.dataset
        rows = []
        for index in range(len(dataset)):
            raw = dataset.data[index]
            item = dataset[index]
            assert isinstance(item, dict), f"{name}[{index}]: {item!r}"
            rows.append(
                {
                    "id": _tolist(raw.get("id")),
                    "raw_types": {k: type(raw[k]).__name__ for k in ("input_ids", "loss_mask")},
                    "input_ids": item["input_ids"].tolist(),
                    "loss_mask": item["loss_mask"].tolist(),
                    "seq_len": _tolist(raw["seq_len"]),
                    "length": int(item["lengths"][0]),
                }
            )
        parts[name] = {"rows": rows, "approx_lengths": list(dataset.approx_lengths)}
    return parts


def disk(folder: str) -> dict[str, Any]:
    dataset = load_from_disk(folder)
    rows = [
        {key: _tolist(row[key]) for key in ("input_ids", "loss_mask", "seq_len")} for row in dataset
    ]
    return {"columns": dataset.column_names, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "disk"])
    parser.add_argument("path")
    parser.add_argument("result")
    parser.add_argument("--train-data-ratio", type=float, default=0.9)  # the CLI's default
    args = parser.parse_args()
    result = train(args.path, args.train_data_ratio) if args.mode == "train" else disk(args.path)
    with open(args.result, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
