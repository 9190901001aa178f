"""A process frozen inside a transaction that holds a dataset's ledger row (SIGSTOP: a VM
pause, a swap storm) does not stall the other workers of that dataset."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from core.settings import Settings
from models.repository import Repository
from models.states import JobState
from tests.helpers import enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.integration.test_pipeline import worker

# A transaction that writes a dataset's ledger row (a worker's release of a job, `budget
# set`), frozen between that UPDATE and its COMMIT: the session is idle in a transaction
# holding the dataset row's lock.
FREEZE = """
import os, signal, sys
from sqlalchemy import text
from core.settings import Settings
from worker.runner import worker_engine
engine = worker_engine(sys.argv[1], Settings())
conn = engine.connect()
conn.begin()
conn.execute(text("UPDATE datasets SET reserved_tokens = reserved_tokens"))
print("holding", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_frozen_session_holding_the_ledger_row_stalls_no_other_worker(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    assert settings.database_url is not None
    # Stored and published; no worker runs yet.
    enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(20)), max_new_tokens=16)
    frozen = subprocess.Popen(
        [sys.executable, "-c", FREEZE, settings.database_url],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert frozen.stdout is not None and frozen.stdout.readline().strip() == "holding"
        _wait_stopped(frozen.pid)
        started = time.monotonic()
        with worker(settings):
            states = wait_settled(repo, timeout_s=60)
        elapsed = time.monotonic() - started
        # Still frozen all along: the others went on without it.
        assert _state(frozen.pid) == "T"
    finally:
        frozen.kill()
        frozen.wait()
        if frozen.stdout is not None:
            frozen.stdout.close()
    assert states[JobState.DONE.value] == 20
    assert elapsed < 60


def _state(pid: int) -> str:
    """The process's state letter in /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 10
    while _state(pid) != "T":
        assert time.monotonic() < deadline, "the freezing process did not stop"
        time.sleep(0.02)
