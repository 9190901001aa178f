"""`eaglegen export --format conversations` against real Postgres: rows recorded through the
repository from text the bundled tokenizer encoded (so that a round trip can reproduce them),
and rows a real worker generated with the simulator."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR
from exporter.conversations import MODELOPT, SPECFORGE
from exporter.export import ExportRequest, ExportResult, prepare, run_export
from exporter.layouts import CONVERSATIONS, JSONL, PARQUET, TOKENS
from exporter.manifest import MANIFEST, Options
from exporter.rows import INVALID, NOT_EXACT, TRUNCATED, Filters
from models.records import DatasetSpec, GenerationRecord, NewJob, RunSpec
from models.repository import Repository
from tests.helpers import InspectRepository, family_tokenizer, sample_rows
from tests.integration.test_export import generate, parquet_rows, shard_files

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>'
)
# (user text, tools, output text, finish): each output as the model would write it.
ROWS: list[tuple[str, list[dict[str, Any]] | None, str, str]] = [
    ("Name a planet.", None, "Any will do.</think>Saturn.<|im_end|>", "stop"),
    ("Weather in Oslo?", TOOLS, f"Look it up.</think>Checking.{CALL}<|im_end|>", "stop"),
    ("Weather again?", TOOLS, f"Again.</think>{CALL}<|im_end|>", "stop"),
    ("Count to three.", None, "One, two", "length"),
    ("Never done?", None, "I keep thinking<|im_end|>", "stop"),  # no think-end
    ("Bad call?", TOOLS, "Hm.</think><|tool_calls_section_begin|><|im_end|>", "stop"),
]
# What the test expects each row's assistant turn to decode to (tools: the arguments).
TURNS: list[dict[str, Any]] = [
    {"reasoning_content": "Any will do.", "content": "Saturn.", "calls": 0},
    {"reasoning_content": "Look it up.", "content": "Checking.", "calls": 1},
    {"reasoning_content": "Again.", "content": "", "calls": 1},
    {"reasoning_content": "One, two", "content": "", "calls": 0},
    {"reasoning_content": "I keep thinking", "content": "", "calls": 0},
    {"reasoning_content": "Hm.", "content": "", "calls": 0},
]
VALID = {0, 1, 2}  # the others: truncated, think-end missing, an unclosed section


def export(
    repo: Repository,
    out: Path,
    *,
    style: str = SPECFORGE,
    filters: Filters | None = None,
    fmt: str = CONVERSATIONS,
    incremental: bool = False,
) -> ExportResult:
    writer = JSONL if fmt == CONVERSATIONS else PARQUET
    options = Options(
        writer, filters or Filters(), format=fmt, style=style if fmt != TOKENS else None
    )
    request = ExportRequest("run", out, options, 256_000_000, incremental)
    found, previous, _ = prepare(repo, request)
    return run_export(repo, request, found, previous)


def lines(out: Path, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for name in shard_files(manifest)
        for line in (out / name).read_text().splitlines()
    ]


def record_rows(repo: Repository, tokenizer_dir: Path, prompt_dir: Path = TOKENIZER_DIR) -> None:
    """Run "run" on ``tokenizer_dir`` with a dataset "d" of ROWS: each prompt templated by
    ``prompt_dir``'s template (the bundled one), each output the tokenizer's ids of its text."""
    tok = AutoTokenizer.from_pretrained(str(prompt_dir), local_files_only=True)
    run_id = repo.ensure_run(
        RunSpec("run", str(tokenizer_dir), "a" * 64, "b" * 64, "tiny", think_end_id=None)
    )
    # The stop ids as enqueue stores them (the bundled tokenizer's eos, <|im_end|>).
    params = {"max_new_tokens": 99, "stop_token_ids": [tok.eos_token_id]}
    dataset_id = repo.ensure_dataset(run_id, DatasetSpec("d", "x", params))
    jobs, outputs = [], []
    for i, (text, tools, output, finish) in enumerate(ROWS):
        messages = [{"role": "user", "content": text}]
        prompt = tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        ids = tok.backend_tokenizer.encode(prompt, add_special_tokens=False).ids
        stored = {"messages": messages, "tools": tools}
        jobs.append(NewJob(i, ids, stored, opens_reasoning=True))
        outputs.append((tok.backend_tokenizer.encode(output, add_special_tokens=False).ids, finish))
    for job_id, job, (ids, finish) in zip(
        repo.insert_jobs(dataset_id, jobs), jobs, outputs, strict=True
    ):
        assert repo.claim(job_id, "w", lease_seconds=60).job is not None
        record = GenerationRecord(ids, finish, None, len(job.input_ids), len(ids), 0, 0.1, "sim")
        assert repo.record(job_id, "w", record)


def test_conversations_decode_reasoning_answer_and_calls_and_round_trip_exactly(
    repo: InspectRepository, tmp_path: Path
) -> None:
    record_rows(repo, TOKENIZER_DIR)
    out = tmp_path / "out"
    result = export(repo, out, filters=Filters(exclude_truncated=True))
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["format"] == CONVERSATIONS and manifest["options"]["style"] == SPECFORGE
    assert manifest["run"]["template_matches_run"] is False  # the run records "b" * 64
    rows = lines(out, manifest)
    assert len(rows) == 5 and manifest["counts"]["d"]["removed"][TRUNCATED] == 1
    for row in rows:
        job = repo.job(int(row["id"]))
        assert job is not None
        index = job["row_index"]
        stored = job["messages"]
        assert row["conversations"][:-1] == stored["messages"]
        assert row.get("tools") == stored["tools"]
        turn = row["conversations"][-1]
        expected = TURNS[index]
        assert turn["role"] == "assistant"
        assert (turn["reasoning_content"], turn["content"]) == (
            expected["reasoning_content"],
            expected["content"],
        )
        calls = turn.get("tool_calls", [])
        assert len(calls) == expected["calls"]
        for call in calls:
            assert call == {
                "id": "functions.get_weather:0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        assert row["metadata"]["valid"] == (index in VALID)
        # A turn whose ids the template writes back: a valid one does, the others cannot.
        assert row["metadata"]["roundtrip_exact"] == (index in VALID)
    trips = manifest["roundtrip"]["d"]
    assert (trips["checked"], trips["exact"], trips["differs_in"]["output"]) == (5, 3, 2)
    # Kimi's template writes nothing after <|im_end|>: exact, not up to a suffix.
    assert (trips["exact_up_to_turn_suffix"], trips["turn_suffix"]) == (0, None)
    assert result.roundtrip is not None and result.roundtrip.datasets["d"].exact == 3


def test_only_valid_and_modelopt_shape(repo: InspectRepository, tmp_path: Path) -> None:
    record_rows(repo, TOKENIZER_DIR)
    filters = Filters(exclude_truncated=True, only_valid=True)
    manifest = export(repo, tmp_path / "out", style=MODELOPT, filters=filters).manifest
    rows = lines(tmp_path / "out", manifest)
    assert {r["metadata"]["row_index"] for r in rows} == VALID
    assert all(set(r) >= {"conversation_id", "messages", "metadata"} for r in rows)
    assert manifest["counts"]["d"]["removed"][INVALID] == 2
    assert manifest["roundtrip"]["d"]["exact_rate"] == 1.0
    tokens = export(repo, tmp_path / "tokens", fmt=TOKENS, filters=Filters(only_valid=True))
    token_rows = parquet_rows(tmp_path / "tokens", shard_files(tokens.manifest))
    # The truncated row fails validity too (its reasoning never ended).
    assert {r["row_index"] for r in token_rows} == VALID
    assert tokens.manifest["counts"]["d"]["removed"][INVALID] == 3


def mismatched_tokenizer(tmp_path: Path) -> Path:
    """The bundled tokenizer with a template that drops an assistant's reasoning (as real
    templates do for turns before the last): its round trip cannot reproduce the ids."""
    folder = tmp_path / "stripping-tokenizer"
    shutil.copytree(TOKENIZER_DIR, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    assert "message.get('reasoning_content')" in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(
        "message.get('reasoning_content')", "false"
    )
    config_path.write_text(json.dumps(config))
    return folder


def test_a_template_that_strips_reasoning_is_flagged_and_require_exact_drops_its_rows(
    repo: InspectRepository, tmp_path: Path
) -> None:
    record_rows(repo, mismatched_tokenizer(tmp_path))
    manifest = export(repo, tmp_path / "out", filters=Filters(exclude_truncated=True)).manifest
    trips = manifest["roundtrip"]["d"]
    assert trips["checked"] == 5 and trips["exact"] == 0
    assert trips["differs_in"] == {"prompt": 0, "output": 5}
    example = trips["examples"][0]
    assert "<think>Any will do." in example["recorded"]
    assert "<think></think>" in example["rendered"]
    strict = Filters(exclude_truncated=True, require_exact=True)
    dropped = export(repo, tmp_path / "strict", filters=strict).manifest
    assert dropped["rows"] == 0 and dropped["counts"]["d"]["removed"][NOT_EXACT] == 5


# (user text, output text as the model writes it after the generation prompt, finish).
Generated = tuple[str, str, str]


def record_family(
    repo: Repository,
    folder: Path,
    rows: list[Generated],
    *,
    stop: str,
    opens_reasoning: bool,
    **template_kwargs: Any,
) -> None:
    """Run "run" on the family tokenizer ``folder`` with a dataset "d" of ``rows``: each prompt
    templated by its own template, each output the tokenizer's ids of its text, recorded as a
    worker records a generation; ``stop``: the model's eos, which ends them."""
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    eos = tok.convert_tokens_to_ids(stop)
    # The model's eos as enqueue stores it: generation_config and the dataset's stop ids.
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    spec = RunSpec("run", str(folder), "a" * 64, "b" * 64, "tiny", dict(template_kwargs))
    run_id = repo.ensure_run(spec)
    params = {"max_new_tokens": 99, "stop_token_ids": [eos]}
    dataset_id = repo.ensure_dataset(run_id, DatasetSpec("d", "x", params))
    jobs, outputs = [], []
    for i, (text, output, finish) in enumerate(rows):
        messages = [{"role": "user", "content": text}]
        prompt = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **template_kwargs
        )
        ids = tok.backend_tokenizer.encode(prompt, add_special_tokens=False).ids
        jobs.append(NewJob(i, ids, {"messages": messages, "tools": None}, opens_reasoning))
        outputs.append((tok.backend_tokenizer.encode(output, add_special_tokens=False).ids, finish))
    for job_id, job, (ids, finish) in zip(
        repo.insert_jobs(dataset_id, jobs), jobs, outputs, strict=True
    ):
        assert repo.claim(job_id, "w", lease_seconds=60).job is not None
        record = GenerationRecord(ids, finish, None, len(job.input_ids), len(ids), 0, 0.1, "sim")
        assert repo.record(job_id, "w", record)


