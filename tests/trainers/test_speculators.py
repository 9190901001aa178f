"""`eaglegen export --for speculators` and the SpecForge JSONL loaded by speculators 0.9.0's
own code: the Dataset folder ``speculators train --data-path`` opens
(``create_train_val_loaders`` -> ``ArrowDataset``, loaders/speculators_load.py) and the
folder ``speculators prepare-data`` writes from the JSONL (its CLI, run as a user runs it).
Ids and masks equal to Postgres, row for row."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from core.settings import Settings
from tests.helpers import InspectRepository
from tests.trainers.runs import Stored, export, generate, in_venv, jsonl, stored, tools


def key(ids: list[int], mask: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(ids), tuple(mask)


def test_train_data_path_folders_load_in_arrow_dataset_equal_to_postgres(
    settings: Settings, repo: InspectRepository, tmp_path: Path, trainers_python: Path
) -> None:
    """Each split folder is what ``--data-path`` opens. speculators 0.9.0 splits the one
    folder it is given by ``--train-data-ratio`` (default 0.9, strictly below 1) into its
    own train and val parts, in row order: both parts, together, are the folder's rows.
    It never reads OUT/val; given as a --data-path of its own, it loads the same way."""
    folders = generate(settings, repo, tmp_path)
    for family in folders:
        database = stored(repo, family)
        out = tmp_path / "out" / family
        printed = export(
            settings,
            family,
            out,
            "--for",
            "speculators",
            "--val-fraction",
            "0.25",
            "--include-truncated",
        )
        assert f"--data-path {(out / 'train').resolve()}" in printed
        seen: list[int] = []
        for split in ("train", "val"):
            folder = out / split
            assert (folder / "dataset_info.json").exists() and (folder / "state.json").exists()
            parts = in_venv(
                trainers_python,
                "speculators_load.py",
                "train",
                str(folder),
                str(tmp_path / f"{family}-{split}.json"),
            )
            rows = parts["train"]["rows"] + parts["val"]["rows"]
            assert parts["train"]["rows"] and parts["val"]["rows"]
            for row in rows:
                # The torch format: tensors, as ArrowDataset's torch.equal needs.
                assert row["raw_types"] == {"input_ids": "Tensor", "loss_mask": "Tensor"}
                expected = database[int(row["id"])]
                assert row["input_ids"] == expected.input_ids, (family, row["id"])
                assert row["loss_mask"] == expected.loss_mask, (family, row["id"])
                assert row["seq_len"] == row["length"] == len(expected.input_ids)
            for part in ("train", "val"):
                lengths = [row["seq_len"] for row in parts[part]["rows"]]
                assert parts[part]["approx_lengths"] == lengths
            seen += [int(row["id"]) for row in rows]
        assert sorted(seen) == sorted(database), family  # the splits: disjoint, complete


def test_prepare_data_reads_the_specforge_jsonl_equal_to_postgres(
    settings: Settings, repo: InspectRepository, tmp_path: Path, trainers_python: Path
) -> None:
    """``speculators prepare-data --data OUT/train`` (the folder: it reads every *.json*
    under it, which is the one split file) passes pre-tokenized rows through; it keeps
    only input_ids, loss_mask and seq_len and shuffles them, so the rows are compared as a
    multiset of (ids, mask) pairs, each the database's."""
    folders = generate(settings, repo, tmp_path)
    for family, tokenizer in folders.items():
        database = stored(repo, family)
        out = tmp_path / "out" / family
        export(
            settings,
            family,
            out,
            "--for",
            "specforge",
            "--val-fraction",
            "0.25",
            "--include-truncated",
        )
        for split in ("train",):  # the val file is the same kind of file
            prepared = tmp_path / "prepared" / family / split
            tools(
                trainers_python,
                "speculators",
                "prepare-data",
                "--model",
                str(tokenizer),
                "--data",
                str(out / split),
                "--output",
                str(prepared),
                "--seq-length",
                "8192",
                "--num-preprocessing-workers",
                "1",
            )
            loaded = in_venv(
                trainers_python,
                "speculators_load.py",
                "disk",
                str(prepared),
                str(tmp_path / f"{family}-{split}-prepared.json"),
            )
            assert loaded["columns"] == ["input_ids", "loss_mask", "seq_len"]
            file = out / split / f"{split}.jsonl"
            exported: list[Stored] = [database[int(r["id"])] for r in jsonl(file)]
            assert Counter(key(r["input_ids"], r["loss_mask"]) for r in loaded["rows"]) == Counter(
                key(s.input_ids, s.loss_mask) for s in exported
            )
            assert all(r["seq_len"] == len(r["input_ids"]) for r in loaded["rows"])
