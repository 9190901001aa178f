"""What the CLI tells an operator in our words: a misspelt tokenizer, the worker's defaults."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from core.settings import Settings
from tests.e2e.test_cli import eaglegen
from tests.helpers import sample_rows, write_jsonl

pytestmark = pytest.mark.e2e


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and "Traceback" not in done.stderr
    return line.removeprefix("error: ")


@pytest.fixture
def hub_cache(tmp_path: Path) -> dict[str, str]:
    """An empty Hugging Face cache: the machine's own must not decide what is found."""
    return {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "COLUMNS": "400"}


@pytest.mark.parametrize(
    ("tokenizer", "says"),
    [
        (
            "moonshotai/Kimi-K2-Instrct",
            "tokenizer 'moonshotai/Kimi-K2-Instrct' not found: not a folder with tokenizer "
            "files, nor a model in this machine's Hugging Face cache",
        ),
        ("{empty}", "tokenizer '{empty}' not found: the folder holds no tokenizer files"),
        ("{file}", "tokenizer '{file}' not found: it is a file"),
    ],
)
def test_a_misspelt_tokenizer_is_one_line_in_our_words(
    tmp_path: Path, hub_cache: dict[str, str], tokenizer: str, says: str
) -> None:
    empty = tmp_path / "models" / "Kimi-K2"
    empty.mkdir(parents=True)
    (empty / "config.json").write_text("{}")
    names = {"empty": str(empty), "file": str(empty / "config.json")}
    data = write_jsonl(tmp_path / "d.jsonl", sample_rows(2))
    args = ("enqueue", "--run", "r", "--dataset", "d", "--dry-run", str(data))
    done = eaglegen(*args, "--tokenizer", tokenizer.format(**names), env=hub_cache)
    line = one_line_error(done)
    assert line.startswith(says.format(**names)), line
    assert "huggingface.co" not in line and "repo_type" not in line  # transformers' words


def test_doctor_says_the_same_of_a_run_files_tokenizer(
    tmp_path: Path, hub_cache: dict[str, str]
) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text(
        'run = "r"\ntokenizer = "/models/Kimi-K2-Instrct"\n'
        '[[datasets]]\nname = "d"\npath = "d.jsonl"\n'
    )
    done = eaglegen("doctor", "--server", "http://127.0.0.1:9", str(run_file), env=hub_cache)
    line = one_line_error(done)
    assert line.startswith("tokenizer '/models/Kimi-K2-Instrct' not found: "), line


def test_worker_help_shows_the_default_concurrency() -> None:
    done = eaglegen("worker", "--help", env={"COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert Settings.model_fields["worker_concurrency"].default is None  # derived, below
    assert "(default: the most its servers' in-flight limits can reach;" in done.stdout


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ("metrics", "--host", "0.0.0.0"),
            "metrics on 0.0.0.0 would be reachable from other hosts with no login: pass --public",
        ),
        (
            ("flower", "--address", "0.0.0.0", "--basic-auth", "ops:Pa,ss:word"),
            "--basic-auth must be one USER:PASSWORD; the one given holds a comma",
        ),
        (
            ("flower", "--basic-auth", " : "),
            "--basic-auth must be one USER:PASSWORD; the one given needs a user and a password",
        ),
    ],
)
def test_exposure_beyond_loopback_and_logins_flower_would_split_are_refused(
    argv: tuple[str, ...], says: str
) -> None:
    # Refused before any service is asked: no database or broker is given.
    done = eaglegen(*argv, env={"EAGLEGEN_BROKER_URL": "redis://127.0.0.1:1/0"})
    line = one_line_error(done)
    assert line.startswith(says), line
    assert "Pa,ss" not in done.stderr  # the login is never echoed
