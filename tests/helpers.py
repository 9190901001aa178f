"""Small helpers shared by integration and e2e tests."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from eaglegen.assets import SAMPLE_DATASET, TOKENIZER_DIR
from eaglegen.queue import make_celery
from eaglegen.sampling import complete
from eaglegen.settings import Settings
from models.db import make_engine
from models.repository import Repository
from producer.enqueue import EnqueueRequest, EnqueueSummary, enqueue
from producer.template import Templater


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
) -> EnqueueSummary:
    """Enqueue ``path`` with the bundled tokenizer, as `eaglegen enqueue` does."""
    assert settings.database_url is not None
    templater = Templater(TOKENIZER_DIR)
    engine = make_engine(settings.database_url, pool_size=2)
    app = make_celery(settings)
    try:
        params = complete({"max_new_tokens": max_new_tokens}, templater.stop_token_ids())
        request = EnqueueRequest(run=run, dataset=dataset, path=path, sampling_params=params)
        return enqueue(Repository(engine), app, settings.queue, templater, request)
    finally:
        engine.dispose()
        app.close()


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
