"""Ctrl-C during `eaglegen enqueue`: it says how many jobs it stored (as Postgres holds them)
and that the same command goes on, and exits 130."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR
from tests.e2e.test_cli import service_env
from tests.helpers import InspectRepository

# Long enough that the enqueue still runs once its first batches are stored, on any machine.
ROWS = 200_000


def test_ctrl_c_says_how_many_jobs_are_stored_and_exits_130(
    settings: Settings, repo: InspectRepository, tmp_path: Path
) -> None:
    path = tmp_path / "big.jsonl"
    with path.open("w") as out:
        for i in range(ROWS):
            out.write(f'{{"prompt": "question number {i}"}}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLEGEN_")}
    env.update(service_env(settings), COLUMNS="200")
    command = [
        *(sys.executable, "-m", "eaglegen", "enqueue", str(path)),
        *("--run", "r", "--dataset", "chat", "--tokenizer", str(TOKENIZER_DIR)),
    ]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not repo.job_ids() and process.poll() is None:
            assert time.monotonic() < deadline, "no job stored within 120 s"
            time.sleep(0.05)
        assert process.poll() is None, f"done before it could be interrupted: {ROWS} rows"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    stored = len(repo.job_ids())
    assert process.returncode == 130, stderr
    assert 0 < stored < ROWS
    said = re.search(r"interrupted: ([\d,]+) jobs of 'chat' stored", stderr)
    assert said, stderr
    assert int(said.group(1).replace(",", "")) == stored, stderr
    assert "run the same command again to go on" in stderr, stderr
    assert "Traceback" not in stderr, stderr