DS_EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"  # DeepSeek's eos, spelled with U+FF5C
QWEN3_ROWS: list[Generated] = [
    ("Name a planet.", "<think>\nAny will do.\n</think>\n\nSaturn.<|im_end|>", "stop"),
    ("And a moon?", "<think>\nTitan is one.\n</think>\n\nTitan.<|im_end|>", "stop"),
    ("Say hi.", "<think>\nEasy.\n</think>\n\nHi!<|im_end|>", "stop"),
]


def test_qwen3_rows_are_exact_up_to_the_newline_its_template_writes_after_im_end(
    repo: InspectRepository, tmp_path: Path
) -> None:
    """Qwen3's template ends every turn with <|im_end|> then a newline; the model stops at
    <|im_end|>. Each row is the re-rendered ids but that newline: exact up to the template's
    turn suffix, counted apart, and kept by --require-exact (it used to drop all of them)."""
    folder = family_tokenizer(tmp_path, "qwen3")
    record_family(repo, folder, QWEN3_ROWS, stop="<|im_end|>", opens_reasoning=False)
    strict = Filters(exclude_truncated=True, require_exact=True)
    manifest = export(repo, tmp_path / "out", filters=strict).manifest
    trips = manifest["roundtrip"]["d"]
    assert (trips["checked"], trips["exact"], trips["exact_up_to_turn_suffix"]) == (3, 3, 3)
    assert trips["turn_suffix"] == "\n" and trips["examples"] == []
    assert manifest["rows"] == 3 and manifest["counts"]["d"]["removed"][NOT_EXACT] == 0
    rows = lines(tmp_path / "out", manifest)
    assert all(row["metadata"]["roundtrip_exact"] for row in rows)
    assert {row["conversations"][-1]["content"].split("\n")[-1] for row in rows} == {
        "Saturn.",
        "Titan.",
        "Hi!",
    }


