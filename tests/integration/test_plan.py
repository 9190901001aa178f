"""`eaglegen plan --json` against a real simulator and Postgres: the recommendation and the
ETA are recomputed here from the rows and the server's own facts."""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import text

from core.settings import ServerSpec, Settings
from eaglegen.assets import TOKENIZER_DIR
from eaglegen.sim import SimConfig, SimServer
from eaglegen.stack import free_port
from models.repository import Repository
from producer.commands import run_enqueue
from producer.plan import DatasetPlan, RunPlan
from tests.e2e.test_cli import eaglegen, service_env
from tests.helpers import enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.integration.test_pipeline import worker

MAX_NEW_A, MAX_NEW_B, BUDGET_B = 64, 128, 500
# A pool small enough that the KV, not max_running_requests, bounds the batch of the suite's
# short prompts.
SMALL = SimConfig(seed=5, kv_tokens=20_000, max_running_requests=256, decode_step_ms=0.5,
                  decode_ms_per_request=0.02)  # fmt: skip
DONE_SQL = (
    "SELECT g.prompt_tokens AS p, g.completion_tokens AS c, g.created_at, g.e2e_latency"
    " FROM generations g JOIN jobs j ON j.id = g.job_id"
)
_OF = "FROM jobs j JOIN datasets d ON d.id = j.dataset_id WHERE d.name ="
QUEUED_A_SQL = f"SELECT count(*) {_OF} 'a' AND j.state = 'queued'"
PROMPTS_B_SQL = f"SELECT j.prompt_tokens {_OF} 'b'"


def plan(settings: Settings, *args: str) -> tuple[dict[str, Any], str]:
    """The JSON document and the warnings of one `eaglegen plan`."""
    done = eaglegen("plan", "--json", *args, env=service_env(settings))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def rows(repo: Repository, sql: str) -> list[Any]:
    with repo.engine.connect() as conn:
        return list(conn.execute(text(sql)).all())


def enqueue_more(settings: Settings, tmp_path: Path) -> None:
    """20 more prompts for `a` and 20 for a new `b` under a budget, with no worker running."""
    every = sample_rows(70)
    run_enqueue(
        settings,
        settings.services(),
        RunPlan(
            run="run",
            tokenizer=TOKENIZER_DIR,
            datasets=[
                DatasetPlan("a", write_jsonl(tmp_path / "a.jsonl", every[:50]),
                            sampling={"max_new_tokens": MAX_NEW_A}),
                DatasetPlan("b", write_jsonl(tmp_path / "b.jsonl", every[50:]),
                            sampling={"max_new_tokens": MAX_NEW_B}, budget_tokens=BUDGET_B),
            ],
        ),
        quiet=True,
    )  # fmt: skip


def expected(repo: Repository, sim: SimServer, now: datetime) -> dict[str, float]:
    """The plan recomputed from the tables. The simulator's fast preset reserves every
    request's whole max_new_tokens (its ratio is 1 and M is under the clip), so a running
    request costs (P + M) slots per step; before its first generation `b` is its pending
    prompts with every answer max_new_tokens long."""
    done = rows(repo, DONE_SQL)
    queued_a = rows(repo, QUEUED_A_SQL)[0][0]
    prompts_b = [r[0] for r in rows(repo, PROMPTS_B_SQL)]
    steps = [max(r.c, 1) for r in done]
    per_step_a = sum(r.p * s + MAX_NEW_A * r.c for r, s in zip(done, steps, strict=True))
    per_step_a /= sum(steps)
    prompt_a = sum(r.p for r in done) / len(done)
    prompt_b = sum(prompts_b) / len(prompts_b)
    jobs_a, jobs_b = float(queued_a), min(len(prompts_b), BUDGET_B / MAX_NEW_B)
    steps_a, steps_b = jobs_a * sum(steps) / len(done), jobs_b * MAX_NEW_B
    footprint = (steps_a * per_step_a + steps_b * (prompt_b + MAX_NEW_B)) / (steps_a + steps_b)
    newcomer = jobs_a * (prompt_a + MAX_NEW_A) + jobs_b * (prompt_b + MAX_NEW_B)
    newcomer /= jobs_a + jobs_b
    recent = [r for r in done if r.created_at > now - timedelta(seconds=600)]
    tokens_a = queued_a * sum(r.c for r in done) / len(done)
    # Over the time the window's work spans: from the start of its earliest generation to
    # the plan's now, which the document gives to the second (so up to 1 s later).
    started = min(r.created_at - timedelta(seconds=r.e2e_latency) for r in recent)
    span = (now - started).total_seconds()
    tok_s_range = [sum(r.c for r in recent) / min(600.0, max(1.0, s)) for s in (span + 1, span)]
    return {
        "recommended": min(
            sim.config.max_running_requests,
            math.floor((sim.config.kv_tokens - newcomer) / footprint),
        ),
        "tokens_a": tokens_a,
        "tokens": tokens_a + min(len(prompts_b) * MAX_NEW_B, BUDGET_B),
        "tok_s_range": tok_s_range,
        "tokens_left": tokens_a + BUDGET_B,
    }


