"""`eaglegen export --for specforge` loaded by SpecForge 0.2.0's own code: the ``data:``
section the export wrote, validated by SpecForge's config schema, and its path read by
``prepare_prompt_tasks`` as ``specforge train`` prepares its prompts
(loaders/specforge_load.py). Tokens: ids and masks equal to Postgres, row for row.
Conversations: SpecForge templates them again; what differs is asserted exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from transformers import AutoTokenizer

from core.settings import Settings
from tests.helpers import InspectRepository
from tests.trainers.runs import (
    export,
    first_difference,
    generate,
    in_venv,
    jsonl,
    stored,
)

# A prompt longer than SpecForge's default data.max_length (2048): the config lines the
# export writes must keep every id of every row.
LONG_ROW = {
    "messages": [
        {
            "role": "user",
            "content": "Summarise: " + "the quick brown fox jumps over the lazy dog. " * 300,
        }
    ]
}
# What each family's generation prompt opens the reasoning with, which SpecForge's thinking
# templates train with the answer: Kimi-K2's prompt ends inside the reasoning block; the
# Qwen3 test template (Hermes, hybrid) opens none, its model writes <think> itself.
OPENED = {"kimi_k2": "<think>", "qwen3": ""}
# SpecForge's thinking templates add this system message to a chat that has none (Kimi-K2's
# template writes the same default itself; the Qwen3 one writes none).
SPECFORGE_SYSTEM = "You are a helpful assistant."


def specforge_data(out: Path) -> dict[str, Any]:
    """The ``data:`` section the export wrote for SpecForge: the lines of how-to-load.txt
    from ``data:`` to the first blank line."""
    text = (out / "how-to-load.txt").read_text().splitlines()
    start = text.index("data:")
    end = next((i for i in range(start, len(text)) if not text[i].strip()), len(text))
    section = yaml.safe_load("\n".join(text[start:end]))["data"]
    assert isinstance(section, dict), section
    return section


def load(
    python: Path, section: dict[str, Any], tokenizer: Path, result: Path, path: Path | None = None
) -> dict[str, Any]:
    extra = ["--path", str(path)] if path is not None else []
    return in_venv(
        python, "specforge_load.py", *extra, json.dumps(section), str(tokenizer), str(result)
    )


def test_tokens_split_files_load_in_prepare_prompt_tasks_equal_to_postgres(
    settings: Settings, repo: InspectRepository, tmp_path: Path, trainers_python: Path
) -> None:
    folders = generate(settings, repo, tmp_path, extra=[LONG_ROW])
    for family, tokenizer in folders.items():
        database = stored(repo, family)
        assert max(len(s.input_ids) for s in database.values()) > 2048, "no long row"
        out = tmp_path / "out" / family
        printed = export(
            settings,
            family,
            out,
            "--for",
            "specforge",
            "--val-fraction",
            "0.25",
            "--include-truncated",
        )
        train_file, val_file = out / "train" / "train.jsonl", out / "val" / "val.jsonl"
        section = specforge_data(out)
        assert Path(section["prompts_path"]) == train_file.resolve()
        assert str(train_file.resolve()) in printed
        train = load(trainers_python, section, tokenizer, tmp_path / f"{family}-train.json")
        # SpecForge 0.2.0 has no online evaluation (its schema refuses data.eval_data_path
        # and knows no other eval path but offline hidden states): the val file is read by
        # the same function, given by hand.
        val = load(trainers_python, section, tokenizer, tmp_path / f"{family}-val.json", val_file)
        seen: list[int] = []
        for part, file in ((train, train_file), (val, val_file)):
            assert part["path"] == str(file.resolve()) or Path(part["path"]) == file
            # Every row kept (none cut to no loss, none cut at all: see the long row).
            assert len(part["ids"]) == len(jsonl(file)) > 0
            assert len(part["rows"]) == len(part["ids"]), (
                f"{family}: SpecForge kept {len(part['rows'])} of {len(part['ids'])} rows: it "
                f"cuts rows at data.max_length ({part['max_length']}) and drops those left "
                "without loss; the config lines must set max_length to the longest row"
            )
            for row_id, row in zip(part["ids"], part["rows"], strict=True):
                expected = database[int(row_id)]
                assert len(row["input_ids"]) == len(expected.input_ids), (
                    f"{family} row {row_id}: SpecForge cut it at data.max_length "
                    f"{part['max_length']}: the config lines must keep every id"
                )
                assert row["input_ids"] == expected.input_ids, (family, row_id)
                assert row["loss_mask"] == expected.loss_mask, (family, row_id)
                seen.append(int(row_id))
        assert sorted(seen) == sorted(database), family  # the splits: disjoint, complete


def test_conversations_load_in_build_eagle3_dataset_and_differ_only_where_stated(
    settings: Settings, repo: InspectRepository, tmp_path: Path, trainers_python: Path
) -> None:
    """SpecForge templates the conversations with its own template and tokenizes the text:
    its ids are the database's up to where eaglegen's own round trip said they part
    (``metadata.roundtrip_position``: a re-tokenized output), or from the first message
    where SpecForge adds a system message the run's template does not; its mask is
    eaglegen's but for the ids the prompt opened the reasoning with (``<think>``), which it
    trains. Without ``train_only_last_turn`` it also trains the earlier assistant turns."""
    folders = generate(settings, repo, tmp_path)
    assert set(folders) == set(OPENED)
    for family, tokenizer in folders.items():
        database = stored(repo, family)
        out = tmp_path / "out" / family
        export(settings, family, out, "--for", "specforge", "--format", "conversations")
        exported = {str(row["id"]): row for row in jsonl(out / "train" / "train.jsonl")}
        section = specforge_data(out)
        assert section.get("train_only_last_turn") is True, section
        result = load(trainers_python, section, tokenizer, tmp_path / f"{family}-conv.json")
        assert len(result["ids"]) == len(exported) > 0
        assert len(result["rows"]) == len(exported), (
            f"{family}: SpecForge kept {len(result['rows'])} of {len(exported)} rows with "
            f"chat_template {result['chat_template']!r}: the config lines must name SpecForge's "
            "template of the family (with another one no assistant turn is found: no loss)"
        )
        tok = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
        exact = 0
        for row_id, row in zip(result["ids"], result["rows"], strict=True):
            expected = database[int(row_id)]
            metadata = exported[str(row_id)]["metadata"]
            parts_at = metadata["roundtrip_position"] if not metadata["roundtrip_exact"] else None
            if not expected.has_system:
                system = {"role": "system", "content": SPECFORGE_SYSTEM}
                with_system = tok.apply_chat_template(
                    [system, *expected.messages],
                    tools=expected.tools,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
                added = first_difference(list(with_system), expected.prompt_ids)
                if added is not None:  # the run's template writes no such default itself
                    parts_at = added
            assert first_difference(row["input_ids"], expected.input_ids) == parts_at, row_id
            shared = len(expected.input_ids) if parts_at is None else parts_at
            exact += parts_at is None
            # Over the ids both have: eaglegen's mask, and 1 over the opened reasoning.
            differ = [i for i in range(shared) if row["loss_mask"][i] != expected.loss_mask[i]]
            prompt = len(expected.prompt_ids)
            if shared >= prompt and OPENED[family]:
                assert differ and differ == list(range(differ[0], prompt)), (row_id, differ)
                assert tok.decode(expected.prompt_ids[differ[0] :]) == OPENED[family]
                assert all(row["loss_mask"][i] == 1 for i in differ)
            else:
                assert differ == [], (row_id, differ)
        if family == "kimi_k2":
            assert exact > 0, "no row re-tokenizes exactly: the mask check proves little"
            every_turn = dict(section, train_only_last_turn=False)
            earlier = load(trainers_python, every_turn, tokenizer, tmp_path / "kimi-turns.json")
            assert_earlier_turns_trained(tok, database, result, earlier)


def assert_earlier_turns_trained(
    tok: Any, database: dict[int, Any], last_only: dict[str, Any], every_turn: dict[str, Any]
) -> None:
    """Without train_only_last_turn, SpecForge's mask is 1 over every assistant turn of the
    prompt too: from after its header (``<|im_assistant|>assistant<|im_middle|>``) through
    its ``<|im_end|>``. Checked on the rows whose prompt holds an earlier assistant turn."""
    header = tok.convert_tokens_to_ids(["<|im_assistant|>", "assistant", "<|im_middle|>"])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    by_id = dict(zip(every_turn["ids"], every_turn["rows"], strict=True))
    turns = 0
    for row_id, row in zip(last_only["ids"], last_only["rows"], strict=True):
        prompt = database[int(row_id)].prompt_ids
        spans = []
        for start in range(len(prompt) - len(header)):
            if prompt[start : start + len(header)] == header:
                first = start + len(header)
                if end in prompt[first:]:
                    spans.append(range(first, prompt.index(end, first) + 1))
        other = by_id[row_id]
        assert other["input_ids"] == row["input_ids"]
        expected = list(row["loss_mask"])
        for span in spans:
            for i in span:
                expected[i] = 1
        assert other["loss_mask"] == expected, row_id
        turns += len(spans)
    assert turns > 0, "no row with an earlier assistant turn"
