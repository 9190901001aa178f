"""Model families through enqueue, status, stats, show and export, against real Postgres.

Enqueue detects a run's family from its tokenizer and records it with the union of the stop
ids SGLang stops at; a second enqueue naming another family is refused. Generations in Qwen3's
and GLM-4.5's layouts are recorded through the repository (the simulator speaks only Kimi's
vocabulary for now), and every reader cuts them by the run's family: stats counts the calls,
`export --format conversations` writes them in OpenAI's shape, `--only-valid` drops a broken
call. A run of an unknown family says its calls were not checked.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from sqlalchemy import select, update

from core.settings import Settings
from core.tokenizer import RunTokenizer
from eaglegen.assets import TOKENIZER_DIR
from eaglegen.cli.enqueue import family_line
from eaglegen.report.samples import view
from eaglegen.report.stats import Scope, collect, coverage, run_tokenizer
from eaglegen.report.status import status_document, status_view
from exporter.conversations import SPECFORGE
from exporter.export import ExportRequest, prepare, run_export
from exporter.layouts import CONVERSATIONS, JSONL, TOKENS
from exporter.manifest import MANIFEST, Options
from exporter.rows import INVALID, Filters
from models.records import DatasetSpec, GenerationRecord, NewJob, RunSpec
from models.repository import Repository, RunMismatchError
from models.schema import Dataset, Run
from models.stats import StatsQueries
from producer.commands import run_enqueue
from producer.plan import DatasetPlan, RunPlan
from tests.helpers import enqueue_file, family_tokenizer, sample_rows, write_jsonl
from tests.unit.test_run_tokenizer import TOOLS

REASONING, ANSWER = "The user wants the weather.", "Let me check."
OSLO, PARIS = '{"city": "Oslo"}', '{"city": "Paris"}'


def qwen3_call(arguments: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'


# Qwen3 (hybrid): the prompt leaves `<think>` to the model. (name, output, finish)
QWEN3_OUTPUTS = [
    ("call", f"<think>\n{REASONING}\n</think>\n\n{ANSWER}\n{qwen3_call(OSLO)}<|im_end|>", "stop"),
    (
        "parallel",
        f"<think>\n{REASONING}\n</think>\n\n{qwen3_call(OSLO)}\n{qwen3_call(PARIS)}<|im_end|>",
        "stop",
    ),
    ("broken", f"<think>\nHm.\n</think>\n\n{qwen3_call(OSLO[:-1])}<|im_end|>", "stop"),
    ("plain", "<think>\nEasy.\n</think>\n\nIt is sunny.<|im_end|>", "stop"),
    ("cut", '<think>\nHm.\n</think>\n\n<tool_call>\n{"name": "get_weather", "argu', "length"),
]


def glm_call(value: str, close: bool = True) -> str:
    end = "</arg_value>\n</tool_call>" if close else "\n</tool_call>"
    return f"\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>{value}{end}"


# GLM-4.5: the prompt ends `<|assistant|>`; the model writes `\n<think>` itself.
GLM45_OUTPUTS = [
    ("call", f"\n<think>{REASONING}</think>\n{ANSWER}{glm_call('Oslo')}<|observation|>", "stop"),
    ("broken", f"\n<think>Hm.</think>{glm_call('Oslo', close=False)}<|observation|>", "stop"),
    ("plain", "\n<think>Easy.</think>\nIt is sunny.<|user|>", "stop"),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Each family's test tokenizer folder, built once for the module on first use."""
    root = tmp_path_factory.mktemp("family-tokenizers")

    def get(family: str) -> Path:
        folder = root / family
        return folder if folder.exists() else family_tokenizer(root, family, structure=True)

    return get


# --- enqueue, status ------------------------------------------------------------------------


def with_generation_config(folder: Path, tmp_path: Path) -> tuple[Path, list[int]]:
    """A copy of ``folder`` whose generation_config.json names <|endoftext|> only, as a
    model's may: (the copy, the stop ids SGLang stops at: that one and the tokenizer's eos)."""
    import shutil

    out = tmp_path / "qwen3-model"
    shutil.copytree(folder, out)
    tok = RunTokenizer(out)
    endoftext, im_end = tok.vocab["<|endoftext|>"], tok.vocab["<|im_end|>"]
    assert tok.tokenizer.eos_token_id == im_end
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": endoftext}))
    return out, [endoftext, im_end]


