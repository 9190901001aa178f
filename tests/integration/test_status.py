"""`eaglegen status --json` against a real run: every figure recomputed from the rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from core.settings import Settings
from core.urls import redact
from eaglegen.report.progress import MIN_SPAN_S
from eaglegen.stack import free_port
from models.records import DatasetSpec, NewJob, RunSpec
from models.repository import Repository
from models.states import JobState
from producer.commands import run_enqueue
from producer.plan import DatasetPlan, RunPlan
from tests.e2e.test_cli import eaglegen
from tests.helpers import (
    InspectRepository,
    enqueue_file,
    sample_rows,
    wait_settled,
    write_jsonl,
)
from tests.integration.test_pipeline import worker
from tests.outage import Lines, outage


def status_json(settings: Settings, *args: str) -> dict[str, Any]:
    services = settings.services()
    env = {
        "EAGLEGEN_DATABASE_URL": services.database_url,
        "EAGLEGEN_BROKER_URL": services.broker_url,
    }
    done = eaglegen("status", "--json", *args, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def rows_by_dataset(repo: Repository) -> dict[str, list[dict[str, Any]]]:
    """Every job of every dataset with its generation's figures, straight from the tables."""
    with repo.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT d.name AS dataset, j.state, g.prompt_tokens, g.completion_tokens,"
                " g.server, g.created_at, g.e2e_latency"
                " FROM jobs j JOIN datasets d ON d.id = j.dataset_id"
                " LEFT JOIN generations g ON g.job_id = j.id"
            )
        ).all()
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(row.dataset, []).append(dict(row._mapping))
    return out


def within(rows: list[dict[str, Any]], now: datetime, seconds: int) -> list[dict[str, Any]]:
    return [
        r for r in rows if r["created_at"] and r["created_at"] > now - timedelta(seconds=seconds)
    ]


def spans(rows: list[dict[str, Any]], now: datetime, seconds: int) -> tuple[float, float]:
    """The least and the most a window's rate may divide by: from the start of its earliest
    generation to now, at most the window, at least MIN_SPAN_S. Two bounds because the
    document's ``now`` is cut to the second (the true one is up to a second later)."""
    first = min(r["created_at"] - timedelta(seconds=r["e2e_latency"]) for r in rows)
    covered = (now - first).total_seconds()

    def clamp(value: float) -> float:
        return min(float(seconds), max(MIN_SPAN_S, value))

    return clamp(covered), clamp(covered + 1)


