"""`eaglegen up` and `down` as a user runs them: a stack that lasts, restarts where it was,
and is found from any folder."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest

from core.urls import libpq_url
from eaglegen.stack import free_port

pytestmark = pytest.mark.e2e


@dataclass
class Place:
    """Where a test runs the CLI: its working folder, and its own user configuration."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config"

    @property
    def pointer(self) -> Path:
        return self.config / "eaglegen" / "stack"

    def run(
        self, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("EAGLEGEN_")}
        (cwd or self.root).mkdir(parents=True, exist_ok=True)
        return subprocess.run(
            [sys.executable, "-m", "eaglegen", *args],
            cwd=cwd or self.root,
            env={**base, "XDG_CONFIG_HOME": str(self.config), "COLUMNS": "300", **(env or {})},
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )

    def up(self, data_dir: Path, *args: str) -> dict[str, Any]:
        result = self.run("up", "--json", "--data-dir", str(data_dir), *args)
        assert result.returncode == 0, result.stderr
        document: dict[str, Any] = json.loads(result.stdout)
        document["stderr"] = result.stderr
        return document


@pytest.fixture
def place() -> Iterator[Place]:
    """A folder of its own; whatever `up` started under it is stopped afterwards.

    Not under tmp_path: each pytest session that starts makes /tmp/pytest-of-USER private
    again (0700), which, under root, would lock the Postgres server's own user out of the
    clusters of the sessions running meanwhile.
    """
    root = Path(tempfile.mkdtemp(prefix="eaglegen-stack-test-"))
    where = Place(root)
    try:
        yield where
    finally:
        for stack_file in root.glob("**/stack.json"):
            where.run("down", "--data-dir", str(stack_file.parent))
        shutil.rmtree(root, ignore_errors=True)


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