def stored_params(repo: Repository, run: str) -> dict[str, Any]:
    with repo.engine.connect() as conn:
        found = conn.scalar(select(Dataset.sampling_params).where(Dataset.name == "d"))
    return dict(found or {})


def test_enqueue_records_the_family_and_the_stop_ids_sglang_stops_at(
    settings: Settings, repo: Repository, tmp_path: Path, folders: Callable[[str], Path]
) -> None:
    folder, stops = with_generation_config(folders("qwen3"), tmp_path)
    rows = write_jsonl(tmp_path / "rows.jsonl", sample_rows(4))
    stats = enqueue_file(settings, rows, run="q", tokenizer=folder)
    assert stats.accepted == 4
    assert repo.run_family("q") == "qwen3"
    # generation_config.json's eos and the tokenizer's, both: SGLang stops at either.
    assert stored_params(repo, "q")["stop_token_ids"] == stops

    datasets = [DatasetPlan("d", rows, sampling={"max_new_tokens": 256})]  # as enqueue_file
    plan = RunPlan("q", folder, datasets, family="glm45")
    with pytest.raises(RunMismatchError) as refused:
        run_enqueue(settings, settings.services(), plan, quiet=True)
    message = str(refused.value)
    assert "\n" not in message and "'qwen3'" in message and "'glm45'" in message
    # Naming none, or the same, goes on: the run reads as it was recorded.
    again = run_enqueue(settings, settings.services(), RunPlan("q", folder, plan.datasets))
    assert (again.family, again.family_source, again.datasets[0].duplicates) == (
        "qwen3",
        "detected",
        4,
    )
    named = run_enqueue(settings, None, RunPlan("q", folder, plan.datasets, family="hermes"))
    assert (named.family, named.family_source, named.dry_run) == ("qwen3", "named", True)
    assert named.as_dict()["default_stop_token_ids"] == stops
    assert family_line(again) == (
        f"family: qwen3 (detected from the tokenizer); default stop ids: {stops[0]}, {stops[1]}"
    )

    document = status_document(repo.status("q"), None)
    assert document["runs"][0]["family"] == "qwen3"
    out = Console(record=True, width=400)
    out.print(status_view(repo.status("q"), None))
    assert "family qwen3;" in out.export_text()


def test_a_run_from_before_families_takes_its_family_and_keeps_its_stop_ids(
    settings: Settings, repo: Repository, tmp_path: Path, folders: Callable[[str], Path]
) -> None:
    folder, stops = with_generation_config(folders("qwen3"), tmp_path)
    rows = write_jsonl(tmp_path / "rows.jsonl", sample_rows(3))
    enqueue_file(settings, rows, run="old", tokenizer=folder)
    # As a run enqueued before 0010 left it: no family, and the stop ids of the old rule
    # (generation_config.json's eos, else the tokenizer's).
    with repo.engine.begin() as conn:
        conn.execute(update(Run).values(family=None))
        params = {**stored_params(repo, "old"), "stop_token_ids": stops[:1]}
        conn.execute(update(Dataset).values(sampling_params=params))
    assert repo.run_family("old") is None
    more = write_jsonl(tmp_path / "more.jsonl", sample_rows(5))
    stats = enqueue_file(settings, more, run="old", tokenizer=folder)
    assert (stats.accepted, stats.duplicates) == (2, 3)
    assert repo.run_family("old") == "qwen3"
    # Its jobs were sent with those: they stay (a run file naming others is still refused).
    assert stored_params(repo, "old")["stop_token_ids"] == stops[:1]


# --- stats, show, export on hand-recorded generations ------------------------------------


