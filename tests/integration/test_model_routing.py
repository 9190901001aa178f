"""A run's prompts go only to servers of its model; a run no server serves waits, saying why."""

from __future__ import annotations

import socket
import time
from dataclasses import replace
from pathlib import Path

from sqlalchemy import text

from core.settings import ServerSpec, Settings
from eaglegen.sim import SimConfig, SimServer
from models.repository import Repository
from tests.helpers import enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.integration.test_pipeline import worker

FAST = SimConfig(seed=3, decode_step_ms=0.5, decode_ms_per_request=0.02)


def by_run(repo: Repository) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for c in repo.counts():
        counts.setdefault(c.run, {k: 0 for k in c.states})
        for state, n in c.states.items():
            counts[c.run][state] += n
    return counts


def waiting_reasons(repo: Repository) -> list[str]:
    """Why run rc's jobs wait, as they say it."""
    with repo.engine.connect() as conn:
        return list(
            conn.scalars(
                text(
                    "SELECT DISTINCT jobs.last_error FROM jobs JOIN datasets"
                    " ON datasets.id = jobs.dataset_id JOIN runs ON runs.id = datasets.run_id"
                    " WHERE runs.name = 'rc' AND jobs.last_error IS NOT NULL"
                )
            ).all()
        )


def test_each_run_goes_to_a_server_of_its_model_and_an_unserved_run_waits(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    rows = sample_rows(30)
    with (
        SimServer(replace(FAST, model_path="org/model-a")) as a,
        SimServer(replace(FAST, model_path="/weights/model-b")) as b,
    ):
        servers = [ServerSpec(name="a", url=a.url), ServerSpec(name="b", url=b.url)]
        served = settings.model_copy(update={"servers": servers})
        with worker(served):
            for run, model, part in (
                ("ra", "org/model-a", rows[:10]),
                ("rb", "Model-B", rows[10:20]),  # the hub id's name, another case
                ("rc", "org/model-c", rows[20:]),  # no server serves it
            ):
                path = write_jsonl(tmp_path / f"{run}.jsonl", part)
                enqueue_file(served, path, run=run, model=model, max_new_tokens=64)
            deadline = time.monotonic() + 120
            # rc's jobs are offered and sent back with the reason while the others run.
            while (counts := by_run(repo))["ra"]["done"] + counts["rb"]["done"] < 20 or not (
                waiting_reasons(repo)
            ):
                assert time.monotonic() < deadline, counts
                time.sleep(0.2)
    assert counts["ra"]["done"] == counts["rb"]["done"] == 10
    assert by_run(repo)["rc"] == {**{k: 0 for k in counts["rc"]}, "queued": 10}
    with repo.engine.connect() as conn:
        servers_of = dict(
            conn.execute(
                text(
                    "SELECT runs.name, array_agg(DISTINCT generations.server) FROM generations"
                    " JOIN jobs ON jobs.id = generations.job_id"
                    " JOIN datasets ON datasets.id = jobs.dataset_id"
                    " JOIN runs ON runs.id = datasets.run_id GROUP BY runs.name"
                )
            ).all()
        )
    assert servers_of == {"ra": ["a"], "rb": ["b"]}
    for reason in waiting_reasons(repo):
        assert reason.startswith("waiting for a server of model 'org/model-c'")
        assert "a: run 'rc' wants model 'org/model-c', the server serves 'org/model-a'" in reason
        assert (
            "b: run 'rc' wants model 'org/model-c', the server serves '/weights/model-b'" in reason
        )


def test_a_server_that_never_answers_does_not_hold_up_the_others(
    settings: Settings, repo: Repository, sim: SimServer, tmp_path: Path
) -> None:
    # It accepts connections and says nothing: asking its model takes a full timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        servers = [
            ServerSpec(name="sim", url=sim.url),
            ServerSpec(name="silent", url=f"http://127.0.0.1:{silent.getsockname()[1]}"),
        ]
        # The health loop asks it with a timeout of 3 intervals (at most 60 s): 60 s here.
        served = settings.model_copy(update={"servers": servers, "health_interval_s": 20.0})
        with worker(served):
            started = time.monotonic()
            enqueue_file(served, write_jsonl(tmp_path / "d.jsonl", sample_rows(20)))
            # Jobs that waited for the silent server would wait out that timeout.
            states = wait_settled(repo, timeout_s=55)
            elapsed = time.monotonic() - started
    assert states["done"] == 20, f"{elapsed:.1f} s"
    with repo.engine.connect() as conn:
        assert conn.scalar(text("SELECT count(*) FROM jobs WHERE last_error IS NOT NULL")) == 0
