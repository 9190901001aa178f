"""Small helpers shared by integration and e2e tests."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from eaglegen.assets import SAMPLE_DATASET, TOKENIZER_DIR
from eaglegen.settings import Settings
from models.repository import Repository
from producer.commands import run_enqueue
from producer.plan import DatasetPlan, RunPlan
from producer.rows import to_prompt
from producer.stats import DatasetStats


def sample_rows(n: int) -> list[dict[str, Any]]:
    """The first ``n`` rows of the bundled sample dataset."""
    with SAMPLE_DATASET.open() as handle:
        return [json.loads(line) for _, line in zip(range(n), handle, strict=False)]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """Write rows (objects or raw strings) as JSONL."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def enqueue_file(
    settings: Settings,
    path: Path,
    *,
    run: str = "run",
    dataset: str = "d",
    max_new_tokens: int = 256,
    **plan: Any,
) -> DatasetStats:
    """Enqueue ``path`` with the bundled tokenizer, as `eaglegen enqueue` does."""
    report = run_enqueue(
        settings,
        RunPlan(
            run=run,
            tokenizer=TOKENIZER_DIR,
            datasets=[DatasetPlan(dataset, path, sampling={"max_new_tokens": max_new_tokens})],
            **plan,
        ),
        quiet=True,
    )
    [stats] = report.datasets
    return stats


def wait_settled(repo: Repository, timeout_s: float = 120.0) -> dict[str, int]:
    """Poll until no job is queued or running; the final counts by state."""
    deadline = time.monotonic() + timeout_s
    while True:
        states: dict[str, int] = {}
        for counts in repo.counts():
            for state, n in counts.states.items():
                states[state] = states.get(state, 0) + n
        if states and states.get("queued", 0) + states.get("running", 0) == 0:
            return states
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs not settled after {timeout_s} s: {states}")
        time.sleep(0.1)


def reference_ids(tokenizer: Any, row: dict[str, Any], **template_kwargs: Any) -> list[int]:
    """What transformers' apply_chat_template gives for the row: the ground truth."""
    prompt = to_prompt(row)
    ids = tokenizer.apply_chat_template(
        prompt.messages,
        tools=prompt.tools,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **template_kwargs,
    )
    return list(ids)