def wait_gone(pid: int) -> None:
    """Until ``pid`` is no process (a zombie awaiting its reaper counts as gone)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state == "Z":
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs")


def postmaster_pid(data_dir: Path) -> int:
    return int((data_dir / "postgres" / "postmaster.pid").read_text().split("\n", 1)[0])


def query(database_url: str, sql: str) -> Any:
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        cursor = conn.execute(sql)
        row = cursor.fetchone() if cursor.description else None
    return None if row is None else row[0]


@pytest.mark.needs("root")
def test_as_root_the_embedded_postgres_survives_its_checkpoints(place: Place) -> None:
    # Run by root, pgserver runs Postgres as its own user, which must still reach its
    # files once `up` has made the data folder private: the server re-opens
    # global/pg_control at each checkpoint (every 5 minutes; forced here).
    data_dir = place.root / "stack"
    info = place.up(data_dir, "--flower-port", str(free_port()))
    query(info["database_url"], "CHECKPOINT")
    assert query(info["database_url"], "SELECT 1") == 1  # still up, on a new connection
    log = (data_dir / "postgres" / "log").read_text()
    assert "PANIC" not in log, log
    folder = data_dir.stat()
    assert stat.S_IMODE(folder.st_mode) == 0o710  # other users: nothing; the server: pass
    status = Path(f"/proc/{postmaster_pid(data_dir)}/status").read_text().splitlines()
    server_gid = next(int(line.split()[2]) for line in status if line.startswith("Gid:"))
    assert folder.st_gid == server_gid


def test_down_then_up_keeps_the_ports_of_the_folder(place: Place) -> None:
    data_dir = place.root / "stack"
    flower = free_port()
    first = place.up(data_dir, "--flower-port", str(flower))
    assert place.run("down", "--data-dir", str(data_dir)).returncode == 0
    second = place.up(data_dir)  # no --flower-port: the recorded one
    # Workers started on the first stack find their broker where it was.
    assert second["broker_url"] == first["broker_url"]
    assert second["flower_url"] == first["flower_url"] == f"http://127.0.0.1:{flower}"
    assert second["database_url"] == first["database_url"]
    assert second["notes"] == []


def test_a_recorded_port_taken_meanwhile_is_replaced_and_said(place: Place) -> None:
    data_dir = place.root / "stack"
    first = place.up(data_dir, "--flower-port", str(free_port()))
    assert place.run("down", "--data-dir", str(data_dir)).returncode == 0
    taken = port_of(first["broker_url"])
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        second = place.up(data_dir)
    assert port_of(second["broker_url"]) != taken
    assert query(second["database_url"], "SELECT 1") == 1
    note = f"Redis: port {taken} (recorded for this folder) is taken; using port "
    assert note + str(port_of(second["broker_url"])) in second["stderr"]


def test_up_restarts_what_died_and_keeps_what_runs(place: Place) -> None:
    data_dir = place.root / "stack"
    first = place.up(data_dir, "--flower-port", str(free_port()))
    assert sorted(first["started"]) == ["flower", "postgres", "redis"]

    again = place.up(data_dir)  # everything runs: nothing to do
    assert again["started"] == [] and sorted(again["kept"]) == ["flower", "postgres", "redis"]
    assert (again["redis_pid"], again["flower_pid"]) == (first["redis_pid"], first["flower_pid"])

    os.kill(first["redis_pid"], signal.SIGKILL)
    postgres = postmaster_pid(data_dir)
    os.kill(postgres, signal.SIGQUIT)  # an immediate shutdown, as after a crash
    wait_gone(first["redis_pid"])
    wait_gone(postgres)
    repaired = place.up(data_dir)
    assert sorted(repaired["started"]) == ["postgres", "redis"]
    assert repaired["kept"] == ["flower"] and repaired["flower_pid"] == first["flower_pid"]
    assert repaired["broker_url"] == first["broker_url"]  # the same port
    assert query(repaired["database_url"], "SELECT count(*) FROM alembic_version") == 1

    stopped = place.run("down", "--data-dir", str(data_dir))
    assert "stopped: flower, redis, postgres" in stopped.stderr, stopped.stderr


def test_up_refuses_to_swap_the_services_of_a_running_stack(place: Place) -> None:
    data_dir = place.root / "stack"
    place.up(data_dir, "--flower-port", str(free_port()))
    result = place.run(
        "up",
        "--data-dir",
        str(data_dir),
        "--broker-url",
        f"redis://127.0.0.1:{free_port()}/0",
    )
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: the stack under {data_dir} runs an embedded Redis")
    assert len(result.stderr.strip().splitlines()) == 1


def test_commands_find_the_stack_from_other_folders(place: Place) -> None:
    data_dir = place.root / "project" / "stack"
    elsewhere = place.root / "elsewhere"
    place.up(data_dir, "--flower-port", str(free_port()))
    assert place.pointer.read_text().strip() == str(data_dir)

    # No --data-dir, no EAGLEGEN_DATA_DIR, no ./.eaglegen: found through the pointer.
    migrated = place.run("db", "upgrade", cwd=elsewhere)
    assert migrated.returncode == 0, migrated.stderr
    assert not (elsewhere / ".eaglegen").exists()  # and no second stack was started

    stopped = place.run("down", cwd=elsewhere)
    assert f"stopped: flower, redis, postgres (the stack under {data_dir})" in stopped.stderr
    assert not place.pointer.exists()

    # Nothing to find now: one line saying where the command looked.
    missing = place.run("db", "upgrade", cwd=elsewhere)
    assert missing.returncode == 2
    assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert "run `eaglegen up`" in missing.stderr
    assert f"looked in {elsewhere / '.eaglegen'} and for {place.pointer}" in missing.stderr

    given = place.root / "nothing-here"
    named = place.run("db", "upgrade", env={"EAGLEGEN_DATA_DIR": str(given)})
    assert named.returncode == 2
    assert f"no stack of `eaglegen up` found: looked in {given}" in named.stderr


def test_a_folder_with_its_own_stack_wins_over_the_pointer(place: Place) -> None:
    first = place.root / "first" / ".eaglegen"
    second = place.root / "second" / ".eaglegen"
    place.up(first, "--flower-port", str(free_port()))
    place.up(second, "--flower-port", str(free_port()))  # the pointer names the latest
    assert place.pointer.read_text().strip() == str(second)
    stopped = place.run("down", cwd=first.parent)  # ./.eaglegen first
    assert f"(the stack under {first})" in stopped.stderr, stopped.stderr
    assert place.pointer.read_text().strip() == str(second)  # another stack's: kept


def test_a_flower_port_given_but_taken_is_refused_before_anything_starts(place: Place) -> None:
    data_dir = place.root / "stack"
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        result = place.run("up", "--data-dir", str(data_dir), "--flower-port", str(port))
    assert result.returncode == 2
    assert (
        result.stderr == f"error: Flower's port {port} on 127.0.0.1 is taken by another program\n"
    )
    assert not (data_dir / "postgres").exists()  # nothing was started
