"""`eaglegen export` as a user runs it: a subprocess, real Postgres, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR
from models.repository import Repository
from tests.e2e.test_cli import eaglegen, service_env
from tests.integration.test_export import recorded_run
from tests.integration.test_export_conversations import record_rows

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


def test_export_conversations_reports_the_round_trip_per_dataset(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    record_rows(repo, TOKENIZER_DIR)
    env = service_env(settings)
    out = tmp_path / "conv"
    done = eaglegen("export", "run", str(out), "--format", "conversations", env=env)
    assert done.returncode == 0, done.stderr
    # Truncated rows are left out of conversations by default: 5 of the 6.
    assert "exported 5 row(s) (train 5)" in done.stderr
    assert "round trip d: 3/5 exact" in done.stderr
    assert "differs in prompt 0, output 2" in done.stderr
    [shard] = [p for p in out.iterdir() if p.name.startswith("train-")]
    rows = [json.loads(line) for line in shard.read_text().splitlines()]
    assert len(rows) == 5 and all("conversations" in r for r in rows)

    strict = eaglegen(
        "export", "run", str(tmp_path / "strict"), "--format", "conversations",
        "--style", "modelopt", "--require-exact", "--include-truncated", "--json", env=env,
    )  # fmt: skip
    assert strict.returncode == 0, strict.stderr
    document = json.loads(strict.stdout)
    assert document["rows"] == 3 and document["counts"]["d"]["removed"]["require_exact"] == 3
    assert document["roundtrip"]["d"]["checked"] == 6

    tokens_exact = eaglegen("export", "run", str(tmp_path / "t"), "--require-exact", env=env)
    assert tokens_exact.returncode == 2
    assert "--format conversations" in one_line_error(tokens_exact.stderr)

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    unwritable = eaglegen(
        "export", "run", str(blocker / "out"), "--format", "conversations", env=env
    )
    assert unwritable.returncode == 2
    assert "cannot write there" in one_line_error(unwritable.stderr)


def test_a_missing_tokenizer_is_one_line(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    recorded_run(repo, {"d": [(4, 6, "stop")]})  # its tokenizer path is "/tok"
    env = service_env(settings)
    gone = eaglegen("export", "run", str(tmp_path / "out"), "--format", "conversations", env=env)
    assert gone.returncode == 2
    assert "its tokenizer /tok is not a folder" in one_line_error(gone.stderr)
    only_valid = eaglegen("export", "run", str(tmp_path / "out"), "--only-valid", env=env)
    assert only_valid.returncode == 2 and "/tok" in one_line_error(only_valid.stderr)
    assert eaglegen("export", "run", str(tmp_path / "out"), env=env).returncode == 0
