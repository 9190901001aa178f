"""Several samples per prompt and sampling variants (issue 31), through a real enqueue, a
real worker and the simulator, for two families' real chat templates and tokens.

That a sample's seed reached the server is checked by the simulator's own answer: its
output is a function of the prompt ids, the sampling params and the ``sampling_seed``, so
asking it again with what the job stored must give the recorded ids exactly.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import aliased
from transformers import AutoTokenizer

from core.samples import Variant, request_params, variants_of
from core.settings import ServerSpec, Settings
from eaglegen.report.status import status_document
from eaglegen.sim import SimConfig, SimServer
from exporter.export import ExportRequest, prepare, run_export
from exporter.layouts import JSONL, TOKENS
from exporter.manifest import Options
from exporter.rows import EXTRA_SAMPLE, Filters
from models.repository import Repository
from models.schema import Conversation, Dataset, Generation, Job
from producer.commands import run_enqueue
from producer.plan import DatasetPlan, RunPlan
from producer.stats import DatasetStats
from tests.helpers import wait_settled, write_jsonl
from tests.integration.test_conversations import ROWS as CHATS
from tests.integration.test_conversations import wait_conversations
from tests.integration.test_families_end_to_end import tokenizer_folder
from tests.integration.test_families_pipeline import stats_document
from tests.workers import in_thread_worker

FAST: dict[str, Any] = {
    "decode_step_ms": 0.2,
    "decode_ms_per_request": 0.0,
    "mean_output_tokens": 30,
    "max_output_tokens": 120,
}
QUESTIONS = [{"messages": [{"role": "user", "content": f"Question {i}?"}]} for i in range(12)]


def enqueue(
    settings: Settings,
    path: Path,
    tokenizer: Path,
    *,
    samples: int | None = None,
    variants: tuple[Variant, ...] | None = None,
    turns: str = "last",
    budget: int | None = None,
    max_new_tokens: int = 64,
    order_seed: int = 7,
) -> DatasetStats:
    """`eaglegen enqueue` of one dataset ``d`` of run ``run``; the run's order seed fixed, so
    that the variants drawn (by the seed) are the same on every run of a test."""
    dataset = DatasetPlan(
        "d",
        path,
        sampling={"max_new_tokens": max_new_tokens},
        turns=turns,
        samples=samples,
        variants=variants,
        budget_tokens=budget,
    )
    report = run_enqueue(
        settings,
        settings.services(),
        RunPlan(run="run", tokenizer=tokenizer, datasets=[dataset], order_seed=order_seed),
        quiet=True,
    )
    [stats] = report.datasets
    return stats


@pytest.fixture(params=["kimi_k2", "qwen3"])
def family(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    return tokenizer_folder(tmp_path / "tok", str(request.param))


@pytest.fixture
def sim_url(family: Path) -> Iterator[str]:
    with SimServer(SimConfig(tokenizer_dir=family, **FAST)) as sim:
        yield sim.url


def served(settings: Settings, url: str, concurrency: int = 8) -> Settings:
    return settings.model_copy(
        update={"servers": [ServerSpec(name="sim", url=url)], "worker_concurrency": concurrency}
    )


_HOLDER = aliased(Job, name="holder")


def jobs_of(repo: Repository) -> list[dict[str, Any]]:
    """Every job with its prompt ids as a worker reads them (a sample holding none reads
    its holder's), its own stored ids, its sample columns and its output."""
    with repo.engine.connect() as conn:
        rows = conn.execute(
            select(
                Job.id,
                Job.row_index,
                Job.sample,
                Job.variant,
                Job.sampling_seed,
                Job.prompt_job,
                Job.prompt_of,
                Job.sort_key,
                Job.state,
                Job.conversation_id,
                Job.turn,
                Job.input_ids.label("own_ids"),
                func.coalesce(Job.input_ids, _HOLDER.input_ids).label("ids"),
                Dataset.sampling_params,
                Dataset.variants,
                Generation.output_ids,
                Generation.completion_tokens,
            )
            .join(Dataset, Dataset.id == Job.dataset_id)
            .outerjoin(_HOLDER, _HOLDER.id == Job.prompt_of)
            .outerjoin(Generation, Generation.job_id == Job.id)
            .order_by(Job.id)
        ).all()
    return [r._asdict() for r in rows]


def by_row(jobs: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    rows: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for job in jobs:
        rows[job["row_index"]].append(job)
    return {r: sorted(js, key=lambda j: j["sample"]) for r, js in rows.items()}


def asked_again(url: str, job: dict[str, Any]) -> list[int]:
    """What the simulator answers to the job's prompt, variant and seed."""
    params = request_params(
        job["sampling_params"], variants_of(job["variants"]), job["variant"], job["sampling_seed"]
    )
    answer = httpx.post(
        f"{url}/generate",
        json={"input_ids": list(job["ids"]), "sampling_params": params},
        timeout=30,
    )
    answer.raise_for_status()
    return list(answer.json()["output_ids"])


def test_k_samples_each_with_its_seed_reach_the_server_and_share_one_prompt(
    settings: Settings, family: Path, sim_url: str, repo: Repository, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    stats = enqueue(settings, path, family, samples=4)
    assert stats.accepted == 4 * len(QUESTIONS)
    with in_thread_worker(served(settings, sim_url)):
        states = wait_settled(repo)
    assert states["done"] == 4 * len(QUESTIONS), states
    rows = by_row(jobs_of(repo))
    assert len(rows) == len(QUESTIONS)
    differing = 0
    for samples in rows.values():
        first = samples[0]
        assert [j["sample"] for j in samples] == [0, 1, 2, 3]
        assert len({j["sampling_seed"] for j in samples}) == 4
        # The prompt's ids are stored once, by sample 0; the others name it.
        assert first["own_ids"] is not None and first["prompt_of"] is None
        for j in samples[1:]:
            assert j["own_ids"] is None
            assert j["prompt_of"] == first["id"] and j["prompt_job"] == first["id"]
            assert list(j["ids"]) == list(first["ids"])
        # Every sample of a prompt takes the same place in the publishing order.
        assert len({j["sort_key"] for j in samples}) == 1
        for j in samples:
            assert list(j["output_ids"]) == asked_again(sim_url, j)
        differing += len({tuple(j["output_ids"]) for j in samples}) > 1
    assert differing >= len(QUESTIONS) - 1  # seeds differ, so do the draws

    # The same enqueue again adds nothing.
    assert enqueue(settings, path, family, samples=4).accepted == 0


def test_raising_samples_adds_only_the_missing_ones_and_lowering_is_refused(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    family = tokenizer_folder(tmp_path / "tok", "qwen3")
    path = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    assert enqueue(settings, path, family, samples=2).accepted == 2 * len(QUESTIONS)
    before = {(j["row_index"], j["sample"]): j for j in jobs_of(repo)}
    assert enqueue(settings, path, family, samples=4).accepted == 2 * len(QUESTIONS)
    after = {(j["row_index"], j["sample"]): j for j in jobs_of(repo)}
    assert set(after) - set(before) == {(r, s) for r in range(len(QUESTIONS)) for s in (2, 3)}
    assert all(after[k]["id"] == before[k]["id"] for k in before)  # nothing re-created
    for (row, sample), job in after.items():
        if sample:
            assert job["prompt_of"] == after[(row, 0)]["id"]
    with pytest.raises(ValueError, match="asks 4 samples of each prompt; 3 would") as refused:
        enqueue(settings, path, family, samples=3)
    assert "nothing is deleted" in str(refused.value)
    assert len(jobs_of(repo)) == 4 * len(QUESTIONS)
    # Without `samples` the dataset keeps its own.
    assert enqueue(settings, path, family).accepted == 0
    with repo.engine.connect() as conn:
        assert conn.scalar(select(Dataset.samples)) == 4


THINK = Variant("think", 1.0, {"temperature": 0.6})
NO_THINK = Variant("nothink", 1.0, {"max_new_tokens": 16}, {"enable_thinking": False})


def test_variants_by_weight_a_thinking_off_prompt_of_its_own_reported_and_exported(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    family = tokenizer_folder(tmp_path / "tok", "qwen3")
    rows = [{"messages": [{"role": "user", "content": f"Tell me about {i}."}]} for i in range(30)]
    path = write_jsonl(tmp_path / "q.jsonl", rows)
    stats = enqueue(settings, path, family, samples=4, variants=(THINK, NO_THINK))
    assert stats.accepted == 4 * len(rows)
    hf = AutoTokenizer.from_pretrained(str(family), local_files_only=True)

    def reference(row: int, **kwargs: Any) -> list[int]:
        text = hf.apply_chat_template(
            rows[row]["messages"], add_generation_prompt=True, tokenize=False, **kwargs
        )
        return list(hf.encode(text, add_special_tokens=False))

    jobs = jobs_of(repo)
    drawn = Counter(j["variant"] for j in jobs)
    assert set(drawn) == {"think", "nothink"}
    assert 0.3 < drawn["nothink"] / len(jobs) < 0.7, drawn  # 120 draws at even weights
    for row, samples in by_row(jobs).items():
        for j in samples:
            kwargs = {"enable_thinking": False} if j["variant"] == "nothink" else {}
            assert list(j["ids"]) == reference(row, **kwargs)
        # Each distinct prompt of the row is stored once.
        stored = [j for j in samples if j["own_ids"] is not None]
        assert len(stored) == len({j["variant"] for j in samples})
    assert reference(0, enable_thinking=False) != reference(0)

    with SimServer(SimConfig(tokenizer_dir=family, **FAST)) as sim:
        with in_thread_worker(served(settings, sim.url)):
            assert wait_settled(repo)["done"] == len(jobs)
        done = jobs_of(repo)
        for j in done[:12]:
            assert list(j["output_ids"]) == asked_again(sim.url, j)
    assert max(j["completion_tokens"] for j in done if j["variant"] == "nothink") <= 16
    assert max(j["completion_tokens"] for j in done if j["variant"] == "think") > 16

    # stats: per variant; status: samples per prompt and the variants' shares.
    figures = {v["variant"]: v for v in stats_document(repo, "run")["variants"]}
    assert {k: v["done"] for k, v in figures.items()} == dict(drawn)
    assert figures["nothink"]["samples_per_prompt"] == 4
    [status] = status_document(repo.status(), None)["datasets"]
    assert (status["samples"], status["variants"]) == (4, {"think": 1.0, "nothink": 1.0})

    # Export: ids <prompt>_gen<k>, the variant in the row, every prompt in one split.
    out = export_rows(repo, tmp_path / "out", Filters(), val_fraction=0.5)
    assert len(out) == len(jobs)
    first = {j["id"]: j for j in done if j["sample"] == 0}
    splits: dict[int, set[str]] = defaultdict(set)
    for split, row in out:
        prompt, _, k = row["id"].partition("_gen")
        assert int(prompt) in first
        job = next(j for j in done if j["id"] == row["metadata"]["job_id"])
        assert (int(k), row["metadata"]["variant"]) == (job["sample"], job["variant"])
        assert row["input_ids"] == [*job["ids"], *job["output_ids"]]
        splits[int(prompt)].add(split)
    assert all(len(s) == 1 for s in splits.values())
    assert {s for found in splits.values() for s in found} == {"train", "val"}
    kept = export_rows(repo, tmp_path / "two", Filters(samples_per_prompt=2))
    assert Counter(row["id"].split("_gen")[1] for _, row in kept) == {
        "0": len(rows),
        "1": len(rows),
    }
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert manifest["counts"]["d"]["removed"][EXTRA_SAMPLE] == 2 * len(rows)


def export_rows(
    repo: Repository, out: Path, filters: Filters, val_fraction: float = 0.0
) -> list[tuple[str, dict[str, Any]]]:
    """(split, row) of a JSON Lines tokens export of run ``run``."""
    options = Options(JSONL, filters, val_fraction=val_fraction, seed=3, format=TOKENS)
    request = ExportRequest("run", out, options, 256_000_000)
    found, previous, _ = prepare(repo, request)
    run_export(repo, request, found, previous)
    return [
        (split.name, json.loads(line))
        for split in sorted(p for p in out.iterdir() if p.is_dir())
        for shard in sorted(split.glob("*.jsonl"))
        for line in shard.read_text().splitlines()
    ]


OFF = Variant("off", 1.0, {}, {"enable_thinking": False})


def test_each_sample_of_a_conversation_is_a_conversation_of_its_own(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    family = tokenizer_folder(tmp_path / "tok", "qwen3")
    path = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    stats = enqueue(
        settings, path, family, samples=2, variants=(THINK, OFF), turns="all", max_new_tokens=200
    )
    assert (stats.conversations, stats.accepted) == (6, 8)  # 3 rows x 2, 1 single x 2
    with SimServer(SimConfig(tokenizer_dir=family, **FAST)) as sim:
        with in_thread_worker(served(settings, sim.url)):
            with repo.engine.connect() as conn:
                dataset_id = int(conn.scalar(select(Dataset.id)))
            counts = wait_conversations(repo, dataset_id)
        assert counts.total == 6 and counts.turns_created > 6, counts
        with repo.engine.connect() as conn:
            conversations = conn.execute(
                select(Conversation.id, Conversation.row_index, Conversation.sample,
                       Conversation.variant, Conversation.sampling_seed,
                       Conversation.first_sample)
            ).all()  # fmt: skip
            messages = dict(conn.execute(select(Job.id, Job.messages)).all())
        firsts = {c.row_index: c.id for c in conversations if c.sample == 0}
        for c in conversations:
            assert c.first_sample == (None if c.sample == 0 else firsts[c.row_index])
        turns = [j for j in jobs_of(repo) if j["conversation_id"] is not None]
        assert any(j["turn"] for j in turns), "no conversation reached a later turn"
        of = {c.id: c for c in conversations}
        hf = AutoTokenizer.from_pretrained(str(family), local_files_only=True)
        for j in turns:  # every turn is sent with its conversation's sample, variant and seed
            c = of[j["conversation_id"]]
            assert (j["sample"], j["variant"], j["sampling_seed"]) == (
                c.sample,
                c.variant,
                c.sampling_seed,
            )
            if j["output_ids"] is not None:
                assert list(j["output_ids"]) == asked_again(sim.url, j)
            # Each turn, the later ones templated by the advancer too, with its variant's
            # template kwargs.
            kwargs = {"enable_thinking": False} if c.variant == "off" else {}
            stored = messages[j["id"]]
            text = hf.apply_chat_template(
                stored["messages"], tools=stored["tools"], add_generation_prompt=True,
                tokenize=False, **kwargs,
            )  # fmt: skip
            assert list(j["ids"]) == hf.encode(text, add_special_tokens=False)
        assert {c.variant for c in conversations} == {"think", "off"}
    out = export_rows(repo, tmp_path / "out", Filters())
    ids = {row["id"] for _, row in out}
    for c in conversations:
        assert f"{firsts[c.row_index]}_gen{c.sample}_turn0" in ids


def test_a_budget_holds_whole_prompts_with_all_their_samples(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    family = tokenizer_folder(tmp_path / "tok", "qwen3")
    rows = [{"messages": [{"role": "user", "content": f"Item {i}"}]} for i in range(60)]
    path = write_jsonl(tmp_path / "q.jsonl", rows)
    # About 25 prompts' four samples (FAST: 30 completion tokens on average).
    enqueue(settings, path, family, samples=4, budget=3_000)
    with (
        SimServer(SimConfig(tokenizer_dir=family, **FAST)) as sim,
        in_thread_worker(served(settings, sim.url, concurrency=4)),
    ):
        states = wait_settled(repo)
    assert states["skipped_budget"] > 0 and states["done"] > 0, states
    done = Counter(j["row_index"] for j in jobs_of(repo) if j["state"] == "done")
    partial = [r for r, n in done.items() if n < 4]
    # Samples of a prompt are next to each other in the order: the budget cuts between
    # prompts but for those in flight or deferred (their reservation did not fit) when it
    # ran out. Were each sample placed on its own, ~100 done jobs would be spread over
    # nearly all 60 prompts, hardly one whole.
    whole = len(done) - len(partial)
    assert whole >= 15 and len(partial) <= whole / 3, done