@pytest.mark.parametrize(
    ("family", "kwargs", "output"),
    [
        # R1's generation prompt opens <think>; its template writes no reasoning back.
        ("deepseek_r1", {}, f"Any will do.\n</think>\n\nSaturn.{DS_EOS}"),
        # V3.1 thinking: the prompt ends <think>, the template writes </think> after the
        # assistant tag instead, dropping the reasoning.
        ("deepseek_v31", {"thinking": True}, f"Any will do.</think>Saturn.{DS_EOS}"),
    ],
)
def test_a_template_that_drops_the_last_turn_s_reasoning_is_reported_where_it_differs(
    family: str, kwargs: dict[str, Any], output: str, repo: InspectRepository, tmp_path: Path
) -> None:
    folder = family_tokenizer(tmp_path, family, structure=True)
    rows = [("Name a planet.", output, "stop")]
    record_family(repo, folder, rows, stop=DS_EOS, opens_reasoning=True, **kwargs)
    manifest = export(repo, tmp_path / "out", filters=Filters(exclude_truncated=True)).manifest
    trips = manifest["roundtrip"]["d"]
    assert (trips["checked"], trips["exact"], trips["exact_up_to_turn_suffix"]) == (1, 0, 0)
    [example] = trips["examples"]
    job = repo.job(example["id"])
    assert job is not None
    # The first difference is the <think> the generation prompt opened, which the
    # re-rendered conversation has not.
    think = AutoTokenizer.from_pretrained(str(folder)).convert_tokens_to_ids("<think>")
    assert example["position"] == job["input_ids"].index(think) and example["part"] == "prompt"
    assert "<think>" in example["recorded"] and "Any will do." in example["recorded"]
    assert "Any will do." not in example["rendered"]
    strict = Filters(exclude_truncated=True, require_exact=True)
    assert export(repo, tmp_path / "strict", filters=strict).manifest["rows"] == 0


