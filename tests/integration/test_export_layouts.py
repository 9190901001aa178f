"""`eaglegen export --for CONSUMER`: each layout's folders and files, an incremental export
of each, and the combinations a consumer cannot read. (That each trainer's own loader reads
them is the trainers tier's proof: tests/trainers.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest

from exporter.export import ExportRequest, ExportResult, prepare, run_export
from exporter.files import sha256_of, sha256_of_files
from exporter.layouts import (
    CONVERSATIONS,
    HF,
    HF_DATASET,
    JSONL,
    MODELOPT,
    PARQUET,
    SPECFORGE,
    SPECULATORS,
    TOKENS,
    layout_for,
)
from exporter.manifest import MANIFEST, Options
from exporter.rows import Filters
from models.repository import Repository
from tests.helpers import InspectRepository
from tests.integration.test_export import assert_rows_are_the_database, recorded_run

USAGE = "how-to-load.txt"


def export(
    repo: Repository,
    out: Path,
    consumer: str,
    row_format: str | None = None,
    *,
    incremental: bool = False,
    val_fraction: float = 0.0,
) -> ExportResult:
    layout = layout_for(consumer, row_format)
    options = Options(
        layout.writer,
        Filters(),
        val_fraction,
        0,
        format=layout.format,
        style=layout.style,
        consumer=layout.consumer,
    )
    request = ExportRequest("run", out, options, 256_000_000, incremental)
    found, previous, _ = prepare(repo, request)
    return run_export(repo, request, found, previous)


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def saved(folder: Path) -> list[dict[str, Any]]:
    """The rows of a saved Dataset folder recorded in torch format (torch is not installed
    here: the trainers tier loads it with torch, through speculators' own code)."""
    state = json.loads((folder / "state.json").read_bytes())
    assert state["_format_type"] == "torch" and state["_output_all_columns"] is True
    assert state["_format_columns"] == ["input_ids", "loss_mask", "seq_len"]
    files = [folder / entry["filename"] for entry in state["_data_files"]]
    return [row for f in files for row in datasets.Dataset.from_file(str(f)).to_list()]


def entries(out: Path) -> list[str]:
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))


def test_specforge_writes_one_file_per_split_and_an_incremental_export_extends_it(
    repo: InspectRepository, tmp_path: Path
) -> None:
    recorded_run(repo, {"a": [(4, 6, "stop")] * 30})
    out = tmp_path / "out"
    first = export(repo, out, SPECFORGE, val_fraction=0.3)
    assert entries(out) == [
        USAGE, MANIFEST, "train", "train/train.jsonl", "val", "val/val.jsonl"
    ]  # fmt: skip
    train, val = jsonl(out / "train/train.jsonl"), jsonl(out / "val/val.jsonl")
    assert len(train) + len(val) == 30 and val and train
    assert_rows_are_the_database(repo, [r | r["metadata"] for r in train + val])
    assert [s["file"] for s in first.manifest["shards"]] == ["train/train.jsonl", "val/val.jsonl"]
    usage = (out / USAGE).read_text()
    assert f"  prompts_path: {out.resolve() / 'train/train.jsonl'}\n  max_length: 10\n" in usage
    assert "reads no validation file online" in usage
    assert first.usage == usage

    old_train = (out / "train/train.jsonl").read_bytes()
    recorded_run(repo, {"b": [(5, 7, "stop")] * 20})
    second = export(repo, out, SPECFORGE, incremental=True, val_fraction=0.3).manifest
    grown = (out / "train/train.jsonl").read_bytes()
    assert grown.startswith(old_train) and len(grown) > len(old_train)
    shards = {s["file"]: s for s in second["shards"]}
    assert list(shards) == ["train/train.jsonl", "val/val.jsonl"]  # replaced, not added
    train, val = jsonl(out / "train/train.jsonl"), jsonl(out / "val/val.jsonl")
    assert len(train) + len(val) == 50 == second["rows"]
    assert shards["train/train.jsonl"]["rows"] == len(train)
    assert shards["train/train.jsonl"]["sha256"] == sha256_of(out / "train/train.jsonl")
    assert len({r["id"] for r in train + val}) == 50
    assert_rows_are_the_database(repo, [r | r["metadata"] for r in train + val])
    assert [p.name for p in out.iterdir() if p.name.startswith(".tmp-")] == []


def test_speculators_writes_a_torch_dataset_per_split_and_an_incremental_export_adds_to_it(
    repo: InspectRepository, tmp_path: Path
) -> None:
    recorded_run(repo, {"a": [(4, 6, "stop")] * 12})
    out = tmp_path / "out"
    first = export(repo, out, SPECULATORS)
    assert [s["file"] for s in first.manifest["shards"]] == ["train"]
    rows = saved(out / "train")
    assert len(rows) == 12
    assert_rows_are_the_database(repo, rows)
    assert [r["id"] for r in rows] != sorted(r["id"] for r in rows)  # shuffled by the seed
    assert [r["id"] for r in saved_again(repo, tmp_path)] == [r["id"] for r in rows]
    assert f"--data-path {out.resolve() / 'train'}" in first.usage
    # What speculators keeps in the folder: hidden states saved by row index.
    (out / "train" / "hidden_states").mkdir()
    (out / "train" / "hidden_states" / "hs_0.safetensors").write_bytes(b"row 0")

    recorded_run(repo, {"b": [(5, 7, "stop")] * 5})
    second = export(repo, out, SPECULATORS, incremental=True).manifest
    grown = saved(out / "train")
    assert len(grown) == 17 == second["rows"] == second["shards"][0]["rows"]
    assert grown[:12] == rows  # the old rows keep their places
    assert_rows_are_the_database(repo, grown)
    assert (out / "train" / "hidden_states" / "hs_0.safetensors").read_bytes() == b"row 0"
    files = [out / "train" / n for n in ("dataset_info.json", "state.json")]
    files += [out / "train" / f"data-0000{i}-of-0000{i + 1}.arrow" for i in range(2)]
    assert second["shards"][0]["sha256"] == sha256_of_files(files)
    assert sorted(p.name for p in out.iterdir()) == [USAGE, MANIFEST, "train"]


