"""Run inside the trainers' venv: SpecForge 0.2.0 loads a split as its online trainer does.

``specforge.training.assembly._prepare_prompts`` validates the run's ``data:`` section
(``specforge.config.schema.DataConfig``, which refuses unknown keys) and hands its path to
``specforge.data.prompt_builder.prepare_prompt_tasks``: pre-tokenized rows (``input_ids``
and ``loss_mask``) as they are, conversation rows through ``build_eagle3_dataset`` and the
named chat template. This script does the same with the ``data:`` mapping an export wrote,
with EAGLE-3's own minimum of one loss token (``one_loss_token``) and no loss-mask filter
(EAGLE-3 registers none), and writes the payloads it got to RESULT as JSON.

    python specforge_load.py DATA_JSON TOKENIZER_DIR RESULT [--path P]

``--path`` loads P instead of the section's path (the val split, which the section cannot
name: SpecForge 0.2.0 has no online evaluation).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

from specforge.config.schema import DataConfig
from specforge.data.prompt_builder import prepare_prompt_tasks
from transformers import AutoTokenizer


def _row_ids(path: str) -> list[Any]:
    """Which exported row each payload is: the file's ``id`` in the order SpecForge keeps.
    Pre-tokenized rows keep the file's order; conversation rows go through
    ``build_eagle3_dataset``, which shuffles them with its default seed (42) and drops the
    ``id`` column: the same shuffle of the file's ids names each row."""
    from datasets import load_dataset

    with open(path) as handle:
        first = json.loads(handle.readline())
        handle.seek(0)
        ids = [json.loads(line)["id"] for line in handle if line.strip()]
    if "input_ids" in first:
        return ids
    shuffled = load_dataset("json", data_files=path, split="train").shuffle(seed=42)
    return list(shuffled["id"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data_json", help="the data: section, as a JSON object")
    parser.add_argument("tokenizer")
    parser.add_argument("result")
    parser.add_argument("--path", default=None)
    args = parser.parse_args()

    data = DataConfig.model_validate(json.loads(args.data_json))
    path = args.path or data.prompts_path or data.train_data_path
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    with tempfile.TemporaryDirectory() as cache:
        prompts = prepare_prompt_tasks(
            path,
            tokenizer,
            chat_template=data.chat_template,
            max_length=data.max_length,
            is_preformatted=data.is_preformatted,
            train_only_last_turn=data.train_only_last_turn,
            # One process: the same map as build_dataset_num_proc workers, in order.
            cache_dir=cache,
            cache_key="eaglegen-test",
            num_proc=1,
            min_loss_tokens=1,
            max_prompts=data.max_prompts,
            loss_mask_filter=None,
        )
        rows: list[dict[str, Any]] = [
            {
                "input_ids": list(prompt["payload"]["input_ids"]),
                "loss_mask": list(prompt["payload"]["loss_mask"]),
            }
            for prompt in prompts
        ]
    result = {
        "path": path,
        "ids": _row_ids(path),
        "max_length": data.max_length,
        "chat_template": data.chat_template,
        "train_only_last_turn": data.train_only_last_turn,
        "rows": rows,
    }
    with open(args.result, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