def record(
    repo: Repository,
    tok: RunTokenizer,
    run: str,
    outputs: list[tuple[str, str, str]],
    family: str | None = None,
) -> dict[str, int]:
    """``outputs`` as done jobs of dataset "d" of ``run`` (prompts rendered by the run's
    template, one per output), cut at the tokenizer's default stop ids: name -> job id."""
    spec = RunSpec(
        run,
        str(tok.path),
        tok.tokenizer_sha256(),
        tok.chat_template_sha256(),
        "model",
        vocab_size=tok.vocab_size(),
        family=family or tok.family.name,
    )
    stops = tok.default_stop_ids() + tok.family.stop_ids(tok.vocab)
    params = {"max_new_tokens": 500, "stop_token_ids": list(dict.fromkeys(stops))}
    dataset_id = repo.ensure_dataset(repo.ensure_run(spec), DatasetSpec("d", "x", params))
    jobs = []
    for name, _, _ in outputs:
        messages = [{"role": "user", "content": f"Weather? ({name})"}]
        ids = tok.encode(tok.render_chat(messages, TOOLS, add_generation_prompt=True))
        jobs.append(NewJob(len(jobs), ids, {"messages": messages, "tools": TOOLS}, False))
    job_ids = repo.insert_jobs(dataset_id, jobs)
    for job_id, job, (_, text, finish) in zip(job_ids, jobs, outputs, strict=True):
        output = tok.encode(text)
        matched = output[-1] if finish == "stop" else None
        assert repo.claim(job_id, "w", lease_seconds=60).job is not None
        generation = GenerationRecord(
            output, finish, matched, len(job.input_ids), len(output), 0, 0.1, "sim"
        )
        assert repo.record(job_id, "w", generation)
    return {name: job_id for (name, _, _), job_id in zip(outputs, job_ids, strict=True)}


def stats_document(repo: Repository, run: str) -> dict[str, Any]:
    queries = StatsQueries(repo.engine)
    found = queries.stats_run(run)
    assert found is not None
    report = collect(queries, found, Scope(("d",), None), run_tokenizer(found))
    return {**report.document(), "coverage": coverage(report)}


def export(
    repo: Repository, run: str, out: Path, filters: Filters, fmt: str = CONVERSATIONS
) -> list[dict[str, Any]]:
    """The rows of an export of ``run`` (JSON Lines), or the manifest's counts for tokens."""
    options = Options(JSONL, filters, format=fmt, style=SPECFORGE if fmt == CONVERSATIONS else None)
    request = ExportRequest(run, out, options, 256_000_000)
    found, previous, _ = prepare(repo, request)
    manifest = run_export(repo, request, found, previous).manifest
    if fmt == TOKENS:
        return [manifest]
    assert json.loads((out / MANIFEST).read_text())["counts"] == manifest["counts"]
    return [
        json.loads(line)
        for shard in manifest["shards"]
        for line in (out / shard["file"]).read_text().splitlines()
    ]


def by_name(rows: list[dict[str, Any]], ids: dict[str, int]) -> dict[str, dict[str, Any]]:
    names = {job_id: name for name, job_id in ids.items()}
    return {names[int(row["id"])]: row for row in rows}


def function(arguments: Any) -> dict[str, Any]:
    return {"name": "get_weather", "arguments": arguments}


def test_qwen3_calls_are_counted_shown_and_exported_in_openai_s_shape(
    repo: Repository, tmp_path: Path, folders: Callable[[str], Path]
) -> None:
    tok = RunTokenizer(folders("qwen3"))
    ids = record(repo, tok, "q3", QWEN3_OUTPUTS)
    document = stats_document(repo, "q3")
    assert document["family"] == "qwen3"
    assert "family qwen3; tool calls checked in every generation" in document["coverage"]
    calls = document["datasets"][0]["tool_calls"]
    assert (calls["checked"], calls["declared"], calls["with_calls"], calls["calls"]) == (
        5,
        5,
        4,
        5,
    )
    assert (calls["invalid_arguments"], calls["cut_in_section"], calls["unbalanced"]) == (1, 1, 0)
    assert calls["examples"]["invalid_arguments"] == [ids["broken"]]

    detail = StatsQueries(repo.engine).detail(ids["parallel"])
    assert detail is not None
    shown = view(detail, tok.decode, tok.markers(detail.stop_token_ids), family=tok.family)
    assert [(c.name, c.arguments) for c in shown.tool_calls] == [
        ("get_weather", OSLO),
        ("get_weather", PARIS),
    ]
    assert shown.family == "qwen3" and shown.stop == "<|im_end|>"

    rows = by_name(export(repo, "q3", tmp_path / "conv", Filters(exclude_truncated=True)), ids)
    assert set(rows) == {"call", "parallel", "broken", "plain"}
    turn = rows["call"]["conversations"][-1]
    # The template's white space is its own: it writes it again, and the round trip holds.
    assert (turn["reasoning_content"], turn["content"]) == (REASONING, ANSWER)
    assert turn["tool_calls"] == [{"id": "call_0", "type": "function", "function": function(OSLO)}]
    parallel = rows["parallel"]["conversations"][-1]
    assert [c["id"] for c in parallel["tool_calls"]] == ["call_0", "call_1"]
    assert parallel["content"] == "" and parallel["tool_calls"][1]["function"] == function(PARIS)
    for name in ("call", "parallel", "plain"):
        assert rows[name]["metadata"]["valid"] and rows[name]["metadata"]["roundtrip_exact"]
    assert not rows["broken"]["metadata"]["valid"]

    valid = export(repo, "q3", tmp_path / "valid", Filters(exclude_truncated=True, only_valid=True))
    assert set(by_name(valid, ids)) == {"call", "parallel", "plain"}
    [manifest] = export(repo, "q3", tmp_path / "tokens", Filters(only_valid=True), TOKENS)
    assert manifest["counts"]["d"]["removed"][INVALID] == 2  # the broken call and the cut one