def saved_again(repo: InspectRepository, tmp_path: Path) -> list[dict[str, Any]]:
    """The rows of a second export of the same run with the same seed."""
    export(repo, tmp_path / "again", SPECULATORS)
    return saved(tmp_path / "again" / "train")


def test_modelopt_writes_its_conversation_file_per_split(
    repo: InspectRepository, tmp_path: Path
) -> None:
    recorded_run(repo, {"a": [(4, 6, "stop")] * 3})
    out = tmp_path / "out"
    # recorded_run's tokenizer path is not a tokenizer: conversations cannot be decoded.
    with pytest.raises(ValueError, match="tokenizer"):
        export(repo, out, MODELOPT)
    assert layout_for(MODELOPT, None).format == CONVERSATIONS


def test_the_hf_layout_loads_by_split_from_the_folder(
    repo: InspectRepository, tmp_path: Path
) -> None:
    recorded_run(repo, {"a": [(4, 6, "stop")] * 40})
    out = tmp_path / "out"
    export(repo, out, HF, val_fraction=0.25)
    loaded = datasets.load_dataset(str(out), cache_dir=str(tmp_path / "cache"))
    assert sorted(loaded) == ["train", "validation"]
    assert len(loaded["train"]) + len(loaded["validation"]) == 40
    assert_rows_are_the_database(repo, loaded["train"].to_list() + loaded["validation"].to_list())


@pytest.mark.parametrize(
    ("consumer", "row_format", "flags", "reason"),
    [
        (SPECULATORS, CONVERSATIONS, {}, "vLLM /render server"),
        (MODELOPT, TOKENS, {}, "for the exact ids, use --for specforge"),
        (SPECFORGE, None, {"jsonl": True}, "choose the shards of --for hf"),
        (HF, CONVERSATIONS, {"hf_dataset": True}, "drop --hf-dataset"),
        (HF, None, {"jsonl": True, "hf_dataset": True}, "exclude each other"),
    ],
)
def test_a_layout_its_consumer_cannot_read_is_refused_with_the_reason(
    consumer: str, row_format: str | None, flags: dict[str, bool], reason: str
) -> None:
    with pytest.raises(ValueError, match=reason):
        layout_for(consumer, row_format, **flags)


def test_an_incremental_export_into_an_export_of_the_earlier_layout_is_refused(
    repo: InspectRepository, tmp_path: Path
) -> None:
    recorded_run(repo, {"a": [(4, 6, "stop")] * 3})
    out = tmp_path / "out"
    export(repo, out, HF)
    manifest = json.loads((out / MANIFEST).read_bytes())
    manifest["manifest_version"] = 1
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"another layout .* export into a new folder"):
        export(repo, out, HF, incremental=True)


def test_an_incremental_export_keeps_the_consumer_of_the_export_it_extends(
    repo: InspectRepository, tmp_path: Path
) -> None:
    recorded_run(repo, {"a": [(4, 6, "stop")] * 3})
    out = tmp_path / "out"
    export(repo, out, SPECFORGE)
    with pytest.raises(ValueError, match="--for was 'specforge', now 'hf'"):
        export(repo, out, HF, incremental=True)


def test_a_killed_first_export_of_a_whole_split_is_written_again(
    repo: InspectRepository, tmp_path: Path
) -> None:
    recorded_run(repo, {"a": [(4, 6, "stop")] * 4})
    clean = tmp_path / "clean"
    export(repo, clean, SPECFORGE)
    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    (out / "train/train.jsonl").write_bytes((clean / "train/train.jsonl").read_bytes()[:10])
    again = export(repo, out, SPECFORGE)
    assert sorted(again.removed) == ["train/train.jsonl"]
    assert (out / "train/train.jsonl").read_bytes() == (clean / "train/train.jsonl").read_bytes()


@pytest.mark.parametrize("writer", [PARQUET, JSONL, HF_DATASET])
def test_the_printed_python_loads_the_hf_layout(
    repo: InspectRepository, tmp_path: Path, writer: str
) -> None:
    recorded_run(repo, {"a": [(4, 6, "stop")] * 7})
    out = tmp_path / "out"
    options = Options(writer, Filters(), consumer=HF)
    request = ExportRequest("run", out, options, 256_000_000)
    found, previous, _ = prepare(repo, request)
    usage = run_export(repo, request, found, previous).usage
    code = "\n".join(line[2:] for line in usage.splitlines() if line.startswith("  "))
    namespace: dict[str, Any] = {}
    exec(code, namespace)  # what a user pastes
    rows = namespace["train"].to_list()
    assert_rows_are_the_database(repo, [r | (r.get("metadata") or {}) for r in rows])
    assert len(namespace["train"]) == 7
