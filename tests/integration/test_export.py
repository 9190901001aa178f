"""`eaglegen export --format tokens` against real Postgres, with generations a real worker
made (or recorded through the repository where a test needs chosen finish reasons)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq
import pytest

from core.settings import Settings
from exporter.export import ExportRequest, ExportResult, prepare, run_export
from exporter.files import TMP_PREFIX, sha256_of
from exporter.layouts import HF_DATASET, JSONL, PARQUET
from exporter.manifest import MANIFEST, Options
from exporter.rows import EXTRA_SAMPLE, INVALID, NO_LOSS, NOT_EXACT, SHORT, TRUNCATED, Filters
from models.records import DatasetSpec, GenerationRecord, NewJob, RunSpec
from models.repository import Repository
from tests.helpers import InspectRepository, enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.integration.test_pipeline import worker


def export(
    repo: Repository,
    out: Path,
    *,
    writer: str = PARQUET,
    filters: Filters | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
    shard_bytes: int = 256_000_000,
    incremental: bool = False,
    run: str = "run",
) -> ExportResult:
    """One export pass, as `eaglegen export` runs it."""
    options = Options(writer, filters or Filters(), val_fraction, seed)
    request = ExportRequest(run, out, options, shard_bytes, incremental)
    found, previous, _ = prepare(repo, request)
    return run_export(repo, request, found, previous)


def generate(settings: Settings, repo: Repository, path: Path, rows: list[Any], **kw: Any) -> int:
    """Enqueue ``rows`` and let a real worker generate them all; how many are done."""
    with worker(settings):
        enqueue_file(settings, write_jsonl(path, rows), **kw)
        states = wait_settled(repo)
    return states["done"]


def parquet_rows(out: Path, files: list[str]) -> list[dict[str, Any]]:
    return [row for name in files for row in pq.read_table(out / name).to_pylist()]


def shard_files(manifest: dict[str, Any], split: str | None = None) -> list[str]:
    return [s["file"] for s in manifest["shards"] if split is None or s["split"] == split]


def assert_rows_are_the_database(repo: InspectRepository, rows: list[dict[str, Any]]) -> None:
    """Each row's ids are the job's prompt ids then its output ids, exactly, and its mask
    turns from 0 to 1 where the output begins."""
    for row in rows:
        job, gen = repo.job(row["job_id"]), repo.generation(row["job_id"])
        assert job is not None and gen is not None
        assert row["id"] == str(job["id"])  # a plain job's row is named by its id
        assert row["input_ids"] == job["input_ids"] + gen["output_ids"]
        prompt_len = len(job["input_ids"])
        assert row["prompt_len"] == prompt_len
        mask = row["loss_mask"]
        assert len(mask) == len(row["input_ids"]) == row["seq_len"]
        assert mask[prompt_len - 1] == 0 and mask[prompt_len] == 1
        assert mask == [0] * prompt_len + [1] * len(gen["output_ids"])
        assert row["finish_reason"] == gen["finish_type"]
        assert row["completion_tokens"] == gen["completion_tokens"]
        assert row["think_end_present"] == gen["think_end_present"]


@pytest.mark.embedded
def test_the_tokens_export_is_the_database_exactly_and_loads_with_datasets(
    settings: Settings, repo: InspectRepository, tmp_path: Path
) -> None:
    done = generate(settings, repo, tmp_path / "d.jsonl", sample_rows(40), max_new_tokens=300)
    assert done == 40
    out = tmp_path / "out"
    result = export(repo, out, shard_bytes=20_000)  # small shards: several of them
    manifest = json.loads((out / MANIFEST).read_text())
    files = shard_files(manifest)
    assert len(files) > 1 and manifest == result.manifest
    rows = parquet_rows(out, files)
    assert sorted(r["job_id"] for r in rows) == repo.job_ids()
    assert_rows_are_the_database(repo, rows)
    assert {r["finish_reason"] for r in rows} <= {"stop", "length"}
    for shard in manifest["shards"]:
        assert sha256_of(out / shard["file"]) == shard["sha256"]
        assert pq.read_metadata(out / shard["file"]).num_rows == shard["rows"]
    assert manifest["run"]["name"] == "run" and len(manifest["run"]["tokenizer_sha256"]) == 64
    assert manifest["sampling"]["d"]["max_new_tokens"] == 300
    assert manifest["counts"]["d"]["exported"] == 40 and manifest["rows"] == 40
    loaded = datasets.load_dataset(
        "parquet",
        data_files=[str(out / f) for f in files],
        split="train",
        cache_dir=str(tmp_path / "hf"),
    )
    assert len(loaded) == 40
    assert sorted(loaded["id"]) == sorted(r["id"] for r in rows)
    first = loaded[0]
    assert first["input_ids"] == next(r for r in rows if r["id"] == first["id"])["input_ids"]


def test_jsonl_and_save_to_disk_shards_load_with_datasets(
    settings: Settings, repo: InspectRepository, tmp_path: Path
) -> None:
    generate(settings, repo, tmp_path / "d.jsonl", sample_rows(24), max_new_tokens=300)
    jsonl_out, hf_out = tmp_path / "jsonl", tmp_path / "hf-out"
    jsonl_manifest = export(repo, jsonl_out, writer=JSONL).manifest
    hf_manifest = export(repo, hf_out, writer=HF_DATASET, shard_bytes=10_000).manifest
    [jsonl_file] = shard_files(jsonl_manifest)
    assert jsonl_file == "train/train-00000.jsonl"
    lines = [json.loads(line) for line in (jsonl_out / jsonl_file).read_text().splitlines()]
    # The keys SpecForge's prompts_path and speculators' pre-tokenized rows read.
    assert {"id", "primary_id", "input_ids", "loss_mask", "metadata"} <= set(lines[0])
    assert_rows_are_the_database(repo, [line | line["metadata"] for line in lines])
    loaded = datasets.load_dataset(
        "json",
        data_files=str(jsonl_out / jsonl_file),
        split="train",
        cache_dir=str(tmp_path / "cache"),
    )
    assert len(loaded) == 24 and loaded[0]["input_ids"] == lines[0]["input_ids"]
    folders = shard_files(hf_manifest)
    assert len(folders) > 1 and all((hf_out / f).is_dir() for f in folders)
    arrow_rows = []
    for folder in folders:
        shard = datasets.load_from_disk(str(hf_out / folder))
        assert {"input_ids", "loss_mask", "seq_len"} <= set(shard.column_names)
        arrow_rows += shard.to_list()
    assert sorted(r["job_id"] for r in arrow_rows) == repo.job_ids()
    assert_rows_are_the_database(repo, arrow_rows)
    assert not [p for p in hf_out.iterdir() if p.name.startswith(TMP_PREFIX)]


def recorded_run(repo: Repository, specs: dict[str, list[tuple[int, int, str]]]) -> None:
    """Run "run" with a dataset per key, one done job per (prompt length, output length,
    finish type), recorded through the repository as a worker records them."""
    run_id = repo.ensure_run(RunSpec("run", "/tok", "a" * 64, "b" * 64, "tiny"))
    for name, jobs in specs.items():
        dataset_id = repo.ensure_dataset(run_id, DatasetSpec(name, "x", {"max_new_tokens": 9}))
        new = [NewJob(i, [1000 + i] * p, {"messages": []}) for i, (p, _, _) in enumerate(jobs)]
        for job_id, (prompt, output, finish) in zip(
            repo.insert_jobs(dataset_id, new), jobs, strict=True
        ):
            assert repo.claim(job_id, "w", lease_seconds=60).job is not None
            ids = [5] * output
            record = GenerationRecord(ids, finish, None, prompt, output, 0, 0.1, "sim")
            assert repo.record(job_id, "w", record)


def test_filters_remove_rows_and_the_manifest_counts_what_each_removed(
    repo: InspectRepository, tmp_path: Path
) -> None:
    recorded_run(
        repo,
        {
            "a": [(4, 6, "stop"), (4, 6, "length"), (4, 2, "stop"), (9, 6, "stop"), (3, 6, "stop")],
            "b": [(4, 6, "stop")],
        },
    )
    filters = Filters(("a",), exclude_truncated=True, min_completion_tokens=3, max_len=8)
    manifest = export(repo, tmp_path / "out", filters=filters).manifest
    counts = manifest["counts"]
    assert counts["a"]["removed"] == {
        TRUNCATED: 1,
        SHORT: 1,
        INVALID: 0,
        NO_LOSS: 1,
        NOT_EXACT: 0,
        EXTRA_SAMPLE: 0,
    }
    assert (counts["a"]["read"], counts["a"]["exported"], counts["a"]["cut_to_max_len"]) == (
        5,
        2,
        2,
    )
    assert counts["b"]["removed"] == {"datasets": 1} and counts["b"]["exported"] == 0
    assert manifest["options"]["max_len"] == 8 and manifest["options"]["datasets"] == ["a"]
    rows = parquet_rows(tmp_path / "out", shard_files(manifest))
    assert sorted((r["prompt_len"], r["seq_len"], sum(r["loss_mask"])) for r in rows) == [
        (3, 8, 5),
        (4, 8, 4),
    ]
    for row in rows:  # the cut keeps the front of the database's ids
        job, gen = repo.job(row["job_id"]), repo.generation(row["job_id"])
        assert job is not None and gen is not None
        assert row["input_ids"] == (job["input_ids"] + gen["output_ids"])[:8]


def test_the_split_is_the_same_on_every_export(repo: InspectRepository, tmp_path: Path) -> None:
    recorded_run(repo, {"a": [(3, 4, "stop")] * 1 + [(i % 7 + 2, 4, "stop") for i in range(199)]})
    ids = []
    for name in ("one", "two"):
        manifest = export(repo, tmp_path / name, val_fraction=0.2, seed=11).manifest
        train = parquet_rows(tmp_path / name, shard_files(manifest, "train"))
        val = parquet_rows(tmp_path / name, shard_files(manifest, "val"))
        assert shard_files(manifest, "val") == ["val/val-00000.parquet"]
        assert manifest["counts"]["a"]["splits"] == {"train": len(train), "val": len(val)}
        ids.append(({r["id"] for r in train}, {r["id"] for r in val}))
    assert ids[0] == ids[1]
    assert 20 <= len(ids[0][1]) <= 60 and len(ids[0][0]) + len(ids[0][1]) == 200
    other = export(repo, tmp_path / "other-seed", val_fraction=0.2, seed=12).manifest
    assert {r["id"] for r in parquet_rows(tmp_path / "other-seed", shard_files(other, "val"))} != (
        ids[0][1]
    )


def test_an_incremental_export_adds_only_the_new_rows_and_keeps_old_shards_as_they_were(
    settings: Settings, repo: InspectRepository, tmp_path: Path
) -> None:
    rows = sample_rows(60)
    generate(settings, repo, tmp_path / "one.jsonl", rows[:30])
    out = tmp_path / "out"
    first = export(repo, out, shard_bytes=20_000).manifest
    before = {f: (out / f).read_bytes() for f in shard_files(first)}
    first_ids = {r["id"] for r in parquet_rows(out, list(before))}
    assert len(first_ids) == 30
    with pytest.raises(ValueError, match="pass --incremental"):
        export(repo, out)
    generate(settings, repo, tmp_path / "two.jsonl", rows[30:])
    second = export(repo, out, shard_bytes=20_000, incremental=True).manifest
    new_files = [f for f in shard_files(second) if f not in before]
    assert shard_files(second)[: len(before)] == list(before) and new_files
    assert {f: (out / f).read_bytes() for f in before} == before
    new_ids = {r["id"] for r in parquet_rows(out, new_files)}
    assert new_ids.isdisjoint(first_ids) and new_ids | first_ids == set(map(str, repo.job_ids()))
    assert_rows_are_the_database(repo, parquet_rows(out, new_files))
    assert second["rows"] == 60 and second["counts"]["d"]["exported"] == 60
    assert [p["rows"] for p in second["passes"]] == [30, 30]
    third = export(repo, out, shard_bytes=20_000, incremental=True).manifest
    assert shard_files(third) == shard_files(second) and third["passes"][-1]["rows"] == 0
    with pytest.raises(ValueError, match="--max-len was None, now 64"):
        export(repo, out, filters=Filters(max_len=64), incremental=True)


def test_a_killed_export_leaves_no_partial_shard_under_a_final_name_and_a_rerun_completes_it(
    settings: Settings, repo: InspectRepository, tmp_path: Path
) -> None:
    assert generate(settings, repo, tmp_path / "d.jsonl", sample_rows(300)) == 300
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLEGEN_")}
    assert settings.database_url is not None
    env["EAGLEGEN_DATABASE_URL"] = settings.database_url
    command = [sys.executable, "-m", "eaglegen", "export", "run", str(out), "--shard-mb", "0.002"]
    with subprocess.Popen(command, env=env, stderr=subprocess.PIPE) as export_process:
        # Stop it as soon as its first shard is in place, then kill it: mid-export.
        deadline = time.monotonic() + 60
        train = out / "train"
        while not (train.is_dir() and any(p.name.startswith("train-") for p in train.iterdir())):
            assert export_process.poll() is None, "the export ended before its first shard"
            assert time.monotonic() < deadline
            time.sleep(0.001)
        export_process.send_signal(signal.SIGSTOP)
        export_process.kill()
        export_process.wait()
    assert export_process.returncode == -signal.SIGKILL
    assert not (out / MANIFEST).exists()  # it was killed before its end
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(TMP_PREFIX)) == ["train"]
    finals = list(train.iterdir())
    assert finals and all(p.name.startswith("train-") for p in finals)
    for shard in finals:  # each one complete: its footer is there and every row reads
        table = pq.read_table(shard)
        assert table.num_rows == pq.read_metadata(shard).num_rows > 0
        assert_rows_are_the_database(repo, table.to_pylist())
    # The same export again: it removes what the killed one left and writes it all.
    left = sorted(p.name for p in out.iterdir() if p.name != "train")
    left += sorted(f"train/{p.name}" for p in finals)
    again = export(repo, out, shard_bytes=2_000)
    assert sorted(again.removed) == sorted(left)
    clean = export(repo, tmp_path / "clean", shard_bytes=2_000)
    assert comparable(again.manifest) == comparable(clean.manifest)
    assert sorted(p.name for p in out.iterdir()) == ["how-to-load.txt", MANIFEST, "train"]
    assert sorted(f"train/{p.name}" for p in train.iterdir()) == shard_files(clean.manifest)


def comparable(manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest without what differs between two exports of the same rows: the times."""
    passes = [{k: v for k, v in p.items() if k != "started_at"} for p in manifest["passes"]]
    return {k: v for k, v in manifest.items() if k != "resume"} | {"passes": passes}
