"""The pieces of an export's layout that need no database: the exchange of a split's
folder, the shard names a manifest may list, and an extended export's shard list."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from exporter.files import swap
from exporter.manifest import _in_folder, merge_shards
from exporter.writers import Shard


def test_swap_exchanges_two_folders_in_place(tmp_path: Path) -> None:
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "rows").write_text("new")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "train").mkdir()
    (tmp_path / "out" / "train" / "rows").write_text("old")
    src, dst = os.open(tmp_path, os.O_RDONLY), os.open(tmp_path / "out", os.O_RDONLY)
    try:
        swap(src, "new", dst, "train")
    finally:
        os.close(src)
        os.close(dst)
    assert (tmp_path / "out" / "train" / "rows").read_text() == "new"
    assert (tmp_path / "new" / "rows").read_text() == "old"


@pytest.mark.parametrize(
    ("name", "inside"),
    [
        ("train/train-00000.parquet", True),
        ("val/val.jsonl", True),
        ("train", True),  # a whole split: speculators' Dataset folder
        ("train-00000.parquet", False),  # the earlier layout's place
        ("train/../../victim", False),
        ("train/..", False),
        ("train/a/b", False),
        ("other/train-00000.parquet", False),
        ("/etc/passwd", False),
        ("", False),
        (7, False),
    ],
)
def test_a_manifest_lists_only_split_folders_and_names_in_them(
    tmp_path: Path, name: object, inside: bool
) -> None:
    assert _in_folder(tmp_path, name) is inside


def test_a_link_in_a_split_folder_must_stay_in_the_export(tmp_path: Path) -> None:
    (tmp_path / "out" / "train").mkdir(parents=True)
    (tmp_path / "out" / "train" / "away").symlink_to(tmp_path)
    (tmp_path / "out" / "train" / "near").symlink_to(tmp_path / "out" / "train")
    assert not _in_folder(tmp_path / "out", "train/away")
    assert _in_folder(tmp_path / "out", "train/near")


def shard(file: str, rows: int) -> Shard:
    return Shard(file, file.split("/")[0], rows, rows * 10, f"{rows:064x}")


def test_a_split_written_again_replaces_its_entry_and_new_shards_follow() -> None:
    before = [shard("train/train.jsonl", 30), shard("val/val.jsonl", 3)]
    merged = merge_shards(before, [shard("train/train.jsonl", 50)])
    assert merged == [shard("train/train.jsonl", 50), shard("val/val.jsonl", 3)]
    sharded = [shard("train/train-00000.parquet", 5)]
    assert merge_shards(sharded, [shard("train/train-00001.parquet", 2)]) == [
        *sharded,
        shard("train/train-00001.parquet", 2),
    ]