def test_simulated_generations_decode_with_and_without_calls(
    settings: Settings, repo: InspectRepository, tmp_path: Path
) -> None:
    """A real worker's rows: the conversation holds exactly the decoded ids, and the round
    trip is counted for every row (the simulator samples ids at random, which the tokenizer
    rarely encodes its own way: the manifest says how many reproduce)."""
    every = sample_rows(300)
    rows = [r for r in every if "tools" in r] + [r for r in every if "tools" not in r][:30]
    assert len(rows) == 60
    assert generate(settings, repo, tmp_path / "d.jsonl", rows, max_new_tokens=400) == 60
    out = tmp_path / "out"
    manifest = export(repo, out, filters=Filters(exclude_truncated=False)).manifest
    exported = lines(out, manifest)
    assert len(exported) == 60
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    end = tok.convert_tokens_to_ids("</think>")
    call_begin = tok.convert_tokens_to_ids("<|tool_call_begin|>")
    pairs = [
        tuple(tok.convert_tokens_to_ids(f"<|tool_{a}_{b}|>") for b in ("begin", "end"))
        for a in ("calls_section", "call")
    ]
    with_calls = broken = 0
    for row in exported:
        gen = repo.generation(int(row["id"]))
        assert gen is not None
        output = gen["output_ids"]
        turn = row["conversations"][-1]
        if end in output:
            reasoning = output[: output.index(end)]
            assert turn["reasoning_content"] == tok.decode(reasoning, skip_special_tokens=False)
        calls = output.count(call_begin)
        assert len(turn.get("tool_calls", [])) == calls
        with_calls += calls > 0
        arguments_json = [is_json(c["function"]["arguments"]) for c in turn.get("tool_calls", [])]
        balanced = all(output.count(a) == output.count(b) for a, b in pairs)
        assert row["metadata"]["valid"] == (end in output and balanced and all(arguments_json))
        broken += not all(arguments_json)
    assert 0 < with_calls < 60 and broken < with_calls
    trips = manifest["roundtrip"]["d"]
    assert trips["checked"] == 60
    assert trips["exact"] + trips["differs_in"]["prompt"] + trips["differs_in"]["output"] == 60


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_a_run_whose_tokenizer_is_gone_is_refused(repo: InspectRepository, tmp_path: Path) -> None:
    record_rows(repo, Path("/nowhere/tokenizer"))
    with pytest.raises(ValueError, match="/nowhere/tokenizer is not a folder"):
        export(repo, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_integer_beyond_64_bits_in_a_message_is_exported_exactly(
    settings: Settings, repo: InspectRepository, tmp_path: Path
) -> None:
    """JSON has no integer limit and the job stores the messages as written; orjson refuses
    integers beyond 64 bits, and one such row stopped the whole export."""
    huge = 123_456_789_012_345_678_901_234_567_890
    rows = sample_rows(4)
    odd = {"messages": [{"role": "user", "content": "Big numbers?", "ticket": huge}]}
    text = tmp_path / "d.jsonl"
    assert generate(settings, repo, text, [odd, *rows], max_new_tokens=64) == 5
    out = tmp_path / "out"
    manifest = export(repo, out, filters=Filters(exclude_truncated=False)).manifest
    exported = lines(out, manifest)
    assert len(exported) == manifest["rows"] == 5
    [row] = [r for r in exported if r["metadata"]["row_index"] == 0]
    assert row["conversations"][0] == {"role": "user", "content": "Big numbers?", "ticket": huge}
    files = [out / name for name in shard_files(manifest)]
    assert any(str(huge) in path.read_text() for path in files)  # written out, not rounded
