"""`eaglegen stats` against real Postgres: the figures of its JSON document are computed
again here, independently, from the rows the test made (a real worker against the
simulator, with broken tool arguments switched on; and hand-recorded edge cases)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import Engine, select
from tokenizers import Tokenizer

from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR, special_ids
from eaglegen.report import html
from eaglegen.report.plots import prompt_vs_completion
from eaglegen.report.quality import Report
from eaglegen.report.stats import Scope, collect, run_tokenizer
from eaglegen.sim import FaultConfig, SimConfig, SimServer
from models.records import DatasetSpec, GenerationRecord, NewJob, RunSpec
from models.repository import Repository
from models.schema import Dataset, Generation, Job
from models.stats import StatsQueries
from tests.helpers import enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.integration.test_pipeline import worker
from worker.reasoning import split_reasoning

TOKENIZER = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
IDS = special_ids()
EOS, THINK_END = IDS.im_end, IDS.think_end
SB, SE = IDS.tool_calls_section_begin, IDS.tool_calls_section_end
CB, AB, CE = IDS.tool_call_begin, IDS.tool_call_argument_begin, IDS.tool_call_end
CALL = re.compile(
    r"<\|tool_call_begin\|>functions\.(.+?):\d+<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
    re.S,
)


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    """This module's simulator: a third of the tool calls get arguments that are not JSON,
    and answers long enough that a small max_new_tokens cuts many."""
    config = SimConfig(
        seed=7,
        decode_step_ms=0.2,
        decode_ms_per_request=0.01,
        mean_output_tokens=220,
        faults=FaultConfig(broken_tool_args_rate=0.35, seed=3),
    )
    with SimServer(config) as server:
        yield server


def collected(engine: Engine, run: str = "run", **scope: Any) -> Report:
    """The report `eaglegen stats` makes of ``run``."""
    queries = StatsQueries(engine)
    found = queries.stats_run(run)
    assert found is not None
    names = tuple(d.name for d in found.datasets)
    tokenizer = run_tokenizer(found)  # the run's own: its recorded path and family
    return collect(queries, found, Scope(names, **{"sample": None, **scope}), tokenizer)


def report(engine: Engine, run: str = "run", **scope: Any) -> dict[str, Any]:
    """What `eaglegen stats --json` prints for ``run``."""
    return collected(engine, run, **scope).document()


def database_rows(engine: Engine) -> list[dict[str, Any]]:
    """Every done generation with its job and dataset, as plain dicts."""
    stmt = (
        select(
            Dataset.name.label("dataset"),
            Dataset.sampling_params,
            Job.opens_reasoning,
            Job.messages,
            Generation.__table__,
        )
        .join(Job, Job.id == Generation.job_id)
        .join(Dataset, Dataset.id == Job.dataset_id)
        .where(Job.state == "done")
    )
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(stmt).mappings()]


def pct(values: list[float]) -> dict[str, float]:
    """p50/p90/p99/max as percentile_cont computes them (linear interpolation)."""
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": p50, "p90": p90, "p99": p99, "max": max(values)}


def tool_figures(rows: list[dict[str, Any]]) -> dict[str, int]:
    """The tool-call figures from the decoded text, by regular expression: another way
    than the report's (which walks the ids)."""
    out = Counter[str]()
    for row in rows:
        out["checked"] += 1
        tools = row["messages"].get("tools")
        declared = {t["function"]["name"] for t in tools} if tools else set()
        out["declared"] += bool(tools)
        text = TOKENIZER.decode(row["output_ids"], skip_special_tokens=False)
        answer = text.split("</think>", 1)[1] if "</think>" in text else ""
        begun = answer.count("<|tool_call_begin|>")  # finished or not
        out["with_calls"] += bool(begun)
        out["calls"] += begun
        if row["finish_type"] == "length":
            continue  # a call cut short is unfinished, not wrong
        for name, arguments in CALL.findall(answer):
            out["undeclared"] += name not in declared
            try:
                json.loads(arguments)
            except ValueError:
                out["invalid_arguments"] += 1
    return dict(out)


def is_empty(row: dict[str, Any], stop: int) -> bool:
    """No answer id but the stop id (a reasoning never closed is no empty answer)."""
    if not row["opens_reasoning"]:
        return bool(row["completion_tokens"] - stop <= 0)
    return bool(row["think_end_present"] and row["answer_tokens"] - stop <= 0)


