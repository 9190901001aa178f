"""A password given in a service URL, in the userinfo or the query, is never shown: not in a
worker's logs (start, reconnects), not by `eaglegen up` (text, --json, stack.json), not on
the command line of any process it starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from core.settings import Settings
from core.urls import redact
from eaglegen.sim import SimServer
from eaglegen.stack import free_port
from models.repository import Repository
from tests.helpers import PasswordRedis, enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.integration.test_worker_processes import live_pids, wait_for, worker_env, worker_process
from tests.workers import EACH_ENGINE

REDIS_SECRET = "RdS3cretPW"
PG_SECRET = "PgS3cretPW"


def with_query_password(url: str, password: str) -> str:
    """``url`` with ``password=`` added to its query (the local Postgres trusts anyway)."""
    return f"{url}{'&' if '?' in url else '?'}password={password}"


def command_lines() -> list[str]:
    """Every process's command line on this machine."""
    lines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue  # gone meanwhile
    return lines


@EACH_ENGINE
def test_a_worker_logs_no_password_at_start_or_on_reconnect(
    settings: Settings, repo: Repository, sim: SimServer, tmp_path: Path
) -> None:
    broker = PasswordRedis(tmp_path / "redis", REDIS_SECRET)
    broker.start()
    try:
        secret = settings.model_copy(
            update={
                "broker_url": broker.url,
                "database_url": with_query_password(str(settings.database_url), PG_SECRET),
            }
        )
        env = worker_env(secret, [{"name": "sim", "url": sim.url}])
        log = tmp_path / "worker.log"
        with worker_process(env, log, "--concurrency", "4") as process:
            wait_for(lambda: process.pid in live_pids(secret), what="heartbeat", log=log)
            assert not [c for c in command_lines() if REDIS_SECRET in c or PG_SECRET in c]
            enqueue_file(secret, write_jsonl(tmp_path / "rows.jsonl", sample_rows(8)))
            assert wait_settled(repo, timeout_s=60)["done"] == 8
            broker.stop()  # the worker loses its broker and keeps trying to reconnect
            time.sleep(3)
            broker.start()
            wait_for(lambda: process.pid in live_pids(secret), what="heartbeat again", log=log)
    finally:
        broker.stop()
    text = log.read_text()
    if settings.worker_engine == "celery":
        assert "Transport://:**@127.0.0.1" in text  # Celery names its broker, password masked
        assert "Cannot connect to" in text  # the reconnect was logged, the URL in it masked
    else:
        assert "Redis unreachable" in text and "Redis back" in text  # the reconnect, logged
    assert REDIS_SECRET not in text and PG_SECRET not in text


def test_up_shows_no_password_anywhere(settings: Settings, tmp_path: Path) -> None:
    broker = PasswordRedis(tmp_path / "redis", REDIS_SECRET)
    broker.start()
    database = with_query_password(str(settings.database_url), PG_SECRET)
    data_dir = tmp_path / "stack"
    port = str(free_port())
    base = {k: v for k, v in os.environ.items() if not k.startswith("EAGLEGEN_")}
    up = [sys.executable, "-m", "eaglegen", "up", "--data-dir", str(data_dir)]
    try:
        shown = []
        for flags in (["--flower-port", port, "--json"], []):
            result = subprocess.run(
                [*up, *flags],
                env={**base, "EAGLEGEN_DATABASE_URL": database, "EAGLEGEN_BROKER_URL": broker.url},
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            shown.append(result.stdout + result.stderr)
            if flags:
                assert result.returncode == 0, result.stderr
                document = json.loads(result.stdout)
                assert document["broker_url"] == redact(broker.url)
                assert document["database_url"].endswith("password=***")
                flower = int(json.loads((data_dir / "stack.json").read_text())["flower_pid"])
                cmdline = Path(f"/proc/{flower}/cmdline").read_bytes().decode()
                assert "flower" in cmdline and REDIS_SECRET not in cmdline
                assert (data_dir / "stack.json").stat().st_mode & 0o777 == 0o600
                assert data_dir.stat().st_mode & 0o777 == 0o700
            else:  # a second `up` while the first is up: it keeps what runs, still no password
                assert result.returncode == 0, result.stderr
                assert "kept running: flower" in result.stderr
        assert not [c for c in command_lines() if REDIS_SECRET in c or PG_SECRET in c]
    finally:
        down = subprocess.run(
            [sys.executable, "-m", "eaglegen", "down", "--data-dir", str(data_dir)],
            env=base,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        broker.stop()
    assert "flower" in down.stderr
    for text in shown:
        assert REDIS_SECRET not in text and PG_SECRET not in text, text
