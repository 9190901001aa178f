"""Processes as Linux's /proc shows them (the benchmarks and the tests): the tree under a
pid, a child's memory high-water mark, and how to start the installed `eaglegen`."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path


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


def live_children() -> dict[int, list[int]]:
    """Every live (not zombie) process's children, by parent pid."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def descendants(root: int) -> list[int]:
    """Every live process below ``root``."""
    children = live_children()
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
