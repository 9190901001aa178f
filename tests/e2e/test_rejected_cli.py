"""`eaglegen rejected` on rows a real enqueue refused: the table, the filters, the JSON."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from core.settings import Settings
from tests.e2e.test_cli import eaglegen, service_env
from tests.e2e.test_hostile_files import enqueue, rows
from tests.helpers import write_jsonl

pytestmark = pytest.mark.e2e

ESC = "\x1b[31m"
BAD: list[Any] = [
    f'{{"prompt": "cut off {ESC}red',  # invalid_json, a raw escape in the line
    "[1, 2, 3]",  # not_an_object
    {"question": "no prompt field"},  # no_prompt_field
    {"messages": [{"role": "wizard", "content": "abracadabra"}]},  # unknown_role
    {"messages": [{"role": "oracle", "content": "foresee"}]},  # unknown_role
]


def rejected(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return eaglegen("rejected", *args, env={**service_env(settings), "COLUMNS": "400"})


@pytest.fixture
def refused(settings: Settings, tmp_path: Path) -> Settings:
    """Run "r": dataset "d" with the BAD rows among good ones, dataset "e" with one more."""
    data = write_jsonl(tmp_path / "d.jsonl", [*rows(3), *BAD])
    assert enqueue(data, settings).returncode == 0
    other = write_jsonl(tmp_path / "e.jsonl", [*rows(2), "not json"])
    assert enqueue(other, settings, dataset="e").returncode == 0
    return settings


def test_the_table_lists_every_rejected_row_then_counts_them_by_reason(
    refused: Settings,
) -> None:
    done = rejected(refused, "r")
    assert done.returncode == 0, done.stderr
    table = done.stdout
    for needle in ("invalid_json", "not_an_object", "no_prompt_field", "unknown_role"):
        assert needle in table
    # The rows' own text, with the escape written out instead of sent to the terminal.
    assert "cut off \\x1b[31mred" in table and "\x1b" not in table
    last = table.strip().splitlines()[-1]
    assert last == (
        "6 rejected row(s): invalid_json 2, unknown_role 2, no_prompt_field 1, not_an_object 1"
    )


def test_filters_and_limit_narrow_the_list_and_json_is_one_document(refused: Settings) -> None:
    done = rejected(refused, "r", "--dataset", "d", "--reason", "unknown_role", "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["total"] == 2 and document["by_reason"] == {"unknown_role": 2}
    assert [(r["dataset"], r["row_index"]) for r in document["rows"]] == [("d", 6), ("d", 7)]
    assert "'wizard'" in document["rows"][0]["excerpt"]
    cut = rejected(refused, "r", "--reason", "invalid_json", "--json")
    assert ESC in json.loads(cut.stdout)["rows"][0]["excerpt"]  # JSON keeps the text as it is
    limited = json.loads(rejected(refused, "r", "--limit", "2", "--json").stdout)
    assert len(limited["rows"]) == 2 and limited["total"] == 6
    assert [r["row_index"] for r in limited["rows"]] == [3, 4]  # dataset d, in row order
    text = rejected(refused, "r", "--limit", "2").stdout
    assert "(the first 2 listed; --limit 0 lists all)" in text


def test_unknown_names_are_one_line_and_a_clean_dataset_says_so(refused: Settings) -> None:
    for args, says in (
        (("nope",), "run 'nope' not found"),
        (("r", "--dataset", "x"), "run 'r' has no dataset 'x' (it has 'd', 'e')"),
    ):
        done = rejected(refused, *args)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        [line] = done.stderr.strip().splitlines()
        assert line.startswith("error: ") and says in line, line
    clean = rejected(refused, "r", "--reason", "too_long")
    assert clean.returncode == 0
    assert clean.stdout.strip() == "no rejected rows in run r with reason too_long"
