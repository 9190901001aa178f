"""A tokenizer that loads as remote code and has no Rust backend, as Kimi-K2's does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR
from models.repository import Repository
from producer import enqueue
from producer.commands import run_enqueue
from producer.plan import DatasetPlan, RunPlan
from producer.template import Templater
from tests.helpers import reference_ids, sample_rows, write_jsonl

MODULE = Path(__file__).parent.parent / "data" / "remote_tokenizer" / "tokenization_tiny.py"


@pytest.fixture
def remote_tokenizer(tmp_path: Path) -> Path:
    """The bundled tokenizer's files, with a tokenization_tiny.py that AutoTokenizer loads."""
    folder = tmp_path / "remote-tokenizer"
    shutil.copytree(TOKENIZER_DIR, folder)
    shutil.copy(MODULE, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "TinySlowTokenizer"
    config["auto_map"] = {"AutoTokenizer": ["tokenization_tiny.TinySlowTokenizer", None]}
    config_path.write_text(json.dumps(config))
    return folder


def plan(tokenizer: Path, data: Path, run: str, *, trust: bool) -> RunPlan:
    return RunPlan(
        run=run,
        tokenizer=tokenizer,
        trust_remote_code=trust,
        datasets=[DatasetPlan("d", data, sampling={"max_new_tokens": 64}, turns="last")],
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_remote_code_tokenizer_stores_its_own_apply_chat_template_ids(
    settings: Settings,
    repo: Repository,
    remote_tokenizer: Path,
    tmp_path: Path,
    workers: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(enqueue, "BATCH_ROWS", 32)  # batches spread over the workers
    templater = Templater(remote_tokenizer, trust_remote_code=True)
    assert not templater.is_fast  # the pure-Python path, not the Rust backend
    rows = sample_rows(300)  # tools, tool-call history, multi-turn
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    report = run_enqueue(
        settings,
        settings.services(),
        plan(remote_tokenizer, data, f"w{workers}", trust=True),
        workers=workers,
    )
    assert report.datasets[0].accepted == 300
    tokenizer = templater.tokenizer
    for job_id in repo.job_ids():
        job = repo.job(job_id)
        assert job is not None
        assert job["input_ids"] == reference_ids(tokenizer, rows[job["row_index"]])


def test_remote_code_runs_only_when_trusted(
    settings: Settings, remote_tokenizer: Path, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", sample_rows(2))
    with pytest.raises(ValueError, match="if you trust it, pass --trust-remote-code"):
        run_enqueue(
            settings,
            settings.services(),
            plan(remote_tokenizer, data, "r", trust=False),
            quiet=True,
        )


def test_the_remote_code_is_part_of_the_tokenizer_hash(remote_tokenizer: Path) -> None:
    before = Templater(remote_tokenizer, trust_remote_code=True).tokenizer_sha256()
    code = remote_tokenizer / "tokenization_tiny.py"
    code.write_text(code.read_text() + "\n# a changed tokenizer implementation\n")
    assert Templater(remote_tokenizer, trust_remote_code=True).tokenizer_sha256() != before


def test_every_python_file_of_the_folder_is_part_of_the_tokenizer_hash(
    remote_tokenizer: Path,
) -> None:
    # A helper module the tokenization code imports changes tokenization just as well.
    helper = remote_tokenizer / "tiny_helpers.py"
    helper.write_text("SPLIT = ' '\n")
    before = Templater(remote_tokenizer, trust_remote_code=True).tokenizer_sha256()
    helper.write_text("SPLIT = '-'\n")
    assert Templater(remote_tokenizer, trust_remote_code=True).tokenizer_sha256() != before
