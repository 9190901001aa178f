"""The CLI as a user runs it: a subprocess, real services, JSON on stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from eaglegen.assets import TOKENIZER_DIR
from eaglegen.settings import Settings
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
    assert json.loads(first.stdout) == {
        "dataset": "chat",
        "accepted": 20,
        "rejected": 1,
        "duplicates": 0,
        "rejected_by_reason": {"invalid_json": 1},
    }
    again = json.loads(eaglegen(*args, env=env).stdout)
    assert (again["accepted"], again["duplicates"]) == (0, 20)

    status = eaglegen("status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    document: dict[str, Any] = json.loads(status.stdout)
    assert document["jobs"]["queued"] == 20 and document["jobs"]["total"] == 20
    assert document["datasets"][0]["run"] == "r1"


def test_missing_file_is_a_clear_error(settings: Settings, tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    result = eaglegen(
        "enqueue",
        "--run",
        "r",
        "--dataset",
        "d",
        "--tokenizer",
        str(TOKENIZER_DIR),
        str(missing),
        env=service_env(settings),
    )
    assert result.returncode == 2
    assert str(missing) in result.stderr.replace("\n", "") and "no such file" in result.stderr


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
    assert summary["jobs"]["total"] == 300
    assert summary["jobs"]["done"] == 300
    assert summary["completion_tokens"] > 0 and summary["tokens_per_s"] > 0
    assert summary["data_dir"] == str((tmp_path / "demo").resolve())
    assert (tmp_path / "demo" / "postgres" / "PG_VERSION").is_file()  # the data stays