def test_glm45_calls_are_counted_and_exported_with_their_arguments_as_an_object(
    repo: Repository, tmp_path: Path, folders: Callable[[str], Path]
) -> None:
    tok = RunTokenizer(folders("glm45"))
    ids = record(repo, tok, "glm", GLM45_OUTPUTS)
    calls = stats_document(repo, "glm")["datasets"][0]["tool_calls"]
    assert (calls["with_calls"], calls["calls"], calls["invalid_arguments"]) == (2, 2, 1)

    rows = by_name(export(repo, "glm", tmp_path / "conv", Filters()), ids)
    turn = rows["call"]["conversations"][-1]
    assert (turn["reasoning_content"], turn["content"]) == (REASONING, ANSWER)
    # GLM's template writes the arguments key by key: they go as an object.
    assert turn["tool_calls"] == [
        {"id": "call_0", "type": "function", "function": function({"city": "Oslo"})}
    ]
    assert rows["plain"]["conversations"][-1]["content"] == "It is sunny."
    # GLM's template writes no stop at the end of the turn: exact but for the model's own.
    assert rows["call"]["metadata"]["roundtrip_exact"] is True
    trips = json.loads((tmp_path / "conv" / MANIFEST).read_text())["roundtrip"]["d"]
    assert trips["unrendered_stop"] == "<|observation|>" and trips["exact_but_unrendered_stop"] >= 1
    valid = export(repo, "glm", tmp_path / "valid", Filters(only_valid=True))
    assert set(by_name(valid, ids)) == {"call", "plain"}


def kimi_call(arguments: str) -> str:
    return (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        f"<|tool_call_argument_begin|>{arguments}<|tool_call_end|><|tool_calls_section_end|>"
    )


def test_a_run_of_an_unknown_family_says_its_calls_were_not_checked(
    repo: Repository, tmp_path: Path
) -> None:
    tok = RunTokenizer(TOKENIZER_DIR, family="unknown")
    outputs = [
        ("call", f"Hm.</think>{kimi_call(OSLO)}<|im_end|>", "stop"),
        ("broken", f"Hm.</think>{kimi_call(OSLO[:-1])}<|im_end|>", "stop"),
    ]
    ids = record(repo, tok, "unk", outputs, family="unknown")
    document = stats_document(repo, "unk")
    assert document["family"] == "unknown"
    assert document["datasets"][0]["tool_calls"] == "not checked"
    assert document["total"]["tool_calls"] == "not checked"
    assert document["coverage"].endswith("family unknown — tool calls not checked")

    detail = StatsQueries(repo.engine).detail(ids["call"])
    assert detail is not None
    shown = view(detail, tok.decode, tok.markers(detail.stop_token_ids), family=tok.family)
    assert shown.document()["tool_calls"] == "not checked"

    rows = by_name(export(repo, "unk", tmp_path / "conv", Filters(only_valid=True)), ids)
    assert set(rows) == {"call", "broken"}  # judged on reasoning alone: not "invalid"
    turn = rows["call"]["conversations"][-1]
    assert "tool_calls" not in turn and "<|tool_call_begin|>" in turn["content"]
    assert rows["call"]["metadata"]["tool_calls"] == "not checked"
