"""Several samples per prompt and two variants under faults (issue 31): worker processes
killed with SIGKILL mid-run. Every sample must end done once, generated from its prompt's
ids (read through the sample that holds them) with its own seed and its variant's params."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from core.samples import Variant
from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR
from eaglegen.sim import SimServer
from models.repository import Repository
from tests.faults.harness import (
    Fleet,
    assert_exactly_once,
    kill_a_holder,
    report,
    state_counts,
    wait_for,
    wait_settled,
)
from tests.helpers import write_jsonl
from tests.integration.test_samples import asked_again, by_row, enqueue, jobs_of

pytestmark = pytest.mark.faults

ROWS = 150
SAMPLES = 4
VARIANTS = (
    Variant("warm", 2.0, {"temperature": 0.9}),
    Variant("short", 1.0, {"max_new_tokens": 8}),
)


def test_kill_9_workers_mid_run_of_samples_loses_and_duplicates_no_sample(
    fast_settings: Settings, repo: Repository, fleet: Fleet, sim: SimServer, tmp_path: Path
) -> None:
    started = time.monotonic()
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?"}]} for i in range(ROWS)]
    path = write_jsonl(tmp_path / "q.jsonl", rows)
    total = enqueue(
        fast_settings, path, TOKENIZER_DIR, samples=SAMPLES, variants=VARIANTS, max_new_tokens=256
    ).accepted  # answers long enough to be running when a worker is killed
    assert total == ROWS * SAMPLES
    fleet.start()
    fleet.start()
    rng = random.Random(31)
    orphans: list[int] = []
    for share in (0.2, 0.5):
        done = int(share * total)
        wait_for(lambda d=done: state_counts(repo)["done"] >= d, 120, f"{done} done", fleet.tails)
        orphans += kill_a_holder(fleet, repo)
        fleet.start()
    wait_settled(repo, fleet, timeout_s=180)
    assert_exactly_once(repo, total, fleet)
    assert orphans, "no kill caught a sample running: the test exercised nothing"
    jobs = jobs_of(repo)
    for samples in by_row(jobs).values():
        assert [j["sample"] for j in samples] == list(range(SAMPLES))
        assert len({j["sampling_seed"] for j in samples}) == SAMPLES
    # Retried or not, each sample is what its own prompt, variant and seed give.
    retried = set(orphans)
    checked = [j for j in jobs if j["id"] in retried] + rng.sample(jobs, 40)
    for job in checked:
        assert list(job["output_ids"]) == asked_again(sim.url, job), job["id"]
    assert max(j["completion_tokens"] for j in jobs if j["variant"] == "short") <= 8
    report(
        "samples, kill -9",
        jobs=total,
        running_at_kills=len(orphans),
        seconds=round(time.monotonic() - started, 1),
        **fleet.reconciler_totals(),
    )
