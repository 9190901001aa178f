"""An enqueue killed mid-run and run again: every prompt one job, published once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from bench.procs import live_children
from core.broker import Publisher, waiting_job_ids
from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR
from models.repository import Repository
from tests.faults.harness import state_counts, wait_for, worker_env
from tests.helpers import PasswordRedis
from worker.feeder import Feeder

pytestmark = pytest.mark.faults

PROMPTS = 40_000
KILL_AFTER_JOBS = 5_000


def write_prompts(path: Path, n: int) -> Path:
    """``n`` distinct short chat prompts as JSONL."""
    with path.open("w") as handle:
        for i in range(n):
            row = {"messages": [{"role": "user", "content": f"Question {i}: why is {i} odd?"}]}
            handle.write(json.dumps(row) + "\n")
    return path


@pytest.mark.parametrize("workers", ["0", "2"])
def test_an_enqueue_killed_mid_run_is_finished_by_a_rerun(
    fast_settings: Settings, repo: Repository, tmp_path: Path, workers: str
) -> None:
    path = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    command = [
        *(sys.executable, "-m", "eaglegen", "enqueue", "--json", "--workers", workers),
        *("--run", "r", "--dataset", "d", "--tokenizer", str(TOKENIZER_DIR), str(path)),
    ]
    env = worker_env(fast_settings)
    # Its own session: the kill reaches the enqueue and its template workers at once.
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(
            lambda: state_counts(repo)["queued"] >= KILL_AFTER_JOBS,
            120,
            f"{KILL_AFTER_JOBS} jobs stored",
            lambda: f"enqueue exit code: {first.poll()}",
        )
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    stored_at_kill = state_counts(repo)["queued"]
    assert KILL_AFTER_JOBS <= stored_at_kill < PROMPTS

    rerun = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert rerun.returncode == 0, rerun.stderr
    document = json.loads(rerun.stdout)
    assert (document["accepted"], document["duplicates"]) == (
        PROMPTS - stored_at_kill,
        stored_at_kill,
    )

    assert fast_settings.broker_url is not None
    client = redis.Redis.from_url(fast_settings.broker_url)
    publisher = Publisher(fast_settings.broker_url, fast_settings.queue)
    try:
        job_ids = repo.job_ids()
        assert len(job_ids) == PROMPTS  # every prompt once: nothing lost, nothing twice
        # The enqueue published nothing; the feeder publishes each stored job once.
        assert client.llen(fast_settings.queue) == 0
        feeder = Feeder(repo, client, publisher, window=2 * PROMPTS)
        assert [feeder.feed().published for _ in range(2)] == [PROMPTS, 0]
        assert waiting_job_ids(client, fast_settings.queue) == set(job_ids)
        assert client.llen(fast_settings.queue) == PROMPTS  # one message per job
    finally:
        publisher.close()
        client.close()


def template_workers(enqueue: int) -> list[int]:
    """The template worker processes of an enqueue: forked from it (its command line), or
    the children of its fork server."""
    children = live_children()
    own = Path(f"/proc/{enqueue}/cmdline").read_bytes()
    workers: list[int] = []
    for pid in children.get(enqueue, []):
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"forkserver" in command:
            workers.extend(children.get(pid, []))
        elif command == own:
            workers.append(pid)
    return workers


def test_a_template_worker_killed_mid_run_is_a_clear_error(
    fast_settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    path = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    command = [
        *(sys.executable, "-m", "eaglegen", "enqueue", "--workers", "2"),
        *("--run", "r", "--dataset", "d", "--tokenizer", str(TOKENIZER_DIR), str(path)),
    ]
    with subprocess.Popen(
        command, env=worker_env(fast_settings), stderr=subprocess.PIPE, text=True
    ) as enqueue:
        wait_for(
            lambda: state_counts(repo)["queued"] >= KILL_AFTER_JOBS,
            120,
            f"{KILL_AFTER_JOBS} jobs stored",
            lambda: f"enqueue exit code: {enqueue.poll()}",
        )
        workers = template_workers(enqueue.pid)
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        _, stderr = enqueue.communicate(timeout=120)
    assert enqueue.returncode == 2
    assert stderr.strip().startswith("error: a template worker process died"), stderr
    assert "Traceback" not in stderr


def test_redis_lost_mid_run_does_not_stop_the_enqueue(
    fast_settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    # Redis carries only the feeder's window, so the enqueue needs it for nothing but a
    # wake-up call: a lost Redis is one warning, every job is stored, and the warning names
    # no password (given in the query).
    broker = PasswordRedis(tmp_path, "RdS3cretPW")
    env = {**worker_env(fast_settings), "EAGLEGEN_BROKER_URL": broker.start()}
    path = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    command = [
        *(sys.executable, "-m", "eaglegen", "enqueue"),
        *("--run", "r", "--dataset", "d", "--tokenizer", str(TOKENIZER_DIR), str(path)),
    ]
    try:
        with subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True) as enqueue:
            wait_for(
                lambda: state_counts(repo)["queued"] >= KILL_AFTER_JOBS,
                120,
                f"{KILL_AFTER_JOBS} jobs stored",
                lambda: f"enqueue exit code: {enqueue.poll()}",
            )
            broker.stop()
            _, stderr = enqueue.communicate(timeout=120)
    finally:
        broker.stop()
    assert enqueue.returncode == 0, stderr
    assert stderr.count("warning:") == 1 and "Redis refused to wake the feeder" in stderr
    assert "RdS3cretPW" not in stderr
    assert "Traceback" not in stderr
    assert state_counts(repo)["queued"] == PROMPTS
