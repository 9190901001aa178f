"""Processes as Linux's /proc shows them (the benchmarks and the tests): the tree under a
pid, a child's memory high-water mark, CPU seconds (a process's, a server's with its
children), and how to start the installed `eaglegen`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import redis
from sqlalchemy import make_url, text
from sqlalchemy.exc import SQLAlchemyError

from core.settings import is_loopback
from models.db import make_engine


def eaglegen_command() -> list[str]:
    """The installed `eaglegen` console script (else `python -m eaglegen`): what users run."""
    script = Path(sys.executable).with_name("eaglegen")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "eaglegen"]


def peak_rss_samples(process: subprocess.Popen[bytes]) -> Iterator[float]:
    """The process's RSS high-water mark (VmHWM, MB), every 50 ms until it ends."""
    while process.poll() is None:
        try:
            status = Path(f"/proc/{process.pid}/status").read_text()
        except OSError:
            return
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                yield int(line.split()[1]) / 1024
        time.sleep(0.05)


def live_children(zombies: bool = False) -> dict[int, list[int]]:
    """Every live process's children, by parent pid; ended ones not yet waited for (zombies)
    only if asked."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if zombies or fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def descendants(root: int, zombies: bool = False) -> list[int]:
    """Every live process below ``root`` (with the zombies among them, if asked)."""
    children = live_children(zombies)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _cpu_fields(pid: int) -> list[int]:
    """utime, stime, cutime, cstime of a process, in clock ticks; zeros once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return [0, 0, 0, 0]
    return [int(f) for f in fields[11:15]]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0 elsewhere)."""
    utime, stime, _, _ = _cpu_fields(pid)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy so far (Linux /proc/stat; 0 elsewhere)."""
    try:
        fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of a process and every process below it, live or ended (an ended child's
    are its own until it is waited for, a zombie, then its parent's cutime/cstime): a
    Postgres server's, its backends' included, those that came and went between two
    readings as well."""
    ticks = sum(sum(_cpu_fields(pid)) for pid in (root, *descendants(root, zombies=True)))
    return ticks / os.sysconf("SC_CLK_TCK")


def service_pids(database_url: str, broker_url: str) -> dict[str, int]:
    """The pids of the Postgres server (its postmaster) and of the Redis server by name,
    those of them that run on this machine (a loopback address or a Unix socket)."""
    pids = {}
    db = make_url(database_url)
    if _here(db.host) or _here(db.query.get("host")):
        engine = make_engine(database_url)
        try:
            with engine.connect() as conn:
                backend = int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
                # Read while the session lasts: its backend ends with it.
                stat = Path(f"/proc/{backend}/stat").read_text()
            pids["postgres"] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, SQLAlchemyError):
            pass  # not found: not shown
        finally:
            engine.dispose()
    broker = redis.Redis.from_url(broker_url)
    try:
        where = broker.connection_pool.connection_kwargs
        if _here(where.get("host")) or "path" in where:
            pids["redis"] = int(broker.info("server")["process_id"])
    except redis.RedisError:
        pass  # not found: not shown
    finally:
        broker.close()
    return pids


def _here(host: object) -> bool:
    """Whether a URL's host (None when absent) is this machine: a loopback name or a socket."""
    return isinstance(host, str) and (is_loopback(host) or host.startswith("/"))