def test_the_plan_is_the_arithmetic_of_the_rows_and_the_servers_facts(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    with SimServer(SMALL) as sim:
        settings = settings.model_copy(update={"servers": [ServerSpec(name="sim", url=sim.url)]})
        with worker(settings):
            enqueue_file(settings, write_jsonl(tmp_path / "a0.jsonl", sample_rows(30)),
                         run="run", dataset="a", max_new_tokens=MAX_NEW_A)  # fmt: skip
            wait_settled(repo)
        enqueue_more(settings, tmp_path)
        check_plan(settings, repo, sim)


def check_plan(settings: Settings, repo: Repository, sim: SimServer) -> None:
    document, warnings = plan(settings, "run", "--server", f"sim={sim.url}")
    truth = expected(repo, sim, datetime.fromisoformat(document["now"]))
    [server] = document["servers"]
    assert server["max_total_num_tokens"] == sim.config.kv_tokens
    assert server["max_running_requests"] == sim.config.max_running_requests
    assert server["new_token_ratio"] == {"init": 1.0, "floor": 1.0}
    assert server["sources"]["ratio"] == "simulator"
    assert server["recommended"] == document["recommended_concurrency"] == truth["recommended"]
    assert server["limited_by"] == "kv"
    throughput = document["throughput"]
    assert throughput["source"] == "measured over the last 10m"
    low, high = truth["tok_s_range"]
    tok_s = throughput["completion_tok_s"]
    assert low - 0.001 <= tok_s <= high + 0.001, (tok_s, truth["tok_s_range"])
    assert document["remaining_completion_tokens"] == round(truth["tokens"])
    assert abs(document["eta_s"] - truth["tokens_left"] / tok_s) <= 0.1
    a, b = document["datasets"]
    assert (a["request"]["source"], b["request"]["source"]) == ("generations", "prior")
    assert a["remaining_completion_tokens"] == round(truth["tokens_a"])
    assert b["remaining_completion_tokens"] == BUDGET_B and b["budget_left"] == BUDGET_B
    assert a["eta_s"] == b["eta_s"] == document["eta_s"]  # side by side, they end together
    assert "no generation yet in b" in " ".join(warnings.split())

    # The flags win over the server and the measured rate.
    capped, _ = plan(settings, "run", "--server", f"sim={sim.url}",
                     "--max-running-requests", "10", "--tok-s", "50")  # fmt: skip
    assert capped["recommended_concurrency"] == 10
    assert capped["servers"][0]["limited_by"] == "max_running_requests"
    assert abs(capped["eta_s"] - truth["tokens"] / 50) <= 0.1


def test_foreseeable_failures_are_one_line_errors(
    settings: Settings, repo: Repository, sim: SimServer, tmp_path: Path
) -> None:
    env = service_env(settings)
    dead = f"http://127.0.0.1:{free_port()}"
    enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(5)), run="fresh")
    for args, says in [
        (("nope", "--server", sim.url), "error: run 'nope' not found"),
        (("fresh", "--server", dead), "answers neither /get_server_info"),
        (("fresh",), "no server to plan for"),
    ]:
        done = eaglegen("plan", *args, env=env)
        assert done.returncode == 2, done.stderr
        assert says in " ".join(done.stderr.split()) and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) <= 3  # one line, wrapped at most
    # No generation yet and no throughput: a plan all the same, its ETA unknown and said so.
    document, warnings = plan(settings, "--server", dead, "--kv-tokens", "159000")
    assert document["run"] == "fresh" and document["eta_s"] is None
    assert document["recommended_concurrency"] > 0
    assert "no completion in the last 10 minutes" in " ".join(warnings.split())
    table = eaglegen("plan", "--server", sim.url, env={**env, "COLUMNS": "200"})
    assert table.returncode == 0 and "recommended" in table.stdout and "ETA" in table.stdout
