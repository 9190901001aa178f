"""Run and dataset names are checked once where they come in, and every user string reaches
the terminal as text: never as rich markup, never as raw control characters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.settings import Settings
from models.db import make_engine
from models.records import DatasetSpec, NewJob, RunSpec
from models.repository import Repository
from producer.plan import plan_from_flags
from tests.e2e.test_cli import eaglegen, service_env
from tests.e2e.test_hostile_files import enqueue, one_line_error, rows
from tests.helpers import write_jsonl

pytestmark = pytest.mark.e2e
ESC = "\x1b[31m"


@pytest.mark.parametrize(
    ("flag", "value", "reason"),
    [
        ("--dataset", "d" * 201, "a dataset name must be 1 to 200 characters, not 201"),
        ("--run", "r" * 201, "a run name must be 1 to 200 characters, not 201"),
        ("--dataset", f"red{ESC}", "holds the control character '\\x1b'"),
        ("--dataset", "two\nlines", "holds the control character '\\n'"),
    ],
)
def test_a_bad_name_given_as_a_flag_is_one_clear_error_and_stores_nothing(
    settings: Settings, tmp_path: Path, flag: str, value: str, reason: str
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", rows(3))
    extra = ("--run", value) if flag == "--run" else ()
    result = enqueue(data, settings, *extra, dataset=value if flag == "--dataset" else "d")
    line = one_line_error(result)
    assert reason in line
    assert ESC not in result.stderr
    assert (
        json.loads(eaglegen("status", "--json", env=service_env(settings)).stdout)["jobs"]["total"]
        == 0
    )


def test_a_nul_in_a_name_is_refused_before_anything_is_stored(tmp_path: Path) -> None:
    # A process's argv cannot carry NUL; a run file or a caller of the planner can.
    with pytest.raises(ValueError, match="holds the control character '\\\\x00'"):
        plan_from_flags(
            tmp_path / "d.jsonl", run="r", dataset="a\x00b", tokenizer=tmp_path, sampling={}
        )


def test_a_name_that_is_rich_markup_is_printed_as_it_is(settings: Settings, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", rows(3))
    result = enqueue(data, settings, dataset="[/]")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "[/]" in result.stderr and "MarkupError" not in result.stderr
    env = service_env(settings)
    budget = eaglegen("budget", "set", "[/]", "1M", env=env)
    assert budget.returncode == 0, budget.stderr
    assert "[/]: budget 1.0M" in budget.stderr
    for command in (("status",), ("budget", "show")):
        shown = eaglegen(*command, env=env)
        assert shown.returncode == 0 and "[/]" in shown.stdout, shown.stderr


def test_control_characters_in_stored_names_are_shown_escaped(settings: Settings) -> None:
    # Names stored before they were checked (or written by another tool).
    assert settings.database_url is not None
    engine = make_engine(settings.database_url)
    repo = Repository(engine)
    run_id = repo.ensure_run(RunSpec(f"run{ESC}", "/tok", "a" * 64, "b" * 64, "tiny"))
    dataset = repo.ensure_dataset(
        run_id, DatasetSpec(f"data{ESC}x", "d.jsonl", {"max_new_tokens": 8})
    )
    repo.insert_jobs(dataset, [NewJob(0, [1, 2, 3], None)])
    engine.dispose()
    env = service_env(settings)
    for command in (("status",), ("budget", "show")):
        shown = eaglegen(*command, env={**env, "COLUMNS": "300"})
        assert shown.returncode == 0, shown.stderr
        assert ESC not in shown.stdout
        assert "data\\x1b[31mx" in shown.stdout
