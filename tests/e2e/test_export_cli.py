"""`eaglegen export` as a user runs it: a subprocess, real Postgres, one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psycopg
import pytest

from core.settings import Settings
from core.urls import libpq_url, redact
from eaglegen.assets import TOKENIZER_DIR
from models.repository import Repository
from tests.e2e.test_cli import eaglegen, service_env
from tests.helpers import enqueue_file, write_jsonl
from tests.integration.test_export import export as export_pass
from tests.integration.test_export import recorded_run
from tests.integration.test_export_conversations import record_rows
from tests.integration.test_export_turns import ROWS as TURN_ROWS
from tests.integration.test_export_turns import TOOL_ROW, Answering
from tests.outage import PATIENCE_S, holds_lock, lock_waiter, outage, wait_for

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
    [shard] = [p for p in (out / "train").iterdir() if p.name.startswith("train-")]
    rows = [json.loads(line) for line in shard.read_text().splitlines()]
    assert len(rows) == 5 and all("conversations" in r for r in rows)

    strict = eaglegen(
        "export", "run", str(tmp_path / "strict"), "--for", "modelopt",
        "--require-exact", "--include-truncated", "--json", env=env,
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


def export_process(out: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("EAGLEGEN_")}
    return subprocess.Popen(
        [sys.executable, "-m", "eaglegen", "export", "run", str(out), *args],
        env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_an_export_that_loses_postgres_before_writing_says_so_in_one_line(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    recorded_run(repo, {"d": [(4, 6, "stop")] * 3})
    url = settings.services().database_url
    out = tmp_path / "out"
    # The scan waits for a lock the test holds; Postgres goes away while it waits (and the
    # outage ends the holder's session too).
    holder = psycopg.connect(libpq_url(url))
    try:
        holder.execute("LOCK TABLE generations IN ACCESS EXCLUSIVE MODE")
        export = export_process(out, service_env(settings))
        wait_for(lambda: lock_waiter(url, "generations"), "the export's scan to wait")
        with outage(url):
            _, stderr = export.communicate(timeout=PATIENCE_S)
    finally:
        holder.close()
    assert export.returncode == 2, stderr
    line = one_line_error(stderr)
    assert f"lost Postgres at {redact(url)} during the export: " in line
    assert line.endswith(f"Nothing was written to {out}: run the export again")
    assert not out.exists() or not any(out.iterdir())  # no shard, no temporary file


def test_an_export_that_loses_postgres_names_the_shards_it_wrote_in_one_line(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    # Prompts of 2,000 ids: the rows fill more shards of the smallest size than the error
    # names one by one.
    recorded_run(repo, {"d": [(2000, 6, "stop")] * 12})
    url = settings.services().database_url
    env = service_env(settings)
    out = tmp_path / "out"
    args = ("--datasets", "d", "--shard-mb", "0.000001")  # --datasets: a read after the scan
    # Step by step, each step waiting for the one before (no timing): the export's scan
    # starts and holds its locks while the export is stopped; a lock on datasets is queued
    # behind them; the export goes on, writes every shard, and waits behind that lock for
    # its last read, before the manifest. Then Postgres goes away.
    holder = psycopg.connect(libpq_url(url))
    locker = psycopg.connect(libpq_url(url))
    queued: list[BaseException] = []

    def lock_datasets() -> None:
        try:
            locker.execute("LOCK TABLE datasets IN ACCESS EXCLUSIVE MODE")
        except psycopg.Error as exc:  # ended by the outage
            queued.append(exc)

    try:
        holder.execute("LOCK TABLE generations IN ACCESS EXCLUSIVE MODE")
        export = export_process(out, env, *args)
        scan = wait_for(lambda: lock_waiter(url, "generations"), "the export's scan to wait")
        os.kill(export.pid, signal.SIGSTOP)
        holder.commit()
        wait_for(lambda: holds_lock(url, scan, "datasets"), "the scan to hold its locks")
        thread = threading.Thread(target=lock_datasets)
        thread.start()
        wait_for(lambda: lock_waiter(url, "datasets"), "the lock on datasets to queue")
        os.kill(export.pid, signal.SIGCONT)
        wait_for(
            lambda: (
                lock_waiter(url, "datasets") == scan and not holds_lock(url, scan, "generations")
            ),
            "the export's last read to wait",
        )
        # (The export's private folder aside: the shard it writes is in there.)
        written = sorted(f"train/{p.name}" for p in (out / "train").iterdir())
        with outage(url):
            _, stderr = export.communicate(timeout=PATIENCE_S)
            thread.join(timeout=PATIENCE_S)
    finally:
        holder.close()
        locker.close()
    assert export.returncode == 2, stderr
    assert len(written) > 5
    assert written == [f"train/train-{i:05d}.parquet" for i in range(len(written))]
    line = one_line_error(stderr)
    assert f"lost Postgres at {redact(url)} during the export: " in line
    assert (
        f"{len(written)} complete shard(s) were written to {out} ({', '.join(written[:5])} "
        f"and {len(written) - 5} more), but no manifest.json: they are no export yet; run the "
        "export again (it removes them first)"
    ) in line
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".tmp-")) == ["train"]
    assert sorted(f"train/{p.name}" for p in (out / "train").iterdir()) == written
    again = eaglegen("export", "run", str(out), *args, "--json", env=env)
    assert again.returncode == 0, again.stderr
    document = json.loads(again.stdout)
    assert document["rows"] == 12 and document["removed"] == written


def test_an_export_says_in_one_line_what_an_unfinished_one_left_and_it_removed(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    recorded_run(repo, {"d": [(4, 6, "stop")]})
    out = tmp_path / "out"
    export_pass(repo, out)
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    # A link at a temporary name of an earlier version, and a killed pass's private folder.
    (out / ".tmp-1234-manifest.json").symlink_to(victim)
    (out / ".tmp-export-0123456789abcdef").mkdir()
    more = eaglegen("export", "run", str(out), "--incremental", env=service_env(settings))
    assert more.returncode == 0, more.stderr
    removed, exported = more.stderr.strip().splitlines()
    assert more.stdout.startswith("Load with datasets:")
    assert removed == (
        f"removed 2 file(s) an unfinished export had left in {out}: .tmp-1234-manifest.json, "
        ".tmp-export-0123456789abcdef"
    )
    assert exported.startswith("exported 0 row(s)")
    assert victim.read_text() == "mine" and not (out / "manifest.json").is_symlink()


def test_each_layout_prints_how_to_load_it_and_writes_it_beside_the_manifest(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    recorded_run(repo, {"d": [(4, 6, "stop")] * 8})
    env = service_env(settings)
    for consumer, loads in [
        ("specforge", f"  prompts_path: {tmp_path / 'sf' / 'train' / 'train.jsonl'}"),
        ("speculators", f"  speculators train --data-path {tmp_path / 'sf' / 'train'}"),
        ("hf", "load_dataset('parquet', data_dir="),
    ]:
        out = tmp_path / consumer
        loads = loads.replace(str(tmp_path / "sf"), str(out))
        done = eaglegen("export", "run", str(out), "--for", consumer, env=env)
        assert done.returncode == 0, done.stderr
        assert loads in done.stdout
        assert (out / "how-to-load.txt").read_text() == done.stdout
        assert done.stderr.startswith("exported 8 row(s) (train 8) in 1 new shard(s)")
    refused = eaglegen(
        "export", "run", str(tmp_path / "x"), "--for", "speculators", "--format",
        "conversations", env=env,
    )  # fmt: skip
    assert refused.returncode == 2
    assert "vLLM /render server" in one_line_error(refused.stderr)
    assert not (tmp_path / "x").exists()


def test_export_merge_turns_merges_ended_conversations_and_adds_the_others_later(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    rows = write_jsonl(tmp_path / "chats.jsonl", [*TURN_ROWS, TOOL_ROW])
    enqueue_file(settings, rows, tokenizer=TOKENIZER_DIR, max_new_tokens=400, turns="all")
    answering = Answering(repo, TOKENIZER_DIR, "kimi_k2")
    answering.step()  # every conversation's first turn done, its second one queued
    env = service_env(settings)
    out = tmp_path / "out"
    merge = ("--merge-turns", "--for", "specforge")
    first = eaglegen("export", "run", str(out), *merge, env=env)
    assert first.returncode == 0, first.stderr
    assert "exported 1 row(s) (train 1)" in first.stderr  # the plain job alone
    assert (
        "conversations d: 4 done turn(s) of conversations still under way, left for a later "
        "--incremental export"
    ) in first.stderr

    answering.run()
    second = eaglegen("export", "run", str(out), *merge, "--incremental", "--json", env=env)
    assert second.returncode == 0, second.stderr
    document = json.loads(second.stdout)
    assert document["rows"] == 4 and document["total_rows"] == 5
    conversations = document["counts"]["d"]["conversations"]
    assert (conversations["read"], conversations["merged"], conversations["merged_turns"]) == (
        4,
        4,
        10,
    )
    lines = (out / "train" / "train.jsonl").read_text().splitlines()
    ids = [json.loads(line)["id"] for line in lines]
    assert len(ids) == 5 and sum("_turn0-" in i for i in ids) == 4

    again = eaglegen("export", "run", str(out), "--for", "specforge", "--incremental", env=env)
    assert again.returncode == 2
    assert "--merge-turns was True, now False" in one_line_error(again.stderr)
    conversations_too = eaglegen(
        "export", "run", str(tmp_path / "x"), "--merge-turns", "--format", "conversations",
        env=env,
    )  # fmt: skip
    assert conversations_too.returncode == 2
    assert "--merge-turns merges token rows" in one_line_error(conversations_too.stderr)
    assert not (tmp_path / "x").exists()