def test_status_figures_are_those_of_the_rows(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    # Two datasets side by side, one capped by a budget it reaches (its rest is skipped).
    rows = sample_rows(60)
    plan = RunPlan(
        run="run",
        tokenizer=Path(__file__).parents[2] / "eaglegen/assets/tokenizer",
        datasets=[
            DatasetPlan("open", write_jsonl(tmp_path / "a.jsonl", rows[:30]),
                        sampling={"max_new_tokens": 64}),
            DatasetPlan("capped", write_jsonl(tmp_path / "b.jsonl", rows[30:]),
                        sampling={"max_new_tokens": 64}, budget_tokens=300),
        ],
    )  # fmt: skip
    with worker(settings):
        run_enqueue(settings, settings.services(), plan, quiet=True)
        wait_settled(repo)
    document = status_json(settings, "--run", "run")
    now = datetime.fromisoformat(document["now"])
    truth = rows_by_dataset(repo)
    assert {d["dataset"] for d in document["datasets"]} == {"open", "capped"}
    for d in document["datasets"]:
        jobs = truth[d["dataset"]]
        done = [r for r in jobs if r["state"] == JobState.DONE.value]
        assert d["jobs"] == {
            **{s.value: sum(r["state"] == s.value for r in jobs) for s in JobState},
            "total": len(jobs),
        }
        assert d["prompt_tokens"] == sum(r["prompt_tokens"] for r in done)
        assert d["completion_tokens"] == sum(r["completion_tokens"] for r in done)
        for label, seconds in (("1m", 60), ("10m", 600)):
            recent = within(done, now, seconds)
            rate = d["rates"][label]
            # Over the time the work spans, not the whole window: the run is seconds old.
            low, high = spans(recent, now, seconds)
            assert low - 0.05 <= rate["span_s"] <= high + 0.05
            tokens = sum(r["completion_tokens"] for r in recent)
            close = 0.06 / rate["span_s"] + 1e-3  # span_s is rounded to 0.1 s
            assert rate["completion_tok_s"] == pytest.approx(tokens / rate["span_s"], rel=close)
            assert rate["completions_per_min"] == pytest.approx(
                len(recent) * 60 / rate["span_s"], rel=close
            )
        if d["rates"]["1m"]["span_s"] < 60:  # all of it within the last minute
            assert d["rates"]["10m"] == d["rates"]["1m"]
        assert d["remaining_jobs"] == 0 and d["eta_s"] == 0
    capped = next(d for d in document["datasets"] if d["dataset"] == "capped")
    assert capped["jobs"]["skipped_budget"] > 0 and capped["finished"] == "budget reached"
    assert capped["budget"]["used"] == capped["completion_tokens"]
    assert capped["budget"]["left"] == 300 - capped["completion_tokens"]
    # The default policy, reserving the worst case until it has enough answers.
    assert (capped["budget"]["reserve"], capped["budget"]["reserve_per_job"]) == ("observed", 64)
    opened = next(d for d in document["datasets"] if d["dataset"] == "open")
    assert opened["finished"] == "all jobs done" and opened["budget"]["left"] is None
    # Per server: what the generations of the last minute say.
    every = [r for jobs in truth.values() for r in jobs if r["state"] == "done"]
    for server in document["servers"]:
        recent = [r for r in within(every, now, 60) if r["server"] == server["name"]]
        low, high = spans(recent, now, 60)
        tokens = sum(r["completion_tokens"] for r in recent)
        assert tokens / high <= server["completion_tok_s_1m"] <= tokens / low
    assert {s["name"] for s in document["servers"]} == {r["server"] for r in every}
    [run] = document["runs"]
    assert run["finished"] == "every dataset finished"
    assert run["jobs"]["total"] == 60 == document["jobs"]["total"]
    assert InspectRepository(repo.engine).audit(lease_grace_s=60) == []


def test_failed_attempts_show_by_server_and_class(settings: Settings, repo: Repository) -> None:
    run_id = repo.ensure_run(RunSpec("r", "tok", "a", "b", "m"))
    dataset = repo.ensure_dataset(run_id, DatasetSpec("d", "s", {"max_new_tokens": 8}))
    ids = repo.insert_jobs(dataset, [NewJob(i, [1, 2, i + 3], {}) for i in range(4)])
    for job_id, kind in zip(ids[:3], ("timeout", "timeout", "http_5xx"), strict=True):
        assert repo.claim(job_id, "w", 60).outcome == "claimed"
        assert repo.release(job_id, "w", "boom", server="gpu-a", kind=kind)
    assert repo.claim(ids[3], "w", 60).outcome == "claimed"
    assert repo.fail(ids[3], "w", "bad", server="gpu-b", kind="invalid_response")
    # A lapsed lease blames no server; lapses in two datasets add up.
    other = repo.ensure_dataset(run_id, DatasetSpec("e", "s", {"max_new_tokens": 8}))
    [elsewhere] = repo.insert_jobs(other, [NewJob(0, [9, 9, 9], {})])
    for job_id in (ids[0], elsewhere):
        assert repo.claim(job_id, "w", 60).outcome == "claimed"
    with repo.engine.begin() as conn:
        conn.execute(text("UPDATE jobs SET lease_until = now() - interval '1 s'"))
    assert sorted(repo.expire_leases(max_attempts=5)) == sorted([ids[0], elsewhere])
    # A shutdown's release is no failure of the attempt.
    assert repo.claim(ids[1], "w", 60).outcome == "claimed"
    assert repo.release(ids[1], "w", "worker stopping", refund=True)
    document = status_json(settings)
    servers = {s["name"]: s["errors"] for s in document["servers"]}
    assert servers == {"gpu-a": {"timeout": 2, "http_5xx": 1}, "gpu-b": {"invalid_response": 1}}
    assert document["errors_without_server"] == {"lease_expired": 2}
    [d, _] = document["datasets"]
    assert d["jobs"]["queued"] == 3 and d["jobs"]["failed"] == 1
    assert d["eta_s"] is None and d["finished"] is None  # nothing done lately: unknown
    assert InspectRepository(repo.engine).audit(lease_grace_s=60) == []


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, timeout_s: float = 30.0) -> Samples:
    """Every sample of the exporter's /metrics, by name and labels (waits for it to serve)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            body = httpx.get(url, timeout=5).text
            break
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def serve_metrics(command: str, database_url: str) -> tuple[Samples, str]:
    """Start ``eaglegen <command>`` on a free port, scrape it once, stop it: the samples and
    what it printed; it exits 0 on SIGTERM."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLEGEN_")}
    env["EAGLEGEN_DATABASE_URL"] = database_url
    process = subprocess.Popen(
        [sys.executable, "-m", "eaglegen", command, "--port", str(port)],
        env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        samples = scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    return samples, stderr


def test_metrics_serves_the_status_figures_and_the_old_name_warns(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    with worker(settings):
        enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(20)), dataset="chat")
        wait_settled(repo)
    truth = rows_by_dataset(repo)["chat"]
    samples, stderr = serve_metrics("metrics", settings.services().database_url)
    key = (("dataset", "chat"), ("run", "run"))
    done = [r for r in truth if r["state"] == "done"]
    assert samples[("eaglegen_dataset_jobs", (*key, ("state", "done")))] == len(done)
    assert samples[("eaglegen_dataset_completion_tokens_total", key)] == sum(
        r["completion_tokens"] for r in done
    )
    assert samples[("eaglegen_dataset_prompt_tokens_total", key)] == sum(
        r["prompt_tokens"] for r in done
    )
    assert samples[("eaglegen_dataset_eta_seconds", key)] == 0  # all done
    assert "warning" not in stderr
    # `exporter`, the command's old name, serves the same figures and says it was renamed.
    again, stderr = serve_metrics("exporter", settings.services().database_url)
    totals = [k for k in samples if k[0].endswith(("_jobs", "_tokens_total"))]
    assert totals and {k: again[k] for k in totals} == {k: samples[k] for k in totals}
    assert "`eaglegen exporter` is now `eaglegen metrics`" in stderr


