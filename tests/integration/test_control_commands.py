"""Control commands never wait on a lock without limit: they retry with a message, and a
client that goes away leaves no server session waiting behind it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import psycopg
import pytest

from core.settings import Settings
from core.urls import libpq_url
from tests.helpers import enqueue_file, sample_rows, write_jsonl
from tests.integration.test_worker_processes import worker_env


def _libpq(settings: Settings) -> str:
    assert settings.database_url is not None
    return libpq_url(settings.database_url)


@contextmanager
def ledger_row_locked(settings: Settings) -> Iterator[psycopg.Connection]:
    """Another session holds every dataset row (a stuck or frozen one)."""
    with psycopg.connect(_libpq(settings)) as conn:
        conn.execute("SELECT id FROM datasets FOR UPDATE")
        yield conn
        conn.rollback()


def _waiting_sessions(settings: Settings) -> int:
    """Server sessions of this database waiting for a lock."""
    with psycopg.connect(_libpq(settings), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone()
    return int(row[0]) if row else 0


def run_until_it_retries(
    env: dict[str, str], holder: psycopg.Connection, *args: str
) -> subprocess.CompletedProcess[str]:
    """Run `eaglegen ARGS` while ``holder`` holds the rows; release them once the command has
    said it is retrying (its first lock wait ran out), however long it took to get there."""
    command = [sys.executable, "-m", "eaglegen", *args]
    lines: list[str] = []
    retrying = threading.Event()

    def read(stream: IO[str]) -> None:
        for line in stream:
            lines.append(line)
            if "retrying" in line:
                retrying.set()

    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:  # closes both pipes at exit
        assert process.stdout is not None and process.stderr is not None
        reader = threading.Thread(target=read, args=(process.stderr,))
        reader.start()
        try:
            assert retrying.wait(120), "the command never said it was retrying"
        finally:
            holder.rollback()
            stdout = process.stdout.read()
            process.wait(timeout=120)
            reader.join()
    return subprocess.CompletedProcess(command, process.returncode, stdout, "".join(lines))


def test_an_interrupted_budget_set_leaves_no_session_waiting(
    settings: Settings, tmp_path: Path
) -> None:
    enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(3)))
    env = worker_env(settings, [])
    with ledger_row_locked(settings):
        command = [sys.executable, "-m", "eaglegen", "budget", "set", "d", "10M"]
        client = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while _waiting_sessions(settings) == 0:
            assert time.monotonic() < deadline, "budget set never waited for the lock"
            time.sleep(0.05)
        client.kill()  # Ctrl-C, a closed terminal: Postgres does not see the client leave
        client.wait()
        assert client.stderr is not None
        client.stderr.close()
        # Its session gives up by itself (lock_timeout), while the lock is still held.
        deadline = time.monotonic() + 10
        while _waiting_sessions(settings):
            assert time.monotonic() < deadline, "a session still waits for the client gone"
            time.sleep(0.1)


@pytest.mark.embedded
def test_budget_set_gets_a_lock_held_for_a_while_by_retrying(
    settings: Settings, tmp_path: Path
) -> None:
    enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(3)))
    env = worker_env(settings, [])
    with ledger_row_locked(settings) as holder:
        result = run_until_it_retries(env, holder, "budget", "set", "d", "10M")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stderr.split())
    assert "dataset 'd' is busy; retrying for up to 30 s" in text
    assert "d: budget 10.0M" in text


def test_reconcile_waits_out_a_held_ledger_row_by_retrying(
    settings: Settings, tmp_path: Path
) -> None:
    # A job whose worker died: re-queueing it settles its dataset's ledger row, held here.
    enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(1)))
    with psycopg.connect(_libpq(settings), autocommit=True) as conn:
        conn.execute(
            "UPDATE jobs SET state = 'running', attempts = 1, worker = 'gone',"
            " lease_until = now() - interval '1 minute'"
        )
    env = worker_env(settings, [])
    with ledger_row_locked(settings) as holder:
        result = run_until_it_retries(env, holder, "reconcile", "--json")
    assert result.returncode == 0, result.stderr
    assert "a job or dataset row is busy; retrying" in " ".join(result.stderr.split())
    assert json.loads(result.stdout)["expired_leases"] == 1