def expected_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The SQL-side figures of one dataset's rows, computed here."""
    c = [r["completion_tokens"] for r in rows]
    p = [r["prompt_tokens"] for r in rows]
    opens = [r for r in rows if r["opens_reasoning"]]
    missing = [r for r in opens if not r["think_end_present"]]
    reasoning = [r["reasoning_tokens"] for r in opens]
    stop = [int(r["finish_type"] == "stop" and isinstance(r["finish_matched"], int)) for r in rows]
    empty = sum(is_empty(r, s) for r, s in zip(rows, stop, strict=True))
    latency = [r["e2e_latency"] for r in rows]
    return {
        "generations": len(rows),
        "completion": {"sum": sum(c), **pct(c)},
        "prompt": {"sum": sum(p), **pct(p)},
        "finish": dict(Counter(r["finish_type"] for r in rows)),
        "at_max_new": sum(
            r["finish_type"] == "length"
            and r["completion_tokens"] >= r["sampling_params"]["max_new_tokens"]
            for r in rows
        ),
        "opens": len(opens),
        "missing": len(missing),
        "missing_cut": sum(r["finish_type"] == "length" for r in missing),
        "reasoning": {"sum": sum(reasoning), **pct(reasoning)},
        "answer_sum": sum(r["answer_tokens"] for r in opens),
        "empty": empty,
        "cached": sum(r["cached_tokens"] for r in rows),
        "latency": pct(latency),
        "histogram_total": len(rows),
    }


def assert_matches(doc: dict[str, Any], want: dict[str, Any]) -> None:
    """The report's figures of one dataset equal those computed from its rows."""
    assert doc["generations"] == want["generations"]
    for key, got in (("completion", doc["completion_tokens"]), ("prompt", doc["prompt_tokens"])):
        for stat, value in want[key].items():
            assert got[stat] == pytest.approx(value), (key, stat)
    assert doc["finish"] == want["finish"]
    assert doc["truncated"]["at_max_new_tokens"] == want["at_max_new"]
    assert doc["truncated"]["share"] == pytest.approx(want["at_max_new"] / want["generations"])
    r = doc["reasoning"]
    assert (r["opens_reasoning"], r["think_end_missing"]) == (want["opens"], want["missing"])
    assert r["think_end_missing_cut"] == want["missing_cut"]
    for stat in ("sum", "p50", "p90", "p99", "max"):
        assert r["reasoning_tokens"][stat] == pytest.approx(want["reasoning"][stat]), stat
    assert r["answer_tokens"]["sum"] == want["answer_sum"]
    assert doc["empty_answers"] == want["empty"]
    assert doc["cache"]["cached_tokens"] == want["cached"]
    assert doc["cache"]["hit_ratio"] == pytest.approx(want["cached"] / want["prompt"]["sum"])
    for stat, value in want["latency"].items():
        assert doc["latency_s"][stat] == pytest.approx(value), stat
    assert sum(doc["histogram"]["counts"]) == want["histogram_total"]


