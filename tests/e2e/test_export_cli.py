"""`eaglegen export` as a user runs it: a subprocess, real Postgres, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.settings import Settings
from models.repository import Repository
from tests.e2e.test_cli import eaglegen, service_env
from tests.integration.test_export import recorded_run

pytestmark = pytest.mark.e2e


def one_line_error(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    return lines[0]


def test_export_json_then_errors_are_one_line_and_exit_2(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    recorded_run(repo, {"d": [(4, 6, "stop"), (5, 3, "length")]})
    env = service_env(settings)
    out = tmp_path / "out"
    done = eaglegen("export", "run", str(out), "--json", "--val-fraction", "0.5", env=env)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["rows"] == document["total_rows"] == 2
    assert document["counts"]["d"]["exported"] == 2
    manifest = json.loads(Path(document["manifest"]).read_text())
    assert manifest["options"]["val_fraction"] == 0.5
    assert [s["file"] for s in manifest["shards"]] == [s["file"] for s in document["new_shards"]]
    assert sum(s["rows"] for s in document["new_shards"]) == 2

    more = eaglegen("export", "run", str(out), "--incremental", "--val-fraction", "0.5", env=env)
    assert more.returncode == 0, more.stderr
    assert "exported 0 row(s) (no rows) in 0 new shard(s)" in more.stderr

    again = eaglegen("export", "run", str(out), env=env)
    assert again.returncode == 2
    assert "pass --incremental" in one_line_error(again.stderr)

    unknown = eaglegen("export", "nope", str(tmp_path / "other"), env=env)
    assert unknown.returncode == 2
    assert "run 'nope' not found" in one_line_error(unknown.stderr)
    assert not (tmp_path / "other").exists()

    no_dataset = eaglegen("export", "run", str(tmp_path / "x"), "--datasets", "d,zz", env=env)
    assert no_dataset.returncode == 2
    assert "no dataset 'zz'" in one_line_error(no_dataset.stderr)

    both = eaglegen("export", "run", str(tmp_path / "y"), "--jsonl", "--hf-dataset", env=env)
    assert both.returncode == 2
    assert "exclude each other" in one_line_error(both.stderr)

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    full = eaglegen("export", "run", str(tmp_path / "full"), env=env)
    assert full.returncode == 2
    assert "holds no manifest.json" in one_line_error(full.stderr)