def test_status_watch_says_postgres_is_gone_and_goes_on_until_it_is_back(
    settings: Settings, repo: Repository
) -> None:
    run_id = repo.ensure_run(RunSpec("r", "tok", "a", "b", "m"))
    dataset = repo.ensure_dataset(run_id, DatasetSpec("d", "s", {"max_new_tokens": 8}))
    repo.insert_jobs(dataset, [NewJob(i, [1, 2, i + 3], {}) for i in range(3)])
    url = settings.services().database_url
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLEGEN_")}
    env["EAGLEGEN_DATABASE_URL"] = url
    # stdout is a pipe, as under nohup or tee: each refresh is printed after the last.
    watch = subprocess.Popen(
        [sys.executable, "-m", "eaglegen", "status", "--watch", "--interval", "0.5"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert watch.stdout is not None and watch.stderr is not None
    lines = Lines(watch.stdout)

    def view(line: str) -> bool:
        return line.startswith("run r: ") and "0 of 3 jobs done" in line

    try:
        lines.next_matching(view, "a view")
        with outage(url):
            lost = [
                lines.next_matching(lambda line: "unreachable since" in line, "the outage")
                for _ in range(3)  # refresh after refresh: it goes on
            ]
        back = lines.next_matching(view, "a view again")
    finally:
        watch.send_signal(signal.SIGINT)
        code = watch.wait(timeout=60)
        stderr = watch.stderr.read()
        watch.stderr.close()
        lines.close()
    assert code == 0, stderr
    assert "Traceback" not in stderr and stderr.strip() == "", stderr
    redacted = redact(url)
    for line in lost:
        assert f"Postgres at {redacted} unreachable since" in line
        assert "retrying every 0.5 s until it answers or Ctrl-C" in line
    # The same outage: one "since" for all its refreshes.
    assert len({line.split(" since ", 1)[1].split(" (", 1)[0] for line in lost}) == 1
    assert any("not currently accepting connections" in line for line in lost)
    assert "0 of 3 jobs done" in back