def test_the_report_of_a_worker_run_is_what_the_rows_say(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    rows = sample_rows(300)
    with_tools = [r for r in rows if r.get("tools")]
    plain = [r for r in rows if not r.get("tools")][:90]
    with worker(settings):
        enqueue_file(settings, write_jsonl(tmp_path / "c.jsonl", plain), dataset="chat",
                     max_new_tokens=150)  # fmt: skip
        enqueue_file(settings, write_jsonl(tmp_path / "f.jsonl", with_tools), dataset="fc",
                     max_new_tokens=600)  # fmt: skip
        states = wait_settled(repo)
    assert states["done"] == len(plain) + len(with_tools)
    document = report(repo.engine)
    all_rows = database_rows(repo.engine)
    by_dataset = {d["dataset"]: d for d in document["datasets"]}
    assert set(by_dataset) == {"chat", "fc"}
    for name, figures in by_dataset.items():
        mine = [r for r in all_rows if r["dataset"] == name]
        assert_matches(figures, expected_figures(mine))
        width = figures["histogram"]["bin_width"]
        counts = Counter(r["completion_tokens"] // width for r in mine)
        assert figures["histogram"]["counts"] == [counts.get(i, 0) for i in range(max(counts) + 1)]
        assert figures["jobs"] == {"done": len(mine), "total": len(mine)}
        for key, value in tool_figures(mine).items():
            assert figures["tool_calls"][key] == value, (name, key)
    assert_matches(document["total"], expected_figures(all_rows))
    chat, fc = by_dataset["chat"], by_dataset["fc"]
    # The knobs did what they say, so the comparisons above compared something.
    assert chat["truncated"]["at_max_new_tokens"] > 0 and chat["tool_calls"]["calls"] == 0
    assert fc["tool_calls"]["calls"] > 0 and fc["tool_calls"]["invalid_arguments"] > 0
    assert fc["tool_calls"]["undeclared"] == 0 and fc["tool_calls"]["declared"] == len(with_tools)
    share = chat["truncated"]["share"]
    assert any(w.startswith(f"{round(share * 100)}% of `chat` truncated at 150 tokens") for w in
               document["warnings"])  # fmt: skip
    assert any("tool calls of `fc` ha" in w
               for w in document["warnings"])  # fmt: skip
    assert document["token_checks"] == {
        "sample": None, "seed": 0, "generations": len(all_rows), "tool_markers": True,
    }  # fmt: skip


def test_a_seeded_sample_checks_that_many_generations_and_the_same_ones_every_time(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    rows = [r for r in sample_rows(300) if r.get("tools")]
    with worker(settings):
        enqueue_file(settings, write_jsonl(tmp_path / "f.jsonl", rows), dataset="fc")
        wait_settled(repo)
    first = report(repo.engine, sample=12, seed=5)
    again = report(repo.engine, sample=12, seed=5)
    other = report(repo.engine, sample=12, seed=6)
    assert first["token_checks"]["generations"] == 12
    assert first["total"]["tool_calls"] == again["total"]["tool_calls"]
    assert first["total"]["tool_calls"]["checked"] == 12
    assert first["total"]["tool_calls"]["declared"] == 12
    # The SQL figures cover every generation whatever the sample.
    assert first["total"]["generations"] == len(rows) == other["total"]["generations"]
    everything = report(repo.engine)["total"]["tool_calls"]
    assert everything["checked"] == len(rows)
    assert first["total"]["tool_calls"]["calls"] <= everything["calls"]


# --- hand-recorded edge cases ------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def enc(text: str) -> list[int]:
    return list(TOKENIZER.encode(text, add_special_tokens=False).ids)


def call(name: str, arguments: str) -> list[int]:
    return [CB, *enc(f"functions.{name}:0"), AB, *enc(arguments), CE]


# (what it is, output ids, finish type, declares tools)
EDGES: list[tuple[str, list[int], str, bool]] = [
    ("fine", [*enc("hmm"), THINK_END, *enc("Sunny."), EOS], "stop", False),
    ("fine call", [*enc("hmm"), THINK_END, SB, *call("get_weather", '{"city": "Oslo"}'), SE, EOS],
     "stop", True),
    ("no think-end, stopped", [*enc("I keep thinking"), EOS], "stop", False),
    ("no think-end, cut", enc("on and on and on and on and on"), "length", False),
    ("empty answer", [*enc("hmm"), THINK_END, EOS], "stop", False),
    ("broken arguments", [*enc("x"), THINK_END, SB, *call("get_weather", "{'city': 1}"), SE, EOS],
     "stop", True),
    ("undeclared", [*enc("x"), THINK_END, SB, *call("launch", "{}"), SE, EOS], "stop", True),
    ("unclosed section", [*enc("x"), THINK_END, SB, *call("get_weather", "{}"), EOS], "stop", True),
    ("cut in a section", [*enc("x"), THINK_END, SB, CB, *enc("functions.get")], "length", True),
]  # fmt: skip


def record_edges(
    repo: Repository, max_new: int, run: str = "edges", dataset: str = "edge"
) -> list[int]:
    """The EDGES as done jobs of ``dataset`` of ``run``; their job ids."""
    spec = RunSpec(run, str(TOKENIZER_DIR), "a" * 64, "b" * 64, "tiny", think_end_id=THINK_END)
    run_id = repo.ensure_run(spec)
    params = {"max_new_tokens": max_new, "stop_token_ids": [EOS]}
    dataset_id = repo.ensure_dataset(run_id, DatasetSpec(dataset, "x", params))
    jobs = [
        NewJob(i, [7, 8, 9 + i], {"messages": [], "tools": TOOLS if tools else None}, True)
        for i, (_, _, _, tools) in enumerate(EDGES)
    ]
    ids = repo.insert_jobs(dataset_id, jobs)
    for job_id, (_, output, finish, _) in zip(ids, EDGES, strict=True):
        assert repo.claim(job_id, "w", lease_seconds=60).job is not None
        split = split_reasoning(output, THINK_END)
        matched = EOS if finish == "stop" else None
        record = GenerationRecord(
            output, finish, matched, 3, len(output), 1, 0.5, "sim", {},
            split.think_end_present, split.reasoning_tokens, split.answer_tokens,
        )  # fmt: skip
        assert repo.record(job_id, "w", record)
    return ids


def test_edge_cases_are_counted_each_where_it_belongs(repo: Repository) -> None:
    cut_length = len(EDGES[3][1])
    ids = record_edges(repo, max_new=cut_length)
    edge = report(repo.engine, "edges")["datasets"][0]
    assert edge["finish"] == {"stop": 7, "length": 2}
    # "no think-end, cut" reached max_new_tokens; "cut in a section" stopped short of it.
    assert edge["truncated"]["at_max_new_tokens"] == 1
    assert edge["truncated"]["before_max_new_tokens"] == 1
    assert edge["reasoning"]["think_end_missing"] == 2
    assert edge["reasoning"]["think_end_missing_cut"] == 1
    assert edge["empty_answers"] == 1
    tools = edge["tool_calls"]
    assert tools["checked"] == 9 and tools["declared"] == 5
    assert tools["with_calls"] == 5 and tools["calls"] == 5
    assert tools["invalid_arguments"] == 1 and tools["undeclared"] == 1
    assert tools["unbalanced"] == 1 and tools["cut_in_section"] == 1
    assert tools["examples"]["invalid_arguments"] == [ids[5]]
    assert tools["examples"]["undeclared"] == [ids[6]]
    assert tools["examples"]["unbalanced"] == [ids[7]]
    warnings = report(repo.engine, "edges")["warnings"]
    assert "2 generations of `edge` lack `</think>` (1 cut by length, 1 stopped without it)" in (
        warnings
    )
    assert f"11% of `edge` truncated at {cut_length:,} tokens (1 of 9 generations)" in warnings
    assert "1 generation of `edge` has an empty answer" in warnings
    assert any(w.startswith("1 of 5 tool calls of `edge` has arguments that are not JSON")
               for w in warnings)  # fmt: skip


def test_the_reasoning_spread_reaches_its_longest_reasoning(repo: Repository) -> None:
    record_edges(repo, max_new=len(EDGES[3][1]))
    document = report(repo.engine, "edges")
    longest = max(split_reasoning(output, THINK_END).reasoning_tokens for _, output, _, _ in EDGES)
    assert longest > 0
    for figures in (document["datasets"][0], document["total"]):
        assert figures["reasoning"]["reasoning_tokens"]["max"] == longest


def test_the_scatter_plot_says_whether_it_sampled(repo: Repository) -> None:
    record_edges(repo, max_new=len(EDGES[3][1]))
    whole = collected(repo.engine, "edges")
    assert len(whole.points) == len(EDGES)  # fewer generations than the plot draws
    title = prompt_vs_completion(whole).axes[0].get_title()
    assert title == f"Prompt vs completion (all {len(EDGES)} generations)"
    fewer = dataclasses.replace(whole, points=whole.points[:4])
    title = prompt_vs_completion(fewer).axes[0].get_title()
    assert title == f"Prompt vs completion (a seeded sample of 4 of {len(EDGES)} generations)"


def test_every_table_of_the_page_scrolls_in_a_box_of_its_own(repo: Repository) -> None:
    record_edges(repo, max_new=len(EDGES[3][1]))
    page = html.page(collected(repo.engine, "edges"), {})
    tables = re.findall(r"(.{0,40})<table>", page)
    assert len(tables) == 4  # lengths, reasoning, tool calls, cache and latency
    assert all(before.endswith('<div class="scroll">') for before in tables)
    assert page.count("</table></div>") == len(tables)
    style = re.search(r"\.scroll \{([^}]*)\}", page)
    assert style is not None and "overflow-x: auto" in style.group(1)


def test_a_run_without_generations_is_an_honest_empty_report(repo: Repository) -> None:
    spec = RunSpec("empty", str(TOKENIZER_DIR), "a" * 64, "b" * 64, "tiny", think_end_id=THINK_END)
    run_id = repo.ensure_run(spec)
    dataset_id = repo.ensure_dataset(run_id, DatasetSpec("d", "x", {"max_new_tokens": 8}))
    repo.insert_jobs(dataset_id, [NewJob(i, [1, 2, i], {"messages": []}) for i in range(3)])
    repo.ensure_dataset(run_id, DatasetSpec("nothing", "x", {"max_new_tokens": 8}))
    document = report(repo.engine, "empty")
    assert document["warnings"] == [] and document["token_checks"] is None
    assert document["total"]["generations"] == 0
    assert document["total"]["jobs"] == {"queued": 3, "total": 3}
    assert document["total"]["completion_tokens"]["p50"] is None
    assert [d["dataset"] for d in document["datasets"]] == ["d", "nothing"]
    assert document["datasets"][1]["jobs"] == {"total": 0}


def test_a_prompt_holding_nul_beside_an_escaped_quote_is_read_with_its_tools(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    # Postgres refuses to unescape \u0000 in a json string that also holds another escape
    # (a decoded model answer can hold NUL): `show` and `stats` read the tools all the same.
    from models.stats import StatsQueries
    from tests.helpers import enqueue_file, write_jsonl

    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    row = {"messages": [{"role": "user", "content": 'say "hi"\u0000 now'}], "tools": tools}
    assert enqueue_file(settings, write_jsonl(tmp_path / "nul.jsonl", [row])).accepted == 1
    [job_id] = repo.job_ids()
    detail = StatsQueries(repo.engine).detail(job_id)
    assert detail is not None and detail.tools == tools
