"""Hostile input files through the CLI: each ends in one line naming the file, where it broke
and what was stored, never a traceback or "Aborted.", and memory stays flat."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR
from tests.e2e.test_cli import eaglegen, service_env
from tests.helpers import write_jsonl

pytestmark = pytest.mark.e2e


def rows(n: int, start: int = 0) -> list[dict[str, str]]:
    return [{"prompt": f"Question number {i}: what is {i} + {i}?"} for i in range(start, n)]


def enqueue(
    path: Path, settings: Settings, *extra: str, dataset: str = "d"
) -> subprocess.CompletedProcess[str]:
    args = ("enqueue", "--run", "r", "--dataset", dataset, "--tokenizer", str(TOKENIZER_DIR))
    return eaglegen(*args, *extra, str(path), env={**service_env(settings), "COLUMNS": "400"})


def jobs_stored(settings: Settings) -> int:
    status = json.loads(eaglegen("status", "--json", env=service_env(settings)).stdout)
    return int(status["jobs"]["total"])


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("error: ") and "Traceback" not in result.stderr
    assert "Aborted" not in result.stderr
    return lines[0]


def test_a_truncated_gzip_says_where_it_broke_and_what_is_stored(
    settings: Settings, tmp_path: Path
) -> None:
    whole = tmp_path / "whole.jsonl.gz"
    with gzip.open(whole, "wt") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows(6000))
    cut = tmp_path / "chat.jsonl.gz"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    line = one_line_error(enqueue(cut, settings))
    assert str(cut) in line and "truncated" in line and "after row " in line
    stored = jobs_stored(settings)
    assert 0 < stored < 6000
    assert f"{stored:,} new job(s) of dataset 'd'" in line
    assert "run the same enqueue again" in line
    # The whole file, under the same name: the re-run adds exactly the rest.
    cut.write_bytes(whole.read_bytes())
    assert enqueue(cut, settings).returncode == 0
    assert jobs_stored(settings) == 6000


def test_a_json_array_never_closed_says_what_is_stored(settings: Settings, tmp_path: Path) -> None:
    path = tmp_path / "chat.json"
    text = json.dumps(rows(3000), indent=1)
    path.write_text(text[: len(text) * 2 // 3])
    line = one_line_error(enqueue(path, settings))
    assert str(path) in line and "invalid JSON at line" in line
    stored = jobs_stored(settings)
    assert stored > 1024  # the rows before the break are kept, not only whole batches
    assert f"{stored:,} new job(s) of dataset 'd'" in line


def test_a_broken_file_in_a_dry_run_says_nothing_is_stored(tmp_path: Path) -> None:
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(rows(50))[:-200])
    args = ("--run", "r", "--dataset", "d", "--tokenizer", str(TOKENIZER_DIR), "--dry-run")
    result = eaglegen("enqueue", *args, str(path), env={"COLUMNS": "400"})
    assert "nothing is stored" in one_line_error(result)


def test_a_huge_line_is_rejected_unread_and_memory_stays_flat(
    settings: Settings, tmp_path: Path
) -> None:
    path = tmp_path / "chat.jsonl"
    with path.open("w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows(3))
        handle.write(json.dumps({"prompt": "x" * (50 << 20)}) + "\n")
        handle.writelines(json.dumps(row) + "\n" for row in rows(6, start=3))
    # The CLI in a process of its own that reports its own peak memory (templating in it):
    # VmHWM, the high-water mark of its own memory map. Not getrusage's ru_maxrss, which
    # Linux carries across exec from the forking parent (a pytest process grown large by
    # the tests before this one would be measured instead).
    script = (
        "import sys; from eaglegen.__main__ import main\n"
        "try:\n    main()\nexcept SystemExit as exit:\n    code = exit.code\n"
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
        "print('peak_kb', hwm.split()[1])\n"
        "sys.exit(code)\n"
    )
    args = ["enqueue", "--run", "r", "--dataset", "d", "--tokenizer", str(TOKENIZER_DIR)]
    base = {k: v for k, v in os.environ.items() if not k.startswith("EAGLEGEN_")}
    result = subprocess.run(
        [sys.executable, "-c", script, *args, "--workers", "0", "--json", str(path)],
        env={**base, **service_env(settings)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    document, _, peak = result.stdout.rpartition("peak_kb")
    report = json.loads(document)["datasets"]["d"]
    assert (report["accepted"], report["rejected_by_reason"]) == (6, {"too_long": 1})
    peak_mb = int(peak) / 1024
    assert peak_mb < 600, f"peak RSS {peak_mb:.0f} MB for a file with one 50 MB line"


def test_a_binary_file_and_an_empty_file_are_warnings_and_exit_1(
    settings: Settings, tmp_path: Path
) -> None:
    binary = tmp_path / "chat.jsonl"
    binary.write_bytes(bytes(range(256)) * 200 + b"\n\x00\xff garbage\n" * 50)
    result = enqueue(binary, settings, "--json")
    assert result.returncode == 1, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["empty_datasets"] == ["d"] and report["accepted"] == 0
    assert "none of the" in result.stderr and "invalid_json" in result.stderr
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    empty.write_text("")
    result = enqueue(empty, settings, dataset="e")
    assert result.returncode == 1
    assert f"{empty} is empty" in result.stderr.replace("\n", "")
    # A dataset whose rows are all there already is not empty: a re-run exits 0.
    good = write_jsonl(tmp_path / "good.jsonl", rows(5))
    assert enqueue(good, settings, dataset="g").returncode == 0
    assert enqueue(good, settings, dataset="g").returncode == 0


def test_a_seeded_sample_of_a_broken_file_stores_nothing(
    settings: Settings, tmp_path: Path
) -> None:
    # Any prefix of a sample of the whole file would not be that sample: nothing is stored.
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(rows(3000))[:-5000])
    result = enqueue(path, settings, "--limit", "100", "--sample-seed", "1")
    line = one_line_error(result)
    assert "invalid JSON" in line and "a seeded sample needs the whole file" in line
    assert jobs_stored(settings) == 0
