"""`eaglegen export --for modelopt` loaded by Model-Optimizer 0.47.0's own code: its EAGLE-3
example's ``ShardedDataset`` and ``LanguageDataCollator`` (loaders/modelopt_load.py). Its
collator templates the conversations again with the run's tokenizer and drops their tools:
what differs from Postgres is asserted exactly."""

from __future__ import annotations

from pathlib import Path

from core.settings import Settings
from tests.helpers import InspectRepository
from tests.trainers.runs import export, first_difference, generate, in_venv, jsonl, stored

TRAIN_LEN = 4096  # longer than every row: the collator cuts nothing


def test_conversations_load_in_sharded_dataset_and_the_collator_differ_only_where_stated(
    settings: Settings, repo: InspectRepository, tmp_path: Path, trainers_python: Path
) -> None:
    """Rows without tools: the collator's ids are the database's up to where eaglegen's own
    round trip said they part (``metadata.roundtrip_position``: a re-tokenized output).
    Rows with tools: the collator passes no ``tools`` to the template, so the tool
    declaration the prompt opened with is gone (these rows have no system message: the ids
    part at the first message's role, index 1). Its loss: every target but the first id,
    the prompt's included (no ``answer_only_loss``); ``answer_only_loss`` is refused, the
    run's template having no ``{% generation %}`` tags."""
    folders = generate(settings, repo, tmp_path)
    for family, tokenizer in folders.items():
        database = stored(repo, family)
        out = tmp_path / "out" / family
        printed = export(settings, family, out, "--for", "modelopt")
        file = out / "train" / "train.jsonl"
        assert str(file.resolve()) in printed
        exported = jsonl(file)
        assert {"conversation_id", "messages"} <= set(exported[0])
        as_file = in_venv(
            trainers_python,
            "modelopt_load.py",
            str(file),
            str(tokenizer),
            "--train-len",
            str(TRAIN_LEN),
            str(tmp_path / f"{family}-file.json"),
        )
        # The example's data_path may name the split's folder too (read as data_dir).
        as_folder = in_venv(
            trainers_python,
            "modelopt_load.py",
            str(out / "train"),
            str(tokenizer),
            "--train-len",
            str(TRAIN_LEN),
            str(tmp_path / f"{family}-folder.json"),
        )
        assert as_folder == as_file
        rows = as_file["rows"]
        assert len(rows) == len(exported) > 0
        with_tools = 0
        for row in rows:
            expected = database[int(row["conversation_id"])]
            metadata = row["metadata"]
            assert row["has_tools"] == expected.has_tools
            if expected.has_tools:
                assert not expected.has_system
                parts_at = 1
                with_tools += 1
            else:
                parts_at = None if metadata["roundtrip_exact"] else metadata["roundtrip_position"]
            assert first_difference(row["input_ids"], expected.input_ids) == parts_at, row
            assert row["trained"] == [0] + [1] * (len(row["input_ids"]) - 1)
        assert with_tools > 0, "no row with tools: the tools check proves nothing"

        refused = in_venv(
            trainers_python,
            "modelopt_load.py",
            str(file),
            str(tokenizer),
            "--train-len",
            str(TRAIN_LEN),
            "--answer-only-loss",
            str(tmp_path / f"{family}-answer-only.json"),
        )
        assert "{% generation %}" in refused["error"]
        assert not list(out.glob("*.jinja"))  # no tagged template: the tokens export is exact
